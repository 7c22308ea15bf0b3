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
// Thread mapping (kGateUpWarps / kGateUpBatch and kDownWarps / kDownBatch are template
// parameters; the kernels are built as _w{warps}_b{batch} and moe.GATHER_SHAPES picks them by
// token count: 8- and 16-warp blocks at 1-2 tokens, where few blocks must spread over the
// GPU, 4- and 8-warp blocks from 4 tokens on, where more resident blocks hide the loads'
// latency):
//   gate_up: grid (I/32, P), block kGateUpWarps warps.  Block (c, p) computes column tile c of
//     gate AND of up for pair p, so the lane that owns column lane_column(l) of both holds the
//     gate and up sums of the same output column.  The H/32 k tiles are cut into equal
//     contiguous ranges of `per_warp`, one per warp; each lane streams its column's 32 k of
//     gate and up per k tile (one 128-bit load each), kGateUpBatch k tiles in flight.  The
//     warps' fp32 sums are added in shared memory and warp 0 applies silu(g) * u (fp32) and
//     stores h in fp16.
//   down: grid (H/32, T, S), block kDownWarps warps.  Block (c, t, s) computes output column
//     tile c of token t over split s of a "virtual K" of top_k * I: the concatenation of the
//     token's k hidden rows h[t*top_k .. t*top_k + top_k - 1] (contiguous in h), against the
//     concatenation of the chosen experts' w2 column tiles.  Virtual k tile v belongs to
//     expert slot j = v / (I/32), k tile v % (I/32) of expert ids[t, j].  The S splits take
//     equal consecutive ranges of it, and each warp `per_warp` consecutive virtual k tiles of
//     its split, multiplying each tile's fp32 dot product by its routing weight, so the
//     weighted sum over experts is part of the reduction.  S = 1 (the host's choice from
//     about two tokens up): the block writes out.  S > 1 (one token: H/32 = 64 blocks would
//     leave half of the SMs idle with three dependent rounds of loads per warp): each block
//     adds its fp32 partial to the column's 64-bit split word [t][H] (split_sum_add,
//     w4a16_common.cuh: an exact fixed-point sum, so the result does not depend on the order
//     of arrival, and a count in the same atomic), and the block whose add completes the S
//     splits writes out and re-zeroes the word.  No memset, no fence or read-back round trip,
//     one write of out.
//
// Grouped decode (from moe.GROUPED_GEMV_MIN_TOKENS tokens): with one block per pair, an
// expert chosen by n tokens (the folded shared expert: by every token) is read n times.
// Instead the pairs are first sorted by expert (w4a16_moe_wmma_align, row tiles of R pairs of
// one expert), then:
//   grouped gate_up: grid (I/32, row-tile bound), block kWarps warps, the k tiles split over
//     the warps as above; each lane's gate and up tiles are loaded and dequantised once and
//     multiplied with the x rows of the tile's R (or fewer) tokens; h is written in sorted
//     order.
//   grouped down: grid (H/32/kWarps, row-tile bound); warp w owns output column tile
//     b*kWarps + w over all I/32 k tiles, dequantises each tile once for the R h rows, and
//     writes w[p] * sum (fp32) to row p of pair_out [P, H].
//   w4a16_moe_gemv_pair_sum: grid (ceil(H/1024), T), 256 threads of 4 columns: out[t] = the
//     sum of the token's pair rows in j order (deterministic), ids outside [0, E) skipped.
//
// Activation staging (gate_up, both paths; grouped down): each lane needs all 32 x (or h)
// values of every k tile it multiplies, and a global load of them inside the loop waits on
// the tile's dequantisation and then on an L1 / L2 round trip, once per row and tile, in
// series.  So gate_up's warps first copy their k range of the x rows (kStageMaxH halfs at
// most a row: 8 KB a row of shared memory) and the grouped down's block copies its h rows
// (kStageMaxI) to shared memory, all loads in flight at once, and the loops read them with
// broadcast 128-bit LDS.  Wider rows take the unstaged instantiation.  H200, 35B-A3B layer:
// the op at 32 tokens 127.5 -> 113.8 us (BENCHMARKS.md, 2026-12-02).
//
// Why not fp32 atomics into a workspace for the sum over experts: they need a memset and a
// conversion pass per step (two more launches at decode, where launches dominate) and
// their order varies from run to run; the virtual-K walk needs neither.
//
// Arithmetic: weights dequantised in registers as in w4a16_gemv.cu (the contract
// fma.rn.f16x2(q, s, -z*s)), products summed in fp16 in runs of 16 (a k tile) then in fp32.
#include "w4a16_common.cuh"

