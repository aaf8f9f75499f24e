// Decode attention on the CPU: one query per sequence over all of its keys, read where they lie (hybrid/layers/
// attention.py `decode_attention` is the specification). For sequence s and KV head h, with the G = nq / nkv
// query heads of h:
//   scores[g, t] = (q[s, h G + g] . k_t) * scale        over the sequence's key rows t = 0 .. L_s - 1
//   out[s, h G + g] = sum_t softmax_t(scores[g]) v_t     (fp32 throughout; bf16 keys and values widened;
//                                                         exp by a polynomial, within fp32's rounding)
// Two ways to name the rows:
//   decode_attention(q [S, nq, hd], k / v [S, nkv, L, hd] any strides, last dimension contiguous)
//   paged_decode_attention(q [S, nq, hd], k / v pools [R, nkv, hd] contiguous, rows: S int64 tensors of
//                          pool rows, L_s each)  -- a paged KV cache's blocks, never gathered into a copy
// Both run the same loop (one parallel loop over the S x nkv heads, and with AVX-512 over blocks of 16 of a KV
// head's query heads, the lanes of a vector), so a sequence gets the same bits either way; a CPU without
// AVX-512 runs plain loops (-mno-avx512f builds them on any CPU, and the tests compare them too). Returns
// out [S, nq, hd] fp32. Built on first use by hybrid/ops/cpu.py; the PyTorch path stays the reference.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
// pybind11 with torch's casters: not all of torch/extension.h (a shorter compile: docs/perf-log.md#extension-headers)
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t LANES = 16;  // partial sums / maxima per lane, so the compiler vectorises the reductions
constexpr int64_t TILE = 64;   // keys per tile: widened and laid out dimension-major, so the dot products of
                               // a query with a tile's keys vectorise over the keys (no horizontal sums)

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (scores minus their maximum), branch-free so that the loops calling it vectorise:
// x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor polynomial to r^7 (relative error < 2e-8, below fp32's
// rounding), times 2^n built in the exponent bits. Below -87 (2^-126) the result is flushed to 0.
inline float exp_nonpositive(float x) {
  const float clamped = x > -87.0f ? x : -87.0f;  // (ternaries and nearbyint: forms GCC vectorises)
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = (clamped - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
#if defined(__has_builtin) && __has_builtin(__builtin_bit_cast)
  const float scale = __builtin_bit_cast(float, bits);  // (GCC 11+, clang: vectorises; memcpy does not)
#else
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
#endif
  return x < -87.0f ? 0.f : p * scale;
}

#if defined(__AVX512F__)
// exp(x) for x <= 0 on 16 lanes: exp_nonpositive's steps (above), lane by lane
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 clamped = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), e);
}

// The key or value rows t0 .. t0 + n - 1 as fp32 rows of hd: fp32 data where it lies, bf16 widened into buf.
// The rows kAhead further (of L) are asked for meanwhile: a row is a few cache lines, often of a paged
// pool's scattered blocks, and a core waiting on each in turn reads far below the memory's bandwidth
// (docs/perf-log.md#decode-attention-prefetch).
constexpr int64_t kAhead = 64;
template <typename T, typename Row>
inline void fp32_rows(const T* data, Row row, int64_t t0, int64_t n, int64_t L, int64_t hd, float* buf,
                      const float** out) {
  for (int64_t j = 0; j < n && t0 + j + kAhead < L; ++j) {
    const char* ahead = reinterpret_cast<const char*>(data + row(t0 + j + kAhead));
    for (int64_t b = 0; b < hd * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* src = data + row(t0 + j);
    if (std::is_same_v<T, float> && hd % 16 == 0) {  // (a partial 16-dimension block would read past the row)
      out[j] = reinterpret_cast<const float*>(src);
    } else {
      float* dst = buf + j * hd;
      int64_t d = 0;
      for (; std::is_same_v<T, at::BFloat16> && d + 16 <= hd; d += 16) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
        _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
      }
      for (; d < hd; ++d) dst[d] = static_cast<float>(src[d]);
      out[j] = dst;
    }
  }
}

