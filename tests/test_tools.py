"""tools/save_runs.sh, which keeps a long record alive across a replaced machine: it commits a record's pools, its
finished runs with their run.json, and a Phase-2 run's v_hack before that run is done — and nothing in flight (an
unfinished run, checkpoints, a write's temporary), nothing else staged riding along."""
import json, shutil, subprocess
from pathlib import Path

from entropy_grpo.experiments import repo_root

SCRIPT = repo_root() / "tools" / "save_runs.sh"


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _run(d:Path, state:str, files=("metrics.json", "log.jsonl")):
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps(dict(state=state), indent=1))
    for f in files: (d / f).write_text("{}")


def test_save_runs_commits_what_is_finished_and_nothing_in_flight(tmp_path):
    repo, bed = tmp_path / "main", tmp_path / "bed" / "runs" / "rec"
    repo.mkdir()
    _git(repo, "init", "-q"); _git(repo, "config", "user.email", "t@t"); _git(repo, "config", "user.name", "t")
    shutil.copy(repo_root() / ".gitignore", repo / ".gitignore")          # the project's rules: pools, run.json ignored
    (repo / "code.py").write_text("x = 1\n")
    _git(repo, "add", "-A"); _git(repo, "commit", "-qm", "init")
    (bed / "pools" / "A").mkdir(parents=True)
    for f in ("pool.json", "step_000.jsonl.gz", ".step_001.jsonl.gz.ab12cd34.tmp"): (bed / "pools" / "A" / f).write_text("")
    _run(bed / "block1" / "arms" / "1000-vanilla", "ok")
    (bed / "block1" / "arms" / "1000-vanilla" / "checkpoints").mkdir()
    (bed / "block1" / "arms" / "1000-vanilla" / "checkpoints" / "step_4.pt").write_text("")
    _run(bed / "block1" / "arms" / "1000-projected", "running")
    _run(bed / "block1" / "A-phase2", "running", files=("v_hack.safetensors", "report.partial.ipynb"))
    (repo / "code.py").write_text("x = 2\n"); _git(repo, "add", "code.py")            # staged: must not ride along
    subprocess.run(["bash", str(SCRIPT), str(tmp_path / "bed"), "rec"], cwd=repo, check=True)
    assert _git(repo, "log", "--format=%s", "-1").startswith("runs/rec: finished files so far")
    files = set(_git(repo, "show", "--name-only", "--format=", "HEAD").split())
    assert files == {"runs/rec/pools/A/pool.json", "runs/rec/pools/A/step_000.jsonl.gz",
                     "runs/rec/block1/arms/1000-vanilla/run.json", "runs/rec/block1/arms/1000-vanilla/metrics.json",
                     "runs/rec/block1/arms/1000-vanilla/log.jsonl", "runs/rec/block1/A-phase2/v_hack.safetensors"}
    assert _git(repo, "diff", "--cached", "--name-only").split() == ["code.py"]      # still staged, not committed
    subprocess.run(["bash", str(SCRIPT), str(tmp_path / "bed"), "rec"], cwd=repo, check=True)
    assert len(_git(repo, "log", "--format=%s").splitlines()) == 2                    # nothing new: no commit
