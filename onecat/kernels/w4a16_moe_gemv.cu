// Routed experts of a MoE block for decode (few (token, expert) pairs), on CUDA cores:
//   out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = ids[t, j]
// in two launches, reading every chosen expert's packed weights in place (no copies):
//
//   1. w4a16_moe_gemv_gate_up: h[p, :] = silu(gate_e(x[t])) * up_e(x[t]) for each pair
//      p = t*top_k + j, fp16 [P, I];
//   2. w4a16_moe_gemv_down: out[t, :] = sum_j w[t, j] * down_{e_j}(h[t*top_k + j, :]).
//
// Data layout (docs/FORMAT.md, w4a16_common.cuh), stacked over E experts:
//   w13 qweight u32 [E][2I/32][H/32][32 lanes][4]   column tiles 0..I/32-1 = gate, then up
//   w13 scales  half2 [E][2I/32][H/g][32 lanes]
//   w2  qweight u32 [E][H/32][I/32][32 lanes][4],   w2 scales half2 [E][H/32][I/g][32 lanes]
//   x [T, H] fp16, h [P, I] fp16, out [T, H] fp16, row-major; ids [T, top_k] int32 or int64,
//   routing weights [T, top_k] fp32 or fp16.  An id outside [0, E) (another rank's expert)
//   contributes nothing: its pair's block exits and its h row is never read.
//
// Thread mapping:
//   gate_up: grid (I/32, P), block kGateUpWarps warps.  Block (c, p) computes column tile c of
//     gate AND of up for pair p, so the lane that owns column lane_column(l) of both holds the
//     gate and up sums of the same output column.  The H/32 k tiles are cut into equal
//     contiguous ranges of `per_warp`, one per warp; each lane streams its column's 32 k of
//     gate and up per k tile (one 128-bit load each), kGateUpBatch k tiles in flight.  The
//     warps' fp32 sums are added in shared memory and warp 0 applies silu(g) * u (fp32) and
//     stores h in fp16.
//   down: grid (H/32, T), block kDownWarps warps.  Block (c, t) computes output column tile c
//     of token t over a "virtual K" of top_k * I: the concatenation of the token's k hidden
//     rows h[t*top_k .. t*top_k + top_k - 1] (contiguous in h), against the concatenation of
//     the chosen experts' w2 column tiles.  Virtual k tile v belongs to expert slot
//     j = v / (I/32), k tile v % (I/32) of expert ids[t, j].  Each warp takes `per_warp`
//     consecutive virtual k tiles and multiplies each tile's fp32 dot product by its routing
//     weight, so the weighted sum over experts is part of the reduction: no atomics, no
//     zeroed workspace, a deterministic summation order, one write of out.
//
// Why not fp32 atomics into a workspace for the sum over experts: they need a memset and a
// conversion pass per step (two more launches at decode, where launches dominate) and
// their order varies from run to run; the virtual-K walk needs neither.
//
// Arithmetic, as in w4a16_gemv.cu: weights dequantised in registers (the contract
// fma.rn.f16x2(q, s, -z*s)), products summed in fp16 in runs of 8 then in fp32.
#include "w4a16_common.cuh"

