"""sigmafast: train σ-GPT models and sample from them in any order and in bursts."""

from .model import PRESETS, SigmaGPT, SigmaGPTConfig
from .sampler import conditional_density, generate, log_likelihood

__all__ = ["PRESETS", "SigmaGPT", "SigmaGPTConfig", "conditional_density", "generate", "log_likelihood"]
__version__ = "0.1.0"
