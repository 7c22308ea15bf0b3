// Gated DeltaNet decode step for sm_70: P consecutive tokens of each of B sequences through the
// gated delta rule and the gated RMSNorm after it (P = 1 for decoding; P = 1 + drafts for a
// speculative verify pass).  Each sequence's recurrent state is read once from its slot of the
// state pool, kept in registers across its P tokens, and written after token p to the row
// dst[p][b] (its slot itself: an update IN PLACE; for the drafts, rows of their own, so that a
// rejection can fall back to the state after any kept token).  Every token's output leaves
// normed and gated, ready for out_proj.  Compiled by NVRTC 12 for compute_70 / sm_70; no torch
// headers.
//
// Data layout (row-major, innermost dimension contiguous):
//   mixed    fp16 [B*P][mixed_stride] the short conv's output, token p of sequence b in row
//                                     b*P + p: q (Hk*128) | k (Hk*128) | v (Hv*DV)
//   ba       fp16 [B*P][ba_stride]    in_proj_ba's output: b (Hv) | a (Hv); unread when ba_w is set
//   x        fp16 [B*P][x_stride]     with ba_w: the layer's normed input (hidden values)
//   ba_w     fp16 [2*Hv][hidden]      in_proj_ba's weight (b rows, then a rows), or null: then
//                                     b and a come from `ba`, else the kernel projects them,
//                                     b = x . ba_w[h], a = x . ba_w[Hv + h] in fp32, and a
//                                     step of decode rows needs no in_proj_ba launches
//   z        fp16 [B*P][z_stride]     in_proj_z's output (the output gate): Hv*DV
//   A_log, dt_bias  fp32 [Hv];   norm_w  fp32 [DV] (the gated norm's weight, shared by heads)
//   state    fp32 [slots][Hv][128][DV]  S of value head h of sequence b starts as state[slot[b]][h]
//   slots    int64 [B]                (distinct for real sequences; padding rows of a CUDA
//                                     graph share a scratch slot whose content is garbage)
//   dst      int64 [P][B]             where the state after token p of sequence b goes (slots
//                                     itself, or rows no other sequence reads)
//   out      fp16 [B*P][Hv][DV]
// Value head h reads key head h / (Hv / Hk).  Per head and token, with k and q l2-normalised
// (eps 1e-6 inside the root) and q scaled by 128^-1/2, g = -exp(A_log) * softplus(a + dt_bias)
// and beta = sigmoid(b):
//     S <- exp(g) S;   delta = beta (v - S^T k);   S <- S + k delta^T;   o = S^T q
//     out = norm_w * o / sqrt(mean(o^2) + eps) * silu(z)     (mean over the head's DV values)
// in fp32, rounded once at the end.
//
// Thread mapping: block (value head h, sequence b), 8*DV threads (1024 for DV 128).  The norm
// needs all DV values of a head's o, so one block owns the whole head.  Thread t = DV*g + j owns
// column j of S and the 16 rows 16g .. 16g+15 (row group g of 8), and holds those 16 fp32
// values in registers for all P tokens: a warp covers 32 adjacent columns, so for each row it
// reads and writes 128 contiguous bytes.  Per token, threads t < 128 load q[t] and k[t] and
// the block normalises them into shared memory; with ba_w, every thread also takes every
// (8*DV)-th half2 of the two dot products over hidden, reduced by warp shuffles and then one
// (b, a) pair per warp in shared memory, at the barriers the q/k norms need anyway.  S^T k
// and S^T q are sums over rows: each thread sums its 16 rows in registers, the 8 row groups'
// partials meet in shared memory, and row group 0 (t < DV, one thread per column) finishes o,
// sums o^2 over the head (warp shuffles, then one value per warp through shared memory),
// applies norm and gate, and stores.
//
// Occupancy (V100: 80 SMs, H200: 132 SMs; each SM 64K registers, 64 warps): at 64 registers
// (ptxas, 0 spills) one 32-warp block of DV 128 fits an SM, so the grid of Hv x B blocks runs
//   27B (Hv 48 a GPU):   B=1: 48 blocks,  B=3: 144,  B=33: 1584,  B=64: 3072
//   35B-A3B (Hv 32):     B=1: 32 blocks,  B=3: 96,   B=33: 1056,  B=64: 2048
// in ceil(blocks / SMs) waves (27B B=64: 39 on a V100, 24 on an H200); tensor parallelism
// divides Hv.  (Holding 32 rows in 512 threads, two blocks an SM, needs more than the 64
// registers that allows: ptxas spilled.)  The step streams 64 KB of fp32 state per head in and
// out with little math, so what it needs is bytes in flight, not busy SMs: every thread issues
// its 16 row loads at once, a block has its whole 64 KB head in flight, and one block per SM
// exceeds what Little's law asks for the full bandwidth of a V100 (~900 GB/s x ~0.5 us = 0.45
// MB against 80 x 64 KB) and about meets an H200's (~4.8 TB/s x ~0.6 us = 2.9 MB against 132 x
// 64 KB).  At B=1 only Hv SMs work (48 or 32; gdn_decode_wide's mapping, 4 blocks of 4 warps
// per head, spreads over all of them), still 3 MB (27B) / 2 MB (35B-A3B) in flight: enough
// for a V100 and about enough for an H200; 27B at TP=2 (24 blocks) is the thinnest case.
// The price of a head per block is 6 barriers of 32 warps per token; the gain is the
// gated-norm launch and a [B*P, Hv*DV] fp16 round trip through memory per layer.  The b/a
// projection adds 2 weight rows and an x row per (head, token) (30 KB at hidden 5120, all of
// in_proj_ba's weight is 1 MB and stays in L2) to 128 KB of state traffic, and saves
// in_proj_ba's 2 launches.
// Wide batches lose more at the barriers than the fused norm saves (27B, B=32 on an H200:
// ~60% of the copy bandwidth against ~84% for 4 blocks of 4 warps per head): above a row
// threshold the host runs gdn_decode_wide_d* and then gdn_decode_gated_norm instead (below).
#include <cuda_fp16.h>

