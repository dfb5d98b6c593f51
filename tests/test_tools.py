"""tools/save_runs.sh, which keeps a long record alive across a replaced machine: it commits a record's pools, its
finished runs with their run.json, a calibration's finished jobs, and a Phase-2 run's v_hack before that run is done
— and nothing in flight (an unfinished run, checkpoints, a write's temporary, a job's scratch), no other file git
ignores, nothing written by hand in the checkout under the record's folder, nothing else staged riding along; with --prune it then deletes the checkpoints of finished runs it has committed, never of a run in
flight; a committed v_hack is never replaced."""
import json, os, shutil, subprocess
from pathlib import Path

from entropy_grpo.experiments import repo_root

SCRIPT = repo_root() / "tools" / "save_runs.sh"


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _run(d:Path, state:str, files=("metrics.json", "log.jsonl")):
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps(dict(state=state), indent=1))
    for f in files: (d / f).write_text("{}")


def _repo(tmp_path) -> tuple[Path, Path]:
    "A checkout with the project's ignore rules (pools, run.json, tensors ignored) and the record's folder beside it."
    repo = tmp_path / "main"
    repo.mkdir()
    _git(repo, "init", "-q"); _git(repo, "config", "user.email", "t@t"); _git(repo, "config", "user.name", "t")
    shutil.copy(repo_root() / ".gitignore", repo / ".gitignore")
    (repo / "code.py").write_text("x = 1\n")
    _git(repo, "add", "-A"); _git(repo, "commit", "-qm", "init")
    return repo, tmp_path / "bed" / "runs" / "rec"


def test_save_runs_commits_what_is_finished_and_nothing_in_flight(tmp_path):
    repo, bed = _repo(tmp_path)
    (bed / "pools" / "A").mkdir(parents=True)
    for f in ("pool.json", "step_000.jsonl.gz", ".step_001.jsonl.gz.ab12cd34.tmp"): (bed / "pools" / "A" / f).write_text("")
    _run(bed / "block1" / "arms" / "1000-vanilla", "ok", files=("metrics.json", "log.jsonl", "v_hack.safetensors"))
    (bed / "block1" / "arms" / "1000-vanilla" / "checkpoints").mkdir()
    (bed / "block1" / "arms" / "1000-vanilla" / "checkpoints" / "step_4.pt").write_text("")
    _run(bed / "block1" / "arms" / "1000-projected", "running")
    (bed / "block1" / "arms" / "1000-projected" / "checkpoints").mkdir()
    _run(bed / "block1" / "A-phase2", "running", files=("v_hack.safetensors", "report.partial.ipynb"))
    _run(bed / "calibration", "running", files=("report.partial.ipynb",))              # a calibration block in flight
    jobs = bed / "calibration" / "phase3"
    (jobs / ".work-ab12cd34" / "signal-5001-phase3").mkdir(parents=True)                  # its scratch: never saved
    (jobs / ".work-ab12cd34" / "signal-5001" / "pools" / "base").mkdir(parents=True)      # its own pools: neither
    for f in ("jobs.json", "signal-5000.json", ".signal-5001.json.ab12cd34.tmp", ".work-ab12cd34/x.json",
              ".work-ab12cd34/signal-5001/pools/base/step_000.jsonl.gz"):
        (jobs / f).write_text("{}")
    (repo / "code.py").write_text("x = 2\n"); _git(repo, "add", "code.py")            # staged: must not ride along
    (repo / "runs" / "rec").mkdir(parents=True)
    (repo / "runs" / "rec" / "RESULT.md").write_text("a reading, written by hand")   # neither (not copied)
    subprocess.run(["bash", str(SCRIPT), str(tmp_path / "bed"), "rec"], cwd=repo, check=True)
    assert _git(repo, "log", "--format=%s", "-1").startswith("runs/rec: finished files so far")
    files = set(_git(repo, "show", "--name-only", "--format=", "HEAD").split())
    assert files == {"runs/rec/pools/A/pool.json", "runs/rec/pools/A/step_000.jsonl.gz",
                     "runs/rec/block1/arms/1000-vanilla/run.json", "runs/rec/block1/arms/1000-vanilla/metrics.json",
                     "runs/rec/block1/arms/1000-vanilla/log.jsonl", "runs/rec/block1/A-phase2/v_hack.safetensors",
                     "runs/rec/calibration/phase3/jobs.json", "runs/rec/calibration/phase3/signal-5000.json"}
    assert _git(repo, "diff", "--cached", "--name-only").split() == ["code.py"]      # still staged, not committed
    assert _git(repo, "status", "--porcelain", "runs").split() == ["??", "runs/rec/RESULT.md"]   # left as it was
    assert (bed / "block1" / "arms" / "1000-vanilla" / "checkpoints").is_dir()        # kept without --prune
    subprocess.run(["bash", str(SCRIPT), "--prune", str(tmp_path / "bed"), "rec"], cwd=repo, check=True)
    assert len(_git(repo, "log", "--format=%s").splitlines()) == 2                    # nothing new: no commit
    assert not (bed / "block1" / "arms" / "1000-vanilla" / "checkpoints").exists()    # finished and committed
    assert (bed / "block1" / "arms" / "1000-projected" / "checkpoints").is_dir()      # in flight: kept


