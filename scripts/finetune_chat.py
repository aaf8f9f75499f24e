"""Teach the shipped checkpoint to chat: add Nemotron 3's chat tokens, resize the vocabulary, fine-tune on
chat data built offline, and save it with its chat template; or evaluate a checkpoint (`--evaluate`).

The shipped `checkpoints/hybrid-mini` was made from the pre-chat checkpoint of commit 6c8b608 (the one
`scripts/train.py` wrote) with (700 steps, 1,601 s of training on 2 cores; about 27 minutes in all):

    mkdir -p /tmp/base && git archive 6c8b608 checkpoints/hybrid-mini | tar -x -C /tmp/base
    python scripts/finetune_chat.py --base /tmp/base/checkpoints/hybrid-mini --out /tmp/hybrid-mini-chat \
        --steps 700 --threads 2
    python scripts/finetune_chat.py --evaluate /tmp/hybrid-mini-chat --threads 2   # the model card's numbers

and the output's files copied into `checkpoints/hybrid-mini` but README.md (the model card, rewritten by hand).
generation_config.json is the base's with `<|im_end|>` added to `eos_token_id`. `--steps 0` writes the resized
checkpoint untrained: the chat evaluation's "before". Everything random is seeded (the data, the new rows, the
order); floating-point sums may still differ on another CPU or thread count.

What it does:
- Tokens: `<|im_start|>`, `<|im_end|>` (special: dropped from decoded text) and `<think>`, `</think>`,
  `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` (added, not special: they stay in
  decoded text, where the reasoning split and a tool-call parser look for them) become added tokens of
  tokenizer.json, one id each, never split, after the base vocabulary. config.json's `vocab_size` grows to
  the next multiple of 64; the embedding and `lm_head` rows of the new ids and of the unused padding rows
  start at the mean of the existing rows plus noise of a tenth of their spread (the MTP block shares both).
  `<|im_end|>` becomes the tokenizer's eos and joins generation_config.json's `eos_token_id` (config.json
  keeps eos 2; the project stops on the union), as Nemotron 3's files do.
- Data (`ChatData`, all offline, seeded): conversations rendered by the shipped chat template
  (`--chat-template`): questions about the Python reference topics and module docstrings of `scripts/train.py`'s
  training documents answered with their text, continue-this-text requests, the recall tasks of
  `hybrid.eval.tasks` (passkey, needle, phonebook, key-value) asked in a user turn, tool-call dialogues (tools
  in the system turn, a `<tool_call>` block, a `<tool_response>`, the answer; some questions need no tool),
  half with short reasoning and half with `enable_thinking=False`, some multi-turn. The loss is on the
  assistant's tokens only (what the model writes after the generation prompt, `<|im_end|>` included); the
  rest of a row is packed with more conversations, then prose. Beside them, rows of `scripts/train.py`'s own
  mixture (prose windows and recall tasks with answers weighted x4) keep what the model knew.
- Optimisation: `scripts/train.py`'s (AdamW, `hybrid.training`'s warm-up + cosine schedule, MTP loss,
  auxiliary-loss-free expert balancing, gradient clipping, bf16 autocast), over a fixed number of steps.
- Evaluation (`evaluate`): held-out prose loss (`scripts/train.py`'s validation batches, the model card's
  number), teacher-forced recall accuracy at 240 tokens (`scripts/train.py`'s final evaluation), and, for a
  checkpoint with a chat template, greedy chat behaviour on conversations of seeds training never drew:
  replies that close `</think>` and end with `<|im_end|>`, retrieval answers, tool calls that parse and name
  the right function and arguments, answers after a tool response.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
import time
from pathlib import Path

import torch
import tokenizers
from tokenizers import AddedToken
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train  # noqa: E402  scripts/train.py: the corpus, the recall rows, the validation loss

import hybrid  # noqa: E402
from hybrid.checkpoint_writer import check_destination  # noqa: E402
from hybrid.eval.tasks import FIRST_NAMES, LAST_NAMES  # noqa: E402
from hybrid.generate import generate_ids  # noqa: E402
from hybrid.loading import build_model  # noqa: E402
from hybrid.sampling import SamplingParams  # noqa: E402
from hybrid.saving import save_checkpoint  # noqa: E402
from hybrid.tokenizer import Tokenizer  # noqa: E402
from hybrid.training import ExpertBalancer, learning_rate, lm_loss, train_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEMPLATE = ROOT / "checkpoints" / "hybrid-mini" / "chat_template.jinja"
SPECIAL = ["<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CHAT_TOKENS = SPECIAL + TAGS
END = "<|im_end|>"
VOCAB_MULTIPLE = 64
EVAL_SEED = 10**6  # held-out conversations draw their seeds from here on; training's are below it


# ---------------------------------------------------------------------------------------------- tokens
def add_chat_tokens(tok: tokenizers.Tokenizer) -> dict[str, int]:
    """Add `CHAT_TOKENS` (in that order, after the base vocabulary) unless present; {token: id}."""
    for token in CHAT_TOKENS:
        if tok.token_to_id(token) is None:
            added = AddedToken(token, special=token in SPECIAL, normalized=False, lstrip=False, rstrip=False,
                               single_word=False)
            (tok.add_special_tokens if token in SPECIAL else tok.add_tokens)([added])
    return {t: tok.token_to_id(t) for t in CHAT_TOKENS}


def padded(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


@torch.no_grad()
def resize_vocabulary(model, vocab_size: int, seed: int):
    """A copy of `model` (fp32) with `vocab_size` embedding and lm_head rows: the old rows kept, each new row
    the mean of the old ones plus normal noise of a tenth of their per-coordinate spread."""
    config = dataclasses.replace(model.config, vocab_size=vocab_size)
    new = build_model(config, torch.float32, device="cpu")
    state = model.state_dict()
    g = torch.Generator().manual_seed(seed)
    for name in ("backbone.embeddings.weight", "lm_head.weight"):
        old = state[name].float()
        extra = vocab_size - old.shape[0]
        rows = old.mean(0) + torch.randn(extra, old.shape[1], generator=g) * old.std(0) * 0.1
        state[name] = torch.cat([old, rows])
    new.load_state_dict(state, strict=True)
    return new


def tokenizer_files(tok: tokenizers.Tokenizer, base: Path, ids: dict[str, int]) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json (eos `<|im_end|>`, the added tokens) and special_tokens_map.json."""
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["eos_token"] = END
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": t in SPECIAL} for t, i in ids.items()}
    for t in ("<pad>", "<s>", "</s>"):
        decoder[str(tok.token_to_id(t))] = {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                            "single_word": False, "special": True}
    config["added_tokens_decoder"] = dict(sorted(decoder.items(), key=lambda kv: int(kv[0])))
    special = json.loads((base / "special_tokens_map.json").read_text())
    special["eos_token"] = END
    special["additional_special_tokens"] = SPECIAL
    return {"tokenizer.json": tok.to_str(pretty=True), "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
            "special_tokens_map.json": json.dumps(special, indent=2) + "\n"}


