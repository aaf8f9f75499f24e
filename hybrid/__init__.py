"""Nemotron-style hybrid Mamba-2 / attention Mixture-of-Experts language models for inference.

    model, tokenizer = hybrid.load("path/or/org-repo", dtype="bf16")
    logits = model(input_ids)                                  # [B, T, V] float32
    [completion] = hybrid.generate(model, tokenizer, "Hello", max_new_tokens=32)
"""

from hybrid.checkpoint_files import CheckpointError
from hybrid.config import ConfigError, HybridConfig
from hybrid.generate import generate
from hybrid.loading import load, load_model
from hybrid.model import HybridForCausalLM
from hybrid.prefix_cache import PrefixCache
from hybrid.sampling import Completion, SamplingParams
from hybrid.saving import save_checkpoint
from hybrid.serving.speculation import SpeculativeStats
from hybrid.tokenizer import Tokenizer

__all__ = [
    "CheckpointError", "Completion", "ConfigError", "HybridConfig", "HybridForCausalLM",
    "PrefixCache", "SamplingParams", "SpeculativeStats", "Tokenizer", "generate", "load", "load_model",
    "save_checkpoint",
]
