"""Triton commit (kernels/commit_step.py) against kernels/reference.py.

Both write a session's buffers in place, so each case builds one random state
(canvas, known mask, last token and position, caches holding NaN past the
valid lengths, lens) and two copies of it, commits with each implementation,
and compares every buffer exactly: the commit only moves values. The caches'
scratch slot (where the reference sends the rejected steps) is excluded.
"""

from __future__ import annotations

import pytest
import torch

from helpers import inner_strided, triton_device
from sigmafast.kernels import commit_step
from sigmafast.kernels import reference as ref

DEVICE = triton_device()
T = 40  # canvas length; caches hold T + 1 slots

# (n_layer, B, O, H, R, D, lens kind, n kind, keys layout)
CASES = [
    (1, 1, 1, 1, 1, 16, "empty", "all", "contiguous"),  # one step, empty cache
    (2, 3, 1, 2, 1, 16, "ragged", "mixed", "contiguous"),  # autoregressive: n in {0, 1}
    (2, 3, 5, 4, 17, 64, "ragged", "mixed", "shared"),  # several orders, odd R
    (3, 2, 4, 2, 33, 24, "ragged", "all", "shared"),  # non-power-of-two head dim, n > BLOCK_R
    (1, 4, 3, 3, 16, 32, "full", "mixed", "contiguous"),  # lens + n reaches the cache end
    (2, 2, 2, 2, 8, 16, "ragged", "none", "shared"),  # nothing accepted
    (2, 3, 5, 4, 17, 64, "ragged", "mixed-strided", "shared"),  # choice and n strided views (a packed plan)
    (2, 3, 3, 2, 9, 32, "ragged", "mixed", "keys-contiguous"),  # keys and values of different strides
]


def _ids(case) -> str:
    nl, B, O, H, R, D, lens, n, layout = case
    return f"L{nl}-B{B}-O{O}-H{H}-R{R}-D{D}-{lens}-n_{n}-{layout}"


def _state(case, seed: int, dtype: torch.dtype):
    nl, B, O, H, R, D, lens_kind, n_kind, layout = case
    g = torch.Generator().manual_seed(seed)
    if lens_kind == "empty":
        lens = torch.zeros(B, dtype=torch.long)
    elif lens_kind == "full":
        lens = torch.full((B,), T - R, dtype=torch.long)
    else:
        lens = torch.randint(0, T - R + 1, (B,), generator=g)
        lens[0] = 0
    if n_kind == "all":
        n = torch.full((B,), R, dtype=torch.long)
    elif n_kind == "none":
        n = torch.zeros(B, dtype=torch.long)
    else:
        n = torch.randint(0, R + 1, (B,), generator=g)
        n[0], n[-1] = 0, R
    orders = torch.rand(B, O, T, generator=g).argsort(-1)[..., :R]  # (B, O, R) a view: inner stride 1
    choice = torch.randint(0, O, (B,), generator=g)
    if n_kind.endswith("strided"):  # every other element of a (B, 2) buffer holding -1 elsewhere
        n, choice = (torch.stack([t, torch.full_like(t, -1)], dim=1)[:, 0] for t in (n, choice))
    tokens = torch.randint(0, 1000, (B, R), generator=g)
    if layout == "shared":  # views of an (n_layer, B, O, R, 3C) projection buffer, as NeuralSession.verify makes
        qkv = torch.randn(nl, B, O, R, 3 * H * D, generator=g).to(dtype)
        kv = qkv[..., H * D:].unflatten(-1, (2, H, D)).permute(4, 0, 1, 2, 5, 3, 6)
        keys, values = kv[0], kv[1]
    elif layout == "keys-contiguous":  # the values a view of the projection buffer, each read with its strides
        qkv = torch.randn(nl, B, O, R, 3 * H * D, generator=g).to(dtype)
        keys = torch.randn(nl, B, O, H, R, D, generator=g).to(dtype)
        values = qkv[..., 2 * H * D:].unflatten(-1, (H, D)).transpose(3, 4)
    else:
        keys, values = (torch.randn(nl, B, O, H, R, D, generator=g).to(dtype) for _ in range(2))
    slot = torch.arange(T + 1)[None, None, None, :, None]
    caches = []
    for _ in range(2):
        c = torch.randn(nl, B, H, T + 1, D, generator=g).to(dtype)
        caches.append(c.masked_fill(slot >= lens[None, :, None, None, None], float("nan")))
    state = dict(canvas=torch.randint(0, 1000, (B, T), generator=g), known=torch.rand(B, T, generator=g) < 0.3,
                 last_tok=torch.randint(0, 1000, (B,), generator=g), last_pos=torch.randint(0, T, (B,), generator=g),
                 k_cache=caches[0], v_cache=caches[1], lens=lens)
    args = (orders, choice, n, tokens, keys, values)
    return tuple(t.to(DEVICE) for t in args), {k: t.to(DEVICE) for k, t in state.items()}


