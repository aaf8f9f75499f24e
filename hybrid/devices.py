"""The device a command runs on (`--device`), and what runs each operation there."""

from __future__ import annotations

import os

import torch

from moe.quant.kernels import backend


def resolve_device(name: str | None = None, local_rank: int | None = None) -> torch.device:
    """The device a command runs on: `name` (`cpu`, `cuda`, `cuda:N`), or by default CUDA when a device is
    available, else the CPU. Under torchrun (`local_rank` given) `cuda` means `cuda:{local_rank}`.

    Raises:
        ValueError: an unknown device name, `cuda` on a machine without a CUDA device (names the torch build),
            or a device index past the devices present.
    """
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"--device {name!r}: expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(f"--device {name}: no CUDA device is available (torch {torch.__version__}, {build})")
    index = device.index if device.index is not None else (local_rank or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: device {index} does not exist ({torch.cuda.device_count()} CUDA "
                         f"device(s) present)")
    return torch.device("cuda", index)


def missing_kernels() -> dict[str, str]:
    """{package: why it does not import} for the GPU path's kernel package, triton (every GPU kernel of this
    project is a Triton kernel; mamba-ssm and causal-conv1d are optional); empty when it imports."""
    from moe.quant.kernels import triton

    return {} if triton.available() else {"triton": triton.IMPORT_ERROR or "it does not import"}


def check_required_kernels(device: torch.device | str) -> None:
    """Under HYBRID_REQUIRE_CUDA_KERNELS=1, when `device` takes the GPU path: raise unless the GPU path's kernel
    package (triton) imports (a load calls this first, so a server refuses to start instead of failing each
    request).

    Raises:
        KernelUnavailable: naming each package that does not import, and its error.
    """
    if not backend.require_kernels() or not backend.gpu_path_on(device):
        return
    if missing := missing_kernels():
        raise backend.KernelUnavailable(
            f"{backend.REQUIRE_VARIABLE}=1 and the GPU path's kernels do not all import: "
            + "; ".join(f"{name} ({error})" for name, error in missing.items()))


def describe(device: torch.device | str) -> dict[str, str]:
    """{operation: what runs it on `device`} for each hot operation of a model: the kernel, or `PyTorch` with
    the reason (a package that does not import names its error). Builds the CPU kernels on a CPU device."""
    from hybrid.ops import kernel_status
    from moe.quant.kernels import routing as router_kernel
    from moe.quant.kernels import status as quant_status

    on_gpu = backend.gpu_path_on(device)
    routing = "PyTorch" if on_gpu or router_kernel.kernel() is None else "C++ (cpu_router.cpp) for decode rows, else PyTorch"
    ops = {**kernel_status(on_gpu), "MoE router": routing, **quant_status(on_gpu)}
    if on_gpu and backend.require_kernels():  # a fallback is an error then, not PyTorch
        ops = {op: f"an error ({backend.REQUIRE_VARIABLE}=1; {how[len('PyTorch ('):-1]})"
               if how.startswith("PyTorch (") and "not import" in how else how for op, how in ops.items()}
    return ops


def switches(device: torch.device | str) -> list[str]:
    """The environment switches in force, each as a sentence for `hybrid info --device` (empty: none)."""
    said = []
    if backend.triton_on_cpu():
        said.append(f"{backend.BACKEND_VARIABLE}=triton: CPU tensors take the GPU path"
                    + ("" if torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
                       else " (its Triton kernels run on the CPU only with TRITON_INTERPRET=1)"))
    if backend.require_kernels():
        said.append(f"{backend.REQUIRE_VARIABLE}=1: a GPU-path kernel that does not import is an error")
    return said
