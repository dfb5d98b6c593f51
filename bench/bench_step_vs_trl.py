"""The package's Dr.GRPO training step (`training.train`) beside TRL's `GRPOTrainer` step, in one process, by phase.

The same weights (the embedded SmolLM2-135M-Instruct, float32, CPU), the same task (`Task.trl_dataset` for TRL), G,
max new tokens, temperature 1, top_p, LoRA r 16 (α 32), loss_type dr_grpo, β 0, one optimizer step per batch, at one
of two settings: `arith` (`ArithmeticTask`, 4 prompts × G 4, 32 new tokens, top_p 0.95, LoRA on all seven
projections, lr 7e-5) or `leak` (the real-model hack bed's LoRA arms: `hackbed.ReferenceLeakTask` without the hint,
4 prompts × G 8, 24 new tokens, top_p 1, LoRA on q/k/v/o, lr 1e-3). TRL runs first, twice: with its own defaults
(gradient checkpointing on, what a TRL user has) and with gradient checkpointing off (as our loop runs a model this
size); both draw the same prompts and, seeded alike, the same completions. Ours then runs on TRL's batches
(`trl_engine.StepBatches` records them, a `trl_engine.Replay` hands them to `train`): each step generates its own
completions for TRL's prompts (timed, then set aside) and trains on TRL's completions and rewards, so that scoring
and loss do the same work in both. TRL's `generate` call of step k is seeded as our `generate_batched(seed=k)` seeds
its call (`sample_seed`), so that ours draws TRL's samples wherever the two policies still agree token for token: the
step's same-work count says in how many steps they did (the two trainers' LoRA inits and learning-rate schedules
differ, so the weights part after step 0). Each trainer runs a warm-up step then --steps steps; per step:

* generation: prompts to completions (ours: the rollout's `time_generate`; TRL: its `_generate`, timed: tokenising,
  `generate` and decoding in both);
* scoring: forwards without grad over the step's completions (ours: `time_teacher_force`, none at num_iterations 1
  and β 0 since the loss's forward gives the logged entropies; TRL: its no-grad log-prob passes, none there either);
* loss: the forward that carries the loss, its backward, clipping and the optimizer step (ours: `time_backward`;
  TRL: `compute_loss`, `accelerator.backward` and what remains of its step after generation and scoring);
* step: the whole step.

Medians over the steps, the ratio ours / TRL per phase, and completion tokens per step. Generation runs until the
longest completion of the batch ends, and where the samples part so do the lengths, so it also prints generation per
decode step (decode_ms: a step's generation seconds over its longest completion, in ms). Then generation alone,
interleaved: our `generate_batched` and the bare transformers `generate` it and TRL call, on a recorded step's
prompts with the same seed (so the same samples and decode steps), alternated --steps times — a same-work figure for
generation free of the drift between trainer runs. Never asserts on time.

    python bench/bench_step_vs_trl.py [--setting arith|leak] [--model default|tiny] [--threads 1] [--steps 3]
                                      [--prompts N] [--G N] [--max-new-tokens N]
"""
import argparse, os, platform, statistics, tempfile, time, warnings

import torch
from peft import LoraConfig
from transformers import PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from entropy_grpo.policies import load_policy, tiny_policy
from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor, hf_generation_config, \
    own_generation_config
from entropy_grpo.hackbed import ReferenceLeakTask
from entropy_grpo.tasks import ArithmeticTask
from entropy_grpo.training import TrainConfig, train
from entropy_grpo.trl_engine import Replay, StepBatches

warnings.filterwarnings("ignore", category=FutureWarning)
PHASES = ("generation", "scoring", "loss", "step")
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SETTINGS = dict(arith=dict(task=ArithmeticTask, prompts=4, G=4, max_new_tokens=32, top_p=0.95, targets=SEVEN, lr=7e-5),
                leak=dict(task=ReferenceLeakTask, prompts=4, G=8, max_new_tokens=24, top_p=1.0, targets=SEVEN[:4],
                          lr=1e-3))


def sample_seed(seed:int) -> int:
    "The torch seed `generate_batched(seed=seed)` sets before its first (here its only) generate call."
    return seed * 1_000_003


def same_tokens(mine, completions:torch.Tensor) -> bool:
    "Whether our BatchedSequences drew these [B·G, L] completions (TRL's, or the bare `generate`'s)."
    ours_ = mine.sequences[..., int(mine.prompt_lens[0]):].flatten(0, 1)
    return ours_.shape == completions.shape and torch.equal(ours_, completions)


def policy(a):
    return tiny_policy(0) if a.model == "tiny" else load_policy(None, device="cpu", dtype="float32")


