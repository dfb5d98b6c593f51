"""RB entropy and kept set: the fast paths vs their full-sort references, a full-vocabulary entropy, and TRL.

On logits [N, V] of two kinds,

* `smollm2`: SmolLM2-135M-Instruct's own logits at N positions of text it sampled (T 0.7, top_p 0.95; `sampled.py`),
  V = 49152 — what teacher forcing meets in training;
* `gauss`: a standard gaussian times a per-row scale spread over [2, 8], V = 49152 (SmolLM2's vocabulary) and 151936
  (Qwen's) — far flatter than a language model's (nuclei of up to tens of thousands of tokens), a stress case,
* `flat`: a standard gaussian times one σ for every row (`--sigma`, default 1.5 and 2.5), the same two vocabularies —
  what random or barely trained heads give at T 1.0: nuclei of most of the vocabulary,

times

* `rb_entropy` (fast: top-k windows for narrow nuclei, a histogram search for wide ones; never sorts the vocabulary)
  against `naive_rb_entropy` (sorts every row, as transformers' TopPLogitsWarper does) and against the reference, a
  plain full-vocabulary entropy of the same logits (`(x / T).log_softmax(-1)`, then −Σ p log p: what entropy costs
  when the truncation is ignored), forward alone and forward + backward of the sum;
* `sampling_mask` against `naive_sampling_mask` (forward only: it is a bool mask);
* peer table: TRL's `entropy_from_logits` and `selective_log_softmax` (full vocabulary only: what GRPO users run
  today) against the reference, and `rb_entropy` / `sampling_logprobs` at each top_p < 1 against them (skipped with a
  note when trl is not installed: `pip install -e .[bench]`),

for top_p in {0.9, 0.95, 1.0} and temperature in {0.7, 1.0}. Each figure is the median of --repeats runs (one warm-up
per logits first), the implementations interleaved; the script prints the ratios with their median seconds, the
largest absolute difference of the entropies and of their gradients (float32 rounding, ~1e-6) over the rows whose
kept sets agree, and how many mask entries differ (a row whose nucleus mass lands within float32 rounding of top_p can
differ by its crossing token: the naive cumsum is float32 like the warper's, the fast sums float64). Never asserts on
time.

    python bench/bench_rb_entropy.py [--threads 1] [--repeats 5] [--N 256] [--logits smollm2 gauss flat]
                                     [--V 49152 151936] [--sigma 1.5 2.5] [--top-p 0.9 0.95 1.0]
                                     [--temperature 0.7 1.0] [--seed 0]
"""
import argparse, os, platform, statistics, sys, time

import torch

