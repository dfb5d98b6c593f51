"Phase-2 decision rules and the Phase-3 cost ceiling on synthetic metrics: every branch of PHASES.md."
import pytest

from entropy_grpo.experiments import hack_rate_separation
from entropy_grpo.phase2 import phase2_decision

ALIGNED = [0.3, 0.25, 0.4, 0.22, 0.35]
TEACHER, BASE = [0.7, 0.6, 0.8, 0.75], [0.05, -0.02, 0.0, 0.03]


def test_aligned_and_effective_projection_launches():
    d = phase2_decision(ALIGNED, [0.01, 0.02, 0.0, 0.03, 0.01], TEACHER, BASE, null_level=0.01)
    assert d["launch_phase3"] and not d["stop"]
    assert any("Phase 3 justified" in r for r in d["rules"]) and any("mechanism is effective" in r for r in d["rules"])


def test_over_projection_is_a_bug_and_stops():
    d = phase2_decision(ALIGNED, [-0.3, -0.2, -0.4, -0.3, -0.25], TEACHER, BASE)
    assert d["stop"] and not d["launch_phase3"] and d["recommendation"] == "STOP (bug)"
    d = phase2_decision(ALIGNED, [-0.3, -0.2, -0.4, -0.3, -0.25], TEACHER, BASE, frac_fired_projected=[1.0, 0.9, 1.0, 0.8, 0.9])
    assert d["stop"], "judged on the fully projected steps 0 and 2"


def test_negative_cos_out_from_unprojected_modules_is_not_over_projection():
    "One-sided projection leaves modules with a negative component alone: cos_out < 0 while some did not fire is expected."
    d = phase2_decision(ALIGNED, [-0.01, -0.12, -0.02, -0.04, -0.06], TEACHER, BASE, frac_fired_projected=[0.96, 0.76, 0.94, 0.9, 0.75])
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


def test_cost_ceiling_separation():
    rising = [[0.0] * 5 + [0.1] * 10 + [0.5] * 5, [0.05] * 15 + [0.4] * 5, [0.0] * 15 + [0.6] * 5]
    flat = [[0.02] * 20, [0.03] * 20, [0.01] * 19 + [0.05]]
    assert hack_rate_separation(rising)["separated"]
    assert not hack_rate_separation(flat)["separated"]
    noisy = [[0.0] * 15 + [0.9] * 5, [0.3] * 15 + [0.0] * 5, [0.0] * 20]       # mean rise > 0.1 but not > 2 SE
    assert not hack_rate_separation(noisy)["separated"]
    with pytest.raises(ValueError, match="no hack-rate curves"):
        hack_rate_separation([])
