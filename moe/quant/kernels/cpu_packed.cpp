// Matrix products with packed low-bit weights on the CPU: y[r, n] = sum_k x[r, k] * W[n, k], each weight
// element decoded from its packed bytes in registers and never stored dense. Streaming the weight once per
// call, it serves decode (1 to 16 rows) and prefill chunks alike. Built on first use by
// moe/quant/kernels/cpu.py (torch.utils.cpp_extension), -O3 -march=native: four paths, chosen at compile
// time by the CPU's features (`path()` names the one compiled), all equal to the dequantized product up to
// the order of the fp32 sums:
//   - "avx512-bf16": bf16 inputs with AVX512_BF16 + AVX512_VBMI (a bf16 model): weights decoded to bf16 by
//     byte and word table lookups, exact bf16 dot products (`vdpbf16ps`) into fp32 sums; fp32 inputs as below;
//   - "avx512f": AVX-512 (fp32 inputs; bf16 inputs converted to fp32): weights decoded to fp32 (E4M3 through
//     fp16, 32 at a time; E2M1 by a 16-entry `vpermps` on the code bytes shifted in place), fp32 FMAs;
//     bf16 weights widened to fp32 by a shift, 16 at a time (on such CPUs oneDNN's bf16 products, emulated,
//     read a weight at a fifth of this speed);
//   - "avx2-fma": AVX2 + FMA + F16C, no AVX-512 (most desktop and laptop CPUs; fp32 inputs): E4M3 decoded
//     through fp16 (`vcvtph2ps`), E2M1 too (its fp16 high byte from a `pshufb` table), 8-wide fp32 FMAs; bf16
//     weights (the plain form of moe/quant/kernels/bf16.py) widened to fp32 by a shift, bf16 inputs widened once;
//   - "scalar": plain loops elsewhere (table lookups; what the compiler makes of them).
//
// Formats (the layouts of moe/quant/fp8.py, nvfp4.py, mxfp4.py):
//   FP8    q uint8 [N, K] (E4M3 bits), scale fp32: per tensor [1], per channel [N], or per block
//          [ceil(N/B), ceil(K/B)]: W[n, k] = e4m3(q[n, k]) * scale
//   NVFP4  codes uint8 [N, K/2] (element 2j in the low nibble), scales uint8 [N, K/16] (E4M3 bits),
//          W[n, k] = e2m1(code) * e4m3(scale[n, k/16]) * mult          (mult: ModelOpt's weight_scale_2,
//                                                                       or 1 / compressed-tensors' global)
//   MXFP4  codes as NVFP4, scales uint8 [N, K/32] (E8M0): W[n, k] = e2m1(code) * 2^(scale[n, k/32] - 127)
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
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define HYBRID_BF16_DOT 1
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HYBRID_AVX2 1
#endif
#if defined(__AVX512F__) && !defined(HYBRID_BF16_DOT)
#define HYBRID_BF16_WIDEN512 1  // bf16 weights widened to fp32 in registers (AVX-512 without AVX512_BF16)
#endif

namespace {

bool bf16_inputs() {
#if defined(HYBRID_BF16_DOT)
  return true;
#else
  return false;
#endif
}

bool bf16_weights() {  // whether bf16_linear (bf16 weights, no decoding) was compiled
#if defined(HYBRID_BF16_DOT) || defined(HYBRID_AVX2) || defined(HYBRID_BF16_WIDEN512)
  return true;
#else
  return false;
#endif
}

bool avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

const char* path() {  // which of the four paths was compiled (the header above)
#if defined(HYBRID_BF16_DOT)
  return "avx512-bf16";
#elif defined(__AVX512F__)
  return "avx512f";
#elif defined(HYBRID_AVX2)
  return "avx2-fma";
#else
  return "scalar";
#endif
}

constexpr float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float e4m3(uint8_t b) {  // OFP8 E4M3: bias 7, no infinities, S.1111.111 is NaN
  const int e = (b >> 3) & 15, m = b & 7;
  float v = (e == 15 && m == 7) ? NAN : e == 0 ? std::ldexp(static_cast<float>(m), -9)
                                                 : std::ldexp(1.0f + m / 8.0f, e - 7);
  return (b & 0x80) ? -v : v;
}

float e8m0(uint8_t b) { return b == 255 ? NAN : std::ldexp(1.0f, static_cast<int>(b) - 127); }

struct Tables {
  float e4m3[256], e8m0[256];
  Tables() {
    for (int b = 0; b < 256; ++b) {
      e4m3[b] = ::e4m3(static_cast<uint8_t>(b));
      e8m0[b] = ::e8m0(static_cast<uint8_t>(b));
    }
  }
};
const Tables kTables;

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat ||
              (x.scalar_type() == at::kBFloat16 && bf16_inputs())), "x must be [R, K] float32 (or bfloat16 "
              "where AVX512_BF16 and AVX512_VBMI were compiled)");
}

void check(const at::Tensor& x, const at::Tensor& w, int64_t k_per_row) {
  check_x(x);
  TORCH_CHECK(w.dim() >= 2 && w.element_size() == 1 && w.is_contiguous(),
              "packed data must be contiguous bytes [N, ...] (uint8, or a 1-byte float type)");
  TORCH_CHECK(w.numel() == w.size(0) * k_per_row, "packed data has ", w.numel() / std::max<int64_t>(w.size(0), 1),
              " bytes per row, expected ", k_per_row);
}

// The bytes of a packed tensor of any 1-byte dtype (uint8 codes, float8 E4M3 / E8M0 scales), as `check` took it
inline const uint8_t* bytes_of(const at::Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }

// out[r, c + p] = x[r, c + element(p)] for each chunk start c, zero past K: x [R, K] (T = float or bf16 bits)
// laid out as a kernel reads it
template <typename T, typename Element>
at::Tensor reorder(const at::Tensor& x, int64_t chunk, Element element) {
  const int64_t R = x.size(0), K = x.size(1), Kp = (K + chunk - 1) / chunk * chunk;
  auto out = at::empty({R, Kp}, x.options());
  const T* in = static_cast<const T*>(x.data_ptr());
  T* o = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {  // forks only past 16 rows (a prompt)
    for (int64_t r = begin; r < end; ++r)
      for (int64_t c = 0; c < Kp; c += chunk)
        for (int64_t p = 0; p < chunk; ++p) {
          const int64_t e = c + element(p);
          o[r * Kp + c + p] = e < K ? in[r * K + e] : T{};
        }
  });
  return out;
}

// prepare(x) (which checks x) for each input of a group, once per distinct tensor: the k experts a decoded
// token chose share one x (one layout, one conversion, not k)
template <typename Prepare>
std::vector<at::Tensor> once_per_input(const std::vector<at::Tensor>& xs, Prepare prepare) {
  std::vector<at::Tensor> out;
  for (size_t g = 0; g < xs.size(); ++g) {
    size_t same = 0;
    while (same < g && !xs[same].is_same(xs[g])) ++same;
    out.push_back(same < g ? out[same] : prepare(xs[g]));
  }
  return out;
}

#if defined(__AVX512F__) || defined(HYBRID_AVX2)
// E4M3 bytes -> the fp16 bits of e4m3(b) * 2^-8, exactly, except NaN: the byte sign-extended to 16 bits and
// shifted left by 7 is S.S.EEEE.MMM.0000000; clearing bit 14 (a copy of the sign) leaves the fp16
// S.0EEEE.MMM0000000, whose value is the E4M3 value times 2^(7 - 15) (fp16 has subnormals too, so the E4M3
// subnormals map onto them; `vcvtph2ps` converts fp16 exactly, denormals included, whatever MXCSR's DAZ / FTZ
// say). The NaN codes S.1111.111 come out as +-1.875 here: callers detect them on the bytes. No fp32
// subnormal is ever formed: an Intel core takes a microcode assist (~100 cycles) on each multiply with one.
inline __m256i e4m3_fp16(__m128i bytes) {  // 16 bytes
  return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                          _mm256_set1_epi16(static_cast<short>(0xBFFF)));
}
#endif

#if defined(__AVX512F__)
inline __m512i e4m3_fp16(__m256i bytes) {  // 32 bytes
  return _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(bytes), 7),
                          _mm512_set1_epi16(static_cast<short>(0xBFFF)));
}

