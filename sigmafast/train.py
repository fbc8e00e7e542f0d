"""The σ-GPT trainer: any-order training on a task, single process or DDP under torchrun.

Every micro-batch (data and orders) is drawn from a generator seeded by
``(seed, step, micro-step index)``, where the index runs over the global
micro-steps of an optimiser step (rank r takes its own slice). Batches are
therefore a pure function of the step, so resuming reproduces an uninterrupted
run exactly, and a DDP run sees the same global batch as a single process with
the same ``grad_accum``.
"""

from __future__ import annotations

import gc
import logging
import math
import re
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from . import diffusion
from .batches import (
    SAMPLE_STREAM, TRAIN_STREAM, VAL_STREAM, curriculum_l2r, get_batch, make_val_batches, stream_generator,
)
from .checkpoint import (
    atomic_save, build_checkpoint, check_compatible, check_new_run, checkpoint_path, claim_out_dir, load_checkpoint,
    out_dir_lock, read_resumed, rng_state, set_rng_state, stored_objective, task_record,
)
from .diffusion import training as diffusion_training
from .distributed import Layout, init_layout
from .kernels import row_blocks
from .evaluation import estimate_val_loss, metrics_line, numeric_metrics, sample_validity
from .loss import step_weights
from .memory import FP32_BYTES, GIB, check_sampling_memory, check_training_memory
from .model import SigmaGPTConfig
from .optim import configure_optimizer, learning_rate, restore_optimizer
from .resume import changed_fields, check_given_fields, learned_task_kwargs, resumed_config
from .signals import EvaluationStopped, StopRequest
from .train_config import RUN_FIELDS, TrainConfig, check_task_flags, resolve

__all__ = ["TrainConfig", "TrainResult", "train", "load_checkpoint", "learning_rate", "build_model_config"]

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s by device-name fragment, for the MFU estimate.
_PEAK_FLOPS = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("A100", 312e12),
               ("L40S", 362e12), ("L40", 181e12), ("4090", 165e12), ("A10", 125e12), ("L4", 121e12))  # dense bf16
_MAX_ETA_S = 999_999_999 * 86_400  # the logged eta's cap: the largest whole-day timedelta


@dataclass
class TrainResult:
    model: torch.nn.Module  # a SigmaGPT, or a DiffusionGPT for objective "diffusion"
    task: object
    history: list[dict]
    checkpoint_path: Path
    train_log: list[dict] = field(default_factory=list)
    interrupted: bool = False
    stop_signal: Optional[int] = None  # the signal that stopped this process (None: not stopped, or by another rank)


def build_model_config(cfg: TrainConfig, task) -> SigmaGPTConfig:
    """The model config of ``cfg`` for ``task``; ``block_size`` defaults to the task's ``seq_len``.

    A diffusion model's MASK is its BOS id, which must never occur in data: for a task whose BOS is a data
    token (``task.bos_in_data``, GPT-2's <|endoftext|>) the model gets one more id, ``task.vocab_size``."""
    block_size = task.seq_len if cfg.block_size is None else cfg.block_size
    if block_size < task.seq_len:
        raise ValueError(f"TrainConfig.block_size ({block_size}) must be >= the task's seq_len ({task.seq_len})")
    vocab_size, bos = task.vocab_size, task.bos
    if cfg.objective == "diffusion" and task.bos_in_data:
        vocab_size, bos = task.vocab_size + 1, task.vocab_size
    return SigmaGPTConfig.from_preset(
        cfg.preset, vocab_size=vocab_size, block_size=block_size, bos_token_id=bos, **cfg.architecture()
    )


def estimate_mfu(config: SigmaGPTConfig, n_params: int, seq_len: int, tokens_per_s: float, device,
                 bf16: bool = True) -> Optional[float]:
    """nanoGPT's model-FLOPs utilisation estimate (PaLM appendix B) against the GPU's dense bf16 peak (the first
    entry of ``_PEAK_FLOPS`` its name contains); None off CUDA, on unknown GPUs or without bf16 autocast."""
    if device.type != "cuda" or not bf16:
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((flops for key, flops in _PEAK_FLOPS if key in name), None)
    if peak is None:
        return None
    flops_per_token = 6 * n_params + 12 * config.n_layer * config.n_head * config.head_dim * seq_len
    return flops_per_token * tokens_per_s / peak


