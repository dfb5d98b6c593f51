"""Where could the SmolLM2 engine record's difference come from? Five checks on the bed's `leak` setting (SmolLM2, δS,
AdamW 3e-2), each against an exact answer, one reading of the record's curves and one split of its step-0 completion
length into prompts and draw; runs/engines/smollm2/RESULT.md reports what they printed.

  steps N [FIRST COUNT]  TRL's first N steps at seeds FIRST… (default 1000, one seed), their batches replayed
             through the package's loop: the δS each reaches
  knobs      the GenerationConfig `generate` ends up with in each engine, and the prompt ids each feeds it
  prefix     the package's shared-prefix sampler against plain `generate` (TRL's call), same seeds: the replies
  resume     a TRL run killed after step 2's log line and run again, against the uninterrupted run (3 steps)
  draws      TRL's own `generate` call (`_generate_single_turn` of the trainer as a run builds it, GRPOProbe's
             entropy hook on, as training begins it) against the package's sampler, the same prompts and the same
             seed: the completions, token for token
  curves     a block's TRL − package difference per step and arm (mean ± se over its seeds): where the gap opens
  prompts    each seed's step-0 prompts in each engine (TRL's RepeatSampler, the package's `step_problems`), both
             sampled by the package's sampler with the package's step-0 seed: its own replayed against its log, and
             the completion length each engine's prompts give under one draw; at the first seed, TRL's real step 0
             (the prompts it got, its length, its generate call made again out of training)

usage: OMP_NUM_THREADS=1 .venv/bin/python tools/engine_checks.py steps 3 [1000 1] | knobs | prefix | resume | draws
       .venv/bin/python tools/engine_checks.py curves runs/engines/smollm2/trl runs/hackbed/block1 1000 30
       OMP_NUM_THREADS=1 .venv/bin/python tools/engine_checks.py prompts runs/engines/smollm2/trl \
           runs/hackbed/block1 1000 30"""
import dataclasses, itertools, json, shutil, sys, tempfile
from pathlib import Path

import numpy as np
import torch

from transformers import TrainerCallback

from entropy_grpo.bed_record import BLOCK_ARMS, bed_curves, block_curves
from entropy_grpo.checkpoints import trainable_parameters
from entropy_grpo.phase3_run import Phase3Config, Phase3Run
from entropy_grpo.sequence_processor import SequenceProcessor
from entropy_grpo.tasks import load_task
from entropy_grpo.training import step_problems, step_seed
from entropy_grpo.trl_callback import GRPOProbe
from entropy_grpo.trl_engine import Replay, StepBatches, both_engines, train_trl, trl_trainer

V_HACK = "runs/hackbed/block1/A-phase2/v_hack.safetensors"   # what block 1's arms measured or projected


def bed_run(out:Path, steps:int=16, seed:int=1000) -> Phase3Run:
    "A run of the bed's vanilla arm as the sweep builds it, its δS adapter on."
    r = Phase3Run(Phase3Config(preset="leak", engine="trl", seed=seed, steps=steps, out_dir=str(out), v_hack=V_HACK))
    r.add_arm(); r.fit_v_hack()
    return r


def norm(tensors) -> float: return float(sum(float(t.detach().norm()) ** 2 for t in tensors) ** .5)


def steps(tmp:Path, n:str, first:str="1000", count:str="1"):
    for seed in range(int(first), int(first) + int(count)):
        out = tmp/str(seed)
        a, b = bed_run(out/"trl", int(n), seed), bed_run(out/"package", int(n), seed)
        theirs, ours = both_engines(a.adapter.model, b.adapter.model, a.tok, a.task, a.train_config, out, a.adapter)
        A, B = trainable_parameters(a.adapter.model), trainable_parameters(b.adapter.model)
        print(f"seed {seed}, after {n} steps: |δS_trl − δS_package| {norm(A[k] - B[k] for k in A):.3e} of "
              f"|δS_trl| {norm(A.values()):.3e}")
        for x, y in zip(theirs, ours.records):
            print(f"step {x['step']}: loss {x['loss']:.6f} / {y['loss']:.6f}, reward {x['reward_mean']:.4f} / "
                  f"{y['reward_mean']:.4f}, entropy_rb {x['entropy_rb']:.4f} / {y['entropy_rb']:.4f}, TRL's entropy "
                  f"{x['entropy']:.4f} / entropy_full {y['entropy_full']:.4f} (TRL / package)")


