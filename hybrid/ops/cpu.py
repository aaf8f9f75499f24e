"""The decode steps on the CPU: C++ extensions compiled on first use.

- `cpu_mamba.cpp` (`module`): what `hybrid.ops.decode` does with several small PyTorch operations per
  sequence (conv step, dt, SSD step, D skip) in one parallel loop over the sequences' heads, reading and
  writing each state once, in place in its row of the pool; and the same for the prompt chunks of several
  sequences packed in one forward (`mamba_chunks_slots`: the conv, then the SSD recurrence over each chunk's
  tokens with blocks of the state in vector registers), where the PyTorch prefill runs a chunked scan per
  chunk or per padded batch of chunks.
- `cpu_attention.cpp` (`attention_module`): one query per sequence over its keys and values where they lie
  (a prompt chunk's gathered keys, or a paged cache's pool rows, never gathered into a copy), in one parallel loop
  over the sequences' KV heads.
- `cpu_norm.cpp` (`norm_module`): RMSNorm and the gated, grouped RMSNorm of the Mamba-2 mixer, each one
  call and one pass per row, where the specification (`hybrid.ops.norm`) is 4 to 10 PyTorch operations.

Built like the packed-weight kernels (`moe.quant.kernels.build.build`: cached by source, torch and CPU;
`HYBRID_CPU_KERNELS=0` or a failed build leaves the PyTorch path). `build_kernels` makes every C++ kernel of
the project ready at once (a model's load on the CPU calls it, and `hybrid build-kernels`).
"""

from __future__ import annotations

import functools
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_mamba.cpp")
ATTENTION_SOURCE = Path(__file__).with_name("cpu_attention.cpp")
NORM_SOURCE = Path(__file__).with_name("cpu_norm.cpp")


@functools.cache
def module():
    """The compiled extension, or None (disabled, or it cannot be built)."""
    from moe.quant.kernels.build import build

    return build(SOURCE, "hybrid_mamba", what="the Mamba-2 kernels")


@functools.cache
def attention_module(portable: bool = False):
    """The compiled decode-attention extension, or None (disabled, or it cannot be built). `portable`: the
    build without AVX-512 (its plain loops: what a CPU without it runs; tests compare it too)."""
    from moe.quant.kernels.cpu import FLAGS, PORTABLE, build

    return build(ATTENTION_SOURCE, "hybrid_attention", FLAGS + PORTABLE if portable else FLAGS,
                 what="the decode-attention kernel")


@functools.cache
def norm_module():
    """The compiled RMSNorm extension, or None (disabled, or it cannot be built)."""
    from moe.quant.kernels.build import build

    return build(NORM_SOURCE, "hybrid_norm", what="the RMSNorm kernels")


def build_kernels() -> dict[str, object | None]:
    """Every C++ kernel a model on this CPU may run, built (or loaded from the cache) at once, side by side
    (`moe.quant.kernels.build.build_all`, one line on stderr while any compiles): the packed-weight and bf16
    products, the AMX products (on a CPU with AMX), the MoE router, and this module's Mamba-2, decode-attention
    and RMSNorm kernels. Returns {name: the extension, or None where it is disabled, cannot be built or does not
    apply to this CPU}. Why at load: a kernel built on first use would compile between two streamed tokens and
    count in the speed figures."""
    from moe.quant.kernels import routing
    from moe.quant.kernels import amx
    from moe.quant.kernels import cpu as packed
    from moe.quant.kernels.build import build_all

    loaders = {"packed-weight": packed.module, "AMX": amx.module, "MoE router": routing.kernel,
               "Mamba-2": module, "decode attention": attention_module, "RMSNorm": norm_module}
    return dict(zip(loaders, build_all(list(loaders.values()))))
