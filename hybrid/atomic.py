"""Atomic single-file writes: a file is written beside its final name and renamed into place at the end.

Every file the project writes that is not a whole checkpoint directory (`hybrid.checkpoint_writer` does
those) goes through here: prefix-cache files, eval tables and plots, bench JSON, study and training outputs.
An interrupted or failed write leaves the previous file (or none) under the final name, never a partial one,
and the temporary file is removed. Files get the user's umask (`tempfile.mkstemp` alone creates 0600).

    with atomic_path("results.png") as tmp:      # for writers that take a path (safetensors, matplotlib)
        fig.savefig(tmp, format="png")
    atomic_write_text("summary.md", text)
    atomic_write_bytes("cache.bin", data)

Append-only logs meant for resuming (`records.jsonl`) are not written here: they are appended to.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def umask() -> int:
    """The process's umask (read without changing it for longer than the call)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a plain `open(path, "w")` would give a new file: 0o666 less the umask."""
    return 0o666 & ~umask()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in `path`'s directory (created if missing); on leaving the block normally it is
    given the umask's mode and renamed to `path` (replacing any file there); on an exception it is deleted
    and `path` is left as it was.

    Raises:
        IsADirectoryError: `path` is an existing directory.
        OSError: the directory cannot be created or written (before anything else is done).
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory, not a file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (see `atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Write `text` to `path` atomically (see `atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding=encoding)
