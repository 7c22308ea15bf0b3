// Routed experts of a MoE block for prefill (many (token, expert) pairs), on tensor cores:
//   out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = ids[t, j]
// in three launches and no host sync:
//
//   1. w4a16_moe_wmma_align (one block): counts the pairs per expert, prefix-sums them and
//      the 64-row tiles they need (warp shuffles, then warp 0 over the 32 warps' totals: two
//      barriers, where the shared-memory scan it replaced took 20: 35B-A3B decode +0.4-0.7% at
//      batches 16-32 on the H200, BENCHMARKS.md 2026-12-02), and scatters the pair indices into
//      expert order:
//        expert_start [E+1]  first sorted position of expert e (expert_start[E] = valid pairs)
//        tile_start   [E+1]  first row tile of expert e        (tile_start[E] = row tiles)
//        sorted_pairs [P]    pair index p = t*top_k + j at each sorted position
//      Pairs whose id lies outside [0, E) (another rank's experts) are left out.  Positions
//      inside an expert come from shared-memory atomics (any order: rows are independent).
//   2. w4a16_moe_wmma_gate_up: h[s, :] = silu(gate_e(x[t])) * up_e(x[t]) for each sorted
//      position s (token t of pair sorted_pairs[s]), fp16 [P, I] in sorted order;
//   3. w4a16_moe_wmma_down: ws[t, :] += w[p] * down_e(h[s, :]) with fp32 atomics into a
//      zeroed workspace [T, H] (the caller converts it to fp16).  A token's top_k rows sit in
//      different experts' tiles, in different blocks: atomics are the simple way to sum them
//      (top_k adds per output, order not fixed; prefill only).
//
// Data layout: the stacked Volta layout of w4a16_moe_gemv.cu (per expert as in
// w4a16_common.cuh); x [T, H] fp16 row-major.
//
// Row tiles of MT = 64 rows (``w4a16_moe_wmma_gate_up`` / ``_down``) or MT = 16 rows (the
// ``_r16`` kernels, for few pairs per expert: a 64-row tile of an expert with ~10 pairs is
// mostly padding); the align kernel takes MT as ``rows_per_tile``.  Below, 64 stands for MT.
//
// Thread mapping of the GEMMs (the structure of w4a16_wmma.cu, MT = 64 rows, 4 warps):
//   grid (column groups, row-tile bound), block 4 warps.  blockIdx.y is a row tile: a binary
//   search of tile_start gives its expert e and its rows (sorted positions r0 .. r0+rows-1,
//   rows <= 64); the grid is sized by the bound ceil(P/64) + min(E, P) on the number of row
//   tiles, so no count ever travels to the host, and blocks past tile_start[E] exit.
//   gate_up: blockIdx.x = g covers h columns 64g .. 64g+63: warps 0, 1 take gate column tiles
//     2g, 2g+1 and warps 2, 3 the up column tiles I/32 + 2g, I/32 + 2g + 1 (same columns).
//   down: blockIdx.x = g covers output columns 128g .. 128g+127, one column tile per warp.
//   Main loop per chunk of CT = 2 k tiles (64 k): each warp dequantises its uint4 fragments
//   (loaded one chunk earlier: register double buffering, sm_70 has no cp.async) into its
//   slice of shared memory sB[warp][column][k] (col-major B); the 128 threads gather the 64
//   activation rows' chunk into sA[row][k] (x rows by token for gate_up, h rows by sorted
//   position for down; rows past `rows` are zero); then each warp runs 4 x 2 wmma m16n16k16
//   per 16 k into fp32 accumulators (64 rows x 32 columns per warp).
//   The _r16_pk kernels instead store each lane's packed uint4 unchanged as a column of a
//   packed matrix and the activation chunk permuted into 4 steps, and dequantise on the
//   wmma B fragments loaded from it (w4a16_common.cuh, "Dequantisation on packed wmma
//   fragments"; w4a16_wmma.cu explains the scheme): a quarter of the shared-memory traffic.
//   Epilogue through shared memory (fp32, row stride 36): gate_up pairs warp w's gate sums
//   with warp w+2's up sums and writes 64-byte rows of h; down multiplies by the routing
//   weight and adds into ws[token] with atomicAdd.
#include "w4a16_common.cuh"

