"""`hybrid.layers.attention.decode_attention` (one query over unmasked keys, the CPU decode path) against a
float64 softmax attention, and the layer's decode through it against its SDPA path."""

import pytest
import torch
import torch.nn.functional as F

from hybrid.layers.attention import decode_attention


def reference(q, k, v):
    """float64 softmax(q k^T / sqrt(hd)) v with each KV head repeated over its query heads."""
    g = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return scores.softmax(dim=-1) @ v


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("nq,nkv,hd,S", [(16, 2, 64, 2070), (32, 2, 128, 300), (4, 4, 16, 1), (6, 1, 32, 17)])
def test_decode_attention_equals_float64_attention(dtype, tol, nq, nkv, hd, S):
    g = torch.Generator().manual_seed(nq * S + hd)
    q, k, v = (torch.randn(b_shape, generator=g).to(dtype) for b_shape in
               ((3, nq, 1, hd), (3, nkv, S, hd), (3, nkv, S, hd)))
    got = decode_attention(q, k, v)
    assert got.shape == q.shape and got.dtype == dtype
    want = reference(q, k, v)
    # fp32: sums' rounding only; bf16: the output's rounding (8 bits) on values of magnitude <= max |v|
    assert float((got.double() - want).abs().max()) <= tol * float(v.double().abs().max())


def test_the_layers_decode_equals_its_sdpa_path():
    """A decode step through the layer (one query, no mask: decode_attention) equals the same step
    computed with SDPA over the cached keys (the path of every other step)."""
    from hybrid.cache import StepContext
    from hybrid.config import HybridConfig
    from hybrid.layers.attention import Attention

    config = HybridConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                          hybrid_override_pattern="*", vocab_size=32)
    torch.manual_seed(0)
    layer = Attention(config)

    class KV:  # a plain cache handle: keeps every key and value
        def __init__(self):
            self.k = self.v = None

        def update(self, k, v, start):
            self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
            self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
            return self.k, self.v

    x = torch.randn(1, 12, 64)
    kv = KV()
    with torch.no_grad():
        layer(x[:, :11], StepContext(past=0, mask=None, key_mask=None), kv)
        got = layer(x[:, 11:], StepContext(past=11, mask=None, key_mask=None), kv)
        want = layer(x, StepContext(past=0, mask=None, key_mask=None), None)[:, 11:]  # causal SDPA, no cache
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
