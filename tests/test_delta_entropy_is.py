"""delta_entropy_is: the probe restores model, optimizer and RNG exactly (also when the update fails), its lr -> 0
limits, agreement with the enumerated entropy change, RB vs naive spread, 1 vs 2 processes, and bad input named."""
import copy, json, os

import pytest
import torch
from fastcore.test import test_fail

from entropy_grpo.delta_entropy_is import DeltaEntropyIS
from entropy_grpo.dr_grpo import group_advantages, policy_gradient_backward
from entropy_grpo.policies import tiny_policy
from entropy_grpo.probe_state import probe_copy
from entropy_grpo.sequence_processor import BatchedSequences, GenerationConfig, SequenceProcessor, make_probe_batch
from exact import enumerate_entropy
from gloo import gloo_group, spawn_two

QS = [f"Question: What is {a} + {b}? Answer:" for a, b in [(1, 2), (30, 4), (7, 7), (12, 9), (5, 60), (8, 1)]]


def make_probe(policy, top_p=0.95, lr=1e-3, weight_decay=0.01, prior_step=True):
    "A copy of `policy`, its SequenceProcessor, E (6 prompts × 4) and U (4 × 4, random advantages), AdamW with state."
    model, tok = copy.deepcopy(policy)
    cfg = GenerationConfig(temperature=0.9, top_p=top_p, max_new_tokens=8, num_generations=4)
    sp = SequenceProcessor(model, tok, cfg)
    U_seqs = sp.generate_batched(QS[:4], seed=2)
    r = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    U = make_probe_batch(U_seqs, r, group_advantages(r), max_new_tokens=cfg.max_new_tokens)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    if prior_step:
        opt.zero_grad(); policy_gradient_backward(sp, U_seqs, U["advantages"]); opt.step()
    E = sp.generate_batched(QS, seed=1)
    return model, sp, E, U, opt


def snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
             for i, st in enumerate(opt.state.values())},
            [g["lr"] for g in opt.param_groups])


def assert_same(a, b):
    for k in a[0]: assert torch.equal(a[0][k], b[0][k]), k
    assert a[1].keys() == b[1].keys()
    for i in a[1]:
        for k in a[1][i]: assert torch.equal(torch.as_tensor(a[1][i][k]), torch.as_tensor(b[1][i][k])), (i, k)
    assert a[2] == b[2]


def train_step(sp, U, opt):
    opt.zero_grad()
    seqs = BatchedSequences(U["sequences"], U["attention_masks"], U["prompt_lens"],
                            torch.zeros(U["num_prompts"], U["num_responses_per_prompt"]))
    policy_gradient_backward(sp, seqs, U["advantages"])
    opt.step()


def test_restore_is_bitwise_and_next_step_unchanged(tiny):
    model, sp, E, U, opt = make_probe(tiny)
    before = snapshot(model, opt)
    rng = torch.get_rng_state()
    DeltaEntropyIS(model, sp.config, sequence_processor=sp).entropy_change(E, U, opt, {"lr": 1e-2})
    assert_same(before, snapshot(model, opt))
    assert torch.equal(rng, torch.get_rng_state())
    train_step(sp, U, opt)
    twin, sp2, _, _, opt2 = make_probe(tiny)
    train_step(sp2, U, opt2)
    assert_same(snapshot(model, opt), snapshot(twin, opt2))


def test_a_float64_copy_leaves_the_runs_optimizer_and_checkpointing_changes_nothing(tiny):
    """The probe's float64 copy steps its own optimizer: the run's Adam state (its `step` counters too, which
    load_state_dict hands over uncast) is bitwise what it was after probes on three copies; a checkpointed copy
    (train mode, dropout 0) measures the same ΔH_true as a plain one."""
    model, sp, E, U, opt = make_probe(tiny)
    before = snapshot(model, opt)
    dH = []
    for on in (False, True, False):
        s, o = probe_copy(sp, opt, torch.float64, checkpointing=on)
        assert s.model.training == on and any(getattr(m, "gradient_checkpointing", False)
                                              for m in s.model.modules()) == on
        dH.append(DeltaEntropyIS(s.model, sp.config, sequence_processor=s).entropy_change(E, U, o, {"lr": 1e-3}))
    assert_same(before, snapshot(model, opt))
    assert dH[0]["deltaH_true"] == dH[2]["deltaH_true"] and abs(dH[0]["deltaH_true"] - dH[1]["deltaH_true"]) < 1e-12


