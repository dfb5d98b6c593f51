"""experiments: the Phase-3 cost ceiling on synthetic hack-rate curves; sweeps through submitit's LocalExecutor
(killed and resumed on either engine, failing jobs, the ceiling, refused directories, bad input) and the CLI."""
import json, os, signal, subprocess, sys, time
from pathlib import Path

import pytest

from entropy_grpo.cli import main
from entropy_grpo.experiments import (_sweep_spec, check_sweep_spec, hack_rate_separation, make_executor, run_status,
                                      run_sweep)
from entropy_grpo.reports import dir_lock, read_state
from terminal import terminal_popen

CLI = str(Path(sys.executable).parent / "entropy-grpo")

SEEDS, ARMS, STEPS = [0, 1], ["vanilla", "projected"], 2


def log_lines(root, run):
    log = root / "LOG.md"
    return [l for l in log.read_text().splitlines() if f"| {run} |" in l] if log.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["package", "trl"])
def test_killed_sweep_resumes_without_redoing_or_double_counting(labelled, tmp_path, engine):
    if engine == "trl": pytest.importorskip("trl")
    params = dict(preset="smoke", teacher_pool=labelled[0], base_pool=labelled[1], engine=engine)
    args = dict(template="train", seeds=SEEDS, arms=ARMS, steps=STEPS, exp="p3", out_root=str(tmp_path), params=params,
                force=True)
    exp = tmp_path / "p3"
    code = f"from entropy_grpo.experiments import run_sweep; run_sweep(**{args!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 900
        while not log_lines(tmp_path, "0-vanilla"):                # the job's last act: its LOG line
            assert proc.poll() is None, "the sweep ended before its first run finished"
            assert time.time() < deadline, "the first run did not finish in 15 minutes"
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)                      # the sweep, its submitit job and the job's kernel
        proc.wait()
    done = sorted(r for r in ("0-vanilla", "1-vanilla", "0-projected", "1-projected") if run_status(exp / r) == "done")
    assert "0-vanilla" in done and len(done) < 4
    mtimes = {r: (exp / r / "report.ipynb").stat().st_mtime_ns for r in done}

    out = run_sweep(**args)
    assert sorted(out["skipped"]) == done
    assert sorted(x["run"] for x in out["ran"]) == sorted(set(out["plan"]) - set(done))
    assert all(x["status"] == "ok" for x in out["ran"])
    assert all((exp / r / "report.ipynb").stat().st_mtime_ns == t for r, t in mtimes.items())
    for r in out["plan"]: assert sum("| ok |" in l for l in log_lines(tmp_path, r)) == 1, log_lines(tmp_path, r)
    s = out["summary"]
    assert s["n_runs"] == 4 and sorted(s["runs"]) == sorted(out["plan"])
    assert {a["arm"]: a["n_seeds"] for a in s["arms"]} == {"vanilla": 2, "projected": 2}
    assert (exp / "summary.md").exists() and (exp / "summary.png").exists()

    again = run_sweep(**args)
    assert again["ran"] == [] and sorted(again["skipped"]) == sorted(out["plan"]) and again["summary"]["n_runs"] == 4


def test_cost_ceiling_separation():
    rising = [[0.0] * 5 + [0.1] * 10 + [0.5] * 5, [0.05] * 15 + [0.4] * 5, [0.0] * 15 + [0.6] * 5]
    flat = [[0.02] * 20, [0.03] * 20, [0.01] * 19 + [0.05]]
    assert hack_rate_separation(rising)["separated"]
    assert not hack_rate_separation(flat)["separated"]
    noisy = [[0.0] * 15 + [0.9] * 5, [0.3] * 15 + [0.0] * 5, [0.0] * 20]       # mean rise > 0.1 but not > 2 SE
    assert not hack_rate_separation(noisy)["separated"]
    with pytest.raises(ValueError, match="no hack-rate curves"):
        hack_rate_separation([])


class Scripted:
    "A stand-in executor whose job `name` ends at its `polls[name]`-th `done()`; it records each start and end."
    def __init__(self, folder, polls:dict, capacity=None):
        self.folder, self.polls, self.events = folder, polls, []
        if capacity: self.capacity = capacity

    def submit(self, fn, template, out_dir, *rest):
        name, events, left = Path(out_dir).name, self.events, [self.polls[Path(out_dir).name]]
        events.append(("start", name))

        class Job:
            def done(self):
                left[0] -= 1
                if left[0] == 0: events.append(("end", name))
                return left[0] <= 0

            def result(self): return dict(status="ok")
        return Job()


