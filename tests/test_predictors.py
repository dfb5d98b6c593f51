"""predictors: the literature's predictors of the entropy change, each against its formula computed by hand on a tiny
vocabulary, and against ΔH₁ and the true change where its assumption (plain SGD on the logits) holds exactly."""
import math

import pytest
import torch
from fastcore.test import test_fail

from entropy_grpo.predictors import covariance_delta_entropy, discriminator_delta_entropy, logit_stats


def by_hand(row:list[float], k:int, T:float) -> dict:
    "The four numbers of one position with Python floats: softmax of row / T, H, log p_k, S*_k, Σ_j p_j S*_j."
    e = [math.exp(x / T) for x in row]
    p = [x / sum(e) for x in e]
    H = -sum(q * math.log(q) for q in p)
    S = [q * (H + math.log(q)) for q in p]
    return dict(H=H, logp=math.log(p[k]), S=S[k], S_bar=sum(q * s for q, s in zip(p, S)))


@pytest.mark.parametrize("T", [1.0, 0.7])
def test_logit_stats_match_the_formulas_by_hand(T):
    "Leading shape [2, 3], V 5, blocks of 2 positions (a block boundary inside the batch)."
    g = torch.Generator().manual_seed(1)
    logits, tokens = 3 * torch.randn(2, 3, 5, generator=g), torch.randint(0, 5, (2, 3), generator=g)
    st = logit_stats(logits, tokens, temperature=T, block=2)
    for key in ("H", "logp", "S", "S_bar"):
        assert st[key].shape == (2, 3) and st[key].dtype == torch.float64
    for i in range(2):
        for j in range(3):
            want = by_hand(logits[i, j].tolist(), int(tokens[i, j]), T)
            for key, v in want.items(): assert float(st[key][i, j]) == pytest.approx(v, rel=1e-6, abs=1e-9), key


def test_bad_input_is_refused_in_one_line():
    test_fail(lambda: logit_stats(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long)), contains="logits (3, 5)",
              exc=ValueError)
    test_fail(lambda: logit_stats(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), temperature=0.0),
              contains="temperature=0.0", exc=ValueError)


def test_one_raised_logit_changes_entropy_by_minus_eps_s_star():
    "ΔH = −ε S*_k + O(ε²): the gap quarters when ε halves; the sign flips at p_k = exp(−H)."
    z = torch.tensor([2.0, 1.0, 0.3, -0.5, -1.5], dtype=torch.float64)
    H = lambda z: float(-(z.softmax(-1) * z.log_softmax(-1)).sum())
    st = logit_stats(z.expand(5, 5), torch.arange(5))
    for k in range(5):
        gap = [abs(H(z + eps * torch.eye(5, dtype=torch.float64)[k]) - H(z) + eps * float(st["S"][k]))
               for eps in (2e-3, 1e-3)]
        assert gap[0] / gap[1] == pytest.approx(4, rel=0.05)
        assert (float(st["S"][k]) > 0) == (float(z.softmax(-1)[k]) > math.exp(-float(st["H"][k])))


def test_sgd_on_the_logits_the_discriminator_is_delta_h1():
    "Logits as the parameters, loss −Σ_t w_t log p_t(k_t), one SGD step: the predictor equals ⟨∇H, Δθ⟩ to 1e-12 "
    "and the true change to O(lr²)."
    g = torch.Generator().manual_seed(0)
    Z, k = torch.randn(7, 11, generator=g, dtype=torch.float64), torch.randint(0, 11, (7,), generator=g)
    w = torch.randn(7, generator=g, dtype=torch.float64)
    H = lambda Z: -(Z.softmax(-1) * Z.log_softmax(-1)).sum(-1)
    Zg = Z.clone().requires_grad_()
    gH = torch.autograd.grad(H(Zg).sum(), Zg)[0]
    loss_grad = torch.autograd.grad(-(w * Zg.log_softmax(-1).gather(-1, k[:, None]).squeeze(-1)).sum(), Zg)[0]
    gaps = []
    for lr in (0.2, 0.1):
        dZ = -lr * loss_grad
        pred = discriminator_delta_entropy(logit_stats(Z, k), lr * w)
        assert pred.shape == (7,) and float(pred.sum()) == pytest.approx(float((gH * dZ).sum()), abs=1e-12)
        assert pred.tolist() == pytest.approx((gH * dZ).sum(-1).tolist(), abs=1e-12)   # position by position
        gaps.append(abs(float(H(Z + dZ).sum() - H(Z).sum()) - float(pred.sum())))
    assert gaps[0] / gaps[1] == pytest.approx(4, rel=0.1)


