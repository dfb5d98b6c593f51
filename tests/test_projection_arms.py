"""projection_arms: project_grad removes exactly the gated components and keeps the rest, cosine definitions against
naive formulas, v_hack recovers a planted direction (options agree, bad input named, save/load checked), pool pairs,
and the arms: projected lowers the cosine whenever the gate fires, vanilla is bitwise a run without callbacks (direct
loop and `train`)."""
import copy, math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fastcore.test import test_fail

from entropy_grpo.adapters import add_delta_s, add_lora
from entropy_grpo.dr_grpo import group_advantages, policy_gradient_backward
from entropy_grpo.policies import tiny_policy
from entropy_grpo.pools import Pool
from entropy_grpo.projection_arms import (ProjectionArm, VHack, alignment_stats, arm_step, extract_v_hack,
                                          pair_gradient_differences, pair_sequences, planted_pairs, pool_pairs,
                                          project_grad, random_v_hack)
from entropy_grpo.sequence_processor import GenerationConfig
from entropy_grpo.training import TrainConfig, train
from tiny_inputs import ATTN, batch, sp_for
from toy_tasks import DigitTask


# ---------------------------------------------------------------- project_grad

def orthonormal(k, d, seed):
    "k orthonormal rows of dimension d (float32), seeded."
    g = torch.randn(d, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.linalg.qr(g)[0].T.float()


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
    assert torch.equal(out["a"], torch.tensor([1., 0., 3., 4., 5.]))
    assert torch.equal(out["b"], torch.tensor([0., 0., 3., 4., 5.]))
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
                assert st["cos_out"] < st["cos_in"] and st["cos_sub_out"] < st["cos_sub_in"]
                assert st["module_cos_out"] < st["module_cos_in"]


def test_cosine_definitions_against_naive_formulas():
    V = {"a": orthonormal(2, 12, 0), "b": orthonormal(2, 7, 1)}
    g = {"a": torch.randn(12, generator=torch.Generator().manual_seed(3)),
         "b": torch.randn(7, generator=torch.Generator().manual_seed(4))}
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
    test_fail(lambda: project_grad(g, V, gate="both"), contains="gate='both': expected one of", exc=ValueError)
    test_fail(lambda: project_grad(g, V, overshoot=-1.0), contains="overshoot=-1.0", exc=ValueError)
    test_fail(lambda: project_grad({"b": torch.ones(4)}, V),
              contains="modules ['a', 'b'] are in only one of grads and V", exc=ValueError)
    test_fail(lambda: project_grad({"a": torch.ones(5)}, V),
              contains="module a: V has rows of dimension 4, the gradient 5", exc=ValueError)


# ---------------------------------------------------------------- v_hack

@pytest.fixture(scope="module")
def planted(tiny):
    "δS adapter on a copy of the tiny policy, 24 planted pairs, their per-pair differences and mean d̄."
    model, tok = copy.deepcopy(tiny)
    ds = add_delta_s(model, ATTN)
    sp = sp_for(model, tok)
    pairs, pattern = planted_pairs(tok, n_pairs=24, seed=0)
    diffs = pair_gradient_differences(sp, ds, pairs, length_norm="none")
    return SimpleNamespace(model=model, tok=tok, ds=ds, sp=sp, pairs=pairs, diffs=diffs,
                           dbar={n: D.mean(0) for n, D in diffs.items()})


def test_extract_v_hack_recovers_a_planted_direction(planted):
    """Measured on tiny_policy(0), δS on q/k/v/o (N=192, 8 modules, K=8), 24 pairs, k=1, length_norm='none':
    cos_sub(d̄, V) 0.991, signed cos 0.83, per-module mean 0.97; labels permuted over all pairs: either sign;
    random basis: cos_sub 0.13; null √(K/N) = 0.204."""
    p = planted
    vh = extract_v_hack(p.sp, p.ds, p.pairs, k=1, length_norm="none")
    st = alignment_stats(p.dbar, vh.V)
    assert st["cos_sub"] > 0.9 and st["module_cos"] > 0.9 and st["cos"] > 0.5
    assert all(float(v) >= 0.75 for v in vh.vote.values())
    perm = [alignment_stats(p.dbar, extract_v_hack(p.sp, p.ds, p.pairs, k=1, length_norm="none", source="permuted",
                                                   seed=s).V)["cos"] for s in range(8)]
    assert min(perm) < 0 < max(perm), perm                              # the permuted orientation is a coin flip
    rand = alignment_stats(p.dbar, random_v_hack(p.ds, k=1, seed=0).V)
    assert rand["cos_sub"] < 2 * rand["cos_sub_null"] and abs(rand["cos"]) < 3 * rand["cos_null"]


def test_extraction_options_agree_and_grads_are_left_alone(planted):
    p = planted
    for q in p.ds.parameters(): q.grad = torch.full_like(q, 7.0)
    a = extract_v_hack(p.sp, p.ds, p.pairs, k=2, loss="nll", length_norm="none")
    assert all(torch.equal(q.grad, torch.full_like(q, 7.0)) for q in p.ds.parameters())
    b = extract_v_hack(p.sp, p.ds, p.pairs, k=2, loss="grpo", length_norm="max_len")   # = nll "none" / (2·L_max)
    c = extract_v_hack(p.sp, p.ds, p.pairs, k=2, loss="nll", length_norm="sample")
    d = extract_v_hack(p.sp, p.ds, p.pairs, k=2, loss="grpo", length_norm="sample")          # = nll "sample" / 2
    for n in p.ds.names:
        torch.testing.assert_close(a.V[n], b.V[n], rtol=0, atol=1e-4)
        torch.testing.assert_close(c.V[n], d.V[n], rtol=0, atol=1e-4)
        torch.testing.assert_close(a.V[n] @ a.V[n].T, torch.eye(2), rtol=0, atol=1e-5)
    P = p.pairs.prompt_lens[0]
    triples = [(p.pairs.sequences[i, 0, :P][p.pairs.attention_masks[i, 0, :P].bool()].tolist(),
                *(p.pairs.sequences[i, g, P:P + int(p.pairs.gen_lens[i, g])].tolist() for g in (0, 1)))
               for i in range(24)]
    e = extract_v_hack(p.sp, p.ds, triples, k=2, length_norm="none")
    for n in p.ds.names: torch.testing.assert_close(e.V[n], a.V[n], rtol=0, atol=1e-6)
    assert (a.meta["loss"], a.meta["length_norm"], a.meta["k"], a.meta["n_pairs"]) == ("nll", "none", 2, 24)


def test_v_hack_bad_input(planted, tiny, tmp_path):
    p = planted
    test_fail(lambda: extract_v_hack(p.sp, p.ds, p.pairs, k=25),
              contains="k=25: module model.layers.0.self_attn.q_proj has 24 pair differences of dimension 32, "
                       "so k must lie in [1, 24]", exc=ValueError)
    test_fail(lambda: extract_v_hack(p.sp, p.ds, p.pairs[:20], k=17),
              contains="dimension 16, so k must lie in [1, 16]", exc=ValueError)
    test_fail(lambda: extract_v_hack(p.sp, p.ds, p.pairs, k=1, loss="nll", length_norm="max_len"),
              contains="length_norm='max_len': loss='nll' allows ['sample', 'none']", exc=ValueError)
    test_fail(lambda: extract_v_hack(p.sp, p.ds, p.pairs, k=1, loss="kl"), contains="loss='kl'", exc=ValueError)
    twice = pair_sequences([(p.tok("Q: 1 + 1 =")["input_ids"], [5, 6, 7], [8, 9])] * 3, p.tok.pad_token_id)
    test_fail(lambda: extract_v_hack(p.sp, p.ds, twice, k=2), contains="span only 1 directions", exc=ValueError)
    test_fail(lambda: random_v_hack(p.ds, k=17),
              contains="k=17: module model.layers.0.self_attn.k_proj has dimension 16", exc=ValueError)
    vh = extract_v_hack(p.sp, p.ds, p.pairs, k=1, pools={"teacher": "t/", "base": "b/"})
    vh.save(tmp_path/"vh.safetensors")
    back = VHack.load(tmp_path/"vh.safetensors", p.ds)
    assert back.meta["pools"] == {"teacher": "t/", "base": "b/"} and back.meta["date"] == vh.meta["date"]
    for n in p.ds.names: assert torch.equal(back.V[n], vh.V[n]) and torch.equal(back.vote[n], vh.vote[n])
    other = add_delta_s(tiny_policy(1)[0], ATTN)
    test_fail(lambda: VHack.load(tmp_path/"vh.safetensors", other),
              contains=f"weights_hash differs ({p.ds.weights_hash!r} in the file vs {other.weights_hash!r} here)",
              exc=ValueError)
    test_fail(lambda: VHack.load(tmp_path/"vh.safetensors", add_delta_s(copy.deepcopy(tiny[0]), ["q_proj", "v_proj"])),
              contains="targets differs", exc=ValueError)
    test_fail(lambda: VHack.load(tmp_path/"vh.safetensors", add_delta_s(copy.deepcopy(tiny[0]), ATTN, rank=8)),
              contains="dims differs", exc=ValueError)
    test_fail(lambda: ProjectionArm("projected", other, vh),
              contains="v_hack (pairs) was made for delta_s on model 'LlamaForCausalLM'", exc=ValueError)


# ---------------------------------------------------------------- arms

def run_arm(model, tok, adapter, pairs, arm, steps=3, lr=1e-2):
    "Direct loop over policy_gradient_backward with the callback protocol of `training.train` (ctx, record)."
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


def test_projected_arm_lowers_cos_on_every_fired_step(fresh_tiny):
    model, tok = fresh_tiny
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


def test_vanilla_arm_is_bitwise_a_run_without_callbacks(tiny):
    out = []
    for with_arm in (False, True):
        model, tok = copy.deepcopy(tiny)
        ds = add_delta_s(model, ATTN)
        pairs, _ = planted_pairs(tok, n_pairs=6, seed=0)
        arm = ProjectionArm("vanilla", ds, random_v_hack(ds, k=2, seed=1)) if with_arm else None
        out.append((run_arm(model, tok, ds, pairs, arm), [p.detach().clone() for p in ds.parameters()]))
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))
    log = out[1][0]
    assert all(r["arm"] == "vanilla" and r["v_hack_source"] == "random" and r["frac_fired"] == 0.0 for r in log)
    assert all(r["cos_in"] == r["cos_out"] and r["cos_sub_in"] == r["cos_sub_out"] for r in log)


