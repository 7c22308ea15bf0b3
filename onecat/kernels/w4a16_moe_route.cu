// MoE router of Qwen3.5 on the GPU: softmax over E expert logits, the top k, renormalised.
//
// Renormalised top-k softmax weights equal a softmax over the k selected logits alone (the
// full softmax's denominator cancels), and the softmax is monotonic, so the kernel selects
// the k largest logits and then normalises exp(l_j - l_max) over them, in fp32:
//   weights[t, j] = exp(l[t, i_j] - l[t, i_0]) / sum_{j' < k} exp(l[t, i_j'] - l[t, i_0])
// with i_0, i_1, ... the experts in decreasing logit order; equal logits are taken lowest
// expert index first (deterministic).
//
// Data layout: logits [T, E] fp16 or fp32 with row stride `row_stride` (elements), unit
// column stride; weights [T, k] fp32 and ids [T, k] int32, contiguous.
//
// Thread mapping: one warp per token (4 warps per block).  Lane l holds the logits of experts
// l, l+32, l+64, ... in registers (E <= 32 * kSlots).  Each of the k rounds picks every
// lane's best untaken (value, index) and reduces them across the warp with shuffles (larger
// value, then lower index), the owner marks it taken, and lane j keeps the j-th choice.
#include "w4a16_common.cuh"

namespace onecat {
constexpr int kRouteWarps = 4;
constexpr int kSlots = 32;  // logits per lane: E <= 1024

__device__ __forceinline__ bool route_better(float v, int i, float bv, int bi) {
  return bi < 0 || v > bv || (v == bv && i < bi);
}
}  // namespace onecat

extern "C" __global__ void __launch_bounds__(32 * onecat::kRouteWarps)
w4a16_moe_route_topk(const void* logits, int logits32, int row_stride, int T, int E, int top_k,
                     float* __restrict__ weights, int* __restrict__ ids) {
  using namespace onecat;
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * kRouteWarps + (threadIdx.x >> 5);
  if (t >= T) return;
  float v[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int i = s * 32 + lane;
    v[s] = 0.0f;
    if (i < E) {
      const size_t at = (size_t)t * row_stride + i;
      v[s] = logits32 ? reinterpret_cast<const float*>(logits)[at]
                      : __half2float(reinterpret_cast<const half*>(logits)[at]);
    }
  }
  unsigned taken = 0u;
  float mine = 0.0f, top = 0.0f;
  int mine_index = 0;
  for (int j = 0; j < top_k; ++j) {
    float bv = 0.0f;
    int bi = -1;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int i = s * 32 + lane;
      if (i < E && !((taken >> s) & 1u) && route_better(v[s], i, bv, bi)) {
        bv = v[s];
        bi = i;
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, offset);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, offset);
      if (oi >= 0 && route_better(ov, oi, bv, bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
    if (j == lane) {
      mine = bv;
      mine_index = bi;
    }
    if (j == 0) top = bv;
  }
  float ex = lane < top_k ? expf(mine - top) : 0.0f;
  float sum = ex;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane < top_k) {
    weights[(size_t)t * top_k + lane] = ex / sum;
    ids[(size_t)t * top_k + lane] = mine_index;
  }
}
