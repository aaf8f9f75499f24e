"""scripts/finetune_chat.py: its conversations weigh exactly what the assistant writes (checked against the
completions written out by hand from the messages), its tool-call parser reads what the template writes, and a
short run on a smoke checkpoint writes a chat checkpoint: the chat tokens, the grown vocabulary with the old rows
kept, the stop ids, the template, a model that loads and is evaluated."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hybrid
from hybrid.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "checkpoints" / "hybrid-mini"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    sys.path.insert(0, str(ROOT / "scripts"))  # finetune_chat imports train
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return module


@pytest.fixture(scope="module")
def ft():
    return _script("finetune_chat")


@pytest.fixture(scope="module")
def chat_data(ft):
    docs = ft.train.prose_documents()
    return ft.ChatData(Tokenizer.from_dir(CKPT), [d for i, d in enumerate(docs) if i % 20], seed=7)


def written(message: dict, thinking: bool) -> str:
    """What the model writes for an assistant message after the generation prompt, by hand."""
    calls = ""
    for call in message.get("tool_calls", []):
        f = call["function"]
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                         for k, v in f["arguments"].items())
        calls += f"<tool_call>\n<function={f['name']}>\n{params}</function>\n</tool_call>\n"
    content = message["content"].strip()
    body = content + ("\n" if content and calls else "") + calls + "<|im_end|>"
    return f"{message['reasoning_content'].strip()}\n</think>\n{body}" if thinking else body


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("kind", ["docs", "continue", "recall", "tool", "no_tool", "multi_turn"])
def test_the_loss_weighs_exactly_what_the_assistant_writes(chat_data, kind, thinking):
    tok = chat_data.tok
    for _ in range(3):
        e = chat_data.example(kind, thinking)
        ids, weights = chat_data.encode(e)
        assert len(ids) == len(weights) and set(weights) <= {0.0, chat_data.assistant_weight}
        users = [i for i, m in enumerate(e.messages) if m["role"] == "user"]
        trained = [m for i, m in enumerate(e.messages) if m["role"] == "assistant" and (not thinking or i > users[-1])]
        assert trained and trained[-1] is e.messages[-1]
        weighted = [i for i, w in zip(ids, weights) if w]
        assert tok.decode(weighted, skip_special_tokens=False) == "".join(written(m, thinking) for m in trained)
        assert ids == tok.encode_chat(e.messages, add_generation_prompt=False, enable_thinking=thinking,
                                      **({"tools": e.tools} if e.tools is not None else {}))


def test_tool_calls_are_parsed_as_qwen3_coder_reads_them(ft):
    call = ("<tool_call>\n<function=get_time>\n<parameter=timezone>\nEurope/Paris\n</parameter>\n</function>\n"
            "</tool_call>\n")
    assert ft.parse_tool_calls(call) == [("get_time", {"timezone": "Europe/Paris"})]
    assert ft.parse_tool_calls("Sure." + call + call) == [("get_time", {"timezone": "Europe/Paris"})] * 2
    assert ft.parse_tool_calls("No call.") == []
    assert ft.parse_tool_calls(call + "and more") is None
    assert ft.parse_tool_calls(call.replace("</function>\n", "")) is None


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "base"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--out", str(out), "--preset", "smoke",
                        "--steps", "1", "--seq-len", "64", "--batch-size", "2", "--eval-every", "100",
                        "--eval-samples", "1", "--save-dtype", "float32"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def finetune(base: Path, out: Path, steps: int) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "finetune_chat.py"), "--base", str(base), "--out",
                        str(out), "--steps", str(steps), "--batch-size", "2", "--chat-rows", "1", "--eval-every", "1",
                        "--threads", "2"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_short_run_writes_a_chat_checkpoint(ft, base, tmp_path):
    resized, trained = tmp_path / "resized", tmp_path / "trained"
    finetune(base, resized, 0)
    finetune(base, trained, 2)
    tok = Tokenizer.from_dir(trained, config_eos=[2])
    ids = [tok.token_to_id(t) for t in ft.CHAT_TOKENS]
    assert ids == list(range(512, 520))  # after the smoke preset's 512 tokens
    config = json.loads((trained / "config.json").read_text())
    assert config["vocab_size"] == 576 and config["eos_token_id"] == 2
    assert json.loads((trained / "generation_config.json").read_text())["eos_token_id"] == [2, 513]
    assert tok.eos_token == "<|im_end|>" and tok.stop_ids == [2, 513]
    assert (trained / "chat_template.jinja").read_text() == (CKPT / "chat_template.jinja").read_text()
    log = json.loads((trained / "finetune_log.json").read_text())
    assert log["summary"]["steps"] == 2 and all("held_out_chat_loss" in r for r in log["history"])
    with safe_open(base / "model.safetensors", "pt") as old, safe_open(resized / "model.safetensors", "pt") as new:
        for name in ("backbone.embeddings.weight", "lm_head.weight"):
            a, b = old.get_tensor(name), new.get_tensor(name).float()
            assert b.shape == (576, a.shape[1]) and torch.equal(b[:512], a.float().to(torch.bfloat16).float())
            assert (b[512:] - a.float().mean(0)).abs().max() < 5 * a.float().std(0).max()
    model, tok = hybrid.load(trained, dtype="fp32")
    docs = ft.train.prose_documents()
    result = ft.chat_eval(model, tok, docs[1:40], n=1, max_new_tokens=4)
    assert result["chat"]["n_conversations"] == 14 and result["chat_samples"]
