"""Check this project's CUDA path on this machine, with no network: kernels against float64, models and the engine
against the CPU.

    python scripts/gpu_check.py                                  # on the GPU (cuda when present), Nano's widths
    HYBRID_REQUIRE_CUDA_KERNELS=1 python scripts/gpu_check.py    # a missing kernel package fails the check
    python scripts/gpu_check.py --timings --out gpu_check.json   # + speed and memory of a nano-slice
    python scripts/gpu_check.py --device cpu --small             # seconds, on a CPU (tests/test_gpu_check.py)

Steps, in order (each reported in the JSON of --out, with pass / fail):

1. environment: torch / CUDA / triton / mamba-ssm / causal-conv1d versions, the device's name and memory, and
   which backend runs each hot operation there (`hybrid.devices.describe`). With HYBRID_REQUIRE_CUDA_KERNELS=1
   triton, the GPU path's kernel package, must import (else this step fails, and the operations that need it
   raise `KernelUnavailable`); mamba-ssm and causal-conv1d are optional and reported.
2. kernels: each operation through the `hybrid.ops` seam (or the module the model runs) on the device against the
   PyTorch specification in float64, on inputs rounded to each of --dtypes (default fp32, bf16, fp16): the SSD
   scan (a length with a partial last chunk, from a given state), the SSD step and the conv step (and its rolled
   window) where mamba-ssm / causal-conv1d import (their kernels; skipped otherwise), the Mamba-2 decode step and
   prompt chunks over state slots and the forward without a cache (padding), this project's Triton kernels,
   RMSNorm and the gated RMSNorm, the routed experts as a float bf16 bank and packed in FP8 / NVFP4 /
   MXFP4 (one token and a batch, with ids outside [0, E), other ranks' experts, which must add nothing), and
   one-query GQA attention (an attention layer's decode step over a KV cache). Widths are Nano's (128 experts of
   1856 x 2688, top-6; Mamba 64 heads x 64, state 128, 8 groups, chunk 128; 32 query / 2 KV heads of 128);
   --small shrinks every width. Each check reports max |got - want| / max |want| and its tolerance:
   fp32 1e-2 (the Triton kernels may use TF32 products), fp16 1e-2, bf16 3e-2; a wrong decay, group mapping,
   state hand-over or expert is off by O(1).
3. model: the shipped checkpoint (hybrid/cli.py DEFAULT_CHECKPOINT) and its FP8 / NVFP4 / MXFP4 copies
   (`hybrid.quantize.quantize_checkpoint`, into a temporary directory) on the device against the CPU, in
   --model-dtype (default fp32): the CPU reference decodes greedily for --steps tokens from a fixed prompt; the
   device is fed the same tokens, and at every step its argmax must equal the reference's token (so its own
   greedy decoding gives the same tokens) and the KL divergence KL(cpu || device) of the next-token
   distributions is reported (mean and max; fp32: mean <= 1e-3 and max <= 5e-2, bf16: 2e-2 and 0.2). A
   differing argmax is excused only where the reference's top two log-probabilities are closer than the tie gap
   (fp32 0.05, bf16 0.25). The CPU reference runs in a subprocess with HYBRID_CPU_KERNELS=0 (nothing compiled:
   PyTorch's paths, the specification), started at the beginning so that it overlaps the kernel checks.
4. engine: 8 requests of mixed prompt lengths (1 to 150 tokens) together through `hybrid.serving.engine.Engine`
   (chunked prefills packed with decodes) on the device: each request's greedy tokens equal the CPU engine's
   (same subprocess); a divergence is excused only at a near-tie of the reference, as above. On CUDA, a decode
   step of 16 sampled sequences must make no host synchronisation inside the layers (torch's sync debug mode
   counts them; the whole step's count is reported).
5. --timings (only when every check above passed; no figure is asserted): a nano-slice
   (checkpoints/configs/bench-nano-slice.config.json, Nano's widths, 7 layers; random bf16 weights built once
   under --workdir, shared with scripts/bench.py) on the device in bf16: decode tok/s at batch 1 and 16, a
   2048-token prefill, peak GPU memory (torch.cuda.max_memory_allocated), and the active weight bytes a token
   reads against the bandwidth of a device-to-device copy measured in the same run (read + write bytes per
   second): `decode b1 tok/s * bytes per token / copy bandwidth`. On the CPU --timings runs only with --small
   (bench.py's tiny preset, short lengths, peak RSS instead of GPU memory: a test of the code, not a figure).

Exit status: 0 when every check passed, 1 otherwise; 2 with one `error:` line for bad arguments (such as
--device cuda on a machine without CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-2, "bf16": 3e-2, "fp16": 1e-2}  # of the largest reference value (module docstring)
TIE_GAP = {"fp32": 0.05, "bf16": 0.25}  # reference top-2 log-prob gap under which a differing argmax is excused
KL_TOLERANCE = {"fp32": (1e-3, 5e-2), "bf16": (2e-2, 0.2)}  # (mean, max) of KL(cpu || device) per step
QUANT_FORMATS = ("fp8", "nvfp4", "mxfp4")
# the checkpoints of the model step, as the summary names them ("bf16": the shipped one as it is stored)
MODEL_LABELS = {"bf16": "shipped (bf16)", **{f: f"shipped -> {f}" for f in QUANT_FORMATS}}
ENGINE_PROMPT_LENGTHS = (1, 7, 16, 33, 64, 65, 100, 150)  # chunk 64 of the shipped checkpoint: partial and whole
PROMPT_TEXT = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk, carrying a lamp, a notebook and a "
    "flask of tea. From the gallery he could see the whole bay: the fishing boats returning to the harbour, the "
    "gulls circling over the rocks, and far to the west the dark line of the islands. He wrote down the wind, the "
    "height of the waves and the colour of the sky, as his father had done before him. One night in November a "
    "storm came in from the sea. The rain beat against the glass, the tower shook, and the light went out. He "
    "lit the spare lamp with cold hands, wound the clockwork that turned the lens, and waited. Near midnight he "
    "saw a small boat without lights, drifting towards the reef. He rang the bell again and again until the "
    "sailors heard it and turned away from the rocks. In the morning the sea was calm and grey, and the boat was "
    "safe in the harbour. The sailors came up the hill to thank him, and he made them tea and showed them the "
    "notebook, where he had written only: wind north-west, strong; light out at ten; boat saved."
)
_T0 = time.perf_counter()


def log(message: str) -> None:
    """Progress on stderr, with the seconds since the start."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Widths:
    """The widths of the kernel checks. Experts: `experts` of `intermediate` x `hidden`, top `top_k`, over 1 and
    `tokens` tokens; Mamba-2: `heads` x `head_dim`, `state`, `groups`, `chunk`, a scan of `scan_len` positions
    over `batch` sequences, conv over `heads * head_dim + 2 * groups * state` channels; attention: `q_heads` /
    `kv_heads` heads of `attn_head_dim` over `keys` positions."""

    experts: int
    hidden: int
    intermediate: int
    top_k: int
    tokens: int
    heads: int
    head_dim: int
    state: int
    groups: int
    chunk: int
    conv_kernel: int
    scan_len: int
    batch: int
    q_heads: int
    kv_heads: int
    attn_head_dim: int
    keys: int

    @property
    def conv_dim(self) -> int:
        return self.heads * self.head_dim + 2 * self.groups * self.state


# Nemotron 3 Nano; 300 = two chunks of 128 and a partial one
NANO = Widths(experts=128, hidden=2688, intermediate=1856, top_k=6, tokens=33, heads=64, head_dim=64, state=128,
              groups=8, chunk=128, conv_kernel=4, scan_len=300, batch=2, q_heads=32, kv_heads=2, attn_head_dim=128,
              keys=1000)
