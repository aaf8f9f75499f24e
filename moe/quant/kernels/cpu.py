"""Packed FP8 / NVFP4 / MXFP4 matrix products on the CPU, straight from the packed bytes (`cpu_packed.cpp`;
its bf16 x bf16 dot-product kernel serves `moe.quant.kernels.bf16`).

Each weight is read once per call in its packed form and decoded in registers; no dequantized copy exists,
for any number of input rows (decode: 1 to 16; a 512-token prefill chunk: measured as fast as dequantizing
then multiplying at Nano's widths, NVFP4 faster). The result equals the product with the exactly dequantized
weight up to the order of the fp32 sums (tests/test_cpu_kernels.py, at Nano's widths).

Four paths, chosen at compile time by this CPU's features (`module().path()` names the one built):
"avx512-bf16" (AVX512_BF16 + AVX512_VBMI: bf16 inputs stay bf16, exact bf16 dot products into fp32 sums),
"avx512f" (fp32 FMAs on 16 lanes), "avx2-fma" (AVX2 + FMA + F16C without AVX-512, most desktop and laptop
CPUs: E4M3 decoded through fp16, E2M1 through a byte table and fp16, fp32 FMAs on 8 lanes) and "scalar" (plain
loops, table lookups) elsewhere; inputs are fp32 on all but the first.

The extension is compiled on first use (never at import; a message says so; about 30 s), with -O3
-march=native, into `~/.cache/hybrid/kernels/<name>`, where the name is a digest of the source, the torch
version and install (each virtual environment's torch has its own headers: torch's builder would otherwise
recompile silently on the first use from a new one), and this CPU's feature flags, so a build is never used
for another source, torch or CPU. If it cannot be built (no compiler, no ninja) or `HYBRID_CPU_KERNELS=0` is
set, `module()` is None and the packed modules keep the PyTorch reference (dequantize, then matmul), which
stays tested.
"""

from __future__ import annotations

import contextlib
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
PORTABLE = ("-mno-avx512f",)  # the paths for CPUs without AVX-512 (AVX2 + FMA where this CPU has them)
GRANULARITY = {"tensor": 0, "channel": 1, "block": 2}  # FP8 scale layouts, as the extension numbers them


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_key() -> str:
    """This torch: its version and where it is installed (the headers a build compiles against)."""
    return f"{torch.__version__} {Path(torch.__file__).resolve().parent}"


def build_name(source: bytes, torch_id: str, cpu_flags: str, flags: tuple[str, ...] = FLAGS,
               prefix: str = "hybrid_packed") -> str:
    """The extension's name and cache directory: a digest of what the build depends on (`torch_id`: the
    `torch_key()` of the torch it compiles against)."""
    key = hashlib.sha256(source + " ".join(flags).encode() + torch_id.encode() + cpu_flags.encode())
    return f"{prefix}_{key.hexdigest()[:16]}"


@functools.cache
def module(portable: bool = False):
    """The compiled extension, built on first use; None when it is disabled or cannot be built.
    `portable`: the build without AVX-512 (what a CPU without it runs; tests compare it too)."""
    return build(SOURCE, "hybrid_packed", FLAGS + PORTABLE if portable else FLAGS,
                 "the packed-weight CPU kernels (once for this source, torch and CPU; about 30 s)")


