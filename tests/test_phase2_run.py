"""phase2_run: a step without reward spread (every cosine None) is a gap in the table's means and in the figure, not a
crash (it crashed the report's figures cell in 12 of 120 tiny runs); the run's configuration refuses bad values."""
import matplotlib
import pytest
from fastcore.test import test_fail

from entropy_grpo.decision import verification_table
from entropy_grpo.phase2_run import Phase2Config, Phase2Run
from test_decision import synthetic

matplotlib.use("Agg")


def test_a_step_without_spread_is_a_gap_not_a_crash(tmp_path):
    arms = synthetic()
    for arm in arms.values():                                # step 3: all samples one reward, no gradient
        s = arm["steps"][3]
        s.update(cos_in=None, cos_out=None, reward_spread=0.0, cos_step=None, cos_step_plain=None,
                 controls=[dict(c, cos_in=None, cos_step=None, cos_step_plain=None) for c in s["controls"]])
        for r in arm["slim"]:
            if r["step"] == 3: r.update(reward=0.25, cos_S_contrib=None)
    rows, _ = verification_table(arms, G=8)
    assert {r["key"]: r["verdict"] for r in rows if r["arm"] == "vanilla"}["cos_in"] == "success"
    run = Phase2Run.__new__(Phase2Run)                       # the figure from recorded numbers, no model needed
    run.cfg, run.arms, run.out = Phase2Config(model="tiny", G=8, out_dir=str(tmp_path)), arms, tmp_path
    run.alignment_figure()
    assert (tmp_path / "alignment.png").stat().st_size > 0


@pytest.mark.parametrize("bad, says", [(dict(G=7), "G=7: expected an even group size"),
                                       (dict(fit_steps=24), "fit_steps=24: expected 1 <= fit_steps < pool_steps=24"),
                                       (dict(arm="vanilla"), "arm='vanilla'"), (dict(steps=0), "steps=0"),
                                       (dict(teacher_pool="x"), "expected teacher and base (and optionally style)"),
                                       (dict(style_pool="s"), "expected teacher and base"), (dict(lrs=[]), "lrs=[]"),
                                       (dict(G=6), "G=6: expected a multiple of 4 with a style-matched pool"),
                                       (dict(steps=21), "steps=21: each step replays a step file of its own")])
def test_config_refuses_bad_values(bad, says):
    test_fail(lambda: Phase2Config(**bad), contains=says, exc=ValueError)


def test_pools_and_groups_follow_the_style_pool():
    "Built pools are three by default (G/2 teacher, G/4 base, G/4 style); given pools are two unless style_pool."
    assert Phase2Config().per_pool == [4, 2, 2] and Phase2Config(style_matched=False).per_pool == [4, 4]
    two = Phase2Config(teacher_pool="t", base_pool="b", G=6)
    assert not two.three_pools and two.per_pool == [3, 3]
    assert Phase2Config(teacher_pool="t", base_pool="b", style_pool="s").per_pool == [4, 2, 2]
    assert Phase2Config(teacher_pool="t", base_pool="b", steps=30).steps == 30      # given pools: checked on load


def test_what_would_decide_is_said_for_any_group_size(tmp_path):
    "A two-pool run of G = 2 (no G/4 style samples a step) still turns the gate's sample size into steps."
    from entropy_grpo.gate import COINCIDE
    run = Phase2Run.__new__(Phase2Run)
    run.cfg, run.flags = Phase2Config(model="tiny", G=2, teacher_pool="t", base_pool="b"), []
    run.rows = [dict(key="hack_specific", metric="gate", arm="vanilla", value="", null=None, verdict="inconclusive",
                     detail=f"{COINCIDE}: 0 clean teacher samples", to_decide="about 3 each would decide", needed=3)]
    d = run._decide()
    assert d["recommendation"] == f"inconclusive: {COINCIDE}" and "steps=3, pool_steps=7" in d["to_decide"], d
    assert "`entropy-grpo pools style --model <the teacher model> --style-of t` and -p style_pool=style" in \
        d["to_decide"], d                                     # the command that adds the style-matched pool