namespace onecat {

constexpr int kGateUpWarps = 8;
constexpr int kGateUpBatch = 4;  // k tiles of gate and of up loaded per warp step (8 uint4)
constexpr int kDownWarps = 16;
constexpr int kDownBatch = 4;    // virtual k tiles loaded per warp step (64 registers: 2 blocks per SM)

// Expert of pair p, or -1 when it lies outside [0, E).
__device__ __forceinline__ int pair_expert(const void* ids, int ids64, int p, int E) {
  const long long e = ids64 ? reinterpret_cast<const long long*>(ids)[p]
                            : (long long)reinterpret_cast<const int*>(ids)[p];
  return (e >= 0 && e < E) ? (int)e : -1;
}

__device__ __forceinline__ float pair_weight(const void* w, int w32, int p) {
  return w32 ? reinterpret_cast<const float*>(w)[p]
             : __half2float(reinterpret_cast<const half*>(w)[p]);
}

// Dot product of this lane's 32 dequantised weights of one tile with x[k], `xk` pointing at
// the tile's first k (16-byte aligned; broadcast loads): fp16 products in runs of 8, fp32 sum.
__device__ __forceinline__ float dot_dequantized(const half2 w[16], const half* __restrict__ xk) {
  const uint4* xp = reinterpret_cast<const uint4*>(xk);
  float acc = 0.0f;
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {  // 16 k per pair of words
    const uint4 xa = __ldg(xp + 2 * pair);
    const uint4 xb = __ldg(xp + 2 * pair + 1);
    const half2* wp = w + 8 * pair;
    half2 p = __hmul2(wp[0], as_half2(xa.x));
    half2 q = __hmul2(wp[4], as_half2(xb.x));
    p = __hfma2(wp[1], as_half2(xa.y), p);
    q = __hfma2(wp[5], as_half2(xb.y), q);
    p = __hfma2(wp[2], as_half2(xa.z), p);
    q = __hfma2(wp[6], as_half2(xb.z), q);
    p = __hfma2(wp[3], as_half2(xa.w), p);
    q = __hfma2(wp[7], as_half2(xb.w), q);
    const float2 f = __half22float2(__hadd2(p, q));
    acc += f.x + f.y;
  }
  return acc;
}

// The same with the lane's weights still packed (`wv`, `sz`): dequantise, then dot.
__device__ __forceinline__ float dot_tile(uint4 wv, half2 sz, const half* __restrict__ xk) {
  half2 w[16];
  dequant_tile(wv, sz, w);
  return dot_dequantized(w, xk);
}

}  // namespace onecat

extern "C" __global__ void __launch_bounds__(32 * onecat::kGateUpWarps)
w4a16_moe_gemv_gate_up(const half* __restrict__ x, const void* ids, int ids64,
                       const uint4* __restrict__ w13_qweight, const half2* __restrict__ w13_scales,
                       half* __restrict__ h, int top_k, int E, int H, int I, int group_size,
                       int per_warp) {
  using namespace onecat;
  const int c = blockIdx.x;
  const int p = blockIdx.y;
  const int e = pair_expert(ids, ids64, p, E);
  if (e < 0) return;  // another rank's expert: h[p] is never read
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int ktiles = H / kTile;
  const int groups = H / group_size;
  const int tiles_per_group = group_size / kTile;
  const int itiles = I / kTile;
  const size_t gate_tile = (size_t)e * 2 * itiles + c;  // column tile index in w13
  const size_t up_tile = gate_tile + itiles;
  const uint4* gate_w = w13_qweight + gate_tile * ktiles * 32 + lane;
  const uint4* up_w = w13_qweight + up_tile * ktiles * 32 + lane;
  const half* xr = x + (size_t)(p / top_k) * H;

  const int kt_begin = warp * per_warp;
  const int kt_end = min(ktiles, kt_begin + per_warp);
  float g = 0.0f, u = 0.0f;
  if (kt_begin < kt_end) {
    ScaleCursor gate_s(w13_scales + gate_tile * groups * 32 + lane, kt_begin, tiles_per_group);
    ScaleCursor up_s(w13_scales + up_tile * groups * 32 + lane, kt_begin, tiles_per_group);
#pragma unroll 1
    for (int kt = kt_begin; kt < kt_end; kt += kGateUpBatch) {
      uint4 wg[kGateUpBatch], wu[kGateUpBatch];
      half2 sg[kGateUpBatch], su[kGateUpBatch];
#pragma unroll
      for (int b = 0; b < kGateUpBatch; ++b) {
        if (kt + b < kt_end) {
          wg[b] = load_weights_streaming(gate_w + (size_t)(kt + b) * 32);
          wu[b] = load_weights_streaming(up_w + (size_t)(kt + b) * 32);
          sg[b] = gate_s.next();
          su[b] = up_s.next();
        }
      }
#pragma unroll
      for (int b = 0; b < kGateUpBatch; ++b) {
        if (kt + b < kt_end) {
          const half* xk = xr + (size_t)(kt + b) * kTile;
          g += dot_tile(wg[b], sg[b], xk);
          u += dot_tile(wu[b], su[b], xk);
        }
      }
    }
  }

  __shared__ float partial[kGateUpWarps][2][32];
  partial[warp][0][lane] = g;
  partial[warp][1][lane] = u;
  __syncthreads();
  if (warp == 0) {
    float gs = 0.0f, us = 0.0f;
#pragma unroll
    for (int w = 0; w < kGateUpWarps; ++w) {
      gs += partial[w][0][lane];
      us += partial[w][1][lane];
    }
    const float silu = gs / (1.0f + __expf(-gs));
    h[(size_t)p * I + c * kTile + lane_column(lane)] = __float2half_rn(silu * us);
  }
}

