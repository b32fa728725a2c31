// A step's prompt rows attended in one call (chapter 18): mv_prefill_attention, the tiled prefill kernel.
//
// Included at the end of ops.cpp (it uses its fail(), and few_rows.h's threads()). Each task
// is one sequence, one KV head and one tile of up to kVecs query vectors (its
// consecutive query rows times the query heads that share the KV head). The
// queries lie across the lanes, transposed once per tile, so the online
// softmax is lane by lane with no horizontal sum, and both products are small
// register-blocked outer products (a few scalars broadcast times kNR vectors):
//   scores  S[j][i] = sum_d K[j][d] * Qt[d][i]   (keys read in place from the paged cache)
//   output Ot[d][i] = rescale[i] * Ot[d][i] + sum_j V[j][d] * P[j][i]
// over key tiles of kKeys keys at absolute positions 0, kKeys, 2 kKeys...; the
// tiles past the tile's last row are never read, and only the tiles that cross
// a row's position are masked. A query's arithmetic depends on its position and
// the key tiles, never on which thread or which query tile computes it, nor on
// the vector width where the CPU has FMA: the same bits for any thread count.
#pragma once
#include <algorithm>
#include <vector>

namespace minivllm {
namespace prefill {

constexpr int kKeys = 48;             // keys per key tile
constexpr int kMR = 6;                // keys (scores) or head dims (output) per micro-tile; kKeys is a multiple
constexpr int kNR = 2;                // vectors of query lanes per micro-tile: 12 sums, and registers for the loads
constexpr int kStep = kNR * kLanes;   // query lanes per micro-tile: 16 with AVX2, 32 with AVX-512
constexpr int kVecs = 96;             // query vectors per tile at most (a multiple of kStep)
static_assert(kVecs % kStep == 0 && kVecs >= kMaxTile && kKeys % kMR == 0, "the tiles' shapes");

// x in every lane, broadcast from memory (splat's 0 + x is an addition the compiler must keep, for x = -0)
inline fvec broadcast(float x) { return x - fvec{}; }

struct PromptTile {
  const float* q;           // the tile's first row, at its KV head's first query head
  int64_t q_row_stride;
  int64_t pos0;             // the first row's position; row r sits at pos0 + r and sees the keys 0 .. pos0 + r
  int rows;
  int heads;                // query heads that read this KV head
  const float* k_cache;     // at the KV head
  const float* v_cache;
  int64_t kv_stride;
  const int32_t* table;     // the sequence's block table
  int block_size;
  int head_dim;
  float scale;
  float* out;
  int64_t out_row_stride;
};

// S[j0 .. j0 + kMR) for lane vectors f0 .. f0 + kNR: kMR keys' elements broadcast times kNR vectors of Qt, summed
// over the head dimension in registers.
inline void score_keys(float* p, const float* qt, const float* const* krow, int j0, int f0, int nvp, int D) {
  fvec acc[kMR][kNR];
  for (int a = 0; a < kMR; ++a)
    for (int c = 0; c < kNR; ++c) acc[a][c] = splat(0.0f);
  for (int d = 0; d < D; ++d) {
    fvec v[kNR];
    for (int c = 0; c < kNR; ++c) v[c] = load(qt + d * nvp + (f0 + c) * kLanes);
    for (int a = 0; a < kMR; ++a) {
      const fvec s = broadcast(krow[j0 + a][d]);
      for (int c = 0; c < kNR; ++c) acc[a][c] += s * v[c];
    }
  }
  for (int a = 0; a < kMR; ++a)
    for (int c = 0; c < kNR; ++c) store(p + (j0 + a) * nvp + (f0 + c) * kLanes, acc[a][c]);
}

// Ot[d0 .. d0 + MR) for every lane vector: rescaled, then the tile's values weighted by P added.
template <int MR>
inline void weigh_values(float* ot, const float* p, const fvec* rescale, const float* const* vrow, int d0, int nvp,
                         int knp) {
  for (int f0 = 0; f0 < nvp / kLanes; f0 += kNR) {
    fvec acc[MR][kNR];
    for (int a = 0; a < MR; ++a)
      for (int c = 0; c < kNR; ++c) acc[a][c] = load(ot + (d0 + a) * nvp + (f0 + c) * kLanes) * rescale[f0 + c];
    for (int j = 0; j < knp; ++j) {  // key j's values d0 .. d0 + MR, broadcast, times P's row j
      const float* values = vrow[j] + d0;
      fvec w[kNR];
      for (int c = 0; c < kNR; ++c) w[c] = load(p + j * nvp + (f0 + c) * kLanes);
      for (int a = 0; a < MR; ++a) {
        const fvec s = broadcast(values[a]);
        for (int c = 0; c < kNR; ++c) acc[a][c] += s * w[c];
      }
    }
    for (int a = 0; a < MR; ++a)
      for (int c = 0; c < kNR; ++c) store(ot + (d0 + a) * nvp + (f0 + c) * kLanes, acc[a][c]);
  }
}

// One tile of prompt rows over its sequence's keys; qt, ot hold head_dim * kVecs floats, p kKeys * kVecs.
inline void attend_prompt_tile(const PromptTile& t, float* qt, float* ot, float* p) {
  const int D = t.head_dim, G = t.heads, nv = t.rows * G;
  const int nvp = (nv + kStep - 1) / kStep * kStep, nf = nvp / kLanes;
  for (int i = 0; i < nvp; ++i) {  // lane i: row i / G, head i % G, scaled; padding lanes repeat the last vector
    const int v = i < nv ? i : nv - 1;
    const float* src = t.q + (v / G) * t.q_row_stride + (v % G) * D;
    for (int d = 0; d < D; ++d) qt[d * nvp + i] = src[d] * t.scale;
  }
  std::fill(ot, ot + D * nvp, 0.0f);
  fvec m[kVecs / kLanes], l[kVecs / kLanes], rescale[kVecs / kLanes];
  ivec qpos[kVecs / kLanes];
  for (int f = 0; f < nf; ++f) {
    m[f] = splat(-INFINITY);
    l[f] = splat(0.0f);
    for (int j = 0; j < kLanes; ++j) qpos[f][j] = static_cast<int>(t.pos0 + std::min(f * kLanes + j, nv - 1) / G);
  }
  const float* krow[kKeys];
  const float* vrow[kKeys];
  const int64_t last = t.pos0 + t.rows - 1;
  for (int64_t k0 = 0; k0 <= last; k0 += kKeys) {  // key tiles past the last row: never read
    const int kn = static_cast<int>(std::min<int64_t>(kKeys, last - k0 + 1));
    const int knp = (kn + kMR - 1) / kMR * kMR;  // padding keys repeat key k0, sit past `last`, and are masked
    for (int j = 0; j < knp; ++j) {
      const int64_t key = k0 + (j < kn ? j : 0);
      const int64_t slot = static_cast<int64_t>(t.table[key / t.block_size]) * t.block_size + key % t.block_size;
      krow[j] = t.k_cache + slot * t.kv_stride;
      vrow[j] = t.v_cache + slot * t.kv_stride;
    }
    for (int j0 = 0; j0 < knp; j0 += kMR)  // scores: kMR keys times kNR lane vectors
      for (int f0 = 0; f0 < nf; f0 += kNR) score_keys(p, qt, krow, j0, f0, nvp, D);
    const bool crosses = k0 + knp - 1 > t.pos0;  // some key of the tile lies past some row's position
    for (int f = 0; f < nf; ++f) {  // the online softmax, lane by lane
      fvec top = splat(-INFINITY);
      for (int j = 0; j < knp; ++j) {
        fvec s = load(p + j * nvp + f * kLanes);
        if (crosses) {
          s = qpos[f] >= static_cast<int>(k0 + j) ? s : splat(-INFINITY);
          store(p + j * nvp + f * kLanes, s);
        }
        top = s > top ? s : top;
      }
      const fvec new_m = top > m[f] ? top : m[f];  // finite: key 0, in the first tile, is every row's
      rescale[f] = exp_lanes(m[f] - new_m);        // the first tile: exp(-inf) = 0
      fvec sum = splat(0.0f);
      for (int j = 0; j < knp; ++j) {
        const fvec e = exp_lanes(load(p + j * nvp + f * kLanes) - new_m);
        store(p + j * nvp + f * kLanes, e);
        sum += e;
      }
      l[f] = l[f] * rescale[f] + sum;
      m[f] = new_m;
    }
    int d0 = 0;
    for (; d0 + kMR <= D; d0 += kMR) weigh_values<kMR>(ot, p, rescale, vrow, d0, nvp, knp);
    for (; d0 + 4 <= D; d0 += 4) weigh_values<4>(ot, p, rescale, vrow, d0, nvp, knp);  // head_dim 64: the last 4
    for (; d0 < D; ++d0) weigh_values<1>(ot, p, rescale, vrow, d0, nvp, knp);
  }
  float sums[kVecs];
  for (int f = 0; f < nf; ++f) store(sums + f * kLanes, l[f]);
  for (int i = 0; i < nv; ++i) {
    const float inv = 1.0f / sums[i];
    float* o = t.out + (i / G) * t.out_row_stride + (i % G) * D;
    for (int d = 0; d < D; ++d) o[d] = ot[d * nvp + i] * inv;
  }
}

}  // namespace prefill
}  // namespace minivllm