namespace onecat {

constexpr int kMoeWarps = 4;    // warps per block (32 columns each)
constexpr int kMoeChunk = 2;    // k tiles per chunk (CT)
constexpr int kMoeLds = kMoeChunk * kTile + 8;  // shared row stride in halves (144 bytes)
constexpr int kMoeLdc = 36;                     // epilogue row stride in floats
constexpr int kAlignThreads = 1024;             // 32 warps; also the largest E the align kernel takes
static_assert(kAlignThreads == 32 * 32, "the align kernel's warp 0 scans one total per warp");

template <int ROWS, bool PACKED>
struct MoeSmem {  // shared memory of a ROWS-row tile: sA + sB in the main loop, sC after it
  // PACKED: sA holds the chunk's 4 permuted A steps, sB the warps' packed columns
  static constexpr int kA = PACKED ? 4 * ROWS * kPackedLd * 2 : ROWS * kMoeLds * 2;
  static constexpr int kB = PACKED ? kMoeWarps * kTile * kPackedLd * 2 : kMoeWarps * kTile * kMoeLds * 2;
  static constexpr int kC = kMoeWarps * ROWS * kMoeLdc * 4;
  static constexpr int kBytes = (kA + kB) > kC ? (kA + kB) : kC;
};

__device__ __forceinline__ int moe_pair_expert(const void* ids, int ids64, int p, int E) {
  const long long e = ids64 ? reinterpret_cast<const long long*>(ids)[p]
                            : (long long)reinterpret_cast<const int*>(ids)[p];
  return (e >= 0 && e < E) ? (int)e : -1;
}

// The grouped GEMM of one row tile of one expert.  GATE_UP: A = x rows by token, N = 2I
// (gate | up), output h; otherwise A = h rows by sorted position, N = H, output ws.
template <bool GATE_UP, int ROWS, bool PACKED>
__device__ __forceinline__ void moe_tile(const half* __restrict__ a, const int* __restrict__ meta,
                                         int E, const uint4* __restrict__ qweight,
                                         const half2* __restrict__ scales_zeros, int N, int K,
                                         int group_size, int top_k, half* __restrict__ h, int I,
                                         const void* weights, int weights32, float* __restrict__ ws) {
  const int* sorted_pairs = meta + 2 * (E + 1);
  RowTile rt;
  if (!find_row_tile(meta, E, ROWS, blockIdx.y, rt)) return;
  const int e = rt.e, r0 = rt.r0, rows = rt.rows;

  __shared__ __align__(128) unsigned char smem[MoeSmem<ROWS, PACKED>::kBytes];
  __shared__ int row_source[ROWS];  // activation row of each tile row (-1: padding)
  __shared__ int row_pair[ROWS];    // pair index of each tile row
  half* sA = reinterpret_cast<half*>(smem);
  half* sB = reinterpret_cast<half*>(smem + MoeSmem<ROWS, PACKED>::kA);
  float* sC = reinterpret_cast<float*>(smem);

  if (threadIdx.x < ROWS) {
    const int r = threadIdx.x;
    const int pair = r < rows ? __ldg(sorted_pairs + r0 + r) : -1;
    row_pair[r] = pair;
    row_source[r] = r < rows ? (GATE_UP ? pair / top_k : r0 + r) : -1;
  }

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int ntiles = N / kTile;
  int tile;
  bool tile_ok;
  if (GATE_UP) {
    const int itiles = I / kTile;
    const int c = blockIdx.x * (kMoeWarps / 2) + (warp % (kMoeWarps / 2));
    tile_ok = c < itiles;
    tile = (warp < kMoeWarps / 2 ? c : itiles + c);
  } else {
    tile = blockIdx.x * kMoeWarps + warp;
    tile_ok = tile < ntiles;
  }
  const int ktiles = K / kTile;
  const int groups = K / group_size;
  const size_t expert_tile = (size_t)e * ntiles + (tile_ok ? tile : 0);
  const uint4* w_tile = qweight + expert_tile * ktiles * 32 + lane;
  ScaleCursor scales(scales_zeros + expert_tile * groups * 32 + lane, 0, group_size / kTile);
  half* sB_warp = sB + warp * kTile * kMoeLds;

  constexpr int kChunk = kMoeChunk * kTile;
  constexpr int kVecsPerRow = kChunk / 8;
  constexpr int kXVecs = ROWS * kVecsPerRow;
  constexpr int kThreads = 32 * kMoeWarps;
  constexpr int kXPerThread = kXVecs / kThreads;
  constexpr int kMFrags = ROWS / 16;

  uint4 wv[kMoeChunk];
  half2 sz[kMoeChunk];
  uint4 xv[kXPerThread];
  __syncthreads();  // row_source is visible

  auto load_chunk = [&](int kc) {
#pragma unroll
    for (int u = 0; u < kMoeChunk; ++u) {
      if (tile_ok && kc + u < ktiles) {
        wv[u] = load_weights_streaming(w_tile + (size_t)(kc + u) * 32);
        sz[u] = scales.next();
      }
    }
#pragma unroll
    for (int i = 0; i < kXPerThread; ++i) {
      const int idx = threadIdx.x + i * kThreads;
      const int row = idx / kVecsPerRow;
      const int col = (idx % kVecsPerRow) * 8;
      const int src = row_source[row];
      xv[i] = make_uint4(0u, 0u, 0u, 0u);
      if (src >= 0 && kc + col / kTile < ktiles)
        xv[i] = __ldg(reinterpret_cast<const uint4*>(a + (size_t)src * K + (size_t)kc * kTile + col));
    }
  };

  FragC acc[kMFrags][2];
#pragma unroll
  for (int i = 0; i < kMFrags; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int r = 0; r < 8; ++r) acc[i][j].r[r] = 0.0f;

  if constexpr (PACKED) {
    // Dequantisation on packed fragments (w4a16_common.cuh; w4a16_wmma.cu explains it):
    // group sizes that are multiples of 64, so K is too and every chunk is whole.
    half* sP_warp = sB + warp * kTile * kPackedLd;
    store_lane_ids(sP_warp, lane);
    __syncthreads();
    FragAB owner[2], s2[2], nzs2[2];
    load_packed_b<false>(owner, sP_warp);
    const int tiles_per_group = group_size / kTile;
    int group_end = 0;  // s2 / nzs2 hold the scales of k tiles below it (chunks meet each boundary)
    load_chunk(0);
    for (int kc = 0; kc < ktiles; kc += kMoeChunk) {
      __syncthreads();  // the previous chunk's fragments have been read
#pragma unroll
      for (int i = 0; i < kXPerThread; ++i) {
        const int idx = threadIdx.x + i * kThreads;
        stage_a_permuted(sA, ROWS, idx / kVecsPerRow, (idx % kVecsPerRow) * 8, xv[i]);
      }
      if (tile_ok) store_packed_column(sP_warp, lane, wv[0], wv[1]);
      const half2 sz_chunk = sz[0];
      __syncthreads();
      if (kc + kMoeChunk < ktiles) load_chunk(kc + kMoeChunk);  // overlaps the MMAs below
      if (tile_ok) {
        if (kc == group_end) {  // warp-uniform: this group's (s, nzs) per slot
          group_end += tiles_per_group;
          slot_scales(owner, sz_chunk, s2, nzs2);
        }
        FragAB packed[2];
        load_packed_b<false>(packed, sP_warp);
        mma_packed_steps<false>(packed, s2, nzs2, sA, ROWS, acc);
      }
    }
  } else {
    load_chunk(0);
    for (int kc = 0; kc < ktiles; kc += kMoeChunk) {
      const int valid_tiles = min(kMoeChunk, ktiles - kc);
      __syncthreads();  // the previous chunk's fragments have been read
  #pragma unroll
      for (int i = 0; i < kXPerThread; ++i) {
        const int idx = threadIdx.x + i * kThreads;
        *reinterpret_cast<uint4*>(sA + (idx / kVecsPerRow) * kMoeLds + (idx % kVecsPerRow) * 8) = xv[i];
      }
      if (tile_ok) store_dequantised_column(sB_warp, kMoeLds, lane, wv, sz, valid_tiles);
      __syncthreads();
      if (kc + kMoeChunk < ktiles) load_chunk(kc + kMoeChunk);  // overlaps the MMAs below
      if (tile_ok) {
  #pragma unroll
        for (int ks = 0; ks < kChunk / 16; ++ks) {
          if (ks < 2 * valid_tiles) {
            FragAB b[2];
  #pragma unroll
            for (int j = 0; j < 2; ++j) load_b_m16n16k16(b[j], sB_warp + j * 16 * kMoeLds + ks * 16, kMoeLds);
  #pragma unroll
            for (int i = 0; i < kMFrags; ++i) {
              FragAB af;
              load_a_m16n16k16(af, sA + i * 16 * kMoeLds + ks * 16, kMoeLds);
  #pragma unroll
              for (int j = 0; j < 2; ++j) mma_m16n16k16(acc[i][j], af, b[j]);
            }
          }
        }
      }
    }
  }

  __syncthreads();  // sA/sB are reused as sC
  float* sC_warp = sC + warp * ROWS * kMoeLdc;
#pragma unroll
  for (int i = 0; i < kMFrags; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) store_c_m16n16k16(sC_warp + i * 16 * kMoeLdc + j * 16, acc[i][j], kMoeLdc);
  __syncthreads();

  if (GATE_UP) {
    const int itiles = I / kTile;
    constexpr int kHalf = kMoeWarps / 2;
    for (int i = threadIdx.x; i < kHalf * ROWS * kTile; i += kThreads) {
      const int w = i / (ROWS * kTile);
      const int r = (i / kTile) % ROWS;
      const int col = i % kTile;
      const int c = blockIdx.x * kHalf + w;
      if (r < rows && c < itiles) {
        const float g = sC[(w * ROWS + r) * kMoeLdc + col];
        const float u = sC[((w + kHalf) * ROWS + r) * kMoeLdc + col];
        h[(size_t)(r0 + r) * I + c * kTile + col] = __float2half_rn(g / (1.0f + __expf(-g)) * u);
      }
    }
  } else {
    for (int i = threadIdx.x; i < kMoeWarps * ROWS * kTile; i += kThreads) {
      const int w = i / (ROWS * kTile);
      const int r = (i / kTile) % ROWS;
      const int col = i % kTile;
      const int c = blockIdx.x * kMoeWarps + w;
      if (r < rows && c < ntiles) {
        const int pair = row_pair[r];
        const float rw = weights32 ? reinterpret_cast<const float*>(weights)[pair]
                                   : __half2float(reinterpret_cast<const half*>(weights)[pair]);
        atomicAdd(ws + (size_t)(pair / top_k) * N + c * kTile + col,
                  rw * sC[(w * ROWS + r) * kMoeLdc + col]);
      }
    }
  }
}

}  // namespace onecat

