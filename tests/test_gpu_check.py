"""scripts/gpu_check.py, on the CPU: its help documents each step, --device cuda without a CUDA device is a usage
error, a `--device cpu --small` run passes every check and reports each one, and each kind of check fails when
what it checks is wrong (a broken kernel put in through the seam, a model or engine that decodes differently).
No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SCRIPT = SCRIPTS / "gpu_check.py"
sys.path.insert(0, str(SCRIPTS))

import gpu_check  # noqa: E402

CPU = torch.device("cpu")


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_help_documents_each_step():
    done = run("--help", timeout=60)
    assert done.returncode == 0, done.stderr
    for step in ("1. environment", "2. kernels", "3. model", "4. engine", "5. --timings"):
        assert step in done.stdout, step
    for what in ("HYBRID_REQUIRE_CUDA_KERNELS=1", "HYBRID_CPU_KERNELS=0", "--small", "--out", "Exit status"):
        assert what in done.stdout, what


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_cuda_device_is_one_error_line_and_status_2(tmp_path):
    done = run("--device", "cuda", "--out", str(tmp_path / "report.json"), timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "CUDA" in lines[0], done.stderr
    assert done.stdout == "" and not (tmp_path / "report.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_no_arguments_without_a_cuda_device_points_to_the_cpu_check():
    """The default run checks a GPU: without one it says so at once (instead of Nano's widths on the CPU)."""
    done = run(timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: no CUDA device is visible") and "--device cpu --small" in done.stderr


def test_timings_on_the_cpu_need_small():
    done = run("--device", "cpu", "--timings", timeout=60)
    assert done.returncode == 2 and done.stderr.strip().startswith("error: ") and "--small" in done.stderr


def report_path(done) -> str:
    return done.args[done.args.index("--out") + 1]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One `--device cpu --small --timings` run (the timings on bench.py's tiny preset, built under tmp)."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    done = run("--device", "cpu", "--small", "--timings", "--workdir", str(tmp / "work"), "--out",
               str(tmp / "report.json"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads((tmp / "report.json").read_text())


def test_a_small_cpu_run_passes_and_reports_every_kernel_check(cpu_run):
    done, report = cpu_run
    assert report["passed"] and report["device"] == "cpu" and report["small"]
    assert report["steps"] == {"environment": True, "kernels": True, "model": True, "engine": True}
    assert done.stdout.strip().splitlines()[-2:] == ["all checks passed", f"report: {report_path(done)}"]
    assert report["project"]["version"] and report["started"]
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["backends"] and env["pass"]

    dtypes = ["fp32", "bf16", "fp16"]
    want = {(name, d) for name in gpu_check.KERNEL_CHECKS for d in dtypes}
    want |= {("experts float", "bf16")} | {(f"experts {f}", d) for f in ("fp8", "nvfp4", "mxfp4") for d in dtypes}
    got = {(r["check"], r["dtype"]): r for r in report["kernels"]}
    assert set(got) == want and len(report["kernels"]) == len(want)
    for (name, d), r in got.items():
        assert r["pass"] and "exception" not in r, r
        assert r["tolerance"] == gpu_check.TOLERANCE[d]
        assert isinstance(r["error"], float) and 0 <= r["error"] <= r["tolerance"], r
        assert r["error"] == max(r["outputs"].values())
    # the experts run one token and a batch; the Mamba checks compare every output, the window and state included
    assert set(got["experts nvfp4", "fp32"]["outputs"]) == {"1 token", f"{gpu_check.SMALL.tokens} tokens"}
    assert set(got["ssd_scan", "bf16"]["outputs"]) == {"y", "final_state"}
    assert set(got["conv_step", "fp16"]["outputs"]) == {"out", "window"}
    assert got["conv_step", "fp32"]["outputs"]["window"] == 0  # the rolled window is exact


def test_a_small_cpu_run_checks_the_models_and_the_engine(cpu_run):
    _, report = cpu_run
    models = {r["checkpoint"]: r for r in report["model"]}
    assert set(models) == {"bf16", "fp8", "nvfp4", "mxfp4"}
    for r in models.values():
        assert r["pass"] and r["steps"] == 16 and r["tokens_equal"] and r["reference_tokens"] == r["device_tokens"]
        assert 0 <= r["kl_mean"] <= r["kl_tolerance"]["mean"] and 0 <= r["kl_max"] <= r["kl_tolerance"]["max"]
    engine = report["engine"]
    assert engine["pass"] and engine["requests"] == 8 and engine["equal"] == 8
    assert engine["syncs"] is None  # counted on CUDA only (torch's sync debug mode)
    assert sorted(engine["prompt_lengths"]) == sorted(gpu_check.ENGINE_PROMPT_LENGTHS)
    assert all(len(r["device"]) == 16 and r["device"] == r["reference"] for r in engine["rows"])


def test_a_small_cpu_run_reports_timings(cpu_run):
    _, report = cpu_run
    t = report["timings"]
    assert t["checkpoint"] == "tiny" and set(t["decode"]) == {"1", "4"} and t["prefill"]["tokens"] == 256
    figures = [t["decode"]["1"]["tok_s"], t["decode"]["4"]["tok_s"], t["prefill"]["tok_s"], t["copy_bandwidth_gb_s"],
               t["active_weight_bytes_per_token"], t["peak_rss_bytes"]]
    assert all(isinstance(v, (int, float)) and v > 0 for v in figures)  # numbers, not goals
    ratio = t["decode"]["1"]["tok_s"] * t["active_weight_bytes_per_token"] / (t["copy_bandwidth_gb_s"] * 1e9)
    assert t["decode_b1_roofline_ratio"] == pytest.approx(ratio, rel=1e-6)


# ---------------------------------------------------------------------------------------------- checks can fail
def _broken_ssd_scan(real):
    return lambda x, dt, A, B, C, chunk_size, state=None: real(x, dt, A * 0.5, B, C, chunk_size, state)  # a wrong decay


def _broken_ssd_step(real):
    return lambda x, dt, A, B, C, state: real(x, dt, A, C, B, state)  # B and C swapped


def _broken_conv_step(real):
    return lambda x, window, weight, bias: real(x, window.clone(), weight, bias)  # the window never rolls


def _broken_rms_norm(real):
    return lambda x, weight, eps: real(x, torch.ones_like(weight), eps)  # the weight ignored


def _broken_gated_rms_norm(real):
    return lambda x, z, weight, n_groups, eps, out_dtype: real(x, z, weight, 1, eps, out_dtype)  # one group


BROKEN = {"ssd_scan": ("hybrid.ops", "ssd_scan", _broken_ssd_scan),
          "ssd_step": ("hybrid.ops", "ssd_step", _broken_ssd_step),
          "conv_step": ("hybrid.ops", "conv_step", _broken_conv_step),
          "rms_norm": ("hybrid.ops", "rms_norm", _broken_rms_norm),
          "gated_rms_norm": ("hybrid.ops", "gated_rms_norm", _broken_gated_rms_norm),
          # the paged decode attention with the KV heads of the query groups swapped
          "attention": ("hybrid.serving.paged_cache", "paged_decode_attention",
                        lambda real: lambda q, k, v, rows: real(q, k.flip(1), v.flip(1), rows)),
          # the forward without a cache with twice the decay
          "mamba_scan": ("hybrid.ops", "mamba_scan",
                         lambda real: lambda xBC, dt, w, b, dt_bias, A, *rest, **kw: real(xBC, dt, w, b, dt_bias, 2 * A,
                                                                                         *rest, **kw))}


def _kernel_check(name: str, dtype: str) -> dict:
    return gpu_check._guarded(name, dtype, gpu_check.TOLERANCE[dtype],
                              lambda: gpu_check.KERNEL_CHECKS[name](CPU, gpu_check.SMALL, dtype))


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_kernel_check_fails_when_the_kernel_is_wrong(monkeypatch, name):
    import importlib

    module, attr, breaker = BROKEN[name]
    assert name in gpu_check.KERNEL_CHECKS and _kernel_check(name, "fp32")["pass"]
    target = importlib.import_module(module)
    monkeypatch.setattr(target, attr, breaker(getattr(target, attr)))
    for dtype in ("fp32", "bf16"):
        r = _kernel_check(name, dtype)
        assert not r["pass"] and "exception" not in r and r["error"] > r["tolerance"], r


def test_a_kernel_that_raises_or_returns_nan_fails_its_check(monkeypatch):
    import hybrid.ops

    def raises(*args):
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(hybrid.ops, "ssd_step", raises)
    r = _kernel_check("ssd_step", "fp32")
    assert not r["pass"] and r["error"] is None and r["exception"] == "RuntimeError: no kernel image"
    real = hybrid.ops.rms_norm
    monkeypatch.setattr(hybrid.ops, "rms_norm", lambda x, w, eps: real(x, w, eps) * float("nan"))
    r = _kernel_check("rms_norm", "fp32")
    assert not r["pass"] and r["error"] == "nan"


def test_the_expert_checks_fail_when_other_ranks_experts_are_not_skipped(monkeypatch):
    """Ids outside [0, E) must add nothing: a bank that clamps them into range (so it runs experts it should skip)
    fails every packed check; the float bank, left as it is, still passes."""
    from moe.experts import QuantExpertBank

    real = QuantExpertBank.forward
    monkeypatch.setattr(QuantExpertBank, "forward",
                        lambda self, x, weights, ids: real(self, x, weights, ids.clamp(0, self.n_experts - 1)))
    with torch.inference_mode():
        results = {(r["check"], r["dtype"]): r for r in gpu_check.check_experts(CPU, gpu_check.SMALL, ["fp32"])}
    assert results.pop(("experts float", "bf16"))["pass"]
    assert set(results) == {("experts fp8", "fp32"), ("experts nvfp4", "fp32"), ("experts mxfp4", "fp32")}
    for r in results.values():
        assert not r["pass"] and r["error"] > r["tolerance"], r


def test_the_model_comparison_fails_on_a_different_token_or_distribution():
    g = torch.Generator().manual_seed(0)
    ref = (torch.randn(6, 50, generator=g) * 3).log_softmax(-1)
    tokens = ref.argmax(-1).tolist()
    tol = gpu_check.KL_TOLERANCE["fp32"]
    same = gpu_check.compare_greedy(tokens, ref, ref.clone(), 0.05, tol)
    assert same["pass"] and same["tokens_equal"] and same["kl_max"] == 0

    other = ref.clone()
    other[3, tokens[3]] -= 20  # step 3 picks another token (the reference's top-2 gap is no tie)
    r = gpu_check.compare_greedy(tokens, ref, other.log_softmax(-1), 0.05, tol)
    assert not r["pass"] and r["differing_steps"] == [3] and r["excused_steps"] == []

    logits = torch.randn(6, 50, generator=g) * 3
    first, second = logits[2].topk(2).indices.tolist()
    logits[2, second] = logits[2, first] - 0.01  # a near-tie at step 2 (gap 0.01 < 0.05) ...
    tie = logits.log_softmax(-1)
    flipped = logits.clone()
    flipped[2, second] += 0.02  # ... which the other of the two wins
    r = gpu_check.compare_greedy(tie.argmax(-1).tolist(), tie, flipped.log_softmax(-1), 0.05, tol)
    assert r["differing_steps"] == [2] and r["excused_steps"] == [2] and r["pass"]

    noisy = (ref + torch.randn(ref.shape, generator=g)).log_softmax(-1)
    noisy.scatter_(1, torch.tensor(tokens)[:, None], 10.0)  # the same argmax everywhere, another distribution
    r = gpu_check.compare_greedy(tokens, ref, noisy.log_softmax(-1), 0.05, tol)
    assert r["tokens_equal"] and not r["pass"] and r["kl_mean"] > tol[0]


def test_the_engine_comparison_fails_on_a_different_token_unless_the_reference_had_a_tie():
    ref = [[5, 6, 7, 8], [9, 10, 11, 12]]
    gaps = [[3.0, 3.0, 3.0, 3.0], [3.0, 0.01, 3.0, 3.0]]
    assert gpu_check.compare_engine(ref, gaps, [r[:] for r in ref], 0.05)["pass"]
    r = gpu_check.compare_engine(ref, gaps, [[5, 6, 99, 8], ref[1]], 0.05)
    assert not r["pass"] and r["rows"][0]["first_difference"] == 2 and not r["rows"][0]["excused"]
    r = gpu_check.compare_engine(ref, gaps, [ref[0], [9, 77, 78, 79]], 0.05)
    assert r["pass"] and r["excused"] == 1 and r["equal"] == 1
    assert not gpu_check.compare_engine(ref, gaps, [ref[0][:3], ref[1]], 0.05)["pass"]  # one token short
