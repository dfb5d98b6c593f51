"""sequence_processor: generation and teacher forcing exact against enumeration and against transformers' own warpers,
token_stats against a masked softmax, masks, fixed supports and parameter overrides, seeding, bad input."""
import copy, logging, math

import pytest
import torch

from entropy_grpo.policies import tiny_policy
from entropy_grpo.rb_entropy import sampling_mask, token_stats
from entropy_grpo.sequence_processor import (BatchedSequences, GenerationConfig, SequenceProcessor, check_probe_batch,
                                             hf_generation_config, own_generation_config, to_batched_sequences)
from exact import enumerate_entropy, listed_mask, warped_logq


def reference_sequence_logprobs(model, bs, temperature, top_p, top_k=0):
    "Σ_t log q(y_t) per (b, g), token by token from the warpers, on each sequence without its padding."
    B, G, T = bs.shape
    out = torch.zeros(B, G)
    for b in range(B):
        for g in range(G):
            am, P, L = bs.attention_masks[b, g], bs.prompt_lens[b], int(bs.gen_lens[b, g])
            start = int(am[:P].argmax())                      # first real prompt token
            ids = bs.sequences[b, g, start:P + L]
            lq = warped_logq(model, ids, temperature, top_p, top_k)
            out[b, g] = lq[P - start - 1:].gather(1, ids[P - start:, None]).sum()
    return out


PROMPTS = ["Question: What is 1 + 2? Answer:", "Q: 40 * 3 =", "What is 7 - 9? Think step by step. Answer:"]


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.7, 0.9, 0), (1.3, 0.95, 0), (1.0, 1.0, 0), (0.8, 0.9, 20)])
def test_sequence_logprobs_equal_warper_reference(tiny, temperature, top_p, top_k):
    model, tok = tiny
    sp = SequenceProcessor(model, tok, GenerationConfig(temperature=temperature, top_p=top_p, top_k=top_k,
                                                        max_new_tokens=10, num_generations=3, seed=1))
    bs = sp.generate_batched(PROMPTS)
    res, diag = sp.teacher_force_logprobs(bs)
    ref = reference_sequence_logprobs(model, bs, temperature, top_p, top_k)
    torch.testing.assert_close(res.sequence_logprobs, ref, rtol=1e-5, atol=1e-4)
    assert diag["n_outside_support"] == 0
    assert torch.isfinite(res.logprobs).all()


def test_temperature_changes_logq_as_expected(tiny):
    model, tok = tiny
    sp = SequenceProcessor(model, tok, GenerationConfig(temperature=0.7, top_p=1.0, max_new_tokens=8,
                                                        num_generations=2))
    bs = sp.generate_batched(PROMPTS[:2])
    hot_sp = SequenceProcessor(model, tok, GenerationConfig(temperature=1.5, max_new_tokens=8))
    hot = hot_sp.teacher_force_logprobs(bs)[0]
    cold = sp.teacher_force_logprobs(bs)[0]
    torch.testing.assert_close(hot.sequence_logprobs, reference_sequence_logprobs(model, bs, 1.5, 1.0),
                               rtol=1e-5, atol=1e-4)
    assert (hot.sequence_logprobs - cold.sequence_logprobs).abs().min() > 1e-3


