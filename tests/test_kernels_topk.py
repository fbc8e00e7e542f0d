"""The top-k threshold by radix select (kernels/topk.py) against ``reference.kth_largest`` (torch.topk):
exact equality in every dtype, over ragged chunks, one-element rows, ties, infinities and signed zeros."""

from __future__ import annotations

import zlib

import pytest
import torch

from helpers import on_triton_device
from sigmafast.kernels import reference as ref
from sigmafast.kernels import topk

kth_largest = on_triton_device(topk.kth_largest)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _rows(kind, N, V, g):
    x = torch.randn(N, V, generator=g) * 4
    if kind == "negative":  # every key has its sign bit flipped: the low bits are ones
        x = -x.abs() - 1
    elif kind == "ties":
        x = (x * 0.5).round()
    elif kind == "neg-inf":  # the k-th largest may be -inf
        x[:, : (2 * V) // 3] = float("-inf")
    elif kind == "zeros":  # +0.0 and -0.0 compare equal, and have different keys
        x = torch.where(torch.rand(N, V, generator=g) < 0.5, torch.zeros(()), -torch.zeros(()))
        x[:, ::7] = 1.0
    elif kind == "huge":  # the float extremes and +inf
        x[:, ::5] = float("inf")
        x[:, 1::5] = torch.finfo(torch.float16).max
        x[:, 2::5] = -torch.finfo(torch.float16).max
    return x


CASES = [
    # (kind, N, V, top_k, block_v)
    ("randn", 1, 2, 1, None),  # one row, two columns
    ("randn", 7, 5, 4, None),  # k = V - 1
    ("randn", 3, 300, 1, 64),  # the max, ragged last chunk
    ("randn", 33, 300, 50, 64),
    ("randn", 4, 5000, 50, None),  # default chunk
    ("randn", 3, 9000, 7, None),  # default chunk: an interior chunk between two edge ones
    ("negative", 5, 257, 13, 32),
    ("ties", 17, 200, 10, 32),
    ("ties", 6, 200, 199, 16),
    ("neg-inf", 9, 300, 150, 64),
    ("zeros", 8, 100, 20, 16),
    ("huge", 5, 333, 70, 8),
]


def _cid(c):
    kind, N, V, k, bv = c
    return f"{kind}-N{N}-V{V}-k{k}" + (f"-chunk{bv}" if bv else "")


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=_cid)
def test_kth_largest_matches_topk(case, dtype, poisoned_empty):
    kind, N, V, k, block_v = case
    g = torch.Generator().manual_seed(zlib.crc32(_cid(case).encode()))
    x = _rows(kind, N, V, g).to(dtype)
    got = kth_largest(x, k, block_v)
    assert got.dtype == torch.float32 and got.shape == (N,)
    torch.testing.assert_close(got, ref.kth_largest(x, k).float(), rtol=0, atol=0)


def test_kth_largest_strided_rows(poisoned_empty):
    g = torch.Generator().manual_seed(3)
    full = torch.randn(6, 301, generator=g).to(torch.bfloat16)
    x = full[1:, 3:290]  # an offset view with an odd row stride
    torch.testing.assert_close(kth_largest(x, 9, 32), ref.kth_largest(x, 9).float(), rtol=0, atol=0)


def test_kth_largest_empty_batch_and_k_equal_to_v(poisoned_empty):
    x = torch.randn(3, 10)
    assert kth_largest(x[:0], 4).shape == (0,)
    torch.testing.assert_close(kth_largest(x, 10), x.min(-1).values, rtol=0, atol=0)


def test_launchers_threshold_is_the_kth_largest(poisoned_empty):
    """``topk.threshold`` (radix select on CUDA, torch.topk in the interpreter) gives the same float32
    values, and None when top-k keeps every column."""
    threshold = on_triton_device(topk.threshold)
    x = _rows("ties", 20, 300, torch.Generator().manual_seed(4)).to(torch.bfloat16)
    torch.testing.assert_close(threshold(x, 30, 64), ref.kth_largest(x, 30).float(), rtol=0, atol=0)
    assert threshold(x, None) is None and threshold(x, 300) is None
