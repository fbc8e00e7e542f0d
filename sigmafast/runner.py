"""Who runs the sampler's steps: eagerly for an oracle, or through an :class:`Engine` for a σ-GPT.

An :class:`Engine` owns, per model:

- **bucketed static shapes**: the batch is padded to a power of two (padding
  rows are complete) and the remaining count R to :func:`~sigmafast.steps.bucket`
  (powers of two from 16, capped at T), so a handful of shapes cover every call;
- **reusable sessions**: one set of static buffers (canvas, mask, full-length
  KV cache, draw buffers) per (backend, batch bucket, T), reset by each call;
  the ``max_sessions`` most recently used are kept, with their graphs;
- **CUDA graphs** (on CUDA): a step whose key (shapes, sampling settings) was
  already run once eagerly, which compiled its Triton kernels, is captured
  the second time and replayed from then on. Replays need no host work but
  drawing the iteration's random numbers into the static buffers. The prompt's
  prefill is such a step too, over the R bucket of the largest known count.

Without buckets (the CPU default, where padding only costs time) the engine
runs exact shapes eagerly and drops finished rows once they are half of the
batch. :func:`warmup` captures every step a call will need ahead of time.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from . import kernels, steps
from .capture import Graphs, compile_step
from .engine import NeuralSession
from .request import DRAW_DTYPE, BurstDraws, burst_shapes, check_int, is_sigma_gpt
from .scoring import SCORING_CHOICES, MeasuredScoring

__all__ = ["Engine", "EagerRunner", "runner_for"]


def batch_bucket(n: int) -> int:
    """The next power of two >= n."""
    return 1 << max(n - 1, 0).bit_length()


class EagerRunner:
    """Runs the steps as plain calls on any session (oracles): exact shapes, finished rows dropped."""

    buckets = False
    lookahead = False

    def __init__(self, conds) -> None:
        self.conds = conds

    def start(self, canvas: torch.Tensor, known: torch.Tensor, most: Optional[int] = None):  # most: Engine's hint
        return self.conds.prefill(canvas, known)

    def r_bucket(self, remaining: int, seq_len: int) -> int:
        return steps.bucket(remaining, seq_len) if self.buckets else remaining

    def session_rows(self, batch_size: int) -> int:
        """The rows a session of ``batch_size`` rows allocates (its batch bucket)."""
        return batch_bucket(batch_size) if self.buckets else batch_size

    def holds_session(self, batch_size: int, seq_len: int) -> bool:
        """Whether a call of ``batch_size`` rows of ``seq_len`` tokens reuses a session kept from an earlier call
        (its KV cache and its graphs' memory allocated already: the free memory no longer counts them)."""
        return False

    def static(self, session, kind: str, tensors: tuple) -> tuple:
        """The tensors a step reads, as the session's static buffers when steps are captured."""
        return tensors

    def draw_buffers(self, session, num_orders: int) -> Optional[BurstDraws]:
        """The session's static buffers for a burst iteration's draws (None: draw fresh tensors)."""
        return None

    def burst(self, session, d: BurstDraws, R: int, temperature, top_k, rule):
        return steps.burst_step(session, d, R, temperature, top_k, rule)

    def ar(self, session, plan: steps.ARPlan, temperature, top_k) -> None:
        steps.ar_step(session, plan, temperature, top_k)


class _EngineSlot:
    """Holds :meth:`Engine.for_model`'s engine in the model's own ``__dict__``: the model and its engine (which
    references the model, as its sessions do) then form a cycle that the garbage collector frees with the model,
    where a global ``WeakKeyDictionary``'s values, strong references, kept every model in it alive. Copies and
    pickles of the model get an empty slot (an engine serves the model it was built for only)."""

    __slots__ = ("engine",)

    def __init__(self, engine: "Optional[Engine]" = None) -> None:
        self.engine = engine

    def __reduce__(self):
        return (_EngineSlot, ())

    def __deepcopy__(self, memo) -> "_EngineSlot":
        return _EngineSlot()


ENGINE_ATTR = "_sigmafast_engine"  # the model's __dict__ entry of its _EngineSlot


@contextlib.contextmanager
def _kept():
    """Where an engine allocates what it keeps between calls (sessions, static buffers): normal tensors, with
    no autograd, even inside a caller's ``torch.inference_mode()``, whose inference tensors no later call
    outside it could update in place."""
    with torch.inference_mode(False), torch.no_grad():  # inference_mode(False) alone enables autograd
        yield


def _check_model(model) -> None:
    if not is_sigma_gpt(model) or getattr(model, "objective", "sigma") != "sigma":
        raise TypeError(f"model must be a SigmaGPT, got {type(model).__name__}")


def _check_compile_steps(compile_steps) -> None:
    if compile_steps is None:
        return
    if not isinstance(compile_steps, str):
        raise TypeError(f"compile_steps must be None or a torch.compile backend name, got {compile_steps!r}")
    backends = torch.compiler.list_backends(exclude_tags=())
    if compile_steps not in backends:
        raise ValueError(f"compile_steps must be None or a torch.compile backend name, one of {backends}, "
                         f"got {compile_steps!r}")


class Engine(EagerRunner):
    """Bucketed static shapes, reusable sessions and CUDA-graph replay for one :class:`SigmaGPT`.

    ``buckets`` and ``cuda_graphs`` default to True on CUDA and False elsewhere;
    ``cuda_graphs`` needs ``buckets`` and a CUDA model. ``compile_steps`` (a
    ``torch.compile`` backend name, e.g. "inductor") compiles the step functions
    with ``fullgraph=True`` first, fusing their small ops; it costs a compilation
    per shape (one for autoregressive sampling, one per R bucket for burst; up to
    ``capture.RECOMPILE_LIMIT`` per step function and process, then eagerly). ``lookahead=True`` (opt-in, with
    buckets) queues each burst iteration before reading the previous one's
    status, with an R bucket bounded one iteration late: the GPU never waits for
    the host, at the cost of an occasional larger bucket and one surplus
    iteration per call (see ``sampler._burst_static``); the default reads every
    status before the next launch, which an H200 ran faster in every measured
    case (GPT-2, B = 1: 26.9 against 31.5 ms per 256-token call). ``fused_ends=True`` (opt-in) ends each
    sublayer of a model at most 256 wide in one Triton kernel (its output
    projection or MLP, the residual add, the next LayerNorm and QKV projection;
    ``kernels.linear_add_norm``, ``kernels.mlp_add_norm``) and has the embedding
    kernel compute the first block's QKV projection; the default keeps those
    matmuls cuBLAS's, which an H200 ran faster (``small``: 0.13 against 0.20 ms
    per autoregressive token, 0.55 against 0.70 ms per burst iteration;
    ``benchmarks/RESULTS.md``). ``fused_gelu=True`` (opt-in, not yet timed on a GPU) computes each MLP's
    first matmul with its GELU as one Triton kernel (``kernels.linear_gelu``) where the matmuls are cuBLAS's:
    one launch fewer per block and forward. ``scoring`` ("matmul" or "fused"; None: the
    default of ``kernels.acceptance_from_hidden``) chooses how a burst scores
    its drafts from the verifier's hidden states on the Triton path; "auto"
    times both on the GPU at the first run of each burst shape and keeps the
    faster (:mod:`sigmafast.scoring`; :attr:`scoring_choices`). ``pdl=True``
    (opt-in; Hopper or later) launches the steps' Triton kernels with
    programmatic dependent launch (``kernels.use_pdl``), captures included. Pass the engine to
    :func:`sigmafast.generate` in place of the model, or let ``generate`` use
    :meth:`for_model`'s engine.
    """

    def __init__(self, model, *, buckets: Optional[bool] = None, cuda_graphs: Optional[bool] = None,
                 compile_steps: Optional[str] = None, max_sessions: int = 8, lookahead: bool = False,
                 fused_ends: bool = False, scoring: Optional[str] = None, pdl: bool = False,
                 fused_gelu: bool = False) -> None:
        _check_model(model)
        for name, flag in (("buckets", buckets), ("cuda_graphs", cuda_graphs)):
            if flag is not None and not isinstance(flag, bool):
                raise TypeError(f"{name} must be None or a bool, got {type(flag).__name__}")
        self.device = next(model.parameters()).device  # where its sessions and graphs live
        on_cuda = self.device.type == "cuda"
        self.model = model
        self.buckets = on_cuda if buckets is None else buckets
        self.cuda_graphs = (on_cuda and self.buckets) if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not (on_cuda and self.buckets):
            raise ValueError("cuda_graphs=True needs a model on a CUDA device and buckets=True")
        _check_compile_steps(compile_steps)
        self.compile_steps = compile_steps
        self._burst_step, self._ar_step = steps.burst_step, steps.ar_step
        if compile_steps is not None:  # fuse the step's small ops (then captured as usual)
            self._burst_step = compile_step(steps.burst_step, compile_steps)
            self._ar_step = compile_step(steps.ar_step, compile_steps)
        if not isinstance(lookahead, bool):
            raise TypeError(f"lookahead must be a bool, got {type(lookahead).__name__}")
        if lookahead and not self.buckets:
            raise ValueError("lookahead=True needs buckets=True (with exact shapes, each status is read before the "
                             "next launch)")
        self.lookahead = lookahead
        for name, flag in (("fused_ends", fused_ends), ("fused_gelu", fused_gelu)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.fused_ends, self.fused_gelu = fused_ends, fused_gelu
        if scoring is not None and scoring not in SCORING_CHOICES:
            raise ValueError(f"scoring must be None or one of {SCORING_CHOICES}, got {scoring!r}")
        self.scoring = scoring
        self._scoring = MeasuredScoring() if scoring == "auto" else scoring  # what the sessions take
        if not isinstance(pdl, bool):
            raise TypeError(f"pdl must be a bool, got {type(pdl).__name__}")
        if pdl and not kernels.pdl_supported(next(model.parameters()).device):
            raise ValueError("pdl=True needs a model on a CUDA GPU of compute capability 9 or more (Hopper), "
                             "and triton >= 3.5")
        self.pdl = pdl
        self.max_sessions = check_int("max_sessions", max_sessions, 1)
        self._sessions: dict = {}  # (backend, batch, T) -> NeuralSession, reused when capturing, LRU order
        self._static: dict = {}  # (id(session), kind) -> static input buffers
        self._graphs = Graphs()
        self._params = self._fingerprint()

    @classmethod
    def for_model(cls, model) -> "Engine":
        """The engine ``generate`` uses for ``model``: kept with the model while graphs are worth keeping
        (on CUDA), a fresh one otherwise. It lives as long as the model (see :class:`_EngineSlot`)."""
        _check_model(model)  # before the lookup: only a module has the __dict__ that keeps the engine
        slot = vars(model).get(ENGINE_ATTR)
        engine = slot.engine if isinstance(slot, _EngineSlot) else None
        # none yet, a shallow copy's of another model, or one whose model has moved to another device since
        if engine is None or engine.model is not model or engine.device != next(model.parameters()).device:
            engine = cls(model)
            if engine.cuda_graphs:
                vars(model)[ENGINE_ATTR] = _EngineSlot(engine)
            else:  # moved off the GPU: the old engine's graphs and caches go now, not when the model does
                vars(model).pop(ENGINE_ATTR, None)
        return engine

    def _fingerprint(self) -> tuple:
        return tuple((t.data_ptr(), t.dtype) for t in (*self.model.parameters(), *self.model.buffers()))

    @property
    def scoring_choices(self) -> dict:
        """With ``scoring="auto"``: the scoring chosen for each burst shape timed so far, keyed by (hidden
        states' (B, O, R, C) shape, dtype, device, temperature, top_k, rule); {} otherwise."""
        return dict(self._scoring.choices) if isinstance(self._scoring, MeasuredScoring) else {}

    @property
    def scoring_times(self) -> dict:
        """With ``scoring="auto"``: the GPU milliseconds measured for each scoring, by the keys of
        :attr:`scoring_choices`; {} otherwise."""
        return dict(self._scoring.times) if isinstance(self._scoring, MeasuredScoring) else {}

    @property
    def backend(self) -> str:
        return kernels.backend_for(next(self.model.parameters()))

    def holds_session(self, batch_size: int, seq_len: int) -> bool:
        return self.cuda_graphs and (self.backend, self.session_rows(batch_size), seq_len) in self._sessions

    def start(self, canvas: torch.Tensor, known: torch.Tensor, most: Optional[int] = None) -> NeuralSession:
        """Prefill a session of the (bucketed) batch size with ``canvas`` and ``known`` (B, T); ``most``, the
        largest count of known tokens in a row when the caller has read it (else one host read here)."""
        with kernels.use_pdl(self.pdl):
            return self._start(canvas, known, most)

    def burst(self, session, d: BurstDraws, R: int, temperature, top_k, rule):
        with kernels.use_pdl(self.pdl):
            return self._burst(session, d, R, temperature, top_k, rule)

    def ar(self, session, plan: steps.ARPlan, temperature, top_k) -> None:
        with kernels.use_pdl(self.pdl):
            self._ar(session, plan, temperature, top_k)

    def _start(self, canvas: torch.Tensor, known: torch.Tensor, most: Optional[int]) -> NeuralSession:
        if self.cuda_graphs and canvas.device != self.device:  # a capture would hold none of its work
            raise ValueError(f"this Engine captures CUDA graphs on {self.device}, but its model is now on "
                             f"{canvas.device}: build an Engine for the model where it is")
        if self._fingerprint() != self._params:  # moved or replaced weights: captured graphs are stale
            self._sessions.clear()
            self._static.clear()
            self._graphs = Graphs()
            if isinstance(self._scoring, MeasuredScoring):
                self._scoring.clear()
            self._params = self._fingerprint()
        B, T = canvas.shape
        size = self.session_rows(B)
        backend = self.backend
        if self.cuda_graphs:
            session = self._sessions.pop((backend, size, T), None)
            if session is None:
                with _kept():
                    session = NeuralSession(self.model, size, T, backend, fused_ends=self.fused_ends,
                                            scoring=self._scoring, fused_gelu=self.fused_gelu)
            self._sessions[(backend, size, T)] = session  # most recently used last
            if len(self._sessions) > self.max_sessions:  # bounded memory: caches, buffers and graphs
                oldest = self._sessions.pop(next(iter(self._sessions)))
                self._graphs.drop(id(oldest))
                self._static = {k: v for k, v in self._static.items() if k[0] != id(oldest)}
        else:
            session = NeuralSession(self.model, size, T, backend, fused_ends=self.fused_ends,
                                    scoring=self._scoring, fused_gelu=self.fused_gelu)
        m = session.load(canvas, known, most)
        if m > 0:  # the prompt's prefill: a static-shape step over the bucket of the largest known count
            M = self.r_bucket(m, T)
            if self.cuda_graphs:
                self._graphs.run(("prefill", id(session), M), lambda: session.feed_known(M))
            else:
                session.feed_known(M)
        return session

    def static(self, session, kind: str, tensors: tuple) -> tuple:
        if not self.cuda_graphs:
            return tensors
        key = (id(session), kind)
        buffers = self._static.get(key)
        if buffers is None:
            with _kept():
                buffers = self._static[key] = type(tensors)(*(t.clone() for t in tensors))
        else:
            for buf, t in zip(buffers, tensors):
                if buf is not t:  # drawn in place (draw_buffers): nothing to copy
                    buf.copy_(t, non_blocking=True)
        return buffers

    def draw_buffers(self, session, num_orders: int) -> Optional[BurstDraws]:
        if not self.cuda_graphs:
            return None
        key = (id(session), f"burst{num_orders}")
        buffers = self._static.get(key)
        if buffers is None:
            B, T = session.canvas.shape
            with _kept():
                zeros = [torch.zeros(shape, dtype=DRAW_DTYPE, device=session.canvas.device)
                         for shape in burst_shapes(B, num_orders, T)]
            buffers = self._static[key] = BurstDraws(*zeros)  # padding rows: any draws (they commit nothing)
        return buffers

    def _burst(self, session, d: BurstDraws, R: int, temperature, top_k, rule):
        if not self.cuda_graphs:
            return self._burst_step(session, d, R, temperature, top_k, rule)
        d = self.static(session, f"burst{d.keys.shape[1]}", d)
        key = ("burst", id(session), R, d.keys.shape[1], temperature, top_k, rule)
        out = self._graphs.run(key, lambda: self._burst_step(session, d, R, temperature, top_k, rule))
        return torch.cat(out).split([t.shape[0] for t in out])  # one copy out of the graph's outputs

    def _ar(self, session, plan: steps.ARPlan, temperature, top_k) -> None:
        if not self.cuda_graphs:
            self._ar_step(session, plan, temperature, top_k)
            return
        key = ("ar", id(session), temperature, top_k)
        self._graphs.run(key, lambda: self._ar_step(session, plan, temperature, top_k))


def runner_for(model):
    """The runner of a SigmaGPT (an engine), an :class:`Engine` itself, or an oracle (eager)."""
    if isinstance(model, Engine):
        return model
    if is_sigma_gpt(model):
        return Engine.for_model(model)
    if hasattr(model, "prefill"):
        return EagerRunner(model)
    raise TypeError(f"model must be a SigmaGPT, an Engine or an oracle, got {type(model).__name__}")
