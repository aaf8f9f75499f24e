"""The engine's loop for a server whose handlers run on an asyncio event loop (on another thread).

`Engine` is not thread-safe: only the runner's thread touches it. Handlers `submit` checked requests and
`abort` them (a disconnected client); the runner adds them between steps, steps while anything is
unfinished, and hands every `RequestOutput` to the submitting loop's `asyncio.Queue` of that request
(`loop.call_soon_threadsafe`). A finished request is released from the engine at once. A failing step ends
every request it held with the error (the handlers answer 500) and the runner goes on.

Which thread: `hybrid serve` runs the loop (`run`) on the main thread, the one that loaded the model, and
uvicorn on another. Every thread that has run an OpenMP region keeps a pool of OpenMP workers while it
lives, and libgomp cuts its workers' spin-wait to almost nothing once it manages more threads than there
are CPUs: a second thread running torch's ops beside a living main thread that already ran some (the
model's load) turns every parallel region into futex sleeps and wake-ups, which made elementwise ops and whole
decode steps markedly slower on a second thread than on the main one
(docs/perf-log.md#engine-loop-main-thread). `own_thread=True` (tests, embedding) starts a thread of its own
instead.

Logs (logger `hybrid.serving.runner`, INFO): one line per finished request (its id, prompt tokens and how many
the prefix cache served, tokens generated, time to first token from its submission, decode tok/s, finish
reason) and, every `log_interval` seconds while requests run, one line of throughput (prompt and generated
tokens per second, running and waiting requests, KV blocks and state slots used, prefix-cache hit rate), as
vLLM's engine logs its stats.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from hybrid.serving.engine import Engine
from hybrid.serving.metrics import Histogram
from hybrid.serving.request import RequestOutput, Status

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests in flight than the server admits (`max_queue` waiting besides the running ones)."""


@dataclass
class Finished:
    """The last item of a request's queue: its prompt tokens, the ones taken from the prefix cache, and
    the error that ended it, if any."""

    prompt_tokens: int
    cached_tokens: int
    error: str | None = None


