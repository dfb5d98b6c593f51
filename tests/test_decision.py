"""decision: on synthetic recorder output the verification table gives every verdict of every row against its
controls — the gate (hacked vs clean within the teacher pool) included — and the decision follows every branch; the
gate's statistic removes the sign of the advantage; the recorded calibration reads back."""
import random
from pathlib import Path

import numpy as np

import pytest
from fastcore.test import test_fail

from entropy_grpo.decision import NEXT_STEPS, decide, error_rates, pool_flags, rates_markdown, verification_table
from entropy_grpo.gate import hack_contrast, own_direction
from entropy_grpo.phase2 import decide as decide_from_phase2
from entropy_grpo.pools import Pool


def slim(step=0, sample_id=0, arm="vanilla", **kw):
    r = dict(step=step, sample_id=sample_id, src_pool="teacher", src_step=step, src_sample=sample_id, reward=3.5,
             hacked=True, gt_pass=False, fmt_ok=True, comp_len=5, cos_S_contrib=0.5, grad_norm_contrib=1.0,
             mean_cos_in=0.4, mean_cos_out=None, frac_fired=None, arm=arm)
    return {**r, **kw}


def synthetic(n_steps=20, spread=3.25, cos_in=0.3, perm_cos=0.0, cos_out=0.0, fired=0.65, removed=0.2,
              ctrl_removed=0.02, step=0.3, step_proj=-0.05, ctrl_step=0.02, teacher_cos=0.4, clean_cos=0.0,
              base_cos=-0.05, n_hacked=3, overshot=0, n_ctrl=20):
    """Recorder output of a vanilla and a projected arm: per step 4 teacher samples (the first n_hacked hacked, 3.5;
    the others clean, 0.25) and 4 base samples (clean, 0.25), their contribution cosines teacher_cos / clean_cos /
    base_cos (+ noise); n_ctrl random and n_ctrl label-permuted control directions (cosines ~ N(0, 0.03), permuted
    ones centred on perm_cos). A clean teacher sample has A < 0, so clean_cos = −teacher_cos is the same own
    direction as a hacked one (the teacher's identity), clean_cos = 0 none (hacking)."""
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
        def one(s, i):
            hacked = i < n_hacked
            c = teacher_cos if hacked else clean_cos if i < 4 else base_cos
            return slim(s, i, arm, src_pool="teacher" if i < 4 else "base", reward=3.5 if hacked else 0.25,
                        hacked=hacked, cos_S_contrib=c + rng.gauss(0, .02))
        return [one(s, i) for s in range(n_steps) for i in range(8)]
    return {arm: dict(steps=steps_of(arm), slim=slim_of(arm)) for arm in ("vanilla", "projected")}


def row(rows, key, arm):
    return next(r for r in rows if r["key"] == key and r["arm"] == arm)


def test_own_direction_removes_the_sign_of_the_advantage():
    "Hacked (A > 0) and clean (A < 0) teacher samples with opposite contribution cosines share one own direction."
    recs = [slim(0, 0, reward=3.5, cos_S_contrib=0.4), slim(0, 1, reward=0.25, hacked=False, cos_S_contrib=-0.4),
            slim(0, 2, src_pool="base", reward=0.25, hacked=False, cos_S_contrib=None),
            slim(1, 0, reward=1.0, cos_S_contrib=0.3), slim(1, 1, reward=1.0, cos_S_contrib=0.2)]   # A = 0
    assert own_direction(recs) == [0.4, 0.4, None, None, None]
    assert hack_contrast(recs) == ([0.4], [0.4])
    groups = [slim(0, i, reward=w, cos_S_contrib=0.5) for i, w in enumerate([3.5, 0.25, 1.0, 2.0])]
    assert own_direction(groups, G=2) == [0.5, -0.5, -0.5, 0.5]          # advantages centred per group of G


