"""rb_entropy: the reference (`warped_logits`, transformers' warpers) is what `generate` samples from; the fast kept
sets equal it (ties included), the fast log q and entropies equal their references, and their gradients."""
import math, re

import pytest
import torch

import entropy_grpo.kept_sets as ks
from entropy_grpo.rb_entropy import (naive_rb_entropy, rb_entropy, sampling_logprobs, sampling_mask,
                                     truncated_log_softmax, warped_logits)
from entropy_grpo.sequence_processor import GenerationConfig, hf_generation_config, own_generation_config
from exact import listed_mask


def lm_like(N, V, seed=0, spread=(0.5, 6.0)):
    "Gaussian logits whose scale varies by row, so nucleus sizes range from a few tokens to most of V."
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, V, generator=g) * torch.linspace(*spread, N)[:, None]


def tied(N, V, seed=0, step=0.25):
    "Logits on a grid: many exact ties, also across the top-p and top-k boundaries."
    return (lm_like(N, V, seed) / step).round() * step


@pytest.fixture(params=[2, ks._WINDOW], ids=["window2", "window-default"])
def window(request, monkeypatch):
    "Run with the real first window and with a tiny one, so the widening retries run on nearly every row."
    monkeypatch.setattr(ks, "_WINDOW", request.param)
    return request.param


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.7, 0.9, 0), (1.3, 0.8, 20), (1.0, 1.0, 5), (0.9, 0.95, 50)])
def test_warped_logits_are_the_scores_generate_samples_from(tiny, temperature, top_p, top_k):
    "The reference is transformers' own chain: its output equals generate's processed scores bitwise, step by step."
    model, tok = tiny
    cfg = GenerationConfig(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=6)
    gc = hf_generation_config(cfg, tok)
    gc.update(output_scores=True, output_logits=True, return_dict_in_generate=True, num_return_sequences=3)
    enc = tok(["Question: What is 1 + 2? Answer:", "Q: 3 * 3 ="], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with own_generation_config(model), torch.no_grad():
        out = model.generate(**enc, generation_config=gc)
    assert len(out.scores) == len(out.logits) == 6
    for raw, processed in zip(out.logits, out.scores):
        assert torch.equal(warped_logits(raw, temperature, top_p, top_k), processed)
    if top_p < 1 or top_k: assert not torch.isfinite(out.scores[0]).all()      # the truncation really happened


KNOBS = [dict(top_p=0.9), dict(temperature=0.7, top_p=0.95), dict(temperature=2.5, top_p=0.5), dict(top_p=0.999),
         dict(top_k=1), dict(top_k=37), dict(temperature=1.3, top_k=50, top_p=0.8), dict(top_p=1.0),
         dict(top_p=0.3, min_tokens_to_keep=4), dict(top_k=3, top_p=0.2, min_tokens_to_keep=6)]


@pytest.mark.parametrize("kw", KNOBS, ids=str)
@pytest.mark.parametrize("make", [lm_like, tied], ids=["random", "ties"])
def test_mask_equals_warpers(kw, make, window):
    x = make(48, 2000, seed=3)
    ref = warped_logits(x, **kw) != -math.inf
    torch.testing.assert_close(sampling_mask(x, **kw, chunk_size=11), ref, rtol=0, atol=0)


@pytest.mark.parametrize("kw", [k for k in KNOBS if k.get("top_p", 1) < 1 and not k.get("top_k")], ids=str)
@pytest.mark.parametrize("make", [lm_like, tied], ids=["random", "ties"])
def test_mask_exact_tail_on_every_row(kw, make, monkeypatch):
    "Forcing the exact tail (masked logsumexp below the window) on every row also gives the warpers' set."
    monkeypatch.setattr(ks, "_Z_RTOL", 1.0)
    x = make(48, 2000, seed=4)
    assert torch.equal(sampling_mask(x, **kw, chunk_size=16), warped_logits(x, **kw) != -math.inf)


def test_tail_from_lse_alone_is_not_enough(monkeypatch):
    "Without the exact-tail fallback the float32 logsumexp's rounding moves boundary tokens at top_p 0.999."
    x, kw = lm_like(48, 2000, seed=4), dict(top_p=0.999)
    ref = warped_logits(x, **kw) != -math.inf
    assert torch.equal(sampling_mask(x, **kw), ref)
    monkeypatch.setattr(ks, "_Z_RTOL", 0.0)
    assert not torch.equal(sampling_mask(x, **kw), ref)


@pytest.mark.parametrize("kw", [k for k in KNOBS if "min_tokens_to_keep" not in k], ids=str)   # generate's default 1
@pytest.mark.parametrize("make", [lm_like, tied], ids=["random", "ties"])
def test_kept_indices_list_the_mask(kw, make, window):
    "The index lists token_stats uses name exactly the tokens of sampling_mask, with or without a known lse."
    x = make(40, 1500, seed=5) / kw.get("temperature", 1.)
    mask = sampling_mask(x, top_p=kw.get("top_p", 1.), top_k=kw.get("top_k", 0))
    for lse in (None, x.logsumexp(-1)):
        idx = ks._kept_indices(x, kw.get("top_p", 1.), kw.get("top_k", 0), lse, chunk_size=7)
        assert idx.shape == (40, int(mask.sum(-1).max()))
        assert torch.equal(listed_mask(idx, 1500), mask) and torch.equal((idx >= 0).sum(-1), mask.sum(-1))


def test_mask_ties_straddle_boundary():
    "Exact ties split by the boundary: how many survive is fixed, which ones is the warper's sort order; we match it."
    x = torch.zeros(4, 300)
    x[:, :3] = 5.0                                # 30% of the mass
    x[:, 100:140] = 3.0                           # 40 tied tokens holding the next 53%: top-p 0.5 / 0.6 splits them
    x[1, 250:260] = 3.0
    x[3] = x[3].flip(0)
    for kw in [dict(top_p=0.5), dict(top_p=0.6, top_k=60), dict(top_p=0.05, min_tokens_to_keep=20)]:
        m, ref = sampling_mask(x, **kw), warped_logits(x, **kw) != -math.inf
        assert torch.equal(m, ref), kw
        assert 3 < int(m[0].sum()) < 43, kw


def test_mask_bfloat16_equals_warpers():
    "bfloat16 logits: generate casts to float32 first; few distinct values, so split ties are the rule."
    x = lm_like(32, 5000, seed=1).bfloat16()
    for kw in [dict(top_p=0.9), dict(temperature=0.8, top_p=0.95, top_k=100)]:
        assert torch.equal(sampling_mask(x, **kw), warped_logits(x, **kw) != -math.inf)


def test_mask_top_p_one_keeps_everything():
    x = lm_like(4, 50)
    assert sampling_mask(x, top_p=1.0).all() and sampling_mask(x, temperature=0.3).all()
    assert sampling_mask(x[None], top_p=0.9).shape == (1, 4, 50)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,chunk", [((37, 1500), 5), ((2, 9, 1500), 64), ((3, 5, 1500), 1), ((1, 40), 7)])
@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(temperature=0.6, top_p=0.95), dict(temperature=3.0, top_p=0.7),
                                dict(top_k=20), dict(temperature=1.2, top_k=40, top_p=0.9), dict()], ids=str)
