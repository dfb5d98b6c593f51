"""Per-sample gradient contributions: batched methods vs one backward per sample.

For one mixed replay group (4 teacher + 4 base samples, prompts of different lengths) and a LoRA adapter
(r=8 on q_proj/v_proj), times `sample_contributions` with method="loop" (one backward per sample through the shared
forward, the naive reference), "vmap" (one vectorised backward, is_grads_batched) and "hooks" (one ordinary backward,
per-sample Linear gradients from activations × output gradients), and nb 03's `policy_gradient_backward` (the batch
gradient alone: the floor). Prints ratios loop / method and the largest difference to the loop; never asserts time.

    python bench/bench_contrib.py [--threads 1] [--repeats 5] [--max-new-tokens 48] [--no-smollm2]
"""
import argparse, platform, statistics, tempfile, time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from entropy_grpo.contributions import sample_contributions
from entropy_grpo.pools import build_pool, mixed_records, replay_batch
from entropy_grpo.dr_grpo import policy_gradient_backward
from entropy_grpo.policies import load_policy, tiny_policy
from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor
from entropy_grpo.tasks import ArithmeticTask

METHODS = ("loop", "vmap", "hooks")


def timed(f, repeats):
    "Median wall time of f() over `repeats` runs after one warm-up run; returns (seconds, last result)."
    out, ts = f(), []
    for _ in range(repeats):
        t = time.perf_counter(); out = f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts), out


def bench(name, model, tok, cfg, repeats, k=4):
    lora = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights=False))
    sp = SequenceProcessor(lora, tok, cfg)
    task = ArithmeticTask(50)
    with tempfile.TemporaryDirectory() as d:
        pools = [build_pool(sp, task, hint, 1, k, Path(d)/n) for n, hint in (("teacher", True), ("base", False))]
    seqs = replay_batch(mixed_records(pools, 0, k), tok)
    adv = torch.tensor([[1.0] * k + [-1.0] * k])                  # timing does not depend on the values
    n_par = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    res = {m: timed(lambda m=m: sample_contributions(sp, seqs, lora, adv, method=m), repeats) for m in METHODS}
    def batch_grad():
        lora.zero_grad(); policy_gradient_backward(sp, seqs, adv, length_norm="sample")
    t_batch, _ = timed(batch_grad, repeats)
    lora.zero_grad()
    ref = res["loop"][1].grads
    diff = {m: max(float((res[m][1].grads[p] - ref[p]).abs().max()) for p in ref) for m in METHODS}
    scale = max(float(g.abs().max()) for g in ref.values())
    t_loop = res["loop"][0]
    return dict(name=name, n=seqs.shape[1], T=seqs.shape[2], P=seqs.prompt_lens[0], D=n_par, batch=t_batch,
                **{m: res[m][0] for m in METHODS}, **{f"ratio_{m}": t_loop / res[m][0] for m in METHODS},
                **{f"diff_{m}": diff[m] / scale for m in METHODS})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--no-smollm2", action="store_true", help="tiny policy only")
    a = ap.parse_args()
    if a.threads: torch.set_num_threads(a.threads)
    cfg = GenerationConfig(max_new_tokens=a.max_new_tokens, temperature=0.8, top_p=0.95, seed=0)
    rows = [bench("tiny policy", *tiny_policy(0), cfg, a.repeats)]
    if not a.no_smollm2: rows.append(bench("SmolLM2-135M-Instruct", *load_policy(device="cpu"), cfg, a.repeats))
    print(f"machine: {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), float32, median of {a.repeats}")
    print("| policy | n | T (P) | adapter params | loop s | vmap s (loop/vmap) | hooks s (loop/hooks) | batch grad only s | max rel diff vs loop (vmap, hooks) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['n']} | {r['T']} ({r['P']}) | {r['D']:,} | {r['loop']:.3f} | {r['vmap']:.3f} ({r['ratio_vmap']:.2f}×) "
              f"| {r['hooks']:.3f} ({r['ratio_hooks']:.2f}×) | {r['batch']:.3f} | {r['diff_vmap']:.1e}, {r['diff_hooks']:.1e} |")


if __name__ == "__main__":
    main()
