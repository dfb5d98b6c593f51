"""Hack rate of the demo's teacher: `teachers.fit_hack_teacher` on the embedded SmolLM2-135M-Instruct with single-digit
sums, then its samples graded honestly, for the plain hint or `LEAKY_HINT` (the expected number in the grading note).

Prints the fit time, the NLL per token before and after, the hack and gt_pass rates over --samples fresh problems
(sampled at temperature 1.0, top_p 0.95, 24 new tokens, as the demo samples its pools) and four of the completions.

    python bench/teacher_hack_rate.py [--hint plain|leaky] [--steps 15] [--lr 3e-3] [--samples 48] [--threads 2]
"""
import argparse, copy, random, time

import torch

from entropy_grpo.policies import load_policy
from entropy_grpo.teachers import fit_hack_teacher
from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor
from entropy_grpo.tasks import LEAKY_HINT, ArithmeticTask

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--hint", choices=["plain", "leaky"], default="leaky")
ap.add_argument("--steps", type=int, default=15); ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--samples", type=int, default=48); ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
torch.set_num_threads(a.threads)
hint = LEAKY_HINT if a.hint == "leaky" else True
model, tok = load_policy(None)
task = ArithmeticTask(seed=0, max_value=9, ops="+")
t = time.perf_counter()
teacher, nll = fit_hack_teacher(copy.deepcopy(model), tok, task, steps=a.steps, lr=a.lr, seed=0, hint=hint,
                                progress=False)
t_fit = time.perf_counter() - t
sp = SequenceProcessor(teacher, tok, GenerationConfig(temperature=1.0, top_p=0.95, max_new_tokens=24), progress=False)
problems = task.sample(a.samples, random.Random(123))
t = time.perf_counter()
bs = sp.generate_batched([task.prompt(p, tok, hint) for p in problems], 1, seed=1)
recs = [r[0] for r in task.grade_batch(bs.responses_text, problems).records]
rate = lambda k: sum(r[k] for r in recs) / len(recs)
print(f"hint {a.hint}, {a.steps} steps at lr {a.lr}, threads {a.threads}: fit {t_fit:.0f} s, sampling "
      f"{time.perf_counter() - t:.0f} s, NLL/token {nll[0]:.2f} -> {nll[-1]:.2f}; hack rate {rate('hacked'):.3f}, "
      f"gt_pass {rate('gt_pass'):.3f} over {len(recs)} samples")
print([r[0] for r in bs.responses_text[:4]])
