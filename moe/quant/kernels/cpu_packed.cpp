// Matrix products with packed low-bit weights on the CPU: y[r, n] = sum_k x[r, k] * W[n, k], each weight
// element decoded from its packed bytes in registers and never stored dense. Streaming the weight once per
// call, it serves decode (1 to 16 rows: bound by decoding, 8-16 GB/s of packed bytes on 2 cores) and prefill
// chunks alike (512 rows of a 1,856 x 2,688 FP8 matrix as fast as dequantizing it and multiplying). Built on first use by moe/quant/kernels/cpu.py (torch.utils.cpp_extension), -O3
// -march=native: the AVX-512 path where the CPU has it, the portable loops (which the compiler vectorises
// for AVX2) elsewhere. Both equal the dequantized product up to the order of the fp32 sums.
//
// Formats (the layouts of moe/quant/fp8.py, nvfp4.py, mxfp4.py):
//   FP8    q uint8 [N, K] (E4M3 bits), scale fp32: per tensor [1], per channel [N], or per block
//          [ceil(N/B), ceil(K/B)]: W[n, k] = e4m3(q[n, k]) * scale
//   NVFP4  codes uint8 [N, K/2] (element 2j in the low nibble), scales uint8 [N, K/16] (E4M3 bits),
//          W[n, k] = e2m1(code) * e4m3(scale[n, k/16]) * mult          (mult: ModelOpt's weight_scale_2,
//                                                                       or 1 / compressed-tensors' global)
//   MXFP4  codes as NVFP4, scales uint8 [N, K/32] (E8M0): W[n, k] = e2m1(code) * 2^(scale[n, k/32] - 127)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

bool bf16_inputs();
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

void check(const torch::Tensor& x, const torch::Tensor& w, int64_t k_per_row) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == torch::kFloat ||
              (x.scalar_type() == torch::kBFloat16 && bf16_inputs())), "x must be [R, K] float32 (or bfloat16 "
              "where AVX512_BF16 was compiled)");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "packed data must be uint8 [N, *]");
  TORCH_CHECK(w.size(1) == k_per_row, "packed data has ", w.size(1), " bytes per row, expected ", k_per_row);
}

// ---------------------------------------------------------------------------------------------- FP8
#if defined(__AVX512F__)
inline __m512 decode_e4m3(__m128i bytes) {
  const __m512i v = _mm512_cvtepu8_epi32(bytes);
  const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  // E.EEE.MMM moved into fp32's exponent and mantissa, then 2^120 restores the bias (normal numbers)
  __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(mag, 20)), _mm512_set1_ps(0x1p120f));
  const __mmask16 sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));  // subnormal: m * 2^-9, exactly
  f = _mm512_mask_mov_ps(f, sub, _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f)));
  f = _mm512_mask_mov_ps(f, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), _mm512_set1_ps(NAN));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}
#endif

// The products run on tiles of kTileN weight rows x up to kTileR input rows, so each decoded weight vector
// meets every input row and each input vector every weight row while they are in registers, and the
// kTileN x kTileR accumulators are independent (no single dependency chain). A tile past the last weight
// row repeats that row; its results are dropped.
constexpr int kTileN = 4, kTileR = 4;

// part[j][r] = sum_{i < len} x[r * ldx + i] * e4m3(w[j][i])
template <int RT>
void fp8_tile(const uint8_t* const* w, const float* x, int64_t ldx, int64_t len, float part[kTileN][kTileR]) {
#if defined(__AVX512F__)
  __m512 acc[kTileN][RT];
  for (int j = 0; j < kTileN; ++j)
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; i += 16) {
    const int64_t n = std::min<int64_t>(16, len - i);
    const __mmask16 m = n == 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    __m512 xv[RT];
    for (int r = 0; r < RT; ++r) xv[r] = _mm512_maskz_loadu_ps(m, x + r * ldx + i);
    for (int j = 0; j < kTileN; ++j) {
      const __m512 wv = decode_e4m3(_mm_maskz_loadu_epi8(m, w[j] + i));
      for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_fmadd_ps(xv[r], wv, acc[j][r]);
    }
  }
  for (int j = 0; j < kTileN; ++j)
    for (int r = 0; r < RT; ++r) part[j][r] = _mm512_reduce_add_ps(acc[j][r]);