def test_projected_lora_arm_and_param_keyed_projection(tiny, fresh_tiny):
    model, tok = fresh_tiny
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
    test_fail(lambda: ProjectionArm("projected", la, vh),
              contains="arm='projected' trains a delta_s adapter, got lora", exc=ValueError)
    test_fail(lambda: ProjectionArm("projected_lora", la), contains="needs an adapter and a v_hack", exc=ValueError)
    test_fail(lambda: ProjectionArm("sideways", la, vh), contains="arm='sideways': expected one of", exc=ValueError)
    ds = add_delta_s(copy.deepcopy(tiny[0]), ["q_proj", "v_proj"])
    test_fail(lambda: vh.check(ds), contains="kind differs ('lora' in the file vs 'delta_s' here)", exc=ValueError)


def _train_arm(policy, arm_name, v_seed=None, steps=4):
    "`training.train` on a copy of `policy` with a δS adapter and a ProjectionArm callback (None: plain train)."
    model, tok = copy.deepcopy(policy)
    ds = add_delta_s(model, ATTN)
    cbs = []
    if arm_name is not None:
        pairs, _ = planted_pairs(tok, n_pairs=12, seed=0)
        vh = (extract_v_hack(sp_for(model, tok), ds, pairs, k=2) if v_seed is None
              else random_v_hack(ds, k=2, seed=v_seed))
        cbs = [ProjectionArm(arm_name, ds, vh)]
    cfg = TrainConfig(max_steps=steps, prompts_per_step=2, num_generations=4, learning_rate=1e-2,
                      arm=arm_name or "vanilla", generation=GenerationConfig(max_new_tokens=8))
    res = train(model, tok, DigitTask(16), cfg, callbacks=cbs, progress=False)
    return res, [p.detach().clone() for p in ds.parameters()]