# --small: every width shrunk (16 and more: the Triton kernels' smallest tiles; MXFP4 needs multiples of 32); a scan
# of 150 positions: past the chunked SSD's chunk of 64 (both of its forms run)
SMALL = Widths(experts=8, hidden=96, intermediate=64, top_k=2, tokens=13, heads=4, head_dim=16, state=16, groups=2,
               chunk=16, conv_kernel=4, scan_len=150, batch=2, q_heads=4, kv_heads=2, attn_head_dim=16, keys=37)


# ---------------------------------------------------------------------------------------------- helpers
def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in float64 (on `want`'s device); NaN or inf when `got` holds them."""
    want = want.detach().double()
    diff = (got.detach().to(want.device).double() - want).abs().max()
    return float(diff / want.abs().max().clamp_min(1e-300))


def _json_float(x: float | None):
    """A float for the JSON report: non-finite values as strings ("nan", "inf"), which JSON cannot hold."""
    if x is None or x == x and abs(x) != float("inf"):
        return x
    return str(x)


def one_line(e: BaseException) -> str:
    """An exception as one line for the report: its type and the first line of its message (500 characters)."""
    text = f"{type(e).__name__}: {e}"
    return (text.splitlines() or [text])[0][:500]


def _result(name: str, dtype: str, errors: dict[str, float] | None, tol: float, exception: str | None = None) -> dict:
    """One kernel check's report: the largest of `errors` (output -> relative error) against `tol`."""
    worst = None if not errors else float("nan") if any(e != e for e in errors.values()) else max(errors.values())
    ok = exception is None and errors is not None and all(e <= tol for e in errors.values())  # NaN fails
    out = {"check": name, "dtype": dtype, "error": _json_float(worst), "tolerance": tol, "pass": ok,
           "outputs": {k: _json_float(v) for k, v in (errors or {}).items()}}
    if exception:
        out["exception"] = exception
    return out


def _fmt(x) -> str:
    """An error or divergence for the log and the summary: 3 significant digits, or as it is (None, "nan")."""
    return f"{x:.2e}" if isinstance(x, float) else str(x)


def _guarded(name: str, dtype: str, tol: float, run) -> dict:
    """`run()` -> {output: relative error}, as a result; an exception fails the check and is reported."""
    try:
        return _result(name, dtype, run(), tol)
    except Exception as e:  # noqa: BLE001: a kernel that raises is a failed check, not a crashed run
        return _result(name, dtype, None, tol, one_line(e))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- 1. environment
def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def optional_kernel_packages() -> dict[str, str]:
    """{package: "imports" or its import error} for mamba-ssm and causal-conv1d, whose kernels the GPU path
    takes where they import (mamba-ssm's chunked scan for a forward without a cache) and does without."""
    from hybrid import ops

    return {p: ops.import_error(p) or "imports" for p in ("mamba-ssm", "causal-conv1d")}


def check_environment(device: torch.device) -> dict:
    """Versions, the device, `describe(device)` ({operation: backend}); `pass` is False when
    HYBRID_REQUIRE_CUDA_KERNELS=1 and triton, the GPU path's kernel package, does not import."""
    from hybrid.devices import describe, missing_kernels
    from moe.quant.kernels import backend

    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "triton": _package_version("triton"), "mamba-ssm": _package_version("mamba-ssm"),
            "causal-conv1d": _package_version("causal-conv1d"), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, memory_bytes=props.total_memory,
                    compute_capability=f"{props.major}.{props.minor}")
    else:
        info.update(device_name=_cpu_model(), cpu_count=os.cpu_count(),
                    memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                    if hasattr(os, "sysconf") else None)
    gpu_path = device.type == "cuda" or backend.triton_on_cpu()
    info["gpu_path"] = gpu_path
    info["require_cuda_kernels"] = backend.require_kernels()
    try:
        info["backends"] = describe(device)
        info["missing_kernel_packages"] = missing_kernels() if gpu_path else {}
        info["optional_kernel_packages"] = optional_kernel_packages() if gpu_path else {}
    except Exception as e:  # noqa: BLE001: a broken report of the backends is a failed check, not a crash
        info.setdefault("backends", {})
        info["missing_kernel_packages"] = {}
        info["exception"] = one_line(e)
    info["pass"] = "exception" not in info and not (info["require_cuda_kernels"] and info["missing_kernel_packages"])
    return info


# ---------------------------------------------------------------------------------------------- 2. kernels
def _ssd_inputs(w: Widths, T: int, dtype: torch.dtype, seed: int):
    """x [b, T, h, p], B, C [b, T, g, n] rounded to `dtype`; dt [b, T, h] (already softplus-ed and clamped, as the
    mixer passes it), A [h] and state [b, h, p, n] in fp32 (as the model holds them). CPU tensors."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(w.batch, T, w.heads, w.head_dim, generator=g).to(dtype)
    dt = torch.rand(w.batch, T, w.heads, generator=g) * 0.1 + 0.001
    A = -torch.rand(w.heads, generator=g) * 8 - 1
    B, C = (torch.randn(w.batch, T, w.groups, w.state, generator=g).to(dtype) for _ in range(2))
    state = torch.randn(w.batch, w.heads, w.head_dim, w.state, generator=g) * 0.5
    return x, dt, A, B, C, state


def ssd_scan_float64(x, dt, A, B, C, chunk: int, state=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification's chunked SSD scan (`hybrid.ops.ssd.ssd_chunk`, chunk by chunk) in float64 on the CPU:
    shapes as `hybrid.ops.ssd.ssd_scan` -> (y [b, T, h, p], final state [b, h, p, n]). Not `ssd.ssd_scan` or
    `ssd.ssd_step` themselves: those compute in fp32 whatever their inputs' dtype."""
    from hybrid.ops import ssd

    if state is None:  # from zero
        state = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1])
    x, dt, A, B, C, state = (t.cpu().double() for t in (x, dt, A, B, C, state))
    ys = []
    for s in range(0, x.shape[1], chunk):
        y, state = ssd.ssd_chunk(x[:, s:s + chunk], dt[:, s:s + chunk], A, B[:, s:s + chunk], C[:, s:s + chunk], state)
        ys.append(y)
    return torch.cat(ys, dim=1), state


def check_ssd_scan(device: torch.device, w: Widths, dtype: str) -> dict[str, float]:
    """`hybrid.ops.ssd_scan` over `w.scan_len` positions (a partial last chunk) from a given state, against
    `ssd_scan_float64`: {"y": error, "final_state": error}."""
    from hybrid import ops

    x, dt, A, B, C, state = _ssd_inputs(w, w.scan_len, DTYPES[dtype], seed=1)
    want_y, want_state = ssd_scan_float64(x, dt, A, B, C, w.chunk, state)
    y, final = ops.ssd_scan(*(t.to(device) for t in (x, dt, A, B, C)), w.chunk, state.to(device))
    return {"y": rel_error(y, want_y), "final_state": rel_error(final, want_state)}


def check_ssd_step(device: torch.device, w: Widths, dtype: str) -> dict[str, float]:
    """`hybrid.ops.ssd_step` (fp32 state updated in place) against one position of `ssd_scan_float64` (the
    specification's chunk at length 1: the same recurrence)."""
    from hybrid import ops

    x, dt, A, B, C, state = _ssd_inputs(w, 1, DTYPES[dtype], seed=2)
    want_y, want_state = ssd_scan_float64(x, dt, A, B, C, 1, state)
    on_device = state.to(device)
    y = ops.ssd_step(x[:, 0].to(device), dt[:, 0].to(device), A.to(device), B[:, 0].to(device), C[:, 0].to(device),
                     on_device)
    return {"y": rel_error(y, want_y[:, 0]), "state": rel_error(on_device, want_state)}


