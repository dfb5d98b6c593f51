"""Projection arms on the embedded default policy (SmolLM2-135M-Instruct), δS / LoRA on the attention projections:
per-step overhead of the projected arms relative to vanilla, what the adapters cost, and the SVD cache on first use.

    python bench/bench_projection.py [--reps 5] [--device cpu] [--threads N]

Every step is zero_grad → policy_gradient_backward (Dr.GRPO, one microbatch) → the arm's on_after_backward →
AdamW step, on the same synthetic batch, with the configurations interleaved and the median taken. Only ratios are
meant to be recorded (bench/README.md).
"""
import argparse, copy, statistics, tempfile, time
from types import SimpleNamespace

import torch

from entropy_grpo.dr_grpo import group_advantages, policy_gradient_backward
from entropy_grpo.policies import load_policy
from entropy_grpo.adapters import add_delta_s, add_lora, clear_svd_cache, tensor_hash
from entropy_grpo.pairs import planted_pairs
from entropy_grpo.projection_arms import ProjectionArm, extract_v_hack, random_v_hack
from entropy_grpo.sequence_processor import BatchedSequences, GenerationConfig, SequenceProcessor

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def synthetic_batch(tok, B, G, P, L, seed=0):
    "[B, G, P + L] random non-special tokens: a P-token prompt per row and L-token completions."
    gen = torch.Generator().manual_seed(seed)
    special = torch.tensor(sorted(tok.all_special_ids))
    seqs = torch.randint(0, len(tok), (B, G, P + L), generator=gen)
    seqs[torch.isin(seqs, special)] = len(tok) - 1
    seqs[:, :, :P] = seqs[:, :1, :P]                          # the G completions of a prompt share it
    return BatchedSequences(seqs, torch.ones_like(seqs), [P] * B, torch.full((B, G), L))


