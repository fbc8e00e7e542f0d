"""sigmafast.diffusion: a discrete-diffusion baseline (D3PM uniform, MDLM absorbing) on the σ-GPT backbone.

- :mod:`~sigmafast.diffusion.noise`: forward processes, closed-form marginals, reverse steps, losses;
- :mod:`~sigmafast.diffusion.model`: :class:`DiffusionGPT` (bidirectional backbone + timestep embedding);
- :mod:`~sigmafast.diffusion.sampler`: :func:`generate`, fixed-step sampling with ``sigmafast.generate``'s
  conventions;
- :mod:`~sigmafast.diffusion.training`: the trainer's hooks for ``--objective diffusion``.
"""

from .model import OBJECTIVES, DiffusionConfig, DiffusionGPT, make_model, objective_of
from .noise import NOISES
from .sampler import generate

__all__ = ["NOISES", "OBJECTIVES", "DiffusionConfig", "DiffusionGPT", "generate", "make_model", "objective_of"]
