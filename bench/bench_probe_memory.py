"""Memory GRPOProbe adds to a TRL GRPOTrainer run, measured beside the figure its pre-run check predicts.

For each setup (LoRA r 16 on q/k/v/o through TRL's `peft_config`, and full fine-tuning) the same two-step run twice,
each in a fresh process: plain TRL, and with the probe measuring every step (`every=1`, float64 copy). Measured: the
rise of resident memory over `trainer.train()` (Linux /proc, sampled every millisecond, `plan.PeakRSS`); the probe's
added peak is the rise with it less the rise without. Predicted: `GRPOProbe.memory` (`trl_setup.probe_memory`: the
scoring copy, θ/∇H/Δθ, one ∇H pass), computed at `on_train_begin` before anything is copied. CPU, float32 training.

    python bench/bench_probe_memory.py [--model default|tiny] [--threads 1] [--prompts 4] [--G 4] [--max-new-tokens 32]
"""
import argparse, json, os, platform, random, subprocess, sys, tempfile, warnings

import torch

warnings.filterwarnings("ignore", category=FutureWarning)


def one(a):
    "One run in this process; prints a JSON line: the RSS rise over train() and the probe's predicted terms."
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer
    from entropy_grpo.plan import PeakRSS
    from entropy_grpo.policies import load_policy, tiny_policy
    from entropy_grpo.tasks import ArithmeticTask
    from entropy_grpo.trl_callback import add_grpo_probe
    torch.set_num_threads(a.threads)
    model, tok = tiny_policy(0) if a.model == "tiny" else load_policy(None, device="cpu", dtype="float32")
    prompts = [p.question for p in ArithmeticTask().sample(2 * a.prompts, random.Random(0))]
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=a.prompts * a.G, num_generations=a.G,
                      max_completion_length=a.max_new_tokens, max_steps=2, learning_rate=1e-5, top_p=0.95,
                      use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
                      bf16=False)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    tr = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                     args=args, processing_class=tok, train_dataset=Dataset.from_dict({"prompt": prompts}),
                     peft_config=lora if a.setup == "lora" else None)
    tr.remove_callback(PrinterCallback)
    probe = add_grpo_probe(tr, dict(every=1, n_prompts=a.prompts)) if a.probe else None
    with PeakRSS() as rss: tr.train()
    print(json.dumps(dict(rise=rss.rise, memory=probe.memory if probe else None,
                          trainable=sum(p.numel() for p in tr.model.parameters() if p.requires_grad))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", choices=("default", "tiny"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step, and E's prompts")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--one", choices=("lora", "full"), help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one: a.setup = a.one; return one(a)
    print(f"# {platform.machine()}, torch {torch.__version__}, threads {a.threads}, model {a.model}, "
          f"{a.prompts} prompts × G {a.G}, {a.max_new_tokens} tokens, two steps, float32 training, float64 probe")
    print("| setup | trainable | RSS rise, plain | with the probe | added (measured) | predicted: copy | θ, ∇H, Δθ | "
          "∇H pass | total | measured / predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for setup in ("lora", "full"):
        runs = []
        for probe in (False, True):
            cmd = [sys.executable, __file__, "--one", setup, "--model", a.model, "--threads", str(a.threads),
                   "--prompts", str(a.prompts), "--G", str(a.G), "--max-new-tokens", str(a.max_new_tokens)]
            out = subprocess.run(cmd + ["--probe"] * probe, capture_output=True, text=True, check=True,
                                 env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        m, added = runs[1]["memory"], runs[1]["rise"] - runs[0]["rise"]
        gb = lambda x: f"{x / 1e9:.2f} GB"
        print(f"| {setup} | {runs[1]['trainable']:,} | {gb(runs[0]['rise'])} | {gb(runs[1]['rise'])} | {gb(added)} | "
              f"{gb(m['copy'])} | {gb(m['step'])} | {gb(m['activations'] + m['head'])} | {gb(m['total'])} | "
              f"{added / m['total']:.2f} |")


if __name__ == "__main__":
    main()