from entropy_grpo.rb_entropy import (naive_rb_entropy, naive_sampling_mask, rb_entropy, sampling_logprobs,
                                     sampling_mask)


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
    "The reference: entropy of softmax(x / T) over the whole vocabulary (top_p ignored)."
    logp = (x / T).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def interleaved(fns:dict, repeats:int) -> dict:
    "{name: (median seconds, last result)}: `repeats` rounds running every fn once per round (warm up beforehand)."
    out, ts = {}, {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter(); out[k] = f(); ts[k].append(time.perf_counter() - t)
    return {k: (statistics.median(ts[k]), out[k]) for k in fns}


def fwd(f, *args):
    def run():
        with torch.no_grad(): return f(*args)
    return run


def fwd_bwd(f, x, T, p):
    def run():
        xg = x.detach().requires_grad_(True)
        H = f(xg, T, p)
        H.sum().backward()
        return H.detach(), xg.grad
    return run


def ratio(d, a, b): return f"{d[a][0] / d[b][0]:.2f}× ({d[a][0]:.3f} / {d[b][0]:.3f} s)"


def main_table(cases, a):
    print("| logits | V | threads | top_p | T | kept tokens median (max) | H fwd: naive / fast | **fast / reference** "
          "| H fwd+bwd: naive / fast | fast / reference | mask: naive / fast "
          "| max abs diff H, ∇H (rows with equal masks); mask entries differing |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, x in cases:
        for f in (naive_rb_entropy, rb_entropy, full_entropy): fwd_bwd(f, x, a.temperature[0], min(a.top_p))()
        for f in (naive_sampling_mask, sampling_mask): fwd(f, x, a.temperature[0], min(a.top_p))()
        for p in a.top_p:
            for T in a.temperature:
                impl = (("naive", naive_rb_entropy), ("fast", rb_entropy), ("ref", full_entropy))
                r = interleaved({k: fwd(f, x, T, p) for k, f in impl}, a.repeats)
                rb = interleaved({k: fwd_bwd(f, x, T, p) for k, f in impl}, a.repeats)
                rm = interleaved({"naive": fwd(naive_sampling_mask, x, T, p), "fast": fwd(sampling_mask, x, T, p)},
                                 a.repeats)
                keep = rm["naive"][1].sum(-1).float()
                split = (rm["naive"][1] != rm["fast"][1]).any(-1)                # rows whose kept sets differ
                dH = float((r["naive"][1] - r["fast"][1])[~split].abs().max())
                dG = float((rb["naive"][1][1] - rb["fast"][1][1])[~split].abs().max())
                dM = int((rm["naive"][1] != rm["fast"][1]).sum())
                print(f"| {kind} | {x.shape[-1]} | {a.threads} | {p} | {T} | {keep.median():.0f} ({keep.max():.0f}) "
                      f"| {ratio(r, 'naive', 'fast')} | {ratio(r, 'fast', 'ref')} | {ratio(rb, 'naive', 'fast')} "
                      f"| {ratio(rb, 'fast', 'ref')} | {ratio(rm, 'naive', 'fast')} "
                      f"| {dH:.1e}, {dG:.1e}, {dM} in {int(split.sum())} rows |", flush=True)


def peer_table(cases, a):
    "TRL's full-vocabulary entropy and log p against the reference; ours (truncated) against TRL's."
    try: from trl.trainer.utils import entropy_from_logits, selective_log_softmax
    except ImportError:
        print("\n(TRL peer table skipped: trl is not installed; `pip install -e .[bench]` adds it)")
        return
    import trl
    print(f"\nPeer: TRL {trl.__version__} `entropy_from_logits` (H) and `selective_log_softmax` (log p), full "
          f"vocabulary, forward; tokens = each row's most probable one\n")
    print("| logits | V | threads | T | TRL H / reference | TRL log p / reference | top_p | rb_entropy / TRL H "
          "| sampling_logprobs / TRL log p |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, x in cases:
        tok = x.argmax(-1)
        for T in a.temperature:
            fns = {"ref": fwd(full_entropy, x, T), "trl_H": fwd(lambda: entropy_from_logits(x / T)),
                   "trl_lp": fwd(lambda: selective_log_softmax(x, tok, T))}
            for p in [p for p in a.top_p if p < 1]:
                fns |= {f"H{p}": fwd(rb_entropy, x, T, p), f"lp{p}": fwd(sampling_logprobs, x, tok, T, p)}
            for f in fns.values(): f()                                             # warm-up
            r = interleaved(fns, a.repeats)
            for p in [p for p in a.top_p if p < 1]:
                print(f"| {kind} | {x.shape[-1]} | {a.threads} | {T} | {ratio(r, 'trl_H', 'ref')} "
                      f"| {ratio(r, 'trl_lp', 'ref')} | {p} | {ratio(r, f'H{p}', 'trl_H')} "
                      f"| {ratio(r, f'lp{p}', 'trl_lp')} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per configuration (median)")
    ap.add_argument("--N", type=int, default=256, help="positions (rows)")
    ap.add_argument("--logits", nargs="+", choices=["smollm2", "gauss", "flat"], default=["smollm2", "gauss", "flat"])
    ap.add_argument("--sigma", type=float, nargs="+", default=[1.5, 2.5], help="the flat logits' σ (one per case)")
    ap.add_argument("--V", type=int, nargs="+", default=[49152, 151936], help="vocabulary sizes of the gauss logits")
    ap.add_argument("--top-p", type=float, nargs="+", default=[0.9, 0.95, 1.0])
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-peer", action="store_true", help="skip the TRL peer table")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cases = ([("smollm2", smollm2_logits(a.N, a.seed))] if "smollm2" in a.logits else []) + \
            ([("gauss", lm_like_logits(a.N, V, a.seed)) for V in a.V] if "gauss" in a.logits else []) + \
            ([(f"flat σ {s}", lm_like_logits(a.N, V, a.seed, s, s)) for V in a.V for s in a.sigma]
             if "flat" in a.logits else [])
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, N={a.N}, float32, median of {a.repeats}, "
          f"load average at start {os.getloadavg()[0]:.1f}\n")
    main_table(cases, a)
    if not a.no_peer: peer_table(cases, a)
    print(f"\n# load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