#else
  for (int j = 0; j < kTileN; ++j)
    for (int r = 0; r < RT; ++r) {
      float s = 0.0f;
      for (int64_t i = 0; i < len; ++i) s += x[r * ldx + i] * kTables.e4m3[w[j][i]];
      part[j][r] = s;
    }
#endif
}

template <int RT>
void fp8_tile_bf16(const uint8_t* const* w, const uint16_t* x, int64_t ldx, int64_t len, float part[kTileN][kTileR]);

void fp8_tile_rows(int rt, const uint8_t* const* w, const float* x, int64_t ldx, int64_t len,
                   float part[kTileN][kTileR]) {
  switch (rt) {
    case 1: fp8_tile<1>(w, x, ldx, len, part); break;
    case 2: fp8_tile<2>(w, x, ldx, len, part); break;
    case 3: fp8_tile<3>(w, x, ldx, len, part); break;
    default: fp8_tile<4>(w, x, ldx, len, part); break;
  }
}

// granularity 0: per tensor, 1: per channel, 2: per block of `block` x `block`
torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t granularity, int64_t block) {
  const int64_t R = x.size(0), K = x.size(1), N = q.size(0);
  check(x, q, K);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous(), "scale must be contiguous float32");
  auto y = torch::empty({R, N}, x.options().dtype(torch::kFloat));
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const float* xp = bf16 ? nullptr : x.data_ptr<float>();
  const uint16_t* xh = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t span = granularity == 2 ? block : K, block_cols = (K + block - 1) / block;
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    float part[kTileN][kTileR];
    for (int64_t tile = begin; tile < end; ++tile) {
      int64_t n[kTileN];
      const uint8_t* w[kTileN];
      for (int j = 0; j < kTileN; ++j) n[j] = std::min(tile * kTileN + j, N - 1);
      for (int64_t r0 = 0; r0 < R; r0 += kTileR) {
        const int rt = static_cast<int>(std::min<int64_t>(kTileR, R - r0));
        float sum[kTileN][kTileR] = {};
        for (int64_t k0 = 0; k0 < K; k0 += span) {
          for (int j = 0; j < kTileN; ++j) w[j] = qp + n[j] * K + k0;
          const int64_t len = std::min(span, K - k0);
          if (bf16) {
#if defined(__AVX512BF16__)
            const uint16_t* x0 = xh + r0 * K + k0;
            switch (rt) {
              case 1: fp8_tile_bf16<1>(w, x0, K, len, part); break;
              case 2: fp8_tile_bf16<2>(w, x0, K, len, part); break;
              case 3: fp8_tile_bf16<3>(w, x0, K, len, part); break;
              default: fp8_tile_bf16<4>(w, x0, K, len, part); break;
            }
#endif
          } else {
            fp8_tile_rows(rt, w, xp + r0 * K + k0, K, len, part);
          }
          for (int j = 0; j < kTileN; ++j) {
            const float s = granularity == 0 ? sp[0] : granularity == 1 ? sp[n[j]]
                                                     : sp[(n[j] / block) * block_cols + k0 / block];
            for (int r = 0; r < rt; ++r) sum[j][r] += part[j][r] * s;
          }
        }
        for (int j = 0; j < kTileN && tile * kTileN + j < N; ++j)
          for (int r = 0; r < rt; ++r) yp[(r0 + r) * N + n[j]] = sum[j][r];
      }
    }
  });
  return y;
}

