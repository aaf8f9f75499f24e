"""This project's Triton kernels of `hybrid/ops` against their specifications, run by Triton's interpreter on the
CPU in fp32 (how: tests/interpreter.py), and the seams taking them on the GPU path:

- the Mamba-2 decode step over state slots (`triton_mamba.py`) against `hybrid/ops/decode.py` with the PyTorch
  conv and SSD steps: sequences in rows of a pool given by an index in any order, head and state widths that
  are not powers of two, with and without a conv bias and a dt limit; rows of other sequences untouched;
- the Mamba-2 prompt chunks of several packed sequences (`triton_mamba.mamba_chunks`) against
  `hybrid/ops/prefill.py`: segments shorter than the conv window, boundaries anywhere in the packed rows, rows
  outside every segment left zero, states continued from and written back to scrambled slots;
- paged decode attention (`triton_attention.py`) against `decode_attention` over each sequence's gathered rows:
  GQA groups and head sizes that are not powers of two, histories of one row to several key tiles, rows
  scattered over the pool with holes; a sequence without rows refused.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from interpreter import driver, needs_interpreter, run_in_interpreter  # noqa: E402


@driver
def test_the_kernels_in_the_interpreter():
    run_in_interpreter(__file__, "18 passed, 1 skipped")


import hybrid.ops as ops  # noqa: E402
from hybrid.ops import conv1d, decode, prefill, ssd  # noqa: E402
from hybrid.ops.attention import decode_attention  # noqa: E402
from moe.quant.kernels import backend  # noqa: E402


def _case(S, R, nh, P, N, G, K, bias, seed):
    g = torch.Generator().manual_seed(seed)
    d_inner = nh * P
    channels = d_inner + 2 * G * N
    return dict(
        xBC=torch.randn(S, channels, generator=g), dt=torch.randn(S, nh, generator=g),
        conv=torch.randn(R, channels, K - 1, generator=g), ssm=torch.randn(R, nh, P, N, generator=g),
        index=torch.randperm(R, generator=g)[:S], weight=torch.randn(channels, K, generator=g) * 0.5,
        bias=torch.randn(channels, generator=g) if bias else None, dt_bias=torch.randn(nh, generator=g),
        A=-torch.rand(nh, generator=g) * 4, D=torch.randn(nh, generator=g)), d_inner


def _spec(case, limit, d_inner, G):
    c = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    y = decode.mamba_decode_step(c["xBC"], c["dt"], c["conv"], c["ssm"], c["index"], c["weight"], c["bias"],
                                 c["dt_bias"], c["A"], c["D"], limit, d_inner, G, conv1d.causal_conv1d_update,
                                 ssd.ssd_step)
    return y, c["conv"], c["ssm"]


@needs_interpreter
@pytest.mark.parametrize("S, R, nh, P, N, G, K, bias, limit", [
    (5, 8, 4, 16, 16, 2, 4, True, (0.0, float("inf"))),
    (3, 3, 6, 12, 10, 3, 4, False, (0.001, 0.1)),  # every row, in another order; widths not powers of two
    (1, 6, 2, 40, 24, 1, 3, True, (0.0, float("inf"))),  # head dim over several programs, a 3-tap conv
])
def test_the_decode_step_over_slots_equals_the_specification(S, R, nh, P, N, G, K, bias, limit):
    from hybrid.ops import triton_mamba

    case, d_inner = _case(S, R, nh, P, N, G, K, bias, seed=S * 7 + P)
    want_y, want_conv, want_ssm = _spec(case, limit, d_inner, G)
    conv, ssm = case["conv"].clone(), case["ssm"].clone()
    y = triton_mamba.mamba_decode_step(case["xBC"], case["dt"], conv, ssm, case["index"], case["weight"],
                                       case["bias"], case["dt_bias"], case["A"], case["D"], limit, d_inner, G)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, want_conv, rtol=0, atol=0)  # the window rolls exactly
    torch.testing.assert_close(ssm, want_ssm, rtol=1e-5, atol=1e-5)
    others = [r for r in range(R) if r not in case["index"].tolist()]
    assert torch.equal(ssm[others], case["ssm"][others]) and torch.equal(conv[others], case["conv"][others])


@needs_interpreter
def test_the_seam_takes_the_kernels_on_the_gpu_path(monkeypatch):
    """`hybrid.ops.mamba_decode_step` under HYBRID_BACKEND=triton launches the two kernels (once each for all
    sequences) and gives the CPU path's result."""
    from hybrid.ops import triton_mamba

    case, d_inner = _case(4, 6, 4, 16, 16, 2, 4, True, seed=11)
    limit = (0.0, float("inf"))
    calls = []
    real = triton_mamba.mamba_decode_step
    monkeypatch.setattr(triton_mamba, "mamba_decode_step", lambda *a: calls.append(1) or real(*a))

    def run():
        conv, ssm = case["conv"].clone(), case["ssm"].clone()
        y = ops.mamba_decode_step(case["xBC"], case["dt"], conv, ssm, case["index"], case["weight"], case["bias"],
                                  case["dt_bias"], case["A"], case["D"], limit, d_inner, 2)
        return y, conv, ssm

    with backend.override("triton"):
        got = run()
    assert calls == [1]
    want = run()  # the CPU path: the C++ kernel, or the specification
    assert calls == [1]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ops.kernel_status(True)["Mamba-2 decode step"].startswith("Triton")


