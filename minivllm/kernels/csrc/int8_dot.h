// The GGUF's blocks times 8-bit activations in integer dot products, as llama.cpp does (chapter 18).
//
// llama.cpp (ggml-org/llama.cpp at 04e1dd75, ggml/src/ggml-cpu/arch/x86/quants.c) rounds each activation row once
// per matmul to blocks of 32 (quantize_row_q8_1: d = max|x| / 127 kept as fp16, q = x * (127 / max|x|) rounded to
// the nearest integer, ties to even, and for Q8_1 s = d * sum(q) as fp16: ggml-common.h's block_q8_1), then
// multiplies each weight block by them in integers: ggml_vec_dot_q4_1_q8_1 (the 4-bit quants, unsigned, against
// the signed 8-bit ones with maddubs, or dpbusd where the CPU has VNNI; then d_w * d_x per block, and m_w * s_x
// for the block's minimum) and ggml_vec_dot_q8_0_q8_0 (a Q8_0 weight meets a Q8_0 row: ggml-cpu.c's
// type_traits_cpu at 005913fd gives Q8_0 the vec_dot_type Q8_0, whose d and q are Q8_1's without s).
//
// The integer part is exact on every path. So that the float part is too, every path (AVX-512 VNNI, AVX-VNNI,
// AVX2, scalar) sums in the same order: each block's 32 products in 8 lanes of 4 neighbours (lane i holds weights
// 4i .. 4i+3: what maddubs + madd and dpbusd both give), each lane accumulated over the blocks with one fused
// multiply-add by d_w * d_x (a product of two halves: exact in float), the lanes added pairwise
// ((0+4)+(2+6))+((1+5)+(3+7)), then the minima's sum (sum of m_w * s_x, each exact), then the bias. Which path
// runs is a rule: the instruction sets the build targets (-march=native), named by mv_int8_dot_kind().
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "inner.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define MINIVLLM_INT8_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MINIVLLM_INT8_VNNI 1  // EVEX vpdpbusd on 256-bit registers (llama.cpp's mul_sum_us8_pairs_float)
#elif defined(__AVXVNNI__)
#define MINIVLLM_INT8_VNNI 2  // the VEX encoding (Alder Lake and later)
#endif
#endif

namespace minivllm {

constexpr int kQ8_1Bytes = 36;  // fp16 d, fp16 s, 32 signed bytes: llama.cpp's block_q8_1

inline const char* int8_dot_kind() {
#if MINIVLLM_INT8_VNNI == 1
  return "avx512-vnni";
#elif MINIVLLM_INT8_VNNI == 2
  return "avx-vnni";
#elif defined(MINIVLLM_INT8_AVX2)
  return "avx2-maddubs";
#else
  return "scalar";
#endif
}

// A float as an IEEE half, rounded to nearest, ties to even (as torch's .half() and F16C's vcvtps2ph).
inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  uint32_t h;
  if (x >= 0x47800000u) {  // 2^16 and above, inf, nan
    h = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (x < 0x38800000u) {  // below 2^-14: a subnormal half; adding 0.5 rounds its 10 bits into place
    float v;
    std::memcpy(&v, &x, 4);
    v += 0.5f;
    uint32_t b;
    std::memcpy(&b, &v, 4);
    h = b - 0x3f000000u;
  } else {  // normal: rebias the exponent, round the 13 dropped bits to nearest even
    x += 0xc8000fffu + ((x >> 13) & 1u);
    h = x >> 13;
  }
  return static_cast<uint16_t>(h | sign);
#endif
}

// One row x [K] as K / 32 Q8_1 blocks at out (llama.cpp's quantize_row_q8_1, AVX2 branch).
inline void quantize_row_q8_1(const float* x, int64_t K, uint8_t* out) {
  for (int64_t b = 0; b < K / kBlockQ; ++b) {
    const float* xb = x + b * kBlockQ;
    uint8_t* block = out + b * kQ8_1Bytes;
    float amax = 0.0f;
    for (int j = 0; j < kBlockQ; ++j) amax = std::fabs(xb[j]) > amax ? std::fabs(xb[j]) : amax;
    const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < kBlockQ; ++j) {
      const int q = static_cast<int>(std::nearbyint(xb[j] * id));  // |q| <= 127: never -128
      block[4 + j] = static_cast<uint8_t>(static_cast<int8_t>(q));
      sum += q;
    }
    const uint16_t dh = float_to_half(d), sh = float_to_half(d * static_cast<float>(sum));
    std::memcpy(block, &dh, 2);
    std::memcpy(block + 2, &sh, 2);
  }
}

// The rows of quantized activations as the dot products read them: quants [R][K], d and s [R][K / 32] as floats.
struct Int8Rows {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t K, blocks;
};

