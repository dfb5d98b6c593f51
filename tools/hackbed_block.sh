#!/usr/bin/env bash
# One seed block of the real-model hack bed (runs/hackbed/PROTOCOL.md): the pools of settings A and B (built once,
# shared by the blocks), Phase 2 on each setting with the product's defaults (probe seed = the block's first seed),
# then the six arms two seeds at a time, so that a stopped block holds whole seed pairs. Every step skips what is done:
# re-run the same command to resume.
#   usage: tools/hackbed_block.sh BLOCK FIRST_SEED N      e.g. tools/hackbed_block.sh 1 1000 30
#          tools/hackbed_block.sh BLOCK FIRST_SEED N probe SETTING   only that setting's probe, through to its report
#          (37 min to 2 h 50 min of both cores by machine, not resumable inside: run it alone, early in a session)
set -euo pipefail
block=$1; first=$2; n=$3
E=.venv/bin/entropy-grpo; PY=.venv/bin/python; B=runs/hackbed; P=$B/pools; D=$B/block$block
LEAK=entropy_grpo.hackbed:ReferenceLeakTask; DECOY=entropy_grpo.hackbed:addend_decoy_task
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# The package the probes import (default: PYTHONPATH's), so that every block's Phase-2 decision is made by one version
# of the rules (runs/hackbed/RUNNING.md says which). The arms import the checkout this runs in: a sweep's jobs start in
# it with `python -m`, so its package is theirs (they refuse another).
PROBE_PATH=${PROBE_PATH:-${PYTHONPATH:-}}

pools_of() { echo "-p teacher_pool='$P/$1-teacher' -p base_pool='$P/$1-base' -p style_pool='$P/$1-style'"; }

# pools: teacher with its hint (seed 1), the style-matched pool (same problems, no hint), the base pool (seed 2)
build_pools() {   # setting task
  $E pools "$P/$1-teacher" --task "$2" --hint --seed 1
  $E pools "$P/$1-style" --task "$2" --style-of "$P/$1-teacher"
  $E pools "$P/$1-base" --task "$2" --seed 2
}

# Phase 2 per setting (two threads: one probe at a time), done when its run.json says ok. The arms need only its
# v_hack.safetensors, which the probe writes in its first minutes (a re-run writes the same tensors): each setting's
# probe runs first until it has saved one, and the reports are completed after the block's seeds, so that a session
# too short for a whole probe (up to 2 h 50 min of both cores) still advances the arms.
probe() {   # setting
  local task=$LEAK; [ "$1" = B ] && task=$DECOY
  OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 PYTHONPATH=$PROBE_PATH \
    $E probe --out "$D/$1-phase2" --seed "$first" -p task="'$task'" $(pools_of "$1")
}
# The probe until it has saved its v_hack (written atomically), then stopped: its report is completed below.
first_fit() {   # setting
  local v=$D/$1-phase2/v_hack.safetensors
  [ -f "$v" ] && return
  export -f probe pools_of; export E D P LEAK DECOY first PROBE_PATH
  setsid bash -c "probe $1" & local pid=$!   # its own process group: the probe's kernel stops with it
  while [ ! -f "$v" ] && kill -0 "$pid" 2>/dev/null; do sleep 5; done
  kill -- -"$pid" 2>/dev/null || true; wait "$pid" || true
  [ -f "$v" ] || { echo "setting $1's probe ended without a v_hack" >&2; exit 1; }
}
finished() { $PY -c "import json, sys; sys.exit(json.load(open('$1/run.json'))['state'] != 'ok')" 2>/dev/null; }
if [ "${4:-}" = probe ]; then
  case ${5:-} in A|B) finished "$D/$5-phase2" || probe "$5"; exit ;; esac
  echo "probe needs a setting, A or B: got '${5:-}'" >&2; exit 2
fi

build_pools A "$LEAK" & build_pools B "$DECOY" & wait
for s in A B; do first_fit "$s"; done

sweep() {   # sweep-dir seeds... -- arms and parameters
  local dir=$1; shift
  $E sweep --out "$D/$dir" --steps 16 --max-parallel 2 --force -p preset="'leak'" "$@"
}
for ((s = first; s < first + n; s += 2)); do
  seeds=("$s"); [ $((s + 1)) -lt $((first + n)) ] && seeds+=("$((s + 1))")
  sweep arms --seeds "${seeds[@]}" --arms vanilla projected -p v_hack="'$D/A-phase2/v_hack.safetensors'"
  sweep decoy --seeds "${seeds[@]}" --arms projected -p v_hack="'$D/B-phase2/v_hack.safetensors'"
  sweep random --seeds "${seeds[@]}" --arms projected -p v_hack_source="'random'" $(pools_of A)
  sweep lora --seeds "${seeds[@]}" --arms vanilla_lora projected_lora $(pools_of A)
done
for s in A B; do finished "$D/$s-phase2" || probe "$s"; done