namespace onecat {
constexpr int kStageMaxH = 4096;  // widest x row (halfs) gate_up stages in shared memory
constexpr int kStageMaxI = 2048;  // widest h row (halfs) the grouped down stages

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

// Dot product of this lane's 32 dequantised k of one tile `w` with the tile's 32 x values
// `x` (8 per 128-bit vector): two fp16x2 chains of 8 products a fp16 lane, added in fp16
// (16 products a lane), then the two lanes in fp32: one conversion a tile.  The dense GEMV
// converts every 16 k (partial sums of 8); converting per tile here cut the grouped gate_up's
// sm_90 code by 6% (static count) in these issue-bound kernels (BENCHMARKS.md, 2026-12-02).
__device__ __forceinline__ float dot_values(const half2 (&w)[16], const uint4 (&x)[4]) {
  half2 p = __hmul2(w[0], as_half2(x[0].x));
  half2 q = __hmul2(w[4], as_half2(x[1].x));
  p = __hfma2(w[1], as_half2(x[0].y), p);
  q = __hfma2(w[5], as_half2(x[1].y), q);
  p = __hfma2(w[2], as_half2(x[0].z), p);
  q = __hfma2(w[6], as_half2(x[1].z), q);
  p = __hfma2(w[3], as_half2(x[0].w), p);
  q = __hfma2(w[7], as_half2(x[1].w), q);
  p = __hfma2(w[8], as_half2(x[2].x), p);
  q = __hfma2(w[12], as_half2(x[3].x), q);
  p = __hfma2(w[9], as_half2(x[2].y), p);
  q = __hfma2(w[13], as_half2(x[3].y), q);
  p = __hfma2(w[10], as_half2(x[2].z), p);
  q = __hfma2(w[14], as_half2(x[3].z), q);
  p = __hfma2(w[11], as_half2(x[2].w), p);
  q = __hfma2(w[15], as_half2(x[3].w), q);
  const float2 f = __half22float2(__hadd2(p, q));
  return f.x + f.y;
}

// The same with x read from global memory, `xk` pointing at the tile's first k (16-byte
// aligned; broadcast loads).
__device__ __forceinline__ float dot_dequantised(const half2 (&w)[16], const half* __restrict__ xk) {
  const uint4* xp = reinterpret_cast<const uint4*>(xk);
  const uint4 x[4] = {__ldg(xp), __ldg(xp + 1), __ldg(xp + 2), __ldg(xp + 3)};
  return dot_values(w, x);
}

// The 32 activation values of k tile kt of one row: from its shared-memory copy `staged`
// (kStaged) or from global memory at `row`.
template <bool kStaged>
__device__ __forceinline__ void tile_values(uint4 (&out)[kTile / 8], const uint4* staged, const half* __restrict__ row,
                                            int kt) {
  const uint4* src = reinterpret_cast<const uint4*>(row + (size_t)kt * kTile);
#pragma unroll
  for (int q = 0; q < kTile / 8; ++q) out[q] = kStaged ? staged[kt * (kTile / 8) + q] : __ldg(src + q);
}

// The same for a packed tile (`wv`, `sz`), dequantised first.
__device__ __forceinline__ float dot_tile(uint4 wv, half2 sz, const half* __restrict__ xk) {
  half2 w[16];
  dequant_tile(wv, sz, w);
  return dot_dequantised(w, xk);
}

// Column tile c of expert e's gate and up for R activation rows xr[i] (the first `rows` of
// them real; the others repeat a real row and are never stored): the H/32 k tiles split into
// ranges of `per_warp` over the block's warps, each lane's gate and up tiles loaded
// (kBatch k tiles in flight) and dequantised once for all rows; warp 0 adds the warps' sums
// and writes fp16(silu(g) * u) to hr[i][c*32 + column].
template <int kWarps, int kBatch, int R, bool kStaged>
__device__ __forceinline__ void gate_up_tile(const half* const (&xr)[R], half* const (&hr)[R], int rows, int e,
                                             const uint4* __restrict__ w13_qweight,
                                             const half2* __restrict__ w13_scales, int H, int I,
                                             int group_size, int per_warp) {
  const int c = blockIdx.x;
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

  const int kt_begin = warp * per_warp;
  const int kt_end = min(ktiles, kt_begin + per_warp);
  float g[R], u[R];
#pragma unroll
  for (int i = 0; i < R; ++i) g[i] = u[i] = 0.0f;
  // kStaged: the warp first copies its k range of the x rows to shared memory (one round
  // trip, all loads in flight), so the dot products read x with broadcast LDS instead of a
  // global load per row and tile that waits on the weights' dequantisation (a serial L1 /
  // L2 round trip per row and tile).  Warps' ranges are disjoint: no block barrier.
  __shared__ uint4 xs[kStaged ? R : 1][kStaged ? kStageMaxH / 8 : 1];
  constexpr int kVecs = kTile / 8;  // 128-bit x vectors per k tile
  if (kStaged && kt_begin < kt_end) {
    const int first = kt_begin * kVecs, count = (kt_end - kt_begin) * kVecs;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (i < rows) {
        const uint4* src = reinterpret_cast<const uint4*>(xr[i]);
        for (int v = lane; v < count; v += 32) xs[i][first + v] = __ldg(src + first + v);
      }
    }
    __syncwarp();
  }
  if (kt_begin < kt_end) {
    ScaleCursor gate_s(w13_scales + gate_tile * groups * 32 + lane, kt_begin, tiles_per_group);
    ScaleCursor up_s(w13_scales + up_tile * groups * 32 + lane, kt_begin, tiles_per_group);
#pragma unroll 1
    for (int kt = kt_begin; kt < kt_end; kt += kBatch) {
      uint4 wg[kBatch], wu[kBatch];
      half2 sg[kBatch], su[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (kt + b < kt_end) {
          wg[b] = load_weights_streaming(gate_w + (size_t)(kt + b) * 32);
          wu[b] = load_weights_streaming(up_w + (size_t)(kt + b) * 32);
          sg[b] = gate_s.next();
          su[b] = up_s.next();
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (kt + b < kt_end) {
          half2 wgd[16], wud[16];
          dequant_tile(wg[b], sg[b], wgd);
          dequant_tile(wu[b], su[b], wud);
#pragma unroll
          for (int i = 0; i < R; ++i) {
            if (i < rows) {
              uint4 xv[kVecs];
              tile_values<kStaged>(xv, xs[i], xr[i], kt + b);
              g[i] += dot_values(wgd, xv);
              u[i] += dot_values(wud, xv);
            }
          }
        }
      }
    }
  }

  __shared__ float partial[kWarps][2][R][32];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    partial[warp][0][i][lane] = g[i];
    partial[warp][1][i][lane] = u[i];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (i < rows) {
        float gs = 0.0f, us = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          gs += partial[w][0][i][lane];
          us += partial[w][1][i][lane];
        }
        const float silu = gs / (1.0f + __expf(-gs));
        hr[i][c * kTile + lane_column(lane)] = __float2half_rn(silu * us);
      }
    }
  }
}

