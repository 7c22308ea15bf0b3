// One-shot all-reduce (sum) of an fp16 tensor over 2, 4 or 8 GPUs of one host, for
// tensor-parallel decode: the same idea as vLLM's custom all-reduce (one kernel, peers'
// memory read directly over NVLink / PCIe P2P), written for sm_70 (volatile accesses and
// __threadfence_system only: no acquire/release PTX, no cp.async, no multimem).
//
// Shared buffer (one per rank, cuMemAlloc'd, mapped into every peer through CUDA IPC;
// onecat/kernels/all_reduce.py allocates it and mirrors these offsets):
//   [0, 4)                     epoch: calls completed by this rank (read and written by this
//                              rank only)
//   [128, 132)                 ticket: blocks of the current call that have finished (this rank)
//   [kFlagsOffset, +kMaxBlocks*kMaxRanks*4)
//                              flags[b][q]: the epoch of the latest call whose block b on
//                              rank q has staged its slice; written by rank q (remote store)
//   [kStagingOffset, +2*stage_bytes)
//                              two staging buffers; call e stages in buffer (e & 1)
// All of it is zero before the first call.
//
// Data layout and thread mapping: x and out are n16 vectors of 16 bytes (8 fp16), 16-byte
// aligned, contiguous (x == out allowed: the reduction is in place). Block b of a grid of G
// blocks of kThreads threads owns vectors i = (b + k*G) * kThreads + threadIdx.x, k = 0, 1, ...
// (a grid-stride loop). Every rank launches the same grid for the same call (the grid is a
// function of n16), so block b owns the same vectors on every rank, and block b on one rank
// synchronises with block b on each peer only.
//
// One call, epoch e = epoch + 1, buffer p = e & 1, per block b:
//   1. copy its vectors of x into its own staging buffer p;
//   2. __syncthreads; thread q < W: __threadfence_system, then a volatile store of e into
//      rank q's flags[b][rank] (a release: the block's staging writes are ordered before the
//      flag through the CTA barrier and the system-scope fence);
//   3. thread q < W spins (volatile loads of its own flags[b][q]) until it has reached e,
//      then __threadfence_system (the acquire side); __syncthreads;
//   4. each thread sums its vectors over ranks 0, 1, ..., W-1 in that fixed order, in fp32
//      (volatile 16-byte loads from every rank's staging buffer p), rounds to fp16 once and
//      writes out: every rank computes bit-identical sums;
//   5. thread 0 takes a ticket (fence, atomicAdd); the block with the last ticket resets it
//      and stores e into epoch, so the next call, on the same stream, uses e + 1.
// The epoch lives in device memory and only the kernel advances it: a CUDA graph that
// captured the launch replays it with the right epoch every time (nothing on the host counts
// calls). Every rank makes the same sequence of calls, so epochs agree across ranks.
//
// Why "reached" (flag - e as a signed 32-bit difference >= 0) and not "equal": a peer may
// finish call e and already store e + 1 into the same flag word before this rank's block
// looked (flags are written by the peer only, so each word only grows). A peer can never be
// two calls ahead: its call e + 1 cannot finish before every rank has raised its e + 1
// flags in every block of that call, i.e. started call e + 1.
//
// Why two staging buffers are enough (no end barrier): rank r overwrites buffer p in call
// e + 2. Before that, r's call e + 1 saw every peer's e + 1 flag (every block waits on every
// rank), so every peer had started call e + 1 and, its calls being ordered on its stream,
// finished call e: the last call that read r's buffer p. Meanwhile a peer still in call
// e + 1 reads r's other buffer. A peer that is one call ahead reads the right data too: its
// flag e + 1 was stored after its call e had finished writing buffer p (kernel boundary,
// then fence and flag store).
//
// Deadlock freedom: block b only waits for block b of the peers, which never waits on any
// other block of its own GPU, and the grid (at most kMaxBlocks blocks) fits on the GPU at
// once. The wait has no timeout: a peer that never makes the call (a crashed rank) hangs it,
// as with NCCL.

// Fused variant, all_reduce_add_rms_norm_w<N> (a decode layer's row-parallel output, its
// residual add and the next RMSNorm in one launch): x, residual, out and residual_out are
// [rows, hidden] fp16 row-major, weight is the norm's fp32 [hidden] (stored centred on zero:
// the factor is 1 + w). One block of kNormThreads threads per row (rows <= kMaxBlocks); thread
// t owns the row's vectors t, t + kNormThreads, ... (at most kNormVectors: hidden <= 8192).
// Steps 1-3 and 5 are the one-shot protocol above with block b = row b; step 4 becomes: sum
// the row over the ranks in fp32, round to fp16 (the all-reduce's result), add the residual
// and round (the new residual, written to residual_out), then a block reduction of the
// squares of those fp16 values gives rstd = rsqrt(mean + eps) and out = fp16(r * rstd * (1 + w)):
// the roundings of `add_rms_norm(all_reduce(x), residual, w, eps)` in onecat/runtime.

