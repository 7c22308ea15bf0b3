// Gated DeltaNet PREFILL for sm_70: the causal depthwise conv and the chunked gated delta rule
// for the prompt chunks of a batch (varlen: several sequences, one launch per step), each
// sequence's conv and recurrent states read from and written back IN PLACE into its slot.
// Compiled by NVRTC 12 for compute_70 / sm_70; chunk matmuls on tensor cores through wmma
// m16n16k16 (inline PTX, fp16 inputs, fp32 accumulation); no ldmatrix, cp.async or bf16.
//
// Math (per value head; see onecat/runtime/layers/delta_rule.py).  Token t of a chunk of C = 64
// tokens, gamma_t = cumulative sum of g inside the chunk, S0 the state at the chunk start:
//     A[t][j] = beta_t (k_t . k_j) exp(gamma_t - gamma_j)   (j < t),   T = (I + A)^-1
//     W = T diag(beta exp(gamma)) K,   U = T diag(beta) V          (the "WY" form)
//     D = U - W S0                                                 (the chunk's deltas)
//     o = diag(exp(gamma)) Q S0 + (Q K^T * exp(gamma_t - gamma_j) [j <= t]) D
//     S = exp(gamma_C) S0 + K^T diag(exp(gamma_C - gamma)) D
// q and k are l2-normalised (eps 1e-6 inside the root), q scaled by 128^-1/2; value head h reads
// key head h / (Hv / Hk); g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), in fp32.
//
// Data layout (row-major, innermost contiguous; T = the prefill tokens, rows of the step's
// flat batch starting at its first prefill token):
//   x         fp16 [T][x_stride]      in_proj_qkv's output (q | k | v), input of the conv
//   conv_w    fp16 [C][4]             conv weight (kernel 4), C = 2*Hk*128 + Hv*DV
//   conv_st   fp16 [slots][C][3]      the last 3 conv inputs of each sequence
//   mixed     fp16 [T][mixed_stride]  the conv's output (silu applied): q | k | v
//   ba        fp16 [T][ba_stride]     in_proj_ba's output: b (Hv) | a (Hv)
//   state     fp32 [slots][Hv][128][DV]
//   out       fp16 [T][Hv][DV]
//   seqs      int32 [nseq][5]         (first token, length, first chunk, state slot, chunks)
//   chunks    int32 [nchunks][4]      (first token, length <= 64, sequence, checkpoint row),
//                                     sequences' chunks in order; any chunk may be partial
//                                     (one ends at each checkpoint); after a chunk whose
//                                     checkpoint row is >= 0 the scan also writes the state
//                                     there (prefix caching: the state at a block boundary
//                                     inside the prompt chunk, without cutting the pass)
// Workspace written by gdn_prefill_chunk and read by gdn_prefill_scan (n = chunk, rows of a
// partial chunk beyond its length are zero):
//   qk_ws     fp16 [nchunks][Hk][2][64][128]   normalised q (scaled) and k
//   w_ws      fp16 [nchunks][Hv][64][128]      W
//   u_ws      fp16 [nchunks][Hv][64][DV]       U
//   attn_ws   fp16 [nchunks][Hv][64][64]       the decayed causal Q K^T
//   gamma_ws  fp32 [nchunks][Hv][64]           gamma (flat past the chunk's length)
//
// Precision: A, T (the triangular inverse, by forward substitution), gamma, all decays, the
// state and every accumulation are fp32.  fp16 are the wmma inputs: q, k (unit norm), T, W, U,
// the decayed Q K^T, the state's fp16 copy for W S0 and Q S0, and D.  FLA's Triton kernels make
// the same cuts with bf16 (A in fp32, its inverse, w, u, the per-chunk state and v_new in the
// input dtype); fp16 keeps 3 more mantissa bits, and every one of these values is bounded by a
// few units (unit-norm keys, beta and decays in (0, 1]), far from fp16's range limits.
//
// Thread mapping (128 threads = 4 warps everywhere):
//   gdn_prefill_conv  grid (C / 256, nchunks): thread owns 2 adjacent channels and walks the
//                     chunk's tokens with a sliding window in registers; the block of a
//                     sequence's first chunk reads the old conv state and writes the new one
//                     (the same thread reads then writes a channel: no race); a later chunk
//                     that starts less than 3 tokens into its sequence (after a checkpoint)
//                     reads the old state from a copy taken before the launch.
//   gdn_prefill_chunk grid (nchunks, Hv): one chunk of one value head.  Warp w normalises rows
//                     w, w+4, ...; warp w computes row block w of Q K^T and K K^T; warps 0-1
//                     invert I + A (thread c owns column c of T in 64 registers, rows in order,
//                     no barrier) while warps 2-3 scale K by beta exp(gamma); warp w computes
//                     column tiles 2w, 2w+1 of W and w, w+4 of U.
//   gdn_prefill_scan  grid (DV / 32, Hv, nseq): 32 state columns of one value head of one
//                     sequence, walking its chunks in order.  The 128x32 fp32 state lives in
//                     wmma accumulators (warp w: rows 32w..32w+31); per chunk it is copied to
//                     shared memory as fp16, warp w computes rows 16w..16w+15 of D and o, then
//                     its state rows get the decay and the K^T D update.  W, q, k and the
//                     decayed Q K^T are read as wmma fragments straight from global memory
//                     (the four column blocks of a head read the same chunk: L2 hits).
#include <cuda_fp16.h>