// Gather gate_up: block (c, p) runs gate_up_tile for pair p alone (its token's x row, h row p).
template <int kGateUpWarps, int kGateUpBatch>
__device__ __forceinline__ void gate_up_body(const half* __restrict__ x, const void* ids, int ids64,
                                             const uint4* __restrict__ w13_qweight,
                                             const half2* __restrict__ w13_scales, half* __restrict__ h,
                                             int top_k, int E, int H, int I, int group_size, int per_warp) {
  const int p = blockIdx.y;
  const int e = pair_expert(ids, ids64, p, E);
  if (e < 0) return;  // another rank's expert: h[p] is never read
  const half* xr[1] = {x + (size_t)(p / top_k) * H};
  half* hr[1] = {h + (size_t)p * I};
  if (H <= kStageMaxH)
    gate_up_tile<kGateUpWarps, kGateUpBatch, 1, true>(xr, hr, 1, e, w13_qweight, w13_scales, H, I, group_size, per_warp);
  else
    gate_up_tile<kGateUpWarps, kGateUpBatch, 1, false>(xr, hr, 1, e, w13_qweight, w13_scales, H, I, group_size, per_warp);
}

template <int kDownWarps, int kDownBatch>
__device__ __forceinline__ void down_body(const half* __restrict__ h, const void* ids, int ids64,
                                          const void* weights, int weights32,
                                          const uint4* __restrict__ w2_qweight,
                                          const half2* __restrict__ w2_scales, half* __restrict__ out,
                                          int top_k, int E, int H, int I, int group_size, int per_warp,
                                          unsigned long long* split_words) {
  const int c = blockIdx.x;
  const int t = blockIdx.y;
  const int splits = gridDim.z;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int itiles = I / kTile;
  const int htiles = H / kTile;
  const int groups = I / group_size;
  const int tiles_per_group = group_size / kTile;
  const int total = top_k * itiles;
  const half* ht = h + (size_t)t * top_k * I;

  const int per_split = (total + splits - 1) / splits;
  const int split_end = min(total, ((int)blockIdx.z + 1) * per_split);
  const int v_begin = (int)blockIdx.z * per_split + warp * per_warp;
  const int v_end = min(split_end, v_begin + per_warp);
  const SmallDivisor by_itiles(itiles), by_group(tiles_per_group);  // no division per tile
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
        const int j = by_itiles.div(vt);
        const int kt = vt - j * itiles;
        const int p = t * top_k + j;
        const int e = pair_expert(ids, ids64, p, E);  // warp-uniform
        if (e >= 0) {
          const size_t tile = (size_t)e * htiles + c;
          wv[b] = load_weights_streaming(w2_qweight + (tile * itiles + kt) * 32 + lane);
          sz[b] = __ldg(w2_scales + (tile * groups + by_group.div(kt)) * 32 + lane);
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
  const size_t column = (size_t)c * kTile + lane_column(lane);
  float sum = 0.0f;
  if (warp != 0) return;
#pragma unroll
  for (int w = 0; w < kDownWarps; ++w) sum += partial[w][lane];
  if (splits > 1) {
    unsigned long long* word = split_words + (size_t)t * H + column;
    if (!split_sum_total(split_sum_add(word, sum), splits, word, sum)) return;
  }
  out[(size_t)t * H + column] = __float2half_rn(sum);
}

// --- grouped decode: one block per (column tile, row tile of one expert) ------------------

// Grouped gate_up: block (c, tile) runs gate_up_tile for the R (or fewer) sorted positions of
// one row tile (the tokens' x rows; h rows in sorted order).
template <int kWarps, int kBatch, int R>
__device__ __forceinline__ void grouped_gate_up_body(const half* __restrict__ x, const int* __restrict__ meta,
                                                     int E, const uint4* __restrict__ w13_qweight,
                                                     const half2* __restrict__ w13_scales, half* __restrict__ h,
                                                     int top_k, int H, int I, int group_size, int per_warp) {
  RowTile rt;
  if (!find_row_tile(meta, E, R, blockIdx.y, rt)) return;
  const int* sorted_pairs = meta + 2 * (E + 1);
  const half* xr[R];
  half* hr[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {  // padding rows repeat the last row (computed, never stored)
    xr[i] = x + (size_t)(__ldg(sorted_pairs + rt.r0 + min(i, rt.rows - 1)) / top_k) * H;
    hr[i] = h + (size_t)(rt.r0 + i) * I;
  }
  if (H <= kStageMaxH)
    gate_up_tile<kWarps, kBatch, R, true>(xr, hr, rt.rows, rt.e, w13_qweight, w13_scales, H, I, group_size, per_warp);
  else
    gate_up_tile<kWarps, kBatch, R, false>(xr, hr, rt.rows, rt.e, w13_qweight, w13_scales, H, I, group_size, per_warp);
}

// Grouped down: warp w of block (b, tile) computes output column tile c = b * kWarps + w of
// down_e(h[s]) over all I/32 k tiles for the sorted positions s of one row tile (h in sorted
// order, as the grouped gate_up writes it), and stores w[p] * that, fp32, at row p (the pair
// of s) of pair_out [P, H]; w4a16_moe_gemv_pair_sum adds each token's rows in j order.
template <int kWarps, int kBatch, int R, bool kStaged>
__device__ __forceinline__ void grouped_down_body(const half* __restrict__ h, const int* __restrict__ meta,
                                                  int E, const void* weights, int weights32,
                                                  const uint4* __restrict__ w2_qweight,
                                                  const half2* __restrict__ w2_scales,
                                                  float* __restrict__ pair_out, int H, int I, int group_size) {
  RowTile rt;
  if (!find_row_tile(meta, E, R, blockIdx.y, rt)) return;  // uniform over the block
  const int lane = threadIdx.x & 31;
  const int c = blockIdx.x * kWarps + (threadIdx.x >> 5);
  // kStaged: the block copies the tile's h rows (all warps read all of them) to shared
  // memory first, so the dot products read them with broadcast LDS (see gate_up_tile).
  __shared__ uint4 hs[kStaged ? R : 1][kStaged ? kStageMaxI / 8 : 1];
  if (kStaged) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (i < rt.rows) {
        const uint4* src = reinterpret_cast<const uint4*>(h + (size_t)(rt.r0 + i) * I);
        for (int v = threadIdx.x; v < I / 8; v += 32 * kWarps) hs[i][v] = __ldg(src + v);
      }
    }
    __syncthreads();
  }
  if (c >= H / kTile) return;  // no block-wide synchronisation below
  const int* sorted_pairs = meta + 2 * (E + 1);
  const int ktiles = I / kTile;
  const int groups = I / group_size;
  const size_t tile = (size_t)rt.e * (H / kTile) + c;
  const uint4* w_tile = w2_qweight + tile * ktiles * 32 + lane;
  ScaleCursor scales(w2_scales + tile * groups * 32 + lane, 0, group_size / kTile);
  const half* hr[R];
#pragma unroll
  for (int i = 0; i < R; ++i) hr[i] = h + (size_t)(rt.r0 + min(i, rt.rows - 1)) * I;

  float acc[R];
#pragma unroll
  for (int i = 0; i < R; ++i) acc[i] = 0.0f;
#pragma unroll 1
  for (int kt = 0; kt < ktiles; kt += kBatch) {
    uint4 wv[kBatch];
    half2 sz[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (kt + b < ktiles) {
        wv[b] = load_weights_streaming(w_tile + (size_t)(kt + b) * 32);
        sz[b] = scales.next();
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (kt + b < ktiles) {
        half2 w[16];
        dequant_tile(wv[b], sz[b], w);
#pragma unroll
        for (int i = 0; i < R; ++i) {
          if (i < rt.rows) {
            uint4 hv[kTile / 8];
            tile_values<kStaged>(hv, hs[i], hr[i], kt + b);
            acc[i] += dot_values(w, hv);
          }
        }
      }
    }
  }
  const int column = c * kTile + lane_column(lane);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (i < rt.rows) {
      const int p = __ldg(sorted_pairs + rt.r0 + i);
      pair_out[(size_t)p * H + column] = pair_weight(weights, weights32, p) * acc[i];
    }
  }
}

}  // namespace onecat

