// RMSNorm and the Mamba-2 mixer's grouped, gated RMSNorm, each row in one pass over memory and one call
// (hybrid/ops/norm.py is the specification; there each norm is 4 to 10 PyTorch operations, and in a decode
// step, after the weight streams have evicted the interpreter's and dispatcher's lines, each operation's fixed
// cost adds up: docs/perf-log.md#fused-norm):
//   rms_norm:        out = (v * rsqrt(mean(v^2) + eps)) * w,               v = fp32(x)
//   gated_rms_norm:  g = fp32(x) * silu(fp32(z)); per group of d / n_groups contiguous elements
//                    out = (g * rsqrt(mean(g^2) + eps)) * w
// computed in fp32 (the products in the specification's order) and rounded once to the output dtype. Each
// row's sum of squares is summed in 16 lanes in a fixed order, so a row's result never depends on the other
// rows (a batch equals its rows alone). Built on first use by hybrid/ops/cpu.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
// pybind11 with torch's casters: not all of torch/extension.h (a shorter compile: docs/perf-log.md#extension-headers)
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

inline float f32(float v) { return v; }
inline float f32(at::BFloat16 v) { return static_cast<float>(v); }

// 1 / sqrt(mean of v[0..n)^2 + eps): the squares summed in kLanes partial sums (the compiler vectorises
// them), then the lanes in order
inline float inv_rms(const float* v, int64_t n, float eps) {
  float part[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) part[j] += v[i + j] * v[i + j];
  for (int64_t j = 0; i + j < n; ++j) part[j] += v[i + j] * v[i + j];
  float sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) sum += part[j];
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// rows of d elements: grain so that a small call (one decoded token) does not fork the threads
inline int64_t grain(int64_t d) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1)); }

template <typename X, typename W>
void rms_rows(const X* x, const W* w, X* out, int64_t R, int64_t d, float eps) {
  at::parallel_for(0, R, grain(d), [&](int64_t begin, int64_t end) {
    std::vector<float> v(d);
    for (int64_t r = begin; r < end; ++r) {
      const X* xr = x + r * d;
      for (int64_t i = 0; i < d; ++i) v[i] = f32(xr[i]);
      const float inv = inv_rms(v.data(), d, eps);
      X* o = out + r * d;
      for (int64_t i = 0; i < d; ++i) o[i] = static_cast<X>((v[i] * inv) * f32(w[i]));
    }
  });
}

template <typename Z, typename W, typename O>
void gated_rows(const float* x, const Z* z, const W* w, O* out, int64_t R, int64_t d, int64_t groups, float eps) {
  const int64_t width = d / groups;
  at::parallel_for(0, R, grain(d), [&](int64_t begin, int64_t end) {
    std::vector<float> g(d);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * d;
      const Z* zr = z + r * d;
      for (int64_t i = 0; i < d; ++i) {
        const float zv = f32(zr[i]);
        g[i] = xr[i] * (zv / (1.f + std::exp(-zv)));
      }
      O* o = out + r * d;
      for (int64_t k = 0; k < groups; ++k) {
        const float* gk = g.data() + k * width;
        const float inv = inv_rms(gk, width, eps);
        for (int64_t i = 0; i < width; ++i) o[k * width + i] = static_cast<O>((gk[i] * inv) * f32(w[k * width + i]));
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be fp32 or bf16, got ", t.scalar_type());
}

template <typename X, typename W>
void rms_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, int64_t R, int64_t d, float eps) {
  rms_rows<X, W>(x.data_ptr<X>(), w.data_ptr<W>(), out.data_ptr<X>(), R, d, eps);
}

// x [..., d] fp32 / bf16, weight [d] fp32 / bf16 -> [..., d] in x's dtype
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(weight, "weight");
  const int64_t d = x.size(-1), R = d ? x.numel() / d : 0;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d, "weight must be [", d, "], got ", weight.sizes());
  auto out = at::empty_like(x);
  const bool xf = x.scalar_type() == at::kFloat, wf = weight.scalar_type() == at::kFloat;
  const float e = static_cast<float>(eps);
  if (xf && wf) rms_out<float, float>(x, weight, out, R, d, e);
  else if (xf) rms_out<float, at::BFloat16>(x, weight, out, R, d, e);
  else if (wf) rms_out<at::BFloat16, float>(x, weight, out, R, d, e);
  else rms_out<at::BFloat16, at::BFloat16>(x, weight, out, R, d, e);
  return out;
}

template <typename Z, typename W>
void gated_out(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w, at::Tensor& out, int64_t R,
               int64_t d, int64_t groups, float eps) {
  if (out.scalar_type() == at::kFloat)
    gated_rows<Z, W, float>(x.data_ptr<float>(), z.data_ptr<Z>(), w.data_ptr<W>(), out.data_ptr<float>(), R, d,
                            groups, eps);
  else
    gated_rows<Z, W, at::BFloat16>(x.data_ptr<float>(), z.data_ptr<Z>(), w.data_ptr<W>(),
                                   out.data_ptr<at::BFloat16>(), R, d, groups, eps);
}

// x [..., d] fp32, z [..., d] fp32 / bf16, weight [d] fp32 / bf16 -> [..., d] in out_dtype (fp32 / bf16)
at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight,
                          int64_t groups, double eps, at::ScalarType out_dtype) {
  check_rows(x, "x");
  check_rows(z, "z");
  check_rows(weight, "weight");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be fp32, got ", x.scalar_type());
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "out_dtype must be fp32 or bf16");
  TORCH_CHECK(z.sizes() == x.sizes(), "z must have x's shape ", x.sizes(), ", got ", z.sizes());
  const int64_t d = x.size(-1), R = d ? x.numel() / d : 0;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d, "weight must be [", d, "], got ", weight.sizes());
  TORCH_CHECK(groups > 0 && d % groups == 0, "n_groups ", groups, " must divide ", d);
  auto out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  const bool zf = z.scalar_type() == at::kFloat, wf = weight.scalar_type() == at::kFloat;
  const float e = static_cast<float>(eps);
  if (zf && wf) gated_out<float, float>(x, z, weight, out, R, d, groups, e);
  else if (zf) gated_out<float, at::BFloat16>(x, z, weight, out, R, d, groups, e);
  else if (wf) gated_out<at::BFloat16, float>(x, z, weight, out, R, d, groups, e);
  else gated_out<at::BFloat16, at::BFloat16>(x, z, weight, out, R, d, groups, e);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim of x [..., d] with weight [d] -> x's dtype");
  m.def("gated_rms_norm", &gated_rms_norm,
        "grouped gated RMSNorm of x [..., d] fp32 gated by silu(z), weight [d] -> out_dtype");
}
