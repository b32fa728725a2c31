// A decode step's decoder layers in one native call (chapter 18): the op-by-op path's kernels, called from C++.
//
// A few-row decode step (1 to kMaxRows rows, each a sequence's one new token) runs, for every layer, the same
// extern "C" kernels the op table calls one by one from Python, with the same arguments in the same order:
// rms_norm (the first layer) or fused_add_rms_norm (the residual add carried from the layer before), the fused
// q/k/v matmul, rotary, write_kv, paged_attention, o_proj, fused_add_rms_norm, the fused gate/up matmul,
// silu_and_mul, down; then the final norm. So its output equals the op-by-op path's bit for bit, and the
// Python wrappers (a ctypes call, its checks, a torch tensor for each output: 10-15 us an op) leave the loop.
// The weights' addresses come in a DecodeModel built once per model (kernels/fused.py); the step's metadata
// (positions, slots, block tables, lengths) is the same for every layer, so it is checked once, before any
// memory is written. Included at the end of ops.cpp, after the kernels it calls.
#pragma once

namespace minivllm {

// A matmul of the step: which kernel (the one Linear's rule picks for a few rows), its weight, bias, shape.
enum MatmulKind : int64_t { kLinearF32 = 0, kQ4_1F32 = 1, kQ8_0F32 = 2, kQ4_1Q8_1 = 3, kQ8_0Q8_0 = 4 };

struct DecodeMatmul {
  int64_t kind;        // MatmulKind
  const void* weight;  // float32 [N, K], or the GGUF's blocks [N, K / 32 * bytes]
  const float* bias;   // [N] or null
  int64_t N, K;
};

struct DecodeLayer {
  const float* input_norm;  // [hidden]
  const float* post_norm;   // [hidden]
  DecodeMatmul qkv;         // [(H + 2 KVH) * D, hidden]
  DecodeMatmul o;           // [hidden, H * D]
  DecodeMatmul gate_up;     // [2 * I, hidden]
  DecodeMatmul down;        // [hidden, I]
};

struct DecodeModel {
  int64_t layers, hidden, heads, kv_heads, head_dim, intermediate;
  double eps;                  // the norms' epsilon (passed to them as a float, as from Python)
  const float* cos;            // [max_position, D / 2]
  const float* sin;
  int64_t max_position;
  const float* final_norm;     // [hidden]
  const DecodeLayer* layer;    // [layers]
};

}  // namespace minivllm

