"""Triton burst / verification attention against kernels/reference.py.

The CPU runs use the Triton interpreter (conftest sets TRITON_INTERPRET=1 when
there is no CUDA device; with one, the same tests run compiled on it) in
float32; outputs are pre-filled with NaN so an unwritten element fails. The
error measure is max |out - ref| / max |ref| (per tensor).
"""

from __future__ import annotations

import pytest
import torch

from helpers import count_variants, on_triton_device, triton_device
from sigmafast.kernels import attention
from sigmafast.kernels import reference as ref

# in the interpreter on CPU, compiled on a GPU (the tensors are built on the CPU either way)
burst_attention = on_triton_device(attention.burst_attention)
verify_attention = on_triton_device(attention.verify_attention)

L_MAX = 200  # several key tiles (32 keys per tile in fp32)

# (B, H, R, D, cache lengths kind); every value of every axis, the awkward combinations
CASES = [
    (1, 1, 1, 16, "empty"),
    (1, 4, 5, 64, "one"),
    (3, 1, 17, 16, "odd"),
    (3, 4, 17, 64, "ragged"),
    (3, 1, 64, 16, "ragged"),
    (1, 1, 64, 64, "long"),
    (3, 4, 1, 16, "long"),
    (1, 4, 5, 64, "long"),
    (1, 1, 5, 24, "odd"),  # non-power-of-two head dim
]


def _lens(kind: str, B: int, g: torch.Generator) -> torch.Tensor:
    if kind == "empty":
        return torch.zeros(B, dtype=torch.long)
    if kind == "one":
        return torch.ones(B, dtype=torch.long)
    if kind == "odd":
        return torch.full((B,), 37, dtype=torch.long)
    if kind == "long":
        return torch.full((B,), L_MAX - 3, dtype=torch.long)
    return torch.tensor([0, 1, 130, 65, L_MAX][:B]) if B > 1 else torch.randint(1, L_MAX, (1,), generator=g)


def _ids(case) -> str:
    B, H, R, D, kind = case
    return f"B{B}-H{H}-R{R}-D{D}-{kind}"


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).abs().max() / want.double().abs().max()).item()