namespace onecat_gdnp {
constexpr int kChunk = 64;   // tokens per chunk
constexpr int kDk = 128;     // key head dim
constexpr int kLdK = 136;    // halves per row of the 64x128 fp16 tiles in shared memory
constexpr int kLdF = 68;     // floats per row of the 64x64 fp32 tile
constexpr int kLdT = 72;     // halves per row of T
constexpr int kCols = 32;    // state columns per scan block
constexpr int kLdS = 36;     // floats per row of the scan's fp32 scratch
constexpr int kLdH = 40;     // halves per row of the scan's fp16 tiles

struct Frag { unsigned r[8]; };  // A or B operand: 16 fp16 as 8 pairs
struct Acc { float r[8]; };      // fp32 accumulator

__device__ __forceinline__ unsigned smem(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

#define GDNP_FRAG_OUT "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3]), "=r"(f.r[4]), \
                      "=r"(f.r[5]), "=r"(f.r[6]), "=r"(f.r[7])
// operand loads from shared memory (volatile: ordered with the barriers)
#define GDNP_LOAD_SHARED(NAME, WHICH, LAYOUT)                                                 \
  __device__ __forceinline__ void NAME(Frag& f, const half* p, int ld) {                      \
    asm volatile("wmma.load." #WHICH ".sync.aligned." #LAYOUT ".m16n16k16.shared.f16 "        \
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"                                       \
                 : GDNP_FRAG_OUT : "r"(smem(p)), "r"(ld));                                    \
  }
// operand loads of the read-only workspace from global memory (generic addresses; not
// volatile, so the compiler may issue them early)
#define GDNP_LOAD_GLOBAL(NAME, WHICH, LAYOUT)                                                 \
  __device__ __forceinline__ void NAME(Frag& f, const half* p, int ld) {                      \
    asm("wmma.load." #WHICH ".sync.aligned." #LAYOUT ".m16n16k16.f16 "                        \
        "{%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"                                                \
        : GDNP_FRAG_OUT : "l"(p), "r"(ld));                                                   \
  }
GDNP_LOAD_SHARED(load_a_row_s, a, row)
GDNP_LOAD_SHARED(load_b_row_s, b, row)
GDNP_LOAD_SHARED(load_b_col_s, b, col)
GDNP_LOAD_GLOBAL(load_a_row_g, a, row)
GDNP_LOAD_GLOBAL(load_a_col_g, a, col)

#define GDNP_MMA(NAME, ALAYOUT, BLAYOUT)                                                      \
  __device__ __forceinline__ void NAME(Acc& d, const Frag& a, const Frag& b) {                \
    asm volatile("wmma.mma.sync.aligned." #ALAYOUT "." #BLAYOUT ".m16n16k16.f32.f32 "         \
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11,%12,%13,%14,%15}, "               \
                 "{%16,%17,%18,%19,%20,%21,%22,%23}, {%0,%1,%2,%3,%4,%5,%6,%7};"              \
                 : "+f"(d.r[0]), "+f"(d.r[1]), "+f"(d.r[2]), "+f"(d.r[3]), "+f"(d.r[4]),      \
                   "+f"(d.r[5]), "+f"(d.r[6]), "+f"(d.r[7])                                   \
                 : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(a.r[4]),           \
                   "r"(a.r[5]), "r"(a.r[6]), "r"(a.r[7]), "r"(b.r[0]), "r"(b.r[1]),           \
                   "r"(b.r[2]), "r"(b.r[3]), "r"(b.r[4]), "r"(b.r[5]), "r"(b.r[6]),           \
                   "r"(b.r[7]));                                                              \
  }
GDNP_MMA(mma_rc, row, col)
GDNP_MMA(mma_rr, row, row)
GDNP_MMA(mma_cr, col, row)

#define GDNP_ACC_REGS "f"(c.r[0]), "f"(c.r[1]), "f"(c.r[2]), "f"(c.r[3]), "f"(c.r[4]), \
                      "f"(c.r[5]), "f"(c.r[6]), "f"(c.r[7])
__device__ __forceinline__ void store_acc_s(float* p, const Acc& c, int ld) {
  asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.shared.f32 "
               "[%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
               :: "r"(smem(p)), GDNP_ACC_REGS, "r"(ld) : "memory");
}
__device__ __forceinline__ void store_acc_g(float* p, const Acc& c, int ld) {
  asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.f32 "
               "[%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
               :: "l"(p), GDNP_ACC_REGS, "r"(ld) : "memory");
}
#define GDNP_ACC_OUT "=f"(c.r[0]), "=f"(c.r[1]), "=f"(c.r[2]), "=f"(c.r[3]), "=f"(c.r[4]), \
                     "=f"(c.r[5]), "=f"(c.r[6]), "=f"(c.r[7])
__device__ __forceinline__ void load_acc_s(Acc& c, const float* p, int ld) {
  asm volatile("wmma.load.c.sync.aligned.row.m16n16k16.shared.f32 "
               "{%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
               : GDNP_ACC_OUT : "r"(smem(p)), "r"(ld) : "memory");
}
__device__ __forceinline__ void load_acc_g(Acc& c, const float* p, int ld) {
  asm volatile("wmma.load.c.sync.aligned.row.m16n16k16.f32 "
               "{%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
               : GDNP_ACC_OUT : "l"(p), "r"(ld) : "memory");
}

__device__ __forceinline__ void zero(Acc& c) {
#pragma unroll
  for (int i = 0; i < 8; ++i) c.r[i] = 0.f;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

__device__ __forceinline__ uint2 pack4(float a, float b, float c, float d) {
  half2 lo = __floats2half2_rn(a, b), hi = __floats2half2_rn(c, d);
  return make_uint2(*reinterpret_cast<unsigned*>(&lo), *reinterpret_cast<unsigned*>(&hi));
}
}  // namespace onecat_gdnp

// ---------------------------------------------------------------------------------------------
// The causal depthwise conv (kernel 4) + SiLU over the prefill tokens, conv states in place.
// (minimum 1 block per SM: without it ptxas 12.9 keeps 40 registers and spills 4 bytes)
extern "C" __global__ void __launch_bounds__(128, 1)
gdn_prefill_conv(const half* __restrict__ x, int x_stride, const half* __restrict__ conv_w,
                 half* __restrict__ conv_st, const half* __restrict__ old_st, const int* __restrict__ seqs,
                 const int* __restrict__ chunks, half* __restrict__ mixed, int channels) {
  const int c = 2 * (blockIdx.x * 128 + threadIdx.x);
  if (c >= channels) return;
  const int* chunk = chunks + 4 * blockIdx.y;
  const int start = chunk[0], len = chunk[1];
  const int* seq = seqs + 5 * chunk[2];
  const int seq_start = seq[0], seq_len = seq[1];
  const bool first = start == seq_start;
  float w0[4], w1[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w0[i] = __half2float(conv_w[c * 4 + i]);
    w1[i] = __half2float(conv_w[(c + 1) * 4 + i]);
  }
  // window: inputs at tokens start-3, start-2, start-1 (channels c, c+1); those before the
  // sequence's first token are its old conv state, read from old_st (conv_st itself, or a
  // copy taken before the launch when a chunk other than the first reaches back into it)
  float2 p[3];
  half* st = conv_st + ((size_t)seq[3] * channels + c) * 3;
  const half* old = old_st + ((size_t)seq[3] * channels + c) * 3;
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    const int t = start - 3 + i;
    p[i] = t < seq_start
               ? make_float2(__half2float(old[3 + t - seq_start]), __half2float(old[6 + t - seq_start]))
               : __half22float2(*reinterpret_cast<const half2*>(x + (size_t)t * x_stride + c));
  }
  if (first) {  // new state: the last 3 of (old state ++ the sequence's inputs)
    half2 next[3];
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const int j = seq_len + i;  // index into (old state ++ inputs)
      next[i] = j < 3 ? __halves2half2(old[j], old[3 + j])
                      : *reinterpret_cast<const half2*>(x + (size_t)(seq_start + j - 3) * x_stride + c);
    }
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      st[i] = __low2half(next[i]);
      st[3 + i] = __high2half(next[i]);
    }
  }
#pragma unroll 8
  for (int t = 0; t < len; ++t) {
    const float2 v = __half22float2(*reinterpret_cast<const half2*>(x + (size_t)(start + t) * x_stride + c));
    const float y0 = w0[0] * p[0].x + w0[1] * p[1].x + w0[2] * p[2].x + w0[3] * v.x;
    const float y1 = w1[0] * p[0].y + w1[1] * p[1].y + w1[2] * p[2].y + w1[3] * v.y;
    *reinterpret_cast<half2*>(mixed + (size_t)(start + t) * channels + c) =
        __floats2half2_rn(onecat_gdnp::silu(y0), onecat_gdnp::silu(y1));
    p[0] = p[1];
    p[1] = p[2];
    p[2] = v;
  }
}