// 32 E4M3 bytes -> 32 fp32 equal to e4m3(b) * 2^-8 (e4m3_fp16, widened).
// The former decoder (the bits shifted into fp32's fields, then times 2^120, 13 instructions per 16) formed
// fp32 subnormals and was slower, on subnormal-rich bytes by far (docs/perf-log.md#e4m3-fp16-decode).
// NaN codes: callers check the bytes.
inline void decode_e4m3_scaled(__m256i bytes, __m512& lo, __m512& hi) {
  const __m512i h = e4m3_fp16(bytes);
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

inline __m512 decode_e8m0(__m128i bytes) {  // 16 E8M0 bytes -> 16 fp32: the exponent field; 0 is 2^-127, 255 NaN
  const __m512i v = _mm512_cvtepu8_epi32(bytes);
  __m512i f = _mm512_slli_epi32(v, 23);
  f = _mm512_mask_mov_epi32(f, _mm512_cmpeq_epi32_mask(v, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
  f = _mm512_mask_mov_epi32(f, _mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(f);
}
#endif

// The products run on tiles of NT weight rows x up to kTileR input rows, so each decoded weight vector
// meets every input row and each input vector every weight row while they are in registers (or L1), and the
// NT x RT accumulators are independent (no single dependency chain). A tile past the last weight
// row repeats that row; its results are dropped.
// NT is 8 for a single input row (eight weight streams keep DRAM busier: docs/perf-log.md#decode-tile-rows)
// and 4 for more (8 x 4 accumulators would not fit the 32 vector registers).
constexpr int kTileN = 8, kTileR = 4;  // the largest tile
inline int tile_rows(int64_t R) { return R == 1 ? 8 : 4; }

// f(NT, RT) with the tile shape as compile-time constants (std::integral_constant): 8 x 1, or 4 x 1..4
template <typename F>
void with_tile(int nt, int rt, F&& f) {
  using std::integral_constant;
  if (nt == 8) return f(integral_constant<int, 8>{}, integral_constant<int, 1>{});
  switch (rt) {
    case 1: return f(integral_constant<int, 4>{}, integral_constant<int, 1>{});
    case 2: return f(integral_constant<int, 4>{}, integral_constant<int, 2>{});
    case 3: return f(integral_constant<int, 4>{}, integral_constant<int, 3>{});
    default: return f(integral_constant<int, 4>{}, integral_constant<int, 4>{});
  }
}
#define TILE_ARGS decltype(NT)::value, decltype(RT)::value

// jobs[g].tile(t) for every tile t < jobs[g].tiles of every job, in one parallel loop over all of them (a
// group of products, e.g. the k experts a decoded token chose: one fork of the threads instead of k, the
// threads balanced over the whole group); returns the jobs' outputs `y`
template <typename Job>
std::vector<at::Tensor> parallel_tiles(const std::vector<Job>& jobs) {
  std::vector<int64_t> first(jobs.size() + 1, 0);
  for (size_t g = 0; g < jobs.size(); ++g) first[g + 1] = first[g] + jobs[g].tiles;
  at::parallel_for(0, first.back(), 4, [&](int64_t begin, int64_t end) {
    size_t g = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t t = begin; t < end; ++t) {
      while (t >= first[g + 1]) ++g;
      jobs[g].tile(t - first[g]);
    }
  });
  std::vector<at::Tensor> ys;  // each job's output
  for (const auto& job : jobs) ys.push_back(job.y);
  return ys;
}

// A tile reads its NT weight rows as as many short streams, and the hardware prefetchers lose the pace
// at each jump to the next tile; asking for the same bytes of the next tile's rows (the rows are
// contiguous: `tile_bytes` further) one tile ahead, into L2, keeps DRAM busy: the FP8 decode then reads close
// to the machine's bandwidth (docs/perf-log.md#fp8-prefetch).
inline void prefetch_next_tile(const uint8_t* p, int64_t tile_bytes) {
#if defined(__AVX512F__) || defined(HYBRID_AVX2)
  _mm_prefetch(reinterpret_cast<const char*>(p + tile_bytes), _MM_HINT_T1);
#endif
}

// part[j][r] = NaN for each of the nt weight rows w[j] with an E4M3 NaN code (S.1111.111) among its first len
// bytes (NaN times anything, 0 included, is NaN, as in the reference); for the vector paths, which find that
// some row has one from the bytes they read
inline void mark_nan_rows(const uint8_t* const* w, int nt, int rt, int64_t len, float (*part)[kTileR]) {
  for (int j = 0; j < nt; ++j)
    for (int64_t i = 0; i < len; ++i)
      if ((w[j][i] & 0x7F) == 0x7F) {
        for (int r = 0; r < rt; ++r) part[j][r] = NAN;
        break;
      }
}

struct Fp4Rows {
  const uint8_t* codes[kTileN];
  const uint8_t* scales[kTileN];
};

// ---------------------------------------------------------------------------------------------- bf16 inputs
// The weights are decoded to bf16 exactly (an E4M3 value and an E2M1 code both fit bf16's 8-bit significand)
// and `vdpbf16ps` multiplies pairs of bf16 exactly and adds them into fp32 lanes; scales multiply those fp32
// sums. A decoder emits a chunk's elements in a fixed order, so x is first put in the same order chunk by
// chunk (`reorder`, zero padded to whole chunks); a masked load past a weight row's end reads bytes 0, which
// decode to +0.
#if defined(HYBRID_BF16_DOT)
constexpr int64_t kFp8Chunk = 64, kFp4Chunk = 128;  // elements per chunk (64 packed bytes)

struct Bf16Tables {
  alignas(64) uint8_t e4m3_hi[128], e4m3_lo[128];  // the bf16 bits of e4m3(m) for magnitudes m (127: NaN)
  alignas(64) uint16_t e2m1[32];                    // the bf16 bits of e2m1(i & 15)
  static uint16_t bits(float f) {  // exact for these values: at most 3 mantissa bits
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>(u >> 16);
  }
  Bf16Tables() {
    for (int m = 0; m < 128; ++m) {
      const uint16_t b = m == 127 ? 0x7FC0 : bits(e4m3(static_cast<uint8_t>(m)));
      e4m3_hi[m] = static_cast<uint8_t>(b >> 8);
      e4m3_lo[m] = static_cast<uint8_t>(b & 0xFF);
    }
    for (int i = 0; i < 32; ++i) e2m1[i] = bits(kE2M1[i & 15]);
  }
};
const Bf16Tables kBf16;

// FP8: 64 E4M3 bytes -> two vectors of 32 bf16. The high byte of each bf16 comes from a 128-entry table on
// the byte's magnitude (its low 7 bits) with the byte's sign bit or-ed in, the low byte from another; the
// byte interleave then puts element 16L + t in word 8L + t of `a` and element 16L + 8 + t in word 8L + t of
// `b` (L: the 128-bit lane, t < 8).
inline int64_t fp8_element(int64_t p) { return 16 * ((p % 32) / 8) + 8 * (p / 32) + p % 8; }

struct E4m3ToBf16 {
  __m512i hi0 = _mm512_load_si512(kBf16.e4m3_hi), hi1 = _mm512_load_si512(kBf16.e4m3_hi + 64);
  __m512i lo0 = _mm512_load_si512(kBf16.e4m3_lo), lo1 = _mm512_load_si512(kBf16.e4m3_lo + 64);
  void operator()(__m512i bytes, __m512i& a, __m512i& b) const {
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, bytes, hi1), bytes,
                                                 _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // t | (b & s)
    const __m512i lo = _mm512_permutex2var_epi8(lo0, bytes, lo1);
    a = _mm512_unpacklo_epi8(lo, hi);
    b = _mm512_unpackhi_epi8(lo, hi);
  }
};

// part[j][r] = sum_{i < len} x[r, i] * e4m3(w[j][i]), x in FP8 chunk order (row strides: ldw bytes, ldx)
template <int NT, int RT>
void fp8_tile_dot(const uint8_t* const* w, int64_t ldw, const uint16_t* x, int64_t ldx, int64_t len,
                  float part[kTileN][kTileR]) {
  const E4m3ToBf16 decode;
  __m512 acc[NT][RT];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; i += kFp8Chunk) {
    const int64_t n = std::min<int64_t>(kFp8Chunk, len - i);
    const __mmask64 m = n == 64 ? ~0ull : (1ull << n) - 1;
    for (int j = 0; j < NT; ++j) {
      prefetch_next_tile(w[j] + i, NT * ldw);
      __m512i a, b;
      decode(_mm512_maskz_loadu_epi8(m, w[j] + i), a, b);
      for (int r = 0; r < RT; ++r) {
        const uint16_t* xr = x + r * ldx + i;
        acc[j][r] = _mm512_dpbf16_ps(acc[j][r], (__m512bh)_mm512_loadu_si512(xr), (__m512bh)a);
        acc[j][r] = _mm512_dpbf16_ps(acc[j][r], (__m512bh)_mm512_loadu_si512(xr + 32), (__m512bh)b);
      }
    }
  }
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) part[j][r] = _mm512_reduce_add_ps(acc[j][r]);
}