// ---------------------------------------------------------------------------------------------- FP4
// x is first laid out per 32-element chunk as its 16 even elements then its 16 odd ones, the order in which
// the low and high nibbles of 16 packed bytes come out (K padded to a multiple of 32 with zeros).
torch::Tensor split_even_odd(const torch::Tensor& x) {
  const int64_t R = x.size(0), K = x.size(1), Kp = (K + 31) / 32 * 32;
  auto padded = torch::zeros({R, Kp}, x.options());
  padded.narrow(1, 0, K).copy_(x);
  return padded.view({R, Kp / 32, 16, 2}).transpose(2, 3).contiguous().view({R, Kp});
}

struct Fp4Rows {
  const uint8_t* codes[kTileN];
  const uint8_t* scales[kTileN];
};

// part[j][r] = sum over the row's chunks of x . (e2m1(codes) * scale(block)), before the global multiplier
template <int RT>
void fp4_tile(const Fp4Rows& w, const float* xs, int64_t ldx, int64_t K, int64_t group, const float* table,
              float part[kTileN][kTileR]) {
  const int64_t chunks = (K + 31) / 32, G = K / group;
#if defined(__AVX512F__)
  const __m512 lut = _mm512_loadu_ps(kE2M1);
  __m512 acc[kTileN][RT];
  for (int j = 0; j < kTileN; ++j)
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t bytes = std::min<int64_t>(16, K / 2 - c * 16);  // 8 in a final half chunk
    const __mmask16 mask = bytes == 16 ? 0xFFFF : 0x00FF;
    __m512 xe[RT], xo[RT];
    for (int r = 0; r < RT; ++r) {
      xe[r] = _mm512_loadu_ps(xs + r * ldx + c * 32);
      xo[r] = _mm512_loadu_ps(xs + r * ldx + c * 32 + 16);
    }
    for (int j = 0; j < kTileN; ++j) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, w.codes[j] + c * 16));
      __m512 s;
      if (group == 32) {
        s = _mm512_set1_ps(table[w.scales[j][c]]);
      } else {  // lanes 0-7 hold elements of block 2c, lanes 8-15 of block 2c + 1
        const float s1 = 2 * c + 1 < G ? table[w.scales[j][2 * c + 1]] : 0.0f;
        s = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(table[w.scales[j][2 * c]]), _mm512_set1_ps(s1));
      }
      const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)), lut), s);
      const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut), s);
      for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_fmadd_ps(xo[r], hi, _mm512_fmadd_ps(xe[r], lo, acc[j][r]));
    }
  }
  for (int j = 0; j < kTileN; ++j)
    for (int r = 0; r < RT; ++r) part[j][r] = _mm512_reduce_add_ps(acc[j][r]);
#else
  for (int j = 0; j < kTileN; ++j)
    for (int r = 0; r < RT; ++r) {
      float sum = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* xr = xs + r * ldx + c * 32;
        for (int64_t b = 0; b < 16 && c * 16 + b < K / 2; ++b) {
          const uint8_t code = w.codes[j][c * 16 + b];
          const float s = table[w.scales[j][(c * 32 + 2 * b) / group]];
          sum += xr[b] * kE2M1[code & 15] * s + xr[16 + b] * kE2M1[code >> 4] * s;
        }
      }
      part[j][r] = sum;
    }
#endif
}

template <int RT>
void fp4_tile_bf16(const Fp4Rows& w, const uint16_t* x, int64_t ldx, int64_t K, int64_t group, const float* table,
                   float part[kTileN][kTileR]);

