"""`hybrid serve` under load, with real HTTP clients, against llama.cpp's own server and the sequential Python API.

    python scripts/bench_serve.py                      # the medium preset (scripts/bench.py's), three workloads
    python scripts/bench_serve.py --quick              # seconds: the tiny preset in fp32, few requests (the smoke test)

Three workloads (`--workloads`), each request `--max-tokens` new tokens, greedy, streamed from `/v1/completions`
by an `httpx` async client that times every server-sent event:

- **shared**: one shared system prompt (`--system-tokens`, exactly that many tokens, a multiple of the server's
  snapshot interval so that a hit resumes at its end) + a short question of its own (a different one for every
  request of the run), after a warm-up request that leaves the system prompt cached;
- **distinct**: about `--distinct-tokens` (256) tokens of text no other request shares: plain batching, nothing
  to reuse;
- **chat**: one conversation per client of `--chat-turns` (4) requests, each turn's prompt the last one, its reply
  and a new question (a chat's next turn extends the last), opened by a distinct text.

Measured in one run, on the same checkpoint and threads (a preset's checkpoint is built once by
`bench.make_checkpoint`):

- **load levels** (`--clients`, default 1 4 16 64) of every workload: that many clients in a closed loop (each
  sends its next request when its last one ended) through `--requests` requests per level (default: 2 per client,
  at least 8; chat: a conversation per client). Per level: generated tokens/s of all clients together (generated
  tokens / the level's wall time), aggregate decode tok/s (the tokens after each stream's first event / the time
  during which any stream was between its first and last event: with N streams decoding at once, N x their
  rate), time to first token and inter-token latency p50 / p99 (ITL: the gaps between a stream's events, per
  token: our server is asked for logprobs, so each event lists its tokens, and an event of k tokens, when a
  token's bytes ended no character, counts k gaps of 1/k of its wait; llama.cpp's events count one token each),
  the prompt tokens served from cache (`usage.prompt_tokens_details.cached_tokens`, llama-server's
  `timings.cache_n`; ours also `/metrics`' hits per admission) and the server process's peak resident memory
  during the level (VmHWM, reset before each level);
- **llama.cpp** (unless `--no-peer`; left out without the optional `llamacpp-peer` tool): its server on a GGUF of
  the same weights (`llamacpp-peer convert`, as scripts/bench.py converts) under the same workloads, levels,
  prompts and client, as many requests as ours: `llamacpp-peer serve` runs llama.cpp's own `llama-server` with
  16 parallel slots over a 65,536-token cache (`PEER_SLOTS`, `PEER_CTX`) once `llamacpp-peer setup-server` has
  built it (continuous batching: the fair peer), else llama-cpp-python's server (one request at a time; noted);
- **sequential**: the shared workload's requests of the target level (16 clients, else the largest level below)
  one after another through `hybrid.generate` with its prefix cache on (`hybrid.prefix_cache.PrefixCache`, warmed
  with the system prompt as the server is), and batch-1 decode tok/s (`generate_ids` on one of the prompts);
  these lone greedy responses are the references the server's are checked against;
- **a long prompt arriving while requests stream**, on both servers: `--streams` (15) requests decode, then a
  `--long-tokens` (8K) prompt of other text arrives; the p99 ITL of the streams from its arrival to its first
  token (per token, as above), against (ours) one prefill chunk's time (the slowest 512-token chunk, the server's
  `max_num_batched_tokens`, of the same prompt alone) plus one decode step of `--streams` sequences, both
  measured after the server stopped, on `hybrid.serving.engine.Engine` with the server's settings, and against
  llama.cpp's;
- **correctness** (unless `--soak 0`), in `--check-dtype` (fp32: there a batched forward gives exactly the
  tokens of a lone one; in bf16 it rounds differently, and on random weights, whose logits are nearly
  flat, greedy paths part at the first near-tie, so bf16 responses are only counted against their lone
  references): the lone greedy responses (`--soak-max-tokens`, 16 new tokens) of the target level's
  requests through `hybrid.generate`, then a fresh server of that dtype: the same requests from the
  target level's clients at once, each response equal to its reference (text and finish reason), and the
  **soak** (`--soak N`, default 1000): N requests from `--soak-clients` (16) clients over those prompts,
  10% of them closing the connection mid-stream (after a random number of events), every completed
  response equal to its reference. Afterwards `/metrics` must show every KV block and state slot free and
  nothing running or waiting, and the server's resident memory must be back within `--rss-tolerance` (5%,
  at least 64 MB) of its level before the soak (after the concurrent requests warmed it). The tokens
  generated for disconnected requests after they left (from `/metrics`) are reported.

The in-process parts (sequential, batch-1 decode, chunk and step, references) run on the main thread, the
one that loaded the model, as the server runs its engine (`hybrid.serving.runner` says why). Targets, printed as
pass / fall short with their ratios, all measured in the same run: at the target level of every workload,
throughput and p99 TTFT against llama.cpp's server (distinct prompts: >= 1.5x its throughput and <= half its
TTFT; the other workloads: >= 1x and <= 1x); on the shared workload, aggregate decode tok/s >= 3x batch-1
decode and throughput >= 4x the sequential run; p99 ITL during the long prefill <= one chunk + one step, and
<= llama.cpp's; the correctness phase's checks. Nothing asserts a time. JSON goes to `--out`; the servers' logs to
`--workdir`/serve-bench-logs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import PEER_TOOL, llamacpp_gguf, make_checkpoint, proc_memory_bytes, write_json  # scripts/ is on the path

from hybrid.serving.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS
from hybrid.serving.prefix import DEFAULT_SNAPSHOT_INTERVAL

SERVER_SNAPSHOT_INTERVAL = DEFAULT_SNAPSHOT_INTERVAL  # `hybrid serve`'s engine: Mamba snapshots (and chunk ends) here
SERVER_CHUNK = DEFAULT_MAX_NUM_BATCHED_TOKENS  # its max_num_batched_tokens: the tokens of one forward
DISCONNECT_FRACTION = 0.1
# asked of our server: then each streamed event lists its tokens (a token whose bytes end no character sends no
# text of its own and joins the next event), so ITL and decode rates count tokens, not text events
TOKEN_COUNTS = {"logprobs": 0}
WORKLOADS = ("shared", "distinct", "chat")
# goals against llama.cpp's server at the target level: (throughput ratio >=, p99 TTFT ratio <=); distinct prompts
# (nothing to reuse) are plain batching, where a batching server must beat it; elsewhere the ratios are reported
PEER_GOALS = {"distinct": (1.5, 0.5)}
_T0 = time.perf_counter()


def log(message: str) -> None:
    """Progress on stderr, with the seconds since the start."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {message}", file=sys.stderr, flush=True)


WORDS = ("the a list of values is returned by function when argument string and module defines class with methods "
         "for reading writing files in current directory while each object keeps its own state after call new "
         "name from table key item index loop over elements that raise error if type not found default option "
         "set to true false number line text data file path read write open close print format value result "
         "called once per request this example shows how use dictionary tuple sequence iterator generator").split()


# ---------------------------------------------------------------------------------------------- prompts
def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
    return " ".join(words).capitalize() + "."


