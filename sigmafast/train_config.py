"""Training configuration: a validated dataclass, per-preset recipes and their resolution.

Fields left at ``None`` mean "the preset's default". ``gpt2`` / ``gpt2-medium``
follow the nanoGPT / σ-GPT paper recipe (lr 6e-4 cosine to 6e-5, 2000 warm-up
steps, weight decay 0.1, betas (0.9, 0.95), clip 1.0, about 0.5M tokens per
step through gradient accumulation, bf16); ``tiny`` / ``small`` get CPU-sized
defaults. :func:`resolve` fills every ``None`` once the task and world size
are known.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Optional

from .diffusion.model import OBJECTIVES, DiffusionConfig
from .diffusion.noise import NOISES
from .loss import LOSS_WEIGHTINGS
from .model_config import EMBEDDING_INITS, FINAL_NORMS, POS_ENCODINGS, PRESETS
from .orders import ORDER_NAMES
from .request import check_seed
from .tasks import TASK_NAMES, task_arguments

DTYPES = ("auto", "float32", "bfloat16")
TASK_FLAGS = ("seq_len", "text", "data_dir", "csv", "column")  # the fields passed to the task's constructor
PATH_FIELDS = ("text", "data_dir", "csv")
RUN_FIELDS = frozenset({"out_dir", "resume", "overwrite"})  # the invocation's, never the checkpoint's

# Tokens per optimiser step for the paper-scale presets: nanoGPT's 12 x 1024 x 40.
PAPER_TOKENS_PER_STEP = 491_520

_PAPER = dict(
    max_iters=600_000, batch_size=12, lr=6e-4, min_lr=6e-5, warmup_iters=2000, beta2=0.95, weight_decay=0.1,
    eval_interval=1000, eval_iters=200, num_eval_samples=0,
)
_CPU = dict(
    max_iters=2000, batch_size=32, grad_accum=1, lr=3e-3, warmup_iters=50, beta2=0.99, weight_decay=0.1,
    eval_interval=100, eval_iters=10, num_eval_samples=16,
)
TRAIN_PRESETS: dict[str, dict] = {
    "tiny": _CPU,
    "small": {**_CPU, "max_iters": 5000},
    "gpt2": _PAPER,
    "gpt2-medium": _PAPER,
}

PAPER_TASKS = ("owt", "wikitext103")

# Per-task recipes, chosen from learning curves measured on a 2-core CPU (README, "Recipes"). They
# fill the fields a user leaves unset. The task-level keys apply with any preset; the others (sizes,
# schedule) only with the recipe's own preset.
TASK_RECIPES: dict[str, dict] = {
    # rope-v: 97.4% valid AR samples after the default 2000 steps (rope 84.5%, sinusoidal 26.2%)
    "step": dict(pos_encoding="rope-v"),
    # one attention-only layer of width 256, no biases, a final LayerNorm with one scalar gain learnt 30x
    # faster (the logits' scale), orthogonal token embeddings learnt 30x slower, and step k's loss
    # weighted by k + 1/2: 95.6% valid AR samples in 25 min; see benchmarks/RESULTS.md, "Recipes"
    "permutation": dict(pos_encoding="rope", loss_weighting="visited", preset="tiny", n_layer=1, n_embd=256,
                        n_head=2, mlp_ratio=0, bias=False, final_norm="scalar", lr=3e-3, min_lr=3e-5,
                        weight_decay=0.0, batch_size=16, embedding_init="orthogonal", embedding_lr_scale=0.03,
                        final_norm_lr_scale=30.0, warmup_iters=200, eval_interval=500, max_iters=24000),
    # rope-v + curriculum, small, T=256, 1500 steps: random-order 2.00 (rope 2.07, sinusoidal 3.30),
    # l2r 1.69 (rope 1.73; the GPT 1.645)
    "char": dict(pos_encoding="rope-v", order="curriculum"),
    # random order, small, 3000 steps: random-order loss 0.93 with rope-v against 1.18 with sinusoidal
    "vertical_rate": dict(pos_encoding="rope-v"),
    # small + rope-v, 1300 steps (50 min on 2 CPU cores): solution NLL 15.5 nats per maze against 18.7 for
    # tiny after 63 min (the path's entropy is 1.9), yet 0/200 correct; benchmarks/RESULTS.md, "Maze search"
    "maze": dict(pos_encoding="rope-v", preset="small", max_iters=1300, eval_interval=250),
}
TASK_LEVEL_FIELDS = ("pos_encoding", "order", "curriculum_start", "loss_weighting")

ARCH_FIELDS = ("n_layer", "n_head", "n_embd", "mlp_ratio", "dropout", "bias", "pos_encoding", "embedding_init",
               "final_norm")


def _field(default, help_text: str, choices: Optional[tuple] = None):
    """A dataclass field whose metadata feeds ``scripts/train.py``'s flag (help, choices)."""
    meta = {"help": help_text, **({"choices": choices} if choices else {})}
    return field(default=default, metadata=meta)