def check_conv_step(device: torch.device, w: Widths, dtype: str) -> dict[str, float]:
    """`hybrid.ops.conv_step` (conv + SiLU, window rolled in place) over `w.conv_dim` channels against
    `hybrid.ops.conv1d.causal_conv1d_update` in float64; the rolled window must be exact."""
    from hybrid import ops
    from hybrid.ops import conv1d

    g = torch.Generator().manual_seed(3)
    dt = DTYPES[dtype]
    x = torch.randn(4, w.conv_dim, generator=g).to(dt)
    window = torch.randn(4, w.conv_dim, w.conv_kernel - 1, generator=g).to(dt)
    weight = (torch.randn(w.conv_dim, w.conv_kernel, generator=g) * 0.5).to(dt)
    bias = torch.randn(w.conv_dim, generator=g).to(dt)
    want_window = window.double()
    want = conv1d.causal_conv1d_update(x.double(), want_window, weight.double(), bias.double())
    on_device = window.to(device)
    out = ops.conv_step(x.to(device), on_device, weight.to(device), bias.to(device))
    return {"out": rel_error(out, want), "window": rel_error(on_device, want_window)}


def _ssd_step_float64(x, dt, A, B, C, state):
    """One recurrent SSD step in float64 (state updated in place): x [b, h, p], dt [b, h], A [h], B / C [b, g, n],
    state [b, h, p, n] -> y [b, h, p] (without the D skip); head i reads group i // (h / g)."""
    heads = x.shape[1] // B.shape[1]
    Bh, Ch = (t.double().repeat_interleave(heads, 1)[:, :, None, :] for t in (B, C))
    dt = dt.double()
    state.mul_(torch.exp(dt * A.double())[..., None, None]).add_((x.double() * dt[..., None])[..., None] * Bh)
    return (state * Ch).sum(-1)


def check_mamba_decode_step(device: torch.device, w: Widths, dtype: str) -> dict[str, float]:
    """`hybrid.ops.mamba_decode_step` (this project's Triton kernels on a GPU: conv step and SSD step over the
    state slots) for `w.batch` sequences in rows of a pool of twice as many, in a scrambled order, against the
    specification (`hybrid.ops.decode`) in float64; rows of other sequences must stay as they were."""
    from hybrid.ops import conv1d, decode, mamba_decode_step

    g = torch.Generator().manual_seed(7)
    dt_ = DTYPES[dtype]
    S, R, nh, P, N, G, K = w.batch, 2 * w.batch, w.heads, w.head_dim, w.state, w.groups, w.conv_kernel
    xBC = torch.randn(S, w.conv_dim, generator=g).to(dt_)
    dt = torch.randn(S, nh, generator=g).to(dt_)
    conv = torch.randn(R, w.conv_dim, K - 1, generator=g).to(dt_)
    state = torch.randn(R, nh, P, N, generator=g)
    index = torch.randperm(R, generator=g)[:S]
    weight = (torch.randn(w.conv_dim, K, generator=g) * 0.5).to(dt_)
    bias = torch.randn(w.conv_dim, generator=g).to(dt_)
    dt_bias, A, D = torch.randn(nh, generator=g), -torch.rand(nh, generator=g) * 4, torch.randn(nh, generator=g)
    limit = (0.0, float("inf"))
    want_conv, want_state = conv.double(), state.double()
    want = decode.mamba_decode_step(xBC.double(), dt.double(), want_conv, want_state, index, weight.double(),
                                    bias.double(), dt_bias.double(), A.double(), D.double(), limit, nh * P, G,
                                    conv1d.causal_conv1d_update, _ssd_step_float64)
    on = {n: t.to(device) for n, t in dict(conv=conv, state=state).items()}
    y = mamba_decode_step(xBC.to(device), dt.to(device), on["conv"], on["state"], index.to(device), weight.to(device),
                          bias.to(device), dt_bias.to(device), A.to(device), D.to(device), limit, nh * P, G)
    others = [r for r in range(R) if r not in index.tolist()]
    untouched = torch.equal(on["state"][others].cpu(), state[others]) and torch.equal(on["conv"][others].cpu(), conv[others])
    return {"y": rel_error(y, want), "state": rel_error(on["state"], want_state),
            "window": rel_error(on["conv"], want_conv), "other rows": 0.0 if untouched else float("inf")}


def check_mamba_chunks(device: torch.device, w: Widths, dtype: str) -> dict[str, float]:
    """`hybrid.ops.mamba_chunks` (this project's Triton kernels on a GPU, the recurrent and the chunked form of the
    SSD) for two prompt chunks of `w.scan_len` and 5 tokens packed in one row, their states continued from rows of
    a pool in a scrambled order, against the specification (`hybrid.ops.prefill.mamba_chunks`) in float64 (its
    scan sums in fp32)."""
    from hybrid.ops import conv1d, mamba_chunks, prefill, ssd

    g = torch.Generator().manual_seed(8)
    dt_ = DTYPES[dtype]
    lengths = [w.scan_len, 5]
    L, R, nh, P, N, G, K = sum(lengths), 4, w.heads, w.head_dim, w.state, w.groups, w.conv_kernel
    xBC = torch.randn(L, w.conv_dim, generator=g).to(dt_)
    dt = torch.randn(L, nh, generator=g).to(dt_)
    conv = torch.randn(R, w.conv_dim, K - 1, generator=g).to(dt_)
    state = torch.randn(R, nh, P, N, generator=g)
    index, starts, n = torch.tensor([3, 1]), torch.tensor([0, lengths[0]]), torch.tensor(lengths)
    weight = (torch.randn(w.conv_dim, K, generator=g) * 0.5).to(dt_)
    bias = torch.randn(w.conv_dim, generator=g).to(dt_)
    dt_bias, A, D = torch.randn(nh, generator=g), -torch.rand(nh, generator=g) * 4, torch.randn(nh, generator=g)
    limit = (0.0, float("inf"))
    want_conv, want_state = conv.double(), state.double()
    want = prefill.mamba_chunks(xBC.double(), dt.double(), want_conv, want_state, starts, n, index, weight.double(),
                                bias.double(), dt_bias.double(), A.double(), D.double(), limit, nh * P, G, w.chunk,
                                conv1d.causal_conv1d, ssd.ssd_scan)
    errors = {}
    for form, max_length in (("recurrent", None), ("chunked", max(lengths))):  # on the GPU path: both SSD forms
        on = {name: t.to(device, copy=True) for name, t in dict(conv=conv, state=state).items()}
        y = mamba_chunks(xBC.to(device), dt.to(device), on["conv"], on["state"], starts.to(device), n.to(device),
                         index.to(device), weight.to(device), bias.to(device), dt_bias.to(device), A.to(device),
                         D.to(device), limit, nh * P, G, w.chunk, max_length=max_length)
        errors.update({f"y {form}": rel_error(y, want), f"state {form}": rel_error(on["state"], want_state),
                       f"window {form}": rel_error(on["conv"], want_conv)})
    return errors


