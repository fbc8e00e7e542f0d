"""sigmafast: train σ-GPT models and sample from them in any order and in bursts."""

from . import diffusion
from .model import SigmaGPT
from .model_config import PRESETS, SigmaGPTConfig
from .runner import Engine
from .density import conditional_density, log_likelihood
from .sampler import generate, warmup

__all__ = ["PRESETS", "Engine", "SigmaGPT", "SigmaGPTConfig", "conditional_density", "diffusion", "generate",
           "log_likelihood", "warmup"]
__version__ = "0.1.0"
