"kept_sets: the histogram path for wide nuclei against transformers' warpers: ties, top-k, min_tokens_to_keep."
import math

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

import entropy_grpo.kept_sets as ks
from exact import listed_mask
from entropy_grpo.kept_sets import _kept_indices, _nucleus, _nucleus_mask
from entropy_grpo.rb_entropy import (naive_rb_entropy, rb_entropy, sampling_logprobs, sampling_mask,
                                     truncated_log_softmax)

V = 49152                                                   # SmolLM2's vocabulary


def warped(x, top_p, top_k=0, min_tokens_to_keep=1):
    "transformers' kept set as generate computes it: float32 logits, TopK, then TopP."
    x = x.float()
    if top_k: x = TopKLogitsWarper(top_k, min_tokens_to_keep=min_tokens_to_keep)(None, x)
    return TopPLogitsWarper(top_p, min_tokens_to_keep=min_tokens_to_keep)(None, x) != -math.inf


def warped64(x, top_p, top_k=0, min_tokens_to_keep=1):
    """The same warpers run in float64 on the float32 logits, against generate's float32 threshold 1 − top_p: their
    rule in exact arithmetic (the float32 warper's softmax normalisation rounds: test_float32_warper_differs_...)."""
    t = float(torch.tensor(1 - top_p, dtype=torch.float32))
    x = x.float().double()
    if top_k: x = TopKLogitsWarper(top_k, min_tokens_to_keep=min_tokens_to_keep)(None, x)
    return TopPLogitsWarper(1 - t, min_tokens_to_keep=min_tokens_to_keep)(None, x) != -math.inf


def gauss(N, scales, seed=0, V=V):
    "Gaussian logits [N, V] with per-row scales: small scales make flat rows whose nuclei hold most of V."
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, V, generator=g) * torch.as_tensor(scales, dtype=torch.float32).view(-1, 1).expand(N, 1)


@pytest.fixture(params=[ks._HIST_AFTER, 0], ids=["windows-first", "histogram-only"])
def hist_after(request, monkeypatch):
    "As shipped (windows for narrow nuclei), and with every row sent to the histogram search."
    monkeypatch.setattr(ks, "_HIST_AFTER", request.param)
    return request.param


@pytest.mark.parametrize("top_p", [0.9, 0.95, 0.999])
def test_wide_nuclei_equal_the_warper_in_exact_arithmetic(top_p, hist_after):
    x = gauss(24, torch.linspace(0.2, 2.0, 24))
    mask = sampling_mask(x, top_p=top_p)
    assert (mask.sum(-1) > 10_000).all()                    # 11.6k … 49k kept tokens
    assert torch.equal(mask, warped64(x, top_p))
    assert torch.equal(mask, warped(x, top_p))              # here the float32 warper's rounding decides no row


def test_float32_warper_differs_only_within_its_rounding():
    """Where the float32 warper disagrees (on some CPUs one row of these 64, on others none), its own normalisation
    error decides: every differing token's exact cumulative mass (at or below it, ascending) lies within 1e-6 of
    1 − top_p; either rule may be the one keeping it."""
    x, top_p = gauss(64, 1.5, seed=2), 0.9
    t = float(torch.tensor(1 - top_p, dtype=torch.float32))
    mask, ref32 = sampling_mask(x, top_p=top_p), warped(x, top_p)
    assert torch.equal(mask, warped64(x, top_p)) and (mask.sum(-1) > 10_000).all()
    for j in (mask != ref32).any(-1).nonzero()[:, 0].tolist():   # how many rows differ depends on the CPU's sums
        v, order = x[j].sort()
        cum = v.double().softmax(-1).cumsum(-1)
        for tok in (mask[j] != ref32[j]).nonzero()[:, 0].tolist():
            assert abs(float(cum[(order == tok).nonzero()[0, 0]]) - t) < 1e-6, (j, tok)


