"""Packed FP8 / NVFP4 / MXFP4 matrix products on the CPU, straight from the packed bytes (`cpu_packed.cpp`;
its bf16 x bf16 dot-product kernel serves `moe.quant.kernels.bf16`).

Each weight is read once per call in its packed form and decoded in registers; no dequantized copy exists,
for any number of input rows (decode: 1 to 16; a 512-token prefill chunk: measured as fast as dequantizing
then multiplying at Nano's widths, NVFP4 faster). The result equals the product with the exactly dequantized
weight up to the order of the fp32 sums (tests/test_cpu_kernels.py, at Nano's widths).

The extension is compiled on first use (never at import; a message says so; about 30 s), with -O3
-march=native, into `~/.cache/hybrid/kernels/<name>`, where the name is a digest of the source, the torch
version and this CPU's feature flags, so a build is never used for another source, torch or CPU. If it
cannot be built (no compiler, no ninja) or `HYBRID_CPU_KERNELS=0` is set, `module()` is None and the
packed modules keep the PyTorch reference (dequantize, then matmul), which stays tested.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_packed.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp")  # OpenMP: at::parallel_for spreads the weight rows over the threads
PORTABLE = ("-mno-avx512f",)  # the loops for CPUs without AVX-512 (the compiler vectorises them for AVX2)
GRANULARITY = {"tensor": 0, "channel": 1, "block": 2}  # FP8 scale layouts, as the extension numbers them


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_name(source: bytes, torch_version: str, cpu_flags: str, flags: tuple[str, ...] = FLAGS) -> str:
    """The extension's name and cache directory: a digest of what the build depends on."""
    key = hashlib.sha256(source + " ".join(flags).encode() + torch_version.encode() + cpu_flags.encode())
    return f"hybrid_packed_{key.hexdigest()[:16]}"


@functools.cache
def module(portable: bool = False):
    """The compiled extension, built on first use; None when it is disabled or cannot be built.
    `portable`: the build without AVX-512 (what a CPU without it runs; tests compare it too)."""
    if os.environ.get("HYBRID_CPU_KERNELS", "1") == "0":
        return None
    flags = FLAGS + PORTABLE if portable else FLAGS
    name = build_name(SOURCE.read_bytes(), torch.__version__, _cpu_flags(), flags)
    directory = Path(os.environ.get("HYBRID_CACHE", Path.home() / ".cache" / "hybrid")) / "kernels" / name
    try:
        from torch.utils.cpp_extension import load

        directory.mkdir(parents=True, exist_ok=True)
        if not any(directory.glob(f"{name}*.so")):
            print("compiling the packed-weight CPU kernels (once for this source, torch and CPU; about 30 s) ...",
                  file=sys.stderr, flush=True)
        return load(name=name, sources=[str(SOURCE)], extra_cflags=list(flags), extra_ldflags=["-fopenmp"],
                    build_directory=str(directory), verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the PyTorch path is always correct
        warnings.warn(f"packed-weight CPU kernels unavailable, using the PyTorch path ({type(e).__name__}: {e})",
                      stacklevel=2)
        return None


def _fp8(ext, x, data, t, fmt):
    granularity = GRANULARITY[fmt.layout.granularity]
    scale = t["scale"].float().contiguous()
    scale = scale.reshape(-1) if granularity < 2 else scale.reshape(scale.shape[-2], scale.shape[-1])
    return ext.fp8_linear(x, data, scale, granularity, fmt.layout.block)


def _nvfp4(ext, x, data, t, fmt):
    g = float(t["global"].float().reshape(()))
    mult = 1.0 / g if fmt.layout.divisor else g  # compressed-tensors' global scale divides, ModelOpt's multiplies
    return ext.fp4_linear(x, data, t["scale"].contiguous().view(torch.uint8), fmt.codec.group, False, mult)


def _mxfp4(ext, x, data, t, fmt):
    return ext.fp4_linear(x, data.reshape(data.shape[0], -1), t["scale"].contiguous().view(torch.uint8),
                          fmt.codec.group, True, 1.0)


KERNELS = {"fp8": _fp8, "nvfp4": _nvfp4, "mxfp4": _mxfp4}  # codec name -> the call into the extension


def supports(fmt) -> bool:
    return fmt is not None and fmt.codec.name in KERNELS


def linear(x: torch.Tensor, weight, expert: int | None = None, ext=None) -> torch.Tensor:
    """x [R, K] (any float dtype) @ dequantize(W).T -> [R, N] float32, from the packed bytes
    of `weight` (a `moe.quant.PackedWeight`; of expert `expert` for a stack). bf16 inputs stay bf16 where the
    CPU has AVX512_BF16 (exact products in fp32 sums), others are converted to fp32."""
    fmt = weight.fmt
    t = {role: weight.role(role) for role in fmt.roles}
    if expert is not None:
        t = {role: v[expert] for role, v in t.items()}
    data = t["data"].contiguous().view(torch.uint8)
    ext = ext or module()
    x = x.contiguous() if x.dtype == torch.bfloat16 and ext.bf16_inputs() else x.float().contiguous()
    return KERNELS[fmt.codec.name](ext, x, data, t, fmt)