// ---------------------------------------------------------------------------------------------
// Per (chunk, value head): gates, normalised q/k, the decayed Q K^T, T = (I + A)^-1, W and U.
extern "C" __global__ void __launch_bounds__(128)
gdn_prefill_chunk(const half* __restrict__ mixed, int mixed_stride, const half* __restrict__ ba,
                  int ba_stride, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                  const int* __restrict__ chunks, half* __restrict__ qk_ws, half* __restrict__ w_ws,
                  half* __restrict__ u_ws, half* __restrict__ attn_ws, float* __restrict__ gamma_ws,
                  int num_k_heads, int num_v_heads, int dv) {
  using namespace onecat_gdnp;
  __shared__ __align__(32) half k_s[kChunk * kLdK];   // k, then beta exp(gamma) k, then beta v
  __shared__ __align__(32) float f_s[kChunk * kLdF];  // q (as fp16), then Q K^T, A, scratch
  __shared__ __align__(32) half t_s[kChunk * kLdT];   // T = (I + A)^-1
  __shared__ float gam_s[kChunk], beta_s[kChunk], kscale_s[kChunk];
  half* q_s = reinterpret_cast<half*>(f_s);

  const int n = blockIdx.x, h = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int start = chunks[4 * n], len = chunks[4 * n + 1];
  const int group = num_v_heads / num_k_heads, hk = h / group;
  const int key_dim = num_k_heads * kDk;
  const bool writes_qk = h % group == 0;
  half* qk_out = qk_ws + (size_t)(n * num_k_heads + hk) * 2 * kChunk * kDk;

  // 1. q and k rows, l2-normalised in fp32 (rows past the chunk's length are zero)
  for (int r = warp; r < kChunk; r += 4) {
    float q[4] = {0.f, 0.f, 0.f, 0.f}, k[4] = {0.f, 0.f, 0.f, 0.f};
    if (r < len) {
      const half* row = mixed + (size_t)(start + r) * mixed_stride + hk * kDk + 4 * lane;
      const uint2 qv = *reinterpret_cast<const uint2*>(row);
      const uint2 kv = *reinterpret_cast<const uint2*>(row + key_dim);
      const float2 q01 = __half22float2(*reinterpret_cast<const half2*>(&qv.x));
      const float2 q23 = __half22float2(*reinterpret_cast<const half2*>(&qv.y));
      const float2 k01 = __half22float2(*reinterpret_cast<const half2*>(&kv.x));
      const float2 k23 = __half22float2(*reinterpret_cast<const half2*>(&kv.y));
      q[0] = q01.x; q[1] = q01.y; q[2] = q23.x; q[3] = q23.y;
      k[0] = k01.x; k[1] = k01.y; k[2] = k23.x; k[3] = k23.y;
    }
    const float qq = warp_sum(q[0] * q[0] + q[1] * q[1] + q[2] * q[2] + q[3] * q[3]);
    const float kk = warp_sum(k[0] * k[0] + k[1] * k[1] + k[2] * k[2] + k[3] * k[3]);
    const float qn = rsqrtf(qq + 1e-6f) * rsqrtf((float)kDk), kn = rsqrtf(kk + 1e-6f);
    const uint2 qh = pack4(q[0] * qn, q[1] * qn, q[2] * qn, q[3] * qn);
    const uint2 kh = pack4(k[0] * kn, k[1] * kn, k[2] * kn, k[3] * kn);
    *reinterpret_cast<uint2*>(q_s + r * kLdK + 4 * lane) = qh;
    *reinterpret_cast<uint2*>(k_s + r * kLdK + 4 * lane) = kh;
    if (writes_qk) {
      *reinterpret_cast<uint2*>(qk_out + r * kDk + 4 * lane) = qh;
      *reinterpret_cast<uint2*>(qk_out + (kChunk + r) * kDk + 4 * lane) = kh;
    }
  }

  // 2. g and beta in fp32 (softplus as torch's, threshold 20), gamma = inclusive cumsum of g
  if (tid < kChunk) {
    float g = 0.f, beta = 0.f;
    if (tid < len) {
      const half* gates = ba + (size_t)(start + tid) * ba_stride;
      const float a = __half2float(gates[num_v_heads + h]) + dt_bias[h];
      const float softplus = a > 20.f ? a : log1pf(expf(a));
      g = -expf(A_log[h]) * softplus;
      beta = 1.f / (1.f + expf(-__half2float(gates[h])));
    }
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, g, offset);
      if (lane >= offset) g += y;
    }
    gam_s[tid] = g;
    beta_s[tid] = beta;
  }
  __syncthreads();
  if (tid >= 32 && tid < kChunk) gam_s[tid] += gam_s[31];
  __syncthreads();
  if (tid < kChunk) {
    gamma_ws[(size_t)(n * num_v_heads + h) * kChunk + tid] = gam_s[tid];
    kscale_s[tid] = beta_s[tid] * expf(gam_s[tid]);
  }

  // 3. row block `warp` of Q K^T and K K^T (blocks right of the diagonal are never needed)
  Acc qk[4], kk[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    zero(qk[j]);
    zero(kk[j]);
  }