def test_a_sweep_starts_the_next_job_as_soon_as_one_ends(tmp_path):
    "max_parallel 2: C starts when the short B ends, while the long A still runs (no waiting for a whole batch); an"
    " executor that runs one job at a time (a local machine's one GPU) gets them one by one."
    from entropy_grpo.experiments import _run_jobs
    calls = [("train", tmp_path / n, {}, "p3", tmp_path / "LOG.md") for n in "ABC"]
    ex, result = Scripted(tmp_path, dict(A=4, B=1, C=1)), dict(ran=[])
    assert _run_jobs(ex, calls, 2, result)
    assert ex.events == [("start", "A"), ("start", "B"), ("end", "B"), ("start", "C"), ("end", "C"), ("end", "A")]
    assert [x["run"] for x in result["ran"]] == ["B", "C", "A"]
    ex, result = Scripted(tmp_path, dict(A=2, B=1, C=1), capacity=1), dict(ran=[])
    assert _run_jobs(ex, calls, 2, result)
    assert ex.events == [("start", "A"), ("end", "A"), ("start", "B"), ("end", "B"), ("start", "C"), ("end", "C")]


def test_failing_job_leaves_report_and_log_line_and_the_sweep_goes_on(tmp_path):
    "The projected arm without pools fails inside its notebook; the vanilla run after it still runs."
    out = run_sweep("train", [0], ["projected", "vanilla"], 1, exp="p3", out_root=tmp_path, params=dict(preset="smoke"),
                    force=True)
    assert [(x["run"], x["status"]) for x in out["ran"]] == [("0-projected", "failed"), ("0-vanilla", "ok")]
    failed = tmp_path / "p3" / "0-projected"
    m = json.loads((failed / "metrics.json").read_text())
    assert m["status"] == "failed"
    assert "give v_hack (a Phase-2 run's v_hack.safetensors), or teacher_pool and base_pool" in m["error"]
    assert "or teacher_pool and base_pool" in (failed / "report.ipynb").read_text()
    [line] = log_lines(tmp_path, "0-projected")
    assert "| failed |" in line and "ValueError" in line
    assert out["summary"]["n_runs"] == 1 and run_status(failed) == "failed"


def test_a_job_that_imports_another_checkout_refuses_before_its_run(tmp_path, monkeypatch):
    "A sweep started in a folder that holds another copy of the package: its job process (`python -m`, that folder"
    " first on its path) imports the copy and refuses before the run starts, naming both copies; no record is left."
    import shutil, entropy_grpo
    shutil.copytree(Path(entropy_grpo.__file__).parent, tmp_path / "other" / "entropy_grpo")
    monkeypatch.chdir(tmp_path / "other")
    out = run_sweep("train", [0], ["vanilla"], 1, exp="p3", out_root=tmp_path / "runs", params=dict(preset="smoke"),
                    force=True)
    [ran] = out["ran"]
    assert ran["status"] == "failed" and f"imported entropy_grpo from {tmp_path / 'other' / 'entropy_grpo'}" in \
        ran["error"], ran
    assert not (tmp_path / "runs" / "p3" / "0-vanilla" / "metrics.json").exists()


def test_cost_ceiling_stops_the_other_arms_without_force(tmp_path):
    "No finished first-arm run means no separation: the other arm's runs are not launched."
    out = run_sweep("train", [0], ["projected", "vanilla"], 1, exp="p3", out_root=tmp_path, params=dict(preset="smoke"))
    assert [x["run"] for x in out["ran"]] == ["0-projected"] and out["stopped_by_ceiling"] == ["0-vanilla"]
    assert not (tmp_path / "p3" / "0-vanilla").exists() and (tmp_path / "p3" / "ceiling.json").exists()


def test_sweep_refuses_a_directory_made_with_other_parameters(tmp_path):
    check_sweep_spec(tmp_path / "p3", _sweep_spec("train", 2, dict(preset="smoke", k=1)))
    msg = r"other parameters \(params.k: existing 1 vs requested 2; steps: existing 2 vs requested 3\)"
    with pytest.raises(ValueError, match=msg):
        run_sweep("train", [0], ["vanilla"], 3, exp="p3", out_root=tmp_path, params=dict(preset="smoke", k=2))
    assert sorted(p.name for p in (tmp_path / "p3").iterdir()) == [".lock", "sweep.json"]


def test_bad_sweep_input(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))                    # no sbatch anywhere
    with pytest.raises(RuntimeError, match="executor='slurm' but no Slurm was found"):
        run_sweep("train", [0], ["vanilla"], 1, exp="p3", out_root=tmp_path, executor="slurm")
    assert not (tmp_path / "p3" / "0-vanilla").exists()
    with pytest.raises(ValueError, match="executor='ssh': expected 'local' or 'slurm'"): make_executor("ssh", tmp_path)
    with pytest.raises(ValueError, match="unknown parameter 'seeds' for train \\(did you mean 'seed'\\?\\)"):
        run_sweep("train", [0], ["vanilla"], 1, out_root=tmp_path, params=dict(seeds=3))
    with pytest.raises(ValueError, match="steps=0: expected >= 1"):
        run_sweep("train", [0], ["vanilla"], 0, out_root=tmp_path)


