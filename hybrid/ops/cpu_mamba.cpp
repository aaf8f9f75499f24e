// One decode step of the Mamba-2 recurrences of S sequences, each in its own slot of the state pools,
// updated in place (vLLM's state indices; never gathered into a batch and scattered back). For sequence s
// with slot i = slots[s] (hybrid/ops/conv1d.py and ssd.py are the specification, hybrid/layers/mamba2.py
// the order of the steps):
//   conv:  full = [conv_pool[i] | xBC[s]] (K taps per channel), out = silu(sum_k full_k * w_k + b),
//          conv_pool[i] = full[1:]                                   (products, sums and SiLU rounded to
//                                                                      the model dtype as PyTorch does)
//   dt:    clamp(softplus(dt[s] + dt_bias), lo, hi)                   (fp32)
//   SSD:   per head h (group g = h / (nh / ng)) and p: state = exp(dt A) state + (x dt) B_g,
//          y = state . C_g + D x                                      (fp32, ssm_pool[i] in place)
// Returns y [S, nh, P] fp32. Built on first use by hybrid/ops/cpu.py; the PyTorch path stays the reference.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
// pybind11 with torch's casters: not all of torch/extension.h (a shorter compile: docs/perf-log.md#extension-headers)
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

template <typename T>
inline float round_to(float v) {  // the value PyTorch would store in T
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
void conv_step(const T* x, T* window, const float* w, const float* b, float* out, int64_t S, int64_t C, int64_t K,
               const int64_t* slots, int64_t slot_stride) {
  const int64_t K1 = K - 1;
  at::parallel_for(0, S * C, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t sc = begin; sc < end; ++sc) {
      const int64_t s = sc / C, c = sc % C;
      T* win = window + slots[s] * slot_stride + c * K1;
      const T xv = x[s * C + c];
      float acc = 0.f;
      for (int64_t k = 0; k < K1; ++k) acc += round_to<T>(static_cast<float>(win[k]) * w[c * K + k]);
      acc += round_to<T>(static_cast<float>(xv) * w[c * K + K1]);
      float v = round_to<T>(acc);
      if (b) v = round_to<T>(v + b[c]);
      v = round_to<T>(v / (1.f + std::exp(-v)));
      out[s * C + c] = v;
      for (int64_t k = 0; k + 1 < K1; ++k) win[k] = win[k + 1];
      if (K1 > 0) win[K1 - 1] = xv;
    }
  });
}

