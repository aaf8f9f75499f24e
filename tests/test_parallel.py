"""Tensor and expert parallelism (`hybrid.parallel`) against the single-process model.

The oracle is the single-process model of the same transformers-made checkpoint (itself checked against
transformers in test_parity.py): N gloo ranks on this machine (tests/tp_worker.py) must give its logits
(fp32, atol = rtol = 1e-5) for a whole prompt, for a prefill on the cache and for every decode step, and its
24 greedy tokens. Each case also checks what a replicate-everything design would fail: each rank holds E / N
experts, reads exactly the bytes it holds (never the whole tensor, then a slice) and less than the model, and
its collectives per decoded token are the ones `ShardPlan.traffic` states.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import helpers
from hybrid.config import ConfigError, HybridConfig
from hybrid.parallel import ShardPlan, rank_plan

WORKER = Path(__file__).with_name("tp_worker.py")
NEW_TOKENS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(directory: Path, world: int, out: Path, prompt: list[int], expect_error: bool = False):
    """Start `world` worker ranks on loopback; returns each rank's (json, tensors). Raises naming the rank and
    its error when one fails; with `expect_error`, returns each rank's error text instead (and raises when one
    succeeds)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(directory), str(out), "--prompt", ",".join(map(str, prompt)),
             "--new-tokens", str(NEW_TOKENS)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    if expect_error:
        assert all(p.returncode == 3 for p in procs), logs
        return [(out / f"rank{rank}.error").read_text() for rank in range(world)]
    for rank, p in enumerate(procs):
        error = out / f"rank{rank}.error"
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}: " + (
            error.read_text() if error.exists() else logs[rank][-3000:])
    return [(json.loads((out / f"rank{r}.json").read_text()), load_file(str(out / f"rank{r}.safetensors")))
            for r in range(world)]


# (checkpoint of conftest.CHECKPOINTS, ranks): what each covers
CASES = [
    ("all4_ng2_gqa4_c8", 2),  # every layer type; KV heads and groups split evenly
    ("all4_ng2_gqa4_c8", 4),  # KV heads (2) fewer than ranks: replicated; n_groups 2 with N = 4: a group spans 2 ranks
    ("ng1_mha_c16", 4),  # n_groups 1 with N = 4: one group over every rank
    ("nano_like_c16", 2),  # n_groups 8 larger than N; one KV head (MQA) on both ranks
    ("tied_c8", 2),  # tied embeddings: one vocabulary-parallel matrix for both
    ("latent_moe_c8", 2),  # latent projections replicated; 6 experts, 3 per rank
    ("grouped_routing_c16", 4),  # grouped routing over 8 experts, 2 per rank
]