#include "w4a16_common.cuh"

using onecat::accumulate;
using onecat::add_rounded;
using onecat::rms_scale;
using onecat::round_to_half;

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 64;
constexpr int kThreads = 512;
constexpr int kNormThreads = 256;
constexpr int kNormVectors = 4;
constexpr unsigned long long kTicketOffset = 128;
constexpr unsigned long long kFlagsOffset = 4096;
constexpr unsigned long long kStagingOffset = 8192;
static_assert(kFlagsOffset + kMaxBlocks * kMaxRanks * 4 <= kStagingOffset, "flags overlap staging");

__device__ __forceinline__ unsigned load_volatile(const unsigned* p) {
  unsigned v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_volatile(unsigned* p, unsigned v) {
  asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint4 load_volatile4(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// This call's epoch: the previous call's (stored by its last block; same stream) + 1.
__device__ __forceinline__ unsigned read_epoch(const char* self) {
  __shared__ unsigned s_epoch;
  if (threadIdx.x == 0) s_epoch = load_volatile(reinterpret_cast<const unsigned*>(self)) + 1u;
  __syncthreads();
  return s_epoch;
}

// Steps 2-3: raise block b's flag of this epoch on every rank, wait for every rank's.
template <int W>
__device__ __forceinline__ void signal_and_wait(char* const (&base)[kMaxRanks], char* self, int rank,
                                                unsigned epoch) {
  const int slot = blockIdx.x * kMaxRanks;
  if (threadIdx.x < W) {
    __threadfence_system();
#pragma unroll
    for (int q = 0; q < W; ++q)  // thread q stores to rank q (static indices: base stays in registers)
      if (threadIdx.x == q) store_volatile(reinterpret_cast<unsigned*>(base[q] + kFlagsOffset) + slot + rank, epoch);
    const unsigned* flag = reinterpret_cast<const unsigned*>(self + kFlagsOffset) + slot + threadIdx.x;
    while (static_cast<int>(load_volatile(flag) - epoch) < 0) {
    }
    __threadfence_system();
  }
  __syncthreads();
}

// Step 5: the block with the last ticket resets it and publishes this epoch.
__device__ __forceinline__ void finish_call(char* self, unsigned epoch) {
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned* ticket = reinterpret_cast<unsigned*>(self + kTicketOffset);
    if (atomicAdd(ticket, 1u) == gridDim.x - 1) {
      store_volatile(ticket, 0u);
      store_volatile(reinterpret_cast<unsigned*>(self), epoch);
    }
  }
}

template <int W>
__device__ __forceinline__ void one_shot(char* const (&base)[kMaxRanks], char* self, int rank,
                                         unsigned long long stage_bytes, const uint4* x, uint4* out, int n16) {
  const unsigned epoch = read_epoch(self);
  const unsigned long long stage = kStagingOffset + (epoch & 1u) * stage_bytes;
  const int stride = gridDim.x * kThreads;
  const int first = blockIdx.x * kThreads + threadIdx.x;

  // 1. stage this block's vectors of x
  uint4* mine = reinterpret_cast<uint4*>(self + stage);
  for (int i = first; i < n16; i += stride) mine[i] = x[i];
  __syncthreads();

  // 2. tell every rank (this one included) that block b of this rank has staged epoch, then
  // 3. wait until block b of every rank has staged epoch
  signal_and_wait<W>(base, self, rank, epoch);

  // 4. sum over the ranks in rank order, fp32, one rounding
  for (int i = first; i < n16; i += stride) {
    uint4 v[W];
#pragma unroll
    for (int q = 0; q < W; ++q) v[q] = load_volatile4(reinterpret_cast<const uint4*>(base[q] + stage) + i);
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int q = 0; q < W; ++q) accumulate(acc, v[q]);
    out[i] = round_to_half(acc);
  }

  // 5. the last block to finish advances the epoch for the next call
  finish_call(self, epoch);
}

// Fused all-reduce + residual add + RMSNorm (1 + w) of one row per block (header comment).
template <int W>
__device__ __forceinline__ void one_shot_add_rms_norm(char* const (&base)[kMaxRanks], char* self, int rank,
                                                      unsigned long long stage_bytes, const uint4* x,
                                                      const uint4* residual, const float* weight, uint4* out,
                                                      uint4* residual_out, int hidden, float eps) {
  __shared__ float s_partial[kNormThreads / 32];
  __shared__ float s_rstd;
  const unsigned epoch = read_epoch(self);
  const unsigned long long stage = kStagingOffset + (epoch & 1u) * stage_bytes;
  const int vectors = hidden / 8;
  const size_t row = static_cast<size_t>(blockIdx.x) * vectors;

  // 1. stage this row of x
  uint4* mine = reinterpret_cast<uint4*>(self + stage) + row;
  for (int i = threadIdx.x; i < vectors; i += kNormThreads) mine[i] = x[row + i];
  __syncthreads();
  // 2-3. flags and wait, as the plain kernel
  signal_and_wait<W>(base, self, rank, epoch);

  // 4. sum over the ranks (fp32, rank order, one rounding), add the residual (one rounding)
  float r[kNormVectors][8];
  float squares = 0.f;
#pragma unroll
  for (int j = 0; j < kNormVectors; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    if (i < vectors) {
      uint4 v[W];
#pragma unroll
      for (int q = 0; q < W; ++q) v[q] = load_volatile4(reinterpret_cast<const uint4*>(base[q] + stage) + row + i);
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int q = 0; q < W; ++q) accumulate(acc, v[q]);
      const uint4 summed = add_rounded(round_to_half(acc), residual[row + i]);  // the all-reduce's fp16 result + residual
      residual_out[row + i] = summed;
#pragma unroll
      for (int k = 0; k < 8; ++k) r[j][k] = 0.f;
      accumulate(r[j], summed);
#pragma unroll
      for (int k = 0; k < 8; ++k) squares += r[j][k] * r[j][k];
    }
  }
  // block reduction of the squares
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
  if ((threadIdx.x & 31) == 0) s_partial[threadIdx.x >> 5] = squares;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kNormThreads / 32; ++w) total += s_partial[w];
    s_rstd = rsqrtf(total / static_cast<float>(hidden) + eps);
  }
  __syncthreads();
  const float rstd = s_rstd;
