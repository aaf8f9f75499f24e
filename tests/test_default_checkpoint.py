"""The shipped default checkpoint (checkpoints/hybrid-mini): published layout, every part of the architecture,
the reference implementation's logits, and passkey retrieval at its training length."""

import json
from pathlib import Path

import pytest
import torch

import hybrid
from hybrid.eval.tasks import fit_to_length
from hybrid.generate import generate_ids

CKPT = Path(__file__).resolve().parents[1] / "checkpoints" / "hybrid-mini"
TRAIN_LENGTH = 256
GREEDY = Path(__file__).resolve().parent / "data" / "hybrid_mini_greedy.json"


@pytest.fixture(scope="module")
def loaded():
    return hybrid.load(CKPT)


def test_layout_size_and_architecture(loaded):
    model, _ = loaded
    files = {p.name for p in CKPT.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "README.md", "training_log.json"} <= files
    assert sum(p.stat().st_size for p in CKPT.iterdir()) <= 50 * 2**20
    config = json.loads((CKPT / "config.json").read_text())
    pattern = config["hybrid_override_pattern"]
    assert {"M", "*", "E"} <= set(pattern) and pattern.count("*") < pattern.count("M")
    assert config["n_routed_experts"] > config["num_experts_per_tok"] >= 2 and config["n_shared_experts"] == 1
    assert model.mtp is not None and config["num_nextn_predict_layers"] == 1
    assert model.dtype == torch.bfloat16


def transformers_greedy(prompt_ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' NemotronHForCausalLM on the same files, fp32: (n greedy tokens, prompt logits)."""
    from transformers import NemotronHForCausalLM

    # time_step_min=0.0: see test_train.py (transformers clamps dt at an initialisation setting)
    theirs = NemotronHForCausalLM.from_pretrained(CKPT, dtype=torch.float32, time_step_min=0.0).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        logits = theirs(torch.tensor([ids])).logits
        for _ in range(n):  # full forward per token: no cache or generation settings between us and the model
            ids.append(int(theirs(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):], logits


def test_stored_greedy_continuation_is_transformers_and_ours():
    """tests/data/hybrid_mini_greedy.json holds a fixed prompt and the greedy tokens transformers produced
    from these files (fp32); it still does, and our model produces the same tokens and logits."""
    stored = json.loads(GREEDY.read_text())
    theirs, ref_logits = transformers_greedy(stored["prompt_ids"], len(stored["greedy_ids"]))
    assert theirs == stored["greedy_ids"]
    ours, _ = hybrid.load(CKPT, dtype="fp32")
    with torch.no_grad():
        assert (ours(torch.tensor([stored["prompt_ids"]])) - ref_logits).abs().max() < 1e-3
    (c,) = generate_ids(ours, [stored["prompt_ids"]], max_new_tokens=len(stored["greedy_ids"]))
    assert c.token_ids == stored["greedy_ids"]


@pytest.mark.parametrize("depth", [0.0, 25.0, 50.0, 75.0, 100.0])
def test_passkey_at_training_length(loaded, depth):
    """Unseen passkeys (seeds the training stream never drew) at five depths of a 496-token prompt."""
    model, tok = loaded
    for seed in (9001, 9002):
        s = fit_to_length("passkey", tok, TRAIN_LENGTH - 16, seed, depth_percent=depth)
        (c,) = generate_ids(model, [tok.encode(s.prompt)], max_new_tokens=8)
        assert tok.decode(c.token_ids).strip().startswith(s.continuation.strip()), (depth, seed, tok.decode(c.token_ids))