#pragma unroll
  for (int s = 0; s < kDk / 16; ++s) {
    Frag aq, ak;
    load_a_row_s(aq, q_s + 16 * warp * kLdK + 16 * s, kLdK);
    load_a_row_s(ak, k_s + 16 * warp * kLdK + 16 * s, kLdK);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j <= warp) {
        Frag b;
        load_b_col_s(b, k_s + 16 * j * kLdK + 16 * s, kLdK);
        mma_rc(qk[j], aq, b);
        mma_rc(kk[j], ak, b);
      }
    }
  }
  __syncthreads();  // q_s (aliasing f_s) fully read
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (j <= warp) store_acc_s(f_s + 16 * warp * kLdF + 16 * j, qk[j], kLdF);
  __syncthreads();
  // the decayed causal Q K^T, fp16, to the workspace
  half* attn = attn_ws + (size_t)(n * num_v_heads + h) * kChunk * kChunk;
  for (int e = 2 * tid; e < kChunk * kChunk; e += 256) {
    const int r = e / kChunk, c = e % kChunk;
    const float v0 = c <= r ? f_s[r * kLdF + c] * expf(gam_s[r] - gam_s[c]) : 0.f;
    const float v1 = c + 1 <= r ? f_s[r * kLdF + c + 1] * expf(gam_s[r] - gam_s[c + 1]) : 0.f;
    *reinterpret_cast<half2*>(attn + e) = __floats2half2_rn(v0, v1);
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (j <= warp) store_acc_s(f_s + 16 * warp * kLdF + 16 * j, kk[j], kLdF);
  __syncthreads();
  // A (strictly lower part only; the rest is never read)
  for (int e = tid; e < kChunk * kChunk; e += 128) {
    const int r = e / kChunk, c = e % kChunk;
    if (c < r) f_s[r * kLdF + c] *= beta_s[r] * expf(gam_s[r] - gam_s[c]);
  }
  __syncthreads();

  // 4. warps 0-1: T = (I + A)^-1 by forward substitution, thread c owns column c;
  //    warps 2-3: k rows scaled by beta exp(gamma) (the right-hand side of W)
  if (tid < kChunk) {
    const int c = tid;
    float t[kChunk];
#pragma unroll
    for (int r = 0; r < kChunk; ++r) {
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
      for (int m = 0; m < r; m += 4) {
        const float4 a = *reinterpret_cast<const float4*>(f_s + r * kLdF + m);
        s0 += a.x * t[m];
        if (m + 1 < r) s1 += a.y * t[m + 1];
        if (m + 2 < r) s2 += a.z * t[m + 2];
        if (m + 3 < r) s3 += a.w * t[m + 3];
      }
      t[r] = r == c ? 1.f : -((s0 + s1) + (s2 + s3));
      t_s[r * kLdT + c] = __float2half_rn(t[r]);
    }
  } else {
    for (int e = tid - kChunk; e < kChunk * kDk / 2; e += kChunk) {
      const int r = e / (kDk / 2), c = 2 * (e % (kDk / 2));
      half2* p = reinterpret_cast<half2*>(k_s + r * kLdK + c);
      const float2 v = __half22float2(*p);
      *p = __floats2half2_rn(v.x * kscale_s[r], v.y * kscale_s[r]);
    }
  }
  __syncthreads();

  // 5. W = T (beta exp(gamma) K): warp w, column tiles 2w and 2w+1; T is lower triangular
  float* scratch = f_s + 16 * warp * kLdF;  // this warp's 16 x 64 floats
  half* w_out = w_ws + (size_t)(n * num_v_heads + h) * kChunk * kDk;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    Acc acc[2];
    zero(acc[0]);
    zero(acc[1]);
#pragma unroll
    for (int j = 0; j <= i; ++j) {
      Frag a;
      load_a_row_s(a, t_s + 16 * i * kLdT + 16 * j, kLdT);
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        Frag b;
        load_b_row_s(b, k_s + 16 * j * kLdK + 16 * (2 * warp + x), kLdK);
        mma_rr(acc[x], a, b);
      }
    }
    store_acc_s(scratch, acc[0], kLdF);
    store_acc_s(scratch + 16, acc[1], kLdF);
    __syncwarp();
    {  // lane: row lane/2, 16 columns
      const int row = lane >> 1, col = 16 * (lane & 1);
      const float* src = scratch + row * kLdF + col;
      uint4 lo, hi;
      *reinterpret_cast<uint2*>(&lo.x) = pack4(src[0], src[1], src[2], src[3]);
      *reinterpret_cast<uint2*>(&lo.z) = pack4(src[4], src[5], src[6], src[7]);
      *reinterpret_cast<uint2*>(&hi.x) = pack4(src[8], src[9], src[10], src[11]);
      *reinterpret_cast<uint2*>(&hi.z) = pack4(src[12], src[13], src[14], src[15]);
      uint4* dst = reinterpret_cast<uint4*>(w_out + (16 * i + row) * kDk + 32 * warp + col);
      dst[0] = lo;
      dst[1] = hi;
    }
    __syncwarp();
  }
  __syncthreads();  // k_s fully read

  // 6. beta v into k_s (rows past the length zero)
  const int quads = dv / 4;
  for (int e = tid; e < kChunk * quads; e += 128) {
    const int r = e / quads, c = 4 * (e % quads);
    uint2 v = make_uint2(0u, 0u);
    if (r < len) {
      const uint2 raw = *reinterpret_cast<const uint2*>(
          mixed + (size_t)(start + r) * mixed_stride + 2 * key_dim + h * dv + c);
      const float2 v01 = __half22float2(*reinterpret_cast<const half2*>(&raw.x));
      const float2 v23 = __half22float2(*reinterpret_cast<const half2*>(&raw.y));
      const float b = beta_s[r];
      v = pack4(v01.x * b, v01.y * b, v23.x * b, v23.y * b);
    }
    *reinterpret_cast<uint2*>(k_s + r * kLdK + c) = v;
  }
  __syncthreads();

  // 7. U = T (beta V): warp w, column tiles w and w+4
  half* u_out = u_ws + (size_t)(n * num_v_heads + h) * kChunk * dv;
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int ct = warp + 4 * x;
    if (16 * ct >= dv) break;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      Acc acc;
      zero(acc);
