"""The `hybrid` command, run as a subprocess on a saved tiny checkpoint."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_checkpoint import write_checkpoint

NANO = Path(__file__).resolve().parents[1] / "checkpoints" / "configs" / "nemotron-3-nano-30b-a3b.config.json"


def run(*args, env: dict[str, str] | None = None):
    return subprocess.run([sys.executable, "-m", "hybrid.cli", *args], capture_output=True, text=True, timeout=300,
                          env=None if env is None else {**os.environ, **env})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("cli"), pattern="ME*-M", seed=5)


def test_generate_streams_text_and_speed(ckpt):
    import hybrid

    model, tok = hybrid.load(ckpt)
    (expected,) = hybrid.generate(model, tok, "The grass is green.", max_new_tokens=12)
    r = run("generate", str(ckpt), "--prompt", "The grass is green.", "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected.text + "\n"
    assert "prefill" in r.stderr and "decode" in r.stderr and "tok/s" in r.stderr


def test_generate_json_chat_and_sampling(ckpt):
    r = run("generate", str(ckpt), "--prompt", "hi", "--chat", "--max-new-tokens", "5", "--temperature", "0.8",
            "--top-k", "20", "--top-p", "0.9", "--seed", "1", "--dtype", "bf16", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] > 3 and 1 <= out["generated_tokens"] <= 5
    assert out["finish_reason"] in ("stop", "length") and out["decode_tokens_per_s"] > 0
    again = json.loads(run("generate", str(ckpt), "--prompt", "hi", "--chat", "--max-new-tokens", "5", "--temperature",
                           "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "1", "--dtype", "bf16", "--json").stdout)
    assert again["token_ids"] == out["token_ids"]


def test_info_json_on_checkpoint(ckpt):
    r = run("info", str(ckpt), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["pattern"] == "ME*-M" and info["layers"] == {"mamba2": 2, "attention": 1, "moe": 1, "mlp": 1}
    assert info["kv_cache_bytes_per_token"] == 1 * 2 * 2 * 8 * 4
    import hybrid

    model = hybrid.load_model(ckpt)
    assert info["parameters"] == sum(t.numel() for t in model.state_dict().values())


def test_info_from_config_alone():
    r = run("info", str(NANO))
    assert r.returncode == 0, r.stderr
    assert "31,577,940,288" in r.stdout and "6,144 bytes per token" in r.stdout and "46.8 MiB" in r.stdout


def test_errors_are_one_clear_line(tmp_path):
    r = run("generate", str(tmp_path / "missing"), "--prompt", "x")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "no such directory" in r.stderr
    (tmp_path / "config.json").write_text("{")
    r = run("info", str(tmp_path))
    assert r.returncode == 2 and "not valid JSON" in r.stderr


def test_cli_user_errors(ckpt):
    r = run("generate", str(ckpt), "--prompt", "")
    assert r.returncode == 2 and "the prompt is empty" in r.stderr
    r = run("generate", str(ckpt), "--prompt", "x", "--threads", "-1")
    assert r.returncode == 2 and "--threads: must be a positive integer" in r.stderr
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("hybrid ")


def test_one_token_has_no_decode_speed(ckpt):
    r = run("generate", str(ckpt), "--prompt", "hello", "--max-new-tokens", "1", "--top-k", "3")
    assert r.returncode == 0, r.stderr
    assert "1 generated: decode - |" in r.stderr
    assert "only matter with --temperature > 0" in r.stderr


def test_speculative_gives_the_plain_greedy_text(tmp_path):
    mtp_ckpt = write_checkpoint(tmp_path / "mtp", pattern="ME*-M", seed=6, num_nextn_predict_layers=1,
                                mtp_pattern="*E")
    args = ["generate", str(mtp_ckpt), "--prompt", "The pass key is 12345.", "--max-new-tokens", "16", "--json"]
    plain, spec = run(*args), run(*args, "--speculative", "3")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    plain, spec = json.loads(plain.stdout), json.loads(spec.stdout)
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    assert 0.0 <= spec["draft_acceptance_rate"] <= 1.0 and "draft_acceptance_rate" not in plain


def test_speculative_needs_an_mtp_block(ckpt):
    r = run("generate", str(ckpt), "--prompt", "hi", "--speculative", "2")
    assert r.returncode == 2 and "MTP block" in r.stderr and str(ckpt) in r.stderr
    off = run("generate", str(ckpt), "--prompt", "hi", "--max-new-tokens", "3", "--speculative", "0", "--json")
    plain = run("generate", str(ckpt), "--prompt", "hi", "--max-new-tokens", "3", "--json")
    assert off.returncode == 0 and json.loads(off.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    assert run("generate", str(ckpt), "--prompt", "hi", "--speculative", "-1").returncode == 2


def test_info_without_model_describes_the_default_checkpoint():
    from hybrid.cli import DEFAULT_CHECKPOINT

    default, explicit = run("info", "--json"), run("info", str(DEFAULT_CHECKPOINT), "--json")
    assert default.returncode == 0, default.stderr
    assert json.loads(default.stdout) == json.loads(explicit.stdout)
    assert json.loads(default.stdout)["pattern"] == "MEM*EMEM*E"


def test_prefix_cache_file_is_reused_across_runs(ckpt, tmp_path):
    store = tmp_path / "prefix.safetensors"
    prompt = "The grass is green. The sky is blue. The sun is yellow. What color is the grass?"
    args = ["generate", str(ckpt), "--prompt", prompt, "--max-new-tokens", "8", "--json",
            "--prefix-cache", str(store), "--prefix-snapshot-interval", "16"]
    first, second = run(*args), run(*args)
    assert first.returncode == 0 and second.returncode == 0, second.stderr
    first, second = json.loads(first.stdout), json.loads(second.stdout)
    assert store.exists() and first["prefix_cache_reused_tokens"] == 0
    n = first["prompt_tokens"]
    assert second["prefix_cache_reused_tokens"] == n  # the whole prompt: its first token from the kept hidden state
    assert second["token_ids"] == first["token_ids"]
    longer = run("generate", str(ckpt), "--prompt", prompt + " Green.", "--max-new-tokens", "8", "--json",
                 "--prefix-cache", str(store))
    assert json.loads(longer.stdout)["prefix_cache_reused_tokens"] == n  # the earlier prompt's end


def test_prefix_cache_file_serves_another_snapshot_interval(ckpt, tmp_path):
    """The interval only says where snapshots are taken: a file written at 16 serves a run at 32."""
    store = tmp_path / "prefix.safetensors"
    prompt = "The grass is green. The sky is blue. The sun is yellow."
    args = ["generate", str(ckpt), "--prompt", prompt, "--max-new-tokens", "4", "--json", "--prefix-cache", str(store)]
    first = run(*args, "--prefix-snapshot-interval", "16")
    assert first.returncode == 0, first.stderr
    n = json.loads(first.stdout)["prompt_tokens"]
    r = run(*args, "--prefix-snapshot-interval", "32")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prefix_cache_reused_tokens"] == n  # the prompt-end snapshot, whole


def run_bytes(*args, stdin: bytes):
    return subprocess.run([sys.executable, "-m", "hybrid.cli", *args], input=stdin, capture_output=True, timeout=300)


@pytest.mark.parametrize("option, value, message", [
    ("--temperature", "nan", "argument --temperature: must be a finite number >= 0 (below 1e-05: greedy), got nan"),
    ("--temperature", "inf", "argument --temperature: must be a finite number >= 0 (below 1e-05: greedy), got inf"),
    ("--temperature", "-0.1", "argument --temperature: must be a finite number >= 0 (below 1e-05: greedy), got -0.1"),
    ("--top-p", "nan", "argument --top-p: must be in (0, 1], got nan"),
    ("--top-p", "0", "argument --top-p: must be in (0, 1], got 0"),
    ("--top-k", "-2", "argument --top-k: must be a positive integer, or 0 or -1 for no limit, got -2"),
    ("--seed", str(2**64), f"argument --seed: must be an integer in [-2**63, 2**64), got {2**64}"),
    ("--repetition-penalty", "0", "argument --repetition-penalty: must be a finite number > 0 (1: none), got 0"),
    ("--frequency-penalty", "2.5", "argument --frequency-penalty: must be a number in [-2, 2] (0: none), got 2.5"),
    ("--presence-penalty", "nan", "argument --presence-penalty: must be a number in [-2, 2] (0: none), got nan"),
])
def test_degenerate_sampling_options_are_usage_errors(ckpt, option, value, message):
    r = run("generate", str(ckpt), "--prompt", "hi", option, value)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_generate_takes_penalties_as_the_library_does(ckpt):
    import hybrid

    model, tok = hybrid.load(ckpt)
    penalties = dict(repetition_penalty=0.3, frequency_penalty=0.5, presence_penalty=0.3)  # < 1: seen tokens favoured
    (expected,) = hybrid.generate(model, tok, "a a a a", max_new_tokens=12, **penalties)
    (free,) = hybrid.generate(model, tok, "a a a a", max_new_tokens=12)
    r = run("generate", str(ckpt), "--prompt", "a a a a", "--max-new-tokens", "12", "--json", "--repetition-penalty",
            "0.3", "--frequency-penalty", "0.5", "--presence-penalty", "0.3")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == expected.token_ids != free.token_ids


def test_tiny_temperature_is_greedy_and_top_k_zero_is_off(ckpt):
    args = ["generate", str(ckpt), "--prompt", "hi", "--max-new-tokens", "6", "--json"]
    greedy = json.loads(run(*args).stdout)["token_ids"]
    tiny = run(*args, "--temperature", "1e-40", "--seed", "1")
    assert tiny.returncode == 0, tiny.stderr
    assert json.loads(tiny.stdout)["token_ids"] == greedy
    sampled = [run(*args, "--temperature", "0.9", "--seed", "4", *k) for k in ([], ["--top-k", "0"], ["--top-k", "-1"])]
    assert all(r.returncode == 0 for r in sampled), sampled[1].stderr
    assert len({tuple(json.loads(r.stdout)["token_ids"]) for r in sampled}) == 1


def test_prompt_that_is_not_utf8_is_a_clear_error(ckpt):
    r = run_bytes("generate", str(ckpt), "--prompt", "-", stdin=b"\xff\xfe hi")
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err
    assert err == "error: stdin is not valid UTF-8: byte 0xff at offset 0 (invalid start byte)\n"
    r = run_bytes("generate", str(ckpt), "--prompt", "-", stdin="naïve café\n".encode() + b"\xc3")
    assert r.returncode == 2 and "stdin is not valid UTF-8: byte 0xc3 at offset 13" in r.stderr.decode()
    r = subprocess.run([sys.executable, "-m", "hybrid.cli", "generate", str(ckpt), "--prompt", b"ab\xff"],
                       capture_output=True, timeout=300)
    assert r.returncode == 2 and r.stderr.decode() == "error: --prompt is not valid UTF-8: byte 0xff at character 2\n"
    ok = run_bytes("generate", str(ckpt), "--prompt", "-", "--max-new-tokens", "2", stdin="naïve café\n".encode())
    assert ok.returncode == 0, ok.stderr


def test_token_past_the_vocabulary_is_a_clear_error(tmp_path):
    small = write_checkpoint(tmp_path / "small", pattern="ME*-M", seed=5, vocab_size=300)  # tokenizer: 320
    r = run("generate", str(small), "--prompt", "The grass is green.", "--max-new-tokens", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "note: " in r.stderr and "the tokenizer has 20 tokens past the model's vocabulary (config.vocab_size 300)" \
        in r.stderr
    assert r.stderr.splitlines()[-1].startswith("error: token id 3")
    assert r.stderr.splitlines()[-1].endswith("is outside the model's vocabulary: ids must lie in [0, 300) "
                                              "(config.vocab_size)")


# ---------------------------------------------------------------------------------- new-user trial faults
@pytest.mark.parametrize("limit", ["1000000000", str(2**31), str(10**22)])
def test_huge_max_new_tokens_is_not_reserved_up_front(tmp_path, limit):
    """A limit far past memory is not reserved up front: generation runs until a stop id (here every id)."""
    small = write_checkpoint(tmp_path / "ck", pattern="ME*-M", seed=5, eos_token_id=list(range(320)))
    r = run("generate", str(small), "--prompt", "The", "--max-new-tokens", limit, "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    out = json.loads(r.stdout)
    assert out["generated_tokens"] == 1 and out["finish_reason"] == "stop"


def test_past_max_position_embeddings_is_one_note(tmp_path):
    small = write_checkpoint(tmp_path / "ck", pattern="ME*-M", seed=5, max_position_embeddings=4)
    r = run("generate", str(small), "--prompt", "The grass", "--max-new-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("note: ") == 1 and "max_position_embeddings (4)" in r.stderr
    assert "Warning" not in r.stderr and json.loads(r.stdout)["generated_tokens"] == 8


@pytest.mark.parametrize("command", ["generate", "quantize"])
def test_threads_above_the_cpus_are_a_usage_error(ckpt, tmp_path, command):
    import os

    args = ["generate", str(ckpt), "--prompt", "x"] if command == "generate" else \
        ["quantize", str(ckpt), str(tmp_path / "out"), "--format", "fp8"]
    r = run(*args, "--threads", "100000")
    bound = 4 * (os.cpu_count() or 1)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"argument --threads: must be at most {bound} (4 x os.cpu_count()), got 100000" in r.stderr
    assert not (tmp_path / "out").exists()


def test_broken_pipe_exits_quietly(ckpt):
    def pipe(*flags):
        return subprocess.run(f"set -o pipefail; {sys.executable} -m hybrid.cli generate {ckpt} --prompt 'The grass is' "
                              f"--max-new-tokens 1000 {' '.join(flags)} | head -c 1", shell=True, capture_output=True,
                              timeout=300, executable="/bin/bash")

    for p in (pipe(), pipe("--json")):
        err = p.stderr.decode()
        assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
        assert p.returncode in (0, 141) and len(p.stdout) == 1  # 0 when every write landed before head left
    assert pipe("--json").stdout == b"{"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_stdout_write_error_is_one_line(ckpt, json_flag):
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "hybrid.cli", "generate", str(ckpt), "--prompt", "The grass is",
                            "--max-new-tokens", "4", *json_flag], stdout=full, stderr=subprocess.PIPE, text=True,
                           timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: writing to stdout failed: [Errno 28] No space left on device"], r.stderr


# ---------------------------------------------------------------------------------------------- first run

def with_generation_config(ckpt, tmp_path, **fields):
    """A copy of `ckpt` whose generation_config.json also says `fields`."""
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    path = copy / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, **fields}))
    return copy


def test_generate_takes_the_checkpoints_sampling_defaults(ckpt, tmp_path):
    """Options left out take generation_config.json's temperature / top_p / top_k (vLLM's reading); given ones
    win; `do_sample: false` is greedy (transformers' reading)."""
    import hybrid

    sampled = with_generation_config(ckpt, tmp_path, temperature=0.9, top_p=0.8, top_k=7)
    model, tok = hybrid.load(sampled)
    assert tok.sampling_defaults == {"temperature": 0.9, "top_p": 0.8, "top_k": 7}
    (expected,) = hybrid.generate(model, tok, "The grass", max_new_tokens=8, temperature=0.9, top_p=0.8, top_k=7,
                                  seed=3)
    (greedy,) = hybrid.generate(model, tok, "The grass", max_new_tokens=8)
    r = run("generate", str(sampled), "--prompt", "The grass", "--max-new-tokens", "8", "--seed", "3", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == expected.token_ids != greedy.token_ids
    r = run("generate", str(sampled), "--prompt", "The grass", "--max-new-tokens", "8", "--temperature", "0", "--json")
    assert json.loads(r.stdout)["token_ids"] == greedy.token_ids and "note:" not in r.stderr
    off = with_generation_config(ckpt, tmp_path / "off", do_sample=False, temperature=0.9)
    r = run("generate", str(off), "--prompt", "The grass", "--max-new-tokens", "8", "--json")
    assert json.loads(r.stdout)["token_ids"] == greedy.token_ids


def test_info_exits_1_when_the_model_does_not_fit():
    small = run("info", str(NANO), "--memory", "32GB")
    assert small.returncode == 1 and "does not fit" in small.stdout
    fits = run("info", str(NANO), "--format", "nvfp4", "--memory", "32GB")
    assert fits.returncode == 0 and "concurrency" in fits.stdout
    assert run("info", str(NANO), "--memory", "32GB", "--json").returncode == 1


def test_build_kernels_reports_each_kernel():
    r = run("build-kernels")
    names = [line.split("  ")[0] for line in r.stdout.splitlines()]
    assert names == ["packed-weight", "AMX", "MoE router", "Mamba-2", "decode attention", "RMSNorm"], r.stdout
    assert r.returncode == (1 if "unavailable" in r.stdout else 0), r.stderr
    off = subprocess.run([sys.executable, "-m", "hybrid.cli", "build-kernels"], capture_output=True, text=True,
                         env={**__import__("os").environ, "HYBRID_CPU_KERNELS": "0"}, timeout=300)
    assert off.returncode == 0 and "off" in off.stderr and off.stdout == ""


def test_chat_template_file_replaces_the_checkpoints(ckpt, tmp_path):
    """--chat-template FILE renders with FILE (vLLM's --chat-template), on generate, chat and serve alike."""
    import hybrid

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}<assistant>")
    model, tok = hybrid.load(ckpt)
    (theirs,) = hybrid.generate(model, tok, "The grass", max_new_tokens=6, chat=True)
    tok.use_chat_template(template)
    assert tok.apply_chat_template([{"role": "user", "content": "The grass"}]) == "<user> The grass\n<assistant>"
    (ours,) = hybrid.generate(model, tok, "The grass", max_new_tokens=6, chat=True)
    r = run("generate", str(ckpt), "--prompt", "The grass", "--chat", "--chat-template", str(template),
            "--max-new-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["prompt_tokens"], out["token_ids"]) == (ours.prompt_tokens, ours.token_ids) != \
           (theirs.prompt_tokens, theirs.token_ids)
    for command in (["generate", str(ckpt), "--prompt", "x", "--chat"], ["chat", str(ckpt)], ["serve", str(ckpt)]):
        r = run(*command, "--chat-template", str(tmp_path / "missing.jinja"))
        assert r.returncode == 2 and r.stderr.startswith("error: --chat-template ") and "missing.jinja" in r.stderr


def test_generate_on_the_cpu_device_gives_the_default_text(ckpt):
    r = run("generate", str(ckpt), "--prompt", "The grass is green.", "--max-new-tokens", "8", "--json")
    on_cpu = run("generate", str(ckpt), "--prompt", "The grass is green.", "--max-new-tokens", "8", "--json",
                 "--device", "cpu")
    assert r.returncode == 0 and on_cpu.returncode == 0, r.stderr + on_cpu.stderr
    assert json.loads(on_cpu.stdout)["token_ids"] == json.loads(r.stdout)["token_ids"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is present")
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"], ["chat"], ["info"]])
def test_cuda_without_a_cuda_device_is_one_line(ckpt, command, tmp_path):
    args = [command[0], str(ckpt), *command[1:], "--device", "cuda"]
    r = run(*args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: --device cuda: no CUDA device")
    r = run("quantize", str(ckpt), str(tmp_path / "out"), "--format", "fp8", "--device", "cuda:1")
    assert r.returncode == 2 and r.stderr.startswith("error: --device cuda:1: no CUDA device")
    assert not (tmp_path / "out").exists()


def test_info_names_each_operations_backend(ckpt):
    r = run("info", str(ckpt), "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    backends = json.loads(r.stdout)["backends"]
    assert backends["device"] == "cpu"
    assert set(backends["operations"]) >= {"Mamba-2 prompt scan", "Mamba-2 decode step", "decode attention",
                                           "FP8 / NVFP4 products and experts", "MXFP4 products and experts"}
    gpu_path = run("info", str(ckpt), "--device", "cpu", "--json", env={"HYBRID_BACKEND": "triton"})
    ops = json.loads(gpu_path.stdout)["backends"]["operations"]
    assert ops["FP8 / NVFP4 products and experts"] != backends["operations"]["FP8 / NVFP4 products and experts"]
    bad = run("info", str(ckpt), "--device", "cpu", env={"HYBRID_BACKEND": "rocm"})
    assert bad.returncode == 2 and bad.stderr.startswith("error: HYBRID_BACKEND='rocm': expected one of auto, triton")


def test_a_required_gpu_kernel_that_does_not_import_is_one_line_before_the_load(ckpt, monkeypatch, capsys):
    """HYBRID_REQUIRE_CUDA_KERNELS=1 on the GPU path (here CPU tensors under HYBRID_BACKEND=triton): without triton,
    the GPU path's kernel package, every command stops at once, naming it (a server refuses to start); mamba-ssm
    and causal-conv1d are optional, so their absence stops nothing."""
    import socket

    import hybrid.cli
    import hybrid.devices
    from moe.quant.kernels import backend, triton

    monkeypatch.setenv("HYBRID_REQUIRE_CUDA_KERNELS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with backend.override("triton"):
        if triton.available():
            hybrid.devices.check_required_kernels("cpu")  # whether mamba-ssm imports or not
        monkeypatch.setattr(triton, "available", lambda: False)
        monkeypatch.setattr(triton, "IMPORT_ERROR", "ModuleNotFoundError: No module named 'triton'")
        for args in (["generate", str(ckpt), "--prompt", "hi"], ["serve", str(ckpt), "--port", str(port)]):
            assert hybrid.cli.main(args) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1, err
            assert err.startswith("error: HYBRID_REQUIRE_CUDA_KERNELS=1 and the GPU path's kernels do not all import: "
                                  "triton (ModuleNotFoundError: No module named 'triton')"), err
