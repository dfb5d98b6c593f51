"Dr.GRPO: the loss against TRL's formula, its gradient against finite differences, streaming, training, resume, 2 processes."
import json, math, os, shutil

import pytest
import torch
from torch.func import functional_call

from entropy_grpo.dr_grpo import dr_grpo_loss, group_advantages, policy_gradient_backward
from entropy_grpo.training import TrainConfig, latest_checkpoint, train
from entropy_grpo.policies import tiny_policy
from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor
from gloo import gloo_group, spawn_two
from toy_tasks import DigitTask

QS = ["Question: What is 1 + 2? Answer:", "Q: 5 * 5 =", "Q: 9 - 4 =", "Question: What is 30 + 4? Answer:"]


def trl_dr_grpo(logp, old_logp, ref_logp, adv, mask, max_completion_length, eps_low, eps_high, beta):
    "TRL's loss_type='dr_grpo' written out on flattened completions [N, T]: Σ masked per-token loss / (N · L_max)."
    coef_1 = torch.exp(logp - old_logp)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if beta:
        per_token = per_token + beta * (torch.exp(ref_logp - logp) - (ref_logp - logp) - 1)
    return (per_token * mask).sum() / (per_token.size(0) * max_completion_length)


@pytest.mark.parametrize("spread,beta,eps", [(1e-3, 0.0, 0.2), (0.5, 0.0, 0.2), (0.5, 0.04, (0.2, 0.28))],
                         ids=["ratio~1", "clipping", "clip-higher+kl"])
def test_loss_and_gradient_equal_trl_formula(spread, beta, eps):
    g = torch.Generator().manual_seed(0)
    B, G, T, L = 3, 4, 7, 9
    new = (-torch.rand(B, G, T, generator=g, dtype=torch.float64) * 3)
    old = new + torch.randn(B, G, T, generator=g, dtype=torch.float64) * spread
    ref = new + torch.randn(B, G, T, generator=g, dtype=torch.float64) * 0.3
    mask = torch.rand(B, G, T, generator=g) > 0.25
    adv = group_advantages(torch.randn(B, G, generator=g, dtype=torch.float64))
    a, b = new.clone().requires_grad_(), new.clone().requires_grad_()
    ours, st = dr_grpo_loss(a, old, adv, mask, max_len=L, clip_eps=eps, beta=beta, ref_logp=ref, return_stats=True)
    lo, hi = (eps, eps) if isinstance(eps, float) else eps
    theirs = trl_dr_grpo(b.flatten(0, 1), old.flatten(0, 1), ref.flatten(0, 1), adv.flatten(), mask.flatten(0, 1), L, lo, hi, beta)
    ours.backward(); theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-15)
    n_clipped = int(st["n_clipped"])
    assert (n_clipped == 0) if spread < 0.01 else (n_clipped > 0), n_clipped     # the clipped branch really is exercised
    print(f"{spread=}: loss {float(ours):.6f} (TRL {float(theirs):.6f}), clipped tokens {n_clipped}/{int(mask.sum())}")


def _setup(top_p, dtype=torch.float64):
    model, tok = tiny_policy(0, dtype=dtype)
    sp = SequenceProcessor(model, tok, GenerationConfig(temperature=0.9, top_p=top_p, max_new_tokens=8, num_generations=4,
                                                        tf_batch_size=4), progress=False)
    U = sp.generate_batched(QS[:3], seed=3)
    return model, sp, U, group_advantages(torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64))


@pytest.fixture
def float64_norms(monkeypatch):
    "LlamaRMSNorm computes in float32 even for a float64 model; for finite differences keep it in float64."
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_ratio_one_gradient_is_closed_form_by_finite_differences(top_p, float64_norms):
    "−(1/B) Σ_b (1/(G·L_max)) Σ_g A Σ_t log q: its central difference along a unit direction equals ⟨∇loss, v⟩."
    model, sp, U, adv = _setup(top_p)
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
    print(f"top_p={top_p}: analytic {analytic:.10f}, finite difference {fd:.10f}, rel. error {abs(fd - analytic) / abs(analytic):.1e}")
    assert abs(fd - analytic) <= 1e-6 * abs(analytic), (fd, analytic)


def test_streamed_backward_equals_one_batch():
    model, sp, U, adv = _setup(0.95)
    grads = []
    for ppm in (1, 2, 3):
        model.zero_grad()
        out = policy_gradient_backward(sp, U, adv, prompts_per_microbatch=ppm)
        grads.append((torch.cat([p.grad.flatten() for p in model.parameters()]), out["loss"]))
    for g, loss in grads[:2]:
        torch.testing.assert_close(g, grads[2][0], rtol=1e-12, atol=1e-15)
        assert loss == pytest.approx(grads[2][1], rel=1e-12)


def _cfg(**kw):
    base = dict(steps=30, prompts_per_step=4, num_generations=8, lora_r=8, lr=1e-2,
                generation=GenerationConfig(max_new_tokens=8))
    return TrainConfig(**(base | kw))