#pragma unroll
  for (int j = 0; j < kNormVectors; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    if (i < vectors) {
      const float4* w = reinterpret_cast<const float4*>(weight) + 2 * i;
      out[row + i] = rms_scale(r[j], rstd, w[0], w[1]);
    }
  }

  // 5. the last block advances the epoch
  finish_call(self, epoch);
}

#define ONECAT_ALL_REDUCE_ARGS                                                                         \
  char *b0, char *b1, char *b2, char *b3, char *b4, char *b5, char *b6, char *b7, char *self, int rank, \
      unsigned long long stage_bytes, const uint4 *x, uint4 *out, int n16

extern "C" __global__ void __launch_bounds__(kThreads)
    all_reduce_w2(ONECAT_ALL_REDUCE_ARGS) {
  char* const base[kMaxRanks] = {b0, b1, b2, b3, b4, b5, b6, b7};
  one_shot<2>(base, self, rank, stage_bytes, x, out, n16);
}

extern "C" __global__ void __launch_bounds__(kThreads)
    all_reduce_w4(ONECAT_ALL_REDUCE_ARGS) {
  char* const base[kMaxRanks] = {b0, b1, b2, b3, b4, b5, b6, b7};
  one_shot<4>(base, self, rank, stage_bytes, x, out, n16);
}

extern "C" __global__ void __launch_bounds__(kThreads)
    all_reduce_w8(ONECAT_ALL_REDUCE_ARGS) {
  char* const base[kMaxRanks] = {b0, b1, b2, b3, b4, b5, b6, b7};
  one_shot<8>(base, self, rank, stage_bytes, x, out, n16);
}

#define ONECAT_ALL_REDUCE_NORM_ARGS                                                                      \
  char *b0, char *b1, char *b2, char *b3, char *b4, char *b5, char *b6, char *b7, char *self, int rank, \
      unsigned long long stage_bytes, const uint4 *x, const uint4 *residual, const float *weight,      \
      uint4 *out, uint4 *residual_out, int hidden, float eps
#define ONECAT_ALL_REDUCE_NORM_CALL(W)                                                                      \
  char* const base[kMaxRanks] = {b0, b1, b2, b3, b4, b5, b6, b7};                                          \
  one_shot_add_rms_norm<W>(base, self, rank, stage_bytes, x, residual, weight, out, residual_out, hidden, eps)

extern "C" __global__ void __launch_bounds__(kNormThreads)
    all_reduce_add_rms_norm_w2(ONECAT_ALL_REDUCE_NORM_ARGS) {
  ONECAT_ALL_REDUCE_NORM_CALL(2);
}

extern "C" __global__ void __launch_bounds__(kNormThreads)
    all_reduce_add_rms_norm_w4(ONECAT_ALL_REDUCE_NORM_ARGS) {
  ONECAT_ALL_REDUCE_NORM_CALL(4);
}

extern "C" __global__ void __launch_bounds__(kNormThreads)
    all_reduce_add_rms_norm_w8(ONECAT_ALL_REDUCE_NORM_ARGS) {
  ONECAT_ALL_REDUCE_NORM_CALL(8);
}
