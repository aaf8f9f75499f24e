"""The C++ router (`moe/quant/kernels/cpu_router.cpp`) against its specification, `route` of the fp32 product
`x.float() @ weight.T`: at Nemotron 3 Nano's widths (2,688 x 128 experts, top-6, one group, scale 2.5), at
DeepSeek-V3's grouping (256 experts in 8 groups, 4 kept, top-8), with fp32 and bf16 inputs; ties, NaN and
-inf masks ranked as the stable sort ranks them (exact logits made by one-hot inputs); the router module
taking the kernel only where it should; bad arguments refused by name."""

from __future__ import annotations

import pytest
import torch

from moe.quant.kernels import routing as router_module
from moe.quant.kernels.routing import KERNEL_ROWS, route
from moe.router import TopkRouter

pytestmark = pytest.mark.skipif(router_module.kernel() is None, reason="the router kernel could not be built here")


def kernel_route(x, weight, bias, top_k, n_group=1, topk_group=1, norm=True, scale=1.0):
    return router_module.kernel().route(x, weight, bias, top_k, n_group, topk_group, norm, scale)


def spec_route(x, weight, bias, top_k, n_group=1, topk_group=1, norm=True, scale=1.0):
    return route(x.float() @ weight.T, bias, top_k, n_group, topk_group, norm, scale)


def draw(T, H, E, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    weight = torch.randn(E, H, generator=g) * H ** -0.5  # logits of about unit scale
    bias = torch.randn(E, generator=g) * 0.05
    return x, weight, bias


def assert_same_routing(got, want):
    """Ids equal (the product's sums run in another order, so logits agree to about 1e-6, not bit for bit: these
    seeds' draws have no choice that close at the cut), weights to 2e-6 of their scale."""
    (w, ids), (w_ref, ids_ref) = got, want
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == ids_ref.shape
    assert torch.equal(ids, ids_ref), (ids, ids_ref)
    assert (w - w_ref).abs().max() <= 2e-6 * w_ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, KERNEL_ROWS])
def test_nano_widths_equal_the_specification(dtype, T):
    x, weight, bias = draw(T, 2688, 128, dtype, seed=T)
    got = kernel_route(x, weight, bias, 6, scale=2.5)
    want = spec_route(x, weight, bias, 6, scale=2.5)
    assert_same_routing(got, want)
    assert torch.allclose(got[0].sum(-1), torch.full((T,), 2.5), atol=1e-5)  # normalised, then scaled


@pytest.mark.parametrize("norm", [True, False])
def test_grouped_selection_equals_the_specification(norm):
    """256 experts in 8 groups, the 4 best groups kept (by the sum of each group's top-2), top-8 of those."""
    x, weight, bias = draw(5, 512, 256, torch.float32, seed=7)
    got = kernel_route(x, weight, bias, 8, n_group=8, topk_group=4, norm=norm, scale=1.5)
    want = spec_route(x, weight, bias, 8, n_group=8, topk_group=4, norm=norm, scale=1.5)
    assert_same_routing(got, want)
    groups = got[1] // 32
    assert all(len(set(row)) <= 4 for row in groups.tolist())  # the chosen experts lie in at most 4 groups


def exact(logits: list[list[float]]):
    """One-hot inputs x [T, E] and weight = the logits' transpose padded to H = E: x_t . w_e = logits[t][e]
    exactly (every other product is zero), so ties and special values reach the selection as written."""
    L = torch.tensor(logits, dtype=torch.float32)
    T, E = L.shape
    x = torch.zeros(T, 16 * T)
    weight = torch.zeros(E, 16 * T)
    for t in range(T):
        x[t, 16 * t] = 1.0
        weight[:, 16 * t] = L[t]
    return x, weight


def test_ties_go_to_the_lower_id_and_masked_groups_to_minus_infinity():
    cases = [
        ([[0.0] * 8] * 3, torch.zeros(8), dict(top_k=3, n_group=4, topk_group=2)),  # all tied: experts 0, 1, 2
        ([[0.0, 1.0, 1.0, 0.0]], torch.zeros(4), dict(top_k=1)),
        ([[0.0] * 4], torch.tensor([0.0, 0.25, 0.25, 0.0]), dict(top_k=1)),  # the tie made by the bias
        # negative choices (bias -5): a 0-mask instead of -inf would pick the dropped groups' experts
        ([[2.0, 1.9, 1.8, 1.7, -3.0, -3.1, -4.0, -4.1]], torch.full((8,), -5.0), dict(top_k=3, n_group=4, topk_group=2)),
        # k larger than the kept groups hold: the masked experts follow, by id
        ([[1.0, 0.5, -1.0, -2.0, 3.0, 2.0, 0.0, 0.1]], torch.zeros(8), dict(top_k=5, n_group=4, topk_group=2)),
        ([[float("nan"), 0.0, 5.0, float("-inf")]], torch.zeros(4), dict(top_k=3)),  # NaN first, as torch.sort
    ]
    for logits, bias, kw in cases:
        x, weight = exact(logits)
        w, ids = kernel_route(x, weight, bias, **kw)
        w_ref, ids_ref = route(torch.tensor(logits), bias, **kw)
        assert ids.tolist() == ids_ref.tolist(), (logits, kw)
        assert torch.allclose(w, w_ref, atol=1e-7, equal_nan=True), (logits, kw)


def make_router(**kw) -> TopkRouter:
    r = TopkRouter(2688, 128, 6, routed_scaling_factor=2.5, **kw)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=g) * 2688 ** -0.5)
        r.e_score_correction_bias.copy_(torch.randn(128, generator=g) * 0.05)
    return r.requires_grad_(False)


def test_the_router_takes_the_kernel_for_decode_rows_only(monkeypatch):
    """Up to KERNEL_ROWS tokens go to the kernel, more to PyTorch's product; both route alike; autograd keeps
    PyTorch's path (the kernel's outputs have no gradient)."""
    r = make_router()
    calls = []
    real = router_module.kernel()

    class Spy:
        def route(self, *args):
            calls.append(args[0].shape[0])
            return real.route(*args)

    monkeypatch.setattr(router_module, "kernel", lambda: Spy())
    g = torch.Generator().manual_seed(5)
    for T in (1, KERNEL_ROWS, KERNEL_ROWS + 1):
        x = torch.randn(T, 2688, generator=g).bfloat16()
        got = r(x)
        assert_same_routing(got, spec_route(x, r.weight, r.e_score_correction_bias, 6, scale=2.5))
    assert calls == [1, KERNEL_ROWS]
    r.requires_grad_(True)
    w, _ = r(torch.randn(2, 2688, generator=g))
    assert calls == [1, KERNEL_ROWS] and w.requires_grad


def test_bad_arguments_are_refused_by_name():
    x, weight, bias = draw(2, 64, 8, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32"):
        kernel_route(x, weight.double(), bias, 2)
    with pytest.raises(RuntimeError, match="H = 64"):
        kernel_route(x, weight[:, :32].contiguous(), bias, 2)
    with pytest.raises(RuntimeError, match="e_score_correction_bias"):
        kernel_route(x, weight, bias[:4].contiguous(), 2)
    with pytest.raises(RuntimeError, match="n_group must divide"):
        kernel_route(x, weight, bias, 2, n_group=3)
    with pytest.raises(RuntimeError, match="top_k must be in"):
        kernel_route(x, weight, bias, 9)
    with pytest.raises(RuntimeError, match="x must be"):
        kernel_route(x.half(), weight, bias, 2)
