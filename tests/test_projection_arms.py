"Projection arms: δS and LoRA adapters, SVD cache, v_hack extraction on planted pairs, project_grad, arms, bad input."
import copy, math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from entropy_grpo.dr_grpo import group_advantages, policy_gradient_backward
from entropy_grpo.training import TrainConfig, train
from entropy_grpo.policies import tiny_policy
from entropy_grpo.adapters import add_delta_s, add_lora, clear_svd_cache, find_linears
from entropy_grpo.projection_arms import (ProjectionArm, VHack, alignment_stats, extract_v_hack,
                                          pair_gradient_differences, pair_sequences, planted_pairs, pool_pairs,
                                          project_grad, random_v_hack, shuffle_pair_labels)
from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor
from toy_tasks import DigitTask

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def fails(f, contains):
    "f() raises a ValueError whose message contains `contains`."
    with pytest.raises(ValueError) as e: f()
    assert contains in str(e.value), str(e.value)


@pytest.fixture(scope="module")
def base():
    return tiny_policy(0)


def fresh(base):
    "A copy of the tiny policy (seed 0) and its tokenizer."
    return copy.deepcopy(base[0]), base[1]


def batch(tok):
    "Two left-padded prompts with their attention mask."
    enc = tok(["Question: What is 12 + 7? Answer: 19", "Q: 3 * 3 ="], return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def sp_for(model, tok):
    return SequenceProcessor(model, tok, GenerationConfig(max_new_tokens=16), progress=False)


# ---------------------------------------------------------------- δS adapter

def test_zero_delta_s_is_bitwise_base_and_a_step_changes_only_delta_s(base):
    model, tok = fresh(base)
    x, am = batch(tok)
    ref = model(x, attention_mask=am).logits
    ds = add_delta_s(model, ATTN)
    assert torch.equal(model(x, attention_mask=am).logits, ref)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [f"{n}.delta_S" for n in ds.names]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sp = sp_for(model, tok)
    pairs, _ = planted_pairs(tok, n_pairs=4)
    opt = torch.optim.AdamW(ds.parameters(), lr=1e-2, weight_decay=0.1)
    policy_gradient_backward(sp, pairs, group_advantages(torch.tensor([[1.0, 0.0]] * 4)))
    opt.step()
    after = model.state_dict()
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert changed == sorted(f"{n}.delta_S" for n in ds.names)
    assert all(after[f"{n}.delta_S"].abs().max() > 0 for n in ds.names)
    with ds.zeroed():
        assert torch.equal(model(x, attention_mask=am).logits, ref)
    twin, _ = fresh(base)
    with torch.no_grad():
        for n in ds.names: twin.get_submodule(n).weight.copy_(ds.merged_weight(n))
    torch.testing.assert_close(model(x, attention_mask=am).logits, twin(x, attention_mask=am).logits, rtol=1e-5, atol=1e-5)


def test_delta_s_gradient_is_the_svd_diagonal_of_the_weight_gradient(base):
    "∂L/∂δS_i = u_iᵀ (∂L/∂W) v_i, against the weight gradient of the plain model."
    model, tok = fresh(base)
    ref, _ = fresh(base)
    x, am = batch(tok)
    ds = add_delta_s(model, ATTN)
    model(x, attention_mask=am).logits.logsumexp(-1).mean().backward()
    ref(x, attention_mask=am).logits.logsumexp(-1).mean().backward()
    for n in ds.names:
        m, G = model.get_submodule(n), ref.get_submodule(n).weight.grad
        torch.testing.assert_close(m.delta_S.grad, torch.diagonal(m.svd_U.T @ G @ m.svd_Vh.T), rtol=1e-4, atol=1e-6)


def test_top_rank_delta_s(base):
    model, tok = fresh(base)
    x, am = batch(tok)
    ds = add_delta_s(model, ["q_proj", "k_proj"], rank=4)
    assert set(ds.dims.values()) == {4}
    with torch.no_grad():
        for p in ds.parameters(): p.normal_(0, 0.5)
    twin, _ = fresh(base)
    with torch.no_grad():
        for n in ds.names: twin.get_submodule(n).weight.copy_(ds.merged_weight(n))
    torch.testing.assert_close(model(x, attention_mask=am).logits, twin(x, attention_mask=am).logits, rtol=1e-5, atol=1e-5)
    fails(lambda: add_delta_s(fresh(base)[0], ["k_proj"], rank=17), contains="rank=17: module model.layers.0.self_attn.k_proj has a 16x32 weight, so rank must lie in [1, 16]")
    fails(lambda: add_delta_s(model, ["q_proj"]), contains="already carries a δS adapter")


def test_svd_cache_memory_then_disk(base, tmp_path, monkeypatch):
    clear_svd_cache()
    a = add_delta_s(fresh(base)[0], ATTN, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("svd_*.safetensors"))) == len(a.names)
    def no_svd(*a, **k): raise AssertionError("SVD recomputed")
    monkeypatch.setattr(torch.linalg, "svd", no_svd)
    b = add_delta_s(fresh(base)[0], ATTN)                     # memory cache
    clear_svd_cache()
    c = add_delta_s(fresh(base)[0], ATTN, cache_dir=tmp_path)  # disk cache
    for n in a.names:
        ma, mb, mc = (x.model.get_submodule(n) for x in (a, b, c))
        assert torch.equal(ma.svd_U, mb.svd_U) and torch.equal(ma.svd_Vh, mc.svd_Vh) and torch.equal(ma.svd_S, mc.svd_S)


