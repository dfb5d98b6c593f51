"""Overhead of `trl_callback.GRPOProbe` on a TRL GRPOTrainer step, as a ratio to the plain step in the same process.

Three runs of the same trainer settings (same seed, same data): plain TRL; the probe measuring every step (`every=1`:
E sampled afresh from the float64 copy at θ, scored at θ and θ⁺, ∇H(E), plus cos_in and entropy_rb); the probe with
`every=0` (only what it does on every step: cos_in/frac_fired after clipping and entropy_rb from generate's logits).
A step is timed from `on_step_begin` to the end of `on_step_end` (generation, loss, backward, clipping, the probe, the
optimizer step); the first step of each run is a warm-up. Training in float32 (`--bf16`: TRL's default autocast).
Printed: the median step time of each run and its ratio to the plain step, and the probe's own seconds per measured
step (its `seconds` metric). LoRA r 8 on q/k/v/o through TRL's `peft_config`; v_hack random in that LoRA space (k 1).
Never asserts on time.

    python bench/bench_trl.py [--model default|tiny] [--threads 1] [--steps 6] [--prompts 4] [--G 4]
                              [--max-new-tokens 32] [--E-prompts 4] [--bf16]
"""
import argparse, os, platform, random, statistics, tempfile, time, warnings

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from entropy_grpo.adapters import LoraAdapter
from entropy_grpo.policies import load_policy, tiny_policy
from entropy_grpo.projection_arms import random_v_hack
from entropy_grpo.tasks import ArithmeticTask
from entropy_grpo.trl_callback import add_grpo_probe

warnings.filterwarnings("ignore", category=FutureWarning)


class StepTimer(TrainerCallback):
    "Seconds from on_step_begin to on_step_end (added last: its on_step_end runs after the probe's)."
    def __init__(self): self.times, self.t0 = [], None
    def on_step_begin(self, args, state, control, **kw): self.t0 = time.perf_counter()
    def on_step_end(self, args, state, control, **kw): self.times.append(time.perf_counter() - self.t0)


def reward(completions, **kw):
    return [0.5 * sum(ch.isdigit() for ch in c) - 0.01 * len(c) for c in completions]


def run(a, prompts, probe):
    model, tok = tiny_policy(0) if a.model == "tiny" else load_policy(None, device="cpu", dtype="float32")
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=a.prompts * a.G, num_generations=a.G,
                      max_completion_length=a.max_new_tokens, max_steps=a.steps, learning_rate=1e-4, temperature=1.0,
                      top_p=0.95, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", seed=0,
                      disable_tqdm=True, bf16=a.bf16)
    tr = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok,
                     train_dataset=Dataset.from_dict({"prompt": prompts}),
                     peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                 "o_proj"]))
    tr.remove_callback(PrinterCallback)
    if probe is not None:
        adapter = LoraAdapter.from_peft(tr.model)
        add_grpo_probe(tr, dict(every=probe, n_prompts=a.E_prompts), v_hack=random_v_hack(adapter, 1), adapter=adapter)
    timer = StepTimer()
    tr.add_callback(timer)
    tr.train()
    secs = [r["entropy_grpo/seconds"] for r in tr.state.log_history if "entropy_grpo/seconds" in r][1:]
    return statistics.median(timer.times[1:]), (statistics.median(secs) if secs else float("nan"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", choices=("default", "tiny"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is a warm-up)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--E-prompts", type=int, default=4, help="prompts of E (× G completions)")
    ap.add_argument("--bf16", action="store_true", help="TRL's default bf16 autocast (emulated on CPUs without bf16)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    task = ArithmeticTask()
    prompts = [p.question for p in task.sample(a.prompts * a.steps, random.Random(0))]
    print(f"# {platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}, load "
          f"{os.getloadavg()[0]:.2f}, model {a.model}, LoRA r 8 q/k/v/o, {a.prompts} prompts × G {a.G}, "
          f"{a.max_new_tokens} tokens, top_p 0.95, {'bf16 autocast' if a.bf16 else 'float32'}, |E| {a.E_prompts} × "
          f"{a.G}, median of {a.steps - 1} steps after "
          "a warm-up")
    plain, _ = run(a, prompts, None)
    every, probe_s = run(a, prompts, 1)
    light, _ = run(a, prompts, 0)
    print("| run | step s | ratio to plain TRL step | probe s per measured step |")
    print("|---|---|---|---|")
    print(f"| plain TRL | {plain:.2f} | 1.00× | — |")
    print(f"| probe, every=1 (ΔH_true, ΔH₁, cos_in, entropy_rb) | {every:.2f} | {every / plain:.2f}× | {probe_s:.2f} |")
    print(f"| probe, every=0 (cos_in, entropy_rb only) | {light:.2f} | {light / plain:.2f}× | — |")
    print(f"# load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
