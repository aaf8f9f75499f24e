"""`hybrid serve`: load a checkpoint, size the engine's pools, run the OpenAI-compatible API with uvicorn.

Sizing: with `--memory SIZE` the budget left after the weights and a reserve (`hybrid.serving.capacity`)
holds `max_num_seqs` state slots (fewer when one request of the longest length would not fit in the KV
left beside them) and KV blocks for the rest; without it, `DEFAULT_NUM_BLOCKS` blocks. The longest request
(`--max-model-len`, default the config's `max_position_embeddings`) is capped by what the KV pool holds.
The capacity is printed at start. `hybrid chat` builds its engine the same way (`build_engine`).
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from hybrid.serving.capacity import DEFAULT_BLOCK_SIZE, DEFAULT_RESERVE
from hybrid.serving.engine import DEFAULT_NUM_BLOCKS, Engine


@dataclass
class Sizes:
    num_blocks: int
    max_num_seqs: int
    max_model_len: int

    def describe(self, engine: Engine) -> str:
        state = engine.slots.slot_nbytes()
        tokens = self.num_blocks * engine.blocks.block_size
        return (f"capacity: {self.max_num_seqs} state slots of {state / 2**20:.1f} MiB, {self.num_blocks} KV blocks of "
                f"{engine.blocks.block_size} tokens ({tokens:,} tokens, {engine.blocks.nbytes() / 2**20:.1f} MiB); "
                f"max_model_len {self.max_model_len:,}; steps of {engine.scheduler.max_num_batched_tokens} tokens"
                + ("" if engine.prefix is None else f", prefix snapshots every {engine.prefix.snapshot_interval} tokens")
                + ("" if engine.drafter is None else f", {engine.drafter.num_speculative_tokens} MTP drafts a step"))


def size_pools(model, memory: int | None, max_num_seqs: int, max_model_len: int | None,
               block_size: int = DEFAULT_BLOCK_SIZE, mtp: bool = False) -> Sizes:
    """The pools' sizes for `model` within `memory` bytes (or the defaults); `mtp`: the KV blocks also hold the
    MTP block's keys and values (speculative decoding).

    Raises:
        ValueError: the budget holds no state slot and KV block after the weights, or max_model_len
            exceeds what the pool holds.
    """
    from hybrid.accounting import describe

    config = model.config
    wanted = max_model_len or config.max_position_embeddings
    if memory is None:
        num_blocks = DEFAULT_NUM_BLOCKS
    else:
        report = describe(config, model.dtype, model.quantization)
        state, kv_token = report["mamba_state_bytes_per_sequence"], report["kv_cache_bytes_per_token"]
        if mtp:  # the MTP block's attention layers are as wide as the main stack's
            attention = config.hybrid_override_pattern.count("*")
            kv_token += kv_token * config.mtp_pattern.count("*") // max(attention, 1)
        block = kv_token * block_size
        free = memory - report["weight_bytes"] - DEFAULT_RESERVE
        if free < state + block:
            raise ValueError(f"--memory {memory:,} bytes leaves {max(free, 0):,} after the weights "
                             f"({report['weight_bytes']:,}) and the reserve ({DEFAULT_RESERVE:,}): not enough for one "
                             f"state slot ({state:,}) and one KV block ({block:,})")
        kv_one = -(-wanted // block_size) * block  # the KV of one request of the longest length
        if state:  # as vLLM: max_num_seqs slots, fewer when one request of max_model_len would not fit beside them
            max_num_seqs = max(1, min(max_num_seqs, (free - min(kv_one, free - state)) // state))
        num_blocks = max(1, (free - max_num_seqs * state) // block) if block else 1
    pool_tokens = num_blocks * block_size
    if max_model_len is not None and max_model_len > pool_tokens:
        raise ValueError(f"--max-model-len {max_model_len:,} is more than the KV pool holds ({pool_tokens:,} tokens)")
    return Sizes(num_blocks, max_num_seqs, max(2, min(wanted, pool_tokens)))


def build_engine(model, args, max_num_seqs: int) -> Engine:
    """The engine `hybrid serve` and `hybrid chat` run: pools sized by `args.memory` / `args.max_model_len`,
    steps of `args.max_num_batched_tokens`, `args.speculative` MTP drafts, prefix caching unless `--no-prefix-cache` with Mamba snapshots
    every `args.prefix_snapshot_interval` prompt tokens, the prefix cache loaded from `args.prefix_cache_file`
    when it exists and matches the model (otherwise a note, and `args.prefix_cache_file` is set to None so
    that the file is left as it was). Prints the capacity.

    Raises:
        ValueError: see `size_pools`.
    """
    sizes = size_pools(model, args.memory, max_num_seqs, args.max_model_len, mtp=bool(args.speculative))
    engine = Engine(model, num_blocks=sizes.num_blocks, max_num_seqs=sizes.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=sizes.max_model_len,
                    prefix_caching=args.prefix_cache, snapshot_interval=args.prefix_snapshot_interval,
                    num_speculative_tokens=args.speculative)
    if args.prefix_cache_file and Path(args.prefix_cache_file).exists():
        try:
            n = engine.load_prefix_cache(args.prefix_cache_file)
            print(f"prefix cache: {n} snapshots loaded from {args.prefix_cache_file}", file=sys.stderr)
        except ValueError as e:
            print(f"note: not using the prefix cache file (left unchanged): {e}", file=sys.stderr)
            args.prefix_cache_file = None
    print(sizes.describe(engine), file=sys.stderr)
    return engine


def save_prefix_cache(engine: Engine, args) -> None:
    """Write the engine's prefix cache to `args.prefix_cache_file`, if there is one to write."""
    if args.prefix_cache_file and engine.prefix is not None:
        engine.save_prefix_cache(args.prefix_cache_file)
        print(f"prefix cache saved to {args.prefix_cache_file}", file=sys.stderr)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) for uvicorn to serve on (SO_REUSEADDR, as uvicorn sets it); an
    IPv6 host (e.g. "::") gets an IPv6 socket.

    Raises:
        OSError: the host does not resolve, or the address is taken or not this machine's.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # uvicorn's default backlog
    except OSError:
        sock.close()
        raise
    return sock