// One (sequence, KV head, up to 16 of its query heads): the query heads are the 16 lanes of every vector,
// so nothing is summed across lanes. Scores: for each key, sum_d broadcast(k_t[d]) * qT[d] (qT[d]: lane g
// holds q[g, d] * scale), 8 keys at a time (8 independent sums); softmax lane by lane over the keys; then
// out^T[d] += broadcast(v_t[d]) * p_t, 16 dimensions at a time held in registers over a block of keys.
// Faster than the plain loops below at the `medium` preset's heads serving 16 users and at Nano's heads up to
// 32K keys (docs/perf-log.md#decode-attention-lanes).
template <typename T, typename Row>
void attend(const float* q, int64_t G, int64_t hd, const T* k, const T* v, int64_t L, Row row, float scale,
            float* out) {
  constexpr int64_t KB = 8, VB = 32;  // keys per block: the scores' sums, the values' rows
  thread_local std::vector<float> qt, scores, buf, acc;
  qt.assign(hd * 16, 0.f);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < hd; ++d) qt[d * 16 + g] = q[g * hd + d] * scale;
  scores.resize(L * 16);
  buf.resize(VB * hd + 16);  // + 16: the last row's final 16-dimension block may read past hd
  const float* rows[VB];
  for (int64_t t0 = 0; t0 < L; t0 += KB) {
    const int64_t n = std::min(KB, L - t0);
    fp32_rows(k, row, t0, n, L, hd, buf.data(), rows);
    for (int64_t j = n; j < KB; ++j) rows[j] = rows[0];  // past L: a repeat, never stored
    __m512 s[KB];
    for (int64_t j = 0; j < KB; ++j) s[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; ++d) {
      const __m512 qd = _mm512_loadu_ps(qt.data() + d * 16);
      for (int64_t j = 0; j < KB; ++j) s[j] = _mm512_fmadd_ps(_mm512_set1_ps(rows[j][d]), qd, s[j]);
    }
    for (int64_t j = 0; j < n; ++j) _mm512_storeu_ps(scores.data() + (t0 + j) * 16, s[j]);
  }
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < L; ++t) m = _mm512_max_ps(m, _mm512_loadu_ps(scores.data() + t * 16));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores.data() + t * 16), m));
    _mm512_storeu_ps(scores.data() + t * 16, e);
    sum = _mm512_add_ps(sum, e);
  }
  const int64_t dblocks = (hd + 15) / 16;
  acc.assign(dblocks * 16 * 16, 0.f);  // acc[d * 16 + g]: out^T, padded to whole 16-dimension blocks
  for (int64_t t0 = 0; t0 < L; t0 += VB) {
    const int64_t n = std::min(VB, L - t0);
    fp32_rows(v, row, t0, n, L, hd, buf.data(), rows);
    for (int64_t b = 0; b < dblocks; ++b) {
      const int64_t d0 = b * 16;
      __m512 a[16];
      for (int64_t i = 0; i < 16; ++i) a[i] = _mm512_loadu_ps(acc.data() + (d0 + i) * 16);
      for (int64_t t = 0; t < n; ++t) {
        const __m512 p = _mm512_loadu_ps(scores.data() + (t0 + t) * 16);
        const float* vr = rows[t] + d0;
        for (int64_t i = 0; i < 16; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(vr[i]), p, a[i]);
      }
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(acc.data() + (d0 + i) * 16, a[i]);
    }
  }
  alignas(64) float inv[16];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < hd; ++d) out[g * hd + d] = acc[d * 16 + g] * inv[g];
}
#else
// One (sequence, KV head, G of its query heads): G query rows q [G, hd] fp32 over L key / value rows given by
// row(t) -> offset;
// out [G, hd] fp32 (contiguous).
template <typename T, typename Row>
void attend(const float* q, int64_t G, int64_t hd, const T* k, const T* v, int64_t L, Row row, float scale,
            float* out) {
  std::vector<float> scores(G * L);
  std::vector<float> tile(hd * TILE);  // tile[d * TILE + t]: dimension d of the tile's key t
  std::vector<float> vf(hd);
  for (int64_t t0 = 0; t0 < L; t0 += TILE) {
    const int64_t n = std::min(TILE, L - t0);
    for (int64_t t = 0; t < n; ++t) {
      const T* kr = k + row(t0 + t);
      for (int64_t d = 0; d < hd; ++d) tile[d * TILE + t] = widen(kr[d]);
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * hd;
      float acc[TILE] = {0.f};  // past n: stale keys of the last tile, never read
      for (int64_t d = 0; d < hd; ++d) {
        const float qd = qg[d];
        const float* kd = tile.data() + d * TILE;
        for (int64_t t = 0; t < TILE; ++t) acc[t] += qd * kd[t];
      }
      float* sg = scores.data() + g * L + t0;
      for (int64_t t = 0; t < n; ++t) sg[t] = acc[t] * scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * L;
    float part[LANES];
    for (int64_t j = 0; j < LANES; ++j) part[j] = -std::numeric_limits<float>::infinity();
    int64_t t = 0;
    for (; t + LANES <= L; t += LANES)
      for (int64_t j = 0; j < LANES; ++j) part[j] = sg[t + j] > part[j] ? sg[t + j] : part[j];
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < LANES; ++j) m = std::max(m, part[j]);
    for (; t < L; ++t) m = std::max(m, sg[t]);
    for (t = 0; t < L; ++t) sg[t] = exp_nonpositive(sg[t] - m);
    for (int64_t j = 0; j < LANES; ++j) part[j] = 0.f;
    for (t = 0; t + LANES <= L; t += LANES)
      for (int64_t j = 0; j < LANES; ++j) part[j] += sg[t + j];
    float sum = 0.f;
    for (int64_t j = 0; j < LANES; ++j) sum += part[j];
    for (; t < L; ++t) sum += sg[t];
    const float inv = 1.f / sum;
    for (t = 0; t < L; ++t) sg[t] *= inv;
    float* og = out + g * hd;
    for (int64_t d = 0; d < hd; ++d) og[d] = 0.f;
  }
  for (int64_t t = 0; t < L; ++t) {
    const T* vr = v + row(t);
    for (int64_t d = 0; d < hd; ++d) vf[d] = widen(vr[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + t];
      float* og = out + g * hd;
      for (int64_t d = 0; d < hd; ++d) og[d] += p * vf[d];
    }
  }
}

