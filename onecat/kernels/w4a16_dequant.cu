// Dequantise a packed W4 weight into a dense fp16 W [N, K] (row-major, the layout of
// torch.nn.Linear.weight), for large M where y = x @ W^T then runs in cuBLAS.
//
// Data layout: input as in w4a16_common.cuh; output W[n][k] fp16, rows of K halves.
//
// Thread mapping: one warp per (column tile t, k tile kt) pair, pairs enumerated k-fastest
// so that consecutive warps read consecutive 512-byte tiles.  Lane l loads its uint4
// (32 k of column n = 32t + lane_column(l)), dequantises it in registers with the contract
// (fma.rn.f16x2) and writes the 64 contiguous bytes W[n][32kt .. 32kt+31] as four 128-bit
// stores.  A warp's stores cover 32 rows x 64 bytes: whole 32-byte sectors, merged in L2.
#include "w4a16_common.cuh"

extern "C" __global__ void __launch_bounds__(256) w4a16_dequant(const uint4* __restrict__ qweight,
                                                                const half2* __restrict__ scales_zeros,
                                                                half* __restrict__ w_out, int N, int K,
                                                                int group_size) {
  using namespace onecat;
  const int lane = threadIdx.x & 31;
  const long long pair = (long long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  const int ktiles = K / kTile;
  const long long pairs = (long long)(N / kTile) * ktiles;
  if (pair >= pairs) return;
  const int tile = (int)(pair / ktiles);
  const int kt = (int)(pair % ktiles);
  const int groups = K / group_size;
  const uint4 v = load_weights_streaming(qweight + (size_t)pair * 32 + lane);
  const half2 sz = __ldg(scales_zeros + ((size_t)tile * groups + (size_t)kt * kTile / group_size) * 32 + lane);
  half2 w[16];
  dequant_tile(v, sz, w);
  const int n = tile * kTile + lane_column(lane);
  uint4* dst = reinterpret_cast<uint4*>(w_out + (size_t)n * K + (size_t)kt * kTile);
#pragma unroll
  for (int q = 0; q < 4; ++q) dst[q] = *reinterpret_cast<uint4*>(w + 4 * q);
}