def test_the_float64_copy_is_cast_tensor_by_tensor_and_checkpointed_above_a_size(tiny, monkeypatch):
    """cast_copy equals a float32 deepcopy cast whole (every parameter and buffer, bitwise), keeps tied weights tied
    and shares no storage with the original; probe_copy's "auto" checkpoints a float64 copy above
    PROBE_CHECKPOINT_ABOVE parameters, a float32 one only above CHECKPOINT_ABOVE."""
    from entropy_grpo import probe_state
    from entropy_grpo.probe_state import cast_copy
    _, sp, E, U, opt = make_probe(tiny)
    model = copy.deepcopy(sp.model)
    model.lm_head.weight = model.get_input_embeddings().weight             # tied, as in SmolLM2
    ref, got = copy.deepcopy(model).to(torch.float64), cast_copy(model, torch.float64)
    for (n, a), (_, b) in zip(list(ref.named_parameters()) + list(ref.named_buffers()),
                              list(got.named_parameters()) + list(got.named_buffers())):
        assert a.dtype == b.dtype and torch.equal(a, b), n
    assert got.lm_head.weight is got.get_input_embeddings().weight
    assert {p.data_ptr() for p in got.parameters()}.isdisjoint(p.data_ptr() for p in model.parameters())
    assert [p.requires_grad for p in got.parameters()] == [p.requires_grad for p in model.parameters()]
    assert not probe_copy(sp, opt, torch.float64)[0].model.is_gradient_checkpointing            # 0.05 M parameters
    assert not probe_copy(sp, opt, torch.float64, checkpointing=False)[0].model.is_gradient_checkpointing
    monkeypatch.setattr(probe_state, "PROBE_CHECKPOINT_ABOVE", 0)
    assert probe_copy(sp, opt, torch.float64)[0].model.is_gradient_checkpointing
    assert not probe_state.probe_checkpointing(sp.model, torch.float32)


