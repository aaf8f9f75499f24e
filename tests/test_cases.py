"""The fault cases of docs/cases.md (1 to 11), one named test each, against independent oracles.

Oracles: the naive float64 Mamba-2 mixer of helpers.py (sequential per-head loop, written from
docs/semantics.md), float64 hand computations of the router and the experts, the same prompt run
alone, one pass over the whole sequence, and transformers' `NemotronHForCausalLM` for loading.
Cases 12 and 13 (quantized formats) are tested with the quantized checkpoints: case 12 in
tests/test_quant_checkpoints.py (every expert keeps its own scale), case 13 in tests/test_quant_oracles.py
(the NVFP4 global scale as ModelOpt's multiplier and compressed-tensors' divisor).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import hybrid
from hybrid import CheckpointError
from hybrid.config import HybridConfig
from hybrid.layers.norm import GatedRMSNorm
from hybrid.ops import ssd as ssd_ops
from hybrid.layers.moe import MoE
from moe import route
from hybrid.generate import generate_ids
from helpers import (
    REPORT,
    Packed,
    assert_same_greedy,
    mamba_config,
    naive_mamba_mixer,
    new_mamba_state,
    our_greedy,
    random_ids,
    random_mixer,
    run_mixer,
    tf_logits,
)


# ------------------------------------------------------------------------------------------- helpers
def mixer_prefill_then_decode(mixer, config, x: torch.Tensor, n_prefill: int) -> tuple[torch.Tensor, object]:
    """Our mixer over x [B, T, H]: one chunked prefill of n_prefill tokens, then one token per step."""
    state = new_mamba_state(config, x.shape[0], dtype=x.dtype)
    outs = [run_mixer(mixer, x[:, :n_prefill], state, past=0)]
    for t in range(n_prefill, x.shape[1]):
        outs.append(run_mixer(mixer, x[:, t : t + 1], state, past=t))
    return torch.cat(outs, dim=1), state


def assert_close64(ours: torch.Tensor, ref: torch.Tensor, rtol=1e-5, what=""):
    """fp32 result vs float64 oracle: error within rtol of the oracle's scale (max |ref|)."""
    ours, ref = ours.detach(), ref.detach()
    scale = float(ref.abs().max())
    err = float((ours.double() - ref).abs().max())
    assert err <= rtol * scale + 1e-7, f"{what}: max error {err:.3g} for a scale of {scale:.3g}"


def record_ops(monkeypatch):
    """Record the arguments our mixer passes to ssd_scan / ssd_step (x, dt, A, B, C). The decode step runs
    its PyTorch specification (`hybrid.ops.decode`, whose SSD step is recorded) and a prefill the PyTorch
    prefill (the prompt-chunk kernel is off); the fused CPU kernels are held to those specifications in
    tests/test_mamba_kernel.py."""
    import hybrid.layers.mamba2 as mamba2
    import hybrid.ops as ops
    import hybrid.ops.decode as decode

    calls = []
    real_scan, real_step = ops.ssd_scan, ops.ssd_step

    def scan(x, dt, A, B, C, chunk_size, state=None):
        calls.append(("scan", x.clone(), dt.clone(), A.clone(), B.clone(), C.clone()))
        return real_scan(x, dt, A, B, C, chunk_size, state)

    def step(x, dt, A, B, C, state):
        calls.append(("step", x.clone(), dt.clone(), A.clone(), B.clone(), C.clone()))
        return real_step(x, dt, A, B, C, state)

    def decode_step(*args):
        return decode.mamba_decode_step(*args, ops.conv_step, step)

    monkeypatch.setattr(ops, "ssd_scan", scan)
    monkeypatch.setattr(mamba2, "mamba_decode_step", decode_step)
    monkeypatch.setattr(ops, "mamba_chunks_fused", lambda *args: None)
    return calls


