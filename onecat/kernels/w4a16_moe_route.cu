// MoE router of Qwen3.5 on the GPU: softmax over E expert logits, the top k, renormalised.
//
// Renormalised top-k softmax weights equal a softmax over the k selected logits alone (the
// full softmax's denominator cancels), and the softmax is monotonic, so the kernels select
// the k largest logits and then normalise exp(l_j - l_max) over them, in fp32:
//   weights[t, j] = exp(l[t, i_j] - l[t, i_0]) / sum_{j' < k} exp(l[t, i_j'] - l[t, i_0])
// with i_0, i_1, ... the experts in decreasing logit order; equal logits are taken lowest
// expert index first (deterministic).
//
// Two kernels:
//
// w4a16_moe_route_topk: the selection over given logits.
//   Data layout: logits [T, E] fp16 or fp32 with row stride `row_stride` (elements), unit
//   column stride; weights [T, k] fp32 and ids [T, k] int32, contiguous.
//   Thread mapping: one warp per token (4 warps per block), see select_top_k.
//
// w4a16_moe_route_decode: the router's projection AND the selection in one launch, for a few
//   tokens (decode): logits = x @ router_w^T (fp32 sums rounded to fp16, as the fp16 linear
//   it replaces rounds them), and optionally the shared expert's gate logit g = x @ shared_w^T
//   (fp16 [T]) in the same pass.  With shared_id >= 0 the shared expert is one more choice of
//   every token instead: ids/weights are [T, k+1] and column k holds (shared_id, sigmoid(g)),
//   so that the grouped MoE op adds sigmoid(g) * shared(x) to the routed sum.
//   Data layout: x [T, H] fp16 (row stride x_stride elements, rows 16-byte aligned, H % 8 ==
//   0); router_w [E, H] and shared_w [H] fp16 contiguous; scratch fp32 [T, E]; counter one
//   u32 that is zero on entry and left zero; weights fp32 / ids int32 [T, k] or [T, k+1].
//   Thread mapping: block b, warp w computes weight row r = 16 b + w (rows 0..E-1 the
//   experts, row E the shared gate) for every token.  The block first stages up to 8
//   tokens of x in shared memory (all threads, 128-bit loads: one round trip to L2 instead of
//   one per token and column chunk); then lane l reads 8 consecutive weights (one 128-bit
//   load) per 256 columns and the same 8 columns of each staged token from shared memory,
//   fp32 products, a warp shuffle sum per token.  Each block then fences and takes a ticket;
//   the last block to finish (all logits are in the scratch) runs the selection, one warp
//   per token, reading the logits through L2, and zeroes the counter again.  No block waits
//   for another, so the kernel is safe whatever the residency.
#include "w4a16_common.cuh"