class EngineRunner:
    """Runs `engine` on its own thread (see the module docstring).

    Args:
        max_queue: requests that may wait besides the `max_num_seqs` running ones; past it `submit` raises
            `QueueFull` (the server answers 503 with Retry-After).
        own_thread: start a thread that runs `run`; otherwise the caller runs it, on the thread that did
            the model's torch work so far (see the module docstring).
    """

    def __init__(self, engine: Engine, max_queue: int = 256, own_thread: bool = True, log_interval: float = 10.0):
        self.engine, self.max_queue, self.log_interval = engine, max_queue, log_interval
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.generated_tokens = 0
        self.step_seconds = Histogram()  # each engine step's wall time (/metrics)
        self.started = time.monotonic()
        self._timing: dict[str, list] = {}  # request id -> [submitted, first token or None] (monotonic seconds)
        self._window = [time.monotonic(), 0, 0]  # the throughput line's: start, prompt and generated tokens
        self._thread = None
        if own_thread:
            self._thread = threading.Thread(target=self.run, name="hybrid-engine", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------------------------------ handlers' side
    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def submit(self, request_id: str, checked) -> asyncio.Queue:
        """Queue a request (`Engine.check_request`'s result) under `request_id`; returns the queue its
        `RequestOutput`s arrive on, ending with a `Finished`. Call from the event loop's thread.

        Raises:
            QueueFull: `max_num_seqs + max_queue` requests are already in flight.
        """
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if len(self._streams) >= self.engine.scheduler.max_num_seqs + self.max_queue:
                raise QueueFull(f"{len(self._streams)} requests in flight, the server's limit")
            self._streams[request_id] = (loop, stream)
            self._timing[request_id] = [time.monotonic(), None]
        self._commands.put(("add", request_id, checked))
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel a request (its blocks and slot are freed at the runner's next turn)."""
        self._commands.put(("abort", request_id, None))

    def close(self) -> None:
        """Stop the loop (from any thread; `run` returns after the step it is in)."""
        self._stop.set()
        self._commands.put(("wake", None, None))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Add and abort requests, step the engine and deliver its outputs until `close` is called. Run on
        one thread only (the runner's own with `own_thread`)."""
        engine = self.engine
        while not self._stop.is_set():
            try:
                command = self._commands.get(timeout=None if not engine.has_unfinished() else 0)
            except queue.Empty:
                command = None
            while command is not None:
                self._apply(*command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._stop.is_set() or not engine.has_unfinished():
                continue
            try:
                start = time.perf_counter()
                outputs = engine.step()
                self.step_seconds.observe(time.perf_counter() - start)
            except Exception as e:  # a failing forward must not take the server down: end what it held
                log.exception("engine step failed")
                for request_id in list(engine.requests):
                    engine.abort(request_id)
                    self._finish(request_id, f"{type(e).__name__}: {e}")
                engine.step()  # drops the abort notices
                continue
            stats, now = engine.last_step, time.monotonic()
            self._window[1] += stats.num_tokens - stats.num_decode_tokens
            batches: dict[asyncio.AbstractEventLoop, list] = {}  # one wake-up of each loop per step
            for out in outputs:
                self.generated_tokens += len(out.new_token_ids)
                self._window[2] += len(out.new_token_ids)
                timing = self._timing.get(out.request_id)
                if timing is not None and timing[1] is None and out.new_token_ids:
                    timing[1] = now
                self._deliver(out.request_id, out, batches)
                if out.finished:
                    self._finish(out.request_id, None, batches=batches)
            for loop, items in batches.items():
                try:
                    loop.call_soon_threadsafe(_put_all, items)
                except RuntimeError:  # the loop is closed (server shutting down)
                    pass
            if now - self._window[0] >= self.log_interval:
                self._log_throughput(now)

    def _apply(self, kind: str, request_id: str | None, checked) -> None:
        if kind == "add":
            try:
                self.engine.add_checked(checked, request_id)
            except Exception as e:
                self._finish(request_id, f"{type(e).__name__}: {e}", known=False)
        elif kind == "abort" and request_id in self.engine.requests:
            self.engine.abort(request_id)

    def _deliver(self, request_id: str, item, batches: dict | None = None) -> None:
        """Hand `item` to the request's queue: now, or (with `batches`) with the step's other items for its
        loop, which the caller then wakes once (each wake-up of the event loop's thread is CPU taken from the
        engine's OpenMP threads: on 2 cores, one per token of 16 streams slowed the decode steps)."""
        with self._lock:
            target = self._streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        if batches is not None:
            batches.setdefault(loop, []).append((stream, item))
            return
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the loop is closed (server shutting down)
            pass

    def _finish(self, request_id: str, error: str | None, known: bool = True, batches: dict | None = None) -> None:
        request = self.engine.requests.get(request_id) if known else None
        done = Finished(len(request.prompt_ids) if request else 0, request.num_cached_tokens if request else 0, error)
        reason = f"error ({error})" if error else (request.finish_reason if request else None) or "abort"
        self._log_request(request_id, done, len(request.output_ids) if request else 0, reason)
        if request is not None:
            if request.status is not Status.FINISHED:
                self.engine.abort(request_id)
            self.engine.release(request_id)
        self._deliver(request_id, done, batches)
        with self._lock:
            self._streams.pop(request_id, None)

    def _log_request(self, request_id: str, done: Finished, generated: int, reason: str) -> None:
        """The finished request's line (see the module docstring)."""
        submitted, first = self._timing.pop(request_id, (None, None))
        parts = [f"request {request_id}: {done.prompt_tokens} prompt tokens ({done.cached_tokens} cached), "
                 f"{generated} generated"]
        if first is not None:
            parts.append(f"first token {first - submitted:.3f} s")
            elapsed = time.monotonic() - first
            if generated > 1 and elapsed > 0:
                parts.append(f"{(generated - 1) / elapsed:.1f} tok/s")
        log.info(", ".join(parts) + f", finish {reason}")

    def _log_throughput(self, now: float) -> None:
        """The periodic line (see the module docstring); nothing for a window in which no token was computed."""
        start, prompt, generated = self._window
        self._window = [now, 0, 0]
        if not prompt and not generated:
            return
        e, seconds = self.engine, max(now - start, 1e-9)
        prefix = e.prefix
        hit_rate = f"{prefix.hits / prefix.queries:.0%}" if prefix is not None and prefix.queries else "-"
        log.info(f"throughput: prompt {prompt / seconds:.1f} tok/s, generation {generated / seconds:.1f} tok/s; "
                 f"{len(e.scheduler.running)} running, {len(e.scheduler.waiting)} waiting; KV blocks "
                 f"{e.blocks.num_blocks - e.blocks.num_free}/{e.blocks.num_blocks} used, state slots "
                 f"{e.slots.num_slots - e.slots.num_free}/{e.slots.num_slots}; prefix cache hit rate {hit_rate}")


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for stream, item in items:
        stream.put_nowait(item)


__all__ = ["EngineRunner", "Finished", "QueueFull", "RequestOutput"]