namespace onecat_gdn {
constexpr int kDk = 128;               // key head dim = rows of S
constexpr int kGroups = 8;             // row groups: 8*DV threads
constexpr int kRows = kDk / kGroups;   // rows of S per thread
constexpr int kMaxDv = 128;            // largest value head dim (1024 threads)
constexpr int kQkWarps = kDk / 32;     // warps that load q and k

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum of `v` over the first `warps` warps of the block (every thread calls it and gets the sum;
// later warps' values are ignored).  `scratch` holds `warps` floats.  One barrier: the caller
// makes sure that no thread still reads `scratch` from an earlier call.
__device__ __forceinline__ float leading_warps_sum(float v, int warps, float* scratch) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0 && (int)(threadIdx.x >> 5) < warps) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

// The gated RMSNorm of one value o of a head whose values' squares sum to sum_sq:
// weight * o / sqrt(mean + eps) * silu(gate), fp32, one rounding.
__device__ __forceinline__ half gated_norm(float o, float sum_sq, int dv, float eps, float weight,
                                           float gate) {
  const float silu = gate / (1.f + expf(-gate));
  return __float2half_rn(weight * (o * rsqrtf(sum_sq / (float)dv + eps)) * silu);
}

template <int DV>
__device__ __forceinline__ void decode(const half* __restrict__ mixed, int mixed_stride,
                                       const half* __restrict__ ba, int ba_stride,
                                       const half* __restrict__ hidden_x, int x_stride,
                                       const half* __restrict__ ba_w, int hidden,
                                       const half* __restrict__ z, int z_stride,
                                       const float* __restrict__ A_log,
                                       const float* __restrict__ dt_bias,
                                       const float* __restrict__ norm_w, float norm_eps,
                                       float* __restrict__ state, const long long* __restrict__ slots,
                                       const long long* __restrict__ dst, half* __restrict__ out,
                                       int num_k_heads, int num_v_heads, int positions) {
  __shared__ float q_rows[kDk], k_rows[kDk];
  __shared__ float norms[2][kQkWarps];
  __shared__ float partial[kGroups][DV];
  __shared__ float sums[DV / 32];
  __shared__ float2 projected[kGroups * DV / 32];  // (b, a) partial dot products per warp
  const int h = blockIdx.x, b = blockIdx.y, num_seqs = gridDim.y;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int group = t / DV, j = t % DV;
  const bool loads_qk = t < kDk, finishes = group == 0;  // both warp-uniform
  const int key_head = h / (num_v_heads / num_k_heads);
  const int key_dim = num_k_heads * kDk;
  const int head_offset = (h * kDk + group * kRows) * DV + j;  // < 2^31: Hv * 128 * DV
  const float* k_mine = k_rows + group * kRows;
  const float* q_mine = q_rows + group * kRows;

  // this thread's 16 entries of S, read once
  float s[kRows];
  const float* S = state + slots[b] * num_v_heads * (kDk * DV) + head_offset;
#pragma unroll
  for (int r = 0; r < kRows; ++r) s[r] = S[r * DV];

#pragma unroll 1
  for (int p = 0; p < positions; ++p) {
    const int token = b * positions + p;
    const half* row = mixed + (size_t)token * mixed_stride;
    // 1. q and k of this head, l2-normalised over the 128 rows (one element per thread t < 128)
    float q = 0.f, k = 0.f, qq = 0.f, kk = 0.f;
    if (loads_qk) {
      q = __half2float(row[key_head * kDk + t]);
      k = __half2float(row[key_dim + key_head * kDk + t]);
      qq = warp_sum(q * q);
      kk = warp_sum(k * k);
    }
    // b and a of this head: in_proj_ba's rows h and Hv + h against the layer input, when given
    float2 dots = make_float2(0.f, 0.f);
    if (ba_w != nullptr) {
      const half2* xr = reinterpret_cast<const half2*>(hidden_x + (size_t)token * x_stride);
      const half2* wb = reinterpret_cast<const half2*>(ba_w + (size_t)h * hidden);
      const half2* wa = reinterpret_cast<const half2*>(ba_w + (size_t)(num_v_heads + h) * hidden);
#pragma unroll 1
      for (int i = t; i < hidden / 2; i += kGroups * DV) {
        const float2 xv = __half22float2(xr[i]), bv = __half22float2(wb[i]), av = __half22float2(wa[i]);
        dots.x += xv.x * bv.x + xv.y * bv.y;
        dots.y += xv.x * av.x + xv.y * av.y;
      }
      dots.x = warp_sum(dots.x);
      dots.y = warp_sum(dots.y);
    }
    __syncthreads();  // the previous token is done with norms, projected, q_rows, k_rows, partial, sums
    if (loads_qk && lane == 0) {
      norms[0][warp] = qq;
      norms[1][warp] = kk;
    }
    if (ba_w != nullptr && lane == 0) projected[warp] = dots;
    __syncthreads();
    if (loads_qk) {
      float q_sq = 0.f, k_sq = 0.f;
#pragma unroll
      for (int w = 0; w < kQkWarps; ++w) {
        q_sq += norms[0][w];
        k_sq += norms[1][w];
      }
      q_rows[t] = q * rsqrtf(q_sq + 1e-6f) * rsqrtf((float)kDk);
      k_rows[t] = k * rsqrtf(k_sq + 1e-6f);
    }

    // decay and learning rate of this head (fp32; softplus as torch's, threshold 20)
    float b_in, a_in;
    if (ba_w != nullptr) {
      b_in = a_in = 0.f;
      for (int w = 0; w < kGroups * DV / 32; ++w) {
        b_in += projected[w].x;
        a_in += projected[w].y;
      }
    } else {
      const half* gates = ba + (size_t)token * ba_stride;
      b_in = __half2float(gates[h]);
      a_in = __half2float(gates[num_v_heads + h]);
    }
    const float x = a_in + dt_bias[h];
    const float softplus = x > 20.f ? x : log1pf(expf(x));
    const float decay = expf(-expf(A_log[h]) * softplus);
    const float beta = 1.f / (1.f + expf(-b_in));
    __syncthreads();

    // 2. forget, and this row group's share of S^T k
    float predicted = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      s[r] *= decay;
      predicted += s[r] * k_mine[r];
    }
    partial[group][j] = predicted;
    __syncthreads();
    predicted = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) predicted += partial[g][j];