# ------------------------------------------------------------------------------------------ prompt chunks
@needs_interpreter
@pytest.mark.parametrize("segments, L, K, bias", [
    ([(0, 7), (9, 2), (12, 20)], 34, 4, True),  # a 2-token segment (shorter than the window), rows 7, 8 and 32, 33 outside
    ([(0, 1)], 1, 4, False),  # one token
    ([(3, 11), (14, 5)], 19, 3, True),
    # the chunked form (a segment longer than triton_mamba.CHUNK = 64): 150 = two chunks and a part, beside a
    # segment of one partial chunk and one of fewer tokens than the window
    ([(0, 150), (152, 70), (230, 3)], 233, 4, True),
])
def test_prompt_chunks_over_slots_equal_the_specification(segments, L, K, bias):
    """Both forms of the SSD (recurrent up to one chunk, chunked past it: `max_length` picks) against the
    specification: outputs, conv windows (exactly) and states."""
    from hybrid.ops import triton_mamba

    S, R, nh, P, N, G = len(segments), len(segments) + 2, 4, 12, 10, 2
    case, d_inner = _case(L, R, nh, P, N, G, K, bias, seed=L)  # xBC, dt: one row per packed token
    index = torch.randperm(R, generator=torch.Generator().manual_seed(L))[:S]
    starts = torch.tensor([s0 for s0, _ in segments])
    lengths = torch.tensor([n for _, n in segments])
    limit = (0.001, 0.5)
    want_conv, want_ssm = case["conv"].clone(), case["ssm"].clone()
    args = (case["weight"], case["bias"], case["dt_bias"], case["A"], case["D"], limit, d_inner, G)
    want = prefill.mamba_chunks(case["xBC"], case["dt"], want_conv, want_ssm, starts, lengths, index, *args, 8,
                                conv1d.causal_conv1d, ssd.ssd_scan)
    conv, ssm = case["conv"].clone(), case["ssm"].clone()
    max_length = max(n for _, n in segments)
    assert (max_length > triton_mamba.CHUNK) == (L == 233)
    got = triton_mamba.mamba_chunks(case["xBC"], case["dt"], conv, ssm, starts, lengths, index, *args, max_length)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv, want_conv, rtol=0, atol=0)
    torch.testing.assert_close(ssm, want_ssm, rtol=1e-4, atol=1e-4)
    inside = torch.zeros(L, dtype=torch.bool)
    for s0, n in segments:
        inside[s0:s0 + n] = True
    assert not got[~inside].any()