def build(source: Path, prefix: str, flags: tuple[str, ...] = FLAGS, what: str = "a CPU kernel"):
    """Compile the C++ extension `source` on first use into `$HYBRID_CACHE/kernels/<prefix>_<digest>` (the
    digest of `build_name`: never used for another source, torch (`torch_key`) or CPU), saying so once; None when
    `HYBRID_CPU_KERNELS=0` is set or it cannot be built (a warning names why)."""
    if os.environ.get("HYBRID_CPU_KERNELS", "1") == "0":
        return None
    name = build_name(source.read_bytes(), torch_key(), _cpu_flags(), flags, prefix)
    directory = Path(os.environ.get("HYBRID_CACHE", Path.home() / ".cache" / "hybrid")) / "kernels" / name
    try:
        from torch.utils.cpp_extension import load

        directory.mkdir(parents=True, exist_ok=True)
        with _build_lock(directory), _our_ninja_first():
            if not any(directory.glob(f"{name}*.so")):
                print(f"compiling {what} ...", file=sys.stderr, flush=True)
            return load(name=name, sources=[str(source)], extra_cflags=list(flags), extra_ldflags=["-fopenmp"],
                        build_directory=str(directory), verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the PyTorch path is always correct
        warnings.warn(f"{what} unavailable, using the PyTorch path ({type(e).__name__}: {e})", stacklevel=3)
        return None


@contextlib.contextmanager
def _build_lock(directory: Path):
    """Hold an exclusive `flock` on `directory/build.flock` (the OS releases it when its holder dies) and, once
    held, remove torch's own lock file `directory/lock`: torch (`FileBaton`) creates that file while it builds
    and, seeing it, waits for it to go, forever; a build killed midway (Ctrl-C during the first compile) would
    leave it and hang every later start. Under the flock no other process of ours is building, so a `lock`
    found then is stale. Where `fcntl` is missing (not POSIX), torch's lock alone."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(directory / "build.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _our_ninja_first():
    """While torch builds (it runs `ninja` from PATH): PATH with the directory of the `ninja` package that this
    project installs (a dependency) first. Without it, `.venv/bin/hybrid` run without the environment activated
    (or a subprocess with a bare PATH) finds another ninja, or none (no build: the slow PyTorch path); and two
    ninja versions taking turns on one cache directory rebuild from scratch each time the older follows the
    newer (measured: ninja 1.11 after 1.13 recompiled a kernel at every start, 30-70 s each on 2 cores)."""
    try:
        import ninja

        ours = str(Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        yield
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([ours, before]) if before else ours
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def _fp8(ext, xs, ts, fmt):
    scales = [_float32(t["scale"]) for t in ts]  # any shape holding the layout's values in row-major order
    return ext.fp8_linear_group(xs, [t["data"] for t in ts], scales, GRANULARITY[fmt.layout.granularity],
                                fmt.layout.block)


def _nvfp4(ext, xs, ts, fmt):  # compressed-tensors' global divides, ModelOpt's multiplies (`divisor`)
    return ext.fp4_linear_group(xs, [t["data"] for t in ts], [t["scale"] for t in ts], fmt.codec.group, False,
                                [_float32(t["global"]) for t in ts], fmt.layout.divisor)


def _mxfp4(ext, xs, ts, fmt):
    return ext.fp4_linear_group(xs, [t["data"] for t in ts], [t["scale"] for t in ts], fmt.codec.group, True, [], False)


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


KERNELS = {"fp8": _fp8, "nvfp4": _nvfp4, "mxfp4": _mxfp4}  # codec name -> the call into the extension


def supports(fmt) -> bool:
    return fmt is not None and fmt.codec.name in KERNELS


def linear(x: torch.Tensor, weight, expert: int | None = None, ext=None) -> torch.Tensor:
    """x [R, K] (any float dtype) @ dequantize(W).T -> [R, N] float32, from the packed bytes
    of `weight` (a `moe.quant.PackedWeight`; of expert `expert` for a stack). bf16 inputs stay bf16 where the
    CPU has AVX512_BF16 + AVX512_VBMI (exact products in fp32 sums), others are converted to fp32."""
    return linear_group([x], weight, [expert], ext)[0]


def linear_group(xs: list[torch.Tensor], weight, experts: list[int | None], ext=None) -> list[torch.Tensor]:
    """`[linear(x, weight, e) for x, e in zip(xs, experts)]` in one call of the extension: one parallel loop
    over the tiles of every product (the k experts a decoded token chose: one fork of the threads, not k)."""
    ext = ext or module()
    # the packed tensors as stored (the extension reads their bytes; a copy only of one not contiguous)
    ts = [{r: t if t.is_contiguous() else t.contiguous() for r, t in weight.expert(e).items()} for e in experts]
    ready = {}  # one conversion per distinct input (a decoded token's k experts share one x)
    for x in xs:
        if id(x) not in ready:
            ready[id(x)] = kernel_input(x, ext)
    return KERNELS[weight.fmt.codec.name](ext, [ready[id(x)] for x in xs], ts, weight.fmt)


def kernel_input(x: torch.Tensor, ext=None) -> torch.Tensor:
    """x as the extension takes it: contiguous bf16 where it has bf16 dot products (`bf16_inputs()`), else
    contiguous fp32 (x itself when already so)."""
    ext = ext or module()
    return x.contiguous() if x.dtype == torch.bfloat16 and ext.bf16_inputs() else x.float().contiguous()