def test_projected_arm_in_train_lowers_cos_whenever_the_gate_fires(tiny):
    res, _ = _train_arm(tiny, "projected")
    fired = [r for r in res.records if r["frac_fired"] > 0]
    assert fired, "the gate never fired: the test would prove nothing"
    assert all(r["cos_out"] < r["cos_in"] for r in fired)
    assert all(r["arm"] == "projected" and "cos_sub_null" in r for r in res.records)
    print([(round(r["cos_in"], 4), round(r["cos_out"], 4), r["frac_fired"]) for r in res.records])


def test_vanilla_arm_in_train_is_bitwise_plain_train(tiny):
    plain, p0 = _train_arm(tiny, None)
    vanilla, p1 = _train_arm(tiny, "vanilla", v_seed=1)
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
    sp = sp_for(model, tok)
    pairs, _ = planted_pairs(tok, n_pairs=4, seed=0)
    vh = extract_v_hack(sp, ds, pairs, k=2)
    log = run_arm(model, tok, ds, pairs, ProjectionArm("projected", ds, vh), steps=2, lr=1e-3)
    assert all(r["cos_out"] < r["cos_in"] for r in log if r["frac_fired"] > 0)
    with ds.zeroed():
        assert torch.equal(model(x, attention_mask=am).logits, ref)


