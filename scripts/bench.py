"""Speed and memory of our model against its peers, in one run, on the same checkpoint, threads and dtype.

    python scripts/bench.py --preset medium            # 554M-parameter MoE, bf16 (see checkpoints/configs/)
    python scripts/bench.py --preset long              # the same model with a 32K-token prompt
    python scripts/bench.py --preset wide              # medium with every width doubled (2.1B, 4x the bytes per layer)
    python scripts/bench.py --preset nano-slice        # Nano's real widths; bf16 / FP8 / NVFP4 / MXFP4 vs llama.cpp
                                                       # (scripts/bench_formats.py)
    python scripts/bench.py --checkpoint DIR           # any checkpoint the loader accepts
    python scripts/bench.py --smoke                    # seconds: the tiny preset, short lengths (CI)

A preset's checkpoint is built once with random weights (`hybrid.training.write_random_checkpoint`, seed
0: tensor by tensor, sharded, in bf16) with the default checkpoint's tokenizer files, under `--workdir`. Each engine then
runs in its own process (so its peak resident memory is its own), reading the same files:

- ours: `hybrid.load` + `hybrid.generate.generate_ids` (the user's path), greedy;
- transformers: `NemotronHForCausalLM.from_pretrained` + `generate` (always; prefill lengths above
  `--peer-max-prefill` are skipped, it is about 10x slower);
- llama.cpp: through the optional external `llamacpp-peer` tool (`--peer-tool`, by default
  `../shared/tools/llamacpp-peer`, not part of this repository), when its `setup` has been run (its venv
  exists): the checkpoint is converted to a GGUF of the same dtype and benchmarked by the tool. Without
  the tool the llama.cpp figures are left out (the README says how to run llama.cpp by hand).

Figures: load seconds; prefill tokens/s and time to first token per prompt length; decode tokens/s at each
batch size (all rows together); peak resident memory; the cache's bytes after the longest prompt; the
memory read bandwidth measured in this run (the median of samples taken before and after the engines) and
the decode roofline ratio
`decode tok/s * active weight bytes per token / bandwidth`; our/peer ratios and the issue's targets, each
printed as pass / fall short. Every timing is the median of `--repeats`. JSON goes to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PEER_TOOL = ROOT.parent / "shared" / "tools" / "llamacpp-peer"  # the default of --peer-tool
PEER_HOME = Path(os.environ.get("PEER_HOME", Path.home() / ".cache" / "hybrid-peers"))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

TINY = dict(
    architectures=["NemotronHForCausalLM"], model_type="nemotron_h", hybrid_override_pattern="MEM*EM",
    vocab_size=4096, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    mamba_num_heads=4, mamba_head_dim=64, ssm_state_size=32, n_groups=2, chunk_size=64, conv_kernel=4, expand=2,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, moe_shared_expert_intermediate_size=256,
    intermediate_size=256, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
MEDIUM = ROOT / "checkpoints" / "configs" / "bench-medium.config.json"
WIDE = ROOT / "checkpoints" / "configs" / "bench-wide.config.json"  # medium with every width doubled
NANO_SLICE = ROOT / "checkpoints" / "configs" / "bench-nano-slice.config.json"  # Nano's widths, 7 layers, 32K vocab
PRESETS = {  # config, prefill lengths, decode batch sizes
    "tiny": (TINY, [256, 1024], [1, 8]),
    "medium": (MEDIUM, [1024, 8192], [1, 8]),
    "long": (MEDIUM, [1024, 32768], [1]),
    "wide": (WIDE, [1024], [1, 8]),
    "nano-slice": (NANO_SLICE, [512], [1]),
}


# ---------------------------------------------------------------------------------------------- checkpoint
def make_checkpoint(preset: str, workdir: Path) -> Path:
    """The preset's random bf16 checkpoint (built once, then reused), written tensor by tensor in the
    published layout (sharded, one tensor per expert) with the default checkpoint's tokenizer files."""
    from hybrid.config import HybridConfig
    from hybrid.training import write_random_checkpoint

    out = workdir / preset
    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return out
    source = PRESETS[preset][0]
    config = HybridConfig.from_file(source) if isinstance(source, Path) else HybridConfig.from_dict(source)
    tokenizer = [ROOT / "checkpoints" / "hybrid-mini" / name for name in TOKENIZER_FILES]
    return write_random_checkpoint(config, out, seed=0, extra_files=tokenizer)


def bandwidth_samples(repeats: int = 5) -> list[float]:
    """Read bandwidth samples in bytes/s: the times of summing a 1 GiB fp32 tensor."""
    x = torch.ones(2**28)
    x.sum()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        samples.append(x.nbytes / (time.perf_counter() - start))
    return samples