def test_cli_help_and_dry_run(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e: main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert all(c in text for c in ("demo", "probe", "sweep", "report", "pools"))
    with pytest.raises(SystemExit): main(["sweep", "--help"])
    assert "--dry-run" in capsys.readouterr().out
    assert main(["sweep", "--exp", "p3", "--seeds", "0", "1", "--arms", "vanilla", "--steps", "2", "--dry-run",
                 "-p", "preset='smoke'"]) == 0
    assert "sweep p3: 2 runs, 0 done, 2 to run: ['0-vanilla', '1-vanilla']" in capsys.readouterr().out
    assert main(["probe", "-p", "preset"]) == 2
    assert capsys.readouterr().err == "entropy-grpo probe: -p 'preset': expected name=value\n"


def test_a_second_sweep_on_a_directory_is_refused_naming_the_first(tmp_path, capsys):
    "Two sweeps on one directory ran both jobs twice; the second is now refused before any work."
    with dir_lock(tmp_path / "p3", "sweep directory"):
        with pytest.raises(RuntimeError, match=f"sweep directory .*p3 is in use by pid {os.getpid()} on "):
            run_sweep("train", [0], ["vanilla"], 1, exp="p3", out_root=tmp_path, params=dict(preset="smoke"))
        assert main(["sweep", "--out", str(tmp_path / "p3"), "--seeds", "0", "--arms", "vanilla", "--steps", "1",
                     "-p", "preset='smoke'"]) == 2
    assert f"is in use by pid {os.getpid()}" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "p3").iterdir()) == [".lock"]


@pytest.mark.parametrize("gpus", ["", "0"])
def test_a_sweep_with_a_failed_run_exits_non_zero_and_logs_beside_its_directory(tmp_path, capsys, monkeypatch, gpus):
    """A projected arm without pools fails in its notebook: exit 1; --out puts the runs and the LOG where it says.
    With a visible GPU ("0": the per-GPU executor; here the job's torch finds no device and runs on CPU) the same."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpus)
    out = tmp_path / "elsewhere" / "p3"
    assert main(["sweep", "--out", str(out), "--seeds", "0", "--arms", "projected", "--steps", "1",
                 "-p", "preset='smoke'", "--force"]) == 1
    [line] = (tmp_path / "elsewhere" / "LOG.md").read_text().splitlines()
    assert "| p3 | 0-projected | failed |" in line and run_status(out / "0-projected") == "failed"
    [ran] = json.loads(capsys.readouterr().out)["ran"]                    # the run's error, in one line
    assert (ran["run"], ran["status"]) == ("0-projected", "failed") and "or teacher_pool and base_pool" in ran["error"]


def sweep_in_background(tmp_path, steps=2):
    "A one-run sweep (CLI) in its own process group; returns (process, run directory) once the run is running."
    out = tmp_path / "p3"
    args = [CLI, "sweep", "--out", str(out), "--seeds", "0", "--arms", "vanilla", "--steps", str(steps), "-p",
            "preset='smoke'"]
    proc = terminal_popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while (read_state(out / "0-vanilla") or {}).get("state") != "running":       # a state, not a sleep
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)
    return proc, out


def test_ctrl_c_a_sweep_records_the_interrupt_in_one_line_and_a_restart_finishes(tmp_path):
    proc, out = sweep_in_background(tmp_path, steps=6)
    os.killpg(proc.pid, signal.SIGINT)                           # as a terminal does: the sweep and its job
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (stdout, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, err
    assert run_status(out / "0-vanilla") == "interrupted"
    assert "| 0-vanilla | interrupted |" in (tmp_path / "LOG.md").read_text()
    res = run_sweep("train", [0], ["vanilla"], 6, exp="p3", out_root=tmp_path, params=dict(preset="smoke"))
    assert res["ran"] == [{"run": "0-vanilla", "status": "ok"}]
    steps = [json.loads(l)["step"] for l in (out / "0-vanilla" / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(6))                               # resumed, no step twice


def test_jobs_of_a_killed_sweep_are_found_and_waited_for_not_run_twice(tmp_path):
    proc, out = sweep_in_background(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)                            # the parent only: its job runs on
    proc.wait()
    res = run_sweep("train", [0], ["vanilla"], 2, exp="p3", out_root=tmp_path, params=dict(preset="smoke"))
    assert res["orphans"] and res["orphans"][0].startswith("0-vanilla (pid ")
    assert res["ran"] == [] and res["skipped"] == ["0-vanilla"] and run_status(out / "0-vanilla") == "done"
    assert [l.split(" | ")[3] for l in (tmp_path / "LOG.md").read_text().splitlines()] == ["ok"]