def generation_config(base: Path, end_id: int) -> str:
    """The base's generation_config.json with `end_id` joined to `eos_token_id` (every other field as it was)."""
    config = json.loads((base / "generation_config.json").read_text())
    eos = config.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    config["eos_token_id"] = eos + [end_id] if end_id not in eos else eos
    return json.dumps(config, indent=2) + "\n"


# ---------------------------------------------------------------------------------------------- data
CITIES = ("Paris London Berlin Madrid Rome Vienna Prague Warsaw Dublin Oslo Lisbon Athens Cairo Lagos Nairobi "
          "Tokyo Seoul Beijing Delhi Mumbai Sydney Lima Bogota Toronto Chicago Boston Denver Seattle Austin Miami "
          "Havana Quito Dakar Accra Tunis Riga Tallinn Vilnius Sofia Zagreb").split()
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy"]
ZONES = ["UTC", "Europe/Paris", "America/New_York", "Asia/Tokyo", "Australia/Sydney", "Africa/Lagos",
         "America/Lima", "Asia/Delhi", "Europe/London", "America/Chicago"]
SYSTEMS = ["You are a helpful assistant.", "Be brief.", "You answer questions about Python.",
           "You are hybrid-mini, a small model. Answer clearly.", "Answer in one or two sentences."]


def _tool(name: str, description: str, params: dict[str, tuple[str, str]], required: list[str],
          enums: dict | None = None) -> dict:
    properties = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
    for k, values in (enums or {}).items():
        properties[k]["enum"] = values
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