def test_generate_uses_exactly_our_knobs_despite_model_generation_config(tiny):
    "generate's processed scores = our truncated log q, with a hostile model generation_config in place."
    model, tok = tiny
    cfg = GenerationConfig(temperature=0.7, top_p=0.9, max_new_tokens=6, num_generations=4)
    sp = SequenceProcessor(model, tok, cfg)
    gc = model.generation_config
    saved = gc.top_k, gc.repetition_penalty, gc.min_p, gc.temperature
    gc.top_k, gc.repetition_penalty, gc.min_p, gc.temperature = 3, 1.3, 0.2, 0.1
    try:
        enc = tok(PROMPTS[:1], return_tensors="pt")
        torch.manual_seed(0)
        with own_generation_config(model):
            out = model.generate(**enc, generation_config=hf_generation_config(cfg, tok), output_scores=True,
                                 return_dict_in_generate=True, num_return_sequences=4)
        assert model.generation_config.top_k == 3      # restored
        bs = sp.generate_batched(PROMPTS[:1])           # and generate_batched itself runs despite it
    finally:
        gc.top_k, gc.repetition_penalty, gc.min_p, gc.temperature = saved
    P = enc["input_ids"].shape[1]
    gen = out.sequences[:, P:]
    ref = torch.stack([s.log_softmax(-1) for s in out.scores], 1).gather(-1, gen[..., None]).squeeze(-1)
    one = BatchedSequences(out.sequences[None], torch.ones_like(out.sequences)[None], [P],
                           torch.full((1, 4), gen.shape[1]))
    res, _ = sp.teacher_force_logprobs(one)
    torch.testing.assert_close(res.logprobs[0], ref, rtol=0, atol=1e-5)
    assert bs.shape[:2] == (1, 4)


@pytest.mark.slow
def test_rb_and_naive_match_enumerated_entropy():
    model, tok = tiny_policy(0, vocab_size=7, pad_is_eos=True, alphabet="abcdef", init_std=0.6)
    T, top_p, max_new = 0.7, 0.9, 3
    prompt = tok("abc", add_special_tokens=False)["input_ids"]
    exact = enumerate_entropy(model, prompt, tok.eos_token_id, len(tok), max_new, T, top_p)
    sp = SequenceProcessor(model, tok, GenerationConfig(temperature=T, top_p=top_p, max_new_tokens=max_new,
                                                        num_generations=1000, gen_batch_size=1000, seed=0))
    bs = sp.generate_batched(["abc"] * 4)                      # 4000 sequences
    res, diag = sp.teacher_force_logprobs(bs)
    rb, naive = res.rb_entropy_sums.flatten(), -res.sequence_logprobs.flatten()
    n = rb.numel()
    se_rb, se_naive = rb.std() / n ** 0.5, naive.std() / n ** 0.5
    print(f"exact {exact:.4f}  RB {rb.mean():.4f} ± {se_rb:.4f}  naive {naive.mean():.4f} ± {se_naive:.4f}  "
          f"var ratio naive/RB {naive.var() / rb.var():.2f}  "
          f"eos-terminated {(bs.gen_lens < max_new).float().mean():.2f}")
    assert abs(rb.mean() - exact) < 4 * se_rb
    assert abs(naive.mean() - exact) < 4 * se_naive
    assert rb.var() < naive.var()
    assert diag["n_outside_support"] == 0


