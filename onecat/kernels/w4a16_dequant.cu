// Dequantise a packed W4 weight into a dense fp16 W [N, K] (row-major, the layout of
// torch.nn.Linear.weight), for large M where y = x @ W^T then runs in cuBLAS.
//
// Data layout: input as in w4a16_common.cuh; output W[n][k] fp16, rows of K halves.
//
// Thread mapping: work item = (column tile t, run of 4 k tiles), numbered in memory order;
// warps take items in a grid-stride loop.  For one item, lane l loads its 4 uint4 (4 x 32 k
// of column 32t + lane_column(l); 2 KB per warp in flight), dequantises them in registers
// with the contract (fma.rn.f16x2) and stores them as row lane_column(l) of a per-warp
// staging tile in shared memory [32 rows][128 k] (rows padded by 16 bytes).  The warp then
// writes the tile to W with fully coalesced 128-bit stores: each store instruction covers two
// rows x 256 contiguous bytes.
#include "w4a16_common.cuh"

namespace onecat {
constexpr int kRun = 4;                    // k tiles per work item
constexpr int kRowVecs = kRun * 4 + 1;     // uint4 per staging row (+1 pad against conflicts)
constexpr int kDequantWarps = 4;
}  // namespace onecat

extern "C" __global__ void __launch_bounds__(32 * onecat::kDequantWarps)
    w4a16_dequant(const uint4* __restrict__ qweight, const half2* __restrict__ scales_zeros,
                  half* __restrict__ w_out, int N, int K, int group_size) {
  using namespace onecat;
  __shared__ uint4 stage[kDequantWarps][kTile][kRowVecs];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int ktiles = K / kTile;
  const int groups = K / group_size;
  const int tiles_per_group = group_size / kTile;
  const int runs_per_tile = (ktiles + kRun - 1) / kRun;
  const int items = (N / kTile) * runs_per_tile;
  uint4(*tile_rows)[kRowVecs] = stage[warp];

  for (int item = blockIdx.x * kDequantWarps + warp; item < items;
       item += gridDim.x * kDequantWarps) {
    const int tile = item / runs_per_tile;
    const int kt0 = (item % runs_per_tile) * kRun;
    const int valid = min(kRun, ktiles - kt0);
    uint4 v[kRun];
    half2 sz[kRun];
    ScaleCursor scales(scales_zeros + (size_t)tile * groups * 32 + lane, kt0, tiles_per_group);
#pragma unroll
    for (int u = 0; u < kRun; ++u) {
      if (u < valid) {
        v[u] = load_weights_streaming(qweight + ((size_t)tile * ktiles + kt0 + u) * 32 + lane);
        sz[u] = scales.next();
      }
    }
    const int row = lane_column(lane);
#pragma unroll
    for (int u = 0; u < kRun; ++u) {
      if (u < valid) {
        half2 w[16];
        dequant_tile(v[u], sz[u], w);
#pragma unroll
        for (int q = 0; q < 4; ++q) tile_rows[row][u * 4 + q] = *reinterpret_cast<uint4*>(w + 4 * q);
      }
    }
    __syncwarp();
    half* out = w_out + (size_t)tile * kTile * K + (size_t)kt0 * kTile;
#pragma unroll 4
    for (int i = 0; i < kTile * kRun * 4 / 32; ++i) {  // 32 rows x 16 uint4, 32 per step
      const int flat = i * 32 + lane;
      const int r = flat / (kRun * 4);
      const int c = flat % (kRun * 4);
      if (c / 4 < valid) *reinterpret_cast<uint4*>(out + (size_t)r * K + c * 8) = tile_rows[r][c];
    }
    __syncwarp();
  }
}
