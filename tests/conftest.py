"""Fixtures shared by the oracle tests.

`checkpoint(name)` builds a tiny randomised transformers checkpoint once per session (see helpers.py),
saves it with `save_pretrained`, loads it with our `hybrid.load_model`, and returns the three.
Numbers that tests record in `helpers.REPORT` are printed at the end of the run.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

import helpers  # noqa: E402

torch.set_num_threads(2)

# Property tests (hypothesis): "ci", the default, is deterministic (derandomize: the same examples every run) and
# small enough that all property tests together add well under a minute on 2 cores; no example database is
# written and no timing health check can fail a run. HYPOTHESIS_PROFILE=dev draws ten times more, random, examples.
settings.register_profile("ci", derandomize=True, max_examples=100, deadline=None, print_blob=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=1000, deadline=None, print_blob=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# name -> (pattern, overrides). Shared by several test files; each is built at most once per session.
CHECKPOINTS = {
    # every layer type; GQA 8/2 = 4; n_groups 2; chunk 8
    "all4_ng2_gqa4_c8": ("M*E-", dict(num_attention_heads=8, num_key_value_heads=2, n_groups=2, chunk_size=8)),
    # n_groups 1; plain multi-head attention (ratio 1); chunk 16
    "ng1_mha_c16": ("MM*E-", dict(num_attention_heads=4, num_key_value_heads=4, n_groups=1, chunk_size=16)),
    # n_groups = mamba_num_heads; MQA (one KV head); conv_kernel 2
    "ngnh_mqa_c8_k2": ("M*M-", dict(num_attention_heads=4, num_key_value_heads=1, n_groups=4, chunk_size=8,
                                    conv_kernel=2)),
    # grouped routing: 8 experts in 4 groups, keep 2 groups, top-3, scaling 2.5
    "grouped_routing_c16": ("ME*E", dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                                         routed_scaling_factor=2.5, chunk_size=16)),
    # latent MoE (experts in a 12-wide latent space), no renormalisation of the top-k weights
    "latent_moe_c8": ("ME*E", dict(moe_latent_size=12, n_routed_experts=6, num_experts_per_tok=2,
                                   norm_topk_prob=False, routed_scaling_factor=1.5, chunk_size=8)),
    # tied embeddings: transformers saves lm_head.weight anyway (set equal to the embeddings here)
    "tied_c8": ("M*-E", dict(tie_word_embeddings=True, chunk_size=8)),
    # chunk 64, 8 heads of 4 in 2 groups, conv_kernel 3
    "chunk64_ng2": ("M*ME", dict(mamba_num_heads=8, mamba_head_dim=4, n_groups=2, chunk_size=64, conv_kernel=3)),
    # Nano-like interleaving, n_groups = nh = 8, state 16, GQA 4/1
    "nano_like_c16": ("MEM*EM-", dict(mamba_num_heads=8, mamba_head_dim=4, ssm_state_size=16, n_groups=8,
                                      num_attention_heads=4, num_key_value_heads=1, chunk_size=16)),
}


@dataclass
class Checkpoint:
    name: str
    directory: Path
    tf: torch.nn.Module  # transformers NemotronHForCausalLM, fp32, eval
    ours: torch.nn.Module  # hybrid.load_model(directory), fp32
    chunk_size: int
    vocab_size: int


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    built: dict[str, Checkpoint] = {}

    def get(name: str) -> Checkpoint:
        if name not in built:
            pattern, overrides = CHECKPOINTS[name]
            seed = sorted(CHECKPOINTS).index(name) + 1
            directory = tmp_path_factory.mktemp(name)
            tf, directory = helpers.make_tf_checkpoint(
                directory, pattern, seed=seed, tie_head=overrides.get("tie_word_embeddings", False), **overrides
            )
            ours = helpers.load_ours(directory)
            built[name] = Checkpoint(name, directory, tf, ours, tf.config.chunk_size, tf.config.vocab_size)
        return built[name]

    return get


def pytest_terminal_summary(terminalreporter):
    if not helpers.REPORT:
        return
    terminalreporter.section("oracle figures")
    for key, value in helpers.REPORT.items():
        terminalreporter.write_line(f"{key}: {value}")
