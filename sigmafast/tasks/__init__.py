"""Task registry: ``get_task(name, **kwargs)`` for every name in :data:`TASK_NAMES`.

The text tasks live in :mod:`sigmafast.tasks.text` and are imported only when
asked for, so the synthetic tasks work without their dependencies.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

from .base import Task
from .maze import MazeTask
from .series import SeriesTask
from .synthetic import PermutationTask, ProductTask, RandomWalkTask, StepTask
from .vertical_rate import VerticalRateTask


def _char():
    from .text import CharTask

    return CharTask, {}


def _token_file(name: str) -> Callable[[], tuple[type, dict]]:
    def load():
        from .text import TokenFileTask

        return TokenFileTask, {"name": name}

    return load


# name -> loader returning (task class, keyword arguments fixed by the registry)
_REGISTRY: dict[str, Callable[[], tuple[type, dict]]] = {
    "product": lambda: (ProductTask, {}),
    "step": lambda: (StepTask, {}),
    "permutation": lambda: (PermutationTask, {}),
    "random_walk": lambda: (RandomWalkTask, {}),
    "maze": lambda: (MazeTask, {}),
    "vertical_rate": lambda: (VerticalRateTask, {}),
    "series": lambda: (SeriesTask, {}),
    "char": _char,
    "owt": _token_file("owt"),
    "wikitext103": _token_file("wikitext103"),
}

TASK_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def task_arguments(name: str) -> Optional[list[str]]:
    """The keyword arguments task ``name`` takes (None: any), the registry's fixed ones left out."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASK_NAMES)}")
    cls, fixed = _REGISTRY[name]()
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return [p for p in params if p not in fixed and params[p].kind is not inspect.Parameter.VAR_POSITIONAL]


def get_task(name: str, /, **kwargs) -> Task:
    """The task called ``name`` built with ``kwargs`` (e.g. ``seq_len=``, ``text=``, ``data_dir=``, ``csv=``)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASK_NAMES)}")
    cls, fixed = _REGISTRY[name]()
    clash = sorted(k for k in kwargs if k in fixed)
    if clash:
        raise TypeError(f"argument(s) {', '.join(clash)} of task {name!r} are fixed by the registry")
    allowed = task_arguments(name)
    unknown = [] if allowed is None else sorted(k for k in kwargs if k not in allowed)
    if unknown:
        raise TypeError(
            f"unknown argument(s) {', '.join(unknown)} for task {name!r}; "
            f"it accepts {', '.join(allowed) if allowed else 'no arguments'}"
        )
    return cls(**fixed, **kwargs)


__all__ = ["TASK_NAMES", "Task", "get_task", "task_arguments"]
