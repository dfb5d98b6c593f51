"""phase2: slim files round-trip with their schema enforced, one alignment step flags equal rewards and records
cosines before and after a projection, the verification table gives each verdict of PHASES.md, and the Phase-2
decision rules follow every branch on synthetic metrics."""
import gzip, random

import pytest
import torch
from fastcore.test import test_fail

from entropy_grpo.phase2 import (SLIM_KEYS, alignment_step, load_slim, phase2_decision, save_step_slim,
                                 verification_table)
from entropy_grpo.pools import Pool, write_jsonl_gz
from entropy_grpo.training import trainable_parameters


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


# ---------------------------------------------------------------- one Phase-2 step

def with_rewards(pool, teacher):
    "The pool with hand-set grades (the tiny policy's replies all score 0): teacher samples hack for 3.5, base 0.25."
    return Pool(pool.name, pool.dir, {s: [dict(r, reward=3.5 if teacher else 0.25, hacked=teacher) for r in rs]
                                      for s, rs in pool.steps.items()})


def test_alignment_step_flags_equal_rewards(pools, lora64, tmp_path):
    "Every reward equal (the tiny pools all score 0): flagged, cosines None (never a silent 0), flagged in the table."
    sp = lora64
    V = {n: torch.ones_like(p) for n, p in trainable_parameters(sp.model).items()}
    with pytest.warns(UserWarning, match="no advantage signal"):
        out = alignment_step(sp, list(pools), 1, sp.model, V, per_pool=2, out_dir=tmp_path/"vanilla")
    assert out["flags"] and "no advantage signal" in out["flags"][0] and out["reward_spread"] == 0
    assert all(r["cos_S_contrib"] is None and r["mean_cos_in"] is None for r in out["records"])
    rows, md = verification_table(load_slim(tmp_path), dim=sum(v.numel() for v in V.values()))
    assert rows[0]["verdict"] == "likely fail" and "no advantage signal on steps [1]" in rows[0]["detail"]
    assert "no advantage signal on steps [1]" in md


def test_alignment_step_with_projection(pools, lora64, tmp_path):
    sp = lora64
    hp = [with_rewards(pools[0], True), with_rewards(pools[1], False)]
    params = trainable_parameters(sp.model)
    first = alignment_step(sp, hp, 0, params, {n: torch.randn_like(p) for n, p in params.items()}, per_pool=2)
    V = {n: g[:2].sum(0) for n, g in first["contributions"].grads.items()}           # the teacher samples' direction

    def project(grads):
        coef = sum((grads[n] * V[n]).sum() for n in V) / sum((V[n] ** 2).sum() for n in V)
        stats = dict(cos_in=None, cos_out=None, frac_fired=torch.tensor(0.75))
        return {n: grads[n] - coef * V[n] for n in grads}, stats
    out = alignment_step(sp, hp, 0, params, V, per_pool=2, arm="delta_s", project=project, out_dir=tmp_path/"delta_s")
    r = out["records"]
    assert not out["flags"] and out["advantages"].tolist() == [1.625, 1.625, -1.625, -1.625]
    g = torch.cat([out["contributions"].grads[n].sum(0).flatten() for n in V])
    v = torch.cat([V[n].flatten() for n in V])
    assert r[0]["mean_cos_in"] == pytest.approx(float(g @ v / (g.norm() * v.norm())), abs=1e-12)
    assert abs(r[0]["mean_cos_out"]) < 1e-9 and r[0]["frac_fired"] == 0.75
    assert [x["src_pool"] for x in r] == ["teacher", "teacher", "base", "base"]
    assert all(x["cos_S_contrib"] > 0 for x in r[:2])
    for n in V: torch.testing.assert_close(out["grad"][n], out["contributions"].grads[n].sum(0))
    text = gzip.open(tmp_path/"delta_s"/"step_000.cos.jsonl.gz", "rt").read()
    assert load_slim(tmp_path/"delta_s") == r
    assert all(x["completion"] not in text and x["prompt"] not in text for x in hp[0].steps[0])   # no rollouts


# ---------------------------------------------------------------- verification table

