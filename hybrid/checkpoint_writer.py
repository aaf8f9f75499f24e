"""The one way a checkpoint directory is written (`save_checkpoint`, `hybrid quantize`, the bench builders).

Rules, each tested (tests/test_checkpoint_writer.py, tests/test_writes.py):
- The destination is never the source, inside it, or around it (paths resolved, symlinks followed).
- A destination that exists and is not empty is refused unless `overwrite`; one that cannot be created (under
  a file, in a read-only directory) is refused before anything else is done. Parent directories are created
  as needed; a check or a failed write removes those it created itself (and only those).
- Everything is written into a temporary directory beside the destination and renamed into place at the
  end, so an interrupted or failed write leaves the old destination as it was and no partial file under a
  final name. With `overwrite`, the old destination is moved aside first and deleted only after the rename,
  so nothing of an earlier checkpoint (a stale shard or index) stays beside the new one.
- Files get the user's umask (safetensors alone would leave its files 0600).
- Everything of the source that is not weights (generation_config.json with its sampling defaults and
  stop ids, tokenizer files, the chat template, special tokens map, the model card) is copied unless the
  caller writes that file itself; `WriteReport` says what was written, copied and left out. Weight
  indexes (`*.index.json`) and `hf_quant_config.json` describe the source's weights and are left out.
- Weights are added tensor by tensor; a shard (safetensors, via the `safetensors` library) is written as
  soon as the next tensor would take it past `max_shard_bytes`, so a writer holds at most one shard's
  tensors. With `max_shard_bytes`, shards are `model-0000i-of-0000n.safetensors` plus
  `model.safetensors.index.json` (`{"metadata": {"total_size"}, "weight_map"}`); without, one
  `model.safetensors`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from hybrid.atomic import file_in_the_way, umask
from hybrid.checkpoint_files import INDEX_NAME, SINGLE_NAME

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
NOT_COPIED = {INDEX_NAME, "hf_quant_config.json"}  # describe the source's weights, not the new ones


class WriteError(ValueError):
    """A destination that cannot be written as asked (names the path and why)."""


@dataclass
class WriteReport:
    """What a finished write did: files written by the caller, weight shards, files copied from the source,
    source files left out (weights and their index), and the weight bytes."""

    destination: Path
    written: list[str] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    weight_bytes: int = 0


def check_destination(destination: Path, source: Path | None, overwrite: bool) -> None:
    """Check that `destination` may be written (see the module docstring): its parent directory is created
    and a temporary directory made in it, then both removed again (only the directories created here), so a
    path that cannot be written fails here and a check leaves nothing behind.

    Raises:
        WriteError: the destination is the source, inside or around it, exists and is not empty (without
            `overwrite`), is a file, or cannot be created.
    """
    dst = Path(destination).expanduser().resolve()
    if dst.exists() and not dst.is_dir():
        raise WriteError(f"{destination} exists and is not a directory")
    if source is not None:
        src = Path(source).expanduser().resolve()
        if dst == src:
            raise WriteError(f"{destination} is the source checkpoint {source}: write to another directory")
        if src in dst.parents:
            raise WriteError(f"{destination} lies inside the source checkpoint {source}: write to another directory")
        if dst in src.parents:
            raise WriteError(f"{destination} contains the source checkpoint {source}: write to another directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise WriteError(f"{destination} exists and is not empty: choose another directory, or overwrite it "
                         "(--overwrite; overwrite=True)")
    tmp, created = _temp_dir(destination)
    tmp.rmdir()
    _remove_created(created)  # a check leaves nothing behind: the writer creates them again


def _temp_dir(destination: Path) -> tuple[Path, list[Path]]:
    """A new temporary directory beside `destination` (its parent created first), and the parent directories
    that were created for it (deepest first), so that a failed write can remove them again.

    Raises:
        WriteError: the parent cannot be created or written (the message names the path in the way).
    """
    dst = Path(destination).expanduser().resolve()
    blocking = file_in_the_way(dst)
    if blocking is not None:
        raise WriteError(f"{destination} cannot be created: {blocking} is a file, not a directory")
    created = [p for p in dst.parents if not p.exists()]  # deepest first
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _remove_created(created)
        raise WriteError(f"{destination} cannot be created: {e.strerror or e} ({e.filename})") from None
    try:
        return Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent)), created
    except OSError as e:
        _remove_created(created)
        raise WriteError(f"{destination} cannot be created: {e.strerror or e} in {dst.parent}") from None


def _remove_created(created: list[Path]) -> None:
    """Remove the directories a write created itself (deepest first), as long as they are empty."""
    for d in created:
        try:
            d.rmdir()
        except OSError:  # not empty (something else wrote there meanwhile) or gone: keep the rest
            return


class CheckpointWriter:
    """Write a checkpoint directory safely (see the module docstring).

        with CheckpointWriter(dst, source=src, max_shard_bytes=512 * 2**20) as writer:
            writer.write_json("config.json", config.to_dict())
            for name, tensor in tensors:
                writer.add(name, tensor)            # contiguous CPU tensors
        writer.report                               # after the block: what was written and copied

    Leaving the block normally commits (renames the temporary directory into place); an exception
    discards the temporary directory and leaves the destination untouched.
    Raises:
        WriteError: the destination is the source, inside it or around it, exists and is not empty
            (without `overwrite`), or cannot be created.
        ValueError: max_shard_bytes < 1.
        OSError: (from `add` or the commit) writing failed, e.g. a full disk; the destination is as it was.
    """

    def __init__(self, destination: str | Path, source: str | Path | None = None, overwrite: bool = False,
                 max_shard_bytes: int | None = None):
        self.destination = Path(destination).expanduser()
        self.source = None if source is None else Path(source).expanduser()
        if max_shard_bytes is not None and max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
        check_destination(self.destination, self.source, overwrite)
        self.max_shard_bytes = max_shard_bytes
        self.overwrite = overwrite
        self.tmp, self._created = _temp_dir(self.destination)
        self.report = WriteReport(self.destination)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names per written shard
        self._names: set[str] = set()

    # ------------------------------------------------------------------------------------------ content
    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Add one weight tensor (written with the current shard; a full shard is written first).

        Raises:
            ValueError: the name was added before.
            OSError: writing a full shard failed (a full disk; safetensors' own error is converted to this,
                naming the destination and the shard).
        """
        if name in self._names:
            raise ValueError(f"tensor {name!r} was added twice")
        self._names.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self.max_shard_bytes is not None and self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().cpu().contiguous()
        self._pending_bytes += nbytes
        self.report.weight_bytes += nbytes

    def write_json(self, filename: str, content) -> None:
        """Write a JSON file of the checkpoint (config.json, generation_config.json, hf_quant_config.json)."""
        self.write_text(filename, json.dumps(content, indent=2, sort_keys=filename == "config.json") + "\n")

    def copy(self, path: str | Path) -> None:
        """Copy one file (a tokenizer file, ...) into the checkpoint under its own name."""
        path = Path(path)
        shutil.copyfile(path, self.tmp / path.name)
        self.report.copied.append(path.name)

    def write_text(self, filename: str, text: str) -> None:
        """Write a text file of the checkpoint (the caller's; the source's file of that name is not copied)."""
        (self.tmp / filename).write_text(text)
        self.report.written.append(filename)

    def _flush(self) -> None:
        if not self._pending and self._shards:
            return
        name = f"shard-{len(self._shards)}.safetensors"
        try:
            save_file(self._pending, self.tmp / name, metadata={"format": "pt"})
        except SafetensorError as e:  # a full disk, a lost mount: safetensors reports it as its own error
            raise OSError(f"writing a weight shard of {self.destination} (in {self.tmp / name}) failed: {e}") from None
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    # ------------------------------------------------------------------------------------------ commit
    def commit(self) -> WriteReport:
        """Write the last shard, the index, the copied files; rename the result into place.

        Raises:
            OSError: a file could not be written or renamed (a full disk: the message names the destination);
                the destination is left as it was.
        """
        self._flush()
        n = len(self._shards)
        if self.max_shard_bytes is None:
            (self.tmp / "shard-0.safetensors").rename(self.tmp / SINGLE_NAME)
            self.report.shards = [SINGLE_NAME]
        else:
            weight_map = {}
            for i, names in enumerate(self._shards):
                final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                (self.tmp / f"shard-{i}.safetensors").rename(self.tmp / final)
                weight_map.update({name: final for name in names})
                self.report.shards.append(final)
            index = {"metadata": {"total_size": self.report.weight_bytes}, "weight_map": weight_map}
            (self.tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        self._copy_source_files()
        mask = umask()
        for f in self.tmp.iterdir():
            f.chmod(0o666 & ~mask)
        self.tmp.chmod(0o777 & ~mask)
        self._move_into_place()
        return self.report

    def _copy_source_files(self) -> None:
        if self.source is None:
            return
        for f in sorted(self.source.iterdir()):
            if not f.is_file() or f.name.startswith("."):
                continue
            if f.name.endswith(WEIGHT_SUFFIXES + (".index.json",)) or f.name in NOT_COPIED:
                self.report.left_out.append(f.name)
            elif f.name not in self.report.written:
                shutil.copyfile(f, self.tmp / f.name)
                self.report.copied.append(f.name)

    def _move_into_place(self) -> None:
        dst = self.destination.resolve()  # through a symlink: its target is replaced
        old = None
        if dst.exists() and any(dst.iterdir()):  # overwrite (checked at the start): keep it until the rename
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
            os.replace(dst, old / dst.name)
        os.replace(self.tmp, dst)
        if old is not None:
            shutil.rmtree(old)

    def abort(self) -> None:
        """Discard everything written so far, and the parent directories this writer created; the
        destination is untouched."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        _remove_created(self._created)

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()
