#!/usr/bin/env bash
# Commit what the hack bed has finished so far, so that a replaced machine loses only the runs in flight.
# Run from this checkout with the bed's worktree (where tools/hackbed_block.sh runs) as the argument. It copies the
# pools, each setting's Phase-2 folder (its v_hack at once; the rest once the probe is done) and every finished run
# (run.json says ok, checkpoints left out) into runs/hackbed here, and commits them, run.json and the Phase-2
# v_hack tensors included (git ignores those elsewhere). Nothing is read: no metric is printed.
# To resume on a new machine: copy runs/hackbed/{pools,blockN} from here into a fresh worktree of the bed's commit
# and re-run its tools/hackbed_block.sh command (runs/hackbed/RUNNING.md); finished runs are skipped.
#   usage: tools/bed_save.sh BED_WORKTREE      e.g. tools/bed_save.sh ../bed
set -euo pipefail
src=$1/runs/hackbed; dst=runs/hackbed
ok() { grep -q '"state": "ok"' "$1/run.json" 2>/dev/null; }
copy() { tar -C "$src" -cf - --exclude=checkpoints --exclude=.lock "$1" | tar -C "$dst" -xf -; }
[ -d "$src/pools" ] && copy pools
for p in "$src"/block*/*-phase2; do
  rel=${p#"$src"/}
  if ok "$p"; then copy "$rel"
  elif [ -f "$p/v_hack.safetensors" ]; then mkdir -p "$dst/$rel"; cp -p "$p/v_hack.safetensors" "$dst/$rel/"; fi
done
for r in "$src"/block*/*/*-*/; do
  r=${r%/}; if ok "$r" && [[ $r != *-phase2 ]]; then copy "${r#"$src"/}"; fi
done
git add -f "$dst/pools" $(find "$dst"/block* \( -name run.json -o -path '*-phase2/v_hack.safetensors' \) 2>/dev/null)
git add "$dst"
git diff --cached --quiet || git commit -qm "runs/hackbed: the bed's finished files so far (pools, Phase-2 v_hack, finished runs; not read)"
