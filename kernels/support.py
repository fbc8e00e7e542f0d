"""Whether the Triton kernels can run in this process: triton importable, and at least ``MIN_TRITON``.

Every kernel's first statement is ``utils.gdc_enter``, which names ``tl.extra.cuda.gdc_wait``, and the
launches may ask for Triton's ``launch_pdl`` option: both appeared in Triton 3.4 (the release torch 2.8
pins). With an older Triton (torch 2.4 to 2.7 pin 3.0 to 3.3) or none, the ``auto`` backend takes the PyTorch
reference, with a warning on CUDA tensors; an explicit ``triton`` backend and every launch raise
:class:`TritonUnavailable`. Programmatic dependent launch needs ``PDL_TRITON``: 3.4's ``gdc_wait`` does not
compile (it takes ``_builder``, and 3.4's ``extern`` passes ``_semantic``). Nothing here imports triton
until it is asked.
"""

from __future__ import annotations

import functools
import re
from typing import Optional

MIN_TRITON = (3, 4)
TORCH_WITH_IT = "2.8"  # the first torch whose pinned triton is MIN_TRITON or newer
PDL_TRITON = (3, 5)


class TritonUnavailable(ImportError):
    """The fused Triton kernels cannot run here: triton is missing, or older than ``MIN_TRITON``."""


def version_tuple(version: str) -> Optional[tuple[int, int]]:
    """(major, minor) of a version string such as ``"3.4.0"`` or ``"3.5.0+git1b0418a9"``; None if it has none."""
    numbers = re.findall(r"\d+", version)[:2]
    return (int(numbers[0]), int(numbers[1])) if len(numbers) == 2 else None


def installed_triton() -> tuple[str, Optional[tuple[int, int]]]:
    """The importable triton's version, as text and as (major, minor) (None if unreadable); ``ImportError``
    without one."""
    import triton

    found = str(getattr(triton, "__version__", ""))
    return found, version_tuple(found)


def required_version() -> str:
    """``MIN_TRITON`` as text, e.g. ``"3.4"``."""
    return ".".join(map(str, MIN_TRITON))


@functools.lru_cache(maxsize=None)
def triton_problem() -> Optional[str]:
    """Why the Triton kernels cannot run in this process, or None when they can (checked once). A version
    that cannot be read is given the benefit of the doubt."""
    try:
        found, version = installed_triton()
    except ImportError as e:
        return f"triton cannot be imported ({e})"
    if version is not None and version < MIN_TRITON:
        return f"found triton {found} (torch {TORCH_WITH_IT} and later come with a recent enough one)"
    return None


def require_triton(what: str) -> None:
    """Raise :class:`TritonUnavailable` naming ``what`` when the kernels cannot run here."""
    problem = triton_problem()
    if problem is not None:
        raise TritonUnavailable(f"{what} needs triton >= {required_version()}; {problem}")


@functools.lru_cache(maxsize=None)
def triton_has_pdl() -> bool:
    """Whether the kernels can run here with programmatic dependent launch (``PDL_TRITON`` or newer)."""
    if triton_problem() is not None:
        return False
    version = installed_triton()[1]
    return version is None or version >= PDL_TRITON
