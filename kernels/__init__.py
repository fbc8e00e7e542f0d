"""sigmafast.kernels: the sampler's attention, acceptance and sampling ops.

This folder is the top-level ``kernels/`` of the repository, installed as the
subpackage ``sigmafast.kernels`` through setuptools ``package-dir``
(``"sigmafast.kernels" = "kernels"``); there is deliberately no top-level
``kernels`` module, which would collide with an unrelated PyPI package.

Every op has one plain PyTorch reference in :mod:`sigmafast.kernels.reference`.
"""

from .reference import Acceptance, acceptance, burst_attention, residual_sample, sample, verify_attention

__all__ = ["Acceptance", "acceptance", "burst_attention", "residual_sample", "sample", "verify_attention"]