    // 3. the delta, the write, and this row group's share of S^T q
    const float delta = beta * (__half2float(row[2 * key_dim + h * DV + j]) - predicted);
    float* S_out = state + dst[p * num_seqs + b] * num_v_heads * (kDk * DV) + head_offset;
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      s[r] += k_mine[r] * delta;
      S_out[r * DV] = s[r];
      o += s[r] * q_mine[r];
    }
    __syncthreads();  // every thread has read `partial` above
    partial[group][j] = o;
    __syncthreads();

    // 4. o of column j (row group 0), the head's sum of squares, the gated norm
    if (finishes) {
      o = 0.f;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) o += partial[g][j];
    }
    const float sum_sq = leading_warps_sum(finishes ? o * o : 0.f, DV / 32, sums);
    if (finishes) {
      const float gate = __half2float(z[(size_t)token * z_stride + h * DV + j]);
      out[((size_t)token * num_v_heads + h) * DV + j] = gated_norm(o, sum_sq, DV, norm_eps, norm_w[j], gate);
    }
  }
}
}  // namespace onecat_gdn

// One kernel per value head dim (a compile-time row stride keeps the 16 row addresses
// immediate offsets): gdn_decode_d128 (Qwen3.5), _d64, _d32; 8*DV threads each.
#define ONECAT_GDN_DECODE_ARGS                                                                   \
  const half *__restrict__ mixed, int mixed_stride, const half *__restrict__ ba, int ba_stride, \
      const half *__restrict__ hidden_x, int x_stride, const half *__restrict__ ba_w, int hidden, \
      const half *__restrict__ z, int z_stride, const float *__restrict__ A_log,                \
      const float *__restrict__ dt_bias, const float *__restrict__ norm_w, float norm_eps,      \
      float *__restrict__ state, const long long *__restrict__ slots,                           \
      const long long *__restrict__ dst, half *__restrict__ out, int num_k_heads,               \
      int num_v_heads, int positions
