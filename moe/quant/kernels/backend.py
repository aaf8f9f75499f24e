"""Which kernels run an operation (chosen by the device of its tensors), and the switches that override the choice.

    a CPU tensor    the project's C++ kernels (`hybrid.ops.cpu`; `moe.quant.kernels.cpu`, `bf16`, `amx`; the MoE
                    router's) where they build, else PyTorch (the specification)
    a CUDA tensor   the GPU path: this project's Triton kernels (`moe.quant.kernels.triton`, `hybrid.ops.triton_*`)
                    where triton imports, mamba-ssm's chunked scan for a forward without a cache where it imports
                    (optional), else PyTorch

Environment:
    HYBRID_BACKEND=triton           CPU tensors take the GPU path too (`gpu_path`): with TRITON_INTERPRET=1 Triton
                                    runs its kernels on the CPU, so a machine without a GPU (CI) runs the code a
                                    GPU runs, kernels included (fp32: the interpreter cannot compute bf16 dots)
    HYBRID_REQUIRE_CUDA_KERNELS=1   an operation on the GPU path whose kernel package does not import raises
                                    `KernelUnavailable` (naming the import error) instead of running PyTorch's
                                    version: a GPU run that passes then proves the kernels ran

`hybrid.devices.describe(device)` names what each operation takes on a device (`hybrid info --device`,
scripts/gpu_check.py). Here, below every package of the project, so that each kernel seam asks the same questions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from types import ModuleType

import torch

BACKEND_VARIABLE = "HYBRID_BACKEND"
REQUIRE_VARIABLE = "HYBRID_REQUIRE_CUDA_KERNELS"
BACKENDS = ("auto", "triton")


class KernelUnavailable(RuntimeError):
    """A kernel the GPU path needs does not import, and HYBRID_REQUIRE_CUDA_KERNELS=1 forbids the fallback."""


_chosen: str | None = None  # HYBRID_BACKEND, read on first use (every seam asks, on every call), or `override`'s


def triton_on_cpu() -> bool:
    """Whether HYBRID_BACKEND=triton (read once, on the first call) or `override("triton")` sends CPU tensors
    down the GPU path.

    Raises:
        ValueError: HYBRID_BACKEND is set to something else than `auto` or `triton`.
    """
    global _chosen
    if _chosen is None:
        value = os.environ.get(BACKEND_VARIABLE, "auto").strip().lower() or "auto"
        if value not in BACKENDS:
            raise ValueError(f"{BACKEND_VARIABLE}={value!r}: expected one of {', '.join(BACKENDS)}")
        _chosen = value
    return _chosen == "triton"


@contextlib.contextmanager
def override(name: str) -> Iterator[None]:
    """Within the block, operations choose as under HYBRID_BACKEND=`name` (`auto` or `triton`), whatever the
    environment says (tests and scripts/gpu_check.py compare both paths in one process). Modules load for the
    backend in force when they are loaded (prepacked bf16 weights only for the CPU kernels).

    Raises:
        ValueError: an unknown name.
    """
    global _chosen
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r}: expected one of {', '.join(BACKENDS)}")
    triton_on_cpu()  # the environment's choice, checked, to restore
    before, _chosen = _chosen, name
    try:
        yield
    finally:
        _chosen = before


def gpu_path(t: torch.Tensor) -> bool:
    """Whether operations on `t` take the GPU path (a CUDA tensor, or any tensor under HYBRID_BACKEND=triton)."""
    return t.is_cuda or triton_on_cpu()


def triton_kernels(t: torch.Tensor, load: Callable[[], ModuleType]) -> ModuleType | None:
    """The module of Triton kernels `load()` imports (one with `available()` and `IMPORT_ERROR`) when `t` takes
    the GPU path and triton imports; None means: the operation's other path (which `fallback` forbids under
    HYBRID_REQUIRE_CUDA_KERNELS=1). CPU runs never import the module.

    Raises:
        KernelUnavailable: triton does not import and HYBRID_REQUIRE_CUDA_KERNELS=1.
    """
    if not gpu_path(t):
        return None
    module = load()
    if not module.available():
        fallback("triton", module.IMPORT_ERROR)
        return None
    return module


def launch_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """The device guard of a Triton launch: Triton launches on the current CUDA device, which need not be the
    tensors' (a model on cuda:1); a no-op for CPU tensors (the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def cpu_kernels(t: torch.Tensor) -> bool:
    """Whether operations on `t` may take the project's C++ CPU kernels (a CPU tensor, not under
    HYBRID_BACKEND=triton)."""
    return t.device.type == "cpu" and not triton_on_cpu()


def gpu_path_on(device: torch.device | str) -> bool:
    """`gpu_path` for a device rather than a tensor (which kernels a load or a report is about)."""
    return torch.device(device).type == "cuda" or triton_on_cpu()


def cpu_kernels_on(device: torch.device | str) -> bool:
    """`cpu_kernels` for a device rather than a tensor (what a load prepares: prepacked weights, built kernels)."""
    return torch.device(device).type == "cpu" and not triton_on_cpu()


def require_kernels() -> bool:
    """Whether HYBRID_REQUIRE_CUDA_KERNELS=1 (any other value than empty or 0 counts as set)."""
    return os.environ.get(REQUIRE_VARIABLE, "0").strip() not in ("", "0")


def fallback(what: str, error: str) -> None:
    """Called where the GPU path falls back to PyTorch because `what` (a package or kernel) is unavailable for
    `error`: raises under HYBRID_REQUIRE_CUDA_KERNELS=1, else returns (the PyTorch path is always correct).

    Raises:
        KernelUnavailable: naming `what`, `error` and the variable.
    """
    if require_kernels():
        raise KernelUnavailable(f"{what} is unavailable ({error}) and {REQUIRE_VARIABLE}=1 forbids running "
                                "PyTorch's version instead")
