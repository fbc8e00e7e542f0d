"""The vocabulary kernels on rows laid out unusually: row offsets past int32, and row windows that end on the
padding of a wider row stride."""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers import assert_same_tokens as _assert_same_tokens
from helpers import triton_device
from sigmafast.kernels import accept, sampling
from sigmafast.kernels import reference as ref


def _rows_past_int32_offsets(N, V, g, dtype=torch.float16):
    """(N, V) rows at a row stride of 2^30 elements, so that rows 2 and 3 start 2^31 and more elements past the
    first: an int32 row offset wraps there, to 2^31 elements before the first row, where the buffer holds
    other values (zeros), so that the wrap reads wrong logits instead of faulting. 8 GiB of address space, of
    which only the rows' pages are touched."""
    S = 1 << 30
    buf = torch.empty(2 * S + (N - 1) * S + V, dtype=dtype, device=triton_device())
    buf[:V].zero_()
    buf[S:S + V].zero_()
    x = buf.as_strided((N, V), (S, 1), 2 * S)
    x.copy_((torch.randn(N, V, generator=g) * 3).to(dtype))
    return x


def test_row_offsets_past_int32():
    """Every vocabulary kernel computes its row offsets in int64: rows 2^31 elements and more past the first
    (a batch of long rows, or rows of a large padded buffer) are read as themselves."""
    from sigmafast.kernels import lm_head, radix, residual_rows, topk

    g = torch.Generator().manual_seed(31)
    N, V = 4, 16
    x, p = _rows_past_int32_offsets(N, V, g), _rows_past_int32_offsets(N, V, g)
    xf, pf = x.float().cpu(), p.float().cpu()
    d = torch.tensor([3, 0, 15, 7])
    u = torch.rand(N, generator=g)
    got = accept.draft_logq(x, d.to(x.device), 0.7).cpu()
    torch.testing.assert_close(got, ref.log_probs(xf, 0.7, None).gather(-1, d[:, None]).squeeze(-1), rtol=0,
                               atol=1e-5)
    assert torch.equal(accept.draft_logq(x, d.to(x.device), 0.0).cpu(), xf.argmax(-1))
    tokens, logp = sampling.sample(x, u.to(x.device), 0.7, 3)
    want, want_logp = ref.sample(xf, u, 0.7, 3)
    _assert_same_tokens(tokens.cpu(), want, ref.log_probs(xf, 0.7, 3).exp(), u)
    torch.testing.assert_close(logp.cpu(), want_logp, rtol=0, atol=1e-5)
    qp, pp = ref.log_probs(xf, 0.7, None).exp(), ref.log_probs(pf, 0.7, None).exp()
    r = (qp - pp).clamp_min(0)
    for rows in (False, True):
        with residual_rows.by_rows() if rows else contextlib.nullcontext():
            tokens = sampling.residual_sample(x, p, u.to(x.device), 0.7)
        _assert_same_tokens(tokens.cpu(), ref.residual_sample(xf, pf, u, 0.7), r, u)
    for k in (1, 3):
        want = ref.kth_largest(xf, k)
        assert torch.equal(radix.radix_kth_largest(x, k).cpu(), want)
        assert torch.equal(topk.kth_largest(x, k, chunk=4, chunks_per_k=1).cpu(), want)  # the prefilter
    got = accept.topk_logq(x, d.to(x.device), 0.7, 3, chunk=4, chunks_per_k=1).cpu()
    torch.testing.assert_close(got, ref.log_probs(xf, 0.7, 3).gather(-1, d[:, None]).squeeze(-1), rtol=0,
                               atol=1e-5)
    weight = (torch.randn(V + 8, V, generator=g) / 4).to(x.dtype)
    got = lm_head.lm_head_logq(x, weight.to(x.device), d.to(x.device), 0.7).cpu()
    want = ref.log_probs(xf @ weight.float().T, 0.7, None).gather(-1, d[:, None]).squeeze(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_the_columns_past_v_in_a_row_s_window_are_not_the_row_s(dtype, poisoned_empty):
    """Rows of V = 61 columns at a row stride of 64: each row's aligned window ends past its last column, on
    padding that holds a huge value. The argmax, the k-th largest (radix select, prefilter and its overflow
    scan) and the top-k log q never count it."""
    from sigmafast.kernels import radix, topk

    g = torch.Generator().manual_seed(61)
    N, V = 5, 61
    wide = torch.randn(N, 64, generator=g) * 3
    wide[:, V:] = 1000.0
    x = wide.to(dtype).to(triton_device())[:, :V]
    xf = x.float().cpu()
    d = torch.tensor([0, 60, 7, 30, 59])
    assert torch.equal(accept.draft_logq(x, d.to(x.device), 0.0, None, 16).cpu(), xf.argmax(-1))
    for k in (1, 4):
        want = ref.kth_largest(xf, k)
        assert torch.equal(radix.radix_kth_largest(x, k, 16).cpu(), want)
        for cap in (topk.CAP, 2):  # the candidates, or the overflow scan
            assert torch.equal(topk.kth_largest(x, k, 16, 4, cap, 1).cpu(), want)
            got = accept.topk_logq(x, d.to(x.device), 0.8, k, 16, 4, cap, 1).cpu()
            want_logq = ref.log_probs(xf, 0.8, k).gather(-1, d[:, None]).squeeze(-1)
            assert torch.equal(got.isfinite(), want_logq.isfinite())
            torch.testing.assert_close(got[got.isfinite()], want_logq[got.isfinite()], rtol=0, atol=1e-5)