_PRESET = " (default: the preset's)"
_RECIPE = " (default: the task recipe's, else the preset's)"  # the fields a task recipe may set (TASK_RECIPES)


def _record_explicit(cls):
    """Wrap the dataclass ``__init__`` of ``cls`` so that each instance knows which fields its caller passed
    (``self._explicit``), before ``__post_init__`` fills in any default."""
    init, names = cls.__init__, [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        self._explicit = frozenset(names[:len(args)]) | frozenset(kwargs)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@_record_explicit
@dataclass
class TrainConfig:
    task: str = _field("permutation", "task", TASK_NAMES)
    preset: Optional[str] = _field(
        None, "model preset: architecture and training recipe (default: the task recipe's, else gpt2 for "
        "owt/wikitext103 and tiny for the others)",
        tuple(PRESETS),
    )
    n_layer: Optional[int] = _field(None, "layers" + _RECIPE)
    n_head: Optional[int] = _field(None, "attention heads" + _RECIPE)
    n_embd: Optional[int] = _field(None, "model width" + _RECIPE)
    mlp_ratio: Optional[int] = _field(None, "MLP hidden width / model width, 0 for attention-only blocks "
                                         "(default: the task recipe's, else 4)")
    block_size: Optional[int] = _field(None, "context length (default: the task's seq_len)")
    dropout: Optional[float] = _field(None, "dropout (default: 0)")
    bias: Optional[bool] = _field(None, "biases in Linear/LayerNorm (default: the task recipe's, else on)")
    pos_encoding: Optional[str] = _field(
        None, "positional encoding (default: the task recipe's, else sinusoidal)", POS_ENCODINGS)
    embedding_init: Optional[str] = _field(
        None, "token embedding init (default: the task recipe's, else normal)", EMBEDDING_INITS)
    final_norm: Optional[str] = _field(
        None, "final LayerNorm: per-channel gain and bias, or one scalar gain (default: the task recipe's, else "
        "layernorm)", FINAL_NORMS
    )
    seq_len: Optional[int] = _field(None, "sequence length of the 1-D and text tasks (default: the task's)")
    text: Optional[str] = _field(None, "UTF-8 text file, required by --task char (default: none)")
    data_dir: Optional[str] = _field(None, "train.bin / val.bin folder for owt, wikitext103 (default: data/<task>)")
    csv: Optional[str] = _field(None, "CSV file with a header row, required by --task series (default: none)")
    column: Optional[str] = _field(None, "numeric column of --csv, required by --task series (default: none)")
    out_dir: str = _field("out", "where ckpt.pt is written")
    max_iters: Optional[int] = _field(None, "optimiser steps" + _RECIPE)
    batch_size: Optional[int] = _field(None, "sequences per micro-step and rank" + _RECIPE)
    grad_accum: Optional[int] = _field(None, "micro-steps per optimiser step, over all ranks" + _PRESET)
    lr: Optional[float] = _field(None, "peak learning rate" + _RECIPE)
    min_lr: Optional[float] = _field(
        None, "final learning rate (default: the task recipe's, else the preset's; lr/10 with --lr)")
    warmup_iters: Optional[int] = _field(None, "linear warm-up steps" + _RECIPE)
    lr_decay_iters: Optional[int] = _field(None, "cosine decay length (default: max_iters)")
    weight_decay: Optional[float] = _field(None, "AdamW weight decay on >=2-D weights" + _RECIPE)
    embedding_lr_scale: Optional[float] = _field(
        None, "learning-rate multiplier of the token embedding, tied to the LM head (default: the task "
        "recipe's, else 1)")
    final_norm_lr_scale: Optional[float] = _field(
        None, "learning-rate multiplier of the final LayerNorm, which sets the logits' scale (default: the "
        "task recipe's, else 1)")
    beta1: float = _field(0.9, "AdamW beta1")
    beta2: Optional[float] = _field(None, "AdamW beta2" + _PRESET)
    grad_clip: float = _field(1.0, "gradient norm clip (0 disables)")
    objective: str = _field(
        "sigma", "sigma: any-order σ-GPT; diffusion: the discrete-diffusion baseline (bidirectional)", OBJECTIVES
    )
    diffusion_noise: str = _field("uniform", "noise process of --objective diffusion (D3PM uniform or MDLM absorbing)",
                                  NOISES)
    order: Optional[str] = _field(
        None, "training order of objective sigma (default: the task recipe's, else random)", ORDER_NAMES)
    curriculum_start: Optional[float] = _field(
        None, "curriculum: left-to-right fraction at step 0, falling linearly to 0 (default: 0.5)")
    curriculum_iters: Optional[int] = _field(None, "curriculum: the step where the left-to-right fraction reaches 0 "
                                                   "(default: max_iters)")
    loss_weighting: Optional[str] = _field(
        None, "objective sigma: weight of each step's cross-entropy, uniform or visited (proportional to the "
        "tokens visited before it, mean 1); every conditional keeps its optimum (default: the task recipe's, "
        "else uniform)", LOSS_WEIGHTINGS)
    eval_interval: Optional[int] = _field(None, "steps between evaluations" + _RECIPE)
    eval_iters: Optional[int] = _field(None, "validation batches per evaluation" + _PRESET)
    log_interval: int = _field(10, "steps between log lines")
    num_eval_samples: Optional[int] = _field(None, "sequences sampled for the validity metric, 0 disables" + _PRESET)
    seed: int = _field(1337, "seed of the model init, data and orders")
    device: str = _field("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = _field("auto", "auto: bf16 autocast on CUDA, fp32 on CPU", DTYPES)
    compile: bool = _field(False, "torch.compile the model")
    resume: bool = _field(False, "continue from out_dir/ckpt.pt; unset flags take the checkpoint's values")
    overwrite: bool = _field(False, "start a new run in an out_dir that already holds a ckpt.pt, which the new "
                                    "run's first save replaces (without --overwrite or --resume, such an out_dir is "
                                    "an error)")

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check_type(f.name, value, hints[f.name])
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"TrainConfig.{f.name} must be a finite number, got {value!r}")
        _check_choice("task", self.task, TASK_NAMES)
        check_seed("TrainConfig.seed", self.seed)
        for name in PATH_FIELDS:  # absolute, so that --resume from another folder reads the same files
            if getattr(self, name) is not None:
                setattr(self, name, os.path.abspath(getattr(self, name)))
        if self.resume and self.overwrite:
            raise ValueError("TrainConfig.resume and TrainConfig.overwrite exclude each other: continue the run, "
                             "or start anew")
        if self.preset is None:
            self.preset = default_preset(self.task)
        _check_choice("preset", self.preset, tuple(PRESETS))
        if self.order is not None:
            _check_choice("order", self.order, ORDER_NAMES)
        _check_choice("objective", self.objective, OBJECTIVES)
        _check_choice("diffusion_noise", self.diffusion_noise, NOISES)
        if self.objective == "diffusion" and self.order not in (None, "random"):
            raise ValueError(f"TrainConfig.order ({self.order!r}) applies to objective 'sigma' only; "
                             "a diffusion model has no generation order")
        if self.loss_weighting is not None:
            _check_choice("loss_weighting", self.loss_weighting, LOSS_WEIGHTINGS)
            if self.objective == "diffusion" and self.loss_weighting != "uniform":
                raise ValueError(f"TrainConfig.loss_weighting ({self.loss_weighting!r}) applies to objective "
                                 "'sigma' only")
        _check_choice("dtype", self.dtype, DTYPES)
        if self.pos_encoding is not None:
            _check_choice("pos_encoding", self.pos_encoding, POS_ENCODINGS)
        if self.embedding_init is not None:
            _check_choice("embedding_init", self.embedding_init, EMBEDDING_INITS)
        if self.final_norm is not None:
            _check_choice("final_norm", self.final_norm, FINAL_NORMS)
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise ValueError(f"TrainConfig.device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "seq_len", "max_iters", "batch_size",
                     "grad_accum", "lr_decay_iters", "curriculum_iters", "eval_interval", "eval_iters",
                     "log_interval"):
            _check_range(name, getattr(self, name), low=1)
        for name in ("mlp_ratio", "warmup_iters", "num_eval_samples", "weight_decay", "grad_clip", "min_lr",
                     "embedding_lr_scale", "final_norm_lr_scale"):
            _check_range(name, getattr(self, name), low=0)
        _check_range("lr", self.lr, low=0, strict=True)
        for name in ("beta1", "beta2", "dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"TrainConfig.{name} must be in [0, 1), got {value!r}")
        if self.curriculum_start is not None and not 0.0 <= self.curriculum_start <= 1.0:
            raise ValueError(f"TrainConfig.curriculum_start must be in [0, 1], got {self.curriculum_start!r}")
        if None not in (self.lr_decay_iters, self.warmup_iters) and self.lr_decay_iters < self.warmup_iters:
            raise ValueError(f"TrainConfig.lr_decay_iters ({self.lr_decay_iters}) must be >= warmup_iters "
                             f"({self.warmup_iters}): the cosine decay starts when the warm-up ends")
        if self.lr is not None and self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"TrainConfig.min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        arch = self.architecture()
        # on --resume without both widths given, the architecture is the checkpoint's, checked once read
        if (not self.resume or None not in (self.n_embd, self.n_head)) and arch["n_embd"] % (2 * arch["n_head"]):
            raise ValueError(
                f"TrainConfig.n_embd ({arch['n_embd']}) must be divisible by 2*n_head ({2 * arch['n_head']})"
            )

    def explicit_fields(self) -> frozenset:
        """The fields passed to the constructor: on ``--resume`` these override the checkpoint's values (even
        one equal to its default), the others take the checkpoint's."""
        return self._explicit

    def recipe(self) -> dict:
        """The task recipe's defaults that apply with this config's preset (see :data:`TASK_RECIPES`)."""
        recipe = TASK_RECIPES.get(self.task, {})
        if recipe.get("preset", self.preset) != self.preset:
            recipe = {k: v for k, v in recipe.items() if k in TASK_LEVEL_FIELDS}
        return {k: v for k, v in recipe.items() if k != "preset"}

    def architecture(self) -> dict:
        """The preset's architecture with the recipe's and this config's overrides (no task fields)."""
        arch = {k: v for k, v in PRESETS[self.preset].items() if k != "block_size"}
        arch.update({k: v for k, v in self.recipe().items() if k in ARCH_FIELDS})
        arch.update({k: getattr(self, k) for k in ARCH_FIELDS if getattr(self, k) is not None})
        return arch

    def diffusion_config(self) -> Optional[DiffusionConfig]:
        """The noise process of objective "diffusion"; None for "sigma"."""
        return DiffusionConfig(noise=self.diffusion_noise) if self.objective == "diffusion" else None

    def task_kwargs(self) -> dict:
        """Keyword arguments for ``get_task(self.task, **kwargs)``: the task fields that are set."""
        return {k: getattr(self, k) for k in TASK_FLAGS if getattr(self, k) is not None}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown TrainConfig fields: {sorted(unknown)}")
        return cls(**d)


def default_preset(task: str) -> str:
    """The task recipe's preset; else the paper's GPT-2 124M for the web-text tasks, a CPU-sized model otherwise."""
    return TASK_RECIPES.get(task, {}).get("preset", "gpt2" if task in PAPER_TASKS else "tiny")


def _check_type(name: str, value, annotation) -> None:
    optional = typing.get_origin(annotation) is typing.Union and type(None) in typing.get_args(annotation)
    base = next(a for a in typing.get_args(annotation) if a is not type(None)) if optional else annotation
    if value is None:
        if optional:
            return
    elif base is bool:
        if isinstance(value, bool):
            return
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return
    elif isinstance(value, base):
        return
    raise TypeError(f"TrainConfig.{name} must be {_annotation_name(annotation)}, got {value!r}")


def _annotation_name(annotation) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args:
        return f"{args[0].__name__} or None"
    return annotation.__name__


def _check_choice(name: str, value: str, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"TrainConfig.{name}: unknown {name} {value!r}; expected one of {list(choices)}")


def _check_range(name: str, value, low: float, strict: bool = False) -> None:
    if value is None:
        return
    if value < low or (strict and value == low):
        bound = f"> {low}" if strict else f">= {low}"
        raise ValueError(f"TrainConfig.{name} must be {bound}, got {value!r}")


def check_task_flags(task: str, kwargs: dict) -> None:
    """A ``ValueError`` naming the flags (``--text``, ``--csv``...) that task ``task`` does not take."""
    accepted = task_arguments(task)
    unused = [] if accepted is None else [k for k in kwargs if k not in accepted]
    if unused:
        flags = ", ".join("--" + k.replace("_", "-") for k in unused)
        takes = [f"--{k.replace('_', '-')}" for k in TASK_FLAGS if k in accepted]
        raise ValueError(f"task {task!r} does not take {flags}; of the task flags it takes "
                         f"{', '.join(takes) if takes else 'none'}")


# Training fields' values before any recipe set them: what a checkpoint that lacks the field was trained with.
_BASE_DEFAULTS = {"order": "random", "curriculum_start": 0.5, "embedding_lr_scale": 1.0, "final_norm_lr_scale": 1.0,
                  "loss_weighting": "uniform"}
_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig))
# Fields derived from another one when unset: (derived, source).
_DERIVED = (("lr_decay_iters", "max_iters"), ("lr_decay_iters", "warmup_iters"), ("curriculum_iters", "max_iters"),
            ("min_lr", "lr"), ("grad_accum", "batch_size"))