#define ONECAT_GDN_DECODE_CALL(DV)                                                               \
  onecat_gdn::decode<DV>(mixed, mixed_stride, ba, ba_stride, hidden_x, x_stride, ba_w, hidden, z, \
                         z_stride, A_log, dt_bias, norm_w,                                       \
                         norm_eps, state, slots, dst, out, num_k_heads, num_v_heads, positions)

extern "C" __global__ void __launch_bounds__(1024, 1)
    gdn_decode_d128(ONECAT_GDN_DECODE_ARGS) {
  ONECAT_GDN_DECODE_CALL(128);
}

extern "C" __global__ void __launch_bounds__(512, 2)
    gdn_decode_d64(ONECAT_GDN_DECODE_ARGS) {
  ONECAT_GDN_DECODE_CALL(64);
}

extern "C" __global__ void __launch_bounds__(256, 4)
    gdn_decode_d32(ONECAT_GDN_DECODE_ARGS) {
  ONECAT_GDN_DECODE_CALL(32);
}

// ---------------------------------------------------------------------------------------------
// The same delta rule for wide batches, WITHOUT the norm: gdn_decode_wide_d{128,64,32} write
// the raw o = S^T q (fp16) to `out`, and gdn_decode_gated_norm then norms and gates those rows
// in place (two launches).  Same arguments, layout, rows, dst rows, int64 slots and in-place
// state rule as gdn_decode_d*, except that b and a always come as `ba` rows (in_proj_ba's
// output) and there is no z / norm weight.
//
// Why it exists beside the fused kernel: with a whole head per block (1024 threads, one block
// an SM) the grid of Hv x B blocks runs in waves of one block per SM, and each block's state
// traffic stalls at its 6 barriers of 32 warps per token with no other block on the SM to fill
// the gap.  At batch 32 on the 27B shape (Hv 48) that reached ~60% of the copy bandwidth
// (77.9 us a layer on an H200, compute_70 PTX), while this mapping, with several small blocks
// per SM, reached ~84% (50.1 us, + 6.0 us for the separate norm).  At a few sequences the fused
// kernel wins (one launch, and a head per block spreads a thin batch over Hv SMs), so the host
// picks this one above a row threshold (onecat/kernels/gdn.py: WIDE_ABOVE_ROWS).
//
// Thread mapping: block (column chunk c, value head h, sequence b), 128 threads = 4 warps, so
// a head is DV/32 blocks.  Per token, thread t loads q[t] and k[t] (the 128 rows) and the block
// normalises them into shared memory.  Lane l of warp w owns column j = 32c + l of S and rows
// 32w .. 32w+31, and holds those 32 fp32 values in registers for all P tokens: for each row a
// warp reads and writes 128 contiguous bytes.  S^T k and S^T q are sums over rows: each warp
// sums its 32 rows in registers, the 4 warps' partials meet in shared memory, and warp 0
// writes the block's 32 values of o.  Blocks of a head share nothing but q, k, b and a (each
// loads them itself), so no block waits for another.  ptxas: 72 registers, 0 spills (64, what
// 8 blocks an SM would need, spills), so 7 blocks = 28 warps an SM, 7 x 16 KB of state in
// flight per SM (the fused kernel: one block, 64 KB, but all of it behind the same barriers).
namespace onecat_gdn {
constexpr int kWideWarps = 4;                  // warps per block
constexpr int kWideRows = kDk / kWideWarps;    // rows of S per thread

template <int DV>
__device__ __forceinline__ void decode_wide(const half* __restrict__ mixed, int mixed_stride,
                                            const half* __restrict__ ba, int ba_stride,
                                            const float* __restrict__ A_log,
                                            const float* __restrict__ dt_bias,
                                            float* __restrict__ state,
                                            const long long* __restrict__ slots,
                                            const long long* __restrict__ dst,
                                            half* __restrict__ out, int num_k_heads,
                                            int num_v_heads, int positions) {
  __shared__ float q_rows[kDk], k_rows[kDk];
  __shared__ float norms[2][kWideWarps];
  __shared__ float partial[kWideWarps][32];
  const int chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z, num_seqs = gridDim.z;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int key_head = h / (num_v_heads / num_k_heads);
  const int key_dim = num_k_heads * kDk;
  const int j = chunk * 32 + lane;
  const int head_offset = (h * kDk + warp * kWideRows) * DV + j;  // < 2^31: Hv * 128 * DV
  const float* k_mine = k_rows + warp * kWideRows;
  const float* q_mine = q_rows + warp * kWideRows;
  const float A = expf(A_log[h]);

  // this thread's 32 entries of S, read once
  float s[kWideRows];
  const float* S = state + slots[b] * num_v_heads * (kDk * DV) + head_offset;
#pragma unroll
  for (int r = 0; r < kWideRows; ++r) s[r] = S[r * DV];

#pragma unroll 1
  for (int p = 0; p < positions; ++p) {
    const int token = b * positions + p;
    const half* row = mixed + (size_t)token * mixed_stride;
    // 1. q and k of this head, l2-normalised over the 128 rows (one element per thread)
    const float q = __half2float(row[key_head * kDk + t]);
    const float k = __half2float(row[key_dim + key_head * kDk + t]);
    const float qq = warp_sum(q * q), kk = warp_sum(k * k);
    __syncthreads();  // the previous token is done with norms, q_rows, k_rows and partial
    if (lane == 0) {
      norms[0][warp] = qq;
      norms[1][warp] = kk;
    }
    __syncthreads();
    float q_sq = 0.f, k_sq = 0.f;
#pragma unroll
    for (int w = 0; w < kWideWarps; ++w) {
      q_sq += norms[0][w];
      k_sq += norms[1][w];
    }
    q_rows[t] = q * rsqrtf(q_sq + 1e-6f) * rsqrtf((float)kDk);
    k_rows[t] = k * rsqrtf(k_sq + 1e-6f);

    // decay and learning rate of this head (fp32; softplus as torch's, threshold 20)
    const half* gates = ba + (size_t)token * ba_stride;
    const float x = __half2float(gates[num_v_heads + h]) + dt_bias[h];
    const float softplus = x > 20.f ? x : log1pf(expf(x));
    const float decay = expf(-A * softplus);
    const float beta = 1.f / (1.f + expf(-__half2float(gates[h])));
    __syncthreads();

    // 2. forget, and this warp's share of S^T k
    float predicted = 0.f;
#pragma unroll
    for (int r = 0; r < kWideRows; ++r) {
      s[r] *= decay;
      predicted += s[r] * k_mine[r];
    }
    partial[warp][lane] = predicted;
    __syncthreads();
    predicted = 0.f;
#pragma unroll
    for (int w = 0; w < kWideWarps; ++w) predicted += partial[w][lane];

    // 3. the delta, the write, and this warp's share of S^T q
    const float delta = beta * (__half2float(row[2 * key_dim + h * DV + j]) - predicted);
    float* S_out = state + dst[p * num_seqs + b] * num_v_heads * (kDk * DV) + head_offset;
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < kWideRows; ++r) {
      s[r] += k_mine[r] * delta;
      S_out[r * DV] = s[r];
      o += s[r] * q_mine[r];
    }
    __syncthreads();  // every thread has read `partial` above
    partial[warp][lane] = o;
    __syncthreads();
    if (warp == 0) {
      o = 0.f;
#pragma unroll
      for (int w = 0; w < kWideWarps; ++w) o += partial[w][lane];
      out[((size_t)token * num_v_heads + h) * DV + j] = __float2half_rn(o);
    }
  }
}
}  // namespace onecat_gdn