def test_eos_included_and_padding_masked_when_pad_is_eos():
    model, tok = tiny_policy(0, vocab_size=7, pad_is_eos=True, alphabet="abcdef", init_std=0.6)
    sp = SequenceProcessor(model, tok, GenerationConfig(temperature=1.0, max_new_tokens=6, num_generations=16, seed=3))
    bs = sp.generate_batched(["ab", "abcdef"])
    eos, P = tok.eos_token_id, bs.prompt_lens[0]
    gen = bs.sequences[..., P:]
    assert tok.pad_token_id == eos
    saw_eos = saw_full = False
    for b in range(2):
        for g in range(16):
            row, L = gen[b, g].tolist(), int(bs.gen_lens[b, g])
            first = row.index(eos) + 1 if eos in row else len(row)
            assert L == min(first, 6)                                  # EOS counted, nothing after it
            assert bs.attention_masks[b, g, P:P + L].all() and not bs.attention_masks[b, g, P + L:].any()
            saw_eos |= eos in row[:6]; saw_full |= L == 6 and eos not in row[:6]
    assert saw_eos and saw_full
    res, _ = sp.teacher_force_logprobs(bs)
    torch.testing.assert_close(res.gen_mask.sum(-1), bs.gen_lens)
    # garbage after EOS with attention 1 (a careless caller's mask) contributes nothing
    dirty = BatchedSequences(bs.sequences.clone(), bs.attention_masks.clone(), bs.prompt_lens, bs.gen_lens)
    after = torch.arange(bs.shape[2]) >= (P + bs.gen_lens)[..., None]
    dirty.sequences[after] = 3
    dirty.attention_masks[...] = 1
    dirty.attention_masks[..., :P] = bs.attention_masks[..., :P]
    torch.testing.assert_close(sp.teacher_force_logprobs(dirty)[0].sequence_logprobs, res.sequence_logprobs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kw", [dict(top_p=0.8), dict(top_k=9), dict(top_p=0.9, top_k=40), dict()], ids=str)
def test_token_stats_equal_masked_softmax(kw, dtype):
    "Kept-set lists, log q, RB and full entropies and their gradients against a masked log-softmax over all of V."
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(50, 300, generator=g) * torch.linspace(0.5, 5, 50)[:, None]).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, 300, (50,), generator=g)                     # many outside the kept sets
    st = token_stats(x, tokens, **kw, full=True, return_support=True)
    keep = sampling_mask(x.detach(), **kw)
    outside = ~keep[torch.arange(50), tokens]
    keep[torch.arange(50), tokens] = True                                  # the realised token is put back in
    assert torch.equal(st["outside"], outside) and (not kw or outside.any())
    if kw: assert torch.equal(listed_mask(st["support"], 300), keep)
    else: assert st["support"] is None
    logq = x.masked_fill(~keep, -math.inf).log_softmax(-1)
    q, logp = logq.exp(), x.log_softmax(-1)
    ref = dict(logq=logq.gather(1, tokens[:, None])[:, 0], rb=-(q * logq.nan_to_num(neginf=0.)).sum(-1),
               full=-(logp.exp() * logp).sum(-1))
    for k, v in ref.items(): torch.testing.assert_close(st[k], v)
    w = torch.randn(3, 50, generator=g, dtype=dtype)
    got = torch.autograd.grad(sum((wi * st[k]).sum() for wi, k in zip(w, ref)), x)[0]
    want = torch.autograd.grad(sum((wi * ref[k]).sum() for wi, k in zip(w, ref)), x)[0]
    torch.testing.assert_close(got, want)
    if kw:                                                                 # fixed support: the same numbers
        again = token_stats(x, tokens, **kw, support=st["support"])
        torch.testing.assert_close(again["logq"], st["logq"]); torch.testing.assert_close(again["rb"], st["rb"])


def test_rb_requires_grad_controls_graph(tiny):
    model, tok = tiny
    cfg = GenerationConfig(temperature=0.8, top_p=0.9, max_new_tokens=6, num_generations=2)
    bs = SequenceProcessor(model, tok, cfg).generate_batched(PROMPTS[:2])
    res, _ = SequenceProcessor(model, tok, cfg).teacher_force_logprobs(bs, with_grad=True)
    assert res.rb_entropies_torch is None and not res.rb_entropies.requires_grad
    assert res.logprobs.requires_grad
    cfg_g = GenerationConfig(temperature=0.8, top_p=0.9, max_new_tokens=6, num_generations=2, rb_requires_grad=True)
    res_g, _ = SequenceProcessor(model, tok, cfg_g).teacher_force_logprobs(bs, with_grad=True)
    model.zero_grad()
    (res_g.rb_entropies_torch * res_g.gen_mask).sum().backward()
    g = sum(p.grad.abs().sum() for p in model.parameters() if p.grad is not None)
    assert g > 0
    model.zero_grad()
    torch.testing.assert_close(res_g.rb_entropies, res.rb_entropies)


def test_same_scalars_any_microbatch_and_chunk(tiny):
    model, tok = tiny
    gen = GenerationConfig(temperature=0.9, top_p=0.95, max_new_tokens=12, num_generations=4)
    bs = SequenceProcessor(model, tok, gen).generate_batched(PROMPTS)
    outs = [SequenceProcessor(model, tok, GenerationConfig(temperature=0.9, top_p=0.95, tf_batch_size=tf,
                                                           head_chunk_size=hc)).teacher_force_logprobs(bs)[0]
            for tf, hc in ((1, 1024), (64, 1024), (64, 7), (5, 3))]
    for o in outs[1:]:
        for name in ("logprobs", "rb_entropies", "full_entropies"):
            torch.testing.assert_close(getattr(o, name), getattr(outs[0], name), rtol=1e-5, atol=1e-5)