namespace {

// The arguments of mv_paged_attention, checked as it checks them: every index before any memory is read.
int check_prefill(int64_t H, int64_t KVH, int64_t D, int64_t block_size, const int32_t* query_start,
                  const int32_t* seq_lens, const int32_t* block_table, int64_t width, int64_t B, int64_t T,
                  int64_t num_blocks) {
  if (B < 0 || T < 0) return fail("%lld sequences, %lld query tokens", B, T);
  if (H < 1 || KVH < 1 || H % KVH != 0)
    return fail("query heads (%lld) must be a positive multiple of KV heads (%lld)", H, KVH);
  if (D < 1 || D > kMaxHeadDim) return fail("head_dim %lld: the kernel takes 1 to %lld", D, kMaxHeadDim);
  if (H / KVH > kMaxTile)
    return fail("%lld query heads per KV head: the kernel takes at most %lld", H / KVH, kMaxTile);
  if (block_size < 1 || block_size > kMaxBlockSize)
    return fail("block_size %lld is not in [1, %lld]", block_size, kMaxBlockSize);
  if (query_start[0] != 0) return fail("query_start[0] is %lld, not 0", query_start[0]);
  if (query_start[B] != T) return fail("query_start[-1] is %lld, not the %lld query tokens", query_start[B], T);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = static_cast<int64_t>(query_start[b + 1]) - query_start[b];
    if (n < 0) return fail("query_start decreases at sequence %lld", b);
    if (n == 0) continue;
    if (seq_lens[b] < n) return fail("seq_lens[%lld] is %lld, fewer than its %lld queries", b, seq_lens[b], n);
    const int64_t blocks = (seq_lens[b] + block_size - 1) / block_size;
    if (blocks > width)
      return fail("seq_lens[%lld] is %lld: more blocks than block_table's %lld columns", b, seq_lens[b], width);
    for (int64_t j = 0; j < blocks; ++j) {
      const int32_t id = block_table[b * width + j];
      if (id < 0 || id >= num_blocks)
        return fail("block_table[%lld] holds block %lld, outside the pool's %lld blocks", b * width + j, id,
                    num_blocks);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// A step's prompt rows through the paged cache, read in place (chapter 18): the arguments and the result of
// mv_paged_attention, every row of each sequence causal to its own position (after any cached keys), in tiles.
// Threads take (sequence, KV head, query tile) tasks, the longest first.
int mv_prefill_attention(float* out, const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                         const int32_t* block_table, int64_t width, const int32_t* seq_lens,
                         const int32_t* query_start, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                         int64_t block_size, int64_t num_blocks, float scale, int nthreads) {
  using namespace minivllm::prefill;
  if (check_prefill(H, KVH, D, block_size, query_start, seq_lens, block_table, width, B, T, num_blocks)) return 1;
  const int64_t G = H / KVH, tile_rows = kVecs / G;
  struct Task { int64_t b, head, first, rows, last; };
  std::vector<Task> tasks;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = query_start[b + 1] - query_start[b];
    for (int64_t first = 0; first < n; first += tile_rows) {
      const int64_t rows = std::min(tile_rows, n - first), last = seq_lens[b] - n + first + rows - 1;
      for (int64_t g = 0; g < KVH; ++g) tasks.push_back({b, g, first, rows, last});
    }
  }
  // the longest first (the most keys), so no thread is left with a long tile at the end
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.last > y.last; });
  const int64_t count = static_cast<int64_t>(tasks.size());
#pragma omp parallel num_threads(threads(count > 1 ? nthreads : 1))
  {
    std::vector<float> buffer((2 * D + kKeys) * kVecs);
    float* qt = buffer.data();
    float* ot = qt + D * kVecs;
    float* p = ot + D * kVecs;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) {
      const Task& task = tasks[i];
      const int64_t n = query_start[task.b + 1] - query_start[task.b];
      const int64_t token = query_start[task.b] + task.first;
      const PromptTile tile{q + token * q_stride + task.head * G * D, q_stride, seq_lens[task.b] - n + task.first,
                            static_cast<int>(task.rows), static_cast<int>(G), k_cache + task.head * D,
                            v_cache + task.head * D, KVH * D, block_table + task.b * width,
                            static_cast<int>(block_size), static_cast<int>(D), scale,
                            out + (token * H + task.head * G) * D, H * D};
      attend_prompt_tile(tile, qt, ot, p);
    }
  }
  return 0;
}

}  // extern "C"
