"""Triton drafts along the orders (kernels/along.py) against kernels/reference.py.

Outputs and the kernel's position -> slot scratch come pre-filled with garbage (``poisoned_empty``), so
an element the kernel forgets, or a slot it reads before writing, fails. All four outputs are exact.
"""

from __future__ import annotations

import pytest
import torch

from helpers import on_triton_device
from sigmafast.kernels import along
from sigmafast.kernels import reference as ref

gather_drafts = on_triton_device(along.gather_drafts)

# (B, O, S, T, known fraction, orders): "sampler" orders visit the unknown positions first (as
# kernels.draft_slots' orders), "any" orders visit positions in any order, known or not
CASES = [
    (1, 1, 1, 1, 0.0, "sampler"),  # one position, one step
    (2, 5, 16, 16, 0.3, "sampler"),  # a bucket wider than the remaining positions: padded steps
    (3, 1, 17, 40, 0.6, "sampler"),  # odd sizes, one order (lossless)
    (2, 3, 300, 300, 0.1, "sampler"),  # more steps than one program's tile, more slots than one pass
    (4, 2, 9, 12, 0.5, "any"),  # known positions anywhere along the orders
    (2, 4, 8, 8, 1.0, "any"),  # every position known: canvas tokens only
]


def _ids(case) -> str:
    B, O, S, T, frac, kind = case
    return f"B{B}-O{O}-S{S}-T{T}-known{frac}-{kind}"


def _inputs(case, seed, logp_dtype=torch.float32, u_dtype=torch.float64):
    B, O, S, T, frac, kind = case
    g = torch.Generator().manual_seed(seed)
    known = torch.rand(B, T, generator=g) < frac
    R = max(int((~known).sum(1).max()), 1) if kind == "sampler" else T
    R = max(R, min(S, T)) if kind == "sampler" else R
    positions = known.to(torch.int8).argsort(dim=1, stable=True)[:, :R]  # unknown first, as draft_slots
    keys = torch.rand(B, O, T, generator=g)
    if kind == "sampler":
        orders = keys.masked_fill(known[:, None, :], 2.0).argsort(dim=-1, stable=True)[..., :S]  # a strided slice
    else:
        orders = torch.randint(0, T, (B, O, S), generator=g)
    tokens = torch.randint(0, 1000, (B, R), generator=g)
    logp = -torch.rand(B, R, generator=g, dtype=torch.float64).to(logp_dtype) * 5
    canvas = torch.randint(1000, 2000, (B, T), generator=g)  # distinct from the drafts' range
    uniforms = torch.rand(B, T, generator=g, dtype=torch.float64).to(u_dtype)
    return positions, tokens, logp, canvas, known, uniforms, orders


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float64), (torch.float64, torch.float32)],
                         ids=["logp32-u64", "logp64-u32"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gather_drafts_matches_reference(case, dtypes, poisoned_empty):
    for seed in range(2):
        args = _inputs(case, seed, *dtypes)
        got = gather_drafts(*args)
        want = ref.gather_drafts(*args)
        for name, g, w in zip(("tokens", "logp", "uniforms", "slots"), got, want):
            assert g.shape == args[-1].shape and g.dtype == w.dtype, name
            assert torch.equal(g, w), name


def test_gather_drafts_follows_each_step_to_its_draft():
    """An independent check, one step at a time: a step at an unknown position reads the draft of that
    position's slot; at a known position the canvas token, log-prob 0, slot 0."""
    positions, tokens, logp, canvas, known, uniforms, orders = _inputs((2, 3, 7, 10, 0.4, "any"), 5)
    tok_o, logp_o, u_o, slot_o = gather_drafts(positions, tokens, logp, canvas, known, uniforms, orders)
    B, O, S = orders.shape
    for b in range(B):
        slot_of = {int(p): s for s, p in enumerate(positions[b])}
        for o in range(O):
            for s in range(S):
                p = int(orders[b, o, s])
                assert u_o[b, o, s] == uniforms[b, p]
                if known[b, p]:
                    assert (tok_o[b, o, s], logp_o[b, o, s], slot_o[b, o, s]) == (canvas[b, p], 0.0, 0)
                else:
                    slot = slot_of[p]
                    assert (tok_o[b, o, s], logp_o[b, o, s], slot_o[b, o, s]) == (tokens[b, slot], logp[b, slot], slot)


def _bad_args(**bad):
    names = ("positions", "tokens", "logp", "canvas", "known", "uniforms", "orders")
    args = dict(zip(names, _inputs(CASES[1], 0)))
    args.update(bad)
    return args


@pytest.mark.parametrize("bad,err,match", [
    (dict(orders=torch.zeros(2, 5, dtype=torch.long)), ValueError, "orders must be a \\(B, O, S\\)"),
    (dict(orders=torch.zeros(2, 5, 16, dtype=torch.int32)), ValueError, "orders must be a"),
    (dict(positions=torch.zeros(2, 17, dtype=torch.long)), ValueError, "positions must hold 1 to T = 16"),
    (dict(positions=torch.zeros(3, 16, dtype=torch.long)), ValueError, "positions must be a \\(2, 16\\)"),
    (dict(tokens=torch.zeros(2, 16)), ValueError, "tokens must be a \\(2, 16\\) tensor of torch.int64"),
    (dict(logp=torch.zeros(2, 16, dtype=torch.float16)), ValueError, "logp must be"),
    (dict(known=torch.zeros(2, 16, dtype=torch.long)), ValueError, "known must be"),
    (dict(uniforms=torch.zeros(2, 32)[:, ::2]), ValueError, "uniforms must have unit stride"),
    (dict(canvas=[0] * 16), ValueError, "canvas must be a \\(B, T\\)"),
    (dict(tokens=None), TypeError, "tokens must be a torch.Tensor"),
])
def test_gather_drafts_rejects_bad_inputs(bad, err, match):
    with pytest.raises(err, match=match):
        along.gather_drafts(**_bad_args(**bad))