class ModelLoss(torch.nn.Module):
    """``model.loss(*batch)`` as a module call, so that DDP and ``torch.compile`` wrap the chunked loss
    of either objective (a σ-GPT batch: tokens, in_pos, out_pos, targets[, step weights]; a diffusion batch:
    x0, x_t, t)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        return self.model.loss(*batch)


def check_memory(cfg: TrainConfig, model_config: SigmaGPTConfig, seq_len: int, device: torch.device) -> int:
    """The estimated training peak in bytes (:func:`sigmafast.memory.training_peak_bytes`, bf16
    activations under autocast); a ``ValueError`` naming the flags that reduce it when it exceeds the
    memory available on ``device``."""
    bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")
    if cfg.num_eval_samples:  # each evaluation's validity sampling: one order, float32
        n = cfg.num_eval_samples
        blocks = None if device.type == "cuda" else row_blocks.block_elements(device)  # the reference path's
        check_sampling_memory(model_config, n, 1, seq_len, device, FP32_BYTES, block_elements=blocks,
                              what=f"sampling {n} sequences of {seq_len} tokens at each evaluation",
                              remedy="TrainConfig.num_eval_samples (0 disables the sampling)")
    return check_training_memory(model_config, cfg.batch_size, seq_len, device, activation_bytes=2 if bf16 else 4)


def train(cfg: TrainConfig) -> TrainResult:
    """Train (or, with ``cfg.resume``, continue training) a σ-GPT on ``cfg.task``; see :class:`TrainConfig`."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
    layout = init_layout(cfg.device)
    trainer = None
    try:
        with StopRequest() as stop, ExitStack() as held:
            trainer = _Trainer(cfg, layout, stop, held)
            return trainer.run()
    finally:
        trainer = None  # its DDP wrapper holds the process group: free it before the group is destroyed,
        gc.collect()  # not at interpreter exit, where gloo's threads abort the process
        layout.close()


