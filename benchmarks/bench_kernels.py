"""Kernels: each Triton kernel against its PyTorch reference and SDPA, on CUDA.

Every case checks the implementation against the fp32 reference before timing,
then reports in ``benchmark.extra_info``: ms per call (CUDA events, L2 flushed
between calls, compile time excluded by a warm-up call), the minimum DRAM bytes
the op must move, GB/s, and the fraction of the card's measured device-to-device
copy bandwidth, with NVML readings. Inputs are bf16, GPT-2 small heads (H=12, D=64).

* burst: B=8 rows, R=16 queries each, cache L in {4096, 16384}; SDPA gets the
  cache and the R own keys concatenated with a mask (a copy per call).
* verify: O=5 orders of R=64 tokens over a shared L=4096 prefix; SDPA gets the
  prefix repeated per order (the traffic the Triton kernel avoids).
* small-model attention: one layer of a ``small`` burst iteration (H=4, D=32, R=256, 136 cached keys),
  burst and verify, with 1, 2 or 4 KV splits forced beside the automatic choice.
* top-k threshold: the k-th largest of 8 or 1280 rows (radix select against ``torch.topk``).
* sublayer end: a narrow model's (C = 128) MLP or projection end with the next QKV projection, the one
  ``kernels/linear_norm.py`` kernel against cuBLAS matmuls and the add + LayerNorm kernel, 64 to 10240 rows.
* acceptance / sample / residual: B·O·R verifier rows of a 50257-token vocabulary; the bytes counted are
  one read of each logit tensor (q, and p for the residual), the least any implementation must move;
  acceptance_from_hidden: the same from (B, O, R, C) hidden states and the LM head, C = 768 and 128.
  ``triton-tiles`` runs the same Triton kernels with one program per vocabulary tile instead of the
  persistent streaming programs.

Each case is timed eagerly (``ms``: Python's launch cost included, which dominates the small attention
cases) and replayed as a CUDA graph (``graph_ms``: the device time, as in the engine's captured steps),
both by ``triton.testing.do_bench``, whose L2 flush writes a 256 MB buffer; and the graph once more with
L2 flushed by reading one (``graph_read_flushed_ms``), so that the call does not also write back the
flush's dirty lines.

Skipped with a reason without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _common import bench_full, device_info
from _timing import copy_bandwidth_gbps, graph_timings
from sigmafast.kernels import reference as ref
from sigmafast.kernels import reference_layers as ref_layers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="kernel benchmarks need a CUDA device")

H, D, DTYPE, VOCAB = 12, 64, torch.bfloat16, 50257


@pytest.fixture(scope="module")
def copy_gbps() -> float:
    return copy_bandwidth_gbps()


def _run(benchmark, fn, nbytes: int, copy_gbps: float, **info) -> None:
    from triton.testing import do_bench

    fn()  # compile outside the timings
    torch.cuda.synchronize()
    ms = do_bench(fn, warmup=10, rep=100)
    graph_ms, clean_ms, graph_error = graph_timings(fn)
    gbps = nbytes / ms / 1e6
    graph_gbps = None if graph_ms is None else nbytes / graph_ms / 1e6
    clean_gbps = None if clean_ms is None else nbytes / clean_ms / 1e6
    benchmark.extra_info.update(
        ms=ms, bytes=nbytes, gbps=gbps, copy_gbps=copy_gbps, fraction_of_copy_bw=gbps / copy_gbps,
        graph_ms=graph_ms, graph_gbps=graph_gbps, graph_error=graph_error,
        graph_fraction_of_copy_bw=None if graph_gbps is None else graph_gbps / copy_gbps,
        graph_read_flushed_ms=clean_ms,
        graph_read_flushed_fraction_of_copy_bw=None if clean_gbps is None else clean_gbps / copy_gbps,
        **info, **device_info(torch.device("cuda")),
    )
    benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=20, iterations=1, warmup_rounds=2)


def _rel_err(out, want) -> float:
    return ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _sdpa_burst(q, k, v, kc, vc, lens):
    B, _, R, _ = q.shape
    L = kc.shape[2]
    keys, vals = torch.cat([kc, k], 2), torch.cat([vc, v], 2)  # (B, H, L + R, D)
    cache_ok = torch.arange(L, device=q.device)[None, :] < lens[:, None]  # (B, L)
    self_ok = torch.eye(R, dtype=torch.bool, device=q.device)
    mask = torch.cat([cache_ok[:, None, :].expand(B, R, L), self_ok.expand(B, R, R)], -1)[:, None]
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)


def _sdpa_verify(q, k, v, kc, vc, lens):
    B, O, _, R, _ = q.shape
    L = kc.shape[2]
    keys = torch.cat([kc[:, None].expand(B, O, H, L, D), k], 3).flatten(0, 1)  # prefix repeated per order
    vals = torch.cat([vc[:, None].expand(B, O, H, L, D), v], 3).flatten(0, 1)
    cache_ok = (torch.arange(L, device=q.device)[None, :] < lens[:, None])[:, None, :].expand(B, R, L)
    causal = torch.ones(R, R, dtype=torch.bool, device=q.device).tril().expand(B, R, R)
    mask = torch.cat([cache_ok, causal], -1)[:, None, None].expand(B, O, 1, R, L + R).flatten(0, 1)
    return F.scaled_dot_product_attention(q.flatten(0, 1), keys, vals, attn_mask=mask).unflatten(0, (B, O))


BURST_L = [4096, 16384, 65536] if bench_full() else [4096, 16384]


@pytest.mark.parametrize("impl", ["triton", "reference", "sdpa"])
@pytest.mark.parametrize("L", BURST_L, ids=lambda L: f"L{L}")
def test_burst_attention(benchmark, impl, L, copy_gbps):
    from sigmafast.kernels.attention import burst_attention

    B, R = 8, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, R, D, device="cuda", generator=g, dtype=DTYPE) for _ in range(3))
    kc, vc = (torch.randn(B, H, L, D, device="cuda", generator=g, dtype=DTYPE) for _ in range(2))
    lens = torch.full((B,), L, device="cuda")
    fn = {"triton": burst_attention, "reference": ref.burst_attention, "sdpa": _sdpa_burst}[impl]
    args = (q, k, v, kc, vc, lens)
    err = _rel_err(fn(*args), ref.burst_attention(*(t.float() for t in args[:5]), lens))
    assert err < 3e-2, f"{impl} is wrong before timing: rel. error {err:.2e}"
    nbytes = (2 * B * H * L * D + 4 * B * H * R * D) * q.element_size()
    _run(benchmark, lambda: fn(*args), nbytes, copy_gbps, impl=impl, op="burst_attention", B=B, H=H, R=R, L=L, D=D,
         rel_err=err)


@pytest.mark.parametrize("splits", [1, 2, 4, 6, 8, 16], ids=lambda s: f"splits{s}")
def test_burst_attention_splits(benchmark, splits, copy_gbps):
    """The burst case at L = 4096 (short of its 60% target) with fixed KV split counts, beside the automatic
    choice of ``test_burst_attention``: which count the card prefers."""
    from sigmafast.kernels.attention import cascade_attention

    B, R, L = 8, 16, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, R, D, device="cuda", generator=g, dtype=DTYPE) for _ in range(3))
    kc, vc = (torch.randn(B, H, L, D, device="cuda", generator=g, dtype=DTYPE) for _ in range(2))
    lens = torch.full((B,), L, device="cuda")
    args = (q, k, v, kc, vc, lens)
    err = _rel_err(cascade_attention(*args, num_splits=splits), ref.burst_attention(*(t.float() for t in args)))
    assert err < 3e-2, f"{splits} splits are wrong before timing: rel. error {err:.2e}"
    nbytes = (2 * B * H * L * D + 4 * B * H * R * D) * q.element_size()
    _run(benchmark, lambda: cascade_attention(*args, num_splits=splits), nbytes, copy_gbps, impl="triton",
         op="burst_attention_splits", B=B, H=H, R=R, L=L, D=D, splits=splits, rel_err=err)


@pytest.mark.parametrize("splits", [None, 1, 2, 4], ids=lambda s: f"splits{s or '-auto'}")
@pytest.mark.parametrize("kind", ["burst", "verify"])
def test_small_model_attention(benchmark, kind, splits, copy_gbps):
    """One layer's attention in a ``small`` burst iteration (B = 1, H = 4, D = 32, R = 256 remaining of a
    272-token canvas, half of it cached; 5 orders to verify): a few dozen programs with a handful of key tiles
    each, bound by latency rather than bandwidth (the H200 profile put 8 such calls at 89.5 us per
    iteration). Which KV split count the card prefers there; the automatic choice never splits a cache
    under 2 x ``utils.min_split_keys`` keys."""
    from sigmafast.kernels.attention import cascade_attention

    B, Hs, Ds, R, L, O = 1, 4, 32, 256, 272, 5
    g = torch.Generator(device="cuda").manual_seed(2)
    shape = (B, Hs, R, Ds) if kind == "burst" else (B, O, Hs, R, Ds)
    q, k, v = (torch.randn(shape, device="cuda", generator=g, dtype=DTYPE) for _ in range(3))
    kc, vc = (torch.randn(B, Hs, L, Ds, device="cuda", generator=g, dtype=DTYPE) for _ in range(2))
    lens = torch.full((B,), L // 2, device="cuda")
    args = (q, k, v, kc, vc, lens)
    want = (ref.burst_attention if kind == "burst" else ref.verify_attention)(*(t.float() for t in args[:5]), lens)
    err = _rel_err(cascade_attention(*args, num_splits=splits), want)
    assert err < 3e-2, f"{kind} attention with {splits} splits is wrong before timing: rel. error {err:.2e}"
    nbytes = (2 * B * Hs * (L // 2) * Ds + 4 * q.numel()) * q.element_size()
    _run(benchmark, lambda: cascade_attention(*args, num_splits=splits), nbytes, copy_gbps, impl="triton",
         op=f"small_{kind}_attention", B=B, H=Hs, R=R, L=L // 2, D=Ds, O=O if kind == "verify" else 1,
         splits=splits, rel_err=err)


@pytest.mark.parametrize("impl", ["triton", "reference", "sdpa"])
@pytest.mark.parametrize("R", [16, 64], ids=lambda R: f"R{R}")
def test_verify_attention(benchmark, impl, R, copy_gbps):
    from sigmafast.kernels.attention import verify_attention

    B, O, L = 4, 5, 4096
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, O, H, R, D, device="cuda", generator=g, dtype=DTYPE) for _ in range(3))
    kc, vc = (torch.randn(B, H, L, D, device="cuda", generator=g, dtype=DTYPE) for _ in range(2))
    lens = torch.full((B,), L, device="cuda")
    fn = {"triton": verify_attention, "reference": ref.verify_attention, "sdpa": _sdpa_verify}[impl]
    args = (q, k, v, kc, vc, lens)
    err = _rel_err(fn(*args), ref.verify_attention(*(t.float() for t in args[:5]), lens))
    assert err < 3e-2, f"{impl} is wrong before timing: rel. error {err:.2e}"
    nbytes = (2 * B * H * L * D + 4 * B * O * H * R * D) * q.element_size()  # prefix read once
    _run(benchmark, lambda: fn(*args), nbytes, copy_gbps, impl=impl, op="verify_attention", B=B, O=O, H=H, R=R,
         L=L, D=D, rel_err=err, prefix_bytes_repeated=O * 2 * B * H * L * D * q.element_size())


def _logits(N: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(N, VOCAB, device="cuda", generator=g) * 3).to(DTYPE)


def _stream_layout(impl: str, monkeypatch) -> str:
    """``triton-tiles``: the Triton kernels with one program per vocabulary tile instead of the persistent
    streaming programs (``vocab.PERSISTENT``), to compare the two layouts on the same card; ``triton-rows``:
    the residual's two passes over each row in one program (``residual_rows.ROWS``)."""
    if impl == "triton-tiles":
        from sigmafast.kernels import vocab

        monkeypatch.setattr(vocab, "PERSISTENT", False)
        return "triton"
    if impl == "triton-rows":
        from sigmafast.kernels import residual_rows

        monkeypatch.setattr(residual_rows, "ROWS", True)
        return "triton"
    return impl