// group 16 with E4M3 scales (NVFP4) or 32 with E8M0 scales (MXFP4); `mult` multiplies every weight
torch::Tensor fp4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t group, bool e8m0_scales,
                         double mult) {
  const int64_t R = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % 16 == 0 && (group == 16 || group == 32) && K % group == 0, "K must be a multiple of the group");
  check(x, codes, K / 2);
  TORCH_CHECK(scales.scalar_type() == torch::kUInt8 && scales.is_contiguous() && scales.size(0) == N &&
              scales.size(1) == K / group, "scales must be uint8 [N, K / group]");
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const auto xs = bf16 ? x : split_even_odd(x);  // bf16: natural order, each pair of elements in one lane
  const int64_t Kp = xs.size(1), G = K / group, tiles = (N + kTileN - 1) / kTileN;
  auto y = torch::empty({R, N}, x.options().dtype(torch::kFloat));
  const float* xp = bf16 ? nullptr : xs.data_ptr<float>();
  const uint16_t* xh = bf16 ? reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>()) : nullptr;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  const float* table = e8m0_scales ? kTables.e8m0 : kTables.e4m3;
  float* yp = y.data_ptr<float>();
  const float m = static_cast<float>(mult);
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    float part[kTileN][kTileR];
    for (int64_t tile = begin; tile < end; ++tile) {
      Fp4Rows w;
      int64_t n[kTileN];
      for (int j = 0; j < kTileN; ++j) {
        n[j] = std::min(tile * kTileN + j, N - 1);
        w.codes[j] = cp + n[j] * (K / 2);
        w.scales[j] = sp + n[j] * G;
      }
      for (int64_t r0 = 0; r0 < R; r0 += kTileR) {
        const int rt = static_cast<int>(std::min<int64_t>(kTileR, R - r0));
        if (bf16) {
#if defined(__AVX512BF16__)
          const uint16_t* x0 = xh + r0 * K;
          switch (rt) {
            case 1: fp4_tile_bf16<1>(w, x0, K, K, group, table, part); break;
            case 2: fp4_tile_bf16<2>(w, x0, K, K, group, table, part); break;
            case 3: fp4_tile_bf16<3>(w, x0, K, K, group, table, part); break;
            default: fp4_tile_bf16<4>(w, x0, K, K, group, table, part); break;
          }
#endif
        } else {
          const float* x0 = xp + r0 * Kp;
          switch (rt) {
            case 1: fp4_tile<1>(w, x0, Kp, K, group, table, part); break;
            case 2: fp4_tile<2>(w, x0, Kp, K, group, table, part); break;
            case 3: fp4_tile<3>(w, x0, Kp, K, group, table, part); break;
            default: fp4_tile<4>(w, x0, Kp, K, group, table, part); break;
          }
        }
        for (int j = 0; j < kTileN && tile * kTileN + j < N; ++j)
          for (int r = 0; r < rt; ++r) yp[(r0 + r) * N + n[j]] = part[j][r] * m;
      }
    }
  });
  return y;
}

// ---------------------------------------------------------------------------------------------- bf16 inputs
// With bf16 activations (a bf16 model) and AVX512_BF16, weights are decoded to bf16, exactly (an E4M3 value,
// or an E2M1 code, fits bf16), and `vdpbf16ps` multiplies pairs exactly into fp32 sums: twice the elements
// per instruction, and a quarter of the decoding work per element. Scales multiply the fp32 sums.
#if defined(__AVX512BF16__)
struct Bf16Tables {
  alignas(64) int16_t subnormal[32];  // E4M3 subnormals m * 2^-9 (m = 0..7) as bf16 bits
  alignas(64) int32_t e2m1[16];       // E2M1 codes as bf16 bits, one per 32-bit lane
  static int16_t bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<int16_t>(u >> 16);
  }
  Bf16Tables() {
    for (int i = 0; i < 32; ++i) subnormal[i] = bits(i < 8 ? std::ldexp(static_cast<float>(i), -9) : 0.0f);
    for (int i = 0; i < 16; ++i) e2m1[i] = static_cast<uint16_t>(bits(kE2M1[i]));
  }
};
const Bf16Tables kBf16;

// 32 E4M3 bytes -> 32 bf16 values, exactly: exponent + 120 for normal numbers, a table for subnormals
inline __m512i e4m3_bf16(__m256i bytes) {
  const __m512i v = _mm512_cvtepu8_epi16(bytes);
  const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7F));
  __m512i b = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  b = _mm512_mask_mov_epi16(b, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)),
                            _mm512_permutexvar_epi16(mag, _mm512_load_si512(kBf16.subnormal)));
  b = _mm512_mask_mov_epi16(b, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(0x7FC0));
  return _mm512_or_si512(b, _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8));
}

