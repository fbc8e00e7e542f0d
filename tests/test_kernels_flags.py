"""Triton step flag (kernels/flags.py) against kernels/reference.py: the non-finite flag; and the flags the
steps raise through the Triton ops (the burst status the commit writes, the autoregressive plan's flag).

The flag is exact. Every non-finite case is placed in
a used row and in an unused one; the masks come in every form the steps pass
(per row, broadcast over orders, fewer dims, none) and the values as views of
padded or permuted buffers, read in place.
"""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_model, triton_device
from sigmafast.kernels import flags, sampling
from sigmafast.kernels import reference as ref

DEVICE = triton_device()
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# (values shape, used shape or None, layout)
CASES = [
    ((1, 1), (1,), "contiguous"),  # N = 1
    ((5, 7), (5,), "strided"),  # the first 7 of rows 16 wide (a padded logits buffer)
    ((3, 6, 50), (3, 6), "contiguous"),  # draft logits (B, R, V) with (B, R) used
    ((2, 3, 4, 33), (2, 1, 4), "strided"),  # scores (B, O, R, C) with (B, 1, R): a stride-0 order dim
    ((3, 4, 9), (4,), "permuted"),  # fewer mask dims; leading dims of a transposed buffer
    ((2, 3, 4, 5, 6), (3, 1, 5), "contiguous"),  # 4 leading dims that do not merge
    ((4, 300), None, "inner-stride"),  # every row; a non-unit inner stride (copied)
    ((2, 4100), (2,), "strided"),  # more than one 4096-wide tile per row
]
POISONS = ["clean", "nan", "+inf", "all--inf", "-inf-but-one-finite", "-inf-entries"]
BAD = {"nan", "+inf", "all--inf"}
FLAG = torch.zeros((), dtype=torch.bool)  # for the bad-input cases


def _ids(case) -> str:
    shape, used, layout = case
    return f"{'x'.join(map(str, shape))}-used{'x'.join(map(str, used)) if used else 'None'}-{layout}"


def _values(shape, layout, dtype, g):
    N = shape[-1]
    if layout == "strided":
        return (torch.randn(*shape[:-1], N + 9, generator=g) * 4).to(dtype)[..., :N]
    if layout == "permuted":
        return (torch.randn(shape[1], shape[0], *shape[2:], generator=g) * 4).to(dtype).transpose(0, 1)
    if layout == "inner-stride":
        return (torch.randn(*shape, 2, generator=g) * 4).to(dtype)[..., 0]
    return (torch.randn(*shape, generator=g) * 4).to(dtype)


def _poison(values, row, col, poison) -> None:
    """Write ``poison`` into one row (an index of the leading dims) of ``values`` at column ``col``, in place."""
    if poison == "nan":
        values[row][col] = float("nan")
    elif poison == "+inf":
        values[row][col] = float("inf")
    elif poison == "all--inf":
        values[row] = float("-inf")
    elif poison == "-inf-but-one-finite":
        values[row] = float("-inf")
        values[row][col] = 1.5
    elif poison == "-inf-entries":
        values[row][::2] = float("-inf")
        values[row][-1] = 0.25


def _triton_flag(values, used, flag) -> torch.Tensor:
    """flags.flag_nonfinite on the Triton device; the flag after it."""
    flag = flag.to(DEVICE)
    flags.flag_nonfinite(values.to(DEVICE), None if used is None else used.to(DEVICE), flag)
    return flag.cpu()


