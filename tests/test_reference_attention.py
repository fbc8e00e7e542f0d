"""The attention references (the CPU path, and the Triton kernels' ground truth) against attention written
one query at a time: each query's visible keys gathered by hand, then softmax(q k^T / sqrt(D)) v."""

from __future__ import annotations

import math

import pytest
import torch

from sigmafast.kernels import reference as ref


def _one_query(q, keys, values, scale):
    """(D,) query over (N, D) keys and values -> (D,)."""
    return torch.softmax(keys @ q * scale, dim=0) @ values


def _inputs(B, O, H, R, L, D, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, O, H, R, D, generator=g, dtype=torch.float64) for _ in range(3))
    kc, vc = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(2))
    lens = torch.randint(0, L + 1, (B,), generator=g)
    if B > 1:
        lens[0] = L  # a full cache beside the random lengths
    return q, k, v, kc, vc, lens


# (B, O, H, R, L, D): one query, one order, an empty cache, ragged lengths, odd sizes; R > D and R <= D
SHAPES = [(1, 1, 1, 1, 0, 4), (1, 1, 2, 1, 9, 8), (3, 1, 2, 5, 7, 3), (2, 4, 3, 6, 11, 5), (2, 3, 1, 1, 5, 16),
          (2, 3, 2, 4, 6, 8)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-O{}-H{}-R{}-L{}-D{}".format(*s))
@pytest.mark.parametrize("scale", [None, 0.3])
def test_references_match_attention_one_query_at_a_time(shape, scale):
    B, O, H, R, L, D = shape
    q, k, v, kc, vc, lens = _inputs(B, O, H, R, L, D, seed=sum(shape))
    s = 1 / math.sqrt(D) if scale is None else scale
    burst = torch.full((B, O, H, R, D), float("nan"), dtype=torch.float64)
    verify = burst.clone()
    for b in range(B):
        n = int(lens[b])
        for o in range(O):
            for h in range(H):
                for r in range(R):
                    qr, cache_k, cache_v = q[b, o, h, r], kc[b, h, :n], vc[b, h, :n]
                    own = torch.cat([cache_k, k[b, o, h, r:r + 1]]), torch.cat([cache_v, v[b, o, h, r:r + 1]])
                    burst[b, o, h, r] = _one_query(qr, *own, s)
                    seen = torch.cat([cache_k, k[b, o, h, :r + 1]]), torch.cat([cache_v, v[b, o, h, :r + 1]])
                    verify[b, o, h, r] = _one_query(qr, *seen, s)
    torch.testing.assert_close(ref.verify_attention(q, k, v, kc, vc, lens, scale), verify, rtol=1e-12, atol=1e-12)
    for o in range(O):
        got = ref.burst_attention(q[:, o], k[:, o], v[:, o], kc, vc, lens, scale)
        torch.testing.assert_close(got, burst[:, o], rtol=1e-12, atol=1e-12)


def test_references_keep_the_cache_and_the_inputs():
    """The references scale and mask copies: the caller's tensors (the session's cache) stay as they were."""
    q, k, v, kc, vc, lens = _inputs(2, 3, 2, 4, 6, 8, seed=0)
    before = [t.clone() for t in (q, k, v, kc, vc, lens)]
    ref.verify_attention(q, k, v, kc, vc, lens)
    ref.burst_attention(q[:, 0], k[:, 0], v[:, 0], kc, vc, lens)
    for t, want in zip((q, k, v, kc, vc, lens), before):
        assert torch.equal(t, want)
