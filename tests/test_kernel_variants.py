"""Compile-once: every Triton kernel compiles at most two variants per dtype and model.

Nothing compiles in the interpreter, so :func:`helpers.count_variants` records the key
Triton's JIT would compute at each launch (constexprs, the specialisation of the other
arguments, launch options). The first tests prove that the counter sees what it should (a
constexpr taken from a size, a size Triton specialises, a misaligned pointer); the others
run the kernels over many shapes and ``sigmafast.generate`` over varied calls.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from helpers import count_variants, on_triton_device, spec_key, tiny_model, triton_device

import sigmafast
from sigmafast import kernels
from sigmafast.kernels import accept, attention, sampling

MAX_VARIANTS = 2
DEVICE = triton_device()  # the interpreter on CPU; compiled (the same keys, really compiled) on a GPU
acceptance = on_triton_device(accept.acceptance)
acceptance_from_hidden = on_triton_device(accept.acceptance_from_hidden)
burst_attention = on_triton_device(attention.burst_attention)
verify_attention = on_triton_device(attention.verify_attention)
residual_sample = on_triton_device(sampling.residual_sample)
sample = on_triton_device(sampling.sample)


@triton.jit
def _toy_copy(X, Y, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + o, tl.load(X + o, mask=o < N), mask=o < N)


@triton.jit(do_not_specialize=["N"])
def _toy_copy_dns(X, Y, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + o, tl.load(X + o, mask=o < N), mask=o < N)


def _copy(kernel, n, block=None, offset=0, **options):
    x = torch.arange(n + offset, dtype=torch.float32, device=DEVICE)[offset:]
    y = torch.empty(n, device=DEVICE)
    block = block or triton.next_power_of_2(n)
    kernel[(triton.cdiv(n, block),)](x, y, n, BLOCK=block, **options)
    assert torch.equal(x, y)


def test_counter_sees_size_dependent_constexprs_and_specialisation():
    with count_variants() as v:
        for n in (3, 16, 17, 40):  # BLOCK from the size: 4, 16, 32, 64
            _copy(_toy_copy, n)
    assert v.counts() == {"_toy_copy": 4} and v.launches == {"_toy_copy": 4}
    with count_variants() as v:
        for n in (1, 5, 16, 33, 48, 7):  # fixed BLOCK; N == 1, N % 16 == 0 and the rest: 3 keys
            _copy(_toy_copy, n, block=16)
    assert v.counts() == {"_toy_copy": 3}
    with count_variants() as v:
        for n in (1, 5, 16, 33, 48, 7):
            _copy(_toy_copy_dns, n, block=16)
    assert v.counts() == {"_toy_copy_dns": 1}
    with count_variants() as v:
        _copy(_toy_copy_dns, 20, block=16)
        _copy(_toy_copy_dns, 20, block=16, offset=1)  # a 4-byte aligned pointer
        _copy(_toy_copy_dns, 20, block=16, num_warps=2)  # launch options are in the key
    assert v.counts() == {"_toy_copy_dns": 3}
    with count_variants() as v:  # restored on exit: nothing recorded after the block
        pass
    _copy(_toy_copy, 9)
    assert v.counts() == {}


def test_spec_key_mirrors_triton():
    native = getattr(pytest.importorskip("triton._C.libtriton"), "native_specialize_impl", None)
    if native is None:
        pytest.skip("this triton has no native_specialize_impl")
    from triton.backends.compiler import BaseBackend

    t = torch.zeros(8)
    values = [0, 1, 2, 16, -16, 17, 2**31 - 1, 2**31, -2**31 - 1, 2**63, 1.5, 1e300, True, None, t, t[1:],
              t.long(), t.bool(), t.half()]
    for value in values:
        for specialize in (True, False):
            for align in (True, False):
                want = tuple(native(BaseBackend, value, False, specialize, align))
                assert spec_key(value, specialize, align) == want, (value, specialize, align)


def _assert_bounded(v, expected):
    counts = v.counts()
    assert set(expected) <= set(counts), f"kernels not launched: {set(expected) - set(counts)}"
    over = {name: sorted(map(str, v.keys[name])) for name, n in counts.items() if n > MAX_VARIANTS}
    assert not over, f"more than {MAX_VARIANTS} variants: {over}"


def test_attention_over_shapes():
    """Burst and verify attention at many R, O, B, L and cache lengths, strided projection views,
    forced and automatic KV splits: one variant without splits, one with, per dtype and head dim."""
    g = torch.Generator().manual_seed(0)
    H, D = 2, 16
    with count_variants() as v:
        for i, (B, O, R, L) in enumerate([(1, 1, 1, 8), (2, 3, 5, 40), (3, 2, 17, 70), (1, 5, 64, 33),
                                          (2, 1, 16, 100), (3, 4, 9, 16)]):
            kc, vc = (torch.randn(B, L, H, D, generator=g).transpose(1, 2) for _ in range(2))
            lens = torch.randint(0, L + 1, (B,), generator=g)
            q, k, v_ = (t.permute(0, 2, 3, 1, 4) for t in torch.randn(3, B, R, O, H, D, generator=g))
            splits = None if i % 2 else i % 4 + 1
            verify_attention(q, k, v_, kc, vc, lens, num_splits=splits)
            qkv = torch.randn(B, R, 3 * H * D, generator=g)  # a fused projection, as in the model
            q, k, v_ = (t.view(B, R, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=-1))
            burst_attention(q, k, v_, kc, vc, lens, num_splits=splits)
            burst_attention(q.contiguous(), k, v_, kc.contiguous(), vc, lens, num_splits=splits)
    _assert_bounded(v, ["_cascade_attn_kernel", "_combine_kernel"])
    assert v.counts()["_combine_kernel"] == 1


def test_vocabulary_ops_over_row_counts():
    """Sampling, residual, acceptance and the fused LM head at many row counts (and views) for one V."""
    g = torch.Generator().manual_seed(1)
    V, C = 7, 32
    weight = torch.randn(V, C, generator=g)
    with count_variants() as v:
        for B, O, R in [(1, 1, 1), (2, 3, 5), (3, 1, 16), (1, 5, 13), (2, 2, 32)]:
            N = B * O * R
            logits = torch.randn(B, O, R, V, generator=g)
            rows, u = logits.view(N, V), torch.rand(N, generator=g)
            for top_k in (None, 3):
                sample(rows, u, 0.9, top_k)
                sample(logits[:, 0, 0], u[:B], 0.9, top_k)  # a strided view of rows
                residual_sample(rows, rows.flip(0), u, 0.9, top_k)
            drafts = torch.randint(0, V, (B, O, R), generator=g)
            dl, ua, lens = torch.full((B, O, R), -1.0), torch.rand(B, O, R, generator=g), torch.full((B,), R)
            accept.topk_logq(rows, drafts.view(-1), 0.9, 2, None, 2, chunks_per_k=1)  # CUDA's top-k log q
            for temperature, top_k in ((1.0, None), (0.8, 2), (0.0, None)):
                acceptance(logits, drafts, dl, ua, lens, temperature, top_k)
                for scoring in kernels.checks.SCORINGS:
                    acceptance_from_hidden(torch.randn(B, O, R, C, generator=g), weight, drafts, dl, ua, lens,
                                           temperature, top_k, scoring=scoring)
    _assert_bounded(v, ["_chunk_stats_kernel", "_residual_mass_kernel", "_sample_kernel", "_residual_kernel",
                        "_logq_finish_kernel", "_draft_argmax_kernel", "_lm_head_stream_kernel",
                        "_lm_head_finish_kernel", "_topk_logq_kernel"])


def _infill(B, T, n_known, seed):
    g = torch.Generator().manual_seed(seed)
    known = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):  # ragged: a different number of known positions per row, anywhere
        known[b, torch.randperm(T, generator=g)[: n_known[b]]] = True
    return torch.randint(0, 7, (B, T), generator=g), known


@pytest.mark.parametrize("options", [{}, {"fused_ends": True}, {"scoring": "fused"}],
                         ids=["defaults", "fused-ends", "fused-scoring"])
@pytest.mark.parametrize("pos_encoding", ["sinusoidal", "rope-v"])
def test_generate_compiles_each_kernel_at_most_twice(pos_encoding, options):
    """Many ``generate`` calls on one fp32 model: batch sizes 1-3, prompt lengths, ragged infilling,
    paper (1 and 3 orders) and lossless rules, top-k, greedy, autoregressive; R takes many values,
    and caches over 32 keys split the KV. With rope-v the layers' rotations are kernels too; with
    ``fused_ends`` the sublayer ends are one kernel each; with the fused scoring the LM head's log q
    (greedy and not) is the stream kernel's."""
    model = tiny_model(vocab_size=7, block_size=40, dtype=torch.float32, pos_encoding=pos_encoding).to(DEVICE)
    engine = sigmafast.Engine(model, **options)
    fused_ends = options.get("fused_ends", False)
    g = torch.Generator().manual_seed(0)
    calls = [
        (torch.randint(0, 7, (1, 2), generator=g), None, 10, dict(acceptance="paper", num_orders=3)),
        (torch.randint(0, 7, (2, 30), generator=g), None, 10, dict(acceptance="paper", num_orders=1)),
        (torch.randint(0, 7, (3, 5), generator=g), None, 9, dict(acceptance="lossless", num_orders=1, top_k=4)),
        (*_infill(2, 20, [3, 11], seed=1), None, dict(acceptance="paper", num_orders=3)),
        (*_infill(3, 36, [30, 33, 34], seed=2), None, dict(acceptance="lossless", num_orders=1)),
        (torch.randint(0, 7, (2, 3), generator=g), None, 8, dict(temperature=0.0, acceptance="paper", num_orders=2)),
        (torch.randint(0, 7, (3, 1), generator=g), None, 6, dict(strategy="autoregressive", temperature=0.8)),
        # R = 32 (a multiple of 16, as every bucket but the cap), one row and one order (N = 1 rows),
        # and autoregressive plans of other batch sizes and lengths (B = 1, T % 16 == 0)
        (torch.randint(0, 7, (2, 8), generator=g), None, 32, dict(acceptance="lossless", num_orders=1)),
        (*_infill(1, 12, [11], seed=3), None, dict(temperature=0.0, acceptance="paper", num_orders=1)),
        (torch.randint(0, 7, (1, 4), generator=g), None, 12, dict(strategy="autoregressive", top_k=3)),
        (torch.randint(0, 7, (2, 0), generator=g), None, 16, dict(strategy="autoregressive")),
    ]

    def run(engine, seed0, extra_rows=0):
        for i, (idx, known, new, kwargs) in enumerate(calls):
            g = torch.Generator(device=DEVICE).manual_seed(seed0 + i)
            if extra_rows:  # other batch sizes: the first row repeated
                idx = torch.cat([idx, idx[:1].expand(extra_rows, -1)])
                known = None if known is None else torch.cat([known, known[:1].expand(extra_rows, -1)])
            idx, known = idx.to(DEVICE), None if known is None else known.to(DEVICE)
            out = sigmafast.generate(engine, idx, new, known=known, generator=g, **kwargs)
            assert out.shape == (idx.shape[0], idx.shape[1] + (new or 0))

    with count_variants() as v, kernels.use_backend("triton"):
        run(engine, 0)
        warm = {name: set(keys) for name, keys in v.keys.items()}
        if not options:  # warm: other seeds, batch sizes and the bucketed shapes (the GPU default) compile nothing
            run(sigmafast.Engine(model, buckets=True), 100, extra_rows=1)
            new_keys = {name: keys - warm.get(name, set()) for name, keys in v.keys.items()}
            assert not any(new_keys.values()), f"new variants once warm: {new_keys}"
    _assert_bounded(v, ["_cascade_attn_kernel", "_combine_kernel", "_chunk_stats_kernel", "_residual_mass_kernel",
                        "_sample_kernel", "_residual_kernel", "_commit_kv_kernel", "_commit_state_kernel",
                        "_decide_kernel", "_feed_embedding_kernel", "_flag_nonfinite_kernel", "_gather_drafts_kernel",
                        "_draft_slots_kernel", "_residual_pick_kernel"]
                    + (["_rotary_kernel"] if pos_encoding == "rope-v" else [])
                    + (["_lm_head_stream_kernel", "_lm_head_finish_kernel"] if "scoring" in options else [])
                    + (["_linear_add_norm_kernel", "_mlp_add_norm_kernel"] if fused_ends
                       else ["_add_layer_norm_kernel"]))
    assert {"_lm_head_finish_kernel", "_logq_finish_kernel"} & set(v.counts()), "no draft was scored"
