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
//   - otherwise it adds its partials to a zeroed fp32 workspace [rows, N] with atomicAdd and
//     bumps the tile's counter; the last of the (known) number of warps covering the tile
//     reads the sums back (ld.global.cg), writes y (+bias) and zeroes its workspace entries
//     and the counter again, so one persistent workspace serves every launch.
// With `act` (a SwiGLU layer's merged gate/up projection: gate columns 0..N/2-1, up columns
// N/2..N-1) y is scratch and the kernel's output is act[rows, N/2] = silu(gate) * up: whoever
// finishes a column tile writes it to y and bumps the tile PAIR's counter (gate tile t and up
// tile t + N/64, counters after the split counters); the second of the pair reads the other
// tile back (ld.global.cg) and writes act, so no separate activation launch runs.
// Inside a range the warp runs a two-stage software pipeline over register batches of
// UNROLL tiles: while one batch (UNROLL 128-bit loads per lane) is dequantised and multiplied,
// the loads of the next batch are in flight, so every warp always keeps UNROLL * 512 bytes
// requested.  x values come from broadcast 128-bit loads (same address in all lanes; x is
// small and stays in L1/L2).
//
// Arithmetic: weights are dequantised in registers (lop3 magic number + one fma.rn.f16x2
// each: the dequant contract).  The products of two packed words (16 k) are summed with two
// mul.f16x2, six fma.f16x2 and one add.f16x2 into two fp16 partial sums of 8 products each, which are
// converted and added to the fp32 accumulator.  So products and 8-term partial sums are
// fp16 and every longer sum is fp32: converting every product (F2F runs at a quarter of the
// FMA rate on sm_70) would make the kernel instruction-bound instead of memory-bound.
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
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {  // words 2*pair and 2*pair+1 (16 k)
      const uint4 xa = __ldg(xp + 2 * pair);
      const uint4 xb = __ldg(xp + 2 * pair + 1);
      const half2* wp = w + 8 * pair;
      // Two independent 4-deep chains (shorter dependency chains), then one add.
      half2 p = __hmul2(wp[0], as_half2(xa.x));
      half2 q = __hmul2(wp[4], as_half2(xb.x));
      p = __hfma2(wp[1], as_half2(xa.y), p);
      q = __hfma2(wp[5], as_half2(xb.y), q);
      p = __hfma2(wp[2], as_half2(xa.z), p);
      q = __hfma2(wp[6], as_half2(xb.z), q);
      p = __hfma2(wp[3], as_half2(xa.w), p);
      q = __hfma2(wp[7], as_half2(xb.w), q);
      const float2 f = __half22float2(__hadd2(p, q));
      acc[m] += f.x + f.y;
    }
  }
}

// A SwiGLU launch's column tile is final in `done` (and in y): count its pair (gate tile t,
// up tile t + N/64) finished; the second of the two reads the other tile back and writes
// act[m, t*32 + column] = silu(gate) * up, then re-zeroes the pair's counter.
template <int M>
__device__ __forceinline__ void finish_silu_mul_pair(const half (&done)[M], const half* y, half* __restrict__ act,
                                                     int* pair_counters, int tile, int rows, int N) {
  const int lane = threadIdx.x & 31;
  const int half_tiles = N / (2 * kTile);
  const bool is_gate = tile < half_tiles;
  const int pair = is_gate ? tile : tile - half_tiles;
  const int other_tile = is_gate ? tile + half_tiles : pair;
  __threadfence();
  __syncwarp();
  int previous = 0;
  if (lane == 0) previous = atomicAdd(pair_counters + pair, 1);
  if (__shfl_sync(0xffffffffu, previous, 0) == 0) return;  // the other tile is not done yet
  __threadfence();
  const int column = lane_column(lane);
#pragma unroll
  for (int m = 0; m < M; ++m)
    if (m < rows) {
      const unsigned short bits =
          __ldcg(reinterpret_cast<const unsigned short*>(y + (size_t)m * N + other_tile * kTile + column));
      const half other = __ushort_as_half(bits);
      act[(size_t)m * (N / 2) + pair * kTile + column] =
          is_gate ? silu_mul(done[m], other) : silu_mul(other, done[m]);
    }
  if (lane == 0) pair_counters[pair] = 0;
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
                                          float* __restrict__ workspace, int* __restrict__ counters,
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
    half done[M];  // the column's final values, once this warp finished the tile
    bool finished = false;
    if (kt_begin == 0 && kt_end == ktiles) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        done[m] = __float2half_rn(acc[m] + bias_n);
        if (m < rows) y[(size_t)m * N + n] = done[m];
      }
      finished = true;
    } else {
#pragma unroll
      for (int m = 0; m < M; ++m)
        if (m < rows) atomicAdd(workspace + (size_t)m * N + n, acc[m]);
      __threadfence();
      __syncwarp();
      // Warps covering this tile: those whose ranges meet [tile_begin, tile_begin + ktiles).
      const int arrivals = (tile_begin + ktiles - 1) / per_warp - tile_begin / per_warp + 1;
      int previous = 0;
      if (lane == 0) previous = atomicAdd(counters + tile, 1);
      previous = __shfl_sync(0xffffffffu, previous, 0);
      if (previous == arrivals - 1) {
        __threadfence();
#pragma unroll
        for (int m = 0; m < M; ++m) {
          done[m] = __float2half_rn(0.0f);
          if (m < rows) {
            done[m] = __float2half_rn(__ldcg(workspace + (size_t)m * N + n) + bias_n);
            y[(size_t)m * N + n] = done[m];
            workspace[(size_t)m * N + n] = 0.0f;  // leave it zeroed for the next launch
          }
        }
        if (lane == 0) counters[tile] = 0;
        finished = true;
      }
    }
    if (act != nullptr && finished) finish_silu_mul_pair<M>(done, y, act, counters + N / kTile, tile, rows, N);
    pos = seg_end;
  }
}

}  // namespace onecat

// extern "C" entry points (plain names for the driver API), one per (M, WARPS per block,
// UNROLL); a kernel for M rows also serves fewer rows (`rows` <= M); `act` null: plain linear.  MINB (resident blocks
// per SM asked of ptxas) caps the registers: more resident warps hide more latency.
#define ONECAT_GEMV(M, WARPS, UNROLL, MINB)                                                         \
  extern "C" __global__ void __launch_bounds__(32 * WARPS, MINB) w4a16_gemv_m##M##_w##WARPS##_u##UNROLL( \
      const half* x, const uint4* qweight, const half2* scales_zeros, const half* bias,       \
      half* y, float* workspace, int* counters, int rows, int N, int K, int group_size,        \
      int per_warp, half* act) {                                                               \
    onecat::gemv_warp<M, UNROLL>(x, qweight, scales_zeros, bias, y, workspace, counters, rows, \
                                 N, K, group_size, per_warp,                                   \
                                 blockIdx.x * WARPS + (threadIdx.x >> 5), act);                \
  }

ONECAT_GEMV(1, 4, 2, 5)
ONECAT_GEMV(1, 4, 4, 4)
ONECAT_GEMV(2, 4, 2, 4)
ONECAT_GEMV(4, 4, 2, 2)