def _reference_flag(values, used, flag) -> torch.Tensor:
    flag = flag.clone()
    ref.flag_nonfinite(values, used, flag)
    return flag


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_flag_nonfinite_matches_reference(case, dtype, poison):
    shape, used_shape, layout = case
    lead = shape[:-1]
    seen = set()
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        values = _values(shape, layout, dtype, g)
        used = None if used_shape is None else torch.rand(used_shape, generator=g) < 0.5
        want_used = used is None or seed % 2 == 0  # poison a used row, then an unused one
        if used is not None and not bool((used == want_used).any()):
            used.view(-1)[0] = want_used
        full = torch.ones(lead, dtype=torch.bool) if used is None else used.expand(lead)
        rows = (full if want_used else ~full).nonzero()
        row = tuple(rows[torch.randint(0, rows.shape[0], (), generator=g)].tolist())
        _poison(values, row, shape[-1] // 2 if seed < 2 else shape[-1] - 1, poison)  # the last tile too
        flag = torch.zeros((), dtype=torch.bool)
        want = _reference_flag(values, used, flag)
        assert bool(want) == (poison in BAD and want_used)  # the reference agrees with the case's intent
        got = _triton_flag(values, used, flag)
        assert got.dtype == torch.bool and got.shape == ()
        assert bool(got) == bool(want), f"seed {seed}: row {row} (used: {want_used})"
        seen.add(bool(got))
    if poison in BAD and used_shape is not None:
        assert seen == {True, False}


@pytest.mark.parametrize("shape", [(0, 7), (2, 0, 5), (3, 7)], ids=["no-rows", "no-rows-3d", "clean"])
def test_flag_nonfinite_never_clears_the_flag(shape):
    values = torch.randn(shape)
    used = torch.ones(shape[:-1], dtype=torch.bool)
    for start in (False, True):
        flag = torch.tensor(start)
        assert bool(_triton_flag(values, used, flag)) == start
        assert bool(_reference_flag(values, used, flag)) == start


def test_flag_nonfinite_leaves_values_and_mask_unchanged():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(3, 4, 40, generator=g)
    values[1, 2, 5] = float("nan")
    used = torch.rand(3, 4, generator=g) < 0.5
    before = values.clone(), used.clone()
    _triton_flag(values, used, torch.zeros((), dtype=torch.bool))
    assert torch.equal(used, before[1]) and torch.equal(values.isnan(), before[0].isnan())
    assert torch.equal(values.nan_to_num(), before[0].nan_to_num())


# sampling.sample's fused check: (N, V, block_v), (temperature, top_k), used form
SAMPLE_SHAPES = [(1, 1, 64), (5, 7, 64), (6, 300, 64), (9, 130, 64)]  # one chunk; several, a ragged last one
# (one chunk width, so that a GPU run compiles one sampling variant per top-k setting)
SAMPLE_SETTINGS = [(1.0, None), (0.7, 3), (0.0, None)]  # temperature 0: the flags kernel, no sampling kernel
USED_FORMS = ["none", "mask", "int64-view"]  # every row; a (N,) bool; a strided bool view (as steps.bool_view)


def _used_rows(form, N, g, want_used: bool):
    """``(used, dense)``: the mask passed to sample and the same rows as a contiguous bool (None: every row),
    with at least one row whose flag is ``want_used``."""
    if form == "none":
        return None, None
    live = (torch.rand(N, generator=g) < 0.5).long()
    if not bool((live.bool() == want_used).any()):
        live[0] = int(want_used)
    if form == "int64-view":
        return live.view(torch.bool)[::8], live.bool()
    return live.bool(), live.bool()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN logits
@pytest.mark.parametrize("form", USED_FORMS)
@pytest.mark.parametrize("setting", SAMPLE_SETTINGS, ids=lambda s: f"T{s[0]}-k{s[1]}")
@pytest.mark.parametrize("shape", SAMPLE_SHAPES, ids=lambda s: f"N{s[0]}-V{s[1]}-chunk{s[2]}")
@pytest.mark.parametrize("poison", POISONS)
def test_sample_flags_rows_as_flag_nonfinite(poison, shape, setting, form):
    """sample(..., used=, flag=) sets the flag exactly as ``reference.flag_nonfinite`` (from its row totals, without
    a second read) and samples the same tokens as without a flag; a poisoned used row and an unused one."""
    N, V, block_v = shape
    temperature, top_k = setting
    if top_k is not None and top_k > V:
        top_k = V
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        logits = _values((N, V), "strided" if seed == 1 else "contiguous", torch.float32, g)
        u = torch.rand(N, generator=g)
        want_used = form == "none" or seed != 1  # seed 1 poisons an unused row
        used, dense = _used_rows(form, N, g, want_used)
        rows = (torch.ones(N, dtype=torch.bool) if dense is None else dense == want_used).nonzero()[:, 0]
        _poison(logits, int(rows[seed % rows.numel()]), V // 2 if seed else V - 1, poison)
        want = _reference_flag(logits, dense, torch.zeros((), dtype=torch.bool))
        assert bool(want) == (poison in BAD and want_used)
        dev = [None if t is None else t.to(DEVICE) for t in (logits, u, used)]
        flag = torch.zeros((), dtype=torch.bool, device=DEVICE)
        tok, logp = sampling.sample(dev[0], dev[1], temperature, top_k, block_v=block_v, used=dev[2], flag=flag)
        assert bool(flag) == bool(want), f"seed {seed}"
        plain_tok, plain_logp = sampling.sample(dev[0], dev[1], temperature, top_k, block_v=block_v)
        assert torch.equal(tok, plain_tok)
        torch.testing.assert_close(logp, plain_logp, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_sample_never_clears_the_flag(temperature):
    logits, u = torch.randn(4, 20).to(DEVICE), torch.rand(4).to(DEVICE)
    flag = torch.ones((), dtype=torch.bool, device=DEVICE)
    sampling.sample(logits, u, temperature, used=torch.ones(4, dtype=torch.bool, device=DEVICE), flag=flag)
    assert bool(flag)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(used=torch.ones(2, dtype=torch.bool)), ValueError, "used is only read with a flag"),
    (dict(flag=torch.zeros(())), ValueError, "flag must be a \\(\\) bool"),
    (dict(flag=True), TypeError, "flag must be a torch.Tensor"),
    (dict(used=torch.ones(3, dtype=torch.bool), flag=FLAG), ValueError, "used must be None or a \\(2,\\) bool"),
    (dict(used=torch.ones(2), flag=FLAG), ValueError, "used must be None or a \\(2,\\) bool"),
    (dict(used=[True, True], flag=FLAG), TypeError, "used must be None or a torch.Tensor"),
], ids=["used-without-flag", "flag-float", "flag-bool", "used-shape", "used-float", "used-list"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_sample_rejects_bad_flag_arguments(kwargs, error, match, backend):
    from sigmafast import kernels

    with pytest.raises(error, match=match):
        kernels.sample(torch.zeros(2, 3), torch.rand(2), 1.0, backend=backend, **kwargs)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN logits
def test_draft_flags_its_used_rows_only():
    """steps.draft checks the draft logits of the used slots (fused into its sampling) and no others."""
    from types import SimpleNamespace

    from sigmafast import steps

    B, R, V = 2, 4, 11
    logits = torch.randn(B, R, V, device=DEVICE)
    used = torch.tensor([[True, True, False, False], [True, False, False, False]], device=DEVICE)
    slots = steps.Slots(torch.arange(R, device=DEVICE).expand(B, R), torch.rand(B, R, device=DEVICE), used,
                        used.sum(1), torch.arange(R, device=DEVICE).expand(B, 1, R))
    got = []
    for b, r in ((0, 2), (1, 0)):  # an unused slot, then a used one
        bad = logits.clone()
        bad[b, r, 3] = float("nan")
        session = SimpleNamespace(draft=lambda positions, x=bad: x, backend="triton",
                                  nonfinite=torch.zeros((), dtype=torch.bool, device=DEVICE))
        with torch.no_grad():
            steps.draft(session, slots, 1.0, None)
        got.append(bool(session.nonfinite))
    assert got == [False, True]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN logits
@pytest.mark.parametrize("scoring", ["logits", "hidden", "hidden-fused"])
@pytest.mark.parametrize("where", ["used-step", "past-length", "none"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_acceptance_flags_a_non_finite_verifier_row_of_a_used_step(backend, where, scoring):
    """acceptance(..., flag=) and acceptance_from_hidden(..., flag=): a NaN in the verifier row of a step below
    its row's length sets the flag (on both backends), one past it does not, and the decisions are unchanged."""
    from sigmafast import kernels

    B, O, R, V, C = 2, 3, 5, 40, 16
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(B, O, R, C, generator=g), torch.randn(V, C, generator=g) * 0.3
    drafts = torch.randint(0, V, (B, O, R), generator=g)
    draft_logp, u = -torch.rand(B, O, R, generator=g) * 3, torch.rand(B, O, R, generator=g)
    lengths = torch.tensor([R, 3])
    if where != "none":
        hidden[1, 2, 1 if where == "used-step" else 4, 7] = float("nan")
    dev = [t.to(DEVICE) for t in (hidden, weight, drafts, draft_logp, u, lengths)]
    flag = torch.zeros((), dtype=torch.bool, device=DEVICE)
    if scoring.startswith("hidden"):
        fused = {"scoring": "fused"} if scoring == "hidden-fused" else {}
        call = lambda **kw: kernels.acceptance_from_hidden(*dev, 0.9, None, "paper", backend=backend,  # noqa
                                                           **fused, **kw)
    else:
        logits = dev[0] @ dev[1].T  # (B, O, R, V)
        call = lambda **kw: kernels.acceptance(logits, *dev[2:], 0.9, None, "paper", backend=backend, **kw)  # noqa
    res = call(flag=flag)
    assert bool(flag) == (where == "used-step")
    plain = call()
    for name in plain._fields:
        torch.testing.assert_close(getattr(res, name), getattr(plain, name), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_acceptance_flag_needs_a_temperature(backend):
    from sigmafast import kernels

    x = torch.zeros(1, 1, 2, 5)
    args = (torch.zeros(1, 1, 2, dtype=torch.long), torch.zeros(1, 1, 2), torch.rand(1, 1, 2), torch.tensor([2]))
    with pytest.raises(ValueError, match="flag needs temperature > 0"):
        kernels.acceptance(x, *args, 0.0, flag=torch.zeros((), dtype=torch.bool), backend=backend)
    with pytest.raises(ValueError, match="flag must be a \\(\\) bool"):
        kernels.acceptance(x, *args, 1.0, flag=torch.zeros(()), backend=backend)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN hidden states
@pytest.mark.parametrize("step", ["used", "padding"])
@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampled", "greedy"])
def test_burst_step_flags_a_non_finite_verifier_row(step, temperature):
    """burst_step on the Triton path: a NaN verifier hidden state at a used step sets the status flag (by the
    decisions' kernel; greedy: by flag_nonfinite), one at a padded step past the remaining count does not."""
    from sigmafast import steps
    from sigmafast.engine import NeuralSession
    from sigmafast.request import draw_burst

    T = 6
    model = tiny_model(5, T, seed=2, std=0.5, dtype=torch.float32).to(DEVICE)
    known = torch.zeros(2, T, dtype=torch.bool, device=DEVICE)
    known[:, :3] = True  # 3 remaining positions per row in a bucket of R = T: steps 3.. are padding
    session = NeuralSession(model, 2, T, "triton")
    real = session.verify

    def poisoned(orders, drafts):
        out = real(orders, drafts)
        out.hidden[1, 0, 1 if step == "used" else 4, 2] = float("nan")
        return out

    with torch.no_grad():
        session.prefill(torch.zeros(2, T, dtype=torch.long, device=DEVICE), known)
        session.verify = poisoned  # the burst's verification only
        _, _, status = steps.burst_step(session, draw_burst(torch.Generator().manual_seed(0), 2, 2, T, DEVICE), T,
                                        temperature, None, "paper")
    assert int(status[2]) == (step == "used")


@pytest.mark.parametrize("args,error,match", [
    ((torch.zeros(2, 3).numpy(), None, FLAG), TypeError, "values must be a"),
    ((torch.zeros(2, 3, dtype=torch.float64), None, FLAG), ValueError, "values must be a"),
    ((torch.zeros(2, 0), None, FLAG), ValueError, "values must be a .* N >= 1"),
    ((torch.zeros(2, 3), [True, False], FLAG), TypeError, "used must be None or a torch.Tensor"),
    ((torch.zeros(2, 3), torch.ones(2), FLAG), ValueError, "used must be None or a bool tensor"),
    ((torch.zeros(2, 3), torch.ones(3, dtype=torch.bool), FLAG), ValueError, "used must be .* broadcastable"),
    ((torch.zeros(2, 3), torch.ones(1, 2, dtype=torch.bool), FLAG), ValueError, "used must be .* broadcastable"),
    ((torch.zeros(2, 3), None, False), TypeError, "flag must be a torch.Tensor"),
    ((torch.zeros(2, 3), None, torch.zeros(1, dtype=torch.bool)), ValueError, "flag must be a \\(\\) bool"),
    ((torch.zeros(2, 3), None, torch.zeros(())), ValueError, "flag must be a \\(\\) bool"),
], ids=["values-not-tensor", "values-float64", "values-empty-rows", "used-list", "used-float", "used-shape",
        "used-more-dims", "flag-bool", "flag-shape", "flag-float"])
def test_flag_nonfinite_rejects_bad_inputs(args, error, match):
    with pytest.raises(error, match=match):
        flags.flag_nonfinite(*args)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on a NaN model's logits
@pytest.mark.parametrize("broken", [False, True], ids=["finite-model", "nan-model"])
def test_steps_flag_on_the_triton_path(broken):
    """burst_step's status and ar_step's plan flag through the Triton ops: 1 exactly for a NaN model."""
    from sigmafast import steps
    from sigmafast.engine import NeuralSession
    from sigmafast.request import draw, draw_burst

    T = 6
    model = tiny_model(5, T, seed=2, std=0.5, dtype=torch.float32).to(DEVICE)
    if broken:
        with torch.no_grad():
            model.h[0].mlp.c_fc.weight.fill_(float("nan"))
    known = torch.zeros(2, T, dtype=torch.bool, device=DEVICE)
    known[0, :2] = True
    session = NeuralSession(model, 2, T, "triton")
    with torch.no_grad():
        session.prefill(torch.zeros(2, T, dtype=torch.long, device=DEVICE), known)
        _, n, status = steps.burst_step(session, draw_burst(torch.Generator().manual_seed(0), 2, 2, T, DEVICE), T,
                                        1.0, None, "paper")
    left = (~session.known).sum(1).cpu()
    assert status.tolist() == [int(left.max()), int((left > 0).sum()), int(broken)]
    session = NeuralSession(model, 2, T, "triton")
    with torch.no_grad():
        session.prefill(torch.zeros(2, T, dtype=torch.long, device=DEVICE), known)
        visit = torch.arange(T, device=DEVICE).expand(2, T)
        plan = steps.ar_plan(visit, draw(torch.Generator().manual_seed(1), (2, T), DEVICE), known.sum(1))
        steps.ar_step(session, plan, 1.0, None)
    assert bool(plan.nonfinite) == broken