def text_of_tokens(tokenizer, n: int, seed: int, exact: bool = True) -> str:
    """English-looking sentences whose encoding (as the server encodes a prompt: BOS included) has exactly
    `n` tokens (about `n` when not `exact`).

    Raises:
        ValueError: no such text was found (exact).
    """
    rng = random.Random(seed)
    sentences: list[str] = []
    while len(tokenizer.encode(" ".join(sentences))) < n:
        sentences.extend(_sentence(rng) for _ in range(max(1, (n - len(tokenizer.encode(" ".join(sentences)))) // 12)))
    words = " ".join(sentences).split(" ")
    lo, hi = 0, len(words)  # the most words whose encoding has at most n tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.encode(" ".join(words[:mid]))) <= n:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    for _ in range(64):  # pad with one-token words up to exactly n
        missing = n - len(tokenizer.encode(text))
        if missing == 0 or not exact:
            return text
        for pad in (" a", " the", " of", ".", ","):
            if len(tokenizer.encode(text + pad)) <= n:
                text += pad
                break
        else:
            break
    raise ValueError(f"found no text of exactly {n} tokens")


def _question(rng: random.Random, label: str) -> str:
    return f"\n\nQuestion {label}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12))) + "?\nAnswer:"


@dataclass
class Prompts:
    """The prompts of every workload, each a pure function of its index (and the tokenizer)."""

    system: str
    system_tokens: int
    questions: list[str]  # request i's prompt of the shared workload is system + questions[i]
    long: str
    long_tokens: int
    prefix_stable: bool  # every prompt's tokens start with the system prompt's
    tokenizer: object = field(default=None, repr=False)
    distinct_tokens: int = 256
    _distinct: dict = field(default_factory=dict, repr=False)

    def prompt(self, i: int) -> str:
        return self.system + self.questions[i]

    def distinct(self, i: int) -> str:
        """Request i's prompt of the distinct workload (and conversation i's opening in the chat one): about
        `distinct_tokens` tokens of text that no other request shares."""
        if i not in self._distinct:
            self._distinct[i] = text_of_tokens(self.tokenizer, self.distinct_tokens, seed=100_000 + i, exact=False)
        return self._distinct[i]

    def follow_up(self, i: int, turn: int) -> str:
        """The user's next question in conversation i after `turn` replies (the chat workload)."""
        return _question(random.Random(1_000_000 * (turn + 1) + i), f"{turn + 1}")

    def of(self, workload: str, i: int) -> str:
        """Request i's prompt of a closed-loop workload ("shared" or "distinct")."""
        return self.prompt(i) if workload == "shared" else self.distinct(i)


def make_prompts(tokenizer, system_tokens: int, num_questions: int, long_tokens: int,
                 distinct_tokens: int = 256) -> Prompts:
    system = text_of_tokens(tokenizer, system_tokens, seed=1)
    rng = random.Random(2)
    questions = [_question(rng, str(i)) for i in range(num_questions)]
    head = tokenizer.encode(system)
    stable = all(tokenizer.encode(system + q)[:len(head)] == head for q in questions[:32])
    long = text_of_tokens(tokenizer, long_tokens, seed=3, exact=False)
    return Prompts(system, len(head), questions, long, len(tokenizer.encode(long)), stable, tokenizer, distinct_tokens)


# ---------------------------------------------------------------------------------------------- statistics
def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    f = math.floor(k)
    return xs[f] + (xs[min(f + 1, len(xs) - 1)] - xs[f]) * (k - f)


# ---------------------------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started as a process of its own (its output to `log`), ready once `ready` answers 200."""

    def __init__(self, name: str, cmd: list[str], url: str, log: Path, ready: str = "/health", timeout: float = 600,
                 env: dict[str, str] | None = None):
        import os

        import httpx

        self.name, self.url, self.log = name, url, log
        self._peaks: list[int] = []
        self._log = log.open("a")  # a running log, appended to: each run starts with its own header line
        self._log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        self._log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode} before it was ready:\n{self.tail()}")
            try:
                if httpx.get(url + ready, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} was not ready after {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.25)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def rss(self) -> int | None:
        return proc_memory_bytes(self.pid, "VmRSS")

    def peak(self) -> int | None:
        return proc_memory_bytes(self.pid, "VmHWM")

    def reset_peak(self) -> bool:
        """Reset the process's peak resident memory to its present one (Linux: clear_refs 5); the peak so
        far is kept for `overall_peak`."""
        self._peaks.append(self.peak() or 0)
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def overall_peak(self) -> int | None:
        """The process's peak resident memory since it started, across `reset_peak`s."""
        now = self.peak()
        return None if now is None else max(self._peaks + [now])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn shuts down on SIGINT
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def read_metrics(url: str) -> dict[str, float]:
    """The server's /metrics (Prometheus text) as {name without the hybrid_ prefix: value}."""
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("hybrid_"):
            name, value = line.split()[:2]
            out[name[len("hybrid_"):]] = float(value)
    return out


# ---------------------------------------------------------------------------------------------- clients
@dataclass
class Response:
    """One streamed request as its client saw it (times in seconds of `time.perf_counter`)."""

    index: int  # the prompt's index (Prompts.questions)
    start: float
    events: list[float] = field(default_factory=list)  # arrival of each event that carried text
    event_tokens: list[int] = field(default_factory=list)  # the tokens of each (its logprobs' when asked, else 1)
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None  # from the usage chunk, when the server sends one
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    disconnected: bool = False
    error: str | None = None
    end: float = 0.0

    @property
    def ttft(self) -> float | None:
        return self.events[0] - self.start if self.events else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.events, self.events[1:])]

    def token_gaps(self, after: float, until: float) -> list[float]:
        """Inter-token latencies of the events that arrived in (after, until]: an event of k tokens (a token
        whose bytes end no character sends no text: the next event carries both) counts k gaps of 1/k of
        the time since the event before it."""
        return [(b - a) / k for a, b, k in zip(self.events, self.events[1:], self.event_tokens[1:])
                if after < b <= until for _ in range(k)]

    def tokens(self, max_tokens: int) -> int:
        """Generated tokens: the usage chunk's count, else max_tokens for a response cut at its length, else
        its text events (one per token when the server sends one per token)."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return max_tokens if self.finish_reason == "length" else len(self.events)


class Client:
    """Streams completions from one server (`/v1/completions`, greedy), with up to `connections` at once."""

    def __init__(self, url: str, model: str | None, max_tokens: int, connections: int, extra: dict | None = None):
        import httpx

        self.url, self.model, self.max_tokens, self.extra = url, model, max_tokens, extra or {}
        limits = httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4)
        self.http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(3600.0))

    async def close(self) -> None:
        await self.http.aclose()

    async def stream(self, index: int, prompt: str, max_tokens: int | None = None, disconnect_after: int | None = None,
                     on_event=None, until=None) -> Response:
        """One streamed request; the client closes the connection (mid-stream) after `disconnect_after` text
        events, or after the first event at which `until()` is true; `on_event(response)` is called after
        each text event."""
        body = {"prompt": prompt, "max_tokens": max_tokens or self.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **self.extra}
        if self.model is not None:
            body["model"] = self.model
        r = Response(index, time.perf_counter())
        try:
            async with self.http.stream("POST", self.url + "/v1/completions", json=body) as http:
                if http.status_code != 200:
                    r.error = f"HTTP {http.status_code}: {(await http.aread())[:300]!r}"
                    return r
                async for line in http.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        r.error = str(chunk["error"])[:300]
                        break
                    usage = chunk.get("usage")
                    if usage:
                        r.completion_tokens, r.prompt_tokens = usage.get("completion_tokens"), usage.get("prompt_tokens")
                        r.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    timings = chunk.get("timings")  # llama-server's: cache_n prompt tokens from its slot's cache
                    if isinstance(timings, dict) and r.cached_tokens is None and "cache_n" in timings:
                        r.cached_tokens = timings["cache_n"]
                    for choice in chunk.get("choices") or []:
                        if choice.get("text"):
                            r.events.append(time.perf_counter())
                            r.event_tokens.append(len((choice.get("logprobs") or {}).get("tokens") or [None]))
                            r.text += choice["text"]
                            if on_event is not None:
                                on_event(r)
                        if choice.get("finish_reason"):
                            r.finish_reason = choice["finish_reason"]
                    if (disconnect_after is not None and len(r.events) >= disconnect_after) or (until and until()):
                        r.disconnected = True
                        break  # leaving the block closes the response before its end: the connection goes
        except Exception as e:  # a failed request is reported, not fatal
            r.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            r.end = time.perf_counter()
        return r

    async def closed_loop(self, jobs: list[tuple[int, str, int | None]], clients: int) -> tuple[list[Response], float]:
        """`clients` clients, each sending its next job (index, prompt, disconnect_after) when its last one
        ended; returns the responses in job order and the wall time from the first send to the last end."""
        pending = list(enumerate(jobs))[::-1]
        out: list[Response | None] = [None] * len(jobs)

        async def one_client():
            while pending:
                k, (index, prompt, cut) = pending.pop()
                out[k] = await self.stream(index, prompt, disconnect_after=cut)

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        return out, time.perf_counter() - start  # type: ignore[return-value]

    async def conversations(self, openings: list[tuple[int, str]], turns: int, follow_up) -> tuple[list[Response], float]:
        """One client per (index, opening) holding a conversation of `turns` requests: each turn's prompt is the
        last one, its reply and `follow_up(index, turn)` (each prompt extends the one before, as a chat's next
        turn does); returns every response and the wall time from the first send to the last end."""

        async def one_conversation(index: int, prompt: str) -> list[Response]:
            out = []
            for turn in range(turns):
                r = await self.stream(index, prompt)
                out.append(r)
                if r.error is not None:
                    break
                prompt = prompt + r.text + follow_up(index, turn)
            return out

        start = time.perf_counter()
        runs = await asyncio.gather(*(one_conversation(i, opening) for i, opening in openings))
        return [r for run in runs for r in run], time.perf_counter() - start


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals (a, b)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(responses: list[Response], wall: float, max_tokens: int) -> dict:
    """A level's figures from its responses."""
    done = [r for r in responses if r.error is None]
    tokens = sum(r.tokens(max_tokens) for r in done)
    ttft = [r.ttft for r in done if r.ttft is not None]
    gaps = [g for r in done for g in r.token_gaps(-math.inf, math.inf)]
    rates = [sum(r.event_tokens[1:]) / (r.events[-1] - r.events[0]) for r in done
             if len(r.events) > 2 and r.events[-1] > r.events[0]]
    decoding = union_length([(r.events[0], r.events[-1]) for r in done if len(r.events) > 1])
    prompt = sum(r.prompt_tokens or 0 for r in done)
    cached = sum(r.cached_tokens or 0 for r in done)
    return {
        "requests": len(responses), "errors": len(responses) - len(done),
        "cut_short": sum(1 for r in done if r.finish_reason is None and not r.disconnected),
        "errors_seen": sorted({r.error for r in responses if r.error})[:3],
        "wall_s": wall, "generated_tokens": tokens, "tok_s": tokens / wall if wall > 0 else None,
        "stream_decode_tok_s": statistics.mean(rates) if rates else None,
        "decode_tok_s": sum(sum(r.event_tokens[1:]) for r in done) / decoding if decoding else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99), "itl_samples": len(gaps),
        "prompt_tokens": prompt or None, "cached_tokens": cached if prompt else None,
        "cached_fraction": cached / prompt if prompt else None,
    }


