// Split-KV (flash-decoding) for a decode step's few rows over long contexts (chapter 18c).
//
// A decode step gives the paged attention one query token per row, so its work items are rows x KV heads: a
// batch-1 decode of SmolLM2 (3 KV heads) has 3, whatever the thread count. Here each (row, KV head)'s keys are cut
// into chunks of `chunk_keys` keys; each chunk is one work item, an online-softmax partial over its keys only
// (per query head: the maximum m, the sum l of exp(score - m), the values weighted by those exps, not divided).
// The partials of a (row, KV head) are then merged in key order, chunk 0 first (the merge chapter 18 teaches):
// M = max m_c, L = sum l_c exp(m_c - M), out = sum acc_c exp(m_c - M) / L. Each partial is one thread's
// deterministic loop and the merge order is fixed, so the same input and thread count give the same bits on
// every run; another thread count may cut other chunks, and the last bits of the output may differ.
//
// The partial loop is minivllm's own, beside inner.cpp's attend_tile: a build of a reader's inner loops (exercise
// 18, which defines no MINIVLLM_OWN_INNER) attends every row through the reader's attend_tile, unsplit. The inner
// unit, compiled with the inner loops, says which (kSplitKVBuilt, inner_ops.h).
#pragma once
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "inner.h"
#include "inner_ops.h"

namespace minivllm {

constexpr int64_t kSplitMinKeys = 128;  // no chunk shorter: below, a work item is too small to pay for a merge
constexpr int64_t kSplitGranule = 16;   // chunk lengths are multiples of 16 keys (whole vectors on every build)

inline int64_t split_gcd(int64_t a, int64_t b) {
  while (b) {
    const int64_t r = a % b;
    a = b;
    b = r;
  }
  return a;
}

// The rule (chapter 18c; kernels/cpu.py's split_kv_chunk_keys mirrors it): the keys per chunk of a decode step of
// `rows` rows, the longest `max_len` keys, over `threads` threads; max_len itself when the step is not split.
// The step's items = rows x kv_heads. Split only where the threads would wait: fewer than two items a thread
// and not a multiple of the threads. Then the fewest chunks that give every thread the same number of equal
// chunks, threads / gcd(items, threads), no chunk shorter than kSplitMinKeys, lengths rounded up to kSplitGranule.
inline int64_t split_kv_rule(int64_t rows, int64_t kv_heads, int64_t max_len, int64_t threads) {
  const int64_t items = rows * kv_heads;
  if (threads < 2 || items < 1 || max_len < 1 || items >= 2 * threads || items % threads == 0) return max_len;
  int64_t chunks = threads / split_gcd(items, threads);
  if (chunks > max_len / kSplitMinKeys) chunks = max_len / kSplitMinKeys;
  if (chunks < 2) return max_len;
  const int64_t keys = (max_len + chunks - 1) / chunks;
  return (keys + kSplitGranule - 1) / kSplitGranule * kSplitGranule;
}

inline float split_dot(const float* a, const float* b, int D) {
  fvec s = splat(0.0f);
  int d = 0;
  for (; d + kLanes <= D; d += kLanes) s += load(a + d) * load(b + d);
  float r = hsum(s);
  for (; d < D; ++d) r += a[d] * b[d];
  return r;
}

// One chunk: the G query vectors q + i * D (the heads sharing one KV head) against keys k0 .. k1 - 1 of a
// sequence (key t in slot table[t / block_size] * block_size + t % block_size; its vector at
// k_cache + slot * kv_stride, its value v_cache the same). Writes m[G], l[G] and acc[G * D] (not divided).
inline void attend_partial(const float* q, int G, int D, const float* k_cache, const float* v_cache, int64_t kv_stride,
                           const int32_t* table, int64_t block_size, int64_t k0, int64_t k1, float scale, float* m,
                           float* l, float* acc) {
  alignas(64) float scores[kMaxTile][kLanes];
  const float* vrow[kLanes];
  for (int i = 0; i < G; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
    for (int d = 0; d < D; ++d) acc[i * D + d] = 0.0f;
  }
  ivec lane;
  for (int j = 0; j < kLanes; ++j) lane[j] = j;
  for (int64_t t0 = k0; t0 < k1; t0 += kLanes) {
    const int kn = static_cast<int>(k1 - t0 < kLanes ? k1 - t0 : kLanes);
    for (int j = 0; j < kn; ++j) {
      const int64_t key = t0 + j;
      const int64_t slot = static_cast<int64_t>(table[key / block_size]) * block_size + key % block_size;
      const float* krow = k_cache + slot * kv_stride;
      vrow[j] = v_cache + slot * kv_stride;
      for (int i = 0; i < G; ++i) scores[i][j] = split_dot(q + i * D, krow, D);
    }
    for (int i = 0; i < G; ++i) {
      const fvec s = lane < kn ? load(scores[i]) * scale : splat(-INFINITY);  // lanes past the chunk: weight 0
      float chunk_max = -INFINITY;
      for (int j = 0; j < kLanes; ++j) chunk_max = s[j] > chunk_max ? s[j] : chunk_max;
      const float new_max = chunk_max > m[i] ? chunk_max : m[i];
      const float rescale = new_max == -INFINITY ? 1.0f : std::exp(m[i] - new_max);
      const fvec p = new_max == -INFINITY ? splat(0.0f) : exp_lanes(s - new_max);
      l[i] = l[i] * rescale + hsum(p);
      m[i] = new_max;
      float* a = acc + i * D;
      int d = 0;
      for (; d + kLanes <= D; d += kLanes) {
        fvec sum = load(a + d) * rescale;
        for (int j = 0; j < kn; ++j) sum += p[j] * load(vrow[j] + d);
        store(a + d, sum);
      }
      for (; d < D; ++d) {
        float sum = a[d] * rescale;
        for (int j = 0; j < kn; ++j) sum += p[j] * vrow[j][d];
        a[d] = sum;
      }
    }
  }
}

// The chunk length a step is attended with: 0 where it is not split (a build of a reader's loops, a step with a
// sequence of more than one query, or the rule's whole length), else the keys per chunk. `forced` > 0 replaces
// the rule's length (mv_paged_attention_chunked: the chapter's comparison, the tests).
inline int64_t split_kv_step(const int32_t* seq_lens, const int32_t* query_start, int64_t B, int64_t KVH, int nthreads,
                             int64_t forced) {
  if (!kSplitKVBuilt) return 0;
  int64_t rows = 0, max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = static_cast<int64_t>(query_start[b + 1]) - query_start[b];
    if (n > 1) return 0;
    if (n == 1) {
      ++rows;
      max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    }
  }
  const int64_t keys = forced > 0 ? forced : split_kv_rule(rows, KVH, max_len, nthreads);
  return rows == 0 || keys >= max_len ? 0 : keys;
}

