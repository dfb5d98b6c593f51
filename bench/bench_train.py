"""Steps/s of `train` (Dr.GRPO, nb 03) on the embedded SmolLM2-135M with LoRA, and where a step's time goes.

`train` times each step's phases itself (log records `time_generate`, `time_grade`, `time_teacher_force`,
`time_backward`, `time_step`); this script runs --steps steps after one warm-up step and prints their medians and each
phase's share of the step. Never asserts on time.

    python bench/bench_train.py [--threads 1] [--steps 4] [--prompts 2] [--G 4] [--max-new-tokens 64] [--lora-r 16]
"""
import argparse, platform, statistics

import torch

from entropy_grpo.training import TrainConfig, train
from entropy_grpo.policies import load_policy
from entropy_grpo.sequence_processor import GenerationConfig
from entropy_grpo.tasks import ArithmeticTask

PHASES = ("generate", "grade", "teacher_force", "backward")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up step)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lora-r", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = load_policy(None)
    gen = GenerationConfig(max_new_tokens=a.max_new_tokens, num_generations=a.G)
    cfg = TrainConfig(max_steps=a.steps + 1, prompts_per_step=a.prompts, lora_r=a.lora_r, generation=gen, seed=0)
    recs = train(model, tok, ArithmeticTask(), cfg, progress=False).records[1:]
    med = {k: statistics.median(r[f"time_{k}"] for r in recs) for k in PHASES + ("step",)}
    tokens = statistics.median(r["n_tokens"] for r in recs)
    print(f"# {platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}, float32, SmolLM2-135M-Instruct, "
          f"LoRA r={a.lora_r} on all linear layers, {a.prompts} prompts × G={a.G}, max_new_tokens {a.max_new_tokens}, "
          f"median of {len(recs)} steps after a warm-up")
    print("| steps/s | s/step | completion tokens/step | " + " | ".join(f"{k} s (share)" for k in PHASES) + " |")
    print("|---|---|---|" + "---|" * len(PHASES))
    print(f"| {1 / med['step']:.3f} | {med['step']:.2f} | {tokens:.0f} | "
          + " | ".join(f"{med[k]:.2f} ({med[k] / med['step']:.0%})" for k in PHASES) + " |")


if __name__ == "__main__":
    main()
