"""`PagedCache`: the `hybrid.cache.Cache` of one engine step, over the server's KV blocks and state slots.

Before each forward the engine names the sequences it packs (`PagedCache.schedule`: each one's block
table, state slot, positions already computed and new tokens); the model's forward then sees one row of
`sum(new tokens)` tokens with `StepContext.packed` set, and its layers reach each sequence's state through
`Cache.layer(i).seq(s)`:
- attention: `update(k, v, start)` writes the sequence's new keys and values into its blocks and returns
  all of its keys and values [1, nkv, start + T, hd] (gathered from its block table); the layer's
  `attend_decode` stores one new token of each of several sequences and attends them over their rows
  (`hybrid.ops.paged_decode_attention`: in place on the CPU, no gathered copy);
- Mamba: a batch-1 `MambaState` of views of the sequence's slot, updated in place; `rows(seqs)` gives the
  pools and the slots of several sequences, whose decode tokens then run in one step; `keep(t, seqs)` copies
  the states of verifying sequences after their token `t` (speculative decoding), so that `accept` can
  return a sequence to the state after its last accepted token.

The MTP block's cache (`mtp=True`) is a `PagedCache` over the block pool's MTP keys and values, addressed by
the same block tables (position p of a sequence holds the MTP block's keys of hidden state p and token p+1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.cache import Cache, MambaState, PackedSeqs, StepContext
from hybrid.config import ATTENTION, MAMBA, HybridConfig
from hybrid.ops import PagedTable, paged_decode_attention
from hybrid.serving.blocks import BlockPool, GrowingBlockPool
from hybrid.serving.slots import StateSlots


@dataclass
class ScheduledSeq:
    """One sequence of a step: its block table (covering `past + num_tokens` positions), its state slot,
    the positions already computed and the new tokens of this step; `verify`: the tokens are its last token
    and draft tokens, whose Mamba states are kept for `PagedCache.accept`."""

    block_table: list[int]
    slot: int
    past: int
    num_tokens: int
    verify: bool = False


class _SeqKV:
    """One sequence's keys and values in one attention layer (the handle `Attention` uses)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor):
        self.k, self.v, self.index = k, v, index  # pool views [num_blocks * block_size, nkv, hd]; flat positions

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [1, nkv, T, hd] at positions [start, start+T); return the keys and values of
        [0, start+T), [1, nkv, start+T, hd]."""
        end = start + k.shape[2]
        new = self.index[start:end]
        self.k.index_copy_(0, new, k[0].transpose(0, 1))
        self.v.index_copy_(0, new, v[0].transpose(0, 1))
        every = self.index[:end]
        return self.k[every].transpose(0, 1)[None], self.v[every].transpose(0, 1)[None]


class _KVLayer:
    def __init__(self, cache: "PagedCache", k: list[torch.Tensor], v: list[torch.Tensor], j: int):
        self.cache, self.k, self.v, self.j = cache, k, v, j  # the pool's lists (a growing pool swaps their tensors)

    def _pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[self.j], self.v[self.j]
        flat = (-1, k.shape[2], k.shape[3])
        return k.view(flat), v.view(flat)

    def seq(self, s: int) -> _SeqKV:
        return _SeqKV(*self._pools(), self.cache.position_index(s))

    def attend_decode(self, seqs: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One new token of each sequence `seqs` (each scheduled with one token): store its key and value
        k / v [n, nkv, hd] at its position and attend its query q [n, nq, hd] over all of its positions'
        rows in the pool (`hybrid.ops.paged_decode_attention`: on the CPU read in place, no gathered copy)
        -> [n, nq, hd] fp32."""
        k_pool, v_pool = self._pools()
        new, table = self.cache.decode_rows(seqs)
        k_pool.index_copy_(0, new, k.to(k_pool.dtype))
        v_pool.index_copy_(0, new, v.to(v_pool.dtype))
        return paged_decode_attention(q, k_pool, v_pool, table)


