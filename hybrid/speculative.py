"""Self-speculative decoding with the model's multi-token-prediction (MTP) block.

Each round (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; the MTP
drafter as in DeepSeek-V3 and vLLM's NemotronH MTP):

1. Draft: the MTP block, fed the main model's normalised hidden state at the last position and the token
   that follows it, proposes the next token; fed its own output and that token, the one after; `n` times.
2. Verify: the main model runs one forward over [last token, d1, ..., dn] on its warm cache, recording the
   Mamba state after every token.
3. Accept: greedy keeps the drafts up to the first disagreement with the main model's argmax and adds the
   main model's own token there. Sampling accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)) and, on
   the first rejection, draws from normalise(max(p_i - q_i, 0)); when all are accepted it draws a bonus
   token from p_{n+1}. Either way the output has exactly the target model's distribution (greedy: the
   very tokens of plain greedy decoding).
4. Roll back: the main cache keeps the accepted tokens only. The KV cache is cut at the new length; each
   Mamba layer returns to the state it recorded after the last accepted token. Recording steps only the
   small recurrences (conv window, SSM state) token by token and copies the constant-size state after
   each; the projections run once over all n + 1 tokens, so the weights are read once per round.
   Re-running the accepted tokens instead would cost a second forward of the whole model per round.
   The MTP block's cache drops its draft positions and catches up on the accepted ones with the main
   model's hidden states.

Batch size 1 (the latency case speculative decoding is for).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hybrid.cache import RESERVE_AHEAD
from hybrid.config import MAMBA
from hybrid.model import HybridForCausalLM
from hybrid.sampling import Completion, SamplingParams, check_rank_draws, filtered_probs, sample


@dataclass
class SpeculativeStats:
    """Drafted and accepted token counts; `acceptance_rate` = accepted / drafted."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def _accept_greedy(p_logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """(number of drafts accepted, the main model's token after them). p_logits: [n+1, V]."""
    target = p_logits.argmax(dim=-1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return a, target[a]


def _accept_sampled(p_logits: torch.Tensor, drafts: list[int], q_probs: list[torch.Tensor],
                    sampling: SamplingParams) -> tuple[int, int]:
    """Rejection sampling: (number accepted, the corrected or bonus token). p_logits: [n+1, V]."""
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


@torch.inference_mode()
def speculative_generate_ids(
    model: HybridForCausalLM,
    prompt: list[int],
    max_new_tokens: int = 256,
    num_draft: int = 2,
    sampling: SamplingParams | None = None,
    stop_ids: list[int] | tuple[int, ...] = (),
    drafter=None,
    on_tokens=None,
) -> tuple[Completion, SpeculativeStats]:
    """Generate from one prompt with MTP drafts of `num_draft` tokens per round.

    on_tokens: called with `[token]` for each token as it is produced (as in `generate_ids`).
    drafter: replaces the MTP block, for tests: `drafter(position, tokens_so_far) -> (token, probs [V])`.
    Returns the `Completion` (as `hybrid.generate.generate_ids` gives it) and the draft statistics.
    Raises:
        ValueError: a tensor or empty prompt (a list of ids is expected), num_draft < 1, penalties in
            `sampling` (`SamplingParams.penalized`), a model without an MTP block and no drafter, an MTP
            block with Mamba layers (published ones are `*E`; their draft positions could not be dropped), or
            on a tensor-parallel rank sampling without a seed (`hybrid.sampling.check_rank_draws`).
    """
    if isinstance(prompt, torch.Tensor):
        raise ValueError("prompt must be a list of token ids, not a tensor (use prompt.tolist())")
    if not prompt:
        raise ValueError("prompt must be a non-empty list of token ids")
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    if sampling is not None and sampling.penalized:  # each drafted position would need the penalties before it
        raise ValueError("repetition / frequency / presence penalties are not supported with speculative decoding")
    if model.mtp is None and drafter is None:
        raise ValueError("speculative decoding needs an MTP block (num_nextn_predict_layers > 0) or a drafter")
    if drafter is None and MAMBA in model.config.mtp_pattern:
        raise ValueError(f"MTP blocks with Mamba layers are not supported (mtp pattern {model.config.mtp_pattern!r})")
    sampling = sampling or SamplingParams()
    check_rank_draws(sampling, model.parallel is not None)
    greedy = not sampling.temperature
    stop = set(stop_ids)
    device = model.device
    capacity = len(prompt) + min(max_new_tokens, RESERVE_AHEAD) + num_draft + 1  # the caches grow past it
    cache = model.new_cache(1, capacity)
    mtp_cache = model.new_mtp_cache(1, capacity) if drafter is None else None
    stats = SpeculativeStats()

    start = time.perf_counter()
    ids = torch.tensor([prompt], device=device)
    logits, hidden = model(ids, cache, return_hidden=True)
    out = [int(sample(logits[:, -1], sampling)[0])]
    if on_tokens is not None:
        on_tokens(out[-1:])
    prefill_done = time.perf_counter()
    if mtp_cache is not None:  # the block reads position t's hidden state and token t+1
        d_logits, d_hidden = model.mtp_step(hidden, torch.tensor([prompt[1:] + out], device=device), mtp_cache)
        d_logits, d_hidden = d_logits[:, -1], d_hidden[:, -1:]

    while len(out) < max_new_tokens and out[-1] not in stop:
        n = min(num_draft, max_new_tokens - len(out))
        drafts: list[int] = []
        q_probs: list[torch.Tensor] = []
        mtp_len = mtp_cache.seq_len if mtp_cache is not None else 0
        for i in range(n):
            if drafter is not None:
                token, q = drafter(len(prompt) + len(out) + i, prompt + out + drafts)
            else:
                q = filtered_probs(d_logits, sampling)[0]
                token = int(q.argmax()) if greedy else int(torch.multinomial(q.cpu(), 1, generator=sampling.generator))
                if i < n - 1:
                    d_logits, d_hidden = model.mtp_step(d_hidden, torch.tensor([[token]], device=device), mtp_cache)
                    d_logits, d_hidden = d_logits[:, -1], d_hidden[:, -1:]
            drafts.append(token)
            q_probs.append(q)

        verify = torch.tensor([[out[-1]] + drafts], device=device)
        p_logits, hidden = model(verify, cache, record=True, return_hidden=True)
        if greedy:
            a, extra = _accept_greedy(p_logits[0], drafts)
        else:
            a, extra = _accept_sampled(p_logits[0], drafts, q_probs, sampling)
        cache.rollback(a + 1)
        new = drafts[:a] + [extra]
        for t in new[: max_new_tokens - len(out)]:
            out.append(t)
            if on_tokens is not None:
                on_tokens([t])
            if t in stop:
                break
        stats.rounds += 1
        stats.drafted += n
        stats.accepted += a
        if mtp_cache is not None:
            mtp_cache.truncate(mtp_len)
            d_logits, d_hidden = model.mtp_step(hidden[:, : a + 1], torch.tensor([new], device=device), mtp_cache)
            d_logits, d_hidden = d_logits[:, -1], d_hidden[:, -1:]
    end = time.perf_counter()
    reason = "stop" if out[-1] in stop else "length"
    return Completion(out, reason, len(prompt), prefill_done - start, end - prefill_done), stats