// E4M3 scale bytes -> fp32 lanes by the same byte tables: the bf16 words of a chunk's (up to 8) scales, then
// lane j (the high word of 32-bit lane j, the low one zero) takes scale j * 8 / group, the block lane j of an
// FP4 dot product covers (below). 6 instructions where an arithmetic E4M3 decoder + a byte shuffle took 15:
// the NVFP4 decode of one Nano expert matrix was bound by instructions, not by its bytes.
struct E4m3Spread {
  E4m3ToBf16 to_bf16;
  __m512i idx;
  explicit E4m3Spread(int64_t group) {
    alignas(64) uint16_t words[32] = {};
    for (int j = 0; j < 16; ++j) words[2 * j + 1] = static_cast<uint16_t>(j * 8 / group);
    idx = _mm512_load_si512(words);
  }
  __m512 operator()(__m128i bytes) const {
    __m512i a, b;
    to_bf16(_mm512_castsi128_si512(bytes), a, b);  // word t of a: scale t (t < 8)
    return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAA, idx, a));
  }
};

// FP4: 64 code bytes (128 elements) -> four vectors of 32 bf16: word i of vector s is element 4i + s, nibble
// s of the 16-bit word i of the codes (a word table lookup; the table repeats over the index's fifth bit).
// Lane j of a dot product then sums elements 8j + s and 8j + 4 + s: all of scale block j / 2 (NVFP4, 16
// elements) or j / 4 (MXFP4, 32), whose scales `spread` puts in lane j.
inline int64_t fp4_element(int64_t p) { return 4 * (p % 32) + p / 32; }

// part[j][r] = sum over the chunks of x . (e2m1(codes) * scale(block)), x in FP4 chunk order (stride ldx)
template <int NT, int RT>
void fp4_tile_dot(const Fp4Rows& w, const uint16_t* x, int64_t ldx, int64_t K, int64_t group, bool e8m0_scales,
                  float part[kTileN][kTileR]) {
  const int64_t chunks = (K + kFp4Chunk - 1) / kFp4Chunk, G = K / group, per_chunk = kFp4Chunk / group;
  const __m512i lut = _mm512_load_si512(kBf16.e2m1);
  const __m128i spread = group == 16 ? _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)
                                     : _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const E4m3Spread e4m3_spread(group);
  __m512 acc[NT][RT];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t bytes = std::min<int64_t>(64, K / 2 - 64 * c), blocks = std::min(per_chunk, G - per_chunk * c);
    const __mmask64 cm = bytes == 64 ? ~0ull : (1ull << bytes) - 1;
    const __mmask16 sm = static_cast<__mmask16>((1u << blocks) - 1);
    for (int j = 0; j < NT; ++j) {
      prefetch_next_tile(w.codes[j] + 64 * c, NT * K / 2);
      if (c % 8 == 0) prefetch_next_tile(w.scales[j] + per_chunk * c, NT * G);  // 4-8 scale bytes a chunk
      const __m512i v = _mm512_maskz_loadu_epi8(cm, w.codes[j] + 64 * c);
      const __m512i w0 = _mm512_permutexvar_epi16(v, lut);
      const __m512i w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut);
      const __m512i w2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), lut);
      const __m512i w3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), lut);
      const __m128i sb = _mm_maskz_loadu_epi8(sm, w.scales[j] + per_chunk * c);
      const __m512 s = e8m0_scales ? decode_e8m0(_mm_shuffle_epi8(sb, spread)) : e4m3_spread(sb);
      for (int r = 0; r < RT; ++r) {
        const uint16_t* xr = x + r * ldx + kFp4Chunk * c;
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(xr), (__m512bh)w0);
        t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_loadu_si512(xr + 32), (__m512bh)w1);
        t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_loadu_si512(xr + 64), (__m512bh)w2);
        t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_loadu_si512(xr + 96), (__m512bh)w3);
        acc[j][r] = _mm512_fmadd_ps(t, s, acc[j][r]);
      }
    }
  }
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) part[j][r] = _mm512_reduce_add_ps(acc[j][r]);
}
// bf16 weights: no decoding at all; the rows pair up as `vdpbf16ps` wants them, x in natural order
// part[j][r] = sum_{i < len} x[r, i] * w[j][i] (row strides: ldw, ldx elements)
template <int NT, int RT>
void bf16_tile_dot(const uint16_t* const* w, int64_t ldw, const uint16_t* x, int64_t ldx, int64_t len,
                   float part[kTileN][kTileR]) {
  __m512 acc[NT][RT];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; i += 32) {
    const int64_t n = std::min<int64_t>(32, len - i);
    const __mmask32 m = n == 32 ? 0xFFFFFFFFu : (1u << n) - 1;
    for (int j = 0; j < NT; ++j) {
      prefetch_next_tile(reinterpret_cast<const uint8_t*>(w[j] + i), NT * 2 * ldw);
      const __m512i wv = _mm512_maskz_loadu_epi16(m, w[j] + i);
      for (int r = 0; r < RT; ++r)
        acc[j][r] = _mm512_dpbf16_ps(acc[j][r], (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * ldx + i), (__m512bh)wv);
    }
  }
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) part[j][r] = _mm512_reduce_add_ps(acc[j][r]);
}

#endif

// ---------------------------------------------------------------------------------------------- AVX2
// Without AVX-512 there are 16 vector registers: a tile's NT x RT accumulators are cut into blocks of JB
// weight rows with JB x RT <= 8 (8 x 1, 4 x 1..2, 2 x 3..4), each weight row still decoded once per tile and
// x read as memory operands of the FMAs (from L1 / L2).
#if defined(HYBRID_AVX2)
template <int NT, int RT>
constexpr int kAvx2Rows = RT <= 2 ? NT : 2;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 16 E4M3 bytes -> 16 fp32 equal to e4m3(b) * 2^-8 (e4m3_fp16, widened).
inline void decode_e4m3_scaled(__m128i bytes, __m256& lo, __m256& hi) {
  const __m256i h = e4m3_fp16(bytes);
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// part[j][r] = sum_{i < len} x[r * ldx + i] * e4m3(w[j][i]), for JB weight rows (next: the bytes from a row
// to the same row of the next tile). The sums run on e4m3 * 2^-8 and are multiplied by 2^8 at the end (exact:
// a power of two; the fp32 roundings are the same scaled ones, short of sums below 2^-118). A byte S.1111.111
// anywhere in a row makes that row's results NaN (NaN times anything, 0 included, is NaN, as in the
// reference); the last len % 16 elements go through the scalar table.
template <int JB, int RT>
void fp8_rows_avx2(const uint8_t* const* w, int64_t next, const float* x, int64_t ldx, int64_t len,
                   float (*part)[kTileR]) {
  __m256 acc[JB][RT];
  for (int j = 0; j < JB; ++j)
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm256_setzero_ps();
  __m256i seen = _mm256_setzero_si256();  // bytewise max of (b | 0x80): 0xFF once a NaN code was read
  const __m256i sign = _mm256_set1_epi8(static_cast<char>(0x80));
  const auto step = [&](int j, int64_t i) {  // 16 elements of row j from element i
    __m256 lo, hi;
    decode_e4m3_scaled(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[j] + i)), lo, hi);
    for (int r = 0; r < RT; ++r) {
      acc[j][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + i), lo, acc[j][r]);
      acc[j][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + i + 8), hi, acc[j][r]);
    }
  };
  const auto nan_check = [&](const uint8_t* p) {  // 32 bytes
    seen = _mm256_max_epu8(seen, _mm256_or_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), sign));
  };
  const int64_t len64 = len & ~int64_t{63}, len16 = len & ~int64_t{15};
  for (int64_t i = 0; i < len64; i += 64)  // 64 bytes a row: one prefetch, two NaN checks, four steps
    for (int j = 0; j < JB; ++j) {
      prefetch_next_tile(w[j] + i, next);
      nan_check(w[j] + i);
      nan_check(w[j] + i + 32);
      step(j, i), step(j, i + 16), step(j, i + 32), step(j, i + 48);
    }
  for (int64_t i = len64; i < len16; i += 16)
    for (int j = 0; j < JB; ++j) {
      seen = _mm256_max_epu8(seen, _mm256_or_si256(_mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128(
                 reinterpret_cast<const __m128i*>(w[j] + i)), 0), sign));
      step(j, i);
    }
  for (int j = 0; j < JB; ++j)
    for (int r = 0; r < RT; ++r) {
      float s = hsum(acc[j][r]) * 256.0f;
      for (int64_t i = len16; i < len; ++i) s += x[r * ldx + i] * kTables.e4m3[w[j][i]];
      part[j][r] = s;
    }
  if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(seen, _mm256_set1_epi8(-1))))  // rare: find the rows with a NaN code
    mark_nan_rows(w, JB, RT, len16, part);
}

