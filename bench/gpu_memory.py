"""Peak GPU memory of each phase at Qwen3-4B's exact shapes (random bf16 weights), beside `entropy-grpo plan`'s estimate.

The model is built from its config straight on the GPU (no download; random weights, std 0.02). Sampling runs at
temperature 0.25 so that random weights give a peaked next-token distribution, as a trained model's is (at 1.0 they
give a near-uniform one whose top-p set is most of the 151,936 tokens). Per phase the script resets CUDA's peak
counter, runs the package's own code at the plan's shape, and prints the peak minus what was allocated before the
phase (the weights and adapter), beside the plan's figure for the same terms:

* generation: one `generate` call of 258 sequences, 148 + 512 tokens (no early EOS: min_new_tokens = max_new_tokens);
* training step: LoRA r 64, checkpointing on, one Dr.GRPO backward microbatch of 12 sequences + the AdamW step;
* entropy probe: δS on q/k/v/o, `run_mixed_probe` at Phase 2's shape (|E| = 32, U = 2 × 8, 8 sequences per float64
  pass) with one lr and one floor draw (more lrs repeat the same passes: the peak does not grow).

    python bench/gpu_memory.py [--model Qwen/Qwen3-4B] [--phases generation,training,probe] [--out gpu.json]
"""
import argparse, ast, dataclasses, json, time

import torch

from entropy_grpo.adapters import add_delta_s, add_lora
from entropy_grpo.dr_grpo import group_advantages, policy_gradient_backward
from entropy_grpo.phase2_run import PROBE_TF_BATCH, Phase2Config
from entropy_grpo.plan import TARGETS, meta_model, model_config, model_shape, plan_phases, run_shape
from entropy_grpo.policies import set_checkpointing, tiny_tokenizer
from entropy_grpo.probes import run_mixed_probe
from entropy_grpo.sequence_processor import BatchedSequences, GenerationConfig, SequenceProcessor, make_probe_batch
from entropy_grpo.training import TrainConfig, build_optimizer

TEMPERATURE = 0.25


def build(name, dev):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(dev): m = AutoModelForCausalLM.from_config(model_config(name), dtype=torch.bfloat16)
    return m


def random_batch(B, G, P, N, V, dev, seed):
    "Random ids from the vocabulary's upper half (no EOS or pad): B prompts × G completions of P + N tokens."
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(V // 2, V, (B, G, P + N), generator=g)
    ids[:, :, :P] = ids[:, :1, :P]                                   # a group shares its prompt
    return BatchedSequences(ids.to(dev), torch.ones_like(ids).to(dev), [P] * B, torch.full((B, G), N))


def peak(fn, dev):
    "(result, GB the call added at its peak over what was allocated before it (NaN off CUDA), seconds)."
    if dev.type != "cuda":
        t0 = time.perf_counter(); out = fn()
        return out, float("nan"), time.perf_counter() - t0
    torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    base, t0 = torch.cuda.memory_allocated(), time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / 1e9, time.perf_counter() - t0


def generation(name, run, dev):
    m = build(name, dev)
    n = min(max(1, run.gen_batch_size // run.G), run.prompts_per_step) * run.G
    ids = torch.randint(m.config.vocab_size // 2, m.config.vocab_size, (n, run.prompt_len), device=dev)
    f = lambda: m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=0.95,
                           temperature=TEMPERATURE, max_new_tokens=run.max_new_tokens,
                           min_new_tokens=run.max_new_tokens, pad_token_id=0)
    with torch.no_grad(): out, gb, s = peak(f, dev)
    return dict(gb=gb, seconds=s, sequences=n, tokens=int(out.shape[1]))


def training(name, run, dev, tok):
    m = build(name, dev)
    la = add_lora(m, list(TARGETS), r=run.lora_r)
    set_checkpointing(m); m.train()
    gen = GenerationConfig(max_new_tokens=run.max_new_tokens, num_generations=run.G, temperature=TEMPERATURE,
                           tf_batch_size=run.tf_batch_size, head_chunk_size=run.head_chunk_size)
    B = max(1, run.tf_batch_size // run.G)                         # one microbatch: the plan's peak
    seqs = random_batch(B, run.G, run.prompt_len, run.max_new_tokens, m.config.vocab_size, dev, 1)
    opt = build_optimizer(la.parameters(), TrainConfig(learning_rate=1e-5))
    def step():
        policy_gradient_backward(SequenceProcessor(m, tok, gen, progress=False), seqs,
                                 torch.randn(B, run.G, device=dev))
        opt.step()
    _, gb, s = peak(step, dev)
    return dict(gb=gb, seconds=s, sequences=B * run.G)


def probe(name, run, dev, tok):
    c = Phase2Config()
    m = build(name, dev)
    t0 = time.perf_counter(); ad = add_delta_s(m, list(TARGETS)); svd_s = time.perf_counter() - t0
    gen = GenerationConfig(max_new_tokens=run.max_new_tokens, num_generations=c.G, temperature=TEMPERATURE,
                           top_p=c.top_p, tf_batch_size=PROBE_TF_BATCH)
    sp = SequenceProcessor(m, tok, gen, progress=False)
    V, P, N = m.config.vocab_size, run.prompt_len, run.max_new_tokens
    E = random_batch(run.probe_E // c.G, c.G, P, N, V, dev, 2)
    U_seqs = random_batch(c.B_U, c.G, P, N, V, dev, 3)
    r = torch.rand(c.B_U, c.G, generator=torch.Generator().manual_seed(4)).round().to(dev)
    U = make_probe_batch(U_seqs, r, group_advantages(r), max_new_tokens=N)
    tc = TrainConfig(prompts_per_step=c.B_U, num_generations=c.G, learning_rate=1e-4, generation=gen)
    opt = build_optimizer(ad.parameters(), tc)
    res, gb, s = peak(lambda: run_mixed_probe(sp, E, U, opt, lrs=[1e-4], plot=False, train_config=tc, floor_draws=1,
                                              max_extra_lrs=0), dev)
    return dict(gb=gb, seconds=s, svd_seconds=svd_s, deltaH_true=res["rows"][0]["deltaH_true"],
                deltaH1=res["rows"][0]["deltaH1"], floor=res["floor"], ess=res["rows"][0]["ess"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen/Qwen3-4B")
    ap.add_argument("--phases", default="generation,training,probe")
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (no memory figures)")
    ap.add_argument("-p", dest="params", action="append", default=[], help="plan parameter k=v (e.g. max_new_tokens=32)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    name, run = run_shape(dict(preset="full", model=a.model, **{k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in a.params)}))
    tok = tiny_tokenizer()
    est = {r["phase"]: r for r in plan_phases(model_shape(meta_model(name), run.lora_r), run)}
    est["probe"] = est.pop("entropy probe"); est["training"] = est.pop("training step")
    out = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__, model=name, run=dataclasses.asdict(run))
    for ph in a.phases.split(","):
        r = dict(generation=lambda: generation(name, run, dev), training=lambda: training(name, run, dev, tok),
                 probe=lambda: probe(name, run, dev, tok))[ph]()
        e = est[ph]
        r.update(plan_gb=(e["bytes"] - e["weights"]) / 1e9, plan_total_gb=e["bytes"] / 1e9)
        r["ratio"] = r["gb"] / r["plan_gb"]
        out[ph] = r
        print(f"{ph}: measured {r['gb']:.2f} GB over the weights, plan {r['plan_gb']:.2f} GB (ratio {r['ratio']:.2f}); "
              f"{r['seconds']:.1f} s; {json.dumps({k: v for k, v in r.items() if k not in ('gb', 'plan_gb')})}",
              flush=True)
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f: json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
