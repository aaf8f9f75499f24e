"""`hybrid.ops.attention.decode_attention` (one query over unmasked keys, the CPU decode path) and its C++
kernel (`hybrid.ops.cpu.attention_module`: dense and paged rows; its AVX-512 build where the CPU has it and its
portable build, plain loops, everywhere) against a float64 softmax attention; the kernel's dense and paged
entries give the same bits; the layer's decode through them against its SDPA path;
a packed engine step's decodes through the paged entry equal the step without the kernel."""

import pytest
import torch
import torch.nn.functional as F

from hybrid.ops.attention import decode_attention, one_query_attention
from hybrid.ops.cpu import attention_module
from moe.quant.kernels.build import cpu_flags

needs_kernel = pytest.mark.skipif(attention_module() is None, reason="the decode-attention kernel is not built here")


def reference(q, k, v):
    """float64 softmax(q k^T / sqrt(hd)) v with each KV head repeated over its query heads."""
    g = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return scores.softmax(dim=-1) @ v


def portable_kernel(q, k, v):
    """The kernel built without AVX-512 (the plain loops a CPU without it runs; on such a CPU the default build,
    tested as "kernel", is already this one)."""
    if "avx512f" not in cpu_flags().split():
        pytest.skip("this CPU has no AVX-512: its default build is the portable one")
    b, nq, _, hd = q.shape
    out = attention_module(portable=True).decode_attention(q.reshape(b, nq, hd), k, v, hd ** -0.5)
    return out.reshape(b, nq, 1, hd).to(q.dtype)


@pytest.mark.parametrize("fn", [decode_attention, pytest.param(one_query_attention, marks=needs_kernel),
                                pytest.param(portable_kernel, marks=needs_kernel)],
                         ids=["pytorch", "kernel", "portable-kernel"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
# (40 / 2: 20 query heads per KV head, more than one vector's 16 lanes)
@pytest.mark.parametrize("nq,nkv,hd,S", [(16, 2, 64, 2070), (32, 2, 128, 300), (4, 4, 16, 1), (6, 1, 32, 17),
                                         (4, 2, 20, 33), (40, 2, 32, 50)])
def test_decode_attention_equals_float64_attention(fn, dtype, tol, nq, nkv, hd, S):
    g = torch.Generator().manual_seed(nq * S + hd)
    q, k, v = (torch.randn(b_shape, generator=g).to(dtype) for b_shape in
               ((3, nq, 1, hd), (3, nkv, S, hd), (3, nkv, S, hd)))
    got = fn(q, k, v)
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


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_paged_rows_give_the_bits_of_its_dense_rows(dtype):
    """Three sequences' keys scattered over a pool's rows in a shuffled order (a paged cache's blocks): the
    paged entry reads them in place and gives exactly the dense entry's result over the same keys in order,
    whatever strides the dense keys have (a cache's [b, nkv, capacity, hd] storage sliced to its length)."""
    ext = attention_module()
    g = torch.Generator().manual_seed(5)
    nq, nkv, hd, lengths = 8, 2, 64, [37, 1, 130]
    pool_k, pool_v = (torch.randn(400, nkv, hd, generator=g).to(dtype) for _ in range(2))
    order = torch.randperm(400, generator=g)
    rows, start = [], 0
    for n in lengths:
        rows.append(order[start:start + n])
        start += n
    q = torch.randn(3, nq, hd, generator=g).to(dtype)
    paged = ext.paged_decode_attention(q, pool_k, pool_v, rows, hd ** -0.5)
    for s, r in enumerate(rows):
        store_k = torch.zeros(1, nkv, 200, hd, dtype=dtype)  # capacity 200, the first len(r) positions used
        store_v = torch.zeros(1, nkv, 200, hd, dtype=dtype)
        store_k[0, :, :len(r)] = pool_k[r].transpose(0, 1)
        store_v[0, :, :len(r)] = pool_v[r].transpose(0, 1)
        dense = ext.decode_attention(q[s:s + 1], store_k[:, :, :len(r)], store_v[:, :, :len(r)], hd ** -0.5)
        assert torch.equal(paged[s], dense[0])
        want = reference(q[s:s + 1, :, None], pool_k[r].transpose(0, 1)[None], pool_v[r].transpose(0, 1)[None])
        assert float((paged[s].double() - want[0, :, 0]).abs().max()) <= 1e-5 * float(pool_v.double().abs().max())
    with pytest.raises(RuntimeError, match="outside the pool"):
        ext.paged_decode_attention(q[:1], pool_k, pool_v, [torch.tensor([0, 400])], 1.0)


@needs_kernel
def test_an_engine_step_of_decodes_through_the_paged_kernel_equals_the_reference_path(monkeypatch):
    """The serving engine (its paged cache offers `attend_decode`) generates the greedy tokens it generates
    with the kernel off (the reference: per-sequence gathers and `decode_attention`), and those of
    `generate_ids` alone (the dense entry of the same kernel)."""
    import hybrid.ops.attention as attention
    from hybrid.cli import DEFAULT_CHECKPOINT
    from hybrid.generate import generate_ids
    from hybrid.loading import load
    from hybrid.sampling import SamplingParams
    from hybrid.serving.engine import Engine

    model, tok = load(DEFAULT_CHECKPOINT, dtype="fp32")
    prompts = [tok.encode(t) for t in ("The for statement is used to", "A list is", "Once upon a time, in a land")]
    engine = Engine(model, num_blocks=256, max_num_seqs=4)
    calls = []
    kernel = attention.decode_kernel
    monkeypatch.setattr(attention, "decode_kernel", lambda q, k: calls.append(1) or kernel(q, k))
    fast = engine.generate(prompts, SamplingParams(logprobs=0), max_tokens=24)
    alone = [generate_ids(model, [p], max_new_tokens=24)[0].token_ids for p in prompts]
    monkeypatch.setattr(attention, "decode_kernel", lambda q, k: None)
    slow = engine.generate(prompts, SamplingParams(logprobs=0), max_tokens=24)
    assert calls and [c.token_ids for c in fast] == [c.token_ids for c in slow] == alone
