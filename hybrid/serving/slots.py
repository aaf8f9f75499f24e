"""The Mamba state slots of a server: one slot per running sequence, allocated at start.

A slot holds every Mamba layer's conv window and fp32 SSM state for one sequence, a fixed size whatever its
length (Nemotron 3 Nano: 46.8 MiB). The state cannot be paged or cut, so it lives in a pool of whole slots
(vLLM's Mamba cache with its state indices). A forward updates each running sequence's state in place
through views of its slot (`StateSlots.view`); it is never gathered into a batch and scattered back.
"""

from __future__ import annotations

import torch

from hybrid.cache import MambaState
from hybrid.config import MAMBA, HybridConfig
from hybrid.dtypes import torch_dtype


class NoFreeSlots(RuntimeError):
    """Every state slot is held by a running sequence."""


class StateSlots:
    """`num_slots` state slots for the Mamba layers of `config`.

    Attributes:
        conv: per Mamba layer (in pattern order), [num_slots, conv_dim, conv_kernel - 1] in the model dtype.
        ssm: per Mamba layer, [num_slots, mamba_num_heads, mamba_head_dim, ssm_state_size] in
            `mamba_ssm_cache_dtype` (fp32).
    Raises:
        ValueError: num_slots below 1.
    """

    def __init__(self, config: HybridConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        n_mamba = config.hybrid_override_pattern.count(MAMBA)
        ssm_dtype = torch_dtype(config.mamba_ssm_cache_dtype)
        self.conv = [torch.zeros(num_slots, config.conv_dim, config.conv_kernel - 1, dtype=dtype, device=device)
                     for _ in range(n_mamba)]
        self.ssm = [torch.zeros(num_slots, config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size,
                                dtype=ssm_dtype, device=device) for _ in range(n_mamba)]
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest

    @property
    def num_free(self) -> int:
        return len(self._free)

    def nbytes(self) -> int:
        return sum(t.nelement() * t.element_size() for t in self.conv + self.ssm)

    def slot_nbytes(self) -> int:
        """Bytes of one slot (one sequence's state)."""
        return self.nbytes() // self.num_slots

    def grow(self, num_slots: int) -> None:
        """Enlarge the pool to `num_slots` slots (held slots and their states kept)."""
        if num_slots <= self.num_slots:
            return
        for pools in (self.conv, self.ssm):
            for j, t in enumerate(pools):
                new = t.new_zeros(num_slots, *t.shape[1:])
                new[: self.num_slots] = t
                pools[j] = new
        self._free = list(range(num_slots - 1, self.num_slots - 1, -1)) + self._free
        self.num_slots = num_slots

    def allocate(self, zero: bool = True) -> int:
        """A slot holding the zero state of a fresh sequence (`zero`), or whatever its last sequence left, for a
        caller that overwrites all of it (`write`).

        Raises:
            NoFreeSlots: every slot is held.
        """
        if not self._free:
            raise NoFreeSlots(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        if zero:
            for t in self.conv + self.ssm:
                t[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} is not held")
        self._free.append(slot)

    def view(self, layer: int, slot: int) -> MambaState:
        """Mamba layer `layer`'s state of `slot` as a batch-1 `MambaState` of views (writes land in the pool)."""
        return MambaState(conv=self.conv[layer][slot:slot + 1], ssm=self.ssm[layer][slot:slot + 1])

    def read(self, slot: int, out: list[tuple[torch.Tensor, torch.Tensor]] | None = None
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the slot's states, per Mamba layer: (conv [conv_dim, K-1], ssm [nh, P, N]); written into
        `out` (tensors of those shapes and dtypes, as an earlier `read` returned) when given."""
        if out is None:
            return [(c[slot].clone(), s[slot].clone()) for c, s in zip(self.conv, self.ssm)]
        for c, s, (conv, ssm) in zip(self.conv, self.ssm, out):
            conv.copy_(c[slot])
            ssm.copy_(s[slot])
        return out

    def write(self, slot: int, states: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set the slot's states from copies in the form `read` returns."""
        if len(states) != len(self.conv):
            raise ValueError(f"{len(states)} Mamba states for {len(self.conv)} Mamba layers")
        for c, s, (conv, ssm) in zip(self.conv, self.ssm, states):
            c[slot].copy_(conv)
            s[slot].copy_(ssm)
