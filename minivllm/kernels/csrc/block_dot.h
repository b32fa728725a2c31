// Exercise 18b's header: one Q4_1 weight block times one Q8_1 activation block in integers (chapter 18b).
//
// The reader's file (your_engine/int8_block_dot.cpp) includes this one and defines the three functions declared
// below; it is built alone into a small shared library (no ops.cpp, no OpenMP: a build takes about a second) and
// loaded with ctypes by minivllm.exercises.native.build_block_dot. The layouts are the GGUF's and llama.cpp's:
//
//   Q4_1 (20 bytes): fp16 d_w, fp16 m_w, 16 bytes qs; byte j holds weight j in its low 4 bits and weight j + 16
//                    in its high 4 bits; weight = d_w * q + m_w, q in 0 .. 15.
//   Q8_1 (36 bytes): fp16 d_a, fp16 s_a = d_a * sum(q_a) (rounded to fp16), then 32 int8 q_a in -127 .. 127;
//                    activation = d_a * q_a.
//
// half_to_float and read_u16 come from inner.h (through int8_dot.h), as do kQ4_1Bytes and kQ8_1Bytes.
#pragma once
#include <cstdint>

#include "int8_dot.h"

using minivllm::half_to_float;
using minivllm::kBlockQ;
using minivllm::kQ4_1Bytes;
using minivllm::kQ8_1Bytes;
using minivllm::read_u16;

extern "C" {
// sum_j q_w[j] * q_a[j] over the block's 32 weights: an integer, exact (|sum| <= 32 * 15 * 127 = 60,960).
int32_t q4_1_q8_1_isum_scalar(const uint8_t* w_block, const uint8_t* a_block);
// The same sum with AVX2's _mm256_maddubs_epi16 and _mm256_madd_epi16 (where the build has AVX2; else the
// scaffold calls the scalar loop).
int32_t q4_1_q8_1_isum_avx2(const uint8_t* w_block, const uint8_t* a_block);
// The block's share of the dot product of the float weights and activations: d_w * d_a * isum + m_w * s_a.
float q4_1_q8_1_block_dot(const uint8_t* w_block, const uint8_t* a_block);

// Which functions are still the exercise's stub (bit 1: isum_scalar, 2: isum_avx2, 4: block_dot), once called.
int mv18b_not_written(void);
// "avx2" where the build has AVX2 (so isum_avx2's intrinsics are compiled), else "scalar".
const char* mv18b_isa(void);
}

// A function not written yet (exercise 18b's stub): MINIVLLM_NOT_WRITTEN(q4_1_q8_1_isum_scalar) marks it and
// returns 0; the check calls each function once, then asks mv18b_not_written() which are still stubs.
enum : int { kStub_q4_1_q8_1_isum_scalar = 1, kStub_q4_1_q8_1_isum_avx2 = 2, kStub_q4_1_q8_1_block_dot = 4 };
static int mv18b_stubs = 0;
#undef MINIVLLM_NOT_WRITTEN
#define MINIVLLM_NOT_WRITTEN(fn) \
  do {                           \
    mv18b_stubs |= kStub_##fn;   \
    return {};                   \
  } while (0)

extern "C" int mv18b_not_written(void) { return mv18b_stubs; }
extern "C" const char* mv18b_isa(void) {
#if defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}