// The bf16 forms (the high halves of the fp32 forms) of the 16 E2M1 values +-0, 0.5, 1, 1.5, 2, 3, 4, 6:
// their high bytes and their low bytes, the 16 twice (one copy per 128-bit lane, as `vpshufb` reads them)
alignas(32) constexpr uint8_t kE2M1Bf16High[32] = {
    0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x80, 0xBF, 0xBF, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0,
    0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x80, 0xBF, 0xBF, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0};
alignas(32) constexpr uint8_t kE2M1Bf16Low[32] = {
    0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0, 0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0,
    0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0, 0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0};

// part[j][r] = sum over the row of x . (e2m1(codes) * scale(block)), for JB weight rows, x in fp4_avx2_layout's
// order. Steps of 16 code bytes (32 elements: two NVFP4 blocks, one MXFP4 one), decoded in 11 integer
// instructions into 4 vectors of 8 exact fp32 weights: the bytes in both 128-bit lanes, shifted right by 4
// in the high lane (its nibbles: the odd elements), masked to nibbles; one `vpshufb` each gives the high and
// the low bytes of their bf16 forms, `vpunpck*bw` pairs them into bf16 words and `vpunpck*wd` beside a zero
// word makes fp32. Vectors 0 and 1 hold elements 0..15 of the step (the first NVFP4 block), 2 and 3 elements
// 16..31. Each block's products are summed unscaled and one FMA applies its scale, as in the AVX-512 path
// (an NVFP4 block: 3 vector ops per row for 16 weights where scaling each decoded vector took 4). Faster than
// the former decoder (`vpshufb` to fp16 high bytes, 4 `vpunpck` and 4 `vcvtph2ps` per 32 weights, each decoded
// vector multiplied by its scale), most at one input row (docs/perf-log.md#fp4-scale-fma-avx2). Tried and no
// faster there (same entry): 4 weight rows at a time instead of 8 for one input row; fp32 made by a shift and
// a mask of the bf16 pairs instead of the two word unpacks.
// A K that is an odd multiple of 16 ends with a step of 8 bytes, decoded the same way (vectors 0 and 1).
template <int JB, int RT, int GROUP>
void fp4_rows_avx2(const uint8_t* const* codes, const uint8_t* const* scales, int64_t next_codes,
                   int64_t next_scales, const float* xs, int64_t ldx, int64_t K, const float* table,
                   float (*part)[kTileR]) {
  const __m256i high = _mm256_load_si256(reinterpret_cast<const __m256i*>(kE2M1Bf16High));
  const __m256i low = _mm256_load_si256(reinterpret_cast<const __m256i*>(kE2M1Bf16Low));
  const __m256i nibble = _mm256_set1_epi8(0x0F), shifts = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  const __m256i zero = _mm256_setzero_si256();
  __m256 acc[JB][RT];
  for (int j = 0; j < JB; ++j)
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm256_setzero_ps();
  const auto decode = [&](__m128i b, __m256 (&w)[4]) {  // 16 code bytes -> 32 fp32 weights
    const __m256i n = _mm256_and_si256(_mm256_srlv_epi32(_mm256_broadcastsi128_si256(b), shifts), nibble);
    const __m256i h = _mm256_shuffle_epi8(high, n), l = _mm256_shuffle_epi8(low, n);
    const __m256i w0 = _mm256_unpacklo_epi8(l, h), w1 = _mm256_unpackhi_epi8(l, h);
    w[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w0));
    w[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w0));
    w[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w1));
    w[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w1));
  };
  // acc[j][r] += scale * (x . w) over the vectors first..last of one block (x: the step's 32 elements)
  const auto block = [&](int j, const float* x, const __m256 (&w)[4], int first, int last, __m256 scale) {
    for (int r = 0; r < RT; ++r) {
      const float* xr = x + r * ldx;
      __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(xr + 8 * first), w[first]);
      for (int v = first + 1; v <= last; ++v) sum = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * v), w[v], sum);
      acc[j][r] = _mm256_fmadd_ps(sum, scale, acc[j][r]);
    }
  };
  for (int64_t c = 0; c < K / 32; ++c) {
    const float* x = xs + c * 32;
    for (int j = 0; j < JB; ++j) {
      if ((c & 3) == 0) {
        prefetch_next_tile(codes[j] + c * 16, next_codes);
        prefetch_next_tile(scales[j] + c * 32 / GROUP, next_scales);
      }
      __m256 w[4];
      decode(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes[j] + c * 16)), w);
      if constexpr (GROUP == 16) {
        block(j, x, w, 0, 1, _mm256_set1_ps(table[scales[j][2 * c]]));
        block(j, x, w, 2, 3, _mm256_set1_ps(table[scales[j][2 * c + 1]]));
      } else {
        block(j, x, w, 0, 3, _mm256_set1_ps(table[scales[j][c]]));
      }
    }
  }
  if (K % 32) {  // 8 code bytes left (NVFP4, K an odd multiple of 16): one block
    const int64_t h = K / 16 - 1;
    for (int j = 0; j < JB; ++j) {
      __m256 w[4];
      decode(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes[j] + h * 8)), w);
      block(j, xs + (h >> 1) * 32, w, 0, 1, _mm256_set1_ps(table[scales[j][h * 16 / GROUP]]));
    }
  }
  for (int j = 0; j < JB; ++j)
    for (int r = 0; r < RT; ++r) part[j][r] = hsum(acc[j][r]);
}

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// part[j][r] = sum_{i < len} x[r * ldx + i] * bf16(w[j][i]), for JB bf16 weight rows and fp32 x: 8 weights at
// a time widened to fp32 by a zero-extension and a 16-bit shift (exact), then fp32 FMAs (the products of two
// bf16 are exact in fp32, as `vdpbf16ps`'s; the sums are fp32). `next`: the bytes to the next tile's rows.
template <int JB, int RT>
void bf16_rows_avx2(const uint16_t* const* w, int64_t next, const float* x, int64_t ldx, int64_t len,
                    float (*part)[kTileR]) {
  __m256 acc[JB][RT];
  for (int j = 0; j < JB; ++j)
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm256_setzero_ps();
  const auto step = [&](int j, int64_t i) {
    const __m256 wv = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[j] + i))), 16));
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + i), wv, acc[j][r]);
  };
  const int64_t len32 = len & ~int64_t{31}, len8 = len & ~int64_t{7};
  for (int64_t i = 0; i < len32; i += 32)  // 64 bytes a row: one prefetch, four steps
    for (int j = 0; j < JB; ++j) {
      prefetch_next_tile(reinterpret_cast<const uint8_t*>(w[j] + i), next);
      step(j, i), step(j, i + 8), step(j, i + 16), step(j, i + 24);
    }
  for (int64_t i = len32; i < len8; i += 8)
    for (int j = 0; j < JB; ++j) step(j, i);
  for (int j = 0; j < JB; ++j)
    for (int r = 0; r < RT; ++r) {
      float s = hsum(acc[j][r]);
      for (int64_t i = len8; i < len; ++i) s += x[r * ldx + i] * bf16_to_float(w[j][i]);
      part[j][r] = s;
    }
}

