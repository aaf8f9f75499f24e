"""The checkpoint writer's rules: never onto, into or around the source; never over a non-empty directory
unless asked; nothing half-written under a final name; the user's umask; the source's other files copied.

Oracles: the source's bytes before and after, the `safetensors` library reading what was written, the file
modes the umask implies, and `hybrid.load_model` of the result against the model it was written from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hybrid
from hybrid.checkpoint_writer import CheckpointWriter, WriteError
from tiny_checkpoint import write_checkpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def source(tmp_path):
    src = write_checkpoint(tmp_path / "src", pattern="ME*E", seed=1)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4], "temperature": 0.6,
                                                            "top_p": 0.95, "do_sample": True}))
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "README.md").write_text("# model card\n")
    return src


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def cli(*args):
    return subprocess.run([sys.executable, "-m", "hybrid.cli", *args], capture_output=True, text=True, cwd=ROOT)


WHERE = {  # destination, through a symlink or not -> the refusal
    "same": "is the source", "inside": "lies inside the source", "around": "contains the source",
    "symlink-same": "is the source", "symlink-inside": "lies inside the source",
    "symlink-around": "contains the source",
}


@pytest.mark.parametrize("where", WHERE)
def test_the_source_is_never_the_destination(source, tmp_path, where):
    before = snapshot(source)
    (tmp_path / "to-source").symlink_to(source)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "to-parent").symlink_to(tmp_path)
    dst = {"same": source, "inside": source / "quantized", "around": tmp_path,
           "symlink-same": tmp_path / "to-source", "symlink-inside": tmp_path / "to-source" / "quantized",
           "symlink-around": tmp_path / "elsewhere" / "to-parent"}[where]
    with pytest.raises(WriteError, match=WHERE[where]):
        hybrid.save_checkpoint(hybrid.load_model(source), dst, source=source, overwrite=True)
    r = cli("quantize", str(source), str(dst), "--format", "fp8", "--overwrite")
    assert r.returncode == 2 and WHERE[where] in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert snapshot(source) == before and not (source / "quantized").exists()
    assert hidden(tmp_path) == [] and hidden(source) == []


def test_a_non_empty_destination_needs_overwrite(source, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    model = hybrid.load_model(source)
    with pytest.raises(WriteError, match="exists and is not empty"):
        hybrid.save_checkpoint(model, dst)
    assert snapshot(dst) == {"keep.txt": b"mine"}
    r = cli("quantize", str(source), str(dst), "--format", "mxfp4")
    assert r.returncode == 2 and "--overwrite" in r.stderr
    hybrid.save_checkpoint(model, dst, overwrite=True)
    assert "keep.txt" not in snapshot(dst) and (dst / "model.safetensors").exists()
    assert hidden(tmp_path) == []  # no temporary or old directory left beside it


def test_an_interrupted_write_leaves_the_destination_as_it_was(source, tmp_path):
    dst = tmp_path / "dst"
    hybrid.save_checkpoint(hybrid.load_model(source), dst)
    before = snapshot(dst)
    other = write_checkpoint(tmp_path / "other", pattern="ME*E", seed=2)
    tensors = hybrid.load_model(other).state_dict()
    with pytest.raises(KeyboardInterrupt):
        with CheckpointWriter(dst, overwrite=True, max_shard_bytes=4096) as writer:
            for name, t in tensors.items():
                writer.add(name, t)
                if len(list(writer.tmp.glob("shard-*"))) >= 2:
                    raise KeyboardInterrupt  # after its first shards are on disk
    assert snapshot(dst) == before and hidden(tmp_path) == []


class ShardWriteFails(OSError):
    pass


def fail_on_second_shard(monkeypatch):
    """The shard writer writes the first shard, then fails (a full disk) on the second."""
    from hybrid import checkpoint_writer

    real, calls = checkpoint_writer.save_file, []

    def save_file(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise ShardWriteFails(28, "No space left on device")
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_writer, "save_file", save_file)
    return calls


@pytest.mark.parametrize("writer", ["save_checkpoint", "quantize_checkpoint", "cli"])
@pytest.mark.parametrize("existing", [True, False])
def test_a_writer_failing_after_its_first_shard_leaves_the_destination_as_it_was(
        source, tmp_path, monkeypatch, capsys, writer, existing):
    from hybrid.cli import main
    from hybrid.quantize import quantize_checkpoint

    dst = tmp_path / "dst"
    if existing:
        hybrid.save_checkpoint(hybrid.load_model(write_checkpoint(tmp_path / "old", "ME*E", seed=3)), dst)
    before = snapshot(dst) if existing else None
    calls = fail_on_second_shard(monkeypatch)
    if writer == "cli":  # a clear error, no traceback
        assert main(["quantize", str(source), str(dst), "--format", "fp8", "--calibration-samples", "0",
                     "--max-shard-bytes", "4096", "--overwrite"]) == 1
        assert "error: writing" in capsys.readouterr().err
    else:
        with pytest.raises(ShardWriteFails):
            if writer == "save_checkpoint":
                hybrid.save_checkpoint(hybrid.load_model(source), dst, max_shard_bytes=4096, source=source,
                                       overwrite=True)
            else:
                quantize_checkpoint(source, dst, "fp8", max_shard_bytes=4096, overwrite=True)
    assert len(calls) == 2  # the first shard was on disk when the second failed
    assert (snapshot(dst) if dst.exists() else None) == before
    assert hidden(tmp_path) == []  # no temporary directory behind


def test_modes_follow_the_umask(source, tmp_path):
    model = hybrid.load_model(source)
    for mask, file_mode, dir_mode in ((0o022, 0o644, 0o755), (0o077, 0o600, 0o700)):
        old = os.umask(mask)
        try:
            dst = hybrid.save_checkpoint(model, tmp_path / f"m{mask:o}", max_shard_bytes=20_000, source=source)
        finally:
            os.umask(old)
        assert (dst.stat().st_mode & 0o777) == dir_mode
        assert {p.stat().st_mode & 0o777 for p in dst.iterdir()} == {file_mode}


def test_the_source_files_are_copied_and_the_weights_sharded(source, tmp_path):
    model = hybrid.load_model(source)
    with CheckpointWriter(tmp_path / "dst", source=source, max_shard_bytes=30_000) as writer:
        writer.write_json("config.json", model.config.to_dict())
        for name, t in model.state_dict().items():
            writer.add(name, t)
    report, dst = writer.report, tmp_path / "dst"
    assert report.copied == sorted(["README.md", "chat_template.jinja", "generation_config.json",
                                    "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"])
    assert report.left_out == ["model.safetensors"] and report.written == ["config.json"]
    assert json.loads((dst / "generation_config.json").read_text())["top_p"] == 0.95  # sampling defaults kept
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == report.shards and len(report.shards) > 2
    state = model.state_dict()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    seen = {}
    for shard in report.shards:  # the safetensors library reads back exactly what was added
        with safe_open(dst / shard, "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        seen.update(tensors)
        shard_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert shard_bytes <= 30_000 or len(tensors) == 1  # a tensor larger than a shard gets one of its own
    assert seen.keys() == state.keys() and all(torch.equal(seen[k], state[k]) for k in state)


def test_save_checkpoint_keeps_the_source_generation_config_and_loads_back(source, tmp_path):
    model = hybrid.load_model(source)
    dst = hybrid.save_checkpoint(model, tmp_path / "copy", source=source)
    assert json.loads((dst / "generation_config.json").read_text()) == json.loads(
        (source / "generation_config.json").read_text())
    ids = torch.randint(5, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(hybrid.load_model(dst)(ids), model(ids))
    assert hybrid.load_model(dst).identity == model.identity


def test_a_random_checkpoint_is_written_tensor_by_tensor_in_the_published_layout(tmp_path):
    """`write_random_checkpoint` (the bench's builder): sharded with an index, one tensor per expert, the
    initialisation's rules (norms and D 1, biases 0, A in [1, 16]), and it loads strictly."""
    from hybrid.config import HybridConfig
    from hybrid.training import write_random_checkpoint
    from tiny_checkpoint import TINY

    config = HybridConfig(hybrid_override_pattern="ME*E", **TINY)
    dst = write_random_checkpoint(config, tmp_path / "random", seed=3, max_shard_bytes=10_000)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 3
    assert "backbone.layers.1.mixer.experts.3.down_proj.weight" in index and not any(
        k.endswith("experts.up_proj") for k in index)
    model = hybrid.load_model(dst, dtype="fp32")
    state = model.state_dict()
    assert state["backbone.layers.1.mixer.experts.up_proj"].dtype == torch.float32
    assert torch.equal(state["backbone.norm_f.weight"], torch.ones(32)) and torch.equal(state["backbone.layers.0.mixer.D"], torch.ones(4))
    assert not state["backbone.layers.0.mixer.conv1d.bias"].any() and not state["backbone.layers.1.mixer.gate.e_score_correction_bias"].any()
    A = torch.exp(state["backbone.layers.0.mixer.A_log"])
    assert bool(((A >= 1) & (A <= 16)).all())
    assert 0.015 < float(state["backbone.layers.1.mixer.experts.up_proj"].std()) < 0.025  # initializer_range 0.02


def test_a_full_disk_is_an_os_error_naming_the_destination(source, tmp_path, monkeypatch):
    """The writer turns safetensors' SafetensorError (a full disk) into an OSError naming the destination."""
    from safetensors import SafetensorError

    import hybrid.checkpoint_writer
    from hybrid.checkpoint_writer import CheckpointWriter

    def full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: No space left on device")

    monkeypatch.setattr(hybrid.checkpoint_writer, "save_file", full)
    dst = tmp_path / "dst"
    with pytest.raises(OSError, match=f"{dst}.*No space left on device"):
        with CheckpointWriter(dst, source=source) as writer:
            writer.add("w", torch.zeros(4))
    assert not dst.exists() and hidden(tmp_path) == []


def test_a_loaded_model_is_never_saved_onto_its_own_checkpoint(source, tmp_path):
    """`load_model` records where the model came from; `save_checkpoint` uses it as the default `source`:
    saving onto it (even with overwrite) is refused as "the source" and leaves every file; saving elsewhere
    copies its tokenizer files."""
    model = hybrid.load_model(source)
    assert model.source_dir == source.resolve()
    before = snapshot(source)
    with pytest.raises(WriteError, match="is the source"):
        hybrid.save_checkpoint(model, source, overwrite=True)
    assert snapshot(source) == before
    out = hybrid.save_checkpoint(model, tmp_path / "copy")
    tokenizer_files = [n for n in before if n.startswith("tokenizer") or n == "chat_template.jinja"]
    assert tokenizer_files and all((out / n).read_bytes() == before[n] for n in tokenizer_files)


@pytest.mark.parametrize("where", ["new-parents", "inside-a-checkpoint"])
def test_a_failed_write_removes_the_parent_directories_it_created(source, tmp_path, monkeypatch, where):
    """A write into new parent directories that fails (here in the CLI, on a full disk) removes the
    directories it created itself, and only those: an existing checkpoint gets no empty `sub/`."""
    from safetensors import SafetensorError

    import hybrid.checkpoint_writer
    from hybrid.cli import main

    def full(tensors, filename, metadata=None):
        raise SafetensorError("No space left on device")

    monkeypatch.setattr(hybrid.checkpoint_writer, "save_file", full)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "config.json").write_text("{}")
    dst = {"new-parents": tmp_path / "newparent" / "a" / "b", "inside-a-checkpoint": existing / "sub" / "x"}[where]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["quantize", str(source), str(dst), "--format", "mxfp4"]) in (1, 2)  # block size or disk
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert sorted(p.name for p in existing.iterdir()) == ["config.json"]
    with pytest.raises(OSError):
        with CheckpointWriter(dst) as writer:
            writer.add("w", torch.zeros(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert sorted(p.name for p in existing.iterdir()) == ["config.json"]


def test_checking_a_destination_leaves_no_directory(tmp_path):
    from hybrid.checkpoint_writer import check_destination

    check_destination(tmp_path / "a" / "b" / "c", None, False)
    assert list(tmp_path.iterdir()) == []
