// The inner unit (chapter 18): compiled for each file of inner loops the build names (-DMINIVLLM_INNER: inner.cpp,
// minivllm's own, or a reader's), with only the two loops that call them, so the compiler sees both in this unit
// and inlines attend_tile into the tile loop and q4_1_block_dot into the Q4_1 matvec. Everything else (ops.cpp)
// is compiled once and linked with it (inner_ops.h).
#include <omp.h>

#include <algorithm>
#include <vector>

#include "inner.h"
#include MINIVLLM_INNER  // the inner loops: inner.cpp, or a reader's (exercise 18)
#include "few_rows.h"
#include "inner_ops.h"

namespace minivllm {

NotWritten not_written;

#if defined(MINIVLLM_OWN_INNER)
const bool kSplitKVBuilt = true;
#else
const bool kSplitKVBuilt = false;
#endif

void attend_rows(float* out, const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                 const int32_t* block_table, int64_t width, const int32_t* seq_lens, const int32_t* query_start,
                 int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, int nthreads) {
  const int64_t G = H / KVH;
  const int64_t tile_rows = std::max<int64_t>(1, std::min<int64_t>(16, kMaxTile / G));
  struct Task { int64_t b, head, first, rows; };
  std::vector<Task> tasks;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = query_start[b + 1] - query_start[b];
    for (int64_t first = 0; first < n; first += tile_rows)
      for (int64_t g = 0; g < KVH; ++g) tasks.push_back({b, g, first, std::min(tile_rows, n - first)});
  }
  const int64_t count = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads(nthreads))
  for (int64_t i = 0; i < count; ++i) {
    const Task& task = tasks[i];
    const int64_t n = query_start[task.b + 1] - query_start[task.b];
    const int64_t token = query_start[task.b] + task.first;
    int64_t pos[kMaxTile];
    for (int64_t r = 0; r < task.rows; ++r) pos[r] = seq_lens[task.b] - n + task.first + r;
    AttentionTile tile{q + token * q_stride + task.head * G * D, q_stride, pos, static_cast<int>(task.rows),
                       static_cast<int>(G), k_cache + task.head * D, v_cache + task.head * D, KVH * D,
                       block_table + task.b * width, static_cast<int>(block_size), static_cast<int>(D), scale,
                       out + (token * H + task.head * G) * D, H * D};
    attend_tile(tile);
  }
}

void q4_1_rows(float* out, const float* x, const uint8_t* weight, const float* bias, int64_t R, int64_t N,
               int64_t K, int nthreads) {
  const int64_t row_bytes = K / kBlockQ * kQ4_1Bytes;
  few_rows(out, bias, R, N, K, kBlockQ, nthreads, [&](int64_t n, int64_t kb, int rows, fvec* acc) {
    q4_1_block_dot(weight + n * row_bytes + kb * kQ4_1Bytes, x + kb * kBlockQ, K, rows, acc);
  });
}

}  // namespace minivllm