def resume_config(cfg: TrainConfig, stored_train: dict, stored_model: dict,
                  stored_explicit: frozenset = frozenset()) -> TrainConfig:
    """``cfg`` for ``--resume``: every field the user did not set (:meth:`TrainConfig.explicit_fields`) takes
    the checkpoint's value, so that the run goes on as it was started, even when a later version changed the
    presets or the task recipes. :data:`RUN_FIELDS` (``out_dir``, ``resume``, ``overwrite``) stay ``cfg``'s.

    ``stored_train`` is the checkpoint's resolved TrainConfig dict and ``stored_model`` its model config dict
    (fields an older checkpoint lacks already at their defaults). The architecture comes from the model that
    was built; training fields the checkpoint lacks take their values from before any recipe
    (:data:`_BASE_DEFAULTS`), else their defaults. A derived field (``lr_decay_iters``, ``curriculum_iters``,
    ``min_lr``, ``grad_accum``) whose source the user sets to another value is derived again, unless it is in
    ``stored_explicit`` (the fields the stored run was given explicitly).
    """
    given = cfg.explicit_fields() | RUN_FIELDS
    stored = {**_BASE_DEFAULTS, **{k: v for k, v in stored_train.items() if v is not None}}
    stored.update({k: stored_model[k] for k in ARCH_FIELDS if k in stored_model})
    if stored.get("preset") not in PRESETS:  # a preset removed since: the default of the stored task
        stored.pop("preset", None)
    values = {name: value for name, value in cfg.to_dict().items() if name in given}
    values.update({name: value for name, value in stored.items() if name not in given and name in _FIELDS})
    for derived, source in _DERIVED:  # derived again from a source given another value than the run's
        if derived not in given and derived not in stored_explicit and source in given \
                and values[source] != stored.get(source):
            values[derived] = None
    return TrainConfig(**values)