#endif

// Every (sequence s, KV head h) of q [S, nq, hd] in one parallel loop over keys and values k / v (fp32 or
// bf16 data, flat): sequence s has length(s) rows, row t of head h at element offset(s, h, t).
template <typename Length, typename Offset>
at::Tensor attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t nkv,
                      double scale, Length length, Offset offset) {
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const int64_t S = q.size(0), nq = q.size(1), hd = q.size(2), G = nq / nkv;
#if defined(__AVX512F__)
  const int64_t width = 16;  // query heads per task: the lanes of a vector
#else
  const int64_t width = G;
#endif
  const int64_t chunks = (G + width - 1) / width;
  auto out = at::empty({S, nq, hd}, q.options().dtype(at::kFloat));
  auto run = [&](auto* kp, auto* vp) {
    at::parallel_for(0, S * nkv * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t s = i / (nkv * chunks), h = i / chunks % nkv, g0 = i % chunks * width;
        const int64_t first = s * nq + h * G + g0;  // the task's first query head
        attend(qf.data_ptr<float>() + first * hd, std::min(width, G - g0), hd, kp, vp, length(s),
               [&](int64_t t) { return offset(s, h, t); }, static_cast<float>(scale),
               out.data_ptr<float>() + first * hd);
      }
    });
  };
  if (k.scalar_type() == at::kFloat) run(k.data_ptr<float>(), v.data_ptr<float>());
  else {
    TORCH_CHECK(k.scalar_type() == at::kBFloat16, "fp32 or bf16 keys and values");
    run(k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>());
  }
  return out;
}

at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [S, nq, hd]");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.scalar_type() == v.scalar_type(), "k, v [S, nkv, L, hd]");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.strides() == v.strides(), "k, v: the same strides, hd contiguous");
  const int64_t nkv = k.size(1), L = k.size(2), ss = k.stride(0), sh = k.stride(1), st = k.stride(2);
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(2) && q.size(1) % nkv == 0, "q and k disagree");
  return attend_all(q, k, v, nkv, scale, [&](int64_t) { return L; },
                    [&](int64_t s, int64_t h, int64_t t) { return s * ss + h * sh + t * st; });
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                                  std::vector<at::Tensor> rows, double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [S, nq, hd]");
  TORCH_CHECK(k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes() && k_pool.is_contiguous() && v_pool.is_contiguous()
              && k_pool.scalar_type() == v_pool.scalar_type(), "k, v pools [R, nkv, hd], contiguous");
  const int64_t S = q.size(0), hd = q.size(2), nkv = k_pool.size(1), R = k_pool.size(0);
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == S && k_pool.size(2) == hd && q.size(1) % nkv == 0,
              "q and the pools disagree");
  std::vector<at::Tensor> idx(S);
  std::vector<const int64_t*> row(S);
  for (int64_t s = 0; s < S; ++s) {
    idx[s] = rows[s].to(at::kLong).contiguous();
    TORCH_CHECK(idx[s].dim() == 1 && idx[s].numel() > 0, "each sequence has at least one row");
    const int64_t lo = idx[s].min().item<int64_t>(), hi = idx[s].max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < R, "a row outside the pool");
    row[s] = idx[s].data_ptr<int64_t>();
  }
  return attend_all(q, k_pool, v_pool, nkv, scale, [&](int64_t s) { return idx[s].numel(); },
                    [&](int64_t s, int64_t h, int64_t t) { return (row[s][t] * nkv + h) * hd; });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "q [S, nq, hd] over k / v [S, nkv, L, hd] -> [S, nq, hd] fp32");
  m.def("paged_decode_attention", &paged_decode_attention,
        "q [S, nq, hd] over the pool rows of each sequence -> [S, nq, hd] fp32");
}