namespace onecat {
constexpr int kRouteWarps = 4;
constexpr int kSlots = 32;  // logits per lane: E <= 1024
constexpr int kRouterWarps = 16;
constexpr int kRouterTokens = 8;           // most tokens staged in shared memory at a time
constexpr int kRouterStageHalfs = 16384;   // 32 KB of staged x: 8 tokens of H = 2048

__device__ __forceinline__ bool route_better(float v, int i, float bv, int bi) {
  return bi < 0 || v > bv || (v == bv && i < bi);
}

// The top_k of one token's E logits, which the warp holds as v[s] = logit of expert 32 s +
// lane: each of the k rounds picks every lane's best untaken (value, index), reduces them
// across the warp with shuffles (larger value, then lower index), the owner marks it taken,
// and lane j keeps the j-th choice; then the softmax over the k choices.
__device__ __forceinline__ void select_top_k(const float (&v)[kSlots], int E, int top_k,
                                             float* __restrict__ weights, int* __restrict__ ids) {
  const int lane = threadIdx.x & 31;
  unsigned taken = 0u;
  float mine = 0.0f, top = 0.0f;
  int mine_index = 0;
  for (int j = 0; j < top_k; ++j) {
    float bv = 0.0f;
    int bi = -1;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      if (s * 32 >= E) break;  // E = 256: 8 of the 32 slots
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
    weights[lane] = ex / sum;
    ids[lane] = mine_index;
  }
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
  select_top_k(v, E, top_k, weights + (size_t)t * top_k, ids + (size_t)t * top_k);
}

extern "C" __global__ void __launch_bounds__(32 * onecat::kRouterWarps)
w4a16_moe_route_decode(const half* __restrict__ x, int x_stride, int T, int H,
                       const half* __restrict__ router_w, int E, const half* __restrict__ shared_w,
                       int top_k, int shared_id, float* __restrict__ scratch,
                       unsigned* __restrict__ counter, float* __restrict__ weights,
                       int* __restrict__ ids, half* __restrict__ shared_gate) {
  using namespace onecat;
  __shared__ __align__(16) half xs[kRouterStageHalfs];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int stride = top_k + (shared_id >= 0 ? 1 : 0);  // choices per token in weights / ids
  const int row = blockIdx.x * kRouterWarps + warp;
  const bool has_row = row < E + (shared_w != nullptr ? 1 : 0);
  const half* w = row < E ? router_w + (size_t)row * H : shared_w;
  const int chunk = min(kRouterTokens, kRouterStageHalfs / H);  // tokens staged at a time
  const int vecs = H / 8;                                        // 16-byte vectors per x row
  for (int t0 = 0; t0 < T; t0 += chunk) {
    const int n = min(chunk, T - t0);
    __syncthreads();  // the previous chunk's readers are done
    for (int v = threadIdx.x; v < n * vecs; v += blockDim.x) {
      const int j = v / vecs;
      reinterpret_cast<uint4*>(xs)[v] =
          __ldg(reinterpret_cast<const uint4*>(x + (size_t)(t0 + j) * x_stride) + (v - j * vecs));
    }
    __syncthreads();
    if (!has_row) continue;
    float acc[kRouterTokens];
#pragma unroll
    for (int j = 0; j < kRouterTokens; ++j) acc[j] = 0.0f;
#pragma unroll 4
    for (int k = 8 * lane; k < H; k += 256) {
      const uint4 wv = __ldg(reinterpret_cast<const uint4*>(w + k));
      const half2* wh = reinterpret_cast<const half2*>(&wv);
      float2 wf[4];
#pragma unroll
      for (int p = 0; p < 4; ++p) wf[p] = __half22float2(wh[p]);
#pragma unroll
      for (int j = 0; j < kRouterTokens; ++j) {
        if (j < n) {
          const uint4 xv = *reinterpret_cast<const uint4*>(xs + j * H + k);
          const half2* xh = reinterpret_cast<const half2*>(&xv);
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            const float2 b = __half22float2(xh[p]);
            acc[j] = fmaf(wf[p].x, b.x, fmaf(wf[p].y, b.y, acc[j]));
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kRouterTokens; ++j) {
      float sum = acc[j];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      if (lane == 0 && j < n) {
        const int t = t0 + j;
        const half rounded = __float2half_rn(sum);
        if (row < E) {
          scratch[(size_t)t * E + row] = __half2float(rounded);
        } else if (shared_id >= 0) {
          weights[(size_t)t * stride + top_k] = 1.0f / (1.0f + expf(-__half2float(rounded)));
          ids[(size_t)t * stride + top_k] = shared_id;
        } else {
          shared_gate[t] = rounded;
        }
      }
    }
  }
  // Ticket: the block's writes (ordered before thread 0 by the barrier) are released at GPU
  // scope by thread 0's fence before its atomic; the last block acquires them the same way.
  // One acq_rel fence per block, not a sequentially consistent __threadfence per thread.
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) asm volatile("fence.acq_rel.gpu;" ::: "memory");
  }
  __syncthreads();
  if (!last) return;
  for (int t = warp; t < T; t += kRouterWarps) {
    float v[kSlots];
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int i = s * 32 + lane;
      v[s] = i < E ? __ldcg(scratch + (size_t)t * E + i) : 0.0f;
    }
    select_top_k(v, E, top_k, weights + (size_t)t * stride, ids + (size_t)t * stride);
  }
  if (threadIdx.x == 0) *counter = 0u;
}
