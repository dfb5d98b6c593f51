"""Where the demo's memory goes: resident memory of `entropy-grpo demo` per phase of its report.

Runs the whole command the way a user does (`entropy-grpo demo --out DIR`) as a child process, samples the resident
set size of its whole process tree (the papermill kernel included) every `--every` seconds with psutil, and reads
the phase from the command's own progress lines ("[k/9] name ..."). Printed: a table of each phase's wall time, its
peak RSS and the RSS it ends at, and the whole run's peak. Sampling misses spikes shorter than `--every`; the run's
true peak is `/usr/bin/time -v`'s "Maximum resident set size" (of the largest single process).

    python bench/demo_memory.py [--out /tmp/demo_memory] [--every 0.5] [--threads 1]
"""
import argparse, os, re, subprocess, sys, tempfile, threading, time
from pathlib import Path

import psutil

PHASE = re.compile(r"\[(\d+)/(\d+)\] (.+?) \.\.\.")


def tree_rss(p:psutil.Process) -> int:
    "Resident bytes of p and all its descendants (0 for any that ended meanwhile)."
    total = 0
    for q in [p, *p.children(recursive=True)]:
        try: total += q.memory_info().rss
        except psutil.Error: pass
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="the demo's run directory (default: a fresh temporary one)")
    ap.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--threads", type=int, default=1, help="OMP/MKL threads of the demo")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="demo_memory-")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    exe = Path(sys.executable).with_name("entropy-grpo")
    proc = subprocess.Popen([str(exe), "demo", "--out", out], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    phase, samples, t0 = ["start"], [], time.time()

    def sample():
        p = psutil.Process(proc.pid)
        while proc.poll() is None:
            samples.append((time.time() - t0, phase[0], tree_rss(p)))
            time.sleep(a.every)

    threading.Thread(target=sample, daemon=True).start()
    text = ""                                # a phase's line ends only when it does: read what is there
    while chunk := os.read(proc.stdout.fileno(), 4096):
        sys.stdout.write(chunk.decode(errors="replace")); sys.stdout.flush()
        text = (text + chunk.decode(errors="replace"))[-4096:]
        for m in PHASE.finditer(text): phase[0] = f"[{m[1]}/{m[2]}] {m[3]}"
    proc.wait()
    rows, order = {}, []
    for t, ph, rss in samples:
        if ph not in rows: rows[ph] = dict(start=t, end=t, peak=rss, last=rss); order.append(ph)
        r = rows[ph]
        r.update(end=t, peak=max(r["peak"], rss), last=rss)
    print(f"\nentropy-grpo demo --out {out}: exit {proc.returncode}, {a.threads} thread(s), sampled every {a.every} s, "
          f"psutil RSS of the process tree\n")
    print("| phase | wall s | peak RSS GB | RSS at its end GB |\n|---|---|---|---|")
    for ph in order:
        r = rows[ph]
        print(f"| {ph} | {r['end'] - r['start']:.0f} | {r['peak'] / 1e9:.2f} | {r['last'] / 1e9:.2f} |")
    print(f"| whole run | {samples[-1][0]:.0f} | {max(s[2] for s in samples) / 1e9:.2f} | |" if samples else "")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
