"""adapters: a zero δS adapter is bitwise the base model and a step moves only δS, its gradient is the SVD diagonal of
the weight gradient, top-rank δS, the SVD cache (memory, then disk), save/load with signature checks, find_linears'
errors, and the LoRA adapter (B = 0 init, init hash, zeroed, save/load)."""
import copy

import torch
from fastcore.test import test_fail

from entropy_grpo.adapters import add_delta_s, add_lora, clear_svd_cache, find_linears
from entropy_grpo.dr_grpo import group_advantages, policy_gradient_backward
from entropy_grpo.policies import tiny_policy
from entropy_grpo.pairs import planted_pairs
from tiny_inputs import ATTN, batch, sp_for


# ---------------------------------------------------------------- δS adapter

def test_zero_delta_s_is_bitwise_base_and_a_step_changes_only_delta_s(tiny, fresh_tiny):
    model, tok = fresh_tiny
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
    twin = copy.deepcopy(tiny[0])
    with torch.no_grad():
        for n in ds.names: twin.get_submodule(n).weight.copy_(ds.merged_weight(n))
    torch.testing.assert_close(model(x, attention_mask=am).logits, twin(x, attention_mask=am).logits,
                               rtol=1e-5, atol=1e-5)


def test_delta_s_gradient_is_the_svd_diagonal_of_the_weight_gradient(tiny):
    "∂L/∂δS_i = u_iᵀ (∂L/∂W) v_i, against the weight gradient of the plain model."
    (model, tok), (ref, _) = copy.deepcopy(tiny), copy.deepcopy(tiny)
    x, am = batch(tok)
    ds = add_delta_s(model, ATTN)
    model(x, attention_mask=am).logits.logsumexp(-1).mean().backward()
    ref(x, attention_mask=am).logits.logsumexp(-1).mean().backward()
    for n in ds.names:
        m, G = model.get_submodule(n), ref.get_submodule(n).weight.grad
        torch.testing.assert_close(m.delta_S.grad, torch.diagonal(m.svd_U.T @ G @ m.svd_Vh.T), rtol=1e-4, atol=1e-6)


def test_top_rank_delta_s(tiny, fresh_tiny):
    model, tok = fresh_tiny
    x, am = batch(tok)
    ds = add_delta_s(model, ["q_proj", "k_proj"], rank=4)
    assert set(ds.dims.values()) == {4}
    with torch.no_grad():
        for p in ds.parameters(): p.normal_(0, 0.5)
    twin = copy.deepcopy(tiny[0])
    with torch.no_grad():
        for n in ds.names: twin.get_submodule(n).weight.copy_(ds.merged_weight(n))
    torch.testing.assert_close(model(x, attention_mask=am).logits, twin(x, attention_mask=am).logits,
                               rtol=1e-5, atol=1e-5)
    test_fail(lambda: add_delta_s(copy.deepcopy(tiny[0]), ["k_proj"], rank=17),
              contains="rank=17: module model.layers.0.self_attn.k_proj has a 16x32 weight, so rank must lie in "
                       "[1, 16]", exc=ValueError)
    test_fail(lambda: add_delta_s(model, ["q_proj"]), contains="already carries a δS adapter", exc=ValueError)


def test_svd_cache_memory_then_disk(tiny, tmp_path, monkeypatch):
    clear_svd_cache()
    a = add_delta_s(copy.deepcopy(tiny[0]), ATTN, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("svd_*.safetensors"))) == len(a.names)

    def no_svd(*a, **k): raise AssertionError("SVD recomputed")
    monkeypatch.setattr(torch.linalg, "svd", no_svd)
    b = add_delta_s(copy.deepcopy(tiny[0]), ATTN)                     # memory cache
    clear_svd_cache()
    c = add_delta_s(copy.deepcopy(tiny[0]), ATTN, cache_dir=tmp_path)  # disk cache
    for n in a.names:
        ma, mb, mc = (x.model.get_submodule(n) for x in (a, b, c))
        assert torch.equal(ma.svd_U, mb.svd_U) and torch.equal(ma.svd_Vh, mc.svd_Vh) and torch.equal(ma.svd_S, mc.svd_S)


def test_delta_s_save_load_and_mismatch(tiny, tmp_path):
    ds = add_delta_s(copy.deepcopy(tiny[0]), ATTN)
    with torch.no_grad():
        for p in ds.parameters(): p.normal_()
    ds.save(tmp_path/"ds.safetensors", note="x")
    ds2 = add_delta_s(copy.deepcopy(tiny[0]), ATTN)
    assert ds2.load(tmp_path/"ds.safetensors")["note"] == "x"
    for p, q in zip(ds.parameters(), ds2.parameters()): assert torch.equal(p, q)
    other = add_delta_s(tiny_policy(1)[0], ATTN)
    test_fail(lambda: other.load(tmp_path/"ds.safetensors"),
              contains=f"weights_hash differs ({ds.weights_hash!r} in the file vs {other.weights_hash!r} here)",
              exc=ValueError)
    fewer = add_delta_s(copy.deepcopy(tiny[0]), ["q_proj"])
    test_fail(lambda: fewer.load(tmp_path/"ds.safetensors"), contains="targets differs", exc=ValueError)