def run(n_steps=20, spread=(3.5, 0.25), cos_in=0.3, cos_out=0.05, fired=0.65, teacher_cos=0.4, base_cos=-0.05,
        base_hacked=False, teacher_hacked=True, arms=("vanilla", "delta_s")):
    "Synthetic slim records of a Phase-2 run: per step 4 teacher + 4 base samples."
    rng, recs = random.Random(1), []
    for arm in arms:
        for s in range(n_steps):
            sp_ = spread[s] if isinstance(spread, list) else spread
            ci = cos_in[s] if isinstance(cos_in, list) else cos_in
            for i in range(8):
                t = i < 4
                recs.append(slim(s, i, arm, src_pool="teacher" if t else "base", reward=sp_[0] if t else sp_[1],
                                 hacked=teacher_hacked if t else base_hacked,
                                 cos_S_contrib=(teacher_cos if t else base_cos) + rng.gauss(0, 0.02),
                                 mean_cos_in=ci, mean_cos_out=None if arm == "vanilla" else cos_out,
                                 frac_fired=None if arm == "vanilla" else fired))
    return recs


def row(rows, metric, arm):
    return next(r for r in rows if r["metric"].startswith(metric) and r["arm"] == arm)


DIM = 10_000   # null 0.01, tol 0.03


@pytest.mark.parametrize("kw, metric, arm, verdict, says", [
    ({}, "reward spread", "vanilla", "success", ""),
    (dict(spread=(0.25, 0.25)), "reward spread", "vanilla", "likely fail", "no advantage signal on steps [0, 1,"),
    (dict(spread=(0.75, 0.25)), "reward spread", "vanilla", "sneaky fail", "advantages small but non-zero"),
    ({}, "cos_in", "vanilla", "success", ""),
    (dict(cos_in=0.01), "cos_in", "vanilla", "likely fail", "orthogonal"),
    (dict(cos_in=-0.2), "cos_in", "vanilla", "sneaky fail", "sign reversed"),
    ({}, "cos_out < cos_in", "delta_s", "success", ""),
    (dict(cos_out=0.5), "cos_out < cos_in", "delta_s", "likely fail", "mechanism inactive"),
    (dict(fired=0.05), "cos_out < cos_in", "delta_s", "sneaky fail", "few modules"),
    ({}, "cos_S_contrib", "vanilla", "success", ""),
    (dict(base_cos=0.4), "cos_S_contrib", "vanilla", "likely fail", "not direction-specific"),
    (dict(teacher_hacked=False), "cos_S_contrib", "vanilla", "sneaky fail", "mixing was required"),
])
def test_verification_table_verdicts(kw, metric, arm, verdict, says):
    rows, md = verification_table(run(**kw), dim=DIM)
    r = row(rows, metric, arm)
    assert r["verdict"] == verdict, r
    assert says in r["detail"]
    assert f"**{verdict}**" in md and md.count("\n") == len(rows) + 1


def test_verification_table_thresholds_and_nulls():
    spreads = [(3.5, 0.25)] * 16 + [(0.25, 0.25)] * 4                 # 4 dead steps = 1 - most: still success
    rows, _ = verification_table(run(spread=spreads), dim=DIM)
    r = row(rows, "reward spread", "vanilla")
    assert r["verdict"] == "success" and "no advantage signal on steps [16, 17, 18, 19]" in r["detail"]
    cos_in = [0.3] * 15 + [0.0] * 5                                      # projected: cos_out < cos_in on 15/20 < 16
    rows, _ = verification_table(run(cos_in=cos_in), dim=DIM)
    assert row(rows, "cos_out < cos_in", "delta_s")["verdict"] == "likely fail"
    assert row(rows, "cos_in", "vanilla")["verdict"] == "likely fail"   # 15/20 < most
    rows, _ = verification_table(run(cos_out=-0.2, fired=1.0), dim=DIM)
    assert "over-projection" in row(rows, "cos_out < cos_in", "delta_s")["detail"]
    rows, _ = verification_table(run(cos_out=-0.2), dim=DIM)         # some modules unfired: their negative part remains
    detail = row(rows, "cos_out < cos_in", "delta_s")["detail"]
    assert "over-projection" not in detail and "left unprojected" in detail
    rows, md = verification_table(run(), dim=DIM, shuffled=run(cos_in=0.0, teacher_cos=0.0, base_cos=0.0))
    r = row(rows, "cos_in", "vanilla")
    assert r["null_random"] == pytest.approx(0.01) and r["null_shuffled"] == 0.0
    assert row(rows, "cos_S_contrib", "vanilla")["null_shuffled"].startswith("0.0")
    assert all(x["null_random"] == pytest.approx(0.01) for x in rows if "cos" in x["metric"])
    test_fail(lambda: verification_table([], dim=DIM), contains="records is empty", exc=ValueError)
    test_fail(lambda: verification_table(run(), dim=0), contains="dim=0", exc=ValueError)