// A decode step (one query per row; lengths, tables and shapes checked by the caller) with each row's keys cut
// into chunks of `chunk_keys`: the partials over the threads, round robin in the order row, KV head, chunk
// (schedule(static, 1): item i on thread i % threads), then each (row, KV head)'s merge in chunk order.
inline void attend_split(float* out, const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                         const int32_t* block_table, int64_t width, const int32_t* seq_lens, const int32_t* query_start,
                         int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, int nthreads,
                         int64_t chunk_keys) {
  const int64_t G = H / KVH, part = G * (D + 2);  // a partial: m[G], l[G], acc[G * D]
  struct Item { int64_t b, head, k0, k1; };
  struct Merge { int64_t b, head, first, count; };
  std::vector<Item> items;
  std::vector<Merge> merges;
  for (int64_t b = 0; b < B; ++b) {
    if (query_start[b + 1] == query_start[b]) continue;
    for (int64_t g = 0; g < KVH; ++g) {
      const int64_t first = static_cast<int64_t>(items.size());
      for (int64_t k0 = 0; k0 < seq_lens[b]; k0 += chunk_keys)
        items.push_back({b, g, k0, std::min<int64_t>(k0 + chunk_keys, seq_lens[b])});
      merges.push_back({b, g, first, static_cast<int64_t>(items.size()) - first});
    }
  }
  std::vector<float> parts(items.size() * part);
  const int64_t count = static_cast<int64_t>(items.size()), heads = static_cast<int64_t>(merges.size());
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1)
  {
#pragma omp for schedule(static, 1)
    for (int64_t i = 0; i < count; ++i) {
      const Item& it = items[i];
      float* p = parts.data() + i * part;
      attend_partial(q + query_start[it.b] * q_stride + it.head * G * D, static_cast<int>(G), static_cast<int>(D),
                     k_cache + it.head * D, v_cache + it.head * D, KVH * D, block_table + it.b * width, block_size,
                     it.k0, it.k1, scale, p, p + G, p + 2 * G);
    }
#pragma omp for schedule(static)
    for (int64_t j = 0; j < heads; ++j) {
      const Merge& mg = merges[j];
      float* o = out + (query_start[mg.b] * H + mg.head * G) * D;
      for (int64_t i = 0; i < G; ++i) {
        float top = -INFINITY;
        for (int64_t c = 0; c < mg.count; ++c) {
          const float mc = parts[(mg.first + c) * part + i];
          top = mc > top ? mc : top;
        }
        float total = 0.0f;
        for (int64_t d = 0; d < D; ++d) o[i * D + d] = 0.0f;
        for (int64_t c = 0; c < mg.count; ++c) {
          const float* p = parts.data() + (mg.first + c) * part;
          const float w = top == -INFINITY ? 0.0f : std::exp(p[i] - top);  // exp(m_c - M): the chunk's rescale
          total += p[G + i] * w;
          const float* a = p + 2 * G + i * D;
          for (int64_t d = 0; d < D; ++d) o[i * D + d] += a[d] * w;
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < D; ++d) o[i * D + d] *= inv;
      }
    }
  }
}

}  // namespace minivllm