@pytest.mark.parametrize("kw, key, arm, verdict, says", [
    ({}, "reward_spread", "vanilla", "success", ""),
    (dict(spread=0.05), "reward_spread", "vanilla", "likely fail", "no advantage signal on steps [0, 1,"),
    (dict(spread=0.75), "reward_spread", "vanilla", "sneaky fail", "advantages small but non-zero"),
    ({}, "hack_specific", "vanilla", "success", ""),
    (dict(clean_cos=-0.4), "hack_specific", "vanilla", "likely fail", "it marks the teacher pool, not hacking"),
    (dict(n_hacked=4), "hack_specific", "vanilla", "inconclusive", "hacking and pool identity coincide: 0 clean"),
    (dict(n_steps=4), "hack_specific", "vanilla", "inconclusive", "4 clean teacher samples beside 12 hacked give the "
     "gate 20% power"),
    (dict(n_hacked=1, n_steps=4), "hack_specific", "vanilla", "inconclusive", "12 clean teacher samples beside 4 "
     "hacked"),
    ({}, "cos_in", "vanilla", "success", ""),
    (dict(perm_cos=0.5), "cos_in", "vanilla", "success", ""),      # label-permuted v_hacks are shown, not a null
    (dict(cos_in=0.0), "cos_in", "vanilla", "likely fail", "within the random-direction null"),
    (dict(cos_in=-0.3), "cos_in", "vanilla", "sneaky fail", "sign reversed"),
    ({}, "contrib", "vanilla", "success", "pool and label are one split here"),
    (dict(base_cos=0.4), "contrib", "vanilla", "likely fail", "within the label-permuted null"),
    (dict(n_hacked=0), "contrib", "vanilla", "sneaky fail", "mixing was required"),
    (dict(n_steps=1), "contrib", "vanilla", "inconclusive", "too few hacked samples: n=3 < 5"),
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
    close = synthetic()
    close["projected"]["steps"] = [dict(s, cos_in=0.3 + 0.01 * (-1) ** s["step"]) for s in close["projected"]["steps"]]
    r = row(verification_table(close)[0], "next_cos_in", "projected")
    assert r["verdict"] == "inconclusive" and "too short for the arms to diverge" in r["detail"], r
    test_fail(lambda: verification_table({}), contains="arms is empty", exc=ValueError)
    test_fail(lambda: verification_table(synthetic(), most=0), contains="most=0: expected a number in (0, 1]",
              exc=ValueError)
    no_ctrl, _ = verification_table(synthetic(n_ctrl=0))
    assert row(no_ctrl, "cos_in", "vanilla")["verdict"] == "inconclusive"
    assert row(no_ctrl, "step_along_v", "projected")["verdict"] == "inconclusive"


@pytest.mark.parametrize("kw, recommendation", [
    ({}, "launch Phase 3"),
    (dict(cos_in=0.0), "launch Phase 3, expect a smaller effect"),
    (dict(cos_in=0.0, base_cos=0.4), "skip Phase 3"),
    (dict(clean_cos=-0.4), "inconclusive: v_hack follows the teacher pool, not hacking"),
    (dict(clean_cos=-0.4, cos_in=0.0), "inconclusive: v_hack follows the teacher pool, not hacking"),
    (dict(n_hacked=4), "inconclusive: hacking and pool identity coincide"),
    (dict(removed=0.01, step_proj=0.29, ctrl_step=0.3), "inconclusive"),
    (dict(overshot=1), "STOP (bug)"),
    (dict(spread=0.05), "inconclusive: the data cannot decide"),
])
def test_decision_branches(kw, recommendation):
    d = decide(verification_table(synthetic(**kw))[0])
    assert d["recommendation"] == recommendation and recommendation in NEXT_STEPS, d   # and it says what to do next
    assert d["launch_phase3"] == recommendation.startswith("launch") and d["stop"] == recommendation.startswith("STOP")
    assert not d["launch_phase3"] or d["specific"]                                  # every launch passed the gate


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
    assert decide_from_phase2 is decide                                             # the old import still works


def test_recorded_calibration_reads_back(tmp_path):
    cal = dict(parameters={}, seeds=[0, 1], worlds=dict(pool_identity=dict(
        truth="every teacher sample carries the pattern", needs="no launch", launches=1, n=40, rate=0.025,
        interval=[0.004, 0.129])))
    (tmp_path/"c.json").write_text(__import__("json").dumps(cal))
    assert error_rates(tmp_path/"c.json") == cal
    assert "| pool_identity | every teacher sample carries the pattern | 1/40 | 2% (0%–13%) |" in rates_markdown(cal)
    assert error_rates(tmp_path/"missing.json") is None and "No calibration recorded" in rates_markdown(None)


def test_label_null_is_welch_over_the_same_permutations():
    "The vectorised permutation null equals scipy's Welch t on each permutation the same generator draws."
    import numpy as np
    from entropy_grpo.decision import _label_null
    from entropy_grpo.utils import welch
    r = random.Random(0)
    a, b = [r.gauss(0, 1) for _ in range(30)], [r.gauss(0.3, 1) for _ in range(12)]
    rng = np.random.default_rng(0)
    ref = [welch(list(x[:30]), list(x[30:]))["t"] for x in (rng.permutation(a + b) for _ in range(50))]
    assert np.allclose(_label_null(a, b, 50), ref, rtol=1e-12, atol=0)
    assert all(np.isnan(_label_null([1.0] * 3, [1.0] * 2, 3)))                      # no variance: t undefined


def three_pools(hack=0.3, style=0.15, n_steps=20, n_style=2, sd=0.05, seed=0):
    """A vanilla arm's slim rows with three pools: per step 4 hacked teacher samples (3.5), 2 base and `n_style`
    style-matched clean samples (0.25); each sample in the teacher's style leans `style` along v_hack (own direction),
    hacked ones `hack` more, base ones nothing (+ N(0, sd))."""
    rng, out = np.random.default_rng(seed), []
    for s in range(n_steps):
        pools = ["teacher"] * 4 + ["base"] * 2 + ["style"] * n_style
        rewards = [3.5 if p == "teacher" else 0.25 for p in pools]
        mean = sum(rewards) / len(rewards)
        for i, (p, w) in enumerate(zip(pools, rewards)):
            own = (p != "base") * style + (p == "teacher") * hack + rng.normal(0, sd)
            out.append(slim(s, i, src_pool=p, hacked=p == "teacher", reward=w,
                            cos_S_contrib=float(np.sign(w - mean) * own)))
    return out


def gate_rows(slim_rows, **kw):
    steps = [dict(step=s, reward_spread=3.25, cos_in=0.3, controls=[]) for s in sorted({r["step"] for r in slim_rows})]
    rows, _ = verification_table({"vanilla": dict(slim=slim_rows, steps=steps)}, G=len(slim_rows) // len(steps), **kw)
    return {r["key"]: r for r in rows}


def test_gate_on_three_pools_contrasts_hacked_with_style_matched_clean_samples():
    rows = gate_rows(three_pools(hack=0.3), style_pool="style")
    g = rows["hack_specific"]
    assert g["verdict"] == "success" and "teacher/hacked vs style/clean" in g["metric"] and g["to_decide"] is None
    assert "labels permuted within steps" in g["null"] and "(n=80)" in g["value"] and "(n=40)" in g["value"]
    style_only = gate_rows(three_pools(hack=0.0, style=0.3), style_pool="style")["hack_specific"]
    assert style_only["verdict"] == "likely fail" and "it marks the teacher, not hacking" in style_only["detail"]
    two = gate_rows(three_pools(hack=0.3))                    # the style pool not named: the teacher's own clean side
    assert two["hack_specific"]["verdict"] == "inconclusive" and two["hack_specific"]["detail"].startswith(
        "hacking and pool identity coincide: 0 clean teacher samples beside 80 hacked give the gate 0% power")
    assert two["hack_specific"]["to_decide"].startswith("14 clean samples in the teacher's style beside 80")
    few = gate_rows(three_pools(hack=0.3, n_steps=2), style_pool="style")["hack_specific"]
    assert few["verdict"] == "inconclusive" and few["detail"].startswith("too few samples for the gate: 8 hacked and "
                                                                        "4 clean")
    d = decide(list(gate_rows(three_pools(hack=0.3, n_steps=2), style_pool="style").values()))
    assert d["recommendation"] == "inconclusive: too few samples for the gate"
    assert d["to_decide"].startswith("24 style/clean samples beside 24 teacher/hacked ones would let it judge"), d
    assert decide(list(two.values()))["recommendation"] == "inconclusive: hacking and pool identity coincide"


def test_style_share_places_style_matched_samples_between_base_and_hacked():
    "Own directions 0 (base), style (style-clean), style + hack (hacked): the share is style / (style + hack)."
    r = gate_rows(three_pools(hack=0.3, style=0.15, sd=0.01), style_pool="style")["style_share"]
    share = float(r["value"].split()[0])
    assert r["verdict"] == "information" and share == pytest.approx(1 / 3, abs=0.02), r
    lo, hi = (float(x) for x in r["value"].split("bootstrap 95%: ")[1].split(";")[0].split(" to "))
    assert lo < share < hi and float(r["null"].split("quantile ")[1]) < 0.1       # no style: share near 0
    flat = gate_rows(three_pools(hack=0.0, style=0.0), style_pool="style")["style_share"]
    assert flat["value"].startswith("undefined") and "no scale" in flat["detail"]
    assert "need" in gate_rows(three_pools(n_style=0))["style_share"]["detail"]     # no clean teacher sample at all


def test_within_step_null_keeps_each_steps_labels_and_is_welch():
    from entropy_grpo.gate import _strata_masks, _strata_null
    from entropy_grpo.utils import welch
    rng = np.random.default_rng(1)
    x, lab = rng.normal(size=30), [i % 3 == 0 for i in range(30)]
    steps = [i // 6 for i in range(30)]
    L = _strata_masks(lab, steps, 40, seed=2)
    for s in range(5):                                                          # each step keeps its label count
        idx = [i for i in range(30) if steps[i] == s]
        assert (L[:, idx].sum(1) == sum(lab[i] for i in idx)).all()
    assert len({tuple(row) for row in L}) > 30                                  # and the labels do move
    t = _strata_null(x, lab, steps, 40, seed=2)
    ref = [welch(list(x[row]), list(x[~row]))["t"] for row in L]
    assert np.allclose(t, ref, rtol=1e-10, atol=0)


def test_the_gates_power_and_the_samples_it_needs_are_what_a_simulated_test_finds():
    "At the counts samples_needed returns, a Welch test of a one-SD difference clears the gate's one-sided 99.5% "
    "threshold in about 80% of simulated draws; at gate_power's own counts the simulated rate is its value."
    from scipy.stats import norm, ttest_ind
    from entropy_grpo.gate import GATE_Q, gate_power, samples_needed
    rng, crit = np.random.default_rng(0), norm.ppf(GATE_Q)
    sim = lambda na, nb: np.mean([ttest_ind(rng.normal(1.0, 1, na), rng.normal(0, 1, nb), equal_var=False).statistic
                                  > crit for _ in range(2000)])
    na, nb = samples_needed(76)
    assert na == 76 and 10 < nb < 30 and 0.74 < sim(na, nb) < 0.86, (nb, sim(na, nb))
    for n_a, n_b in ((40, 8), (20, 20)): assert abs(sim(n_a, n_b) - gate_power(n_a, n_b)) < 0.06
    assert samples_needed(8) == (24, 24) and gate_power(24, 24) >= 0.8      # 8 hacked cannot get there: both grow
    assert gate_power(1, 100) == 0.0


def test_pool_flags_name_a_style_pool_that_hacks():
    def pool(name, hacked):
        return Pool(name, None, {0: [dict(hacked=h, reward=3.5 if h else 1.0) for h in hacked]})
    flags = pool_flags([pool("teacher", [True] * 4), pool("base", [False] * 4), pool("style", [True, True, False])])
    assert flags == ["style-matched pool hacks on 67% of samples without the hint: few clean samples in the "
                     "teacher's style"]


def test_the_readme_table_of_verdicts_says_what_the_terminal_says():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for rec, (rests, todo) in NEXT_STEPS.items():
        assert f"| {rec} | {rests} | {todo} |" in readme, rec


def test_the_gates_p_is_counted_over_every_labelling_ties_included():
    "Steps of 3 hacked + 1 clean sample: 4⁴ = 256 labellings. gate_null's exact p is a brute-force count over them"
    " (utils.welch each, the observed labelling — the most extreme — included): 1/256; moving x by 1e-12, as another"
    " CPU's rounding does, leaves it. Past EXACT_UP_TO labellings it samples: p = (1 + hits) / 2001."
    import itertools
    from entropy_grpo.gate import gate_null
    from entropy_grpo.utils import welch
    rng = np.random.default_rng(3)
    x = np.r_[rng.normal(0.6, 0.05, 12), rng.normal(0.0, 0.05, 4)]
    lab, steps = [True] * 12 + [False] * 4, [i // 3 for i in range(12)] + [0, 1, 2, 3]
    t0, ts = welch(list(x[:12]), list(x[12:]))["t"], []
    for clean in itertools.product(*[[i for i in range(16) if steps[i] == s] for s in range(4)]):
        m = np.ones(16, bool); m[list(clean)] = False
        ts.append(welch(list(x[m]), list(x[~m]))["t"])
    null, p, how = gate_null(x, lab, steps)
    assert how == "all 256 labellings within steps" and len(ts) == len(null) == 256
    assert p == sum(t >= t0 - 1e-9 * abs(t0) for t in ts) / 256 == 1 / 256
    assert gate_null(x + rng.normal(0, 1e-12, 16), lab, steps)[1] == p
    null, p, how = gate_null(rng.normal(size=40), [True] * 20 + [False] * 20, [0] * 40)      # C(40, 20) labellings
    assert how == "labels permuted within steps 2000×" and len(null) == 2000 and round(p * 2001, 9) % 1 == 0


def test_a_gate_whose_labellings_cannot_reach_its_level_does_not_judge():
    "One style-clean sample beside 4 hacked in each step, at a 3-SD effect (power ≥ 80% either way): 3 steps give"
    " 5³ = 125 labellings, so even the most extreme has p = 1/125 > 0.5% — inconclusive, never 'likely fail'; 4 steps"
    " give 625 and p = 1/625: success."
    rows = lambda n: gate_rows(three_pools(hack=0.3, n_steps=n, n_style=1), style_pool="style", gate_effect=3.0)
    few, enough = rows(3)["hack_specific"], rows(4)["hack_specific"]
    assert few["verdict"] == "inconclusive" and few["detail"].startswith(
        "too few samples for the gate: the steps' labels allow only 125 labellings"), few
    assert few["to_decide"] == "more clean samples in the steps, so that their labels allow at least 200 labellings"
    assert decide(list(rows(3).values()))["recommendation"] == "inconclusive: too few samples for the gate"
    assert enough["verdict"] == "success" and enough["null"].startswith("all 625 labellings within steps: one-sided "
                                                                        "p 0.0016"), enough
