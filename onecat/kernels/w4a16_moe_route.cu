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
//   column stride; weights [T, k] fp32 and ids [T, k] int32, contiguous.  With shared_id >= 0
//   column E of the logits is the shared expert's gate logit g and, as in the decode kernel
//   below, ids/weights are [T, k+1] with column k = (shared_id, sigmoid(g)).
//   Thread mapping: one warp per token (4 warps per block), see select_top_k.
//
// w4a16_moe_route_decode: the router's projection AND the selection in one launch, for a few
//   tokens (decode): logits = x @ router_w^T (fp32 sums rounded to fp16, as the fp16 linear
//   it replaces rounds them), and optionally the shared expert's gate logit g = x @ shared_w^T
//   (fp16 [T]) in the same pass.  With shared_id >= 0 the shared expert is one more choice of
//   every token instead: ids/weights are [T, k+1] and column k holds (shared_id, sigmoid(g)),
//   so that the grouped MoE op adds sigmoid(g) * shared(x) to the routed sum.
//   Data layout: x [T, H] fp16 (row stride x_stride elements, rows 16-byte aligned, H % 8 ==
//   0); router_w [E, H] and shared_w [H] fp16 contiguous; scratch 32-bit [T, E] (selection
//   keys, below); counter one u32 that is zero on entry and left zero; weights fp32 / ids
//   int32 [T, k] or [T, k+1].
//   Thread mapping: any block size up to kRouterMaxWarps warps (the launch chooses rows per
//   block); warp w of block b computes weight row r = b * warps + w (rows 0..E-1 the experts,
//   row E the shared gate) for every token.  Latency, not bandwidth, is the cost (1 MiB of
//   weights), so every memory round trip is issued as early as possible:
//   1. each lane loads its first 2048 columns of the row (8 x 128-bit loads, all in flight)
//      BEFORE the block stages x, so the weight and x round trips overlap;
//   2. the block stages up to 8 tokens of x in shared memory (128-bit loads by all threads);
//   3. lane l multiplies 8 consecutive weights per 256 columns with the same 8 columns of
//      each staged token (fp32 products and sums);
//   4. one transposing butterfly reduces the 8 tokens' sums in 9 shuffles (not 8 x 5): after
//      halving the live values at offsets 16, 8 and 4, lane l holds token (l >> 2) & 7;
//   5. the rounded logit is written as a 32-bit selection key (below) to the scratch; each
//      block fences and takes a ticket; the last block to finish (all keys are in the
//      scratch) selects, one warp per token, reading the keys through L2, and zeroes the
//      counter again.  No block waits for another, so the kernel is safe whatever the
//      residency.
//   With the residual add and the post-attention RMSNorm (residual != null: what
//   `moe_router_norm` launches, so that a decode MoE block needs no norm launch of its own):
//   step 2 stages fp16(x + residual) instead of x, one warp per token sums its squares from
//   shared memory, and the staged rows are rewritten as fp16(r * rsqrt(mean(r^2) + eps) *
//   (1 + w)) (norm_w fp32 [H], the roundings of the runtime's add_rms_norm) before step 3;
//   block 0 also writes the sums to summed_out and the normed rows to normed_out ([T, H]
//   fp16 contiguous) for the experts and the residual stream. Two more barriers a block.
//   Selection keys: the logits are fp16 numbers, so (order-preserving fp16 bits << 16) |
//   (0xFFFF - expert) is one u32 whose unsigned order is "larger logit, then lower expert
//   index" (-0 is taken as +0, as the float comparison does).  A warp then finds the top
//   L = 8 (16, 32) keys of 32 x 8 without serial argmax rounds: each lane sorts its 8 keys
//   (bitonic network in registers) and the lanes merge their sorted lists in 5 butterfly
//   steps (each: the partner's list reversed by shuffles, an elementwise max, which keeps the
//   top L of both as a bitonic sequence, and a bitonic merge); every lane ends with the same
//   sorted top L, and computes the softmax over the first k itself (no shuffles).
#include "w4a16_common.cuh"