def test_delta_s_save_load_and_mismatch(base, tmp_path):
    model, tok = fresh(base)
    ds = add_delta_s(model, ATTN)
    with torch.no_grad():
        for p in ds.parameters(): p.normal_()
    ds.save(tmp_path/"ds.safetensors", note="x")
    ds2 = add_delta_s(fresh(base)[0], ATTN)
    assert ds2.load(tmp_path/"ds.safetensors")["note"] == "x"
    for p, q in zip(ds.parameters(), ds2.parameters()): assert torch.equal(p, q)
    other = add_delta_s(tiny_policy(1)[0], ATTN)
    fails(lambda: other.load(tmp_path/"ds.safetensors"), contains=f"weights_hash differs ({ds.weights_hash!r} in the file vs {other.weights_hash!r} here)")
    fewer = add_delta_s(fresh(base)[0], ["q_proj"])
    fails(lambda: fewer.load(tmp_path/"ds.safetensors"), contains="targets differs")


def test_find_linears_error_lists_the_linears(base):
    fails(lambda: add_delta_s(fresh(base)[0], ["q_proj", "qkv_proj"]),
              contains="entry 'qkv_proj' matches no nn.Linear of LlamaForCausalLM; its nn.Linear modules are named "
                       "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']")
    fails(lambda: find_linears(base[0], r".*attn\.qkv"), contains="matches no nn.Linear")
    assert find_linears(base[0], r".*layers\.1\.self_attn\.[qk]_proj") == ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"]


# ---------------------------------------------------------------- LoRA adapter

def test_lora_init_gauge_zeroed_and_save_load(base, tmp_path):
    model, tok = fresh(base)
    x, am = batch(tok)
    ref = model(x, attention_mask=am).logits
    la = add_lora(model, ["q_proj", "v_proj"], r=4, seed=3)
    assert model(x, attention_mask=am).logits.equal(ref)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for d in la.param_names().values() for n in d.values()}
    model(x, attention_mask=am).logits.logsumexp(-1).mean().backward()
    for ps in la.module_params().values():                    # B = 0: the A-gradient is exactly zero
        assert torch.equal(ps["lora_A"].grad, torch.zeros_like(ps["lora_A"])) and ps["lora_B"].grad.abs().max() > 0
    assert la.init_hash == add_lora(fresh(base)[0], ["q_proj", "v_proj"], r=4, seed=3).init_hash
    assert la.init_hash != add_lora(fresh(base)[0], ["q_proj", "v_proj"], r=4, seed=4).init_hash
    with torch.no_grad():
        for ps in la.module_params().values(): ps["lora_B"].normal_(0, 0.3)
    moved = model(x, attention_mask=am).logits
    assert not torch.allclose(moved, ref)
    with la.zeroed():
        assert torch.equal(model(x, attention_mask=am).logits, ref)
    assert all(p.requires_grad for p in la.parameters())
    la.save(tmp_path/"lora.safetensors")
    lb = add_lora(fresh(base)[0], ["q_proj", "v_proj"], r=4, seed=9)
    lb.load(tmp_path/"lora.safetensors")
    assert lb.init_hash == la.init_hash
    torch.testing.assert_close(lb.model(x, attention_mask=am).logits, moved, rtol=0, atol=0)
    fails(lambda: add_lora(fresh(base)[0], ["q_proj", "v_proj"], r=2).load(tmp_path/"lora.safetensors"), contains="differs")
    fails(lambda: add_lora(fresh(base)[0], ["k_proj"], r=17), contains="r=17: module model.layers.0.self_attn.k_proj")


