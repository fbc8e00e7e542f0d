"""Triton RoPE (kernels/rotary.py) against kernels/reference.py, and the engine's use of it.

The kernel rotates in place, so each case rotates a copy of the same inputs both ways and compares every
element of the buffers, untouched parts included (the values with plain RoPE, the projection's other
columns).
"""

from __future__ import annotations

import pytest
import torch

import sigmafast
from helpers import tiny_model, triton_device
from sigmafast import kernels
from sigmafast.kernels import reference_layers as ref
from sigmafast.kernels import rotary
from sigmafast.kernels.reference_layers import turn_tables
from sigmafast.positions import rotary_tables

DEVICE = triton_device()

TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=2e-3)}

# (lead dims, H, T, D): lead () is one row of heads; (B, O) are the verification's orders
CASES = [
    ((1,), 1, 1, 2),  # one token, one pair
    ((3,), 4, 17, 32),  # rows not a multiple of the tile
    ((2, 5), 2, 9, 16),  # (B, O, H, R, D): the verification's layout
    ((2,), 3, 40, 48),  # D / 2 = 24: a padded half tile
    ((1, 1), 12, 1, 64),  # one step (an autoregressive token), GPT-2 heads
]


def _ids(case) -> str:
    lead, H, T, D = case
    return f"lead{'x'.join(map(str, lead))}-H{H}-T{T}-D{D}"


def _projection(case, dtype, seed):
    """A (..., T, 3C) QKV projection and its q, k, v views (..., H, T, D), as the model makes them."""
    lead, H, T, D = case
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(*lead, T, 3 * H * D, generator=g).to(dtype=dtype, device=DEVICE)
    shape = (*lead, T, H, D)
    return proj, [t.view(shape).transpose(-3, -2) for t in proj.split(H * D, dim=-1)]


def _positions(case, n_pos, seed, expanded=False):
    lead, H, T, D = case
    g = torch.Generator().manual_seed(seed + 100)
    pos_q = torch.randint(0, n_pos, (*lead, T), generator=g).to(DEVICE)
    if expanded:  # one position per row, broadcast over T (the draft's keys: the last token)
        return pos_q, torch.randint(0, n_pos, (*lead, 1), generator=g).to(DEVICE).expand(*lead, T)
    return pos_q, torch.randint(0, n_pos, (*lead, T), generator=g).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("values", [True, False], ids=["rope-v", "rope"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_rotary_matches_reference_on_the_projection(case, values, dtype):
    lead, H, T, D = case
    cos, sin = (t.to(dtype=dtype, device=DEVICE) for t in rotary_tables(50, D))
    pos_q, pos_k = _positions(case, 50, seed=1, expanded=len(lead) == 1)
    proj, (q, k, v) = _projection(case, dtype, seed=0)
    want, (wq, wk, wv) = _projection(case, dtype, seed=0)
    rotary.rotary_(q, k, v if values else None, pos_q, pos_k, cos, sin)
    ref.rotary_(wq, wk, wv if values else None, pos_q, pos_k, cos, sin)
    torch.testing.assert_close(proj, want, **TOL[dtype])
    if not values:  # the values' columns are untouched, bit for bit
        assert torch.equal(proj[..., 2 * H * D:], want[..., 2 * H * D:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_rotary_back_undoes_the_rotation(case, dtype):
    """rope-v's restore: sign -1 on an attention output of (..., T, H, D) memory order; it matches the
    reference, and rotating forth then back returns the input."""
    lead, H, T, D = case
    cos, sin = (t.to(DEVICE) for t in rotary_tables(50, D))
    pos_q, _ = _positions(case, 50, seed=2)
    g = torch.Generator().manual_seed(3)
    y0 = torch.randn(*lead, T, H, D, generator=g).to(dtype=dtype, device=DEVICE).transpose(-3, -2)  # (..., H, T, D)
    y, want = y0.clone(memory_format=torch.preserve_format), y0.clone(memory_format=torch.preserve_format)
    rotary.rotary_(y, None, None, pos_q, None, cos, sin, -1.0)
    ref.rotary_(want, None, None, pos_q, None, cos, sin, -1.0)
    torch.testing.assert_close(y, want, **TOL[dtype])
    rotary.rotary_(y, None, None, pos_q, None, cos, sin, 1.0)
    torch.testing.assert_close(y, y0, rtol=1e-5 if dtype == torch.float32 else 4e-3,
                               atol=1e-5 if dtype == torch.float32 else 4e-3)


def test_rotary_of_a_layout_that_does_not_collapse_falls_back_in_place():
    """Leading dims that do not collapse into one stride (here orders before batch) are rotated by the
    reference and written back: still in place, still right."""
    cos, sin = (t.to(DEVICE) for t in rotary_tables(20, 8))
    g = torch.Generator().manual_seed(4)
    base = torch.randn(3, 2, 4, 5, 8, generator=g).to(DEVICE)  # (O, B, H, T, D)
    q = base.permute(1, 0, 2, 3, 4)  # (B, O, H, T, D), B's stride below O's
    pos = torch.randint(0, 20, (2, 3, 5), generator=g).to(DEVICE)
    want = q.clone()
    ref.rotary_(want, None, None, pos, None, cos, sin)
    rotary.rotary_(q, None, None, pos, None, cos, sin)
    torch.testing.assert_close(q, want, rtol=1e-6, atol=1e-6)


def test_rotary_reads_the_halves_of_the_models_full_width_tables():
    """The engine passes views of the model's (n_pos, D) [cos, cos] and [-sin, sin] tables (row stride D):
    the same rotation as contiguous (n_pos, D / 2) tables."""
    case = ((2, 3), 2, 7, 16)
    cos, sin = (t.to(DEVICE) for t in rotary_tables(30, 16))
    turn_cos, turn_sin = turn_tables(cos, sin)
    pos_q, pos_k = _positions(case, 30, seed=5)
    proj, (q, k, v) = _projection(case, torch.float32, seed=6)
    want, (wq, wk, wv) = _projection(case, torch.float32, seed=6)
    rotary.rotary_(q, k, v, pos_q, pos_k, turn_cos[:, :8], turn_sin[:, 8:])
    rotary.rotary_(wq, wk, wv, pos_q, pos_k, cos, sin)
    assert torch.equal(proj, want)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=torch.zeros(2, 3, 5, 7)), "head dim must be even"),
        (dict(q=torch.zeros(5, 8, dtype=torch.float64)), "q must be a"),
        (dict(k=torch.zeros(2, 3, 5, 6)), "k must be None or a tensor like q"),
        (dict(v=torch.zeros(2, 3, 5, 8, dtype=torch.float16)), "v must be None or a tensor like q"),
        (dict(pos_q=torch.zeros(2, 4, dtype=torch.long)), "pos_q must be"),
        (dict(pos_k=torch.zeros(2, 5)), "pos_k must be"),
        (dict(cos=torch.zeros(20, 8)), "cos must be"),
        (dict(sin=torch.zeros(21, 4)), "sin must have the shape of cos"),
        (dict(cos=torch.zeros(4, 20).t()), "cos must be"),
    ],
    ids=["odd-D", "q-fp64", "k-shape", "v-dtype", "pos_q-shape", "pos_k-float", "cos-width", "sin-rows",
         "cos-strided"],
)
def test_rotary_rejects_bad_input(change, match):
    args = dict(q=torch.zeros(2, 3, 5, 8), k=torch.zeros(2, 3, 5, 8), v=None, pos_q=torch.zeros(2, 5, dtype=torch.long),
                pos_k=torch.zeros(2, 5, dtype=torch.long), cos=torch.zeros(20, 4), sin=torch.zeros(20, 4))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        rotary.rotary_(**args)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("name", ["q", "k"])
