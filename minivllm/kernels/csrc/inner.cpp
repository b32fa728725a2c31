// minivllm's inner loops (chapter 18): the paged attention tile and the Q4_1 block dot product.
// Exercise 18's stub of this file has the same two functions, empty.
#include "inner.h"

#define MINIVLLM_OWN_INNER  // minivllm's own loops: a decode step may split its keys (split_kv.h, inner_ops.cpp)

namespace minivllm {

template <int KV>  // key vectors per chunk: the softmax is updated once per KV * kLanes keys
inline void attend_chunks(const AttentionTile& t) {
  // query vectors computed together: independent sums the CPU overlaps
  constexpr int QB = 4;
  constexpr int KC = KV * kLanes;  // keys per chunk
  const int D = t.head_dim, nv = t.rows * t.heads;
  // running max, running sum, this chunk's rescale
  float m[kMaxTile + QB], l[kMaxTile + QB], rescale[kMaxTile + QB];
  // each query's weighted sum of values, not yet divided
  alignas(64) float acc[kMaxTile + QB][kMaxHeadDim];
  // this chunk's exp(score - max), one key per lane
  alignas(64) float p[kMaxTile + QB][KC];
  // this chunk's keys, transposed: kt[d][j] is key j's d-th
  alignas(64) float kt[kMaxHeadDim][KC];
  const float* vrow[KC];
  const float* qrow[kMaxTile + QB];
  int64_t qpos[kMaxTile + QB];
  // QB spare vectors: a block of QB never reads past the tile's end
  for (int i = 0; i < nv + QB; ++i) {
    const int r = i < nv ? i / t.heads : t.rows - 1, h = i < nv ? i % t.heads : 0;
    qrow[i] = t.q + r * t.q_row_stride + h * D;
    qpos[i] = i < nv ? t.pos[r] : -1;
    m[i] = -INFINITY;
    l[i] = 0.0f;
    for (int d = 0; d < D; ++d) acc[i][d] = 0.0f;
  }
  ivec lane;
  for (int j = 0; j < kLanes; ++j) lane[j] = j;
  const int64_t last = t.pos[t.rows - 1];
  // KC keys at a time, each found through the block table
  for (int64_t t0 = 0; t0 <= last; t0 += KC) {
    const int kn = static_cast<int>(last - t0 + 1 < KC ? last - t0 + 1 : KC);
    for (int j = 0; j < KC; ++j) {
      const int64_t key = t0 + (j < kn ? j : 0);  // past the last key: key 0 again, masked below
      const int64_t slot =
          static_cast<int64_t>(t.table[key / t.block_size]) * t.block_size + key % t.block_size;
      const float* krow = t.k_cache + slot * t.kv_stride;
      vrow[j] = t.v_cache + slot * t.kv_stride;
      for (int d = 0; d < D; ++d) kt[d][j] = krow[d];
    }
    const int kvecs = (kn + kLanes - 1) / kLanes;
    for (int i0 = 0; i0 < nv; i0 += QB) {  // scores: QB query vectors against the chunk's keys
      fvec s[QB][KV];
      for (int b = 0; b < QB; ++b)
        for (int c = 0; c < KV; ++c) s[b][c] = splat(0.0f);
      for (int d = 0; d < D; ++d) {
        for (int c = 0; c < KV; ++c) {
          if (c >= kvecs) break;
          const fvec kd = load(kt[d] + c * kLanes);
          for (int b = 0; b < QB; ++b) s[b][c] += qrow[i0 + b][d] * kd;
        }
      }
      for (int b = 0; b < QB; ++b) {  // the online softmax: new maximum, rescale what came before
        const int i = i0 + b;
        // keys at or before the row's position
        const int64_t seen = qpos[i] - t0 + 1 < kn ? qpos[i] - t0 + 1 : kn;
        fvec scores[KV], top = splat(-INFINITY);
        for (int c = 0; c < KV; ++c) {
          const ivec visible = lane + c * kLanes < static_cast<int>(seen);
          scores[c] = visible ? s[b][c] * t.scale : splat(-INFINITY);  // not seen: weight 0
          top = scores[c] > top ? scores[c] : top;
        }
        float chunk_max = -INFINITY;
        for (int j = 0; j < kLanes; ++j) chunk_max = top[j] > chunk_max ? top[j] : chunk_max;
        const float new_max = chunk_max > m[i] ? chunk_max : m[i];
        rescale[i] = new_max == -INFINITY ? 1.0f : std::exp(m[i] - new_max);
        fvec total = splat(0.0f);
        for (int c = 0; c < KV; ++c) {
          const fvec e = new_max == -INFINITY ? splat(0.0f) : exp_lanes(scores[c] - new_max);
          store(p[i] + c * kLanes, e);
          total += e;
        }
        l[i] = l[i] * rescale[i] + hsum(total);
        m[i] = new_max;
      }
    }
    // values: QB weighted sums at once, each kLanes components at a time
    for (int i0 = 0; i0 < nv; i0 += QB) {
      int d = 0;
      for (; d + kLanes <= D; d += kLanes) {
        fvec a[QB];
        for (int b = 0; b < QB; ++b) a[b] = load(acc[i0 + b] + d) * rescale[i0 + b];
        for (int j = 0; j < kn; ++j) {
          const fvec v = load(vrow[j] + d);
          for (int b = 0; b < QB; ++b) a[b] += p[i0 + b][j] * v;
        }
        for (int b = 0; b < QB; ++b) store(acc[i0 + b] + d, a[b]);
      }
      for (; d < D; ++d) {  // a head_dim that is not a multiple of kLanes
        for (int b = 0; b < QB; ++b) {
          float a = acc[i0 + b][d] * rescale[i0 + b];
          for (int j = 0; j < kn; ++j) a += p[i0 + b][j] * vrow[j][d];
          acc[i0 + b][d] = a;
        }
      }
    }
  }
  for (int i = 0; i < nv; ++i) {
    const float inv = 1.0f / l[i];
    float* o = t.out + (i / t.heads) * t.out_row_stride + (i % t.heads) * D;
    for (int d = 0; d < D; ++d) o[d] = acc[i][d] * inv;
  }
}

// A few query vectors (a decode row's heads): each key's score is a dot product along the head
// dimension, no transposed copy of the keys (it would cost more than the arithmetic it feeds).
inline void attend_direct(const AttentionTile& t) {
  const int D = t.head_dim, nv = t.rows * t.heads;
  float m[4], l[4];
  alignas(64) float acc[4][kMaxHeadDim];
  alignas(64) float scores[4][kLanes];
  const float* vrow[kLanes];
  const float* qrow[4];
  for (int i = 0; i < nv; ++i) {
    qrow[i] = t.q + (i / t.heads) * t.q_row_stride + (i % t.heads) * D;
    m[i] = -INFINITY;
    l[i] = 0.0f;
    for (int d = 0; d < D; ++d) acc[i][d] = 0.0f;
  }
  ivec lane;
  for (int j = 0; j < kLanes; ++j) lane[j] = j;
  const int64_t last = t.pos[t.rows - 1];
  for (int64_t t0 = 0; t0 <= last; t0 += kLanes) {
    const int kn = static_cast<int>(last - t0 + 1 < kLanes ? last - t0 + 1 : kLanes);
    for (int j = 0; j < kn; ++j) {
      const int64_t key = t0 + j;
      const int64_t slot =
          static_cast<int64_t>(t.table[key / t.block_size]) * t.block_size + key % t.block_size;
      const float* krow = t.k_cache + slot * t.kv_stride;
      vrow[j] = t.v_cache + slot * t.kv_stride;
      for (int i = 0; i < nv; ++i) {
        fvec dot = splat(0.0f);
        for (int d = 0; d < D; d += kLanes) dot += load(qrow[i] + d) * load(krow + d);
        scores[i][j] = hsum(dot);
      }
    }
    for (int i = 0; i < nv; ++i) {
      const int64_t seen = t.pos[i / t.heads] - t0 + 1 < kn ? t.pos[i / t.heads] - t0 + 1 : kn;
      const fvec s = lane < static_cast<int>(seen) ? load(scores[i]) * t.scale : splat(-INFINITY);
      float chunk_max = -INFINITY;
      for (int j = 0; j < kLanes; ++j) chunk_max = s[j] > chunk_max ? s[j] : chunk_max;
      const float new_max = chunk_max > m[i] ? chunk_max : m[i];
      const float rescale = new_max == -INFINITY ? 1.0f : std::exp(m[i] - new_max);
      const fvec p = new_max == -INFINITY ? splat(0.0f) : exp_lanes(s - new_max);
      l[i] = l[i] * rescale + hsum(p);
      m[i] = new_max;
      for (int d = 0; d < D; d += kLanes) {
        fvec a = load(acc[i] + d) * rescale;
        for (int j = 0; j < kn; ++j) a += p[j] * load(vrow[j] + d);
        store(acc[i] + d, a);
      }
    }
  }
  for (int i = 0; i < nv; ++i) {
    const float inv = 1.0f / l[i];
    float* o = t.out + (i / t.heads) * t.out_row_stride + (i % t.heads) * D;
    for (int d = 0; d < D; ++d) o[d] = acc[i][d] * inv;
  }
}

inline void attend_tile(const AttentionTile& t) {
  // a decode row's heads
  if (t.rows * t.heads <= 4 && t.head_dim % kLanes == 0) return attend_direct(t);
  if (t.rows * t.heads <= 4) return attend_chunks<1>(t);  // short chunks, little to mask
  // many queries: each chunk's keys transposed once for all, the softmax updated less often
  attend_chunks<4>(t);
}

inline void q4_1_block_dot(const uint8_t* block, const float* x, int64_t x_stride, int rows, fvec* acc) {
  const float d = half_to_float(read_u16(block)), m = half_to_float(read_u16(block + 2));
  for (int c = 0; c < 16; c += kLanes) {
    const bvec qs = load_bytes(block + 4 + c);
    const fvec low = to_float(qs & 0x0f) * d + m;  // weights c .. c + kLanes - 1
    const fvec high = to_float(qs >> 4) * d + m;   // weights 16 + c ..
    for (int r = 0; r < rows; ++r) {
      const float* xr = x + r * x_stride;
      acc[r] += low * load(xr + c) + high * load(xr + 16 + c);
    }
  }
}

}  // namespace minivllm