# ---------------------------------------------------------------- project_grad

def orthonormal(k, d, seed):
    return torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))[0].T.float()


def test_one_sided_removes_positive_components_exactly_and_keeps_the_rest():
    V = {"a": orthonormal(3, 40, 0), "b": orthonormal(2, 25, 1)}
    gen = torch.Generator().manual_seed(2)
    perp = {n: (lambda r: r - v.T @ (v @ r))(torch.randn(v.shape[1], generator=gen)) for n, v in V.items()}
    coef = {"a": torch.tensor([2.0, 0.5, 1.0]), "b": torch.tensor([3.0, 0.1])}   # every c > 0
    g = {n: perp[n] + coef[n] @ V[n] for n in V}
    out, st = project_grad(g, V)
    assert st["cos_sub_out"] <= 1e-6 and abs(st["cos_out"]) <= 1e-6 and st["frac_fired"] == 1.0
    assert st["cos_sub_in"] > 0.1 and st["cos_in"] > 0.1
    for n in V: torch.testing.assert_close(out[n], perp[n], rtol=0, atol=1e-6)   # the orthogonal part is untouched


def test_gates_and_frac_fired():
    V = {m: torch.eye(5)[:2] for m in "abc"}
    g = {"a": torch.tensor([1., -2., 3., 4., 5.]),     # fires on component 0 (one_sided), 1 (reverse)
         "b": torch.tensor([-1., -1., 3., 4., 5.]),    # never fires one-sided
         "c": torch.tensor([2., 3., 3., 4., 5.])}      # fires on both (one_sided), never reverse
    out, st = project_grad(g, V, "one_sided")
    assert st["frac_fired"] == pytest.approx(2 / 3)
    assert torch.equal(out["a"], torch.tensor([0., -2., 3., 4., 5.])) and torch.equal(out["b"], g["b"])
    assert torch.equal(out["c"], torch.tensor([0., 0., 3., 4., 5.]))
    out, st = project_grad(g, V, "reverse")
    assert st["frac_fired"] == pytest.approx(2 / 3)
    assert torch.equal(out["a"], torch.tensor([1., 0., 3., 4., 5.])) and torch.equal(out["b"], torch.tensor([0., 0., 3., 4., 5.]))
    assert torch.equal(out["c"], g["c"])
    out, st = project_grad(g, V, "none")
    assert st["frac_fired"] == 1.0 and st["cos_sub_out"] == 0.0
    assert all(torch.equal(out[m][:2], torch.zeros(2)) and torch.equal(out[m][2:], g[m][2:]) for m in "abc")
    out, _ = project_grad(g, V, "one_sided", overshoot=2.0)
    assert torch.equal(out["c"], torch.tensor([-2., -3., 3., 4., 5.]))


def test_random_projections_match_the_gate_formula_and_lower_the_cosines():
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        V = {f"m{i}": orthonormal(3, 30 + i, 100 * trial + i) for i in range(4)}
        g = {n: torch.randn(v.shape[1], generator=gen) + 0.5 * torch.randn(3, generator=gen) @ v for n, v in V.items()}
        for gate, keep in (("one_sided", lambda c: c > 0), ("reverse", lambda c: c < 0)):
            out, st = project_grad(g, V, gate)
            for n, v in V.items():
                c = v @ g[n]
                torch.testing.assert_close(v @ out[n], torch.where(keep(c), torch.zeros_like(c), c), rtol=0, atol=1e-5)
            fired = sum(bool(keep(v @ g[n]).any()) for n, v in V.items())
            assert st["frac_fired"] == fired / 4
            if gate == "one_sided" and fired:
                assert st["cos_out"] < st["cos_in"] and st["cos_sub_out"] < st["cos_sub_in"] and st["module_cos_out"] < st["module_cos_in"]


