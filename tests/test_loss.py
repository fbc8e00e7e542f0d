"""``linear_cross_entropy`` on its own: the CPU's default chunk, ignored rows, bad input. (The model's loss
through it, in every chunking, is in ``test_model.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sigmafast import loss as loss_mod
from sigmafast.kernels import row_blocks
from sigmafast.loss import linear_cross_entropy


@pytest.mark.parametrize("grad", [True, False], ids=["train", "eval"])
def test_chunked_loss_takes_the_cpu_chunk_by_default(grad, monkeypatch):
    """Without ``chunk_elements``, CPU tensors go in chunks of the sampler's CPU row blocks (here 3 rows of 5
    logits), with the loss and gradients of ``F.cross_entropy``; other devices keep LOSS_CHUNK_ELEMENTS."""
    monkeypatch.setattr(row_blocks, "CPU_BLOCK_ELEMENTS", 15)
    chunks = []
    chunk_loss = loss_mod._chunk_loss
    monkeypatch.setattr(loss_mod, "_chunk_loss", lambda h, *a: chunks.append(len(h)) or chunk_loss(h, *a))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 8, generator=g, dtype=torch.float64, requires_grad=grad)
    w = torch.randn(5, 8, generator=g, dtype=torch.float64, requires_grad=grad)
    y = torch.tensor([0, 4, -1, 2, 3, 1, 1])
    with torch.set_grad_enabled(grad):
        got = linear_cross_entropy(h, w, y)
    assert chunks == [3, 3, 1]
    want = F.cross_entropy(h @ w.T, y, ignore_index=-1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if grad:
        got_grads = torch.autograd.grad(got, (h, w))
        for a, b in zip(got_grads, torch.autograd.grad(want, (h, w))):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert loss_mod.default_chunk_elements(torch.device("cuda")) == loss_mod.LOSS_CHUNK_ELEMENTS


def test_chunked_loss_all_ignored_is_zero_with_zero_gradient():
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.full((4,), -1), chunk_elements=10)
    loss.backward()
    assert loss.item() == 0.0 and not h.grad.any() and not w.grad.any()


@pytest.mark.parametrize(
    "args,error,match",
    [
        ((torch.randn(4, 8), torch.randn(5, 7), torch.zeros(4, dtype=torch.long)), ValueError, "weight must be"),
        ((torch.randn(4, 8), torch.randn(5, 8), torch.zeros(3, dtype=torch.long)), ValueError, "targets must have"),
        ((torch.randn(4, 8), torch.randn(5, 8), torch.zeros(4)), TypeError, "targets must be int64"),
        ((torch.randn(4, 8), torch.randn(5, 8), [0, 1, 2, 3]), TypeError, "targets must be an int64 torch.Tensor"),
        ((torch.randn(4, 8), torch.randn(5, 8), torch.zeros(4, dtype=torch.long), 1e3), TypeError,
         "chunk_elements must be None or an int, got float"),
    ],
    ids=["width", "targets-shape", "targets-dtype", "targets-list", "chunk-float"],
)
def test_chunked_loss_rejects_bad_inputs(args, error, match):
    with pytest.raises(error, match=match):
        linear_cross_entropy(*args[:3], **({"chunk_elements": args[3]} if len(args) > 3 else {}))


@pytest.mark.parametrize("grad", [True, False], ids=["train", "eval"])
def test_chunked_loss_cuts_row_args_and_row_weight_with_their_rows(grad):
    """``adjust``'s per-row args and ``row_weight`` go with their own rows in every chunk: 7 rows in chunks of
    3, 3 and 1 give the loss (and gradients) of the weighted cross-entropy of the adjusted full logits."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(7, 8, generator=g, dtype=torch.float64, requires_grad=grad)
    w = torch.randn(5, 8, generator=g, dtype=torch.float64, requires_grad=grad)
    y = torch.tensor([0, 4, -1, 2, 3, 1, 1])
    shift = torch.randn(7, generator=g, dtype=torch.float64) * 3
    column = torch.tensor([0, 1, 2, 3, 4, 0, 2])
    weight = torch.rand(7, generator=g, dtype=torch.float64) + 0.5

    def adjust(logits, s, c):
        return logits + s[:, None] * F.one_hot(c, logits.shape[-1]).to(logits.dtype)

    with torch.set_grad_enabled(grad):
        got = linear_cross_entropy(h, w, y, chunk_elements=15, adjust=adjust, row_args=(shift, column),
                                   row_weight=weight)
        ce = F.cross_entropy(adjust(h @ w.T, shift, column), y, ignore_index=-1, reduction="none")
        want = (ce * weight).sum() / (y != -1).sum()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if grad:
        for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