def test_rb_entropy_equals_naive(dtype, shape, chunk, kw, window):
    x = lm_like(math.prod(shape[:-1]), shape[-1], seed=len(shape)).view(shape).to(dtype)
    H = rb_entropy(x, **kw, chunk_size=chunk)
    assert H.shape == shape[:-1] and H.dtype == torch.float32
    torch.testing.assert_close(H, naive_rb_entropy(x, **kw))


def test_rb_entropy_full_vocab_at_top_p_one():
    x = lm_like(20, 3000)
    full = -(x.softmax(-1) * x.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(rb_entropy(x, top_p=1.0), full)
    torch.testing.assert_close(rb_entropy(x, top_p=1.0, chunk_size=3), full)
    torch.testing.assert_close(rb_entropy(x, temperature=0.5), -((2 * x).softmax(-1) * (2 * x).log_softmax(-1)).sum(-1))


def test_rb_entropy_of_truncated_log_softmax():
    "−inf logits have probability 0: the entropy of an already-truncated log q at top_p = 1 is the truncated entropy."
    x = lm_like(16, 500)
    logq = truncated_log_softmax(x, 0.8, 0.9).requires_grad_()
    H = rb_entropy(logq)
    torch.testing.assert_close(H, rb_entropy(x, 0.8, 0.9))
    H.sum().backward()
    assert torch.isfinite(logq.grad).all()


def spaced(rows=3, V=7, seed=0):
    "float64 logits 0.37 apart with a little noise: no kept-set boundary within gradcheck's step."
    g = torch.Generator().manual_seed(seed)
    return (torch.arange(V, dtype=torch.float64) * 0.37 + torch.randn(rows, V, generator=g, dtype=torch.float64) * 0.05
            ).requires_grad_()


@pytest.mark.parametrize("kw", [dict(temperature=1.3, top_p=0.8), dict(top_p=0.5), dict(temperature=0.9, top_k=4),
                                dict(top_k=3, top_p=0.7), dict(temperature=1.3), dict()], ids=str)
def test_gradcheck(kw):
    x = spaced()
    assert torch.autograd.gradcheck(lambda z: rb_entropy(z, **kw), (x,))
    keep = sampling_mask(x, **kw)
    assert keep[:, 5:].all()                                    # every kept set holds the two largest logits
    assert torch.autograd.gradcheck(lambda z: sampling_logprobs(z, torch.tensor([6, 5, 6]), **kw), (x,))
    assert torch.autograd.gradcheck(lambda z: truncated_log_softmax(z, **kw).masked_fill(~keep, 0.), (x,))


def test_gradcheck_explicit_keep():
    x = spaced()
    keep = torch.rand(3, 7, generator=torch.Generator().manual_seed(0)) < 0.5
    keep[:, 6] = True
    assert torch.autograd.gradcheck(lambda z: rb_entropy(z, 1.2, keep=keep), (x,))
    assert torch.autograd.gradcheck(lambda z: sampling_logprobs(z, torch.tensor([6, 6, 6]), keep=keep), (x,))


@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(temperature=0.7, top_k=30, top_p=0.95), dict()], ids=str)
def test_gradient_equals_naive(kw, window):
    x = lm_like(24, 1000)
    g1, g2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = torch.randn(24, generator=torch.Generator().manual_seed(1))
    (rb_entropy(g1, **kw, chunk_size=5) * w).sum().backward()
    (naive_rb_entropy(g2, **kw) * w).sum().backward()
    torch.testing.assert_close(g1.grad, g2.grad)