template <int NT, int RT>
void bf16_tile_avx2(const uint16_t* const* w, int64_t ldw, const float* x, int64_t ldx, int64_t len,
                    float part[kTileN][kTileR]) {
  constexpr int JB = kAvx2Rows<NT, RT>;
  for (int j0 = 0; j0 < NT; j0 += JB) bf16_rows_avx2<JB, RT>(w + j0, NT * 2 * ldw, x, ldx, len, part + j0);
}
#endif

// ---------------------------------------------------------------------------------------------- bf16 weights
#if defined(HYBRID_BF16_WIDEN512)
// part[j][r] = sum_{i < len} x[r * ldx + i] * bf16(w[j][i]) on AVX-512 without AVX512_BF16: 16 weights at a
// time widened to fp32 by a zero-extension and a 16-bit shift (exact), fp32 FMAs (exact products, fp32
// sums, as `vdpbf16ps`'s), two 16-element steps per 64 bytes of a weight row and one prefetch of the next
// tile's (`ldw`: elements per weight row).
template <int NT, int RT>
void bf16_tile_avx512(const uint16_t* const* w, int64_t ldw, const float* x, int64_t ldx, int64_t len,
                      float part[kTileN][kTileR]) {
  __m512 acc[NT][RT];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_setzero_ps();
  const auto widen = [](const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  };
  const int64_t len32 = len & ~int64_t{31}, len16 = len & ~int64_t{15};
  for (int64_t i = 0; i < len32; i += 32) {
    __m512 x0[RT], x1[RT];
    for (int r = 0; r < RT; ++r) x0[r] = _mm512_loadu_ps(x + r * ldx + i), x1[r] = _mm512_loadu_ps(x + r * ldx + i + 16);
    for (int j = 0; j < NT; ++j) {
      prefetch_next_tile(reinterpret_cast<const uint8_t*>(w[j] + i), NT * 2 * ldw);
      const __m512 w0 = widen(w[j] + i), w1 = widen(w[j] + i + 16);
      for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_fmadd_ps(x1[r], w1, _mm512_fmadd_ps(x0[r], w0, acc[j][r]));
    }
  }
  for (int64_t i = len32; i < len16; i += 16)
    for (int j = 0; j < NT; ++j) {
      const __m512 w0 = widen(w[j] + i);
      for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + i), w0, acc[j][r]);
    }
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) {
      float s = _mm512_reduce_add_ps(acc[j][r]);
      for (int64_t i = len16; i < len; ++i) {
        uint32_t u = static_cast<uint32_t>(w[j][i]) << 16;
        float f;
        std::memcpy(&f, &u, sizeof f);
        s += x[r * ldx + i] * f;
      }
      part[j][r] = s;
    }
}
#endif

#if defined(HYBRID_BF16_DOT) || defined(HYBRID_AVX2) || defined(HYBRID_BF16_WIDEN512)
// One product x [R, K] bf16 @ w [N, K] bf16 .T -> y [R, N] fp32 (exact products, fp32 sums), tile by tile:
// `vdpbf16ps` on bf16 x where AVX512_BF16 was compiled; otherwise x widened to fp32 once and the weights in
// registers (`bf16_tile_avx512`, `bf16_rows_avx2`)
struct Bf16Product {
  at::Tensor x, w, y;
  int64_t R, K, N, tiles;
  int nt;
  // x = input(bf16 x) (shared by the products of a group that share x)
  Bf16Product(const at::Tensor& x_, const at::Tensor& w_) : x(x_), w(w_) {
    R = x.size(0), K = x.size(1), N = w.size(0), nt = tile_rows(R), tiles = (N + nt - 1) / nt;
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(1) == K,
                "w must be contiguous bfloat16 [N, ", K, "]");
    y = at::empty({R, N}, x.options().dtype(at::kFloat));
  }
  static at::Tensor input(const at::Tensor& x) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be [R, K] bfloat16");
#if defined(HYBRID_BF16_DOT)
    return x;
#else
    return x.to(at::kFloat);
#endif
  }
  void tile(int64_t t) const {
#if defined(HYBRID_BF16_DOT)
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
#else
    const float* xp = x.data_ptr<float>();
#endif
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    float* yp = y.data_ptr<float>();
    float part[kTileN][kTileR];
    int64_t n[kTileN];
    const uint16_t* wr[kTileN];
    for (int j = 0; j < nt; ++j) {
      n[j] = std::min(t * nt + j, N - 1);
      wr[j] = wp + n[j] * K;
    }
    for (int64_t r0 = 0; r0 < R; r0 += kTileR) {
      const int rt = static_cast<int>(std::min<int64_t>(kTileR, R - r0));
      const auto* x0 = xp + r0 * K;
#if defined(HYBRID_BF16_DOT)
      with_tile(nt, rt, [&](auto NT, auto RT) { bf16_tile_dot<TILE_ARGS>(wr, K, x0, K, K, part); });
#elif defined(HYBRID_BF16_WIDEN512)
      with_tile(nt, rt, [&](auto NT, auto RT) { bf16_tile_avx512<TILE_ARGS>(wr, K, x0, K, K, part); });
#else
      with_tile(nt, rt, [&](auto NT, auto RT) { bf16_tile_avx2<TILE_ARGS>(wr, K, x0, K, K, part); });
#endif
      for (int j = 0; j < nt && t * nt + j < N; ++j)
        for (int r = 0; r < rt; ++r) yp[(r0 + r) * N + n[j]] = part[j][r];
    }
  }
};

// [xs[g] @ ws[g].T for each g] (each pair its own shapes) in one parallel loop
std::vector<at::Tensor> bf16_linear_group(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& ws) {
  TORCH_CHECK(xs.size() == ws.size(), "as many inputs as weights");
  const auto inputs = once_per_input(xs, &Bf16Product::input);
  std::vector<Bf16Product> jobs;
  for (size_t g = 0; g < xs.size(); ++g) jobs.emplace_back(inputs[g], ws[g]);
  return parallel_tiles(jobs);
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w) { return bf16_linear_group({x}, {w})[0]; }
#endif

