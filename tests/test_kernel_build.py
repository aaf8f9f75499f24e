"""Kernels ready before the first token: `build_all` compiles side by side and says so in one line, a model's load
on the CPU builds every kernel first, and generating then builds none."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import hybrid
from hybrid.cli import DEFAULT_CHECKPOINT
from hybrid.ops import cpu as ops_cpu
from moe.quant.kernels import routing
from moe.quant.kernels import amx, build
from moe.quant.kernels import cpu as packed
from tiny_checkpoint import write_checkpoint

LOADERS = [packed.module, amx.module, routing.kernel, ops_cpu.module, ops_cpu.attention_module, ops_cpu.norm_module]


def fake_compiles(monkeypatch, tmp_path, n: int):
    """torch's extension loader replaced by one that needs `n` calls at once to return (a barrier: the builds
    must run side by side) and leaves a built library behind, as the real one does."""
    import torch.utils.cpp_extension

    barrier = threading.Barrier(n, timeout=20)
    calls = []

    def load(name, sources, build_directory, **kwargs):
        calls.append(name)
        barrier.wait()
        (Path(build_directory) / f"{name}.so").touch()
        return f"built {name}"

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setenv("HYBRID_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HYBRID_CPU_KERNELS", raising=False)
    return calls


def sources(tmp_path, n: int) -> list[Path]:
    paths = []
    for i in range(n):
        path = tmp_path / f"k{i}.cpp"
        path.write_text(f"// kernel {i}\n")
        paths.append(path)
    return paths


def test_build_all_compiles_side_by_side_in_one_line(monkeypatch, tmp_path, capsys):
    calls = fake_compiles(monkeypatch, tmp_path, 3)
    loaders = [lambda p=p, i=i: build.build(p, f"test_k{i}", what=f"kernel {i}")
               for i, p in enumerate(sources(tmp_path, 3))]
    results = build.build_all(loaders)
    assert len(calls) == 3 and all(r.startswith(f"built test_k{i}_") for i, r in enumerate(results)), results
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("compiling the CPU kernels (once for this source, torch and CPU) ... done in ")
    assert all(f"kernel {i}" in err for i in range(3))
    # built: the next run loads them without a word
    assert len(build.build_all(loaders)) == 3 and capsys.readouterr().err == ""


def test_build_alone_says_so_in_its_own_line(monkeypatch, tmp_path, capsys):
    fake_compiles(monkeypatch, tmp_path, 1)
    (path,) = sources(tmp_path, 1)
    assert build.build(path, "test_alone", what="the test kernel").startswith("built test_alone")
    assert capsys.readouterr().err == "compiling the test kernel (once for this source, torch and CPU) ...\n"


def test_a_cpu_load_builds_every_kernel_before_the_weights(monkeypatch, tmp_path):
    import hybrid.loading

    order = []
    monkeypatch.setattr(ops_cpu, "build_kernels", lambda: order.append("kernels"))
    weights = hybrid.loading.load_weights
    monkeypatch.setattr(hybrid.loading, "load_weights", lambda *a, **k: (order.append("weights"), weights(*a, **k)))
    hybrid.load_model(write_checkpoint(tmp_path, pattern="M*E", seed=1))
    assert order == ["kernels", "weights"]


def test_no_kernel_is_built_during_generation():
    """After `hybrid.load`, every kernel loader has run: a generation (prefill, decode, attention, router, norms)
    calls none of them for the first time, so nothing compiles between two streamed tokens."""
    model, tok = hybrid.load(DEFAULT_CHECKPOINT)
    before = [loader.cache_info().misses for loader in LOADERS]
    assert all(before), "a loader not run by the load"
    hybrid.generate(model, tok, "The for statement is used to", max_new_tokens=8)
    assert [loader.cache_info().misses for loader in LOADERS] == before
