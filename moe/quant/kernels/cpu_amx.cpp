// Prefill-sized products from FP8 / NVFP4 / MXFP4 weights on CPUs with AMX (Intel Sapphire Rapids and later):
// each weight is decoded, a slab of kSlab rows at a time, into a short-lived bf16 buffer of plain rows
// (kSlab x K x 2 bytes: 344 KB at Nano's width 2,688, per thread), the A operand of PyTorch's oneDNN
// micro-kernel (`at::native::cpublas::brgemm`: bf16 x bf16 -> fp32 on the AMX tiles), whose B operand is the
// input transposed into bf16 pairs once per call. Every decoded value is exact in bf16 (E4M3, and E2M1 times
// an E4M3 or E8M0 block scale, have at most 6 significant bits), the products of bf16 values are exact and
// the sums fp32, so the result equals the product with the exactly dequantized weight up to the order of the
// fp32 sums; the factors a bf16 cannot hold exactly (FP8's per-tensor or per-channel scale, NVFP4's global
// scale) multiply the fp32 sums. Not covered here (the caller keeps the register kernels of cpu_packed.cpp):
// FP8 128 x 128 blocks, fp32 inputs, MXFP4 scale bytes 0, 1 and 255 (E2M1 times 2^-127 or 2^-126 is a bf16
// subnormal, which AMX reads as 0; 255 is NaN), K not a multiple of 32. bf16 weights (a bf16 model's routed
// experts and its dense projections of 8 rows or more, `moe.quant.kernels.bf16`) take the same loop with their
// rows as the A operand where they lie: nothing decoded, nothing copied.
//
// Built on first use by moe/quant/kernels/amx.py only where this CPU has AMX_BF16 (and the build -march=native).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kSlab = 64;  // weight rows decoded per buffer: the M of one micro-kernel call (C = W_slab x^T)
// A bf16 weight's rows per micro-kernel call (read in place) for inputs of at most kFewRows rows, whose product
// streams the weight from memory: 64 of Nano's 5,376-byte rows are 84 pages read at once, more streams than the
// L2 prefetcher follows. Larger inputs keep kSlab: on weights in cache 32-row slabs were slower
// (docs/perf-log.md#amx-slab-rows).
constexpr int64_t kSlabBf16Few = 32, kFewRows = 16;
constexpr int64_t kRows = 32;  // input rows per micro-kernel call: its N

bool available() { return at::native::cpublas::could_pack(at::kBFloat16); }  // oneDNN's AMX micro-kernels

float e4m3(uint8_t b) {  // OFP8 E4M3: bias 7, no infinities, S.1111.111 is NaN
  const int e = (b >> 3) & 15, m = b & 7;
  const float v = (e == 15 && m == 7) ? NAN : e == 0 ? std::ldexp(static_cast<float>(m), -9)
                                                     : std::ldexp(1.0f + m / 8.0f, e - 7);
  return (b & 0x80) ? -v : v;
}

// The bf16 bits of e4m3(m) for the magnitudes m < 128 (127: NaN), as four vectors of 32 words
struct E4m3Words {
  __m512i t[4];
  E4m3Words() {
    alignas(64) uint16_t words[128];
    for (int m = 0; m < 128; ++m) {
      const float v = e4m3(static_cast<uint8_t>(m));
      uint32_t u;
      std::memcpy(&u, &v, 4);
      words[m] = m == 127 ? 0x7FC0 : static_cast<uint16_t>(u >> 16);  // exact: at most 4 significant bits
    }
    for (int i = 0; i < 4; ++i) t[i] = _mm512_load_si512(words + 32 * i);
  }
};

const E4m3Words kE4m3Words;