@pytest.mark.parametrize("impl", ["triton", "triton-tiles", "reference"])
@pytest.mark.parametrize("top_k", [None, 50], ids=lambda k: f"topk{k}")
def test_acceptance(benchmark, impl, top_k, copy_gbps, monkeypatch):
    from sigmafast.kernels.accept import acceptance

    layout, impl = impl, _stream_layout(impl, monkeypatch)

    B, O, R = 4, 5, 64
    logits = _logits(B * O * R, 2).view(B, O, R, VOCAB)
    g = torch.Generator(device="cuda").manual_seed(3)
    drafts = logits.float().argmax(-1)
    draft_logp = torch.full((B, O, R), -1.0, device="cuda")
    u = torch.rand(B, O, R, device="cuda", generator=g)
    lengths = torch.full((B,), R, device="cuda")
    fn = {"triton": acceptance, "reference": ref.acceptance}[impl]
    args = (logits, drafts, draft_logp, u, lengths, 1.0, top_k, "paper")
    want = ref.log_probs(logits.float(), 1.0, top_k).gather(-1, drafts[..., None]).squeeze(-1)
    err = (fn(*args).logq.float() - want).abs().max().item()
    assert err < 5e-2, f"{impl} log q is off before timing: {err:.2e}"
    _run(benchmark, lambda: fn(*args), logits.numel() * logits.element_size(), copy_gbps, impl=layout,
         op="acceptance", rows=B * O * R, V=VOCAB, top_k=top_k, logq_abs_err=err)


