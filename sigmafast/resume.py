"""What a run takes from the checkpoint it resumes (its config, the task's learned state) and the checks of the
fields a user passed that the resolved config would otherwise ignore."""

from __future__ import annotations

import os

from .batches import SAMPLE_STREAM, stream_generator
from .checkpoint import stored_model_config, stored_objective, stored_train_config
from .evaluation import numeric_metrics
from .train_config import PATH_FIELDS, RUN_FIELDS, TASK_FLAGS, TrainConfig, resume_config


def resumed_config(user_cfg: TrainConfig, ckpt: dict) -> tuple[TrainConfig, frozenset]:
    """The config that continues the run of ``ckpt`` with the fields ``user_cfg`` sets
    (:func:`~sigmafast.train_config.resume_config`), and the fields the run was given explicitly so far,
    to store in the next checkpoint."""
    objective = stored_objective(ckpt)[0]
    if "objective" in user_cfg.explicit_fields() and user_cfg.objective != objective:  # before the merged fields
        raise ValueError(f"TrainConfig.objective: the checkpoint's run has objective {objective!r}, and a resumed "
                         f"run keeps it: leave TrainConfig.objective out, or start a new run (--overwrite, or "
                         f"another --out-dir)")
    stored_explicit = frozenset(ckpt.get("explicit_fields", ()))  # none in checkpoints before the record
    stored = stored_train_config(ckpt)
    recorded = ckpt["task"]["kwargs"]
    for name in PATH_FIELDS:  # older checkpoints kept the path as given; the task record holds it absolute
        if isinstance(stored.get(name), str) and not os.path.isabs(stored[name]) and name in recorded:
            stored[name] = recorded[name]
    cfg = resume_config(user_cfg, stored, stored_model_config(ckpt).to_dict(), stored_explicit)
    return cfg, (stored_explicit | user_cfg.explicit_fields()) - RUN_FIELDS


# Fields a resumed run may change and still be the run it continues: its length, machine and reports.
SAME_RUN_FIELDS = frozenset({"max_iters", "device", "compile", "log_interval", "eval_interval", "num_eval_samples"})


def changed_fields(user_cfg: TrainConfig, ckpt: dict) -> list[str]:
    """``"name: stored -> new"`` for each field ``user_cfg`` sets to another value than the checkpoint's run
    had (but :data:`SAME_RUN_FIELDS`): a resumed run that changes them is no longer the run it continues."""
    stored = ckpt["train_config"]
    return [f"{name}: {stored[name]!r} -> {getattr(user_cfg, name)!r}"
            for name in sorted(user_cfg.explicit_fields() - RUN_FIELDS - SAME_RUN_FIELDS)
            if stored.get(name) is not None and getattr(user_cfg, name) != stored[name]]


def learned_task_kwargs(ckpt: dict) -> dict:
    """The task arguments the stored run learned from its data (the char task's vocabulary, the series task's
    value range and bins): the resumed task is built with them, so that a token id keeps its meaning when
    the data file changed since."""
    return {k: v for k, v in ckpt["task"]["kwargs"].items() if k not in TASK_FLAGS}


def check_given_fields(cfg: TrainConfig, given: frozenset, task) -> None:
    """A ``ValueError`` for a field the user passed (``given``) that the resolved ``cfg`` or ``task`` would
    ignore: ``curriculum_start`` or ``curriculum_iters`` without the curriculum order, ``diffusion_noise``
    without objective diffusion, ``num_eval_samples`` > 0 on a task without a validity metric."""
    for name in ("curriculum_start", "curriculum_iters"):
        if name in given and getattr(cfg, name) is not None and cfg.order != "curriculum":
            raise ValueError(f"TrainConfig.{name} applies to order 'curriculum' only; this run's order is "
                             f"{cfg.order!r}")
    if "diffusion_noise" in given and cfg.objective != "diffusion":
        raise ValueError(f"TrainConfig.diffusion_noise applies to objective 'diffusion' only; this run's objective "
                         f"is {cfg.objective!r}")
    if "num_eval_samples" in given and cfg.num_eval_samples > 0:
        probe = task.sample_batch(1, "val", stream_generator(cfg.seed, SAMPLE_STREAM))
        if not numeric_metrics(task.evaluate(probe)):
            raise ValueError(f"TrainConfig.num_eval_samples ({cfg.num_eval_samples}) needs a task with a validity "
                             f"metric, and task {task.name!r} has none: pass 0 or leave it out")
