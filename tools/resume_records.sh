#!/usr/bin/env bash
# Start a long record again after a session's end or on a replaced machine: its worktree beside this checkout at the
# commit it is frozen at (its RUNNING.md says why), this checkout's .venv linked in, the finished files committed here
# copied in without overwriting anything the worktree already has, its command started in the background, and a loop
# that commits its finished files here every 15 minutes (tools/save_runs.sh). Run from this checkout; log a line in
# the record's RUNNING.md. tools/pause_records.sh stop | cont pauses them all and lets them go on.
#   usage: tools/resume_records.sh bed BLOCK FIRST_SEED           the bed's block (pools, probes to their v_hack, arms)
#          tools/resume_records.sh probe BLOCK FIRST_SEED SETTING one probe through to its report: alone, at a
#                                                                 session's start (37 min to 2 h 50 min, by machine)
#          tools/resume_records.sh engines                        the SmolLM2 engine record, in the bed's idle time
#          tools/resume_records.sh engines-block2                 its second block (PROTOCOL.md's addendum 2); two
#                                                                 runs at a time when the calibration is not running
#          tools/resume_records.sh calibration                    the calibration's second record, both blocks at
#                                                                 once on one thread each (about 22 h of both cores)
#          DRY_RUN=1 tools/resume_records.sh …                    the worktrees and files only; prints the commands
# Logs: ../bed/block<B>.log, ../bed/probe<B><S>.log, ../engines2/engines.log, ../engines-b2/engines.log,
# ../calib/calibration.log, ../records-saver.log.
set -euo pipefail
cd "$(dirname "$0")/.."
main=$PWD; up=$(dirname "$main")
BED=df140ec PROBES=9947035 ENGINES=e49269a   # the arms and pools, the probes' rules, the TRL engine record
ENGINES_B2=179b172                           # the engine record's second block
CALIB=10ec03b                                # the calibration's second record (runs/calibration2/RUNNING.md)

worktree() {   # folder commit
  [ -d "$1" ] || git worktree add -q --detach "$1" "$2"
  local at; at=$(git -C "$1" rev-parse HEAD)
  [ "$at" = "$(git rev-parse "$2^{commit}")" ] || { echo "$1 is at ${at:0:7}, not at $2: move it aside" >&2; exit 1; }
  [ -e "$1/.venv" ] || [ -L "$1/.venv" ] || ln -s "$main/.venv" "$1/.venv"   # a link, even before setup makes it
}
bring() {   # worktree folder-under-runs...
  local d
  for d in "${@:2}"; do
    [ -e "runs/$d" ] || continue
    mkdir -p "$1/runs/$(dirname "$d")"; cp -rn "runs/$d" "$1/runs/$(dirname "$d")/"
  done
}
start() {   # folder log-path pattern command...: in a session of its own, unless a process matching pattern runs
  if [ -n "${DRY_RUN:-}" ]; then echo "cd $1 && ${*:4}"; return; fi
  if pgrep -f -- "$3" >/dev/null; then echo "already running ($3): not started again"; return; fi
  (cd "$1" || exit; setsid nohup "${@:4}" >> "$2" 2>&1 < /dev/null &)
  echo "started in $1 (log $2): ${*:4}"
}
pids_in() {   # folder: the processes working in it, one pid a line
  local d
  for d in /proc/[0-9]*; do [ "$(readlink "$d/cwd" 2>/dev/null)" = "$1" ] && echo "${d#/proc/}"; done; return 0
}
probe_running() {   # a probe through to its report (hackbed_block.sh … probe SETTING) in this checkout's bed worktree
  local pid
  for pid in $(pids_in "$up/bed"); do
    tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q "hackbed_block.sh .* probe [AB]" && return 0
  done; return 1
}
bed_tree() {   # block: the worktrees and files the bed's block needs
  worktree "$up/bed" "$BED"; worktree "$up/bedprobe" "$PROBES"
  bring "$up/bed" hackbed/pools "hackbed/block$1"
}
case ${1:-} in   # the loops it leaves running, one of each per machine; a failed round does not end them
  _saver) set +e; while sleep 900; do
      [ -d ../bed ] && tools/save_runs.sh --prune ../bed hackbed
      [ -d ../engines2 ] && tools/save_runs.sh --prune ../engines2 engines/smollm2
      [ -d ../engines-b2 ] && tools/save_runs.sh --prune ../engines-b2 engines/smollm2
      [ -d ../calib ] && tools/save_runs.sh ../calib calibration2
    done ;;
  _renice) set +e; while sleep 20; do   # every process working in the engine record's worktree, and its group:
      pgrep -f hackbed_block.sh >/dev/null || continue   # nice 19 while a block of the bed runs (its costs are its
      # record); beside the calibration, an equal share of the machine
      for pid in $(pids_in "$up/engines2"); do
        renice -n 19 -p "$pid" >/dev/null 2>&1; echo 19 > "/proc/$pid/autogroup" 2>/dev/null
      done
    done ;;
