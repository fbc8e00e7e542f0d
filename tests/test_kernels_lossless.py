"""Triton lossless pick (kernels/lossless.py) against kernels/reference.py (the splice of the residual token is the
commit's: tests/test_kernels_commit.py).

Outputs come pre-filled with garbage (``poisoned_empty``). Everything is integer or copied, so every output
is compared exactly.
"""

from __future__ import annotations

import pytest
import torch

from helpers import inner_strided, on_triton_device, triton_device
from sigmafast.kernels import lossless
from sigmafast.kernels import reference as ref

residual_pick = on_triton_device(lossless.residual_pick)

# (B, R, T): one row and step, rows over many programs (4 rows each), long orders, R = T
CASES = [(1, 1, 1), (3, 5, 9), (70, 16, 40), (2, 300, 300), (5, 7, 7)]


def _ids(case) -> str:
    return "B{}-R{}-T{}".format(*case)


def _inputs(case, seed: int, u_dtype=torch.float64, V=37, X=20):
    """Counts n in [0, R] (every step accepted included), remaining counts around them, and the sampler's
    layouts: the order a strided view of a (B, 1, T) sort, the slots of a (B, 1, R) tensor, the draft
    logits a view of a padded (B, R, V + 11) head output, the verifier's rows the order 0 of (B, 2, R, X)."""
    B, R, T = case
    g = torch.Generator().manual_seed(seed)
    orders = torch.rand(B, 1, T, generator=g).argsort(-1)[..., :R][:, 0]  # (B, R), row stride T
    slots = torch.randint(0, R, (B, 1, R), generator=g)[:, 0]
    n = torch.randint(0, R + 1, (B,), generator=g)
    remaining = (n + torch.randint(0, 3, (B,), generator=g)).clamp(max=T)
    u = torch.rand(B, T, generator=g, dtype=torch.float64).to(u_dtype)
    drafts = torch.randn(B, R, V + 11, generator=g)[..., :V]
    verifier = torch.randn(B, 2, R, X, generator=g)[:, 0]
    return n, remaining, orders, slots, u, drafts, verifier


PICKED = ("u", "n_commit", "draft_row", "verifier_row")