#define ONECAT_GDN_DECODE_WIDE_ARGS                                                              \
  const half *__restrict__ mixed, int mixed_stride, const half *__restrict__ ba, int ba_stride, \
      const float *__restrict__ A_log, const float *__restrict__ dt_bias,                       \
      float *__restrict__ state, const long long *__restrict__ slots,                           \
      const long long *__restrict__ dst, half *__restrict__ out, int num_k_heads,               \
      int num_v_heads, int positions
#define ONECAT_GDN_DECODE_WIDE_CALL(DV)                                                          \
  onecat_gdn::decode_wide<DV>(mixed, mixed_stride, ba, ba_stride, A_log, dt_bias, state, slots, \
                              dst, out, num_k_heads, num_v_heads, positions)

extern "C" __global__ void __launch_bounds__(128)
    gdn_decode_wide_d128(ONECAT_GDN_DECODE_WIDE_ARGS) {
  ONECAT_GDN_DECODE_WIDE_CALL(128);
}

extern "C" __global__ void __launch_bounds__(128)
    gdn_decode_wide_d64(ONECAT_GDN_DECODE_WIDE_ARGS) {
  ONECAT_GDN_DECODE_WIDE_CALL(64);
}

extern "C" __global__ void __launch_bounds__(128)
    gdn_decode_wide_d32(ONECAT_GDN_DECODE_WIDE_ARGS) {
  ONECAT_GDN_DECODE_WIDE_CALL(32);
}