def check_mamba_scan(device: torch.device, w: Widths, dtype: str) -> dict[str, float]:
    """`hybrid.ops.mamba_scan`, the forward without a cache (this project's Triton kernels on a GPU without
    mamba-ssm, mamba-ssm's chunked scan with it), over `w.batch` rows of `w.scan_len` positions, the second row
    left-padded by 7, against the specification (`hybrid.ops.prefill.mamba_scan`) in float64 at the real
    positions."""
    from hybrid.ops import conv1d, mamba_scan, prefill

    g = torch.Generator().manual_seed(9)
    dt_ = DTYPES[dtype]
    b, T, nh, P, G, K = w.batch, w.scan_len, w.heads, w.head_dim, w.groups, w.conv_kernel
    xBC = torch.randn(b, T, w.conv_dim, generator=g).to(dt_)
    dt = torch.randn(b, T, nh, generator=g).to(dt_)
    mask = torch.ones(b, T, dtype=torch.bool)
    mask[-1, :7] = False
    weight = (torch.randn(w.conv_dim, K, generator=g) * 0.5).to(dt_)
    bias = torch.randn(w.conv_dim, generator=g).to(dt_)
    dt_bias, A, D = torch.randn(nh, generator=g), -torch.rand(nh, generator=g) * 4, torch.randn(nh, generator=g)
    limit = (0.0, float("inf"))
    want = prefill.mamba_scan(xBC.double(), dt.double(), weight.double(), bias.double(), dt_bias.double(), A.double(),
                              D.double(), limit, nh * P, G, w.chunk, conv1d.causal_conv1d, ssd_scan_float64, mask)
    y = mamba_scan(xBC.to(device), dt.to(device), weight.to(device), bias.to(device), dt_bias.to(device),
                   A.to(device), D.to(device), limit, nh * P, G, w.chunk, mask=mask.to(device))
    return {"y": rel_error(y.cpu()[mask], want[mask])}


def check_rms_norm(device: torch.device, w: Widths, dtype: str) -> dict[str, float]:
    """`hybrid.ops.rms_norm` over `w.hidden` against `hybrid.ops.norm.rms_norm` in float64."""
    from hybrid import ops
    from hybrid.ops import norm

    g = torch.Generator().manual_seed(4)
    dt = DTYPES[dtype]
    x = (torch.randn(w.batch, 5, w.hidden, generator=g) * 3).to(dt)
    weight = (1 + 0.1 * torch.randn(w.hidden, generator=g)).to(dt)
    want = norm.rms_norm(x.double(), weight.double(), 1e-5)
    return {"out": rel_error(ops.rms_norm(x.to(device), weight.to(device), 1e-5), want)}


def check_gated_rms_norm(device: torch.device, w: Widths, dtype: str) -> dict[str, float]:
    """`hybrid.ops.gated_rms_norm` (x fp32 from the scan, z and the weight in `dtype`, out in `dtype`) over
    `w.heads * w.head_dim` in `w.groups` groups against `hybrid.ops.norm.gated_rms_norm` in float64."""
    from hybrid import ops
    from hybrid.ops import norm

    g = torch.Generator().manual_seed(5)
    dt, d = DTYPES[dtype], w.heads * w.head_dim
    x = torch.randn(w.batch, 5, d, generator=g) * 2
    z = torch.randn(w.batch, 5, d, generator=g).to(dt)
    weight = (1 + 0.1 * torch.randn(d, generator=g)).to(dt)
    want = norm.gated_rms_norm(x.double(), z.double(), weight.double(), w.groups, 1e-5, torch.float64)
    got = ops.gated_rms_norm(x.to(device), z.to(device), weight.to(device), w.groups, 1e-5, dt)
    return {"out": rel_error(got, want)}