extern "C" __global__ void __launch_bounds__(32 * onecat::kDownWarps, 2)
w4a16_moe_gemv_down(const half* __restrict__ h, const void* ids, int ids64, const void* weights,
                    int weights32, const uint4* __restrict__ w2_qweight,
                    const half2* __restrict__ w2_scales, half* __restrict__ out, int top_k, int E,
                    int H, int I, int group_size, int per_warp) {
  using namespace onecat;
  const int c = blockIdx.x;
  const int t = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int itiles = I / kTile;
  const int htiles = H / kTile;
  const int groups = I / group_size;
  const int tiles_per_group = group_size / kTile;
  const int total = top_k * itiles;
  const half* ht = h + (size_t)t * top_k * I;

  const int v_begin = warp * per_warp;
  const int v_end = min(total, v_begin + per_warp);
  float acc = 0.0f;
#pragma unroll 1
  for (int v = v_begin; v < v_end; v += kDownBatch) {
    uint4 wv[kDownBatch];
    half2 sz[kDownBatch];
    float rw[kDownBatch];
    bool valid[kDownBatch];
#pragma unroll
    for (int b = 0; b < kDownBatch; ++b) {
      const int vt = v + b;
      valid[b] = false;
      if (vt < v_end) {
        const int j = vt / itiles;
        const int kt = vt - j * itiles;
        const int p = t * top_k + j;
        const int e = pair_expert(ids, ids64, p, E);  // warp-uniform
        if (e >= 0) {
          const size_t tile = (size_t)e * htiles + c;
          wv[b] = load_weights_streaming(w2_qweight + (tile * itiles + kt) * 32 + lane);
          sz[b] = __ldg(w2_scales + (tile * groups + kt / tiles_per_group) * 32 + lane);
          rw[b] = pair_weight(weights, weights32, p);
          valid[b] = true;
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kDownBatch; ++b)
      if (valid[b]) acc += rw[b] * dot_tile(wv[b], sz[b], ht + (size_t)(v + b) * kTile);
  }

  __shared__ float partial[kDownWarps][32];
  partial[warp][lane] = acc;
  __syncthreads();
  if (warp == 0) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kDownWarps; ++w) sum += partial[w][lane];
    out[(size_t)t * H + c * kTile + lane_column(lane)] = __float2half_rn(sum);
  }
}

// ---------------------------------------------------------------------------------------------
// Expert-grouped decode path (2..~64 tokens): every touched expert's packed weights are read
// ONCE per call, however many of the batch's pairs chose it.  Four launches, no host sync:
//
//   0. w4a16_moe_gemv_grouped_align (one block of kGroupedAlignThreads): counts the pairs per
//      expert and cuts each expert's pairs into work items of at most kGroupedRows pairs,
//      written as records of kItemInts ints: [0] expert, [1] rows (0: no work, the block
//      exits), [2 .. 2+rows) pair indices p = t*top_k + j (in any order: rows are independent).
//      Records are numbered from the HIGHEST expert index down, so the folded shared expert
//      (the spare slot after the routed experts, one pair per token: the most rows) is
//      scheduled first instead of forming the tail.  The caller sizes the records by the bound
//      min(E, P) + ceil(P / kGroupedRows); records past the count get rows = 0.
//   1. w4a16_moe_gemv_grouped_gate_up: grid (I/32, records), kGroupedGateUpWarps warps.
//      Block (c, i) computes gate AND up column tile c for the rows of record i: the H/32
//      k tiles are cut into `per_warp` contiguous ranges, one per warp; each lane streams its
//      column's gate and up fragments (kGroupedBatch k tiles in flight), dequantises each
//      fragment ONCE in registers and applies it to every row of the record (x rows read with
//      broadcast loads through L1; fp32 sums per row in registers: 2 x kGroupedRows).  The
//      warps' sums meet in shared memory; h[p, :] = silu(g) * u (fp32, one fp16 rounding)
//      is written at each pair's own index p, so h keeps the per-pair layout.
//   2. w4a16_moe_gemv_grouped_down: grid (H/32 / kGroupedDownCols, records), warps =
//      kGroupedDownCols column tiles x kGroupedDownSplits k ranges (I/32 is short: splitting
//      it keeps enough loads in flight at 2..8 tokens).  Same inner loop over the rows of h;
//      y[p, :] = down_e(h[p]) in fp32 [P, H] scratch (no routing weight yet).
//   3. w4a16_moe_gemv_grouped_sum: out[t, :] = sum_j w[t, j] * y[t*top_k + j, :] in fp32
//      over the token's pairs in order j = 0..top_k-1 (pairs with ids outside [0, E) skipped,
//      their y rows are never written), one fp16 rounding: deterministic, no atomics.
//
// Arithmetic per row is exactly the gather kernels' (dequant contract, fp16 products in runs
// of 8, fp32 sums), so both paths share one tolerance.
// ---------------------------------------------------------------------------------------------

