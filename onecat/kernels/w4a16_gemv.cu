// W4A16 GEMV on CUDA cores for decode (M = 1..4 tokens): y[M, N] = x[M, K] @ W[N, K]^T (+ bias)
//
// Data layout (see w4a16_common.cuh): the packed weight is one stream of 512-byte tiles,
// column tile by column tile, each column tile's K/32 k tiles contiguous.  Lane l of a warp
// reads the 32 k of output column lane_column(l) of a tile with ONE 128-bit load.
// x is [rows, K] fp16 row-major (16-byte aligned rows), y is [rows, N] fp16 row-major.
//
// Thread mapping (per-warp "stream-K"): the (N/32) * (K/32) tiles are numbered in memory
// order and cut into equal contiguous ranges of `per_warp` tiles, one range per warp
// (warp g = blockIdx.x * WARPS + warpIdx).  Equal ranges keep every warp equally busy whatever
// N and K are (no wave quantisation, no idle tail), and each warp streams contiguous memory.
// A range crosses column-tile boundaries: the warp keeps one fp32 accumulator per row for
// the current column tile and flushes it at each boundary:
//   - if the warp covered the whole column tile, it writes y (+bias) directly;
//   - otherwise each lane adds its partial to the column's 64-bit split word (split_sum_add,
//     w4a16_common.cuh: one atomic that also counts the arrivals), and the lane whose atomic
//     completes the (known) number of warps covering the tile writes y (+bias) and zeroes the
//     word.  One L2 round trip ends the kernel, where a fp32 atomic workspace needs three
//     (atomics, fence + counter, read-back): ~1.3-2.8 us a call on an H200 (BENCHMARKS.md).
// With `act` (a SwiGLU layer's merged gate/up projection: gate columns 0..N/2-1, up columns
// N/2..N-1) the kernel's output is act[rows, N/2] = silu(gate) * up and y is not written:
// whoever finishes a column adds its fp16 value and a count to the column PAIR's 64-bit word
// (gate in bits 0-15, up in bits 16-31, count from bit 32; words [rows, N/2] after the split
// words); the second of the pair gets both values back from its atomic, writes act and zeroes
// the word, so no separate activation launch runs.
// Inside a range the warp runs a two-stage software pipeline over register batches of
// UNROLL tiles: while one batch (UNROLL 128-bit loads per lane) is dequantised and multiplied,
// the loads of the next batch are in flight, so every warp always keeps UNROLL * 512 bytes
// requested.  x values come from broadcast 128-bit loads (same address in all lanes; x is
// small and stays in L1/L2).
//
// Arithmetic: weights are dequantised in registers (lop3 magic number + one fma.rn.f16x2
// each: the dequant contract).  The products of a tile (32 k, four packed words) are summed
// with two mul.f16x2, fourteen fma.f16x2 and one add.f16x2 into two fp16 partial sums of 16
// products each, which are converted and added to the fp32 accumulator: one conversion a
// tile.  So products and 16-term partial sums are fp16 and every longer sum is fp32:
// converting every product (F2F runs at a quarter of the FMA rate on sm_70) would make the
// kernel instruction-bound instead of memory-bound.  (One conversion per 16 k instead cost
// 5 more instructions a tile; the MoE decode kernels made the same change, BENCHMARKS.md.)
#include "w4a16_common.cuh"

namespace onecat {

// Dequantise one k tile (this lane's uint4 and scale pair) and accumulate x[m, k] * w[k] into
// acc[m] in fp32; `xk` points at x[0, 32*kt].
template <int M>
__device__ __forceinline__ void compute_tile(uint4 wv, half2 sz, float (&acc)[M],
                                             const half* __restrict__ xk, int rows, int K) {
  half2 w[16];
  dequant_tile(wv, sz, w);
#pragma unroll
  for (int m = 0; m < M; ++m) {
    // Rows past `rows` re-read row 0 (always valid memory); their sums are dropped.
    const uint4* xp = reinterpret_cast<const uint4*>(xk + (m < rows ? (size_t)m * K : 0));
    // Two independent 8-deep chains over the whole tile: p takes the first 8 k of each 16-k
    // half (xa), q the second 8 (xb); then one add and one conversion a tile.
    half2 p, q;
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      const uint4 xa = __ldg(xp + 2 * pair);
      const uint4 xb = __ldg(xp + 2 * pair + 1);
      const half2* wp = w + 8 * pair;
      p = pair == 0 ? __hmul2(wp[0], as_half2(xa.x)) : __hfma2(wp[0], as_half2(xa.x), p);
      q = pair == 0 ? __hmul2(wp[4], as_half2(xb.x)) : __hfma2(wp[4], as_half2(xb.x), q);
      p = __hfma2(wp[1], as_half2(xa.y), p);
      q = __hfma2(wp[5], as_half2(xb.y), q);
      p = __hfma2(wp[2], as_half2(xa.z), p);
      q = __hfma2(wp[6], as_half2(xb.z), q);
      p = __hfma2(wp[3], as_half2(xa.w), p);
      q = __hfma2(wp[7], as_half2(xb.w), q);
    }
    const float2 f = __half22float2(__hadd2(p, q));
    acc[m] += f.x + f.y;
  }
}

