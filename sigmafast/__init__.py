"""sigmafast: train σ-GPT models and sample from them in any order and in bursts."""

from . import diffusion
from .model import PRESETS, SigmaGPT, SigmaGPTConfig
from .runner import Engine
from .sampler import conditional_density, generate, log_likelihood, warmup

__all__ = ["PRESETS", "Engine", "SigmaGPT", "SigmaGPTConfig", "conditional_density", "diffusion", "generate",
           "log_likelihood", "warmup"]
__version__ = "0.1.0"