template <int RT>
void fp8_tile_bf16(const uint8_t* const* w, const uint16_t* x, int64_t ldx, int64_t len,
                   float part[kTileN][kTileR]) {
  __m512 acc[kTileN][RT];
  for (int j = 0; j < kTileN; ++j)
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; i += 32) {
    const int64_t n = std::min<int64_t>(32, len - i);
    const __mmask32 m = n == 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << n) - 1);
    __m512i xv[RT];
    for (int r = 0; r < RT; ++r) xv[r] = _mm512_maskz_loadu_epi16(m, x + r * ldx + i);
    for (int j = 0; j < kTileN; ++j) {
      const __m512i wv = e4m3_bf16(_mm256_maskz_loadu_epi8(m, w[j] + i));
      for (int r = 0; r < RT; ++r)
        acc[j][r] = _mm512_dpbf16_ps(acc[j][r], (__m512bh)xv[r], (__m512bh)wv);
    }
  }
  for (int j = 0; j < kTileN; ++j)
    for (int r = 0; r < RT; ++r) part[j][r] = _mm512_reduce_add_ps(acc[j][r]);
}

template <int RT>
void fp4_tile_bf16(const Fp4Rows& w, const uint16_t* x, int64_t ldx, int64_t K, int64_t group, const float* table,
                   float part[kTileN][kTileR]) {
  const int64_t chunks = (K + 31) / 32, G = K / group;
  const __m512i lut = _mm512_load_si512(kBf16.e2m1);
  __m512 acc[kTileN][RT];
  for (int j = 0; j < kTileN; ++j)
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const bool half = K - c * 32 == 16;  // a final chunk of 16 elements (8 bytes)
    __m512i xv[RT];
    for (int r = 0; r < RT; ++r) xv[r] = _mm512_maskz_loadu_epi16(half ? 0xFFFFu : 0xFFFFFFFFu, x + r * ldx + c * 32);
    for (int j = 0; j < kTileN; ++j) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(half ? 0x00FF : 0xFFFF, w.codes[j] + c * 16));
      // element 2k (low nibble of byte k) in the low half of lane k, element 2k + 1 in the high half
      const __m512i wv = _mm512_or_si512(_mm512_permutexvar_epi32(_mm512_and_si512(v, _mm512_set1_epi32(15)), lut),
                                         _mm512_slli_epi32(_mm512_permutexvar_epi32(_mm512_srli_epi32(v, 4), lut), 16));
      __m512 s;
      if (group == 32) {
        s = _mm512_set1_ps(table[w.scales[j][c]]);
      } else {  // lanes 0-7 hold elements of block 2c, lanes 8-15 of block 2c + 1
        const float s1 = 2 * c + 1 < G ? table[w.scales[j][2 * c + 1]] : 0.0f;
        s = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(table[w.scales[j][2 * c]]), _mm512_set1_ps(s1));
      }
      for (int r = 0; r < RT; ++r)
        acc[j][r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)xv[r],
                                                     (__m512bh)wv), s, acc[j][r]);
    }
  }
  for (int j = 0; j < kTileN; ++j)
    for (int r = 0; r < RT; ++r) part[j][r] = _mm512_reduce_add_ps(acc[j][r]);
}
#endif

bool bf16_inputs() {
#if defined(__AVX512BF16__)
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_linear", &fp8_linear, "x [R, K] fp32 @ FP8 weight.T -> [R, N] fp32");
  m.def("fp4_linear", &fp4_linear, "x [R, K] fp32 @ NVFP4 / MXFP4 weight.T -> [R, N] fp32");
  m.def("avx512", &avx512, "whether the AVX-512 path was compiled");
  m.def("bf16_inputs", &bf16_inputs, "whether bfloat16 inputs are taken (AVX512_BF16 dot products)");
}