@pytest.mark.parametrize("name,world", CASES, ids=[f"{n}-tp{w}" for n, w in CASES])
def test_ranks_equal_one_process(checkpoint, tmp_path, name, world):
    ck = checkpoint(name)
    config = HybridConfig.from_file(ck.directory / "config.json")
    prompt = helpers.random_ids(13, ck.vocab_size, seed=world).tolist()[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        full = ck.ours(ids)
    tokens, steps = helpers.our_greedy(ck.ours, ids, NEW_TOKENS)
    ranks = run_ranks(ck.directory, world, tmp_path, prompt)

    file_bytes = sum(t.numel() * t.element_size() for t in
                     {t.data_ptr(): t for t in ck.ours.state_dict().values()}.values())
    E = config.n_routed_experts
    for rank, (info, tensors) in enumerate(ranks):
        torch.testing.assert_close(tensors["full"], full, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tensors["steps"], steps[0], atol=1e-5, rtol=1e-5)
        assert info["tokens"] == tokens[0].tolist()
        # experts: E / N per rank, rank r's from r E / N
        assert info["experts"] == [E // world] * config.hybrid_override_pattern.count("E")
        assert info["expert_offsets"] == [rank * E // world] * len(info["experts"])
        # it read what it holds (and a tied head's part, checked against the embeddings), less than the model
        plan = ShardPlan(config, rank, world)
        head = (plan.vocab[1] - plan.vocab[0]) * config.hidden_size * 4 if config.tie_word_embeddings else 0
        assert info["read_bytes"] == info["state_bytes"] + head
        assert info["state_bytes"] < file_bytes
        # one decode step's collectives are the stated formula's
        assert info["traffic"] == plan.traffic(tokens=1, dtype_bytes=4)
    held = sum(info["state_bytes"] for info, _ in ranks)
    assert held < file_bytes * 2  # the big matrices are split, not copied


def test_rank_parts_cover_every_tensor():
    """Over the ranks, every split tensor's parts cover it; each piece is held by one rank, or by the ranks a
    KV head or a Mamba group is replicated on."""
    config = HybridConfig(hybrid_override_pattern="M*E-", vocab_size=101, hidden_size=16, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=4, intermediate_size=30, mamba_num_heads=8,
                          mamba_head_dim=2, ssm_state_size=4, n_groups=2, n_routed_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=6, moe_shared_expert_intermediate_size=10)
    from hybrid.loading import build_model

    shapes = {n: tuple(t.shape) for n, t in build_model(config, torch.float32).state_dict(keep_vars=True).items()}
    for world in (1, 2, 4, 8):
        plans = [ShardPlan(config, r, world) for r in range(world)]
        for name, shape in shapes.items():
            shards = [p.shard_of(name) for p in plans]
            if shards[0].kind != "split":
                continue
            dim = shards[0].dim
            held = torch.zeros(shape[dim], dtype=torch.int64)
            for s in shards:
                for a, b in s.ranges:
                    held[a:b] += 1
            kv_or_groups = "k_proj" in name or "v_proj" in name or ("in_proj" in name or "conv1d" in name)
            unheld = (held == 0).nonzero().flatten().tolist()
            assert not unheld, f"{name} at N={world}: rows {unheld} unheld"
            assert bool((held == 1).all()) or (kv_or_groups and world > 2), f"{name} at N={world}: held {held.tolist()}"


@pytest.mark.parametrize("overrides,world,field", [
    (dict(n_routed_experts=6), 4, "n_routed_experts"),
    (dict(num_attention_heads=6, num_key_value_heads=2), 4, "num_attention_heads"),
    (dict(num_attention_heads=12, num_key_value_heads=3), 4, "num_key_value_heads"),
    (dict(mamba_num_heads=6, n_groups=3), 2, "n_groups"),
    (dict(mamba_num_heads=6, n_groups=2), 4, "mamba_num_heads"),
])
def test_sizes_that_do_not_split_are_refused(overrides, world, field):
    config = HybridConfig(hybrid_override_pattern="M*E", **{**dict(num_attention_heads=8, num_key_value_heads=2,
                                                                  mamba_num_heads=8, n_groups=2), **overrides})
    with pytest.raises(ConfigError, match=rf"^tensor_parallel={world}: .*`{field}` \(") as e:
        ShardPlan(config, 0, world)
    fits = [n for n in range(1, 9) if not ShardPlan._problems(config, set("M*E"), n)]
    assert f"(this config splits over {', '.join(map(str, fits))} ranks)" in str(e.value) and world not in fits


def test_every_field_that_does_not_split_is_named():
    config = HybridConfig(hybrid_override_pattern="M*E", num_attention_heads=4, num_key_value_heads=2,
                          mamba_num_heads=8, n_groups=2, n_routed_experts=8)
    with pytest.raises(ConfigError) as e:
        ShardPlan(config, 0, 3)
    for field in ("num_attention_heads", "num_key_value_heads", "mamba_num_heads", "n_groups", "n_routed_experts"):
        assert f"`{field}`" in str(e.value)
    assert str(e.value).endswith("(this config splits over 1, 2, 4 ranks)")


def test_quantized_checkpoint_is_refused(checkpoint, tmp_path):
    """Packed weights are not sharded yet: every rank refuses the FP8 checkpoint, naming it."""
    from hybrid.quantize import quantize_checkpoint

    quantize_checkpoint(checkpoint("all4_ng2_gqa4_c8").directory, tmp_path / "fp8", "fp8")
    for error in run_ranks(tmp_path / "fp8", 2, tmp_path / "out", [3, 4, 5], expect_error=True):
        assert "tensor_parallel=2 with a quantized checkpoint" in error and "not supported yet" in error, error


def test_world_size_mismatch_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel=2 needs a torch.distributed process group of 2 ranks, and "
                       "none is initialised"):
        rank_plan(HybridConfig(), 2)
    with pytest.raises(ValueError, match="positive integer"):
        rank_plan(HybridConfig(), 0)
    assert rank_plan(HybridConfig(), 1) is None and rank_plan(HybridConfig(), None) is None


# ------------------------------------------------------------------------------------------ torchrun
def torchrun(args: list[str], stdin: bytes | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "hybrid", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, timeout=300)


def test_torchrun_generate_equals_one_process():
    """`torchrun --nproc-per-node 2 -m hybrid generate` on the shipped checkpoint (fp32): rank 0 prints one
    result, the same text and tokens as one process; the prompt comes from rank 0's stdin."""
    args = ["generate", "--prompt", "-", "--max-new-tokens", "24", "--dtype", "fp32", "--json"]
    one = subprocess.run([sys.executable, "-m", "hybrid", *args], input=b"The quick brown fox", capture_output=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr.decode()
    two = torchrun(args, stdin=b"The quick brown fox")
    assert two.returncode == 0, two.stderr.decode()[-3000:]
    lines = two.stdout.decode().splitlines()
    assert len(lines) == 1, lines  # rank 0 alone prints
    expected, got = json.loads(one.stdout), json.loads(lines[0])
    assert got["token_ids"] == expected["token_ids"] and got["text"] == expected["text"]
    assert got["generated_tokens"] == 24


def test_torchrun_error_on_one_rank_stops_every_rank():
    """Rank 0 alone reads stdin; its error (bytes that are not UTF-8) reaches the other rank, and the run ends
    with the message once instead of rank 1 waiting for a prompt."""
    run = torchrun(["generate", "--prompt", "-", "--max-new-tokens", "4"], stdin=b"caf\xe9")
    assert run.returncode != 0
    err = run.stderr.decode()
    assert err.count("error: rank 0: stdin is not valid UTF-8: byte 0xe9 at offset 3") == 1, err[-3000:]
    assert run.stdout == b""