def test_lora_training_raises_reward():
    model, tok = tiny_policy(0)
    res = train(model, tok, DigitTask(64), _cfg(), progress=False)
    r = [rec["reward_mean"] for rec in res.records]
    before, after = sum(r[:5]) / 5, sum(r[-5:]) / 5
    print(f"digit-share reward: first 5 steps {before:.3f}, last 5 steps {after:.3f}")
    assert after > before + 0.05
    assert all(rec["arm"] == "vanilla" and rec["n_completions"] == 32 and 0 <= rec["clip_frac"] <= 1 for rec in res.records)
    trained = {n for n, p in res.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)


def test_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    cfg = _cfg(steps=4, checkpoint_every=2)
    a = train(*tiny_policy(0), DigitTask(64), cfg, out_dir=full, progress=False)
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step_000004")
    assert latest_checkpoint(part).name == "step_000002"
    b = train(*tiny_policy(0), DigitTask(64), cfg, out_dir=part, resume_from=latest_checkpoint(part), progress=False)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    strip = lambda rec: {k: v for k, v in rec.items() if not k.startswith("time_")}
    logs = [[strip(json.loads(l)) for l in (d / "log.jsonl").read_text().splitlines()] for d in (full, part)]
    assert logs[0] == logs[1] and [r["step"] for r in logs[1]] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="lr=0.01 \\(now 0.02\\)"):
        train(*tiny_policy(0), DigitTask(64), _cfg(steps=4, checkpoint_every=2, lr=2e-2), out_dir=part,
              resume_from=part / "checkpoints" / "step_000002", progress=False)
    with pytest.raises(ValueError, match="log.jsonl exists"):
        train(*tiny_policy(0), DigitTask(64), cfg, out_dir=part, progress=False)


def test_bad_config_and_non_finite_rewards():
    with pytest.raises(ValueError, match="prompts_per_step=0: expected an integer >= 1"):
        TrainConfig(prompts_per_step=0)
    with pytest.raises(ValueError, match="length_norm='mean': expected one of"):
        TrainConfig(length_norm="mean")

    class NaNTask(DigitTask):
        def grade_batch(self, responses, problems):
            out = super().grade_batch(responses, problems); out.rewards[0, 0] = math.nan; return out
    model, tok = tiny_policy(0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(FloatingPointError, match="step 0: the rewards contain NaN"):
        train(model, tok, NaNTask(8), _cfg(steps=1, lora_r=None), progress=False)
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))


# ---------------------------------------------------------------- 2 processes

class _Keep:
    "Saves this rank's step-0 batch, advantages and the (already all-reduced) gradients."
    def __init__(self, path): self.path = path

    def on_after_backward(self, ctx):
        if ctx.step == 0:
            torch.save(dict(batch=ctx.batch, adv=ctx.advantages, rewards=ctx.rewards,
                            grads={n: p.grad.clone() for n, p in ctx.model.named_parameters()}), self.path)


def _worker(rank, world, port, out_dir):
    with gloo_group(rank, world, port):
        model, tok = tiny_policy(0, dtype=torch.float64)
        res = train(model, tok, DigitTask(64), _cfg(steps=2, lora_r=None, lr=1e-3), progress=False,
                    callbacks=[_Keep(os.path.join(out_dir, f"step0_rank{rank}.pt"))])
        torch.save(dict(params=dict(res.model.named_parameters()), records=res.records),
                   os.path.join(out_dir, f"final_rank{rank}.pt"))


def test_two_processes_reduce_gradients_and_means(tmp_path):
    spawn_two(_worker, str(tmp_path))
    fin = [torch.load(tmp_path / f"final_rank{r}.pt", weights_only=False) for r in (0, 1)]
    for n, p in fin[0]["params"].items(): assert torch.equal(p, fin[1]["params"][n]), n     # ranks stay in sync
    untimed = lambda recs: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in recs]
    assert untimed(fin[0]["records"]) == untimed(fin[1]["records"])                          # every logged mean is global
    s0 = [torch.load(tmp_path / f"step0_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert s0[0]["batch"].shape[:2] == (2, 8) and s0[1]["batch"].shape[:2] == (2, 8)
    # one process: the gradient of the global loss is the sum of each rank's part, normalised by all 4 prompts
    model, tok = tiny_policy(0, dtype=torch.float64)
    sp = SequenceProcessor(model, tok, _cfg().generation, progress=False)
    model.zero_grad()
    for s in s0: policy_gradient_backward(sp, s["batch"], s["adv"], num_prompts=4)
    for n, p in model.named_parameters():
        torch.testing.assert_close(s0[0]["grads"][n], p.grad, rtol=1e-10, atol=1e-14)
    rewards = torch.cat([s["rewards"] for s in s0])
    rec = fin[0]["records"][0]
    assert rec["reward_mean"] == pytest.approx(float(rewards.double().mean()), rel=1e-12)
    assert rec["reward_std"] == pytest.approx(float(rewards.double().std()), rel=1e-9)
    assert rec["n_completions"] == 32 and fin[1]["records"][0]["reward_mean"] == rec["reward_mean"]