TOOLS = {
    "get_weather": _tool("get_weather", "Get the current weather in a city.",
                         {"city": ("string", "The city name."), "unit": ("string", "Temperature unit.")}, ["city"],
                         {"unit": ["celsius", "fahrenheit"]}),
    "add_numbers": _tool("add_numbers", "Add two numbers.", {"a": ("number", "The first number."),
                                                              "b": ("number", "The second number.")}, ["a", "b"]),
    "find_phone": _tool("find_phone", "Find the phone number of a person.", {"name": ("string", "Full name.")},
                        ["name"]),
    "get_time": _tool("get_time", "Get the current time in a time zone.",
                      {"timezone": ("string", "An IANA time zone, e.g. Europe/Paris.")}, ["timezone"]),
    "search_docs": _tool("search_docs", "Search the Python documentation for a topic.",
                         {"query": ("string", "What to search for.")}, ["query"]),
}


def _ask(rng: random.Random, forms: list[str], **values) -> str:
    return rng.choice(forms).format(**values)


@dataclasses.dataclass
class Example:
    """One conversation: its messages (the last one the assistant's), the template's enable_thinking, which
    kind it is, and what an evaluation checks (`expect`)."""

    messages: list[dict]
    thinking: bool
    kind: str
    tools: list[dict] | None = None
    expect: dict = dataclasses.field(default_factory=dict)