// A SwiGLU launch's column is final in `done[m]` for every `finished[m]`: add it to the column
// pair's word (gate column c and up column c + N/2 share word [m, c]); the second of the two
// gets both values back from its atomic, writes act[m, c] = silu(gate) * up and re-zeroes the
// word.
template <int M>
__device__ __forceinline__ void finish_silu_mul_pair(const half (&done)[M], const bool (&finished)[M],
                                                     half* __restrict__ act, unsigned long long* pair_words,
                                                     int tile, int N) {
  const int half_tiles = N / (2 * kTile);
  const bool is_gate = tile < half_tiles;
  const int column = (is_gate ? tile : tile - half_tiles) * kTile + lane_column(threadIdx.x & 31);
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (!finished[m]) continue;
    unsigned long long* word = pair_words + (size_t)m * (N / 2) + column;
    const unsigned long long add = (1ull << 32) | (static_cast<unsigned long long>(__half_as_ushort(done[m])) << (is_gate ? 0 : 16));
    const unsigned long long now = atomicAdd(word, add) + add;
    if ((now >> 32) != 2ull) continue;  // the other column is not done yet
    act[(size_t)m * (N / 2) + column] = silu_mul(__ushort_as_half(static_cast<unsigned short>(now)),
                                                 __ushort_as_half(static_cast<unsigned short>(now >> 16)));
    *word = 0ull;
  }
}

template <int UNROLL>
struct WeightBatch {
  uint4 w[UNROLL];
  half2 sz[UNROLL];
};

// Issue the loads of UNROLL consecutive k tiles starting at `wp` (no bounds checks: callers
// only ask for whole batches).
template <int UNROLL>
__device__ __forceinline__ void load_batch(WeightBatch<UNROLL>& b, const uint4* wp,
                                           ScaleCursor& scales) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    b.w[u] = load_weights_streaming(wp + u * 32);
    b.sz[u] = scales.next();
  }
}

template <int M, int UNROLL>
__device__ __forceinline__ void compute_batch(const WeightBatch<UNROLL>& b, float (&acc)[M],
                                              const half* __restrict__ xk, int rows, int K) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    compute_tile<M>(b.w[u], b.sz[u], acc, xk + u * kTile, rows, K);
    // Keep the compiler from hoisting every x load of the batch (register pressure).
    asm volatile("" ::: "memory");
  }
}