def check_attention(device: torch.device, w: Widths, dtype: str) -> dict[str, float]:
    """One decode step of an attention layer (`hybrid.layers.attention.Attention`, hidden `w.hidden`, GQA
    `w.q_heads` / `w.kv_heads` of `w.attn_head_dim`) for `w.batch` sequences packed in one step, each over
    `w.keys - 1` cached positions in the engine's paged KV blocks, against the same layer in float64
    (projections, grouped softmax attention with scale hd^-0.5, output projection)."""
    from hybrid.config import HybridConfig
    from hybrid.layers.attention import Attention
    from hybrid.serving.blocks import BlockPool
    from hybrid.serving.paged_cache import PagedCache, ScheduledSeq
    from hybrid.serving.slots import StateSlots

    g = torch.Generator().manual_seed(6)
    dt = DTYPES[dtype]
    nq, nkv, hd, H, S, b = w.q_heads, w.kv_heads, w.attn_head_dim, w.hidden, w.keys, w.batch
    config = HybridConfig.from_dict(dict(hybrid_override_pattern="*", hidden_size=H, num_attention_heads=nq,
                                         num_key_value_heads=nkv, head_dim=hd, vocab_size=32))
    layer = Attention(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    layer = layer.to(dt)
    x = torch.randn(b, 1, H, generator=g).to(dt)
    k_past, v_past = (torch.randn(b, nkv, S - 1, hd, generator=g).to(dt) for _ in range(2))

    W = {n: p.detach().double() for n, p in layer.named_parameters()}
    x64 = x[:, 0].double()
    q = (x64 @ W["q_proj.weight"].T).view(b, nkv, nq // nkv, hd)  # query head i reads KV head i // (nq / nkv)
    keys = torch.cat([k_past.double(), (x64 @ W["k_proj.weight"].T).view(b, nkv, 1, hd)], dim=2)
    values = torch.cat([v_past.double(), (x64 @ W["v_proj.weight"].T).view(b, nkv, 1, hd)], dim=2)
    attn = torch.softmax(q @ keys.transpose(-1, -2) * hd ** -0.5, dim=-1) @ values  # [b, nkv, nq / nkv, hd]
    want = attn.reshape(b, nq * hd) @ W["o_proj.weight"].T

    layer = layer.to(device)
    per = -(-S // 16)
    blocks = BlockPool(config, b * per, 16, dt, device)
    cache = PagedCache(config, blocks, StateSlots(config, 1, dt, device))
    cache.schedule([ScheduledSeq(list(range(s * per, (s + 1) * per)), 0, S - 1, 1) for s in range(b)])
    for s in range(b):  # the cached positions' keys and values into each sequence's blocks
        rows = cache.position_index(s)[:S - 1]
        blocks.k[0].flatten(0, 1)[rows] = k_past[s].transpose(0, 1).to(device)
        blocks.v[0].flatten(0, 1)[rows] = v_past[s].transpose(0, 1).to(device)
    got = layer(x.to(device).reshape(1, b, H), cache.begin(1, b, None), cache.layer(0))[0]
    return {"out": rel_error(got, want)}


def _routing(T: int, w: Widths, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, ids [T, k] int64): distinct experts per token, about a quarter of the pairs (and, in
    a batch, every pair of the first token) pointing outside [0, E) (negative or >= E: other ranks' experts)."""
    E, k = w.experts, w.top_k
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    far = torch.where(torch.rand(T, k, generator=g) < 0.5, -1 - torch.randint(0, E, (T, k), generator=g),
                      E + torch.randint(0, E, (T, k), generator=g))
    elsewhere = torch.rand(T, k, generator=g) < 0.25
    if T == 1:
        elsewhere[0] = torch.arange(k) % 2 == 1  # one token: every other pair elsewhere, the first one here
    else:
        elsewhere[0] = True  # a token with no expert here: a zero row
    return torch.rand(T, k, generator=g), torch.where(elsewhere, far, ids)


def _experts_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, E: int, expert) -> torch.Tensor:
    """sum over the pairs (t, j) with ids[t, j] in [0, E) of weights[t, j] * down(relu(up(x[t])) ** 2), in float64
    on x's device; `expert(e)` -> (up [I, L], down [L, I]) float64."""
    x = x.double()
    want = torch.zeros_like(x)
    inside = (ids >= 0) & (ids < E)
    for e in sorted(set(ids[inside].tolist())):
        t, j = (ids == e).nonzero(as_tuple=True)
        up, down = expert(e)
        h = torch.relu(x[t] @ up.T) ** 2
        want.index_add_(0, t, weights[t, j].double()[:, None] * (h @ down.T))
    return want


def check_experts(device: torch.device, w: Widths, dtypes: list[str]) -> list[dict]:
    """The routed experts (`moe.experts`): a float `ExpertBank` in bf16, and `QuantExpertBank.from_bank` of it in
    FP8 / NVFP4 / MXFP4 run with inputs in each of `dtypes` (the fused Triton path on CUDA for all three), over
    one token and `w.tokens` tokens with ids outside [0, E), against float64 (the bank's own bf16 or dequantized
    weights). One result per (bank, dtype)."""
    from torch import nn

    from moe.experts import ExpertBank, QuantExpertBank
    from moe.quant.config import modelopt_format

    E, L, I = w.experts, w.hidden, w.intermediate
    gen = torch.Generator(device=device).manual_seed(7)
    with torch.device("meta"):
        bank = ExpertBank(E, L, I)
    bank.up_proj = nn.Parameter(torch.randn(E, I, L, generator=gen, device=device).mul_(L ** -0.5)
                                .to(torch.bfloat16), requires_grad=False)
    bank.down_proj = nn.Parameter(torch.randn(E, L, I, generator=gen, device=device).mul_(I ** -0.5)
                                  .to(torch.bfloat16), requires_grad=False)
    g = torch.Generator().manual_seed(8)
    cases = []  # (x fp32 [T, L], weights, ids) on the device
    for T in (1, w.tokens):
        x = torch.randn(T, L, generator=g)
        weights, ids = _routing(T, w, g)
        cases.append((x.to(device), weights.to(device), ids.to(device)))

    def run(module, dt, expert) -> dict[str, float]:
        errors = {}
        for x, weights, ids in cases:
            x = x.to(dt)
            want = _experts_reference(x, weights, ids, E, expert)
            errors[f"{x.shape[0]} token{'s' if x.shape[0] > 1 else ''}"] = rel_error(module(x, weights, ids), want)
        return errors

    results = [_guarded("experts float", "bf16", TOLERANCE["bf16"], lambda: run(
        bank, torch.bfloat16, lambda e: (bank.up_proj[e].double(), bank.down_proj[e].double())))]
    for name, algo in (("fp8", "FP8"), ("nvfp4", "NVFP4"), ("mxfp4", "MXFP4")):
        fmt = modelopt_format(algo)
        try:
            amax = torch.ones(E, device=device)
            packed = QuantExpertBank.from_bank(bank, fmt, fmt, amax, amax)
        except Exception as e:  # noqa: BLE001
            results += [_result(f"experts {name}", d, None, TOLERANCE[d], one_line(e)) for d in dtypes]
            continue

        def expert(e, q=packed):
            return q.up_proj.dequantize(torch.float64, expert=e), q.down_proj.dequantize(torch.float64, expert=e)

        for d in dtypes:
            results.append(_guarded(f"experts {name}", d, TOLERANCE[d],
                                    lambda d=d, q=packed, f=expert: run(q, DTYPES[d], f)))
        del packed
        _free(device)
    del bank
    _free(device)
    return results


# name -> check(device, widths, dtype) -> {output: relative error}; the experts have their own (`check_experts`)
# the checks of another package's kernels (they run only where it imports): check -> package
OPTIONAL_PACKAGE_CHECKS = {"ssd_scan": "mamba-ssm", "ssd_step": "mamba-ssm", "conv_step": "causal-conv1d"}
KERNEL_CHECKS = {"ssd_scan": check_ssd_scan, "ssd_step": check_ssd_step, "conv_step": check_conv_step,
                 "mamba_decode_step": check_mamba_decode_step, "mamba_chunks": check_mamba_chunks,
                 "mamba_scan": check_mamba_scan,
                 "rms_norm": check_rms_norm, "gated_rms_norm": check_gated_rms_norm, "attention": check_attention}


@torch.inference_mode()
def check_kernels(device: torch.device, w: Widths, dtypes: list[str]) -> list[dict]:
    """Every kernel check (`KERNEL_CHECKS` for each of `dtypes`, then `check_experts`) on `device` at widths `w`:
    a list of results {check, dtype, error, tolerance, pass, outputs[, exception]}."""
    from hybrid import ops
    from moe.quant.kernels import backend

    results = []
    for name, check in KERNEL_CHECKS.items():
        for d in dtypes:
            package = OPTIONAL_PACKAGE_CHECKS.get(name)
            if package is not None and backend.gpu_path_on(device) and ops.import_error(package) is not None:
                results.append({"check": name, "dtype": d, "error": None, "tolerance": TOLERANCE[d], "pass": True,
                                "outputs": {}, "skipped": f"{package} is not installed (optional: this project's "
                                                          "kernels run without it)"})
                log(f"  {name:16} {d:5} skipped: {results[-1]['skipped']}")
                continue
            results.append(_guarded(name, d, TOLERANCE[d], lambda c=check, d=d: c(device, w, d)))
            r = results[-1]
            log(f"  {name:16} {d:5} error {_fmt(r['error']):>9} (tolerance {r['tolerance']:g}): "
                f"{'pass' if r['pass'] else 'FAIL ' + r.get('exception', '')}")
    _sync(device)
    for r in check_experts(device, w, dtypes):
        results.append(r)
        log(f"  {r['check']:16} {r['dtype']:5} error {_fmt(r['error']):>9} (tolerance {r['tolerance']:g}): "
            f"{'pass' if r['pass'] else 'FAIL ' + r.get('exception', '')}")
    return results


# ---------------------------------------------------------------------------------------------- 3. model, 4. engine
def prompts(tokenizer) -> tuple[list[int], list[list[int]]]:
    """(the model check's prompt: the text's first 100 tokens, BOS first; the engine's 8 prompts of
    `ENGINE_PROMPT_LENGTHS`, each from its own offset of the text)."""
    ids = tokenizer.encode(PROMPT_TEXT)
    need = max(ENGINE_PROMPT_LENGTHS) + 8 * len(ENGINE_PROMPT_LENGTHS)
    ids = (ids * (need // len(ids) + 1))[:need]  # a text shorter than needed (another tokenizer) repeats
    return ids[:100], [ids[8 * i:8 * i + n] for i, n in enumerate(ENGINE_PROMPT_LENGTHS)]


@torch.inference_mode()
def greedy_logprobs(model, prompt: list[int], steps: int,
                    feed: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding of `steps` tokens after `prompt` on the model's device: (each step's argmax, the
    next-token log-probabilities [steps, V] fp32 on the CPU). With `feed` (teacher forcing) step t+1 continues
    from feed[t] instead of this model's own argmax."""
    cache = model.new_cache(1)
    logits = model(torch.tensor([prompt], device=model.device), cache, logits_to_keep=1)[0, -1]
    tokens, rows = [], []
    for t in range(steps):
        lp = logits.float().log_softmax(-1)
        rows.append(lp.cpu())
        tokens.append(int(lp.argmax()))
        if t < steps - 1:
            nxt = tokens[-1] if feed is None else feed[t]
            logits = model(torch.tensor([[nxt]], device=model.device), cache)[0, -1]
    return tokens, torch.stack(rows)


def compare_greedy(ref_tokens: list[int], ref_lp: torch.Tensor, dev_lp: torch.Tensor, tie_gap: float,
                   kl_tol: tuple[float, float]) -> dict:
    """The model check of one checkpoint: the device's log-probabilities [steps, V], computed on the reference's
    tokens, against the reference's. Each step's argmax must be the reference's token, except where the
    reference's top-2 gap is below `tie_gap` (excused); KL(ref || device) per step, its mean and max within
    `kl_tol` (mean, max)."""
    ref_lp, dev_lp = ref_lp.double(), dev_lp.double()
    dev_tokens = dev_lp.argmax(-1).tolist()
    top2 = ref_lp.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    differ = [t for t, (a, b) in enumerate(zip(dev_tokens, ref_tokens)) if a != b]
    excused = [t for t in differ if gaps[t] < tie_gap]
    p = ref_lp.exp()
    kl = torch.where(p > 0, p * (ref_lp - dev_lp), torch.zeros_like(p)).sum(-1)  # [steps]
    kl = kl.clamp(min=0.0)  # a KL is >= 0; below it only rounding noise of equal distributions
    kl_mean, kl_max = float(kl.mean()), float(kl.max())
    tokens_ok = len(differ) == len(excused)
    return {"steps": len(ref_tokens), "tokens_equal": not differ, "differing_steps": differ, "excused_steps": excused,
            "tie_gap": tie_gap, "kl_mean": _json_float(kl_mean), "kl_max": _json_float(kl_max),
            "kl_tolerance": {"mean": kl_tol[0], "max": kl_tol[1]}, "reference_tokens": ref_tokens,
            "device_tokens": dev_tokens,
            "pass": tokens_ok and kl_mean <= kl_tol[0] and kl_max <= kl_tol[1]}


@torch.inference_mode()
def engine_tokens(model, prompt_list: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """The prompts together through an `Engine` (8 sequences, 64 tokens per forward: chunked prefills packed with
    decodes), greedy, no stop ids: (each request's tokens, the top-2 log-prob gap at each of its tokens)."""
    from hybrid.sampling import SamplingParams
    from hybrid.serving.engine import Engine

    engine = Engine(model, num_blocks=128, max_num_seqs=len(prompt_list), max_num_batched_tokens=64)
    sampling = SamplingParams(temperature=0, logprobs=2)
    ids = [engine.add_request(p, sampling, max_tokens=max_tokens) for p in prompt_list]
    tokens = {i: [] for i in ids}
    gaps = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            gaps[out.request_id] += [lp.top_logprobs[0] - lp.top_logprobs[1] for lp in out.logprobs or []]
    return [tokens[i] for i in ids], [gaps[i] for i in ids]


def compare_engine(ref_tokens: list[list[int]], ref_gaps: list[list[float]], got: list[list[int]],
                   tie_gap: float) -> dict:
    """Each request's tokens on the device against the reference's; a request that differs first where the
    reference's top-2 gap is below `tie_gap` is excused."""
    rows = []
    for ref, gaps, dev in zip(ref_tokens, ref_gaps, got):
        first = next((t for t, (a, b) in enumerate(zip(ref, dev)) if a != b), None)
        if first is None and len(ref) != len(dev):
            first = min(len(ref), len(dev))
        excused = first is not None and first < len(gaps) and gaps[first] < tie_gap
        rows.append({"equal": first is None, "first_difference": first, "excused": excused,
                     "reference": ref, "device": dev})
    return {"requests": len(rows), "equal": sum(r["equal"] for r in rows), "excused": sum(r["excused"] for r in rows),
            "tie_gap": tie_gap, "pass": all(r["equal"] or r["excused"] for r in rows), "rows": rows}


def reference_worker(spec_path: Path) -> int:
    """The CPU reference (run in a subprocess with HYBRID_CPU_KERNELS=0): the quantized copies, each
    checkpoint's greedy tokens and log-probabilities, and the engine's tokens; saved to spec["out"]."""
    import hybrid
    from hybrid.quantize import quantize_checkpoint

    spec = json.loads(spec_path.read_text())
    model, tokenizer = hybrid.load(spec["source"], dtype=spec["dtype"], progress=False)
    prompt, engine_prompts = prompts(tokenizer)
    for fmt, dst in spec["quantized"].items():
        log(f"reference: quantizing to {fmt} ...")
        quantize_checkpoint(spec["source"], dst, fmt, calibration=[torch.tensor([prompt])])
    out = {"prompt": prompt, "engine_prompts": engine_prompts, "model": {}}
    for name, path in spec["checkpoints"].items():
        m = model if path == spec["source"] else hybrid.load_model(path, dtype=spec["dtype"], progress=False)
        tokens, lp = greedy_logprobs(m, prompt, spec["steps"])
        out["model"][name] = {"tokens": tokens, "logprobs": lp}
    log("reference: the engine ...")
    out["engine_tokens"], out["engine_gaps"] = engine_tokens(model, engine_prompts, spec["steps"])
    save_reference(out, Path(spec["out"]))
    return 0


def save_reference(out: dict, path: Path) -> None:
    """The reference's result as safetensors (each checkpoint's log-probabilities) with the rest as JSON in its
    metadata: nothing pickled crosses between the processes."""
    from safetensors.torch import save_file

    from hybrid.atomic import atomic_path

    tensors = {name: r["logprobs"].contiguous() for name, r in out["model"].items()}
    rest = {**out, "model": {name: {"tokens": r["tokens"]} for name, r in out["model"].items()}}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"reference": json.dumps(rest)})


def load_reference(path: Path) -> dict:
    """`save_reference`'s result, read back."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        out = json.loads(f.metadata()["reference"])
        for name, r in out["model"].items():
            r["logprobs"] = f.get_tensor(name)
    return out


class Reference:
    """The CPU reference, computed in a subprocess (HYBRID_CPU_KERNELS=0, no CUDA device, HYBRID_BACKEND unset)
    while this process runs the kernel checks; `result()` waits for it."""

    def __init__(self, workdir: Path, dtype: str, steps: int):
        from hybrid.cli import DEFAULT_CHECKPOINT

        self.workdir = workdir
        self.checkpoints = {"bf16": str(DEFAULT_CHECKPOINT)}
        self.checkpoints.update({f: str(workdir / f"checkpoint-{f}") for f in QUANT_FORMATS})
        spec = {"source": str(DEFAULT_CHECKPOINT), "quantized": {f: self.checkpoints[f] for f in QUANT_FORMATS},
                "checkpoints": self.checkpoints, "dtype": dtype, "steps": steps,
                "out": str(workdir / "reference.safetensors")}
        write_json(workdir / "spec.json", spec)
        env = {k: v for k, v in os.environ.items() if k not in ("HYBRID_BACKEND", "TRITON_INTERPRET")}
        env.update(HYBRID_CPU_KERNELS="0", CUDA_VISIBLE_DEVICES="")
        self.log_path = workdir / "reference.log"
        with self.log_path.open("a") as log_file:  # a fresh temporary directory: the log starts empty
            command = [sys.executable, __file__, "--reference-worker", str(workdir / "spec.json")]
            self.process = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT)

    def result(self) -> dict:
        """The reference's output. Raises RuntimeError (with its log's tail) when the subprocess failed."""
        code = self.process.wait()
        if code != 0:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-15:]
            raise RuntimeError(f"the CPU reference failed (exit {code}):\n" + "\n".join(tail))
        return load_reference(self.workdir / "reference.safetensors")

    def stop(self) -> None:
        """End the subprocess if it is still running (this run failed or was interrupted before waiting)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def check_models(device: torch.device, ref: dict, checkpoints: dict[str, str], dtype: str) -> list[dict]:
    """Step 3 (see the module docstring): each checkpoint on `device`, fed the reference's tokens."""
    import hybrid

    results = []
    for name, path in checkpoints.items():
        r = ref["model"][name]
        try:
            model = hybrid.load_model(path, dtype=dtype, device=device, progress=False)
            _, lp = greedy_logprobs(model, ref["prompt"], len(r["tokens"]), feed=r["tokens"])
            res = {"checkpoint": name, **compare_greedy(r["tokens"], r["logprobs"], lp, TIE_GAP[dtype],
                                                        KL_TOLERANCE[dtype])}
            del model
        except Exception as e:  # noqa: BLE001
            res = {"checkpoint": name, "pass": False, "exception": one_line(e)}
        _free(device)
        results.append(res)
        log(f"  {name:6} tokens {'equal' if res.get('tokens_equal') else 'differ'}, KL mean {_fmt(res.get('kl_mean'))} "
            f"max {_fmt(res.get('kl_max'))}: {'pass' if res['pass'] else 'FAIL ' + res.get('exception', '')}")
    return results


@torch.inference_mode()
def layer_syncs(model, prompt_list: list[list[int]]) -> dict | None:
    """The host synchronisations of one decode step of 16 sampled sequences on CUDA, counted by torch's sync
    debug mode (`torch.cuda.set_sync_debug_mode("warn")`: one warning per synchronising call): inside the model's
    layers (none expected: the step's index tensors are made before them) and in the whole step (the sampled
    ids' one transfer, the step's copies to the device). None off CUDA."""
    import warnings

    from hybrid.sampling import SamplingParams
    from hybrid.serving.engine import Engine

    if model.device.type != "cuda":
        return None
    engine = Engine(model, num_blocks=320, max_num_seqs=16, max_num_batched_tokens=4096)
    for i in range(16):
        engine.add_request(prompt_list[i % len(prompt_list)], SamplingParams(temperature=0.8, top_p=0.9, seed=i),
                           max_tokens=8)
    while engine.last_step.num_tokens != 16 or engine.last_step.num_decode_tokens != 16:
        engine.step()  # the prompts, then decode steps until one is a pure decode step of 16 (kernels warmed)
    marks: list[tuple[int, int]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hooks = [h for layer in model.backbone.layers for h in (
            layer.register_forward_pre_hook(lambda *_: marks.append((len(caught), -1))),
            layer.register_forward_hook(lambda *_: marks.append((marks.pop()[0], len(caught)))))]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            for h in hooks:
                h.remove()
    inside = [i for i in range(len(caught)) if any(a <= i < b for a, b in marks)]
    return {"in_layers": len(inside), "in_step": len(caught), "decode_seqs": engine.last_step.num_seqs,
            "first_in_layers": [str(caught[i].message)[:200] for i in inside[:3]]}


def check_engine(device: torch.device, ref: dict, source: str, dtype: str) -> dict:
    """Step 4 (see the module docstring): the engine on `device` against the CPU engine's tokens."""
    import hybrid

    try:
        model = hybrid.load_model(source, dtype=dtype, device=device, progress=False)
        got, _ = engine_tokens(model, ref["engine_prompts"], len(ref["engine_tokens"][0]))
        res = compare_engine(ref["engine_tokens"], ref["engine_gaps"], got, TIE_GAP[dtype])
        res["prompt_lengths"] = [len(p) for p in ref["engine_prompts"]]
        res["syncs"] = layer_syncs(model, ref["engine_prompts"])
        if res["syncs"] is not None:
            res["pass"] = res["pass"] and res["syncs"]["in_layers"] == 0
            log(f"  a decode step of 16: {res['syncs']['in_layers']} host synchronisations inside the layers, "
                f"{res['syncs']['in_step']} in the whole step")
    except Exception as e:  # noqa: BLE001
        res = {"pass": False, "exception": one_line(e)}
    _free(device)
    log(f"  {res.get('equal', 0)} of {res.get('requests', len(ref['engine_prompts']))} requests equal "
        f"({res.get('excused', 0)} excused): {'pass' if res['pass'] else 'FAIL ' + res.get('exception', '')}")
    return res


# ---------------------------------------------------------------------------------------------- 5. timings
def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second moved (read + written) by a `nbytes` device-to-device copy: the median of `repeats`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        samples.append(2 * nbytes / (time.perf_counter() - start))
    return statistics.median(samples)


def run_timings(device: torch.device, small: bool, workdir: Path, repeats: int) -> dict:
    """Step 5 (see the module docstring). Figures only: nothing here passes or fails."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench

    import hybrid
    from hybrid.accounting import describe
    from hybrid.config import HybridConfig
    from hybrid.generate import generate_ids

    preset = "tiny" if small else "nano-slice"
    prefill, decode_tokens, batches, prompt_len = (256, 8, (1, 4), 32) if small else (2048, 64, (1, 16), 32)
    log(f"timings: the {preset} checkpoint under {workdir} (built once) ...")
    directory = bench.make_checkpoint(preset, workdir)
    config = HybridConfig.from_file(directory / "config.json")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = hybrid.load_model(directory, dtype="bf16", device=device, progress=False)
    vocab = config.vocab_size

    def timed(prompt_list, new):
        _sync(device)
        start = time.perf_counter()
        generate_ids(model, prompt_list, max_new_tokens=new)  # reads every token back: synchronised
        _sync(device)
        return time.perf_counter() - start

    out = {"checkpoint": preset, "dtype": "bf16", "repeats": repeats, "decode_tokens": decode_tokens,
           "decode_prompt_tokens": prompt_len, "decode": {}}
    for B in batches:
        prompt_list = [bench.random_prompt(prompt_len, vocab, 100 + b) for b in range(B)]
        timed(prompt_list, 4)  # warm-up: kernels compiled and tuned for these shapes
        first = statistics.median(timed(prompt_list, 1) for _ in range(repeats))
        total = statistics.median(timed(prompt_list, decode_tokens + 1) for _ in range(repeats))
        out["decode"][str(B)] = {"tok_s": B * decode_tokens / max(total - first, 1e-9)}
        log(f"  decode batch {B}: {out['decode'][str(B)]['tok_s']:.1f} tok/s")
    long = bench.random_prompt(prefill, vocab, 7)
    timed([long], 1)
    seconds = statistics.median(timed([long], 1) for _ in range(repeats))
    out["prefill"] = {"tokens": prefill, "ttft_s": seconds, "tok_s": prefill / seconds}
    log(f"  prefill {prefill}: {prefill / seconds:.0f} tok/s")
    if device.type == "cuda":
        out["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    else:
        out["peak_rss_bytes"] = bench.peak_rss_bytes()
    del model
    _free(device)
    bandwidth = copy_bandwidth(device, 2**26 if small else 2**30)
    active = describe(config, torch.bfloat16)["active_weight_bytes_per_token"]
    out.update(copy_bandwidth_gb_s=bandwidth / 1e9, active_weight_bytes_per_token=active,
               decode_b1_weight_read_gb_s=out["decode"]["1"]["tok_s"] * active / 1e9,
               decode_b1_roofline_ratio=out["decode"]["1"]["tok_s"] * active / bandwidth)
    log(f"  copy bandwidth {bandwidth / 1e9:.0f} GB/s; batch-1 decode reads weights at "
        f"{out['decode_b1_weight_read_gb_s']:.1f} GB/s ({out['decode_b1_roofline_ratio']:.2f} of it)")
    return out


# ---------------------------------------------------------------------------------------------- main
def write_json(path: Path, content) -> None:
    """Write `content` as JSON to `path` atomically (`hybrid.atomic`: a failed write leaves the previous file)."""
    from hybrid.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(content, indent=1, default=str) + "\n")


def print_summary(report: dict) -> None:
    """One line per check on stdout, then the verdict."""
    env = report["environment"]
    print(f"{env['device']} ({env.get('device_name')}): torch {env['torch']}, CUDA {env['torch_cuda']}, triton "
          f"{env['triton']}, mamba-ssm {env['mamba-ssm']}, causal-conv1d {env['causal-conv1d']}")
    for op, how in env["backends"].items():
        print(f"  {op:34} {how}")
    if "exception" in env:
        print(f"FAIL  environment: {env['exception']}")
    if env["missing_kernel_packages"]:
        print(f"  missing kernel packages: {env['missing_kernel_packages']}"
              + (" (HYBRID_REQUIRE_CUDA_KERNELS=1: fail)" if env["require_cuda_kernels"] else ""))
    if env.get("optional_kernel_packages"):
        print("  optional kernel packages: "
              + ", ".join(f"{p} {how}" for p, how in env["optional_kernel_packages"].items()))
    for r in report.get("kernels", []):
        if "skipped" in r:
            print(f"skip  kernel {r['check']:16} {r['dtype']:5} {r['skipped']}")
            continue
        print(f"{'pass' if r['pass'] else 'FAIL'}  kernel {r['check']:16} {r['dtype']:5} error {_fmt(r['error']):>9} "
              f"tolerance {r['tolerance']:g}" + (f"  {r['exception']}" if "exception" in r else ""))
    for r in report.get("model", []):
        print(f"{'pass' if r['pass'] else 'FAIL'}  model {MODEL_LABELS.get(r['checkpoint'], r['checkpoint']):18} " + (
            f"tokens {'equal' if r['tokens_equal'] else 'differ at ' + str(r['differing_steps'])}"
            f"{' (excused: ' + str(r['excused_steps']) + ')' if r['excused_steps'] else ''}, "
            f"KL mean {_fmt(r['kl_mean'])} max {_fmt(r['kl_max'])}" if "exception" not in r else r["exception"]))
    if "engine" in report:
        e = report["engine"]
        print(f"{'pass' if e['pass'] else 'FAIL'}  engine " + (
            f"{e['equal']} of {e['requests']} requests equal ({e['excused']} excused)" + (
                f"; decode step of 16: {e['syncs']['in_layers']} host synchronisations in the layers, "
                f"{e['syncs']['in_step']} in the step" if e.get("syncs") else "") if "exception" not in e
            else e["exception"]))
    t = report.get("timings")
    if t and "decode" in t:
        print(f"timings ({t['checkpoint']}, bf16): decode " + ", ".join(
            f"b{b} {v['tok_s']:.1f}" for b, v in t["decode"].items()) + f" tok/s; prefill {t['prefill']['tokens']} "
              f"{t['prefill']['tok_s']:.0f} tok/s; copy bandwidth {t['copy_bandwidth_gb_s']:.0f} GB/s, batch-1 "
              f"roofline ratio {t['decode_b1_roofline_ratio']:.2f}")
    elif t:
        print(f"timings: {t.get('skipped') or t.get('exception')}")
    failed = [s for s, ok in report["steps"].items() if not ok]
    print("all checks passed" if not failed else f"FAILED: {', '.join(failed)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (the module docstring is its help)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda; without a CUDA device, give --device cpu --small to check "
                        "the script itself)")
    p.add_argument("--small", action="store_true", help="small widths for the kernel checks (seconds on a CPU)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16", "fp16"],
                   help="dtypes of the kernel checks (default: fp32 bf16 fp16)")
    p.add_argument("--model-dtype", choices=sorted(TIE_GAP), default="fp32",
                   help="dtype of the model and engine checks (default fp32: exact greedy agreement is expected)")
    p.add_argument("--steps", type=int, default=16, help="greedy steps of the model check and engine requests")
    p.add_argument("--timings", action="store_true", help="step 5: speed and memory (only when all checks passed)")
    p.add_argument("--repeats", type=int, default=3, help="timings: the median of this many runs")
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "hybrid-bench",
                   help="timings: where the benchmark checkpoints are built once (shared with scripts/bench.py)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here (atomically)")
    p.add_argument("--reference-worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the steps; 0 when every check passed, 1 otherwise, 2 for bad arguments (one `error:` line)."""
    args = parse_args(argv)
    if args.reference_worker is not None:  # inside the CPU reference's subprocess
        return reference_worker(args.reference_worker)

    from hybrid.devices import resolve_device
    from moe.quant.kernels import backend

    try:
        if args.device is None and not torch.cuda.is_available():
            raise ValueError("no CUDA device is visible: nothing to check on a GPU (`--device cpu --small` checks "
                             "the script itself on the CPU, in seconds)")
        device = resolve_device(args.device)
        backend.triton_on_cpu()  # a bad HYBRID_BACKEND is a usage error too
        if args.steps < 1 or args.repeats < 1:
            raise ValueError("--steps and --repeats must be >= 1")
        if args.timings and device.type == "cpu" and not args.small:
            raise ValueError("--timings on the CPU runs only with --small (its figures are a GPU's)")
        if args.out is not None:
            from hybrid.atomic import check_writable

            check_writable(args.out)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if device.type == "cpu" and not args.small:
        log("note: Nano's widths on a CPU take many minutes and ~10 GB of memory (--small: seconds)")
    signal.signal(signal.SIGTERM, _stop)  # a `timeout` or a kill ends the run through its cleanup
    start = time.perf_counter()
    widths = SMALL if args.small else NANO
    report = {"device": str(device), "small": args.small, "widths": asdict(widths), "dtypes": args.dtypes,
              "model_dtype": args.model_dtype, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "project": _project_version(), "steps": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        log("starting the CPU reference (a subprocess, HYBRID_CPU_KERNELS=0) ...")
        reference = Reference(Path(tmp), args.model_dtype, args.steps)
        try:
            log("1. environment ...")
            report["environment"] = check_environment(device)
            report["steps"]["environment"] = report["environment"]["pass"]

            log(f"2. kernels on {device} ({'small' if args.small else 'Nano'} widths) ...")
            report["kernels"] = check_kernels(device, widths, args.dtypes)
            report["steps"]["kernels"] = all(r["pass"] for r in report["kernels"])

            log("waiting for the CPU reference ...")
            try:
                ref = reference.result()
            except RuntimeError as e:
                log(str(e))
                report["model"] = [{"checkpoint": n, "pass": False, "exception": str(e).splitlines()[0]}
                                   for n in reference.checkpoints]
                report["engine"] = {"pass": False, "exception": str(e).splitlines()[0]}
                report["reference_log"] = str(e)
            else:
                log(f"3. model: the shipped checkpoint and its {', '.join(QUANT_FORMATS)} copies ...")
                report["model"] = check_models(device, ref, reference.checkpoints, args.model_dtype)
                log("4. engine: 8 requests ...")
                report["engine"] = check_engine(device, ref, reference.checkpoints["bf16"], args.model_dtype)
            report["steps"]["model"] = all(r["pass"] for r in report["model"])
            report["steps"]["engine"] = report["engine"]["pass"]
        finally:
            reference.stop()

    if args.timings:
        if all(report["steps"].values()):
            log("5. timings ...")
            try:
                report["timings"] = run_timings(device, args.small, args.workdir, args.repeats)
            except Exception as e:  # noqa: BLE001: figures only, but a crash is reported
                traceback.print_exc()
                report["timings"] = {"exception": one_line(e)}
                report["steps"]["timings"] = False  # figures only, but a step that crashes is not a pass
        else:
            report["timings"] = {"skipped": "a check above failed"}
    report["passed"] = all(report["steps"].values())
    report["wall_s"] = time.perf_counter() - start
    if args.out is not None:
        write_json(args.out, report)
    print_summary(report)
    if args.out is not None:
        print(f"report: {args.out}")
    return 0 if report["passed"] else 1


def _cpu_model() -> str:
    """This CPU's model name (/proc/cpuinfo's "model name"), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _stop(signum, frame) -> None:
    """SIGTERM: leave through the `finally` blocks (the reference subprocess stopped, the temporary directory
    removed)."""
    raise SystemExit(128 + signum)


def _project_version() -> dict:
    """The project's version and, in a git checkout, its commit (a report names what it checked)."""
    try:
        v = version("hybrid-moe")
    except PackageNotFoundError:
        v = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"version": v, "commit": commit}


if __name__ == "__main__":
    sys.exit(main())
