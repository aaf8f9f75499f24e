"""The collectives a sharded model calls, through torch.distributed, each call counted.

Every collective of the forward goes through one `Collectives` object (`HybridForCausalLM.parallel`), so the
bytes a rank exchanges per token are measured, not estimated. Counted per call: the payload (the bytes of the
tensor each rank passes, the "size" of NCCL's tests) and what a ring algorithm sends from each rank:
`2 (N - 1) / N x payload` for an all-reduce, `(N - 1) x payload` for an all-gather (`sent_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Traffic:
    """Counters of the collectives since the last `reset`: calls and payload bytes by kind."""

    calls: dict[str, int] = field(default_factory=dict)
    payload: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.payload[kind] = self.payload.get(kind, 0) + nbytes

    def sent_bytes(self, world: int) -> float:
        """What a ring algorithm sends from each rank for these calls."""
        return ring_bytes(self.payload.get("all_reduce", 0), self.payload.get("all_gather", 0), world)


def ring_bytes(all_reduce_payload: int, all_gather_payload: int, world: int) -> float:
    """Bytes each rank sends in a ring: 2 (N-1)/N of an all-reduce's payload, (N-1) x an all-gather's."""
    return 2 * (world - 1) / world * all_reduce_payload + (world - 1) * all_gather_payload


class Collectives:
    """This process's rank in the default process group (`torch.distributed.init_process_group` first).

    Raises:
        RuntimeError: no process group is initialised.
    """

    def __init__(self):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("tensor parallelism needs torch.distributed initialised first "
                               "(torchrun sets the environment; then `torch.distributed.init_process_group`)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.traffic = Traffic()

    def reset(self) -> None:
        """Start counting afresh (`traffic` counts every collective since the load or the last reset)."""
        self.traffic = Traffic()

    def sent_bytes(self) -> float:
        """What a ring algorithm sends from this rank for the collectives counted (`Traffic.sent_bytes`)."""
        return self.traffic.sent_bytes(self.world)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        self.traffic.add("all_reduce", t.numel() * t.element_size())
        dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` (all the same shape) concatenated along `dim`, in rank order."""
        t = t.contiguous()
        self.traffic.add("all_gather", t.numel() * t.element_size())
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `t` on every rank (in place)."""
        self.traffic.add("broadcast", t.numel() * t.element_size())
        dist.broadcast(t, src)
        return t
