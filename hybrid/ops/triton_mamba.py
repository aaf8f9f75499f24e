"""Triton kernels of this project for the Mamba-2 decode step and prompt chunks on the GPU path, over state slots.

`mamba_chunks` runs the prompt chunks of S packed sequences (boundaries given by `starts` / `lengths` device
tensors) in two launches per layer, whatever S: the conv (`_conv_chunks_slots`: inputs before a segment read from
the window in row `index[s]` of the conv pool, the new window written back, SiLU applied) and the SSD recurrence
(`_ssd_chunks_slots`: dt = clamp(softplus(dt + dt_bias)), the state of row `index[s]` decayed and updated token by
token in registers, y = state C + D x, the state written back); when the caller says a segment is longer than one
`CHUNK`, the SSD takes the chunked form instead (three launches: each chunk's state, the states passed from chunk to
chunk, each chunk's outputs by matrix products; see `mamba_chunks`). `mamba_decode_step` is the same with one token
per sequence, and `mamba_scan` (the forward without a cache) with each batch row one segment. No state is gathered
into a batch and scattered back, and no value goes to the host. The specifications are `hybrid/ops/prefill.py` and
`hybrid/ops/decode.py` (tested against them under Triton's interpreter: tests/test_triton_ops.py). Sums are fp32;
the conv output is rounded to the activations' dtype before the SSD step reads it, as the specification rounds it.
"""

from __future__ import annotations

import torch

from moe.quant.kernels import backend

IMPORT_ERROR = ""  # why triton did not import
try:
    import triton
    import triton.language as tl
except ImportError as e:  # triton is optional (the `cuda` extra)
    triton, IMPORT_ERROR = None, f"{type(e).__name__}: {e}"

