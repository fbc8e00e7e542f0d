"""The residual's masses by whole rows (kernels/residual_rows.py) against the split kernels and the reference.

In the interpreter on CPU (4 stand-in SMs, so 4 programs that each take several rows), compiled on a GPU.
The rows kernel applies the split kernels' per-element operations to the same chunks, so in the interpreter
its masses and log-sum-exps are bit-identical to theirs; compiled, the reductions may associate differently.
"""

from __future__ import annotations

import types

import pytest
import torch
from helpers import assert_same_tokens, count_variants, on_triton_device, triton_device

from sigmafast.kernels import reference as ref
from sigmafast.kernels import residual, residual_rows, sampling, vocab
from sigmafast.kernels.utils import row_stride

DEVICE = triton_device()
residual_sample = on_triton_device(sampling.residual_sample)

CASES = [
    # (N, V, temperature, top_k, block_v, TILE, dtype): TILE sets the chunks per tile (TILE // 2 // block_v)
    (10, 300, 0.8, None, 64, 256, torch.float32),  # 3 tiles of 2 chunks per row, 4 programs over 10 rows
    (9, 1000, 1.0, 20, 64, 512, torch.float16),  # 4 tiles of 4 chunks, the last one ragged
    (7, 60, 1.3, None, None, 8192, torch.float32),  # one chunk, one tile
    (5, 1, 1.0, None, None, 8192, torch.float32),
    (3, 257, 1.0, 5, 64, 128, torch.float32),  # one chunk per tile, fewer rows than programs
    (1, 130, 0.7, None, 16, 64, torch.float16),
]


def _cid(c):
    N, V, T, k, bv, tile, dtype = c
    return f"N{N}-V{V}-T{T}-k{k}-chunk{bv}-tile{tile}-{str(dtype)[6:]}"


def _rows(N, V, dtype, seed, stride=None):
    """q and p (N, V) of one row stride (a view of wider rows when ``stride`` is given); p = q on row 0."""
    g = torch.Generator().manual_seed(seed)
    width = stride or V
    q = (torch.randn(N, width, generator=g) * 2).to(dtype)
    p = (q.float() + torch.randn(N, width, generator=g)).to(dtype)
    p[0] = q[0]
    return q.to(DEVICE)[:, :V], p.to(DEVICE)[:, :V]


def _kth(x, top_k):
    return None if top_k is None else x.float().topk(min(top_k, x.shape[1]), -1).values[:, -1].contiguous()


@pytest.mark.parametrize("case", CASES, ids=_cid)
def test_rows_masses_equal_the_split_kernels(case, poisoned_empty, monkeypatch):
    N, V, T, k, bv, tile, dtype = case
    monkeypatch.setattr(vocab, "TILE", tile)
    q, p = _rows(N, V, dtype, V + N)
    kq, kp = _kth(q, k), _kth(p, k)
    cfg = vocab.split_config(V, dtype, bv)
    s_x = row_stride(q) // cfg.unit
    m, s = vocab.chunk_stats(q, kq, T, cfg, s_x, p, kp)
    want = residual.residual_masses(q, p, kq, kp, m[:N], s[:N], m[N:], s[N:], T, cfg, s_x)
    got = residual_rows.residual_masses_rows(q, p, kq, kp, T, cfg, s_x)
    for name, a, b in zip(("residual masses", "q masses", "log-sum-exps"), got, want):
        assert not a.isnan().any(), f"{name}: elements left unwritten"
        if DEVICE == "cpu":
            assert torch.equal(a, b), f"{name} differ from the split kernels' by {(a - b).abs().max():.3g}"
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", [(12, 300, 0.8, None, 64), (8, 1000, 1.0, 7, 64), (6, 50, 1.0, None, None)],
                         ids=lambda c: "N{}-V{}-T{}-k{}-chunk{}".format(*c))
