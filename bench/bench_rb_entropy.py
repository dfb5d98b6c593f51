"""RB entropy and kept set: the top-k window fast paths vs their full-sort references and vs the full-vocabulary floor.

On logits [N, V] of two kinds,

* `smollm2`: SmolLM2-135M-Instruct's own logits at N positions of text it sampled (T 0.7, top_p 0.95; `sampled.py`),
  V = 49152 — what teacher forcing meets in training;
* `gauss`: a standard gaussian times a per-row scale spread over [2, 8], V = 49152 (SmolLM2's vocabulary) and 151936
  (Qwen's) — far flatter than a language model's (nuclei of up to tens of thousands of tokens), a stress case,

times

* `rb_entropy` (fast: growing top-k windows, never sorts the vocabulary) against `naive_rb_entropy` (sorts every
  row, as transformers' TopPLogitsWarper does) and against the floor, a plain full-vocabulary entropy of the same
  logits (`log_softmax`, one pass), forward alone and forward + backward of the sum;
* `sampling_mask` against `naive_sampling_mask` (forward only: it is a bool mask),

for top_p in {0.9, 0.95, 1.0} and temperature in {0.7, 1.0}. Each figure is the median of --repeats runs (one warm-up
per logits first), the implementations interleaved; the script prints naive / fast and fast / floor, the largest
absolute difference of the entropies and of their gradients (float32 rounding, ~1e-6) over the rows whose kept sets
agree, and how many mask entries differ (expected 0; a row whose nucleus mass lands within float32 rounding of top_p
can differ by its crossing token, because the naive cumsum is float32 and the fast tail sums are float64). Never
asserts on time.

    python bench/bench_rb_entropy.py [--threads 1] [--repeats 2] [--N 256] [--logits smollm2 gauss]
                                     [--V 49152 151936] [--top-p 0.9 0.95 1.0] [--temperature 0.7 1.0] [--seed 0]
"""
import argparse, os, platform, statistics, sys, time

import torch

from entropy_grpo.rb_entropy import naive_rb_entropy, naive_sampling_mask, rb_entropy, sampling_mask


def lm_like_logits(N, V, seed=0, lo=2., hi=8.):
    "[N, V] float32: N(0, 1) per entry times a per-row scale evenly spread over [lo, hi] (shuffled)."
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(lo, hi, N)[torch.randperm(N, generator=g)]
    return torch.randn(N, V, generator=g) * scale[:, None]


def smollm2_logits(N, seed=0):
    "[N, 49152] SmolLM2 logits predicting the N tokens it sampled after chat prompts (N/128 sequences of 128)."
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sampled import sample_sequences
    from entropy_grpo.policies import load_policy
    model, tok = load_policy(None)
    n = -(-N // 128)
    seqs = sample_sequences(model, tok, n, 32, 128, seed=seed)
    with torch.no_grad(): return model(input_ids=seqs).logits[:, 31:-1].reshape(-1, model.config.vocab_size)[:N].contiguous()


def full_entropy(x, T, p=None):
    "The floor: entropy of softmax(x / T) over the whole vocabulary (top_p ignored)."
    logp = (x / T).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def interleaved(fns:dict, repeats:int) -> dict:
    "{name: (median seconds, last result)}: `repeats` rounds running every fn once per round (warm up beforehand)."
    out, ts = {}, {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter(); out[k] = f(); ts[k].append(time.perf_counter() - t)
    return {k: (statistics.median(ts[k]), out[k]) for k in fns}


def fwd(f, x, T, p):
    def run():
        with torch.no_grad(): return f(x, T, p)
    return run


def fwd_bwd(f, x, T, p):
    def run():
        xg = x.detach().requires_grad_(True)
        H = f(xg, T, p)
        H.sum().backward()
        return H.detach(), xg.grad
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds per configuration (2: ~5 min on 2 vCPUs)")
    ap.add_argument("--N", type=int, default=256, help="positions (rows)")
    ap.add_argument("--logits", nargs="+", choices=["smollm2", "gauss"], default=["smollm2", "gauss"])
    ap.add_argument("--V", type=int, nargs="+", default=[49152, 151936], help="vocabulary sizes of the gauss logits")
    ap.add_argument("--top-p", type=float, nargs="+", default=[0.9, 0.95, 1.0])
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cases = ([("smollm2", smollm2_logits(a.N, a.seed))] if "smollm2" in a.logits else []) + \
            ([("gauss", lm_like_logits(a.N, V, a.seed)) for V in a.V] if "gauss" in a.logits else [])
    print(f"# {platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"N={a.N}, float32, median of {a.repeats}")
    print("| logits | V | top_p | T | kept tokens median (max) | H fwd: naive / fast | fast / floor "
          "| H fwd+bwd: naive / fast | fast / floor | mask: naive / fast "
          "| max abs diff H, ∇H (rows with equal masks); mask entries differing |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, x in cases:
        V = x.shape[-1]
        for f in (naive_rb_entropy, rb_entropy, full_entropy): fwd_bwd(f, x, a.temperature[0], min(a.top_p))()   # warm-up
        for f in (naive_sampling_mask, sampling_mask): fwd(f, x, a.temperature[0], min(a.top_p))()
        for p in a.top_p:
            for T in a.temperature:
                r = interleaved({k: fwd(f, x, T, p) for k, f in
                                 (("naive", naive_rb_entropy), ("fast", rb_entropy), ("floor", full_entropy))}, a.repeats)
                rb = interleaved({k: fwd_bwd(f, x, T, p) for k, f in
                                  (("naive", naive_rb_entropy), ("fast", rb_entropy), ("floor", full_entropy))}, a.repeats)
                rm = interleaved({"naive": fwd(naive_sampling_mask, x, T, p), "fast": fwd(sampling_mask, x, T, p)}, a.repeats)
                keep = rm["naive"][1].sum(-1).float()
                split = (rm["naive"][1] != rm["fast"][1]).any(-1)                # rows whose kept sets differ
                dH = float((r["naive"][1] - r["fast"][1])[~split].abs().max())
                dG = float((rb["naive"][1][1] - rb["fast"][1][1])[~split].abs().max())
                dM = int((rm["naive"][1] != rm["fast"][1]).sum())
                ratio = lambda d, a, b: f"{d[a][0] / d[b][0]:.1f}× ({d[a][0]:.3f} / {d[b][0]:.3f} s)"
                print(f"| {kind} | {V} | {p} | {T} | {keep.median():.0f} ({keep.max():.0f}) | {ratio(r, 'naive', 'fast')} "
                      f"| {ratio(r, 'fast', 'floor')} | {ratio(rb, 'naive', 'fast')} | {ratio(rb, 'fast', 'floor')} "
                      f"| {ratio(rm, 'naive', 'fast')} | {dH:.1e}, {dG:.1e}, {dM} in {int(split.sum())} rows |", flush=True)


if __name__ == "__main__":
    main()