// ---------------------------------------------------------------------------------------------
// The gated RMSNorm alone, for the rows the prefill kernels computed: the end of gdn_decode,
// out = w * x / sqrt(mean(x^2) + eps) * silu(z) per value head, fp32, one rounding.
//   x    fp16 [T][Hv][DV];   z  fp16 [T][z_stride] (Hv*DV gates);   w  fp32 [DV]
//   out  fp16 [T][Hv][DV]    (may be x itself: a thread reads its value before the barrier and
//                            writes only its own value after it)
// Thread mapping: block (token, value head), DV threads (DV a multiple of 32 up to 128), one
// value each; the sum of squares through warp shuffles and one value per warp in shared memory.
extern "C" __global__ void __launch_bounds__(128)
    gdn_decode_gated_norm(const half* x, const half* __restrict__ z, int z_stride,
                   const float* __restrict__ w, float eps, half* out, int num_v_heads, int dv) {
  using namespace onecat_gdn;
  __shared__ float sums[kMaxDv / 32];
  const size_t token = blockIdx.x;
  const int h = blockIdx.y, j = threadIdx.x;
  const size_t at = (token * num_v_heads + h) * dv + j;
  const float o = __half2float(x[at]);
  const float gate = __half2float(z[token * z_stride + h * dv + j]);
  const float sum_sq = leading_warps_sum(o * o, dv >> 5, sums);
  out[at] = gated_norm(o, sum_sq, dv, eps, w[j], gate);
}