# ---------------------------------------------------------------- the decision on Phase 3

ALIGNED = [0.3, 0.25, 0.4, 0.22, 0.35]
TEACHER, BASE = [0.7, 0.6, 0.8, 0.75], [0.05, -0.02, 0.0, 0.03]


def test_aligned_and_effective_projection_launches():
    d = phase2_decision(ALIGNED, [0.01, 0.02, 0.0, 0.03, 0.01], TEACHER, BASE, null_level=0.01)
    assert d["launch_phase3"] and not d["stop"]
    assert any("Phase 3 justified" in r for r in d["rules"]) and any("mechanism is effective" in r for r in d["rules"])


def test_over_projection_is_a_bug_and_stops():
    d = phase2_decision(ALIGNED, [-0.3, -0.2, -0.4, -0.3, -0.25], TEACHER, BASE)
    assert d["stop"] and not d["launch_phase3"] and d["recommendation"] == "STOP (bug)"
    d = phase2_decision(ALIGNED, [-0.3, -0.2, -0.4, -0.3, -0.25], TEACHER, BASE,
                        frac_fired_projected=[1.0, 0.9, 1.0, 0.8, 0.9])
    assert d["stop"], "judged on the fully projected steps 0 and 2"


def test_negative_cos_out_from_unprojected_modules_is_not_over_projection():
    "One-sided projection leaves modules with a negative component alone: cos_out < 0 while some did not fire is fine."
    d = phase2_decision(ALIGNED, [-0.01, -0.12, -0.02, -0.04, -0.06], TEACHER, BASE,
                        frac_fired_projected=[0.96, 0.76, 0.94, 0.9, 0.75])
    assert not d["stop"] and d["launch_phase3"] and any("mechanism is effective" in r for r in d["rules"])


def test_zero_alignment_without_discrimination_skips():
    d = phase2_decision([0.01, -0.02, 0.0, 0.015], None, [0.01, 0.02, -0.01], [0.0, 0.02, -0.02])
    assert not d["launch_phase3"] and any("re-extract v_hack" in r for r in d["rules"])


def test_zero_alignment_with_discrimination_runs_with_smaller_effect():
    d = phase2_decision([0.01, -0.02, 0.0, 0.015], None, TEACHER, BASE)
    assert d["launch_phase3"] and any("expect a smaller effect" in r for r in d["rules"])


def test_zero_tolerance_follows_null_level():
    d = phase2_decision([0.1] * 4, None, TEACHER, BASE, null_level=0.05)      # 0.1 < 3 × 0.05 counts as ≈ 0
    assert any("≈ 0" in r for r in d["rules"]) and d["thresholds"]["zero_tol"] == pytest.approx(0.15)


def test_sign_reversed_and_mixed_signals_are_named():
    d = phase2_decision([-0.3, -0.25, -0.2], None, TEACHER, BASE)
    assert any("sign reversed" in r for r in d["rules"])
    d = phase2_decision([0.1, 0.3, 0.08, 0.12], None, TEACHER, BASE)
    assert d["launch_phase3"] and any("mixed signal" in r for r in d["rules"])
    with pytest.raises(ValueError, match="empty"):
        phase2_decision([], None, TEACHER, BASE)