def timed(fn, sync):
    sync(); t = time.perf_counter(); fn(); sync()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--k", type=int, default=4, help="v_hack directions per module")
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--completion-len", type=int, default=64)
    a = ap.parse_args()
    if a.threads: torch.set_num_threads(a.threads)
    base, tok = load_policy(device=a.device)
    dev = next(base.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cfg = GenerationConfig(max_new_tokens=a.completion_len, num_generations=a.G, tf_batch_size=a.B * a.G)
    U = synthetic_batch(tok, a.B, a.G, a.prompt_len, a.completion_len)
    adv = group_advantages(torch.randn(a.B, a.G, generator=torch.Generator().manual_seed(1)))
    print(f"# {torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}, torch threads {torch.get_num_threads()}, "
          f"batch B={a.B} G={a.G} prompt {a.prompt_len} + completion {a.completion_len} tokens, k={a.k}, LoRA r={a.lora_r}")

    # SVD cache on first use: cold (hash + SVD), memory hit, disk write, disk hit; hashing alone
    weights = [m.weight for n, m in base.named_modules() if n.endswith(ATTN)]
    t_hash = timed(lambda: [tensor_hash(w) for w in weights], sync)
    clear_svd_cache()
    models = {}
    t_cold = timed(lambda: models.__setitem__("ds", add_delta_s(copy.deepcopy(base), ATTN)), sync)
    t_mem = timed(lambda: add_delta_s(copy.deepcopy(base), ATTN), sync)
    t_copy = timed(lambda: copy.deepcopy(base), sync)
    with tempfile.TemporaryDirectory() as d:
        clear_svd_cache()
        t_disk_write = timed(lambda: add_delta_s(copy.deepcopy(base), ATTN, cache_dir=d), sync)
        clear_svd_cache()
        t_disk = timed(lambda: add_delta_s(copy.deepcopy(base), ATTN, cache_dir=d), sync)

    ds = models["ds"]
    ds_plain = add_delta_s(copy.deepcopy(base), ATTN)
    lora = add_lora(copy.deepcopy(base), ATTN, r=a.lora_r)
    lora_plain = add_lora(copy.deepcopy(base), ATTN, r=a.lora_r)
    full = copy.deepcopy(base).train()
    for p in full.parameters(): p.requires_grad_(True)

    pairs, _ = planted_pairs(tok, n_pairs=max(a.k, 4), seed=0)
    sp_ds = SequenceProcessor(ds.model, tok, cfg, progress=False)
    t_extract = timed(lambda: models.__setitem__("vh", extract_v_hack(sp_ds, ds, pairs, k=a.k)), sync) / pairs.shape[0]
    vh = models["vh"]

    def stepper(model, params, arm=None):
        sp = SequenceProcessor(model, tok, cfg, progress=False)
        opt = torch.optim.AdamW(params, lr=1e-6)
        def step():
            opt.zero_grad(set_to_none=False)
            policy_gradient_backward(sp, U, adv)
            if arm is not None: arm.on_after_backward(SimpleNamespace(model=model, optimizer=opt, sp=sp, batch=U))
            opt.step()
        return step

    configs = {
        "delta_s, no callback": stepper(ds_plain.model, ds_plain.parameters()),
        "delta_s, vanilla arm": stepper(ds.model, ds.parameters(), ProjectionArm("vanilla", ds, vh)),
        "delta_s, projected arm": stepper(ds.model, ds.parameters(), ProjectionArm("projected", ds, vh)),
        "lora, no callback": stepper(lora_plain.model, lora_plain.parameters()),
        "lora, projected_lora arm": stepper(lora.model, lora.parameters(), ProjectionArm("projected_lora", lora, random_v_hack(lora, a.k))),
        "full fine-tune, no adapter": stepper(full, list(full.parameters())),
    }
    ids, am = U.sequences.flatten(0, 1).to(dev), U.attention_masks.flatten(0, 1).to(dev)
    def forward(model):
        with torch.no_grad(): model(input_ids=ids, attention_mask=am)
    def forward_zeroed():
        with ds.zeroed(): forward(ds.model)
    configs["forward, base (delta_s zeroed)"] = forward_zeroed
    configs["forward, delta_s"] = lambda: forward(ds.model)

    times = {k: [] for k in configs}
    for fn in configs.values(): fn()                            # warm-up
    for _ in range(a.reps):
        for k, fn in configs.items(): times[k].append(timed(fn, sync))
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items(): print(f"{k:34s} {v:8.3f} s  (min {min(times[k]):.3f})")
    step = med["delta_s, vanilla arm"]
    ratios = [
        ("projected δS step / vanilla δS step (goal <= 1.10)", med["delta_s, projected arm"] / step),
        ("projected δS step / δS step without callback", med["delta_s, projected arm"] / med["delta_s, no callback"]),
        ("vanilla arm (measuring only) / δS step without callback", step / med["delta_s, no callback"]),
        ("projected_lora step / LoRA step without callback", med["lora, projected_lora arm"] / med["lora, no callback"]),
        ("δS step / LoRA step (both without callback)", med["delta_s, no callback"] / med["lora, no callback"]),
        ("δS step / full fine-tune step", med["delta_s, no callback"] / med["full fine-tune, no adapter"]),
        ("δS forward / base forward (the δS path)", med["forward, delta_s"] / med["forward, base (delta_s zeroed)"]),
        ("SVD first use: add_delta_s cold (hash + SVD) / vanilla δS step", (t_cold - t_copy) / step),
        ("SVD memory-cache hit / cold", (t_mem - t_copy) / (t_cold - t_copy)),
        ("SVD disk-cache write (cold + write) / cold", (t_disk_write - t_copy) / (t_cold - t_copy)),
        ("SVD disk-cache hit / cold", (t_disk - t_copy) / (t_cold - t_copy)),
        (f"hashing the {len(weights)} weights / cold", t_hash / (t_cold - t_copy)),
        ("extract_v_hack per pair / vanilla δS step", t_extract / step),
    ]
    print(f"\n# threads {torch.get_num_threads()}, seconds: cold add_delta_s {t_cold - t_copy:.2f} "
          f"(model copy {t_copy:.2f} subtracted), vanilla δS step {step:.2f}")
    for name, r in ratios: print(f"{name:62s} {r:7.3f}")


if __name__ == "__main__":
    main()