esac

if [ -n "${DRY_RUN:-}" ]; then echo "make -s setup"; else make -s setup; fi
case ${1:-} in
  bed)
    [ $# -eq 3 ] || { echo "usage: $0 bed BLOCK FIRST_SEED" >&2; exit 2; }
    bed_tree "$2"
    start "$up/bed" "$up/bed/block$2.log" hackbed_block.sh env PYTHONPATH="$up/bed" PROBE_PATH="$up/bedprobe" \
      nice -n 10 tools/hackbed_block.sh "$2" "$3" 30 ;;
  probe)
    [ $# -eq 4 ] || { echo "usage: $0 probe BLOCK FIRST_SEED SETTING" >&2; exit 2; }
    for d in engines2 engines-b2 calib; do   # the probe's two threads wait on each other: nothing may run beside them
      [ -z "$(pids_in "$up/$d")" ] ||
        { echo "the record in $up/$d is running: a probe runs alone (stop it first; it resumes later)" >&2; exit 1; }
    done
    bed_tree "$2"
    start "$up/bed" "$up/bed/probe$2$4.log" hackbed_block.sh env PYTHONPATH="$up/bed" PROBE_PATH="$up/bedprobe" \
      bash "$main/tools/hackbed_block.sh" "$2" "$3" 30 probe "$4" ;;
  engines)
    worktree "$up/engines2" "$ENGINES"
    bring "$up/engines2" engines/smollm2/trl hackbed/block1/A-phase2
    # a sweep's job starts a session of its own, which the kernel schedules as a group at nice 0 whatever its
    # parent's: `_renice` puts them back at 19
    start "$up/engines2" "$up/engines2/engines.log" "record-engines-smollm2$" \
      env PYTHONPATH="$up/engines2" nice -n 19 make -o setup record-engines-smollm2   # -o: main's .venv, set up above
    start "$main" "$up/records-renice.log" "resume_records.sh _renice" bash tools/resume_records.sh _renice ;;
  engines-block2)   # beside the calibration's record, one run at a time (an equal share of the machine); alone on
    # it, two at a time (one thread and 5.7 GB each): the frozen recipe with its --max-parallel alone raised
    worktree "$up/engines-b2" "$ENGINES_B2"
    bring "$up/engines-b2" engines/smollm2/trl-block2 hackbed/block2/A-phase2
    jobs=1; [ -n "$(pids_in "$up/calib")" ] || jobs=2
    recipe="make -o setup -s -n record-engines-smollm2-2 | sed 's/--max-parallel 1 /--max-parallel $jobs /'"
    start "$up/engines-b2" "$up/engines-b2/engines.log" record-engines-smollm2-2 \
      env PYTHONPATH="$up/engines-b2" nice -n 10 bash -c "$recipe | bash -e" ;;
  calibration)
    if probe_running; then echo "a probe is running: it runs alone" >&2; exit 1; fi
    worktree "$up/calib" "$CALIB"
    bring "$up/calib" calibration2
    start "$up/calib" "$up/calib/calibration.log" record-calibration \
      env PYTHONPATH="$up/calib" nice -n 10 make -o setup -j2 record-calibration ;;
  *) echo "usage: $0 bed BLOCK FIRST_SEED | probe BLOCK FIRST_SEED SETTING | engines | engines-block2 | calibration" >&2
     exit 2 ;;
esac
start "$main" "$up/records-saver.log" "resume_records.sh _saver" bash tools/resume_records.sh _saver