def test_covariance_formula_by_hand_and_equal_to_delta_h1_under_its_step():
    "−lr Cov_{a∼p}(log p_a, A_a) by hand on V 4; every logit moved by lr × its advantage: equal to ⟨∇H, Δz⟩ (1e-12), "
    "the true change O(lr²) away."
    z, A = [1.0, 0.2, -0.4, -1.1], [0.5, -1.0, 2.0, 0.0]
    e = [math.exp(x) for x in z]
    p = [x / sum(e) for x in e]
    lp = [math.log(q) for q in p]
    mean = lambda x: sum(q * v for q, v in zip(p, x))
    cov = mean([l * a for l, a in zip(lp, A)]) - mean(lp) * mean(A)
    got = covariance_delta_entropy(torch.tensor(z, dtype=torch.float64), torch.tensor(A, dtype=torch.float64), 0.1)
    assert float(got) == pytest.approx(-0.1 * cov, rel=1e-12)
    g = torch.Generator().manual_seed(3)
    Z, Adv = torch.randn(5, 9, generator=g, dtype=torch.float64), torch.randn(5, 9, generator=g, dtype=torch.float64)
    H = lambda Z: -(Z.softmax(-1) * Z.log_softmax(-1)).sum(-1)
    Zg = Z.clone().requires_grad_()
    gH = torch.autograd.grad(H(Zg).sum(), Zg)[0]
    gaps = []
    for lr in (0.1, 0.05):
        pred = covariance_delta_entropy(Z, Adv, lr)
        assert pred.tolist() == pytest.approx((gH * lr * Adv).sum(-1).tolist(), abs=1e-12)
        gaps.append(abs(float(H(Z + lr * Adv).sum() - H(Z).sum() - pred.sum())))
    assert gaps[0] / gaps[1] == pytest.approx(4, rel=0.1)
    test_fail(lambda: covariance_delta_entropy(Z, Adv[:, :3], 0.1), contains="advantages (5, 3)", exc=ValueError)


@pytest.mark.parametrize("sampling", [dict(top_p=1.0), dict(top_p=0.8, temperature=0.9), dict(top_k=5, top_p=0.9)])
def test_sampled_stats_are_logit_stats_of_transformers_warped_logits(tiny64, sampling):
    "Teacher forcing with disc=True on the tiny float64 policy: H, log q, S*, S̄ of the sampled distribution equal "
    "logit_stats of transformers' warpers' logits (−inf outside the kept set) at every completion position."
    from entropy_grpo.predictors import sampled_stats
    from entropy_grpo.rb_entropy import warped_logits
    from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor
    model, tok = tiny64
    gc = GenerationConfig(max_new_tokens=7, num_generations=3, head_chunk_size=5, **sampling)
    sp = SequenceProcessor(model, tok, gc)
    seqs = sp.generate_batched(["ab", "abcdef"], seed=3)
    res = sp.teacher_force_logprobs(seqs, disc=True)[0]
    ours, P = sampled_stats(res), max(seqs.prompt_lens)
    ids, attn = seqs.sequences.flatten(0, 1), seqs.attention_masks.flatten(0, 1)
    with torch.no_grad():
        logits = model(ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0)).logits
    ref = logit_stats(warped_logits(logits[:, P - 1:-1], gc.temperature, gc.top_p, gc.top_k), ids[:, P:])
    m = res.gen_mask
    assert m.sum() > 20
    for key in ("H", "logp", "S", "S_bar"):
        torch.testing.assert_close(ours[key][m], ref[key].view(ours[key].shape)[m], atol=1e-12, rtol=1e-10)
        assert (ours[key][~m] == 0).all()
    test_fail(lambda: sampled_stats(sp.teacher_force_logprobs(seqs)[0]), contains="disc=True", exc=ValueError)


def test_square_sums_count_a_token_outside_its_kept_set_as_log_q_does():
    "Row 1's token 3 lies outside its nucleus {2}: it joins the set, and Σ q², Σ q² log q are over {2, 3}."
    from entropy_grpo.rb_entropy import token_stats
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, -5.0]], dtype=torch.float64)
    st = token_stats(x, torch.tensor([0, 3]), top_p=0.7, disc=True)
    keep = torch.tensor([[True, True, False, False], [False, False, True, True]])
    lq = x.masked_fill(~keep, -math.inf).log_softmax(-1)
    q = lq.exp()
    torch.testing.assert_close(st["q2"], (q * q).sum(-1), atol=1e-15, rtol=0)
    torch.testing.assert_close(st["q2logq"], torch.where(keep, q * q * lq, 0.).sum(-1), atol=1e-15, rtol=0)
    torch.testing.assert_close(st["logq"], lq[[0, 1], [0, 3]], atol=1e-15, rtol=0)