def test_bfloat16_gradient():
    x = lm_like(8, 300).bfloat16().requires_grad_()
    rb_entropy(x, top_p=0.9).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and x.grad.abs().sum() > 0


def test_backward_holds_kept_values_not_vocab():
    "The graph saves [n, K] kept values and indices; the full-vocabulary path saves only the logits it was given."
    x = lm_like(64, 20000, spread=(4.0, 8.0)).requires_grad_()    # top-p 0.9 keeps 1…154 tokens per row
    for kw in [dict(top_p=0.9), dict()]:
        saved = []
        def pack(t):
            if t.data_ptr() != x.data_ptr(): saved.append(t.numel())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            rb_entropy(x, **kw, chunk_size=16).sum()
        assert sum(saved) < x.numel() / 10, (kw, sum(saved))


KW_LOGQ = [dict(temperature=0.7, top_p=0.9), dict(top_p=0.95, top_k=30), dict(temperature=1.3), dict(top_k=5),
           dict(top_p=0.6, top_k=80)]


@pytest.mark.parametrize("kw", KW_LOGQ, ids=str)
@pytest.mark.parametrize("make", [lm_like, tied], ids=["random", "ties"])
def test_sampling_logprobs_equal_warpers(kw, make, window):
    x = make(40, 1500, seed=5)
    ref_all = warped_logits(x, **kw).log_softmax(-1)
    g = torch.Generator().manual_seed(0)
    sampled = torch.multinomial(ref_all.exp(), 1, generator=g)[:, 0]
    rand = torch.randint(0, 1500, (40,), generator=g)
    thr = ref_all.masked_fill(ref_all == -math.inf, math.inf).argmin(-1)        # a least probable kept token
    for t in (sampled, rand, thr):
        ref = ref_all.gather(-1, t[:, None])[:, 0]
        lq = sampling_logprobs(x, t, **kw, chunk_size=7)
        assert lq.dtype == torch.float32
        torch.testing.assert_close(lq, ref)
    torch.testing.assert_close(truncated_log_softmax(x, **kw), ref_all)


def test_sampling_logprobs_split_tie_tokens():
    "Tokens tied with the last kept one, kept or not by the warper's sort order: −inf exactly when the warper drops it."
    x = torch.zeros(2, 200)
    x[:, :2] = 2.0
    x[:, 50:90] = 1.0
    ref = warped_logits(x, top_p=0.5).log_softmax(-1)
    for tok in range(50, 90):
        t = torch.tensor([tok, tok])
        torch.testing.assert_close(sampling_logprobs(x, t, top_p=0.5), ref[:, tok])


