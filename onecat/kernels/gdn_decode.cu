// Gated DeltaNet decode step for sm_70: P consecutive tokens of each of B sequences through
// the gated delta rule (P = 1 for decoding; P = 1 + drafts for a speculative verify pass).
// Each sequence's recurrent state is read once from its slot of the state pool, kept in
// registers across its P tokens, and written after token p to the row dst[p][b] (its slot
// itself: an update IN PLACE; for the drafts, rows of their own, so that a rejection can
// fall back to the state after any kept token).
// It replaces, per GDN layer and decode step, a gather of the states, the torch step and the
// scatter back (three reads and three writes of 64 KB per value head) by one read and P
// writes.  Compiled by NVRTC 12 for compute_70 / sm_70; no torch headers.
//
// Data layout (row-major, innermost dimension contiguous):
//   mixed    fp16 [B*P][mixed_stride] the short conv's output, token p of sequence b in row
//                                     b*P + p: q (Hk*128) | k (Hk*128) | v (Hv*DV)
//   ba       fp16 [B*P][ba_stride]    in_proj_ba's output: b (Hv) | a (Hv)
//   A_log, dt_bias  fp32 [Hv]
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
//
// Thread mapping: block (column chunk c, value head h, sequence b), 128 threads = 4 warps.
// Per token, thread t first loads q[t] and k[t] (the 128 rows) and the block normalises them
// into shared memory.  Lane l of warp w owns column j = 32c + l of S and rows 32w .. 32w+31,
// and holds those 32 fp32 values in registers for all P tokens: for each row a warp reads and
// writes 128 contiguous bytes.  S^T k and S^T q are sums over rows: each warp sums its 32 rows
// in registers, the 4 warp partials meet in shared memory.
#include <cuda_fp16.h>

namespace onecat_gdn {
constexpr int kDk = 128;              // key head dim = rows of S
constexpr int kWarps = 4;
constexpr int kRows = kDk / kWarps;   // rows of S per warp
constexpr int kCols = 32;             // columns of S per block: one per lane

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
}  // namespace onecat_gdn

extern "C" __global__ void __launch_bounds__(128)
    gdn_decode(const half* __restrict__ mixed, int mixed_stride, const half* __restrict__ ba,
               int ba_stride, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
               float* __restrict__ state, const long long* __restrict__ slots,
               const long long* __restrict__ dst, half* __restrict__ out, int num_k_heads,
               int num_v_heads, int dv, int positions) {
  using namespace onecat_gdn;
  __shared__ float q_rows[kDk], k_rows[kDk];
  __shared__ float norms[2][kWarps];
  __shared__ float partial[kWarps][kCols];
  const int chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z, num_seqs = gridDim.z;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int key_head = h / (num_v_heads / num_k_heads);
  const int key_dim = num_k_heads * kDk;
  const int j = chunk * kCols + lane;
  const size_t head_offset = ((size_t)h * kDk + warp * kRows) * dv + j;
  const size_t slot_size = (size_t)num_v_heads * kDk * dv;
  const float* k_mine = k_rows + warp * kRows;
  const float* q_mine = q_rows + warp * kRows;
  const float A = expf(A_log[h]);

  // this thread's 32 entries of S, read once
  float s[kRows];
  const float* S = state + (size_t)slots[b] * slot_size + head_offset;
#pragma unroll
  for (int r = 0; r < kRows; ++r) s[r] = S[(size_t)r * dv];

  for (int p = 0; p < positions; ++p) {
    const size_t token = (size_t)b * positions + p;
    const half* row = mixed + token * mixed_stride;
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
    const float q_sq = norms[0][0] + norms[0][1] + norms[0][2] + norms[0][3];
    const float k_sq = norms[1][0] + norms[1][1] + norms[1][2] + norms[1][3];
    q_rows[t] = q * rsqrtf(q_sq + 1e-6f) * rsqrtf((float)kDk);
    k_rows[t] = k * rsqrtf(k_sq + 1e-6f);

    // decay and learning rate of this head (fp32; softplus as torch's, threshold 20)
    const half* gates = ba + token * ba_stride;
    const float x = __half2float(gates[num_v_heads + h]) + dt_bias[h];
    const float softplus = x > 20.f ? x : log1pf(expf(x));
    const float decay = expf(-A * softplus);
    const float beta = 1.f / (1.f + expf(-__half2float(gates[h])));
    __syncthreads();

    // 2. forget, and this warp's share of S^T k
    float predicted = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      s[r] *= decay;
      predicted += s[r] * k_mine[r];
    }
    partial[warp][lane] = predicted;
    __syncthreads();
    predicted = partial[0][lane] + partial[1][lane] + partial[2][lane] + partial[3][lane];

    // 3. the delta, the write, and this warp's share of S^T q
    const float delta = beta * (__half2float(row[2 * key_dim + h * dv + j]) - predicted);
    float* S_out = state + (size_t)dst[(size_t)p * num_seqs + b] * slot_size + head_offset;
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      s[r] += k_mine[r] * delta;
      S_out[(size_t)r * dv] = s[r];
      o += s[r] * q_mine[r];
    }
    __syncthreads();  // every thread has read `partial` above
    partial[warp][lane] = o;
    __syncthreads();
    if (warp == 0) {
      o = partial[0][lane] + partial[1][lane] + partial[2][lane] + partial[3][lane];
      out[(token * num_v_heads + h) * dv + j] = __float2half(o);
    }
  }
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
// Thread mapping: block (256 channels, sequence b), 128 threads; thread owns 2 adjacent
// channels, reads their 3 old inputs into registers, then walks the P tokens writing each
// output and each new state.  A thread reads a channel's old state before it writes any row:
// in place is safe, and no two threads touch the same channel of a row.
extern "C" __global__ void __launch_bounds__(128)
    gdn_decode_conv(const half* __restrict__ x, int x_stride, half* __restrict__ conv_st,
                    const half* __restrict__ weight, const long long* __restrict__ src,
                    const long long* __restrict__ dst, half* __restrict__ out, int channels,
                    int positions) {
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
