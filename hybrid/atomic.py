"""Atomic single-file writes: a file is written beside its final name and renamed into place at the end.

Every file the project writes that is not a whole checkpoint directory (`hybrid.checkpoint_writer` does
those) goes through here: prefix-cache files, eval tables and plots, bench JSON, study and training outputs.
An interrupted or failed write leaves the previous file (or none) under the final name, never a partial one,
and the temporary file is removed. New files get the user's umask (`tempfile.mkstemp` alone creates 0600);
a rewritten file keeps its mode, and a symlink keeps pointing at the (rewritten) target.

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


def file_in_the_way(path: Path) -> Path | None:
    """The outermost ancestor of `path` that exists and is not a directory (so nothing can be created below
    it), or None."""
    return next((p for p in reversed(path.parents) if p.exists() and not p.is_dir()), None)


def check_writable(path: str | os.PathLike) -> Path:
    """Check, before any work, that `path` can be written by `atomic_path`: it is not a directory, its
    directory exists or can be created (missing ones are created, as `atomic_path` would) and a file can be
    made in it (one is created and removed). Returns the path that will be written: `path` with symlinks
    followed (a symlink's target is what gets replaced).

    Raises:
        IsADirectoryError: `path` is an existing directory.
        OSError: its directory cannot be created (a file is in the way, a read-only or special file system)
            or written; the message names `path` and the reason.
    """
    given = Path(path)
    target = Path(os.path.realpath(given))
    if target.is_dir():
        raise IsADirectoryError(f"{given} is a directory, not a file to write")
    blocking = file_in_the_way(target)
    if blocking is not None:
        raise NotADirectoryError(f"{given} cannot be written: {blocking} is a file, not a directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise type(e)(f"{given} cannot be written: no file can be created in {target.parent} "
                      f"({e.strerror or e})") from None
    return target


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in `path`'s directory (created if missing); on leaving the block normally it is
    renamed to `path` (replacing any file there); on an exception it is deleted and `path` is left as it was.

    A symlink is followed: the temporary file is written beside its target and replaces the target, so the
    link stays and points at the new data. The new file keeps the mode of the file it replaces; a new file
    gets the umask's mode (as `open(path, "w")` would give).

    Raises:
        IsADirectoryError: `path` is an existing directory.
        OSError: the directory cannot be created or written (before anything else is done).
    """
    given = Path(path)
    path = Path(os.path.realpath(given))  # through symlinks: the target is replaced, the link is kept
    if path.is_dir():
        raise IsADirectoryError(f"{given} is a directory, not a file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        try:
            mode = path.stat().st_mode & 0o7777  # an existing file keeps its mode
        except FileNotFoundError:
            mode = file_mode()
        os.chmod(tmp, mode)
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
