"""teacher_force_logprobs (log q + RB entropy at top_p 0.95) vs a bare forward that returns logits.

Time and peak memory ratios on the embedded SmolLM2-135M at T = 256 (8 sequences: 32 prompt + 224 completion tokens).
The sequences are sampled from SmolLM2 itself at T 0.7, top_p 0.95 (`sampled.py`; what GRPO scores), or with
`--tokens random` uniformly random ids (a worst case: the model's nuclei then hold thousands of tokens). Each variant
runs in a fresh process; peak memory = highest RSS above the RSS just before the call, sampled every millisecond (CPU)
or torch.cuda.max_memory_allocated (GPU). Prints ratios; never asserts.
  python bench/bench_teacher_forcing.py [--tokens sampled|random] [--device cuda] [--dtype bfloat16]
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


def child(variant, device, dtype, reps, path):
    import torch
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
    print(json.dumps(dict(variant=variant, seconds=times[len(times) // 2], peak_mb=mem)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", choices=["sampled", "random"], default="sampled")
    ap.add_argument("--device", default="cpu"); ap.add_argument("--dtype", default="float32"); ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", default=None); ap.add_argument("--seqs", default=None)
    a = ap.parse_args()
    if a.child: return child(a.child, a.device, a.dtype, a.reps, a.seqs)
    res = {}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "seqs.pt")
        make_sequences(a.tokens, path)
        for v in ("bare", "rb"):
            out = subprocess.run([sys.executable, __file__, "--child", v, "--device", a.device, "--dtype", a.dtype,
                                  "--reps", str(a.reps), "--seqs", path], capture_output=True, text=True, check=True)
            res[v] = json.loads(out.stdout.strip().splitlines()[-1])
    b, r = res["bare"], res["rb"]
    print(f"SmolLM2-135M, {G} x {P + L} tokens ({a.tokens}), {a.device} {a.dtype}, top_p 0.95, T 0.7")
    print(f"bare forward (logits):            {b['seconds']*1e3:8.1f} ms   peak +{b['peak_mb']:7.1f} MB")
    print(f"teacher_force_logprobs (log q+RB): {r['seconds']*1e3:8.1f} ms   peak +{r['peak_mb']:7.1f} MB")
    print(f"ratio time {r['seconds']/b['seconds']:.2f}x (goal <= 1.5x)   ratio peak memory {r['peak_mb']/max(b['peak_mb'], 1e-9):.2f}x (goal <= 1.0x)")


if __name__ == "__main__":
    main()