// ---------------------------------------------------------------------------------------------
// The short conv (kernel 4) + SiLU of the same P consecutive tokens of B sequences, before
// gdn_decode: conv states read from rows src[b] of the conv-state pool, the state after token
// p written to row dst[p][b] (decoding: P = 1 and dst = src, in place).  One launch replaces
// the gather, the conv, the new-state concatenation and the scatter back.
//   x        fp16 [B*P][x_stride]  in_proj_qkv's output, token p of sequence b in row b*P + p;
//                                  channels [0, C) are q | k | v
//   conv_st  fp16 [rows][C][3]     the last 3 inputs of each row, oldest first
//   weight   fp16 [C][4]
//   src      int64 [B];   dst  int64 [P][B]
//   out      fp16 [B*P][C]         silu(sum_i w[i] x[t-3+i]), fp32 accumulation, one rounding
// Optionally (ba_w non-null) the same launch projects the rows' b and a for the wide-batch
// delta rule, which reads them as in_proj_ba's output (this saves in_proj_ba's launches):
//   hidden   fp16 [B*P][hidden_stride]  the layer's normed input (16-byte aligned rows)
//   ba_w     fp16 [ba_cols][H]          in_proj_ba's weight (b rows, then a rows), H % 8 == 0
//   ba       fp16 [B*P][ba_cols]        hidden . ba_w[r] summed in fp32, rounded once
// Thread mapping: block (256 channels, sequence b), 128 threads; thread owns 2 adjacent
// channels, reads their 3 old inputs into registers, then walks the P tokens writing each
// output and each new state.  A thread reads a channel's old state before it writes any row:
// in place is safe, and no two threads touch the same channel of a row.  With ba_w, blocks
// past the channels' (blockIdx.x >= ceil(C / 256)) are projection blocks: block C/256 + r
// computes weight row r for the P rows of sequence b, its 128 threads striding over H in
// 8-value (128-bit) steps (5 per thread at H = 5120, all loads in flight at once: one round
// trip), then warp shuffles and one value per warp in shared memory.  in_proj_ba's weight
// (1 MB) stays in L2 for the B blocks that read each row.
// Why the conv is a launch of its own and not the first step of gdn_decode_wide: there, the
// 2 value heads x DV/32 column chunks of a key head would all read the same q/k channels'
// old state, and decoding updates it in place (dst = src), so the block that writes the new
// state could overtake a reader; no barrier orders blocks of one grid.  Fusing needs a state
// that the update does not destroy (e.g. a ring of 4 inputs indexed by position, where a
// step only replaces x[p-4]), which the prefill kernels, the prefix cache's snapshots and the
// draft rows would all have to adopt.
__device__ __forceinline__ void project_ba_row(const half* __restrict__ hidden, int hidden_stride,
                                               const half* __restrict__ ba_w, int H, int ba_cols,
                                               half* __restrict__ ba, int positions, int r) {
  __shared__ float sums[4];
  const uint4* w = reinterpret_cast<const uint4*>(ba_w + (size_t)r * H);
  for (int j = 0; j < positions; ++j) {
    const size_t row = (size_t)blockIdx.y * positions + j;
    const uint4* xr = reinterpret_cast<const uint4*>(hidden + row * hidden_stride);
    float sum = 0.0f;
#pragma unroll 8
    for (int i = threadIdx.x; i < H / 8; i += 128) {
      const uint4 wv = __ldg(w + i), xv = __ldg(xr + i);
      const unsigned wu[4] = {wv.x, wv.y, wv.z, wv.w}, xu[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 a = __half22float2(*reinterpret_cast<const half2*>(&wu[q]));
        const float2 b = __half22float2(*reinterpret_cast<const half2*>(&xu[q]));
        sum = fmaf(a.x, b.x, fmaf(a.y, b.y, sum));
      }
    }
    const float total = onecat_gdn::leading_warps_sum(sum, 4, sums);
    if (threadIdx.x == 0) ba[row * ba_cols + r] = __float2half_rn(total);
    __syncthreads();  // sums is reused by the next row
  }
}