// ---------------------------------------------------------------------------------------------- FP8
// part[j][r] = sum_{i < len} x[r * ldx + i] * e4m3(w[j][i]) (weight row stride: ldw bytes)
template <int NT, int RT>
void fp8_tile(const uint8_t* const* w, int64_t ldw, const float* x, int64_t ldx, int64_t len,
              float part[kTileN][kTileR]) {
#if defined(__AVX512F__)
  // 64 elements a step (one load and one NaN check of 64 bytes: faster than 32 a step, docs/perf-log.md#fp8-step-64),
  // then 32 a step, the last one masked (masked bytes are 0, decoding to +0, and x is not read past len);
  // the sums run on e4m3 * 2^-8 and are multiplied by 2^8 at the end (exact, as in fp8_rows_avx2)
  __m512 acc[NT][RT];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_setzero_ps();
  __m256i seen = _mm256_setzero_si256();  // bytewise max of (b | 0x80): 0xFF once a NaN code was read
  const __m256i sign = _mm256_set1_epi8(static_cast<char>(0x80));
  __m512i seen64 = _mm512_setzero_si512();
  const __m512i sign64 = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t len64 = len & ~int64_t{63};
  for (int64_t i = 0; i < len64; i += 64) {  // 64 bytes a row: one load, one NaN check
    for (int j = 0; j < NT; ++j) {
      prefetch_next_tile(w[j] + i, NT * ldw);
      const __m512i b = _mm512_loadu_si512(w[j] + i);
      seen64 = _mm512_max_epu8(seen64, _mm512_or_si512(b, sign64));
      __m512 w0, w1, w2, w3;
      decode_e4m3_scaled(_mm512_castsi512_si256(b), w0, w1);
      decode_e4m3_scaled(_mm512_extracti64x4_epi64(b, 1), w2, w3);
      for (int r = 0; r < RT; ++r) {
        const float* xr = x + r * ldx + i;
        acc[j][r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w0, acc[j][r]);
        acc[j][r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, acc[j][r]);
        acc[j][r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 32), w2, acc[j][r]);
        acc[j][r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 48), w3, acc[j][r]);
      }
    }
  }
  seen = _mm256_max_epu8(_mm256_max_epu8(seen, _mm512_castsi512_si256(seen64)), _mm512_extracti64x4_epi64(seen64, 1));
  for (int64_t i = len64; i < len; i += 32) {
    const int64_t n = std::min<int64_t>(32, len - i);
    const __mmask32 m = n == 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1);
    const __mmask16 m0 = static_cast<__mmask16>(m), m1 = static_cast<__mmask16>(m >> 16);
    __m512 x0[RT], x1[RT];
    for (int r = 0; r < RT; ++r) {
      x0[r] = _mm512_maskz_loadu_ps(m0, x + r * ldx + i);
      x1[r] = _mm512_maskz_loadu_ps(m1, x + r * ldx + i + 16);
    }
    for (int j = 0; j < NT; ++j) {
      const __m256i b = _mm256_maskz_loadu_epi8(m, w[j] + i);
      seen = _mm256_max_epu8(seen, _mm256_or_si256(b, sign));
      __m512 lo, hi;
      decode_e4m3_scaled(b, lo, hi);
      for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_fmadd_ps(x1[r], hi, _mm512_fmadd_ps(x0[r], lo, acc[j][r]));
    }
  }
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) part[j][r] = _mm512_reduce_add_ps(acc[j][r]) * 256.0f;
  if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(seen, _mm256_set1_epi8(-1))))  // rare: find the rows with a NaN code
    mark_nan_rows(w, NT, RT, len, part);
#elif defined(HYBRID_AVX2)
  constexpr int JB = kAvx2Rows<NT, RT>;
  for (int j0 = 0; j0 < NT; j0 += JB) fp8_rows_avx2<JB, RT>(w + j0, NT * ldw, x, ldx, len, part + j0);
#else
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) {
      float s = 0.0f;
      for (int64_t i = 0; i < len; ++i) s += x[r * ldx + i] * kTables.e4m3[w[j][i]];
      part[j][r] = s;
    }
#endif
}

// The FP8 tile for rt input rows at x (fp32, or bf16 in FP8 chunk order), row stride ldx
void fp8_tile_rows(int nt, int rt, const uint8_t* const* w, int64_t ldw, const void* x, bool bf16, int64_t ldx,
                   int64_t len, float part[kTileN][kTileR]) {
  with_tile(nt, rt, [&](auto NT, auto RT) {
#if defined(HYBRID_BF16_DOT)
    if (bf16) return fp8_tile_dot<TILE_ARGS>(w, ldw, static_cast<const uint16_t*>(x), ldx, len, part);
#endif
    fp8_tile<TILE_ARGS>(w, ldw, static_cast<const float*>(x), ldx, len, part);
  });
}

// One product x [R, K] @ W.T with W FP8 q [N, K] and its scales -> y [R, N] fp32, tile by tile.
// granularity 0: per tensor, 1: per channel, 2: per block of `block` x `block`
struct Fp8Product {
  at::Tensor xs, q, scale, y;  // xs: x as the tiles read it (fp32, or bf16 in FP8 chunk order)
  int64_t R, K, N, tiles, granularity, block, span, block_cols;
  int nt;
  bool bf16;
  // x [R, K] as given (checked), xs = input(x) (shared by the products of a group that share x)
  Fp8Product(const at::Tensor& x, const at::Tensor& xs_, const at::Tensor& q_, const at::Tensor& scale_,
             int64_t granularity_, int64_t block_)
      : xs(xs_), q(q_), scale(scale_), granularity(granularity_), block(block_) {
    R = x.size(0), K = x.size(1), N = q.size(0), nt = tile_rows(R), tiles = (N + nt - 1) / nt;
    check(x, q, K);
    span = granularity == 2 ? block : K, block_cols = (K + block - 1) / block;
    const int64_t scales = granularity == 0 ? 1 : granularity == 1 ? N : (N + block - 1) / block * block_cols;
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == scales,
                "scale must be contiguous float32 with ", scales, " values, got ", scale.numel());
    bf16 = xs.scalar_type() == at::kBFloat16;
    y = at::empty({R, N}, x.options().dtype(at::kFloat));
  }
  // x as the tiles read it: fp32 as it is, bf16 in FP8 chunk order (in fp32 where blocks cut a bf16 chunk)
  static at::Tensor input(const at::Tensor& x, int64_t granularity, int64_t block) {
    check_x(x);
    if (x.scalar_type() != at::kBFloat16) return x;
    if (granularity == 2 && block % 64) return x.to(at::kFloat);  // blocks that cut a bf16 chunk: fp32 products
#if defined(HYBRID_BF16_DOT)
    return reorder<uint16_t>(x, kFp8Chunk, fp8_element);
#else
    return x;  // not reached: check_x refuses bf16 here
#endif
  }
  void tile(int64_t t) const {
    const int64_t ldx = xs.size(1), esize = xs.element_size();
    const char* xp = static_cast<const char*>(xs.data_ptr());
    const uint8_t* qp = bytes_of(q);
    const float* sp = scale.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    float part[kTileN][kTileR];
    int64_t n[kTileN];
    const uint8_t* w[kTileN];
    for (int j = 0; j < nt; ++j) n[j] = std::min(t * nt + j, N - 1);
    for (int64_t r0 = 0; r0 < R; r0 += kTileR) {
      const int rt = static_cast<int>(std::min<int64_t>(kTileR, R - r0));
      float sum[kTileN][kTileR] = {};
      for (int64_t k0 = 0; k0 < K; k0 += span) {
        for (int j = 0; j < nt; ++j) w[j] = qp + n[j] * K + k0;
        fp8_tile_rows(nt, rt, w, K, xp + (r0 * ldx + k0) * esize, bf16, ldx, std::min(span, K - k0), part);
        for (int j = 0; j < nt; ++j) {
          const float s = granularity == 0 ? sp[0] : granularity == 1 ? sp[n[j]]
                                                   : sp[(n[j] / block) * block_cols + k0 / block];
          for (int r = 0; r < rt; ++r) sum[j][r] += part[j][r] * s;
        }
      }
      for (int j = 0; j < nt && t * nt + j < N; ++j)
        for (int r = 0; r < rt; ++r) yp[(r0 + r) * N + n[j]] = sum[j][r];
    }
  }
};

// [xs[g] @ W_g.T for each g] in one parallel loop, W_g = (qs[g], scales[g]) in one FP8 layout
std::vector<at::Tensor> fp8_linear_group(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& qs,
                                         const std::vector<at::Tensor>& scales, int64_t granularity,
                                         int64_t block) {
  TORCH_CHECK(xs.size() == qs.size() && qs.size() == scales.size(), "as many inputs as weights and scales");
  const auto inputs =
      once_per_input(xs, [&](const at::Tensor& x) { return Fp8Product::input(x, granularity, block); });
  std::vector<Fp8Product> jobs;
  for (size_t g = 0; g < xs.size(); ++g) jobs.emplace_back(xs[g], inputs[g], qs[g], scales[g], granularity, block);
  return parallel_tiles(jobs);
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t granularity,
                      int64_t block) {
  return fp8_linear_group({x}, {q}, {scale}, granularity, block)[0];
}

// ---------------------------------------------------------------------------------------------- FP4
#if defined(__AVX512F__)
// fp32 x is first laid out per 128-element chunk as 8 vectors of 16: lane d of vector k holds element 8d + k,
// the nibble k of the 32-bit word d of the chunk's 64 code bytes (K padded to a multiple of 128 with zeros)
at::Tensor fp4_fp32_layout(const at::Tensor& x) {
  return reorder<float>(x, 128, [](int64_t p) { return 8 * (p % 16) + p / 16; });
}

