"""Triton accept/reject decisions (kernels/decide.py) against ``reference.decide``: bit-identical.

The kernel computes nothing after the reference's own ratio but comparisons
and integer logic, so every field of the result must be equal, not close.
Outputs come pre-filled with garbage (``poisoned_empty``). The cases cover
more than one tile of orders (16) and of steps (128), ragged lengths with 0
and R, ties between orders, both rules, greedy decisions and float32 uniforms.
"""

from __future__ import annotations

import pytest
import torch

from helpers import inner_strided, on_triton_device, triton_device
from sigmafast.kernels import decide as decide_module
from sigmafast.kernels import reference as ref

decide = on_triton_device(decide_module.decide)

# (B, O, R, lengths kind)
CASES = [
    (1, 1, 1, "full"),
    (3, 5, 17, "ragged"),
    (2, 20, 300, "ragged"),  # two order tiles, three step tiles
    (4, 3, 128, "zero"),  # one exact step tile; nothing valid
    (5, 17, 40, "full"),
]


def _ids(case) -> str:
    B, O, R, kind = case
    return f"B{B}-O{O}-R{R}-{kind}"


def _inputs(case, seed, greedy=False, u_dtype=torch.float64):
    B, O, R, kind = case
    g = torch.Generator().manual_seed(seed)
    lengths = {"full": torch.full((B,), R), "zero": torch.zeros(B, dtype=torch.long),
               "ragged": torch.randint(0, R + 1, (B,), generator=g)}[kind]
    if kind == "ragged":
        lengths[0] = R
    drafts = torch.randint(0, 3, (B, O, R), generator=g)
    draft_logp = -torch.rand(B, O, R, generator=g) * 2
    uniforms = torch.rand(B, O, R, generator=g, dtype=torch.float64).to(u_dtype)
    if greedy:  # the verifier agrees with the draft 95% of the time: long prefixes, some ties
        agree = torch.rand(B, O, R, generator=g) < 0.95
        scores = torch.where(agree, drafts, (drafts + 1) % 3)
    else:  # q/p near 1 mostly: long prefixes; some orders copied, so that orders tie
        scores = (draft_logp + torch.randn(B, O, R, generator=g) * 0.05 + 0.02).float()
        if O > 2:
            scores[:, 2] = scores[:, 1]
            uniforms[:, 2] = uniforms[:, 1]
    return scores, drafts, draft_logp, uniforms, lengths