@pytest.mark.parametrize("impl", ["triton", "triton-tiles", "radix", "reference"])
@pytest.mark.parametrize("rows", [8, 1280], ids=lambda n: f"rows{n}")
def test_topk_threshold(benchmark, impl, rows, copy_gbps, monkeypatch):
    """The k-th largest logit per row (k = 50): the chunk-max prefilter (kernels/topk.py; ``triton-tiles``:
    its chunk maxima one program per tile) and the radix select (2 passes over bf16) against ``torch.topk``;
    the bytes counted are one read of the logits."""
    from sigmafast.kernels.radix import radix_kth_largest
    from sigmafast.kernels.topk import kth_largest

    layout, impl = impl, _stream_layout(impl, monkeypatch)
    logits = _logits(rows, 7)
    fn = {"triton": lambda: kth_largest(logits, 50), "radix": lambda: radix_kth_largest(logits, 50),
          "reference": lambda: ref.kth_largest(logits, 50)}[impl]
    assert torch.equal(fn().float(), ref.kth_largest(logits, 50).float()), f"{impl} threshold differs from topk"
    _run(benchmark, fn, logits.numel() * logits.element_size(), copy_gbps, impl=layout, op="topk_threshold",
         rows=rows, V=VOCAB, top_k=50)


@pytest.mark.parametrize("impl", ["triton", "triton-tiles", "triton-rows", "reference"])
@pytest.mark.parametrize("op", ["sample", "residual_sample"])
def test_sampling(benchmark, impl, op, copy_gbps, monkeypatch):
    from sigmafast.kernels import sampling

    if impl == "triton-rows" and op == "sample":
        pytest.skip("the rows layout is the residual's alone")
    layout, impl = impl, _stream_layout(impl, monkeypatch)

    N = 1024
    q = _logits(N, 4)
    p = (q.float() + torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5)))
    p = p.to(DTYPE)
    u = torch.rand(N, device="cuda", generator=torch.Generator(device="cuda").manual_seed(6))
    if impl == "reference":  # the reference in fp32 on the same rounded logits (a bf16 softmax is not one)
        q, p = q.float(), p.float()
    if op == "sample":
        fn = {"triton": sampling.sample, "reference": ref.sample}[impl]
        args, passes = (q, u, 1.0, None), 1
        tokens = fn(*args)[0]
        want = ref.sample(q.float(), u, 1.0, None)[0]
    else:
        fn = {"triton": sampling.residual_sample, "reference": ref.residual_sample}[impl]
        args, passes = (q, p, u, 1.0, None), 2
        tokens = fn(*args)
        want = ref.residual_sample(q.float(), p.float(), u, 1.0, None)
    agree = (tokens == want).float().mean().item()
    assert agree > 0.95, f"{impl} {op} agrees with the fp32 reference on only {agree:.1%} of rows"
    _run(benchmark, lambda: fn(*args), passes * q.numel() * q.element_size(), copy_gbps, impl=layout, op=op,
         rows=N, V=VOCAB, dtype=str(q.dtype), agreement_with_fp32_reference=agree, passes_over_logits=passes)