def rewrite_checkpoint(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file checkpoint, passing its tensors {name: tensor} through `edit`."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    save_file(edit(dict(tensors)), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# ------------------------------------------------------------------------------------- Mamba-2 cases
def test_case01_dt_limits(checkpoint, tmp_path, monkeypatch):
    """dt is clamped to `time_step_limit` and nothing else, on the prefill and the decode path."""
    # (a) time_step_min (an init setting) alone changes nothing, bit for bit.
    ck = checkpoint("all4_ng2_gqa4_c8")
    changed = tmp_path / "time_step_min"
    shutil.copytree(ck.directory, changed)
    cfg = json.loads((changed / "config.json").read_text())
    cfg["time_step_min"] = 0.2  # inside the range of this model's dt values
    (changed / "config.json").write_text(json.dumps(cfg))
    other = hybrid.load_model(changed, dtype=torch.float32)
    ids = random_ids(21, ck.vocab_size, seed=5)
    with torch.no_grad():
        assert torch.equal(other(ids), ck.ours(ids))
    assert torch.equal(our_greedy(other, ids, 6)[1], our_greedy(ck.ours, ids, 6)[1])
    # ... and that value WOULD change the logits if it were used as a clamp:
    cfg["time_step_limit"] = [0.2, {"__float__": "Infinity"}]
    (changed / "config.json").write_text(json.dumps(cfg))
    clamped = hybrid.load_model(changed, dtype=torch.float32)
    with torch.no_grad():
        assert (clamped(ids) - ck.ours(ids)).abs().max() > 1e-3

    # (b) time_step_limit = (0.01, 0.1) really bounds dt (dt spread over [1e-3, 2] before the clamp).
    config = mamba_config(time_step_limit=(0.01, 0.1), chunk_size=8)
    mixer = random_mixer(config, seed=11, dt_range=(1e-3, 2.0))
    x = torch.randn(2, 24, config.hidden_size, generator=torch.Generator().manual_seed(3))
    calls = record_ops(monkeypatch)
    ours, state = mixer_prefill_then_decode(mixer, config, x, n_prefill=19)
    assert {c[0] for c in calls} == {"scan", "step"}
    dts = torch.cat([c[2].reshape(-1) for c in calls])
    assert dts.min() >= 0.01 and dts.max() <= 0.1
    assert (dts == 0.01).any() and (dts == 0.1).any(), "both bounds should be active in this test"
    ref, _, ref_state = naive_mamba_mixer(mixer, x, dt_limit=(0.01, 0.1))
    assert_close64(ours, ref, what="clamped mixer output")
    assert_close64(state.ssm, ref_state, what="clamped final state")
    unclamped, _, _ = naive_mamba_mixer(mixer, x)
    assert (unclamped - ref).abs().max() > 1e-2 * ref.abs().max(), "the clamp must matter in this test"


@pytest.mark.parametrize("n_groups", [1, 2, 4, 8])
def test_case02_head_to_group_mapping(n_groups):
    """Head h reads B/C group h // (nh / ng), checked against the naive per-head float64 recurrence
    (prefill of 21 tokens over chunks of 8, then 3 decode steps, batch 2)."""
    config = mamba_config(mamba_num_heads=8, mamba_head_dim=4, n_groups=n_groups, chunk_size=8)
    mixer = random_mixer(config, seed=20 + n_groups)
    x = torch.randn(2, 24, config.hidden_size, generator=torch.Generator().manual_seed(n_groups))
    ours, state = mixer_prefill_then_decode(mixer, config, x, n_prefill=21)
    ref, ref_window, ref_state = naive_mamba_mixer(mixer, x)
    assert_close64(ours, ref, what=f"n_groups={n_groups} output")
    assert_close64(state.ssm, ref_state, what=f"n_groups={n_groups} SSM state")
    assert_close64(state.conv, ref_window, what=f"n_groups={n_groups} conv window")
    if 1 < n_groups < 8:  # the tiled (`repeat`) mapping differs, so this test would catch it
        tiled, _, _ = naive_mamba_mixer(mixer, x, tiled_groups=True)
        assert (tiled - ref).abs().max() > 1e-2 * ref.abs().max()


def test_case03_grouped_gated_norm():
    """n_groups = 8: the gated RMSNorm normalises each d_inner/8 slice on its own, after the silu(z) gate."""
    g = torch.Generator().manual_seed(0)
    # the norm module alone vs float64
    norm = GatedRMSNorm(32, 8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(32, generator=g))
    y, z = torch.randn(3, 5, 32, generator=g), torch.randn(3, 5, 32, generator=g)
    h = y.double() * F.silu(z.double())
    h = h.view(3, 5, 8, 4)
    ref = (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).view(3, 5, 32) * norm.weight.double()
    assert_close64(norm(y, z, out_dtype=torch.float32), ref, what="GatedRMSNorm")
    # norm-before-gate would differ
    wrong = y.double().view(3, 5, 8, 4)
    wrong = (wrong / torch.sqrt(wrong.pow(2).mean(-1, keepdim=True) + 1e-5)).view(3, 5, 32)
    assert ((wrong * F.silu(z.double()) * norm.weight.double()) - ref).abs().max() > 1e-2

    # the whole mixer with n_groups = nh = 8
    config = mamba_config(mamba_num_heads=8, mamba_head_dim=4, n_groups=8, chunk_size=8)
    mixer = random_mixer(config, seed=3)
    x = torch.randn(2, 13, config.hidden_size, generator=g)
    ours = run_mixer(mixer, x)
    ref, _, _ = naive_mamba_mixer(mixer, x)
    assert_close64(ours, ref, what="mixer with n_groups=8")
    whole, _, _ = naive_mamba_mixer(mixer, x, norm_groups=1)  # a whole-vector norm differs
    assert (whole - ref).abs().max() > 1e-2 * ref.abs().max()


def left_pad(prompts: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :], mask[i, T - len(p) :] = p, 1
    return ids, mask


PADDING_LENGTHS = [3, 11, 20, 2]  # chunk 8, conv_kernel 4: shorter and longer than both


def test_case04_left_padding(checkpoint):
    """Each row of a left-padded batch (a forward without a cache: scoring, training) gives the logits of its real
    positions alone; generated together (packed sequences, no padding), each prompt gives its greedy tokens
    alone."""
    ck = checkpoint("all4_ng2_gqa4_c8")
    model = ck.ours
    prompts = [random_ids(n, ck.vocab_size, seed=40 + n)[0] for n in PADDING_LENGTHS]
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        batch_logits = model(ids, attention_mask=mask)
    together = generate_ids(model, [p.tolist() for p in prompts], max_new_tokens=16)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            alone = model(p[None])
        real = batch_logits[i, ids.shape[1] - len(p) :]
        assert (real - alone[0]).abs().max() <= 1e-5, f"row {i} (length {len(p)}) prefill logits"
        tokens, steps = our_greedy(model, p[None], 16)
        assert_same_greedy(torch.tensor([together[i].token_ids]), tokens, steps)


def test_case05_packed_prefill_and_decode(checkpoint):
    """After one packed prefill of prompts of different lengths, each sequence's conv window and SSM state (in
    its slot) equal those of the prompt run alone, and decoding them together continues each as alone."""
    ck = checkpoint("all4_ng2_gqa4_c8")
    model = ck.ours
    prompts = [random_ids(n, ck.vocab_size, seed=50 + n)[0] for n in PADDING_LENGTHS]
    packed = Packed(model, len(prompts))
    logits = packed.step([p.tolist() for p in prompts])
    for i, p in enumerate(prompts):
        alone = model.new_cache(1)
        with torch.no_grad():
            model(p[None], cache=alone)
        slot = packed.rows[i][1]
        for layer, (conv, ssm) in enumerate(zip(packed.slots.conv, packed.slots.ssm)):
            assert torch.allclose(conv[slot], alone.slots.conv[layer][0], atol=1e-6), f"row {i} layer {layer} conv"
            assert torch.allclose(ssm[slot], alone.slots.ssm[layer][0], atol=1e-5), f"row {i} layer {layer} SSM state"
    batch_steps = [torch.stack([rows[-1] for rows in logits])]
    for _ in range(15):
        batch_steps.append(torch.cat(packed.step([[int(t)] for t in batch_steps[-1].argmax(-1)])))
    batch_steps = torch.stack(batch_steps, 1)
    batch_tokens = batch_steps.argmax(-1)
    for i, p in enumerate(prompts):
        tokens, steps = our_greedy(model, p[None], 16)
        assert_same_greedy(batch_tokens[i : i + 1], tokens, steps)
        if torch.equal(batch_tokens[i], tokens[0]):
            assert (batch_steps[i] - steps[0]).abs().max() <= 1e-5, f"row {i} decode logits"


def split_patterns(T: int, chunk: int, K: int) -> dict[str, list[int]]:
    def repeat(n):
        sizes = [n] * (T // n)
        return sizes + ([T - sum(sizes)] if sum(sizes) < T else [])

    rng = random.Random(0)
    rand = []
    while sum(rand) < T:
        rand.append(min(rng.choice([1, 2, 3, 5, chunk - 1, chunk, chunk + 1, 2 * chunk + 3, 40]), T - sum(rand)))
    return {"1": repeat(1), "2": repeat(2), "K-1": repeat(K - 1), "chunk-1": repeat(chunk - 1),
            "chunk+1": repeat(chunk + 1), "4x64": repeat(64), "random": rand}


def test_case06_segments(checkpoint):
    """A 256-token sequence fed in segments of any lengths with a carried cache equals one pass."""
    ck = checkpoint("ng1_mha_c16")  # MM*E-, chunk 16, conv_kernel 4
    model = ck.ours
    ids = random_ids(256, ck.vocab_size, seed=6)
    with torch.no_grad():
        one_pass = model(ids)
        for name, sizes in split_patterns(256, ck.chunk_size, 4).items():
            assert sum(sizes) == 256
            cache = model.new_cache(1)
            outs, start = [], 0
            for n in sizes:
                outs.append(model(ids[:, start : start + n], cache=cache))
                start += n
            diff = (torch.cat(outs, 1) - one_pass).abs().max()
            assert diff <= 1e-4, f"split {name} {sizes[:6]}...: max diff {diff:.3g}"


def test_case07_no_exp_overflow():
    """Large |A| * dt (A = -50, dt in [1, 5]: dt*A down to -250 per step, cumulative sums far below
    -1e4 over a chunk of 64): outputs stay finite and match float64, with and without a carried state."""
    config = mamba_config(chunk_size=64)
    mixer = random_mixer(config, seed=7, dt_range=(1.0, 5.0), A_range=(50.0, 50.0))
    x = torch.randn(1, 3 * 64 + 5 + 40, config.hidden_size, generator=torch.Generator().manual_seed(7))
    state = new_mamba_state(config, 1)
    first = run_mixer(mixer, x[:, :197], state)
    second = run_mixer(mixer, x[:, 197:], state, past=197)  # a chunked segment on a carried state
    ours = torch.cat([first, second], 1)
    assert torch.isfinite(ours).all() and torch.isfinite(state.ssm).all()
    ref, _, ref_state = naive_mamba_mixer(mixer, x)
    assert_close64(ours, ref, rtol=1e-4, what="large decay")
    assert_close64(state.ssm, ref_state, rtol=1e-4, what="large decay state")

    # the scan alone, far more extreme (dt*A = -2000 per step), vs a float64 sequential recurrence
    g = torch.Generator().manual_seed(1)
    b, T, h, p, n = 1, 150, 2, 3, 4
    xs, B, C = torch.randn(b, T, h, p, generator=g), torch.randn(b, T, 1, n, generator=g), torch.randn(b, T, 1, n, generator=g)
    dt, A = torch.full((b, T, h), 20.0), torch.tensor([-100.0, -0.01])
    S0 = torch.randn(b, h, p, n, generator=g)
    y, final = ssd_ops.ssd_scan(xs, dt, A, B, C, chunk_size=128, state=S0)
    assert torch.isfinite(y).all() and torch.isfinite(final).all()
    S, ys = S0.double(), []
    for t in range(T):  # float64 sequential recurrence; B and C have one group shared by both heads
        decay = torch.exp(dt[:, t].double() * A.double())[..., None, None]
        S = decay * S + dt[:, t].double()[..., None, None] * xs[:, t].double()[..., None] * B[:, t].double()[:, :, None, :]
        ys.append(torch.einsum("bhpn,bn->bhp", S, C[:, t, 0].double()))
    assert_close64(y, torch.stack(ys, 1), rtol=1e-5, what="extreme-decay scan")
    assert_close64(final, S, rtol=1e-5, what="extreme-decay final state")


def test_case08_state_precision(monkeypatch):
    """A bf16 mixer decoding 2,000 tokens keeps its SSM state in fp32; the state stays close to a float64
    recurrence fed the same (bf16-computed) x, B, C and dt. A bf16 state would drift far more."""
    config = mamba_config(hidden_size=16, mamba_num_heads=4, mamba_head_dim=4, ssm_state_size=8, n_groups=2)
    # long memory (dt*|A| ~ 0.005 to 0.2 per step) so rounding errors accumulate
    mixer = random_mixer(config, seed=8, dt_range=(0.005, 0.05), A_range=(1.0, 4.0), dtype=torch.bfloat16)
    state = new_mamba_state(config, 1, dtype=torch.bfloat16)
    assert state.ssm.dtype == torch.float32
    calls = record_ops(monkeypatch)
    x = torch.randn(2000, 1, 1, config.hidden_size, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    S64 = torch.zeros(1, 4, 4, 8, dtype=torch.float64)
    S_bf16 = torch.zeros(1, 4, 4, 8, dtype=torch.bfloat16)  # the faulty engines' choice, for comparison
    worst, worst_bf16 = 0.0, 0.0
    for t in range(2000):
        out = run_mixer(mixer, x[t], state, past=t)
        assert out.dtype == torch.bfloat16 and state.ssm.dtype == torch.float32
        kind, xs, dt, A, B, C = calls[-1]
        assert kind == "step"
        dt64, A64 = dt.double(), A.double()
        dBx = dt64[..., None, None] * xs.double()[..., None] * B.double().repeat_interleave(2, dim=1)[:, :, None, :]
        S64 = torch.exp(dt64 * A64)[..., None, None] * S64 + dBx
        S_bf16 = (torch.exp(dt64 * A64)[..., None, None] * S_bf16.double() + dBx).to(torch.bfloat16)
        if t % 100 == 99:
            scale = float(S64.abs().max())
            worst = max(worst, float((state.ssm.double() - S64).abs().max()) / scale)
            worst_bf16 = max(worst_bf16, float((S_bf16.double() - S64).abs().max()) / scale)
    REPORT["case 8: SSM state rel. error after 2000 bf16 decode steps"] = (
        f"ours (fp32 state) {worst:.3g}, a bf16 state would give {worst_bf16:.3g}")
    assert worst < 1e-5, f"fp32 state drifted: relative error {worst:.3g}"
    assert worst_bf16 > 10 * worst  # the test can see the difference a bf16 state makes
    model = hybrid.loading.build_model(HybridConfig(**{**config.__dict__, "hybrid_override_pattern": "M*"}),
                                       torch.bfloat16, "cpu")
    assert model.new_cache(2).slots.ssm[0].dtype == torch.float32


# ---------------------------------------------------------------------------------------------- MoE
def moe_config(**overrides) -> HybridConfig:
    d = dict(hybrid_override_pattern="E", vocab_size=32, hidden_size=16, n_routed_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=12, moe_shared_expert_intermediate_size=20,
             routed_scaling_factor=2.5, torch_dtype="float32")
    d.update(overrides)
    return HybridConfig(**d)


@torch.no_grad()
def random_moe(config: HybridConfig, seed: int) -> MoE:
    g = torch.Generator().manual_seed(seed)
    moe = MoE(config)
    for p in moe.parameters():
        p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return moe.eval()


def hand_moe(moe: MoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float64: sum_j w_j * down_j(relu(up_j x)^2) + shared(x), token by token."""
    f = lambda t: t.detach().double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            out[t] += w * (f(moe.experts.down_proj[e]) @ torch.relu(f(moe.experts.up_proj[e]) @ f(x[t])) ** 2)
        out[t] += f(moe.shared_experts.down_proj.weight) @ torch.relu(f(moe.shared_experts.up_proj.weight) @ f(x[t])) ** 2
    return out


def test_case09_correction_bias_selects_never_weights():
    config = moe_config()
    moe = random_moe(config, seed=9)
    x = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(9))  # 3 x top-2 < 8 experts
    scores = torch.sigmoid(x.double() @ moe.gate.weight.double().T)  # [T, E], the unbiased scores
    with torch.no_grad():
        base_w, base_ids = moe.gate(x)
        base = moe(x[None])[0]

    # a bias that does not change the choice: lower the experts nobody chose -> bit-identical output
    unused = sorted(set(range(8)) - set(base_ids.flatten().tolist()))
    assert unused, "need an expert no token chose"
    bias = torch.zeros(8)
    bias[unused] = -0.3
    moe.gate.e_score_correction_bias.copy_(bias)
    with torch.no_grad():
        assert torch.equal(moe.gate(x)[1], base_ids)
        assert torch.equal(moe(x[None])[0], base)

    # a bias that changes the choice: +2 on an unused expert puts it first for every token
    e_star = unused[0]
    bias = torch.zeros(8)
    bias[e_star] = 2.0
    moe.gate.e_score_correction_bias.copy_(bias)
    with torch.no_grad():
        w, ids = moe.gate(x)
        out = moe(x[None])[0]
    others = scores.clone()
    others[:, e_star] = -1
    want_ids = torch.cat([torch.full((3, 1), e_star), others.argmax(-1, keepdim=True)], 1)
    assert torch.equal(ids, want_ids)
    s = scores.gather(1, want_ids)  # unbiased sigmoid scores, renormalised and scaled
    want_w = s / s.sum(-1, keepdim=True) * 2.5
    assert torch.allclose(w.double(), want_w, atol=1e-6), (w, want_w)
    assert_close64(out, hand_moe(moe, x, want_ids, want_w), what="MoE output with a choosing bias")
    assert (out - base).abs().max() > 1e-3

    # grouped top-k masks dropped groups with -inf, not 0: with negative choices (bias -5) a 0-mask
    # would pick the dropped groups' experts.
    logits = torch.tensor([[2.0, 1.9, 1.8, 1.7, -3.0, -3.1, -4.0, -4.1]])
    w, ids = route(logits, torch.full((8,), -5.0), top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.0)
    assert ids.tolist() == [[0, 1, 2]]
    s = torch.sigmoid(logits[0, :3].double())
    assert torch.allclose(w[0].double(), s / s.sum() * 2.0, atol=1e-7)

    # ties: the lower expert id wins, and the lower group id wins among tied groups
    w, ids = route(torch.zeros(3, 8), torch.zeros(8), top_k=3, n_group=4, topk_group=2)
    assert ids.tolist() == [[0, 1, 2]] * 3
    assert torch.allclose(w, torch.full((3, 3), 1 / 3))
    _, ids = route(torch.tensor([[0.0, 1.0, 1.0, 0.0]]), torch.zeros(4), top_k=1)
    assert ids.tolist() == [[1]]
    _, ids = route(torch.zeros(1, 4), torch.tensor([0.0, 0.25, 0.25, 0.0]), top_k=1)  # tie made by the bias
    assert ids.tolist() == [[1]]


# ------------------------------------------------------------------------------------------ loading
EXPERT = "backbone.layers.1.mixer.experts.{j}.{proj}.weight"  # layer 1 of grouped_routing_c16 is 'E'


def test_case10_experts_never_silently_missing(checkpoint, tmp_path):
    ck = checkpoint("grouped_routing_c16")

    def drop_one(t):
        del t[EXPERT.format(j=3, proj="up_proj")]
        return t

    def rename_all(t):  # a converter's mismatch: every expert tensor under another name
        return {k.replace(".up_proj.weight", ".w1.weight") if ".experts." in k else k: v for k, v in t.items()}

    def stray(t):
        t["backbone.layers.1.mixer.experts.8.up_proj.weight"] = t[EXPERT.format(j=0, proj="up_proj")].clone()
        return t

    def bad_shape(t):
        k = EXPERT.format(j=5, proj="down_proj")
        t[k] = t[k][:, :-1].contiguous()
        return t

    cases = {
        "drop_one": (drop_one, [EXPERT.format(j=3, proj="up_proj"), "missing"]),
        "rename_all": (rename_all, [EXPERT.format(j=0, proj="up_proj"), "missing"]),
        "stray": (stray, ["backbone.layers.1.mixer.experts.8.up_proj.weight", "not used"]),
        "bad_shape": (bad_shape, [EXPERT.format(j=5, proj="down_proj"), "shape"]),
    }
    for name, (edit, needles) in cases.items():
        directory = rewrite_checkpoint(ck.directory, tmp_path / name, edit)
        with pytest.raises(CheckpointError) as err:
            hybrid.load_model(directory, dtype=torch.float32)
        for needle in needles:
            assert needle in str(err.value), f"{name}: {needle!r} not in {err.value}"

    # a complete checkpoint fills every parameter and buffer with the transformers tensor of that name
    tf_state = {k.replace("model.", "backbone.", 1): v for k, v in ck.tf.state_dict().items()}
    ours_state = ck.ours.state_dict()
    assert set(ours_state) == set(tf_state)
    for k, v in ours_state.items():
        assert v.device.type == "cpu" and torch.equal(v, tf_state[k]), k
    # ... also when transformers writes shards with an index
    sharded = tmp_path / "sharded"
    ck.tf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    model = hybrid.load_model(sharded, dtype=torch.float32)
    for k, v in model.state_dict().items():
        assert torch.equal(v, tf_state[k]), k


def test_case11_tied_embeddings_without_head(checkpoint, tmp_path):
    """tie_word_embeddings and no lm_head.weight in the files: the head is the embedding matrix and the
    logits equal transformers' (whose lm_head holds a copy of the embeddings in this checkpoint)."""
    ck = checkpoint("tied_c8")
    directory = rewrite_checkpoint(ck.directory, tmp_path / "no_head",
                                   lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    model = hybrid.load_model(directory, dtype=torch.float32)
    assert torch.equal(model.lm_head.weight, model.backbone.embeddings.weight)
    assert model.lm_head.weight.data_ptr() == model.backbone.embeddings.weight.data_ptr()
    ids = random_ids(2 * ck.chunk_size + 3, ck.vocab_size, seed=11, batch=2)
    with torch.no_grad():
        assert (model(ids) - tf_logits(ck.tf, ids)).abs().max() <= 1e-4
    # bf16 too: the head follows the embeddings' dtype
    model16 = hybrid.load_model(directory, dtype="bf16")
    assert model16.lm_head.weight.data_ptr() == model16.backbone.embeddings.weight.data_ptr()

    # a tied config whose files hold a DIFFERENT lm_head.weight (what transformers 5.24 writes for an
    # untrained tied model, since it never ties) is refused, naming the tensor
    other = rewrite_checkpoint(ck.directory, tmp_path / "other_head",
                               lambda t: {**t, "lm_head.weight": t["lm_head.weight"] + 1.0})
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        hybrid.load_model(other, dtype=torch.float32)
