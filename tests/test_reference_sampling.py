"""The sampler's references (``kernels/reference.py``) against the conventions they define, written out by hand:
the inverse CDF with its clamp to the last token where the running sum grows, the top-k threshold against
``torch.topk``, the log-probs of the processed distribution, and rows without a distribution."""

from __future__ import annotations

import pytest
import torch

from sigmafast.kernels import reference as ref


def _inverse_cdf_by_hand(probs: torch.Tensor, u: float) -> int:
    """The first index whose running sum exceeds u * total, clamped to the last index where the running sum
    grows (the last nonzero probability when every sum is exact), by a Python loop in float64."""
    p = probs.double().tolist()
    total = sum(p)
    running, last = 0.0, 0
    for i, x in enumerate(p):
        last = i if running + x > running else last
        running += x
    running = 0.0
    for i, x in enumerate(p):
        running += x
        if running > u * total:
            return min(i, last)
    return last


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_inverse_cdf_is_the_first_crossing_clamped_to_the_last_nonzero(dtype):
    """Dyadic probabilities, so that every sum is exact and the draws on a boundary (0.25, 0.5) are too."""
    probs = torch.tensor([0.0, 0.25, 0.0, 0.25, 0.5, 0.0, 0.0], dtype=dtype)  # trailing zeros: the clamp's case
    u = torch.tensor([0.0, 0.1, 0.25 - 2**-20, 0.25, 0.49, 0.5, 0.99, 1.0, 0.6], dtype=torch.float64)
    rows = torch.stack([probs, probs * 3])  # unnormalised rows too
    for row in rows:
        got = ref.inverse_cdf(row.expand(len(u), -1), u)
        want = [_inverse_cdf_by_hand(row, float(x)) for x in u.to(dtype).double()]
        assert got.tolist() == want
    assert want == [1, 1, 1, 3, 3, 4, 4, 4, 4]  # u = 1 crosses nothing: the clamp


@pytest.mark.parametrize("V, last, dtype", [(3000, 2049, torch.float16), ((1 << 24) + 3, (1 << 24) + 1, torch.float32)],
                         ids=["float16-V3000", "float32-V2^24+3"])
def test_the_last_nonzero_index_is_exact_past_the_dtype_s_integers(V, last, dtype):
    """2049 has no float16 and 2^24 + 1 no float32: the clamp still lands on that index."""
    probs = torch.zeros(2, V, dtype=dtype)
    probs[:, 7] = 0.5
    probs[:, last] = 0.5
    got = ref.inverse_cdf(probs, torch.tensor([1.0, 0.9], dtype=torch.float64))
    assert got.tolist() == [last, last]


def test_the_clamp_never_lands_on_a_probability_the_sum_absorbs():
    """float32: 2^-30 after a mass of 1 leaves the running sum at 1, so no draw reaches that token; u = 1, whose
    target is the total, takes the last token where the sum grew. Rows of zeros give token 0."""
    probs = torch.tensor([[0.5, 0.5, 2.0**-30, 0.0], [0.0, 1.0, 2.0**-30, 2.0**-30], [0.0] * 4])
    got = ref.inverse_cdf(probs, torch.tensor([1.0, 1.0, 0.5], dtype=torch.float64))
    assert got.tolist() == [1, 1, 0]


def _rows_for_top_k(V: int, kind: str, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(6, V, generator=g) * 3
    if kind == "ties":  # few distinct values: ties across chunks and at the threshold
        x = x.round()
    elif kind == "sorted":  # the largest values crowded in the last chunks
        x = x.sort(-1).values
    elif kind == "nonfinite":
        x[0, ::7] = float("nan")  # more NaN than k on some rows
        x[1, 3] = float("nan")
        x[2, -1] = float("inf")
        x[3] = float("-inf")
        x[4, : V // 2] = float("-inf")
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["random", "ties", "sorted", "nonfinite"])
@pytest.mark.parametrize("V, top_k", [(64 * 8, 1), (64 * 40 + 37, 5), (64 * 400, 50), (50257, 6), (50257, 98),
                                      (50257, 99), (65, 5), (1000, 200)],
                         ids=lambda v: str(v))
def test_kth_largest_is_topk_s_kth_value(V, top_k, kind, dtype):
    """Exactly torch.topk's k-th value, with the prefilter (8 k chunks of 64 or more) and without, on ragged
    widths, ties, sorted rows, NaN (the largest value for topk), +-inf; 3-d input too."""
    g = torch.Generator().manual_seed(V + top_k)
    x = _rows_for_top_k(V, kind, g).to(dtype)
    want = x.topk(top_k, dim=-1).values[..., -1]
    torch.testing.assert_close(ref.kth_largest(x, top_k), want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(ref.kth_largest(x.view(2, 3, V), top_k), want.view(2, 3), rtol=0, atol=0,
                               equal_nan=True)


def test_kth_largest_of_a_strided_view_and_of_no_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50257, 3, generator=g).t()  # columns of stride 3
    torch.testing.assert_close(ref.kth_largest(x, 7), x.topk(7, -1).values[:, -1], rtol=0, atol=0)
    assert ref.kth_largest(x[:0], 7).shape == (0,)


def test_rows_without_a_distribution_stay_in_the_vocabulary_and_do_not_touch_the_others():
    """A NaN row, a row with +inf and a row without any finite logit: tokens in [0, V), log-probs NaN, and the
    finite rows sample as they do alone."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g)
    logits[1, 4] = float("nan")
    logits[2, 6] = float("inf")
    logits[3] = float("-inf")
    u = torch.rand(5, generator=g, dtype=torch.float64)
    for top_k in (None, 3):
        tokens, logp = ref.sample(logits, u, 1.0, top_k)
        assert bool(((tokens >= 0) & (tokens < 11)).all())
        assert bool(logp[1:4].isnan().all()) and not bool(logp[[0, 4]].isnan().any())
        alone = ref.sample(logits[[0, 4]], u[[0, 4]], 1.0, top_k)
        assert torch.equal(tokens[[0, 4]], alone[0]) and torch.equal(logp[[0, 4]], alone[1])
        residual = ref.residual_sample(logits, logits.flip(0), u, 1.0, top_k)
        assert bool(((residual >= 0) & (residual < 11)).all())


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.25, None), (0.8, 3), (1.5, 1)])
def test_sample_log_probs_are_the_log_softmax_of_the_processed_logits(temperature, top_k):
    """float64: the sampled token's log-prob against log_softmax written out, and no token outside the top k
    (the wide logits underflow most probabilities at temperature 0.25)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(400, 50, generator=g, dtype=torch.float64) * 30
    u = torch.rand(400, generator=g, dtype=torch.float64)
    tokens, logp = ref.sample(logits, u, temperature, top_k)
    z = logits / temperature
    if top_k is not None:
        z = z.masked_fill(z < z.topk(top_k, -1).values[:, -1:], float("-inf"))
    want = z - z.amax(-1, keepdim=True) - (z - z.amax(-1, keepdim=True)).exp().sum(-1, keepdim=True).log()
    torch.testing.assert_close(logp, want.gather(-1, tokens[:, None]).squeeze(-1), rtol=1e-12, atol=1e-12)
    assert bool(torch.isfinite(logp).all())
