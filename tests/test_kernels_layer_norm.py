"""Triton residual add + LayerNorm (kernels/layer_norm.py) against kernels/reference.py.

Outputs come pre-filled with NaN (``poisoned_empty``), so an element the kernel
forgets fails. The sum must equal the reference's exactly (one rounding of
x + y in the input dtype); the normalised output is compared per dtype: float32
to 1e-5, float16 to its rounding (the statistics are float32 in both).
"""

from __future__ import annotations

import pytest
import torch

from helpers import inner_strided, on_triton_device
from sigmafast.kernels import layer_norm
from sigmafast.kernels import reference_layers as ref

add_layer_norm = on_triton_device(layer_norm.add_layer_norm)

# (leading shape, C, params, layout)
CASES = [
    ((1,), 1, "affine", "contiguous"),
    ((7,), 24, "affine", "contiguous"),  # odd rows, non-power-of-two width
    ((2, 3, 5), 64, "no-bias", "contiguous"),  # (B, O, R) leading dims
    ((3, 17), 100, "scalar-gain", "strided"),  # one gain for every channel (stride 0), rows of a wider buffer
    ((33,), 768, "none", "strided"),  # GPT-2's width, no affine
    ((0, 4), 32, "affine", "contiguous"),  # no rows
]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=2e-3)}


def _ids(case) -> str:
    lead, C, params, layout = case
    return f"{'x'.join(map(str, lead))}-C{C}-{params}-{layout}"


def _inputs(case, dtype, seed):
    lead, C, params, layout = case
    g = torch.Generator().manual_seed(seed)
    if layout == "strided":  # the first C channels of rows 2C wide
        x = (torch.randn(*lead, 2 * C, generator=g) * 3 + 1).to(dtype)[..., :C]
    else:
        x = (torch.randn(*lead, C, generator=g) * 3 + 1).to(dtype)
    y = torch.randn(*lead, C, generator=g).to(dtype)
    w = (torch.rand(C, generator=g) + 0.5).to(dtype)
    b = torch.randn(C, generator=g).to(dtype)
    weight, bias = {"affine": (w, b), "no-bias": (w, None), "scalar-gain": (w[:1].expand(C), None),
                    "none": (None, None)}[params]
    return x, y, weight, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_add_layer_norm_matches_reference(case, dtype, poisoned_empty):
    for seed in range(2):
        x, y, weight, bias = _inputs(case, dtype, seed)
        s, h = add_layer_norm(x, y, weight, bias, 1e-5)
        want_s, _ = ref.add_layer_norm(x, y, weight, bias, 1e-5)
        assert s.shape == x.shape and h.shape == x.shape and s.dtype == dtype and h.dtype == dtype
        assert torch.equal(s, want_s)
        f = None if weight is None else weight.float()
        _, want_h = ref.add_layer_norm(want_s.float(), torch.zeros_like(want_s, dtype=torch.float32), f,
                                       None if bias is None else bias.float(), 1e-5)
        torch.testing.assert_close(h.float(), want_h, **TOL[dtype])


def test_add_layer_norm_normalises():
    """An independent check of the definition: zero mean and unit variance before the affine part."""
    x, y, _, _ = _inputs(((9,), 48, "none", "contiguous"), torch.float32, 3)
    s, h = add_layer_norm(x, y, None, None, 1e-5)
    torch.testing.assert_close(s, x + y, rtol=0, atol=0)
    torch.testing.assert_close(h.mean(-1), torch.zeros(9), rtol=0, atol=1e-5)
    torch.testing.assert_close(h.var(-1, unbiased=False), torch.ones(9), rtol=0, atol=1e-3)


@pytest.mark.parametrize("bad,match", [
    (dict(y=torch.zeros(3, 9)), "y must have the shape of x"),
    (dict(y=torch.zeros(3, 8, dtype=torch.float16)), "y must have the dtype of x"),
    (dict(weight=torch.ones(9)), "weight must be None or a \\(8,\\) torch.float32 tensor"),
    (dict(bias=torch.ones(8, dtype=torch.long)), "bias must be None or a \\(8,\\) torch.float32 tensor"),
    (dict(weight=torch.ones(8, dtype=torch.float64)), "weight must be None or a \\(8,\\) torch.float32 tensor"),
    (dict(x=torch.zeros(3, 8, dtype=torch.float16), y=torch.zeros(3, 8, dtype=torch.float16),
          bias=torch.ones(8, dtype=torch.bfloat16)), "bias must be None or a \\(8,\\) torch.float16 or torch.float32"),
    (dict(eps=0.0), "eps must be a positive float"),
    (dict(x=torch.zeros(3, 8, dtype=torch.float64), y=torch.zeros(3, 8, dtype=torch.float64)), "x must be float32"),
])
def test_add_layer_norm_rejects_bad_inputs(bad, match):
    args = dict(x=torch.zeros(3, 8), y=torch.zeros(3, 8), weight=None, bias=None, eps=1e-5)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        layer_norm.add_layer_norm(**args)


def test_add_layer_norm_of_rows_strided_along_c(poisoned_empty):
    g = torch.Generator().manual_seed(2)
    x, y = (torch.randn(9, 24, generator=g) for _ in range(2))
    s, h = layer_norm.add_layer_norm(inner_strided(x), inner_strided(y), None, None, 1e-5)
    want_s, want_h = ref.add_layer_norm(x, y, None, None, 1e-5)
    assert torch.equal(s.cpu(), want_s)
    torch.testing.assert_close(h.cpu(), want_h, rtol=1e-5, atol=1e-5)
