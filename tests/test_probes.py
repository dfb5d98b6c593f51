"probes: samplers, ∇H(E) vs finite differences, Δθ vs a real step, ΔH₁ vs ΔH_true as lr -> 0, estimators."
import pytest
import torch

from entropy_grpo.dr_grpo import policy_gradient_backward
from entropy_grpo.probes import (BatchConfig, _future_sums, entropy_gradient, first_order_delta_entropy,
                                 optimizer_delta, run_mixed_probe)
from entropy_grpo.sequence_processor import to_batched_sequences
from tiny_inputs import probe_components, with_advantages


def test_samplers_shapes_and_duplicates(tiny64):
    pc = probe_components(tiny64, n_problems=3, E_total_sequences=40, G=4, B_U=3)
    E, U = pc.sample_E_batch_with_replacement(), pc.sample_U_batch_distinct()
    assert E["sequences"].shape[:2] == (10, 4) and U["sequences"].shape[:2] == (3, 4)
    assert len(set(E["prompt_ids"])) < len(E["prompt_ids"])          # 10 draws from 3 problems repeat
    assert len(set(U["prompt_ids"])) == 3
    assert E["advantages"].shape == E["rewards"].shape == (10, 4)
    with pytest.raises(ValueError):
        pc.sample_U_batch_distinct(B_U=4)                              # 4 distinct from 3 cannot be done
    with pytest.raises(ValueError, match="E_sampling_mode='both'"):
        BatchConfig(E_sampling_mode="both")
    pc2 = probe_components(tiny64, n_problems=20, E_sampling_mode="distinct", E_total_sequences=24, G=4)
    assert len(set(pc2.sample_E_batch()["prompt_ids"])) == 6


@pytest.mark.parametrize("estimator", ["snis", "causal"])
def test_grad_H_matches_finite_differences(tiny64, estimator):
    pc = probe_components(tiny64)
    E, sp, model = pc.sample_E_batch_with_replacement(), pc.sp, pc.sp.model
    seqs = to_batched_sequences(E)
    base, diag = sp.teacher_force_logprobs(seqs, return_support=True)
    m = base.gen_mask.double()
    lq0 = base.sequence_logprobs.flatten()
    Gk = _future_sums(base.rb_entropies, m)
    coef = (Gk - (Gk * m).sum((0, 1)) / m.sum((0, 1)).clamp_min(1)) * m

    def f(eps, d):
        "The estimator's own definition at θ + eps·d (θ's kept sets): SNIS entropy, or the causal surrogate."
        over = {n: p.detach() + eps * dd for (n, p), dd in zip(model.named_parameters(), d)}
        r, _ = sp.teacher_force_logprobs(seqs, params_override=over, support=diag["support"])
        if estimator == "causal":
            return float(((r.rb_entropies + coef * r.logprobs) * m).sum() / lq0.numel())
        S, lw = (r.rb_entropies * m).sum(-1).flatten(), r.sequence_logprobs.flatten() - lq0
        w = torch.exp(lw - lw.max())
        return float((w * S).sum() / w.sum())

    gH, _ = entropy_gradient(sp, E, estimator)
    torch.manual_seed(1)
    for d, eps, tol in (([torch.randn_like(p) for p in model.parameters()], 1e-2, 2e-3),
                        ([g.clone() for g in gH], 1e-3, 1e-4)):
        nrm = sum(float((x ** 2).sum()) for x in d) ** 0.5
        d = [x / nrm for x in d]
        analytic = sum(float((g * x).sum()) for g, x in zip(gH, d))
        fd = (f(eps, d) - f(-eps, d)) / (2 * eps)
        print(estimator, analytic, fd)
        assert abs(fd - analytic) <= tol * abs(analytic)
    assert all(p.grad is None for p in model.parameters())            # .grad left as found


