"""teacher_force_logprobs (log q + RB entropy at top_p 0.95) vs a forward with the LM head on the completion only.

Two baselines: `head`, the decoder forward then `lm_head(hidden[:, completion positions])` — what a careful user
writes to get the completion's logits — and `bare`, the plain model forward returning the logits of every position.
Time and peak memory ratios on the embedded SmolLM2-135M at T = 256 (8 sequences: 32 prompt + 224 completion tokens).
The sequences are sampled from SmolLM2 itself at T 0.7, top_p 0.95 (`sampled.py`; what GRPO scores), or with
`--tokens random` uniformly random ids (a worst case: the model's nuclei then hold thousands of tokens). Each variant
runs in a fresh process; peak memory = highest RSS above the RSS just before the call, sampled every millisecond (CPU)
or torch.cuda.max_memory_allocated (GPU). Prints ratios; never asserts.
  python bench/bench_teacher_forcing.py [--tokens sampled|random] [--threads N] [--device cuda] [--dtype bfloat16]
"""
import argparse, json, os, subprocess, sys, tempfile, threading, time


def rss_mb():
    with open("/proc/self/statm") as f: return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


B, G, P, L = 1, 8, 32, 224


def make_sequences(kind, path):
    "Save [B, G, P + L] token ids to path: sampled from SmolLM2, or uniformly random (never EOS)."
    import torch
    from entropy_grpo.policies import load_policy
    model, tok = load_policy(None)
    if kind == "sampled":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from sampled import sample_sequences
        seqs = sample_sequences(model, tok, G, P, L)
    else:
        seqs = torch.randint(0, model.config.vocab_size, (G, P + L), generator=torch.Generator().manual_seed(0))
        seqs[seqs == tok.eos_token_id] = 5
    torch.save(seqs.view(B, G, P + L), path)


def child(variant, device, dtype, reps, path, threads):
    import torch
    if threads: torch.set_num_threads(threads)
    from entropy_grpo.policies import load_policy
    from entropy_grpo.sequence_processor import BatchedSequences, GenerationConfig, SequenceProcessor
    model, tok = load_policy(None, device=device, dtype=dtype)
    seqs = torch.load(path)
    bs = BatchedSequences(seqs, torch.ones_like(seqs), [P], torch.full((B, G), L))
    sp = SequenceProcessor(model, tok, GenerationConfig(temperature=0.7, top_p=0.95))   # default chunks
    ids, am = seqs.view(B * G, -1).to(device), torch.ones(B * G, P + L, dtype=torch.long, device=device)
    def run():
        with torch.no_grad():
            if variant == "bare": return model(input_ids=ids, attention_mask=am).logits
            if variant == "head":
                hidden = model.get_decoder()(input_ids=ids, attention_mask=am).last_hidden_state
                return model.get_output_embeddings()(hidden[:, P - 1:-1])        # logits predicting the completion
            return sp.teacher_force_logprobs(bs)[0]
    run()                                                # warm-up
    cuda = device == "cuda"
    if cuda: torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    peak, stop, base_rss = [0.0], [False], rss_mb()
    def sample():
        while not stop[0]: peak[0] = max(peak[0], rss_mb() - base_rss); time.sleep(0.001)
    th = threading.Thread(target=sample); th.start()
    times = []
    for _ in range(reps):
        t = time.perf_counter(); out = run()
        if cuda: torch.cuda.synchronize()
        times.append(time.perf_counter() - t); del out
    stop[0] = True; th.join()
    mem = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else peak[0]
    times.sort()
    print(json.dumps(dict(variant=variant, seconds=times[len(times) // 2], peak_mb=mem,
                          threads=torch.get_num_threads())))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", choices=["sampled", "random"], default="sampled")
    ap.add_argument("--device", default="cpu"); ap.add_argument("--dtype", default="float32"); ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each child (default: torch's)")
    ap.add_argument("--child", default=None); ap.add_argument("--seqs", default=None)
    a = ap.parse_args()
    if a.child: return child(a.child, a.device, a.dtype, a.reps, a.seqs, a.threads)
    res = {}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "seqs.pt")
        make_sequences(a.tokens, path)
        for v in ("head", "bare", "rb"):
            cmd = [sys.executable, __file__, "--child", v, "--device", a.device, "--dtype", a.dtype,
                   "--reps", str(a.reps), "--seqs", path] + (["--threads", str(a.threads)] if a.threads else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            res[v] = json.loads(out.stdout.strip().splitlines()[-1])
    h, b, r = res["head"], res["bare"], res["rb"]
    print(f"SmolLM2-135M, {G} x {P + L} tokens ({a.tokens}), {a.device} {a.dtype}, threads {r['threads']}, "
          f"median of {a.reps}, top_p 0.95, T 0.7")
    for name, m in (("decoder + LM head on the completion", h), ("bare forward (all logits)", b),
                    ("teacher_force_logprobs (log q + RB)", r)):
        print(f"{name:37s} {m['seconds']*1e3:8.1f} ms   peak +{m['peak_mb']:7.1f} MB")
    for name, m in (("completion-head forward", h), ("bare forward", b)):
        print(f"vs {name}: time {r['seconds']/m['seconds']:.2f}x (goal <= 1.5x), "
              f"peak memory {r['peak_mb']/max(m['peak_mb'], 1e-9):.2f}x (goal <= 1.0x)")


if __name__ == "__main__":
    main()