namespace onecat {
constexpr int kRouteWarps = 4;
constexpr int kSlots = 32;  // logits per lane: E <= 1024
constexpr int kRouterMaxWarps = 16;        // largest block the decode router takes
constexpr int kRouterTokens = 8;           // most tokens staged in shared memory at a time
constexpr int kRouterStageHalfs = 16384;   // 32 KB of staged x: 8 tokens of H = 2048
constexpr int kRowVecs = 8;                // 128-bit weight loads a lane holds: 2048 columns
constexpr int kStageBatch = 2;             // x vectors a thread stages (loads in flight) per round

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

// --- key selection (decode router) ---------------------------------------------------------

// u32 key of an fp16 logit and its expert: larger key = larger logit, then lower index.
__device__ __forceinline__ unsigned route_key(half logit, int expert) {
  unsigned bits = __half_as_ushort(logit);
  if (bits == 0x8000u) bits = 0u;  // -0 == +0
  const unsigned ordered = (bits & 0x8000u) ? (~bits & 0xFFFFu) : (bits | 0x8000u);
  return (ordered << 16) | (0xFFFFu - (unsigned)expert);
}

__device__ __forceinline__ float key_logit(unsigned key) {
  const unsigned ordered = key >> 16;
  const unsigned bits = (ordered & 0x8000u) ? (ordered & 0x7FFFu) : (~ordered & 0xFFFFu);
  return __half2float(__ushort_as_half((unsigned short)bits));
}

__device__ __forceinline__ int key_expert(unsigned key) { return (int)(0xFFFFu - (key & 0xFFFFu)); }

// Sort N keys descending in registers (bitonic network; N a power of two).
template <int N>
__device__ __forceinline__ void sort_keys(unsigned (&a)[N]) {
#pragma unroll
  for (int size = 2; size <= N; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int j = i ^ stride;
        if (j > i) {
          const bool descending = (i & size) == 0 || size == N;
          const unsigned hi = max(a[i], a[j]), lo = min(a[i], a[j]);
          a[i] = descending ? hi : lo;
          a[j] = descending ? lo : hi;
        }
      }
    }
  }
}

// Sort a bitonic sequence of N keys descending (the merge half of the network).
template <int N>
__device__ __forceinline__ void merge_keys(unsigned (&a)[N]) {
#pragma unroll
  for (int stride = N >> 1; stride > 0; stride >>= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int j = i ^ stride;
      if (j > i) {
        const unsigned hi = max(a[i], a[j]);
        a[j] = min(a[i], a[j]);
        a[i] = hi;
      }
    }
  }
}

// The top_k (<= L) of one token's E keys (global, read through L2), the softmax over them,
// weights[0..k) and ids[0..k) written by lanes 0..k-1.  Padding keys are 0, below any real
// key (whose index part is at least 0xFFFF - 1023).
template <int L>
__device__ __forceinline__ void select_keys(const unsigned* __restrict__ keys, int E, int top_k,
                                            float* __restrict__ weights, int* __restrict__ ids) {
  const int lane = threadIdx.x & 31;
  unsigned best[L];
#pragma unroll
  for (int i = 0; i < L; ++i) best[i] = 0u;
  for (int e0 = 0; e0 < E; e0 += 256) {  // 8 keys per lane at a time: E = 256 is one round
    unsigned group[8];
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const int e = e0 + 32 * p + lane;
      group[p] = e < E ? __ldcg(keys + e) : 0u;
    }
    sort_keys<8>(group);
#pragma unroll
    for (int i = 0; i < L; ++i) best[i] = max(best[i], L - 1 - i < 8 ? group[L - 1 - i] : 0u);
    merge_keys<L>(best);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    unsigned other[L];
#pragma unroll
    for (int i = 0; i < L; ++i) other[i] = __shfl_xor_sync(0xffffffffu, best[L - 1 - i], offset);
#pragma unroll
    for (int i = 0; i < L; ++i) best[i] = max(best[i], other[i]);
    merge_keys<L>(best);
  }
  const float top = key_logit(best[0]);
  float sum = 0.0f, mine = 0.0f;
  unsigned mine_key = 0u;
#pragma unroll
  for (int i = 0; i < L; ++i) {
    if (i < top_k) {
      const float ex = expf(key_logit(best[i]) - top);
      sum += ex;
      if (i == lane) {
        mine = ex;
        mine_key = best[i];
      }
    }
  }
  if (lane < top_k) {
    weights[lane] = mine / sum;
    ids[lane] = key_expert(mine_key);
  }
}

// Sum acc[j] (token j's partial sum in every lane) over the warp in 9 shuffles: halving the
// live values at offsets 16, 8, 4 (a lane keeps the half its offset bit selects and adds the
// partner's copy of it), then two plain steps.  Returns token (lane >> 2) & 7's total.
__device__ __forceinline__ float warp_sum_tokens(const float (&acc)[8]) {
  const int lane = threadIdx.x & 31;
  float four[4], two[2];
  bool up = (lane & 16) != 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float send = up ? acc[i] : acc[i + 4];
    four[i] = (up ? acc[i + 4] : acc[i]) + __shfl_xor_sync(0xffffffffu, send, 16);
  }
  up = (lane & 8) != 0;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float send = up ? four[i] : four[i + 2];
    two[i] = (up ? four[i + 2] : four[i]) + __shfl_xor_sync(0xffffffffu, send, 8);
  }
  up = (lane & 4) != 0;
  float one = (up ? two[1] : two[0]) + __shfl_xor_sync(0xffffffffu, up ? two[0] : two[1], 4);
  one += __shfl_xor_sync(0xffffffffu, one, 2);
  one += __shfl_xor_sync(0xffffffffu, one, 1);
  return one;
}

