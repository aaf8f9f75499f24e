"""The files of a Hugging Face style checkpoint: where they are, and memory-mapped views of their tensors.

A checkpoint is a directory (or a hub repo id, fetched with huggingface_hub) holding `config.json` and
either `model.safetensors` or shards listed in `model.safetensors.index.json`
(`{"weight_map": {tensor_name: shard_file}}`). Only safetensors are read: pickled `.bin` / `.pt` files
are refused, never unpickled.

safetensors layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header length,
a JSON header `{name: {"dtype", "shape", "data_offsets": [begin, end]}}` (offsets relative to the end of
the header), then the raw little-endian data. Tensors are returned as views of a read-only memory map,
so each is copied exactly once, into its final place, by the caller.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
import warnings
from pathlib import Path

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is. The message names the file, key or argument."""


def resolve_checkpoint(path_or_repo: str | Path, revision: str | None = None) -> Path:
    """A local checkpoint directory for `path_or_repo`: the directory itself, or a hub snapshot.

    Raises:
        CheckpointError: the path is neither an existing directory nor a hub repo id (`org/name`), or
            the download fails.
    """
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is a file; expected a checkpoint directory holding config.json")
    name = str(path_or_repo)
    if not _REPO_ID.match(name):
        raise CheckpointError(f"{name}: no such directory, and not a hub repo id of the form 'org/name'")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # network, authentication, unknown repo: one clear message
        raise CheckpointError(f"{name}: not a local directory, and downloading it from the hub failed: {e}") from e


class SafetensorsFile:
    """One .safetensors file: its header, and zero-copy tensor views of a read-only memory map."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot open ({e})") from None
        size = len(self._map)
        if size < 8:
            raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", self._map[:8])
        if 8 + n > size:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n} exceeds the file size {size})")
        try:
            header = json.loads(bytes(self._map[8 : 8 + n]))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self.entries: dict[str, dict] = header
        for name, entry in header.items():
            dtype = _ST_DTYPES.get(entry.get("dtype"))
            if dtype is None:
                raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
            begin, end = entry["data_offsets"]
            numel = 1
            for d in entry["shape"]:
                numel *= d
            if end - begin != numel * torch.empty((), dtype=dtype).element_size() or self._data_start + end > size:
                raise CheckpointError(f"{path}: tensor {name!r} has a data range that does not match its shape")

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return _ST_DTYPES[self.entries[name]["dtype"]]

    def view(self, name: str) -> torch.Tensor:
        """A read-only view of tensor `name` backed by the memory map (copy it before writing)."""
        entry = self.entries[name]
        dtype = _ST_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        if end == begin:
            return torch.empty(entry["shape"], dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the buffer is read-only; we only read it
            flat = torch.frombuffer(self._map, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=self._data_start + begin)
        return flat.view(entry["shape"])

    def release(self, name: str) -> None:
        """Drop the memory map's pages of tensor `name` from this process (after copying it), so that loading
        never holds a tensor twice in resident memory; the pages stay in the OS page cache."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        begin, end = self.entries[name]["data_offsets"]
        page = mmap.PAGESIZE
        first = -(-(self._data_start + begin) // page) * page  # whole pages inside the tensor's bytes only
        last = (self._data_start + end) // page * page
        if last > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)


class CheckpointFiles:
    """Every tensor of a checkpoint directory, by name, across its shards.

    Raises:
        CheckpointError: no safetensors weights (pickled files are refused), an unreadable index, a shard
            the index names that is missing, or a tensor the index places in a shard that lacks it.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        index_path = directory / INDEX_NAME
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: unreadable index ({type(e).__name__}: {e})") from None
            shard_names = sorted(set(weight_map.values()))
            missing = [s for s in shard_names if not (directory / s).is_file()]
            if missing:
                raise CheckpointError(f"{index_path} lists shard(s) missing from {directory}: {', '.join(missing)}")
            self.files = {s: SafetensorsFile(directory / s) for s in shard_names}
            self.where: dict[str, SafetensorsFile] = {}
            for name, shard in weight_map.items():
                f = self.files[shard]
                if name not in f.entries:
                    raise CheckpointError(f"{index_path} places tensor {name!r} in {shard}, which does not contain it")
                self.where[name] = f
            for shard, f in self.files.items():
                stray = [k for k in f.keys() if k not in weight_map]
                if stray:
                    raise CheckpointError(f"{directory / shard} holds tensor(s) not listed in {INDEX_NAME}: {stray[:5]}")
        elif (directory / SINGLE_NAME).exists():
            f = SafetensorsFile(directory / SINGLE_NAME)
            self.files = {SINGLE_NAME: f}
            self.where = {k: f for k in f.keys()}
        else:
            pickled = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
            hint = f" (found {', '.join(pickled)}: pickled weights are never loaded; convert them to safetensors)" if pickled else ""
            raise CheckpointError(f"{directory}: no {SINGLE_NAME} or {INDEX_NAME}{hint}")

    def keys(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.where[name].dtype(name)

    def nbytes(self, name: str) -> int:
        begin, end = self.where[name].entries[name]["data_offsets"]
        return end - begin

    def view(self, name: str) -> torch.Tensor:
        return self.where[name].view(name)

    def release(self, name: str) -> None:
        self.where[name].release(name)

    def file_of(self, name: str) -> Path:
        return self.where[name].path
