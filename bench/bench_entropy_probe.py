"""The entropy probe on SmolLM2-135M-Instruct: noise floor, signed gaps, qualifying lrs and the gap slope, per dtype.

`probes.run_mixed_probe` on the embedded policy with a δS adapter on q/k/v/o_proj (the Phase-2 template's basis) and a
fresh AdamW built as `train` builds it (the update is the training update: Dr.GRPO G·L_max, clipping at 1.0). E is the
student's own samples at the given top_p (prompts with replacement, the demo's single-digit sums with the hint), U
`--B-U` distinct prompts × G with the task's rewards (a group without reward variance gets the stand-in reward "shorter
is better", so every group moves θ). For each top_p and each scoring dtype the script prints the measured noise floor,
every lr's ΔH₁, ΔH_true (fixed-support and support-change parts), the signed gap ΔH_true_fixed − ΔH₁, whether it
clears 10× the floor, the slope fitted on the qualifying lrs, the verdict, and the probe's wall time — float64 / float32
is the cost ratio recorded in bench/README.md. Never asserts (tests/test_entropy_probe.py holds the slow test).

    python bench/bench_entropy_probe.py [--threads 2] [--top-p 1.0 0.95] [--dtypes float64 float32]
                                        [--lrs 3e-6 1e-5 3e-5 1e-4 3e-4] [--E 8] [--B-U 2] [--G 4] [--max-new-tokens 16]
"""
import argparse, copy, datetime, platform, time

import torch

from entropy_grpo.adapters import add_delta_s
from entropy_grpo.dr_grpo import group_advantages
from entropy_grpo.policies import load_policy
from entropy_grpo.probes import BatchConfig, ProbeComponents, run_mixed_probe
from entropy_grpo.sequence_processor import GenerationConfig
from entropy_grpo.tasks import ArithmeticTask
from entropy_grpo.training import TrainConfig


def batches(model, tok, top_p, a):
    "E (student samples, prompts with replacement) and U (distinct prompts, rewards with group variance)."
    gen = GenerationConfig(temperature=1.0, top_p=top_p, max_new_tokens=a.max_new_tokens, num_generations=a.G,
                           tf_batch_size=8)
    pc = ProbeComponents(model, tok, ArithmeticTask(seed=a.seed, max_value=9, ops="+"), gen,
                         BatchConfig(E_total_sequences=a.E, B_U=a.B_U, G=a.G, hint=True, seed=a.seed))
    pc.sp.progress = False
    E, U = pc.sample_E_batch(), pc.sample_U_batch_distinct()
    r = U["rewards"].double()
    flat = r.amax(1) == r.amin(1)
    lens = (U["attention_masks"][..., max(U["prompt_lens"]):] > 0).sum(-1).double()
    r[flat] = -lens[flat] / a.max_new_tokens                             # stand-in: shorter is better
    return pc.sp, E, {**U, "rewards": r, "advantages": group_advantages(r)}


def score_seconds(sp, E, dtype, repeats=3):
    "Median seconds of one teacher-forcing pass over E (log q, RB entropies) in the probe's copy in `dtype`."
    from entropy_grpo.policies import full_precision_norms
    from entropy_grpo.sequence_processor import SequenceProcessor, as_batched_sequences
    E, model = as_batched_sequences(E, "E"), copy.deepcopy(sp.model).to(getattr(torch, dtype))
    if dtype == "float64": full_precision_norms(model)                  # as the probe's copy
    s = SequenceProcessor(model, sp.tokenizer, sp.config, progress=False)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter(); s.teacher_force_logprobs(E); ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top-p", type=float, nargs="+", default=[1.0, 0.95])
    ap.add_argument("--dtypes", nargs="+", default=["float64", "float32"])
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-6, 1e-5, 3e-5, 1e-4, 3e-4])
    ap.add_argument("--E", type=int, default=8, help="|E| sequences")
    ap.add_argument("--B-U", type=int, default=2, help="prompts in U")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--max-extra-lrs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"# {datetime.date.today()}, {platform.machine()}, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}; SmolLM2-135M-Instruct + δS on q/k/v/o_proj, fresh AdamW, TrainConfig() update "
          f"(clip 1.0, G·L_max); |E| {a.E}, U {a.B_U} × G {a.G}, max_new_tokens {a.max_new_tokens}, T 1.0", flush=True)
    policy, tok = load_policy(None, device="cpu", dtype=torch.float32)
    summary = []
    for top_p in a.top_p:
        model = copy.deepcopy(policy)
        adapter = add_delta_s(model)
        sp, E, U = batches(model, tok, top_p, a)
        cfg = TrainConfig(learning_rate=max(a.lrs), num_generations=a.G, prompts_per_step=a.B_U)
        for dt in a.dtypes:
            opt = torch.optim.AdamW(adapter.parameters(), lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                    eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
            t = time.perf_counter()
            p = run_mixed_probe(sp, E, U, opt, lrs=a.lrs, train_config=cfg, dtype=dt, plot=False,
                                max_extra_lrs=a.max_extra_lrs)
            secs = time.perf_counter() - t
            draws = ", ".join(f"{d:+.1e}" for d in p["floor_diffs"])
            print(f"\n## top_p {top_p}, {p['dtype']}: floor {p['floor']:.2e} (draws {draws}), H_orig "
                  f"{p['H_orig']:.3f} nats/seq, grad norm {p['grad_norm']:.3g} (clip coef {p['clip_coef']:.3g}), "
                  f"{secs:.0f} s", flush=True)
            print(p["table"])
            print(f"slope {p['slope']:.3f} on qualifying lrs {p['qualifying_lrs']}; verdict: {p['verdict']} "
                  f"{p['detail']}", flush=True)
            print(f"one scoring pass of E in {dt}: {score_seconds(sp, E, dt):.2f} s (median of 3)", flush=True)
            summary.append((top_p, p["dtype"], p["floor"], len(p["qualifying_lrs"]), len(p["rows"]), p["slope"],
                            p["verdict"], secs))
    print("\n| top_p | dtype | floor | qualifying lrs | slope | verdict | seconds |\n|---|---|---|---|---|---|---|")
    for top_p, dt, fl, nq, n, sl, v, s in summary:
        print(f"| {top_p} | {dt} | {fl:.1e} | {nq}/{n} | {sl:.2f} | {v} | {s:.0f} |")
    for top_p in a.top_p:
        t = {dt: (s, n) for tp, dt, _, _, n, _, _, s in summary if tp == top_p}
        if {"float64", "float32"} <= set(t):
            print(f"top_p {top_p}: float64 / float32 probe wall time {t['float64'][0] / t['float32'][0]:.2f}× "
                  f"({t['float64'][1]} vs {t['float32'][1]} lrs)")


if __name__ == "__main__":
    main()
