"""Nemotron-style hybrid Mamba-2 / attention Mixture-of-Experts language models for inference."""

from hybrid.cache import HybridCache
from hybrid.config import ConfigError, HybridConfig
from hybrid.checkpoint_files import CheckpointError
from hybrid.loading import load_model
from hybrid.model import HybridForCausalLM

__all__ = ["CheckpointError", "ConfigError", "HybridCache", "HybridConfig", "HybridForCausalLM", "load_model"]
