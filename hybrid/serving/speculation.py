"""Speculative decoding inside the engine: the MTP block drafts, the packed step verifies, rollback is exact.

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; the MTP drafter as in
DeepSeek-V3 and vLLM's NemotronH MTP, run the way vLLM runs it, over the engine's own block tables and state
slots. Per running request and step:

1. Draft (`MTPDrafter.propose`, after the step's sampling): the MTP block runs over the positions the main
   model computed this step (hidden state p and token p+1 at position p; its keys and values in the block
   pool's MTP layers, under the request's block table), in one packed forward for every request; its output
   at the last position gives the first draft; fed its own output and that draft, the next; up to
   `num_speculative_tokens` (fewer near `max_tokens` or `max_model_len`).
2. Verify: the next step packs the request's last token and its drafts as one segment (`ScheduledSeq.verify`)
   beside the other requests' decode tokens and prompt chunks; the Mamba layers keep their state after each
   of those tokens (`PackedSeqs.verifying`).
3. Accept (`accept`): greedy keeps the drafts up to the first disagreement with the main model's argmax and
   adds the main model's own token there, so the tokens are those of plain greedy decoding. Sampling accepts
   d_i with probability min(1, p_i(d_i) / q_i(d_i)) and on the first rejection draws from
   normalise(max(p_i - q_i, 0)); with every draft accepted it draws a bonus token from p_{n+1}: the output
   has the target model's distribution.
4. Roll back (`PagedCache.accept`): each Mamba layer returns to the state it kept after the last accepted
   token; keys and values past it are never read and are overwritten by the next step.

Requests with penalties decode without drafts (each drafted position would need the penalties before it).
With prefix caching, the MTP keys of a cached block were made with the token after the block of the request
that filled it, and a prefix snapshot's last partial block holds no MTP keys: drafts near such positions may
be weaker (a lower acceptance rate), never wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.config import ATTENTION, MAMBA
from hybrid.model import HybridForCausalLM
from hybrid.sampling import SamplingParams, filtered_probs
from hybrid.serving.blocks import BlockPool
from hybrid.serving.paged_cache import PagedCache, ScheduledSeq
from hybrid.serving.request import Request
from hybrid.serving.slots import StateSlots


@dataclass
class SpeculativeStats:
    """Drafted and accepted token counts; `acceptance_rate` = accepted / drafted."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def add(self, drafted: int, accepted: int) -> None:
        """Count one verification of `drafted` tokens, `accepted` of them kept."""
        self.rounds, self.drafted, self.accepted = self.rounds + 1, self.drafted + drafted, self.accepted + accepted


