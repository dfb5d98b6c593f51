"""phase2: slim files round-trip with their schema enforced; on synthetic recorder output the verification table
gives every verdict of every row against its controls, and the decision follows every branch. The recorder on the
training loop itself is tested in test_phase2_loop.py."""
import random

import torch

import pytest
from fastcore.test import test_fail

from entropy_grpo.phase2 import SLIM_KEYS, decide, load_slim, pool_flags, save_step_slim, verification_table
from entropy_grpo.pools import Pool, write_jsonl_gz


def slim(step=0, sample_id=0, arm="vanilla", **kw):
    r = dict(step=step, sample_id=sample_id, src_pool="teacher", src_step=step, src_sample=sample_id, reward=3.5,
             hacked=True, gt_pass=False, fmt_ok=True, comp_len=5, cos_S_contrib=0.5, grad_norm_contrib=1.0,
             mean_cos_in=0.4, mean_cos_out=None, frac_fired=None, arm=arm)
    return {**r, **kw}


# ---------------------------------------------------------------- slim files

def test_slim_round_trip_and_schema(tmp_path):
    recs = [slim(3, i, cos_S_contrib=float("nan") if i == 2 else 0.1 * i) for i in range(4)]
    path = save_step_slim(tmp_path/"vanilla", 3, recs)
    assert path.name == "step_003.cos.jsonl.gz"
    back = load_slim(tmp_path/"vanilla")
    assert [list(r) for r in back] == [list(SLIM_KEYS)] * 4
    assert back[2]["cos_S_contrib"] is None and back[1] == recs[1]                         # NaN -> null
    save_step_slim(tmp_path/"delta_s"/"step_003.cos.jsonl.gz", 3,
                   [slim(3, 0, arm="delta_s", mean_cos_out=0.1, frac_fired=0.6)])
    assert [r["arm"] for r in load_slim(tmp_path)] == ["delta_s"] + ["vanilla"] * 4         # arm subdirectories
    no_arm = {k: v for k, v in slim().items() if k != "arm"}
    test_fail(lambda: save_step_slim(tmp_path/"v", 0, [no_arm]), contains="missing ['arm']", exc=ValueError)
    test_fail(lambda: save_step_slim(tmp_path/"v", 0, [slim(prompt="Q")]), contains="extra ['prompt']", exc=ValueError)
    test_fail(lambda: save_step_slim(tmp_path/"v", 1, [slim()]), contains="step=0: expected 1", exc=ValueError)
    test_fail(lambda: save_step_slim(tmp_path/"vanilla", 3, [slim(3, arm="delta_s")]),
              contains="not overwriting", exc=ValueError)
    write_jsonl_gz(tmp_path/"vanilla"/"step_004.cos.jsonl.gz", [slim(4), slim(4, 1, completion="x")])
    test_fail(lambda: load_slim(tmp_path/"vanilla"),
              contains="step_004.cos.jsonl.gz:2: slim record schema: missing [], extra ['completion']", exc=ValueError)
    test_fail(lambda: load_slim(tmp_path/"none"), contains="slim directory not found", exc=FileNotFoundError)


# ---------------------------------------------------------------- the verification table

