"""Shared fixtures of the sampler tests: tiny random σ-GPT models."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Iterator, Optional

import torch

from sigmafast import SigmaGPT, SigmaGPTConfig
from sigmafast.train import TrainConfig


def tiny_model(vocab_size: int = 5, block_size: int = 8, seed: int = 0, std: float = 0.3,
               dtype: torch.dtype = torch.float64, n_embd: int = 32, pos_encoding: str = "sinusoidal",
               mlp_ratio: int = 4, final_norm: str = "layernorm") -> SigmaGPT:
    """A 2-layer random model whose weights are scaled up (``std``) so that its
    conditionals are far from uniform and depend on the visited tokens and order."""
    torch.manual_seed(seed)
    config = SigmaGPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=n_embd,
                            pos_encoding=pos_encoding, mlp_ratio=mlp_ratio, final_norm=final_norm)
    model = SigmaGPT(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif p.numel() == 1:  # a scalar final-norm gain: scale the logits up too
                p.fill_(3.0)
    return model.to(dtype).eval()


INTERPRETER_NUMPY_TRITON = (3, 7)  # the first Triton whose interpreter runs under NumPy 2.4 (triton#9172)


def interpreter_numpy_problem(triton_version: str, numpy_version: str) -> Optional[str]:
    """Why Triton's interpreter cannot run the kernels with this NumPy, or None. The interpreters of Triton 3.4
    to 3.6 (torch 2.8 to 2.11 pin them) turn a scalar argument into an index with ``int()`` of its shape-(1,)
    array (``tensor.__index__``: a ``range`` over a size), which NumPy 2.4 refuses, so nearly every kernel test
    would fail. Below ``kernels.MIN_TRITON`` the kernel tests are skipped anyway."""
    from sigmafast.kernels.support import MIN_TRITON, version_tuple

    found, numpy_found = version_tuple(triton_version), version_tuple(numpy_version)
    if found is None or numpy_found is None or numpy_found < (2, 4):
        return None
    if not MIN_TRITON <= found < INTERPRETER_NUMPY_TRITON:
        return None
    return (f"the interpreter of triton {triton_version} cannot run the kernels with numpy {numpy_version}: "
            f"install numpy<2.4 (triton >= {'.'.join(map(str, INTERPRETER_NUMPY_TRITON))} takes either)")


# --- Triton specialisation keys (compile-once checks) ---------------------------------------------

_TRITON_DTYPES = {
    torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "u1",
}


def spec_key(arg, specialize: bool = True, align: bool = True) -> tuple:
    """The part of Triton's JIT cache key for one non-constexpr argument (mirrors
    ``triton.runtime.jit.create_function_from_signature`` / ``native_specialize_impl``):
    ints by i32/i64/u64 and, when specialised, value 1 (a constexpr) and divisibility by 16;
    tensors by dtype and, when specialised, a 16-byte aligned data pointer; floats and bools by type."""
    if arg is None:
        return ("constexpr", None)
    if isinstance(arg, bool):
        return ("u1", None)
    if isinstance(arg, int):
        ty = "i32" if -2**31 <= arg < 2**31 else "u64" if arg >= 2**63 else "i64"
        if not specialize:
            return (ty, None)
        if arg == 1:
            return ("constexpr", 1)
        return (ty, "D" if align and arg % 16 == 0 else "")
    if isinstance(arg, float):
        return ("fp32", None)
    if isinstance(arg, torch.Tensor):
        ty = "*" + _TRITON_DTYPES.get(arg.dtype, str(arg.dtype))
        if not specialize:
            return (ty, None)
        return (ty, "D" if align and arg.data_ptr() % 16 == 0 else "")
    raise TypeError(f"no Triton specialisation rule for {type(arg).__name__}")


class KernelVariants:
    """What :func:`count_variants` recorded: per kernel name, the launches, the distinct keys and the
    launch grids (padded to three axes)."""

    def __init__(self) -> None:
        self.keys: dict[str, set] = {}
        self.launches: dict[str, int] = {}
        self.grids: dict[str, list] = {}

    def counts(self) -> dict[str, int]:
        """Kernel name -> number of variants Triton's JIT would have compiled."""
        return {name: len(keys) for name, keys in self.keys.items()}

    def record(self, fn, args: tuple, kwargs: dict, grid=None) -> None:
        import inspect

        sig = inspect.signature(fn.fn)
        params = sig.parameters
        call = {k: v for k, v in kwargs.items() if k in params}
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
        bound = sig.bind(*args, **call)
        bound.apply_defaults()
        extra = getattr(fn, "kwargs", None) or {}  # InterpretedFunction keeps jit's keywords here
        names = list(params)

        def listed(attr):
            chosen = getattr(fn, attr, None) or extra.get(attr) or ()
            return {names[c] if isinstance(c, int) else c for c in chosen}

        dns, dnsa = listed("do_not_specialize"), listed("do_not_specialize_on_alignment")
        key = []
        for name, value in bound.arguments.items():
            if "constexpr" in str(params[name].annotation):
                key.append(("constexpr", value))
            else:
                key.append(spec_key(value, name not in dns, name not in dnsa))
        name = fn.fn.__name__
        self.keys.setdefault(name, set()).add((tuple(key), options))
        self.launches[name] = self.launches.get(name, 0) + 1
        if isinstance(grid, tuple):
            self.grids.setdefault(name, []).append(tuple(int(g) for g in grid) + (1,) * (3 - len(grid)))