// Sum of the squares of 8 fp16 values, in fp32.
__device__ __forceinline__ float sum_of_squares(uint4 v) {
  float f[8];
  unpack(v, f);
  float total = 0.0f;
#pragma unroll
  for (int p = 0; p < 4; ++p) total = fmaf(f[2 * p], f[2 * p], fmaf(f[2 * p + 1], f[2 * p + 1], total));
  return total;
}

// This lane's 128-bit weight vectors of row w for columns [k0, k0 + 2048): column k0 + 256 v
// + 8 lane .. +8 in vector v (zeros past H).
__device__ __forceinline__ void load_row(uint4 (&wv)[kRowVecs], const half* __restrict__ w, int k0,
                                         int H) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int v = 0; v < kRowVecs; ++v) {
    const int k = k0 + 256 * v + 8 * lane;
    wv[v] = k < H ? load_weights_streaming(reinterpret_cast<const uint4*>(w + k)) : make_uint4(0, 0, 0, 0);
  }
}
}  // namespace onecat

extern "C" __global__ void __launch_bounds__(32 * onecat::kRouteWarps)
w4a16_moe_route_topk(const void* logits, int logits32, int row_stride, int T, int E, int top_k,
                     int shared_id, float* __restrict__ weights, int* __restrict__ ids) {
  using namespace onecat;
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * kRouteWarps + (threadIdx.x >> 5);
  if (t >= T) return;
  const int stride = top_k + (shared_id >= 0 ? 1 : 0);  // choices per token in weights / ids
  if (shared_id >= 0 && lane == 0) {  // column E of the logits: the shared expert's gate
    const size_t at = (size_t)t * row_stride + E;
    const float g = logits32 ? reinterpret_cast<const float*>(logits)[at]
                             : __half2float(reinterpret_cast<const half*>(logits)[at]);
    weights[(size_t)t * stride + top_k] = 1.0f / (1.0f + expf(-g));
    ids[(size_t)t * stride + top_k] = shared_id;
  }
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
  select_top_k(v, E, top_k, weights + (size_t)t * stride, ids + (size_t)t * stride);
}