// meta = expert_start [E+1] | tile_start [E+1] | sorted_pairs [P], int32 (see the top).
extern "C" __global__ void __launch_bounds__(onecat::kAlignThreads)
w4a16_moe_wmma_align(const void* ids, int ids64, int P, int E, int rows_per_tile, int* __restrict__ meta) {
  using namespace onecat;
  __shared__ int cursor[kAlignThreads];
  __shared__ int warp_pairs[kAlignThreads / 32], warp_tiles[kAlignThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  cursor[tid] = 0;
  __syncthreads();
  for (int p = tid; p < P; p += kAlignThreads) {
    const int e = moe_pair_expert(ids, ids64, p, E);
    if (e >= 0) atomicAdd(&cursor[e], 1);
  }
  __syncthreads();
  const int count = tid < E ? cursor[tid] : 0;
  const int tiles = (count + rows_per_tile - 1) / rows_per_tile;
  // Inclusive scans of both counts over the block: within each warp by shuffles, then of the
  // 32 warps' totals by warp 0 (two barriers, where a shared-memory scan takes two a step).
  int pairs_sum = count, tiles_sum = tiles;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int a = __shfl_up_sync(0xffffffffu, pairs_sum, offset);
    const int b = __shfl_up_sync(0xffffffffu, tiles_sum, offset);
    if (lane >= offset) pairs_sum += a, tiles_sum += b;
  }
  if (lane == 31) warp_pairs[warp] = pairs_sum, warp_tiles[warp] = tiles_sum;
  __syncthreads();
  if (warp == 0) {
    int a = warp_pairs[lane], b = warp_tiles[lane];
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int ua = __shfl_up_sync(0xffffffffu, a, offset);
      const int ub = __shfl_up_sync(0xffffffffu, b, offset);
      if (lane >= offset) a += ua, b += ub;
    }
    warp_pairs[lane] = a, warp_tiles[lane] = b;
  }
  __syncthreads();
  if (warp > 0) pairs_sum += warp_pairs[warp - 1], tiles_sum += warp_tiles[warp - 1];
  const int start = pairs_sum - count;
  if (tid < E) {
    meta[tid] = start;
    meta[E + 1 + tid] = tiles_sum - tiles;
    cursor[tid] = start;
  }
  if (tid == E - 1) {
    meta[E] = pairs_sum;
    meta[2 * E + 1] = tiles_sum;
  }
  __syncthreads();
  int* sorted_pairs = meta + 2 * (E + 1);
  for (int p = tid; p < P; p += kAlignThreads) {
    const int e = moe_pair_expert(ids, ids64, p, E);
    if (e >= 0) sorted_pairs[atomicAdd(&cursor[e], 1)] = p;
  }
}