# ------------------------------------------------------------------------------------------ forward without a cache
def _scan_mask(kind: str, b: int, T: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    mask = torch.ones(b, T, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[1, T - 4:] = False  # right padding
    mask[2, [2, 5, 6]] = False  # holes
    mask[3] = False  # a row of padding only
    return mask


@needs_interpreter
@pytest.mark.parametrize("kind, states, T", [("none", False, 13), ("padded", False, 13), ("padded", True, 13),
                                             ("padded", True, 140)])  # 140: the chunked form
def test_the_forward_without_a_cache_equals_the_specification(kind, states, T):
    """`hybrid.ops.mamba_scan` on the GPU path (no mamba-ssm here): the prompt-chunk kernels with each row one
    segment, padding moved behind the real tokens; equal to `prefill.mamba_scan` at every real position, and the
    states it continues (`conv` / `ssm`) updated as the specification updates them."""
    b, nh, P, N, G, K = 5, 4, 12, 10, 2, 4
    g = torch.Generator().manual_seed(21)
    d_inner = nh * P
    channels = d_inner + 2 * G * N
    xBC, dt = torch.randn(b, T, channels, generator=g), torch.randn(b, T, nh, generator=g)
    args = (torch.randn(channels, K, generator=g) * 0.5, torch.randn(channels, generator=g),
            torch.randn(nh, generator=g), -torch.rand(nh, generator=g) * 4, torch.randn(nh, generator=g),
            (0.001, 0.5), d_inner, G)
    mask = _scan_mask(kind, b, T)
    conv = torch.randn(b, channels, K - 1, generator=g) if states else None
    ssm = torch.randn(b, nh, P, N, generator=g) if states else None
    want_conv, want_ssm = (conv.clone(), ssm.clone()) if states else (None, None)
    want = prefill.mamba_scan(xBC, dt, *args, 8, conv1d.causal_conv1d, ssd.ssd_scan, mask, want_conv, want_ssm)
    got_conv, got_ssm = (conv.clone(), ssm.clone()) if states else (None, None)
    with backend.override("triton"):
        got = ops.mamba_scan(xBC, dt, *args, 8, mask=mask, conv=got_conv, ssm=got_ssm)
    real = mask if mask is not None else torch.ones(b, T, dtype=torch.bool)
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)
    if states:
        torch.testing.assert_close(got_conv, want_conv, rtol=0, atol=0)
        torch.testing.assert_close(got_ssm, want_ssm, rtol=1e-4, atol=1e-4)
        assert torch.equal(got_ssm[3], ssm[3]) and torch.equal(got_conv[3], conv[3])  # no real token: unchanged
    assert ops.kernel_status(True)["Mamba-2 prompt scan"].endswith("a forward without a cache: the same kernels)")


# ------------------------------------------------------------------------------------------ paged attention
def _paged_case(lengths, nq, nkv, hd, pool_rows, seed):
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(pool_rows, nkv, hd, generator=g)
    v_pool = torch.randn(pool_rows, nkv, hd, generator=g)
    q = torch.randn(len(lengths), nq, hd, generator=g)
    rows = [torch.randperm(pool_rows, generator=g)[:n] for n in lengths]  # scattered, holes between them
    return q, k_pool, v_pool, rows


def _paged_spec(q, k_pool, v_pool, rows):
    return torch.cat([decode_attention(q[i:i + 1, :, None], k_pool[r].transpose(0, 1)[None],
                                       v_pool[r].transpose(0, 1)[None]) for i, r in enumerate(rows)])[:, :, 0]


@needs_interpreter
@pytest.mark.parametrize("lengths, nq, nkv, hd", [
    ([1, 5, 33, 70], 8, 2, 16),  # one row, a part tile, just past a tile, three tiles
    ([64, 2, 31], 6, 2, 24),  # groups of 3 heads, a head size that is not a power of two
    ([9], 4, 4, 32),  # no grouping (MHA)
])
def test_paged_decode_attention_equals_the_specification(lengths, nq, nkv, hd):
    from hybrid.ops import triton_attention

    q, k_pool, v_pool, rows = _paged_case(lengths, nq, nkv, hd, 96, seed=sum(lengths))
    got = triton_attention.paged_decode_attention(q, k_pool, v_pool, ops.PagedTable.of_rows(rows))
    torch.testing.assert_close(got, _paged_spec(q, k_pool, v_pool, rows), rtol=1e-5, atol=1e-5)
    assert got.dtype == torch.float32 and got.shape == q.shape


@needs_interpreter
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_decode_attention_over_block_tables_equals_the_specification(block_size):
    """The engine's form: each sequence's blocks scattered over the pool in any order (a table with holes), its
    last block partly used, the rows of a shorter table padded; against the specification over the same rows."""
    from hybrid.ops import PagedTable, triton_attention

    g = torch.Generator().manual_seed(block_size)
    lengths, nq, nkv, hd, num_blocks = [1, 13, 70, 32], 8, 2, 16, 40
    k_pool = torch.randn(num_blocks * block_size, nkv, hd, generator=g)
    v_pool = torch.randn(num_blocks * block_size, nkv, hd, generator=g)
    q = torch.randn(len(lengths), nq, hd, generator=g)
    blocks = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in lengths:
        tables.append(torch.tensor([blocks.pop() for _ in range(-(-n // block_size))]))
    table = PagedTable(torch.nn.utils.rnn.pad_sequence(tables, batch_first=True), torch.tensor(lengths), lengths,
                       block_size)
    rows = [(t[:, None] * block_size + torch.arange(block_size)).flatten()[:n] for t, n in zip(tables, lengths)]
    assert all(torch.equal(a, b) for a, b in zip(table.rows, rows))
    got = triton_attention.paged_decode_attention(q, k_pool, v_pool, table)
    torch.testing.assert_close(got, _paged_spec(q, k_pool, v_pool, rows), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.paged_decode_attention(q, k_pool, v_pool, table),
                               ops.paged_decode_attention(q, k_pool, v_pool, rows), rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_paged_decode_attention_through_the_seam_and_its_errors(monkeypatch):
    """`hybrid.ops.paged_decode_attention` takes the kernel on the GPU path (once for all sequences) with the CPU
    path's result; a sequence without rows is refused by name."""
    from hybrid.ops import triton_attention

    q, k_pool, v_pool, rows = _paged_case([3, 40], 4, 2, 16, 64, seed=5)
    calls = []
    real = triton_attention.paged_decode_attention
    monkeypatch.setattr(triton_attention, "paged_decode_attention", lambda *a: calls.append(1) or real(*a))
    with backend.override("triton"):
        got = ops.paged_decode_attention(q, k_pool, v_pool, rows)
    assert calls == [1]
    torch.testing.assert_close(got, ops.paged_decode_attention(q, k_pool, v_pool, rows), rtol=1e-5, atol=1e-5)
    assert calls == [1]
    assert ops.kernel_status(True)["decode attention"].startswith("Triton")
    with pytest.raises(ValueError, match="sequence lengths"):
        real(q, k_pool, v_pool, ops.PagedTable.of_rows([rows[0], rows[1][:0]]))