def test_find_linears_error_lists_the_linears(tiny):
    test_fail(lambda: add_delta_s(copy.deepcopy(tiny[0]), ["q_proj", "qkv_proj"]),
              contains="entry 'qkv_proj' matches no nn.Linear of LlamaForCausalLM; its nn.Linear modules are named "
                       "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']",
              exc=ValueError)
    test_fail(lambda: find_linears(tiny[0], r".*attn\.qkv"), contains="matches no nn.Linear", exc=ValueError)
    assert find_linears(tiny[0], r".*layers\.1\.self_attn\.[qk]_proj") == ["model.layers.1.self_attn.q_proj",
                                                                          "model.layers.1.self_attn.k_proj"]


# ---------------------------------------------------------------- LoRA adapter

def test_lora_init_gauge_zeroed_and_save_load(tiny, fresh_tiny, tmp_path):
    model, tok = fresh_tiny
    x, am = batch(tok)
    ref = model(x, attention_mask=am).logits
    la = add_lora(model, ["q_proj", "v_proj"], r=4, seed=3)
    assert model(x, attention_mask=am).logits.equal(ref)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for d in la.param_names().values() for n in d.values()}
    model(x, attention_mask=am).logits.logsumexp(-1).mean().backward()
    for ps in la.module_params().values():                    # B = 0: the A-gradient is exactly zero
        assert torch.equal(ps["lora_A"].grad, torch.zeros_like(ps["lora_A"])) and ps["lora_B"].grad.abs().max() > 0
    assert la.init_hash == add_lora(copy.deepcopy(tiny[0]), ["q_proj", "v_proj"], r=4, seed=3).init_hash
    assert la.init_hash != add_lora(copy.deepcopy(tiny[0]), ["q_proj", "v_proj"], r=4, seed=4).init_hash
    with torch.no_grad():
        for ps in la.module_params().values(): ps["lora_B"].normal_(0, 0.3)
    moved = model(x, attention_mask=am).logits
    assert not torch.allclose(moved, ref)
    with la.zeroed():
        assert torch.equal(model(x, attention_mask=am).logits, ref)
    assert all(p.requires_grad for p in la.parameters())
    la.save(tmp_path/"lora.safetensors")
    lb = add_lora(copy.deepcopy(tiny[0]), ["q_proj", "v_proj"], r=4, seed=9)
    lb.load(tmp_path/"lora.safetensors")
    assert lb.init_hash == la.init_hash
    torch.testing.assert_close(lb.model(x, attention_mask=am).logits, moved, rtol=0, atol=0)
    test_fail(lambda: add_lora(copy.deepcopy(tiny[0]), ["q_proj", "v_proj"], r=2).load(tmp_path/"lora.safetensors"),
              contains="differs", exc=ValueError)
    test_fail(lambda: add_lora(copy.deepcopy(tiny[0]), ["k_proj"], r=17),
              contains="r=17: module model.layers.0.self_attn.k_proj", exc=ValueError)


def test_lora_weights_are_float32_on_a_bf16_model_and_one_step_moves_them():
    "One AdamW step at lr 7e-5 on a bf16 policy moves (almost) every lora_A entry: in bf16 most would round away."
    model, tok = tiny_policy(0, dtype=torch.bfloat16)
    x, am = batch(tok)
    la = add_lora(model, ["q_proj", "v_proj"], r=4)
    assert {p.dtype for p in la.parameters()} == {torch.float32}
    with torch.no_grad():
        for ps in la.module_params().values(): ps["lora_B"].normal_(0, 0.2)
    opt = torch.optim.AdamW(la.parameters(), lr=7e-5)
    A0 = [ps["lora_A"].detach().clone() for ps in la.module_params().values()]
    out = model(x, attention_mask=am).logits
    assert out.dtype == torch.bfloat16
    out.float().logsumexp(-1).mean().backward(); opt.step()
    changed = sum(int((ps["lora_A"] != a).sum()) for ps, a in zip(la.module_params().values(), A0))
    assert changed >= 0.95 * sum(a.numel() for a in A0), (changed, sum(a.numel() for a in A0))


def test_lora_from_peft_and_weights_adapter_are_the_runs_own_coordinates(tiny):
    "A user's peft LoRA and full weights as Adapters: same parameter objects, gradients in and out unchanged."
    from peft import LoraConfig, get_peft_model
    from entropy_grpo.adapters import LoraAdapter, WeightsAdapter
    pm = get_peft_model(copy.deepcopy(tiny[0]), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    own = LoraAdapter.from_peft(pm)
    assert [id(p) for p in own.parameters()] == [id(p) for p in pm.parameters() if p.requires_grad]
    assert (own.r, own.alpha, own.kind) == (4, 8, "lora") and len(own.names) == 4
    assert own.signature()["init_hash"] == own.init_hash
    test_fail(lambda: LoraAdapter.from_peft(tiny[0]), contains="no peft LoRA layer")
    model, tok = copy.deepcopy(tiny)
    wa = WeightsAdapter(model, ["q_proj", "o_proj"])
    assert wa.dims == {n: model.get_submodule(n).weight.numel() for n in wa.names}
    x, am = batch(tok)
    model(x, attention_mask=am).logits.logsumexp(-1).mean().backward()
    flat = wa.flat_grads()
    wa.set_flat_grads({n: 2 * g for n, g in flat.items()})
    assert all(torch.equal(model.get_submodule(n).weight.grad, 2 * flat[n].view_as(model.get_submodule(n).weight))
               for n in wa.names)
    test_fail(lambda: wa.zeroed().__enter__(), contains="no base-policy switch", exc=NotImplementedError)