@pytest.mark.parametrize("impl", ["fused", "matmul-chunks", "matmul-chunks-padded", "matmul+triton",
                                  "matmul+reference"])
@pytest.mark.parametrize("C", [768, 128], ids=lambda c: f"C{c}")
def test_acceptance_from_hidden(benchmark, impl, C, copy_gbps):
    """Scoring drafts from hidden states: the LM head fused into the acceptance log-sum-exp (no logits
    written), cuBLAS over row chunks feeding the log q kernel (the engine's default), and the whole
    logits materialised then scored by the kernel or the reference. C = 128 (the ``small`` preset's width)
    is where the fused kernel should win: its compute is 6x smaller while the logits' traffic is the same."""
    from sigmafast.kernels.accept import acceptance, acceptance_from_hidden

    B, O, R = 4, 5, 64
    g = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(B, O, R, C, device="cuda", generator=g).to(DTYPE)
    weight = (torch.randn(VOCAB, C, device="cuda", generator=g) * 0.05).to(DTYPE)
    drafts = torch.randint(0, VOCAB, (B, O, R), device="cuda", generator=g)
    padded_weight = torch.cat([weight, weight.new_zeros(-VOCAB % 64, C)])  # 50304 rows: aligned logits
    rest = (torch.full((B, O, R), -10.0, device="cuda"), torch.rand(B, O, R, device="cuda", generator=g),
            torch.full((B,), R, device="cuda"))
    fn = {
        "fused": lambda: acceptance_from_hidden(hidden, weight, drafts, *rest, scoring="fused"),
        "matmul-chunks": lambda: acceptance_from_hidden(hidden, weight, drafts, *rest, scoring="matmul"),
        "matmul-chunks-padded": lambda: acceptance_from_hidden(hidden, padded_weight, drafts, *rest,
                                                               scoring="matmul", vocab_size=VOCAB),
        "matmul+triton": lambda: acceptance(hidden @ weight.T, drafts, *rest),
        "matmul+reference": lambda: ref.acceptance(hidden @ weight.T, drafts, *rest),
    }[impl]
    want = ref.log_probs(hidden.float() @ weight.float().T, 1.0, None).gather(-1, drafts[..., None]).squeeze(-1)
    err = (fn().logq.float() - want).abs().max().item()
    assert err < 0.1, f"{impl} log q is off before timing: {err:.2e}"
    nbytes = (hidden.numel() + weight.numel()) * hidden.element_size()
    flops = 2 * B * O * R * VOCAB * C
    _run(benchmark, fn, nbytes, copy_gbps, impl=impl, op="acceptance_from_hidden", rows=B * O * R, C=C, V=VOCAB,
         logq_abs_err=err, flops=flops, logits_bytes_avoided=B * O * R * VOCAB * hidden.element_size())


