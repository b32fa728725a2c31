// minivllm's CPU kernels (chapter 18): the op table's native half, called through ctypes from kernels/cpu.py.
//
// Every op checks every shape and index it is given before it touches memory,
// and returns nonzero with a message (mv_last_error) instead of reading or
// writing out of bounds; Python raises it as a ValueError. Threads split the
// independent outputs (rows, heads, output features), never a sum, so a
// result does not depend on the thread count or on what else the machine runs; split-KV (split_kv.h) alone sums
// partials, in a fixed order cut by the thread count: the same bits every run for a given count.
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "few_rows.h"      // the few-row matvec loop (float32, Q8_0 here; Q4_1 in the inner unit)
#include "inner.h"
#include "inner_ops.h"     // the inner unit's loops: compiled with the inner loops the build names (exercise 18)
#include "int8_dot.h"      // the GGUF's blocks times 8-bit activations (llama.cpp's integer dot products)
#include "split_kv.h"      // a decode step's few rows over long contexts: keys split over the threads

using namespace minivllm;

namespace {

thread_local char error_message[512];

int fail(const char* fmt, long long a = 0, long long b = 0, long long c = 0) {
  std::snprintf(error_message, sizeof error_message, fmt, a, b, c);
  return 1;
}

constexpr int kNotWritten = 2;  // an inner loop is exercise 18's stub: Python raises NotImplementedError

int unwritten(const char* loop) {
  std::snprintf(error_message, sizeof error_message, "not written yet: %s", loop);
  return kNotWritten;
}

}  // namespace

extern "C" {

const char* mv_last_error() { return error_message; }

// k, v [T, row] (token t at t * k_stride, t * v_stride) into k_cache, v_cache [num_slots, row] at slot_mapping[T];
// slot -1 (a padding row) writes nothing.
int mv_write_kv(const float* k, int64_t k_stride, const float* v, int64_t v_stride, float* k_cache, float* v_cache,
                const int64_t* slots, int64_t T, int64_t row, int64_t num_slots) {
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < -1 || slots[t] >= num_slots)
      return fail("slot_mapping[%lld] is %lld: a slot must be -1 (write nothing) or in [0, %lld)", t, slots[t],
                  num_slots);
  }
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(k_cache + slots[t] * row, k + t * k_stride, row * sizeof(float));
    std::memcpy(v_cache + slots[t] * row, v + t * v_stride, row * sizeof(float));
  }
  return 0;
}

// Every row of a step through the paged cache (chapter 18): sequence b owns the queries
// query_start[b] .. query_start[b + 1] of q [T, H, D] (token t at t * q_stride), the last of its seq_lens[b]
// tokens, and reads its keys through block_table[b] [width]. The caches are [num_blocks * block_size (+ more), KVH, D].
// A decode step's few rows over long contexts split their keys over the threads by split_kv.h's rule.
int mv_paged_attention_chunked(float* out, const float* q, int64_t q_stride, const float* k_cache,
                               const float* v_cache, const int32_t* block_table, int64_t width,
                               const int32_t* seq_lens, const int32_t* query_start, int64_t B, int64_t T, int64_t H,
                               int64_t KVH, int64_t D, int64_t block_size, int64_t num_blocks, float scale,
                               int nthreads, int64_t chunk_keys);

int mv_paged_attention(float* out, const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                       const int32_t* block_table, int64_t width, const int32_t* seq_lens,
                       const int32_t* query_start, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                       int64_t block_size, int64_t num_blocks, float scale, int nthreads) {
  return mv_paged_attention_chunked(out, q, q_stride, k_cache, v_cache, block_table, width, seq_lens, query_start,
                                    B, T, H, KVH, D, block_size, num_blocks, scale, nthreads, 0);
}

// The rule's keys per chunk (split_kv.h), for Python's mirror of it to be checked against; whether this build
// splits at all (minivllm's own inner loops do, a reader's do not).
int64_t mv_split_kv_chunk_keys(int64_t rows, int64_t kv_heads, int64_t max_len, int64_t threads) {
  return split_kv_rule(rows, kv_heads, max_len, threads);
}
int mv_split_kv_built() { return kSplitKVBuilt ? 1 : 0; }