def test_rotary_refuses_an_expanded_view_on_both_backends(name, backend):
    """The rows of an expanded tensor share memory: rotating them in place would turn it once per row."""
    g = torch.Generator().manual_seed(0)
    qk = {n: torch.randn(2, 3, 5, 8, generator=g).to(DEVICE) for n in ("q", "k")}
    qk[name] = qk[name][:1].expand(2, 3, 5, 8)
    before = qk[name].clone()
    pos = torch.randint(0, 20, (2, 5), generator=g).to(DEVICE)
    cos, sin = (torch.rand(20, 4, generator=g).to(DEVICE) for _ in range(2))
    with pytest.raises(ValueError, match=f"{name} must not be an expanded view"):
        kernels.rotary_(qk["q"], qk["k"], None, pos, pos, cos, sin, backend=backend)
    assert torch.equal(qk[name], before)


@pytest.mark.parametrize("pos_encoding", ["rope", "rope-v", "rope-v+learned"])
@pytest.mark.parametrize("strategy", ["burst", "autoregressive"])
def test_engine_rotary_kernels_give_the_reference_backends_tokens(pos_encoding, strategy):
    """A RoPE model sampled on the Triton path (in-place rotations, keys and values read from the shared
    projection buffer) and on the reference path: the same tokens, with a prompt and infilling."""
    model = tiny_model(vocab_size=11, block_size=24, pos_encoding=pos_encoding, dtype=torch.float32).to(DEVICE)
    idx = torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    kwargs = dict(acceptance="paper", num_orders=3) if strategy == "burst" else {}
    outs = []
    for backend in ("triton", "reference"):
        with kernels.use_backend(backend), torch.no_grad():
            g = torch.Generator(device=DEVICE).manual_seed(1)
            outs.append(sigmafast.generate(model, idx, 16, generator=g, strategy=strategy, **kwargs))
    assert torch.equal(outs[0], outs[1])