template <int M, int UNROLL>
__device__ __forceinline__ void gemv_warp(const half* __restrict__ x, const uint4* __restrict__ qweight,
                                          const half2* __restrict__ scales_zeros,
                                          const half* __restrict__ bias, half* __restrict__ y,
                                          unsigned long long* __restrict__ split_words,
                                          unsigned long long* __restrict__ pair_words,
                                          int rows, int N, int K, int group_size, int per_warp,
                                          int warp_id, half* __restrict__ act) {
  const int lane = threadIdx.x & 31;
  const int ktiles = K / kTile;
  const int groups = K / group_size;
  const int tiles_per_group = group_size / kTile;
  const int total = (N / kTile) * ktiles;  // < 2^31 for any layer that fits a GPU
  int pos = warp_id * per_warp;
  const int end = min(total, pos + per_warp);

  while (pos < end) {
    const int tile = pos / ktiles;
    const int tile_begin = tile * ktiles;
    const int seg_end = min(end, tile_begin + ktiles);
    const int kt_begin = pos - tile_begin;
    const int kt_end = seg_end - tile_begin;
    const uint4* w_tile = qweight + (size_t)tile_begin * 32 + lane;
    ScaleCursor scales(scales_zeros + (size_t)tile * groups * 32 + lane, kt_begin, tiles_per_group);

    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;

    // Software pipeline over two register batches of whole UNROLL-tile runs: the loads of
    // the next batch are in flight while the current one is dequantised and multiplied.
    // The last kt_end - kt_begin mod UNROLL tiles are done one by one.
    const uint4* wp = w_tile + (size_t)kt_begin * 32;
    const half* xk = x + (size_t)kt_begin * kTile;
    int kt = kt_begin;
    if (kt + UNROLL <= kt_end) {
      WeightBatch<UNROLL> a, b;
      load_batch(a, wp, scales);
      wp += UNROLL * 32;
#pragma unroll 1
      while (true) {
        const bool more_b = kt + 2 * UNROLL <= kt_end;
        if (more_b) load_batch(b, wp, scales), wp += UNROLL * 32;
        compute_batch<M>(a, acc, xk, rows, K);
        kt += UNROLL;
        xk += UNROLL * kTile;
        if (!more_b) break;
        const bool more_a = kt + 2 * UNROLL <= kt_end;
        if (more_a) load_batch(a, wp, scales), wp += UNROLL * 32;
        compute_batch<M>(b, acc, xk, rows, K);
        kt += UNROLL;
        xk += UNROLL * kTile;
        if (!more_a) break;
      }
    }
#pragma unroll 1
    for (; kt < kt_end; ++kt, wp += 32, xk += kTile) {
      const uint4 wv = load_weights_streaming(wp);
      compute_tile<M>(wv, scales.next(), acc, xk, rows, K);
    }

    const int n = tile * kTile + lane_column(lane);
    const float bias_n = bias ? __half2float(bias[n]) : 0.0f;
    half done[M];       // the column's final values ...
    bool finished[M];   // ... where this lane completed them
    const bool whole = kt_begin == 0 && kt_end == ktiles;
    // Warps covering this tile: those whose ranges meet [tile_begin, tile_begin + ktiles).
    const int arrivals = (tile_begin + ktiles - 1) / per_warp - tile_begin / per_warp + 1;
    unsigned long long now[M];
#pragma unroll
    for (int m = 0; m < M; ++m)
      if (!whole && m < rows) now[m] = split_sum_add(split_words + (size_t)m * N + n, acc[m]);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float total = acc[m];
      finished[m] = m < rows && (whole || split_sum_total(now[m], arrivals, split_words + (size_t)m * N + n, total));
      done[m] = __float2half_rn(total + bias_n);
      if (finished[m] && act == nullptr) y[(size_t)m * N + n] = done[m];
    }
    if (act != nullptr) finish_silu_mul_pair<M>(done, finished, act, pair_words, tile, N);
    pos = seg_end;
  }
}

}  // namespace onecat

// extern "C" entry points (plain names for the driver API), one per (M, WARPS per block,
// UNROLL); a kernel for M rows also serves fewer rows (`rows` <= M); `act` null: plain linear.
// MINB (resident blocks per SM asked of ptxas) caps the registers: more resident warps hide
// more latency.  One row: 6 blocks (unroll 2, 78 registers in the sm_70 build) and 5 (unroll
// 4, 96); unroll 2 at 8 blocks (64 registers) was slower and unroll 4 at 6 spills
// (BENCHMARKS.md, 2026-12-02 midday).
#define ONECAT_GEMV(M, WARPS, UNROLL, MINB)                                                         \
  extern "C" __global__ void __launch_bounds__(32 * WARPS, MINB) w4a16_gemv_m##M##_w##WARPS##_u##UNROLL( \
      const half* x, const uint4* qweight, const half2* scales_zeros, const half* bias,       \
      half* y, unsigned long long* split_words, unsigned long long* pair_words, int rows, int N, \
      int K, int group_size, int per_warp, half* act) {                                        \
    onecat::gemv_warp<M, UNROLL>(x, qweight, scales_zeros, bias, y, split_words, pair_words, rows, \
                                 N, K, group_size, per_warp,                                   \
                                 blockIdx.x * WARPS + (threadIdx.x >> 5), act);                \
  }

ONECAT_GEMV(1, 4, 2, 6)
ONECAT_GEMV(1, 4, 4, 5)
ONECAT_GEMV(2, 4, 2, 4)
ONECAT_GEMV(4, 4, 2, 2)
