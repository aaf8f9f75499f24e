"""The command line under torchrun: the process group, threads per rank, rank 0's input, errors on any rank.

`torchrun --nproc-per-node N -m hybrid generate MODEL ...` starts N copies of the command with the
torch.distributed environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Each one loads
its shard; rank 0 alone reads the prompt (also stdin) and prints. A failure on one rank is exchanged
(`agree`) so every rank stops with its message instead of waiting in a collective for a rank that left;
torchrun also stops the other workers when one exits with an error.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# long enough for a large model's load on a slow disk, short enough that a lost rank ends the run
TIMEOUT = datetime.timedelta(minutes=10)


def launched() -> bool:
    """Whether this process is one of several ranks started by torchrun (WORLD_SIZE above 1)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def local_rank() -> int:
    """This rank's index among the ranks on its host (torchrun's LOCAL_RANK; 0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def rank_from_environment() -> int:
    """This process's rank as torchrun set it (RANK; 0 when unset), before the process group exists."""
    return int(os.environ.get("RANK", "0") or 0)


def start(threads: int | None, device: torch.device | str = "cpu") -> tuple[int, int]:
    """Join the process group and set this rank's torch threads: `threads`, or the CPUs this process may use
    divided among the ranks on this host (torchrun's own default is one thread per rank). On a CUDA `device`
    the rank's GPU becomes the current one and the group carries CUDA tensors over NCCL and CPU tensors (the
    command's own messages: `agree`, `broadcast_text`) over gloo; on the CPU everything goes over gloo.
    Returns (rank, world size)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(threads or max(1, cpus // max(1, local)))
    return dist.get_rank(), dist.get_world_size()


def finish() -> None:
    """After a rank's command returned (not raised): wait for every rank, so that rank 0 has printed before any
    rank exits (torchrun stops the others as soon as one exits with an error)."""
    dist.barrier()


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_text(text: str | None) -> str:
    """Rank 0's `text` on every rank (the other ranks pass None), sent as UTF-8 bytes (nothing is pickled)."""
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8) if dist.get_rank() == 0 \
        else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    dist.broadcast(size, 0)
    if dist.get_rank() != 0:
        data = torch.empty(int(size), dtype=torch.uint8)
    if int(size):
        dist.broadcast(data, 0)
    return bytes(data.tolist()).decode("utf-8")


def agree(error: str | None) -> str | None:
    """Every rank's error of the step just done (None where it succeeded) -> on every rank, the message alone
    when every rank had the same one, else the first one as "rank R: message"; None when all succeeded."""
    mine = torch.frombuffer(bytearray((error or "").encode("utf-8")), dtype=torch.uint8) if error \
        else torch.empty(0, dtype=torch.uint8)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64))
    longest = max(int(s) for s in sizes)
    if longest == 0:
        return None
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: mine.numel()] = mine
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(parts, padded)
    errors = {rank: bytes(part[: int(size)].tolist()).decode("utf-8", errors="replace")
              for rank, (size, part) in enumerate(zip(sizes, parts)) if int(size)}
    first = min(errors)
    if len(errors) == world and len(set(errors.values())) == 1:
        return errors[first]
    return f"rank {first}: {errors[first]}"


def shared_seed() -> int:
    """A random seed drawn by rank 0, the same on every rank (sampled tokens agree across ranks only if their
    generators do: `hybrid.sampling.check_rank_draws`)."""
    seed = torch.tensor([int.from_bytes(os.urandom(7), "little") if dist.get_rank() == 0 else 0], dtype=torch.int64)
    dist.broadcast(seed, 0)
    return int(seed)


def rank_file(path: str, rank: int, world: int) -> str:
    """Rank `rank`'s own file of a per-rank file `path` (`--prefix-cache`): `path.rank{r}-of-{N}`, beside it."""
    return f"{path}.rank{rank}-of-{world}"
