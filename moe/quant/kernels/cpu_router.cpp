// The MoE router of a few tokens in one call (moe/router.py's `route` of `x.float() @ weight.T` is the
// specification; DeepSeek-V3 / Nemotron 3 routing): per token t, in fp32,
//   logits = x_t . weight_e for every expert e          (fp32 products and sums; the order of the sums is
//                                                         this kernel's, so logits differ from a BLAS
//                                                         product's in the last bits)
//   scores = sigmoid(logits), choice = scores + bias      (the bias steers selection only)
//   groups: each of n_group groups scored by the sum of its two largest `choice`; the topk_group best kept,
//           the others' experts set to -inf
//   ids = the top_k experts by `choice`, weights = scores[ids] (/ their sum + 1e-20 if norm) * scale
// Every ranking is a stable descending sort's: ties go to the lower expert (or group) id, NaN ranks first.
// A decode step routes 1 to 16 tokens: the product reads the [E, H] fp32 weight once at the bandwidth
// (PyTorch's one-row sgemv read Nano's router well below it), and the selection replaces a dozen small
// PyTorch operations (docs/perf-log.md#router-kernel). Built on first use by moe/router.py
// (moe.quant.kernels.build.build); PyTorch otherwise.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's casters: not all of torch/extension.h
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));  // GCC vector extension: one AVX-512 register, two AVX2 ones

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float dot(const float* a, const float* b, int64_t n) {
  v16 acc[4] = {};  // four independent chains
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int r = 0; r < 4; ++r) acc[r] += load16(a + i + 16 * r) * load16(b + i + 16 * r);
  for (; i + 16 <= n; i += 16) acc[0] += load16(a + i) * load16(b + i);
  const v16 s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  float out = 0.f;
  for (int j = 0; j < 16; ++j) out += s[j];
  for (; i < n; ++i) out += a[i] * b[i];
  return out;
}

// whether (a, ia) comes before (b, ib) in a stable descending sort (NaN first, as torch.sort's)
inline bool before(float a, int64_t ia, float b, int64_t ib) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na != nb) return na;
  if (!na && a != b) return a > b;
  return ia < ib;
}

// the index of the first of v[0..n) in that order among those not yet `taken`
inline int64_t best(const float* v, int64_t n, const std::vector<char>& taken) {
  int64_t k = -1;
  for (int64_t i = 0; i < n; ++i)
    if (!taken[i] && (k < 0 || before(v[i], i, v[k], k))) k = i;
  return k;
}

std::vector<at::Tensor> route(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t top_k,
                              int64_t n_group, int64_t topk_group, bool norm, double scale) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "router: x must be a [T, H] float32 or bfloat16 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "router: weight must be a contiguous float32 [E, H] with H = ", x.size(1), ", got ", weight.sizes(), " ",
              weight.scalar_type());
  const int64_t T = x.size(0), H = x.size(1), E = weight.size(0);
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == E && bias.scalar_type() == at::kFloat && bias.is_contiguous(),
              "router: e_score_correction_bias must be a contiguous float32 [", E, "], got ", bias.sizes(), " ",
              bias.scalar_type());
  TORCH_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group,
              "router: n_group must divide E = ", E, " and 1 <= topk_group <= n_group; got n_group ", n_group,
              ", topk_group ", topk_group);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "router: top_k must be in [1, ", E, "], got ", top_k);
  TORCH_CHECK(n_group == 1 || E / n_group >= 2, "router: groups need at least 2 experts each (the top-2 score)");

  std::vector<float> xf(T * H);  // x in fp32, row-major
  const at::Tensor xc = x.contiguous();
  if (xc.scalar_type() == at::kFloat) {
    std::memcpy(xf.data(), xc.data_ptr<float>(), sizeof(float) * T * H);
  } else {
    const uint16_t* b = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < T * H; ++i) {
      const uint32_t bits = static_cast<uint32_t>(b[i]) << 16;
      std::memcpy(&xf[i], &bits, sizeof(float));
    }
  }
  std::vector<float> logits(T * E);
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, E, 8, [&](int64_t begin, int64_t end) {  // each weight row read once, for all T tokens
    for (int64_t e = begin; e < end; ++e)
      for (int64_t t = 0; t < T; ++t) logits[t * E + e] = dot(xf.data() + t * H, w + e * H, H);
  });

  auto weights = at::empty({T, top_k}, x.options().dtype(at::kFloat));
  auto ids = at::empty({T, top_k}, x.options().dtype(at::kLong));
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const float* bp = bias.data_ptr<float>();
  const int64_t G = E / n_group;
  std::vector<float> scores(E), choice(E), group_score(n_group);
  std::vector<char> taken(E), group_taken(n_group);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      scores[e] = 1.f / (1.f + std::exp(-logits[t * E + e]));
      choice[e] = scores[e] + bp[e];
    }
    if (n_group > 1) {
      for (int64_t g = 0; g < n_group; ++g) {  // the sum of the group's two largest
        std::fill(taken.begin(), taken.begin() + G, 0);
        const int64_t a = best(choice.data() + g * G, G, taken);
        taken[a] = 1;
        const int64_t b = best(choice.data() + g * G, G, taken);
        group_score[g] = choice[g * G + a] + choice[g * G + b];
      }
      std::fill(group_taken.begin(), group_taken.end(), 0);
      for (int64_t j = 0; j < topk_group; ++j) group_taken[best(group_score.data(), n_group, group_taken)] = 1;
      for (int64_t g = 0; g < n_group; ++g)
        if (!group_taken[g])
          for (int64_t e = g * G; e < (g + 1) * G; ++e) choice[e] = -std::numeric_limits<float>::infinity();
    }
    std::fill(taken.begin(), taken.end(), 0);
    float sum = 0.f;
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t e = best(choice.data(), E, taken);
      taken[e] = 1;
      ip[t * top_k + j] = e;
      wp[t * top_k + j] = scores[e];
      sum += scores[e];
    }
    for (int64_t j = 0; j < top_k; ++j) {
      float& v = wp[t * top_k + j];
      if (norm) v /= sum + 1e-20f;
      v *= static_cast<float>(scale);
    }
  }
  return {weights, ids};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("route", &route, "x [T, H] @ weight [E, H].T -> sigmoid, bias-corrected grouped top-k: (weights [T, k] fp32, "
        "ids [T, k] int64)");
}
