"""The GPU code path on the CPU: `HYBRID_BACKEND=triton` sends CPU tensors down the path a CUDA tensor takes
(this project's Triton kernels, run by Triton's interpreter; PyTorch where mamba-ssm and causal-conv1d do not
import), so CI checks what a GPU runs: a tiny FP8 / NVFP4 / MXFP4 model (hidden 64, 8 experts, every Linear packed)
and the serving engine against the CPU path, in fp32 (the interpreter computes no bf16 dot), a 16-sequence decode
step that reads nothing back to the host inside the layers, and the fail-loud switch
`HYBRID_REQUIRE_CUDA_KERNELS=1`. The tests run in a fresh process under the interpreter (tests/interpreter.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from interpreter import driver, needs_interpreter, run_in_interpreter  # noqa: E402


@driver
def test_the_gpu_path_in_the_interpreter():
    run_in_interpreter(__file__, "12 passed, 1 skipped")


import hybrid  # noqa: E402
import hybrid.ops as ops  # noqa: E402
from hybrid.devices import describe  # noqa: E402
from hybrid.quantize import quantize_checkpoint  # noqa: E402
from hybrid.sampling import SamplingParams  # noqa: E402
from hybrid.serving.engine import Engine  # noqa: E402
from helpers import greedy_all_logits  # noqa: E402
from moe.quant.kernels import backend  # noqa: E402
from tiny_checkpoint import write_checkpoint  # noqa: E402

SHAPES = dict(hidden_size=64, intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              moe_shared_expert_intermediate_size=32, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
              ssm_state_size=16, chunk_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.fixture
def gpu_path(monkeypatch):
    """Run the body as under HYBRID_BACKEND=triton; yields a counter of the Triton launches."""
    from moe.quant.kernels import triton

    launches = []
    real = triton.grouped_matmul
    monkeypatch.setattr(triton, "grouped_matmul", lambda *a, **k: launches.append(1) or real(*a, **k))
    monkeypatch.delenv("HYBRID_REQUIRE_CUDA_KERNELS", raising=False)
    with backend.override("triton"):
        yield launches


@pytest.fixture(scope="module", params=["fp8", "nvfp4", "mxfp4"])
def packed(request, tmp_path_factory):
    """A tiny checkpoint with every Linear and expert packed in the format (attention and Mamba included)."""
    root = tmp_path_factory.mktemp(request.param)
    source = write_checkpoint(root / "float", pattern="M*MEME", seed=3, **SHAPES)
    quantize_checkpoint(source, root / "packed", request.param, exclude=[])
    return root / "packed"


@needs_interpreter
def test_describe_names_the_gpu_path_on_cpu_tensors(gpu_path):
    on = describe("cpu")
    assert on["FP8 / NVFP4 products and experts"].startswith("Triton")
    assert on["Mamba-2 prompt scan"].startswith("Triton")
    assert on["Mamba-2 decode step"].startswith("Triton") and on["decode attention"].startswith("Triton")


@needs_interpreter
def test_a_missing_kernel_package_fails_loudly_when_required(gpu_path, monkeypatch):
    if ops._mamba_ssm() is not None:
        pytest.skip("mamba-ssm imports here")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5, 2, 4, generator=g)
    B, C = torch.randn(1, 5, 1, 8, generator=g), torch.randn(1, 5, 1, 8, generator=g)
    dt, A = torch.rand(1, 5, 2, generator=g) * 0.1, -torch.rand(2, generator=g)
    y, _ = ops.ssd_scan(x, dt, A, B, C, 4)  # the PyTorch fallback, allowed by default
    assert y.shape == x.shape
    monkeypatch.setenv("HYBRID_REQUIRE_CUDA_KERNELS", "1")
    with pytest.raises(backend.KernelUnavailable, match="mamba-ssm is unavailable .*No module named"):
        ops.ssd_scan(x, dt, A, B, C, 4)


@needs_interpreter
def test_the_packed_model_on_the_gpu_path_decodes_as_on_the_cpu_path(packed, gpu_path):
    """Prompts of 21 tokens (chunks of 16 and a part), 6 greedy steps: the same tokens, logits within 1e-4 of the
    largest; the Triton kernels ran (every packed product goes through them)."""
    ids = torch.randint(5, 320, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = greedy_all_logits(hybrid.load_model(packed), ids, 6)
        assert gpu_path, "no Triton launch on the GPU path"
        n = len(gpu_path)
        with backend.override("auto"):
            want = greedy_all_logits(hybrid.load_model(packed), ids, 6)
        assert len(gpu_path) == n, "the CPU path launched Triton"
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@needs_interpreter
def test_the_engine_on_the_gpu_path_serves_the_cpu_paths_tokens(packed, gpu_path):
    """Three requests of mixed lengths through the paged engine (packed prefill chunks beside decode steps)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 320, (n,), generator=g).tolist() for n in (3, 19, 40)]

    def serve():
        engine = Engine(hybrid.load_model(packed), num_blocks=64, max_num_seqs=3, max_num_batched_tokens=32)
        return [c.token_ids for c in engine.generate(prompts, SamplingParams(temperature=0), max_tokens=5)]

    got = serve()
    assert gpu_path
    with backend.override("auto"):
        assert got == serve()


