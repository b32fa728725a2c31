// The inner loops of minivllm's two central kernels (chapter 18): what exercise 18 has the reader write.
//
// ops.cpp holds everything around them: the argument checks, the loops over
// rows, heads and output features, the threads. It is compiled once; the two
// loops that call these (inner_ops.cpp) are compiled with the file of inner
// loops the build names (inner.cpp, minivllm's own, or a reader's), so the
// compiler sees both in that unit and inlines them, and a reader's edit
// recompiles only that small unit.
#pragma once
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace minivllm {

constexpr int kBlockQ = 32;        // weights per Q4_1 / Q8_0 block: the GGUF's QK4_1 and QK8_0
constexpr int kQ4_1Bytes = 20;     // fp16 scale, fp16 minimum, 16 bytes of two 4-bit quants each
constexpr int kQ8_0Bytes = 34;     // fp16 scale, 32 signed bytes
constexpr int kMaxRows = 8;        // rows a quantized or streaming matvec takes at once
constexpr int kMaxHeadDim = 256;
constexpr int kMaxTile = 64;       // query vectors attended together: rows times the heads that share a KV head
constexpr int kMaxBlockSize = 256;

// A vector of floats as the compiler's vector extension: 16 lanes with AVX-512, 8 otherwise (two AVX2 registers'
// worth would split into halves anyway). Arithmetic on it runs lane by lane; the helpers load, store, convert.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float fvec __attribute__((vector_size(4 * kLanes)));
typedef float fvec_any __attribute__((vector_size(4 * kLanes), aligned(4)));  // the same at any float address
typedef int32_t ivec __attribute__((vector_size(4 * kLanes)));
typedef uint8_t bvec __attribute__((vector_size(kLanes)));  // kLanes bytes
typedef uint8_t bvec_any __attribute__((vector_size(kLanes), aligned(1)));
typedef int8_t sbvec __attribute__((vector_size(kLanes)));
typedef int8_t sbvec_any __attribute__((vector_size(kLanes), aligned(1)));

inline fvec load(const float* p) { return *reinterpret_cast<const fvec_any*>(p); }
inline void store(float* p, fvec v) { *reinterpret_cast<fvec_any*>(p) = v; }
inline fvec splat(float x) { return fvec{} + x; }
inline float hsum(fvec v) {  // the lanes added pairwise, halving the vector each step
#if defined(__AVX512F__)
  v += __builtin_shuffle(v, ivec{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, ivec{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, ivec{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, ivec{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#else
  v += __builtin_shuffle(v, ivec{4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, ivec{2, 3, 0, 1, 6, 7, 4, 5});
  v += __builtin_shuffle(v, ivec{1, 0, 3, 2, 5, 4, 7, 6});
#endif
  return v[0];
}
inline bvec load_bytes(const uint8_t* p) { return *reinterpret_cast<const bvec_any*>(p); }
inline sbvec load_signed_bytes(const uint8_t* p) { return *reinterpret_cast<const sbvec_any*>(p); }
inline fvec to_float(bvec b) { return __builtin_convertvector(__builtin_convertvector(b, ivec), fvec); }
inline fvec to_float(sbvec b) { return __builtin_convertvector(__builtin_convertvector(b, ivec), fvec); }

// An IEEE half (how the GGUF stores each block's scale and minimum) as a float: exact.
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)  // _cvtsh_ss's instruction, without <immintrin.h> (half a second of parsing a build)
  typedef short half8 __attribute__((vector_size(16)));
  return __builtin_ia32_vcvtph2ps(half8{static_cast<short>(h)})[0];
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = 113;
    while (!(man & 0x400)) { man <<= 1; --e; }
    bits = sign | (static_cast<uint32_t>(e) << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t read_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// exp(x) in every lane, to about 2 ulp; exp of -inf (a masked score) is 0. Written with the vector extension so
// it vectorises (libm's expf would not) and every lane runs the same arithmetic.
inline fvec exp_lanes(fvec x) {
  const fvec hi = splat(88.0f), lo = splat(-87.3365447504f);
  x = x > hi ? hi : x;
  const ivec under = x < lo;
  x = x < lo ? lo : x;
  fvec n = x * 1.44269504088896341f;  // x / ln 2, rounded to nearest
  n = __builtin_convertvector(__builtin_convertvector(n + (n >= 0 ? splat(0.5f) : splat(-0.5f)), ivec), fvec);
  fvec r = x - n * 0.693359375f;  // Cody-Waite: ln 2 in two parts
  r = r - n * -2.12194440e-4f;
  fvec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ivec pow2 = (__builtin_convertvector(n, ivec) + 127) << 23;
  fvec scale;
  std::memcpy(&scale, &pow2, sizeof scale);
  const fvec out = p * scale;
  return under ? splat(0.0f) : out;
}

// One tile of queries attends over one sequence's cache, through its block table (chapter 18).
//
// The tile is `rows` consecutive query tokens of one sequence times the
// `heads` query heads that read one KV head: query vector (r, h) is
// q[r * q_row_stride + h * head_dim + d], and its output goes to
// out[r * out_row_stride + h * head_dim + d]. Row r sits at position pos[r]
// (non-decreasing) and sees the keys 0 .. pos[r]. Key t of the sequence lives
// in slot table[t / block_size] * block_size + t % block_size; its vector is
// k_cache[slot * kv_stride + d] (k_cache already points at the tile's KV
// head), and its value v_cache[...] the same. Each output is the softmax of
// the scaled scores against the visible keys, weighting their values, summed
// in float32 by an online softmax: block by block, a running maximum, a
// running sum of exp(score - maximum) and the weighted values, rescaled when
// the maximum grows. Nothing is read beyond a row's own position.
struct AttentionTile {
  const float* q;
  int64_t q_row_stride;
  const int64_t* pos;
  int rows;
  int heads;
  const float* k_cache;
  const float* v_cache;
  int64_t kv_stride;
  const int32_t* table;
  int block_size;
  int head_dim;
  float scale;
  float* out;
  int64_t out_row_stride;
};

inline void attend_tile(const AttentionTile& t);

// An inner loop not written yet (exercise 18's stubs): MINIVLLM_NOT_WRITTEN(attend_tile) in its body marks it, for
// good (the stub is compiled in), and the op that calls it fails with "not written yet: attend_tile", which Python
// raises as NotImplementedError, instead of returning whatever its output held. One object in each built library,
// defined in the inner unit (inner_ops.cpp), read by ops.cpp; hidden, so each library keeps its own flags (an
// inline variable would be one object shared by every library loaded, minivllm's and a reader's).
struct NotWritten {
  std::atomic<bool> attend_tile{false}, q4_1_block_dot{false};
};
extern __attribute__((visibility("hidden"))) NotWritten not_written;
#define MINIVLLM_NOT_WRITTEN(loop) ::minivllm::not_written.loop.store(true, std::memory_order_relaxed)

// Adds the products of one Q4_1 block's 32 weights with each of `rows` rows of x to acc[r] (chapter 18).
//
// The block: an fp16 scale d (bytes 0-1), an fp16 minimum m (bytes 2-3), then
// 16 bytes of quants: byte j holds weight j in its low 4 bits and weight
// j + 16 in its high 4 bits; weight = d * q + m. Row r's 32 inputs are
// x[r * x_stride + 0 .. 31]. acc[r] is kLanes partial sums: the caller adds
// its lanes up once the row's last block is in, so add the products into them
// in any lanes you like.
inline void q4_1_block_dot(const uint8_t* block, const float* x, int64_t x_stride, int rows, fvec* acc);

}  // namespace minivllm
