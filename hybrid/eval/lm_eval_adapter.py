"""lm-evaluation-harness model `hybrid` (needs the optional extra: `pip install -e ".[eval]"`).

    python -m hybrid.eval.lm_eval_adapter --model hybrid --model_args pretrained=PATH \\
        --tasks niah_single_1 --metadata '{"max_seq_lengths":[1024]}'

takes the arguments of the `lm_eval` command and runs it with this model registered: lm-eval 0.4.x finds
models only in its own registry (no plugin entry points), so the plain `lm_eval` executable cannot see a
model defined outside it; `scripts/lm_eval_hybrid.py` is the same wrapper. From Python:

    import lm_eval, hybrid.eval.lm_eval_adapter           # importing registers "hybrid"
    lm_eval.simple_evaluate(model="hybrid", model_args="pretrained=PATH", tasks=["niah_single_1"],
                            metadata={"max_seq_lengths": [1024]})

RULER tasks size their prompts with `transformers.AutoTokenizer.from_pretrained(<tokenizer>)`; with a model
name they take it from `pretrained`, so the checkpoint directory (tokenizer.json + tokenizer_config.json)
serves, offline. When a model object is passed instead, put `"tokenizer": PATH` in `metadata`.

API (lm_eval.api.model.LM): `loglikelihood` [(context, continuation)] -> [(sum log p, is_greedy)],
`loglikelihood_rolling` [(text,)] -> [sum log p] over lm-eval's rolling windows, `generate_until`
[(context, gen_kwargs)] -> [text] (greedy unless do_sample with temperature > 0; cut at the first `until`
string; generation itself stops at the checkpoint's stop ids or `max_gen_toks`). Long inputs run in
chunks (`prefill_chunk_size`), so memory stays bounded.

Tokenisation of a (context, continuation) pair follows lm-eval's HF model: trailing spaces of the context
move to the continuation, the pair is encoded whole (with the tokenizer's special tokens, e.g. BOS) and
split after the context's own tokens; an empty context becomes the BOS (else EOS) token. A text that already
starts with the BOS token (a chat template rendering `{{ bos_token }}`, with `--apply_chat_template`) is
encoded without special tokens, so it carries one BOS, as `hybrid.generate(chat=True)` feeds it.
Generation kwargs `top_k: 0` or `-1` mean no limit (transformers' and vLLM's reading).
"""

from __future__ import annotations

import sys

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from hybrid.eval.forward import logits_at
from hybrid.generate import PREFILL_CHUNK_SIZE, generate_ids
from hybrid.sampling import SamplingParams