CONV_BLOCK = 128  # channels per program of the conv
HEAD_DIM_BLOCK = 16  # head-dimension rows per program of the SSD recurrence
CHUNK = 64  # tokens per chunk of the chunked SSD (segments longer than one chunk take it)


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _softplus_clamp(dt, lo, hi):
        """clamp(softplus(dt), lo, hi), softplus(x) = x past 20 (as torch's)."""
        return tl.minimum(tl.maximum(tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt))), lo), hi)

    @triton.jit
    def _conv_chunks_slots(x_ptr, conv_ptr, index_ptr, starts_ptr, lengths_ptr, w_ptr, b_ptr, out_ptr, channels,
                           stride_xl, stride_cr, stride_cc, stride_ck, stride_ol,
                           K: tl.constexpr, HAS_BIAS: tl.constexpr, BC: tl.constexpr):
        s = tl.program_id(0)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        mask = c < channels
        window = conv_ptr + tl.load(index_ptr + s).to(tl.int64) * stride_cr + c * stride_cc
        start = tl.load(starts_ptr + s).to(tl.int64)
        n = tl.load(lengths_ptr + s)
        bias = tl.zeros([BC], tl.float32)
        if HAS_BIAS:
            bias = tl.load(b_ptr + c, mask=mask, other=0.0).to(tl.float32)
        for t in range(0, n):  # input j of the segment: x[start + j] for j >= 0, else window column K-1+j
            acc = bias
            for k in tl.static_range(K):
                j = c * 0 + (t - (K - 1) + k)  # a vector, so that the masks stay boolean vectors
                v = tl.load(x_ptr + (start + j) * stride_xl + c, mask=mask & (j >= 0), other=0.0).to(tl.float32) + \
                    tl.load(window + (K - 1 + j) * stride_ck, mask=mask & (j < 0), other=0.0).to(tl.float32)
                acc += v * tl.load(w_ptr + c * K + k, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + (start + t) * stride_ol + c, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty),
                     mask=mask)
        for i in tl.static_range(K - 1):  # the new window: the segment's last K-1 inputs (columns read >= i)
            j = c * 0 + (n - (K - 1) + i)
            v = tl.load(x_ptr + (start + j) * stride_xl + c, mask=mask & (j >= 0), other=0.0) + \
                tl.load(window + (K - 1 + j) * stride_ck, mask=mask & (j < 0), other=0.0)
            tl.store(window + i * stride_ck, v.to(conv_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _ssd_chunks_slots(xbc_ptr, dt_ptr, dt_bias_ptr, A_ptr, D_ptr, state_ptr, index_ptr, starts_ptr, lengths_ptr,
                          y_ptr, lo, hi, stride_xl, stride_dl, stride_sr, stride_sh, stride_sp, stride_yl,
                          P, N, heads_per_group, d_inner, group_width,
                          BP: tl.constexpr, BN: tl.constexpr):
        s = tl.program_id(0)
        h = tl.program_id(1)
        p = tl.program_id(2) * BP + tl.arange(0, BP)
        n = tl.arange(0, BN)
        mp, mn = p < P, n < N
        m = mp[:, None] & mn[None, :]
        g = h // heads_per_group
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        A = tl.load(A_ptr + h).to(tl.float32)
        D = tl.load(D_ptr + h).to(tl.float32)
        at = state_ptr + tl.load(index_ptr + s).to(tl.int64) * stride_sr + h * stride_sh + \
            p[:, None] * stride_sp + n[None, :]
        state = tl.load(at, mask=m, other=0.0)
        start = tl.load(starts_ptr + s).to(tl.int64)
        for t in range(0, tl.load(lengths_ptr + s)):  # the recurrence token by token, the state in registers
            row = xbc_ptr + (start + t) * stride_xl
            dt = _softplus_clamp(tl.load(dt_ptr + (start + t) * stride_dl + h).to(tl.float32) + dt_bias, lo, hi)
            x = tl.load(row + h * P + p, mask=mp, other=0.0).to(tl.float32)
            B = tl.load(row + d_inner + g * N + n, mask=mn, other=0.0).to(tl.float32)
            C = tl.load(row + d_inner + group_width + g * N + n, mask=mn, other=0.0).to(tl.float32)
            state = state * tl.exp(dt * A) + (x * dt)[:, None] * B[None, :]
            y = tl.sum(state * C[None, :], axis=1) + D * x
            tl.store(y_ptr + (start + t) * stride_yl + h * P + p, y, mask=mp)
        tl.store(at, state, mask=m)

    @triton.jit
    def _dt_decay(dt_ptr, dt_bias_ptr, A_ptr, h, start, t, valid, stride_dl, lo, hi):
        """dt = clamp(softplus(dt + dt_bias)) of tokens t of a segment (0 past its end), and a = the inclusive
        cumulative sum of dt * A over them: the chunk's log-decays."""
        dt = _softplus_clamp(tl.load(dt_ptr + (start + t) * stride_dl + h, mask=valid, other=0.0).to(tl.float32) +
                             tl.load(dt_bias_ptr + h).to(tl.float32), lo, hi)
        dt = tl.where(valid, dt, 0.0)
        return dt, tl.cumsum(dt * tl.load(A_ptr + h).to(tl.float32), axis=0)

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _ssd_chunk_states(xbc_ptr, dt_ptr, dt_bias_ptr, A_ptr, starts_ptr, lengths_ptr, states_ptr, decay_ptr, lo, hi,
                          stride_xl, stride_dl, stride_ss, stride_sc, stride_sh, stride_sp, stride_ds, stride_dc,
                          P, N, heads_per_group, d_inner,
                          Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
        # chunk c of segment s, head h: its state from zero, sum_u exp(a_last - a_u) dt_u x_u B_u^T, and a_last
        s, h, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(starts_ptr + s).to(tl.int64)
        t = c * Q + tl.arange(0, Q)
        valid = t < tl.load(lengths_ptr + s)
        dt, a = _dt_decay(dt_ptr, dt_bias_ptr, A_ptr, h, start, t, valid, stride_dl, lo, hi)
        a_last = tl.sum(dt * tl.load(A_ptr + h).to(tl.float32), axis=0)
        p, n = tl.arange(0, BP), tl.arange(0, BN)
        rows = xbc_ptr + (start + t)[:, None] * stride_xl
        x = tl.load(rows + h * P + p[None, :], mask=valid[:, None] & (p < P)[None, :], other=0.0)
        B = tl.load(rows + d_inner + (h // heads_per_group) * N + n[None, :], mask=valid[:, None] & (n < N)[None, :],
                    other=0.0)
        xw = (x.to(tl.float32) * (dt * tl.exp(a_last - a))[:, None]).to(x.dtype)
        state = _dot(tl.trans(xw), B, IEEE)  # [BP, BN]
        out = states_ptr + s * stride_ss + c * stride_sc + h * stride_sh + p[:, None] * stride_sp + n[None, :]
        tl.store(out, state, mask=(p < P)[:, None] & (n < N)[None, :])
        tl.store(decay_ptr + s * stride_ds + c * stride_dc + h, a_last)

    @triton.jit
    def _ssd_state_passing(state_ptr, index_ptr, lengths_ptr, states_ptr, decay_ptr,
                           stride_sr, stride_sh, stride_sp, stride_ss, stride_sc, stride_ch, stride_cp,
                           stride_ds, stride_dc, P, N, Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
        # segment s, head h, head-dimension block: the state entering each chunk (written over the chunk's own
        # state), from the slot's, chunk after chunk; the state after the last chunk back into the slot
        s, h = tl.program_id(0), tl.program_id(1)
        p = tl.program_id(2) * BP + tl.arange(0, BP)
        n = tl.arange(0, BN)
        m = (p < P)[:, None] & (n < N)[None, :]
        slot = state_ptr + tl.load(index_ptr + s).to(tl.int64) * stride_sr + h * stride_sh + p[:, None] * stride_sp + \
            n[None, :]
        state = tl.load(slot, mask=m, other=0.0)
        for c in range(0, tl.cdiv(tl.load(lengths_ptr + s), Q)):
            at = states_ptr + s * stride_ss + c * stride_sc + h * stride_ch + p[:, None] * stride_cp + n[None, :]
            own = tl.load(at, mask=m, other=0.0)
            tl.store(at, state, mask=m)
            state = state * tl.exp(tl.load(decay_ptr + s * stride_ds + c * stride_dc + h)) + own
        tl.store(slot, state, mask=m)

    @triton.jit
    def _ssd_chunk_scan(xbc_ptr, dt_ptr, dt_bias_ptr, A_ptr, D_ptr, starts_ptr, lengths_ptr, states_ptr, y_ptr, lo, hi,
                        stride_xl, stride_dl, stride_ss, stride_sc, stride_sh, stride_sp, stride_yl,
                        P, N, heads_per_group, d_inner, group_width,
                        Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
        # chunk c of segment s, head h: y_t = exp(a_t) C_t h_in + sum_{u <= t} (C_t . B_u) exp(a_t - a_u) dt_u x_u
        # + D x_t, h_in the state entering the chunk
        s, h, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(starts_ptr + s).to(tl.int64)
        local = tl.arange(0, Q)
        t = c * Q + local
        valid = t < tl.load(lengths_ptr + s)
        dt, a = _dt_decay(dt_ptr, dt_bias_ptr, A_ptr, h, start, t, valid, stride_dl, lo, hi)
        p, n = tl.arange(0, BP), tl.arange(0, BN)
        g = h // heads_per_group
        rows = xbc_ptr + (start + t)[:, None] * stride_xl
        mn = valid[:, None] & (n < N)[None, :]
        x = tl.load(rows + h * P + p[None, :], mask=valid[:, None] & (p < P)[None, :], other=0.0)
        B = tl.load(rows + d_inner + g * N + n[None, :], mask=mn, other=0.0)
        C = tl.load(rows + d_inner + group_width + g * N + n[None, :], mask=mn, other=0.0)
        h_in = tl.load(states_ptr + s * stride_ss + c * stride_sc + h * stride_sh + p[:, None] * stride_sp + n[None, :],
                       mask=(p < P)[:, None] & (n < N)[None, :], other=0.0)
        y = _dot(C.to(tl.float32), tl.trans(h_in), IEEE) * tl.exp(a)[:, None]  # [Q, BP]
        causal = local[:, None] >= local[None, :]
        decay = tl.exp(tl.where(causal, a[:, None] - a[None, :], float("-inf")))  # [Q, Q], 0 above the diagonal
        mix = _dot(C, tl.trans(B), IEEE) * decay * dt[None, :]
        y += _dot(mix.to(x.dtype), x, IEEE)
        y += tl.load(D_ptr + h).to(tl.float32) * x.to(tl.float32)
        tl.store(y_ptr + (start + t)[:, None] * stride_yl + h * P + p[None, :], y,
                 mask=valid[:, None] & (p < P)[None, :])


def mamba_chunks(xBC, dt, conv, ssm, starts, lengths, index, weight, bias, dt_bias, A, D, time_step_limit,
                 d_inner: int, n_groups: int, max_length: int | None = None) -> torch.Tensor:
    """`hybrid.ops.mamba_chunks` (arguments and result as there): y [L, nh, P] fp32, rows outside the segments
    zero. The conv runs one program per (sequence, channel block). The SSD then takes one of two forms:
    - recurrent (`max_length` None, or at most `CHUNK`): one program per (sequence, head, head-dimension block)
      stepping its tokens in order with the state in registers; one launch;
    - chunked (`max_length`, the longest segment as a host int, above `CHUNK`): each segment cut into chunks of
      `CHUNK` tokens; per chunk its state from zero (`_ssd_chunk_states`, one product), the states passed from
      chunk to chunk from the slot's (`_ssd_state_passing`, the only sequential part: one step per chunk), and
      the outputs (`_ssd_chunk_scan`: the state entering the chunk through C, plus the chunk's own tokens as
      (C B^T masked by the decays) x, matrix products); three launches. The SSD paper's chunked algorithm: the
      recurrence's O(length) dependent steps become O(length / CHUNK).

    Needs the pools' last dims contiguous as `mamba_decode_step` does; segments of zero tokens or more.
    """
    L, channels = xBC.shape
    S = index.shape[0]
    nh, P, N = ssm.shape[1:]
    K = weight.shape[1]
    xBC, dt = xBC.contiguous(), dt.contiguous()
    activated = torch.empty_like(xBC)
    y = torch.zeros(L, nh, P, dtype=torch.float32, device=xBC.device)
    lo, hi = (float(v) for v in time_step_limit)
    with backend.launch_guard(xBC.device):
        _conv_chunks_slots[(S, triton.cdiv(channels, CONV_BLOCK))](
            xBC, conv, index, starts, lengths, weight.contiguous(), bias if bias is not None else weight, activated,
            channels, xBC.stride(0), conv.stride(0), conv.stride(1), conv.stride(2), activated.stride(0),
            K=K, HAS_BIAS=bias is not None, BC=CONV_BLOCK)
        if max_length is None or max_length <= CHUNK:
            _ssd_chunks_slots[(S, nh, triton.cdiv(P, HEAD_DIM_BLOCK))](
                activated, dt, dt_bias, A, D, ssm, index, starts, lengths, y, lo, hi,
                activated.stride(0), dt.stride(0), ssm.stride(0), ssm.stride(1), ssm.stride(2), y.stride(0),
                P, N, nh // n_groups, d_inner, n_groups * N,
                BP=HEAD_DIM_BLOCK, BN=triton.next_power_of_2(N))
            return y
        chunks = triton.cdiv(max_length, CHUNK)
        states = torch.empty(S, chunks, nh, P, N, dtype=torch.float32, device=xBC.device)
        decay = torch.empty(S, chunks, nh, dtype=torch.float32, device=xBC.device)
        BP, BN = max(16, triton.next_power_of_2(P)), max(16, triton.next_power_of_2(N))
        ieee = xBC.dtype == torch.float32
        _ssd_chunk_states[(S, nh, chunks)](
            activated, dt, dt_bias, A, starts, lengths, states, decay, lo, hi,
            activated.stride(0), dt.stride(0), states.stride(0), states.stride(1), states.stride(2), states.stride(3),
            decay.stride(0), decay.stride(1), P, N, nh // n_groups, d_inner,
            Q=CHUNK, BP=BP, BN=BN, IEEE=ieee)
        _ssd_state_passing[(S, nh, triton.cdiv(P, HEAD_DIM_BLOCK))](
            ssm, index, lengths, states, decay, ssm.stride(0), ssm.stride(1), ssm.stride(2),
            states.stride(0), states.stride(1), states.stride(2), states.stride(3), decay.stride(0), decay.stride(1),
            P, N, Q=CHUNK, BP=HEAD_DIM_BLOCK, BN=triton.next_power_of_2(N))
        _ssd_chunk_scan[(S, nh, chunks)](
            activated, dt, dt_bias, A, D, starts, lengths, states, y, lo, hi,
            activated.stride(0), dt.stride(0), states.stride(0), states.stride(1), states.stride(2), states.stride(3),
            y.stride(0), P, N, nh // n_groups, d_inner, n_groups * N,
            Q=CHUNK, BP=BP, BN=BN, IEEE=ieee)
    return y


def mamba_decode_step(xBC, dt, conv, ssm, index, weight, bias, dt_bias, A, D, time_step_limit, d_inner: int,
                      n_groups: int) -> torch.Tensor:
    """`hybrid.ops.mamba_decode_step` (arguments and result as there): y [S, nh, P] fp32. The prompt-chunk
    kernels with one token per sequence (its `starts` and `lengths` made on the device): two launches whatever S.
    """
    S = xBC.shape[0]
    starts = torch.arange(S, device=xBC.device)
    return mamba_chunks(xBC, dt, conv, ssm, starts, torch.ones_like(starts), index.to(xBC.device), weight, bias,
                        dt_bias, A, D, time_step_limit, d_inner, n_groups)


def mamba_scan(xBC, dt, weight, bias, dt_bias, A, D, time_step_limit, d_inner: int, n_groups: int, mask=None,
               conv=None, ssm=None) -> torch.Tensor:
    """`hybrid.ops.mamba_scan` (arguments and result as there, without `chunk_size`): y [b, T, nh, P] fp32 through
    the prompt-chunk kernels, each of the b rows one segment of the flattened rows, from zero states (or `conv` /
    `ssm` [b, ...], continued and updated in place). With a padding `mask` each row's real tokens are moved to its
    front first (order kept, as the specification's conv does) and its segment is their number, so padding
    reaches no state; the outputs at padded positions are zero. No value goes to the host."""
    b, T, channels = xBC.shape
    nh, K = A.shape[0], weight.shape[1]
    P, N = d_inner // nh, (channels - d_inner) // (2 * n_groups)
    rows = torch.arange(b, device=xBC.device)
    if mask is None:
        lengths = torch.full((b,), T, dtype=torch.long, device=xBC.device)
    else:
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # real tokens first
        xBC = xBC.gather(1, order[..., None].expand(b, T, channels))
        dt = dt.gather(1, order[..., None].expand(b, T, nh))
        lengths = mask.sum(dim=1)
    conv = xBC.new_zeros(b, channels, K - 1) if conv is None else conv
    ssm = torch.zeros(b, nh, P, N, dtype=torch.float32, device=xBC.device) if ssm is None else ssm
    y = mamba_chunks(xBC.reshape(b * T, channels), dt.reshape(b * T, nh), conv, ssm, rows * T, lengths, rows,
                     weight, bias, dt_bias, A, D, time_step_limit, d_inner, n_groups, max_length=T).view(b, T, nh, P)
    if mask is None:
        return y
    return torch.empty_like(y).scatter_(1, order[..., None, None].expand(b, T, nh, P), y)