class _MambaLayer:
    def __init__(self, cache: "PagedCache", j: int):
        self.cache, self.j = cache, j

    def seq(self, s: int) -> MambaState:
        return self.cache.slots.view(self.j, self.cache.seqs[s].slot)

    def rows(self, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv pool, ssm pool, the slots of sequences `seqs` [len(seqs)] int64): for one decode step of
        several sequences in place (`hybrid.ops.mamba_decode_step`)."""
        slots = self.cache.slots
        return slots.conv[self.j], slots.ssm[self.j], self.cache.slot_index(seqs)

    def keep(self, t: int, seqs: list[int]) -> None:
        """Keep copies of the states of verifying sequences `seqs`, each just after its token `t` of this step
        (`PagedCache.accept` returns to them)."""
        conv, ssm, index = self.rows(seqs)
        self.cache.kept[(self.j, t)] = (list(seqs), conv.index_select(0, index), ssm.index_select(0, index))


class PagedCache(Cache):
    """The state of the sequences of one packed forward, in the pools `blocks` and `slots` (see the module
    docstring). `batch_size` is 1 (one packed row); rows of `snapshot_*` / `restore` are the scheduled
    sequences, by index.
    """

    def __init__(self, config: HybridConfig, blocks: BlockPool, slots: StateSlots, mtp: bool = False):
        self.blocks, self.slots = blocks, slots
        self.batch_size, self.seq_len = 1, 0  # one packed row; its sequences' lengths differ (`Cache.seq_len`)
        self.num_tokens = 0  # tokens of the scheduled step
        self.seqs: list[ScheduledSeq] = []
        self.packed: PackedSeqs | None = None
        self._per_step: dict[tuple, object] = {}  # what the layers of this step ask alike, made once
        # (Mamba layer, token) -> (sequences, their conv and ssm states after that token): `keep`, `accept`
        self.kept: dict[tuple[int, int], tuple[list[int], torch.Tensor, torch.Tensor]] = {}
        self.device = (blocks.k[0] if blocks.k else slots.ssm[0] if slots.ssm else torch.empty(0)).device
        self._offsets = torch.arange(blocks.block_size, device=self.device)
        self._layers = []
        k, v = (blocks.mtp_k, blocks.mtp_v) if mtp else (blocks.k, blocks.v)
        n_kv = n_mamba = 0
        for kind in config.mtp_pattern if mtp else config.hybrid_override_pattern:
            if kind == ATTENTION:
                self._layers.append(_KVLayer(self, k, v, n_kv))
                n_kv += 1
            elif kind == MAMBA:
                self._layers.append(_MambaLayer(self, n_mamba))
                n_mamba += 1
            else:
                self._layers.append(None)

    def schedule(self, seqs: list[ScheduledSeq]) -> PackedSeqs:
        """Name the sequences of the next forward, in packed order.

        Raises:
            ValueError: a block table that does not cover a sequence's positions, or no sequences.
        """
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        bs = self.blocks.block_size
        for i, s in enumerate(seqs):
            if s.num_tokens < 1 or len(s.block_table) * bs < s.past + s.num_tokens:
                raise ValueError(f"sequence {i}: {len(s.block_table)} blocks of {bs} do not hold "
                                 f"{s.past} + {s.num_tokens} positions")
        self.seqs, self._per_step, self.kept = list(seqs), {}, {}
        self.num_tokens = sum(s.num_tokens for s in seqs)
        self.packed = PackedSeqs([s.num_tokens for s in seqs], [s.past for s in seqs],
                                 frozenset(i for i, s in enumerate(seqs) if s.verify), self.device)
        self.packed.prepare(self._step_tables())
        return self.packed

    def _step_tables(self) -> list[list[int]]:
        """The ints this step's layers ask for as device tensors (`PackedSeqs.index`), made before they run:
        the state slots of all, the single-token and the chunk sequences (Mamba), each sequence's block table and
        the one-token sequences' decode rows (attention)."""
        packed = self.packed
        slot = [s.slot for s in self.seqs]
        tables = [slot, [slot[s] for s, _ in packed.singles], [slot[s] for s, _, _ in packed.chunks]]
        if any(isinstance(layer, _KVLayer) for layer in self._layers):
            tables += [self._block_table(s) for s in range(len(self.seqs))]
            tables += self._decode_meta([s for s, _ in packed.ones])
        return tables

    def _block_table(self, s: int) -> list[int]:
        """The blocks holding sequence `s`'s positions [0, past + new)."""
        seq = self.seqs[s]
        return seq.block_table[:-(-(seq.past + seq.num_tokens) // self.blocks.block_size)]

    def _decode_meta(self, seqs) -> list[list[int]]:
        """For a decode over sequences `seqs`: the pool row of each one's last position, and its number of
        positions."""
        bs = self.blocks.block_size
        lengths = [self.seqs[s].past + self.seqs[s].num_tokens for s in seqs]
        return [[self.seqs[s].block_table[(n - 1) // bs] * bs + (n - 1) % bs for s, n in zip(seqs, lengths)], lengths]

    def accept(self, row: int, num_tokens: int) -> None:
        """Return verifying sequence `row` to its Mamba states after its first `num_tokens` tokens of the last
        forward (the states `keep` copied); its keys and values past them are simply never read (the next
        forward overwrites them).

        Raises:
            ValueError: `row` did not verify, or num_tokens is not in [1, its tokens].
        """
        seq = self.seqs[row]
        if not seq.verify or not 1 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"sequence {row} ({seq.num_tokens} tokens, verify={seq.verify}) cannot accept "
                             f"{num_tokens} tokens")
        if num_tokens == seq.num_tokens:  # every token kept: the slot holds its state already
            return
        for j, (conv, ssm) in enumerate(zip(self.slots.conv, self.slots.ssm)):
            seqs, kept_conv, kept_ssm = self.kept[(j, num_tokens - 1)]
            i = seqs.index(row)
            conv[seq.slot].copy_(kept_conv[i])
            ssm[seq.slot].copy_(kept_ssm[i])

    def position_index(self, s: int) -> torch.Tensor:
        """Flat pool indices (block * block_size + offset) of sequence `s`'s positions [0, past + new), from its
        block table on the device (made in `schedule`), once a step."""
        key = ("rows", s)
        if key not in self._per_step:
            seq = self.seqs[s]
            table = self.packed.index(self._block_table(s))
            self._per_step[key] = (table[:, None] * self.blocks.block_size + self._offsets).flatten()[
                :seq.past + seq.num_tokens]
        return self._per_step[key]

    def slot_index(self, seqs) -> torch.Tensor:
        """The state slots of sequences `seqs` [len(seqs)] int64, on the pools' device (made in `schedule`)."""
        return self.packed.index([self.seqs[s].slot for s in seqs])

    def decode_rows(self, seqs) -> tuple[torch.Tensor, PagedTable]:
        """For a decode over sequences `seqs`: the pool rows of their last positions [len(seqs)], and where all of
        their positions lie (`PagedTable`: their block tables, padded into one [len(seqs), W] tensor, and lengths);
        made once a step from the tensors `schedule` made, shared by the attention layers."""
        key = ("decode", tuple(seqs))
        if key not in self._per_step:
            new, lengths = self._decode_meta(seqs)
            tables = torch.nn.utils.rnn.pad_sequence([self.packed.index(self._block_table(s)) for s in seqs],
                                                     batch_first=True)
            self._per_step[key] = (self.packed.index(new), PagedTable(tables, self.packed.index(lengths), lengths,
                                                                      self.blocks.block_size))
        return self._per_step[key]

    # ------------------------------------------------------------------------------------------ Cache
    def begin(self, batch_size: int, num_tokens: int, mask: torch.Tensor | None) -> StepContext:
        """The packed context of the scheduled sequences.

        Raises:
            ValueError: not one row of exactly the scheduled tokens, or padding.
        """
        if batch_size != 1 or num_tokens != self.num_tokens or mask is not None:
            raise ValueError(f"a paged step takes one packed row of the {self.num_tokens} scheduled tokens without "
                             f"padding, got [{batch_size}, {num_tokens}]")
        return StepContext(past=0, mask=None, key_mask=None, packed=self.packed)

    def layer(self, i: int):
        return self._layers[i]

    def rollback(self, keep: int) -> None:
        raise ValueError("a paged step is never recorded, so it cannot be rolled back")

    def snapshot_kv(self, row: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`Cache.snapshot_kv`; the MTP block's layers after the main stack's when the pool holds them."""
        seq = self.seqs[row]
        if not 0 <= start <= end <= seq.past + seq.num_tokens:
            raise ValueError(f"positions [{start}, {end}) are not within the {seq.past + seq.num_tokens} of sequence {row}")
        index = self.position_index(row)[start:end]
        return [(k.flatten(0, 1)[index].transpose(0, 1).clone(), v.flatten(0, 1)[index].transpose(0, 1).clone())
                for k, v in zip(self.blocks.k + self.blocks.mtp_k, self.blocks.v + self.blocks.mtp_v)]

    def snapshot_mamba(self, row: int, out: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`Cache.snapshot_mamba`, written into `out` (a dropped snapshot's states: `StateSlots.read`) when given."""
        return self.slots.read(self.seqs[row].slot, out)


class BatchCache(PagedCache):
    """The cache `HybridForCausalLM.new_cache` gives: `batch_size` sequences run step by step through the model's
    forward, each a packed sequence over its own blocks of a growing pool and its own state slot (the engine's
    cache and layer paths, without its scheduler). Every forward brings the same number of new tokens to every
    sequence (input [batch_size, T], no padding: prompts of different lengths run on
    `hybrid.serving.engine.Engine` or `hybrid.generate_ids`).

    `seq_len` is the positions each sequence holds.
    """

    def __init__(self, config: HybridConfig, batch_size: int, dtype: torch.dtype, device, capacity: int = 0,
                 block_size: int = 16):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        blocks = GrowingBlockPool(config, max(1, batch_size * -(-capacity // block_size)), block_size, dtype, device)
        slots = StateSlots(config, batch_size, dtype, device)
        super().__init__(config, blocks, slots)
        self.batch_size = batch_size
        self._rows = [([], slots.allocate()) for _ in range(batch_size)]  # (block table, slot) per sequence

    def begin(self, batch_size: int, num_tokens: int, mask: torch.Tensor | None) -> StepContext:
        """The packed context of `num_tokens` new tokens of each sequence (the model flattens its [batch_size,
        num_tokens] input into the packed row, sequence after sequence).

        Raises:
            ValueError: another batch size than the cache's, or padding.
        """
        if batch_size != len(self._rows):
            raise ValueError(f"input batch size {batch_size} does not match the cache's batch size {len(self._rows)}")
        if mask is not None:
            raise ValueError("a step-by-step cache takes no padding: run prompts of different lengths on "
                             "hybrid.serving.engine.Engine (or hybrid.generate_ids)")
        bs, past = self.blocks.block_size, self.seq_len
        end = past + num_tokens
        needed = sum(max(0, -(-end // bs) - len(table)) for table, _ in self._rows)
        self.blocks.make_room(needed)
        for table, _ in self._rows:
            table.extend(self.blocks.allocate() for _ in range(-(-end // bs) - len(table)))
        packed = self.schedule([ScheduledSeq(table, slot, past, num_tokens) for table, slot in self._rows])
        self.seq_len = end
        return StepContext(past=0, mask=None, key_mask=None, packed=packed)

    def kv_nbytes(self) -> int:
        """Bytes of the attention layers' keys and values for the stored positions of every sequence."""
        per_token = sum(2 * k[0, 0].nelement() * k.element_size() for k in self.blocks.k)
        return per_token * self.seq_len * len(self._rows)

    def state_nbytes(self) -> int:
        """Bytes of the Mamba layers' conv windows and SSM states (independent of the length)."""
        return self.slots.nbytes()

    def nbytes(self) -> int:
        """Total bytes of inference state for the stored positions: KV + Mamba state."""
        return self.kv_nbytes() + self.state_nbytes()