// mv_paged_attention with the chunk length given: chunk_keys 0 is the rule's, chunk_keys > 0 cuts a decode step's
// rows into chunks of that many keys (the chapter's split against unsplit, the tests' every number of chunks).
int mv_paged_attention_chunked(float* out, const float* q, int64_t q_stride, const float* k_cache,
                               const float* v_cache, const int32_t* block_table, int64_t width,
                               const int32_t* seq_lens, const int32_t* query_start, int64_t B, int64_t T, int64_t H,
                               int64_t KVH, int64_t D, int64_t block_size, int64_t num_blocks, float scale,
                               int nthreads, int64_t chunk_keys) {
  if (chunk_keys < 0) return fail("chunk_keys is %lld: 0 (the rule's) or a positive number of keys", chunk_keys);
  if (H < 1 || KVH < 1 || H % KVH != 0)  // H = 0 would pass H % KVH and divide by zero below
    return fail("query heads (%lld) must be a positive multiple of KV heads (%lld)", H, KVH);
  if (D < 1 || D > kMaxHeadDim) return fail("head_dim %lld: the kernel takes 1 to %lld", D, kMaxHeadDim);
  if (H / KVH > kMaxTile) return fail("%lld query heads per KV head: the kernel takes at most %lld", H / KVH,
                                      kMaxTile);
  if (block_size < 1 || block_size > kMaxBlockSize) return fail("block_size %lld is not in [1, %lld]", block_size,
                                                                kMaxBlockSize);
  if (query_start[0] != 0) return fail("query_start[0] is %lld, not 0", query_start[0]);
  if (query_start[B] != T) return fail("query_start[-1] is %lld, not the %lld query tokens", query_start[B], T);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = static_cast<int64_t>(query_start[b + 1]) - query_start[b];
    if (n < 0) return fail("query_start decreases at sequence %lld", b);
    if (n == 0) continue;
    if (seq_lens[b] < n) return fail("seq_lens[%lld] is %lld, fewer than its %lld queries", b, seq_lens[b], n);
    const int64_t blocks = (seq_lens[b] + block_size - 1) / block_size;
    if (blocks > width) return fail("seq_lens[%lld] is %lld: more blocks than block_table's %lld columns", b,
                                    seq_lens[b], width);
    for (int64_t j = 0; j < blocks; ++j) {
      const int32_t id = block_table[b * width + j];
      if (id < 0 || id >= num_blocks)
        return fail("block_table[%lld] holds block %lld, outside the pool's %lld blocks", b * width + j, id,
                    num_blocks);
    }
  }
  const int64_t split = split_kv_step(seq_lens, query_start, B, KVH, threads(nthreads), chunk_keys);
  if (split > 0) {
    attend_split(out, q, q_stride, k_cache, v_cache, block_table, width, seq_lens, query_start, B, H, KVH, D,
                 block_size, scale, threads(nthreads), split);
    return 0;
  }
  attend_rows(out, q, q_stride, k_cache, v_cache, block_table, width, seq_lens, query_start, B, H, KVH, D,
              block_size, scale, nthreads);
  return not_written.attend_tile ? unwritten("attend_tile") : 0;
}

// out [T, N] = RMSNorm(x [T, N]) * weight; out may be x.
int mv_rms_norm(float* out, const float* x, const float* weight, int64_t T, int64_t N, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(threads(T > 8 ? nthreads : 1))
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * N;
    float ss = 0.0f;
    for (int64_t i = 0; i < N; ++i) ss += row[i] * row[i];
    const float inv = 1.0f / std::sqrt(ss / N + eps);
    for (int64_t i = 0; i < N; ++i) out[t * N + i] = weight[i] * (row[i] * inv);
  }
  return 0;
}

// residual += x, then x = RMSNorm(residual) * weight: a decoder layer's residual add and its next norm in one pass.
int mv_fused_add_rms_norm(float* x, float* residual, const float* weight, int64_t T, int64_t N, float eps,
                          int nthreads) {
#pragma omp parallel for schedule(static) num_threads(threads(T > 8 ? nthreads : 1))
  for (int64_t t = 0; t < T; ++t) {
    float* r = residual + t * N;
    float* row = x + t * N;
    float ss = 0.0f;
    for (int64_t i = 0; i < N; ++i) {
      r[i] += row[i];
      ss += r[i] * r[i];
    }
    const float inv = 1.0f / std::sqrt(ss / N + eps);
    for (int64_t i = 0; i < N; ++i) row[i] = weight[i] * (r[i] * inv);
  }
  return 0;
}

// Rotary embedding in place, by positions (rotate-half, as Llama): q [T, H, D] and k [T, KVH, D], rows strided by
// q_stride and k_stride floats; cos and sin [max_position, D / 2].
int mv_rotary(float* q, int64_t q_stride, float* k, int64_t k_stride, const int64_t* positions, const float* cos,
              const float* sin, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t max_position, int nthreads) {
  for (int64_t t = 0; t < T; ++t) {
    if (positions[t] < 0 || positions[t] >= max_position)
      return fail("positions[%lld] is %lld, outside the rotary table's [0, %lld)", t, positions[t], max_position);
  }
  const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(threads(T > 8 ? nthreads : 1))
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos + positions[t] * half;
    const float* s = sin + positions[t] * half;
    for (int64_t h = 0; h < H + KVH; ++h) {
      float* x = h < H ? q + t * q_stride + h * D : k + t * k_stride + (h - H) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
  }
  return 0;
}

