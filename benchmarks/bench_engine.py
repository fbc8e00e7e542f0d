"""Engine: compilation on first use, and steady-state decode cost against HF GPT-2 and a plain anchor.

Random-weight models of the ``tiny``, ``small`` and ``gpt2`` presets
(``SigmaGPTConfig.from_preset``), and of ``small`` and ``gpt2`` with ``rope-v``
(``small-rope-v``, ``gpt2-rope-v``: autoregressive and burst at B = 1), bf16 on
CUDA and float32 on CPU:

* ``first-call``: a child process with empty ``TRITON_CACHE_DIR`` and
  ``TORCHINDUCTOR_CACHE_DIR`` builds a ``small`` model and times its first
  burst ``generate`` call (256 new tokens on CUDA, 32 on CPU), then 3 more with
  other seeds, batch sizes and prompt lengths. Per call: seconds, Triton kernel
  variants compiled (``len(fn.device_caches[device][0])`` summed over the
  ``JITFunction`` objects in the modules of ``sigmafast.kernels``: attention,
  utils, accept, sampling and any other) and the entries created in each cache
  directory. On CPU without ``TRITON_INTERPRET=1`` the reference ops run and
  nothing compiles (0 variants); under the interpreter nothing compiles either.
* ``ar-<shape>-B<b>``: ms per token of ``strategy="autoregressive"``,
  ``order="left-to-right"`` (time of one call / new tokens, prompt prefill included).
* ``burst-<shape>-B<b>``: ms per iteration of ``strategy="burst"``,
  ``num_orders=5``, ``acceptance="paper"`` (time / ``stats.iterations.max()``).
  The time includes the prompt's prefill. Random weights give near-uniform
  conditionals that the paper rule accepts in a few iterations (R close to
  the new-token count), so one more, untimed call syncs after every iteration
  (``on_iteration``) and reports the first iteration (with the prefill) and the
  median of the later ones apart; ``later_iterations_ms`` is the timed calls'
  time less that first iteration, per later iteration (unsynced: the timed
  calls sync only on the engine's status reads).
  ``burst-lookahead-<shape>-B<b>``: the same through ``Engine(lookahead=True)``,
  which queues each iteration before reading the previous one's status; ``burst-lossless``: with
  ``generate``'s default rule (one order, lossless: a residual draw per
  iteration); ``ar-inductor`` and
  ``burst-inductor``: through ``Engine(compile_steps="inductor")`` (CUDA only);
  ``ar-fused`` and ``burst-fused``: through ``Engine(fused_ends=True)``, the
  narrow models' one-kernel sublayer ends in place of cuBLAS's matmuls (CUDA,
  ``tiny`` and ``small`` only); ``burst-fused-scoring``: through
  ``Engine(scoring="fused")``, the drafts scored by the LM-head stream kernel
  (``kernels/lm_head.py``) in place of the matmul and log q kernel (CUDA only); ``burst-auto-scoring``:
  through ``Engine(scoring="auto")``, which times both at each burst shape's first run and keeps the faster
  (``scoring_choices`` in the report; CUDA only);
  ``ar-pdl`` and ``burst-pdl``: through ``Engine(pdl=True)``, every Triton kernel launched with
  programmatic dependent launch (sm_90 or later only); ``ar-fused-gelu`` and ``burst-fused-gelu``: through
  ``Engine(fused_gelu=True)``, each MLP's first matmul and GELU as one Triton kernel (CUDA only).
* ``hf-<shape>-B<b>``: HF ``transformers`` ``GPT2LMHeadModel`` greedy
  ``generate`` (eager, no compile), ms per token; skipped without transformers.
* ``anchor-{eager,compiled}-<shape>-B<b>``: the static-KV-cache decoder of
  ``_decoder.py``, greedy, ms per token; ``compiled`` is
  ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), CUDA only.

When the engine offers ``sigmafast.warmup(model, batch_size=, seq_len=, ...)``,
the sigmafast cases warm up through it (``warmup_s``) and time the returned
engine; otherwise they time ``generate(model, ...)`` after one warm-up call.

Sizes: CUDA, prompt 512 + 256 new tokens, GPT-2 vocabulary (50257), batch 1
and 8, 5 rounds. CPU: prompt 16 + 32 new tokens, a 512-token vocabulary, 2
rounds, ``gpt2`` skipped; ``SIGMAFAST_BENCH_FULL=1`` on CPU runs ``gpt2`` and
the GPT-2 vocabulary with prompt 64 + 64 new tokens. Timings are reported in
``benchmark.extra_info``, never asserted.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import sigmafast
from _common import bench_device, bench_full, device_info, synchronize
from _variants import cache_entries, compiled_variants, jit_functions, uses_triton
from sigmafast import SigmaGPT, SigmaGPTConfig

DEVICE = bench_device()
CUDA = DEVICE.type == "cuda"
FULL = bench_full()
DTYPE = torch.bfloat16 if CUDA else torch.float32
VOCAB = 50257 if CUDA or FULL else 512
PROMPT, NEW = (512, 256) if CUDA else (64, 64) if FULL else (16, 32)
ROUNDS = 5 if CUDA or FULL else 2
SHAPES = ["tiny", "small", "gpt2"]
ROPE_SHAPES = ["small-rope-v", "gpt2-rope-v"]  # sigmafast only (the anchors have no RoPE), B = 1, ar and burst
BATCHES = [1, 8]
SAMPLING = dict(temperature=1.0, top_k=None)
STRATEGIES = {
    "ar": dict(strategy="autoregressive", order="left-to-right"),
    "burst": dict(strategy="burst", num_orders=5, acceptance="paper"),
    "ar-inductor": dict(strategy="autoregressive", order="left-to-right"),  # Engine(compile_steps="inductor")
    "burst-inductor": dict(strategy="burst", num_orders=5, acceptance="paper"),
    "burst-lookahead": dict(strategy="burst", num_orders=5, acceptance="paper"),  # Engine(lookahead=True)
    "burst-lossless": dict(strategy="burst", num_orders=1, acceptance="lossless"),  # generate's default rule
    "ar-fused": dict(strategy="autoregressive", order="left-to-right"),  # Engine(fused_ends=True)
    "burst-fused": dict(strategy="burst", num_orders=5, acceptance="paper"),
    "burst-fused-scoring": dict(strategy="burst", num_orders=5, acceptance="paper"),  # Engine(scoring="fused")
    "burst-auto-scoring": dict(strategy="burst", num_orders=5, acceptance="paper"),  # Engine(scoring="auto")
    "ar-pdl": dict(strategy="autoregressive", order="left-to-right"),  # Engine(pdl=True)
    "burst-pdl": dict(strategy="burst", num_orders=5, acceptance="paper"),
    "ar-fused-gelu": dict(strategy="autoregressive", order="left-to-right"),  # Engine(fused_gelu=True)
    "burst-fused-gelu": dict(strategy="burst", num_orders=5, acceptance="paper"),
}
# CUDA only: inductor's compile time is minutes on a small CPU; a burst compiles once per R bucket, so B = 1 only
COMPILED = {"ar-inductor": "inductor", "burst-inductor": "inductor"}
FUSED = ("ar-fused", "burst-fused")  # CUDA only (the Triton path), narrow shapes only (GPT-2 is never fused)
ENGINE_OPTIONS = {**{s: dict(compile_steps=c) for s, c in COMPILED.items()},
                  "burst-lookahead": dict(lookahead=True, buckets=True),  # buckets: CUDA's default, the CPU's too
                  **{s: dict(fused_ends=True) for s in FUSED}, "burst-fused-scoring": dict(scoring="fused"),
                  "burst-auto-scoring": dict(scoring="auto"),
                  "ar-pdl": dict(pdl=True), "burst-pdl": dict(pdl=True),
                  "ar-fused-gelu": dict(fused_gelu=True), "burst-fused-gelu": dict(fused_gelu=True)}
FIRST_CALL = dict(  # shape, new tokens, then (batch, prompt length, seed) per call
    shape="small", new_tokens=256 if CUDA else 32, calls=[(1, 16, 0), (2, 37, 1), (8, 16, 2), (3, 100, 3)],
)
RESULT_TAG = "BENCH_ENGINE_RESULT "


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _skip_shape(shape: str) -> None:
    if shape.startswith("gpt2") and not (CUDA or FULL):
        pytest.skip("gpt2 shape on CPU only with SIGMAFAST_BENCH_FULL=1")


def _config(shape: str) -> SigmaGPTConfig:
    """A preset, or ``<preset>-<pos_encoding>`` (e.g. ``small-rope-v``)."""
    preset, _, encoding = shape.partition("-")
    return SigmaGPTConfig.from_preset(preset, vocab_size=VOCAB, **({"pos_encoding": encoding} if encoding else {}))


_MODELS: dict = {}


def _model(kind: str, shape: str):
    """A random-weight model of ``shape`` ("sigma", "anchor" or "hf"), on DEVICE in DTYPE, built once."""
    key = (kind, shape)
    if key not in _MODELS:
        torch.manual_seed(0)
        c = _config(shape)
        if kind == "sigma":
            model = SigmaGPT(c)
        elif kind == "anchor":
            from _decoder import Decoder

            model = Decoder(c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.block_size)
        else:
            import transformers

            hf = transformers.GPT2Config(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, vocab_size=c.vocab_size,
                                         n_positions=c.block_size, bos_token_id=c.vocab_size - 1,
                                         eos_token_id=c.vocab_size - 1)
            model = transformers.GPT2LMHeadModel(hf)
        _MODELS[key] = model.to(device=DEVICE, dtype=DTYPE).eval()
    return _MODELS[key]


def _prompt(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB - 1, (batch, length), generator=g).to(DEVICE)


def _timed(benchmark, call, rounds: int = ROUNDS) -> tuple[list, object]:
    """Run ``call`` ``rounds`` times under ``benchmark.pedantic``; (seconds per round, last output)."""
    seconds = []

    def run():
        synchronize(DEVICE)
        t0 = time.perf_counter()
        out = call()
        synchronize(DEVICE)
        seconds.append(time.perf_counter() - t0)
        return out

    out = benchmark.pedantic(run, rounds=rounds, iterations=1, warmup_rounds=0)
    return seconds, out


def _case_info(shape: str, batch: int, **extra) -> dict:
    c = _config(shape)
    return dict(shape=shape, n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, vocab_size=c.vocab_size,
                batch_size=batch, prompt_tokens=PROMPT, new_tokens=NEW, dtype=_dtype_name(DTYPE), rounds=ROUNDS,
                **extra, **device_info(DEVICE))


def _check_tokens(out: torch.Tensor, prompt: torch.Tensor, name: str) -> None:
    B, P = prompt.shape
    if out.shape != (B, P + NEW) or not torch.equal(out[:, :P], prompt):
        raise AssertionError(f"{name}: output shape {tuple(out.shape)} or a changed prompt")
    if bool(((out < 0) | (out >= VOCAB)).any()):
        raise AssertionError(f"{name}: ids outside the vocabulary")


# --- first call with an empty Triton cache ------------------------------------------------------------------


def first_call_child() -> dict:
    """Run in a fresh process with empty TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR: time FIRST_CALL's calls."""
    cache_dir, inductor_dir = os.environ["TRITON_CACHE_DIR"], os.environ["TORCHINDUCTOR_CACHE_DIR"]
    model = _model("sigma", FIRST_CALL["shape"])
    synchronize(DEVICE)  # CUDA context and weights outside the timings
    triton = uses_triton(model)
    t0 = time.perf_counter()
    fns = jit_functions() if triton else {}
    result = dict(uses_triton=triton, triton_interpret=os.environ.get("TRITON_INTERPRET") == "1",
                  import_kernels_s=time.perf_counter() - t0, calls=[])
    before, entries, inductor = compiled_variants(fns), cache_entries(cache_dir), cache_entries(inductor_dir)
    for batch, length, seed in FIRST_CALL["calls"]:
        prompt = _prompt(batch, length, seed)
        gen = torch.Generator(DEVICE).manual_seed(seed)
        synchronize(DEVICE)
        t0 = time.perf_counter()
        sigmafast.generate(model, prompt, FIRST_CALL["new_tokens"], generator=gen, **STRATEGIES["burst"], **SAMPLING)
        synchronize(DEVICE)
        seconds = time.perf_counter() - t0
        if triton:
            fns.update(jit_functions())  # modules the call imported itself
        after, now, inductor_now = compiled_variants(fns), cache_entries(cache_dir), cache_entries(inductor_dir)
        new = {k: v - (before.get(k) or 0) for k, v in after.items() if v is not None and v - (before.get(k) or 0)}
        result["calls"].append(dict(batch_size=batch, prompt_tokens=length, seconds=seconds,
                                    variants_compiled=sum(new.values()), new_variants=new,
                                    cache_entries_created=now - entries,
                                    inductor_cache_entries_created=inductor_now - inductor))
        before, entries, inductor = after, now, inductor_now
    result["variants_per_kernel"] = {k: v for k, v in before.items() if v}
    result["unreadable_kernel_caches"] = sorted(k for k, v in before.items() if v is None)
    return result