def test_well_conditioned_wide_rows_equal_float32_warper():
    """A top_p per row whose threshold lies midway between two cumulative masses: the float32 warper cannot round
    across it, and its kept set (10k+ tokens) is ours token for token."""
    x = gauss(6, [0.3, 0.6, 1.0, 1.5, 2.0, 3.0], seed=2)
    for j, frac in enumerate([0.5, 0.5, 0.8, 0.8, 0.9, 0.99]):
        v = x[j].sort(descending=True).values.double()
        tail = v.softmax(-1).flip(0).cumsum(0).flip(0)         # mass at or below each rank, most probable first
        k = int((tail > 1 - frac).sum())                        # keep ranks 0 … k − 1
        top_p = 1 - float(tail[k - 1] + tail[k]) / 2
        row = x[j:j + 1]
        assert int(warped(row, top_p).sum()) == k > 10_000
        assert torch.equal(sampling_mask(row, top_p=top_p), warped(row, top_p))


@pytest.mark.parametrize("top_p", [0.5, 0.6, 0.999])
def test_ties_straddle_a_wide_boundary(top_p, hist_after):
    "30,000 tokens tied at the top: top_p splits the tie, which ones stay is the warper's sort order, and we match it."
    x = torch.zeros(3, V)
    x[:, :30_000] = 1.0
    x[1] = x[1].flip(0)
    x[2] = x[0, torch.randperm(V, generator=torch.Generator().manual_seed(0))]
    m = sampling_mask(x, top_p=top_p)
    assert torch.equal(m, warped(x, top_p)) and torch.equal(m, warped64(x, top_p))
    assert (m.sum(-1) > 10_000).all()
    idx = _kept_indices(x, top_p, 0)
    assert torch.equal(listed_mask(idx, V), m)


@pytest.mark.parametrize("top_p", [0.9, 0.95])
def test_grid_ties_wide(top_p, hist_after):
    "Logits on a 1/8 grid: a few hundred distinct values, each shared by hundreds of tokens; boundaries split them."
    x = (gauss(16, torch.linspace(0.3, 3.0, 16), seed=3) * 8).round() / 8
    m = sampling_mask(x, top_p=top_p)
    nuc = _nucleus(x, top_p, 0)
    assert nuc.tied.sum() >= 8 and (m.sum(-1) > 10_000).sum() >= 4
    assert torch.equal(m, warped64(x, top_p))
    assert torch.equal(listed_mask(_kept_indices(x, top_p, 0, x.logsumexp(-1)), V), m)


def test_bfloat16_wide(hist_after):
    "bfloat16 logits: generate casts to float32; few distinct values, so most wide boundaries split a tie."
    x = gauss(16, torch.linspace(0.2, 2.0, 16), seed=4).bfloat16()
    for top_p in (0.9, 0.999):
        m = sampling_mask(x, top_p=top_p)
        assert torch.equal(m, warped64(x, top_p)) and (m.sum(-1) > 10_000).all()
        torch.testing.assert_close(rb_entropy(x, top_p=top_p), naive_rb_entropy(x, top_p=top_p), rtol=0, atol=1e-4)


def test_min_tokens_to_keep_wide(hist_after):
    "min_tokens_to_keep larger than the nucleus: the top 12,000 tokens, as TopP keeps its last min_tokens_to_keep."
    x = gauss(8, [8., 6., 4., 2., 1., 0.5, 0.3, 0.1], seed=5)
    for top_p in (0.3, 0.9):
        m = sampling_mask(x, top_p=top_p, min_tokens_to_keep=12_000)
        assert torch.equal(m, warped(x, top_p, min_tokens_to_keep=12_000))
        assert (m.sum(-1) >= 12_000).all() and (m.sum(-1) > 12_000).any()


def test_top_k_then_top_p_wide():
    "top_k = 20,000 first, then top_p over those: nuclei of 10k+ tokens inside the top-k set."
    x = gauss(6, [0.2, 0.5, 1.0, 1.5, 2.0, 3.0], seed=6)
    for top_p in (0.9, 0.999):
        m = sampling_mask(x, top_p=top_p, top_k=20_000)
        assert torch.equal(m, warped(x, top_p, top_k=20_000)) and torch.equal(m, warped64(x, top_p, top_k=20_000))
        assert (m.sum(-1) > 10_000).sum() >= 3


