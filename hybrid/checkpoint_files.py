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
import math
import mmap
import re
import reprlib
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


_REPR = reprlib.Repr()  # messages show untrusted values shortened, whatever their nesting
_REPR.maxstring = _REPR.maxother = 100
_shown = _REPR.repr


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


def _parse_json(data: bytes, what: str) -> object:
    """JSON from untrusted bytes.

    Raises:
        CheckpointError: "{what} ({why})" for bytes that are not UTF-8 JSON, nest too deeply, or hold an
            integer too long to convert.
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise CheckpointError(f"{what} (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise CheckpointError(f"{what} ({e})") from None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry_problem(entry: object, data_size: int) -> str | None:
    """What is wrong with one tensor's header entry (for `data_size` bytes after the header), or None."""
    if not isinstance(entry, dict):
        return f"is {_shown(entry)}; expected an object with dtype, shape and data_offsets"
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        return f"has no {' or '.join(missing)}"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
        return f"has dtype {_shown(dtype)}; expected one of {sorted(_ST_DTYPES)}"
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        return f"has shape {_shown(shape)}; expected a list of integers >= 0"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))
            and 0 <= offsets[0] <= offsets[1] <= data_size):
        return f"has data_offsets {_shown(offsets)}; expected [begin, end] with 0 <= begin <= end <= {data_size}"
    itemsize = _ST_DTYPES[dtype].itemsize
    if math.prod(d or 1 for d in shape) * itemsize >= 2**63:  # torch's strides and sizes are int64, even when empty
        return f"has shape {shape}, too large for torch"
    nbytes = math.prod(shape) * itemsize
    if offsets[1] - offsets[0] != nbytes:
        return (f"has data_offsets {offsets} ({offsets[1] - offsets[0]} bytes), but shape {shape} of {dtype} "
                f"needs {nbytes} bytes")
    return None


class SafetensorsFile:
    """One .safetensors file: its header, and zero-copy tensor views of a read-only memory map.

    Raises:
        CheckpointError: the file cannot be opened or is not a safetensors file: a header length beyond the
            file, a header that is not a JSON object, `__metadata__` that is not an object of strings, or a
            tensor entry without a known dtype, a shape of integers >= 0 and `data_offsets` inside the data
            that match its shape and overlap no other tensor's. The message names the file and the tensor.
    """

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
        header = _parse_json(bytes(self._map[8 : 8 + n]), f"{path}: unreadable safetensors header")
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: safetensors header is not a JSON object (got {type(header).__name__})")
        metadata = header.pop("__metadata__", None)
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CheckpointError(f"{path}: __metadata__ must be an object of strings, got {_shown(metadata)}")
        self.metadata = metadata
        self._data_start = 8 + n
        self.entries: dict[str, dict] = header
        for name, entry in header.items():
            why = _entry_problem(entry, size - self._data_start)
            if why:
                raise CheckpointError(f"{path}: tensor {_shown(name)} {why}")
        spans = sorted((e["data_offsets"], name) for name, e in header.items()
                       if e["data_offsets"][0] < e["data_offsets"][1])
        for (a, name_a), (b, name_b) in zip(spans, spans[1:]):
            if b[0] < a[1]:
                raise CheckpointError(f"{path}: tensors {name_a!r} and {name_b!r} overlap (data_offsets {a} and {b})")

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


def _read_index(path: Path) -> dict[str, str]:
    """The `weight_map` of a model.safetensors.index.json: {tensor name: shard file name}.

    Raises:
        CheckpointError: the file is unreadable or not JSON, not an object, has no `weight_map`, the map is not
            an object of strings, or a shard is not a plain file name (a path separator, `..` or an absolute
            path could reach outside the checkpoint directory). The message names the file and the tensor.
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    index = _parse_json(data, f"{path}: unreadable index")
    if not isinstance(index, dict):
        raise CheckpointError(f"{path}: expected a JSON object with a `weight_map`, got {type(index).__name__}")
    if "weight_map" not in index:
        raise CheckpointError(f"{path}: has no `weight_map` (tensor name -> shard file name)")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path}: `weight_map` must be an object of tensor name -> shard file name, "
                              f"got {_shown(weight_map)}")
    for name, shard in weight_map.items():
        if shard in ("", ".", "..") or "/" in shard or "\\" in shard or "\0" in shard:
            raise CheckpointError(f"{path}: shard {shard!r} of tensor {name!r} is not a file name in the "
                                  "checkpoint directory")
    return weight_map


class CheckpointFiles:
    """Every tensor of a checkpoint directory, by name, across its shards. A directory holding both
    `model.safetensors` and `model.safetensors.index.json` is read from the single file, as transformers reads
    it, with a warning naming both.

    Raises:
        CheckpointError: no safetensors weights (pickled files are refused), an unreadable index (see
            `_read_index`), a shard the index names that is missing, a tensor the index places in a shard
            that lacks it, or a shard that `SafetensorsFile` refuses.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        index_path = directory / INDEX_NAME
        if index_path.exists() and (directory / SINGLE_NAME).exists():  # transformers loads the single file
            warnings.warn(f"{directory}: holds both {SINGLE_NAME} and {INDEX_NAME}; loading {SINGLE_NAME} "
                          f"(as transformers does) and ignoring {INDEX_NAME}", stacklevel=2)
        if index_path.exists() and not (directory / SINGLE_NAME).exists():
            weight_map = _read_index(index_path)
            shard_names = sorted(set(weight_map.values()))
            missing = [s for s in shard_names if not (directory / s).is_file()]
            if missing:
                raise CheckpointError(f"{index_path}: lists shard(s) missing from {directory}: {', '.join(missing)}")
            self.files = {s: SafetensorsFile(directory / s) for s in shard_names}
            self.where: dict[str, SafetensorsFile] = {}
            for name, shard in weight_map.items():
                f = self.files[shard]
                if name not in f.entries:
                    raise CheckpointError(f"{index_path}: places tensor {name!r} in {shard}, which does not contain it")
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