def test_first_call(benchmark, tmp_path):
    env = dict(os.environ)
    for var, name in (("TRITON_CACHE_DIR", "triton-cache"), ("TORCHINDUCTOR_CACHE_DIR", "inductor-cache")):
        (tmp_path / name).mkdir()
        env[var] = str(tmp_path / name)  # both empty: a cold start, also for anything torch.compile'd
    cmd = [sys.executable, str(Path(__file__).resolve()), "--first-call"]

    def child():
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parent)

    proc = benchmark.pedantic(child, rounds=1, iterations=1, warmup_rounds=0)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"first-call child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    res = json.loads(lines[-1][len(RESULT_TAG):])
    calls = res.pop("calls")
    c = _config(FIRST_CALL["shape"])
    benchmark.extra_info.update(
        kind="first_call", shape=FIRST_CALL["shape"], n_layer=c.n_layer, n_embd=c.n_embd, vocab_size=c.vocab_size,
        new_tokens=FIRST_CALL["new_tokens"], dtype=_dtype_name(DTYPE), **STRATEGIES["burst"],
        first_call_s=calls[0]["seconds"], first_call_variants=calls[0]["variants_compiled"],
        first_call_cache_entries=calls[0]["cache_entries_created"],
        later_calls_s=[x["seconds"] for x in calls[1:]],
        later_calls_variants=[x["variants_compiled"] for x in calls[1:]],
        later_calls_cache_entries=[x["cache_entries_created"] for x in calls[1:]],
        max_variants_per_kernel=max(res["variants_per_kernel"].values(), default=0),
        calls=calls, **res, **device_info(DEVICE),
    )