@pytest.mark.parametrize("impl", ["triton", "cublas"])
@pytest.mark.parametrize("rows", [64, 320, 1280, 10240], ids=lambda n: f"rows{n}")
@pytest.mark.parametrize("end", ["mlp", "projection"])
def test_sublayer_end(benchmark, impl, rows, end, copy_gbps):
    """A narrow model's sublayer end with the next block's QKV projection (C = 128, the ``small`` preset):
    the one-kernel ``kernels/linear_norm.py`` against the engine's default layout (``fused_ends=False``:
    cuBLAS matmuls, the GELU, the add + LayerNorm kernel and the next projection). Rows: a burst's draft
    (64), a verify pass at B = 1 and R = 64 or 256 (320, 1280), and at B = 8 and R = 256 (10240)."""
    from sigmafast.kernels import add_layer_norm, linear_norm

    C, g = 128, torch.Generator(device="cuda").manual_seed(3)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(DTYPE)

    x, h = rand(rows, C), rand(rows, C)
    fc_w, fc_b, proj_w, proj_b = rand(4 * C, C, scale=C**-0.5), rand(4 * C), rand(C, 4 * C, scale=0.05), rand(C)
    nw, nb, qkv_w, qkv_b = rand(C) + 1, rand(C), rand(3 * C, C, scale=C**-0.5), rand(3 * C)
    out = torch.empty(rows, 3 * C, device="cuda", dtype=DTYPE)
    mlp = end == "mlp"
    w, b = (proj_w, proj_b) if mlp else (proj_w[:, :C].contiguous(), proj_b)

    def fused():
        if mlp:
            return linear_norm.mlp_add_norm(x, h, fc_w, fc_b, w, b, nw, nb, next_weight=qkv_w, next_bias=qkv_b,
                                            next_out=out)
        return linear_norm.linear_add_norm(x, h, w, b, nw, nb, next_weight=qkv_w, next_bias=qkv_b, next_out=out)

    def unfused():
        y = F.linear(F.gelu(F.linear(h, fc_w, fc_b)), w, b) if mlp else F.linear(h, w, b)
        s, hn = add_layer_norm(x, y, nw, nb, backend="triton")
        torch.addmm(qkv_b, hn, qkv_w.t(), out=out)
        return s, hn

    fn = fused if impl == "triton" else unfused
    f32 = [t.float() for t in (x, h, fc_w, fc_b, w, b, nw, nb)]
    want_s, want_h = (ref_layers.mlp_add_norm(*f32) if mlp else ref_layers.linear_add_norm(f32[0], f32[1], *f32[4:]))
    s, hn = fn()
    err = max(_rel_err(s, want_s), _rel_err(hn, want_h), _rel_err(out, want_h @ qkv_w.float().t() + qkv_b.float()))
    assert err < 0.05, f"{impl} {end} end is off before timing: {err:.2e}"
    weights = (fc_w.numel() + w.numel() if mlp else w.numel()) + qkv_w.numel()
    nbytes = (weights + rows * (2 + 2 + 3) * C) * x.element_size()  # weights; x, h in; s, h, qkv out
    flops = 2 * rows * C * ((8 * C if mlp else C) + 3 * C)
    _run(benchmark, fn, nbytes, copy_gbps, impl=impl, op=f"{end}_end", rows=rows, C=C, rel_err=err, flops=flops)
