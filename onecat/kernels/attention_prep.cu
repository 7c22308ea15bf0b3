// Gated-attention inputs for sm_70: one launch between a full-attention layer's merged qkv
// projection and its attention, for every token of a step (decode and prompt rows alike: the
// work is token-wise).  Per token it splits the projection into heads, applies the per-head
// RMSNorm with the (1 + w) weight to queries and keys, rotates their first rotary_dim
// features (partial RoPE, rotate-half style) and writes keys and values straight into the
// layer's paged KV cache, encoded as the cache's --kv-cache-dtype says (kv_format).  It replaces ~10 small fused elementwise kernels and the two cache
// scatters of the torch path.  Compiled by NVRTC 12 for compute_70 / sm_70; no torch headers.
//
// Data layout (row-major, innermost dimension contiguous):
//   qkv           fp16 [T][qkv_stride]   row t: for each query head h, D query features then
//                                        D gate features (2*H*D), then KVH*D keys, then KVH*D
//                                        values; the gate is not touched here
//   positions     int64 [T]
//   q_weight,
//   k_weight      fp32 [D]               the norms' zero-centred weights w (scale 1 + w)
//   inv_freq      fp32 [rotary_dim / 2]
//   slot_mapping  int64 [T]              cache row of token t; a row outside [0, num_slots)
//                                        (e.g. -1 for padding rows) writes no cache entry
//   k_cache,
//   v_cache       [num_slots][KVH][D]    one layer's cache ([num_blocks][block_size]
//                                        flattened); null (num_slots 0) writes none.  Element
//                                        by kv_format (w4a16_common.cuh, kv_cache.py):
//                                        0 fp16; 1 fp8_e5m2, uint8 = the top byte of the fp16
//                                        value (rounded to nearest even, saturated); 2 int8
//                                        codes q = clamp(rne(x / s), -127, 127)
//   k_scale,
//   v_scale       fp32 [num_slots][KVH]  int8 only (else null): s = amax / 127 over the head's
//                                        D fp16 values (the key after norm and RoPE, the value
//                                        as it is)
//   q_out         fp16 [T][H][D]         contiguous
//   k_out, v_out  fp16 [T][KVH][D]       contiguous; optional (null: not written), for the
//                                        prompt path that attends over the fresh keys
//
// Math (the torch reference `attention_inputs` with its rounding points): per head, with x
// the D fp16 inputs as fp32,
//     y = fp16( x * rsqrt(mean(x^2) + eps) * (1 + w) )
//     for i < r/2 (r = rotary_dim), angle = fp32(position) * inv_freq[i] (one fp32 product):
//         out[i]       = fp16( y[i] cos(angle) - y[i + r/2] sin(angle) )
//         out[i + r/2] = fp16( y[i + r/2] cos(angle) + y[i] sin(angle) )
//     out[i] = y[i] for i >= r.
// cos and sin of the fp32 angle are evaluated in double and rounded to fp32, and the
// rotation's products and sums are rounded one by one (rope_angle, norm_feature and
// rotate_feature in w4a16_common.cuh, shared with paged_attention.cu's prep form).  Values
// are copied unchanged.  The cache then holds the fp16 key / value, or its encoding (the codes
// and scales are bit-equal to kv_cache.encode's of the same fp16 values).
//
// Thread mapping: block (token t, group of 4 heads), 128 threads = 4 warps, one warp per head
// of the token's H + 2*KVH heads (query heads, then key heads, then value heads).  Lane l
// holds features l, l + 32, ..., l + D - 32 (D / 32 <= 8 of them, in registers), so every warp
// load and store touches 32 consecutive halfs.  The sum of squares meets by xor shuffles; the
// rotation's partner feature i +- r/2 lives in another lane, so each warp stages its normed
// rotary features in its own slice of shared memory.  The block first fills a shared table of
// cos / sin of the token's r/2 angles (shared by its heads).  An int8 cache row's amax meets by
// xor shuffles over the warp (one warp holds the whole head); lane 0 writes the scale.
#include "w4a16_common.cuh"

namespace onecat_prep {
constexpr int kWarps = 4;
constexpr int kMaxDim = 256;
constexpr int kMaxPerLane = kMaxDim / 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// One head's D fp16 features (lane l holds l + 32j, j < per_lane; the rest zero) into entry
// `entry` (= slot * KVH + head) of a cache in encoding `format`.  Call from all 32 lanes.
__device__ __forceinline__ void store_head(void* cache, float* scales, long long entry, const half (&x)[kMaxPerLane],
                                          int per_lane, int head_dim, int format, int lane) {
  if (format == onecat::kKvInt8) {
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) amax = fmaxf(amax, fabsf(__half2float(x[j])));
    const float scale = onecat::int8_scale(warp_max(amax));
    if (lane == 0) scales[entry] = scale;
    unsigned char* row = static_cast<unsigned char*>(cache) + entry * head_dim;
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j)
      if (j < per_lane) row[lane + 32 * j] = (unsigned char)onecat::int8_encode(__half2float(x[j]), scale);
  } else if (format == onecat::kKvFp8) {
    unsigned char* row = static_cast<unsigned char*>(cache) + entry * head_dim;
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j)
      if (j < per_lane) row[lane + 32 * j] = (unsigned char)onecat::fp8_e5m2_encode(x[j]);
  } else {
    half* row = static_cast<half*>(cache) + entry * head_dim;
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j)
      if (j < per_lane) row[lane + 32 * j] = x[j];
  }
}
}  // namespace onecat_prep