@pytest.mark.parametrize("make", ["flat", "tied", "two-clusters", "outlier"])
def test_linear_levels(make, hist_after, monkeypatch):
    "Rows whose crossing bin holds thousands of tokens are binned again, linearly in x; _LIMIT 2 makes every row do so."
    g = torch.Generator().manual_seed(7)
    x = {"flat": lambda: torch.randn(4, 20_000, generator=g) * 1e-3,
         "tied": lambda: torch.zeros(4, 20_000),
         "two-clusters": lambda: torch.randint(0, 2, (4, 20_000), generator=g) * 1e-4,
         "outlier": lambda: torch.cat([torch.full((4, 1), 30.), torch.randn(4, 19_999, generator=g) * 1e-3], 1)}[make]()
    for limit in (ks._LIMIT, 2):
        monkeypatch.setattr(ks, "_LIMIT", limit)
        for top_p in (0.33, 0.91):                       # not a multiple of 1 / 20,000: no exact tie with 1 − top_p
            nuc = _nucleus(x, top_p, 0)
            assert torch.equal(_nucleus_mask(x, nuc), warped64(x, top_p)), (limit, top_p)
            assert torch.equal(_nucleus_mask(x, nuc), warped(x, top_p)), (limit, top_p)


def test_rb_entropy_and_log_q_wide(hist_after):
    "Entropy, its gradient and log q over nuclei of 10k+ tokens equal the sort-based reference."
    x = gauss(12, torch.linspace(0.2, 3.0, 12), seed=8)
    kw = dict(temperature=0.8, top_p=0.95)
    xg, xn = x.clone().requires_grad_(), x.clone().requires_grad_()
    H, Hn = rb_entropy(xg, **kw, chunk_size=5), naive_rb_entropy(xn, **kw)
    torch.testing.assert_close(H, Hn)
    H.sum().backward(); Hn.sum().backward()
    torch.testing.assert_close(xg.grad, xn.grad)
    keep = warped64(x / 0.8, 0.95)
    assert (keep.sum(-1) > 10_000).sum() >= 6
    logq = truncated_log_softmax(x, 0.8, keep=keep)
    t = torch.multinomial(keep.float(), 1, generator=torch.Generator().manual_seed(9))[:, 0]
    torch.testing.assert_close(sampling_logprobs(x, t, **kw), logq.gather(1, t[:, None])[:, 0])


def test_float64_logits_take_the_histogram(monkeypatch):
    "float64 logits (gradcheck's dtype) stay float64; the histogram keys their float32 probabilities."
    monkeypatch.setattr(ks, "_HIST_AFTER", 0)
    x = gauss(4, [0.5, 1., 2., 4.], seed=10, V=3000).double()
    for top_p in (0.5, 0.95):
        nuc = _nucleus(x, top_p, 0)
        assert nuc.thr.dtype == torch.float64
        assert torch.equal(_nucleus_mask(x, nuc), warped64(x, top_p))


@pytest.mark.parametrize("top_p", [1e-4, 5e-3])
def test_tiny_top_p(top_p, hist_after):
    "top_p below the float32 bins' rounding bound (2·V·2⁻²⁴ ≈ 0.018 at V = 151,936): the max's bin still decides."
    x = gauss(8, [1e-3, 1e-2, 0.1, 0.5, 1., 2., 4., 8.], seed=11, V=151_936)
    for mk in (1, 5):
        m = sampling_mask(x, top_p=top_p, min_tokens_to_keep=mk)
        assert torch.equal(m, warped64(x, top_p, min_tokens_to_keep=mk))