def knobs(tmp:Path):
    import transformers.generation.utils as gu
    seen, prepare = [], gu.GenerationMixin._prepare_generation_config
    def spy(self, *args, **kw):
        out = prepare(self, *args, **kw)
        seen.append(out[0].to_diff_dict())
        return out
    gu.GenerationMixin._prepare_generation_config = spy
    r = bed_run(tmp)
    trainer = trl_trainer(r.adapter.model, r.tok, r.task, r.train_config, tmp, adapter=r.adapter)
    prompts = [r.task.prompt(p, r.tok) for p in r.task.problems[:4]]
    trl_ids, _, _ = trainer._tokenize_prompts(prompts)
    trainer._generate_single_turn(trl_ids, None, {}, 1)
    seqs = SequenceProcessor(r.adapter.model, r.tok, r.gen, progress=False).generate_batched(prompts, seed=0)
    ours = [seqs.sequences[j, 0, seqs.prompt_lens[j] - len(ids):seqs.prompt_lens[j]].tolist()
            for j, ids in enumerate(trl_ids)]
    print("prompt ids equal:", ours == trl_ids)
    for k in sorted(set(seen[0]) | set(seen[-1])):
        if seen[0].get(k) != seen[-1].get(k): print(f"{k}: TRL {seen[0].get(k)!r}, package {seen[-1].get(k)!r}")


def prefix(tmp:Path):
    r = bed_run(tmp)
    sp = SequenceProcessor(r.adapter.model, r.tok, r.gen, progress=False)
    prompts = [r.task.prompt(p, r.tok) for p in r.task.problems[:8]]
    shared = [sp.generate_batched(prompts[i:i + 4], seed=7 + i) for i in (0, 4)]
    sp._shared_prefix = lambda pb, ab, G: {}           # plain generate, every row prefilled
    plain = [sp.generate_batched(prompts[i:i + 4], seed=7 + i) for i in (0, 4)]
    same = sum(x == y for a, b in zip(shared, plain) for ra, rb in zip(a.responses_text, b.responses_text)
               for x, y in zip(ra, rb))
    print(f"replies equal: {same} of {8 * r.gen.num_generations}")


def draws(tmp:Path):
    r = bed_run(tmp)
    trainer = trl_trainer(r.adapter.model, r.tok, r.task, r.train_config, tmp, adapter=r.adapter)
    probe = next(c for c in trainer.callback_handler.callbacks if isinstance(c, GRPOProbe))
    probe.on_train_begin(trainer.args, trainer.state, trainer.control, model=trainer.model)   # the entropy hook
    assert trainer.model.__dict__.get("generate") is probe.entropy_hook, "the entropy hook is not on"
    sp, G = SequenceProcessor(r.adapter.model, r.tok, r.gen, progress=False), r.gen.num_generations
    same = total = 0
    for i in range(0, 16, 4):                     # four steps' worth of prompts, 4 × G each, one generate call each
        prompts = [r.task.prompt(p, r.tok) for p in r.task.problems[i:i + 4]]
        seqs = sp.generate_batched(prompts, seed=i)
        ours = [seqs.sequences[b, g, seqs.prompt_lens[b]:seqs.prompt_lens[b] + seqs.gen_lens[b, g]].tolist()
                for b in range(4) for g in range(G)]
        ids, _, _ = trainer._tokenize_prompts([p for p in prompts for _ in range(G)])
        torch.manual_seed(i * 1_000_003)                   # the seed the package's sampler gives this call
        theirs, _ = trainer._generate_single_turn(ids, None, {}, G)
        same, total = same + sum(a == b for a, b in zip(theirs, ours)), total + len(ours)
        print(f"prompts {i}-{i + 3}: mean length TRL {np.mean([len(t) for t in theirs]):.2f}, package "
              f"{np.mean([len(t) for t in ours]):.2f}")
    print(f"completions equal token for token: {same} of {total}")


