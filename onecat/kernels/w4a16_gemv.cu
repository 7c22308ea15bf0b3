// W4A16 GEMV on CUDA cores for decode (M = 1..4 tokens): y[M, N] = x[M, K] @ W[N, K]^T (+ bias)
//
// Data layout (see w4a16_common.cuh): a 32-column tile's K stream is contiguous, 512 bytes
// per 32 k; lane l of a warp reads the 32 k of output column lane_column(l) with ONE 128-bit
// load.  x is [M, K] fp16 row-major (16-byte aligned rows), y is [M, N] fp16 row-major.
//
// Thread mapping:
//   grid  = (N/32 column tiles, S splits of K)        block = WARPS warps
//   (the kernel for M serves rows <= M tokens; rows past `rows` are computed and dropped)
//   block (t, s) owns column tile t and k tiles [s*kps, min(K/32, (s+1)*kps)).
//   Warp w of the block takes runs of UNROLL consecutive k tiles (UNROLL*512 contiguous
//   bytes), starting at w*UNROLL and stepping by WARPS*UNROLL.  It issues the UNROLL 128-bit
//   weight loads (plus their scales) before using any of them, so each warp keeps
//   UNROLL*512 bytes in flight.  Every lane then holds 32*UNROLL weights of ONE column and
//   reads the matching x values with broadcast 128-bit loads (all lanes, same address; x is
//   small and stays in L1/L2).
//
// Arithmetic: weights are dequantised in registers (lop3 magic number, sub.f16x2,
// fma.rn.f16x2: the dequant contract).  For each packed word (8 k) the 8 products are formed
// with one mul.f16x2 and three fma.f16x2 (two fp16 partial sums of 4 products each), which are
// then converted and added to an fp32 accumulator per token.  So products and 4-term partial
// sums are fp16, every sum over more than 4 terms is fp32.  (A conversion per product would
// cost 32 F2F per tile; sm_70 converts at a quarter of the FMA rate, which would make the
// kernel compute-bound on a V100.)
//
// Reduction: the WARPS partial sums of a column meet in shared memory.  With S = 1 the block
// writes y directly (+bias).  With S > 1 (too few column tiles to fill the GPU) each block
// adds its partials to a zeroed fp32 workspace [M, N] with atomicAdd, and the last block of
// the tile (a zeroed int counter per tile) converts the sums to fp16, adds bias and writes y.
#include "w4a16_common.cuh"

namespace onecat {

template <int M, int WARPS, int UNROLL>
__device__ __forceinline__ void gemv_body(const half* __restrict__ x, const uint4* __restrict__ qweight,
                                          const half2* __restrict__ scales_zeros,
                                          const half* __restrict__ bias, half* __restrict__ y,
                                          float* __restrict__ workspace, int* __restrict__ counters,
                                          int rows, int N, int K, int group_size,
                                          int ktiles_per_split) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int tile = blockIdx.x;
  const int ktiles = K / kTile;
  const int groups = K / group_size;
  const int tiles_per_group = group_size / kTile;
  const int k_begin = blockIdx.y * ktiles_per_split;
  const int k_end = min(ktiles, k_begin + ktiles_per_split);

  const uint4* w_tile = qweight + (size_t)tile * ktiles * 32 + lane;
  const half2* sz_tile = scales_zeros + (size_t)tile * groups * 32 + lane;

  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.0f;

  for (int kt0 = k_begin + warp * UNROLL; kt0 < k_end; kt0 += WARPS * UNROLL) {
    uint4 wv[UNROLL];
    half2 sz[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int kt = kt0 + u;
      if (kt < k_end) {
        wv[u] = load_weights_streaming(w_tile + (size_t)kt * 32);
        sz[u] = __ldg(sz_tile + (size_t)(kt / tiles_per_group) * 32);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int kt = kt0 + u;
      if (kt < k_end) {
        half2 w[16];
        dequant_tile(wv[u], sz[u], w);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          // Rows past `rows` re-read row 0 (always valid memory); their sums are dropped.
          const int row = m < rows ? m : 0;
          const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)row * K + kt * kTile);
#pragma unroll
          for (int part = 0; part < 4; ++part) {
            const uint4 xv = __ldg(xp + part);
            half2 p = __hmul2(w[4 * part + 0], as_half2(xv.x));
            p = __hfma2(w[4 * part + 1], as_half2(xv.y), p);
            p = __hfma2(w[4 * part + 2], as_half2(xv.z), p);
            p = __hfma2(w[4 * part + 3], as_half2(xv.w), p);
            const float2 f = __half22float2(p);
            acc[m] += f.x + f.y;
          }
        }
      }
    }
  }

  // Sum the WARPS partials of each column in shared memory.
  __shared__ float partial[WARPS][M][32];
#pragma unroll
  for (int m = 0; m < M; ++m) partial[warp][m][lane] = acc[m];
  __syncthreads();
  const int n = tile * kTile + lane_column(lane);
  if (warp == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) sum += partial[w][m][lane];
      acc[m] = sum;
    }
  }
  if (gridDim.y == 1) {
    if (warp == 0) {
      const float b = bias ? __half2float(bias[n]) : 0.0f;
#pragma unroll
      for (int m = 0; m < M; ++m)
        if (m < rows) y[(size_t)m * N + n] = __float2half_rn(acc[m] + b);
    }
    return;
  }
  if (warp == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m)
      if (m < rows) atomicAdd(workspace + (size_t)m * N + n, acc[m]);
  }
  if (arrive_last(counters + tile, gridDim.y) && warp == 0) {
    const float b = bias ? __half2float(bias[n]) : 0.0f;
#pragma unroll
    for (int m = 0; m < M; ++m)
      if (m < rows) y[(size_t)m * N + n] = __float2half_rn(__ldcg(workspace + (size_t)m * N + n) + b);
  }
}

}  // namespace onecat

// extern "C" entry points (plain names for the driver API), one per (M, WARPS); a kernel for M
// rows also serves fewer rows (`rows` <= M).
#define ONECAT_GEMV(M, WARPS)                                                                   \
  extern "C" __global__ void __launch_bounds__(32 * WARPS) w4a16_gemv_m##M##_w##WARPS(       \
      const half* x, const uint4* qweight, const half2* scales_zeros, const half* bias,       \
      half* y, float* workspace, int* counters, int rows, int N, int K, int group_size,        \
      int ktiles_per_split) {                                                                  \
    onecat::gemv_body<M, WARPS, 4>(x, qweight, scales_zeros, bias, y, workspace, counters,    \
                                   rows, N, K, group_size, ktiles_per_split);                  \
  }

ONECAT_GEMV(1, 4)
ONECAT_GEMV(1, 8)
ONECAT_GEMV(2, 4)
ONECAT_GEMV(2, 8)
ONECAT_GEMV(4, 4)