# ------------------------------------------------------------------------------------------ host round trips
HOST_READS = ("tolist", "item", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")


HOST_BUILDS = ("tensor", "as_tensor")


def _host_reads_in_layers(model, step) -> list[str]:
    """The reads of a tensor's values into Python (`.tolist()`, `.item()`, `bool(t)`, ...: each a host
    synchronisation on a GPU) and the tensors made from Python values (`torch.tensor`, `torch.as_tensor`,
    `Tensor.new_tensor`: on a GPU a copy from pageable memory, which waits for the device) that this project's
    code makes inside the model's layers during `step()`, as "file:line method"."""
    import sys
    from pathlib import Path

    root = Path(hybrid.__file__).resolve().parents[1]
    project = (str(root / "hybrid"), str(root / "moe"))
    inside, seen = [False], []
    real = {name: getattr(torch.Tensor, name) for name in HOST_READS + ("new_tensor",)}
    real_builds = {name: getattr(torch, name) for name in HOST_BUILDS}

    def note(name):
        caller = sys._getframe(2)
        if inside[0] and caller.f_code.co_filename.startswith(project):
            seen.append(f"{Path(caller.f_code.co_filename).relative_to(root)}:{caller.f_lineno} {name}")

    def spy(name):
        def read(self, *args, **kwargs):
            note(name)
            return real[name](self, *args, **kwargs)
        return read

    def spy_build(name):
        def build(*args, **kwargs):
            note(name)
            return real_builds[name](*args, **kwargs)
        return build

    def enter(*_):
        inside[0] = True

    def leave(*_):
        inside[0] = False

    hooks = [h for layer in model.backbone.layers
             for h in (layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave))]
    try:
        for name in real:
            setattr(torch.Tensor, name, spy(name))
        for name in HOST_BUILDS:
            setattr(torch, name, spy_build(name))
        step()
    finally:
        for name, method in real.items():
            setattr(torch.Tensor, name, method)
        for name, function in real_builds.items():
            setattr(torch, name, function)
        for h in hooks:
            h.remove()
    return seen


def _decode_step_reads(directory, prompts_beside: int = 3) -> tuple[list[str], list[str]]:
    """16 sampled requests through the engine until every one decodes; then the host reads and builds of one
    decode step, and of the next step with `prompts_beside` new prompts packed beside the 16 decodes (a mixed
    step)."""
    model = hybrid.load_model(directory)
    engine = Engine(model, num_blocks=160, max_num_seqs=16 + prompts_beside, max_num_batched_tokens=256)
    g = torch.Generator().manual_seed(4)
    for n in range(16):
        engine.add_request(torch.randint(5, 320, (3 + n,), generator=g).tolist(), SamplingParams(temperature=0.7),
                           max_tokens=8)
    engine.step()  # every prompt in one step
    engine.step()  # the first decode step (kernels warmed)
    decode = _host_reads_in_layers(model, engine.step)
    assert engine.last_step.num_seqs == 16 and engine.last_step.num_tokens == 16  # a pure decode step
    for n in range(prompts_beside):
        engine.add_request(torch.randint(5, 320, (5 + 3 * n,), generator=g).tolist(), max_tokens=2)
    mixed = _host_reads_in_layers(model, engine.step)
    assert engine.last_step.num_seqs == 16 + prompts_beside
    assert engine.last_step.num_decode_tokens == 16 and engine.last_step.num_tokens == 16 + sum(
        5 + 3 * n for n in range(prompts_beside))
    return decode, mixed


@needs_interpreter
def test_a_packed_decode_step_reads_nothing_back_inside_the_layers(packed, gpu_path):
    """A decode step of 16 sampled sequences on the Triton path (FP8 / NVFP4 / MXFP4 weights): no layer reads a
    tensor's values into Python or makes a tensor from Python values (the step's index tensors are made before the
    layers, in one copy), so on a GPU no layer waits for the device (what CUDA graphs need); nor does a step with
    three prompts packed beside the 16 decodes."""
    assert _decode_step_reads(packed) == ([], [])
    assert gpu_path


@needs_interpreter
def test_a_float_decode_step_reads_nothing_back_inside_the_layers(tmp_path, gpu_path, monkeypatch):
    """The same for a float model: its experts through the grouped dense kernel."""
    from moe.quant.kernels import triton

    launches = []
    real = triton.grouped_dense_matmul
    monkeypatch.setattr(triton, "grouped_dense_matmul", lambda *a, **k: launches.append(1) or real(*a, **k))
    directory = write_checkpoint(tmp_path / "float", pattern="M*MEME", seed=5, **SHAPES)
    assert _decode_step_reads(directory) == ([], [])
    assert launches