async def _run_level(client: Client, prompts: Prompts, workload: str, indices: list[int], clients: int,
                     server: ServerProcess, metrics: bool, turns: int) -> dict:
    before = read_metrics(server.url) if metrics else None
    reset = server.reset_peak()
    if workload == "chat":  # indices: the conversations' openings, one client each
        responses, wall = await client.conversations([(i, prompts.distinct(i)) for i in indices], turns,
                                                     prompts.follow_up)
    else:
        responses, wall = await client.closed_loop([(i, prompts.of(workload, i), None) for i in indices], clients)
    level = summarize(responses, wall, client.max_tokens)
    level["clients"] = clients
    level["peak_rss_bytes"] = server.peak() if reset else None
    if metrics:
        after = read_metrics(server.url)
        queries = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
        level["prefix_hits_per_admission"] = ((after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"])
                                              / queries if queries else None)
        level["preemptions"] = after["preemptions_total"] - before["preemptions_total"]
    level["responses"] = responses
    return level


def run_levels(server: ServerProcess, model: str | None, prompts: Prompts, plan: list[tuple[int, list[int]]],
               max_tokens: int, warmup: int, metrics: bool, extra: dict | None = None, workload: str = "shared",
               turns: int = 1) -> dict:
    """Warm the server with request `warmup` of `workload` (the shared one's leaves the system prompt cached),
    then run each (clients, prompt indices) level: closed-loop requests, or (chat) one conversation of `turns`
    requests per client."""

    async def go():
        client = Client(server.url, model, max_tokens, max(c for c, _ in plan), extra)
        try:
            warm = await client.stream(warmup, prompts.of("distinct" if workload == "chat" else workload, warmup))
            if warm.error:
                raise RuntimeError(f"{server.name}: the warm-up request failed: {warm.error}")
            levels = {}
            for clients, indices in plan:
                levels[str(clients)] = await _run_level(client, prompts, workload, indices, clients, server, metrics,
                                                        turns)
                log(f"  {server.name}, {workload}: {clients} clients: {levels[str(clients)]['tok_s']:.1f} tok/s")
            return {"warmup_prompt_tokens": warm.prompt_tokens, "levels": levels}
        finally:
            await client.close()

    return asyncio.run(go())


def run_long_prompt(server: ServerProcess, model: str | None, prompts: Prompts, indices: list[int], max_tokens: int,
                    extra: dict | None = TOKEN_COUNTS) -> dict:
    """`len(indices)` requests stream; once each has its first token, the long prompt arrives. The streams'
    gaps that end between its arrival and its first token (its prefill) are the figure."""

    async def go():
        streams_max = 6 * math.ceil(prompts.long_tokens / SERVER_CHUNK) + 64  # they outlast the prefill
        # ours asked for logprobs: each event says how many tokens it carries (a token with no text of its own
        # joins the next); llama.cpp's events carry one token each
        client = Client(server.url, model, max_tokens, len(indices) + 1, extra=extra)
        started, done = asyncio.Event(), asyncio.Event()
        first: set[int] = set()

        def on_event(r: Response):
            first.add(r.index)
            if len(first) == len(indices):
                started.set()

        streams = [asyncio.ensure_future(client.stream(i, prompts.prompt(i), streams_max, on_event=on_event,
                                                       until=done.is_set)) for i in indices]
        try:
            waiting = asyncio.ensure_future(started.wait())
            await asyncio.wait([waiting, *streams], return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            if not started.is_set():
                failed = next(s.result() for s in streams if s.done())
                raise RuntimeError(f"a stream ended before the long prompt was sent: {failed.error or failed.finish_reason}")
            arrival = time.perf_counter()
            long = await client.stream(-1, prompts.long, max_tokens=2)
        finally:
            done.set()  # the streams disconnect at their next event (the server aborts them)
            results = await asyncio.gather(*streams)
            await client.close()
        if long.error or not (long.events or long.finish_reason):
            raise RuntimeError(f"the long prompt failed: {long.error or 'no token came back'}")
        # its first token; its two tokens may decode to no text yet: then the stream's end, one step later
        end = long.events[0] if long.events else long.end
        gaps = [g for r in results for g in r.token_gaps(arrival, end)]
        cut = sum(r.finish_reason is not None for r in results)
        if cut:
            print(f"note: {cut} of the streams ended before the long prompt's first token", file=sys.stderr)
        return {"streams": len(indices), "long_prompt_tokens": long.prompt_tokens or prompts.long_tokens,
                "long_ttft_s": end - arrival, "itl_samples": len(gaps), "itl_p50_s": percentile(gaps, 50),
                "itl_p99_s": percentile(gaps, 99), "itl_max_s": max(gaps) if gaps else None}

    return asyncio.run(go())


def wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    """/metrics once nothing runs, waits or holds a block or a slot (or at `timeout`: then as it is)."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(url)
        if not (m["requests_running"] or m["requests_waiting"] or m["kv_blocks_used"] or m["state_slots_used"]):
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def run_soak(server: ServerProcess, model: str, prompts: Prompts, references: dict[int, dict], n: int, clients: int,
             max_tokens: int, tolerance: float, seed: int = 0) -> dict:
    """`n` requests over the prompts of `references`, a tenth of them disconnecting mid-stream; then the
    checks of the module docstring (the responses and the figures)."""
    rng = random.Random(seed)
    pool = sorted(references)
    cuts = set(rng.sample(range(n), round(n * DISCONNECT_FRACTION)))
    jobs = [(pool[k % len(pool)], prompts.prompt(pool[k % len(pool)]),
             rng.randint(1, max(1, max_tokens // 2)) if k in cuts else None) for k in range(n)]
    before = wait_idle(server.url)
    rss_before = server.rss()

    async def go():
        client = Client(server.url, model, max_tokens, clients)
        try:
            return await client.closed_loop(jobs, clients)
        finally:
            await client.close()

    responses, wall = asyncio.run(go())
    after = wait_idle(server.url)
    time.sleep(0.5)  # let the allocator settle after the last frees
    rss_after = server.rss()
    check = check_responses(responses, references)
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    received = sum(r.tokens(max_tokens) if not r.disconnected else len(r.events) for r in responses if r.error is None)
    limit = max(tolerance * rss_before, 64e6) if rss_before else None
    return {
        "requests": n, "clients": clients, "max_tokens": max_tokens, "wall_s": wall,
        "disconnected": sum(r.disconnected for r in responses),
        "errors": sum(r.error is not None for r in responses),
        "errors_seen": sorted({r.error for r in responses if r.error})[:3],
        **check,
        "after": {k: after[k] for k in ("requests_running", "requests_waiting", "kv_blocks_used", "state_slots_used")},
        "kv_blocks_total": after["kv_blocks_total"], "state_slots_total": after["state_slots_total"],
        "all_free": not (after["requests_running"] or after["requests_waiting"] or after["kv_blocks_used"]
                         or after["state_slots_used"]),
        "generated_tokens": generated, "tokens_received": received,
        "tokens_after_disconnects": generated - received,
        "rss_before_bytes": rss_before, "rss_after_bytes": rss_after, "rss_limit_bytes": limit,
        "rss_back": None if limit is None or rss_after is None else rss_after - rss_before <= limit,
    }


def server_command(args, directory: Path, port: int, dtype: str) -> list[str]:
    """`hybrid serve` on `directory` with the bench's threads, slots and queue, in `dtype`."""
    hybrid_cmd = Path(sys.executable).parent / "hybrid"
    cmd = [str(hybrid_cmd)] if hybrid_cmd.exists() else [sys.executable, "-m", "hybrid.cli"]
    return cmd + ["serve", str(directory), "--port", str(port), "--threads", str(args.threads), "--dtype", dtype,
                  "--max-num-seqs", str(max(args.clients + [args.soak_clients, args.streams + 1])),
                  "--max-queue", str(max(args.clients + [args.soak_clients]) + 16)] \
        + (["--speculative", str(args.speculative)] if args.speculative else [])


def check_references(model, tokenizer, prompts: Prompts, indices: list[int], max_tokens: int) -> dict[int, dict]:
    """The lone greedy responses of the requests `indices` (`run_sequential`'s), the correctness phase's
    references."""
    return run_sequential(model, tokenizer, prompts, indices, 0, max_tokens)["references"]


def run_check_and_soak(args, directory: Path, tokenizer, prompts: Prompts, clients: int, indices: list[int],
                       log_dir: Path) -> tuple[dict, dict]:
    """The correctness phase, in `args.check_dtype` (see the module docstring): the references of the requests
    `indices` through `hybrid.generate` alone, then a server of that dtype: those requests from `clients`
    clients at once (compared with the references; this also warms the server) and the soak. Returns the
    figures of both."""
    import hybrid

    log(f"correctness in {args.check_dtype}: {len(indices)} lone references through hybrid.generate ...")
    model, _ = hybrid.load(directory, dtype=args.check_dtype, progress=False)
    references = check_references(model, tokenizer, prompts, indices, args.soak_max_tokens)
    del model
    port = free_port()
    server = ServerProcess(f"hybrid serve ({args.check_dtype})", server_command(args, directory, port, args.check_dtype),
                           f"http://127.0.0.1:{port}", log_dir / "hybrid-serve-check.log")
    try:
        run = run_levels(server, directory.name, prompts, [(clients, indices)], args.soak_max_tokens, 0, metrics=True)
        check = {"dtype": args.check_dtype, "clients": clients, "requests": len(indices),
                 **check_responses(run["levels"][str(clients)]["responses"], references)}
        log(f"soak: {args.soak} requests ...")
        soak = run_soak(server, directory.name, prompts, references, args.soak, args.soak_clients,
                        args.soak_max_tokens, args.rss_tolerance)
    finally:
        server.stop()
    return check, {"dtype": args.check_dtype, **soak}


def check_responses(responses: list[Response], references: dict[int, dict]) -> dict:
    """Every completed response (not disconnected, no error) against the greedy reference of its prompt:
    the same text and finish reason. Returns the counts and the first mismatches."""
    compared = equal = 0
    mismatches = []
    for r in responses:
        if r.error is not None or r.disconnected or r.index not in references:
            continue
        ref = references[r.index]
        compared += 1
        if r.text == ref["text"] and r.finish_reason == ref["finish_reason"]:
            equal += 1
        elif len(mismatches) < 5:
            common = next((k for k, (a, b) in enumerate(zip(r.text, ref["text"])) if a != b), min(len(r.text), len(ref["text"])))
            mismatches.append({"prompt": r.index, "finish_reason": r.finish_reason, "reference_finish": ref["finish_reason"],
                               "common_chars": common, "got": r.text[:120], "want": ref["text"][:120]})
    return {"compared": compared, "equal": equal, "mismatches": mismatches,
            "correct": compared > 0 and equal == compared}


def llamacpp_log_facts(log: Path) -> dict:
    """From llama-cpp-python's server log: how often it re-evaluated a whole prompt although a prefix matched
    (a hybrid model's recurrent state cannot be cut back to a prefix), how often it reused one, and the
    median prompt tokens per request."""
    text = log.read_text(errors="replace")
    counts = [int(line.split("/")[1].split()[0]) for line in text.splitlines()
              if "prompt eval time" in line and "/" in line and line.split("/")[1].split()[0].isdigit()]
    return {"full_reevaluations": text.count("re-evaluating full prompt"), "prefix_hits": text.count("prefix-match hit"),
            "prompt_tokens_median": statistics.median(counts) if counts else None}


def run_peer(args, gguf: Path, url: str, log_path: Path, prompts: Prompts, plans: dict, warmup: int,
             stream_indices: list[int]) -> dict:
    """llama.cpp's server on `gguf` (`llamacpp-peer serve`: llama-server with `PEER_SLOTS` parallel slots when
    `llamacpp-peer setup-server` built it, else llama-cpp-python's, one request at a time) under every workload's
    levels of `plans` ({workload: (plan, turns)}; each level's first `--peer-requests` requests when given, else
    all of them), then the long prompt while requests stream. Returns {"workloads": {workload: levels}, ...}."""
    port = url.rsplit(":", 1)[1]
    # llama-cpp-python's server serves one request at a time and by default (interrupt_requests) ends a
    # streaming response with [DONE] as soon as another request waits: under concurrent clients most of its
    # responses were cut after a few tokens and every switch re-evaluated a whole prompt. Its setting (a
    # pydantic-settings field, read from the environment) off: each request runs to its end, in turn.
    # LLAMA_ARG_KV_UNIFIED: llama-server's slots share one KV buffer, as our requests share one pool (with -np 16
    # and its own per-slot split, each slot holds 1/16 of the cache and the 8K prompt was refused)
    peer = ServerProcess("llama.cpp server", [args.peer_tool, "serve", str(gguf), port, str(args.threads)], url,
                         log_path, ready="/v1/models", env={"INTERRUPT_REQUESTS": "false", "LLAMA_ARG_KV_UNIFIED": "1"})
    # llama-cpp-python's default penalty is 1.1; ignore_eos: every response runs to max_tokens, as ours do on these
    # prompts (llama.cpp's greedy path reached the end-of-text token in a few, which ended a long-prompt stream)
    extra = {"repeat_penalty": 1.0, "seed": 0, "ignore_eos": True}
    result: dict = {"workloads": {}, "errors": []}
    try:  # a phase that fails is noted; the others' figures stand
        for workload, (plan, turns) in plans.items():
            peer_plan = [(c, indices[:args.peer_requests] if args.peer_requests else indices) for c, indices in plan]
            try:
                levels = run_levels(peer, None, prompts, peer_plan, args.max_tokens, warmup, metrics=False,
                                    extra=extra, workload=workload, turns=turns)
            except Exception as e:
                result["errors"].append(f"{workload}: {type(e).__name__}: {str(e)[-600:]}")
                continue
            for level in levels["levels"].values():
                level.pop("responses")
            result["workloads"][workload] = levels
        if stream_indices:
            try:
                result["long_prompt"] = run_long_prompt(peer, None, prompts, stream_indices, args.max_tokens, extra)
            except Exception as e:
                result["errors"].append(f"long prompt: {type(e).__name__}: {str(e)[-600:]}")
        result["peak_rss_bytes"] = peer.overall_peak()
    finally:
        peer.stop()
    text = log_path.read_text(errors="replace")
    result["server"] = "llama-server" if re.search(r"llama[-_]server|server is listening", text) else "llama-cpp-python"
    if result["server"] == "llama-cpp-python":
        result.update(llamacpp_log_facts(log_path))
    return {**result, "gguf": str(gguf)}


# ---------------------------------------------------------------------------------------------- in-process
@torch.inference_mode()
def run_sequential(model, tokenizer, prompts: Prompts, indices: list[int], warmup: int, max_tokens: int) -> dict:
    """The requests one after another through `hybrid.generate` with a prefix cache (warmed by request
    `warmup`, as the server is); their greedy responses are the references. And batch-1 decode tok/s."""
    import hybrid
    from hybrid.generate import generate_ids
    from hybrid.prefix_cache import PrefixCache

    cache = PrefixCache(model)
    hybrid.generate(model, tokenizer, [prompts.prompt(warmup)], max_new_tokens=max_tokens, prefix_cache=cache)
    references, decode = {}, []
    start = time.perf_counter()
    for i in indices:
        (c,) = hybrid.generate(model, tokenizer, [prompts.prompt(i)], max_new_tokens=max_tokens, temperature=0.0,
                               prefix_cache=cache)
        references[i] = {"text": c.text, "finish_reason": c.finish_reason, "tokens": len(c.token_ids),
                         "token_ids": list(c.token_ids), "cached_tokens": c.cached_tokens}
        if c.decode_tokens_per_s:
            decode.append(c.decode_tokens_per_s)
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in references.values())
    del cache
    ids = tokenizer.encode(prompts.prompt(indices[0]))
    (b1,) = generate_ids(model, [ids], max_new_tokens=max_tokens + 1)
    return {"requests": len(indices), "wall_s": wall, "generated_tokens": tokens, "tok_s": tokens / wall,
            "decode_tok_s_median": statistics.median(decode) if decode else None,
            "cached_tokens_min": min(r["cached_tokens"] for r in references.values()),
            "batch1_decode_tok_s": b1.decode_tokens_per_s, "references": references}


@torch.inference_mode()
def measure_chunk_and_step(model, tokenizer, prompts: Prompts, indices: list[int], steps: int = 8) -> dict:
    """On `Engine` with the server's settings: the time of each prefill chunk of the long prompt alone, and
    of a decode step of `len(indices)` sequences (system prompt + question each)."""
    from hybrid.serving.engine import Engine

    def timed_step(engine) -> float:
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    engine = Engine(model, max_num_seqs=max(16, len(indices)), prefix_caching=True)
    ids = tokenizer.encode(prompts.long)
    rid = engine.add_request(ids, None, max_tokens=1)
    chunks = []
    while engine.requests[rid].output_ids == []:
        t = timed_step(engine)
        chunks.append((t, engine.last_step.num_tokens))
    engine.release(rid)
    engine = Engine(model, max_num_seqs=max(16, len(indices)), prefix_caching=True)
    engine.generate([tokenizer.encode(prompts.prompt(indices[0]))], max_tokens=1)  # the system prompt cached
    rids = [engine.add_request(tokenizer.encode(prompts.prompt(i)), None, max_tokens=steps + 64) for i in indices]
    while not all(engine.requests[r].output_ids for r in rids):
        engine.step()
    decode = []
    for _ in range(steps):
        decode.append(timed_step(engine))
        assert engine.last_step.num_decode_tokens == len(indices)
    full = [t for t, n in chunks if n == SERVER_CHUNK] or [t for t, _ in chunks]
    return {"chunk_tokens": SERVER_CHUNK, "chunks": len(chunks), "chunk_median_s": statistics.median(full),
            "chunk_max_s": max(full), "decode_step_seqs": len(indices), "decode_step_s": statistics.median(decode)}


# ---------------------------------------------------------------------------------------------- report
def targets(report: dict) -> list[dict]:
    out = []

    def add(name: str, value, goal: float, below: bool = False, note: str = ""):
        if value is not None:
            out.append({"target": name, "value": round(value, 3), "goal": goal, "below": below, "note": note,
                        "pass": value <= goal if below else value >= goal})

    key = str(report["target_level"])
    seq = report["sequential"]
    shared = report["workloads"].get("shared")
    if shared:
        ours = shared["ours"]["levels"][key]
        if ours["decode_tok_s"]:
            add(f"shared, {key} clients: aggregate decode tok/s / batch-1 decode",
                ours["decode_tok_s"] / seq["batch1_decode_tok_s"], 3.0,
                note=f"{ours['decode_tok_s']:.1f} / {seq['batch1_decode_tok_s']:.1f}")
        add(f"shared, {key} clients: throughput / sequential hybrid.generate", ours["tok_s"] / seq["tok_s"], 4.0,
            note=f"{ours['tok_s']:.1f} / {seq['tok_s']:.1f}")
    for workload, both in report["workloads"].items():  # against the peer in the same run
        ours, peer = both["ours"]["levels"][key], (both.get("llama.cpp") or {}).get("levels", {}).get(key)
        if not peer:
            continue
        goals = PEER_GOALS.get(workload, (1.0, 1.0))
        if peer.get("tok_s"):
            add(f"{workload}, {key} clients: throughput / llama.cpp server's", ours["tok_s"] / peer["tok_s"], goals[0],
                note=f"{ours['tok_s']:.1f} / {peer['tok_s']:.1f} tok/s")
        if ours.get("ttft_p99_s") and peer.get("ttft_p99_s"):
            add(f"{workload}, {key} clients: p99 TTFT / llama.cpp server's", ours["ttft_p99_s"] / peer["ttft_p99_s"],
                goals[1], below=True, note=f"{ours['ttft_p99_s']:.3f} / {peer['ttft_p99_s']:.3f} s")
    long, cost = report.get("long_prompt"), report.get("chunk_and_step")
    peer_long = (report.get("llama.cpp") or {}).get("long_prompt")
    if long and peer_long and long["itl_p99_s"] and peer_long["itl_p99_s"]:
        add(f"p99 ITL during a {long['long_prompt_tokens']}-token prefill / llama.cpp server's",
            long["itl_p99_s"] / peer_long["itl_p99_s"], 1.0, below=True,
            note=f"{long['itl_p99_s']:.3f} / {peer_long['itl_p99_s']:.3f} s; its TTFT {long['long_ttft_s']:.2f} / "
                 f"{peer_long['long_ttft_s']:.2f} s")
    if long and cost and long["itl_p99_s"] is not None:
        bound = cost["chunk_max_s"] + cost["decode_step_s"]
        add(f"p99 ITL during a {long['long_prompt_tokens']}-token prefill / (chunk + step)", long["itl_p99_s"] / bound,
            1.0, below=True, note=f"{long['itl_p99_s']:.3f} s / ({cost['chunk_max_s']:.3f} + {cost['decode_step_s']:.3f} s)")
    check = report.get("check")
    if check:
        add(f"{check['clients']} clients at once ({check['dtype']}): responses equal to the lone ones (fraction)",
            check["equal"] / max(check["compared"], 1), 1.0, note=f"{check['equal']} of {check['compared']}")
    soak = report.get("soak")
    if soak:
        add(f"soak ({soak['dtype']}): completed responses equal to the lone ones (fraction)",
            soak["equal"] / max(soak["compared"], 1), 1.0,
            note=f"{soak['equal']} of {soak['compared']}; {soak['disconnected']} disconnected, {soak['errors']} errors")
        add("soak: KV blocks and state slots in use after", sum(soak["after"].values()), 0, below=True,
            note=", ".join(f"{k} {v:g}" for k, v in soak["after"].items()))
        if soak["rss_back"] is not None:
            add("soak: RSS growth MB (limit: tolerance)", (soak["rss_after_bytes"] - soak["rss_before_bytes"]) / 1e6,
                soak["rss_limit_bytes"] / 1e6, below=True,
                note=f"{soak['rss_before_bytes'] / 1e6:.0f} -> {soak['rss_after_bytes'] / 1e6:.0f} MB")
    return out


def _f(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


WORKLOAD_TEXT = {
    "shared": "a shared system prompt of {system} tokens + a question of its own ({q} tokens)",
    "distinct": "about {distinct} tokens of text no other request shares",
    "chat": "conversations of {turns} turns, one per client: an opening of about {distinct} tokens, then each turn's "
            "prompt the last one + its reply + a question",
}


def print_report(report: dict) -> None:
    p = report["prompts"]
    print(f"{report['model']} | {report['dtype']} | {report['threads']} threads | {report['max_tokens']} new tokens, "
          f"greedy, streamed")
    for workload, both in report["workloads"].items():
        text = WORKLOAD_TEXT[workload].format(system=p["system_tokens"], distinct=p["distinct_tokens"],
                                              turns=report["chat_turns"],
                                              q=f"{min(p['question_tokens'])}-{max(p['question_tokens'])}")
        print(f"\n{workload}: {text}")
        _print_levels(both)
    print()
    _print_rest(report)


def _print_levels(both: dict) -> None:
    print(f"{'server':18}{'clients':>8}{'requests':>9}{'tok/s':>9}{'decode':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}"
          f"{'ITL p99':>9}{'cached':>8}{'hits':>6}{'peak RSS MB':>12}")
    for name in ("ours", "llama.cpp"):
        engine = both.get(name)
        if not engine:
            continue
        for level in engine["levels"].values():
            print(f"{'hybrid serve' if name == 'ours' else 'llama.cpp server':18}{level['clients']:>8}"
                  f"{level['requests']:>9}{_f(level['tok_s'], '.1f'):>9}{_f(level['decode_tok_s'], '.1f'):>8}"
                  f"{_f(level['ttft_p50_s']):>10}"
                  f"{_f(level['ttft_p99_s']):>10}{_f(level['itl_p50_s']):>9}{_f(level['itl_p99_s']):>9}"
                  f"{_f(level['cached_fraction'], '.0%'):>8}{_f(level.get('prefix_hits_per_admission'), '.0%'):>6}"
                  f"{_f(level['peak_rss_bytes'] and level['peak_rss_bytes'] / 1e6, ',.0f'):>12}"
                  + (f"  ({level['errors']} errors: {level['errors_seen'][0]})" if level["errors"] else "")
                  + (f"  ({level['cut_short']} cut short: no finish reason)" if level.get("cut_short") else ""))


def _print_rest(report: dict) -> None:
    mb = lambda b: _f(b and b / 1e6, ",.0f")  # noqa: E731
    print(f"hybrid serve: resident {mb(report.get('server_rss_after_start_bytes'))} MB after start, "
          f"{mb(report.get('server_peak_rss_bytes'))} MB at its peak over the run"
          + (f"; llama.cpp server: {mb(report['llama.cpp'].get('peak_rss_bytes'))} MB at its peak"
             if report.get("llama.cpp") else ""))
    s = report["sequential"]
    level = report["workloads"]["shared"]["ours"]["levels"][str(report["target_level"])] \
        if "shared" in report["workloads"] else {}
    if "equal_to_reference" in level:
        print(f"hybrid serve, {level['clients']} clients: {level['equal_to_reference']} of {level['requests']} responses "
              f"equal to the sequential (lone greedy) ones" + ("" if report["dtype"] == report["check_dtype"] else
              f" ({report['dtype']} rounds a batch differently from a lone forward; exact check in "
              f"{report['check_dtype']} below)"))
    print(f"sequential hybrid.generate, prefix cache on: {s['requests']} requests in {s['wall_s']:.2f} s, "
          f"{s['tok_s']:.1f} tok/s (decode {_f(s['decode_tok_s_median'], '.1f')} tok/s); batch-1 decode "
          f"(generate_ids): {s['batch1_decode_tok_s']:.1f} tok/s")
    if report.get("peer_note"):
        print(f"llama.cpp: {report['peer_note']}")
    for error in (report.get("llama.cpp") or {}).get("errors", []):
        print(f"llama.cpp failed: {error}")
    long, cost = report.get("long_prompt"), report.get("chunk_and_step")
    for name, lp in (("hybrid serve", long), ("llama.cpp server", (report.get("llama.cpp") or {}).get("long_prompt"))):
        if lp:
            print(f"{name}: a {lp['long_prompt_tokens']}-token prompt while {lp['streams']} stream: its TTFT "
                  f"{lp['long_ttft_s']:.2f} s; the streams' ITL during its prefill p50 {_f(lp['itl_p50_s'])} p99 "
                  f"{_f(lp['itl_p99_s'])} max {_f(lp['itl_max_s'])} s ({lp['itl_samples']} gaps)")
    if cost:
        print(f"engine alone: a {cost['chunk_tokens']}-token prefill chunk of it {cost['chunk_median_s']:.3f} s median, "
              f"{cost['chunk_max_s']:.3f} s slowest ({cost['chunks']} chunks); a decode step of "
              f"{cost['decode_step_seqs']} sequences {cost['decode_step_s']:.3f} s")
    check = report.get("check")
    if check:
        print(f"correctness in {check['dtype']}: {check['requests']} requests from {check['clients']} clients at once, "
              f"{check['equal']} of {check['compared']} equal to their lone greedy references")
    soak = report.get("soak")
    if soak:
        print(f"soak ({soak['dtype']}): {soak['requests']} requests of {soak['max_tokens']} new tokens from {soak['clients']} clients in "
              f"{soak['wall_s']:.1f} s, "
              f"{soak['disconnected']} disconnected mid-stream, {soak['errors']} errors; of {soak['compared']} completed "
              f"responses {soak['equal']} equal their lone greedy reference; after: "
              + ", ".join(f"{k} {v:g}" for k, v in soak["after"].items())
              + f" (of {soak['kv_blocks_total']:g} blocks, {soak['state_slots_total']:g} slots); RSS "
              f"{_f(soak['rss_before_bytes'] and soak['rss_before_bytes'] / 1e6, ',.0f')} -> "
              f"{_f(soak['rss_after_bytes'] and soak['rss_after_bytes'] / 1e6, ',.0f')} MB; tokens generated after "
              f"disconnects: {soak['tokens_after_disconnects']:g}")
    for phase in ("check", "soak"):
        for m in (report.get(phase) or {}).get("mismatches", []):
            print(f"  {phase}: prompt {m['prompt']} differs after {m['common_chars']} characters: got {m['got']!r}, "
                  f"want {m['want']!r}")
    for t in report["targets"]:
        goal = ("<= " if t["below"] else ">= ") + format(t["goal"], "g")
        print(f"  {t['target']:72} {t['value']:>9} (goal {goal}): {'pass' if t['pass'] else 'fall short'}"
              + (f"  [{t['note']}]" if t["note"] else ""))


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="medium", help="a preset of scripts/bench.py (default: medium)")
    p.add_argument("--checkpoint", type=Path, default=None, help="benchmark this checkpoint instead of a preset")
    p.add_argument("--quick", action="store_true",
                   help="seconds: the tiny preset, 1 and 4 clients, few requests, a 40-request soak, no llama.cpp")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="default bf16 (--quick: fp32, where a batched forward gives exactly the lone tokens)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--clients", type=int, nargs="+", default=None, help="client levels (default: 1 4 16 64)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level (default: 2 per client, at least 8)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 64)")
    p.add_argument("--system-tokens", type=int, default=None,
                   help=f"the shared system prompt's tokens (default 2048; a multiple of {SERVER_SNAPSHOT_INTERVAL})")
    p.add_argument("--long-tokens", type=int, default=None, help="the prompt that arrives while requests stream (8192)")
    p.add_argument("--streams", type=int, default=15, help="requests streaming while the long prompt arrives")
    p.add_argument("--soak", type=int, default=None, help="soak requests (default 1000; 0: no soak)")
    p.add_argument("--soak-clients", type=int, default=None, help="clients of the soak (default 16)")
    p.add_argument("--soak-max-tokens", type=int, default=None,
                   help="new tokens per request of the correctness phase (default 16)")
    p.add_argument("--rss-tolerance", type=float, default=0.05,
                   help="the soak's RSS growth allowed, a fraction of its level before (at least 64 MB)")
    p.add_argument("--check-dtype", choices=["bf16", "fp32"], default="fp32",
                   help="the dtype of the correctness phase's server and references (default fp32, where a batched "
                        "forward gives exactly the lone tokens)")
    p.add_argument("--no-peer", action="store_true", help="leave llama.cpp's server out")
    p.add_argument("--peer-tool", default=str(PEER_TOOL), help="the optional external llamacpp-peer script")
    p.add_argument("--peer-requests", type=int, default=None,
                   help="llama.cpp requests per level (default: as many as ours; llama-server batches)")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                   help="shared: a shared system prompt + a question each; distinct: nothing shared; chat: "
                        "multi-turn conversations, each turn extending the last (default: all three)")
    p.add_argument("--distinct-tokens", type=int, default=None,
                   help="tokens of a distinct prompt and of a conversation's opening (default 256)")
    p.add_argument("--chat-turns", type=int, default=None, help="requests per conversation (default 4)")
    p.add_argument("--speculative", type=int, default=0, metavar="N",
                   help="our server drafts N tokens a step with the checkpoint's MTP block (default: 0, off); the "
                        "acceptance rate from /metrics goes into the report")
    p.add_argument("--port", type=int, default=None, help="our server's port (default: a free one; llama.cpp: the next)")
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "hybrid-bench")
    p.add_argument("--out", type=Path, default=Path("serve_bench.json"))
    args = p.parse_args(argv)

    if args.quick:
        args.preset, args.no_peer, args.dtype = "tiny", True, args.dtype or "fp32"
        args.clients = args.clients or [1, 4]
        args.max_tokens = args.max_tokens or 16
        args.system_tokens = args.system_tokens or SERVER_SNAPSHOT_INTERVAL
        args.long_tokens = args.long_tokens or 2048
        args.streams = min(args.streams, 3)
        args.soak = 40 if args.soak is None else args.soak
        args.soak_clients = args.soak_clients or 4
        args.distinct_tokens = args.distinct_tokens or 128
        args.chat_turns = args.chat_turns or 2
    args.dtype = args.dtype or "bf16"
    args.distinct_tokens = args.distinct_tokens or 256
    args.chat_turns = args.chat_turns or 4
    args.clients = sorted(set(args.clients or [1, 4, 16, 64]))
    args.max_tokens = args.max_tokens or 64
    args.system_tokens = args.system_tokens or 2048
    args.long_tokens = args.long_tokens or 8192
    args.soak = 1000 if args.soak is None else args.soak
    args.soak_clients = args.soak_clients or 16
    args.soak_max_tokens = min(args.soak_max_tokens or 16, args.max_tokens)
    if args.system_tokens % SERVER_SNAPSHOT_INTERVAL:
        print(f"note: a system prompt of {args.system_tokens} tokens is not a multiple of the server's snapshot "
              f"interval ({SERVER_SNAPSHOT_INTERVAL}): hits resume at the last multiple below", file=sys.stderr)
    torch.set_num_threads(args.threads)

    import hybrid

    directory = args.checkpoint or make_checkpoint(args.preset, args.workdir)
    model, tokenizer = hybrid.load(directory, dtype=args.dtype, progress=False)
    levels = [(c, args.requests or max(8, 2 * c)) for c in args.clients]
    target = 16 if 16 in args.clients else max([c for c in args.clients if c <= 16] or [min(args.clients)])
    # prompt indices: 0 the warm-up, then each level's, the long-prompt streams', the peer's warm-up
    plan, next_index = [], 1
    for c, n in levels:
        plan.append((c, list(range(next_index, next_index + n))))
        next_index += n
    stream_indices = list(range(next_index, next_index + args.streams))
    next_index += args.streams
    prompts = make_prompts(tokenizer, args.system_tokens, next_index + 1, args.long_tokens, args.distinct_tokens)
    chat_plan, first = [], next_index + 1  # conversation openings: after every index above and the peer's warm-up
    for c, _ in levels:
        chat_plan.append((c, list(range(first, first + c))))
        first += c
    plans = {w: ((chat_plan, args.chat_turns) if w == "chat" else (plan, 1)) for w in args.workloads}
    if not prompts.prefix_stable:
        print("note: some prompts do not start with the system prompt's tokens (the tokenizer merges across "
              "the boundary): their hits resume earlier", file=sys.stderr)
    target_indices = dict(plan)[target]
    report = {"model": str(args.checkpoint or args.preset), "dtype": args.dtype, "threads": args.threads,
              "speculative": args.speculative,
              "max_tokens": args.max_tokens, "clients": args.clients, "target_level": target,
              "check_dtype": args.check_dtype, "chat_turns": args.chat_turns, "workloads": {},
              "prompts": {"system_tokens": prompts.system_tokens, "long_tokens": prompts.long_tokens,
                          "prefix_stable": prompts.prefix_stable, "distinct_tokens": args.distinct_tokens,
                          "question_tokens": [len(tokenizer.encode(prompts.questions[i], add_special_tokens=False))
                                              for i in target_indices]}}

    log(f"sequential: {len(target_indices)} requests through hybrid.generate ...")
    report["sequential"] = run_sequential(model, tokenizer, prompts, target_indices, 0, args.max_tokens)
    references = report["sequential"].pop("references")

    def checkpoint(phase: str) -> None:
        """The report so far to --out (a run stopped later keeps its finished phases), marked partial."""
        write_json(args.out, {**report, "partial": f"after {phase}"})

    checkpoint("sequential")

    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    log_dir = args.workdir / "serve-bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"hybrid serve on {url} ...")
    server = ServerProcess("hybrid serve", server_command(args, directory, port, args.dtype), url,
                           log_dir / "hybrid-serve.log")
    name = directory.name
    try:
        report["server_rss_after_start_bytes"] = server.rss()
        for workload, (levels_plan, turns) in plans.items():
            ours = run_levels(server, name, prompts, levels_plan, args.max_tokens, 0, metrics=True, extra=TOKEN_COUNTS,
                              workload=workload, turns=turns)
            for level in ours["levels"].values():  # the shared workload's target level has references
                check = check_responses(level.pop("responses"), references if workload == "shared" else {})
                if check["compared"]:
                    level["equal_to_reference"] = check["equal"]
            report["workloads"][workload] = {"ours": ours}
            checkpoint(f"the {workload} workload")
        log("long prompt while requests stream ...")
        wait_idle(url)
        report["long_prompt"] = run_long_prompt(server, name, prompts, stream_indices, args.max_tokens)
        checkpoint("the long prompt")
        report["server_peak_rss_bytes"] = server.overall_peak()
        if args.speculative:
            spec = read_metrics(url)
            report["speculative"] = {"num_speculative_tokens": args.speculative,
                                     "draft_tokens": spec.get("spec_decode_num_draft_tokens_total"),
                                     "accepted_tokens": spec.get("spec_decode_num_accepted_tokens_total"),
                                     "acceptance_rate": spec.get("spec_decode_acceptance_rate")}
    finally:
        server.stop()
    log("chunk and step times on the engine alone ...")
    report["chunk_and_step"] = measure_chunk_and_step(model, tokenizer, prompts, stream_indices)
    del model
    checkpoint("the chunk and step times")
    if args.soak:
        report["check"], report["soak"] = run_check_and_soak(args, directory, tokenizer, prompts, target,
                                                             target_indices, log_dir)
        checkpoint("the soak")

    if not args.no_peer:
        log("llama.cpp: the GGUF (converted once) ...")
        try:
            gguf = llamacpp_gguf(args.peer_tool, directory, args.dtype)
        except subprocess.CalledProcessError as e:
            gguf = None
            report["peer_note"] = f"the conversion failed: {(e.stderr or b'').decode(errors='replace')[-1500:]}"
        if gguf is None:
            report.setdefault("peer_note", f"left out: {args.peer_tool} or its environment (llamacpp-peer setup) is missing")
        else:
            peer_port = port + 1 if args.port else free_port()
            peer_url = f"http://127.0.0.1:{peer_port}"
            log(f"llama.cpp server on {peer_url} ...")
            try:
                peer = run_peer(args, gguf, peer_url, log_dir / "llamacpp-serve.log", prompts, plans, next_index,
                                stream_indices)
                for workload, levels in peer.pop("workloads").items():
                    report["workloads"][workload]["llama.cpp"] = levels
                report["llama.cpp"] = peer
                for error in peer["errors"]:
                    log(f"llama.cpp: {error}")
                if peer["server"] == "llama-cpp-python":
                    report["peer_note"] = (
                        f"llama-cpp-python (one request at a time; `llamacpp-peer setup-server` builds llama-server): "
                        f"{peer['prompt_tokens_median']} prompt tokens per request; it re-evaluated the whole prompt "
                        f"{peer['full_reevaluations']} times and reused a cached prefix {peer['prefix_hits']} times")
            except Exception as e:  # our figures stand without the peer's
                report["peer_note"] = f"failed: {type(e).__name__}: {str(e)[-1500:]}"
                log(f"llama.cpp failed: {e}")
    report["targets"] = targets(report)
    write_json(args.out, report)
    print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
