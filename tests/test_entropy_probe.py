"Entropy probe above its noise floor: dtypes, Δθ = a clipped train step, top-p 0.8 enumeration, verdicts, flags."
import copy, math
from dataclasses import replace

import pytest
import torch
from fastcore import test as fc
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from entropy_grpo.delta_entropy_is import DeltaEntropyIS, importance_config, update_backward
from entropy_grpo.dr_grpo import group_advantages, loss_token_weights, policy_gradient_backward
from entropy_grpo.phase2 import decide, entropy_probe_row
from entropy_grpo.policies import tiny_policy
from entropy_grpo.probe_state import probe_copy, probe_dtype
from entropy_grpo.probes import covariance_predictor, run_mixed_probe, update_delta, update_settings
from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor, as_batched_sequences, make_probe_batch
from entropy_grpo.tasks import ArithmeticTask
from entropy_grpo.training import GenerationSource, TrainConfig, train
from tiny_inputs import probe_components, with_advantages


def components(top_p=0.95, dtype=torch.float64, seed=0, **bc):
    return probe_components(tiny_policy(seed, dtype=dtype), top_p, **bc)


def batches(pc):
    return pc.sample_E_batch_with_replacement(), with_advantages(pc.sample_U_batch_distinct())


def train_optimizer(params, cfg=TrainConfig()):
    "The AdamW `train` builds for `cfg`."
    return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                             weight_decay=cfg.weight_decay)


# ---------------------------------------------------------------------------------------------------- precision

def test_bf16_and_fp16_scoring_is_refused_with_the_reason():
    for name in ("bfloat16", "float16"):
        fc.test_fail(lambda: probe_dtype(name), contains=f"below {name}'s resolution")
    fc.test_fail(lambda: probe_dtype("int8"), contains="expected 'auto', 'float64' or 'float32'")
    assert probe_dtype("auto") == torch.float64 and probe_dtype(None) == torch.float64
    assert probe_dtype("float32") == torch.float32
    pc = components(dtype=torch.float32)
    E, U = batches(pc)
    opt = train_optimizer(pc.sp.model.parameters())
    fc.test_fail(lambda: run_mixed_probe(pc.sp, E, U, opt, dtype="bfloat16"), contains="refuses to score in bfloat16")


def test_float64_and_float32_agree_where_float32_clears_its_floor():
    pc = components(dtype=torch.float32)
    E, U = batches(pc)
    sp, opt = pc.sp, torch.optim.AdamW(pc.sp.model.parameters(), lr=1e-3)
    sp64, opt64 = probe_copy(sp, opt, torch.float64)
    assert next(sp64.model.parameters()).dtype == torch.float64 and next(sp.model.parameters()).dtype == torch.float32
    p32 = DeltaEntropyIS(sp.model, sp.config, sequence_processor=sp)
    p64 = DeltaEntropyIS(sp64.model, sp64.config, sequence_processor=sp64)
    f32, f64 = p32.noise_floor(E)["floor"], p64.noise_floor(E)["floor"]
    print(f"floor float32 {f32:.2e}, float64 {f64:.2e}")
    assert f64 < f32 / 100
    checked = 0
    for a, b in zip(p32.entropy_changes(E, U, opt, [1e-4, 1e-3]), p64.entropy_changes(E, U, opt64, [1e-4, 1e-3])):
        print(a["lr"], a["deltaH_true"], b["deltaH_true"])
        if abs(a["deltaH_true"]) > 10 * f32:
            assert abs(a["deltaH_true"] - b["deltaH_true"]) < 0.1 * abs(b["deltaH_true"])
            checked += 1
    assert checked


# ------------------------------------------------------------------------------------- the training update

class StandInSource(GenerationSource):
    "Live generation with the stand-in reward (the tiny policy earns none)."
    def __call__(self, step, sp, config, seed):
        ro = super().__call__(step, sp, config, seed)
        r = ro.batch.sequences.double()[..., -3:].mean(-1)
        return replace(ro, rewards=r, records=[[{"reward": float(x)} for x in row] for row in r])


class ProbeAtStep:
    "At `step`, after train's backward: the probe's Δθ (clipped and not) and the IS step's realised Δθ."
    def __init__(self, step): self.step = step

    def on_after_backward(self, ctx):
        if ctx.step != self.step: return
        U = make_probe_batch(ctx.batch, ctx.rewards, ctx.advantages, max_new_tokens=ctx.sp.config.max_new_tokens)
        grads = [p.grad.clone() for p in ctx.model.parameters()]
        self.theta = {n: p.detach().clone() for n, p in ctx.model.named_parameters()}
        upd = update_settings(ctx.config)
        self.delta, self.info = update_delta(ctx.sp, U, ctx.optimizer, **upd)
        self.unclipped, _ = update_delta(ctx.sp, U, ctx.optimizer, **{**upd, "max_grad_norm": None})
        probe = DeltaEntropyIS(ctx.model, ctx.sp.config, sequence_processor=ctx.sp)
        self.is_step = probe.entropy_change(U, U, ctx.optimizer, {**upd, "return_delta": True})["delta_theta"]
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, ctx.model.parameters()))   # .grad as found


