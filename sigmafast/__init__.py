"""sigmafast: train σ-GPT models and sample from them in any order and in bursts."""

from .model import PRESETS, SigmaGPT, SigmaGPTConfig

__all__ = ["PRESETS", "SigmaGPT", "SigmaGPTConfig"]
__version__ = "0.1.0"