def _copy(state: dict) -> dict:
    return {k: t.clone() for k, t in state.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_commit_matches_reference(case, dtype):
    for seed in range(2):
        args, state = _state(case, seed, dtype)
        before = _copy(state)
        want, got = _copy(state), _copy(state)
        ref.commit(*args, **want)
        commit_step.commit(*args, **got)
        for name in ("canvas", "known", "last_tok", "last_pos", "lens"):
            assert torch.equal(got[name].cpu(), want[name].cpu()), name
        for name in ("k_cache", "v_cache"):  # NaN past the lengths must stay where nothing was written
            torch.testing.assert_close(got[name][..., :T, :].cpu(), want[name][..., :T, :].cpu(), rtol=0, atol=0,
                                       equal_nan=True, msg=name)
        n = args[2]
        assert torch.equal(got["lens"], before["lens"] + n)
        moved = n > 0
        assert torch.equal(got["last_tok"][~moved], before["last_tok"][~moved])


@pytest.mark.parametrize("bad", [False, True], ids=["finite", "flagged"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_commit_writes_the_burst_status(case, bad, monkeypatch):
    """With a status, the commit's kernels also write the burst status of the known mask after it (not the
    reference's op): against the reference, and independently counted. The status starts above any count
    (a count not zeroed shows); the other buffers are written as without a status."""
    for seed in range(2):
        args, state = _state(case, seed, torch.float32)
        if seed == 1:  # only the positions this commit writes are unknown: every row finishes, counts of 0
            orders, choice, n = (t.cpu() for t in args[:3])
            known = torch.ones_like(state["known"], device="cpu")
            for b in range(known.shape[0]):
                known[b, orders[b, choice[b], :n[b]]] = False
            state["known"] = known.to(DEVICE)
        flag = torch.tensor(bad, device=DEVICE)
        plain, want, got = _copy(state), _copy(state), _copy(state)
        s_want, s_got = (torch.tensor([10**6, 10**6, 7], device=DEVICE) for _ in range(2))
        ref.commit(*args, **want, flag=flag, status=s_want)
        with monkeypatch.context() as m:
            m.setattr(commit_step.reference, "burst_status", None)
            commit_step.commit(*args, **got, flag=flag, status=s_got)
        commit_step.commit(*args, **plain)
        left = (~want["known"]).sum(1).cpu()
        assert s_want.tolist() == [int(left.max()), int((left > 0).sum()), int(bad)]
        assert torch.equal(s_got.cpu(), s_want.cpu()), f"seed {seed}: {s_got.tolist()} != {s_want.tolist()}"
        for name in plain:
            torch.testing.assert_close(got[name], plain[name], rtol=0, atol=0, equal_nan=True, msg=name)


def test_commit_writes_the_status_of_an_empty_batch():
    args, state = _state((1, 1, 1, 1, 1, 16, "empty", "all", "contiguous"), 0, torch.float32)
    args = tuple(t[:, :0] if i in (4, 5) else t[:0] for i, t in enumerate(args))
    state = {k: t[:, :0] if k.endswith("cache") else t[:0] for k, t in state.items()}
    status = torch.full((3,), 9, device=DEVICE)
    commit_step.commit(*args, **state, flag=torch.tensor(True, device=DEVICE), status=status)
    assert status.tolist() == [0, 0, 1]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_commit_splices_in_the_residual_token(case):
    """With a residual token and its step per row (the lossless rule's draw at its first rejected step), the
    step's token is the residual one when the step is below n (the last token too when it is step n - 1),
    and nothing else changes: against the reference, and independently. Half the rows put it at step n - 1,
    the others anywhere in [0, R + 1]."""
    for seed in range(3):
        args, state = _state(case, seed, torch.float32)
        orders, choice, n, tokens = args[:4]
        B, O, R = orders.shape
        g = torch.Generator().manual_seed(seed + 20)
        step = torch.where(torch.rand(B, generator=g) < 0.5, (n.cpu() - 1).clamp_min(0),
                           torch.randint(0, R + 2, (B,), generator=g)).to(DEVICE)
        residual = torch.randint(1000, 2000, (B,), generator=g).to(DEVICE)
        if seed == 2:  # every other element of a (B, 2) buffer holding garbage elsewhere
            step, residual = (torch.stack([t, torch.full_like(t, -5)], dim=1)[:, 0] for t in (step, residual))
        plain, want, got = _copy(state), _copy(state), _copy(state)
        ref.commit(*args, **want, residual=residual, residual_step=step)
        commit_step.commit(*args, **got, residual=residual, residual_step=step)
        ref.commit(*args, **plain)
        for name in ("canvas", "known", "last_tok", "last_pos", "lens"):
            assert torch.equal(got[name].cpu(), want[name].cpu()), name
        for name in ("k_cache", "v_cache"):
            torch.testing.assert_close(got[name][..., :T, :].cpu(), plain[name][..., :T, :].cpu(), rtol=0, atol=0,
                                       equal_nan=True, msg=name)
        pos = ref.chosen_order(orders, choice).gather(1, step.clamp(max=R - 1)[:, None]).squeeze(1)
        rows = torch.arange(B, device=DEVICE)
        hit = step < n
        assert torch.equal(got["canvas"][rows, pos][hit], residual[hit])
        expect = plain["canvas"].clone()
        expect[rows[hit], pos[hit]] = residual[hit]
        assert torch.equal(got["canvas"], expect)
        last = hit & (step == n - 1)
        assert torch.equal(got["last_tok"], torch.where(last, residual, plain["last_tok"]))


@pytest.mark.parametrize("case", [c for c in CASES if c[2] > 1], ids=_ids)
def test_commit_reads_the_chosen_orders_tokens_from_every_orders(case):
    """(B, O, R) tokens (the paper rule passes every order's): row b commits those of order ``choice[b]``,
    as with the chosen (B, R) rows; also from a strided view."""
    args, state = _state(case, 0, torch.float32)
    orders, choice, n, _, keys, values = args
    B, O, R = orders.shape
    g = torch.Generator().manual_seed(5)
    every = torch.randint(0, 1000, (B, O, 2 * R), generator=g).to(DEVICE)[..., ::2]  # (B, O, R) strided
    chosen = every.gather(1, choice[:, None, None].expand(B, 1, R)).squeeze(1)
    want = _copy(state)
    ref.commit(orders, choice, n, chosen, keys, values, **want)
    for impl in (ref.commit, commit_step.commit):
        got = _copy(state)
        impl(orders, choice, n, every, keys, values, **got)
        for name in ("canvas", "known", "last_tok", "last_pos", "lens"):
            assert torch.equal(got[name].cpu(), want[name].cpu()), name


def test_commit_writes_the_chosen_rows_where_the_reference_says():
    """An independent check of the reference itself on a hand-made case: row 0 keeps 2 steps of order 1,
    row 1 none."""
    nl, B, O, H, R, D = 1, 2, 2, 1, 3, 16
    orders = torch.tensor([[[0, 1, 2], [4, 2, 3]], [[1, 0, 2], [3, 4, 0]]])
    keys = torch.arange(nl * B * O * H * R * D, dtype=torch.float32).view(nl, B, O, H, R, D)
    state = dict(canvas=torch.zeros(B, 5, dtype=torch.long), known=torch.zeros(B, 5, dtype=torch.bool),
                 last_tok=torch.tensor([7, 8]), last_pos=torch.tensor([9, 9]),
                 k_cache=torch.zeros(nl, B, H, 6, D), v_cache=torch.zeros(nl, B, H, 6, D), lens=torch.tensor([1, 2]))
    args = (orders, torch.tensor([1, 0]), torch.tensor([2, 0]), torch.tensor([[11, 12, 13], [14, 15, 16]]), keys, -keys)
    for impl in (ref.commit, commit_step.commit):
        s = {k: t.clone().to(DEVICE) for k, t in state.items()}
        impl(*(t.to(DEVICE) for t in args), **s)
        s = {k: t.cpu() for k, t in s.items()}
        assert s["canvas"].tolist() == [[0, 0, 12, 0, 11], [0, 0, 0, 0, 0]]
        assert s["known"].tolist() == [[False, False, True, False, True], [False] * 5]
        assert s["last_tok"].tolist() == [12, 8] and s["last_pos"].tolist() == [2, 9]
        assert s["lens"].tolist() == [3, 2]
        assert torch.equal(s["k_cache"][0, 0, 0, 1:3], keys[0, 0, 1, 0, :2])
        assert torch.equal(s["v_cache"][0, 0, 0, 1:3], -keys[0, 0, 1, 0, :2])
        assert s["k_cache"][0, 0, 0, 0].eq(0).all() and s["k_cache"][0, 1, :, :5].eq(0).all()


@pytest.mark.parametrize("bad,match", [
    (dict(choice=torch.zeros(3, dtype=torch.long)), "choice must be"),
    (dict(n=torch.zeros(2)), "n must be"),
    (dict(tokens=torch.zeros(2, 4, dtype=torch.long)), "tokens must be"),
    (dict(tokens=torch.zeros(2, 3, 3, dtype=torch.long)), "tokens must be"),
    (dict(canvas=torch.zeros(2, 9, dtype=torch.int32)), "canvas must be"),
    (dict(known=torch.zeros(2, 9)), "known must be"),
    (dict(keys=torch.zeros(1, 2, 2, 1, 4, 8)), "keys must be"),
    (dict(v_cache=torch.zeros(1, 2, 1, 16, 10).transpose(-1, -2)), "k_cache and v_cache"),
    (dict(last_pos=torch.zeros(2, dtype=torch.int32)), "last_pos must be int64"),
    (dict(canvas=torch.zeros(2, 18, dtype=torch.long)[:, ::2]), r"canvas must have unit stride along T"),
    (dict(known=torch.zeros(2, 18, dtype=torch.bool)[:, ::2]), r"known must have unit stride along T"),
    (dict(orders=torch.zeros(2, 2, 0, dtype=torch.long)), r"orders must have at least one slot"),
    (dict(last_tok=torch.zeros(2, 2, dtype=torch.long)[:, 1]), "last_tok must be contiguous"),
    (dict(lens=torch.zeros(2, 2, dtype=torch.long)[:, 0]), "lens must be contiguous"),
    (dict(flag=torch.zeros((), dtype=torch.bool)), "flag and status must be given together"),
    (dict(status=torch.zeros(3, dtype=torch.long)), "flag and status must be given together"),
    (dict(flag=torch.zeros(()), status=torch.zeros(3, dtype=torch.long)), "flag must be"),
    (dict(flag=torch.zeros((), dtype=torch.bool), status=torch.zeros(3)), "status must be a contiguous"),
    (dict(flag=torch.zeros((), dtype=torch.bool), status=torch.zeros(4, dtype=torch.long)), "status must be"),
    (dict(flag=torch.zeros((), dtype=torch.bool), status=torch.zeros(6, dtype=torch.long)[::2]), "status must be"),
    (dict(residual=torch.zeros(2, dtype=torch.long)), "residual and residual_step must be given together"),
    (dict(residual=torch.zeros(2), residual_step=torch.zeros(2, dtype=torch.long)), "residual must be"),
    (dict(residual=torch.zeros(2, dtype=torch.int32), residual_step=torch.zeros(2, dtype=torch.long)),
     "residual must be int64"),
    (dict(residual=torch.zeros(2, dtype=torch.long), residual_step=torch.zeros(3, dtype=torch.long)),
     "residual_step must be"),
])
def test_commit_rejects_bad_inputs(bad, match):
    B, O, R, D, T_ = 2, 2, 3, 16, 9
    args = dict(orders=torch.zeros(B, O, R, dtype=torch.long), choice=torch.zeros(B, dtype=torch.long),
                n=torch.ones(B, dtype=torch.long), tokens=torch.zeros(B, R, dtype=torch.long),
                keys=torch.zeros(1, B, O, 1, R, D), values=torch.zeros(1, B, O, 1, R, D))
    state = dict(canvas=torch.zeros(B, T_, dtype=torch.long), known=torch.zeros(B, T_, dtype=torch.bool),
                 last_tok=torch.zeros(B, dtype=torch.long), last_pos=torch.zeros(B, dtype=torch.long),
                 k_cache=torch.zeros(1, B, 1, T_ + 1, D), v_cache=torch.zeros(1, B, 1, T_ + 1, D),
                 lens=torch.zeros(B, dtype=torch.long))
    for k, v in bad.items():
        (args if k in args else state)[k] = v
    with pytest.raises(ValueError, match=match):
        commit_step.commit(*args.values(), **state)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_commit_status_counts_rows_with_exactly_one_position_left(case, monkeypatch):
    """Rows left with 0, 1 and 2 unknown positions after the commit: the status counts the rows with one or
    more (a row with one left dropped from the batch would never finish)."""
    args, state = _state(case, 1, torch.float32)
    orders, choice, n = (t.cpu() for t in args[:3])
    known = torch.ones_like(state["known"], device="cpu")
    for b in range(known.shape[0]):
        known[b, orders[b, choice[b], :n[b]]] = False  # written by this commit
        spare = [t for t in range(known.shape[1]) if known[b, t]][: b % 3]  # then b % 3 positions stay unknown
        known[b, spare] = False
    state["known"] = known.to(DEVICE)
    flag = torch.tensor(False, device=DEVICE)
    want, got = _copy(state), _copy(state)
    s_want, s_got = (torch.tensor([10**6, 10**6, 7], device=DEVICE) for _ in range(2))
    ref.commit(*args, **want, flag=flag, status=s_want)
    with monkeypatch.context() as m:
        m.setattr(commit_step.reference, "burst_status", None)
        commit_step.commit(*args, **got, flag=flag, status=s_got)
    left = (~want["known"]).sum(1).cpu()
    assert s_want.tolist() == [int(left.max()), int((left > 0).sum()), 0]
    assert torch.equal(s_got.cpu(), s_want.cpu()), f"{s_got.tolist()} != {s_want.tolist()}"


@pytest.mark.parametrize("case", CASES[:3], ids=_ids)
def test_commit_reads_keys_and_values_strided_along_the_head_dim(case):
    args, state = _state(case, 0, torch.float32)
    orders, choice, n, tokens, keys, values = args
    want, got = _copy(state), _copy(state)
    ref.commit(*args, **want)
    commit_step.commit(orders, choice, n, tokens, inner_strided(keys), inner_strided(values), **got)
    for name in ("k_cache", "v_cache"):
        torch.testing.assert_close(got[name][..., :T, :].cpu(), want[name][..., :T, :].cpu(), rtol=0, atol=0,
                                   equal_nan=True, msg=name)


def test_commit_into_a_cache_whose_layer_stride_passes_int32():
    """A KV cache of (n_layer, B, H, L + 1, D) whose layer stride B·H·(L + 1)·D is 2^31 elements or more (a small
    model sampling a large batch: 4 layers, C = 128, B = 4096, L = 4096 is 2^31 + 2^19 per layer, 34 GB of
    bf16 caches). The launcher passes each stride in units of 16 (2^27, an int32 argument); multiplied back in
    int32 it wrapped to -2^31, and layer 1's keys went 2^31 elements before layer 0, here onto the start of the
    buffer (zeros that must stay zeros). 8 GiB of address space, of which only a few rows' pages are touched."""
    S, L1, D = 1 << 31, 4, 16
    dtype = torch.float16
    buf = torch.empty(2 * S + 2 * L1 * D, dtype=dtype, device=DEVICE)  # k and v interleaved: layer l at (l + 1) S
    buf[:2 * L1 * D].zero_()
    for layer in (S, 2 * S):
        buf[layer:layer + 2 * L1 * D].zero_()
    k_cache, v_cache = (buf.as_strided((2, 1, 1, L1, D), (S, L1 * D, L1 * D, D, 1), S + i * L1 * D) for i in (0, 1))
    g = torch.Generator().manual_seed(5)
    keys = (torch.randn(2, 1, 1, 1, 2, D, generator=g) + 2).to(dtype).to(DEVICE)  # (n_layer, B, O, H, R, D)
    values = -keys
    state = dict(canvas=torch.zeros(1, 3, dtype=torch.long, device=DEVICE),
                 known=torch.zeros(1, 3, dtype=torch.bool, device=DEVICE),
                 last_tok=torch.zeros(1, dtype=torch.long, device=DEVICE),
                 last_pos=torch.zeros(1, dtype=torch.long, device=DEVICE),
                 k_cache=k_cache, v_cache=v_cache, lens=torch.ones(1, dtype=torch.long, device=DEVICE))
    args = (torch.tensor([[[2, 0]]], device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE),
            torch.full((1,), 2, dtype=torch.long, device=DEVICE), torch.tensor([[5, 6]], device=DEVICE), keys, values)
    commit_step.commit(*args, **state)
    for layer in (0, 1):
        assert torch.equal(k_cache[layer, 0, 0, 1:3].cpu(), keys[layer, 0, 0, 0].cpu()), layer
        assert torch.equal(v_cache[layer, 0, 0, 1:3].cpu(), values[layer, 0, 0, 0].cpu()), layer
        assert k_cache[layer, 0, 0, 0].eq(0).all() and v_cache[layer, 0, 0, 3].eq(0).all()
    assert buf[:2 * L1 * D].eq(0).all(), "a layer's rows written 2^31 elements before it"