@contextlib.contextmanager
def count_variants() -> Iterator[KernelVariants]:
    """Record, per Triton kernel launched inside the block, the specialisation keys Triton's JIT
    computes (its cache key: constexpr values, the specialisation of every other argument,
    num_warps/num_stages and the other launch options). In the interpreter nothing compiles, so
    this is how the CPU tests count the variants a GPU would compile; it wraps the run of both the
    interpreted and the compiled launchers."""
    import pytest
    import triton
    from triton.runtime import interpreter, jit

    if os.environ.get("TRITON_INTERPRET") == "1" and not hasattr(interpreter.InterpretedFunction, "run"):
        pytest.skip(f"Triton {triton.__version__}'s interpreter has no launcher method to wrap, so the variants "
                    "cannot be counted here (Triton 3.6 and later have one)")
    variants = KernelVariants()
    patched = []
    for cls in [c for c in {interpreter.InterpretedFunction, jit.JITFunction} if hasattr(c, "run")]:
        original = cls.run

        def run(self, *args, grid, warmup, _original=original, **kwargs):
            if not warmup:
                variants.record(self, args, kwargs, grid)
            return _original(self, *args, grid=grid, warmup=warmup, **kwargs)

        cls.run = run
        patched.append((cls, original))
    try:
        yield variants
    finally:
        for cls, original in patched:
            cls.run = original


def triton_device() -> str:
    """Where the Triton kernels run in this session: "cpu" in the interpreter, else "cuda"."""
    import os

    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"


def inner_strided(t: torch.Tensor, fill=-7) -> torch.Tensor:
    """``t``'s values on :func:`triton_device` in a view whose last dimension has stride 2 (the elements between
    them ``fill``): the layouts a launcher must copy before its kernel reads them."""
    full = torch.full((*t.shape[:-1], 2 * t.shape[-1]), fill, dtype=t.dtype, device=triton_device())
    full[..., ::2] = t.to(full.device)
    return full[..., ::2]


def on_triton_device(fn):
    """``fn`` with its tensor arguments moved to :func:`triton_device` and its tensor results moved back
    to the first argument's device, so that the CPU-built kernel tests also run compiled on a GPU. An
    ``out=`` tensor gets the result copied back into it."""
    device = triton_device()

    def move(x, to):
        if isinstance(x, torch.Tensor):
            return x.to(to)
        if isinstance(x, tuple):
            return type(x)(*(move(y, to) for y in x)) if hasattr(x, "_fields") else tuple(move(y, to) for y in x)
        return x

    def call(*args, **kwargs):
        out = kwargs.get("out")
        home = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        res = move(fn(*move(args, device), **{k: move(v, device) for k, v in kwargs.items()}), home)
        if out is not None and out.device.type != device:
            out.copy_(res)
            return out
        return res

    call.__wrapped__ = fn
    return call