def test_include_tokens():
    x = lm_like(30, 800, seed=2)
    kw = dict(temperature=0.9, top_p=0.8)
    keep = sampling_mask(x, **kw)
    t = torch.randint(0, 800, (30,), generator=torch.Generator().manual_seed(3))
    lq, outside = sampling_logprobs(x, t, **kw, include_tokens=True)
    assert torch.equal(outside, ~keep.gather(1, t[:, None])[:, 0]) and outside.sum() > 5
    keep_y = keep.clone()
    keep_y[torch.arange(30), t] = True                                            # S ∪ {y}, renormalised
    torch.testing.assert_close(lq, truncated_log_softmax(x, 0.9, keep=keep_y).gather(1, t[:, None])[:, 0])
    assert torch.isfinite(lq).all()
    inside = ~outside
    torch.testing.assert_close(lq[inside], sampling_logprobs(x, t, **kw)[inside])
    assert torch.isneginf(sampling_logprobs(x, t, **kw)[outside]).all()


def test_include_tokens_never_returns_minus_inf():
    x = lm_like(3, 10)
    x[1, 4] = -math.inf
    with pytest.raises(ValueError, match="1 tokens have logit −inf"):
        sampling_logprobs(x, torch.tensor([0, 4, 0]), top_p=0.9, include_tokens=True)


def test_explicit_keep_fixed_support():
    "Score other logits (θ⁺) on the kept sets of these ones (θ)."
    x = lm_like(25, 1200, seed=4)
    x2 = x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    keep = sampling_mask(x, 0.8, 0.9)
    torch.testing.assert_close(rb_entropy(x, 0.8, 0.9, keep=keep), rb_entropy(x, 0.8, 0.9))
    logq = truncated_log_softmax(x2, 0.8, keep=keep)
    q = logq.exp()
    torch.testing.assert_close(rb_entropy(x2, 0.8, keep=keep, chunk_size=4), -(q * logq.nan_to_num(neginf=0.)).sum(-1))
    t = torch.multinomial(keep.float(), 1, generator=torch.Generator().manual_seed(6))[:, 0]
    torch.testing.assert_close(sampling_logprobs(x2, t, 0.8, keep=keep), logq.gather(1, t[:, None])[:, 0])


def test_empty_rows():
    x = torch.zeros(0, 50)
    assert rb_entropy(x, top_p=0.9).shape == (0,) and rb_entropy(x).shape == (0,)
    assert sampling_mask(x, top_p=0.9).shape == (0, 50)
    assert sampling_logprobs(x, torch.zeros(0, dtype=torch.long), top_p=0.9).shape == (0,)


@pytest.mark.parametrize("call,msg", [
    (lambda x: rb_entropy(x, top_p=0.0), "top_p=0.0: expected a number in (0, 1]"),
    (lambda x: rb_entropy(x, top_p=1.5), "top_p=1.5: expected a number in (0, 1]"),
    (lambda x: sampling_mask(x, top_p=float("nan")), "top_p=nan"),
    (lambda x: sampling_mask(x, temperature=0), "temperature=0: expected a number > 0"),
    (lambda x: rb_entropy(x, temperature=-1.0), "temperature=-1.0"),
    (lambda x: rb_entropy(x, temperature=math.inf), "temperature=inf"),
    (lambda x: sampling_mask(x, top_k=-1), "top_k=-1: expected an integer >= 0"),
    (lambda x: sampling_mask(x, top_k=2.5), "top_k=2.5"),
    (lambda x: sampling_mask(x, top_p=0.9, min_tokens_to_keep=0), "min_tokens_to_keep=0: expected an integer >= 1"),
    (lambda x: rb_entropy(x, top_p=0.9, chunk_size=0), "chunk_size=0: expected an integer >= 1"),
    (lambda x: naive_rb_entropy(x, top_p=2.0), "top_p=2.0"),
    (lambda x: truncated_log_softmax(x, top_k=-3), "top_k=-3"),
    (lambda x: sampling_logprobs(x, torch.zeros(4, dtype=torch.long)), "tokens has shape (4,), expected (3,)"),
    (lambda x: sampling_logprobs(x, torch.tensor([0, 1, 10])), "tokens range over [0, 10]: expected ids in [0, 10)"),
    (lambda x: rb_entropy(x, keep=torch.ones(3, 9, dtype=torch.bool)),
     "keep: torch.bool (3, 9), expected torch.bool (3, 10)"),
    (lambda x: rb_entropy(x, keep=torch.ones(3, 10)), "keep: torch.float32"),
    (lambda x: rb_entropy(x, keep=torch.eye(3, 10, dtype=torch.bool) & False), "keep has an empty kept set in row 0"),
])
def test_bad_input(call, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        call(lm_like(3, 10))