// 32 E4M3 bytes -> 32 bf16 in order: two 64-word table lookups on the magnitude, the sign bit or-ed in
inline __m512i e4m3_to_bf16(const uint8_t* p) {
  const E4m3Words& words = kE4m3Words;
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i low = _mm512_permutex2var_epi16(words.t[0], w, words.t[1]);  // magnitudes 0-63 (index bits 0-5)
  const __m512i high = _mm512_permutex2var_epi16(words.t[2], w, words.t[3]);  // 64-127
  const __m512i v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), low, high);
  const __m512i sign = _mm512_set1_epi16(static_cast<short>(0x8000));
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(w, 8), sign, 0xF8);  // v | (w << 8 & sign)
}

// The E2M1 values as fp32, indexed by a code
alignas(64) constexpr float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

struct ScaleTables {  // a scale byte's value: E4M3 (NVFP4), E8M0 (MXFP4: 2^(b - 127); 255 is NaN)
  float e4m3[256], e8m0[256];
  ScaleTables() {
    for (int b = 0; b < 256; ++b) {
      e4m3[b] = ::e4m3(static_cast<uint8_t>(b));
      e8m0[b] = b == 255 ? NAN : std::ldexp(1.0f, b - 127);
    }
  }
};
const ScaleTables kScales;

// One product y [R, N] fp32 = x [R, K] bf16 @ W.T, W decoded row by row (FP8, or FP4 with its block scales)
struct Product {
  const uint16_t *x, *xt;  // x [R, K], and as transpose_pairs lays it out
  float* y;
  int64_t R, K, N, slabs, slab_rows;
  int kind;  // 0: FP8 (q [N, K]), 1: FP4 (codes [N, K / 2], scales [N, K / group]), 2: bf16 (q: [N, K] bf16)
  const uint8_t *q, *scales;
  int64_t group;
  bool e8m0;
  const float* out_scale;  // per output column (FP8 per channel), or nullptr
  float mult;              // every output times this (FP8 per tensor, NVFP4 global)

  // row n of W as K bf16 words at `out` (exact)
  void decode_row(int64_t n, uint16_t* out) const {
    if (kind == 0) {
      const uint8_t* p = q + n * K;
      for (int64_t k = 0; k < K; k += 32) _mm512_storeu_si512(out + k, e4m3_to_bf16(p + k));
      return;
    }
    const uint8_t* c = q + n * (K / 2);
    const uint8_t* s = scales + n * (K / group);
    const float* table = e8m0 ? kScales.e8m0 : kScales.e4m3;
    const __m512 values = _mm512_load_ps(kE2M1);
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
    for (int64_t k = 0; k < K; k += 32) {
      // 16 code bytes -> word 2i: the low nibble of byte i, word 2i + 1: its high nibble (element order)
      const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + k / 2)));
      const __m512i idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), nibbles, 0xA8);  // (a | b) & c
      // each block's 16 values e2m1(i) x scale as bf16 (exact), looked up by the codes: elements 0-15, 16-31
      const __m512i t0 = _mm512_castsi256_si512(reinterpret_cast<__m256i>(
          _mm512_cvtneps_pbh(_mm512_mul_ps(values, _mm512_set1_ps(table[s[k / group]])))));
      __m512i v = _mm512_permutexvar_epi16(idx, t0);
      if (group == 16) {
        const __m512i t1 = _mm512_castsi256_si512(reinterpret_cast<__m256i>(
            _mm512_cvtneps_pbh(_mm512_mul_ps(values, _mm512_set1_ps(table[s[k / group + 1]])))));
        v = _mm512_mask_permutexvar_epi16(v, 0xFFFF0000u, idx, t1);
      }
      _mm512_storeu_si512(out + k, v);
    }
  }

  // rows [n0, n0 + nb) of W decoded into `w` ([nb, K] bf16; bf16 weights are read where they are), times each
  // block of x: y's columns n0.. n0 + nb
  void slab(int64_t s, uint16_t* w, float* c) const {
    const int64_t n0 = s * slab_rows, nb = std::min(slab_rows, N - n0);
    const uint16_t* a = w;  // the A operand: the decoded slab, or a bf16 weight's own rows
    if (kind == 2) a = reinterpret_cast<const uint16_t*>(q) + n0 * K;
    else
      for (int64_t j = 0; j < nb; ++j) decode_row(n0 + j, w + j * K);
    for (int64_t r0 = 0; r0 < R; r0 += kRows) {
      const int64_t m = std::min(kRows, R - r0);
      // c [nb, m] = W_slab [nb, K] @ (x rows r0.. r0 + m).T, from xt's block of those rows
      at::native::cpublas::brgemm(nb, m, K, K, m, m, false, reinterpret_cast<const at::BFloat16*>(a),
                                  reinterpret_cast<const at::BFloat16*>(xt + r0 * K), c, true);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < nb; ++j)
          y[(r0 + r) * N + n0 + j] = c[j * m + r] * (out_scale ? out_scale[n0 + j] : 1.0f) * mult;
    }
  }
};