namespace onecat {

constexpr int kGroupedRows = 8;            // pairs of one expert per record (work item)
constexpr int kItemInts = 16;              // ints per record (64 bytes; 2 + kGroupedRows used)
constexpr int kGroupedAlignThreads = 1024; // one thread per expert: E <= 1024
constexpr int kGroupedGateUpWarps = 8;
constexpr int kGroupedBatch = 4;           // gate_up: k tiles of gate and of up per warp step
constexpr int kGroupedDownCols = 4;        // down: column tiles per block
constexpr int kGroupedDownSplits = 2;      // down: k ranges per column tile
constexpr int kGroupedDownBatch = 8;       // down: k tiles per warp step
constexpr int kGroupedSumThreads = 256;
static_assert(2 + kGroupedRows <= kItemInts, "a record holds its expert, rows and pairs");

// Loads record `index` into shared memory (threads 0..kItemInts-1) and the token of each of
// its rows; returns the record's row count (0: nothing to do).  Call from every thread.
__device__ __forceinline__ int load_record(const int* __restrict__ items, int index, int top_k,
                                           int* s_item, int* s_token) {
  if (threadIdx.x < kItemInts) {
    const int v = __ldg(items + (size_t)index * kItemInts + threadIdx.x);
    s_item[threadIdx.x] = v;
    if (threadIdx.x >= 2 && threadIdx.x < 2 + kGroupedRows) s_token[threadIdx.x - 2] = v / top_k;
  }
  __syncthreads();
  return s_item[1];
}

}  // namespace onecat

extern "C" __global__ void __launch_bounds__(onecat::kGroupedAlignThreads)
w4a16_moe_gemv_grouped_align(const void* ids, int ids64, int P, int E, int max_items,
                             int* __restrict__ items) {
  using namespace onecat;
  __shared__ int count[kGroupedAlignThreads];  // pairs per expert, then a cursor
  __shared__ int first_item[kGroupedAlignThreads];
  __shared__ int warp_sums[kGroupedAlignThreads / 32];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  count[tid] = 0;
  __syncthreads();
  for (int p = tid; p < P; p += kGroupedAlignThreads) {
    const int e = pair_expert(ids, ids64, p, E);
    if (e >= 0) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  const int e = E - 1 - tid;  // highest expert first (see the top)
  const int n = e >= 0 ? count[e] : 0;
  const int mine = (n + kGroupedRows - 1) / kGroupedRows;
  int incl = mine;  // inclusive scan of `mine` over tid: within the warp, then over warps
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int s = warp_sums[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += v;
    }
    warp_sums[lane] = s;
  }
  __syncthreads();
  const int first = incl - mine + (warp > 0 ? warp_sums[warp - 1] : 0);
  const int total = warp_sums[kGroupedAlignThreads / 32 - 1];
  if (e >= 0) {
    count[e] = 0;
    first_item[e] = first;
    for (int k = 0; k < mine; ++k) {
      int* record = items + (size_t)(first + k) * kItemInts;
      record[0] = e;
      record[1] = min(kGroupedRows, n - k * kGroupedRows);
    }
  }
  for (int i = total + tid; i < max_items; i += kGroupedAlignThreads) items[(size_t)i * kItemInts + 1] = 0;
  __syncthreads();
  for (int p = tid; p < P; p += kGroupedAlignThreads) {
    const int pe = pair_expert(ids, ids64, p, E);
    if (pe >= 0) {
      const int pos = atomicAdd(&count[pe], 1);
      items[(size_t)(first_item[pe] + pos / kGroupedRows) * kItemInts + 2 + pos % kGroupedRows] = p;
    }
  }
}

