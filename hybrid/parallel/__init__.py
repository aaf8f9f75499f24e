"""Tensor and expert parallelism over torch.distributed: one model across N processes (`torchrun`).

    plan.py     which part of every tensor each rank holds (`ShardPlan`), from the config alone
    packed.py   the same for each tensor of a packed (FP8, NVFP4, MXFP4) weight, at whole scale blocks
    files.py    the checkpoint as one rank sees it: each tensor cut to its part before it is read
    modules.py  the rank's model: vocabulary-parallel embedding and head, local experts, the collectives
    comm.py     the collectives, each call counted (bytes per token are measured)
    launch.py   `torchrun ... -m hybrid generate`: the process group, threads, rank 0's prompt, errors

`hybrid.load(path, tensor_parallel=N)` under an initialised process group of N ranks gives each rank its
shard; the forward's results (logits) are the full model's on every rank.
"""

from __future__ import annotations

from hybrid.config import HybridConfig
from hybrid.parallel.comm import Collectives, Traffic, ring_bytes
from hybrid.parallel.modules import TensorParallel
from hybrid.parallel.plan import Shard, ShardPlan
from moe.quant.config import QuantConfig

__all__ = ["Collectives", "Shard", "ShardPlan", "TensorParallel", "Traffic", "ring_bytes", "rank_plan"]


def rank_plan(config: HybridConfig, tensor_parallel: int | None,
              quant: QuantConfig | None = None) -> tuple[ShardPlan, Collectives] | None:
    """This process's (plan, collectives) for `tensor_parallel` ranks, or None for one process
    (`tensor_parallel` None or 1 without a larger process group). `quant`: the checkpoint's quantization
    config (packed weights split at whole scale blocks).

    Raises:
        ValueError: `tensor_parallel` below 1, or N > 1 without an initialised process group, or not equal to its
            world size.
        ConfigError: the config's sizes do not split N ways (`ShardPlan`).
    """
    import torch.distributed as dist

    if tensor_parallel is None:
        return None
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be a positive integer, got {tensor_parallel!r}")
    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialised else 1
    if tensor_parallel != world and not initialised:
        raise ValueError(f"tensor_parallel={tensor_parallel} needs a torch.distributed process group of "
                         f"{tensor_parallel} ranks, and none is initialised (start the ranks with torchrun and call "
                         "torch.distributed.init_process_group first)")
    if tensor_parallel != world:
        raise ValueError(f"tensor_parallel={tensor_parallel}, but the process group has {world} rank(s); "
                         "they must be equal")
    if world == 1:
        return None
    comm = Collectives()
    return ShardPlan(config, comm.rank, comm.world, quant), comm