// out [T, I] = silu(x[:, :I]) * x[:, I:] for x [T, 2I].
int mv_silu_and_mul(float* out, const float* x, int64_t T, int64_t I, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(threads(T * I > 16384 ? nthreads : 1))
  for (int64_t t = 0; t < T; ++t) {
    const float* gate = x + t * 2 * I;
    const float* up = gate + I;
    float* o = out + t * I;
    int64_t i = 0;
    for (; i + kLanes <= I; i += kLanes) {
      const fvec g = load(gate + i);
      store(o + i, g / (1.0f + exp_lanes(-g)) * load(up + i));
      // exp_lanes stops at exp(88): a gate below -88 (or -inf) is redone as the scalar tail does, where exp(-gate)
      // grows to inf as the reference's does (silu(-100) is -0, silu(-inf) NaN, even times an up of 1e38)
      for (int j = 0; j < kLanes; ++j)
        if (g[j] < -88.0f) o[i + j] = gate[i + j] / (1.0f + std::exp(-gate[i + j])) * up[i + j];
    }
    for (; i < I; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
  return 0;
}

}  // extern "C"

namespace {

int check_rows(int64_t R) {
  if (R < 1 || R > kMaxRows) return fail("the kernel takes 1 to %lld rows, got %lld", kMaxRows, R);
  return 0;
}

}  // namespace

extern "C" {

// out [R, N] = x [R, K] @ weight [N, K]^T (+ bias): float32 weights streamed once for every row.
int mv_linear_f32(float* out, const float* x, const float* weight, const float* bias, int64_t R, int64_t N, int64_t K,
                  int nthreads) {
  if (check_rows(R)) return 1;
  if (K % kLanes != 0) return fail("in_features %lld: the kernel takes multiples of %lld", K, kLanes);
  few_rows(out, bias, R, N, K, kLanes, nthreads, [&](int64_t n, int64_t kb, int rows, fvec* acc) {
    const fvec w = load(weight + n * K + kb * kLanes);
    for (int r = 0; r < rows; ++r) acc[r] += w * load(x + r * K + kb * kLanes);
  });
  return 0;
}

// out [R, N] = x [R, K] @ W^T (+ bias), W in the GGUF's Q4_1 blocks: [N, K / 32 blocks of 20 bytes].
int mv_q4_1_linear(float* out, const float* x, const uint8_t* weight, const float* bias, int64_t R, int64_t N,
                   int64_t K, int nthreads) {
  if (check_rows(R)) return 1;
  if (K % kBlockQ != 0) return fail("in_features %lld: Q4_1 rows are whole blocks of %lld", K, kBlockQ);
  q4_1_rows(out, x, weight, bias, R, N, K, nthreads);
  return not_written.q4_1_block_dot ? unwritten("q4_1_block_dot") : 0;
}

// out [R, N] = x [R, K] @ W^T (+ bias), W in the GGUF's Q8_0 blocks: [N, K / 32 blocks of 34 bytes].
int mv_q8_0_linear(float* out, const float* x, const uint8_t* weight, const float* bias, int64_t R, int64_t N,
                   int64_t K, int nthreads) {
  if (check_rows(R)) return 1;
  if (K % kBlockQ != 0) return fail("in_features %lld: Q8_0 rows are whole blocks of %lld", K, kBlockQ);
  const int64_t row_bytes = K / kBlockQ * kQ8_0Bytes;
  few_rows(out, bias, R, N, K, kBlockQ, nthreads, [&](int64_t n, int64_t kb, int rows, fvec* acc) {
    const uint8_t* block = weight + n * row_bytes + kb * kQ8_0Bytes;
    const float d = half_to_float(read_u16(block));
    for (int c = 0; c < kBlockQ; c += kLanes) {
      const fvec w = to_float(load_signed_bytes(block + 2 + c)) * d;
      for (int r = 0; r < rows; ++r) acc[r] += w * load(x + r * K + kb * kBlockQ + c);
    }
  });
  return 0;
}

// out [T, K] = the rows ids[T] of a Q8_0 table [V, K / 32 blocks], dequantised (the tied embedding as stored).
int mv_q8_0_embedding(float* out, const int64_t* ids, const uint8_t* table, int64_t T, int64_t V, int64_t K) {
  if (K % kBlockQ != 0) return fail("embedding width %lld: Q8_0 rows are whole blocks of %lld", K, kBlockQ);
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= V) return fail("ids[%lld] is %lld, outside the vocabulary's [0, %lld)", t, ids[t], V);
  const int64_t row_bytes = K / kBlockQ * kQ8_0Bytes;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t kb = 0; kb < K / kBlockQ; ++kb) {
      const uint8_t* block = table + ids[t] * row_bytes + kb * kQ8_0Bytes;
      const float d = half_to_float(read_u16(block));
      for (int j = 0; j < kBlockQ; ++j) out[t * K + kb * kBlockQ + j] = static_cast<int8_t>(block[2 + j]) * d;
    }
  }
  return 0;
}

}  // extern "C"