def synthetic(n_steps=20, spread=3.25, cos_in=0.3, perm_cos=0.0, cos_out=0.0, fired=0.65, removed=0.2,
              ctrl_removed=0.02,
              step=0.3, step_proj=-0.05, ctrl_step=0.02, teacher_cos=0.4, base_cos=-0.05, teacher_hacked=True,
              overshot=0, n_ctrl=20):
    """Recorder output of a vanilla and a projected arm: per step 4 teacher + 4 base samples and n_ctrl random plus
    n_ctrl label-permuted control directions (cosines ~ N(0, 0.03), permuted ones centred on perm_cos)."""
    rng = random.Random(1)
    def steps_of(arm):
        out = []
        for s in range(n_steps):
            ctrl = [dict(source=src, cos_in=c + rng.gauss(0, 0.03), removed=ctrl_removed * rng.random(),
                         cos_step=rng.gauss(0, ctrl_step), cos_step_plain=rng.gauss(0, ctrl_step),
                         contrib=[rng.gauss(0, 0.05) for _ in range(8)])
                    for src, c in [("random", 0.0)] * n_ctrl + [("permuted", perm_cos)] * n_ctrl]
            projected = arm == "projected"
            out.append(dict(step=s, arm=arm, frac_fired=fired if projected else None, delta_check=1e-7,
                            reward_spread=spread, cos_in=cos_in, cos_out=cos_out if projected else None,
                            removed=removed if projected else 0.0, overshot=overshot if projected else 0,
                            cos_step=step_proj if projected else step, cos_step_plain=step, controls=ctrl))
        return out
    def slim_of(arm):
        return [slim(s, i, arm, src_pool="teacher" if i < 4 else "base", reward=3.25 if i < 4 else 0.0,
                     hacked=teacher_hacked and i < 4,
                     cos_S_contrib=(teacher_cos if i < 4 else base_cos) + rng.gauss(0, .02))
                for s in range(n_steps) for i in range(8)]
    return {arm: dict(steps=steps_of(arm), slim=slim_of(arm)) for arm in ("vanilla", "projected")}


def row(rows, key, arm):
    return next(r for r in rows if r["key"] == key and r["arm"] == arm)


@pytest.mark.parametrize("kw, key, arm, verdict, says", [
    ({}, "reward_spread", "vanilla", "success", ""),
    (dict(spread=0.05), "reward_spread", "vanilla", "likely fail", "no advantage signal on steps [0, 1,"),
    (dict(spread=0.75), "reward_spread", "vanilla", "sneaky fail", "advantages small but non-zero"),
    ({}, "cos_in", "vanilla", "success", ""),
    (dict(cos_in=0.01), "cos_in", "vanilla", "likely fail", "within the random-direction null"),
    (dict(perm_cos=0.5), "cos_in", "vanilla", "likely fail", "above the label-permuted directions' median on 0/20"),
    (dict(cos_in=-0.3), "cos_in", "vanilla", "sneaky fail", "sign reversed"),
    ({}, "contrib", "vanilla", "success", ""),
    (dict(base_cos=0.4), "contrib", "vanilla", "likely fail", "within the label-permuted null"),
    (dict(teacher_hacked=False), "contrib", "vanilla", "sneaky fail", "mixing was required"),
    (dict(n_steps=1), "contrib", "vanilla", "inconclusive", "too few hacked samples: n=4 < 5"),
    ({}, "cos_out_below_in", "projected", "by construction", "true by construction"),
    (dict(fired=0.05), "cos_out_below_in", "projected", "sneaky fail", "fires on few modules"),
    ({}, "over_projection", "projected", "success", ""),
    (dict(overshot=2), "over_projection", "projected", "fail", "a bug, stop"),
    ({}, "step_along_v", "projected", "success", ""),
    (dict(step_proj=0.3), "step_along_v", "projected", "sneaky fail", "still moves toward hacking"),
    (dict(step_proj=0.29, step=0.3, ctrl_step=0.3), "step_along_v", "projected", "likely fail", "within the control"),
    ({}, "norm_removed", "projected", "success", ""),
    (dict(removed=0.01), "norm_removed", "projected", "likely fail", "within the control"),
])
def test_verification_table_verdicts(kw, key, arm, verdict, says):
    rows, md = verification_table(synthetic(**kw))
    r = row(rows, key, arm)
    assert r["verdict"] == verdict and says in r["detail"], r
    assert f"**{r['verdict']}**" in md


