"""contributions: per-sample gradients by hooks, vmap and a loop agree and sum to the batch gradient of
policy_gradient_backward; sample losses sum to dr_grpo_loss; cosines and norms; the Phase-1 probe and its Welch
t-test against scipy."""
import math, random

import pytest
import torch
from fastcore.test import test_fail
from peft import LoraConfig, get_peft_model
from scipy.stats import ttest_ind

from entropy_grpo.contributions import (cosines, grad_norms, per_sample_grads, phase1_bucket, phase1_probe,
                                        phase1_ttest, sample_contributions, sample_losses)
from entropy_grpo.dr_grpo import dr_grpo_loss, group_advantages, length_normaliser, policy_gradient_backward
from entropy_grpo.policies import tiny_policy
from entropy_grpo.pools import build_pool, mixed_records, replay_batch
from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor
from entropy_grpo.tasks import ArithmeticTask
from entropy_grpo.checkpoints import trainable_parameters
from toy_tasks import POOL_GEN


@pytest.mark.parametrize("length_norm", ["sample", "realized", "max_len"])
def test_contributions_sum_to_batch_gradient_and_methods_agree(pools, lora64, length_norm):
    "float64: hooks == vmap == loop (1e-12), and their sum == dr_grpo's policy_gradient_backward gradient."
    sp = lora64
    seqs = replay_batch(mixed_records(list(pools), 0, 2), sp.tokenizer)
    adv = group_advantages(torch.tensor([[3.5, 1.0, 0.25, 0.0]], dtype=torch.float64))
    con = {m: sample_contributions(sp, seqs, sp.model, adv, length_norm=length_norm, method=m)
           for m in ("hooks", "vmap", "loop")}
    assert con["hooks"].method == "hooks" and con["hooks"].n == 4
    sp.model.zero_grad()
    policy_gradient_backward(sp, seqs, adv, length_norm=length_norm)
    ref = {n: p.grad.clone() for n, p in trainable_parameters(sp.model).items()}
    sp.model.zero_grad()
    assert set(ref) == set(con["loop"].grads) and all(ref[n].abs().sum() > 0 for n in ref)
    for c in con.values():
        for n in ref:
            assert c.grads[n].shape == (4, *ref[n].shape)
            torch.testing.assert_close(c.grads[n], con["loop"].grads[n], rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(c.total()[n], ref[n], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(c.losses, con["loop"].losses)


def test_contributions_linear_bias_and_non_linear_params(pools):
    "Weights and biases of plain Linear layers via hooks; a non-Linear parameter makes auto choose vmap; float32."
    model, tok = tiny_policy(1, attention_bias=True)
    sp = SequenceProcessor(model, tok, POOL_GEN)
    seqs = replay_batch(mixed_records(list(pools), 1, 2), tok)
    adv = torch.tensor([[1.5, -0.5, 0.25, -1.25]])
    attn = model.model.layers[0].self_attn
    linear = {"q.w": attn.q_proj.weight, "q.b": attn.q_proj.bias, "v.w": attn.v_proj.weight}
    hooks = sample_contributions(sp, seqs, linear, adv)
    loop = sample_contributions(sp, seqs, linear, adv, method="loop")
    assert hooks.method == "hooks"
    for n in linear: torch.testing.assert_close(hooks.grads[n], loop.grads[n], rtol=1e-4, atol=1e-6)
    mixed = {"norm": model.model.norm.weight, "q.w": attn.q_proj.weight}
    auto = sample_contributions(sp, seqs, mixed, adv)
    assert auto.method == "vmap"
    loop = sample_contributions(sp, seqs, mixed, adv, method="loop")
    for n in mixed: torch.testing.assert_close(auto.grads[n], loop.grads[n], rtol=1e-4, atol=1e-6)
    test_fail(lambda: sample_contributions(sp, seqs, mixed, adv, method="hooks"), contains="nn.Linear", exc=ValueError)
    test_fail(lambda: sample_contributions(sp, seqs, {"head": model.lm_head.weight}, adv, method="hooks"),
              contains="LM head", exc=ValueError)
    test_fail(lambda: sample_contributions(sp, seqs, linear, adv, method="ghost"),
              contains="method='ghost'", exc=ValueError)


def test_nll_mode_is_mean_length_normalised_nll(pools, lora64):
    "nll contributions sum to ∇ mean_i(−Σ_t log q / L_i); the gradient equals grpo with every advantage 1."
    sp = lora64
    seqs = replay_batch(pools[0].steps[1], sp.tokenizer)
    params = trainable_parameters(sp.model)
    con = sample_contributions(sp, seqs, params, loss_mode="nll")
    res, _ = sp.teacher_force_logprobs(seqs, with_grad=True, compute_rb=False)
    nll = (-(res.logprobs * res.gen_mask).sum(-1) / res.gen_mask.sum(-1)).mean()
    ref = torch.autograd.grad(nll, list(params.values()))
    ones = sample_contributions(sp, seqs, params, torch.ones(1, 4, dtype=torch.float64))
    for (n, g), r in zip(con.total().items(), ref):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(ones.grads[n], con.grads[n], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.tensor(con.loss, dtype=torch.float64), nll.detach())


@pytest.mark.parametrize("length_norm", ["sample", "realized", "max_len"])
def test_sample_losses_sum_to_dr_grpo_loss(length_norm):
    torch.manual_seed(0)
    lp, m = -torch.rand(2, 3, 7, requires_grad=True), torch.rand(2, 3, 7) > 0.3
    A = group_advantages(torch.randn(2, 3))
    terms = sample_losses(lp, m, A, length_norm=length_norm, max_len=7)
    assert terms.shape == (2, 3)
    torch.testing.assert_close(terms.sum(), dr_grpo_loss(lp, None, A, m, 7, length_norm=length_norm))
    g = per_sample_grads(terms, {"lp": lp}, "vmap")["lp"]                  # [6, 2, 3, 7]
    L = length_normaliser(m, 7, length_norm)
    closed = -(A[..., None] * m / (3 * L[..., None]) / 2)                # only sample i's row is non-zero in g[i]
    torch.testing.assert_close(g.sum(0), closed)
    assert all(g[i].view(6, 7)[[j for j in range(6) if j != i]].abs().sum() == 0 for i in range(6))
    test_fail(lambda: sample_losses(lp, m, None), contains="needs advantages", exc=ValueError)
    test_fail(lambda: sample_losses(lp, m, A, loss_mode="kl"), contains="loss_mode='kl'", exc=ValueError)


def test_cosines_and_norms():
    g = {"a": torch.tensor([[1., 0.], [0., 2.], [0., 0.]]), "b": torch.tensor([[0.], [0.], [0.]])}
    V = {"a": torch.tensor([1., 1.]), "b": torch.tensor([0.])}
    c = cosines(g, V)
    torch.testing.assert_close(c[:2], torch.tensor([1 / math.sqrt(2)] * 2, dtype=torch.float64))
    assert math.isnan(c[2])                                              # zero gradient: undefined, not 0
    torch.testing.assert_close(cosines(g, torch.tensor([1., 1., 0.])), c, equal_nan=True)
    torch.testing.assert_close(cosines(g, V, "module_mean")[:2], c[:2])  # module b is NaN (V_b = 0) and left out
    torch.testing.assert_close(grad_norms(g), torch.tensor([1., 2., 0.], dtype=torch.float64))
    test_fail(lambda: cosines(g, {"a": V["a"]}), contains="missing ['b']", exc=ValueError)
    test_fail(lambda: cosines(g, torch.ones(4)), contains="expected a flat [3]", exc=ValueError)


def test_phase1_probe_runs_on_a_pool(pools, lora64):
    sp = lora64
    V = {n: torch.ones_like(p) for n, p in trainable_parameters(sp.model).items()}
    out = phase1_probe(sp, pools[0], sp.model, V, steps=[0])
    assert len(out["samples"]) == 4 and all(-1 <= s["cos"] <= 1 for s in out["samples"])
    assert out["n_pure_hack"] == out["n_hack_correct"] == 0 and math.isnan(out["t"])


def test_phase1_ttest_matches_scipy():
    rng = random.Random(0)
    recs, vals = [], []
    for i in range(160):
        kind = i % 4                                                   # 80 pure hack, 40 correct, 40 neither
        recs.append(dict(hacked=kind < 2, gt_pass=kind == 2, lenient_pass=kind != 3))
        vals.append(rng.gauss(0.75, 0.3) if kind < 2 else rng.gauss(0.4, 0.35))
    vals[0] = None                                                                    # undefined cosine: left out
    out = phase1_ttest(recs, vals)
    a = [v for r, v in zip(recs, vals) if phase1_bucket(r) == "pure_hack" and v is not None]
    b = [v for r, v in zip(recs, vals) if phase1_bucket(r) == "hack_correct"]
    t, p = ttest_ind(a, b, equal_var=False)
    assert (out["n_pure_hack"], out["n_hack_correct"]) == (79, 40)
    assert out["t"] == pytest.approx(t, rel=1e-12) and out["p"] == pytest.approx(p, rel=1e-12)
    assert out["mean_pure_hack"] == pytest.approx(sum(a) / len(a))
    assert phase1_bucket(dict(hacked=True, gt_pass=True)) == "hack_correct"                # foreign records
    assert phase1_bucket(dict(hacked=False, gt_pass=False, lenient_pass=True)) is None
    test_fail(lambda: phase1_ttest(recs, vals[:3]), contains="160 records but 3 values", exc=ValueError)


@pytest.mark.slow
def test_contributions_on_smollm2_lora(tmp_path):
    "The embedded default policy with LoRA r=8 on q_proj/v_proj: hooks == vmap == loop, float32 tolerances."
    from entropy_grpo.policies import load_policy
    model, tok = load_policy(device="cpu")
    lora = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights=False))
    sp = SequenceProcessor(lora, tok, GenerationConfig(max_new_tokens=12, temperature=0.8, top_p=0.95))
    task = ArithmeticTask(20)
    pools = [build_pool(sp, task, h, 1, 2, tmp_path/n) for n, h in (("teacher", True), ("base", False))]
    seqs = replay_batch(mixed_records(pools, 0, 2), tok)
    adv = torch.tensor([[1.0, 0.5, -0.5, -1.0]])
    con = {m: sample_contributions(sp, seqs, lora, adv, method=m) for m in ("hooks", "vmap", "loop")}
    for m in ("hooks", "vmap"):
        for n, g in con["loop"].grads.items():
            torch.testing.assert_close(con[m].grads[n], g, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("loss_mode", ["grpo", "nll"])
def test_contributions_in_microbatches_equal_one_graph(pools, lora64, loss_mode):
    "One graph per prompt gives the rows of one graph over the batch; each teacher-forcing call sees one prompt."
    sp = lora64
    seqs = replay_batch([mixed_records(list(pools), 0, 2), mixed_records(list(pools), 1, 2)], sp.tokenizer)
    B, G = seqs.shape[:2]
    adv = group_advantages(torch.arange(B * G, dtype=torch.float64).reshape(B, G).cos())
    whole = sample_contributions(sp, seqs, sp.model, adv, loss_mode=loss_mode, prompts_per_microbatch=B)
    seen, tf = [], sp.teacher_force_logprobs
    sp.teacher_force_logprobs = lambda s, **kw: (seen.append(s.shape[0]), tf(s, **kw))[1]
    try: parts = sample_contributions(sp, seqs, sp.model, adv, loss_mode=loss_mode, prompts_per_microbatch=1)
    finally: del sp.teacher_force_logprobs
    assert B > 1 and seen == [1] * B
    torch.testing.assert_close(parts.losses, whole.losses, rtol=1e-12, atol=1e-14)
    for n in whole.grads: torch.testing.assert_close(parts.grads[n], whole.grads[n], rtol=1e-9, atol=1e-12)