# --- steady state: sigmafast -----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy,shape,batch", [
    pytest.param(s, m, b, id=f"{s}-{m}-B{b}") for s in STRATEGIES for m in SHAPES for b in BATCHES
] + [pytest.param(s, m, 1, id=f"{s}-{m}-B1") for s in ("ar", "burst") for m in ROPE_SHAPES])
def test_engine(benchmark, strategy, shape, batch):
    _skip_shape(shape)
    if strategy in COMPILED and not CUDA:
        pytest.skip("compiled steps are benchmarked on CUDA only")
    if strategy in COMPILED and (shape == "tiny" or (strategy.startswith("burst") and batch > 1)):
        pytest.skip("compiled steps: small and gpt2 shapes only, bursts at B = 1 only (compile time)")
    if strategy in FUSED and (not CUDA or shape.startswith("gpt2")):
        pytest.skip("the fused sublayer ends run on CUDA's Triton path, in models at most 256 wide")
    if strategy.endswith("-fused-gelu") and not CUDA:
        pytest.skip("the fused GELU matmul runs on CUDA's Triton path (the CPU engine runs the reference)")
    if strategy in ("burst-fused-scoring", "burst-auto-scoring") and not CUDA:
        pytest.skip("the fused and timed scorings run on CUDA's Triton path (the CPU engine scores with the reference)")
    if strategy.endswith("-pdl") and not (CUDA and sigmafast.kernels.pdl_supported(torch.device(DEVICE))):
        pytest.skip("programmatic dependent launch needs a CUDA GPU of compute capability 9 or more")
    model = _model("sigma", shape)
    prompt = _prompt(batch, PROMPT)
    kwargs = {**STRATEGIES[strategy], **SAMPLING}
    warmup = getattr(sigmafast, "warmup", None)
    target, warmup_s = model, None
    if strategy in ENGINE_OPTIONS:
        target = sigmafast.Engine(model, **ENGINE_OPTIONS[strategy])
    if warmup is not None:
        opts = {k: v for k, v in kwargs.items() if k != "order"}
        t0 = time.perf_counter()
        target = warmup(target, batch_size=batch, seq_len=PROMPT + NEW, **opts)
        synchronize(DEVICE)
        warmup_s = time.perf_counter() - t0

    def call():
        return sigmafast.generate(target, prompt, NEW, generator=torch.Generator(DEVICE).manual_seed(1234),
                                  return_stats=True, **kwargs)

    out, _ = call()  # warm-up (kernels compiled, caches allocated) and a correctness check
    _check_tokens(out, prompt, f"{strategy}-{shape}-B{batch}")
    seconds, (_, stats) = _timed(benchmark, call)
    wall = statistics.median(seconds)
    info = _case_info(shape, batch, kind="engine", strategy=kwargs["strategy"], warmup_api=warmup is not None,
                      warmup_s=warmup_s, seconds_median=wall, **SAMPLING)
    if kwargs["strategy"] == "autoregressive":
        info.update(order=kwargs["order"], ms_per_token=1e3 * wall / NEW, compile_steps=COMPILED.get(strategy))
    else:
        iters = stats.iterations.double().cpu()
        stamps = []  # one untimed call with a sync after every iteration: iterations apart from the prefill

        def hook(canvas, known):
            synchronize(DEVICE)
            stamps.append(time.perf_counter())

        synchronize(DEVICE)
        t0 = time.perf_counter()
        sigmafast.generate(target, prompt, NEW, generator=torch.Generator(DEVICE).manual_seed(1234),
                           on_iteration=hook, **kwargs)
        per_iter = [1e3 * (b - a) for a, b in zip([t0] + stamps, stamps)]
        info.update(num_orders=kwargs["num_orders"], acceptance=kwargs["acceptance"],
                    compile_steps=COMPILED.get(strategy),
                    iterations_max=int(iters.max()), iterations_mean=float(iters.mean()),
                    ms_per_iteration=1e3 * wall / max(int(iters.max()), 1), ms_per_token=1e3 * wall / NEW,
                    synced_first_iteration_ms=per_iter[0] if per_iter else None,  # prompt prefill included
                    synced_later_iterations_ms_median=statistics.median(per_iter[1:]) if per_iter[1:] else None,
                    # the timed calls' later iterations (unsynced: only the engine's own status reads)
                    later_iterations_ms=(1e3 * wall - per_iter[0]) / (len(per_iter) - 1) if per_iter[1:] else None)
    if isinstance(target, sigmafast.Engine) and target.scoring == "auto":
        info.update(scoring_choices=[dict(rows=list(key[0]), chosen=choice, ms=target.scoring_times[key])
                                     for key, choice in target.scoring_choices.items()])
    benchmark.extra_info.update(info)


