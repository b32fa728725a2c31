// What the inner unit (inner_ops.cpp, compiled with the inner loops) gives the rest of the library (chapter 18).
//
// A build compiles ops.cpp and its headers once into an object file, and for each file of inner loops only
// inner_ops.cpp: the two loops that call attend_tile and q4_1_block_dot, with them inlined. Hidden: each library
// has its own (minivllm's and a reader's may be loaded in one process).
#pragma once
#include <cstdint>

#define MINIVLLM_HIDDEN __attribute__((visibility("hidden")))

namespace minivllm {

// Every row of a step through attend_tile, unsplit: tiles of up to 16 rows of a sequence times the query heads of
// one KV head, over the threads (mv_paged_attention_chunked's arguments, checked by it).
MINIVLLM_HIDDEN void attend_rows(float* out, const float* q, int64_t q_stride, const float* k_cache,
                                 const float* v_cache, const int32_t* block_table, int64_t width,
                                 const int32_t* seq_lens, const int32_t* query_start, int64_t B, int64_t H,
                                 int64_t KVH, int64_t D, int64_t block_size, float scale, int nthreads);

// out [R, N] = x [R, K] @ W^T (+ bias), W in Q4_1 blocks, through q4_1_block_dot (mv_q4_1_linear's, checked by it).
MINIVLLM_HIDDEN void q4_1_rows(float* out, const float* x, const uint8_t* weight, const float* bias, int64_t R,
                               int64_t N, int64_t K, int nthreads);

// Whether the inner loops are minivllm's own inner.cpp (it defines MINIVLLM_OWN_INNER): only then may a decode
// step split its keys over the threads (split_kv.h).
extern MINIVLLM_HIDDEN const bool kSplitKVBuilt;

}  // namespace minivllm