#pragma unroll
      for (int j = 0; j <= i; ++j) {
        Frag a, b;
        load_a_row_s(a, t_s + 16 * i * kLdT + 16 * j, kLdT);
        load_b_row_s(b, k_s + 16 * j * kLdK + 16 * ct, kLdK);
        mma_rr(acc, a, b);
      }
      store_acc_s(scratch, acc, kLdF);
      __syncwarp();
      const int row = lane >> 1, col = 8 * (lane & 1);
      const float* src = scratch + row * kLdF + col;
      uint4 v;
      *reinterpret_cast<uint2*>(&v.x) = pack4(src[0], src[1], src[2], src[3]);
      *reinterpret_cast<uint2*>(&v.z) = pack4(src[4], src[5], src[6], src[7]);
      *reinterpret_cast<uint4*>(u_out + (16 * i + row) * dv + 16 * ct + col) = v;
      __syncwarp();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Per (32 state columns, value head, sequence): the chunks in order; o and the state.
extern "C" __global__ void __launch_bounds__(128)
gdn_prefill_scan(const half* __restrict__ qk_ws, const half* __restrict__ w_ws,
                 const half* __restrict__ u_ws, const half* __restrict__ attn_ws,
                 const float* __restrict__ gamma_ws, const int* __restrict__ seqs,
                 const int* __restrict__ chunks, float* __restrict__ state, half* __restrict__ out, int num_k_heads,
                 int num_v_heads, int dv) {
  using namespace onecat_gdnp;
  __shared__ __align__(32) float s_f[kDk * kLdS];    // warp w: rows 32w.. (state copy, scratch)
  __shared__ __align__(32) half s_h[kDk * kLdH];     // the state, fp16
  __shared__ __align__(32) half d_h[kChunk * kLdH];  // D
  __shared__ __align__(32) half d_k[kChunk * kLdH];  // diag(exp(gamma_C - gamma)) D
  __shared__ float gam_s[kChunk];

  const int col0 = kCols * blockIdx.x, h = blockIdx.y;
  const int* seq = seqs + 5 * blockIdx.z;
  const int chunk0 = seq[2], num_chunks = seq[4];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hk = h / (num_v_heads / num_k_heads);
  float* scratch = s_f + 32 * warp * kLdS;

  Acc s[2][2];  // state rows 32w + 16a, columns col0 + 16b
  float* st = state + ((size_t)seq[3] * num_v_heads + h) * kDk * dv + col0;
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int b = 0; b < 2; ++b) load_acc_g(s[a][b], st + (32 * warp + 16 * a) * dv + 16 * b, dv);

  for (int c = 0; c < num_chunks; ++c) {
    const size_t n = chunk0 + c;
    const int* chunk = chunks + 4 * n;
    const size_t nh = n * num_v_heads + h;
    const half* q_g = qk_ws + (n * num_k_heads + hk) * 2 * kChunk * kDk;
    const half* k_g = q_g + kChunk * kDk;

    // (a) the state to shared memory, fp16 (each warp converts its own rows)
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < 2; ++b) store_acc_s(scratch + 16 * a * kLdS + 16 * b, s[a][b], kLdS);
    if (tid < kChunk) gam_s[tid] = gamma_ws[nh * kChunk + tid];
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 16; ++i) {  // 32 rows x 16 column pairs
      const int e = lane + 32 * i, row = e >> 4, col = 2 * (e & 15);
      *reinterpret_cast<half2*>(s_h + (32 * warp + row) * kLdH + col) =
          __floats2half2_rn(scratch[row * kLdS + col], scratch[row * kLdS + col + 1]);
    }
    __syncthreads();

    // (b) rows 16w..16w+15: P = W S0 and Q S0
    Acc p[2], o[2];
    zero(p[0]); zero(p[1]); zero(o[0]); zero(o[1]);
    const half* w_g = w_ws + nh * kChunk * kDk + 16 * warp * kDk;
