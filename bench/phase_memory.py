"""Memory held against memory used: each phase of the demo's Phase-2 run, in this process, with and without trimming.

Runs the phases of the demo's report (`Phase2Run` with the demo's parameters: pools, v_hack and the in-sample read,
the on-policy row, the arms, verify, the entropy probe) in this process and prints, per phase, its wall and CPU
seconds, its peak RSS (psutil, sampled every 0.2 s) and the RSS it ends at. `Phase2Run` hands each phase's freed
memory back to the OS as it ends (`utils.trim_memory`); `--no-trim` turns that off and prints the RSS before and after
one explicit trim instead — the difference is memory glibc's allocator held but no tensor used. The allocator's own
settings come from the environment (e.g. `MALLOC_MMAP_THRESHOLD_=262144`: every freed block above 256 kB goes
straight back, at the cost of a page fault each time it is allocated again); the script prints the ones set.

`--detail MODULE:NAME` (repeatable; e.g. `probes:first_order_delta_entropy`, `probes:DeltaEntropyIS.noise_floor`)
wraps that attribute of `entropy_grpo.MODULE` and prints a line per call — its seconds, its peak RSS and the RSS it
ends at — so a phase's peak can be pinned on the step that makes it. Patch a function where it is looked up (the
module that imported it by name).

    python bench/phase_memory.py [--out /tmp/phase_memory] [--no-trim] [--until entropy_probe] [-p NAME=VALUE ...]
                                 [--detail MODULE:NAME ...]
"""
import argparse, ast, functools, importlib, os, sys, tempfile, threading, time

import psutil

PHASES = ("pools", "v_hack", "on_policy", "arms", "verify", "entropy_probe")


def _value(text:str):
    "A -p value: a Python literal, else the text itself (model=tiny)."
    try: return ast.literal_eval(text)
    except (ValueError, SyntaxError): return text


def watch(target:str, me, frames:list):
    "Wrap entropy_grpo.MODULE's NAME (a dotted attribute path) to print each call's seconds, peak RSS and end RSS."
    mod, path = target.split(":")
    *owner_path, name = path.split(".")
    owner = functools.reduce(getattr, owner_path, importlib.import_module(f"entropy_grpo.{mod}"))
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapped(*args, **kw):
        frame, t = [me.memory_info().rss], time.perf_counter()
        frames.append(frame)
        try: return fn(*args, **kw)
        finally:
            frames[:] = [f for f in frames if f is not frame]      # by identity: equal peaks are other frames
            end = me.memory_info().rss
            print(f"|   {path} | {time.perf_counter() - t:.0f} | | {max(frame[0], end) / 1e9:.2f} | {end / 1e9:.2f} |",
                  flush=True)

    setattr(owner, name, wrapped)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="the run's out_dir (default: a fresh temporary one)")
    ap.add_argument("--no-trim", action="store_true", help="no trim at phase ends; report RSS before/after one")
    ap.add_argument("--until", choices=PHASES, default=PHASES[-1], help="the last phase to run")
    ap.add_argument("-p", action="append", default=[], metavar="NAME=VALUE", help="a Phase2Config override")
    ap.add_argument("--detail", action="append", default=[], metavar="MODULE:NAME", help="a function to time per call")
    a = ap.parse_args()
    from entropy_grpo import phase2_run
    from entropy_grpo.cli import DEMO_PARAMETERS
    from entropy_grpo.utils import trim_memory
    if a.no_trim: phase2_run.trim_memory = lambda: None
    user = {k: _value(v) for k, v in (s.split("=", 1) for s in a.p)}
    out = a.out or tempfile.mkdtemp(prefix="phase_memory-")
    cfg = phase2_run.Phase2Config(**{**DEMO_PARAMETERS, **user, "out_dir": out})
    me, peak = psutil.Process(), [0]
    frames = [peak]                                   # [peak] of the phase and of every watched call in progress
    for target in a.detail: watch(target, me, frames)

    def sample():
        while True:
            rss = me.memory_info().rss
            for f in list(frames): f[0] = max(f[0], rss)
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    print(f"# {len(os.sched_getaffinity(0))} CPUs, threads {os.environ.get('OMP_NUM_THREADS', 'default')}, "
          f"allocator settings {env or 'glibc defaults'}, trim at phase ends: {not a.no_trim}\n")
    extra = (" after one trim GB |", "---|") if a.no_trim else ("", "")
    print("| phase | wall s | CPU s | peak RSS GB | RSS at its end GB |" + extra[0])
    print("|---|---|---|---|---|" + extra[1], flush=True)
    t, cpu = time.perf_counter(), sum(me.cpu_times()[:2])
    run = phase2_run.Phase2Run(cfg)
    steps = dict(pools=run.build_pools, v_hack=lambda: (run.fit_v_hack(), run.in_sample()), on_policy=run.on_policy,
                 arms=run.run_arms, verify=run.verify, entropy_probe=run.entropy_probe)
    for name in PHASES[:PHASES.index(a.until) + 1]:
        steps[name]()
        end = me.memory_info().rss
        after = f" {(trim_memory(), me.memory_info().rss)[1] / 1e9:.2f} |" if a.no_trim else ""
        now, c = time.perf_counter(), sum(me.cpu_times()[:2])
        print(f"| {name} | {now - t:.0f} | {c - cpu:.0f} | {peak[0] / 1e9:.2f} | {end / 1e9:.2f} |{after}", flush=True)
        t, cpu, peak[0] = now, c, me.memory_info().rss
    sys.exit(0)


if __name__ == "__main__":
    main()