class Crash(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if state.global_step == 2: raise KeyboardInterrupt


def resume(tmp:Path):
    def run(out, callbacks=()):
        r = bed_run(out, 3, seed=1010)
        tc = dataclasses.replace(r.train_config, save_steps=1)
        log = train_trl(r.adapter.model, r.tok, r.task, tc, out, adapter=r.adapter, v_hack=r.v_hack_saved,
                        callbacks=callbacks)
        return log, trainable_parameters(r.adapter.model)
    try: run(tmp/"killed", [Crash()])
    except KeyboardInterrupt: print("killed after step 2's log line")
    (log, resumed), (clean_log, clean) = run(tmp/"killed"), run(tmp/"clean")
    print("rewards resumed / uninterrupted:", [x["reward_mean"] for x in log], [x["reward_mean"] for x in clean_log])
    print(f"|δS_resumed − δS_uninterrupted| {norm(resumed[k] - clean[k] for k in clean):.3e}")


def curves(tmp:Path, trl_dir:str, block_dir:str, first:str, n:str):
    trl, package, seeds = bed_curves(trl_dir), block_curves(block_dir), range(int(first), int(first) + int(n))
    for arm in ("vanilla", "projected"):
        for key in ("hack_rate", "gt_pass_rate", "reward_mean"):
            d = np.array([trl[arm][s][key] for s in seeds]) - np.array([package[arm][s][key] for s in seeds])
            mean, se = d.mean(0), d.std(0, ddof=1) / len(d) ** .5                # [steps] each
            print(f"{arm} {key} (TRL − package, step 0 on):", " ".join(f"{m:+.3f}±{e:.3f}" for m, e in zip(mean, se)))


def step0_len(job:Path) -> float: return json.loads((job/"log.jsonl").read_text().splitlines()[0])["completion_len"]


def trl_step0(tmp:Path, seed:int) -> tuple:
    "A TRL run's real step 0 at `seed`: (the prompts its generate got, as token-id lists; its logged completion_len)."
    " Its generate call is made again after the run, out of training (eval mode, step 0's weights and RNG state)."
    r = bed_run(tmp, 1, seed)
    trainer = trl_trainer(r.adapter.model, r.tok, r.task, r.train_config, tmp, adapter=r.adapter)
    batches, calls, generate = StepBatches(trainer).batches, [], trainer._generate_single_turn
    def spy(*args, **kw):
        calls.append((args, kw, torch.get_rng_state(), trainer.model.training))
        out = generate(*args, **kw)
        calls[-1] += (out[0],)
        return out
    live = trainable_parameters(r.adapter.model)
    trainer._generate_single_turn, weights = spy, {k: v.detach().clone() for k, v in live.items()}
    trainer.train()
    args, kw, state, training, theirs = calls[0]
    with torch.no_grad():
        for k, v in live.items(): v.copy_(weights[k])
    trainer.model.eval(); torch.set_rng_state(state)
    again = generate(*args, **kw)[0]
    print(f"TRL's step-0 generate ran in train mode: {training}; made again out of training: "
          f"{sum(a == b for a, b in zip(again, theirs))} of {len(theirs)} completions equal")
    return Replay(batches, r.gen.num_generations).prompts(0), step0_len(tmp)


def prompts(tmp:Path, trl_dir:str, block_dir:str, first:str, n:str):
    r = bed_run(tmp)
    trainer = trl_trainer(r.adapter.model, r.tok, r.task, r.train_config, tmp, adapter=r.adapter)
    sp = SequenceProcessor(r.adapter.model, r.tok, r.gen, progress=False)
    B, G = r.train_config.prompts_per_step, r.gen.num_generations
    def mean_len(task, problems, seed):
        seqs = sp.generate_batched([task.prompt(p, r.tok, r.train_config.hint) for p in problems], seed=seed)
        return float(seqs.gen_lens.float().mean())
    rows, (d, a) = [], BLOCK_ARMS["vanilla"]
    for s in range(int(first), int(first) + int(n)):
        task = load_task(r.cfg.task, defaults=dict(n=r.cfg.sizes["problems"], seed=s))   # a run's pool is its seed's
        trainer.args.seed = s                                  # TRL's sampler: the first generation batch's B prompts
        theirs = [task.problems[i] for i in itertools.islice(trainer._get_train_sampler(), 0, B * G, G)]
        if s == int(first):                                    # those prompts are the ones TRL's own step 0 gets
            ids, length = trl_step0(tmp/"trl-step0", s)
            same = ids == trainer._tokenize_prompts([task.prompt(p, r.tok, r.train_config.hint) for p in theirs])[0]
            print(f"TRL's real step 0 at seed {s}: prompts as derived here {same}, completion_len {length:.3f}")
        seed = step_seed(s, 0)                                 # the package's step-0 sampling seed
        rows.append([mean_len(task, step_problems(task, 0, B, s), seed), mean_len(task, theirs, seed),
                     step0_len(Path(block_dir)/d/f"{s}-{a}"), step0_len(Path(trl_dir)/f"{s}-vanilla")])
        print(s, "replayed package, TRL prompts, logged package, logged TRL:", " ".join(f"{x:.3f}" for x in rows[-1]))
    ours, on_theirs, logged, logged_trl = np.array(rows).T
    def diff(x): return f"{x.mean():+.3f} ± {x.std(ddof=1) / len(x) ** .5:.3f}"
    print(f"replay equals the package's log in {int(np.isclose(ours, logged, atol=1e-4).sum())} of {len(rows)} seeds")
    print(f"length, package sampler: TRL's prompts − the package's {diff(on_theirs - ours)}; logged TRL − the "
          f"package sampler on TRL's prompts {diff(logged_trl - on_theirs)}; logged TRL − logged package "
          f"{diff(logged_trl - logged)}")


if __name__ == "__main__":
    check, args, tmp = sys.argv[1], sys.argv[2:], Path(tempfile.mkdtemp())
    try: dict(steps=steps, knobs=knobs, prefix=prefix, resume=resume, draws=draws, curves=curves,
                  prompts=prompts)[check](tmp, *args)
    finally: shutil.rmtree(tmp, ignore_errors=True)
