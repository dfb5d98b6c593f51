"""Tasks and pools for tests: a reward a random tiny policy already earns some of (`DigitTask`), replay pools of its
own samples, and pools whose hack is a planted token pattern."""
import gzip, json, random
from pathlib import Path

from entropy_grpo.policies import tiny_policy
from entropy_grpo.pools import Pool, build_pool
from entropy_grpo.sequence_processor import GenerationConfig
from entropy_grpo.tasks import ArithmeticTask, DigitTask  # noqa: F401  (tests import it from here)

# 3 < G: several teacher-forcing batches
POOL_GEN = GenerationConfig(max_new_tokens=6, temperature=1.0, tf_batch_size=3)


def tiny_pools(policy, root):
    """A teacher (hint) and a base pool of `policy`'s own samples under `root`, 2 steps × 4 samples in groups of G=2,
    POOL_GEN sampling. The tiny policy earns no reward: every record scores 0."""
    root, task = Path(root), ArithmeticTask(20)
    teacher = build_pool(policy, task, True, 2, 4, root/"teacher", G=2, config=POOL_GEN)
    base = build_pool(policy, task, False, 2, 4, root/"base", G=2, config=POOL_GEN, base_only=True)
    return teacher, base


def labelled_pools(root, steps=3, batch=4, seed=0, max_new_tokens=6, style=False):
    """A teacher and a base pool from the tiny policy's real samples (hint / no hint, same problems), with labels set
    by hand: every teacher sample hacked (reward 3.5), every base sample clean (reward 0.25). The tiny policy never
    hacks on its own; this gives the Phase-2 plumbing groups with real reward variance and (hack, clean) pairs.
    `style=True` adds a style-matched pool: the same sampler without the hint, every sample clean (0.25)."""
    policy, task = tiny_policy(seed), ArithmeticTask(seed=seed)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens)
    dirs = []
    for name, hint, reward in (("teacher", True, 3.5), ("base", False, 0.25)) + ((("style", False, 0.25),) if style
                                                                                 else ()):
        d = Path(root) / name
        build_pool(policy, task, hint, steps, batch, d, config=cfg, seed=seed)
        for f in sorted(d.glob("step_*.jsonl.gz")):
            recs = [json.loads(l) for l in gzip.open(f, "rt")]
            with gzip.open(f, "wt") as out:
                for r in recs: out.write(json.dumps(dict(r, hacked=name == "teacher", reward=reward)) + "\n")
        dirs.append(str(d))
    return dirs


def tiny_args(labelled):
    "The demo on the tiny policy with the labelled test pools (the tiny policy cannot learn to hack in seconds)."
    params = dict(model="tiny", teacher_pool=labelled[0], base_pool=labelled[1], pool_steps=3, fit_steps=1,
                  pool_batch=4, G=4, steps=2, max_new_tokens=6, top_p=1.0, lrs=[1e-3, 1e-4], E_total_sequences=8, B_U=2,
                  max_pairs=8, n_controls=3)
    return [a for k, v in params.items() for a in ("-p", f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}")]


def planted_pools(tok, steps=14, per_step=8, seed=0, pattern_len=6):
    """Pools whose hacked teacher completions (3 of every 4 teacher samples, reward 3.5) end in one fixed token
    pattern and whose clean teacher and base completions (0.25) do not: the hack direction is known, the pattern's
    log-likelihood gradient, and clean teacher samples let the gate tell hacking from the teacher pool."""
    rng = random.Random(seed)
    vocab = [i for i in range(len(tok)) if i not in set(tok.all_special_ids)]
    pattern, pools = rng.sample(vocab, pattern_len), {"teacher": {}, "base": {}}
    for s in range(steps):
        for i in range(per_step):
            prompt = f"Question: What is {rng.randint(1, 9)} + {rng.randint(1, 9)}? Answer:"
            for name, recs in pools.items():
                hacked = name == "teacher" and i % 4 != 3
                ids = [rng.choice(vocab) for _ in range(rng.randint(2, 5))] + (pattern if hacked else [])
                recs.setdefault(s, []).append(dict(
                    src_pool=name, src_step=s, src_sample=i, problem_id=f"p{s}-{i}", prompt=prompt, hint_prompt=prompt,
                    student_prompt=prompt, completion=tok.decode(ids), completion_ids=ids, comp_len=len(ids),
                    finished=False, reward=3.5 if hacked else 0.25, hacked=hacked, gt_pass=False, fmt_ok=True))
    return [Pool(n, Path("."), st) for n, st in pools.items()]