namespace {

using minivllm::DecodeMatmul;

int decode_matmul(const DecodeMatmul& m, float* out, const float* x, int64_t R, int nthreads) {
  const auto* w = static_cast<const uint8_t*>(m.weight);
  switch (m.kind) {
    case minivllm::kLinearF32:
      return mv_linear_f32(out, x, static_cast<const float*>(m.weight), m.bias, R, m.N, m.K, nthreads);
    case minivllm::kQ4_1F32: return mv_q4_1_linear(out, x, w, m.bias, R, m.N, m.K, nthreads);
    case minivllm::kQ8_0F32: return mv_q8_0_linear(out, x, w, m.bias, R, m.N, m.K, nthreads);
    case minivllm::kQ4_1Q8_1: return mv_q4_1_q8_1_linear(out, x, w, m.bias, R, m.N, m.K, nthreads);
    case minivllm::kQ8_0Q8_0: return mv_q8_0_q8_0_linear(out, x, w, m.bias, R, m.N, m.K, nthreads);
    default: return fail("a matmul of kind %lld: not one of the decode step's kernels", m.kind);
  }
}

int check_matmul(const DecodeMatmul& m, int64_t N, int64_t K, int64_t layer) {
  if (m.weight == nullptr || m.N != N || m.K != K)
    return fail("layer %lld: a matmul's weight is missing or not [%lld, %lld]", layer, N, K);
  if (m.kind < minivllm::kLinearF32 || m.kind > minivllm::kQ8_0Q8_0)
    return fail("layer %lld: a matmul of kind %lld", layer, m.kind);
  const int64_t unit = m.kind == minivllm::kLinearF32 ? minivllm::kLanes : minivllm::kBlockQ;
  if (K % unit != 0) return fail("layer %lld: in_features %lld are not whole vectors of %lld", layer, K, unit);
  return 0;
}

// Everything the kernels below would check, checked once for the whole step before any of them writes.
int check_step(const minivllm::DecodeModel* m, const int64_t* positions, const int64_t* slots,
               const int32_t* block_table, int64_t width, const int32_t* seq_lens, const int32_t* query_start,
               int64_t T, int64_t num_slots, int64_t block_size) {
  using namespace minivllm;
  if (m == nullptr || m->layer == nullptr || m->layers < 1) return fail("the model has no layers");
  if (T < 1 || T > kMaxRows) return fail("a fused decode step takes 1 to %lld rows, got %lld", kMaxRows, T);
  const int64_t H = m->heads, KVH = m->kv_heads, D = m->head_dim;
  if (H < 1 || KVH < 1 || H % KVH != 0 || H / KVH > kMaxTile)
    return fail("%lld query heads over %lld KV heads: not a positive multiple the kernel takes", H, KVH);
  if (D < 2 || D % 2 != 0 || D > kMaxHeadDim) return fail("head_dim %lld is not even and in [2, %lld]", D,
                                                           kMaxHeadDim);
  if (m->hidden < 1 || m->intermediate < 1) return fail("hidden %lld or intermediate %lld is not positive",
                                                        m->hidden, m->intermediate);
  if (block_size < 1 || block_size > kMaxBlockSize) return fail("block_size %lld is not in [1, %lld]", block_size,
                                                                kMaxBlockSize);
  for (int64_t l = 0; l < m->layers; ++l) {
    const DecodeLayer& L = m->layer[l];
    if (!L.input_norm || !L.post_norm) return fail("layer %lld has no norm weights", l);
    if (check_matmul(L.qkv, (H + 2 * KVH) * D, m->hidden, l) || check_matmul(L.o, m->hidden, H * D, l) ||
        check_matmul(L.gate_up, 2 * m->intermediate, m->hidden, l) ||
        check_matmul(L.down, m->hidden, m->intermediate, l))
      return 1;
  }
  for (int64_t t = 0; t < T; ++t) {
    if (positions[t] < 0 || positions[t] >= m->max_position)
      return fail("positions[%lld] is %lld, outside the rotary table's [0, %lld)", t, positions[t], m->max_position);
    if (slots[t] < -1 || slots[t] >= num_slots)
      return fail("slot_mapping[%lld] is %lld: a slot must be -1 (write nothing) or in [0, %lld)", t, slots[t],
                  num_slots);
    if (query_start[t] != t || query_start[t + 1] != t + 1)
      return fail("query_start[%lld] is %lld: a decode step has one query a sequence", t, query_start[t]);
    if (seq_lens[t] < 1) return fail("seq_lens[%lld] is %lld: a decode row sees its own key", t, seq_lens[t]);
    const int64_t blocks = (seq_lens[t] + block_size - 1) / block_size;
    if (blocks > width) return fail("seq_lens[%lld] is %lld: more blocks than block_table's %lld columns", t,
                                    seq_lens[t], width);
    for (int64_t j = 0; j < blocks; ++j) {
      const int32_t id = block_table[t * width + j];
      if (id < 0 || id >= num_slots / block_size)
        return fail("block_table[%lld] holds block %lld, outside the pool's %lld blocks", t * width + j, id,
                    num_slots / block_size);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// hidden [T, hidden] = the final norm of the decoder layers over x [T, hidden] (the embedded tokens; used as the
// residual stream, so overwritten) for a decode step of T rows (row t: sequence t's token at positions[t], its
// KV written to slots[t], attending to its seq_lens[t] keys through block_table [T, width]). k_slots and v_slots
// are the pools, [layers, num_slots, KVH, D]. Returns nonzero (mv_last_error) before any write on bad input.
int mv_decode_step(const minivllm::DecodeModel* m, float* hidden, float* x, const int64_t* positions,
                   const int64_t* slots, const int32_t* block_table, int64_t width, const int32_t* seq_lens,
                   const int32_t* query_start, int64_t T, float* k_slots, float* v_slots, int64_t num_slots,
                   int64_t block_size, int nthreads) {
  if (check_step(m, positions, slots, block_table, width, seq_lens, query_start, T, num_slots, block_size))
    return 1;
  const int64_t H = m->heads, KVH = m->kv_heads, D = m->head_dim, E = m->hidden, I = m->intermediate;
  const int64_t row = (H + 2 * KVH) * D, kv_row = KVH * D, layer_floats = num_slots * kv_row;
  const float eps = static_cast<float>(m->eps);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));  // as Python's, then a float
  std::vector<float> normed(T * E), qkv(T * row), att(T * H * D), o(T * E), gate_up(T * 2 * I), act(T * I),
      down(T * E);
  float* residual = x;
  float* in = normed.data();  // the layer's normed input: the first layer's rms_norm, else the carried add-and-norm
  int status = mv_rms_norm(in, x, m->layer[0].input_norm, T, E, eps, nthreads);
  for (int64_t l = 0; l < m->layers && status == 0; ++l) {
    const minivllm::DecodeLayer& L = m->layer[l];
    if (l > 0) {
      in = down.data();
      status = mv_fused_add_rms_norm(in, residual, L.input_norm, T, E, eps, nthreads);
    }
    float *q = qkv.data(), *k = q + H * D, *v = k + KVH * D;
    float *kc = k_slots + l * layer_floats, *vc = v_slots + l * layer_floats;
    if (status == 0) status = decode_matmul(L.qkv, q, in, T, nthreads);
    if (status == 0)
      status = mv_rotary(q, row, k, row, positions, m->cos, m->sin, T, H, KVH, D, m->max_position, nthreads);
    if (status == 0) status = mv_write_kv(k, row, v, row, kc, vc, slots, T, kv_row, num_slots);
    if (status == 0)
      status = mv_paged_attention(att.data(), q, row, kc, vc, block_table, width, seq_lens, query_start, T, T, H,
                                  KVH, D, block_size, num_slots / block_size, scale, nthreads);
    if (status == 0) status = decode_matmul(L.o, o.data(), att.data(), T, nthreads);
    if (status == 0) status = mv_fused_add_rms_norm(o.data(), residual, L.post_norm, T, E, eps, nthreads);
    if (status == 0) status = decode_matmul(L.gate_up, gate_up.data(), o.data(), T, nthreads);
    if (status == 0) status = mv_silu_and_mul(act.data(), gate_up.data(), T, I, nthreads);
    if (status == 0) status = decode_matmul(L.down, down.data(), act.data(), T, nthreads);
  }
  if (status == 0) status = mv_fused_add_rms_norm(down.data(), residual, m->final_norm, T, E, eps, nthreads);
  if (status == 0) std::memcpy(hidden, down.data(), T * E * sizeof(float));
  return status;
}

}  // extern "C"
