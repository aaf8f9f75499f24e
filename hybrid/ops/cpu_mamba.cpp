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
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's casters: not all of torch/extension.h (half the compile)
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
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

at::Tensor mamba_step_slots(at::Tensor xBC, at::Tensor dt, at::Tensor conv_pool, at::Tensor conv_w,
                            c10::optional<at::Tensor> conv_b, at::Tensor dt_bias, at::Tensor A,
                            at::Tensor D, double lo, double hi, at::Tensor ssm_pool, at::Tensor slots,
                            int64_t d_inner, int64_t n_groups) {
  TORCH_CHECK(xBC.dim() == 2 && dt.dim() == 2 && conv_pool.dim() == 3 && ssm_pool.dim() == 4, "shapes");
  TORCH_CHECK(xBC.scalar_type() == conv_pool.scalar_type() && dt.scalar_type() == xBC.scalar_type(),
              "xBC, dt and the conv pool share the model dtype");
  TORCH_CHECK(ssm_pool.scalar_type() == at::kFloat && ssm_pool.is_contiguous() && conv_pool.is_contiguous(),
              "contiguous pools, the SSM state in fp32");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == xBC.size(0), "one int64 slot per sequence");
  xBC = xBC.contiguous();
  dt = dt.contiguous();
  slots = slots.contiguous();
  conv_w = conv_w.to(at::kFloat).contiguous();
  if (conv_b.has_value()) conv_b = conv_b->to(at::kFloat);
  dt_bias = dt_bias.to(at::kFloat).contiguous();
  A = A.to(at::kFloat).contiguous();
  D = D.to(at::kFloat).contiguous();
  if (xBC.scalar_type() == at::kFloat)
    return step<float>(xBC, dt, conv_pool, conv_w, conv_b, dt_bias, A, D, lo, hi, ssm_pool, slots, d_inner, n_groups);
  TORCH_CHECK(xBC.scalar_type() == at::kBFloat16, "fp32 or bf16 inputs");
  return step<at::BFloat16>(xBC, dt, conv_pool, conv_w, conv_b, dt_bias, A, D, lo, hi, ssm_pool, slots, d_inner,
                            n_groups);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mamba_step_slots", &mamba_step_slots,
        "one decode step of S sequences' conv + SSD recurrences, in place in their slots -> y [S, nh, P] fp32");
}