def test_between_arm_rows_and_bad_input():
    arms = synthetic()
    arms["projected"]["slim"] = [dict(r, cos_S_contrib=r["cos_S_contrib"] - 0.3 * r["hacked"])
                                 for r in arms["projected"]["slim"]]
    arms["projected"]["steps"] = [dict(s, cos_in=0.05 + 0.001 * s["step"]) for s in arms["projected"]["steps"]]
    rows, _ = verification_table(arms)
    assert row(rows, "next_cos_in", "projected")["verdict"] == "success"
    assert row(rows, "hacked_contrib", "projected")["verdict"] == "success"
    same, _ = verification_table(synthetic())
    assert row(same, "next_cos_in", "projected")["verdict"] == "inconclusive"       # identical series: t undefined
    test_fail(lambda: verification_table({}), contains="arms is empty", exc=ValueError)
    test_fail(lambda: verification_table(synthetic(), most=0), contains="most=0: expected a number in (0, 1]",
              exc=ValueError)
    no_ctrl, _ = verification_table(synthetic(n_ctrl=0))
    assert row(no_ctrl, "cos_in", "vanilla")["verdict"] == "inconclusive"
    assert row(no_ctrl, "step_along_v", "projected")["verdict"] == "inconclusive"


# ---------------------------------------------------------------- the decision

@pytest.mark.parametrize("kw, recommendation", [
    ({}, "launch Phase 3"),
    (dict(cos_in=0.01), "launch Phase 3, expect a smaller effect"),
    (dict(cos_in=0.01, base_cos=0.4), "skip Phase 3"),
    (dict(removed=0.01, step_proj=0.29, ctrl_step=0.3), "inconclusive"),
    (dict(overshot=1), "STOP (bug)"),
    (dict(spread=0.05), "inconclusive: the data cannot decide"),
])
def test_decision_branches(kw, recommendation):
    d = decide(verification_table(synthetic(**kw))[0])
    assert d["recommendation"] == recommendation, d
    assert d["launch_phase3"] == recommendation.startswith("launch") and d["stop"] == recommendation.startswith("STOP")


def test_flags_are_listed_and_pool_flags_name_the_problem():
    def pool(name, hacked, reward):
        return Pool(name, None, {0: [dict(hacked=h, reward=r) for h, r in zip(hacked, reward)]})
    flags = pool_flags([pool("teacher", [True, False, False, False], [3.5, 0, 0, 0]),
                        pool("base", [False] * 4, [0.25] * 4)])
    assert flags == ["teacher pool hacks on 25% of samples (< 50%)",
                     "base pool never earns more than 0.5 (one-sided variance)"]
    d = decide(verification_table(synthetic())[0], flags)
    assert d["recommendation"] == "launch Phase 3" and set(flags) <= set(d["rules"])
    assert pool_flags([pool("teacher", [True] * 4, [3.5] * 4), pool("base", [False] * 4, [1.0] * 4)]) == []


def test_overshot_counts_overshoots_not_float32_rounding_of_an_exact_removal():
    "A float32 gradient with a small component along V, removed exactly: rounding leaves ±eps·|g|, not an overshoot."
    from entropy_grpo.phase2 import _overshot
    g = torch.Generator().manual_seed(0)
    V = torch.nn.functional.normalize(torch.randn(1, 4096, generator=g, dtype=torch.float64), dim=-1)
    grads = [torch.randn(4096, generator=g, dtype=torch.float64) for _ in range(200)]
    grads = [(x - (V[0] @ x - 1e-3 * x.norm()) * V[0]).float() for x in grads]   # c_in = +1e-3·|g|
    Vf = V.float()
    removed = [x - (Vf[0] @ x) * Vf[0] for x in grads]                          # exact removal, in float32
    assert sum(_overshot({"m": x}, {"m": y}, {"m": Vf}) for x, y in zip(grads, removed)) == 0
    past = [x - 2 * (Vf[0] @ x) * Vf[0] for x in grads]                         # overshoot 2: c_out = −c_in
    assert sum(_overshot({"m": x}, {"m": y}, {"m": Vf}) for x, y in zip(grads, past)) == 200
