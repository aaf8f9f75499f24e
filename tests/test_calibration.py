"""Calibration statistics (`moe.calibration.InputAmax`) are recorded by forward hooks module by module: running
one layer at a time, fed the inputs the whole model gave it, records bit for bit what calibrating the whole
model records; the per-expert values equal a direct computation from the router's choices."""

import torch

from hybrid.cache import StepContext
from hybrid.quantize import calibrate, plan
from moe.calibration import InputAmax
from moe.experts import ExpertBank
from tiny_checkpoint import random_model


def test_layer_by_layer_calibration_equals_the_whole_model():
    model = random_model("ME*EM-E", seed=4, n_routed_experts=8)
    qc = plan(model.config, "fp8", exclude=["lm_head", "backbone.embeddings"])
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(5, 320, (1, 19), generator=g) for _ in range(3)]
    whole = calibrate(model, qc, batches)

    inputs = {i: [] for i in range(len(model.backbone.layers))}  # each block's input, per batch
    hooks = [block.register_forward_pre_hook(lambda m, args, i=i: inputs[i].append(args[0]))
             for i, block in enumerate(model.backbone.layers)]
    with torch.no_grad():
        for ids in batches:
            model(ids)
    for h in hooks:
        h.remove()

    layered = InputAmax()
    for i, block in enumerate(model.backbone.layers):  # one layer at a time, hooks on its modules only
        prefix = f"backbone.layers.{i}."
        handles = [layered.attach(prefix + name, m) for name, m in block.named_modules()
                   if (isinstance(m, torch.nn.Linear) and qc.format_for(prefix + name)) or isinstance(m, ExpertBank)]
        with torch.no_grad():
            for h in inputs[i]:
                block(h, StepContext(past=0, mask=None, key_mask=None))
        for handle in handles:
            handle.remove()
    layered.fill_unreached()

    assert whole.linear and whole.experts
    assert whole.linear.keys() == layered.linear.keys()
    assert all(torch.equal(whole.linear[k], layered.linear[k]) for k in whole.linear)
    assert whole.experts.keys() == layered.experts.keys() == {"backbone.layers.1.mixer.experts",
                                                              "backbone.layers.3.mixer.experts",
                                                              "backbone.layers.6.mixer.experts"}
    for k, (up, down) in whole.experts.items():
        assert torch.equal(up, layered.experts[k][0]) and torch.equal(down, layered.experts[k][1])


def test_expert_amax_is_the_max_over_the_tokens_routed_to_each_expert():
    model = random_model("ME", seed=5, n_routed_experts=8)
    moe = model.backbone.layers[1].mixer
    seen = []
    handle = moe.experts.register_forward_pre_hook(lambda m, args: seen.append(args))
    qc = plan(model.config, "fp8", exclude=[])
    ids = torch.randint(5, 320, (1, 40), generator=torch.Generator().manual_seed(1))
    stats = calibrate(model, qc, [ids])
    handle.remove()
    (x, _, chosen), = seen
    up, down = stats.experts["backbone.layers.1.mixer.experts"]
    W_up = moe.experts.up_proj.detach().double()
    for e in range(8):
        rows = x[(chosen == e).any(-1)].double()
        if len(rows) == 0:  # no token reached it: the bank's largest
            continue
        assert abs(float(up[e]) - float(rows.abs().max())) <= 1e-6 * float(rows.abs().max())
        ref = torch.relu(rows @ W_up[e].T).square().abs().max()
        assert abs(float(down[e]) - float(ref)) <= 1e-5 * float(ref)
    assert float(up.min()) > 0 and float(down.min()) > 0