extern "C" __global__ void __launch_bounds__(32 * onecat::kRouterMaxWarps)
w4a16_moe_route_decode(const half* __restrict__ x, int x_stride, int T, int H,
                       const half* __restrict__ router_w, int E, const half* __restrict__ shared_w,
                       int top_k, int shared_id, float* __restrict__ scratch,
                       unsigned* __restrict__ counter, float* __restrict__ weights,
                       int* __restrict__ ids, half* __restrict__ shared_gate,
                       const half* __restrict__ residual, const float* __restrict__ norm_w, float eps,
                       half* __restrict__ normed_out, half* __restrict__ summed_out) {
  using namespace onecat;
  __shared__ __align__(16) half xs[kRouterStageHalfs];
  __shared__ float rstd[kRouterTokens];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int stride = top_k + (shared_id >= 0 ? 1 : 0);  // choices per token in weights / ids
  unsigned* keys = reinterpret_cast<unsigned*>(scratch);
  const int row = blockIdx.x * warps + warp;
  const bool has_row = row < E + (shared_w != nullptr ? 1 : 0);
  const half* w = row < E ? router_w + (size_t)row * H : shared_w;
  const bool one_pass = H <= 256 * kRowVecs;  // the whole row stays in registers
  uint4 wv[kRowVecs];
  if (has_row) load_row(wv, w, 0, H);  // in flight while x is staged
  const int chunk = min(kRouterTokens, kRouterStageHalfs / H);  // tokens staged at a time
  const int vecs = H / 8;                                        // 16-byte vectors per x row
  const SmallDivisor by_vecs(vecs);                              // token of a staged vector
  for (int t0 = 0; t0 < T; t0 += chunk) {
    const int n = min(chunk, T - t0);
    if (t0 > 0) __syncthreads();  // the previous chunk's readers are done
    // kStageBatch vectors a thread per round, all loads issued first: the rounds, not the
    // vectors, pay the L2 latency (8 tokens of H = 2048 on 256 threads: 2 rounds, not 8).
    for (int v0 = threadIdx.x; v0 < n * vecs; v0 += kStageBatch * blockDim.x) {
      uint4 xv[kStageBatch], rv[kStageBatch];
#pragma unroll
      for (int b = 0; b < kStageBatch; ++b) {
        const int v = v0 + b * blockDim.x;
        if (v < n * vecs) {
          const int j = by_vecs.div(v);
          xv[b] = __ldg(reinterpret_cast<const uint4*>(x + (size_t)(t0 + j) * x_stride) + (v - j * vecs));
          if (residual != nullptr) rv[b] = __ldg(reinterpret_cast<const uint4*>(residual) + (size_t)t0 * vecs + v);
        }
      }
#pragma unroll
      for (int b = 0; b < kStageBatch; ++b) {
        const int v = v0 + b * blockDim.x;
        if (v < n * vecs) {
          if (residual != nullptr) {
            xv[b] = add_rounded(xv[b], rv[b]);
            if (blockIdx.x == 0) reinterpret_cast<uint4*>(summed_out)[(size_t)t0 * vecs + v] = xv[b];
          }
          reinterpret_cast<uint4*>(xs)[v] = xv[b];
        }
      }
    }
    __syncthreads();
    if (residual != nullptr) {  // the RMSNorm of the staged sums, in place
      for (int j = warp; j < n; j += warps) {
        float squares = 0.0f;
        for (int c = lane; c < vecs; c += 32) squares += sum_of_squares(reinterpret_cast<const uint4*>(xs)[j * vecs + c]);
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
        if (lane == 0) rstd[j] = rsqrtf(squares / (float)H + eps);
      }
      __syncthreads();
      for (int v0 = threadIdx.x; v0 < n * vecs; v0 += kStageBatch * blockDim.x) {
        float4 w0[kStageBatch], w1[kStageBatch];  // the norm weights of the round, loads first
#pragma unroll
        for (int b = 0; b < kStageBatch; ++b) {
          const int v = v0 + b * blockDim.x;
          if (v < n * vecs) {
            const float4* w = reinterpret_cast<const float4*>(norm_w) + 2 * (v - by_vecs.div(v) * vecs);
            w0[b] = __ldg(w);
            w1[b] = __ldg(w + 1);
          }
        }
#pragma unroll
        for (int b = 0; b < kStageBatch; ++b) {
          const int v = v0 + b * blockDim.x;
          if (v < n * vecs) {
            float r[8];
            unpack(reinterpret_cast<const uint4*>(xs)[v], r);
            const uint4 normed = rms_scale(r, rstd[by_vecs.div(v)], w0[b], w1[b]);
            reinterpret_cast<uint4*>(xs)[v] = normed;
            if (blockIdx.x == 0) reinterpret_cast<uint4*>(normed_out)[(size_t)t0 * vecs + v] = normed;
          }
        }
      }
      __syncthreads();
    }
    if (!has_row) continue;
    float acc[kRouterTokens];
#pragma unroll
    for (int j = 0; j < kRouterTokens; ++j) acc[j] = 0.0f;
    for (int k0 = 0; k0 < H; k0 += 256 * kRowVecs) {
      if (!one_pass && (k0 > 0 || t0 > 0)) load_row(wv, w, k0, H);
#pragma unroll
      for (int v = 0; v < kRowVecs; ++v) {
        const int k = k0 + 256 * v + 8 * lane;
        if (k >= H) break;
        const half2* wh = reinterpret_cast<const half2*>(&wv[v]);
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
    }
    const float sum = warp_sum_tokens(acc);
    const int j = lane >> 2;
    if ((lane & 3) == 0 && j < n) {
      const int t = t0 + j;
      const half rounded = __float2half_rn(sum);
      if (row < E) {
        keys[(size_t)t * E + row] = route_key(rounded, row);
      } else if (shared_id >= 0) {
        weights[(size_t)t * stride + top_k] = 1.0f / (1.0f + expf(-__half2float(rounded)));
        ids[(size_t)t * stride + top_k] = shared_id;
      } else {
        shared_gate[t] = rounded;
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
  for (int t = warp; t < T; t += warps) {
    const unsigned* token_keys = keys + (size_t)t * E;
    float* tw = weights + (size_t)t * stride;
    int* ti = ids + (size_t)t * stride;
    if (top_k <= 8) {
      select_keys<8>(token_keys, E, top_k, tw, ti);
    } else if (top_k <= 16) {
      select_keys<16>(token_keys, E, top_k, tw, ti);
    } else {
      select_keys<32>(token_keys, E, top_k, tw, ti);
    }
  }
  if (threadIdx.x == 0) *counter = 0u;
}