// 8 float lanes, each accumulating one lane of every block's integer products (see the top of this file).
struct Lanes8 {
#if defined(MINIVLLM_INT8_AVX2)
  __m256 v = _mm256_setzero_ps();
  void add(float scale, __m256i p) { v = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(p), v); }
  float sum() const {
    alignas(32) float l[8];
    _mm256_store_ps(l, v);
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
  }
#else
  float l[8] = {};
  void add(float scale, const int32_t* p) {
    for (int i = 0; i < 8; ++i) l[i] = std::fma(scale, static_cast<float>(p[i]), l[i]);
  }
  float sum() const { return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])); }
#endif
};

#if defined(MINIVLLM_INT8_AVX2)
// Unsigned bytes u times signed bytes s, 4 neighbours summed into each int32 lane (exact: |u| <= 128, |s| <= 127).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if MINIVLLM_INT8_VNNI == 1
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif MINIVLLM_INT8_VNNI == 2
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));  // pairs fit int16: 2*128*127
#endif
}
#endif

// out [R, N] = the rows times W [N, blocks of Q4_1 (is_q4_1) or Q8_0], in the order described at the top.
template <int R, bool is_q4_1>
void int8_matvec(float* out, const uint8_t* weight, const float* bias, int64_t N, const Int8Rows& x, int nthreads) {
  constexpr int bytes = is_q4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  const int64_t row_bytes = x.blocks * bytes;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t n = 0; n < N; ++n) {
    Lanes8 acc[R];
    float mins[R] = {};
    for (int64_t b = 0; b < x.blocks; ++b) {
      const uint8_t* block = weight + n * row_bytes + b * bytes;
      const float dw = half_to_float(read_u16(block));
      const float mw = is_q4_1 ? half_to_float(read_u16(block + 2)) : 0.0f;
#if defined(MINIVLLM_INT8_AVX2)
      __m256i w;
      if (is_q4_1) {  // bytes 0-15: the low nibbles (weights 0-15), 16-31: the high ones (weights 16-31)
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
        w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
      } else {
        w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
      }
      const __m256i w_abs = is_q4_1 ? w : _mm256_sign_epi8(w, w);  // signed x signed: |w| times sign(w) * a
      for (int r = 0; r < R; ++r) {
        __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + r * x.K + b * kBlockQ));
        if (!is_q4_1) a = _mm256_sign_epi8(a, w);
        acc[r].add(dw * x.d[r * x.blocks + b], dot_u8s8(w_abs, a));
        if (is_q4_1) mins[r] += mw * x.s[r * x.blocks + b];
      }
#else
      int w[kBlockQ];
      for (int j = 0; j < kBlockQ; ++j)
        w[j] = is_q4_1 ? (j < 16 ? block[4 + j] & 0x0f : block[4 + j - 16] >> 4) : static_cast<int8_t>(block[2 + j]);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = x.q + r * x.K + b * kBlockQ;
        int32_t p[8];
        for (int i = 0; i < 8; ++i)
          p[i] = w[4 * i] * a[4 * i] + w[4 * i + 1] * a[4 * i + 1] + w[4 * i + 2] * a[4 * i + 2] +
                 w[4 * i + 3] * a[4 * i + 3];
        acc[r].add(dw * x.d[r * x.blocks + b], p);
        if (is_q4_1) mins[r] += mw * x.s[r * x.blocks + b];
      }
#endif
    }
    for (int r = 0; r < R; ++r) {
      float v = acc[r].sum();
      if (is_q4_1) v += mins[r];
      if (bias) v += bias[n];
      out[r * N + n] = v;
    }
  }
}

template <bool is_q4_1>
void int8_matvec_rows(float* out, const uint8_t* weight, const float* bias, int64_t R, int64_t N,
                      const Int8Rows& x, int nthreads) {
  switch (R) {
    case 1: return int8_matvec<1, is_q4_1>(out, weight, bias, N, x, nthreads);
    case 2: return int8_matvec<2, is_q4_1>(out, weight, bias, N, x, nthreads);
    case 3: return int8_matvec<3, is_q4_1>(out, weight, bias, N, x, nthreads);
    case 4: return int8_matvec<4, is_q4_1>(out, weight, bias, N, x, nthreads);
    case 5: return int8_matvec<5, is_q4_1>(out, weight, bias, N, x, nthreads);
    case 6: return int8_matvec<6, is_q4_1>(out, weight, bias, N, x, nthreads);
    case 7: return int8_matvec<7, is_q4_1>(out, weight, bias, N, x, nthreads);
    default: return int8_matvec<8, is_q4_1>(out, weight, bias, N, x, nthreads);
  }
}

}  // namespace minivllm