class TimedReplay(Replay):
    "`trl_engine.Replay` (TRL's completions and rewards as the rollout), each step first generating its own"
    " completions for TRL's prompts, timed and set aside."
    def __init__(self, batches, G): super().__init__(batches, G); self.decode_steps, self.same = {}, {}

    def __call__(self, step, sp, config, seed):
        b, t = self.batches[step], time.perf_counter()
        own = sp.generate_batched(self.prompts(step), seed=step)      # TRL's generate of this step was seeded alike
        t_gen, rollout = time.perf_counter() - t, super().__call__(step, sp, config, seed)
        rollout.time_generate = t_gen
        self.decode_steps[step] = own.sequences.shape[-1] - own.prompt_lens[0]   # the longest completion drawn
        self.same[step] = same_tokens(own, b["completion_ids"])
        return rollout


def ours(a, batches) -> tuple[dict, float, int]:
    "Per-phase medians of `train`'s own step timings on TRL's batches, completion tokens per step, and the number of"
    " timed steps whose own completions were TRL's."
    model, tok = policy(a)
    gen = GenerationConfig(max_new_tokens=a.max_new_tokens, num_generations=a.G, temperature=1.0, top_p=a.top_p)
    cfg = TrainConfig(max_steps=a.steps + 1, prompts_per_step=a.prompts, lora_r=16, lora_alpha=32.0,
                      lora_target_modules=a.targets, generation=gen, loss_type="dr_grpo", learning_rate=a.lr, seed=0)
    replay = TimedReplay(batches, a.G)
    recs = train(model, tok, None, cfg, source=replay, progress=False).records[1:]
    keys = dict(generation="time_generate", scoring="time_teacher_force", loss="time_backward", step="time_step")
    out = {k: statistics.median(r[v] for r in recs) for k, v in keys.items()}
    out["decode_ms"] = statistics.median(1e3 * r["time_generate"] / replay.decode_steps[r["step"]] for r in recs)
    return out, statistics.median(r["n_tokens"] for r in recs), sum(replay.same[r["step"]] for r in recs)


class Timer(TrainerCallback):
    "TRL's step, its generation (`_generate`: tokenising, `generate`, decoding, as our rollout's time_generate) and"
    " its no-grad log-prob passes (the rest of the step is the loss's): seconds. Its k-th `generate` call is seeded"
    " as ours at step k."
    def __init__(self, trainer):
        self.steps, self.cur, self.calls = [], None, 0
        self._wrap(trainer, "_generate", "generation")
        self._wrap(trainer, "_get_per_token_logps_and_entropies", "scoring")
        self._wrap(trainer.model, "generate", "sampling")

    def _wrap(self, owner, name, key):
        fn = getattr(owner, name)
        def timed(*args, **kw):
            t = time.perf_counter()
            with torch.random.fork_rng(enabled=key == "sampling"):
                if key == "sampling": torch.manual_seed(sample_seed(self.calls)); self.calls += 1
                out = fn(*args, **kw)
            if key != "sampling" and self.cur is not None and (key != "scoring" or not torch.is_grad_enabled()):
                self.cur[key] += time.perf_counter() - t
            return out
        setattr(owner, name, timed)

    def on_step_begin(self, args, state, control, **kw):
        self.cur, self.t0 = dict.fromkeys(PHASES, 0.0), time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.cur["step"] = time.perf_counter() - self.t0
        self.cur["loss"] = self.cur["step"] - self.cur["generation"] - self.cur["scoring"]   # + clip, optimizer step
        self.steps.append(self.cur); self.cur = None


def trl(a, task, checkpointing:bool) -> tuple[dict, float, list]:
    "Per-phase medians of TRL's step, completion tokens per step, and its steps' batches."
    model, tok = policy(a)
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=a.prompts * a.G, num_generations=a.G,
                      max_completion_length=a.max_new_tokens, max_steps=a.steps + 1, learning_rate=a.lr,
                      temperature=1.0, top_p=a.top_p, loss_type="dr_grpo", beta=0.0, use_cpu=True, bf16=False,
                      report_to="none", logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
                      gradient_checkpointing=checkpointing)
    tr = GRPOTrainer(model=model, reward_funcs=task.trl_rewards(("reward",)), args=args, processing_class=tok,
                     train_dataset=task.trl_dataset(tok),
                     peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=a.targets))
    tr.remove_callback(PrinterCallback)
    timer, batches = Timer(tr), StepBatches(tr).batches
    tr.add_callback(timer)
    tr.train()
    steps = timer.steps[1:]
    tokens = [r["completions/mean_length"] * a.prompts * a.G for r in tr.state.log_history
              if "completions/mean_length" in r][1:]
    out = {k: statistics.median(s[k] for s in steps) for k in PHASES}
    widths = [b["completion_ids"].shape[1] for b in batches[1:]]      # decode steps of each timed step
    out["decode_ms"] = statistics.median(1e3 * s["generation"] / w for s, w in zip(steps, widths))
    return out, statistics.median(tokens), batches