def serve(args) -> int:
    """Run the server until interrupted (the `hybrid serve` command): the engine's loop on this (the main)
    thread, which loaded the model, and uvicorn on another (why: `hybrid.serving.runner`). SIGINT or SIGTERM
    shuts uvicorn down gracefully (a second one: at once); the engine steps until it has.

    The address is bound before the model loads (as vLLM does): a taken port is an error at once, and
    "serving ... on URL" is printed only once the address is held.

    Returns:
        0, or 1 when the address cannot be bound or uvicorn did not start.
    """
    import logging
    import signal
    import threading

    import torch
    import uvicorn

    from hybrid.loading import load
    from hybrid.serving.api import Server, create_app
    from hybrid.serving.runner import EngineRunner

    try:  # before the model loads: a taken port fails at once (and the address is printed only once held)
        listener = listen(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    _log_to_stderr(logging.getLogger("hybrid.serving"))  # a line per request and the throughput (runner.py)
    model, tokenizer = load(args.model, dtype=args.dtype, device=args.device)
    if args.chat_template is not None:
        tokenizer.use_chat_template(args.chat_template)
    engine = build_engine(model, args, args.max_num_seqs)
    runner = EngineRunner(engine, max_queue=args.max_queue, own_thread=False)
    name = args.served_model_name or Path(str(args.model)).name
    server = uvicorn.Server(uvicorn.Config(create_app(Server(runner, tokenizer, name, args.api_key)),
                                           host=args.host, port=args.port, log_level="warning"))

    def http() -> None:
        try:
            server.run(sockets=[listener])
        finally:
            runner.close()

    def on_signal(signum, frame) -> None:
        server.force_exit = server.should_exit
        server.should_exit = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    web = threading.Thread(target=http, name="hybrid-http", daemon=True)
    print(f"serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    web.start()
    try:
        runner.run()
    finally:
        server.should_exit = True
        web.join(timeout=30)
        for s, handler in previous.items():
            signal.signal(s, handler)
        save_prefix_cache(engine, args)
    return 0 if server.started else 1


def _log_to_stderr(logger) -> None:
    """`logger`'s INFO lines on stderr, each with its time (once per process)."""
    import logging

    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
