// The few-row matvec loop (chapter 18): out [R, N] (+)= x [R, K] @ W^T for 1 to kMaxRows rows, one weight block at
// a time. ops.cpp runs it for float32 and Q8_0 weights, inner_ops.cpp for Q4_1 (its block dot is the reader's).
#pragma once
#include <omp.h>

#include <cstdint>

#include "inner.h"

namespace minivllm {

inline int threads(int requested) { return requested > 0 ? requested : 1; }

// out [R, N] (+)= x [R, K] @ W^T for few rows, where `dot_block(n, kb, rows, acc)` adds weight row n's block kb of
// `per_block` weights times every row of x to acc. Each thread takes a run of output features. R is a template
// argument so the compiler keeps each row's partial sums in registers.
template <int R, typename DotBlock>
void few_rows_matvec(float* out, const float* bias, int64_t N, int64_t K, int per_block, int nthreads,
                     DotBlock dot_block) {
  constexpr int NB = R == 1 ? 4 : R == 2 ? 2 : 1;  // output features at once: independent sums, more loads in flight
  const int64_t blocks = K / per_block, groups = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(threads(nthreads))
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n0 = g * NB, nb = N - n0 < NB ? N - n0 : NB;
    fvec acc[NB][R];
    for (int i = 0; i < NB; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] = splat(0.0f);
    if (nb == NB) {
      for (int64_t kb = 0; kb < blocks; ++kb)
        for (int i = 0; i < NB; ++i) dot_block(n0 + i, kb, R, acc[i]);
    } else {
      for (int64_t kb = 0; kb < blocks; ++kb)
        for (int i = 0; i < nb; ++i) dot_block(n0 + i, kb, R, acc[i]);
    }
    for (int i = 0; i < nb; ++i)
      for (int r = 0; r < R; ++r) out[r * N + n0 + i] = hsum(acc[i][r]) + (bias ? bias[n0 + i] : 0.0f);
  }
}

template <typename DotBlock>
void few_rows(float* out, const float* bias, int64_t R, int64_t N, int64_t K, int per_block, int nthreads,
              DotBlock dot_block) {
  switch (R) {
    case 1: return few_rows_matvec<1>(out, bias, N, K, per_block, nthreads, dot_block);
    case 2: return few_rows_matvec<2>(out, bias, N, K, per_block, nthreads, dot_block);
    case 3: return few_rows_matvec<3>(out, bias, N, K, per_block, nthreads, dot_block);
    case 4: return few_rows_matvec<4>(out, bias, N, K, per_block, nthreads, dot_block);
    case 5: return few_rows_matvec<5>(out, bias, N, K, per_block, nthreads, dot_block);
    case 6: return few_rows_matvec<6>(out, bias, N, K, per_block, nthreads, dot_block);
    case 7: return few_rows_matvec<7>(out, bias, N, K, per_block, nthreads, dot_block);
    default: return few_rows_matvec<8>(out, bias, N, K, per_block, nthreads, dot_block);
  }
}

}  // namespace minivllm