def test_cosine_definitions_against_naive_formulas():
    V = {"a": orthonormal(2, 12, 0), "b": orthonormal(2, 7, 1)}
    g = {"a": torch.randn(12, generator=torch.Generator().manual_seed(3)), "b": torch.randn(7, generator=torch.Generator().manual_seed(4))}
    st = alignment_stats(g, V)
    G = torch.cat([g["a"], g["b"]])
    blocks = torch.block_diag(V["a"], V["b"])                       # [K, N]: the whole v_hack subspace
    u = blocks.sum(0) / math.sqrt(4)
    assert st["cos"] == pytest.approx(F.cosine_similarity(G, u, dim=0).item(), abs=1e-6)
    assert st["cos_sub"] == pytest.approx(((blocks.T @ blocks @ G).norm() / G.norm()).item(), abs=1e-6)
    per = [F.cosine_similarity(g[n], V[n].sum(0) / math.sqrt(2), dim=0).item() for n in V]
    assert st["module_cos"] == pytest.approx(sum(per) / 2, abs=1e-6)
    assert (st["cos_null"], st["cos_sub_null"]) == (pytest.approx(1 / math.sqrt(19)), pytest.approx(math.sqrt(4 / 19)))


def test_project_grad_bad_input():
    V, g = {"a": torch.eye(4)[:1]}, {"a": torch.ones(4)}
    fails(lambda: project_grad(g, V, gate="both"), contains="gate='both': expected one of")
    fails(lambda: project_grad(g, V, overshoot=-1.0), contains="overshoot=-1.0")
    fails(lambda: project_grad({"b": torch.ones(4)}, V), contains="modules ['a', 'b'] are in only one of grads and V")
    fails(lambda: project_grad({"a": torch.ones(5)}, V), contains="module a: V has rows of dimension 4, the gradient 5")


# ---------------------------------------------------------------- v_hack

@pytest.fixture(scope="module")
def planted(base):
    "δS adapter on a copy of the tiny policy, 24 planted pairs, their per-pair differences and mean d̄."
    model, tok = fresh(base)
    ds = add_delta_s(model, ATTN)
    sp = sp_for(model, tok)
    pairs, pattern = planted_pairs(tok, n_pairs=24, seed=0)
    diffs = pair_gradient_differences(sp, ds, pairs, length_norm="none")
    return SimpleNamespace(model=model, tok=tok, ds=ds, sp=sp, pairs=pairs, diffs=diffs,
                           dbar={n: D.mean(0) for n, D in diffs.items()})


def test_extract_v_hack_recovers_a_planted_direction(planted):
    """Measured on tiny_policy(0), δS on q/k/v/o (N=192, 8 modules, K=8), 24 pairs, k=1, length_norm='none':
    cos_sub(d̄, V) 0.991, signed cos 0.83, per-module mean 0.97; shuffled labels: cos_sub 0.36, signed 0.06;
    random basis: cos_sub 0.13; null √(K/N) = 0.204."""
    p = planted
    vh = extract_v_hack(p.sp, p.ds, p.pairs, k=1, length_norm="none")
    st = alignment_stats(p.dbar, vh.V)
    assert st["cos_sub"] > 0.9 and st["module_cos"] > 0.9 and st["cos"] > 0.5
    assert all(float(v) >= 0.75 for v in vh.vote.values())
    shuf = alignment_stats(p.dbar, extract_v_hack(p.sp, p.ds, shuffle_pair_labels(p.pairs, seed=1), k=1, length_norm="none").V)
    assert abs(shuf["cos"]) < 0.2 and shuf["cos_sub"] < st["cos_sub"] - 0.3
    rand = alignment_stats(p.dbar, random_v_hack(p.ds, k=1, seed=0).V)
    assert rand["cos_sub"] < 2 * rand["cos_sub_null"] and abs(rand["cos"]) < 3 * rand["cos_null"]