template <typename T>
at::Tensor step(const at::Tensor& xBC, const at::Tensor& dt, at::Tensor& conv_pool, const at::Tensor& w,
                const c10::optional<at::Tensor>& bias, const at::Tensor& dt_bias, const at::Tensor& A,
                const at::Tensor& D, double lo, double hi, at::Tensor& ssm_pool, const at::Tensor& slots,
                int64_t d_inner, int64_t n_groups) {
  const int64_t S = xBC.size(0), C = xBC.size(1), K = w.size(1);
  const int64_t nh = ssm_pool.size(1), P = ssm_pool.size(2), N = ssm_pool.size(3);
  const int64_t* slot = slots.data_ptr<int64_t>();
  std::vector<float> conv_out(S * C);
  at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  conv_step<T>(xBC.data_ptr<T>(), conv_pool.data_ptr<T>(), w.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
               conv_out.data(), S, C, K, slot, conv_pool.stride(0));

  auto y = at::empty({S, nh, P}, xBC.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const T* dtp = dt.data_ptr<T>();
  const float *dtb = dt_bias.data_ptr<float>(), *Ap = A.data_ptr<float>(), *Dp = D.data_ptr<float>();
  float* pool = ssm_pool.data_ptr<float>();
  const int64_t heads_per_group = nh / n_groups, slot_stride = ssm_pool.stride(0);
  at::parallel_for(0, S * nh, 1, [&](int64_t begin, int64_t end) {
    for (int64_t sh = begin; sh < end; ++sh) {
      const int64_t s = sh / nh, h = sh % nh, g = h / heads_per_group;
      float d = static_cast<float>(dtp[s * nh + h]) + dtb[h];
      d = d > 20.f ? d : std::log1p(std::exp(d));  // softplus (beta 1, threshold 20, as torch)
      d = std::min(std::max(d, static_cast<float>(lo)), static_cast<float>(hi));
      const float decay = std::exp(d * Ap[h]);
      const float* row = conv_out.data() + s * C;
      const float* x = row + h * P;
      const float* B = row + d_inner + g * N;
      const float* Cg = row + d_inner + n_groups * N + g * N;
      float* st = pool + slot[s] * slot_stride + h * P * N;
      constexpr int64_t L = 16;  // partial sums per lane, so the compiler vectorises the reduction over n
      for (int64_t p = 0; p < P; ++p) {
        const float xdt = x[p] * d;
        float* sp = st + p * N;
        float part[L] = {0.f};
        int64_t n = 0;
        for (; n + L <= N; n += L) {
          for (int64_t j = 0; j < L; ++j) {
            const float v = sp[n + j] * decay + xdt * B[n + j];
            sp[n + j] = v;
            part[j] += v * Cg[n + j];
          }
        }
        float acc = 0.f;
        for (int64_t j = 0; j < L; ++j) acc += part[j];
        for (; n < N; ++n) {
          const float v = sp[n] * decay + xdt * B[n];
          sp[n] = v;
          acc += v * Cg[n];
        }
        yp[(s * nh + h) * P + p] = acc + Dp[h] * x[p];
      }
    }
  });
  return y;
}

// The prompt chunks of S sequences, each its rows [starts[s], starts[s] + lengths[s]) of the packed xBC
// [L, C] / dt [L, nh], continuing the states in slots[s] of the pools, updated in place. The specification
// is the prefill of hybrid/layers/mamba2.py on each chunk alone (conv1d.causal_conv1d, then ssd.ssd_scan):
//   conv:  the taps and bias summed in fp32 and rounded once to the model dtype (a conv1d), then PyTorch's
//          own SiLU on that tensor (so the rounding is PyTorch's);
//   SSD:   its recurrent form per token, state = exp(dt A) state + (x dt) B, y = state . C + D x (the
//          chunked scan is the same sum in another order), with a block of up to 128 entries of a head's
//          [P, N] state held in vector registers over all the chunk's tokens: each state is read and
//          written once per chunk, never per token.
// Returns y [L, nh, P] fp32 (rows outside the segments zero).
typedef float v16 __attribute__((vector_size(64)));  // GCC vector extension: one AVX-512 register, two AVX2 ones

inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline float sum16(v16 v) {  // a tree of halves: 4 adds, not a chain of 15
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// conv of one 64-channel block of one sequence: window and taps transposed to [k][64] so the channel loop
// vectorises; writes the pre-activation rounded to T.
template <typename T>
void conv_chunks(const T* x, T* window, const float* w, const float* b, T* out, int64_t C, int64_t K,
                 const int64_t* starts, const int64_t* lengths, const int64_t* slots, int64_t S, int64_t slot_stride) {
  constexpr int64_t CB = 64;
  const int64_t K1 = K - 1, blocks = (C + CB - 1) / CB;
  at::parallel_for(0, S * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> win(K * CB, 0.f), taps(K * CB, 0.f), bias(CB, 0.f);
    for (int64_t sb = begin; sb < end; ++sb) {
      const int64_t s = sb / blocks, c0 = (sb % blocks) * CB, n = std::min(C, c0 + CB) - c0;
      T* pool = window + slots[s] * slot_stride;
      for (int64_t c = 0; c < n; ++c) {
        for (int64_t k = 0; k < K1; ++k) win[k * CB + c] = static_cast<float>(pool[(c0 + c) * K1 + k]);
        for (int64_t k = 0; k < K; ++k) taps[k * CB + c] = w[(c0 + c) * K + k];
        bias[c] = b ? b[c0 + c] : 0.f;
      }
      for (int64_t t = starts[s]; t < starts[s] + lengths[s]; ++t) {
        const T* xt = x + t * C + c0;
        T* ot = out + t * C + c0;
        float* last = win.data() + K1 * CB;  // row K1 holds the new input
        for (int64_t c = 0; c < n; ++c) last[c] = static_cast<float>(xt[c]);
        float acc[CB];
        for (int64_t c = 0; c < CB; ++c) acc[c] = bias[c];
        for (int64_t k = 0; k < K; ++k)
          for (int64_t c = 0; c < CB; ++c) acc[c] += win[k * CB + c] * taps[k * CB + c];
        for (int64_t c = 0; c < n; ++c) ot[c] = static_cast<T>(acc[c]);
        std::copy(win.begin() + CB, win.end(), win.begin());  // roll the window by one input
      }
      for (int64_t c = 0; c < n; ++c)
        for (int64_t k = 0; k < K1; ++k) pool[(c0 + c) * K1 + k] = static_cast<T>(win[k * CB + c]);
    }
  });
}

// The SSD recurrence for NB x 16 state entries [n0, n0 + 16 NB) of one row p of a head's state, over tokens
// t0 .. t1 - 1; adds each token's partial y_t = state . C_t into out[t].
template <int NB>
void ssd_block(float* sp, const float* rows, int64_t C, int64_t xo, int64_t Bo, int64_t Co, const float* dts,
               const float* decays, int64_t t0, int64_t t1, float* out) {
  v16 st[NB];
  for (int r = 0; r < NB; ++r) st[r] = load16(sp + 16 * r);
  for (int64_t t = t0; t < t1; ++t) {
    const float* row = rows + t * C;
    const float decay = decays[t], xdt = row[xo] * dts[t];
    v16 acc[2] = {};  // two sums: half the chain of dependent adds
    for (int r = 0; r < NB; ++r) {
      st[r] = st[r] * decay + xdt * load16(row + Bo + 16 * r);
      acc[r & 1] += st[r] * load16(row + Co + 16 * r);
    }
    out[t] += sum16(acc[0] + acc[1]);
  }
  for (int r = 0; r < NB; ++r) __builtin_memcpy(sp + 16 * r, &st[r], sizeof(v16));
}

template <typename T>
at::Tensor chunks(const at::Tensor& xBC, const at::Tensor& dt, at::Tensor& conv_pool, const at::Tensor& w,
                  const c10::optional<at::Tensor>& bias, const at::Tensor& dt_bias, const at::Tensor& A,
                  const at::Tensor& D, double lo, double hi, at::Tensor& ssm_pool, const at::Tensor& starts_t,
                  const at::Tensor& lengths_t, const at::Tensor& slots_t, int64_t d_inner, int64_t n_groups) {
  const int64_t L = xBC.size(0), C = xBC.size(1), K = w.size(1), S = slots_t.numel();
  const int64_t nh = ssm_pool.size(1), P = ssm_pool.size(2), N = ssm_pool.size(3);
  const int64_t *starts = starts_t.data_ptr<int64_t>(), *lengths = lengths_t.data_ptr<int64_t>();
  const int64_t* slot = slots_t.data_ptr<int64_t>();
  TORCH_CHECK(C == d_inner + 2 * n_groups * N && nh % n_groups == 0 && d_inner == nh * P, "widths");
  int64_t longest = 0;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(starts[s] >= 0 && lengths[s] >= 1 && starts[s] + lengths[s] <= L, "segment ", s, " outside the rows");
    longest = std::max(longest, lengths[s]);
  }
  std::vector<std::pair<int64_t, int64_t>> spans(S);  // each row belongs to one segment at most
  for (int64_t s = 0; s < S; ++s) spans[s] = {starts[s], starts[s] + lengths[s]};
  std::sort(spans.begin(), spans.end());
  for (int64_t s = 1; s < S; ++s) TORCH_CHECK(spans[s].first >= spans[s - 1].second, "segments overlap");
  at::Tensor pre = at::empty({L, C}, xBC.options());
  at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  conv_chunks<T>(xBC.data_ptr<T>(), conv_pool.data_ptr<T>(), w.data_ptr<float>(),
                 b.defined() ? b.data_ptr<float>() : nullptr, pre.data_ptr<T>(), C, K, starts, lengths, slot, S,
                 conv_pool.stride(0));
  at::silu_(pre);
  const at::Tensor conv_out = pre.to(at::kFloat);
  const float* rows_all = conv_out.data_ptr<float>();

  auto y = at::zeros({L, nh, P}, xBC.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const T* dtp = dt.data_ptr<T>();
  const float *dtb = dt_bias.data_ptr<float>(), *Ap = A.data_ptr<float>(), *Dp = D.data_ptr<float>();
  float* pool = ssm_pool.data_ptr<float>();
  const int64_t heads_per_group = nh / n_groups, slot_stride = ssm_pool.stride(0);
  at::parallel_for(0, S * nh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> dts(longest), decays(longest), out(longest);
    for (int64_t sh = begin; sh < end; ++sh) {
      const int64_t s = sh / nh, h = sh % nh, g = h / heads_per_group, t0 = starts[s], T_ = lengths[s];
      for (int64_t t = 0; t < T_; ++t) {
        float d = static_cast<float>(dtp[(t0 + t) * nh + h]) + dtb[h];
        d = d > 20.f ? d : std::log1p(std::exp(d));  // softplus (beta 1, threshold 20, as torch)
        d = std::min(std::max(d, static_cast<float>(lo)), static_cast<float>(hi));
        dts[t] = d;
        decays[t] = std::exp(d * Ap[h]);
      }
      const float* rows = rows_all + t0 * C;
      const int64_t Bo = d_inner + g * N, Co = d_inner + n_groups * N + g * N;
      float* st = pool + slot[s] * slot_stride + h * P * N;
      // Token blocks of 16: their B and C rows (16 x 2 x N floats) stay in L1 while every row p of the
      // state passes over them (a p-major pass over all tokens streams them from L2 once per p).
      constexpr int64_t TB = 16;
      for (int64_t ta = 0; ta < T_; ta += TB) {
        const int64_t tb = std::min(T_, ta + TB);
        for (int64_t p = 0; p < P; ++p) {
          float* sp = st + p * N;
          const int64_t xo = h * P + p;
          std::fill(out.begin() + ta, out.begin() + tb, 0.f);
          int64_t n0 = 0;
          for (; n0 + 128 <= N; n0 += 128)
            ssd_block<8>(sp + n0, rows, C, xo, Bo + n0, Co + n0, dts.data(), decays.data(), ta, tb, out.data());
          for (; n0 + 16 <= N; n0 += 16)
            ssd_block<1>(sp + n0, rows, C, xo, Bo + n0, Co + n0, dts.data(), decays.data(), ta, tb, out.data());
          for (int64_t n = n0; n < N; ++n) {  // state sizes that are not a multiple of 16
            float v = sp[n];
            for (int64_t t = ta; t < tb; ++t) {
              const float* row = rows + t * C;
              v = v * decays[t] + row[xo] * dts[t] * row[Bo + n];
              out[t] += v * row[Co + n];
            }
            sp[n] = v;
          }
          for (int64_t t = ta; t < tb; ++t) yp[((t0 + t) * nh + h) * P + p] = out[t] + Dp[h] * rows[t * C + xo];
        }
      }
    }
  });
  return y;
}

