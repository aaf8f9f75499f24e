"""Tensor and expert parallelism (`hybrid.parallel`) against the single-process model.

The oracle is the single-process model of the same transformers-made checkpoint (itself checked against
transformers in test_parity.py): N gloo ranks on this machine (tests/tp_worker.py) must give its logits
(fp32, atol = rtol = 1e-5) for a whole prompt, for a prefill on the cache and for every decode step, and its
24 greedy tokens. Each case also checks what a replicate-everything design would fail: each rank holds E / N
experts, reads exactly the bytes it holds (never the whole tensor, then a slice) and less than the model, and
its collectives per decoded token are the ones `ShardPlan.traffic` states, and `hybrid info --tensor-parallel`
states its weights and cache sizes. The same holds for FP8 / NVFP4 / MXFP4 checkpoints `hybrid quantize` wrote
(packed weights cut at whole scale blocks, checked also at Nano's real shapes from its config); and seeded
sampling, MTP speculative decoding and the prefix cache give one process's tokens under 2 ranks.
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
from hybrid.parallel import Shard, ShardPlan, rank_plan

WORKER = Path(__file__).with_name("tp_worker.py")
NANO_CONFIG = Path(__file__).parents[1] / "checkpoints" / "configs" / "nemotron-3-nano-30b-a3b.config.json"
NEW_TOKENS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(directory: Path, world: int, out: Path, prompt: list[int], expect_error: bool = False,
              mode: str = "steps"):
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
             "--new-tokens", str(NEW_TOKENS), "--mode", mode], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT))
    logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    if expect_error:
        assert all(p.returncode == 3 for p in procs), logs
        return [(out / f"rank{rank}.error").read_text() for rank in range(world)]
    for rank, p in enumerate(procs):
        error = out / f"rank{rank}.error"
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}: " + (
            error.read_text() if error.exists() else logs[rank][-3000:])
    if mode != "steps":
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
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
        assert_accounted(info, config, world, rank, None)
    held = sum(info["state_bytes"] for info, _ in ranks)
    assert held < file_bytes * 2  # the big matrices are split, not copied


def assert_accounted(info: dict, config: HybridConfig, world: int, rank: int, quant) -> None:
    """`hybrid info --tensor-parallel N` (`describe_ranks`, from the config alone) states what the loaded rank
    holds: its weights' bytes, its cache's KV bytes per token and Mamba state bytes."""
    from hybrid.accounting import describe_ranks

    stated = describe_ranks(config, torch.float32, world, quant)
    r = stated["ranks"][rank]
    assert (r["weight_bytes"], r["kv_cache_bytes_per_token"], r["mamba_state_bytes_per_sequence"]) == \
        (info["state_bytes"], info["kv_bytes_per_token"], info["mamba_state_bytes"])
    assert stated["collectives_per_token"] == info["traffic"]


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


# ------------------------------------------------------------------------------------------ generation features
def test_sampling_speculative_and_prefix_cache_equal_one_process(tmp_path):
    """Under 2 ranks: seeded sampling, MTP speculative decoding (greedy and sampled: drafts, verification and
    rollback on every rank) and the prefix cache (a hit, then a hit from the saved per-rank file) give one
    process's tokens and the same counts of accepted drafts and reused tokens."""
    import hybrid
    from tiny_checkpoint import write_checkpoint
    from tp_worker import generate_features

    directory = write_checkpoint(tmp_path / "mtp", "M*EM-", seed=3, num_nextn_predict_layers=1, mtp_pattern="*E")
    prompt = helpers.random_ids(19, 320, seed=5).tolist()[0]
    one = generate_features(hybrid.load_model(directory, dtype="fp32", progress=False), prompt, NEW_TOKENS,
                            tmp_path / "prefix.safetensors")
    assert one["prefix_reused"] > 0 and one["prefix_loaded_reused"] > 0  # the cache was hit, in both ways
    assert one["speculative_greedy_acceptance"] < 1 and one["sampled"] != one["speculative_greedy"]
    assert one["prefix_speculative"] == one["prefix_second"]  # drafts over a prefix hit: the plain tokens
    ranks = run_ranks(directory, 2, tmp_path / "out", prompt, mode="features")
    for rank in ranks:
        assert rank == one
    assert (tmp_path / "out" / "prefix.rank1.safetensors").exists()