def test_residual_sample_by_rows_matches_reference(case, monkeypatch):
    """Through ``sampling.residual_sample`` with ``ROWS`` on: fp16 rows, a row stride wider than V (odd when
    V is 1000, so the windows shift), an empty residual row (p = q samples q), the kernel checked launched."""
    N, V, T, k, bv = case
    monkeypatch.setattr(residual_rows, "ROWS", True)
    monkeypatch.setattr(residual_rows, "num_sms", lambda device: 4)  # a row per SM also on a 132-SM GPU
    monkeypatch.setattr(vocab, "TILE", 256)
    calls = []
    real = residual_rows.residual_masses_rows
    monkeypatch.setattr(residual_rows, "residual_masses_rows", lambda *a: calls.append(1) or real(*a))
    q, p = _rows(N, V, torch.float16, V, stride=V + 3)
    u = torch.rand(N, generator=torch.Generator().manual_seed(V))
    tokens = residual_sample(q, p, u, T, k, block_v=bv)
    assert calls, "the rows kernel did not run"
    want = ref.residual_sample(q.cpu(), p.cpu(), u, T, k)
    qp, pp = ref.log_probs(q.cpu().float(), T, k).exp(), ref.log_probs(p.cpu().float(), T, k).exp()
    r = (qp - pp).clamp_min(0)
    assert_same_tokens(tokens, want, torch.where(r.sum(-1, keepdim=True) <= 0, qp, r), u)


def test_rows_compile_once_over_row_counts_and_strides(monkeypatch):
    monkeypatch.setattr(residual_rows, "ROWS", True)
    monkeypatch.setattr(residual_rows, "num_sms", lambda device: 4)  # a row per SM also on a 132-SM GPU
    g = torch.Generator().manual_seed(2)
    with count_variants() as v:
        for N, stride in ((4, 7), (5, 7), (16, 9), (33, 7), (7, 16)):
            rows = torch.randn(N, stride, generator=g)[:, :7]
            u = torch.rand(N, generator=g)
            for top_k in (None, 3):
                residual_sample(rows, rows.flip(0), u, 0.9, top_k)
    counts = v.counts()
    assert counts.get("_residual_rows_kernel") == 2, counts  # one with top-k, one without
    assert "_residual_mass_kernel" not in counts, "the split kernels ran instead"


def test_the_rows_path_needs_ROWS_and_a_row_per_sm(monkeypatch):
    cpu = torch.device("cpu")  # 4 stand-in SMs
    assert not residual_rows.use_rows(64, cpu)  # off by default until a GPU times it
    with residual_rows.by_rows(0.25):  # the benchmarks' switch, undone on exit
        assert residual_rows.use_rows(4, cpu) and residual_rows.L2_SHARE == 0.25
    assert not residual_rows.use_rows(4, cpu) and residual_rows.L2_SHARE == 0.5
    monkeypatch.setattr(residual_rows, "ROWS", True)
    assert not residual_rows.use_rows(3, cpu) and residual_rows.use_rows(4, cpu)


def test_programs_fill_the_sms_and_the_l2_share_in_one_wave(monkeypatch):
    """GPT-2 rows in bf16 (201 KB of q and p) on an H200-like card: 132 SMs, 50 MB of L2."""
    assert residual_rows.programs(10, 2 * 50257 * 2, 4, torch.device("cpu")) == 4  # the interpreter's 4 SMs
    monkeypatch.setattr(residual_rows, "num_sms", lambda device: 132)
    monkeypatch.setattr(residual_rows, "cuda_props", lambda device: types.SimpleNamespace(L2_cache_size=50 << 20))
    cuda, row_pair = torch.device("cuda"), 2 * 50257 * 2
    assert residual_rows.programs(1024, row_pair, 2, cuda) == 132  # the L2's half holds 130 rows: the SMs win
    monkeypatch.setattr(residual_rows, "L2_SHARE", 1.0)
    assert residual_rows.programs(1024, row_pair, 2, cuda) == (50 << 20) // row_pair  # 260
    assert residual_rows.programs(1024, row_pair, 1, cuda) == 132  # never past one wave
    assert residual_rows.programs(100, row_pair, 2, cuda) == 100  # nor past the rows
