"""A request of the serving engine and what each step reports about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from hybrid.sampling import PenaltyState, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds a state slot and KV blocks
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request.

    prompt_ids: the prompt's token ids; output_ids: the tokens generated so far.
    num_computed: leading tokens of `prompt_ids + output_ids` whose keys, values and Mamba state are in the
        request's blocks and slot (0 while waiting; a preempted request starts again from 0 or its prefix hit).
    num_cached_tokens: prompt tokens taken from the prefix cache at its (last) admission.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    slot: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    block_hashes: list[str] = field(default_factory=list)  # prefix hashes of its full blocks, in order
    # the kept final hidden state of its prompt's last token, when the prefix cache held the whole prompt
    # (the first token is sampled from it with no forward); None otherwise and once used
    resume_hidden: torch.Tensor | None = field(default=None, repr=False)
    # a penalized request's token statistics (`hybrid.sampling.PenaltyState`), made at its first sampled token
    penalties: PenaltyState | None = field(default=None, repr=False)
    # speculative decoding: the draft tokens its next step verifies after its last token, and, when it
    # samples, the distribution each was drawn from (`hybrid.serving.speculation`)
    draft_ids: list[int] = field(default_factory=list)
    draft_probs: list[torch.Tensor] = field(default_factory=list, repr=False)
    num_drafted: int = 0  # drafts verified so far, and how many of them were accepted
    num_accepted: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def step_ids(self, n: int) -> list[int]:
        """The `n` token ids its next forward computes: from its first uncomputed position on, its drafts
        after its tokens."""
        start, prompt = self.num_computed, len(self.prompt_ids)
        if start + n <= prompt:
            return self.prompt_ids[start:start + n]
        return (self.prompt_ids[start:] + self.output_ids[max(start - prompt, 0):] + self.draft_ids)[:n]


@dataclass
class TokenLogprobs:
    """A sampled token's log-probability and the `k` most likely tokens at its position, most likely first
    (ids and log-probabilities; `k` is the request's `SamplingParams.logprobs`, so 0 gives empty lists)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class RequestOutput:
    """What one engine step produced for one request: its new tokens (none or one per step; with speculative
    decoding up to one more than the drafts it verified) and, once it
    finished, why ("stop": a stop id, included in `new_token_ids`; "length": max_tokens or the model length;
    "abort": cancelled). `logprobs`: one `TokenLogprobs` per new token when the request's sampling asked for
    them (`SamplingParams.logprobs`), else None."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