def test_probe_delta_theta_is_a_clipped_train_step():
    model, tok = tiny_policy(0, dtype=torch.float64)
    cfg = TrainConfig(max_steps=2, prompts_per_step=2, num_generations=4, learning_rate=1e-3, max_grad_norm=1e-3,
                      generation=GenerationConfig(temperature=1.0, top_p=0.95, max_new_tokens=8))
    probe = ProbeAtStep(1)                                           # step 1: Adam's state is not empty
    res = train(model, tok, config=cfg, callbacks=[probe], source=StandInSource(ArithmeticTask(n=20)))
    assert res.records[1]["grad_norm"] > 10 * cfg.max_grad_norm      # clipping acts
    params = dict(res.model.named_parameters())
    real = {n: p.detach() - probe.theta[n] for n, p in params.items()}
    norm = math.sqrt(sum(float((d ** 2).sum()) for d in real.values()))
    rel = lambda d: math.sqrt(sum(float(((d[n] - real[n]) ** 2).sum()) for n in real)) / norm
    errors = dict(first_order=rel({n: probe.delta[p] for n, p in params.items()}), is_step=rel(probe.is_step),
                  unclipped=rel({n: probe.unclipped[p] for n, p in params.items()}))
    print(errors, probe.info["grad_norm"], probe.info["clip_coef"])
    assert errors["first_order"] < 1e-5 and errors["is_step"] < 1e-5
    assert errors["unclipped"] > 1e-2                                # the comparison can tell a missing clip


def test_probe_refuses_an_optimizer_that_is_not_trains():
    pc = components()
    E, U = batches(pc)
    cfg = TrainConfig(weight_decay=0.1)
    opt = torch.optim.AdamW(pc.sp.model.parameters(), lr=1e-3)      # weight decay 0.01, not the config's 0.1
    fc.test_fail(lambda: run_mixed_probe(pc.sp, E, U, opt, train_config=cfg),
                 contains="not measure the training update")
    fc.test_fail(lambda: run_mixed_probe(pc.sp, E, U, train_optimizer(pc.sp.model.parameters(), cfg), train_config=cfg,
                                         cfg_importance={"max_grad_norm": None}), contains="contradicts train_config")


# ------------------------------------------------------------------------------ covariance predictor, units

def test_covariance_predictor_per_sequence_is_the_token_covariance_summed_along_a_sequence():
    pc = components()
    _, U = batches(pc)
    res, _ = pc.sp.teacher_force_logprobs(as_batched_sequences(U), compute_rb=False)
    m = res.gen_mask.double()
    lq, A = res.logprobs.double(), U["advantages"].double()[..., None].expand_as(m)
    n = m.sum()
    c_lq, c_A = (lq * m).sum() / n, (A * m).sum() / n
    per_seq = (((lq - c_lq) * (A - c_A) * m).sum(-1)).mean()        # Σ_t of centred products, mean over sequences
    tok = covariance_predictor(U, pc.sp)
    seq = covariance_predictor(U, pc.sp, per="sequence")
    assert abs(seq - float(per_seq)) < 1e-9 * max(1.0, abs(seq))
    assert abs(seq - tok * float(n) / m.shape[0] / m.shape[1]) < 1e-9 * max(1.0, abs(seq))
    fc.test_fail(lambda: covariance_predictor(U, pc.sp, per="position"), contains="per='position'")