def resolve(cfg: TrainConfig, seq_len: int, world_size: int = 1) -> TrainConfig:
    """A copy of ``cfg`` with every preset default filled in.

    ``seq_len`` is the task's; ``world_size`` the number of DDP ranks, which
    must divide ``grad_accum``.
    """
    preset = {**TRAIN_PRESETS[cfg.preset], **_BASE_DEFAULTS, **cfg.recipe()}
    values = {k: (preset[k] if getattr(cfg, k) is None and k in preset and k != "min_lr" else getattr(cfg, k))
              for k in (f.name for f in dataclasses.fields(cfg))}
    if cfg.grad_accum is None:  # at least one micro-step per rank
        accum = preset.get("grad_accum") or max(1, round(PAPER_TOKENS_PER_STEP / (values["batch_size"] * seq_len)))
        values["grad_accum"] = -(-accum // world_size) * world_size
    if values["min_lr"] is None:  # the preset's, unless lr is overridden: then lr / 10
        values["min_lr"] = preset.get("min_lr", values["lr"] / 10) if cfg.lr is None else values["lr"] / 10
    if cfg.objective == "diffusion":  # a σ-GPT recipe's order and step weights do not apply
        values["order"] = "random" if cfg.order is None else cfg.order
        values["loss_weighting"] = "uniform" if cfg.loss_weighting is None else cfg.loss_weighting
    if values["lr_decay_iters"] is None:  # the schedule of a run shorter than its warm-up is all warm-up
        values["lr_decay_iters"] = max(values["max_iters"], values["warmup_iters"])
    if values["curriculum_iters"] is None:
        values["curriculum_iters"] = values["max_iters"]
    if values["data_dir"] is None and cfg.task in PAPER_TASKS:  # the task's default folder, made absolute
        from .tasks.text import TOKEN_DATASETS

        values["data_dir"] = TOKEN_DATASETS[cfg.task]["data_dir"]
    resolved = TrainConfig(**values)
    if resolved.grad_accum % world_size != 0:
        raise ValueError(
            f"TrainConfig.grad_accum ({resolved.grad_accum}) must be divisible by the number of DDP ranks "
            f"({world_size}): gradient accumulation is split across ranks; pass TrainConfig.grad_accum as a "
            f"multiple of {world_size}"
        )
    return resolved