def test_extraction_options_agree_and_grads_are_left_alone(planted):
    p = planted
    for q in p.ds.parameters(): q.grad = torch.full_like(q, 7.0)
    a = extract_v_hack(p.sp, p.ds, p.pairs, k=2, loss="nll", length_norm="none")
    assert all(torch.equal(q.grad, torch.full_like(q, 7.0)) for q in p.ds.parameters())
    b = extract_v_hack(p.sp, p.ds, p.pairs, k=2, loss="grpo", length_norm="max_new_tokens")   # = nll "none" / (2·L_max)
    c = extract_v_hack(p.sp, p.ds, p.pairs, k=2, loss="nll", length_norm="sample")
    d = extract_v_hack(p.sp, p.ds, p.pairs, k=2, loss="grpo", length_norm="sample")          # = nll "sample" / 2
    for n in p.ds.names:
        torch.testing.assert_close(a.V[n], b.V[n], rtol=0, atol=1e-4)
        torch.testing.assert_close(c.V[n], d.V[n], rtol=0, atol=1e-4)
        torch.testing.assert_close(a.V[n] @ a.V[n].T, torch.eye(2), rtol=0, atol=1e-5)
    P = p.pairs.prompt_lens[0]
    triples = [(p.pairs.sequences[i, 0, :P][p.pairs.attention_masks[i, 0, :P].bool()].tolist(),
                *(p.pairs.sequences[i, g, P:P + int(p.pairs.gen_lens[i, g])].tolist() for g in (0, 1))) for i in range(24)]
    e = extract_v_hack(p.sp, p.ds, triples, k=2, length_norm="none")
    for n in p.ds.names: torch.testing.assert_close(e.V[n], a.V[n], rtol=0, atol=1e-6)
    assert (a.meta["loss"], a.meta["length_norm"], a.meta["k"], a.meta["n_pairs"]) == ("nll", "none", 2, 24)


def test_v_hack_bad_input(planted, base, tmp_path):
    p = planted
    fails(lambda: extract_v_hack(p.sp, p.ds, p.pairs, k=25), contains="k=25: module model.layers.0.self_attn.q_proj has 24 pair differences of dimension 32, so k must lie in [1, 24]")
    fails(lambda: extract_v_hack(p.sp, p.ds, p.pairs[:20], k=17), contains="dimension 16, so k must lie in [1, 16]")
    fails(lambda: extract_v_hack(p.sp, p.ds, p.pairs, k=1, loss="nll", length_norm="max_new_tokens"),
              contains="length_norm='max_new_tokens': loss='nll' allows ['sample', 'none']")
    fails(lambda: extract_v_hack(p.sp, p.ds, p.pairs, k=1, loss="kl"), contains="loss='kl'")
    twice = pair_sequences([(p.tok("Q: 1 + 1 =")["input_ids"], [5, 6, 7], [8, 9])] * 3, p.tok.pad_token_id)
    fails(lambda: extract_v_hack(p.sp, p.ds, twice, k=2), contains="span only 1 directions")
    fails(lambda: random_v_hack(p.ds, k=17), contains="k=17: module model.layers.0.self_attn.k_proj has dimension 16")
    vh = extract_v_hack(p.sp, p.ds, p.pairs, k=1, pools={"teacher": "t/", "base": "b/"})
    vh.save(tmp_path/"vh.safetensors")
    back = VHack.load(tmp_path/"vh.safetensors", p.ds)
    assert back.meta["pools"] == {"teacher": "t/", "base": "b/"} and back.meta["date"] == vh.meta["date"]
    for n in p.ds.names: assert torch.equal(back.V[n], vh.V[n]) and torch.equal(back.vote[n], vh.vote[n])
    other = add_delta_s(tiny_policy(1)[0], ATTN)
    fails(lambda: VHack.load(tmp_path/"vh.safetensors", other),
              contains=f"weights_hash differs ({p.ds.weights_hash!r} in the file vs {other.weights_hash!r} here)")
    fails(lambda: VHack.load(tmp_path/"vh.safetensors", add_delta_s(fresh(base)[0], ["q_proj", "v_proj"])), contains="targets differs")
    fails(lambda: VHack.load(tmp_path/"vh.safetensors", add_delta_s(fresh(base)[0], ATTN, rank=8)), contains="dims differs")
    fails(lambda: ProjectionArm("projected", other, vh), contains="v_hack (pairs) was made for delta_s on model 'LlamaForCausalLM'")


# ---------------------------------------------------------------- arms

def run_arm(model, tok, adapter, pairs, arm, steps=3, lr=1e-2):
    "Direct loop over policy_gradient_backward with the callback protocol of nb 03's train (ctx, record)."
    sp = sp_for(model, tok)
    adv = group_advantages(torch.tensor([[1.0, 0.0]] * pairs.shape[0]))
    opt = torch.optim.AdamW(adapter.parameters(), lr=lr)
    log = []
    for step in range(steps):
        opt.zero_grad()
        policy_gradient_backward(sp, pairs, adv, length_norm="sample")
        ctx = SimpleNamespace(model=model, optimizer=opt, step=step, sp=sp, batch=pairs)
        if arm is not None: arm.on_after_backward(ctx)
        opt.step()
        rec = dict(step=step)
        if arm is not None: arm.on_step_end(ctx, rec)
        log.append(rec)
    return log