// out[t, :] = fp16(sum over j of pair_out[t*top_k + j, :]) in j order, pairs whose id lies
// outside [0, E) left out.  grid (ceil(H / 1024), T), 256 threads, 4 columns each.
extern "C" __global__ void __launch_bounds__(256)
w4a16_moe_gemv_pair_sum(const float* __restrict__ pair_out, const void* ids, int ids64, int E, half* __restrict__ out,
                   int top_k, int H) {
  const int t = blockIdx.y;
  const int col = (blockIdx.x * 256 + threadIdx.x) * 4;
  if (col >= H) return;
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int j = 0; j < top_k; ++j) {
    const int p = t * top_k + j;
    if (onecat::pair_expert(ids, ids64, p, E) < 0) continue;
    const float4 v = __ldg(reinterpret_cast<const float4*>(pair_out + (size_t)p * H + col));
    sum.x += v.x;
    sum.y += v.y;
    sum.z += v.z;
    sum.w += v.w;
  }
  half2* o = reinterpret_cast<half2*>(out + (size_t)t * H + col);
  o[0] = __floats2half2_rn(sum.x, sum.y);
  o[1] = __floats2half2_rn(sum.z, sum.w);
}

#define ONECAT_MOE_GROUPED(WARPS, BATCH, R)                                                       \
  extern "C" __global__ void __launch_bounds__(32 * WARPS) w4a16_moe_gemv_grouped_gate_up_w##WARPS##_b##BATCH##_r##R( \
      const half* x, const int* meta, int E, const uint4* w13_qweight, const half2* w13_scales,   \
      half* h, int top_k, int H, int I, int group_size, int per_warp) {                         \
    onecat::grouped_gate_up_body<WARPS, BATCH, R>(x, meta, E, w13_qweight, w13_scales, h, top_k, H, I, \
                                                  group_size, per_warp);                        \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(32 * WARPS) w4a16_moe_gemv_grouped_down_w##WARPS##_b##BATCH##_r##R( \
      const half* h, const int* meta, int E, const void* weights, int weights32,                 \
      const uint4* w2_qweight, const half2* w2_scales, float* pair_out, int H, int I, int group_size) { \
    if (I <= onecat::kStageMaxI)                                                                \
      onecat::grouped_down_body<WARPS, BATCH, R, true>(h, meta, E, weights, weights32, w2_qweight, w2_scales, \
                                                     pair_out, H, I, group_size);               \
    else                                                                                        \
      onecat::grouped_down_body<WARPS, BATCH, R, false>(h, meta, E, weights, weights32, w2_qweight, w2_scales, \
                                                      pair_out, H, I, group_size);              \
  }

