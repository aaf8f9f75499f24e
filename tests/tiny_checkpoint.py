"""Tiny checkpoints written with our own writer, plus a small byte-level BPE tokenizer, for the tests of
loading, generation, the tokenizer and the CLI (parity with transformers lives in the parity tests)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hybrid.config import HybridConfig
from hybrid.loading import build_model
from hybrid.saving import save_checkpoint

SPECIAL = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = [
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
    "The pass key is 12345. Remember it. 12345 is the pass key.",
    "hello world, the quick brown fox jumps over the lazy dog; naïve café, 東京 ✓",
]

TINY = dict(
    vocab_size=320, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=8,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
    torch_dtype="float32", eos_token_id=2, bos_token_id=1, pad_token_id=0,
)


def write_tokenizer(directory: Path) -> None:
    """A byte-level BPE (vocab <= 320) with ChatML specials; eos `<|im_end|>` (id 4), config eos 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXT * 20, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))
    (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))


def random_model(pattern: str = "M*E-", seed: int = 0, scale: float = 0.3, **overrides):
    """A random fp32 model of `pattern` with our classes (TINY sizes; `overrides` replace config fields)."""
    config = HybridConfig(hybrid_override_pattern=pattern, **{**TINY, **overrides})
    config.validate()
    model = build_model(config, torch.float32, device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 8 + 1))
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 3)
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.add_(1.0)
        for name, b in model.named_buffers():
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return model.eval()


def write_checkpoint(directory: Path, pattern: str = "M*E-", seed: int = 0, max_shard_bytes: int | None = None,
                     **overrides) -> Path:
    """Save a `random_model(pattern, seed, **overrides)` with tokenizer files; return the directory."""
    directory = Path(directory)
    save_checkpoint(random_model(pattern, seed, **overrides), directory, max_shard_bytes=max_shard_bytes)
    write_tokenizer(directory)
    return directory
