"""on_policy: the policy's own hack gradient and v_hack's alignment with it. The gradient is exactly the one the first
Phase-3 training step follows (same rollout, scaled by the reward gap) and leaves the run as found; without a spread
in hacking there is no gradient and no alignment; a random basis is one more draw of its null; the Phase-2 row says
all of it and never decides."""
import numpy as np
import pytest
import torch
from fastcore.test import test_fail

from entropy_grpo.calibration import HackTokenTask, hack_tokens, world_run
from entropy_grpo.on_policy import hack_gradient, on_policy_alignment, on_policy_row
from entropy_grpo.phase2_run import Phase2Config
from entropy_grpo.phase3_run import Phase3Config, Phase3Run
from entropy_grpo.projection_arms import random_v_hack
from entropy_grpo.training import train


@pytest.fixture(scope="module")
def tok():
    from entropy_grpo.policies import tiny_tokenizer
    return tiny_tokenizer()


class _Flagged(HackTokenTask):
    "Every reply graded hacked (all_hack=True) or none: each group's advantages are exactly zero."
    def __init__(self, tok, ids, all_hack): super().__init__(tok, ids); self.all_hack = all_hack
    def grade(self, response, problem): return dict(super().grade(response, problem), hacked=self.all_hack)


def _run(tmp_path, task):
    run = Phase3Run(Phase3Config(seed=0, preset="truth", steps=1, out_dir=str(tmp_path/"run")), task)
    run.add_arm()
    return run


def _grad(run, prompts, seed=0):
    return hack_gradient(run.adapter, run.tok, run.task, run.gen, run.train_config, prompts, seed)


def test_hack_gradient_is_the_gradient_phase3_follows(tok, tmp_path):
    "Same rollout as the first training step (seed 0): train's gradient = (3.5 − 0.25) × hack_gradient — the sign the "
    "arms see; .grad and train/eval mode as found; groups with no spread in hacking give exactly zero, alignment NaN."
    ids = hack_tokens("signal", tok, seed=0)
    task = HackTokenTask(tok, ids)
    run = _run(tmp_path, task)
    p = run.adapter.parameters()[0]
    p.grad = torch.full_like(p, 7.0)
    g, rate = _grad(run, 4)
    assert torch.equal(p.grad, torch.full_like(p, 7.0)) and not run.adapter.model.training and 0 < rate < 1
    seen = {}
    class Grab:
        def on_after_backward(self, ctx=None): seen.update(run.adapter.flat_grads())
    train(run.adapter.model, run.tok, task, run.train_config, out_dir=tmp_path/"train", callbacks=[Grab()],
          progress=False, reference=run.adapter.zeroed)
    assert all(torch.allclose(seen[m], 3.25 * g[m], rtol=1e-4, atol=1e-7) for m in g)
    assert any(v.abs().sum() > 0 for v in g.values())
    for all_hack in (True, False):
        flagged = _run(tmp_path, _Flagged(tok, ids, all_hack))
        z, r = _grad(flagged, 4)
        assert r == float(all_hack) and all(not v.any() for v in z.values())
        a = on_policy_alignment(flagged.adapter, tok, flagged.task, flagged.gen, flagged.train_config,
                                random_v_hack(flagged.adapter, 1, seed=3), prompts=4, n_random=2)
        assert np.isnan(a["alignment"]) and np.isnan(a["subspace"]) and a["hack_rate"] == float(all_hack)
        row = on_policy_row(a)
        assert row["verdict"] == "information" and row["value"].startswith("undefined") and row["null"] is None
    test_fail(lambda: _grad(run, 0), contains="prompts=0", exc=ValueError)


def test_a_random_basis_is_within_its_null_and_the_row_says_so(tok, tmp_path):
    run = _run(tmp_path, HackTokenTask(tok, hack_tokens("signal", tok, seed=0)))
    r = on_policy_alignment(run.adapter, tok, run.task, run.gen, run.train_config,
                            random_v_hack(run.adapter, 1, seed=999), prompts=4, n_random=40)
    assert abs(r["alignment"]) <= 3 * r["null_q95"] and abs(r["null_mean"]) < r["null_q95"]
    assert 0 <= r["subspace"] <= 3 * r["subspace_null_q95"] and abs(r["alignment"]) <= r["subspace"]
    assert -1 <= r["reproducibility"] <= 1 and len(r["batches"]) == 2 and r["replies"] == 2 * 4 * 8
    assert len(r["null_cos"]) == 40 and r["null_q95"] == np.quantile(np.abs(r["null_cos"]), 0.95)
    row = on_policy_row(r, "projected")
    assert row["key"] == "on_policy" and row["verdict"] == "information"
    assert row["value"].startswith(f"{r['alignment']:+.3f}") and f"{r['null_q95']:.3f}" in row["null"]
    test_fail(lambda: on_policy_alignment(run.adapter, tok, run.task, run.gen, run.train_config,
                                          random_v_hack(run.adapter, 1), n_random=0), contains="n_random=0")


def test_phase2_carries_the_row_and_never_decides_by_it(tmp_path):
    "A calibration world's Phase 2 with the world's grader: the on-policy row is in its table, as information."
    r = world_run("signal_partial", 5, tmp_path)
    row = next(x for x in r["rows"] if x["key"] == "on_policy")
    assert row["verdict"] == "information" and row["arm"] == "projected"
    test_fail(lambda: Phase2Config(on_policy_prompts=-1), contains="on_policy_prompts=-1", exc=ValueError)
    off = world_run("signal_partial", 5, tmp_path, dict(on_policy_prompts=0))
    assert not any(x["key"] == "on_policy" for x in off["rows"])
    assert off["recommendation"] == r["recommendation"]