// The checks and conversions both entry points share: the pools, the model dtype, contiguous inputs and the
// parameters in fp32.
void prepare(at::Tensor& xBC, at::Tensor& dt, const at::Tensor& conv_pool, at::Tensor& conv_w,
             c10::optional<at::Tensor>& conv_b, at::Tensor& dt_bias, at::Tensor& A, at::Tensor& D,
             const at::Tensor& ssm_pool) {
  TORCH_CHECK(xBC.dim() == 2 && dt.dim() == 2 && conv_pool.dim() == 3 && ssm_pool.dim() == 4, "shapes");
  TORCH_CHECK(xBC.scalar_type() == conv_pool.scalar_type() && dt.scalar_type() == xBC.scalar_type(),
              "xBC, dt and the conv pool share the model dtype");
  TORCH_CHECK(ssm_pool.scalar_type() == at::kFloat && ssm_pool.is_contiguous() && conv_pool.is_contiguous(),
              "contiguous pools, the SSM state in fp32");
  TORCH_CHECK(xBC.scalar_type() == at::kFloat || xBC.scalar_type() == at::kBFloat16, "fp32 or bf16 inputs");
  xBC = xBC.contiguous();
  dt = dt.contiguous();
  conv_w = conv_w.to(at::kFloat).contiguous();
  if (conv_b.has_value()) conv_b = conv_b->to(at::kFloat);
  dt_bias = dt_bias.to(at::kFloat).contiguous();
  A = A.to(at::kFloat).contiguous();
  D = D.to(at::kFloat).contiguous();
}