def test_save_runs_never_replaces_the_v_hack_the_arms_projected(tmp_path):
    "A probe run again to its report (another machine: other float rounding) keeps the committed v_hack, in flight "
    "and finished; the re-run's own is committed beside it once the run is done, and a second round changes nothing."
    repo, bed = _repo(tmp_path)
    probe, rel = bed / "block1" / "A-phase2", "runs/rec/block1/A-phase2"
    _run(probe, "running", files=())
    (probe / "v_hack.safetensors").write_bytes(b"the arms' v_hack")
    save = lambda: subprocess.run(["bash", str(SCRIPT), str(tmp_path / "bed"), "rec"], cwd=repo, check=True)
    save()
    (probe / "v_hack.safetensors").write_bytes(b"the re-run's v_hack")                 # the report's run, in flight
    save()
    assert len(_git(repo, "log", "--format=%s").splitlines()) == 2                    # nothing new committed
    (probe / "run.json").write_text(json.dumps(dict(state="ok")))
    (probe / "report.ipynb").write_text("{}")
    save(); save()
    assert _git(repo, "show", f"HEAD:{rel}/v_hack.safetensors") == "the arms' v_hack"
    assert _git(repo, "show", f"HEAD:{rel}/v_hack.report.safetensors") == "the re-run's v_hack"
    assert {f"{rel}/run.json", f"{rel}/report.ipynb"} <= set(_git(repo, "ls-files", rel).split())
    assert len(_git(repo, "log", "--format=%s").splitlines()) == 3 and not _git(repo, "status", "--porcelain")
    assert (probe / "v_hack.safetensors").read_bytes() == b"the re-run's v_hack"      # the worktree's own: untouched


RESUME = repo_root() / "tools" / "resume_records.sh"