#pragma unroll
    for (int k = 0; k < kDk / 16; ++k) {
      Frag aw, aq, b0, b1;
      load_a_row_g(aw, w_g + 16 * k, kDk);
      load_a_row_g(aq, q_g + 16 * warp * kDk + 16 * k, kDk);
      load_b_row_s(b0, s_h + 16 * k * kLdH, kLdH);
      load_b_row_s(b1, s_h + 16 * k * kLdH + 16, kLdH);
      mma_rr(p[0], aw, b0);
      mma_rr(p[1], aw, b1);
      mma_rr(o[0], aq, b0);
      mma_rr(o[1], aq, b1);
    }

    // (c) D = U - P (fp16, and decayed to the chunk end); o's first term scaled by exp(gamma)
    float* p_s = scratch;                // 16 x 32
    float* o_s = scratch + 16 * kLdS;    // 16 x 32
    store_acc_s(p_s, p[0], kLdS);
    store_acc_s(p_s + 16, p[1], kLdS);
    store_acc_s(o_s, o[0], kLdS);
    store_acc_s(o_s + 16, o[1], kLdS);
    __syncwarp();
    const float gamma_end = gam_s[kChunk - 1];
    const half* u_g = u_ws + nh * kChunk * dv + col0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {  // 16 rows x 16 column pairs
      const int e = lane + 32 * i, row = e >> 4, col = 2 * (e & 15), r = 16 * warp + row;
      const float2 u = __half22float2(*reinterpret_cast<const half2*>(u_g + r * dv + col));
      const float d0 = u.x - p_s[row * kLdS + col], d1 = u.y - p_s[row * kLdS + col + 1];
      const float to_end = expf(gamma_end - gam_s[r]), from_start = expf(gam_s[r]);
      *reinterpret_cast<half2*>(d_h + r * kLdH + col) = __floats2half2_rn(d0, d1);
      *reinterpret_cast<half2*>(d_k + r * kLdH + col) = __floats2half2_rn(d0 * to_end, d1 * to_end);
      o_s[row * kLdS + col] *= from_start;
      o_s[row * kLdS + col + 1] *= from_start;
    }
    __syncwarp();
    load_acc_s(o[0], o_s, kLdS);
    load_acc_s(o[1], o_s + 16, kLdS);
    __syncthreads();  // D complete

    // (d) o += (decayed causal Q K^T) D, rows 16w..16w+15; then o to global (valid rows)
    const half* attn_g = attn_ws + nh * kChunk * kChunk + 16 * warp * kChunk;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j <= warp) {
        Frag a, b0, b1;
        load_a_row_g(a, attn_g + 16 * j, kChunk);
        load_b_row_s(b0, d_h + 16 * j * kLdH, kLdH);
        load_b_row_s(b1, d_h + 16 * j * kLdH + 16, kLdH);
        mma_rr(o[0], a, b0);
        mma_rr(o[1], a, b1);
      }
    }
    store_acc_s(p_s, o[0], kLdS);
    store_acc_s(p_s + 16, o[1], kLdS);
    __syncwarp();
    const int valid = chunk[1];