@pytest.mark.parametrize("length_norm", ["max_len", "dapo"])
def test_loss_token_weights_carry_the_training_updates_gradient(length_norm):
    "Σ_t w_t ∇log q_t with w = loss_token_weights is the training update's gradient on U (update_backward, unclipped)."
    pc = components()
    _, U = batches(pc)
    params = [p for p in pc.sp.model.parameters() if p.requires_grad]
    cfg = importance_config(dict(max_grad_norm=None, length_norm=length_norm))
    update_backward(pc.sp, U, params, cfg)
    res, _ = pc.sp.teacher_force_logprobs(as_batched_sequences(U), with_grad=True, compute_rb=False)
    w = loss_token_weights(res.logprobs, U["advantages"], res.gen_mask, pc.sp.config.max_new_tokens,
                           cfg["length_norm"], cfg["clip_eps"])
    got = torch.autograd.grad(-(w.to(res.logprobs) * res.logprobs).sum(), params)
    assert max(float(p.grad.abs().max()) for p in params) > 0
    for g, p in zip(got, params): torch.testing.assert_close(g, p.grad, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------- the probe, its floor and verdicts

def test_probe_scores_a_float64_copy_and_its_verdict_row():
    pc = components(dtype=torch.float32)
    E, U = batches(pc)
    opt = train_optimizer(pc.sp.model.parameters())
    before = {n: p.detach().clone() for n, p in pc.sp.model.named_parameters()}
    out = run_mixed_probe(pc.sp, E, U, opt, lrs=(3e-4, 1e-4, 3e-5, 1e-5), plot=False)
    print(out["table"], out["floor"], out["slope"], out["verdict"])
    assert out["dtype"] == "float64" and out["update"]["max_grad_norm"] == 1.0
    assert all(torch.equal(p, before[n]) for n, p in pc.sp.model.named_parameters())
    assert next(pc.sp.model.parameters()).dtype == torch.float32 and not opt.state    # the run's copy untouched
    assert out["verdict"] == "success" and len(out["qualifying_lrs"]) >= 3 and 1.6 <= out["slope"] <= 2.5
    assert all(r["gap"] == r["deltaH_true_fixed_support"] - r["deltaH1"] for r in out["rows"])   # signed, not abs()
    assert all("cov_ratio" in r and "coverage" in r and "support_new_mass_per_sequence" in r for r in out["rows"])
    d0 = out["rows"][0]["disc_predictor"] / out["rows"][0]["lr"]
    assert d0 != 0 and all(r["disc_predictor"] == pytest.approx(d0 * r["lr"], rel=1e-12) for r in out["rows"])
    row = entropy_probe_row(out, arm="vanilla")
    assert row["key"] == "entropy_probe" and row["verdict"] == "success" and "noise floor" in row["null"]


def test_below_noise_floor_names_lrs_to_try_and_leaves_the_recommendation():
    pc = components(dtype=torch.float32)
    E, U = batches(pc)
    opt = train_optimizer(pc.sp.model.parameters())
    low = run_mixed_probe(pc.sp, E, U, opt, lrs=(1e-8, 3e-9, 1e-9), dtype="float32", max_extra_lrs=0, plot=False)
    print(low["table"], low["detail"])
    assert low["verdict"] == "below noise floor" and len(low["qualifying_lrs"]) < 3
    assert low["try_lrs"] and min(low["try_lrs"]) > 1e-8 and str(low["try_lrs"]) in low["detail"]
    row = entropy_probe_row(low)
    assert row["verdict"] == "below noise floor" and "try lrs" in row["detail"]
    base = [dict(key=k, metric=k, arm="vanilla", value="", null=None, verdict="success", detail="")
            for k in ("hack_specific", "cos_in", "contrib", "step_along_v")]
    for r in (row, {**row, "verdict": "fail", "detail": "slope 0.22 outside [1.6, 2.5]"}):
        d = decide(base + [r])
        assert d["recommendation"] == decide(base)["recommendation"] == "launch Phase 3"
        assert any(r["detail"] in rule for rule in d["rules"])
    ext = run_mixed_probe(pc.sp, E, U, opt, lrs=(1e-8, 3e-9, 1e-9), dtype="float32", max_extra_lrs=2, lr_step=10.0,
                          plot=False)
    assert [r["lr"] for r in ext["rows"]][-2:] == pytest.approx([1e-7, 1e-6])     # the grid is extended upward


def test_low_ess_and_nonfinite_changes_are_named_flags():
    pc = components()
    E, U = batches(pc)
    opt = train_optimizer(pc.sp.model.parameters())
    out = run_mixed_probe(pc.sp, E, U, opt, lrs=(1e-5, 1e-2, 1e300), max_extra_lrs=0, plot=False,
                          cfg_importance={"min_ess_frac": 0.9})
    flags = {(f["name"], f["lr"]) for f in out["flags"]}
    print(out["table"], out["detail"])
    assert ("low_ess", 1e-2) in flags and ("nonfinite_deltaH_true", 1e300) in flags
    assert not any(r["qualifies"] for r in out["rows"] if r["flags"])
    assert "low_ess (lr=0.01)" in out["detail"] and "nonfinite_deltaH_true (lr=1e+300)" in out["detail"]
    assert "low_ess" in out["table"] and "nonfinite_deltaH_true" in entropy_probe_row(out)["detail"]


# --------------------------------------------------------------------- support growth: exact enumeration at 0.8

def warped_logq(model, ids, temperature, top_p):
    "log-softmax of transformers' warpers applied to a plain, unpadded forward. ids [L] -> [L-1, V]."
    logits = model(torch.as_tensor(ids)[None]).logits[0, :-1].double()
    for w in [TemperatureLogitsWarper(temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1 else []):
        logits = w(None, logits)
    return logits.log_softmax(-1)


@torch.no_grad()
def enumerate_step(new, old, prompt, eos, V, max_new, T, top_p):
    "Exact H(θ⁺); θ⁺'s mass on θ's support (every token kept at θ); and E_θ⁺[RB sum | θ's support], by enumeration."
    H, cov, cov_S, stack = 0.0, 0.0, 0.0, [(list(prompt), 0.0, 0.0, True)]
    while stack:
        ids, lq, S, covered = stack.pop()
        q, q_old = (warped_logq(m, ids + [eos], T, top_p)[-1] for m in (new, old))
        kept = q > float("-inf")
        Ht = float(-(q[kept].exp() * q[kept]).sum())
        for y in kept.nonzero().flatten().tolist():
            lqy, Sy, cy = lq + float(q[y]), S + Ht, covered and bool(q_old[y] > float("-inf"))
            if y == eos or len(ids) + 1 - len(prompt) == max_new:
                P = math.exp(lqy)
                H -= P * lqy
                if cy: cov, cov_S = cov + P, cov_S + P * Sy
            else:
                stack.append((ids + [y], lqy, Sy, cy))
    return H, cov, cov_S / cov


@pytest.mark.slow
def test_support_changing_step_at_top_p_08_against_enumeration():
    "A step that lets tokens into θ⁺'s kept sets: SNIS sees θ⁺ on θ's support only, and the coverage says how much."
    model, tok = tiny_policy(0, vocab_size=7, pad_is_eos=True, alphabet="abcdef", init_std=0.6, dtype=torch.float64)
    T, top_p, max_new, V, eos = 0.7, 0.8, 3, 7, tok.eos_token_id
    cfg = GenerationConfig(temperature=T, top_p=top_p, max_new_tokens=max_new, num_generations=8, gen_batch_size=512)
    sp = SequenceProcessor(model, tok, cfg)
    prompt = tok("abc", add_special_tokens=False)["input_ids"]
    kept = (warped_logq(model, prompt + [eos], T, top_p)[-1] > float("-inf")).nonzero().flatten()
    full = SequenceProcessor(model, tok, replace(cfg, top_p=1.0))     # U off θ's nucleus: first tokens it drops
    U_seqs = full.generate_batched(["abc"] * 4, seed=5)
    r = (~torch.isin(U_seqs.sequences[:, :, U_seqs.prompt_lens[0]], kept)).double()
    U = make_probe_batch(U_seqs, r, group_advantages(r), max_new_tokens=max_new)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    old = copy.deepcopy(model)
    H0, _, _ = enumerate_step(model, model, prompt, eos, V, max_new, T, top_p)
    probe = DeltaEntropyIS(model, cfg, sequence_processor=sp)
    outs = [probe.entropy_change(sp.generate_batched(["abc"] * 64, seed=1000 + d), U, opt) for d in range(8)]
    opt.zero_grad(); policy_gradient_backward(sp, U_seqs, U["advantages"]); opt.step()
    H1, cov, S_cov = enumerate_step(model, old, prompt, eos, V, max_new, T, top_p)
    est, c = (torch.tensor([o[k] for o in outs]) for k in ("deltaH_true", "coverage"))
    se, se_c = est.std() / len(est) ** 0.5, c.std() / len(c) ** 0.5
    new_mass = sum(o["support_new_mass_per_sequence"] for o in outs) / len(outs)
    print(f"exact ΔH {H1 - H0:+.5f}, on θ's support {S_cov - H0:+.5f}; estimated {est.mean():+.5f} ± {se:.5f}; "
          f"coverage exact {cov:.5f}, reported {c.mean():.5f} ± {se_c:.5f}; new-token mass / sequence {new_mass:.5f}; "
          f"changed positions {outs[0]['n_support_changed_positions']}")
    assert all(o["n_support_changed_positions"] > 0 for o in outs)    # the step changes kept sets
    assert cov < 0.9 and new_mass > 0.1                                # and tokens enter them: SNIS misses mass
    assert abs(c.mean() - cov) < 4 * se_c                              # the reported coverage is the real one
    assert abs(est.mean() - (S_cov - H0)) < 4 * se                     # SNIS estimates H⁺ on θ's support
    gap, bound = abs(est.mean() - (H1 - H0)), (1 - c.mean()) * max_new * math.log(V)
    assert gap > 4 * se                                                # the missed support shows ...
    assert gap < 4 * se + bound                                        # ... and the reported coverage explains it
