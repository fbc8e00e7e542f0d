"""The MLP's first matmul with its GELU (kernels/fc_gelu.py) against kernels/reference.py, and the engine's use.

Outputs come pre-filled with NaN (``poisoned_empty``), so an element the kernel
forgets fails. Tolerances per dtype: float32 to 1e-5 (the dots are "ieee");
float16 against the float32 reference of the same float16 inputs, to a few of
float16's roundings (the kernel rounds the matmul's output as eager does, but
accumulates in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sigmafast
from helpers import (count_variants, engine_tokens_and_kernels, inner_strided, on_triton_device, tiny_model,
                     triton_device)
from sigmafast.kernels import fc_gelu
from sigmafast.kernels import reference_layers as ref

DEVICE = triton_device()
linear_gelu = on_triton_device(fc_gelu.linear_gelu)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}

# (leading shape, K, F, bias, layout)
CASES = [
    ((1,), 16, 16, True, "contiguous"),  # one row, one tile
    ((7,), 24, 40, True, "strided"),  # odd rows and widths, rows of a wider buffer
    ((2, 3, 5), 64, 256, False, "contiguous"),  # (B, O, R) leading dims, no bias
    ((33,), 100, 300, True, "strided"),  # ragged row and column blocks, a ragged last K chunk
    ((65,), 128, 512, True, "contiguous"),  # the `small` preset's widths, a second row block of one row
    ((3,), 8, 20, True, "contiguous"),  # K narrower than one 16-wide dot
    ((0, 4), 32, 64, True, "contiguous"),  # no rows
]


def _ids(case) -> str:
    lead, K, F, bias, layout = case
    return f"{'x'.join(map(str, lead))}-K{K}-F{F}-{'bias' if bias else 'nobias'}-{layout}"


def _inputs(case, dtype, seed):
    lead, K, F, bias, layout = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K + (5 if layout == "strided" else 0), generator=g)[..., :K]
    w = torch.randn(F, K, generator=g) / K ** 0.5
    b = torch.randn(F, generator=g) if bias else None
    return [t if t is None else t.to(dtype) for t in (x, w, b)]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_linear_gelu_matches_the_reference(case, poisoned_empty):
    x, w, b = _inputs(case, torch.float32, seed=len(case[0]) + case[1])
    got = linear_gelu(x, w, b)
    assert got.shape == (*x.shape[:-1], w.shape[0]) and got.dtype == x.dtype
    torch.testing.assert_close(got.cpu(), ref.linear_gelu(x, w, b), **TOL[torch.float32])


@pytest.mark.parametrize("case", CASES[1:5], ids=_ids)
def test_linear_gelu_in_float16(case, poisoned_empty):
    x, w, b = _inputs(case, torch.float16, seed=7)
    got = linear_gelu(x, w, b).cpu()
    assert got.dtype == torch.float16 and not got.isnan().any()
    want = ref.linear_gelu(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, **TOL[torch.float16])


def test_linear_gelu_compiles_once_per_width():
    """Row counts, output widths and row strides never compile another variant; K and the bias do."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 32, generator=g)
    with count_variants() as v:
        for n, layout in ((1, 0), (16, 0), (37, 3), (64, 8)):
            x = torch.randn(n, 32 + layout, generator=g)[:, :32]
            linear_gelu(x, w, torch.randn(48, generator=g))
            linear_gelu(x, w[:17].contiguous(), torch.randn(17, generator=g))
    assert v.counts() == {"_linear_gelu_kernel": 1}


def test_engine_with_fused_gelu_launches_it_and_keeps_the_tokens():
    """``Engine(fused_gelu=True)`` runs each MLP's first matmul and GELU as one kernel (no ATen gelu) and
    samples the tokens of the default engine, which launches none."""
    assert sigmafast.Engine(tiny_model(dtype=torch.float32)).fused_gelu is False
    model = tiny_model(vocab_size=7, block_size=12, seed=1, std=0.5, dtype=torch.float32).to(DEVICE)
    idx = torch.randint(0, 7, (2, 3), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    (fused, launched), (plain, launched_plain) = (engine_tokens_and_kernels(model, idx, fused_gelu=f)
                                                  for f in (True, False))
    assert "_linear_gelu_kernel" in launched and "_linear_gelu_kernel" not in launched_plain
    assert torch.equal(fused, plain)
    with pytest.raises(TypeError, match="fused_gelu must be a bool"):
        sigmafast.Engine(model, fused_gelu=1)


def test_linear_gelu_of_rows_strided_along_k(poisoned_empty):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 24, generator=g)
    w, b = torch.randn(40, 24, generator=g) / 24**0.5, torch.randn(40, generator=g)
    got = fc_gelu.linear_gelu(inner_strided(x), w.to(DEVICE), b.to(DEVICE))
    torch.testing.assert_close(got.cpu(), ref.linear_gelu(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_gelu_rounds_the_matmul_to_float16_before_the_gelu(poisoned_empty):
    """As eager ``F.gelu(F.linear(x, w))`` in float16: the exact products rounded once to float16, then the
    GELU (float32) rounded; a float32 erf may differ by an ulp, so at most 1% of the values may differ."""
    g = torch.Generator().manual_seed(1)
    N, K, Fo = 33, 32, 40
    x = ((torch.randn(N, K, generator=g) * 600).round().clamp(-2000, 2000) / 4096).half()  # exact in float16
    w = torch.randint(-1, 2, (Fo, K), generator=g).half()  # pre-activations of about +-3, multiples of 2^-12
    got = linear_gelu(x, w, None)
    pre = F.linear(x.float(), w.float())
    want = F.gelu(pre.half().float()).half()
    assert (pre != pre.half().float()).any()  # the rounding matters here
    differ = got != want
    assert differ.float().mean() <= 0.01, f"{int(differ.sum())} of {differ.numel()} differ"