class ChatData:
    """Conversations from seeded generators, rendered and tokenized with per-token loss weights.

    Args:
        tok: the `hybrid.tokenizer.Tokenizer` with the chat tokens and template.
        docs: the training documents (`scripts/train.py`'s, held-out ones excluded).
        seed: the random stream; evaluation uses seeds from `EVAL_SEED` on.
    """

    KINDS = {"docs": 0.12, "continue": 0.06, "recall": 0.2, "tool": 0.42, "no_tool": 0.1, "multi_turn": 0.1}

    def __init__(self, tok: Tokenizer, docs: list[str], seed: int, seq_len: int = 512, assistant_weight: float = 2.0,
                 prose: train.TrainingData | None = None):
        self.tok, self.seq_len, self.assistant_weight, self.prose = tok, seq_len, assistant_weight, prose
        self.rng = random.Random(seed)
        self.docs = docs
        self.topics = _topics(set(docs))

    # ------------------------------------------------------------------ kinds of conversation
    def example(self, kind: str | None = None, thinking: bool | None = None) -> Example:
        rng = self.rng
        kind = kind or rng.choices(list(self.KINDS), weights=list(self.KINDS.values()))[0]
        thinking = rng.random() < 0.5 if thinking is None else thinking
        if kind == "multi_turn":
            first = self.example(rng.choice(["docs", "continue", "recall"]), thinking)
            second = self.example(rng.choice(["docs", "continue", "recall", "tool", "no_tool"]), thinking)
            history = [m for m in first.messages if m["role"] != "system"]
            head = second.messages[:1] if second.messages[0]["role"] == "system" else []
            rest = second.messages[len(head):]
            return Example(head + history + rest, thinking, f"multi_turn/{second.kind}", second.tools, second.expect)
        example = getattr(self, f"_{kind}")(thinking)
        system = rng.choice(SYSTEMS) if rng.random() < 0.4 else None
        if example.tools is None and system is not None:
            example.messages.insert(0, {"role": "system", "content": system})
        elif example.tools is not None:
            example.messages.insert(0, {"role": "system", "content": system or ""})
        return example

    def _assistant(self, thinking: bool, content: str, reasoning: str, **extra) -> dict:
        message = {"role": "assistant", "content": content, **extra}
        if thinking:
            message["reasoning_content"] = reasoning
        return message

    def _docs(self, thinking: bool) -> Example:
        title, body = self.rng.choice(self.topics)
        question = _ask(self.rng, ["What does the Python documentation say about {t}?", "Tell me about {t}.",
                                   "Explain {t}.", "What is {t}?", "Describe {t} in Python.",
                                   "I have a question about {t}. What should I know?"], t=title)
        answer = _first_paragraphs(body, self.tok, self.rng.randint(30, 90))
        reasoning = f"The user asks about {title}. I will answer from the Python documentation."
        return Example([{"role": "user", "content": question}, self._assistant(thinking, answer, reasoning)],
                       thinking, "docs", expect={"answer_start": answer[:40]})

    def _continue(self, thinking: bool) -> Example:
        doc = self.rng.choice(self.docs)
        words = doc.split(" ")
        n = len(words)
        start = self.rng.randrange(max(1, n - 60))
        cut = start + self.rng.randint(15, 40)
        given, rest = " ".join(words[start:cut]), " ".join(words[cut:cut + self.rng.randint(10, 30)])
        question = _ask(self.rng, ["Continue this text:\n{x}", "Please continue the following text.\n\n{x}",
                                   "What comes next?\n{x}", "Complete this passage:\n{x}"], x=given)
        reasoning = "The user wants the text continued. It reads like the Python documentation."
        return Example([{"role": "user", "content": question}, self._assistant(thinking, rest, reasoning)],
                       thinking, "continue")

    def _recall(self, thinking: bool) -> Example:
        rng = self.rng
        task = rng.choices(list(train.TASK_WEIGHTS), weights=list(train.TASK_WEIGHTS.values()))[0]
        prompt, continuation = train.task_text(task, rng.randrange(10**9), self.tok,
                                               rng.randint(48, self.seq_len // 2 - 40), rng.uniform(0, 100))
        question, answer, evidence, value = _recall_turn(task, prompt, continuation)
        reasoning = f"The answer is in the text: {evidence}"
        return Example([{"role": "user", "content": question}, self._assistant(thinking, answer, reasoning)],
                       thinking, f"recall/{task}", expect={"value": value})

    def _tool_call(self, rng: random.Random):
        """(function, arguments, question, tool result, final answer, reasoning before the call, after it)."""
        name = rng.choice(list(TOOLS))
        if name == "get_weather":
            city, t, cond = rng.choice(CITIES), rng.randint(-10, 38), rng.choice(CONDITIONS)
            unit = rng.choice([None, "celsius", "fahrenheit"])
            question = _ask(rng, ["What is the weather in {c}?", "How is the weather in {c} today?",
                                  "Is it warm in {c}?", "Weather for {c}, please."], c=city)
            args = {"city": city}
            if unit:
                question = question.rstrip("?.,") + f", in {unit}?"
                args["unit"] = unit
            result = json.dumps({"city": city, "temperature": t, "condition": cond})
            answer = f"It is {cond} in {city}, {t} degrees{' ' + unit if unit else ''}."
            return name, args, question, result, answer, f"the weather in {city}", str(t)
        if name == "add_numbers":
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            question = _ask(rng, ["What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}.",
                                  "What do {a} and {b} add up to?"], a=a, b=b)
            result = json.dumps({"result": a + b})
            return (name, {"a": a, "b": b}, question, result, f"{a} plus {b} is {a + b}.", f"the sum of {a} and {b}",
                    str(a + b))
        if name == "find_phone":
            person = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
            number = f"{rng.randint(100, 999)}-{rng.randint(1000, 9999)}"
            question = _ask(rng, ["What is the phone number of {p}?", "How can I call {p}?",
                                  "Find the number of {p}."], p=person)
            result = json.dumps({"name": person, "phone": number})
            return name, {"name": person}, question, result, f"The phone number of {person} is {number}.", \
                f"the phone number of {person}", number
        if name == "get_time":
            zone, time_ = rng.choice(ZONES), f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
            question = _ask(rng, ["What time is it in {z}?", "Tell me the time in {z}.",
                                  "What is the current time in the {z} time zone?"], z=zone)
            result = json.dumps({"timezone": zone, "time": time_})
            return name, {"timezone": zone}, question, result, f"It is {time_} in {zone}.", f"the time in {zone}", time_
        title, body = rng.choice(self.topics)
        snippet = " ".join(body.split("\n\n")[0].split())
        snippet = snippet[:snippet.index(". ") + 1] if ". " in snippet[:-1] else snippet
        snippet = snippet if len(snippet) <= 200 else snippet[:200].rsplit(" ", 1)[0]
        question = _ask(rng, ["Search the docs for {t}.", "Look up {t} in the Python documentation.",
                              "Can you find the documentation of {t}?"], t=title)
        result = json.dumps({"query": title, "result": snippet}, ensure_ascii=False)
        return name, {"query": title}, question, result, snippet, f"the documentation of {title}", snippet[:20]

    def _tools_offered(self, rng: random.Random, needed: str | None) -> list[dict]:
        others = [t for t in TOOLS if t != needed]
        chosen = rng.sample(others, rng.randint(0, 1) if needed else rng.randint(1, 2)) + ([needed] if needed else [])
        rng.shuffle(chosen)
        return [TOOLS[t] for t in chosen]

    def _tool(self, thinking: bool) -> Example:
        rng = self.rng
        name, args, question, result, answer, want, value = self._tool_call(rng)
        call = {"type": "function", "function": {"name": name, "arguments": args}}
        given = ", ".join(f"{k} {v}" for k, v in args.items())
        first = self._assistant(thinking, "", f"The user wants {want}. I will call {name} with {given}.",
                                tool_calls=[call])
        last = self._assistant(thinking, answer, f"The function returned {want}. I can answer now.")
        messages = [{"role": "user", "content": question}, first, {"role": "tool", "content": result}, last]
        return Example(messages, thinking, "tool", self._tools_offered(rng, name),
                       {"name": name, "arguments": args, "value": value})

    def _no_tool(self, thinking: bool) -> Example:
        base = self.example(self.rng.choice(["docs", "recall", "continue"]), thinking)
        messages = [m for m in base.messages if m["role"] != "system"]
        messages[-1] = {**messages[-1]}
        if thinking:
            messages[-1]["reasoning_content"] = "No function is needed for this. " + messages[-1]["reasoning_content"]
        return Example(messages, thinking, f"no_tool/{base.kind}", self._tools_offered(self.rng, None), base.expect)

    # ------------------------------------------------------------------ rendering and weights
    def render(self, example: Example, upto: int | None = None) -> str:
        messages = example.messages if upto is None else example.messages[:upto]
        kwargs = {"enable_thinking": example.thinking}
        if example.tools is not None:
            kwargs["tools"] = example.tools
        return self.tok.apply_chat_template(messages, add_generation_prompt=upto is not None, **kwargs)

    def encode(self, example: Example) -> tuple[list[int], list[float]]:
        """Token ids of the whole conversation and a weight per token as a target: `assistant_weight` on
        what the model writes in the trained assistant turns (after the generation prompt, `<|im_end|>`
        included), 0 elsewhere. Trained turns: those after the last user message, and with thinking off every
        one (earlier turns then render exactly as the model writes them).

        Raises:
            AssertionError: a trained turn's generation prompt is not a prefix of the conversation, in text or
                in tokens (the model would be trained on a context it never sees when it generates).
        """
        text = self.render(example)
        ids = self.tok.encode(text, add_special_tokens=False)
        weights = [0.0] * len(ids)
        users = [i for i, m in enumerate(example.messages) if m["role"] == "user"]
        for i, m in enumerate(example.messages):
            if m["role"] != "assistant" or (example.thinking and i < users[-1]):
                continue
            prompt = self.render(example, upto=i)
            if not text.startswith(prompt):
                raise AssertionError(f"turn {i} does not render as its generation prompt continued")
            turn = text[:text.index(END, len(prompt)) + len(END)]
            head, whole = (self.tok.encode(t, add_special_tokens=False) for t in (prompt, turn))
            if ids[:len(head)] != head or ids[:len(whole)] != whole:
                raise AssertionError(f"turn {i}: its prompt's tokens are not a prefix of the conversation's")
            weights[len(head):len(whole)] = [self.assistant_weight] * (len(whole) - len(head))
        return ids, weights

    def row(self) -> tuple[list[int], list[float]]:
        """seq_len + 1 tokens: conversations while they fit (at least one), then prose; weights as targets of
        the previous position (the first token is no target)."""
        ids, weights = [], []
        while True:
            e_ids, e_weights = self.encode(self.example())
            if len(ids) + len(e_ids) > self.seq_len + 1:
                if ids:
                    break
                continue  # too long alone: draw another
            ids, weights = ids + e_ids, weights + e_weights
            if self.rng.random() < 0.5:
                break
        n = self.seq_len + 1 - len(ids)
        if n:
            ids += self.prose.prose(n).tolist()
            weights += [1.0] * n
        return ids, weights

    def batch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        made = [self.row() for _ in range(rows)]
        tokens = torch.tensor([r[0] for r in made], dtype=torch.long)
        weights = torch.tensor([r[1][1:] for r in made], dtype=torch.float32)
        return tokens, weights


def _topics(train_docs: set[str]) -> list[tuple[str, str]]:
    """(title, text) of the Python reference topics and of the documented modules among `train_docs` (the
    docstrings of classes and functions are left to the prose rows: too many titles for a short fine-tune to
    learn)."""
    import importlib
    import inspect

    import pydoc_data.topics

    out = []
    for key in sorted(pydoc_data.topics.topics):
        text = pydoc_data.topics.topics[key]
        if text not in train_docs:
            continue
        lines = text.split("\n")
        if len(lines) > 2 and set(lines[1]) == {"*"}:
            out.append((lines[0].strip(), "\n".join(lines[2:]).strip()))
    for name in train.DOC_MODULES:
        doc = inspect.getdoc(importlib.import_module(name))
        if doc and doc in train_docs:
            out.append((f"the {name} module", doc))
    return out


def _first_paragraphs(text: str, tok: Tokenizer, budget: int) -> str:
    """The first paragraphs of `text` within about `budget` tokens (at least the first paragraph's opening)."""
    out = ""
    for para in text.split("\n\n"):
        candidate = f"{out}\n\n{para}" if out else para
        if out and len(tok.encode(candidate, add_special_tokens=False)) > budget:
            break
        out = candidate
    ids = tok.encode(out, add_special_tokens=False)
    if len(ids) > budget + 40:  # one long paragraph: cut at a sentence end
        out = tok.decode(ids[:budget])
        cut = out.rfind(". ")
        out = out[:cut + 1] if cut > 20 else out
    return out.strip()


def _recall_turn(task: str, prompt: str, continuation: str) -> tuple[str, str, str, str]:
    """(user message, assistant answer, the evidence sentence, the value) of one recall task instance:
    passkey, needle and phonebook put their question in the user turn and their answer prefix in the
    answer; kv_recall asks for the last lookup's value."""
    value = continuation.strip().rstrip(".")
    if task == "kv_recall":
        key = prompt.rsplit(" ", 1)[-1].rstrip("=")
        return (prompt[:-1] + "?\nWhat is the value of the last key?", f"{key}={value}", f"{key}={value}", value)
    cut = prompt.rindex("? ") + 1
    question, prefix = prompt[:cut], prompt[cut + 1:]
    if task == "passkey":
        evidence = f"The pass key is {value}."
    elif task == "needle":
        key = re.search(r"special magic number for (\S+) mentioned", question).group(1)
        evidence = f"One of the special magic numbers for {key} is: {value}."
    else:
        evidence = prefix.replace("The phone number of ", "").replace(" is", "") + f": {value}"
    return question, f"{prefix} {value}.", evidence, value


# ---------------------------------------------------------------------------------------------- evaluation
TOOL_CALL = re.compile(r"<tool_call>\n<function=([^>\n]+)>\n((?:<parameter=[^>\n]+>\n.*?\n</parameter>\n)*)"
                       r"</function>\n</tool_call>\n?", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n", re.S)


def parse_tool_calls(text: str) -> list[tuple[str, dict[str, str]]] | None:
    """The calls of a reply's content (after any reasoning) as vLLM's qwen3_coder parser reads them, or None
    when the content has `<tool_call>` blocks that do not parse or anything after them."""
    if "<tool_call>" not in text:
        return []
    head = text.index("<tool_call>")
    calls, at = [], head
    while at < len(text) and text.startswith("<tool_call>", at):
        m = TOOL_CALL.match(text, at)
        if not m:
            return None
        calls.append((m.group(1), dict(PARAMETER.findall(m.group(2)))))
        at = m.end()
    return calls if not text[at:].strip() else None


def _split(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning or None when it never closed, content) of a reply generated after the generation prompt."""
    if not thinking:
        return "", text
    if "</think>" not in text:
        return None, ""
    reasoning, content = text.split("</think>", 1)
    return reasoning, content.lstrip("\n")


@torch.no_grad()
def chat_eval(model, tok: Tokenizer, docs: list[str], n: int = 16, seed: int = EVAL_SEED,
              max_new_tokens: int = 256) -> dict:
    """Greedy replies to held-out conversations (seeds from `seed` on): per kind and thinking mode, the
    fraction that close `</think>` (thinking on), end with `<|im_end|>` and write no think tag (thinking off),
    recall answers that hold the value, tool calls that parse with the right function and arguments, and
    answers after the tool's response that hold its value."""
    data = ChatData(tok, docs, seed)
    end = tok.token_to_id(END)
    stops = tok.stop_ids
    cases = []  # (prompt ids, thinking, kind, check)
    for thinking in (True, False):
        for kind in ("docs", "continue", "recall", "multi_turn", "no_tool", "tool"):
            for _ in range(n):
                e = data.example(kind, thinking)
                last = len(e.messages) - 1
                if kind == "tool":  # the call, and the answer after the reference call's response
                    cases.append((e, e.messages.index(next(m for m in e.messages if m.get("tool_calls"))), "tool_call"))
                    cases.append((e, last, "tool_answer"))
                else:
                    cases.append((e, last, kind))
    prompts = [tok.encode(data.render(e, upto=i), add_special_tokens=False) for e, i, _ in cases]
    results = []
    for s in range(0, len(prompts), 16):
        results += generate_ids(model, prompts[s:s + 16], max_new_tokens, SamplingParams(0.0), stops)
    tally: dict[str, list[float]] = {}

    def add(key: str, ok: bool) -> None:
        tally.setdefault(key, []).append(float(ok))

    samples = []
    for (e, i, what), c in zip(cases, results):
        mode = "think" if e.thinking else "no_think"
        ended = c.finish_reason == "stop" and c.token_ids[-1] == end
        body = c.token_ids[:-1] if ended else c.token_ids
        text = tok.decode(body)
        reasoning, content = _split(text, e.thinking)
        add(f"{mode}/ends_with_im_end", ended)
        if e.thinking:
            add("think/closes_think", reasoning is not None)
        else:
            add("no_think/no_think_tags", "<think>" not in text and "</think>" not in text)
        kind = what.split("/")[0]
        if what == "tool_call":
            calls = parse_tool_calls(content)
            add(f"{mode}/tool_call_well_formed", bool(calls) and ended)
            want = {k: str(v) for k, v in e.expect["arguments"].items()}
            add(f"{mode}/tool_call_exact", calls == [(e.expect["name"], want)])
        elif what == "tool_answer":
            add(f"{mode}/tool_answer_has_value", e.expect["value"] in content and "<tool_call>" not in content)
        elif e.kind.startswith("no_tool"):
            add(f"{mode}/no_tool_no_call", "<tool_call>" not in text)
        if "value" in e.expect and what not in ("tool_call", "tool_answer"):
            add(f"{mode}/{kind}_recall_value", e.expect["value"] in content)
        if sum(x["turn"] == what and x["thinking"] == e.thinking for x in samples) < 1:
            samples.append({"kind": e.kind, "turn": what, "thinking": e.thinking,
                            "reply": tok.decode(c.token_ids, skip_special_tokens=False)[:400]})
    summary = {k: round(sum(v) / len(v), 4) for k, v in sorted(tally.items())}
    summary["n_conversations"] = len(cases)
    return {"chat": summary, "chat_samples": samples}


@torch.no_grad()
def evaluate(directory: str | Path, seed: int = 0, eval_samples: int = 20, chat_n: int = 16) -> dict:
    """The model card's numbers for the checkpoint at `directory` (see the module docstring)."""
    model, tok = hybrid.load(directory, dtype="fp32")
    raw = tokenizers.Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    docs = train.prose_documents()
    val_docs, train_docs = docs[::20], [d for i, d in enumerate(docs) if i % 20]
    val = train.TrainingData(raw, val_docs, 256, 0.0, seed + 1)
    batches = [val.batch(16) for _ in range(4)]
    out = {"checkpoint": str(directory), "held_out_prose_loss": round(train.validation_loss(model, val, batches), 4)}
    for task in train.TASK_WEIGHTS:
        out[f"{task}_acc@240"] = train.answer_accuracy(model, raw, task, 240, eval_samples)
    if tok.chat_template is not None:
        out.update(chat_eval(model, tok, train_docs, chat_n))
    return out


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="the pre-chat checkpoint directory (scripts/train.py's output)")
    p.add_argument("--out", help="checkpoint directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists and is not empty")
    p.add_argument("--evaluate", metavar="DIR", help="only evaluate the checkpoint DIR (JSON on stdout)")
    p.add_argument("--chat-template", default=str(DEFAULT_TEMPLATE), help="the chat template to ship")
    p.add_argument("--steps", type=int, default=700, help="optimiser steps (0: the resized checkpoint, untrained)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--chat-rows", type=int, default=6, help="rows of each batch that are conversations")
    p.add_argument("--task-fraction", type=float, default=0.5, help="recall rows among the other (train.py) rows")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--assistant-weight", type=float, default=2.0, help="loss weight of the assistant's tokens")
    p.add_argument("--answer-weight", type=float, default=4.0, help="loss weight of recall answers (train.py rows)")
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--balance-rate", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.evaluate:
        print(json.dumps(evaluate(args.evaluate, args.seed), indent=1))
        return 0
    if not (args.base and args.out):
        p.error("give --base and --out (or --evaluate DIR)")
    base, out = Path(args.base), Path(args.out)
    check_destination(out, base, args.overwrite)
    torch.manual_seed(args.seed)
    t0 = time.time()

    raw = tokenizers.Tokenizer.from_file(str(base / "tokenizer.json"))
    if raw.token_to_id(CHAT_TOKENS[0]) is not None:
        p.error(f"{base} has the chat tokens already: give the pre-chat checkpoint")
    template = Path(args.chat_template).read_text(encoding="utf-8")
    ids = add_chat_tokens(raw)
    loaded = hybrid.load_model(base, dtype="fp32", prepack=False, mmap=False, progress=False)
    vocab = padded(max(ids.values()) + 1)
    model = resize_vocabulary(loaded, vocab, args.seed)
    del loaded
    tok = Tokenizer(raw, template, {"bos_token": "<s>", "eos_token": END}, stop_ids=[2, ids[END]])
    docs = train.prose_documents()
    train_docs = [d for i, d in enumerate(docs) if i % 20]  # scripts/train.py's split: docs[::20] held out
    original = train.TrainingData(raw, train_docs, args.seq_len, args.task_fraction, args.seed, args.answer_weight)
    chat = ChatData(tok, train_docs, args.seed, args.seq_len, args.assistant_weight, prose=original)
    print(f"chat tokens {ids}; vocabulary {vocab}; {len(chat.topics)} documentation topics "
          f"({time.time() - t0:.1f}s)", file=sys.stderr)

    decay = [q for n, q in model.named_parameters() if q.dim() >= 2 and "embeddings" not in n]
    no_decay = [q for n, q in model.named_parameters() if not (q.dim() >= 2 and "embeddings" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    balancer = ExpertBalancer(model, rate=args.balance_rate)
    history, tokens, start = [], 0, time.time()
    for step in tqdm(range(args.steps), unit="step", dynamic_ncols=True, disable=args.steps == 0):
        lr = learning_rate(step / args.steps, args.lr, args.warmup, final=0.1)
        chat_tokens, chat_weights = chat.batch(args.chat_rows)
        other_tokens, other_weights = original.batch(args.batch_size - args.chat_rows)
        batch, weights = torch.cat([chat_tokens, other_tokens]), torch.cat([chat_weights, other_weights])
        done = train_step(model, opt, balancer, batch, weights, args.mtp_weight, lr)
        tokens += batch.numel()
        record = {"step": step + 1, "seconds": round(time.time() - start, 1), "tokens": tokens, "lr": lr, **done}
        if (step + 1) % args.eval_every == 0:
            model.eval()
            with torch.no_grad():
                e_tokens, e_weights = ChatData(tok, train_docs, EVAL_SEED + step, args.seq_len, 1.0,
                                               prose=original).batch(8)
                record["held_out_chat_loss"] = lm_loss(model, e_tokens, 0.0, e_weights)[1]["lm"]
            tqdm.write(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}),
                       file=sys.stderr)
        history.append(record)

    model.eval()
    summary = {"base": str(base), "args": vars(args), "chat_tokens": ids, "vocab_size": vocab, "steps": args.steps,
               "tokens": tokens, "train_seconds": round(time.time() - start, 1)}
    print(json.dumps(summary, indent=1), file=sys.stderr)
    files = {**tokenizer_files(raw, base, ids), "chat_template.jinja": template,
             "generation_config.json": generation_config(base, ids[END]),
             "finetune_log.json": json.dumps({"summary": summary, "history": history}) + "\n"}
    save_checkpoint(model.cast(torch.bfloat16), out, source=base, overwrite=args.overwrite, files=files)
    return 0


if __name__ == "__main__":
    sys.exit(main())
