"""dr_grpo: the loss and its gradient equal TRL's dr_grpo and dapo formulas (clipping and KL included), the ratio-one
gradient equals its closed form by finite differences, and streamed backward over microbatches equals one batch."""
import math

import pytest
import torch

from entropy_grpo.dr_grpo import dr_grpo_loss, group_advantages, policy_gradient_backward
from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor

QS = ["Question: What is 1 + 2? Answer:", "Q: 5 * 5 =", "Q: 9 - 4 =", "Question: What is 30 + 4? Answer:"]


def trl_dr_grpo(logp, old_logp, ref_logp, adv, mask, max_completion_length, eps_low, eps_high, beta):
    "TRL's loss_type='dr_grpo' written out on flattened completions [N, T]: Σ masked per-token loss / (N · L_max)."
    coef_1 = torch.exp(logp - old_logp)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if beta:
        per_token = per_token + beta * (torch.exp(ref_logp - logp) - (ref_logp - logp) - 1)
    return (per_token * mask).sum() / (per_token.size(0) * max_completion_length)


def trl_dapo(logp, old_logp, ref_logp, adv, mask, eps_low, eps_high, beta):
    "TRL's loss_type='dapo' (its default), one process, no accumulation: Σ masked per-token loss / Σ mask."
    return trl_dr_grpo(logp, old_logp, ref_logp, adv, mask, 1, eps_low, eps_high, beta) * logp.size(0) / mask.sum()


@pytest.mark.parametrize("loss_type", ["dr_grpo", "dapo"])
@pytest.mark.parametrize("spread,beta,eps", [(1e-3, 0.0, 0.2), (0.5, 0.0, 0.2), (0.5, 0.04, (0.2, 0.28))],
                         ids=["ratio~1", "clipping", "clip-higher+kl"])
def test_loss_and_gradient_equal_trl_formula(spread, beta, eps, loss_type):
    g = torch.Generator().manual_seed(0)
    B, G, T, L = 3, 4, 7, 9
    new = (-torch.rand(B, G, T, generator=g, dtype=torch.float64) * 3)
    old = new + torch.randn(B, G, T, generator=g, dtype=torch.float64) * spread
    ref = new + torch.randn(B, G, T, generator=g, dtype=torch.float64) * 0.3
    mask = torch.rand(B, G, T, generator=g) > 0.25
    adv = group_advantages(torch.randn(B, G, generator=g, dtype=torch.float64))
    a, b = new.clone().requires_grad_(), new.clone().requires_grad_()
    norm = dict(length_norm="dapo", n_tokens=float(mask.sum())) if loss_type == "dapo" else {}
    ours, st = dr_grpo_loss(a, old, adv, mask, max_len=L, clip_eps=eps, beta=beta, ref_logp=ref, return_stats=True,
                            **norm)
    lo, hi = (eps, eps) if isinstance(eps, float) else eps
    flat = (b.flatten(0, 1), old.flatten(0, 1), ref.flatten(0, 1), adv.flatten(), mask.flatten(0, 1))
    theirs = trl_dr_grpo(*flat, L, lo, hi, beta) if loss_type == "dr_grpo" else trl_dapo(*flat, lo, hi, beta)
    ours.backward(); theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-15)
    n_clipped = int(st["n_clipped"])
    # the clipped branch really is exercised
    assert (n_clipped == 0) if spread < 0.01 else (n_clipped > 0), n_clipped
    print(f"{spread=}: loss {float(ours):.6f} (TRL {float(theirs):.6f}), clipped tokens {n_clipped}/{int(mask.sum())}")


def _setup(policy, top_p):
    "The float64 policy (model, tokenizer), a generated batch of 3 prompts × 4 completions and random advantages."
    model, tok = policy
    cfg = GenerationConfig(temperature=0.9, top_p=top_p, max_new_tokens=8, num_generations=4, tf_batch_size=4)
    sp = SequenceProcessor(model, tok, cfg, progress=False)
    U = sp.generate_batched(QS[:3], seed=3)
    rewards = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return model, sp, U, group_advantages(rewards)


@pytest.fixture
def float64_norms(monkeypatch):
    "LlamaRMSNorm computes in float32 even for a float64 model; for finite differences keep it in float64."
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_ratio_one_gradient_is_closed_form_by_finite_differences(top_p, float64_norms, fresh_tiny64):
    "−(1/B) Σ_b (1/(G·L_max)) Σ_g A Σ_t log q: its central difference along a unit direction equals ⟨∇loss, v⟩."
    model, sp, U, adv = _setup(fresh_tiny64, top_p)
    model.zero_grad()
    policy_gradient_backward(sp, U, adv, prompts_per_microbatch=1)
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(7)
    v = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()}
    norm = math.sqrt(sum(float((x ** 2).sum()) for x in v.values()))
    v = {n: x / norm for n, x in v.items()}
    analytic = sum(float((p.grad * v[n]).sum()) for n, p in params.items())
    support = sp.teacher_force_logprobs(U, compute_rb=False, return_support=True)[1]["support"]

    def closed_form(eps):   # θ's kept sets at every position: top-p's kept set must not move within the step
        over = {n: p.detach() + eps * v[n] for n, p in params.items()}
        res, _ = sp.teacher_force_logprobs(U, compute_rb=False, params_override=over, support=support)
        return float(-(adv[..., None] * res.logprobs * res.gen_mask).sum() / (3 * 4 * 8))
    eps = 1e-3
    fd = (closed_form(eps) - closed_form(-eps)) / (2 * eps)
    print(f"top_p={top_p}: analytic {analytic:.10f}, finite difference {fd:.10f}, "
          f"rel. error {abs(fd - analytic) / abs(analytic):.1e}")
    assert abs(fd - analytic) <= 1e-6 * abs(analytic), (fd, analytic)


@pytest.mark.parametrize("length_norm", ["max_len", "dapo"])
def test_streamed_backward_equals_one_batch(fresh_tiny64, length_norm):
    model, sp, U, adv = _setup(fresh_tiny64, 0.95)
    grads = []
    for ppm in (1, 2, 3):
        model.zero_grad()
        out = policy_gradient_backward(sp, U, adv, prompts_per_microbatch=ppm, length_norm=length_norm)
        grads.append((torch.cat([p.grad.flatten() for p in model.parameters()]), out["loss"]))
    for g, loss in grads[:2]:
        torch.testing.assert_close(g, grads[2][0], rtol=1e-12, atol=1e-15)
        assert loss == pytest.approx(grads[2][1], rel=1e-12)
