#!/usr/bin/env bash
# Pause the long records started by tools/resume_records.sh (to give the full test command both cores, or while
# .venv is installed again), let them go on, or end them: SIGSTOP / SIGCONT / SIGTERM (then SIGCONT, so that a paused
# one acts on it; not Ctrl-C's SIGINT, which a command started with `&` ignores, and a sweep's job records SIGTERM as
# an interrupt off Slurm) to each record's make and every process under it (sweep jobs, papermill, their kernels). An
# ended record resumes from its checkpoints with resume_records.sh. Jobs in flight record the paused minutes as wall
# time: log each pause in the record's RUNNING.md. A second argument keeps to the records whose make target starts
# with it (`engines`, `calibration`), e.g. to give one record the cores the other shares.
#   usage: tools/pause_records.sh stop | cont | end [target]
set -euo pipefail
case "${1:-}" in
  stop) sig=STOP ;; cont) sig=CONT ;; end) sig=TERM ;;
  *) echo "usage: $0 stop | cont | end [target] (got '${1:-}')" >&2; exit 2 ;;
esac
below() { local p; for p in $(pgrep -P "$1"); do echo "$p"; below "$p"; done; }
n=0
for top in $(pgrep -f "make -o setup .*record-${2:-}" || true); do
  for p in $top $(below "$top"); do
    kill -"$sig" "$p" 2>/dev/null && n=$((n + 1))
    if [ "$sig" = TERM ]; then kill -CONT "$p" 2>/dev/null || true; fi
  done
done
echo "SIG$sig sent to $n processes"