def accept(p_logits: torch.Tensor, drafts: list[int], q_probs: list[torch.Tensor] | None,
           sampling: SamplingParams) -> tuple[int, int]:
    """(number of drafts accepted, the token after them) from the main model's logits p_logits [n+1, V] at
    the last token and each draft: greedy (temperature 0) by the argmax, else by rejection sampling with the
    drafts' distributions `q_probs` ([V] each) and `sampling.generator` (see the module docstring)."""
    if not sampling.temperature:
        target = p_logits.argmax(dim=-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == target[a]:
            a += 1
        return a, target[a]
    p = filtered_probs(p_logits, sampling)  # [n+1, V]
    g = sampling.generator
    for i, d in enumerate(drafts):
        q = q_probs[i]
        if torch.rand((), generator=g).item() * q[d].item() < p[i, d].item():  # u < p/q, without dividing by 0
            continue
        residual = (p[i] - q).clamp(min=0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[i]
        return i, int(torch.multinomial(residual.cpu(), 1, generator=g).item())
    return len(drafts), int(torch.multinomial(p[-1].cpu(), 1, generator=g).item())


@dataclass
class Computed:
    """Positions [past, past + len(hidden)) of `request` that the main model computed (and kept) this step,
    with their normalised hidden states [m, H]."""

    request: Request
    past: int
    hidden: torch.Tensor


class MTPDrafter:
    """The engine's drafter: the model's MTP block over the block pool's MTP keys and values.

    Raises:
        ValueError: num_speculative_tokens below 1, a model without an MTP block, an MTP block with Mamba
            layers (their draft states could not be dropped; published blocks are `*E`), or a pool made
            without MTP layers.
    """

    def __init__(self, model: HybridForCausalLM, blocks: BlockPool, slots: StateSlots, num_speculative_tokens: int):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if model.mtp is None:
            raise ValueError("speculative decoding needs an MTP block (num_nextn_predict_layers > 0), and this "
                             "model has none")
        if MAMBA in model.config.mtp_pattern:
            raise ValueError(f"MTP blocks with Mamba layers are not supported (mtp pattern "
                             f"{model.config.mtp_pattern!r})")
        if len(blocks.mtp_k) != model.config.mtp_pattern.count(ATTENTION):
            raise ValueError("the block pool holds no keys and values for the MTP block (make it with mtp=True)")
        self.model, self.num_speculative_tokens = model, num_speculative_tokens
        self.cache = PagedCache(model.cache_config, blocks, slots, mtp=True)
        self.stats = SpeculativeStats()

    @staticmethod
    def drafts(request: Request) -> bool:
        """Whether `request` drafts at all (not with penalties)."""
        return not request.sampling.penalized

    def propose(self, computed: list[Computed], budget, reserve) -> None:
        """Run the MTP block over this step's `computed` positions (the tokens after them must be known:
        `request.all_ids`) and set `draft_ids` (and, sampling, `draft_probs`) of each request among them that
        decodes next: `budget(request)` drafts at most (0: none), drafted recursively while
        `reserve(request, positions)` gives blocks for the MTP keys of the draft positions."""
        if not computed:
            return
        model = self.model
        seqs = [ScheduledSeq(c.request.block_table, c.request.slot, c.past, len(c.hidden)) for c in computed]
        next_ids = [t for c in computed for t in c.request.all_ids[c.past + 1:c.past + 1 + len(c.hidden)]]
        self.cache.schedule(seqs)
        out = model.mtp_hidden_states(torch.cat([c.hidden for c in computed])[None],
                                      torch.tensor([next_ids], device=model.device), self.cache)[0]
        ends, last = [], 0
        for c in computed:
            last += len(c.hidden)
            r = c.request
            r.draft_ids, r.draft_probs = [], []
            n = budget(r)
            if n > 1 and not reserve(r, r.num_computed + n - 1):  # MTP keys of drafts 1..n-1 at P..P+n-2
                n = 1
            if n > 0:
                ends.append((r, n, out[last - 1]))
        for i in range(max((n for _, n, _ in ends), default=0)):
            rows = torch.stack([h for _, _, h in ends])
            tokens = self._draw(model.logits(rows), [r for r, _, _ in ends])
            for (r, _, _), token in zip(ends, tokens):
                r.draft_ids.append(token)
            ends = [(r, n, h) for r, n, h in ends if n > i + 1]
            if not ends:
                break
            self.cache.schedule([ScheduledSeq(r.block_table, r.slot, r.num_computed + i, 1) for r, _, _ in ends])
            ids = torch.tensor([[r.draft_ids[-1] for r, _, _ in ends]], device=model.device)
            out = model.mtp_hidden_states(torch.stack([h for _, _, h in ends])[None], ids, self.cache)[0]
            ends = [(r, n, out[j]) for j, (r, n, _) in enumerate(ends)]

    @staticmethod
    def _draw(logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """Each request's draft from its row of the MTP logits [n, V]: the argmax when greedy, else a draw from
        its filtered distribution (kept in `draft_probs` for `accept`) with its generator."""
        argmax = logits.argmax(dim=-1).tolist()
        tokens = []
        for j, r in enumerate(requests):
            if not r.sampling.temperature:
                tokens.append(argmax[j])
                continue
            q = filtered_probs(logits[j:j + 1], r.sampling)[0]
            r.draft_probs.append(q)
            tokens.append(int(torch.multinomial(q.cpu(), 1, generator=r.sampling.generator)))
        return tokens