extern "C" __global__ void __launch_bounds__(128)
    gdn_decode_conv(const half* __restrict__ x, int x_stride, half* __restrict__ conv_st,
                    const half* __restrict__ weight, const long long* __restrict__ src,
                    const long long* __restrict__ dst, half* __restrict__ out, int channels,
                    int positions, const half* __restrict__ hidden, int hidden_stride,
                    const half* __restrict__ ba_w, int H, int ba_cols, half* __restrict__ ba) {
  const int conv_blocks = (channels + 255) / 256;
  if ((int)blockIdx.x >= conv_blocks) {
    project_ba_row(hidden, hidden_stride, ba_w, H, ba_cols, ba, positions, blockIdx.x - conv_blocks);
    return;
  }
  const int c = 2 * (blockIdx.x * 128 + threadIdx.x);
  if (c >= channels) return;
  const int b = blockIdx.y, num_seqs = gridDim.y;
  float w0[4], w1[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w0[i] = __half2float(weight[c * 4 + i]);
    w1[i] = __half2float(weight[(c + 1) * 4 + i]);
  }
  const half* old = conv_st + ((size_t)src[b] * channels + c) * 3;
  float2 p0 = make_float2(__half2float(old[0]), __half2float(old[3]));
  float2 p1 = make_float2(__half2float(old[1]), __half2float(old[4]));
  float2 p2 = make_float2(__half2float(old[2]), __half2float(old[5]));
  for (int j = 0; j < positions; ++j) {
    const size_t row = (size_t)b * positions + j;
    const float2 v = __half22float2(*reinterpret_cast<const half2*>(x + row * x_stride + c));
    const float y0 = w0[0] * p0.x + w0[1] * p1.x + w0[2] * p2.x + w0[3] * v.x;
    const float y1 = w1[0] * p0.y + w1[1] * p1.y + w1[2] * p2.y + w1[3] * v.y;
    *reinterpret_cast<half2*>(out + row * channels + c) =
        __floats2half2_rn(y0 / (1.0f + expf(-y0)), y1 / (1.0f + expf(-y1)));
    p0 = p1;
    p1 = p2;
    p2 = v;
    half* st = conv_st + ((size_t)dst[(size_t)j * num_seqs + b] * channels + c) * 3;
    st[0] = __float2half_rn(p0.x);
    st[1] = __float2half_rn(p1.x);
    st[2] = __float2half_rn(p2.x);
    st[3] = __float2half_rn(p0.y);
    st[4] = __float2half_rn(p1.y);
    st[5] = __float2half_rn(p2.y);
  }
}