def test_sampling_without_a_seed_is_refused_on_ranks():
    from hybrid.sampling import SamplingParams, check_rank_draws

    check_rank_draws(SamplingParams(temperature=0.8), sharded=False)
    check_rank_draws(SamplingParams(), sharded=True)  # greedy needs no seed
    check_rank_draws([SamplingParams(temperature=0.8, seed=1), SamplingParams()], sharded=True)
    with pytest.raises(ValueError, match="sampling under tensor parallelism needs a seed"):
        check_rank_draws([SamplingParams(), SamplingParams(temperature=0.8)], sharded=True)


# ------------------------------------------------------------------------------------------ packed weights
# Sizes at which the packed formats' blocks meet the splits: 16 query heads x 16 (o_proj input columns 128 per
# rank at N = 2, 64 at N = 4), 2 KV heads x 16 (32 rows: less than one FP8 128-row block), Mamba 16 heads x 16
# with 2 groups of state 16 (in_proj B, C and dt rows of a rank share one 128-row block), dense MLP and shared
# expert width 160 (not a multiple of 2 x 128 or of 4 x 16).
PACKED_SIZES = dict(hidden_size=64, num_attention_heads=16, num_key_value_heads=2, head_dim=16, mamba_num_heads=16,
                    mamba_head_dim=16, n_groups=2, ssm_state_size=16, intermediate_size=160,
                    moe_shared_expert_intermediate_size=160, moe_intermediate_size=32, n_routed_experts=4)
# quantize everything but the embeddings, the convolutions and the routers (lm_head included: its vocabulary rows
# are split too)
PACKED_EXCLUDE = ["backbone.embeddings", "*.conv1d", "*.mixer.gate"]
PACKED_CASES = [
    ("fp8", 2),  # per-tensor scales: replicated scalars
    ("fp8-block", 2),  # 128 x 128 blocks: in_proj B/C/dt, k/v, lm_head rows widened to whole blocks; MLP width 128 + 32
    ("nvfp4", 4),  # 16-column blocks: o_proj / out_proj 64 columns per rank; MLP width 48 x 3 + 16; KV heads replicated
    ("mxfp4", 2),  # 32-column blocks: MLP width 96 + 64
]


@pytest.fixture(scope="module")
def packed_source(tmp_path_factory):
    _, directory = helpers.make_tf_checkpoint(tmp_path_factory.mktemp("packed-src"), "M*E-", seed=19,
                                              **PACKED_SIZES)
    return directory