@pytest.mark.parametrize("opt_kind", ["adamw", "adamw_amsgrad", "adam_l2", "sgd_nesterov"])
def test_rebuilt_delta_theta_matches_real_step(tiny64, opt_kind):
    pc = probe_components(tiny64)
    sp, model = pc.sp, pc.sp.model
    U = with_advantages(pc.sample_U_batch_distinct())
    make = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
            "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True),
            "adam_l2": lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.01),
            "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
            }[opt_kind]
    opt = make(model.parameters())
    for _ in range(2):                                                  # non-empty state
        opt.zero_grad(); policy_gradient_backward(sp, to_batched_sequences(U), U["advantages"]); opt.step()
    U2 = with_advantages(pc.sample_U_batch_distinct())
    out = first_order_delta_entropy(sp, pc.sample_E_batch_with_replacement(), U2, opt, check_step=True)
    print(opt_kind, out["delta_theta_rel_error"])
    assert out["delta_theta_rel_error"] < 1e-5


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_first_order_matches_fixed_support_change_to_second_order(tiny64, top_p):
    pc = probe_components(tiny64, top_p=top_p)
    E, U = pc.sample_E_batch_with_replacement(), with_advantages(pc.sample_U_batch_distinct())
    opt = torch.optim.AdamW(pc.sp.model.parameters(), lr=1e-3)
    probe = run_mixed_probe(pc.sp, E, U, opt, lrs=(3e-4, 1e-4, 3e-5, 1e-5), plot=False)
    print(top_p, probe["slope"], probe["table"])
    ratios = [r["deltaH1"] / r["deltaH_true_fixed_support"] for r in probe["rows"]]   # lrs ascending
    assert abs(ratios[0] - 1) < 0.01 and abs(ratios[0] - 1) < abs(ratios[-1] - 1)
    assert 1.7 <= probe["slope"] <= 2.3
    if top_p == 1.0:
        assert all(r["deltaH_support_change"] == 0 for r in probe["rows"])


@pytest.mark.slow
def test_causal_agrees_with_snis_in_expectation_with_smaller_spread(tiny64):
    pc = probe_components(tiny64, top_p=1.0, E_total_sequences=32)
    U = with_advantages(pc.sample_U_batch_distinct())
    opt = torch.optim.AdamW(pc.sp.model.parameters(), lr=1e-4)
    est = {"snis": [], "causal": []}
    for _ in range(16):
        E = pc.sample_E_batch_with_replacement()
        for k in est: est[k].append(first_order_delta_entropy(pc.sp, E, U, opt, estimator=k)["deltaH1"])
    s, c = torch.tensor(est["snis"]), torch.tensor(est["causal"])
    se = ((s.var() + c.var()) / len(s)) ** 0.5
    print(f"ΔH₁ snis {s.mean():.3e} ± {s.std():.2e}  causal {c.mean():.3e} ± {c.std():.2e}")
    assert abs(s.mean() - c.mean()) < 4 * se
    assert c.std() < s.std()


def test_unsupported_optimizer_is_named(tiny64):
    pc = probe_components(tiny64)
    model = pc.sp.model
    for p in model.parameters(): p.grad = torch.zeros_like(p)
    with pytest.raises(NotImplementedError, match="RMSprop"):
        optimizer_delta(torch.optim.RMSprop(model.parameters()))
    with pytest.raises(ValueError, match="estimator='exact'"):
        entropy_gradient(pc.sp, pc.sample_E_batch_with_replacement(), "exact")


def test_a_wrapped_optimizer_gives_the_same_delta_theta(tiny64):
    "accelerate's AcceleratedOptimizer (what a Trainer's callbacks get) is read through to the torch optimizer."
    from accelerate import Accelerator
    pc = probe_components(tiny64)
    model = pc.sp.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for p in model.parameters(): p.grad = torch.randn_like(p)
    opt.step()
    wrapped = Accelerator(cpu=True).prepare_optimizer(opt)
    assert type(wrapped).__name__ == "AcceleratedOptimizer"
    a, b = optimizer_delta(wrapped), optimizer_delta(opt)
    assert a.keys() == b.keys() and all(torch.equal(a[p], b[p]) for p in a)
    for p in model.parameters(): p.grad = None
