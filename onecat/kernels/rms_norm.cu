// Qwen3.5's RMSNorm with the (1 + w) weight, optionally after the residual add, for one GPU:
//   residual_out = fp16(x + residual)                      (when residual is given)
//   out          = fp16(r * rsqrt(mean(r^2) + eps) * (1 + w)),  r = residual_out (or x), fp32
// the roundings of `add_rms_norm` / `rms_norm` in onecat/runtime/layers/norm.py, in one launch
// (the decode step runs two per layer; the tensor-parallel variant is all_reduce.cu's
// all_reduce_add_rms_norm_w<N>, which also sums the ranks first).
//
// Data layout: x, residual, out, residual_out are [rows, hidden] fp16 row-major, contiguous,
// 16-byte aligned, hidden a multiple of 8 and at most kVectors * 8 * blockDim.x; weight is the
// norm's fp32 [hidden] (stored centred on zero).
//
// Thread mapping: one block per row, blockDim.x threads (a multiple of 32, at most 512; the
// host picks about one or two 16-byte vectors a thread, see rms_norm.py). Thread t owns the
// row's vectors t, t + blockDim.x, ... (at most kVectors of them). A row is a few kilobytes
// and one block serves it, so the cost is latency: every load of the row and of its weights
// is issued before the first use, the row stays in registers for the second pass, and the
// sum of squares takes one barrier: per warp by shuffles, then every warp reads all the warps'
// partials from shared memory and finishes the sum itself (no serial pass, no second barrier).
#include "w4a16_common.cuh"

namespace {

using onecat::accumulate;
using onecat::add_rounded;
using onecat::rms_scale;

constexpr int kMaxThreads = 512;
constexpr int kVectors = 4;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kMaxThreads)
    rms_norm_rows(const uint4* __restrict__ x, const uint4* __restrict__ residual,
                  const float4* __restrict__ weight, uint4* __restrict__ out,
                  uint4* __restrict__ residual_out, int hidden, float eps) {
  __shared__ float s_partial[kMaxThreads / 32];
  const int vectors = hidden / 8;
  const size_t row = static_cast<size_t>(blockIdx.x) * vectors;

  uint4 xv[kVectors], rv[kVectors];
  float4 w0[kVectors], w1[kVectors];  // loaded with the row: off the critical path
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < vectors) {
      xv[j] = __ldg(x + row + i);
      if (residual != nullptr) rv[j] = __ldg(residual + row + i);
      w0[j] = __ldg(weight + 2 * i);
      w1[j] = __ldg(weight + 2 * i + 1);
    }
  }
  float r[kVectors][8];
  float squares = 0.f;
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
#pragma unroll
    for (int k = 0; k < 8; ++k) r[j][k] = 0.f;
    if (i < vectors) {
      if (residual != nullptr) {
        xv[j] = add_rounded(xv[j], rv[j]);  // the residual add's one rounding
        residual_out[row + i] = xv[j];
      }
      accumulate(r[j], xv[j]);
#pragma unroll
      for (int k = 0; k < 8; ++k) squares += r[j][k] * r[j][k];
    }
  }
  const int lane = threadIdx.x & 31;
  squares = warp_sum(squares);
  if (lane == 0) s_partial[threadIdx.x >> 5] = squares;
  __syncthreads();
  const float total = warp_sum(lane < static_cast<int>(blockDim.x >> 5) ? s_partial[lane] : 0.f);
  const float rstd = rsqrtf(total / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < vectors) out[row + i] = rms_scale(r[j], rstd, w0[j], w1[j]);
  }
}
