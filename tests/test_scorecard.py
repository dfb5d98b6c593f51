"""scorecard: each step's predictions against the real step the trainer takes, the tabular predictors by hand, the
loss weights against Dr.GRPO's formula, and the scoring of a run."""
import copy, math

import pytest
import torch
from fastcore.test import test_fail

from entropy_grpo.predictors import step_predictors
from entropy_grpo.scorecard import PREDICTORS, loss_weights, run_scorecard, scorecard, scorecard_table
from entropy_grpo.sequence_processor import GenerationConfig, LogprobResults
from entropy_grpo.training import TrainConfig
from toy_tasks import DigitTask


def _cfg(**kw):
    return TrainConfig(**{**dict(max_steps=1, prompts_per_step=2, num_generations=3, lr_scheduler_type="constant",
                                 generation=GenerationConfig(max_new_tokens=6, top_p=0.9)), **kw})


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch"])
def test_delta_h1_is_the_first_order_of_the_step_the_trainer_took(tiny64, optim):
    "One step at lr and lr/2 from the same policy, E and U (top_p 0.9): the fixed-support change minus ΔH₁ is the "
    "step's second order (ratio ≈ 4), so ΔH₁ is the derivative along the very step the trainer took (clipping and "
    "optimizer included)."
    lr = 0.02 if optim == "sgd" else 8e-5
    gaps = []
    for scale in (1.0, 0.5):
        r = run_scorecard(*copy.deepcopy(tiny64), DigitTask(32), _cfg(learning_rate=lr * scale, optim=optim,
                                                                       max_grad_norm=0.5), E_prompts=3)["records"][0]
        assert set(PREDICTORS) <= {k[5:] for k in r if k.startswith("pred_")} and math.isfinite(r["deltaH_true"])
        gaps.append(r["deltaH_true_fixed_support"] - r["pred_deltaH1"])
        assert abs(gaps[-1]) < 0.2 * abs(r["pred_deltaH1"])
    assert gaps[0] / gaps[1] == pytest.approx(4, rel=0.15)


def test_step_predictors_by_hand():
    "B 1, G 2, T 3 with a padded slot: the discriminator's sum over positions per sequence and the token covariance."
    g = torch.Generator().manual_seed(0)
    st = {k: torch.randn(1, 2, 3, generator=g, dtype=torch.float64) for k in ("H", "logp", "S", "S_bar")}
    w, mask = torch.randn(1, 2, 3, generator=g, dtype=torch.float64), torch.tensor([[[1, 1, 1], [1, 1, 0]]]).bool()
    out = step_predictors(st, w, mask, lr=0.3)
    pos = [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1)]
    disc = sum(-0.3 * float(w[i]) * float(st["S"][i] - st["S_bar"][i]) for i in pos) / 2
    lq, ws = [float(st["logp"][i]) for i in pos], [float(w[i]) for i in pos]
    cov = sum(a * b for a, b in zip(lq, ws)) / 5 - sum(lq) / 5 * sum(ws) / 5
    assert out == pytest.approx(dict(discriminator=disc, covariance=-0.3 * cov * 5 / 2, n_tokens=5, n_sequences=2))
    test_fail(lambda: step_predictors(st, w[..., :2], mask, 0.1), contains="weights (1, 2, 2)", exc=ValueError)


@pytest.mark.parametrize("loss_type", ["dr_grpo", "grpo"])
def test_loss_weights_are_the_advantage_over_the_normaliser(loss_type):
    "Dr.GRPO: w = A / (prompts · G · L_max); GRPO: A / (prompts · G · the completion's length)."
    A = torch.tensor([[1.0, -0.5, -0.5], [0.3, 0.0, -0.3]])
    mask = torch.zeros(2, 3, 5, dtype=torch.bool)
    lens = torch.tensor([[5, 2, 3], [1, 4, 5]])
    for b in range(2):
        for j in range(3): mask[b, j, :lens[b, j]] = True
    res = LogprobResults(torch.randn(2, 3, 5), torch.zeros(2, 3, 5), None, mask)
    c = _cfg(prompts_per_step=2, loss_type=loss_type, generation=GenerationConfig(max_new_tokens=5))
    L = torch.full((2, 3), 5.0) if loss_type == "dr_grpo" else lens.double()
    want = (A.double() / (2 * 3 * L))[..., None] * mask
    torch.testing.assert_close(loss_weights(res, A, c), want)


def test_more_than_one_iteration_is_refused_in_one_line(tiny64):
    test_fail(lambda: run_scorecard(*copy.deepcopy(tiny64), DigitTask(32), _cfg(num_iterations=2), E_prompts=2),
              contains="num_iterations=2", exc=ValueError)


def test_scorecard_counts_signs_ranks_and_ratios():
    "Six steps: ΔH₁ = 2 ΔH_true (all signs, ρ = 1, ratio 2); the covariance is wrong in sign on the one resolved "
    "step; the majority-sign control agrees with half; a NaN ΔH_true and a step with no gradient (all 0, an "
    "agreement that says nothing) are left out."
    true, se = [0.5, -0.01, 0.02, -0.03, float("nan"), 0.0], [0.1, 0.1, 0.1, 0.1, 0.1, 0.0]
    recs = [dict(deltaH_true=t, deltaH_true_se=s, pred_deltaH1=2 * t, pred_covariance=-t if i == 0 else t,
                 pred_discriminator=1.0 if i < 5 else 0.0, grad_norm=0.0 if i == 5 else 0.3)
            for i, (t, s) in enumerate(zip(true, se))]
    rows = {r["predictor"]: r for r in scorecard(recs)}
    assert rows["deltaH1"]["steps"] == 4 and rows["deltaH1"]["sign_agreement"] == 1
    assert rows["deltaH1"]["spearman"] == pytest.approx(1) and rows["deltaH1"]["median_ratio"] == pytest.approx(2)
    assert rows["covariance"]["sign_agreement"] == 0.75 and rows["covariance"]["resolved_steps"] == 1
    assert rows["covariance"]["sign_agreement_resolved"] == 0
    assert rows["discriminator"]["sign_agreement"] == 0.5
    assert rows["majority_sign"]["sign_agreement"] == 0.5 and math.isnan(rows["majority_sign"]["spearman"])
    assert scorecard(recs[1:4])[-1]["sign_agreement"] == pytest.approx(2 / 3)   # two of three steps fell
    assert "ΔH₁" in scorecard_table(list(rows.values()))