@register_model("hybrid")
class HybridLM(LM):
    """A `hybrid` checkpoint for lm-evaluation-harness.

    Args:
        pretrained: checkpoint directory or hub id (loaded with `hybrid.load`), or None with `model` and
            `tokenizer` given (objects already loaded).
        dtype: bf16, fp16, fp32 (default: the checkpoint's). device: torch device (default cpu; cuda falls
            back to cpu when absent, since lm_eval's command line passes cuda by default).
        batch_size: rows per forward. max_length: keep at most this many tokens per forward (the
            left-most are dropped, as lm-eval's HF model does); None keeps everything.
        max_gen_toks: default answer budget when a task gives none.
        prefill_chunk_size: tokens per chunk of a long input.
        act_quant: quantized checkpoints: also quantize activations (passed to `hybrid.load`).
    """

    def __init__(self, pretrained: str | None = None, model=None, tokenizer=None, dtype: str | None = None,
                 device: str | None = None, batch_size: int | str = 1, max_length: int | None = None,
                 max_gen_toks: int = 256, prefill_chunk_size: int = PREFILL_CHUNK_SIZE, threads: int | None = None,
                 act_quant: bool = False, **kwargs):
        super().__init__()
        kwargs.pop("max_batch_size", None)
        if kwargs:
            print(f"hybrid: ignoring model arguments {sorted(kwargs)}", file=sys.stderr)
        if threads:
            torch.set_num_threads(int(threads))
        if model is None:
            if pretrained is None:
                raise ValueError("HybridLM needs pretrained=PATH (or model= and tokenizer= objects)")
            import hybrid

            load_options = {"act_quant": True} if act_quant else {}
            model, tokenizer = hybrid.load(pretrained, dtype=dtype, device=_device(device), **load_options)
        elif tokenizer is None:
            raise ValueError("HybridLM: tokenizer is required when model is given")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.pretrained = str(pretrained) if pretrained is not None else "hybrid-model"
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1
        self.max_length = int(max_length) if max_length else None
        self.max_gen_toks = int(max_gen_toks)
        self.prefill_chunk_size = int(prefill_chunk_size)
        bos = tokenizer.token_to_id(tokenizer.bos_token) if tokenizer.bos_token else None
        self.prefix_token_id = bos if bos is not None else (tokenizer.stop_ids[0] if tokenizer.stop_ids else 0)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    # ------------------------------------------------------------------------------------ metadata
    @property
    def tokenizer_name(self) -> str:
        return self.pretrained.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)

    # ------------------------------------------------------------------------------------ scoring
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with the tokenizer's special tokens, unless it already starts with the BOS token
        (as lm-eval's HF model does: a rendered chat template carries its own)."""
        bos = self.tokenizer.bos_token
        return self.tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of context and continuation (see the module docstring)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            ctx = self.tokenizer.encode("") or [self.prefix_token_id]
            return ctx, self.tokenizer.encode(continuation, add_special_tokens=False)
        whole = self.encode(context + continuation)
        ctx = self.encode(context)
        return ctx, whole[len(ctx):]

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation tokens), all greedy) per (context ids, continuation ids)."""
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            seqs, poss, targets = [], [], []
            for i in rows:
                ctx, cont = pairs[i]
                if not cont:
                    raise ValueError("loglikelihood: the continuation encodes to no tokens")
                ids = ctx + cont
                if self.max_length and len(ids) > self.max_length + 1:
                    ids = ids[-(self.max_length + 1):]
                ids = ids[:-1]  # the last continuation token is only predicted
                seqs.append(ids)
                poss.append(list(range(len(ids) - len(cont), len(ids))))
                targets.append(cont)
            for i, logits, target in zip(rows, logits_at(self.model, seqs, poss, self.prefill_chunk_size, self.pad_id),
                                         targets):
                logp = torch.log_softmax(logits, dim=-1)
                t = torch.tensor(target)
                results[i] = (float(logp.gather(-1, t[:, None]).sum()), bool(torch.equal(logp.argmax(-1), t)))
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*req.args) for req in requests]
        out = []
        for start in tqdm(range(0, len(pairs), 64), disable=disable_tqdm, desc="loglikelihood"):
            out += self._score(pairs[start:start + 64])
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="loglikelihood_rolling"):
            (text,) = req.args
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                tokens, self.prefix_token_id, self.max_length or len(tokens) + 1, 1)]
            total = sum(lp for lp, _ in self._score(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    # ------------------------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].args[0]))
        groups: dict[str, list[int]] = {}
        for i in order:
            groups.setdefault(repr(sorted(requests[i].args[1].items())), []).append(i)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
        for indexes in groups.values():
            kwargs = dict(requests[indexes[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            budget = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            sampling = SamplingParams(temperature if kwargs.pop("do_sample", False) else 0.0,
                                      kwargs.pop("top_k", None), kwargs.pop("top_p", None))
            for start in range(0, len(indexes), self.batch_size):
                rows = indexes[start:start + self.batch_size]
                prompts = []
                for i in rows:
                    ids = self.encode(requests[i].args[0])
                    if self.max_length and len(ids) > self.max_length - budget:
                        ids = ids[-max(1, self.max_length - budget):]
                    prompts.append(ids)
                completions = generate_ids(self.model, prompts, budget, sampling, self.tokenizer.stop_ids,
                                           self.pad_id, self.prefill_chunk_size)
                for i, c in zip(rows, completions):
                    body = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
                    text = self.tokenizer.decode(body)
                    for stop in until:
                        if stop and stop in text:
                            text = text[:text.index(stop)]
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(rows))
        bar.close()
        return results


def _device(device: str | None) -> str:
    """`device`, or cpu when none is given or CUDA is asked for but absent (lm_eval's CLI defaults to cuda)."""
    if not device:
        return "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        print(f"hybrid: device {device!r} is not available; using cpu", file=sys.stderr)
        return "cpu"
    return str(device)


def main() -> None:
    """The `lm_eval` command line with the `hybrid` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