class _Trainer:
    def __init__(self, user_cfg: TrainConfig, layout: Layout, stop: StopRequest, held: ExitStack) -> None:
        from .tasks import get_task

        self.layout, self.stop, self.device = layout, stop, layout.device
        locked = layout.is_main and Path(user_cfg.out_dir).is_dir()
        if locked:  # before reading a checkpoint that another run may be writing
            held.enter_context(out_dir_lock(user_cfg.out_dir))
        check_new_run(user_cfg)  # without --resume, never replace a checkpoint unasked
        given = user_cfg.explicit_fields()
        ckpt = read_resumed(user_cfg) if user_cfg.resume else None
        self.explicit = given - RUN_FIELDS
        changed = changed_fields(user_cfg, ckpt) if ckpt is not None else []
        if ckpt is not None:  # the fields left unset continue the stored run
            user_cfg, self.explicit = resumed_config(user_cfg, ckpt)
        task_kwargs = user_cfg.task_kwargs()
        check_task_flags(user_cfg.task, task_kwargs)
        learned = learned_task_kwargs(ckpt) if ckpt is not None else {}  # the stored vocabulary, bins
        try:
            self.task = get_task(user_cfg.task, **task_kwargs, **learned)
        except ValueError as e:  # the task's argument, in the words of the config (the script's --seq-len)
            raise ValueError(re.sub(r"\bseq_len\b", "TrainConfig.seq_len", str(e))) from e
        self.task.check_data()  # a missing data set fails now, with how to get it
        self.cfg = cfg = resolve(user_cfg, self.task.seq_len, layout.world_size)
        check_given_fields(cfg, given, self.task)
        data = {} if cfg.data_dir is None else {"data_dir": cfg.data_dir}  # a default folder too, made absolute
        self.task_info = task_record(self.task, {**task_kwargs, **data})
        self.model_config = build_model_config(cfg, self.task)
        self.path = checkpoint_path(cfg.out_dir)
        diffusion_config = cfg.diffusion_config()
        if ckpt is not None:
            stored = stored_objective(ckpt)[1]
            if diffusion_config is not None and stored is not None and stored.noise == diffusion_config.noise:
                diffusion_config = stored  # its parameterization too, which no flag sets ("plain" before the field)
            check_compatible(ckpt, self.model_config, self.task_info, self.path, cfg.objective, diffusion_config)
            if changed and layout.is_main:
                log.warning("resuming with changed settings (%s): the run goes on with them", "; ".join(changed))
        estimate = check_memory(cfg, self.model_config, self.task.seq_len, self.device)
        self._info("estimated peak memory %.2f GiB per process", estimate / GIB)
        if layout.is_main:  # fail now, not at the first checkpoint after minutes of training
            claim_out_dir(cfg, held, locked)

        use_bf16 = cfg.dtype == "bfloat16" or (
            cfg.dtype == "auto" and self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        )
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

        torch.manual_seed(cfg.seed)
        self.model = diffusion.make_model(self.model_config, cfg.objective, diffusion_config)
        if layout.distributed:
            torch.manual_seed(cfg.seed + layout.rank)
        self.start_iter, self.history = 0, []
        self.val_names = ("diffusion",) if cfg.objective == "diffusion" else ("random", "l2r")
        self.best_val_loss = {name: math.inf for name in self.val_names}
        if ckpt is not None:
            self.model.load_state_dict(ckpt["model"])
        self.model.to(self.device)
        if ckpt is not None:
            self._restore(ckpt)  # also the optimiser, holding the stored Adam moments
        else:
            self.optimizer = configure_optimizer(self.model, cfg, self.device)
        self.eval_pending = not (self.history and self.history[-1]["iter"] == self.start_iter)  # on every rank

        net = ModelLoss(self.model)
        net = torch.compile(net) if cfg.compile else net
        if layout.distributed:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            net = DistributedDataParallel(net, device_ids=device_ids)
        self.net = net
        self.step_weight = step_weights(cfg.loss_weighting, self.task.seq_len)  # (T,) or None
        if self.step_weight is not None:
            self.step_weight = self.step_weight.to(self.device)
        self.accum = cfg.grad_accum // layout.world_size
        self.tokens_per_step = cfg.batch_size * cfg.grad_accum * self.task.seq_len
        self.train_log: list[dict] = []

    def _restore(self, ckpt: dict) -> None:
        stored = ckpt["train_config"]
        scales = tuple(1.0 if stored.get(k) is None else stored[k]  # checkpoints before the scales: 1
                       for k in ("embedding_lr_scale", "final_norm_lr_scale"))
        self.optimizer = restore_optimizer(self.model, self.cfg, self.device, ckpt["optimizer"], scales)
        self.start_iter, self.history = ckpt["iter"], list(ckpt["history"])
        self.best_val_loss = dict(ckpt["best_val_loss"])
        states = ckpt["rng"]
        if len(states) == self.layout.world_size:
            set_rng_state(states[self.layout.rank], self.device)
        else:
            log.warning("checkpoint has RNG states for %d ranks, running %d: dropout masks are reseeded",
                        len(states), self.layout.world_size)
            torch.manual_seed(self.cfg.seed + self.layout.rank + self.start_iter)
        if self.layout.is_main:
            log.info("resumed from %s at iter %d", self.path, self.start_iter)

    def _info(self, msg: str, *args) -> None:
        if self.layout.is_main:
            log.info(msg, *args)

    def check_finite(self, it: int) -> None:
        """Raise ``FloatingPointError`` when a weight is NaN or infinite (one host sync), so that neither the
        evaluation nor a checkpoint sees a diverged model; all ranks must call it."""
        if not torch.stack([p.detach().isfinite().all() for p in self.model.parameters()]).all().item():
            raise self._diverged(f"non-finite weights at iter {it}")

    def _diverged(self, what: str) -> FloatingPointError:
        kept = f"{self.path} is left as it was" if self.path.is_file() else "no checkpoint was written"
        return FloatingPointError(f"{what}: the run diverged; {kept}. Lower --lr or --grad-clip, or change --seed")

    def save(self, it: int) -> None:
        """Write ``ckpt.pt`` (rank 0) with every rank's RNG state; all ranks must call it."""
        states = self.layout.gather(rng_state(self.device))
        if self.layout.is_main:
            ckpt = build_checkpoint(self.model, self.optimizer, self.cfg, self.task_info, it, states,
                                    self.best_val_loss, self.history, self.explicit)
            atomic_save(ckpt, self.path)
            log.info("saved %s at iter %d", self.path, it)

    def _should_stop(self) -> bool:
        """This process's stop request (a flag read: evaluation polls it between batches, no collective)."""
        return self.stop.requested

    def evaluate(self, it: int) -> None:
        """Rank 0: validation loss in random and left-to-right order, and sampled validity. A stop request
        abandons it: nothing of it is recorded (history, best validation loss, log)."""
        if not self.layout.is_main or (self.history and self.history[-1]["iter"] == it):
            return
        self.model.eval()
        try:
            record, line = self._evaluate(it)
        except EvaluationStopped:
            log.warning("evaluation at iter %d abandoned: stopping", it)
            return
        finally:
            self.model.train()
        for name in self.val_names:
            self.best_val_loss[name] = min(self.best_val_loss[name], record[f"val_loss_{name}"])
        self.history.append(record)
        log.info(line)

    def _evaluate(self, it: int) -> tuple[dict, str]:
        record: dict = {"iter": it}
        for name in self.val_names:
            loss = self._val_loss(name)
            record[f"val_loss_{name}"] = loss
            record[f"val_ppl_{name}"] = math.exp(min(loss, 700.0))
        line = f"eval iter {it} | val loss " + " | ".join(
            f"{name} {record[f'val_loss_{name}']:.4f} (ppl {record[f'val_ppl_{name}']:.2f})" for name in self.val_names
        )
        if self.canvas is not None:
            metrics = sample_validity(self.model, self.task, self.canvas, self.cfg.seed, self.device,
                                      should_stop=self._should_stop)
            record.update({f"sample_{k}": float(v) for k, v in metrics.items()})
            line += " | " + metrics_line(metrics, self.canvas.shape[0])
        return record, line

    def _val_loss(self, name: str) -> float:
        """Validation loss ``name``: "random" or "l2r" order for a σ-GPT, "diffusion" for a diffusion model
        (noise redrawn from the same seed at every evaluation)."""
        if name == "diffusion":
            g = stream_generator(self.cfg.seed, VAL_STREAM, 1)
            xs = [x for x, _ in self.val_batches]
            return diffusion_training.estimate_val_loss(self.model, xs, g, self.autocast, self.device,
                                                        should_stop=self._should_stop)
        return estimate_val_loss(self.model, self.val_batches, name, self.task.bos, self.autocast, self.device,
                                 should_stop=self._should_stop)

    def _prepare_eval(self) -> None:
        self.val_batches = self.canvas = None
        if not self.layout.is_main:
            return
        self.val_batches = make_val_batches(self.task, self.cfg)
        n = self.cfg.num_eval_samples
        if n > 0:
            canvas = self.task.sample_batch(n, "val", stream_generator(self.cfg.seed, SAMPLE_STREAM))
            if numeric_metrics(self.task.evaluate(canvas)):
                self.canvas = canvas

    def step(self, it: int) -> torch.Tensor:
        """One optimiser step; returns this rank's mean micro-batch loss (a device tensor, no sync)."""
        lr = learning_rate(it, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # no lr_scale in checkpoints before it
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            index = self.layout.rank * self.accum + micro
            batch = self._batch(it, index)
            last = micro == self.accum - 1
            sync = nullcontext() if last or not self.layout.distributed else self.net.no_sync()
            with sync:
                with self.autocast:
                    loss = self._loss(batch)
                (loss / self.accum).backward()
            loss_sum += loss.detach().float()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / self.accum

    def _batch(self, it: int, index: int) -> tuple:
        if self.cfg.objective == "diffusion":  # same data stream; the noise is drawn after the rows
            g = stream_generator(self.cfg.seed, TRAIN_STREAM, it, index)
            return diffusion_training.get_batch(self.model, self.task, self.cfg.batch_size, g, self.device)
        batch = get_batch(self.task, self.cfg, it, index, self.model_config.start_pos, self.device)
        return batch if self.step_weight is None else (*batch, self.step_weight)

    def _loss(self, batch: tuple) -> torch.Tensor:
        """Scalar loss of one micro-batch through ``self.net`` (compiled / DDP-wrapped)."""
        return self.net(*batch)

    def _log(self, it: int, loss: torch.Tensor, window_steps: int, window_start: float) -> None:
        loss_value = self.layout.mean(loss).item()
        if not math.isfinite(loss_value):
            raise self._diverged(f"training loss {loss_value} at iter {it}")
        window_time = time.perf_counter() - window_start
        cfg = self.cfg
        tokens_per_s = self.tokens_per_step * window_steps / max(window_time, 1e-9)
        entry = {"iter": it, "loss": loss_value, "lr": learning_rate(it, cfg), "tokens_per_s": tokens_per_s}
        weighted = " (step-weighted)" if cfg.loss_weighting != "uniform" else ""
        parts = [f"iter {it}/{cfg.max_iters}", f"loss {loss_value:.4f}{weighted}", f"lr {entry['lr']:.2e}",
                 f"{tokens_per_s:,.0f} tok/s"]
        if cfg.order == "curriculum":
            entry["l2r_fraction"] = curriculum_l2r(it, cfg)
            parts.append(f"l2r {entry['l2r_fraction']:.3f}")
        mfu = estimate_mfu(self.model_config, self.n_params, self.task.seq_len, tokens_per_s / self.layout.world_size,
                           self.device, bf16=not isinstance(self.autocast, nullcontext))
        if mfu is not None:
            entry["mfu"] = mfu
            parts.append(f"mfu {100 * mfu:.1f}%")
        eta = (cfg.max_iters - it - 1) * window_time / max(window_steps, 1)
        parts.append(f"eta {timedelta(seconds=round(min(eta, _MAX_ETA_S)))}")  # a huge --max-iters: capped
        self.train_log.append(entry)
        self._info(" | ".join(parts))

    def run(self) -> TrainResult:
        cfg = self.cfg
        self.n_params = self.model.num_params()
        self._info("task %s (T=%d, V=%d) | %s: %.2fM params | %s | %d tokens/step | %s%s",
                   self.task.name, self.task.seq_len, self.task.vocab_size, cfg.preset, self.n_params / 1e6,
                   f"order {cfg.order}" if cfg.objective == "sigma" else f"diffusion ({cfg.diffusion_noise} noise)",
                   self.tokens_per_step, self.device,
                   f" x{self.layout.world_size} ranks" if self.layout.distributed else "")
        final_only = self.start_iter == cfg.max_iters and self.eval_pending  # its final evaluation was stopped
        if self.start_iter >= cfg.max_iters and not final_only:
            if self.layout.is_main:
                log.warning("nothing to train: the checkpoint is at iter %d and max_iters is %d; pass a larger "
                            "--max-iters to train on", self.start_iter, cfg.max_iters)
            self.model.eval()
            return TrainResult(self.model, self.task, self.history, self.path, [], False)
        self._prepare_eval()
        self.model.train()
        it, stopped = self.start_iter, False
        window_steps, window_start = 0, time.perf_counter()
        while it < cfg.max_iters and not stopped:
            if it % cfg.eval_interval == 0:
                self.check_finite(it)
                self.evaluate(it)
                # rank 0 abandons its evaluation on a stop request: all ranks stop before the next step
                stopped = self.layout.any(self.stop.requested)  # one collective per evaluation
                if stopped:
                    break
                if it > self.start_iter:
                    self.save(it)
                window_steps, window_start = 0, time.perf_counter()
            loss = self.step(it)
            window_steps += 1
            if it % cfg.log_interval == 0 or it == cfg.max_iters - 1:
                self._log(it, loss, window_steps, window_start)
                window_steps, window_start = 0, time.perf_counter()
            it += 1
            stopped = self.layout.any(self.stop.requested)
        self.check_finite(it)
        if not stopped:
            self.evaluate(it)
            stopped = self.layout.any(self.stop.requested)  # the final evaluation was abandoned
        if it > self.start_iter or (stopped and not cfg.resume) or (final_only and not stopped):
            self.save(it)  # stopped in the first evaluation: the initial state, so that --resume continues it
        self.model.eval()
        return TrainResult(self.model, self.task, self.history, self.path, self.train_log, stopped,
                           self.stop.signum if stopped else None)
