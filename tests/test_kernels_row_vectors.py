"""Per-row (B,) vectors (cache lengths, acceptance lengths, last tokens and positions, counts) given as
strided views: every Triton op reads them as the views say, as the reference does.

The kernels read such a vector at ``base + b``; a strided view (an every-other-element slice of a packed
buffer) once made the commit read wrong counts silently. Each case runs an op on contiguous vectors and on
strided copies of them, and compares the results exactly; each op's comparison with the reference on contiguous
inputs is in its own test file.
"""

from __future__ import annotations

import pytest
import torch

from helpers import triton_device
from sigmafast.kernels import attention, decide, embed, lossless

DEVICE = triton_device()


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as every other element of a (B, 2) buffer, whose other column holds garbage."""
    view = torch.stack([t, torch.full_like(t, 7 if t.dtype != torch.bool else True)], dim=1)[:, 0]
    assert view.stride() == (2,)
    return view


def _dev(*ts):
    return tuple(t.to(DEVICE) for t in ts)


def _cases():
    g = torch.Generator().manual_seed(0)
    B, H, R, D, L = 3, 2, 4, 16, 40
    q, k, v = _dev(*torch.randn(3, B, H, R, D, generator=g))
    kc, vc = _dev(*torch.randn(2, B, H, L, D, generator=g))
    lens = torch.tensor([5, 40, 0], device=DEVICE)
    yield "burst_attention", lambda ln: attention.burst_attention(q, k, v, kc, vc, ln), (lens,)

    O = 3
    logq = -torch.rand(B, O, R, generator=g).to(DEVICE)
    drafts = torch.randint(0, 9, (B, O, R), generator=g).to(DEVICE)
    logp = (logq - 0.2).contiguous()
    u = torch.rand(B, O, R, generator=g).to(DEVICE)
    lengths = torch.tensor([4, 1, 3], device=DEVICE)
    yield "decide", lambda ln: tuple(decide.decide(logq, drafts, logp, u, ln, 1.0, "paper"))[1:], (lengths,)

    tokens, orders = _dev(torch.randint(5, (B, 2, R), generator=g), torch.randint(0, 9, (B, 2, R), generator=g))
    tables = _dev(torch.randn(5, 16, generator=g), torch.randn(9, 8, generator=g), torch.randn(9, 8, generator=g),
                  torch.rand(16, generator=g))
    last_tok, last_pos = _dev(torch.tensor([1, 4, 2]), torch.tensor([8, 0, 3]))
    yield ("feed_embedding", lambda lt, lp: embed.feed_embedding(lt, lp, tokens, orders, *tables, None, 1e-5),
           (last_tok, last_pos))

    T = 9
    ords = torch.rand(B, T, generator=g).argsort(-1)[:, :R].to(DEVICE)
    slots = torch.randint(0, R, (B, R), generator=g).to(DEVICE)
    uu = torch.rand(B, T, generator=g, dtype=torch.float64).to(DEVICE)
    n, rem = torch.tensor([0, 4, 2], device=DEVICE), torch.tensor([3, 4, 5], device=DEVICE)
    rows = torch.randn(B, R, 7, generator=g).to(DEVICE)
    yield "residual_pick", lambda a, b: lossless.residual_pick(a, b, ords, slots, uu, rows, rows), (n, rem)


CASES = list(_cases())


@pytest.mark.parametrize("op, vectors", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_strided_row_vectors_read_as_their_views(op, vectors):
    want = op(*vectors)
    got = op(*(_strided(t) for t in vectors))
    want, got = (w if isinstance(w, tuple) else (w,) for w in (want, got))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