def test_support_and_params_override(tiny):
    model, tok = tiny
    cfg = GenerationConfig(temperature=0.9, top_p=0.9, max_new_tokens=8, num_generations=3)
    sp = SequenceProcessor(model, tok, cfg)
    bs = sp.generate_batched(PROMPTS)
    res, diag = sp.teacher_force_logprobs(bs, return_support=True)
    same, _ = sp.teacher_force_logprobs(bs, support=diag["support"])
    torch.testing.assert_close(same.logprobs, res.logprobs)
    # params_override evaluates elsewhere without touching the model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    moved = {k: v.detach() + 0.05 * torch.randn_like(v) for k, v in model.named_parameters()}
    over, _ = sp.teacher_force_logprobs(bs, params_override=moved)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    clone = copy.deepcopy(model)
    clone.load_state_dict(moved, strict=False)
    direct, _ = SequenceProcessor(clone, tok, cfg).teacher_force_logprobs(bs)
    torch.testing.assert_close(over.logprobs, direct.logprobs, rtol=1e-5, atol=1e-5)
    assert (over.logprobs - res.logprobs).abs().max() > 1e-3
    # fixed support: θ⁺ scored with θ's kept sets differs from its own truncation only through the kept sets
    fixed, _ = sp.teacher_force_logprobs(bs, params_override=moved, support=diag["support"])
    assert torch.isfinite(fixed.logprobs[fixed.gen_mask]).all()


def test_generation_is_seeded_and_chunked(tiny):
    model, tok = tiny
    sp = SequenceProcessor(model, tok, GenerationConfig(max_new_tokens=5, num_generations=3, seed=7))
    a = sp.generate_batched(PROMPTS + ["x"], gen_batch_size=3)
    b = sp.generate_batched(PROMPTS + ["x"], gen_batch_size=3)
    assert torch.equal(a.sequences, b.sequences) and a.shape[:2] == (4, 3)
    assert not torch.equal(a.sequences, sp.generate_batched(PROMPTS + ["x"], gen_batch_size=3, seed=8).sequences)
    assert len(a.responses_text) == 4 and len(a.responses_text[0]) == 3


def test_bad_input(tiny):
    model, tok = tiny
    sp = SequenceProcessor(model, tok, GenerationConfig(max_new_tokens=5))
    for kw, msg in ((dict(top_p=0.0), "top_p=0.0"), (dict(top_p=1.2), "top_p=1.2"),
                    (dict(temperature=-1), "temperature=-1"), (dict(top_k=-3), "top_k=-3"),
                    (dict(max_new_tokens=0), "max_new_tokens=0")):
        with pytest.raises(ValueError, match=msg.replace(".", r"\.")):
            GenerationConfig(**kw)
    with pytest.raises(ValueError, match="G=0"):
        sp.generate_batched(PROMPTS, G=0)
    with pytest.raises(ValueError, match="non-empty list"):
        sp.generate_batched([])
    with pytest.raises(ValueError, match="context of 512"):
        sp.generate_batched(["1 + 1 = 2. " * 200])


def test_tokenizer_without_pad_gets_eos(fresh_tiny, caplog):
    model, tok = fresh_tiny
    tok.pad_token = None
    with caplog.at_level(logging.INFO):
        sp = SequenceProcessor(model, tok, GenerationConfig(max_new_tokens=4, num_generations=2))
    assert tok.pad_token_id == tok.eos_token_id and "pad" in caplog.text
    bs = sp.generate_batched(PROMPTS[:2])
    assert torch.equal(sp.teacher_force_logprobs(bs)[0].gen_mask.sum(-1), bs.gen_lens)


