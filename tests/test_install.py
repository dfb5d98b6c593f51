"""The package as users install it: the wheel built from this checkout, installed with its `experiments` extra into a
fresh virtual environment (only what pyproject.toml declares, resolved by pip), runs `entropy-grpo probe` on the tiny
policy from a folder outside the checkout; the run is written under --out and nothing inside the installed package."""
import json, os, shutil, subprocess, sys, venv
from pathlib import Path

import pytest
import torch

from toy_tasks import labelled_pools, tiny_args

ROOT = Path(__file__).resolve().parents[1]


def run(args, **kw):
    "A command as a user runs it: no PYTHONPATH or virtual environment of ours leaking in."
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env, **kw)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def files_under(folder: Path) -> set:
    return {p.relative_to(folder) for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.slow
def test_the_wheel_in_a_fresh_environment_runs_a_probe_from_anywhere(tmp_path):
    src = tmp_path / "src"                                  # what the wheel is built from, no stale build/ folder
    for d in ("entropy_grpo", "nbs/experiments"):
        shutil.copytree(ROOT / d, src / d, ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    for f in ("pyproject.toml", "README.md"): shutil.copy(ROOT / f, src / f)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", src], timeout=300)
    [wheel] = (tmp_path / "dist").glob("entropy_grpo-*.whl")
    env = tmp_path / "env"
    venv.create(env, with_pip=True)
    py, torch_pin = env / "bin" / "python", f"torch=={torch.__version__.split('+')[0]}"   # this machine's build
    run([py, "-m", "pip", "install", "-q", torch_pin, f"{wheel}[experiments]"], timeout=900)
    where = run([py, "-c", "import entropy_grpo, importlib.util; print(entropy_grpo.__file__); "
                 "print(sorted(m for m in ('trl', 'nbdev', 'pytest') if importlib.util.find_spec(m)))"], cwd=tmp_path)
    pkg = Path(where.stdout.splitlines()[0]).parent
    assert pkg.is_relative_to(env) and where.stdout.splitlines()[1] == "[]", where.stdout   # not the checkout's
    before, elsewhere = files_under(pkg), tmp_path / "elsewhere"
    teacher, base = labelled_pools(elsewhere / "pools", steps=3, batch=4)
    args = [a.replace(str(teacher), "pools/teacher").replace(str(base), "pools/base")
            for a in tiny_args((str(teacher), str(base)))]
    r = run([env / "bin" / "entropy-grpo", "probe", "--out", "my_probe", *args], cwd=elsewhere, timeout=900)
    assert "Recommendation: " in r.stdout and "report:  my_probe/report.ipynb" in r.stdout, r.stdout
    m = json.loads((elsewhere / "my_probe" / "metrics.json").read_text())
    version = run([py, "-c", "import entropy_grpo; print(entropy_grpo.__version__)"], cwd=tmp_path).stdout.strip()
    assert m["status"] == "ok" and m["git_sha"] == f"entropy_grpo {version}", m["git_sha"]   # not the folder's git
    assert "| phase2 | my_probe | ok |" in (elsewhere / "LOG.md").read_text()
    assert files_under(pkg) == before                                      # nothing written into site-packages
    with pytest.raises(AssertionError, match="record from a source checkout"):
        run([env / "bin" / "entropy-grpo", "calibrate", "--out", "cal", "-p", "record=True"], cwd=elsewhere,
            timeout=300)

