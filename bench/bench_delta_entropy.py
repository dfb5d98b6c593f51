"""Cost of one `DeltaEntropyIS.entropy_change_two_batch` (nb 02) against the teacher-forcing passes it cannot avoid.

The call: snapshot (parameters, buffers, optimizer and RNG state), score E under θ, one real Dr.GRPO step on U, score E
under θ⁺, restore. The floor is the two scoring passes over E plus the update; the call records each phase's seconds
itself. Printed: the call's time as a ratio to (score θ + score θ⁺) and to the floor, and snapshot + restore as a share
of the call (goal ≤ 10%). SmolLM2-135M-Instruct, all parameters trained (the largest state to snapshot) and LoRA r = 16;
E and U sampled by `ProbeComponents`, U with stand-in rewards that vary within each group. Median of --repeats calls
after a warm-up. Never asserts on time.

    python bench/bench_delta_entropy.py [--threads 1] [--repeats 3] [--E 16] [--B-U 2] [--G 4] [--max-new-tokens 32]
"""
import argparse, platform, statistics

import torch

from entropy_grpo.delta_entropy_is import DeltaEntropyIS
from entropy_grpo.dr_grpo import group_advantages
from entropy_grpo.checkpoints import trainable_parameters
from entropy_grpo.training import TrainConfig, apply_lora
from entropy_grpo.policies import load_policy
from entropy_grpo.probes import BatchConfig, ProbeComponents
from entropy_grpo.sequence_processor import GenerationConfig
from entropy_grpo.tasks import ArithmeticTask


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--E", type=int, default=16, help="|E| sequences")
    ap.add_argument("--B-U", type=int, default=2, help="prompts in U")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"# {platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}, float32, SmolLM2-135M-Instruct, "
          f"|E| {a.E}, U {a.B_U} × G {a.G}, max_new_tokens {a.max_new_tokens}, AdamW lr 1e-5, median of {a.repeats} after a warm-up")
    print("| parameters | trained | call s | score θ + θ⁺ s | update s | call / scoring | call / (scoring + update) "
          "| snapshot + restore s (share of call) |")
    print("|---|---|---|---|---|---|---|---|")
    for setup in ("all", "lora"):
        model, tok = load_policy(None)
        if setup == "lora": model = apply_lora(model, TrainConfig(lora_r=16))
        gen = GenerationConfig(max_new_tokens=a.max_new_tokens, num_generations=a.G)
        pc = ProbeComponents(model, tok, ArithmeticTask(), gen, BatchConfig(E_total_sequences=a.E, B_U=a.B_U, G=a.G, seed=0))
        E, U = pc.sample_E_batch(), pc.sample_U_batch_distinct()
        r = torch.arange(a.G, dtype=torch.float64).expand(a.B_U, a.G)    # stand-in rewards with group variance
        U = {**U, "rewards": r, "advantages": group_advantages(r)}
        params = list(trainable_parameters(model).values())
        opt = torch.optim.AdamW(params, lr=1e-5)
        probe = DeltaEntropyIS(model, gen, sequence_processor=pc.sp)
        outs = [probe.entropy_change_two_batch(model, E, U, opt) for _ in range(a.repeats + 1)][1:]
        m = {k: statistics.median(o[k] for o in outs) for k in
             ("seconds", "seconds_score_theta", "seconds_score_theta_plus", "seconds_update", "seconds_snapshot_restore")}
        scoring = m["seconds_score_theta"] + m["seconds_score_theta_plus"]
        print(f"| {setup} | {sum(p.numel() for p in params):,} | {m['seconds']:.2f} | {scoring:.2f} | {m['seconds_update']:.2f} "
              f"| {m['seconds'] / scoring:.2f}× | {m['seconds'] / (scoring + m['seconds_update']):.2f}× "
              f"| {m['seconds_snapshot_restore']:.3f} ({m['seconds_snapshot_restore'] / m['seconds']:.1%}) |")


if __name__ == "__main__":
    main()