@pytest.mark.parametrize("rule", ["paper", "lossless"])
@pytest.mark.parametrize("mode", ["sample", "greedy", "float32-uniforms"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_decide_matches_reference_exactly(case, mode, rule, poisoned_empty):
    greedy = mode == "greedy"
    temperature = 0.0 if greedy else 0.9
    n_seen = set()
    for seed in range(3):
        args = _inputs(case, seed, greedy, torch.float32 if mode == "float32-uniforms" else torch.float64)
        got = decide(*args, temperature, rule)
        want = ref.decide(*args, temperature, rule)
        for name in want._fields:
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        n_seen.update(want.n_accept.flatten().tolist())
    if case[3] != "zero" and case[2] > 1:
        assert len(n_seen) > 2, "the cases should give prefixes of several lengths"


def test_decide_hand_made_case():
    """The reference's semantics on one row checked by hand: the longest prefix wins, the first on ties."""
    u = torch.tensor([[[0.1, 0.9, 0.1], [0.1, 0.1, 0.9], [0.1, 0.1, 0.9], [0.9, 0.1, 0.1]]], dtype=torch.float64)
    logq = torch.log(torch.full((1, 4, 3), 0.5))
    args = (logq, torch.zeros(1, 4, 3, dtype=torch.long), torch.zeros(1, 4, 3), u, torch.tensor([3]))
    for impl in (decide, ref.decide):
        paper = impl(*args, 1.0, "paper")
        assert paper.n_accept.tolist() == [[1, 2, 2, 3]] and paper.best.tolist() == [3]
        lossless = impl(*args, 1.0, "lossless")
        assert lossless.n_accept.tolist() == [[1, 2, 2, 0]] and lossless.best.tolist() == [1]
        assert lossless.accept[0, 3].tolist() == [False, True, True]


def test_other_score_dtypes_take_the_reference():
    args = _inputs((2, 3, 9, "ragged"), 0)
    scores64 = args[0].double()
    got = decide_module.decide(scores64, *args[1:], 0.9, "paper")
    want = ref.decide(scores64, *args[1:], 0.9, "paper")
    assert got.logq.dtype == torch.float64 and torch.equal(got.n_accept, want.n_accept)


def test_a_uniform_equal_to_the_ratio_rejects():
    """u < q/p is strict: a uniform that equals the ratio exactly (in float32) rejects, in both."""
    g = torch.Generator().manual_seed(1)
    logq, logp = -torch.rand(2, 3, 6, generator=g), -torch.rand(2, 3, 6, generator=g)
    u = torch.exp(logq - logp).clamp(max=0.5).double()  # exactly the float32 ratio where it is < 0.5
    args = (logq, torch.zeros(2, 3, 6, dtype=torch.long), logp, u, torch.tensor([6, 6]))
    want = ref.decide(*args, 1.0, "lossless")
    got = decide(*args, 1.0, "lossless")
    assert not want.accept[u < 0.5].any() and torch.equal(got.accept, want.accept)


@pytest.mark.parametrize("rule", ["paper", "lossless"])
@pytest.mark.parametrize("where", ["valid-step", "past-length", "both-inf", "none"])
@pytest.mark.parametrize("case", CASES[1:3], ids=_ids)
def test_decide_flags_nan_ratios_of_valid_steps(case, where, rule, poisoned_empty):
    """With a flag, the kernel sets it exactly as ``reference.flag_nan_ratios`` (a NaN q/p at a step below
    the row's length: NaN log q, or log q = log p = -inf), and decides as without one."""
    B, O, R, _ = case
    for seed in range(2):
        scores, drafts, draft_logp, uniforms, lengths = _inputs(case, seed)
        lengths[-1] = R - 2  # row B - 1 has two steps past its length
        o, r = O - 1, {"past-length": R - 1}.get(where, R // 2)
        if where in ("valid-step", "past-length"):
            scores[B - 1, o, r] = float("nan")
        elif where == "both-inf":
            scores[B - 1, o, r] = draft_logp[B - 1, o, r] = float("-inf")
        scores[0, 0, 0] = float("-inf")  # a zero ratio is not flagged
        want_flag = torch.zeros((), dtype=torch.bool)
        ref.flag_nan_ratios(scores, draft_logp, lengths, want_flag)
        assert bool(want_flag) == (where in ("valid-step", "both-inf"))
        device = triton_device()
        args = [t.to(device) for t in (scores, drafts, draft_logp, uniforms, lengths)]
        flag = torch.zeros((), dtype=torch.bool, device=device)
        flagged = decide_module.decide(*args, 0.9, rule, flag)
        assert bool(flag) == bool(want_flag)
        want = ref.decide(scores, drafts, draft_logp, uniforms, lengths, 0.9, rule)
        for got in (flagged, decide_module.decide(*args, 0.9, rule)):  # with the flag, and without
            for name in want._fields:
                torch.testing.assert_close(getattr(got, name).cpu(), getattr(want, name), rtol=0, atol=0,
                                           equal_nan=True, msg=name)


def test_decide_never_clears_the_flag():
    args = [t.to(triton_device()) for t in _inputs((3, 5, 17, "ragged"), 0)]
    flag = torch.ones((), dtype=torch.bool, device=args[0].device)
    decide_module.decide(*args, 0.9, "paper", flag)
    assert bool(flag)


def _view(t, fill, kind, device):
    """``t``'s values in a view on ``device`` with other strides than a contiguous (B, O, R) tensor's: every
    other order of a wider buffer, or steps padded to R + 3; the buffer's other elements are ``fill``."""
    B, O, R = t.shape
    if kind == "every-other-order":
        full = torch.full((B, 2 * O, R), fill, dtype=t.dtype, device=device)
        full[:, ::2] = t.to(device)
        return full[:, ::2]
    full = torch.full((B, O, R + 3), fill, dtype=t.dtype, device=device)
    full[..., :R] = t.to(device)
    return full[..., :R]


@pytest.mark.parametrize("mode", ["sample", "greedy"])
@pytest.mark.parametrize("case", CASES[1:3], ids=_ids)
def test_decide_reads_each_input_with_its_own_strides(case, mode, poisoned_empty):
    """Uniforms, drafts and greedy scores as views of wider buffers (whose other elements would flip the
    decisions: uniforms 0, drafts and scores -1): the kernel reads each with its own strides."""
    greedy = mode == "greedy"
    temperature = 0.0 if greedy else 0.9
    device = triton_device()
    for seed in range(2):
        scores, drafts, draft_logp, uniforms, lengths = _inputs(case, seed, greedy)
        want = ref.decide(scores, drafts, draft_logp, uniforms, lengths, temperature, "lossless")
        views = (_view(scores, -1 if greedy else 0.0, "padded-steps", device),
                 _view(drafts, -1, "every-other-order", device), draft_logp.to(device),
                 _view(uniforms, 0.0, "every-other-order" if seed else "padded-steps", device), lengths.to(device))
        got = decide_module.decide(*views, temperature, "lossless")
        for name in want._fields:
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name


@pytest.mark.parametrize("mode", ["sample", "greedy"])
@pytest.mark.parametrize("case", CASES[1:3], ids=_ids)
def test_decide_reads_inputs_strided_along_the_steps(case, mode, poisoned_empty):
    greedy = mode == "greedy"
    temperature = 0.0 if greedy else 0.9
    scores, drafts, draft_logp, uniforms, lengths = _inputs(case, 0, greedy)
    want = ref.decide(scores, drafts, draft_logp, uniforms, lengths, temperature, "lossless")
    dev = triton_device()
    got = decide_module.decide(inner_strided(scores), inner_strided(drafts), draft_logp.to(dev),
                               inner_strided(uniforms), lengths.to(dev), temperature, "lossless")
    for name in want._fields:
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