def generation_alone(a, batches) -> tuple[float, float, bool]:
    "Medians of our generate_batched and of the bare `generate` on the same prompts and seeds, alternated; and whether"
    " every call pair drew the same tokens."
    from peft import get_peft_model
    model, tok = policy(a)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=a.targets)).eval()
    sp = SequenceProcessor(model, tok, GenerationConfig(max_new_tokens=a.max_new_tokens, num_generations=a.G,
                                                        temperature=1.0, top_p=a.top_p), progress=False)
    ids, attn, prompts = batches[1]["prompt_ids"], batches[1]["prompt_mask"], Replay(batches, a.G).prompts(1)
    gcfg, times, same = hf_generation_config(sp.config, tok, sp.eos_token_id), ([], []), True
    def timed(f):
        t = time.perf_counter(); out = f(); return out, time.perf_counter() - t
    def bare(seed):
        torch.manual_seed(sample_seed(seed))
        with torch.no_grad(), own_generation_config(model):
            return model.generate(input_ids=ids, attention_mask=attn, generation_config=gcfg)
    for seed in range(a.steps + 1):                          # seed 0: the warm-up pair; odd seeds: bare first
        calls, got = [lambda: sp.generate_batched(prompts, seed=seed), lambda: bare(seed)], {}
        for i in ((0, 1) if seed % 2 == 0 else (1, 0)): got[i] = timed(calls[i])
        (mine, t_mine), (out, t_bare) = got[0], got[1]
        same &= same_tokens(mine, out[:, ids.shape[1]:])
        if seed: times[0].append(t_mine); times[1].append(t_bare)
    return statistics.median(times[0]), statistics.median(times[1]), same


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", choices=("default", "tiny"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per trainer (after one warm-up step)")
    ap.add_argument("--setting", default="arith", choices=tuple(SETTINGS))
    ap.add_argument("--prompts", type=int, help="prompts per step (default: the setting's)")
    ap.add_argument("--G", type=int, help="completions per prompt (default: the setting's)")
    ap.add_argument("--max-new-tokens", type=int, help="(default: the setting's)")
    a = ap.parse_args()
    for k, v in SETTINGS[a.setting].items():
        if getattr(a, k, None) is None: setattr(a, k, v)
    torch.set_num_threads(a.threads)
    task = a.task()
    print(f"# {platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}, load "
          f"{os.getloadavg()[0]:.2f}, model {a.model}, setting {a.setting}: LoRA r 16 on "
          f"{len(a.targets)} projections, {a.prompts} prompts × G {a.G}, {a.max_new_tokens} new tokens, "
          f"top_p {a.top_p}, lr {a.lr}, dr_grpo, float32, median of {a.steps} steps after a "
          "warm-up")
    (ckpt, ckpt_tok, batches), (plain, plain_tok, again) = trl(a, task, True), trl(a, task, False)
    same = all(torch.equal(x["completion_ids"], y["completion_ids"]) for x, y in zip(batches, again))
    mine, mine_tok, mine_same = ours(a, batches)
    ratio = lambda x, y: f"{x / y:.2f}×" if y > 0 else "—"
    print("| phase | ours s | TRL s (default: checkpointing) | ours / TRL | TRL s, no checkpointing | ours / TRL |")
    print("|---|---|---|---|---|---|")
    for k in PHASES + ("decode_ms",):
        print(f"| {k} | {mine[k]:.2f} | {ckpt[k]:.2f} | {ratio(mine[k], ckpt[k])} | {plain[k]:.2f} | "
              f"{ratio(mine[k], plain[k])} |")
    print(f"| completion tokens per step | {mine_tok:.0f} | {ckpt_tok:.0f} | | {plain_tok:.0f} | |")
    print(f"# both TRL runs drew the same completions: {same}; ours drew TRL's in {mine_same} of {a.steps} steps; "
          f"load {os.getloadavg()[0]:.2f}")
    g_mine, g_bare, g_same = generation_alone(a, batches)
    print(f"| generation alone, interleaved: ours / bare `generate` | {g_mine:.2f} | {g_bare:.2f} | "
          f"{ratio(g_mine, g_bare)} | same tokens: {g_same} | |")
    print(f"# load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