#define ONECAT_MOE_GATE_UP(WARPS, BATCH)                                                          \
  extern "C" __global__ void __launch_bounds__(32 * WARPS) w4a16_moe_gemv_gate_up_w##WARPS##_b##BATCH( \
      const half* x, const void* ids, int ids64, const uint4* w13_qweight, const half2* w13_scales, \
      half* h, int top_k, int E, int H, int I, int group_size, int per_warp) {                  \
    onecat::gate_up_body<WARPS, BATCH>(x, ids, ids64, w13_qweight, w13_scales, h, top_k, E, H, I, \
                                       group_size, per_warp);                                  \
  }
// MIN_BLOCKS: resident blocks per SM the register budget is cut for
#define ONECAT_MOE_DOWN(WARPS, BATCH, MIN_BLOCKS)                                                 \
  extern "C" __global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS) w4a16_moe_gemv_down_w##WARPS##_b##BATCH( \
      const half* h, const void* ids, int ids64, const void* weights, int weights32,            \
      const uint4* w2_qweight, const half2* w2_scales, half* out, int top_k, int E, int H, int I, \
      int group_size, int per_warp, unsigned long long* split_words) {                           \
    onecat::down_body<WARPS, BATCH>(h, ids, ids64, weights, weights32, w2_qweight, w2_scales, out, \
                                    top_k, E, H, I, group_size, per_warp, split_words);         \
  }

ONECAT_MOE_GATE_UP(8, 4)
ONECAT_MOE_GATE_UP(4, 4)
ONECAT_MOE_DOWN(16, 4, 2)
ONECAT_MOE_DOWN(8, 4, 4)
ONECAT_MOE_GROUPED(4, 4, 4)
ONECAT_MOE_GROUPED(4, 4, 2)