# --- HF transformers and the plain static-cache anchor ---------------------------------------------------


@pytest.mark.parametrize("shape,batch", [pytest.param(m, b, id=f"hf-{m}-B{b}") for m in SHAPES for b in BATCHES])
def test_hf(benchmark, shape, batch):
    transformers = pytest.importorskip("transformers")
    _skip_shape(shape)
    model = _model("hf", shape)
    prompt = _prompt(batch, PROMPT)

    def call():
        with torch.no_grad():
            return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                  max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=VOCAB - 1)

    _check_tokens(call(), prompt, f"hf-{shape}-B{batch}")
    seconds, _ = _timed(benchmark, call)
    wall = statistics.median(seconds)
    benchmark.extra_info.update(_case_info(
        shape, batch, kind="hf", transformers_version=transformers.__version__,
        attn_implementation=getattr(model.config, "_attn_implementation", None),
        seconds_median=wall, ms_per_token=1e3 * wall / NEW,
    ))


@pytest.mark.parametrize("mode,shape,batch", [
    pytest.param(c, m, b, id=f"anchor-{c}-{m}-B{b}") for c in ("eager", "compiled") for m in SHAPES for b in BATCHES
])
def test_anchor(benchmark, mode, shape, batch):
    import _decoder

    _skip_shape(shape)
    if mode == "compiled" and not CUDA:
        pytest.skip("the compiled anchor uses CUDA graphs (reduce-overhead); CUDA only")
    model = _model("anchor", shape)
    prompt = _prompt(batch, PROMPT)
    decode = _decoder.decode_one_token
    if mode == "compiled":
        torch._dynamo.reset()
        decode = _decoder.compiled_decode()

    def call():
        return _decoder.generate(model, prompt, NEW, decode=decode)

    t0 = time.perf_counter()
    out = call()  # warm-up: compile and CUDA-graph capture for "compiled"
    synchronize(DEVICE)
    first_s = time.perf_counter() - t0
    _check_tokens(out, prompt, f"anchor-{mode}-{shape}-B{batch}")
    seconds, _ = _timed(benchmark, call)
    wall = statistics.median(seconds)
    benchmark.extra_info.update(_case_info(
        shape, batch, kind="anchor", mode=mode, compile_mode="reduce-overhead" if mode == "compiled" else None,
        first_call_s=first_s, seconds_median=wall, ms_per_token=1e3 * wall / NEW,
    ))


if __name__ == "__main__":
    if sys.argv[1:] != ["--first-call"]:
        sys.exit(f"usage: {sys.argv[0]} --first-call  (run by test_first_call with TRITON_CACHE_DIR set)")
    if os.environ.get("SIGMAFAST_BENCH_THREADS", "").isdigit():  # as conftest.py does for the parent
        torch.set_num_threads(max(1, int(os.environ["SIGMAFAST_BENCH_THREADS"])))
    print(RESULT_TAG + json.dumps(first_call_child()), flush=True)