def test_one_ulp_moves_in_slices_are_the_same_moves_and_undo_exactly(monkeypatch):
    "_ulp_steps in slices of 7 entries moves every entry as in one piece (same coins), and undo restores bitwise."
    from entropy_grpo import probe_state
    ps = [torch.randn(5, 9, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    whole, sliced = [p.clone() for p in ps], [p.clone() for p in ps]
    probe_state._ulp_steps(whole, seed=3)
    monkeypatch.setattr(probe_state, "ULP_CHUNK", 7)
    probe_state._ulp_steps(sliced, seed=3)
    assert all(torch.equal(a, b) and not torch.equal(a, p) for a, b, p in zip(whole, sliced, ps))
    assert all((a - p).abs().max() <= torch.finfo(p.dtype).eps * p.abs().max() for a, p in zip(sliced, ps))
    probe_state._ulp_steps(sliced, seed=3, undo=True)
    assert all(torch.equal(a, p) for a, p in zip(sliced, ps))


def test_restore_when_update_raises_midway(tiny, monkeypatch):
    model, sp, E, U, opt = make_probe(tiny)
    before = snapshot(model, opt)
    real_step = opt.step
    def step_then_fail(*a, **k):
        real_step(*a, **k); raise RuntimeError("device lost mid-update")
    monkeypatch.setattr(opt, "step", step_then_fail)
    with pytest.raises(RuntimeError, match="device lost"):
        DeltaEntropyIS(model, sp.config, sequence_processor=sp).entropy_change(E, U, opt, {"lr": 1e-2})
    assert_same(before, snapshot(model, opt))


def test_nan_log_weights_error_after_restore(tiny, monkeypatch):
    model, sp, E, U, opt = make_probe(tiny)
    before = snapshot(model, opt)
    real_step = opt.step
    def poison(*a, **k):
        real_step(*a, **k)
        with torch.no_grad(): model.lm_head.weight.fill_(float("nan"))
    monkeypatch.setattr(opt, "step", poison)
    with pytest.raises(FloatingPointError, match="NaN"):
        DeltaEntropyIS(model, sp.config, sequence_processor=sp).entropy_change(E, U, opt)
    assert_same(before, snapshot(model, opt))


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_small_lr_limits(tiny64, top_p):
    model, sp, E, U, opt = make_probe(tiny64, top_p=top_p)      # float64 model (Llama's norms still round in float32)
    probe = DeltaEntropyIS(model, sp.config, sequence_processor=sp)
    n_E = E.shape[0] * E.shape[1]
    res = {lr: probe.entropy_change(E, U, opt, {"lr": lr}) for lr in (1e-3, 1e-4, 1e-5, 1e-6, 1e-7)}
    s = {lr: r["deltaH_true_fixed_support"] / lr for lr, r in res.items()}
    print(top_p, {lr: (r["deltaH_true"], r["deltaH_support_change"], r["ess"]) for lr, r in res.items()}, s)
    assert abs(res[1e-7]["deltaH_true"]) < abs(res[1e-3]["deltaH_true"]) and abs(res[1e-7]["deltaH_true"]) < 1e-4
    assert res[1e-7]["ess"] > n_E - 1e-3
    # fixed-support part linear in lr: ΔH/lr settles, its relative change shrinking decade by decade
    assert abs(s[1e-6] / s[1e-5] - 1) < 0.02 and abs(s[1e-6] / s[1e-5] - 1) < abs(s[1e-5] / s[1e-4] - 1)
    if top_p == 1.0:
        assert all(r["deltaH_support_change"] == 0 and r["n_support_changed_positions"] == 0 for r in res.values())
    else:
        assert res[1e-3]["n_support_changed_positions"] > 0           # reported, not hidden
        assert "deltaH_support_change" in res[1e-3]


@pytest.mark.slow
def test_matches_enumerated_entropy_change():
    "Exact H(θ⁺) − H(θ) by enumeration after a real step vs deltaH_true over repeated E draws."
    model, tok = tiny_policy(0, vocab_size=7, pad_is_eos=True, alphabet="abcdef", init_std=0.6)
    T, top_p, max_new = 0.7, 1.0, 3
    cfg = GenerationConfig(temperature=T, top_p=top_p, max_new_tokens=max_new, num_generations=8, gen_batch_size=512)
    sp = SequenceProcessor(model, tok, cfg)
    prompt = tok("abc", add_special_tokens=False)["input_ids"]
    U_seqs = sp.generate_batched(["abc"] * 4, seed=5)
    r = (U_seqs.gen_lens == max_new).float() * 1.0            # reward long completions: entropy moves
    U = make_probe_batch(U_seqs, r, group_advantages(r), max_new_tokens=max_new)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    H0 = enumerate_entropy(model, prompt, tok.eos_token_id, len(tok), max_new, T, top_p)
    probe = DeltaEntropyIS(model, cfg, sequence_processor=sp)
    est = []
    for d in range(12):
        E = sp.generate_batched(["abc"] * 64, seed=100 + d)     # 512 sequences
        est.append(probe.entropy_change(E, U, opt)["deltaH_true"])
    opt.zero_grad(); policy_gradient_backward(sp, U_seqs, U["advantages"]); opt.step()
    H1 = enumerate_entropy(model, prompt, tok.eos_token_id, len(tok), max_new, T, top_p)
    est = torch.tensor(est, dtype=torch.float64)
    se = est.std() / len(est) ** 0.5
    print(f"exact ΔH {H1 - H0:+.5f}  estimated {est.mean():+.5f} ± {se:.5f}")
    assert abs(H1 - H0) > 3 * se                                # the step moved entropy measurably
    assert abs(est.mean() - (H1 - H0)) < 4 * se


def test_rb_spread_smaller_than_naive(tiny):
    model, sp, _, U, opt = make_probe(tiny, top_p=0.95)
    probe = DeltaEntropyIS(model, sp.config, sequence_processor=sp)
    rb, nv = [], []
    for d in range(8):
        E = sp.generate_batched(QS, seed=10 + d)
        rb.append(probe.entropy_change(E, U, opt, {"entropy_mode": "rb", "lr": 1e-3})["H_orig"])
        nv.append(probe.entropy_change(E, U, opt, {"entropy_mode": "naive", "lr": 1e-3})["H_orig"])
    rb, nv = torch.tensor(rb), torch.tensor(nv)
    print(f"H_orig RB {rb.mean():.3f} ± {rb.std():.3f}  naive {nv.mean():.3f} ± {nv.std():.3f}  "
          f"spread ratio {nv.std() / rb.std():.1f}")
    assert abs(rb.mean() - nv.mean()) < 3 * nv.std()
    assert rb.std() < nv.std()


def test_zero_advantages_and_low_ess_and_bad_input(tiny):
    model, sp, E, U, opt = make_probe(tiny, weight_decay=0.0, prior_step=False)
    probe = DeltaEntropyIS(model, sp.config, sequence_processor=sp)
    zero = {**U, "advantages": torch.zeros_like(U["advantages"])}
    res = probe.entropy_change(E, zero, opt)
    assert res["deltaH_true"] == 0 and any("advantages are zero" in n for n in res["notes"])
    with pytest.warns(UserWarning, match="ESS"):
        res = probe.entropy_change(E, U, opt, {"lr": 0.02, "min_ess_frac": 0.9})
    assert any("ESS" in n for n in res["notes"])
    empty = BatchedSequences(E.sequences, torch.zeros_like(E.attention_masks), E.prompt_lens,
                             torch.zeros_like(E.gen_lens))
    with pytest.raises(ValueError, match="E_batch is empty"):
        probe.entropy_change(empty, U, opt)
    with pytest.raises(ValueError, match=r"advantages: expected shape \(4, 4\)"):
        probe.entropy_change(E, {**U, "advantages": torch.zeros(4, 3)}, opt)
    with pytest.raises(ValueError, match="entropy_mode='exact'"):
        probe.entropy_change(E, U, opt, {"entropy_mode": "exact"})
    with pytest.raises(ValueError, match="unknown keys"):
        probe.entropy_change(E, U, opt, {"lrr": 1e-3})


def test_full_support_weights_and_per_token(tiny):
    model, sp, E, U, opt = make_probe(tiny, top_p=0.95)
    res = DeltaEntropyIS(model, sp.config, sequence_processor=sp).entropy_change(
        E, U, opt, {"weights": "full", "report_per_token": True, "lr": 1e-4})
    assert res["n_zero_weight_sequences"] == 0 and abs(res["deltaH_true_tok"]) < abs(res["deltaH_true"])


def test_two_batch_signature_passes_everything_on_and_checks_the_model(tiny):
    "The original signature gives entropy_change's result with the same cfg; a model not the constructor's raises."
    model, sp, E, U, opt = make_probe(tiny)
    probe = DeltaEntropyIS(model, sp.config, sequence_processor=sp)
    new = probe.entropy_change(E, U, opt, {"lr": 1e-4, "entropy_mode": "naive"})
    old = probe.entropy_change_two_batch(model, E, U, opt, {"lr": 1e-4, "entropy_mode": "naive"})
    assert (old["deltaH_true"], old["ess"], old["entropy_mode"]) == (new["deltaH_true"], new["ess"], "naive")
    assert probe.entropy_change(E, U, opt)["deltaH_true"] != new["deltaH_true"]      # the cfg mattered
    test_fail(lambda: probe.entropy_change_two_batch(copy.deepcopy(model), E, U, opt),
              contains="model is not the one this DeltaEntropyIS was built for", exc=ValueError)


def _worker(rank, world, port, out_dir):
    with gloo_group(rank, world, port):
        model, sp, E, U, opt = make_probe(tiny_policy(0, dtype=torch.float64), top_p=0.95)
        b = E.shape[0] // world; u = U["num_prompts"] // world
        E_r = E[rank * b:(rank + 1) * b]
        U_r = {k: (v[rank * u:(rank + 1) * u] if (torch.is_tensor(v) or isinstance(v, list)) else v)
               for k, v in U.items()}
        U_r.update(num_prompts=u)
        res = DeltaEntropyIS(model, sp.config, sequence_processor=sp).entropy_change(E_r, U_r, opt, {"lr": 1e-3})
        if rank == 0:
            with open(os.path.join(out_dir, "dist.json"), "w") as f: json.dump(res, f)


def test_one_process_equals_two_processes(tiny64, tmp_path):
    spawn_two(_worker, str(tmp_path))
    two = json.loads((tmp_path / "dist.json").read_text())
    model, sp, E, U, opt = make_probe(tiny64, top_p=0.95)
    one = DeltaEntropyIS(model, sp.config, sequence_processor=sp).entropy_change(E, U, opt, {"lr": 1e-3})
    for k in ("H_orig", "H_upd", "deltaH_true", "deltaH_true_fixed_support", "deltaH_support_change", "ess",
              "sum_weights", "logw_max", "logw_min", "logw_mean"):
        # float64: only summation order differs
        assert abs(one[k] - two[k]) <= 1e-9 * max(1.0, abs(one[k])), (k, one[k], two[k])
    for k in ("n_E", "n_zero_weight_sequences", "n_support_changed_positions"):
        assert one[k] == two[k], k


def test_a_bf16_model_is_refused_by_every_entry_point(tiny):
    "A direct call on a bf16 model (how a GPU loads it) refuses, as run_mixed_probe does, rather than measure rounding."
    model, sp, E, U, opt = make_probe(tiny)
    model.to(torch.bfloat16)
    probe = DeltaEntropyIS(model, sp.config, sequence_processor=sp)
    for call in (lambda: probe.entropy_change(E, U, opt), lambda: probe.entropy_change_two_batch(model, E, U, opt),
                 lambda: probe.entropy_changes(E, U, opt, [1e-3])):
        test_fail(call, contains="the model has bfloat16 parameters", exc=ValueError)


def test_snapshot_holds_only_what_a_step_changes(fresh_tiny):
    "With an adapter the snapshot is the adapter's tensors (frozen weights and buffers are not copied); restore works."
    from entropy_grpo.adapters import add_lora
    from entropy_grpo.probe_state import TrainingState
    model, _ = fresh_tiny
    la = add_lora(model, ["q_proj"], r=2)
    opt = torch.optim.AdamW(la.parameters(), lr=1e-2)
    st = TrainingState(model, opt)
    assert set(st.tensors) == {n for d in la.param_names().values() for n in d.values()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward(); opt.step()
    st.restore()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_noise_floor_copies_no_parameters_and_restores_them(tiny64, monkeypatch):
    "The floor's one-ulp perturbations are undone by one ulp back: nothing the size of θ is cloned, θ comes back."
    model, sp, E, U, opt = make_probe(tiny64, prior_step=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cloned, clone = [], torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: (cloned.append(t.numel()), clone(t, *a, **k))[1])
    out = DeltaEntropyIS(model, sp.config, sequence_processor=sp).noise_floor(E, draws=2)
    monkeypatch.undo()
    assert out["floor"] > 0 and len(out["diffs"]) == 2
    assert sum(cloned) < sum(p.numel() for p in model.parameters()) / 10, sum(cloned)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_score_then_change_around_a_step_taken_elsewhere_equals_entropy_change(tiny64):
    "The two halves (`score` before someone else's step, `change` after it) give entropy_change's numbers exactly."
    model, sp, E, U, opt = make_probe(tiny64)
    probe = DeltaEntropyIS(model, sp.config, sequence_processor=sp)
    ref = probe.entropy_change(E, U, opt)
    before = probe.score(E)
    train_step(sp, U, opt)                     # the step the probe takes (max_grad_norm None), taken by the caller
    got = probe.change(E, before)
    for k in ("H_orig", "H_upd", "deltaH_true", "deltaH_true_fixed_support", "deltaH_support_change", "ess",
              "coverage", "n_support_changed_positions", "support_new_mass_per_sequence"):
        assert got[k] == ref[k], (k, got[k], ref[k])
    test_fail(lambda: probe.change(E, before, on_nonfinite="skip"), contains="on_nonfinite='skip'")