def _inputs(shape_q, B, H, D, kind, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape_q, generator=g) for _ in range(3))
    k_cache, v_cache = (torch.randn(B, H, L_MAX, D, generator=g) for _ in range(2))
    lens = _lens(kind, B, g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, k_cache, v_cache)] + [lens.to(device)]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_burst_attention_matches_reference(case):
    B, H, R, D, kind = case
    q, k, v, kc, vc, lens = _inputs((B, H, R, D), B, H, D, kind, seed=R * 7 + D)
    out = torch.full_like(q, float("nan"))
    burst_attention(q, k, v, kc, vc, lens, out=out)
    want = ref.burst_attention(q, k, v, kc, vc, lens)
    assert not out.isnan().any()
    assert _rel_err(out, want) <= 1e-4
    if kind == "empty":
        torch.testing.assert_close(out, v, rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_verify_attention_matches_reference(case):
    B, H, R, D, kind = case
    O = {1: 3, 5: 3, 17: 5, 64: 2}[R]  # R=17, O=5: orders straddle query tiles
    q, k, v, kc, vc, lens = _inputs((B, O, H, R, D), B, H, D, kind, seed=R * 11 + D)
    out = torch.full_like(q, float("nan"))
    verify_attention(q, k, v, kc, vc, lens, out=out)
    want = ref.verify_attention(q, k, v, kc, vc, lens)
    assert not out.isnan().any()
    assert _rel_err(out, want) <= 1e-4


@pytest.mark.parametrize("num_splits", [1, 3, 4], ids=lambda s: f"splits{s}")
def test_split_kv_combine(num_splits):
    B, H, R, D = 3, 2, 5, 16
    q, k, v, kc, vc, lens = _inputs((B, 2, H, R, D), B, H, D, "ragged", seed=num_splits)
    out = torch.full_like(q, float("nan"))
    verify_attention(q, k, v, kc, vc, lens, out=out, num_splits=num_splits)
    assert _rel_err(out, ref.verify_attention(q, k, v, kc, vc, lens)) <= 1e-4
    qb, kb, vb = q[:, 0], k[:, 0], v[:, 0]
    out = torch.full_like(qb, float("nan"))
    burst_attention(qb, kb, vb, kc, vc, lens, out=out, num_splits=num_splits)
    assert _rel_err(out, ref.burst_attention(qb, kb, vb, kc, vc, lens)) <= 1e-4


def test_batch_and_heads_live_on_grid_axis_0():
    """CUDA caps grid axes 1 and 2 at 65535 programs, and a GPT-2 batch of 8192 rows has 98304 (b, h)
    pairs: B·H shares axis 0 with the query tiles, and the other axes do not grow with B or H. Several
    query tiles and KV splits, so that the tile and (b, h) of a program and its partials' rows are checked."""
    grids = {}
    for B, H in ((1, 1), (3, 5)):
        q, k, v, kc, vc, lens = _inputs((B, 3, H, 30, 16), B, H, 16, "ragged", seed=B + H)  # M = 90: 2 tiles
        out = torch.full_like(q, float("nan"))
        with count_variants() as launched:
            verify_attention(q, k, v, kc, vc, lens, out=out, num_splits=3)
        assert _rel_err(out, ref.verify_attention(q, k, v, kc, vc, lens)) <= 1e-4
        grids[B * H] = {name: launched.grids[name] for name in ("_cascade_attn_kernel", "_combine_kernel")}
    for name, (one, many) in {n: (grids[1][n], grids[15][n]) for n in grids[1]}.items():
        assert [g[1:] for g in one] == [g[1:] for g in many], name
        assert [15 * g[0] for g in one] == [g[0] for g in many], name


def test_strided_inputs_and_scale():
    """Views straight out of a (B, R, H, D) projection, and an explicit scale."""
    g = torch.Generator().manual_seed(5)
    B, H, R, D, L = 2, 3, 6, 32, 70
    q, k, v = (torch.randn(B, R, H, D, generator=g).transpose(1, 2) for _ in range(3))
    kc, vc = (torch.randn(B, L, H, D, generator=g).transpose(1, 2) for _ in range(2))
    lens = torch.tensor([75, 9], dtype=torch.int32)  # over L: the whole cache
    out = burst_attention(q, k, v, kc, vc, lens, scale=0.3)
    assert _rel_err(out, ref.burst_attention(q, k, v, kc, vc, lens, scale=0.3)) <= 1e-4
    qo, ko, vo = (torch.randn(B, R, 2, H, D, generator=g).permute(0, 2, 3, 1, 4) for _ in range(3))
    out = verify_attention(qo, ko, vo, kc, vc, lens, scale=0.3)
    assert _rel_err(out, ref.verify_attention(qo, ko, vo, kc, vc, lens, scale=0.3)) <= 1e-4


@pytest.mark.parametrize("D", [64, 128], ids=["D64", "D128"])
def test_fp16_inputs(D):
    """The 16-bit path (P cast to fp16 for the P·V dot) in the interpreter, against the fp32
    reference on the same rounded inputs, at both 16-bit tilings (head dim up to 64, and above). (The
    interpreter's bf16 tl.dot is not usable: bf16 runs only in the GPU tests.)"""
    B, H, R, O = 2, 2, 20, 3
    q, k, v, kc, vc, lens = _inputs((B, O, H, R, D), B, H, D, "ragged", seed=9, dtype=torch.float16)
    f32 = [t.float() for t in (q, k, v, kc, vc)]
    out = verify_attention(q, k, v, kc, vc, lens, num_splits=2)
    assert out.dtype == torch.float16 and _rel_err(out, ref.verify_attention(*f32, lens)) <= 2e-3
    out = burst_attention(q[:, 0], k[:, 0], v[:, 0], kc, vc, lens)
    want = ref.burst_attention(f32[0][:, 0], f32[1][:, 0], f32[2][:, 0], f32[3], f32[4], lens)
    assert _rel_err(out, want) <= 2e-3


def _good(B=1, H=2, R=3, D=16, L=8):
    return [torch.randn(B, H, R, D) for _ in range(3)] + [torch.randn(B, H, L, D) for _ in range(2)] + [
        torch.full((B,), 4)
    ]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.__setitem__(0, a[0][0]), "q must have 4 dimensions"),
        (lambda a: a.__setitem__(1, a[1][:, :, :2]), "k must have the shape of q"),
        (lambda a: a.__setitem__(2, a[2].double()), "v must have the shape of q|float32"),
        (lambda a: a.__setitem__(0, a[0].long()), "q must be float32"),
        (lambda a: a.__setitem__(slice(3, 5), [a[3][:, :1], a[4][:, :1]]), "k_cache must have shape"),
        (lambda a: a.__setitem__(4, a[4][..., :8]), "v_cache must have the shape of k_cache"),
        (lambda a: a.__setitem__(5, a[5].float()), "cache_lens must be an int32/int64 tensor"),
        (lambda a: a.__setitem__(5, torch.zeros(3, dtype=torch.long)), "cache_lens must be an int32/int64"),
    ],
    ids=["rank", "k-shape", "v-dtype", "q-int", "cache-heads", "vcache-dim", "lens-float", "lens-shape"],
)
def test_burst_bad_input(mutate, match):
    args = _good()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        burst_attention(*args)