// 64-row tiles (many pairs per expert) and 16-row tiles (a few: less padding per tile); _pk:
// dequantisation on packed fragments (group sizes that are multiples of 64; with 64-row
// tiles it needs 255 registers and measured slower, so only 16-row tiles are built).
#define ONECAT_MOE_WMMA(SUFFIX, ROWS, PACKED)                                                     \
  extern "C" __global__ void __launch_bounds__(32 * onecat::kMoeWarps) w4a16_moe_wmma_gate_up##SUFFIX( \
      const half* __restrict__ x, const int* __restrict__ meta, int E,                          \
      const uint4* __restrict__ w13_qweight, const half2* __restrict__ w13_scales,             \
      half* __restrict__ h, int top_k, int H, int I, int group_size) {                          \
    onecat::moe_tile<true, ROWS, PACKED>(x, meta, E, w13_qweight, w13_scales, 2 * I, H, group_size, \
                                         top_k, h, I, nullptr, 0, nullptr);                      \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(32 * onecat::kMoeWarps) w4a16_moe_wmma_down##SUFFIX( \
      const half* __restrict__ h, const int* __restrict__ meta, int E, const void* weights,     \
      int weights32, const uint4* __restrict__ w2_qweight, const half2* __restrict__ w2_scales, \
      float* __restrict__ ws, int top_k, int H, int I, int group_size) {                        \
    onecat::moe_tile<false, ROWS, PACKED>(h, meta, E, w2_qweight, w2_scales, H, I, group_size, top_k, \
                                          nullptr, I, weights, weights32, ws);                   \
  }

ONECAT_MOE_WMMA(, 64, false)
ONECAT_MOE_WMMA(_r16, 16, false)
ONECAT_MOE_WMMA(_r16_pk, 16, true)
