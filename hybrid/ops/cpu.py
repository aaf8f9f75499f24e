"""The Mamba-2 decode step on the CPU: the C++ extension `cpu_mamba.cpp`, compiled on first use.

It fuses what `hybrid.ops.decode` does with several small PyTorch operations per sequence (conv step, dt,
SSD step, D skip) into one parallel loop over the sequences' heads, reading and writing each state once,
in place in its row of the pool. Built like the packed-weight kernels (`moe.quant.kernels.cpu.build`:
cached by source, torch and CPU; `HYBRID_CPU_KERNELS=0` or a failed build leaves the PyTorch path).
"""

from __future__ import annotations

import functools
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_mamba.cpp")


@functools.cache
def module():
    """The compiled extension, or None (disabled, or it cannot be built)."""
    from moe.quant.kernels.cpu import build

    return build(SOURCE, "hybrid_mamba", what="the Mamba-2 decode kernel (once for this source, torch and CPU; "
                                              "about 30 s)")