def test_projected_arm_lowers_cos_on_every_fired_step(base):
    model, tok = fresh(base)
    ds = add_delta_s(model, ATTN)
    pairs, _ = planted_pairs(tok, n_pairs=12, seed=0)
    vh = extract_v_hack(sp_for(model, tok), ds, pairs, k=2)
    mixed, _ = planted_pairs(tok, n_pairs=8, seed=5, prompts=["Q: 2 + 2 =", "Question: What is 8 - 3? Answer:"])
    log = run_arm(model, tok, ds, mixed, ProjectionArm("projected", ds, vh), steps=4)
    fired = [r for r in log if r["frac_fired"] > 0]
    assert len(fired) == 4
    assert all(r["cos_out"] < r["cos_in"] and r["cos_sub_out"] < r["cos_sub_in"] for r in fired)
    assert all(r["arm"] == "projected" and r["v_hack_source"] == "pairs" and r["gate"] == "one_sided" for r in log)
    assert all(r["cos_sub_null"] == pytest.approx(math.sqrt(16 / 192)) for r in log)


def test_vanilla_arm_is_bitwise_a_run_without_callbacks(base):
    out = []
    for with_arm in (False, True):
        model, tok = fresh(base)
        ds = add_delta_s(model, ATTN)
        pairs, _ = planted_pairs(tok, n_pairs=6, seed=0)
        arm = ProjectionArm("vanilla", ds, random_v_hack(ds, k=2, seed=1)) if with_arm else None
        out.append((run_arm(model, tok, ds, pairs, arm), [p.detach().clone() for p in ds.parameters()]))
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))
    log = out[1][0]
    assert all(r["arm"] == "vanilla" and r["v_hack_source"] == "random" and r["frac_fired"] == 0.0 for r in log)
    assert all(r["cos_in"] == r["cos_out"] and r["cos_sub_in"] == r["cos_sub_out"] for r in log)


def test_projected_lora_arm_and_param_keyed_projection(base):
    model, tok = fresh(base)
    la = add_lora(model, ["q_proj", "v_proj"], r=2, seed=0)
    sp = sp_for(model, tok)
    pairs, _ = planted_pairs(tok, n_pairs=8, seed=0)
    vh = extract_v_hack(sp, la, pairs, k=1)
    A_dim = 2 * 32
    assert all(v[0, :A_dim].abs().max() < 1e-6 for v in vh.V.values())   # at B = 0 the A-block of v_hack is zero
    arm = ProjectionArm("projected_lora", la, vh)
    log = run_arm(model, tok, la, pairs, arm, steps=3)
    assert all(r["cos_out"] < r["cos_in"] for r in log if r["frac_fired"] > 0) and log[0]["frac_fired"] > 0
    assert all(r["arm"] == "projected_lora" for r in log)
    la.model.zero_grad()
    policy_gradient_backward(sp, pairs, group_advantages(torch.tensor([[1.0, 0.0]] * 8)))
    names = la.param_names()
    param_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    new, st = arm.project(param_grads)
    arm.on_after_backward()
    for n, p in model.named_parameters():
        if p.grad is not None: torch.testing.assert_close(new[n], p.grad, rtol=0, atol=0)
    u = vh.direction(la)
    G = torch.cat([param_grads[n].flatten() for d in names.values() for n in d.values()])
    U = torch.cat([u[n].flatten() for d in names.values() for n in d.values()])
    assert st["cos_in"] == pytest.approx(F.cosine_similarity(G, U, dim=0).item(), abs=1e-5)
    fails(lambda: ProjectionArm("projected", la, vh), contains="arm='projected' needs a DeltaSAdapter, got LoraAdapter")
    fails(lambda: ProjectionArm("projected_lora", la), contains="needs a v_hack")
    fails(lambda: ProjectionArm("sideways", la, vh), contains="arm='sideways': expected one of")
    ds = add_delta_s(fresh(base)[0], ["q_proj", "v_proj"])
    fails(lambda: vh.check(ds), contains="kind differs ('lora' in the file vs 'delta_s' here)")