def test_pool_pairs_matches_hacked_teacher_to_clean_base_samples_of_the_same_problem(tiny, tmp_path):
    "Pairs only (teacher hacked, base clean) of one problem, each base sample used once, in teacher order."
    tok = tiny[1]
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


def test_arm_step_measures_or_projects_as_project_grad_does():
    V, g = {"a": torch.eye(4)[:2]}, {"a": torch.tensor([1.0, -2.0, 3.0, 4.0])}
    same, st = arm_step(g, V)
    assert same is g and st["cos_in"] == st["cos_out"] and st["frac_fired"] == 0.0
    new, st_p = arm_step(g, V, project=True)
    ref, st_ref = project_grad(g, V)
    assert torch.equal(new["a"], ref["a"]) and st_p["cos_out"] == st_ref["cos_out"] and "c_in" not in st_p


def test_cos_update_is_that_of_the_adamw_step_built_from_the_projected_gradient(fresh_tiny):
    "AdamW's first step from zero weights moves by lr·g'/(|g'| + eps) per coordinate (g' the projected gradient): "
    "cos_update is that step's signed cos — not cos_out, which is ≤ 0 — and the weights it saw are the step's own."
    from entropy_grpo.projection_arms import alignment_stats
    model, tok = fresh_tiny
    ds = add_delta_s(model, ATTN)
    pairs, _ = planted_pairs(tok, n_pairs=12, seed=0)
    sp = sp_for(model, tok)
    vh = extract_v_hack(sp, ds, pairs, k=2)
    arm, opt = ProjectionArm("projected", ds, vh), torch.optim.AdamW(ds.parameters(), lr=1e-2, eps=1e-8)
    policy_gradient_backward(sp, pairs, group_advantages(torch.tensor([[1.0, 0.0]] * 12)), length_norm="sample")
    arm.on_after_backward()
    g = ds.flat_grads()
    opt.step()
    rec = {}
    arm.on_step_end(None, rec)
    step = {m: v / (v.abs() + 1e-8) for m, v in g.items()}
    assert rec["frac_fired"] > 0 and rec["cos_out"] <= 1e-6
    assert rec["cos_update"] == pytest.approx(alignment_stats(step, vh.V)["cos"], abs=1e-5)
    assert abs(rec["cos_update"] - rec["cos_out"]) > 0.01
    rec = {}
    arm.on_step_end(None, rec)                    # a step end with no backward since: nothing to measure
    assert "cos_update" not in rec
