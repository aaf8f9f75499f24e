"""The `hybrid` command: `generate` text from a checkpoint, `serve` it over the OpenAI API, `chat` with it in
the terminal, `info` about a checkpoint or config, `quantize`.

    hybrid generate [MODEL] --prompt TEXT [--chat] [--max-new-tokens N] [--temperature T] [--top-k K]
                    [--top-p P] [--seed S] [--dtype D] [--act-quant] [--speculative N]
                    [--prefix-cache FILE [--prefix-snapshot-interval N]] [--json]
    torchrun --nproc-per-node N -m hybrid generate MODEL --prompt TEXT ...   (tensor parallel over N ranks)
    hybrid serve [MODEL] [--host H] [--port P] [--max-num-seqs N] [--max-model-len L] [--memory SIZE]
                 [--max-queue Q] [--no-prefix-cache] [--prefix-cache-file FILE] [--api-key KEY]
    hybrid chat [MODEL] [--system TEXT] [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
                [--no-thinking | --hide-thinking] [--max-model-len L] [--memory SIZE] [--prefix-cache-file FILE]
    hybrid info [MODEL] [--format fp8|nvfp4|mxfp4] [--tensor-parallel N] [--json]
    hybrid quantize SRC DST --format fp8|nvfp4|mxfp4 [--exclude PATTERN ...] [--calibration-samples N]
    (--format: also any format registered in `moe.quant.formats`)

MODEL is a checkpoint directory or a hub repo id; without MODEL, `generate`, `serve`, `chat` and
`info` use the default checkpoint in `checkpoints/`. `info` also accepts a bare config.json (no weights needed).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import warnings
from pathlib import Path

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "hybrid-mini"


def _generate(args) -> int:
    """`hybrid generate`, in one process or, under torchrun, as one rank of a tensor-parallel run
    (`hybrid.parallel.launch`): every rank loads its shard and runs the same steps; rank 0 reads the prompt
    and alone prints (the other ranks' stdout and stderr are discarded; an error on any rank reaches rank 0)."""
    from hybrid.devices import resolve_device
    from hybrid.parallel import launch

    if not launch.launched():
        args.device = resolve_device(args.device)
        return _generate_on(args, 0, 1)
    try:  # each rank its own GPU (cuda:{LOCAL_RANK}); a bad --device is printed by rank 0 alone
        args.device = resolve_device(args.device, launch.local_rank())
    except ValueError:
        if launch.rank_from_environment() != 0:
            return 2
        raise
    rank, world = launch.start(args.threads, args.device)
    try:
        if rank == 0:
            status = _generate_on(args, rank, world)
        else:
            with contextlib.redirect_stdout(_Discard()), contextlib.redirect_stderr(_Discard()):
                try:
                    status = _generate_on(args, rank, world)
                except ValueError:  # ConfigError and CheckpointError too: the same error rank 0 prints
                    status = 2
        launch.finish()
        return status
    finally:
        launch.stop()


class _Discard(io.TextIOBase):
    """A text stream that drops what is written (the stdout and stderr of ranks other than 0)."""

    def write(self, text: str) -> int:
        return len(text)


def _generate_on(args, rank: int, world: int) -> int:
    from hybrid.generate import generate
    from hybrid.loading import load
    from hybrid.parallel import launch

    if not _default_model(args) or not _template_file_ok(args):
        return 2
    if args.threads is not None and world == 1:
        import torch

        torch.set_num_threads(args.threads)
    from hybrid.sampling import SAMPLING_EPS

    prompt, problem = _prompt_text(args.prompt) if rank == 0 else ("", None)
    if rank == 0 and not problem and not prompt:
        problem = "the prompt is empty"
    if world > 1:
        problem = launch.agree(problem)
        prompt = launch.broadcast_text(prompt) if problem is None else ""
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.enable_thinking is not None and not args.chat:
        print("note: --enable-thinking only matters with --chat", file=sys.stderr)
    if args.speculative and (args.repetition_penalty != 1 or args.frequency_penalty or args.presence_penalty):
        print("error: --speculative cannot be combined with a penalty (--repetition-penalty, "
              "--frequency-penalty, --presence-penalty)", file=sys.stderr)
        return 2
    # --prefix-cache FILE: under torchrun each rank keeps its own states in its own file (`launch.rank_file`)
    prefix_path = launch.rank_file(args.prefix_cache, rank, world) if args.prefix_cache and world > 1 \
        else args.prefix_cache
    if prefix_path:  # before any work: the file must be writable (it is rewritten at the end)
        from hybrid.atomic import check_writable

        problem = None
        try:
            check_writable(args.prefix_cache)  # the name given (not a directory), then the rank's own file
            check_writable(prefix_path)
        except OSError as e:
            problem = f"--prefix-cache: {e}"
        if world > 1:
            problem = launch.agree(problem)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    with warnings.catch_warnings(record=True) as notes:  # load-time notes (e.g. tokens past the vocabulary)
        warnings.simplefilter("always")
        if world == 1:
            model, tokenizer = load(args.model, dtype=args.dtype, act_quant=args.act_quant, mmap=args.mmap,
                                    device=args.device)
        else:  # every rank learns of an error on any rank, instead of waiting for it in a collective
            error = None
            try:
                model, tokenizer = load(args.model, dtype=args.dtype, act_quant=args.act_quant, mmap=args.mmap,
                                        tensor_parallel=world, progress=rank == 0, device=args.device)
            except (ValueError, OSError) as e:
                error = str(e)
            error = launch.agree(error)
            if error:
                print(f"error: {error}", file=sys.stderr)
                return 2
    for n in notes:
        print(f"note: {n.message}", file=sys.stderr)
    if args.chat_template is not None:
        tokenizer.use_chat_template(args.chat_template)
    # what the options leave out: the checkpoint's sampling defaults (generation_config.json), else greedy
    defaults = tokenizer.sampling_defaults
    temperature = args.temperature if args.temperature is not None else defaults.get("temperature", 0.0)
    top_k = args.top_k if args.top_k is not None else defaults.get("top_k")
    top_p = args.top_p if args.top_p is not None else defaults.get("top_p")
    greedy = temperature < SAMPLING_EPS
    if world > 1 and not greedy and args.seed is None:  # every rank draws from the same generator
        args.seed = launch.shared_seed()
    if greedy and (args.top_k is not None or args.top_p is not None or args.seed is not None):
        print(f"note: --top-k, --top-p and --seed only matter with --temperature > 0 (at least {SAMPLING_EPS:g}); "
              "decoding greedily", file=sys.stderr)
    if args.speculative and model.mtp is None:
        print(f"error: --speculative needs an MTP block, and {args.model} has none (num_nextn_predict_layers: 0)",
              file=sys.stderr)
        return 2
    prefix_cache, save_prefix_cache = None, True
    if prefix_path:
        from hybrid.prefix_cache import PrefixCache

        prefix_cache = PrefixCache(model, args.prefix_snapshot_interval, num_speculative_tokens=args.speculative)
        absent = "its file does not exist yet"  # the same words on every rank: `agree` finds them equal
        present = Path(prefix_path).exists()
        problem = None
        if present:
            try:
                prefix_cache.load(prefix_path)
            except ValueError as e:  # another model's or block size's file: use it neither way, keep it intact
                problem = str(e)
        if world > 1:  # the ranks resume from the same prefixes, or none does
            problem = launch.agree(problem)
            missing = launch.agree(None if present else absent)
            if problem is None and missing not in (None, absent):  # some ranks' files only: start afresh, rewrite
                print(f"note: not using the prefix cache (every rank's file is rewritten): {missing}", file=sys.stderr)
                prefix_cache = PrefixCache(model, args.prefix_snapshot_interval, num_speculative_tokens=args.speculative)
        if problem:
            print(f"note: not using the prefix cache (left unchanged): {problem}", file=sys.stderr)
            prefix_cache = PrefixCache(model, args.prefix_snapshot_interval, num_speculative_tokens=args.speculative)
            save_prefix_cache = False

    def stream(row: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    chat_kwargs = {} if args.enable_thinking is None else {"enable_thinking": args.enable_thinking}
    (c,) = generate(model, tokenizer, prompt, max_new_tokens=args.max_new_tokens, temperature=temperature,
                    top_k=top_k, top_p=top_p, seed=args.seed, chat=args.chat,
                    on_text=None if args.json else stream, speculative=args.speculative,
                    prefix_cache=prefix_cache, repetition_penalty=args.repetition_penalty,
                    frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty, **chat_kwargs)
    if prefix_cache is not None and save_prefix_cache:
        prefix_cache.save(prefix_path)
    summary = {
        "prompt_tokens": c.prompt_tokens, "generated_tokens": len(c.token_ids), "finish_reason": c.finish_reason,
        "prefill_seconds": round(c.prefill_seconds, 4), "prefill_tokens_per_s": round(c.prefill_tokens_per_s, 2),
        "decode_seconds": round(c.decode_seconds, 4),
        "decode_tokens_per_s": None if c.decode_tokens_per_s is None else round(c.decode_tokens_per_s, 2),
    }
    if c.acceptance_rate is not None:
        summary["draft_acceptance_rate"] = round(c.acceptance_rate, 4)
    if prefix_cache is not None:
        summary["prefix_cache_reused_tokens"] = prefix_cache.reused_tokens
    if args.json:
        print(json.dumps({"text": c.text, "token_ids": c.token_ids, **summary}))
    else:
        sys.stdout.write("\n")
        decode = "-" if c.decode_tokens_per_s is None else f"{summary['decode_tokens_per_s']} tok/s"
        print(
            f"[{c.prompt_tokens} prompt tokens: prefill {summary['prefill_tokens_per_s']} tok/s | "
            f"{len(c.token_ids)} generated: decode {decode} | finish: {c.finish_reason}"
            + (f" | drafts accepted: {c.acceptance_rate:.2f}" if c.acceptance_rate is not None else "")
            + (f" | prefix cache: {prefix_cache.reused_tokens} tokens reused" if prefix_cache is not None else "")
            + "]",
            file=sys.stderr,
        )
    return 0


def _prompt_text(prompt: str) -> tuple[str, str | None]:
    """The --prompt text (stdin for '-', one final newline dropped), and what is wrong with it, if anything:
    text that is not UTF-8 (stdin bytes, or argv bytes Python kept as surrogates)."""
    if prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            return data.decode("utf-8").removesuffix("\n"), None
        except UnicodeDecodeError as e:
            return "", f"stdin is not valid UTF-8: byte 0x{data[e.start]:02x} at offset {e.start} ({e.reason})"
    from hybrid.generate import utf8_problem

    problem = utf8_problem(prompt)
    if problem:
        return "", f"--prompt is not valid UTF-8: {problem}"
    return prompt, None


def _template_file_ok(args) -> bool:
    """--chat-template FILE, if given, is readable UTF-8 text (else a message): checked before the weights load."""
    if args.chat_template is None:
        return True
    try:
        Path(args.chat_template).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: --chat-template {args.chat_template}: cannot read it as UTF-8 text ({e})", file=sys.stderr)
        return False
    return True


def _engine_args_ok(args) -> bool:
    """`hybrid serve` / `hybrid chat`: the model resolved, --chat-template readable and --prefix-cache-file
    writable (else a message)."""
    if not _default_model(args) or not _template_file_ok(args):
        return False
    if args.prefix_cache_file:
        from hybrid.atomic import check_writable

        try:
            check_writable(args.prefix_cache_file)
        except OSError as e:
            print(f"error: --prefix-cache-file: {e}", file=sys.stderr)
            return False
    return True


def _serve(args) -> int:
    if not _engine_args_ok(args):
        return 2
    from hybrid.devices import resolve_device
    from hybrid.serving.serve import serve

    args.device = resolve_device(args.device)
    return serve(args)


def _chat(args) -> int:
    if not _engine_args_ok(args):
        return 2
    from hybrid.devices import resolve_device
    from hybrid.serving.chat import chat

    args.device = resolve_device(args.device)
    return chat(args)


def _info(args) -> int:
    from hybrid.accounting import describe
    from hybrid.config import HybridConfig
    from hybrid.loading import parse_dtype

    if not _default_model(args):
        return 2

    path = Path(args.model).expanduser()
    not_configs = ("model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "hf_quant_config.json")
    if path.is_file() and (path.suffix != ".json" or path.name in not_configs):
        what = "a safetensors weights file" if path.suffix == ".safetensors" else f"not a config ({path.name})"
        print(f"error: {path} is {what}; `hybrid info` takes a checkpoint directory or a config.json",
              file=sys.stderr)
        return 2
    if path.is_file():
        config_path = path
    elif path.is_dir():
        config_path = path / "config.json"
    else:
        from hybrid.checkpoint_files import resolve_checkpoint

        config_path = resolve_checkpoint(args.model) / "config.json"
    config = HybridConfig.from_file(config_path)
    quant = None
    if args.format is not None:
        from hybrid.quantize import plan

        quant = plan(config, args.format)
    else:
        from hybrid.quantization import read_quant_config

        quant = read_quant_config(config_path.parent, config)
    dtype = parse_dtype(args.dtype, config)
    report = describe(config, dtype, quant)
    capacity = None
    if args.tensor_parallel is not None:
        from hybrid.accounting import describe_ranks

        report["tensor_parallel"] = describe_ranks(config, dtype, args.tensor_parallel, quant)
    if args.memory is not None:
        from hybrid.serving.capacity import plan as plan_capacity

        ranks = report["tensor_parallel"]["ranks"] if args.tensor_parallel is not None else None
        capacity = plan_capacity(config, dtype, args.memory, quant, max_model_len=args.max_model_len,
                                 max_num_seqs=args.max_num_seqs, block_size=args.block_size, ranks=ranks)
        report["capacity"] = capacity.to_dict()
    if args.device is not None:
        from hybrid.devices import describe as backends, resolve_device, switches

        device = resolve_device(args.device)
        report["backends"] = {"device": str(device), "operations": backends(device), "switches": switches(device)}
    fits = capacity is None or capacity.fits  # a budget that cannot hold the model: status 1, as a failed check
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if fits else 1
    print(f"pattern        {report['pattern']}  ({len(report['pattern'])} layers: "
          + ", ".join(f"{n} {k}" for k, n in report["layers"].items() if n) + ")")
    print(f"parameters     {report['parameters']:,} in all (embedding {report['embedding_parameters']:,}); "
          f"{report['active_parameters_per_token']:,} active per token besides the embedding")
    print("weight bytes   " + ", ".join(f"{k}: {v:,}" for k, v in report["bytes_by_dtype"].items())
          + f"  (total {report['weight_bytes'] / 2**30:.2f} GiB, {report['storage']})")
    if report["quantization"]:
        q = report["quantization"]
        print("by format      " + ", ".join(f"{k}: {v:,}" for k, v in report["bytes_by_format"].items())
              + f"  ({q['method']}, {q['source']}" + (f", KV cache {q['kv_cache']}" if q["kv_cache"] else "") + ")")
    print(f"read per token {report['active_weight_bytes_per_token']:,} weight bytes (a decode step at batch 1)")
    print(f"KV cache       {report['kv_cache_bytes_per_token']:,} bytes per token")
    print(f"Mamba state    {report['mamba_state_bytes_per_sequence']:,} bytes per sequence "
          f"({report['mamba_state_bytes_per_sequence'] / 2**20:.1f} MiB, constant in length)")
    if report["mtp"]:
        print(f"MTP            layers {report['mtp']['layers']!r}, {report['mtp']['parameters']:,} parameters")
    if capacity is not None:
        _print_capacity(capacity)
    if args.tensor_parallel is not None:
        _print_ranks(report["tensor_parallel"])
    if "backends" in report:
        on = report["backends"]
        print(f"{'on ' + on['device']:<15}" + f"\n{'':<15}".join(
            [f"{op}: {how}" for op, how in on["operations"].items()] + on["switches"]))
    return 0 if fits else 1


def _print_ranks(tp: dict) -> None:
    """One line per group of ranks that hold the same sizes, then the collectives per token."""
    groups: dict[tuple, list[int]] = {}
    for r in tp["ranks"]:
        groups.setdefault(tuple(v for k, v in r.items() if k != "rank"), []).append(r["rank"])
    keys = [k for k in tp["ranks"][0] if k != "rank"]
    for i, (values, ranks) in enumerate(groups.items()):
        r = dict(zip(keys, values))
        who = f"rank {ranks[0]}" if len(ranks) == 1 else \
            (f"ranks {ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else f"ranks {ranks}")
        extra = f", {r['packed_modules_with_extra_rows']} packed modules with whole blocks beyond their rows" \
            if r["packed_modules_with_extra_rows"] else ""
        print(f"{'per rank' if i == 0 else '':<15}{who} of {tp['tensor_parallel']}: weights "
              f"{r['weight_bytes'] / 2**30:.2f} GiB ({r['weight_bytes']:,} bytes), KV cache "
              f"{r['kv_cache_bytes_per_token']:,} bytes per token, Mamba state "
              f"{r['mamba_state_bytes_per_sequence'] / 2**20:.1f} MiB per sequence; {r['experts_per_moe_layer']} "
              f"experts per MoE layer, {r['vocab_rows']:,} vocabulary rows{extra}")
    c = tp["collectives_per_token"]
    print(f"collectives    per decoded token and rank: {c['calls']['all_reduce']} all-reduces "
          f"({c['payload']['all_reduce']:,} bytes in all), {c['calls']['all_gather']} all-gather "
          f"({c['payload']['all_gather']:,} bytes of logits); a ring sends {tp['ring_bytes_sent_per_token']:,} "
          "bytes from each rank")


def _print_capacity(c) -> None:
    gib = 2**30
    rank = f" per rank of {c.tensor_parallel}" if c.tensor_parallel > 1 else ""
    print(f"memory         {c.budget_bytes / gib:.2f} GiB budget{rank}: weights {c.weight_bytes / gib:.2f} GiB, reserve "
          f"{c.reserve_bytes / gib:.2f} GiB (activations, runtime), {max(c.free_bytes, 0) / gib:.2f} GiB for the pools")
    if not c.fits:
        need = c.weight_bytes + c.reserve_bytes + c.bytes_per_full_sequence
        print(f"               does not fit: the weights, the reserve and one sequence of {c.max_model_len:,} tokens "
              f"need {need / gib:.2f} GiB (try a packed --format, a smaller --max-model-len, more --memory or "
              "more --tensor-parallel ranks)")
        return
    same = "" if c.state_equals_kv_tokens == float("inf") else \
        f"; one state weighs as much as {c.state_equals_kv_tokens:,.0f} tokens of KV"
    print(f"per sequence   a state slot of {c.state_bytes_per_sequence / 2**20:.1f} MiB and KV blocks of {c.block_size} "
          f"tokens ({c.kv_bytes_per_token * c.block_size:,} bytes each){same}")
    print("concurrency    " + ", ".join(f"{n:,} at {length:,} tokens ({c.bound_at(length)})"
                                        for length, n in c.concurrency.items()))


def _quantize(args) -> int:
    import torch

    from safetensors import SafetensorError

    from hybrid.calibration import calibration_batches, read_calibration_file
    from hybrid.checkpoint_files import resolve_checkpoint
    from hybrid.checkpoint_writer import check_destination
    from hybrid.devices import resolve_device
    from hybrid.quantize import has_static_inputs, quantize_checkpoint
    from hybrid.tokenizer import Tokenizer

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    src, dst = resolve_checkpoint(args.src), Path(args.dst)
    # before any work: the calibration text, where it goes, and that it can be created
    texts = [read_calibration_file(args.calibration_file)] if args.calibration_file else None
    check_destination(dst, src, args.overwrite)
    batches, calibrated = None, has_static_inputs(args.format)
    if not calibrated and args.calibration_file:
        print(f"note: --calibration-file is not used: {args.format} has no static input scales to calibrate",
              file=sys.stderr)
    if calibrated and args.calibration_samples:
        batches = calibration_batches(Tokenizer.from_dir(src), args.calibration_samples, args.calibration_length, texts)
    try:
        report = quantize_checkpoint(src, dst, args.format, exclude=args.exclude, calibration=batches,
                                     dtype=args.dtype, max_shard_bytes=args.max_shard_bytes,
                                     overwrite=args.overwrite, progress=True, device=device)
    except (OSError, SafetensorError) as e:  # a full disk, a lost mount: nothing was changed
        print(f"error: writing {dst} failed ({e}); {dst} was left as it was", file=sys.stderr)
        return 1
    calibration = (f"{len(batches or [])} calibration samples" if calibrated
                   else f"no calibration: {args.format} has no static input scales")
    print(f"wrote {dst} ({args.format}, {len(report.shards)} shard(s), {report.weight_bytes / 2**30:.2f} GiB of "
          f"weights, {calibration}); written: {', '.join(report.written)}; copied from "
          f"the source: {', '.join(report.copied) or 'nothing'}", file=sys.stderr)
    return 0


def _build_kernels(args) -> int:
    """Build every C++ kernel for this CPU, torch and source (`hybrid.ops.cpu.build_kernels`) and say which
    are ready: status 1 when one that applies here could not be built (a `note:` said why)."""
    from hybrid.ops.cpu import build_kernels
    from moe.quant.kernels.build import cpu_flags

    if os.environ.get("HYBRID_CPU_KERNELS", "1") == "0":
        print("note: HYBRID_CPU_KERNELS=0: the CPU kernels are off (the PyTorch paths run)", file=sys.stderr)
        return 0
    failed = False
    for name, ext in build_kernels().items():
        if name == "AMX" and (ext is None and ("amx_bf16" not in cpu_flags().split()
                                               or os.environ.get("HYBRID_AMX_KERNELS", "1") == "0")):
            state = "not used on this CPU (no AMX_BF16, or HYBRID_AMX_KERNELS=0)"
        else:
            state = "ready" if ext is not None else "unavailable: the PyTorch path runs"
            failed |= ext is None
        print(f"{name:<17} {state}")
    return 1 if failed else 0


def _default_model(args) -> bool:
    """Fill `args.model` with the shipped checkpoint when none was given; False (after an error) if it is missing."""
    if args.model is None:
        if not (DEFAULT_CHECKPOINT / "config.json").exists():
            print(f"error: no MODEL given and the default checkpoint {DEFAULT_CHECKPOINT} is missing", file=sys.stderr)
            return False
        args.model = str(DEFAULT_CHECKPOINT)
    return True


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _engine_options(p: argparse.ArgumentParser) -> None:
    """The serving engine's step budget, snapshot spacing and drafts (`hybrid serve`, `hybrid chat`); the defaults
    are hybrid.serving.engine's DEFAULT_MAX_NUM_BATCHED_TOKENS and hybrid.serving.prefix's
    DEFAULT_SNAPSHOT_INTERVAL (not imported here: parsing stays free of torch)."""
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=512, metavar="N",
                   help="tokens of one engine step, decode tokens and prefill chunks together: a long prompt is "
                        "prefilled N tokens a step while the running requests decode (vLLM's name; default: "
                        "%(default)s)")
    p.add_argument("--prefix-snapshot-interval", type=_snapshot_interval, default=512, metavar="N",
                   help="prompt tokens between the prefix cache's Mamba snapshots (a hit resumes at the last one "
                        "inside the shared prefix, or at an earlier prompt's end; each weighs one state slot; a "
                        "multiple of 16; default: %(default)s)")
    p.add_argument("--speculative", type=_non_negative_int, default=0, metavar="N",
                   help="draft up to N tokens per request and step with the checkpoint's MTP block and verify them "
                        "in the next step (greedy output unchanged, sampled output distributed alike; requests with "
                        "penalties draft none); 0 (the default): off")


def _device_option(p: argparse.ArgumentParser, more: str = "") -> None:
    """`--device` (resolved by `hybrid.devices.resolve_device` when the command runs: parsing stays free of torch)."""
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="cpu, cuda or cuda:N (default: cuda when a CUDA device is available, else cpu)"
                        + (f"; {more}" if more else ""))


def _chat_template_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="render chats with the Jinja template in FILE instead of the checkpoint's (vLLM's "
                        "--chat-template, llama-server's --chat-template-file)")


def _snapshot_interval(text: str) -> int:
    """Prompt tokens between prefix-cache snapshots: a positive multiple of the KV block size."""
    from hybrid.serving.capacity import DEFAULT_BLOCK_SIZE

    value = _positive_int(text)
    if value % DEFAULT_BLOCK_SIZE:
        raise argparse.ArgumentTypeError(f"must be a multiple of the KV block size {DEFAULT_BLOCK_SIZE}, got {text}")
    return value


def _threads(text: str) -> int:
    """torch CPU threads: 1 to 4 x os.cpu_count() (torch crashes, exit 139, on 100000)."""
    value = _positive_int(text)
    bound = 4 * (os.cpu_count() or 1)
    if value > bound:
        raise argparse.ArgumentTypeError(f"must be at most {bound} (4 x os.cpu_count()), got {text}")
    return value


def _parse(kind, text: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, got {text}") from None


def _temperature(text: str) -> float:
    value = _parse(float, text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (below 1e-05: greedy), got {text}")
    return value


def _top_k(text: str) -> int:
    value = _parse(int, text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, or 0 or -1 for no limit, got {text}")
    return value


def _memory(text: str) -> int:
    from hybrid.serving.capacity import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seed(text: str) -> int:
    value = _parse(int, text)
    if not -2**63 <= value < 2**64:  # what torch's generator takes
        raise argparse.ArgumentTypeError(f"must be an integer in [-2**63, 2**64), got {text}")
    return value


def _port(text: str) -> int:
    value = _parse(int, text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [1, 65535], got {text}")
    return value


def _repetition_penalty(text: str) -> float:
    value = _parse(float, text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 (1: none), got {text}")
    return value


def _openai_penalty(text: str) -> float:
    value = _parse(float, text)
    if not -2 <= value <= 2:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number in [-2, 2] (0: none), got {text}")
    return value


def _top_p(text: str) -> float:
    value = _parse(float, text)
    if not 0 < value <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    from hybrid.dtypes import ALIASES
    from moe.quant.formats import QUANTIZE_FORMATS

    dtypes, formats = sorted(ALIASES), sorted(QUANTIZE_FORMATS)  # bf16 fp16 fp32; fp8 mxfp4 nvfp4 (+ registered)

    try:
        v = version("hybrid-moe")
    except PackageNotFoundError:
        v = "unknown"
    parser = argparse.ArgumentParser(prog="hybrid", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"hybrid {v}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a checkpoint (streams to stdout)")
    g.add_argument("model", nargs="?", default=None, help="checkpoint directory or hub repo id (default: shipped checkpoint)")
    g.add_argument("--prompt", required=True, help="prompt text, or '-' to read it from stdin (one final newline dropped)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    _chat_template_option(g)
    g.add_argument("--enable-thinking", dest="enable_thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="passed to the chat template (Nemotron 3 reasoning switch)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=128, help="at most this many tokens (default: %(default)s)")
    g.add_argument("--temperature", type=_temperature, default=None,
                   help="0 (or below 1e-05) = greedy; default: the checkpoint's generation_config.json, else greedy")
    g.add_argument("--top-k", type=_top_k, default=None,
                   help="sample from the k most likely tokens (0 or -1: no limit; default: the checkpoint's, else none)")
    g.add_argument("--top-p", type=_top_p, default=None,
                   help="sample from the smallest set with probability >= p (default: the checkpoint's, else 1)")
    g.add_argument("--seed", type=_seed, default=None, help="seed of the sampler")
    g.add_argument("--repetition-penalty", type=_repetition_penalty, default=1.0,
                   help="divide positive logits (multiply negative ones) of every token in the prompt or output "
                        "by this (vLLM / transformers; default: %(default)s, none)")
    g.add_argument("--frequency-penalty", type=_openai_penalty, default=0.0,
                   help="subtract this times a token's count in the output from its logit (OpenAI's, [-2, 2]; "
                        "default: %(default)s)")
    g.add_argument("--presence-penalty", type=_openai_penalty, default=0.0,
                   help="subtract this from the logit of every token already in the output (OpenAI's, [-2, 2]; "
                        "default: %(default)s)")
    g.add_argument("--dtype", choices=dtypes, default=None, help="default: the checkpoint's dtype")
    g.add_argument("--mmap", action=argparse.BooleanOptionalAction, default=True,
                   help="keep bf16 weights as views of the checkpoint's memory map (default); --no-mmap copies "
                        "them into the process, safe from eviction by the page cache (llama.cpp's --no-mmap)")
    g.add_argument("--threads", type=_threads, default=None,
                   help="torch CPU threads (default: torch's choice; under torchrun, this host's CPUs divided "
                        "among its ranks)")
    _device_option(g, "under torchrun, rank r runs on cuda:{LOCAL_RANK} with NCCL (gloo on the CPU)")
    g.add_argument("--act-quant", action="store_true",
                   help="quantized checkpoints: also quantize activations (W8A8 / W4A4 emulation)")
    g.add_argument("--speculative", type=_non_negative_int, default=0, metavar="N",
                   help="draft N tokens per step with the checkpoint's MTP block and verify them (same output); "
                        "0 (the default): off")
    g.add_argument("--prefix-cache", default=None, metavar="FILE",
                   help="safetensors file of cached prefix states: reused when it matches the model, then updated "
                        "(under torchrun each rank's own FILE.rank{R}-of-{N})")
    g.add_argument("--prefix-snapshot-interval", "--prefix-block-size", type=_snapshot_interval, default=256,
                   metavar="N", dest="prefix_snapshot_interval",
                   help="prompt tokens between the prefix cache's Mamba snapshots (hits fall on them and on earlier "
                        "prompts' ends; a multiple of 16; default: %(default)s)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=_generate)

    v = sub.add_parser("serve", help="serve a checkpoint over the OpenAI API (continuous batching, prefix cache)")
    v.add_argument("model", nargs="?", default=None, help="checkpoint directory or hub repo id (default: shipped checkpoint)")
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    v.add_argument("--port", type=_port, default=8000, help="TCP port to listen on (default: %(default)s)")
    v.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the directory's)")
    v.add_argument("--max-num-seqs", type=_positive_int, default=16, help="requests running at once (state slots; default: %(default)s)")
    v.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="longest request, prompt and output (default: the config's, capped by the KV pool)")
    v.add_argument("--memory", type=_memory, default=None, metavar="SIZE",
                   help="memory budget (32GB, 24GiB) that sizes the state slots and KV blocks after the weights")
    v.add_argument("--dtype", choices=dtypes, default=None, help="default: the checkpoint's dtype")
    v.add_argument("--threads", type=_threads, default=None, help="torch CPU threads (default: torch's choice)")
    _device_option(v)
    v.add_argument("--max-queue", type=_non_negative_int, default=256,
                   help="requests that may wait besides the running ones; past it: 503 with Retry-After "
                        "(default: %(default)s)")
    v.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="share cached prefixes across requests (default: on)")
    v.add_argument("--prefix-cache-file", default=None, metavar="FILE",
                   help="load the prefix cache from FILE at start (if it matches the model) and save it at exit")
    v.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/ requests")
    _chat_template_option(v)
    _engine_options(v)
    v.set_defaults(func=_serve)

    c = sub.add_parser("chat", help="chat with a checkpoint in the terminal (the serving engine, its prefix cache)")
    c.add_argument("model", nargs="?", default=None, help="checkpoint directory or hub repo id (default: shipped checkpoint)")
    c.add_argument("--system", default=None, metavar="TEXT", help="system prompt (kept by /reset)")
    _chat_template_option(c)
    c.add_argument("--max-tokens", type=_positive_int, default=None,
                   help="at most this many tokens per reply (default: the rest of the context, as the server)")
    c.add_argument("--temperature", type=_temperature, default=None,
                   help="0 (or below 1e-05) = greedy; default: the checkpoint's generation_config.json, else 1 (the "
                        "server's, OpenAI's)")
    c.add_argument("--top-p", type=_top_p, default=None, help="sample from the smallest set with probability >= p")
    c.add_argument("--top-k", type=_top_k, default=None, help="sample from the k most likely tokens (0 or -1: no limit)")
    c.add_argument("--seed", type=_seed, default=None, help="seed of the sampler (each reply starts from it, as a request)")
    c.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True,
                   help="--no-thinking passes enable_thinking=false to the chat template (no reasoning)")
    c.add_argument("--hide-thinking", action="store_true", help="let the model think but show only its answers")
    c.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="longest conversation, prompt and reply (default: the config's, capped by the KV pool)")
    c.add_argument("--memory", type=_memory, default=None, metavar="SIZE",
                   help="memory budget (32GB, 24GiB) that sizes the KV blocks after the weights")
    c.add_argument("--dtype", choices=dtypes, default=None, help="default: the checkpoint's dtype")
    c.add_argument("--threads", type=_threads, default=None, help="torch CPU threads (default: torch's choice)")
    _device_option(c)
    c.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="resume each turn from the previous prompt's cached state (default: on)")
    c.add_argument("--prefix-cache-file", default=None, metavar="FILE",
                   help="load the prefix cache from FILE at start (if it matches the model) and save it at exit")
    _engine_options(c)
    c.set_defaults(func=_chat)

    i = sub.add_parser("info", help="layers, parameters, bytes and cache sizes of a checkpoint or config.json")
    i.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory, config.json file, or hub repo id (default: shipped checkpoint)")
    i.add_argument("--dtype", choices=dtypes, default=None, help="default: the config's dtype")
    i.add_argument("--format", choices=formats, default=None,
                   help="report the sizes after `hybrid quantize --format F` with the default exclusions")
    i.add_argument("--memory", type=_memory, default=None, metavar="SIZE",
                   help="a memory budget (32GB, 24GiB): print the state slots and KV blocks it holds and the "
                        "concurrent sequences per length (with --tensor-parallel: one rank's budget)")
    i.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="with --memory: the longest sequence a slot must reach (default: the config's)")
    i.add_argument("--max-num-seqs", type=_positive_int, default=256, help="with --memory: at most this many slots")
    i.add_argument("--block-size", type=_positive_int, default=16, help="with --memory: tokens per KV block")
    i.add_argument("--tensor-parallel", type=_positive_int, default=None, metavar="N",
                   help="also what each of N tensor-parallel ranks holds (weights, KV cache, Mamba state) and the "
                        "collectives per decoded token")
    i.add_argument("--device", default=None, metavar="DEVICE",
                   help="also name what runs each operation on DEVICE (cpu, cuda, cuda:N): kernel or PyTorch")
    i.add_argument("--json", action="store_true", help="print the report as JSON")
    i.set_defaults(func=_info)

    k = sub.add_parser("build-kernels", help="compile the C++ CPU kernels now (otherwise the first model load "
                                             "on the CPU does)")
    k.set_defaults(func=_build_kernels)

    q = sub.add_parser("quantize", help="quantize a checkpoint to FP8 / NVFP4 / MXFP4 (ModelOpt layout)")
    q.add_argument("src", help="float checkpoint directory or hub repo id")
    q.add_argument("dst", help="output directory")
    q.add_argument("--format", required=True, choices=formats)
    q.add_argument("--exclude", nargs="*", default=None, metavar="PATTERN",
                   help="modules to keep unquantized (fnmatch wildcards over module names); replaces the default "
                        "list (lm_head, embeddings, attention, the Mamba layer feeding each attention layer, conv1d, "
                        "routers, MTP); `--exclude` alone quantizes every Linear")
    q.add_argument("--calibration-samples", type=_non_negative_int, default=16,
                   help="token windows for the static input scales (fp8, nvfp4; default: %(default)s); 0: scales of 1.0")
    q.add_argument("--calibration-length", type=_positive_int, default=256,
                   help="tokens per calibration window (default: %(default)s)")
    q.add_argument("--calibration-file", default=None, help="text file to calibrate on (default: built-in text)")
    q.add_argument("--dtype", choices=dtypes, default=None,
                   help="dtype of the unquantized tensors (default: the checkpoint's)")
    q.add_argument("--max-shard-bytes", type=_positive_int, default=512 * 2**20,
                   help="largest weight shard in bytes (default: %(default)s, 512 MiB)")
    q.add_argument("--overwrite", action="store_true", help="replace DST if it exists and is not empty")
    q.add_argument("--threads", type=_threads, default=None, help="torch CPU threads (default: torch's choice)")
    _device_option(q, "where the calibration runs")
    q.set_defaults(func=_quantize)
    return parser


class _OutputError(Exception):
    """Writing to stdout failed (the `OSError` is the cause)."""


class _GuardedStdout:
    """sys.stdout whose write and flush failures surface as `_OutputError` (a closed pipe stays a
    `BrokenPipeError`), so `main` can tell them from the command's own file errors."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _OutputError() from e

    def flush(self):
        try:
            return self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _OutputError() from e

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _show_note(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"note: {message}", file=sys.stderr)


def _silence_stdout(stream) -> None:
    """Point stdout's descriptor at /dev/null, so the interpreter's last flush of `stream` cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    """Run the `hybrid` command; returns the exit status: 0; 1 (writing stdout failed: one `error:` line; also
    `serve` unable to bind or start, `quantize` unable to write, a kernel `build-kernels` could not build, a
    model that does not fit `info --memory`); 2 (a usage, config, checkpoint or value error, or a required GPU
    kernel missing: one `error:` line); 130 (`chat` ended by Ctrl-C); or 141 (stdout was closed, as by `| head`:
    quietly, like a command killed by SIGPIPE). Warnings print as one `note:` line each."""
    from hybrid.parallel import launch

    if launch.launched() and os.environ.get("RANK", "0") != "0":  # a usage error: printed by rank 0 alone
        with contextlib.redirect_stderr(_Discard()), contextlib.redirect_stdout(_Discard()):
            args = build_parser().parse_args(argv)
    else:
        args = build_parser().parse_args(argv)
    from hybrid.checkpoint_files import CheckpointError
    from hybrid.config import ConfigError
    from moe.quant.kernels.backend import KernelUnavailable

    real_stdout, shown = sys.stdout, warnings.showwarning
    sys.stdout, warnings.showwarning = _GuardedStdout(real_stdout), _show_note
    try:
        status = args.func(args)
        sys.stdout.flush()
        return status
    except (ConfigError, CheckpointError, ValueError, KernelUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _silence_stdout(real_stdout)
        return 141
    except _OutputError as e:
        _silence_stdout(real_stdout)
        print(f"error: writing to stdout failed: {e.__cause__}", file=sys.stderr)
        return 1
    finally:
        sys.stdout, warnings.showwarning = real_stdout, shown


if __name__ == "__main__":
    sys.exit(main())