extern "C" __global__ void __launch_bounds__(128)
    attention_prep(const half* __restrict__ qkv, long long qkv_stride,
                   const long long* __restrict__ positions, const float* __restrict__ q_weight,
                   const float* __restrict__ k_weight, const float* __restrict__ inv_freq, float eps,
                   const long long* __restrict__ slot_mapping, void* __restrict__ k_cache,
                   void* __restrict__ v_cache, long long num_slots, half* __restrict__ q_out,
                   half* __restrict__ k_out, half* __restrict__ v_out, int num_heads,
                   int num_kv_heads, int head_dim, int rotary_dim, float* __restrict__ k_scale,
                   float* __restrict__ v_scale, int kv_format) {
  using namespace onecat_prep;
  __shared__ float cos_table[kMaxDim / 2], sin_table[kMaxDim / 2];
  __shared__ float staged[kWarps][kMaxDim];
  const long long t = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int half_rot = rotary_dim >> 1;

  // 1. cos / sin of this token's angles, shared by the block's heads
  const float position = (float)positions[t];
  for (int i = threadIdx.x; i < half_rot; i += 32 * kWarps) {
    onecat::rope_angle(position, inv_freq[i], cos_table[i], sin_table[i]);
  }
  __syncthreads();

  const int head = blockIdx.y * kWarps + warp;
  if (head >= num_heads + 2 * num_kv_heads) return;
  const int per_lane = head_dim >> 5;
  const half* row = qkv + t * qkv_stride;
  const long long slot = slot_mapping[t];
  const bool to_cache = k_cache != nullptr && slot >= 0 && slot < num_slots;

  // 2. values: copied as they are (encoded into the cache)
  if (head >= num_heads + num_kv_heads) {
    const int g = head - num_heads - num_kv_heads;
    const half* src = row + 2 * num_heads * head_dim + (num_kv_heads + g) * head_dim;
    half* out_row = v_out != nullptr ? v_out + (t * num_kv_heads + g) * head_dim : nullptr;
    half v[kMaxPerLane];
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      v[j] = j < per_lane ? src[lane + 32 * j] : __float2half(0.f);
      if (out_row && j < per_lane) out_row[lane + 32 * j] = v[j];
    }
    if (to_cache)  // (warp-uniform: the token's slot)
      store_head(v_cache, v_scale, slot * num_kv_heads + g, v, per_lane, head_dim, kv_format, lane);
    return;
  }

  // 3. queries and keys: RMSNorm with (1 + w), rounded to fp16
  const bool is_query = head < num_heads;
  const int g = is_query ? head : head - num_heads;
  const half* src = is_query ? row + 2 * g * head_dim : row + 2 * num_heads * head_dim + g * head_dim;
  const float* weight = is_query ? q_weight : k_weight;
  float x[kMaxPerLane];
  float squares = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    x[j] = j < per_lane ? __half2float(src[lane + 32 * j]) : 0.f;
    squares = fmaf(x[j], x[j], squares);
  }
  const float inv_rms = rsqrtf(warp_sum(squares) / (float)head_dim + eps);
  float* mine = staged[warp];
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    if (j < per_lane) {
      const int i = lane + 32 * j;
      x[j] = onecat::norm_feature(x[j], inv_rms, weight[i]);
      if (i < rotary_dim) mine[i] = x[j];
    }
  }
  __syncwarp();

  // 4. partial RoPE of the first rotary_dim features, then the stores
  half* dst;
  if (is_query) {
    dst = q_out + (t * num_heads + g) * head_dim;
  } else {
    dst = k_out != nullptr ? k_out + (t * num_kv_heads + g) * head_dim : nullptr;
  }
  half outs[kMaxPerLane];
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    outs[j] = __float2half(0.f);
    if (j < per_lane) {
      const int i = lane + 32 * j;
      float y = x[j];
      if (i < half_rot) {
        y = onecat::rotate_feature(y, mine[i + half_rot], cos_table[i], sin_table[i], true);
      } else if (i < rotary_dim) {
        const int f = i - half_rot;
        y = onecat::rotate_feature(y, mine[f], cos_table[f], sin_table[f], false);
      }
      const half out = __float2half_rn(y);
      if (dst) dst[i] = out;
      outs[j] = out;
    }
  }
  if (!is_query && to_cache)  // (warp-uniform)
    store_head(k_cache, k_scale, slot * num_kv_heads + g, outs, per_lane, head_dim, kv_format, lane);
}