extern "C" __global__ void __launch_bounds__(32 * onecat::kGroupedGateUpWarps, 2)
w4a16_moe_gemv_grouped_gate_up(const half* __restrict__ x, const int* __restrict__ items,
                               const uint4* __restrict__ w13_qweight,
                               const half2* __restrict__ w13_scales, half* __restrict__ h,
                               int top_k, int H, int I, int group_size, int per_warp) {
  using namespace onecat;
  __shared__ int s_item[kItemInts];
  __shared__ int s_token[kGroupedRows];
  __shared__ float partial[kGroupedGateUpWarps][2][kGroupedRows][32];
  const int rows = load_record(items, blockIdx.y, top_k, s_item, s_token);
  if (rows == 0) return;
  const int e = s_item[0];
  const int c = blockIdx.x;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int ktiles = H / kTile;
  const int groups = H / group_size;
  const int tiles_per_group = group_size / kTile;
  const int itiles = I / kTile;
  const size_t gate_tile = (size_t)e * 2 * itiles + c;
  const size_t up_tile = gate_tile + itiles;
  const uint4* gate_w = w13_qweight + gate_tile * ktiles * 32 + lane;
  const uint4* up_w = w13_qweight + up_tile * ktiles * 32 + lane;

  const int kt_begin = warp * per_warp;
  const int kt_end = min(ktiles, kt_begin + per_warp);
  float g[kGroupedRows], u[kGroupedRows];
#pragma unroll
  for (int r = 0; r < kGroupedRows; ++r) g[r] = u[r] = 0.0f;
  if (kt_begin < kt_end) {
    ScaleCursor gate_s(w13_scales + gate_tile * groups * 32 + lane, kt_begin, tiles_per_group);
    ScaleCursor up_s(w13_scales + up_tile * groups * 32 + lane, kt_begin, tiles_per_group);
#pragma unroll 1
    for (int kt = kt_begin; kt < kt_end; kt += kGroupedBatch) {
      uint4 wg[kGroupedBatch], wu[kGroupedBatch];
      half2 sg[kGroupedBatch], su[kGroupedBatch];
#pragma unroll
      for (int b = 0; b < kGroupedBatch; ++b) {
        if (kt + b < kt_end) {
          wg[b] = load_weights_streaming(gate_w + (size_t)(kt + b) * 32);
          wu[b] = load_weights_streaming(up_w + (size_t)(kt + b) * 32);
          sg[b] = gate_s.next();
          su[b] = up_s.next();
        }
      }
#pragma unroll
      for (int b = 0; b < kGroupedBatch; ++b) {
        if (kt + b < kt_end) {
          // gate, then up: one fragment's 16 dequantised pairs live at a time (the x rows
          // are read twice, from L1) to stay under 128 registers.
          half2 w[16];
          dequant_tile(wg[b], sg[b], w);
#pragma unroll
          for (int r = 0; r < kGroupedRows; ++r)
            if (r < rows) g[r] += dot_dequantized(w, x + (size_t)s_token[r] * H + (size_t)(kt + b) * kTile);
          dequant_tile(wu[b], su[b], w);
#pragma unroll
          for (int r = 0; r < kGroupedRows; ++r)
            if (r < rows) u[r] += dot_dequantized(w, x + (size_t)s_token[r] * H + (size_t)(kt + b) * kTile);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kGroupedRows; ++r) {
    partial[warp][0][r][lane] = g[r];
    partial[warp][1][r][lane] = u[r];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kGroupedRows * 32; idx += 32 * kGroupedGateUpWarps) {
    const int r = idx >> 5;
    const int l = idx & 31;
    if (r < rows) {
      float gs = 0.0f, us = 0.0f;
#pragma unroll
      for (int w = 0; w < kGroupedGateUpWarps; ++w) {
        gs += partial[w][0][r][l];
        us += partial[w][1][r][l];
      }
      const float silu = gs / (1.0f + __expf(-gs));
      h[(size_t)s_item[2 + r] * I + c * kTile + lane_column(l)] = __float2half_rn(silu * us);
    }
  }
}

extern "C" __global__ void __launch_bounds__(32 * onecat::kGroupedDownCols * onecat::kGroupedDownSplits, 2)
w4a16_moe_gemv_grouped_down(const half* __restrict__ h, const int* __restrict__ items,
                            const uint4* __restrict__ w2_qweight, const half2* __restrict__ w2_scales,
                            float* __restrict__ y, int top_k, int H, int I, int group_size,
                            int per_warp) {
  using namespace onecat;
  __shared__ int s_item[kItemInts];
  __shared__ int s_token[kGroupedRows];
  __shared__ float partial[kGroupedDownSplits][kGroupedDownCols][kGroupedRows][32];
  const int rows = load_record(items, blockIdx.y, top_k, s_item, s_token);
  if (rows == 0) return;
  const int e = s_item[0];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int col = warp % kGroupedDownCols;
  const int split = warp / kGroupedDownCols;
  const int htiles = H / kTile;
  const int itiles = I / kTile;
  const int groups = I / group_size;
  const int tiles_per_group = group_size / kTile;
  const int c = blockIdx.x * kGroupedDownCols + col;
  const bool tile_ok = c < htiles;
  const size_t tile = (size_t)e * htiles + (tile_ok ? c : 0);
  const uint4* wt = w2_qweight + tile * itiles * 32 + lane;

  const int kt_begin = split * per_warp;
  const int kt_end = tile_ok ? min(itiles, kt_begin + per_warp) : kt_begin;
  float acc[kGroupedRows];
#pragma unroll
  for (int r = 0; r < kGroupedRows; ++r) acc[r] = 0.0f;
  if (kt_begin < kt_end) {
    ScaleCursor scales(w2_scales + tile * groups * 32 + lane, kt_begin, tiles_per_group);
#pragma unroll 1
    for (int kt = kt_begin; kt < kt_end; kt += kGroupedDownBatch) {
      uint4 wv[kGroupedDownBatch];
      half2 sz[kGroupedDownBatch];
#pragma unroll
      for (int b = 0; b < kGroupedDownBatch; ++b) {
        if (kt + b < kt_end) {
          wv[b] = load_weights_streaming(wt + (size_t)(kt + b) * 32);
          sz[b] = scales.next();
        }
      }
#pragma unroll
      for (int b = 0; b < kGroupedDownBatch; ++b) {
        if (kt + b < kt_end) {
          half2 w[16];
          dequant_tile(wv[b], sz[b], w);
#pragma unroll
          for (int r = 0; r < kGroupedRows; ++r)
            if (r < rows) acc[r] += dot_dequantized(w, h + (size_t)s_item[2 + r] * I + (size_t)(kt + b) * kTile);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kGroupedRows; ++r) partial[split][col][r][lane] = acc[r];
  __syncthreads();
  constexpr int kOutputs = kGroupedDownCols * kGroupedRows * 32;
  for (int idx = threadIdx.x; idx < kOutputs; idx += 32 * kGroupedDownCols * kGroupedDownSplits) {
    const int oc = idx / (kGroupedRows * 32);
    const int r = (idx >> 5) % kGroupedRows;
    const int l = idx & 31;
    const int cc = blockIdx.x * kGroupedDownCols + oc;
    if (r < rows && cc < htiles) {
      float sum = 0.0f;
#pragma unroll
      for (int s = 0; s < kGroupedDownSplits; ++s) sum += partial[s][oc][r][l];
      y[(size_t)s_item[2 + r] * H + cc * kTile + lane_column(l)] = sum;
    }
  }
}

extern "C" __global__ void __launch_bounds__(onecat::kGroupedSumThreads)
w4a16_moe_gemv_grouped_sum(const float* __restrict__ y, const void* ids, int ids64,
                           const void* weights, int weights32, half* __restrict__ out, int T,
                           int top_k, int E, int H) {
  using namespace onecat;
  const int quads = H / 4;
  const long long idx = (long long)blockIdx.x * kGroupedSumThreads + threadIdx.x;
  if (idx >= (long long)T * quads) return;
  const int t = (int)(idx / quads);
  const int q = (int)(idx - (long long)t * quads);
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int j = 0; j < top_k; ++j) {
    const int p = t * top_k + j;
    if (pair_expert(ids, ids64, p, E) < 0) continue;  // never written
    const float w = pair_weight(weights, weights32, p);
    const float4 v = __ldg(reinterpret_cast<const float4*>(y + (size_t)p * H) + q);
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
  }
  half2* dst = reinterpret_cast<half2*>(out + (size_t)t * H + 4 * q);
  dst[0] = __floats2half2_rn(acc.x, acc.y);
  dst[1] = __floats2half2_rn(acc.z, acc.w);
}