at::Tensor mamba_step_slots(at::Tensor xBC, at::Tensor dt, at::Tensor conv_pool, at::Tensor conv_w,
                            c10::optional<at::Tensor> conv_b, at::Tensor dt_bias, at::Tensor A,
                            at::Tensor D, double lo, double hi, at::Tensor ssm_pool, at::Tensor slots,
                            int64_t d_inner, int64_t n_groups) {
  prepare(xBC, dt, conv_pool, conv_w, conv_b, dt_bias, A, D, ssm_pool);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == xBC.size(0), "one int64 slot per sequence");
  slots = slots.contiguous();
  if (xBC.scalar_type() == at::kFloat)
    return step<float>(xBC, dt, conv_pool, conv_w, conv_b, dt_bias, A, D, lo, hi, ssm_pool, slots, d_inner, n_groups);
  return step<at::BFloat16>(xBC, dt, conv_pool, conv_w, conv_b, dt_bias, A, D, lo, hi, ssm_pool, slots, d_inner,
                            n_groups);
}

at::Tensor mamba_chunks_slots(at::Tensor xBC, at::Tensor dt, at::Tensor conv_pool, at::Tensor conv_w,
                              c10::optional<at::Tensor> conv_b, at::Tensor dt_bias, at::Tensor A, at::Tensor D,
                              double lo, double hi, at::Tensor ssm_pool, at::Tensor starts, at::Tensor lengths,
                              at::Tensor slots, int64_t d_inner, int64_t n_groups) {
  prepare(xBC, dt, conv_pool, conv_w, conv_b, dt_bias, A, D, ssm_pool);
  TORCH_CHECK(slots.scalar_type() == at::kLong && starts.scalar_type() == at::kLong &&
              lengths.scalar_type() == at::kLong && starts.numel() == slots.numel() &&
              lengths.numel() == slots.numel(), "one int64 start, length and slot per sequence");
  slots = slots.contiguous();
  starts = starts.contiguous();
  lengths = lengths.contiguous();
  if (xBC.scalar_type() == at::kFloat)
    return chunks<float>(xBC, dt, conv_pool, conv_w, conv_b, dt_bias, A, D, lo, hi, ssm_pool, starts, lengths, slots,
                         d_inner, n_groups);
  return chunks<at::BFloat16>(xBC, dt, conv_pool, conv_w, conv_b, dt_bias, A, D, lo, hi, ssm_pool, starts, lengths,
                              slots, d_inner, n_groups);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mamba_step_slots", &mamba_step_slots,
        "one decode step of S sequences' conv + SSD recurrences, in place in their slots -> y [S, nh, P] fp32");
  m.def("mamba_chunks_slots", &mamba_chunks_slots,
        "S sequences' prompt chunks (packed rows) through the conv + SSD recurrences, in place in their slots "
        "-> y [L, nh, P] fp32");
}