// A 128-element chunk's scales, lane d taking the scale of the block of elements 8d..8d+7: n <= 8 E4M3 bytes
// (NVFP4, block d / 2) as fp32 times 2^-8 by the fp16 route of e4m3_fp16 (the NaN bytes made NaN),
// or n <= 4 E8M0 bytes (MXFP4, block d / 4); lanes past the n blocks are 0
inline __m512 fp4_chunk_scales(const uint8_t* p, int64_t n, bool e8m0_scales) {
  const __m128i b = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << n) - 1), p);
  if (e8m0_scales) {
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << (4 * n)) - 1), decode_e8m0(_mm_shuffle_epi8(b, spread)));
  }
  const __m128i pairs = _mm_unpacklo_epi8(b, b);  // byte d = scale d / 2
  const __m128i m7 = _mm_set1_epi8(0x7F);
  return _mm512_mask_mov_ps(_mm512_cvtph_ps(e4m3_fp16(pairs)), _mm_cmpeq_epi8_mask(_mm_and_si128(pairs, m7), m7),
                            _mm512_set1_ps(NAN));
}
#if defined(__AVX512VBMI__)
// MXFP4's chunk scales in 3 instructions where fp4_chunk_scales takes 8: n <= 4 E8M0 bytes, byte d / 4 put
// in the low byte of lane d by one byte permute (the other bytes zero), shifted into the exponent field. Exact
// for the bytes 1..254 only: `seen_min` / `seen_max` keep the bytewise extremes of every byte read (past the
// n bytes they read 1), so a tile that met 0 (2^-127) or 255 (NaN) is computed again by fp4_tile_exact.
inline __m512 e8m0_chunk_scales(const uint8_t* p, int64_t n, __m128i& seen_min, __m128i& seen_max) {
  const __m128i b = _mm_mask_loadu_epi8(_mm_set1_epi8(1), static_cast<__mmask16>((1u << n) - 1), p);
  seen_min = _mm_min_epu8(seen_min, b);
  seen_max = _mm_max_epu8(seen_max, b);
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __mmask64 lanes = 0x1111111111111111ull & (n >= 4 ? ~0ull : (1ull << (16 * n)) - 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_maskz_permutexvar_epi8(lanes, idx, _mm512_castsi128_si512(b)), 23));
}
#endif
#else
// Element p of a 32-element chunk in fp4_avx2_layout's order: vector v = p / 8 of fp4_rows_avx2's decoded
// weights holds, in lane l = p % 8 / 4, the elements 16 (v / 2) + 8 (v % 2) + 2i + l, i = p % 4 (the low
// nibbles of 4 bytes in lane 0, their high nibbles in lane 1)
constexpr int64_t fp4_avx2_element(int64_t p) { return 16 * (p / 16) + 8 * (p / 8 % 2) + 2 * (p % 4) + p % 8 / 4; }

// fp32 x laid out per 32-element chunk in the order fp4_rows_avx2 decodes the weights (the portable code
// reads it too; K padded to a multiple of 32 with zeros)
at::Tensor fp4_avx2_layout(const at::Tensor& x) { return reorder<float>(x, 32, fp4_avx2_element); }
#endif

#if defined(__AVX512VBMI__)
// fp4_tile's sums element by element with the scalar decoders (every scale byte, 0 and 255 included), x in
// fp4_fp32_layout's order: for the rare tiles whose scales the vector path does not decode exactly
template <int NT, int RT>
void fp4_tile_exact(const Fp4Rows& w, const float* xs, int64_t ldx, int64_t K, int64_t group, const float* table,
                    float part[kTileN][kTileR]) {
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) {
      float sum = 0.0f;
      for (int64_t e = 0; e < K; ++e) {
        const int code = (w.codes[j][e / 2] >> (4 * (e % 2))) & 15;
        const int64_t at = e / 128 * 128 + 16 * (e % 8) + e % 128 / 8;
        sum += xs[r * ldx + at] * (kE2M1[code] * table[w.scales[j][e / group]]);
      }
      part[j][r] = sum;
    }
}
#endif

// part[j][r] = sum over the row's chunks of x . (e2m1(codes) * scale(block)), before the global multiplier
template <int NT, int RT>
void fp4_tile(const Fp4Rows& w, const float* xs, int64_t ldx, int64_t K, int64_t group, bool e8m0_scales,
              float part[kTileN][kTileR]) {
  [[maybe_unused]] const int64_t G = K / group;
  [[maybe_unused]] const float* table = e8m0_scales ? kTables.e8m0 : kTables.e4m3;
#if defined(__AVX512F__)
  // A chunk is 64 code bytes, one load per weight row: vector k of its decoded weights is a table permute
  // (`vpermps` reads the low 4 bits of each 32-bit lane) of the bytes shifted right by 4k, so no widening;
  // each lane sums 8 elements of one block unscaled, then one FMA applies the blocks' scales: faster at one
  // input row than the former decoder (nibbles widened 16 at a time, every decoded vector multiplied by its
  // scale), equal at 4 and 16 rows (docs/perf-log.md#fp4-scale-fma-avx512). This path is bound by its vector
  // ports (a shift, a permute and an FMA per 16 weights), not by DRAM; two half-length FMA chains per row and
  // k as the outer loop were both slower (same entry). With AVX512_VBMI, MXFP4's scales in 3 instructions
  // instead of 8 (e8m0_chunk_scales), faster at 1 and 4 rows (docs/perf-log.md#e8m0-vbmi-scales).
  const int64_t chunks = (K + 127) / 128, per_chunk = 128 / group;
  const __m512 lut = _mm512_loadu_ps(kE2M1);
  [[maybe_unused]] __m128i seen_min = _mm_set1_epi8(-1), seen_max = _mm_setzero_si128();  // e8m0_chunk_scales
  __m512 acc[NT][RT];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t bytes = std::min<int64_t>(64, K / 2 - c * 64);  // 32 in a final half chunk
    const __mmask64 mask = bytes == 64 ? ~__mmask64{0} : (__mmask64{1} << bytes) - 1;
    const int64_t blocks = std::min(per_chunk, G - c * per_chunk);
    const float* xc = xs + c * 128;
    for (int j = 0; j < NT; ++j) {
      prefetch_next_tile(w.codes[j] + c * 64, NT * K / 2);
      if ((c * per_chunk) % 64 == 0) prefetch_next_tile(w.scales[j] + c * per_chunk, NT * G);
      const __m512i v = _mm512_maskz_loadu_epi8(mask, w.codes[j] + c * 64);
      __m512 t[RT];
      for (int r = 0; r < RT; ++r) t[r] = _mm512_setzero_ps();
      for (int k = 0; k < 8; ++k) {
        const __m512 wk = _mm512_permutexvar_ps(k == 0 ? v : _mm512_srli_epi32(v, 4 * k), lut);
        for (int r = 0; r < RT; ++r) t[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xc + r * ldx + 16 * k), wk, t[r]);
      }
#if defined(__AVX512VBMI__)
      const __m512 s = e8m0_scales ? e8m0_chunk_scales(w.scales[j] + c * per_chunk, blocks, seen_min, seen_max)
                                   : fp4_chunk_scales(w.scales[j] + c * per_chunk, blocks, false);
#else
      const __m512 s = fp4_chunk_scales(w.scales[j] + c * per_chunk, blocks, e8m0_scales);
#endif
      for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_fmadd_ps(t[r], s, acc[j][r]);
    }
  }
  const float unit = e8m0_scales ? 1.0f : 256.0f;  // the E4M3 scales were decoded times 2^-8
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) part[j][r] = _mm512_reduce_add_ps(acc[j][r]) * unit;
#if defined(__AVX512VBMI__)
  if (e8m0_scales && (_mm_cmpeq_epi8_mask(seen_min, _mm_setzero_si128()) |
                      _mm_cmpeq_epi8_mask(seen_max, _mm_set1_epi8(-1))))  // rare: a scale of 2^-127 or NaN
    fp4_tile_exact<NT, RT>(w, xs, ldx, K, group, table, part);