// x [R, K] bf16 as the micro-kernel's B operand, per block of kRows rows: block b ([K / 2][m] pairs, m its
// rows) at xt + b * kRows * K
void transpose_pairs(const uint16_t* x, int64_t R, int64_t K, uint16_t* xt) {
  const uint32_t* in = reinterpret_cast<const uint32_t*>(x);
  uint32_t* out = reinterpret_cast<uint32_t*>(xt);
  for (int64_t r0 = 0; r0 < R; r0 += kRows) {
    const int64_t m = std::min(kRows, R - r0);
    uint32_t* block = out + r0 * K / 2;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t kk = 0; kk < K / 2; ++kk) block[kk * m + r] = in[(r0 + r) * K / 2 + kk];
  }
}

// Every slab of every product in one parallel loop; each thread with its own buffers
void run(std::vector<Product>& jobs, std::vector<at::Tensor>& keep) {
  std::vector<int64_t> first(jobs.size() + 1, 0);
  int64_t K = 0;  // the widest decoded row (bf16 weights decode nothing)
  for (size_t g = 0; g < jobs.size(); ++g) {
    first[g + 1] = first[g] + jobs[g].slabs;
    if (jobs[g].kind != 2) K = std::max(K, jobs[g].K);
    keep.push_back(at::empty({jobs[g].R * jobs[g].K}, at::kBFloat16));
    jobs[g].xt = reinterpret_cast<const uint16_t*>(keep.back().data_ptr());
  }
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      transpose_pairs(jobs[g].x, jobs[g].R, jobs[g].K, const_cast<uint16_t*>(jobs[g].xt));
  });
  at::parallel_for(0, first.back(), 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> w(kSlab * K);
    std::vector<float> c(kSlab * kRows);
    size_t g = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t t = begin; t < end; ++t) {
      while (t >= first[g + 1]) ++g;
      jobs[g].slab(t - first[g], w.data(), c.data());
    }
    at::native::cpublas::brgemm_release();
  });
}

Product product(const at::Tensor& x, const at::Tensor& w, int kind, at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be [R, K] bfloat16");
  const int64_t R = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32, got ", K);
  if (kind == 2) {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 2 && w.size(1) == K,
                "a bf16 weight must be contiguous [N, ", K, "] bfloat16");
  } else {
    TORCH_CHECK(w.element_size() == 1 && w.is_contiguous() && w.numel() == N * (kind == 0 ? K : K / 2),
                "packed data must be contiguous bytes [N, ", kind == 0 ? K : K / 2, "]");
  }
  y = at::empty({R, N}, x.options().dtype(at::kFloat));
  Product p{};
  p.x = reinterpret_cast<const uint16_t*>(x.data_ptr()), p.y = y.data_ptr<float>();
  p.R = R, p.K = K, p.N = N, p.slab_rows = kind == 2 && R <= kFewRows ? kSlabBf16Few : kSlab, p.kind = kind;
  p.slabs = (N + p.slab_rows - 1) / p.slab_rows;
  p.q = static_cast<const uint8_t*>(w.data_ptr()), p.mult = 1.0f;
  return p;
}