@pytest.mark.parametrize("fmt,world", PACKED_CASES, ids=[f"{f}-tp{w}" for f, w in PACKED_CASES])
def test_packed_ranks_equal_one_process(packed_source, tmp_path, monkeypatch, fmt, world):
    """An FP8 / NVFP4 / MXFP4 checkpoint `hybrid quantize` wrote, loaded over N ranks, equals the same checkpoint
    in one process (fp32 1e-5, 24 greedy tokens); each rank reads exactly what it holds, and its traffic is the
    plan's."""
    import hybrid
    from hybrid.quantization import read_quant_config
    from hybrid.quantize import quantize_checkpoint
    from moe.quant import formats

    monkeypatch.setitem(formats.QUANTIZE_FORMATS, "fp8-block", "FP8_PB_WO")
    directory = tmp_path / fmt
    quantize_checkpoint(packed_source, directory, fmt, exclude=PACKED_EXCLUDE)
    one = hybrid.load_model(directory, dtype="fp32", progress=False)
    config = one.config
    quant = read_quant_config(directory, config)
    assert one.get_submodule("lm_head").fmt.label == quant.format_for("lm_head").label  # the head is packed too
    prompt = helpers.random_ids(13, config.vocab_size, seed=world).tolist()[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        full = one(ids)
    tokens, steps = helpers.our_greedy(one, ids, NEW_TOKENS)
    if fmt == "fp8-block":  # the case for rows widened to whole blocks
        _, _, parts = packed_parts(config, quant, world)
        for _, subsets in parts:
            assert {"backbone.layers.0.mixer.in_proj", "backbone.layers.1.mixer.k_proj",
                    "backbone.layers.1.mixer.v_proj", "lm_head"} <= set(subsets)
    ranks = run_ranks(directory, world, tmp_path / "out", prompt)
    file_bytes = sum(t.numel() * t.element_size() for t in one.state_dict().values())
    for rank, (info, tensors) in enumerate(ranks):
        torch.testing.assert_close(tensors["full"], full, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tensors["steps"], steps[0], atol=1e-5, rtol=1e-5)
        assert info["tokens"] == tokens[0].tolist()
        assert info["read_bytes"] == info["state_bytes"] < file_bytes
        assert info["traffic"] == ShardPlan(config, rank, world, quant).traffic(tokens=1, dtype_bytes=4)
        assert_accounted(info, config, world, rank, quant)
    assert sum(info["state_bytes"] for info, _ in ranks) < file_bytes * 1.2  # split, not copied


def nano(fmt: str, monkeypatch=None):
    """Nemotron 3 Nano's config and a QuantConfig of `hybrid quantize --format fmt` quantizing every linear."""
    from hybrid.quantize import plan
    from moe.quant import formats

    if monkeypatch is not None:
        monkeypatch.setitem(formats.QUANTIZE_FORMATS, "fp8-block", "FP8_PB_WO")
    config = HybridConfig.from_file(NANO_CONFIG)
    return config, plan(config, fmt, exclude=PACKED_EXCLUDE)


def packed_parts(config, quant, world):
    """(the full quantized model on meta, every rank's ShardPlan, every rank's `packed_shards`)."""
    from hybrid.loading import build_model
    from hybrid.parallel.packed import packed_shards
    from hybrid.quantization import quantize_modules

    model = build_model(config, torch.bfloat16)
    quantize_modules(model, quant)
    plans = [ShardPlan(config, r, world, quant) for r in range(world)]
    return model, plans, [packed_shards(model, p) for p in plans]


def test_nano_fp8_block_in_proj_holds_whole_blocks(monkeypatch):
    """Nano's Mamba in_proj at N = 2 in FP8 128-blocks: its 64 dt rows are half a block, so both ranks hold that
    block (and the B / C rows of their groups, whole blocks already) and keep their own 32 rows of it."""
    config, quant = nano("fp8-block", monkeypatch)
    model, plans, parts = packed_parts(config, quant, 2)
    name = "backbone.layers.0.mixer.in_proj"  # [z 4096 | x 4096 | B 1024 | C 1024 | dt 64] x 2688
    assert config.hybrid_override_pattern[0] == "M" and model.get_submodule(name).out_features == 10304
    for r, (shards, subsets) in enumerate(parts):
        held = subsets[name].held
        dense = plans[r].shard_of(f"{name}.weight").ranges
        own = torch.cat([torch.arange(a, b) for a, b in dense])
        rows = torch.cat([torch.arange(a, b) for a, b in held])
        assert rows.tolist() == sorted(set(own.tolist()) | set(range(10240, 10304)))  # own rows + the dt block
        assert torch.equal(rows[list(subsets[name].keep)], own)  # keep picks exactly the rank's rows, in order
        assert own[-32:].tolist() == list(range(10240 + 32 * r, 10240 + 32 * (r + 1)))
        assert shards[f"{name}.weight"].ranges == held  # data: one row per row
        assert shards[f"{name}.weight_scale"].ranges == tuple((a // 128, -(-b // 128)) for a, b in held)
        assert shards[f"{name}.weight_scale"].dim == 0
        # out_proj: 2048 input columns per rank, 16 whole blocks
        assert shards["backbone.layers.0.mixer.out_proj.weight_scale"] == Shard("split", 1, ((16 * r, 16 * (r + 1)),))
        assert "backbone.layers.0.mixer.out_proj" not in subsets


def test_nano_mxfp4_shared_down_proj_splits_at_blocks():
    """Nano's shared expert (3,712 wide) in MXFP4 over 8 ranks: 464 columns each would cut 32-column blocks, so
    the 116 blocks are dealt 14 or 15 to a rank (448 or 480 columns); up_proj's rows follow the same ranges."""
    config, quant = nano("mxfp4")
    model, plans, parts = packed_parts(config, quant, 8)
    name = "backbone.layers.1.mixer.shared_experts"
    assert config.hybrid_override_pattern[1] == "E"
    ends = [0]
    for r, (shards, subsets) in enumerate(parts):
        a, b = plans[r].shared
        assert a == ends[-1] and a % 32 == 0 and b - a in (448, 480)
        ends.append(b)
        assert shards[f"{name}.down_proj.weight_scale"] == Shard("split", 1, ((a // 32, b // 32),))
        assert shards[f"{name}.down_proj.weight"] == Shard("split", 1, ((a // 2, b // 2),))  # two E2M1 codes a byte
        assert shards[f"{name}.up_proj.weight"] == Shard("split", 0, ((a, b),)) and not subsets
    assert ends[-1] == 3712


# the rank counts Nano splits over, by format: heads (32 query, 64 Mamba) and 128 experts allow 1-32; FP8 128-blocks
# cut its 3,712-wide shared expert into 29 blocks, fewer than 32 ranks
NANO_FITS = {None: [1, 2, 4, 8, 16, 32], "fp8": [1, 2, 4, 8, 16, 32], "fp8-block": [1, 2, 4, 8, 16],
             "nvfp4": [1, 2, 4, 8, 16, 32], "mxfp4": [1, 2, 4, 8, 16, 32]}


@pytest.mark.parametrize("fmt", list(NANO_FITS), ids=str)
def test_nano_packed_rank_counts(monkeypatch, fmt):
    config, quant = nano(fmt or "fp8", monkeypatch)
    quant = quant if fmt else None
    kinds = set(config.hybrid_override_pattern)
    assert [n for n in range(1, 65) if not ShardPlan._problems(config, kinds, n, quant)] == NANO_FITS[fmt]
    if quant is not None:  # and packed_shards agrees: no column split that cuts a block (it raises)
        for n in (2, NANO_FITS[fmt][-1]):
            packed_parts(config, quant, n)


def test_packed_splits_that_cut_a_block_are_refused(monkeypatch):
    """Refusals at Nano's shapes name the module, the format and the block: FP8 128-blocks over 32 ranks leave
    the shared expert's 29 blocks short of a rank; Mamba heads of 48 over 16 ranks give out_proj 192 input
    columns a rank."""
    import dataclasses

    config, quant = nano("fp8-block", monkeypatch)
    with pytest.raises(ConfigError) as e:
        ShardPlan(config, 0, 32, quant)
    assert str(e.value) == (
        "tensor_parallel=32: `moe_shared_expert_intermediate_size` (3712) is 29 blocks of 128 (the scale blocks of "
        "`backbone.layers.1.mixer.shared_experts.up_proj`, FP8-block), fewer than the ranks: one would hold none "
        "of it (this config splits over 1, 2, 4, 8, 16 ranks)")
    odd = dataclasses.replace(config, mamba_head_dim=48)
    with pytest.raises(ConfigError) as e:
        ShardPlan(odd, 0, 16, quant)
    assert str(e.value).startswith(
        "tensor_parallel=16: `backbone.layers.0.mixer.out_proj` (FP8-block, scale blocks of 128 input columns) would "
        "get 192 input columns per rank, which cuts a scale block"), e.value
    assert str(e.value).endswith("(this config splits over 1, 2, 4, 8 ranks)"), e.value
    ShardPlan(odd, 0, 16)  # unquantized it splits


def test_info_tensor_parallel_nano_by_hand(capsys):
    """`hybrid info NANO --tensor-parallel 4 --json`: the ranks' weights add up to the model's plus, on the 3
    other ranks, what every rank holds whole (23 fp32 routers [128, 2688] with their biases, 53 bf16 norm
    weights of 2,688) and the 6 attention layers' k/v rows once more (2 KV heads over 4 ranks: each held by
    two); each rank's KV cache holds one KV head, its Mamba state 16 of 64 heads."""
    from hybrid.cli import main

    nano_config = str(NANO_CONFIG)
    assert main(["info", nano_config, "--tensor-parallel", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    tp = report["tensor_parallel"]
    H = 2688
    replicated = 23 * (128 * H + 128) * 4 + 53 * H * 2
    kv_once_more = 6 * 2 * 256 * H * 2  # k and v [256, H] bf16: 4 ranks hold each half twice
    assert sum(r["weight_bytes"] for r in tp["ranks"]) == report["weight_bytes"] + 3 * replicated + kv_once_more
    conv, ssm = (4096 // 4 + 2 * 8 // 4 * 128) * 3 * 2, 16 * 64 * 128 * 4
    for r in tp["ranks"]:
        assert r["kv_cache_bytes_per_token"] == 6 * 2 * 1 * 128 * 2 == report["kv_cache_bytes_per_token"] // 2
        assert r["mamba_state_bytes_per_sequence"] == 23 * (conv + ssm)
        assert r["experts_per_moe_layer"] == 32 and r["vocab_rows"] == 131072 // 4
    assert tp["collectives_per_token"] == {"calls": {"all_reduce": 53, "all_gather": 1},
                                           "payload": {"all_reduce": 53 * H * 2, "all_gather": 131072 // 4 * 2}}
    assert tp["ring_bytes_sent_per_token"] == round(2 * 3 / 4 * 53 * H * 2 + 3 * 131072 // 4 * 2)
    # --memory plans one rank's device: the largest rank's weights, a rank's KV and Mamba heads
    assert main(["info", nano_config, "--tensor-parallel", "4", "--memory", "20GB", "--json"]) == 0
    capacity = json.loads(capsys.readouterr().out)["capacity"]
    assert capacity["tensor_parallel"] == 4
    assert capacity["weight_bytes"] == max(r["weight_bytes"] for r in tp["ranks"])
    assert (capacity["kv_bytes_per_token"], capacity["state_bytes_per_sequence"]) == (6 * 2 * 128 * 2, 23 * (conv + ssm))
    assert main(["info", nano_config, "--tensor-parallel", "3"]) == 2
    assert "`num_attention_heads` (32) is not a multiple of 3" in capsys.readouterr().err


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


def test_torchrun_sampling_and_prefix_cache_files(tmp_path):
    """Under torchrun, seeded sampling with a prefix cache gives one process's tokens; each rank keeps its own
    file (FILE.rank{R}-of-2), and the second run resumes from them as one process resumes from its file. Without
    a seed, rank 0 draws one for every rank: the run succeeds with one result."""
    prompt = ("The for statement is used to iterate over the elements of a sequence (such as a string, tuple or "
              "list) or other iterable object, and the while statement repeats")
    args = ["generate", "--prompt", prompt, "--max-new-tokens", "12", "--dtype", "fp32", "--json",
            "--temperature", "0.8", "--top-k", "40", "--prefix-snapshot-interval", "16"]
    ones, twos = [], []
    for _ in range(2):
        one = subprocess.run([sys.executable, "-m", "hybrid", *args, "--seed", "5", "--prefix-cache",
                              str(tmp_path / "one.safetensors")], capture_output=True, timeout=300)
        assert one.returncode == 0, one.stderr.decode()
        ones.append(json.loads(one.stdout))
        two = torchrun([*args, "--seed", "5", "--prefix-cache", str(tmp_path / "pc.safetensors")])
        assert two.returncode == 0, two.stderr.decode()[-3000:]
        twos.append(json.loads(two.stdout))
    assert [t["token_ids"] for t in twos] == [o["token_ids"] for o in ones]
    assert [t["prefix_cache_reused_tokens"] for t in twos] == [o["prefix_cache_reused_tokens"] for o in ones]
    assert ones[1]["prefix_cache_reused_tokens"] > 0
    assert sorted(p.name for p in tmp_path.glob("pc.*")) == ["pc.safetensors.rank0-of-2", "pc.safetensors.rank1-of-2"]
    (tmp_path / "pc.safetensors.rank1-of-2").unlink()  # one rank's file lost: no rank resumes, both are rewritten
    again = torchrun([*args, "--seed", "5", "--prefix-cache", str(tmp_path / "pc.safetensors")])
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    assert "every rank's file is rewritten): rank 1: its file does not exist yet" in again.stderr.decode()
    assert json.loads(again.stdout)["prefix_cache_reused_tokens"] == 0
    assert json.loads(again.stdout)["token_ids"] == ones[0]["token_ids"]
    assert (tmp_path / "pc.safetensors.rank1-of-2").exists()
    unseeded = torchrun(args[:-2])
    assert unseeded.returncode == 0, unseeded.stderr.decode()[-3000:]
    assert json.loads(unseeded.stdout)["generated_tokens"] == 12
    (tmp_path / "dir").mkdir()  # a directory is refused as in one process, nothing written beside it
    refused = torchrun([*args, "--seed", "5", "--prefix-cache", str(tmp_path / "dir")])
    assert refused.returncode != 0 and "is a directory, not a file to write" in refused.stderr.decode()
    assert not list(tmp_path.glob("dir.*"))


def test_torchrun_error_on_one_rank_stops_every_rank():
    """Rank 0 alone reads stdin; its error (bytes that are not UTF-8) reaches the other rank, and the run ends
    with the message once instead of rank 1 waiting for a prompt."""
    run = torchrun(["generate", "--prompt", "-", "--max-new-tokens", "4"], stdin=b"caf\xe9")
    assert run.returncode != 0
    err = run.stderr.decode()
    assert err.count("error: rank 0: stdin is not valid UTF-8: byte 0xe9 at offset 3") == 1, err[-3000:]
    assert run.stdout == b""