// The GGUF's blocks times 8-bit activations (int8_dot.h): each row of x rounded once to Q8_1 blocks, then integer
// dot products with every weight block, the block scales applied once a block.
namespace {

int check_int8(int64_t R, int64_t K) {
  if (R < 0) return fail("x has %lld rows", R);
  if (K < 0 || K % kBlockQ != 0) return fail("in_features %lld: 8-bit rows are whole blocks of %lld", K, kBlockQ);
  return 0;
}

// x [R, K] rounded to Q8_1 and unpacked for the dot products: quants, and each block's d and s as floats.
struct Int8Buffer {
  std::vector<uint8_t> blocks;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  Int8Rows rows;
  Int8Buffer(const float* x, int64_t R, int64_t K)
      : blocks(R * (K / kBlockQ) * kQ8_1Bytes), q(R * K), d(R * (K / kBlockQ)), s(R * (K / kBlockQ)) {
    const int64_t nb = K / kBlockQ;
    for (int64_t r = 0; r < R; ++r) {
      quantize_row_q8_1(x + r * K, K, blocks.data() + r * nb * kQ8_1Bytes);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = blocks.data() + (r * nb + b) * kQ8_1Bytes;
        d[r * nb + b] = half_to_float(read_u16(block));
        s[r * nb + b] = half_to_float(read_u16(block + 2));
        std::memcpy(q.data() + r * K + b * kBlockQ, block + 4, kBlockQ);
      }
    }
    rows = Int8Rows{q.data(), d.data(), s.data(), K, nb};
  }
};

}  // namespace

extern "C" {

// Which integer dot product this build runs: "avx512-vnni", "avx-vnni", "avx2-maddubs" or "scalar".
const char* mv_int8_dot_kind() { return int8_dot_kind(); }

// out [R, K / 32 * 36] = x [R, K] as llama.cpp's Q8_1 blocks (fp16 d, fp16 s, 32 int8).
int mv_quantize_q8_1(uint8_t* out, const float* x, int64_t R, int64_t K) {
  if (check_int8(R, K)) return 1;
  for (int64_t r = 0; r < R; ++r) quantize_row_q8_1(x + r * K, K, out + r * (K / kBlockQ) * kQ8_1Bytes);
  return 0;
}

// out [R, N] = Q8_1(x [R, K]) @ W^T (+ bias), W in Q4_1 blocks [N, K / 32 blocks of 20 bytes]: llama.cpp's
// ggml_vec_dot_q4_1_q8_1 for every output.
int mv_q4_1_q8_1_linear(float* out, const float* x, const uint8_t* weight, const float* bias, int64_t R, int64_t N,
                        int64_t K, int nthreads) {
  if (check_rows(R) || check_int8(R, K)) return 1;
  Int8Buffer xq(x, R, K);
  int8_matvec_rows<true>(out, weight, bias, R, N, xq.rows, threads(nthreads));
  return 0;
}

// out [R, N] = Q8_0(x [R, K]) @ W^T (+ bias), W in Q8_0 blocks [N, K / 32 blocks of 34 bytes]: llama.cpp's
// ggml_vec_dot_q8_0_q8_0 (the row's Q8_0 blocks are its Q8_1 blocks without s).
int mv_q8_0_q8_0_linear(float* out, const float* x, const uint8_t* weight, const float* bias, int64_t R, int64_t N,
                        int64_t K, int nthreads) {
  if (check_rows(R) || check_int8(R, K)) return 1;
  Int8Buffer xq(x, R, K);
  int8_matvec_rows<false>(out, weight, bias, R, N, xq.rows, threads(nthreads));
  return 0;
}

}  // extern "C"

#include "prefill.h"  // a step's prompt rows in tiles (after fail() and threads(), which it uses)
#include "layer.h"  // a decode step's decoder layers in one call, through the kernels above (chapter 18)
