"""Kill a tiny sweep at random points and restart it, until at least `--kills` kills: Ctrl-C (SIGINT to its process
group, as a terminal does), SIGKILL of the group, SIGKILL of the parent alone (its job runs on). Each cycle starts
from an empty directory, is killed a few times, then runs to the end; every run must then match a clean run.

    python tests/kill_sweep.py --kills 30          # prints the counts as JSON; exit 1 if any check failed

Checked after every kill: no run is ok without a complete report, no step is in a log twice, no run has two ok LOG
lines. Checked at the end of each cycle: the sweep finished every run, each run's results are the clean run's
numbers, each log holds every step once, the summary counts every run once."""
import argparse, json, os, random, signal, subprocess, sys, tempfile, time
from collections import Counter
from pathlib import Path

from entropy_grpo.reports import _report_problem, lock_holder, read_metrics, run_status
from terminal import terminal_popen

CLI = str(Path(sys.executable).parent / "entropy-grpo")
MODES = ("SIGINT group", "SIGKILL group", "SIGKILL parent")


def sweep(out:Path, a) -> subprocess.Popen:
    args = [CLI, "sweep", "--out", str(out), "--seeds", *map(str, a.seeds), "--arms", *a.arms, "--steps", str(a.steps),
            "--max-parallel", str(a.max_parallel), "--force", "-p", "preset='smoke'"]
    return terminal_popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def runs(out:Path, a) -> list[Path]:
    return [out / f"{s}-{arm}" for arm in a.arms for s in a.seeds]


def log_steps(run:Path) -> list[int]:
    p = run / "log.jsonl"
    return [json.loads(l)["step"] for l in p.read_text().splitlines()] if p.exists() else []


def ok_lines(out:Path, run:Path) -> int:
    log = out.parent / "LOG.md"
    return sum(f"| {run.name} | ok |" in l for l in log.read_text().splitlines()) if log.exists() else 0


def invariants(out:Path, a, bad:Counter):
    "What must hold whenever the sweep is not running (runs a killed parent's job still holds are skipped)."
    for run in runs(out, a):
        if lock_holder(run): continue
        if run_status(run) == "done" and _report_problem(run): bad["ok without a complete report"] += 1
        steps = log_steps(run)
        if len(steps) != len(set(steps)): bad["a step logged twice"] += 1
        if ok_lines(out, run) > 1: bad["two ok LOG lines"] += 1


def results(run:Path) -> dict:
    return (read_metrics(run) or {}).get("results", {})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=30); ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=4); ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--arms", nargs="+", default=["vanilla"]); ap.add_argument("--max-parallel", type=int, default=2)
    ap.add_argument("--per-cycle", type=int, default=4, help="kills before a cycle runs to its end")
    ap.add_argument("--dir", default=None, help="where the sweeps go (default: a new temporary directory)")
    a = ap.parse_args()
    rng, root = random.Random(a.seed), Path(a.dir or tempfile.mkdtemp(prefix="kill_sweep-"))
    t = time.time()
    clean = sweep(root / "clean" / "p3", a)
    assert clean.wait() == 0, clean.communicate()
    span, ref = time.time() - t, {r.name: results(r) for r in runs(root / "clean" / "p3", a)}
    counts, bad, cycle = Counter(), Counter(), 0
    while counts["kills"] < a.kills:
        cycle += 1
        out = root / f"cycle{cycle}" / "p3"
        for _ in range(a.per_cycle):
            proc = sweep(out, a)
            time.sleep(rng.uniform(0.5, span))
            if proc.poll() is not None:
                proc.communicate(); counts["finished before the kill"] += 1; continue
            mode = rng.choice(MODES)
            if mode == "SIGINT group": os.killpg(proc.pid, signal.SIGINT)
            elif mode == "SIGKILL group": os.killpg(proc.pid, signal.SIGKILL)
            else: os.kill(proc.pid, signal.SIGKILL)
            out_text, err = proc.communicate()
            rc = proc.returncode
            counts["orphans found and waited for"] += out_text.count("a job of an earlier sweep")
            counts["kills"] += 1; counts[mode] += 1
            counts["tracebacks on stderr"] += "Traceback" in err
            if mode == "SIGINT group": counts[f"SIGINT exit {rc}"] += 1
            invariants(out, a, bad)
        last = sweep(out, a)
        out_text, err = last.communicate()
        rc = last.returncode
        counts["orphans found and waited for"] += out_text.count("a job of an earlier sweep")
        if rc != 0: bad[f"final restart exit {rc}"] += 1
        invariants(out, a, bad)
        for run in runs(out, a):
            if run_status(run) != "done": bad["a run not finished"] += 1
            elif results(run) != ref[run.name]: bad["results differ from the clean run"] += 1
            if log_steps(run) != list(range(a.steps)): bad["log steps not 0..steps-1 once"] += 1
            if ok_lines(out, run) != 1: bad["not exactly one ok LOG line"] += 1
        if json.loads((out / "summary.json").read_text())["n_runs"] != len(runs(out, a)): bad["summary count"] += 1
        counts["cycles"] += 1; counts["runs checked"] += len(runs(out, a))
    print(json.dumps(dict(dir=str(root), clean_seconds=round(span, 1), counts=dict(counts), failures=dict(bad)),
                     indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