def test_bad_head_dim_and_verify_rank():
    with pytest.raises(ValueError, match="over the supported maximum 256"):
        burst_attention(*_good(D=272))
    args = _good()
    with pytest.raises(ValueError, match="q must have 5 dimensions"):
        verify_attention(*args)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_realistic_shapes(dtype):
    """GPT-2 small heads (H=12, D=64), R=1024 queries, O=5 orders, a ragged 4096-long cache,
    against the reference computed in fp32 from the same (rounded) inputs."""
    H, R, D, L, O = 12, 1024, 64, 4096, 5
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    kc, vc = rand(2, H, L, D), rand(2, H, L, D)
    lens = torch.tensor([L, 1531], device="cuda")
    q, k, v = rand(2, H, R, D), rand(2, H, R, D), rand(2, H, R, D)
    out = burst_attention(q, k, v, kc, vc, lens)
    assert _rel_err(out, ref.burst_attention(*(t.float() for t in (q, k, v, kc, vc)), lens)) <= GPU_TOL[dtype]
    q, k, v = rand(1, O, H, R, D), rand(1, O, H, R, D), rand(1, O, H, R, D)
    out = verify_attention(q, k, v, kc[1:], vc[1:], lens[1:])
    want = ref.verify_attention(*(t.float() for t in (q, k, v, kc[1:], vc[1:])), lens[1:])
    assert _rel_err(out, want) <= GPU_TOL[dtype]


def test_inputs_and_out_of_any_strides_are_copied():
    """A head-dim stride other than 1 (q, out), strides that are not multiples of 16 with D = 32 (k, the
    caches): the launcher copies such inputs and writes the result back into such an ``out``."""
    g = torch.Generator().manual_seed(6)
    B, H, R, D, L = 2, 3, 5, 32, 70
    dev = triton_device()
    q = torch.randn(B, H, D, R, generator=g).to(dev).transpose(-1, -2)  # head-dim stride R
    k = torch.randn(B, H, R, D + 3, generator=g).to(dev)[..., :D]  # rows D + 3 apart
    v = torch.randn(B, H, R, D, generator=g).to(dev)
    kc, vc = (torch.randn(B, H, L, D + 1, generator=g).to(dev)[..., :D] for _ in range(2))
    lens = torch.tensor([0, 37], device=dev)
    out = torch.full((B, H, D, R), float("nan"), device=dev).transpose(-1, -2)
    attention.burst_attention(q, k, v, kc, vc, lens, out=out)
    assert _rel_err(out.cpu(), ref.burst_attention(*(t.cpu() for t in (q, k, v, kc, vc, lens)))) <= 1e-4
