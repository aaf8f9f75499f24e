"""Building this project's C++ extensions (the packed-weight kernels, the AMX prefill kernels, the Mamba,
attention, norm and router kernels) on first use: `build` compiles one with torch's `cpp_extension` into
`$HYBRID_CACHE/kernels/<prefix>_<digest>` (default `~/.cache/hybrid`), the digest of its source, flags, torch
(`torch_key`) and this CPU's feature flags (`cpu_flags`), so that a build is never used for another of them.
`build_all` runs several kernels' loaders at once (each compile is one process of its own), saying so in one
line: how a model's load makes every kernel ready before its first token.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

FLAGS = ("-O3", "-march=native", "-fopenmp")  # OpenMP: at::parallel_for spreads the weight rows over the threads


def cpu_flags() -> str:
    """The `flags` line of /proc/cpuinfo (or what `platform` says where there is none)."""
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


def build(source: Path, prefix: str, flags: tuple[str, ...] = FLAGS, what: str = "a CPU kernel"):
    """Compile the C++ extension `source` on first use into `$HYBRID_CACHE/kernels/<prefix>_<digest>` (the
    digest of `build_name`: never used for another source, torch (`torch_key`) or CPU), saying so once (within
    `build_all`, in its one line); None when `HYBRID_CPU_KERNELS=0` is set or it cannot be built (a warning
    names why). `what`: the kernel's name in that message, e.g. "the MoE router kernel"."""
    if os.environ.get("HYBRID_CPU_KERNELS", "1") == "0":
        return None
    name = build_name(source.read_bytes(), torch_key(), cpu_flags(), flags, prefix)
    directory = Path(os.environ.get("HYBRID_CACHE", Path.home() / ".cache" / "hybrid")) / "kernels" / name
    try:
        from torch.utils.cpp_extension import load

        directory.mkdir(parents=True, exist_ok=True)
        with _build_lock(directory), _our_ninja_first():
            if not any(directory.glob(f"{name}*.so")):
                _announce(what)
            return load(name=name, sources=[str(source)], extra_cflags=list(flags), extra_ldflags=["-fopenmp"],
                        build_directory=str(directory), verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the PyTorch path is always correct
        warnings.warn(f"{what} unavailable, using the PyTorch path ({type(e).__name__}: {e})", stacklevel=3)
        return None


class _Batch:
    """The kernels `build_all` is compiling (not found in the cache), for its one line."""

    def __init__(self):
        self.lock = threading.Lock()
        self.compiled: list[str] = []


_batch: _Batch | None = None  # set while `build_all` runs its loaders


def _announce(what: str) -> None:
    """Say that `what` is being compiled: alone, a line of its own; within `build_all`, the start of its one line
    (for the first kernel that compiles) and a name at its end."""
    batch = _batch
    if batch is None:
        print(f"compiling {what} (once for this source, torch and CPU) ...", file=sys.stderr, flush=True)
        return
    with batch.lock:
        if not batch.compiled:
            print("compiling the CPU kernels (once for this source, torch and CPU) ...", end="", file=sys.stderr,
                  flush=True)
        batch.compiled.append(what)


def build_all(loaders: list[Callable[[], object]]) -> list[object]:
    """Call every loader (each a cached function that builds or loads one kernel, returning it or None) at once,
    one thread each: the compiles run side by side, as many at a time as the CPU's cores take. While any kernel
    compiles, one line on stderr says so and, when all are done, which and how long they took. Returns the
    loaders' results in order."""
    global _batch
    batch, start = _Batch(), time.monotonic()
    with _our_ninja_first():  # PATH is the process's: set once here, not by each thread
        _batch = batch
        try:
            with ThreadPoolExecutor(max_workers=max(1, len(loaders)), thread_name_prefix="hybrid-build") as pool:
                results = list(pool.map(lambda load: load(), loaders))
        finally:
            _batch = None
    if batch.compiled:
        print(f" done in {time.monotonic() - start:.0f} s: {', '.join(batch.compiled)}", file=sys.stderr, flush=True)
    return results


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
    newer (observed: ninja 1.11 after 1.13 recompiled a kernel at every start, docs/perf-log.md#ninja-version)."""
    try:
        import ninja

        ours = str(Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        yield
        return
    before = os.environ.get("PATH")
    if before is not None and before.split(os.pathsep)[0] == ours:  # already first (within `build_all`)
        yield
        return
    os.environ["PATH"] = os.pathsep.join([ours, before]) if before else ours
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before