#pragma unroll
    for (int i = 0; i < 8; ++i) {  // 16 rows x 16 column pairs
      const int e = lane + 32 * i, row = e >> 4, col = 2 * (e & 15), r = 16 * warp + row;
      if (r < valid) {
        const size_t token = (size_t)chunk[0] + r;
        *reinterpret_cast<half2*>(out + (token * num_v_heads + h) * dv + col0 + col) =
            __floats2half2_rn(p_s[row * kLdS + col], p_s[row * kLdS + col + 1]);
      }
    }

    // (e) S = exp(gamma_C) S0 + K^T (decayed D), this warp's rows 32w..32w+31
    const float decay = expf(gamma_end);
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int i = 0; i < 8; ++i) s[a][b].r[i] *= decay;
#pragma unroll
    for (int j = 0; j < kChunk / 16; ++j) {
      Frag b0, b1;
      load_b_row_s(b0, d_k + 16 * j * kLdH, kLdH);
      load_b_row_s(b1, d_k + 16 * j * kLdH + 16, kLdH);
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        Frag ka;  // K^T rows 32w+16a.., columns (tokens) 16j..: col-major view of k
        load_a_col_g(ka, k_g + 16 * j * kDk + 32 * warp + 16 * a, kDk);
        mma_cr(s[a][0], ka, b0);
        mma_cr(s[a][1], ka, b1);
      }
    }
    if (chunk[3] >= 0) {  // a prefix-cache checkpoint after this chunk
      float* cp = state + ((size_t)chunk[3] * num_v_heads + h) * kDk * dv + col0;
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 2; ++b) store_acc_g(cp + (32 * warp + 16 * a) * dv + 16 * b, s[a][b], dv);
    }
    __syncwarp();
  }
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int b = 0; b < 2; ++b) store_acc_g(st + (32 * warp + 16 * a) * dv + 16 * b, s[a][b], dv);
}