#endif
#elif defined(HYBRID_AVX2)
  constexpr int JB = kAvx2Rows<NT, RT>;
  for (int j0 = 0; j0 < NT; j0 += JB)
    if (group == 16)
      fp4_rows_avx2<JB, RT, 16>(w.codes + j0, w.scales + j0, NT * K / 2, NT * G, xs, ldx, K, table, part + j0);
    else
      fp4_rows_avx2<JB, RT, 32>(w.codes + j0, w.scales + j0, NT * K / 2, NT * G, xs, ldx, K, table, part + j0);
#else
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < RT; ++r) {
      float sum = 0.0f;
      for (int64_t c = 0; c < K; c += 32)
        for (int64_t p = 0; p < 32; ++p) {
          const int64_t e = c + fp4_avx2_element(p);
          if (e >= K) continue;  // the zeros padding a final half chunk
          const int code = (w.codes[j][e / 2] >> (4 * (e % 2))) & 15;
          sum += xs[r * ldx + c + p] * (kE2M1[code] * table[w.scales[j][e / group]]);
        }
      part[j][r] = sum;
    }
#endif
}

// The FP4 tile for rt input rows at x (fp32 split even / odd, or bf16 in FP4 chunk order), row stride ldx
void fp4_tile_rows(int nt, int rt, const Fp4Rows& w, const void* x, bool bf16, int64_t ldx, int64_t K,
                   int64_t group, bool e8m0_scales, float part[kTileN][kTileR]) {
  with_tile(nt, rt, [&](auto NT, auto RT) {
#if defined(HYBRID_BF16_DOT)
    if (bf16) return fp4_tile_dot<TILE_ARGS>(w, static_cast<const uint16_t*>(x), ldx, K, group, e8m0_scales, part);
#endif
    fp4_tile<TILE_ARGS>(w, static_cast<const float*>(x), ldx, K, group, e8m0_scales, part);
  });
}

// One product x [R, K] @ W.T with W NVFP4 / MXFP4 (codes [N, K/2], scales [N, K/group]) -> y [R, N] fp32.
// group 16 with E4M3 scales (NVFP4) or 32 with E8M0 scales (MXFP4); `mult` multiplies every weight
struct Fp4Product {
  // xs: x as the tiles read it (fp32 in fp4_fp32_layout's or fp4_avx2_layout's order, bf16 in FP4 chunk order)
  at::Tensor xs, codes, scales, y;
  int64_t R, K, N, G, tiles, group;
  int nt;
  bool bf16, e8m0_scales;
  float mult;
  // x [R, K] as given (checked), xs = input(x) (shared by the products of a group that share x)
  Fp4Product(const at::Tensor& x, const at::Tensor& xs_, const at::Tensor& codes_,
             const at::Tensor& scales_, int64_t group_, bool e8m0_scales_, float mult_)
      : xs(xs_), codes(codes_), scales(scales_), group(group_), e8m0_scales(e8m0_scales_), mult(mult_) {
    R = x.size(0), K = x.size(1), N = codes.size(0), nt = tile_rows(R), tiles = (N + nt - 1) / nt;
    TORCH_CHECK(K % 16 == 0 && (group == 16 || group == 32) && K % group == 0, "K must be a multiple of the group");
    check(x, codes, K / 2);
    G = K / group;
    TORCH_CHECK(scales.element_size() == 1 && scales.is_contiguous() && scales.dim() >= 1 && scales.size(0) == N &&
                scales.numel() == N * G, "scales must be contiguous bytes [N, K / group]");
    bf16 = xs.scalar_type() == at::kBFloat16;
    y = at::empty({R, N}, x.options().dtype(at::kFloat));
  }
  static at::Tensor input(const at::Tensor& x) {
    check_x(x);
#if defined(HYBRID_BF16_DOT)
    if (x.scalar_type() == at::kBFloat16) return reorder<uint16_t>(x, kFp4Chunk, fp4_element);
#endif
#if defined(__AVX512F__)
    return fp4_fp32_layout(x);
#else
    return fp4_avx2_layout(x);
#endif
  }
  void tile(int64_t t) const {
    const int64_t ldx = xs.size(1), esize = xs.element_size();
    const char* xp = static_cast<const char*>(xs.data_ptr());
    const uint8_t* cp = bytes_of(codes);
    const uint8_t* sp = bytes_of(scales);
    float* yp = y.data_ptr<float>();
    float part[kTileN][kTileR];
    Fp4Rows w;
    int64_t n[kTileN];
    for (int j = 0; j < nt; ++j) {
      n[j] = std::min(t * nt + j, N - 1);
      w.codes[j] = cp + n[j] * (K / 2);
      w.scales[j] = sp + n[j] * G;
    }
    for (int64_t r0 = 0; r0 < R; r0 += kTileR) {
      const int rt = static_cast<int>(std::min<int64_t>(kTileR, R - r0));
      fp4_tile_rows(nt, rt, w, xp + r0 * ldx * esize, bf16, ldx, K, group, e8m0_scales, part);
      for (int j = 0; j < nt && t * nt + j < N; ++j)
        for (int r = 0; r < rt; ++r) yp[(r0 + r) * N + n[j]] = part[j][r] * mult;
    }
  }
};

// The multiplier of every weight from an NVFP4 global scale g (one float32 value): g, or 1 / g when
// `divisor` (compressed-tensors' global divides, ModelOpt's multiplies; 1 / g taken in double, then rounded)
float global_mult(const at::Tensor& g, bool divisor) {
  TORCH_CHECK(g.numel() == 1 && g.scalar_type() == at::kFloat, "the global scale must be one float32 value");
  const float v = *g.data_ptr<float>();
  return divisor ? static_cast<float>(1.0 / static_cast<double>(v)) : v;
}

// [xs[g] @ W_g.T for each g] in one parallel loop, W_g = (codes[g], scales[g], globals[g]) in one FP4 format;
// `globals` empty: every multiplier 1 (MXFP4)
std::vector<at::Tensor> fp4_linear_group(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& codes,
                                         const std::vector<at::Tensor>& scales, int64_t group, bool e8m0_scales,
                                         const std::vector<at::Tensor>& globals, bool divisor) {
  TORCH_CHECK(xs.size() == codes.size() && codes.size() == scales.size() &&
              (globals.empty() || globals.size() == xs.size()), "as many inputs as weights, scales and global scales");
  const auto inputs = once_per_input(xs, &Fp4Product::input);
  std::vector<Fp4Product> jobs;
  for (size_t g = 0; g < xs.size(); ++g)
    jobs.emplace_back(xs[g], inputs[g], codes[g], scales[g], group, e8m0_scales,
                      globals.empty() ? 1.0f : global_mult(globals[g], divisor));
  return parallel_tiles(jobs);
}

at::Tensor fp4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group,
                      bool e8m0_scales, const std::vector<at::Tensor>& globals, bool divisor) {
  return fp4_linear_group({x}, {codes}, {scales}, group, e8m0_scales, globals, divisor)[0];
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_linear", &fp8_linear, "x [R, K] fp32 (or bf16) @ FP8 weight.T -> [R, N] fp32");
  m.def("fp4_linear", &fp4_linear, "x [R, K] fp32 (or bf16) @ NVFP4 / MXFP4 weight.T -> [R, N] fp32");
  m.def("fp8_linear_group", &fp8_linear_group, "[x_g @ FP8 W_g.T for each g] in one parallel loop");
  m.def("fp4_linear_group", &fp4_linear_group, "[x_g @ NVFP4 / MXFP4 W_g.T for each g] in one parallel loop");
#if defined(HYBRID_BF16_DOT) || defined(HYBRID_AVX2) || defined(HYBRID_BF16_WIDEN512)
  m.def("bf16_linear", &bf16_linear, "x [R, K] bf16 @ bf16 weight.T -> [R, N] fp32");
  m.def("bf16_linear_group", &bf16_linear_group, "[x_g @ w_g.T for each g] in one parallel loop (bf16 -> fp32)");
#endif
  m.def("avx512", &avx512, "whether the AVX-512 path was compiled");
  m.def("path", &path, "the path compiled: avx512-bf16, avx512f, avx2-fma or scalar");
  m.def("bf16_weights", &bf16_weights, "whether bf16_linear was compiled (AVX-512, or AVX2 + FMA)");
  m.def("bf16_inputs", &bf16_inputs, "whether bfloat16 inputs are taken (AVX512_BF16 + VBMI dot products)");
}