def test_probe_batch_round_trip(tiny):
    model, tok = tiny
    gen = GenerationConfig(max_new_tokens=4, num_generations=2)
    bs = SequenceProcessor(model, tok, gen).generate_batched(PROMPTS[:2])
    batch = dict(sequences=bs.sequences, attention_masks=bs.attention_masks, prompt_lens=bs.prompt_lens,
                 advantages=torch.zeros(2, 2), rewards=torch.zeros(2, 2), max_lengths=[4, 4], prompt_ids=[0, 1],
                 num_prompts=2, num_responses_per_prompt=2)
    assert torch.equal(to_batched_sequences(batch).gen_lens, bs.gen_lens)
    with pytest.raises(ValueError, match=r"advantages: expected shape \(2, 2\), got \(2, 3\)"):
        check_probe_batch({**batch, "advantages": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="lacks"):
        check_probe_batch({k: v for k, v in batch.items() if k != "rewards"})


@pytest.mark.parametrize("lora", [False, True])
def test_generate_batched_reads_each_prompt_once(lora):
    """The G rows of a prompt share its prefill: the decoder sees each left-padded prompt once (B rows, P − 1 columns)
    and never B·G rows of prompt, and the completions are token for token those of the bare `generate` on the
    repeated prompts with the same seed — with a LoRA adapter too."""
    from peft import LoraConfig, get_peft_model
    model, tok = tiny_policy(0, dtype=torch.float64)
    if lora: model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    cfg = GenerationConfig(temperature=0.9, top_p=0.9, max_new_tokens=8, num_generations=4, seed=5)
    G = cfg.num_generations
    sp = SequenceProcessor(model, tok, cfg)
    shapes = []
    hook = model.get_decoder().register_forward_hook(lambda m, a, kw, out: shapes.append(tuple(kw["input_ids"].shape)),
                                                     with_kwargs=True)
    bs = sp.generate_batched(PROMPTS)
    hook.remove()
    pb, ab = sp._left_pad(sp._tokenize(PROMPTS))
    B, P = pb.shape
    assert shapes[0] == (B, P - 1) and all(s[0] == B * G and s[1] == 1 for s in shapes[1:]), shapes
    torch.manual_seed(cfg.seed * 1_000_003)
    with own_generation_config(model):
        out = model.generate(input_ids=pb.repeat_interleave(G, 0), attention_mask=ab.repeat_interleave(G, 0),
                             generation_config=hf_generation_config(cfg, tok, sp.eos_token_id))
    L = out.shape[1] - P
    assert torch.equal(bs.sequences[..., P:P + L], out[:, P:].view(B, G, L))


def test_a_completion_ends_at_the_tokenizers_eos_or_the_generation_configs(tiny):
    "The tokenizer's EOS moved to the token the policy samples most (a fine-tune's end of turn) while the generation"
    " config keeps the old one: every completion ends at its first of the two, and some end at each."
    model, tok = copy.deepcopy(tiny)
    cfg = GenerationConfig(temperature=1.0, max_new_tokens=8, num_generations=32, seed=0)
    old = tok.eos_token_id
    common = int(SequenceProcessor(model, tok, cfg, progress=False).generate_batched(PROMPTS[:1]).sequences.flatten()
                 .mode().values)
    model.generation_config.eos_token_id, tok.eos_token = old, tok.convert_ids_to_tokens(common)
    sp = SequenceProcessor(model, tok, cfg, progress=False)
    assert sp.eos_token_id == [common, old]
    bs = sp.generate_batched(PROMPTS)
    gen, ends = bs.sequences[..., bs.prompt_lens[0]:], set()
    for b in range(len(PROMPTS)):
        for g in range(32):
            row = gen[b, g].tolist()
            stop = next((i for i, t in enumerate(row) if t in (common, old)), None)
            assert int(bs.gen_lens[b, g]) == (len(row) if stop is None else stop + 1), (b, g, row)
            if stop is not None: ends.add(row[stop])
    assert ends == {common, old}
