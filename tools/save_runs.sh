#!/usr/bin/env bash
# Commit what a long record has finished so far, so that a replaced machine loses only the runs in flight.
# Run from this checkout with the record's worktree (where its command runs) and the folders under runs/ it writes.
# Copied into this checkout's runs/ and committed: every pools/ folder, every finished run (its run.json says ok;
# checkpoints left out), a calibration's finished jobs (the JSON files beside a jobs.json, never its scratch
# .work-* folders) and, from a Phase-2 run not finished yet, its v_hack.safetensors — run.json, pools and
# Phase-2 v_hack tensors included, which git ignores elsewhere. Only the files this round copied are committed:
# another file git ignores stays out, and a file written by hand under these folders, or anything else staged, is
# never committed under this script's message. Nothing is read: no metric is printed.
# A Phase-2 v_hack committed here is never replaced: it is what the record's arms projected. A probe run again to its
# report on another machine writes one that differs at float rounding; that run's own is committed beside it as
# v_hack.report.safetensors once the run is finished (never while it runs).
# To resume on a new machine: copy those folders from here into a fresh worktree of the record's commit and re-run
# its command (the folder's RUNNING.md); finished runs are skipped.
# With --prune, a finished run's checkpoints/ are then deleted in the worktree once its run.json is in a commit here
# (a finished run is never resumed, and nothing reads them): the bed's LoRA checkpoints at its frozen commit hold the
# whole model, 545 MB each, four a run.
#   usage: tools/save_runs.sh [--prune] WORKTREE RUNS_FOLDER...    e.g. tools/save_runs.sh --prune ../bed hackbed
set -euo pipefail
prune=; [ "${1:-}" = --prune ] && { prune=1; shift; }
src=$1/runs; shift
copied=$(mktemp); trap 'rm -f "$copied" "$copied".*' EXIT   # the files this round copied, one path a line
ok() { grep -q '"state": "ok"' "$1/run.json" 2>/dev/null; }
copy() {   # a folder or file under runs/, from the worktree; the files it wrote go on the list
  tar -C "$src" -cf - --exclude=checkpoints --exclude=.lock --exclude='.*.tmp' "$1" | tar -C runs -xvf - |
    sed -n '/[^/]$/s|^|runs/|p' >> "$copied"
}
in_head() { git cat-file -e "HEAD:$1" 2>/dev/null; }
keep_v_hack() {   # a finished Phase-2 run's folder, copied here: HEAD's v_hack stays, a different one goes beside it
  local v=runs/$1/v_hack.safetensors
  in_head "$v" && [ -f "$v" ] || return 0
  cmp -s "$v" <(git show "HEAD:$v") && return 0
  mv "$v" "runs/$1/v_hack.report.safetensors"; git show "HEAD:$v" > "$v"
  echo "runs/$1/v_hack.report.safetensors" >> "$copied"
}
mkdir -p runs
finished=()   # the finished runs copied here: committed below, so --prune may drop their checkpoints
for d in "$@"; do
  while IFS= read -r p; do copy "${p#"$src"/}"; done < <(   # a job's scratch (.work-*) keeps pools of its own
    find "$src/$d" -type d -name '.work-*' -prune -o -type d -name pools -prune -print)
  while IFS= read -r j; do   # a calibration's finished jobs: the <world>-<seed>.json beside its jobs.json (whole files)
    rel=${j%/jobs.json}; rel=${rel#"$src"/}
    mkdir -p "runs/$rel"
    find "$src/$rel" -maxdepth 1 -name '*.json' -type f -exec cp -t "runs/$rel" {} + -printf "runs/$rel/%f\n" >> "$copied"
  done < <(find "$src/$d" -name jobs.json -not -path '*/.work-*')
  while IFS= read -r j; do
    r=${j%/run.json}; rel=${r#"$src"/}
    if ok "$r"; then copy "$rel"; [[ $r == *-phase2 ]] && keep_v_hack "$rel"; finished+=("$r")
    elif [ -f "$r/v_hack.safetensors" ] && [[ $r == *-phase2 ]] && ! in_head "runs/$rel/v_hack.safetensors"; then
      copy "$rel/v_hack.safetensors"
    fi
  done < <(find "$src/$d" -name run.json -not -path '*/pools/*')
done
# The copied files, each once: those git ignores that a record keeps (pools, run.json, Phase-2 v_hack tensors) added
# with -f, the others as the ignore rules say (a run's own v_hack copy, its kernel.log, … stay out).
sort -u "$copied" | while IFS= read -r f; do
  [ -f "$f" ] || continue
  case $f in */.work-*/*) ;; */pools/*|*/run.json|*-phase2/v_hack*.safetensors) echo "$f" >> "$copied.force" ;;
    *) git check-ignore -q -- "$f" || echo "$f" >> "$copied.plain" ;; esac
done
touch "$copied.force" "$copied.plain"; cat "$copied.force" "$copied.plain" > "$copied.all"
[ -s "$copied.all" ] || exit 0
[ -s "$copied.force" ] && git add -f --pathspec-from-file="$copied.force"
[ -s "$copied.plain" ] && git add --pathspec-from-file="$copied.plain"
# only these are committed: anything else staged stays staged
xargs -a "$copied.all" -d '\n' git diff --cached --quiet -- ||
  git commit -qm "runs/$*: finished files so far (pools, Phase-2 v_hack, finished runs; not read)" \
    --pathspec-from-file="$copied.all"
[ -n "$prune" ] || exit 0   # here every copied file is in HEAD (set -e: a failed commit ended the script)
for r in "${finished[@]}"; do rm -rf "$r/checkpoints"; done