@pytest.mark.parametrize("u_dtype", [torch.float32, torch.float64], ids=["u32", "u64"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_residual_pick_matches_reference(case, u_dtype, poisoned_empty):
    for seed in range(3):
        args = _inputs(case, seed, u_dtype, V=[37, 600, 1][seed], X=[20, 5, 1100][seed])  # one or more column tiles
        got, want = residual_pick(*args), ref.residual_pick(*args)
        for name, g, w in zip(PICKED, got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w), name


def test_residual_pick_keeps_the_padded_row_stride(poisoned_empty):
    """The draft row keeps the head's padded row stride (which the verifier's head rows have), so that the
    residual sampler reads q and p rows of one stride without copying either."""
    device = triton_device()
    n, remaining, orders, slots, u, _, verifier = (t.to(device) for t in _inputs((3, 5, 9), 0))
    drafts = torch.randn(3, 5, 64, device=device)[..., :50]  # (B, R, V) of a head padded to 64
    *_, d_row, v_row = lossless.residual_pick(n, remaining, orders, slots, u, drafts, verifier)
    assert d_row.shape == (3, 50) and d_row.stride() == (64, 1) and v_row.is_contiguous()
    torch.testing.assert_close(d_row, ref.rows_at(drafts, slots.gather(1, n.clamp(max=4)[:, None])[:, 0]),
                               rtol=0, atol=0)


def test_residual_pick_by_hand():
    """Row 0 rejected at step 1; row 1 accepted all 3 of its 3 remaining steps (R = 3: the draw happens at
    the clamped step 2 and is never committed); row 2 accepted both of its 2 remaining steps in R = 3."""
    orders = torch.tensor([[4, 0, 2], [1, 3, 0], [2, 4, 1]])
    slots = torch.tensor([[0, 1, 2], [2, 0, 1], [1, 0, 2]])
    n, remaining = torch.tensor([1, 3, 2]), torch.tensor([3, 3, 2])
    u = torch.arange(15, dtype=torch.float32).view(3, 5) / 15
    u_k, n_commit, d_row, v_row = residual_pick(n, remaining, orders, slots, u,
                                                torch.arange(3 * 3 * 2.0).view(3, 3, 2),
                                                torch.arange(3 * 3 * 4.0).view(3, 3, 4))
    assert d_row.tolist() == [[2, 3], [8, 9], [16, 17]]  # the steps' slots: 1 of row 0, 1 of row 1, 2 of row 2
    assert v_row.tolist() == [[4, 5, 6, 7], [20, 21, 22, 23], [32, 33, 34, 35]]  # steps 1, 2, 2
    assert u_k.tolist() == [u[0, 0].item(), u[1, 0].item(), u[2, 1].item()]
    assert n_commit.tolist() == [2, 3, 2]  # row 0: its accepted step and the residual token at step 1


def _pick(R=3, B_n=2, u=None, drafts=None, verifier=None):
    """residual_pick of 2 rows with one argument replaced."""
    return lossless.residual_pick(torch.zeros(B_n, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                                  torch.zeros(2, R, dtype=torch.long), torch.zeros(2, R, dtype=torch.long),
                                  torch.zeros(2, 4) if u is None else u,
                                  torch.zeros(2, 3, 5) if drafts is None else drafts,
                                  torch.zeros(2, R, 5) if verifier is None else verifier)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: _pick(R=0), "R >= 1"),
        (lambda: _pick(B_n=3), "n must be"),
        (lambda: _pick(u=torch.zeros(2, 4, dtype=torch.float16)), "u_residual must be"),
        (lambda: _pick(drafts=torch.zeros(3, 3, 5)), "drafts must be a \\(2, R, W\\)"),
        (lambda: _pick(verifier=torch.zeros(2, 4, 5)), "verifier must be a \\(2, 3, W\\)"),
        (lambda: _pick(verifier=torch.zeros(2, 3, 0)), "verifier must be .* W >= 1"),
    ],
    ids=["R0", "n-shape", "u-fp16", "drafts-rows", "verifier-steps", "verifier-empty"],
)
def test_lossless_ops_reject_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_lossless_step_draws_the_residual_from_rows_of_one_stride(monkeypatch):
    """With a padded LM head (as on CUDA), the residual's q rows (the head's) and p rows (picked from the draft
    logits) share the head's row stride, so the residual sampler copies neither; tokens match the reference's."""
    from helpers import tiny_model

    from sigmafast import kernels, steps
    from sigmafast.engine import NeuralSession
    from sigmafast.request import draw_burst

    device, T = triton_device(), 6
    model = tiny_model(5, T, seed=3, std=0.5, dtype=torch.float32).to(device)
    seen, real = [], kernels.residual_sample
    monkeypatch.setattr(kernels, "residual_sample", lambda q, p, *a, **k: seen.append((q.stride(), p.stride()))
                        or real(q, p, *a, **k))
    canvases = []
    for backend in ("triton", "reference"):
        session = NeuralSession(model, 2, T, backend, head_align=16)
        with torch.no_grad():
            session.prefill(torch.zeros(2, T, dtype=torch.long, device=device),
                            torch.zeros(2, T, dtype=torch.bool, device=device))
            steps.burst_step(session, draw_burst(torch.Generator().manual_seed(0), 2, 1, T, device), T, 1.0, None,
                             "lossless")
        canvases.append(session.canvas.cpu())
    assert seen[0] == ((16, 1), (16, 1))  # the Triton path: both rows views of 16-wide head rows
    assert torch.equal(canvases[0], canvases[1])


def test_residual_pick_reads_rows_strided_along_the_vocabulary(poisoned_empty):
    n, remaining, orders, slots, u, drafts, verifier = _inputs((3, 5, 9), 0)
    want = ref.residual_pick(n, remaining, orders, slots, u, drafts, verifier)
    dev = [t.to(triton_device()) for t in (n, remaining, orders, slots, u)]
    got = lossless.residual_pick(*dev, inner_strided(drafts), inner_strided(verifier))
    for name, g, w in zip(PICKED, got, want, strict=True):
        assert torch.equal(g.cpu(), w), name