def proc_memory_bytes(pid: int | str = "self", field: str = "VmHWM") -> int | None:
    """A memory figure of a process from /proc/PID/status (Linux): "VmHWM" its peak resident memory, "VmRSS"
    its resident memory now; None where there is no such file or field (another OS, a process gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM (Linux; reset by exec, unlike `ru_maxrss`, which a
    worker would inherit from the parent process that started it), else `ru_maxrss`."""
    peak = proc_memory_bytes("self", "VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------------------- workers
def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    """`n` token ids drawn uniformly from [3, vocab) (past the special ids), reproducibly from `seed`."""
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def worker_ours(args) -> dict:
    import hybrid
    from hybrid.generate import PREFILL_CHUNK_SIZE, generate_ids

    start = time.perf_counter()
    model, _ = hybrid.load(args.dir, dtype=args.dtype)
    result = {"engine": "ours", "load_s": time.perf_counter() - start, "prefill": {}, "decode": {}}
    vocab = model.config.vocab_size
    for L in args.lengths:
        prompt = random_prompt(L, vocab, L)
        times = [generate_ids(model, [prompt], max_new_tokens=1)[0].prefill_seconds for _ in range(args.repeats)]
        cache = model.new_cache(1, L)
        with torch.inference_mode():
            for s in range(0, L, PREFILL_CHUNK_SIZE):
                model(torch.tensor([prompt[s:s + PREFILL_CHUNK_SIZE]]), cache, logits_to_keep=1)
        result["prefill"][str(L)] = {"ttft_s": statistics.median(times), "tok_s": L / statistics.median(times),
                                     "cache_bytes": cache.nbytes()}
    for B in args.batches:
        prompts = [random_prompt(args.decode_prompt, vocab, 100 + b) for b in range(B)]
        rates = []
        for _ in range(args.repeats):
            c = generate_ids(model, prompts, max_new_tokens=args.decode_tokens + 1)
            rates.append(B * c[0].decode_tokens_per_s)
        result["decode"][str(B)] = {"tok_s": statistics.median(rates)}
    return result


def worker_transformers(args) -> dict:
    from transformers import NemotronHForCausalLM

    from hybrid.dtypes import torch_dtype

    dtype = torch_dtype(args.dtype)
    start = time.perf_counter()
    model = NemotronHForCausalLM.from_pretrained(args.dir, dtype=dtype).eval()
    result = {"engine": "transformers", "load_s": time.perf_counter() - start, "prefill": {}, "decode": {}}
    vocab = model.config.vocab_size

    def timed_generate(ids: torch.Tensor, new: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    for L in args.lengths:
        if L > args.peer_max_prefill:
            continue
        ids = torch.tensor([random_prompt(L, vocab, L)])
        t = statistics.median(timed_generate(ids, 1) for _ in range(args.repeats))
        result["prefill"][str(L)] = {"ttft_s": t, "tok_s": L / t}
    for B in args.batches:
        ids = torch.tensor([random_prompt(args.decode_prompt, vocab, 100 + b) for b in range(B)])
        first = statistics.median(timed_generate(ids, 1) for _ in range(args.repeats))
        total = statistics.median(timed_generate(ids, args.peer_decode_tokens + 1) for _ in range(args.repeats))
        result["decode"][str(B)] = {"tok_s": B * args.peer_decode_tokens / max(total - first, 1e-9)}
    return result


WORKERS = {"ours": worker_ours, "transformers": worker_transformers}


def run_worker(engine: str, args, directory: Path) -> dict:
    """One engine in a fresh process; its JSON result plus its peak resident memory."""
    cmd = [sys.executable, __file__, "--worker", engine, "--dir", str(directory), "--dtype", args.dtype,
           "--lengths", *map(str, args.lengths), "--batches", *map(str, args.batches),
           "--repeats", str(args.repeats), "--decode-tokens", str(args.decode_tokens),
           "--decode-prompt", str(args.decode_prompt), "--peer-max-prefill", str(args.peer_max_prefill),
           "--peer-decode-tokens", str(args.peer_decode_tokens), "--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"engine": engine, "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def llamacpp_gguf(tool: str | Path, directory: Path, dtype: str) -> Path | None:
    """The GGUF of the checkpoint in `directory` in `dtype` ("bf16" or "fp32"), converted once by the peer
    tool's `convert` (kept beside the checkpoint as model-DTYPE.gguf); None when the tool or its
    environment (`llamacpp-peer setup`) is missing."""
    tool = Path(tool)
    if not (PEER_HOME / "llama-venv" / "bin" / "python").exists() or not tool.exists():
        return None
    gguf = directory / f"model-{dtype}.gguf"
    outtype = {"bf16": "bf16", "fp32": "f32"}[dtype]
    if not gguf.exists():
        subprocess.run([str(tool), "convert", str(directory), str(gguf), outtype], check=True,
                       capture_output=True)
    return gguf


def run_llamacpp(args, directory: Path) -> dict | None:
    """llama.cpp through the peer tool, or None when its environment was never set up."""
    tool = Path(args.peer_tool)
    gguf = llamacpp_gguf(tool, directory, args.dtype)
    if gguf is None:
        return None
    result = {"engine": "llama.cpp", "prefill": {}, "decode": {}}
    for L in args.lengths:
        # run through a Python parent that reports the peak RSS of its descendants (the tool's process)
        report_peak = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
                       "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(r.returncode)")
        done = subprocess.run([sys.executable, "-c", report_peak, str(tool), "bench", str(gguf), str(L),
                               str(args.decode_tokens), str(args.threads)], capture_output=True, text=True)
        if done.returncode != 0:
            result["prefill"][str(L)] = {"error": done.stderr.strip()[-300:]}
            continue
        lines = done.stdout.strip().splitlines()
        result["peak_rss_bytes"] = max(result.get("peak_rss_bytes", 0), int(lines[-1]))
        r = json.loads(lines[-2])
        result["prefill"][str(L)] = {"tok_s": r["prefill_tok_s"], "ttft_s": L / r["prefill_tok_s"]}
        result["decode"].setdefault("1", {"tok_s": r["decode_tok_s"]})
    return result


# ---------------------------------------------------------------------------------------------- report
def targets(results: dict, bandwidth: float, active_bytes: int, checkpoint_bytes: int) -> list[dict]:
    """The issue's targets that these results can decide: name, value, goal, pass."""
    ours, peers = results["ours"], results
    out = []

    def add(name, value, goal):
        if value is not None:
            out.append({"target": name, "value": round(value, 3), "goal": goal, "pass": value >= goal})

    d1 = ours["decode"].get("1", {}).get("tok_s")
    if d1:
        add("decode b1 roofline ratio", d1 * active_bytes / bandwidth, 0.75)
    d8 = ours["decode"].get("8", {}).get("tok_s")
    if d1 and d8:
        add("decode b8 / b1", d8 / d1, 4.0)
    tf = peers.get("transformers") or {}
    if d1 and tf.get("decode", {}).get("1"):
        add("decode vs transformers", d1 / tf["decode"]["1"]["tok_s"], 50.0)
    for L, r in ours["prefill"].items():
        if tf.get("prefill", {}).get(L):
            add(f"prefill {L} vs transformers", r["tok_s"] / tf["prefill"][L]["tok_s"], 5.0)
        lc = (peers.get("llama.cpp") or {}).get("prefill", {}).get(L, {})
        if "tok_s" in lc:
            add(f"prefill {L} vs llama.cpp", r["tok_s"] / lc["tok_s"], 1.0)
    lc_decode = (peers.get("llama.cpp") or {}).get("decode", {}).get("1")
    if d1 and lc_decode:
        add("decode b1 vs llama.cpp (goal)", d1 / lc_decode["tok_s"], 1.0)
    lengths = sorted(int(L) for L in ours["prefill"])
    if len(lengths) > 1 and lengths[-1] >= 8 * lengths[0]:
        short, long = ours["prefill"][str(lengths[0])], ours["prefill"][str(lengths[-1])]
        add(f"prefill tok/s {lengths[-1]} / {lengths[0]}", long["tok_s"] / short["tok_s"], 0.5)  # cost within 2x
    if "peak_rss_bytes" in ours:
        cache = ours["prefill"][str(lengths[-1])]["cache_bytes"]
        add("(1.15 ckpt + cache) / peak RSS", (1.15 * checkpoint_bytes + cache) / ours["peak_rss_bytes"], 1.0)
        add("(ckpt + 2 GB) / peak RSS", (checkpoint_bytes + 2e9) / ours["peak_rss_bytes"], 1.0)
    return out


def print_table(report: dict) -> None:
    engines = [e for e in ("ours", "transformers", "llama.cpp") if report["engines"].get(e)]
    print(f"{report['model']} | {report['dtype']} | {report['threads']} threads | bandwidth "
          f"{report['bandwidth_gb_s']:.1f} GB/s | active weights {report['active_weight_bytes'] / 1e6:.0f} MB/token"
          f" -> decode limit {report['decode_limit_tok_s']:.1f} tok/s")
    print(f"{'figure':28}" + "".join(f"{e:>16}" for e in engines))

    def row(label, get):
        cells = []
        for e in engines:
            try:
                v = get(report["engines"][e])
                cells.append(f"{v:16.2f}" if isinstance(v, float) else f"{v:>16}")
            except (KeyError, TypeError):
                cells.append(f"{'-':>16}")
        print(f"{label:28}" + "".join(cells))

    row("load s", lambda r: r["load_s"])
    for L in report["lengths"]:
        row(f"prefill {L} tok/s", lambda r, L=L: r["prefill"][str(L)]["tok_s"])
        row(f"TTFT {L} s", lambda r, L=L: r["prefill"][str(L)]["ttft_s"])
    for B in report["batches"]:
        row(f"decode b{B} tok/s", lambda r, B=B: r["decode"][str(B)]["tok_s"])
    row("peak RSS MB", lambda r: r["peak_rss_bytes"] / 1e6)
    row("cache MB (longest prompt)", lambda r: r["prefill"][str(report["lengths"][-1])]["cache_bytes"] / 1e6)
    for t in report["targets"]:
        print(f"  {t['target']:40} {t['value']:>9} (goal >= {t['goal']}): {'pass' if t['pass'] else 'fall short'}")


def write_json(path: Path, content, indent: int = 1) -> None:
    """Write `content` as JSON to `path` atomically (`hybrid.atomic`: a failed write leaves the previous file)."""
    from hybrid.atomic import atomic_write_text  # imported here: the engines' workers stay free of it

    atomic_write_text(path, json.dumps(content, indent=indent, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="medium")
    p.add_argument("--checkpoint", type=Path, default=None, help="benchmark this checkpoint instead of a preset")
    p.add_argument("--smoke", action="store_true", help="tiny preset, 64-token prompts, 4 decode tokens, 1 repeat")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="prefill prompt lengths (default: preset's)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes (default: preset's)")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--decode-prompt", type=int, default=32, help="prompt tokens before the decode measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peers", nargs="*", default=["transformers", "llama.cpp"])
    p.add_argument("--peer-tool", default=str(PEER_TOOL),
                   help="the optional external llamacpp-peer script (setup, convert, bench); skipped when absent")
    p.add_argument("--peer-max-prefill", type=int, default=1024, help="longest prompt given to transformers")
    p.add_argument("--peer-decode-tokens", type=int, default=8, help="decode tokens timed for transformers")
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "hybrid-bench")
    p.add_argument("--out", type=Path, default=Path("bench.json"))
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    if args.worker:  # inside an engine's own process
        result = WORKERS[args.worker](args)
        result["peak_rss_bytes"] = peak_rss_bytes()
        print(json.dumps(result))
        return 0

    if args.smoke:
        args.preset, args.repeats, args.decode_tokens, args.peer_decode_tokens = "tiny", 1, 4, 2
        args.lengths, args.batches = args.lengths or [64], args.batches or [1, 2]
    preset_lengths, preset_batches = PRESETS[args.preset][1:]
    args.lengths, args.batches = args.lengths or preset_lengths, args.batches or preset_batches
    directory = args.checkpoint or make_checkpoint(args.preset, args.workdir)
    if args.preset == "nano-slice" and args.checkpoint is None:  # every format against llama.cpp's
        import bench_formats

        args.prefill, args.peer_home = args.lengths[0], PEER_HOME
        return bench_formats.run(args, directory)

    from hybrid.accounting import describe
    from hybrid.config import HybridConfig
    from hybrid.dtypes import torch_dtype

    config = HybridConfig.from_file(directory / "config.json")
    dtype = torch_dtype(args.dtype)
    active_bytes = describe(config, dtype)["active_parameters_per_token"] * dtype.itemsize
    samples = bandwidth_samples()

    engines = {"ours": run_worker("ours", args, directory)}
    if "transformers" in args.peers:
        engines["transformers"] = run_worker("transformers", args, directory)
    if "llama.cpp" in args.peers:
        engines["llama.cpp"] = run_llamacpp(args, directory)
    # sampled before and after the engines: the machine's bandwidth drifts over a run that takes minutes
    bandwidth = statistics.median(samples + bandwidth_samples())
    if "error" in engines["ours"]:
        print(f"error: our engine failed: {engines['ours']['error']}", file=sys.stderr)
        return 1
    report = {
        "model": str(args.checkpoint or args.preset), "dtype": args.dtype, "threads": args.threads,
        "lengths": args.lengths, "batches": args.batches, "bandwidth_gb_s": bandwidth / 1e9,
        "active_weight_bytes": active_bytes, "decode_limit_tok_s": bandwidth / active_bytes,
        "engines": engines,
    }
    checkpoint_bytes = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    report["checkpoint_bytes"] = checkpoint_bytes
    report["targets"] = targets(engines, bandwidth, active_bytes, checkpoint_bytes)
    write_json(args.out, report)
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
