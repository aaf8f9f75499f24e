"""Packed FP8 / NVFP4 / MXFP4 matrix products on the CPU, straight from the packed bytes (`cpu_packed.cpp`;
its bf16 x bf16 dot-product kernel serves `moe.quant.kernels.bf16`).

Each weight is read once per call in its packed form and decoded in registers; no dequantized copy exists,
for any number of input rows (decode: 1 to 16; a 512-token prefill chunk: no slower than dequantizing then
multiplying at Nano's widths, docs/perf-log.md#packed-prefill). The result equals the product with the exactly
dequantized weight up to the order of the fp32 sums (tests/test_cpu_kernels.py, at Nano's widths).

Four paths, chosen at compile time by this CPU's features (`module().path()` names the one built):
"avx512-bf16" (AVX512_BF16 + AVX512_VBMI: bf16 inputs stay bf16, exact bf16 dot products into fp32 sums),
"avx512f" (fp32 FMAs on 16 lanes), "avx2-fma" (AVX2 + FMA + F16C without AVX-512, most desktop and laptop
CPUs: E4M3 decoded through fp16, E2M1 through a byte table and fp16, fp32 FMAs on 8 lanes) and "scalar" (plain
loops, table lookups) elsewhere; inputs are fp32 on all but the first.

The extension is compiled on first use (never at import: a build takes a while,
docs/perf-log.md#kernel-build-time; a message says so), with -O3 -march=native, into
`~/.cache/hybrid/kernels/<name>`, where the name is a digest of the source, the torch version and install (each
virtual environment's torch has its own headers: torch's builder would otherwise recompile silently on the
first use from a new one), and this CPU's feature flags, so a build is never used for another source, torch or
CPU. If it cannot be built (no compiler, no ninja) or `HYBRID_CPU_KERNELS=0` is set, `module()` is None and the
packed modules keep the PyTorch reference (dequantize, then matmul), which stays tested.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from moe.quant.kernels import amx
# the build's names, here too (`cpu.build`, `cpu.FLAGS`, ...)
from moe.quant.kernels.build import FLAGS, build, build_name, cpu_flags, torch_key  # noqa: F401

SOURCE = Path(__file__).with_name("cpu_packed.cpp")
PORTABLE = ("-mno-avx512f",)  # the paths for CPUs without AVX-512 (AVX2 + FMA where this CPU has them)
GRANULARITY = {"tensor": 0, "channel": 1, "block": 2}  # FP8 scale layouts, as the extension numbers them


@functools.cache
def module(portable: bool = False):
    """The compiled extension, built on first use; None when it is disabled or cannot be built.
    `portable`: the build without AVX-512 (what a CPU without it runs; tests compare it too)."""
    return build(SOURCE, "hybrid_packed", FLAGS + PORTABLE if portable else FLAGS,
                 "the packed-weight kernels")


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
    over the tiles of every product (the k experts a decoded token chose: one fork of the threads, not k). On a
    CPU with AMX, the products `amx.applies` to (bf16 inputs of `amx.MIN_ROWS` rows or more) go to `amx` in one
    call, the rest here; `ext` given (a particular build of this extension): all of them there."""
    tiled = [i for i, x in enumerate(xs) if amx.applies(x, weight.fmt)] if ext is None else []  # on AMX tiles
    ext = ext or module()
    # the packed tensors as stored (the extension reads their bytes; a copy only of one not contiguous)
    ts = [{r: t if t.is_contiguous() else t.contiguous() for r, t in weight.expert(e).items()} for e in experts]
    ys: list[torch.Tensor | None] = [None] * len(xs)
    if tiled:
        for i, y in zip(tiled, amx.linear_group([xs[i] for i in tiled], [ts[i] for i in tiled], weight.fmt)):
            ys[i] = y
    rest = [i for i, y in enumerate(ys) if y is None]  # the register kernels
    ready = {}  # one conversion per distinct input (a decoded token's k experts share one x)
    for i in rest:
        if id(xs[i]) not in ready:
            ready[id(xs[i])] = kernel_input(xs[i], ext)
    if rest:
        outs = KERNELS[weight.fmt.codec.name](ext, [ready[id(xs[i])] for i in rest], [ts[i] for i in rest], weight.fmt)
        for i, y in zip(rest, outs):
            ys[i] = y
    return ys


def kernel_input(x: torch.Tensor, ext=None) -> torch.Tensor:
    """x as the extension takes it: contiguous bf16 where it has bf16 dot products (`bf16_inputs()`), else
    contiguous fp32 (x itself when already so)."""
    ext = ext or module()
    return x.contiguous() if x.dtype == torch.bfloat16 and ext.bf16_inputs() else x.float().contiguous()