def test_resume_records_lays_the_worktrees_and_keeps_what_they_have(tmp_path):
    "tools/resume_records.sh on a fresh clone: the bed's worktrees at their frozen commits with the clone's .venv, "
    "the committed runs copied in; run again, it overwrites nothing the worktree has; one at another commit is refused; "
    "the calibration record's and the second engine block's worktrees at their commits, the calibration refused while "
    "a probe works in the bed's; a probe is refused "
    "while another record's worktree is busy."
    if subprocess.run(["git", "-C", str(repo_root()), "cat-file", "-e", "df140ec^{commit}"]).returncode:
        import pytest; pytest.skip("a shallow clone: the bed's frozen commits are not here")
    main = tmp_path / "main"
    subprocess.run(["git", "clone", "-q", str(repo_root()), str(main)], check=True)
    shutil.copy(RESUME, main / "tools")                                   # the script under test, committed or not
    run = lambda *a: subprocess.run(["bash", "tools/resume_records.sh", *a], cwd=main, capture_output=True, text=True,
                                    env=dict(os.environ, DRY_RUN="1"))
    r = run("bed", "1", "1000")
    assert r.returncode == 0, r.stderr
    assert f"cd {tmp_path}/bed && env PYTHONPATH={tmp_path}/bed PROBE_PATH={tmp_path}/bedprobe nice -n 10 " \
           "tools/hackbed_block.sh 1 1000 30" in r.stdout
    for tree, commit in (("bed", "df140ec"), ("bedprobe", "9947035")):
        assert _git(tmp_path / tree, "rev-parse", "--short=7", "HEAD").strip() == commit
        assert (tmp_path / tree / ".venv").resolve() == (main / ".venv").resolve()
    done = Path("runs/hackbed/block1/arms/1000-vanilla/run.json")
    assert (tmp_path / "bed" / done).read_bytes() == (main / done).read_bytes()
    assert (tmp_path / "bed" / "runs/hackbed/pools/A-teacher/pool.json").exists()
    (tmp_path / "bed" / done).write_text("the worktree's own")
    assert run("bed", "1", "1000").returncode == 0
    assert (tmp_path / "bed" / done).read_text() == "the worktree's own"
    _git(tmp_path / "bedprobe", "checkout", "-q", "--detach", "df140ec")
    r = run("bed", "1", "1000")
    assert r.returncode == 1 and f"{tmp_path}/bedprobe is at df140ec, not at 9947035" in r.stderr
    _git(tmp_path / "bedprobe", "checkout", "-q", "--detach", "9947035")
    assert run("probe", "1", "1000").returncode == 2
    r = run("calibration")
    assert r.returncode == 0 and f"cd {tmp_path}/calib && env PYTHONPATH={tmp_path}/calib nice -n 10 make -o setup " \
                                 "-j2 record-calibration" in r.stdout, r.stdout + r.stderr
    assert _git(tmp_path / "calib", "rev-parse", "--short=7", "HEAD").strip() == "10ec03b"
    assert (tmp_path / "calib" / "runs/calibration2/PROTOCOL.md").exists()
    r = run("engines-block2")                         # no calibration at work: two runs at a time, the frozen recipe's
    recipe = "make -o setup -s -n record-engines-smollm2-2"            # --max-parallel alone raised
    assert r.returncode == 0 and f"cd {tmp_path}/engines-b2 && env PYTHONPATH={tmp_path}/engines-b2 nice -n 10 bash " \
        f"-c {recipe} | sed 's/--max-parallel 1 /--max-parallel 2 /' | bash -e" in r.stdout, r.stdout + r.stderr
    frozen = subprocess.run(recipe.split(), cwd=tmp_path / "engines-b2", capture_output=True, text=True).stdout
    assert "--max-parallel 1 " in frozen and "sweep --out runs/engines/smollm2/trl-block2" in frozen, frozen
    assert _git(tmp_path / "engines-b2", "rev-parse", "--short=7", "HEAD").strip() == "179b172"
    assert (tmp_path / "engines-b2" / "runs/hackbed/block2/A-phase2/v_hack.safetensors").exists()
    (fake := tmp_path / "hackbed_block.sh").write_text("sleep 60\n")           # a probe at work in the bed's worktree
    probe = subprocess.Popen(["bash", str(fake), "1", "1000", "30", "probe", "A"], cwd=tmp_path / "bed")
    try:
        r = run("calibration")
        assert r.returncode == 1 and "a probe is running: it runs alone" in r.stderr
    finally: probe.kill(); probe.wait()
    (tmp_path / "engines2").mkdir()
    for busy in ("engines2", "engines-b2", "calib"):                       # a record's worktree is busy
        other = subprocess.Popen(["sleep", "60"], cwd=tmp_path / busy)
        try:
            r = run("probe", "1", "1000", "A")
            assert r.returncode == 1 and f"the record in {tmp_path}/{busy} is running: a probe runs alone" in r.stderr
        finally: other.kill(); other.wait()
    r = run("probe", "1", "1000", "A")
    assert r.returncode == 0 and "tools/hackbed_block.sh 1 1000 30 probe A" in r.stdout