@pytest.mark.parametrize("k", [1, 17, 137])
def test_two_step_topk(k):
    "_topk's values are topk's, ties and −inf included, and its ids point at them; V not a multiple of 16 falls back."
    g = torch.Generator().manual_seed(12)
    for x in (gauss(6, 2.0, seed=12), (gauss(6, 2.0, seed=12) * 2).round(), torch.zeros(6, V),
              gauss(6, 1.0, seed=13).masked_fill(torch.rand(6, V, generator=g) < 0.9, -math.inf), gauss(3, 1., V=3001)):
        v, i = ks._topk(x, k)
        assert torch.equal(v, x.topk(k, dim=-1).values) and torch.equal(x.gather(1, i), v)
        assert (i.sort(-1).values.diff(dim=-1) > 0).all()                   # distinct tokens


def test_wide_rows_as_sums_gradcheck_ties_and_outside_tokens(monkeypatch):
    "Every row wide, so no kept-token list at all (`_wide_sums`, `_KeptStats`): H and log q pass gradcheck, a token"
    " outside its kept set joins it (flagged), and a split tie counts its kept share — against explicit masks."
    monkeypatch.setattr(ks, "_HIST_AFTER", 0)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 200, generator=g, dtype=torch.float64) * torch.tensor([0.3, 1., 2., .5, 1.5]).double()[:, None]
    keep = warped64(x, 0.9)
    rows = torch.arange(5)
    tok = torch.where(rows < 3, (~keep).double().multinomial(1, generator=g)[:, 0], keep.double().argmax(-1))
    assert torch.autograd.gradcheck(lambda z: rb_entropy(z, top_p=0.9), (x.clone().requires_grad_(),))
    logq = lambda z: sampling_logprobs(z, tok, top_p=0.9, include_tokens=True)
    assert torch.autograd.gradcheck(lambda z: logq(z)[0], (x.clone().requires_grad_(),))
    joined = keep.clone(); joined[rows, tok] = True
    lq, outside = logq(x)
    assert outside.tolist() == [True, True, True, False, False]
    torch.testing.assert_close(lq, truncated_log_softmax(x, keep=joined)[rows, tok])
    grid = (x * 4).round() / 4                                              # ties straddle the boundary
    keep = warped64(grid, 0.9)
    assert ((grid == grid.masked_fill(~keep, math.inf).amin(-1, keepdim=True)) & ~keep).any()   # a split tie
    q = truncated_log_softmax(grid, keep=keep).exp()
    torch.testing.assert_close(rb_entropy(grid, top_p=0.9), -(q * q.log().nan_to_num(0, 0, 0)).sum(-1))


def test_wide_and_listed_rows_come_back_in_order():
    "Rows decided by windows (listed) and wide rows (sums) interleaved, and wide rows handed over in any order (the"
    " search may find them at different windows): entropies and log q return row by row."
    from entropy_grpo.rb_entropy import _truncated_stats
    x = gauss(64, [8., 1.5, 8., 0.3] * 16, seed=11)
    wide = _kept_indices(x, 0.95, 0, x.logsumexp(-1), split=True)[1]
    assert 0 < len(wide) < 64
    t = torch.randint(0, V, (64,), generator=torch.Generator().manual_seed(12))
    torch.testing.assert_close(rb_entropy(x, top_p=0.95), naive_rb_entropy(x, top_p=0.95))
    keep = warped64(x, 0.95)
    got, outside = sampling_logprobs(x, t, top_p=0.95, include_tokens=True)
    keep[torch.arange(64), t] = True
    torch.testing.assert_close(got, truncated_log_softmax(x, keep=keep)[torch.arange(64), t])
    x = gauss(8, 1.5, seed=13)                                              # every row wide, handed over shuffled
    m = x.amax(-1); e = (x - m[:, None]).exp(); lse = m + e.sum(-1).log()
    idx = torch.full((8, 1), -1)
    shuffled = torch.randperm(8, generator=torch.Generator().manual_seed(1))
    H = _truncated_stats(x, lse, idx, shuffled, None, 0.95, e, m)[1]
    torch.testing.assert_close(H, naive_rb_entropy(x, top_p=0.95))