// [x_g @ W_g.T] for FP8 weights q_g [N, K] with a per-tensor (one value) or per-channel ([N]) fp32 scale
std::vector<at::Tensor> fp8_linear_group(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& qs,
                                         const std::vector<at::Tensor>& scales) {
  TORCH_CHECK(xs.size() == qs.size() && qs.size() == scales.size(), "as many inputs as weights and scales");
  std::vector<at::Tensor> ys(xs.size());
  std::vector<Product> jobs;
  for (size_t g = 0; g < xs.size(); ++g) {
    Product p = product(xs[g], qs[g], 0, ys[g]);
    const at::Tensor& s = scales[g];
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && (s.numel() == 1 || s.numel() == p.N),
                "an FP8 scale must be one float32 value or one per output row");
    if (s.numel() == 1) p.mult = *s.data_ptr<float>();
    else p.out_scale = s.data_ptr<float>();
    jobs.push_back(p);
  }
  std::vector<at::Tensor> keep;
  run(jobs, keep);
  return ys;
}

// [x_g @ W_g.T] for NVFP4 (E4M3 scales per 16, `mults` one per product) or MXFP4 (E8M0 scales per 32) weights.
// An MXFP4 weight with a scale byte 0, 1 or 255 is not computed: its output is an undefined tensor.
std::vector<at::Tensor> fp4_linear_group(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& codes,
                                         const std::vector<at::Tensor>& scales, int64_t group, bool e8m0,
                                         const std::vector<double>& mults) {
  TORCH_CHECK(xs.size() == codes.size() && codes.size() == scales.size() &&
              (mults.empty() || mults.size() == xs.size()), "as many inputs as weights, scales and multipliers");
  TORCH_CHECK(group == (e8m0 ? 32 : 16), "NVFP4 blocks are 16 elements, MXFP4 blocks 32");
  std::vector<at::Tensor> ys(xs.size());
  std::vector<Product> jobs;
  for (size_t g = 0; g < xs.size(); ++g) {
    const at::Tensor& s = scales[g];
    const int64_t K = xs[g].size(-1), N = codes[g].size(0);
    TORCH_CHECK(s.element_size() == 1 && s.is_contiguous() && s.numel() == N * (K / group),
                "scales must be contiguous bytes [N, K / group]");
    const uint8_t* sb = static_cast<const uint8_t*>(s.data_ptr());
    if (e8m0 && std::any_of(sb, sb + s.numel(), [](uint8_t b) { return b < 2 || b == 255; })) continue;
    Product p = product(xs[g], codes[g], 1, ys[g]);
    p.scales = sb, p.group = group, p.e8m0 = e8m0, p.mult = mults.empty() ? 1.0f : static_cast<float>(mults[g]);
    jobs.push_back(p);
  }
  std::vector<at::Tensor> keep;
  run(jobs, keep);
  return ys;
}

// [x_g @ W_g.T] for bf16 weights W_g [N, K] (the A operand as they are: nothing decoded or copied)
std::vector<at::Tensor> bf16_linear_group(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& ws) {
  TORCH_CHECK(xs.size() == ws.size(), "as many inputs as weights");
  std::vector<at::Tensor> ys(xs.size());
  std::vector<Product> jobs;
  for (size_t g = 0; g < xs.size(); ++g) jobs.push_back(product(xs[g], ws[g], 2, ys[g]));
  std::vector<at::Tensor> keep;
  run(jobs, keep);
  return ys;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether oneDNN's AMX bf16 micro-kernels run on this CPU");
  m.def("fp8_linear_group", &fp8_linear_group, "[x_g bf16 @ FP8 W_g.T -> fp32] (per-tensor or per-channel scales)");
  m.def("fp4_linear_group", &fp4_linear_group, "[x_g bf16 @ NVFP4 / MXFP4 W_g.T -> fp32]");
  m.def("bf16_linear_group", &bf16_linear_group, "[x_g bf16 @ bf16 W_g.T -> fp32]");
}