def _train_arm(base, arm_name, v_seed=None, steps=4):
    "nb 03's `train` on the δS adapter with a ProjectionArm callback (None: plain train, no callback)."
    model, tok = fresh(base)
    ds = add_delta_s(model, ATTN)
    cbs = []
    if arm_name is not None:
        pairs, _ = planted_pairs(tok, n_pairs=12, seed=0)
        vh = extract_v_hack(sp_for(model, tok), ds, pairs, k=2) if v_seed is None else random_v_hack(ds, k=2, seed=v_seed)
        cbs = [ProjectionArm(arm_name, ds, vh)]
    cfg = TrainConfig(steps=steps, prompts_per_step=2, num_generations=4, lr=1e-2, arm=arm_name or "vanilla",
                      generation=GenerationConfig(max_new_tokens=8))
    res = train(model, tok, DigitTask(16), cfg, callbacks=cbs, progress=False)
    return res, [p.detach().clone() for p in ds.parameters()]


def test_projected_arm_in_train_lowers_cos_whenever_the_gate_fires(base):
    res, _ = _train_arm(base, "projected")
    fired = [r for r in res.records if r["frac_fired"] > 0]
    assert fired, "the gate never fired: the test would prove nothing"
    assert all(r["cos_out"] < r["cos_in"] for r in fired)
    assert all(r["arm"] == "projected" and "cos_sub_null" in r for r in res.records)
    print([(round(r["cos_in"], 4), round(r["cos_out"], 4), r["frac_fired"]) for r in res.records])


def test_vanilla_arm_in_train_is_bitwise_plain_train(base):
    plain, p0 = _train_arm(base, None)
    vanilla, p1 = _train_arm(base, "vanilla", v_seed=1)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    keys = ("reward_mean", "loss", "grad_norm", "entropy_rb")
    assert [[r[k] for k in keys] for r in plain.records] == [[r[k] for k in keys] for r in vanilla.records]
    assert all(r["cos_in"] == r["cos_out"] and r["frac_fired"] == 0.0 for r in vanilla.records)


# ---------------------------------------------------------------- the embedded default policy

@pytest.mark.slow
def test_smollm2_delta_s_on_attention(tmp_path):
    from entropy_grpo.policies import load_policy
    model, tok = load_policy(device="cpu")
    x, am = batch(tok)
    ref = model(x, attention_mask=am).logits
    ds = add_delta_s(model, ATTN, cache_dir=tmp_path)
    assert len(ds.names) == 4 * model.config.num_hidden_layers
    assert torch.equal(model(x, attention_mask=am).logits, ref)
    sp = SequenceProcessor(model, tok, GenerationConfig(max_new_tokens=16), progress=False)
    pairs, _ = planted_pairs(tok, n_pairs=4, seed=0)
    vh = extract_v_hack(sp, ds, pairs, k=2)
    log = run_arm(model, tok, ds, pairs, ProjectionArm("projected", ds, vh), steps=2, lr=1e-3)
    assert all(r["cos_out"] < r["cos_in"] for r in log if r["frac_fired"] > 0)
    with ds.zeroed():
        assert torch.equal(model(x, attention_mask=am).logits, ref)


def test_pool_pairs_matches_hacked_teacher_to_clean_base_samples_of_the_same_problem(tmp_path):
    "Pairs only (teacher hacked, base clean) of one problem, each base sample used once, in teacher order."
    from entropy_grpo.pools import Pool
    tok = tiny_policy(0)[1]
    rec = lambda pid, hacked, ids: dict(problem_id=pid, hacked=hacked, completion_ids=ids, student_prompt=f"Q{pid}")
    teacher = Pool("teacher", tmp_path, {0: [rec("a", True, [1]), rec("b", True, [2]), rec("c", False, [3])],
                                         1: [rec("a", True, [4]), rec("a", True, [5])]})
    base = Pool("base", tmp_path, {0: [rec("a", False, [6]), rec("b", True, [7]), rec("c", False, [8])],
                                   1: [rec("a", False, [9])]})
    triples = pool_pairs(teacher, base, tok)
    assert [(h, c) for _, h, c in triples] == [([1], [6]), ([4], [9])]
    assert triples[0][0] == tok("Qa", add_special_tokens=False)["input_ids"]
    assert len(pool_pairs(teacher, base, tok, max_pairs=1)) == 1
    none = Pool("base", tmp_path, {0: [rec("c", False, [8])]})
    with pytest.raises(ValueError, match="no \\(hack, clean\\) pair: teacher pool 'teacher' has 4 hacked samples"):
        pool_pairs(teacher, none, tok)