def engine_tokens_and_kernels(model, idx: torch.Tensor, **options) -> tuple[torch.Tensor, set]:
    """The tokens of a seeded paper-rule ``generate`` through ``Engine(model, **options)`` on the Triton path,
    and the names of the Triton kernels it launched."""
    import sigmafast

    with count_variants() as v, sigmafast.kernels.use_backend("triton"):
        engine = sigmafast.Engine(model, **options)
        out = sigmafast.generate(engine, idx, 8, num_orders=3, acceptance="paper",
                                 generator=torch.Generator(idx.device).manual_seed(5))
    return out, set(v.counts())


def record_block_linears(model) -> tuple[list, list]:
    """The names of the blocks' ``nn.Linear`` modules, and a list to which a module's name is appended each
    time it runs (a forward hook on each)."""
    names, ran = [], []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and "h." in name:
            m.register_forward_hook(lambda mod, args, out, name=name: ran.append(name))
            names.append(name)
    return names, ran


def assert_log_ratio(call, logq: torch.Tensor, seed: int) -> None:
    """``call(draft_logp, log_ratio)``, a log q launcher given the drafts' (N,) float32 log p and an (N,) output
    filled with 1e30 (no result: log q <= 0 and log p >= -5), returns ``logq`` again and writes
    ``logq - draft_logp`` bit for bit: +inf where only the log p is -inf (a third of the rows), NaN where both
    are."""
    N = logq.shape[0]
    logp = -5 * torch.rand(N, generator=torch.Generator().manual_seed(seed))
    logp[: N // 3] = float("-inf")
    ratio = torch.full((N,), 1e30, device=triton_device())
    with warnings.catch_warnings():  # the interpreter's numpy warns at -inf - (-inf): the NaN expected here
        warnings.filterwarnings("ignore", "invalid value encountered in subtract", RuntimeWarning)
        got = call(logp.to(triton_device()), ratio)
    assert torch.equal(got.cpu(), logq.cpu())
    torch.testing.assert_close(ratio.cpu(), logq.cpu() - logp, rtol=0, atol=0, equal_nan=True)


def assert_same_tokens(tokens, want, probs, uniforms):
    """Tokens equal the reference's except at a float-rounding tie of the inverse CDF."""
    differ = (tokens != want).nonzero().flatten()
    cdf = probs.double().cumsum(-1)
    for i in differ.tolist():
        target = uniforms[i].double() * cdf[i, -1]
        edge = cdf[i, min(tokens[i], want[i])]
        assert abs(edge - target) <= 1e-5, f"row {i}: token {tokens[i]} != reference {want[i]} (not a rounding tie)"
    assert differ.numel() <= max(1, tokens.numel() // 100)


P_FAIL = 1e-6  # the level of every seeded goodness-of-fit check of a law: with about 80 of them in the suite,
# a correct sampler fails one with probability about 1e-4 should a seed, the random stream or a rounding change
# (at 1e-3 and 1e-4 they summed to 2e-2); every bug of the mutation review still fails some check (p < 1e-9)


def truncated_log_probs(logits: torch.Tensor, temperature: float, top_k: Optional[int]) -> torch.Tensor:
    """(..., V) float64 log-probabilities of the logits divided by ``temperature``, every token below the
    ``top_k``-th largest (by a full sort; ties kept) given probability 0, renormalised: the exact laws of the
    statistical tests, written out apart from the samplers' ``kernels.reference.process_logits``."""
    z = logits.double() / temperature
    if top_k is not None:
        kth = z.sort(dim=-1, descending=True).values[..., top_k - 1 : top_k]
        z = torch.where(z >= kth, z, torch.full_like(z, float("-inf")))
    return z - torch.logsumexp(z, dim=-1, keepdim=True)


def chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square law: the regularised upper incomplete gamma Q(dof/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square p-value of ``counts`` against the law ``probs`` (normalised here). The cells
    expecting fewer than ``min_expected`` draws are pooled into one, with the next rarest cells until it expects
    that many: a single draw in a cell expecting 0.002 (a binomial's tail) would otherwise add 500 to the
    statistic, failing a correct sampler several times in a thousand at a level of 1e-4."""
    probs = probs.double() / probs.double().sum()
    counts = counts.double()
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    counts, expected = counts[keep], expected[keep]
    order = expected.argsort()
    counts, expected = counts[order], expected[order]
    rare = int((expected < min_expected).sum())
    if rare:
        total = expected.cumsum(0)
        rare = max(rare, int((total < min_expected).sum()) + 1)  # the pooled cell expects min_expected or more
        rare = min(rare, len(expected))
        counts = torch.cat([counts[:rare].sum()[None], counts[rare:]])
        expected = torch.cat([expected[:rare].sum()[None], expected[rare:]])
    if len(expected) < 2:
        return 1.0
    return chi2_sf(float(((counts - expected) ** 2 / expected).sum()), len(expected) - 1)


def small_cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(task="permutation", seq_len=12, preset="tiny", n_embd=64, n_head=2, batch_size=8, max_iters=8,
                warmup_iters=2, eval_interval=4, eval_iters=2, log_interval=1, num_eval_samples=0,
                out_dir=str(tmp_path))
    return TrainConfig(**{**base, **kw})


REPO = Path(__file__).resolve().parents[1]


SHARED = REPO.parent / "shared"
SHAKESPEARE = SHARED / "data" / "tinyshakespeare.txt"
TIKTOKEN_CACHE = Path(os.environ.get("TIKTOKEN_CACHE_DIR") or SHARED / "tiktoken")  # the user's own cache first


def _script(name: str, module_name: str):
    spec = importlib.util.spec_from_file_location(module_name, REPO / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def train_script():
    """scripts/train.py as a module (its ``main(argv)``)."""
    return _script("train.py", "sigmafast_train_script")


def load_prepare_script():
    """scripts/prepare_owt.py as a module (its ``main(argv)``)."""
    return _script("prepare_owt.py", "prepare_owt")


def sample_script():
    """scripts/sample.py as a module (its ``main(argv)``, ``SampleArgs``, ``parse_template``, ``render``)."""
    return _script("sample.py", "sigmafast_sample_script")


def plot_script():
    """scripts/plot_benchmarks.py as a module (its ``markdown``, ``load``, ``small_sample_note``)."""
    return _script("plot_benchmarks.py", "sigmafast_plot_script")


def eval_series_script():
    """scripts/eval_series.py as a module (its ``main(argv)``)."""
    return _script("eval_series.py", "sigmafast_eval_series_script")


class _SignalAfter(list):
    """Validation batches that send ``signum`` to this process once ``after`` of them were handed out, and count
    how many were."""

    def __init__(self, batches, after: int, signum=signal.SIGINT) -> None:
        super().__init__(batches)
        self.after, self.signum, self.taken = after, signum, 0

    def __iter__(self):
        for batch in super().__iter__():
            if self.taken == self.after:
                os.kill(os.getpid(), self.signum)
            self.taken += 1
            yield batch


def signal_in_val_loss(monkeypatch, call: int, after: int = 1) -> list:
    """The ``call``-th validation loss (1-based; two per evaluation: random then l2r order) gets a SIGINT after
    ``after`` of its batches; returns the list of the wrapped batches."""
    import sigmafast.train as train_mod

    real, calls, wrapped = train_mod.estimate_val_loss, [], []

    def estimate(model, batches, *args, **kwargs):
        calls.append(None)
        if len(calls) == call:
            batches = _SignalAfter(batches, after)
            wrapped.append(batches)
        return real(model, batches, *args, **kwargs)

    monkeypatch.setattr(train_mod, "estimate_val_loss", estimate)
    return wrapped


# a short scripts/train.py run (add --out-dir)
BASE_ARGV = ["--task", "permutation", "--seq-len", "12", "--batch-size", "4", "--max-iters", "2",
             "--eval-iters", "1", "--num-eval-samples", "0"]


def signals_at_step(monkeypatch, step: int, *signals) -> None:
    """Have the trainer send ``signals`` to this process as it loads the first micro-batch of optimiser step
    ``step``."""
    import os

    from sigmafast import train as train_mod

    real_get_batch = train_mod.get_batch

    def get_batch(task, cfg, i, index, start_pos, device):
        if i == step and index == 0:
            for sig in signals:
                os.kill(os.getpid(), sig)
        return real_get_batch(task, cfg, i, index, start_pos, device)

    monkeypatch.setattr(train_mod, "get_batch", get_batch)
