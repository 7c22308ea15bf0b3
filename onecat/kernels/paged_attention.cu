// Paged decode attention for sm_70 (flash-decoding): one query token per sequence attends to
// that sequence's keys and values in the paged KV cache, read in place through its block
// table.  Two kernels: `split` walks one range of the context per block and keeps an online
// softmax; `reduce` merges the ranges' partial results.  Compiled by NVRTC 12 for compute_70 /
// sm_70; no torch headers, no cp.async / ldmatrix / bf16.  CUDA cores only: decode attention
// reads every cached key and value once and does 4 flops per fp16 loaded, so it is bound by
// memory bandwidth, not by arithmetic.
//
// Data layout (row-major, innermost dimension contiguous):
//   q             fp16 [B][H][D]     strides q_sb (sequence) and q_sh (head) in elements
//   k_cache,
//   v_cache       [num_blocks][bs][KVH][D]   one layer's cache; token t of sequence b is
//                                    row  block_tables[b][t / bs] * bs + t % bs.  Element by
//                                    the kernel's KV (--kv-cache-dtype, kv_cache.py): fp16;
//                                    uint8 fp8_e5m2 codes (the top byte of fp16: value =
//                                    code << 8 as fp16, exact); int8 codes q
//   k_scale,
//   v_scale       fp32 [num_blocks][bs][KVH]   int8 only (else unused): value = q * s (fp32)
//   block_tables  int64 [B][W]       only the first ceil(ctx / bs) entries of a row are read;
//                                    the rest may hold anything (stale or scratch blocks)
//   context_lens  int64 [B]          ctx: tokens of the sequence, the new one included
//                                    (clamped to W * bs; 0 writes a zero output)
//   out           fp16 [B][H][D]     contiguous
//   gate          fp16 [B][H][D]     optional (null: none): out = attention * sigmoid(gate),
//                                    Qwen3.5's gated attention; strides g_sb and g_sh in
//                                    elements, rows of 8 halfs 16-byte aligned
//   ws_acc        fp32 [B][H][S][D]  per split: sum_t p_t v_t with p_t = 2^(s_t - m)
//   ws_ml         fp32 [B][H][S][2]  per split: (m, l = sum_t p_t), scores s_t in log2 units
// Query head h reads KV head h / (H / KVH) (grouped-query attention).
//
// Splits: the host fixes S (splits per sequence) from the batch size and the GPU so that
// B * KVH * S blocks fill it; each sequence's context is cut on the device into chunks of
// chunk = roundup(ceil(ctx / S), kChunkTokens) tokens, so a block whose chunk starts past ctx exits
// at once and a short context costs what it reads, whatever W is.  Nothing depends on the
// host knowing ctx: the launch is CUDA-graph safe.  A sequence served by a single chunk is
// finished by its split block (fp16 output written directly) and the reduce kernel skips it.
//
// Thread mapping of `split`: block (split s, KV head x head chunk, sequence b), 128 threads =
// 4 warps.  A block serves NG query heads of one KV head (NG = 1, 2, 4, 8; more heads per KV
// head take several head chunks, fewer leave slots idle), so every K and V row it loads is
// used by all of them.  The host picks NG (attention.heads_per_block): the smallest covering
// the group, or 2 when a launch has few (sequence, KV head) pairs, where a block's serial work
// (which grows with NG) is what the step waits for.  The chunk is walked in tiles of kTile
// tokens:
//   0. the tile's cache rows are read from the block table into shared memory;
//   1. scores: a token's key row (D halfs) is read by D/8 lanes, 16 bytes each (one warp
//      reads 256/D tokens per step, warps take steps in turn); each lane holds its 8 query
//      elements of all NG heads in registers (pre-scaled by scale * log2 e), the D/8 lanes'
//      partial dots meet by xor shuffles that also spread the heads over the lanes
//      (spread_sum), and the scores go to shared memory [NG][kTile];
//   2. one warp per head: the tile's max, the running max m, p_t = 2^(s_t - m), the running
//      sum l and the factor alpha that rescales the older accumulators;
//   3. values: warp w owns columns [w*D/4, (w+1)*D/4); a lane reads 8 of them (16 bytes) of
//      one token, so D/32 lanes cover a token's slice and a warp step takes 1024/D tokens;
//      each lane accumulates p_t * v_t for all NG heads in fp32 registers.
// After the last tile the lanes that read different tokens of the same columns sum their
// accumulators by xor shuffles, and the first token group writes them.
// An 8-bit cache (kernels *_fp8_* / *_int8_*: KV = kKvFp8 / kKvInt8) keeps this mapping: a
// lane's 8 elements are 8 bytes (one 8-byte load instead of 16), decoded to fp32 in registers
// (fp8: each code is the high byte of its fp16; int8: code * the row's scale, one fp32 load per
// token next to its codes), so everything after the load is the fp16 kernel's.
//
// Thread mapping of `reduce`: block (query head, sequence), D threads, thread d owns column d:
// out = sum_s 2^(m_s - M) acc_s[d] / sum_s 2^(m_s - M) l_s with M = max_s m_s.
//
// The output gate (when given) is applied by whichever kernel writes a sequence's output, in
// fp32 before the one rounding to fp16: out = fp16(o * sigmoid(gate)), o the fp32 attention.
//
// `split_prep` (PREP = true): the same kernel that also does attention_prep.cu's work for the
// step's one new token per sequence, so a decode step needs no prep launch.  Instead of q it
// reads the layer's merged qkv projection (row b: per query head D query then D gate
// features, then KVH*D keys, then KVH*D values; the gate pointer points into it):
//   - every block norms (RMSNorm, (1 + w) weights q_weight / k_weight fp32 [D]) and rotates
//     (partial RoPE of the first rotary_dim features, rotate-half, position positions[b],
//     inv_freq fp32 [rotary_dim/2]) the queries of its NG heads in the phase-1 mapping: lane
//     part1 holds features 8*part1 .. 8*part1+7, so the sum of squares meets by xor shuffles
//     over the kLanes1 lanes of a token group and a feature's rotation partner (i +- r/2, r/2
//     a multiple of 8) is the same register of lane part1 +- r/16; cos / sin of the r/2
//     angles come from a shared table that the block fills first (sincospi in double);
//   - the block whose range ends at ctx (it holds the new token, position ctx - 1) also
//     prepares that token's key and copies its value into cache row slot_mapping[b] (when it
//     lies in [0, num_slots); the table must map position ctx - 1 there) before its first
//     tile, and reads keys and values (and scales) with ld.global.cg (L2, coherent with its
//     own writes after the barrier) instead of the read-only path.  Blocks of other head
//     chunks of the same KV head write the same bytes.  An 8-bit cache gets the codes of the
//     fp16 key / value (attention_prep.cu's encoding, bit-equal): the kLanes1 lanes of a token
//     group hold a head's D features, so an int8 row's amax meets by xor shuffles over them
//     and lane part1 = 0 writes the scale.
//   - the work is spread over the warps (items: the key, then the NG query heads), the
//     roped queries go through shared memory, and every global load (the first tile's table
//     entries included) is issued before the norms.
// The roundings are attention_prep.cu's (its fp64 contract); only the order of the sum of
// squares differs.  The caller guarantees one decode row per sequence (no drafts): a row never
// reads a key that another row of the same launch writes.
#include "w4a16_common.cuh"

namespace onecat_attn {
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTile = 128;   // tokens per tile (scores held in shared memory)
// Split granularity: a chunk is a multiple of this many tokens.  Short contexts (a decode
// step at a few hundred tokens) are spread over ceil(ctx / 32) blocks instead of one or two
// 128-token tiles, whose serial walk through the scores, the softmax and the values is the
// step's latency; long contexts are cut into S chunks either way.
constexpr int kChunkTokens = 32;
constexpr int kVec = 8;      // halfs per 16-byte load
constexpr int kUnroll = 4;   // token steps in flight per warp
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// 8 halfs in one 16-byte load, kept packed until used (4 registers per token in flight)
__device__ __forceinline__ uint4 load8(const half* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ void unpack2(unsigned int w, float& lo, float& hi) {
  lo = __half2float(__ushort_as_half((unsigned short)(w & 0xffffu)));
  hi = __half2float(__ushort_as_half((unsigned short)(w >> 16)));
}

__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
  return (unsigned int)__half_as_ushort(__float2half_rn(lo)) |
         ((unsigned int)__half_as_ushort(__float2half_rn(hi)) << 16);
}

__device__ __forceinline__ void unpack8(const uint4& raw, float (&f)[kVec]) {
  unpack2(raw.x, f[0], f[1]);
  unpack2(raw.y, f[2], f[3]);
  unpack2(raw.z, f[4], f[5]);
  unpack2(raw.w, f[6], f[7]);
}

// Sums each lane's NG partial dots over the kLanes lanes of its token group (xor offsets below
// kLanes) while spreading the heads over them: at each level the lanes keep one half of their
// heads and swap the other half with their partner, so NG heads cost about NG shuffles instead
// of NG * log2(kLanes).  Afterwards v[j] (j < kKeep = max(1, NG / kLanes)) is the total of head
// `head + j`, complete on every lane whose bits below kLanes / min(NG, kLanes) are zero.
template <int NG, int kCount, int kOffset>
__device__ __forceinline__ void spread_sum(float (&v)[NG], int lane, int& head) {
  if constexpr (kOffset > 0) {
    if constexpr (kCount > 1) {
      constexpr int kHalf = kCount / 2;
      const bool upper = (lane & kOffset) != 0;
#pragma unroll
      for (int j = 0; j < kHalf; ++j) {
        const float send = upper ? v[j] : v[j + kHalf];
        const float keep = upper ? v[j + kHalf] : v[j];
        v[j] = keep + __shfl_xor_sync(0xffffffffu, send, kOffset);
      }
      if (upper) head += kHalf;
      spread_sum<NG, kHalf, kOffset / 2>(v, lane, head);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], kOffset);
      spread_sum<NG, 1, kOffset / 2>(v, lane, head);
    }
  }
}

// sigmoid of an fp16 gate value, fp32
__device__ __forceinline__ float sigmoid_of(half g) {
  return 1.f / (1.f + __expf(-__half2float(g)));  // 0 when exp overflows
}

__device__ __forceinline__ int context_of(const long long* context_lens, int b, int width,
                                          int log2_block) {
  long long ctx = context_lens[b];
  const long long cap = (long long)width << log2_block;
  ctx = ctx < 0 ? 0 : (ctx > cap ? cap : ctx);
  return (int)ctx;
}

// 8 cached keys or values: through the read-only path, or (COHERENT: the prep form, whose
// blocks write the new token's row in the same launch) from L2 with ld.global.cg, which
// sees a write that the block's barrier ordered before it.
template <bool COHERENT>
__device__ __forceinline__ uint4 load_kv(const half* p) {
  if constexpr (COHERENT) return __ldcg(reinterpret_cast<const uint4*>(p));
  return load8(p);
}

// --- 8 cached elements of a lane, in the cache's encoding KV (onecat::KvFormat) ---------------
template <int KV> struct KvRaw { using type = uint2; };  // 8 one-byte codes
template <> struct KvRaw<onecat::kKvFp16> { using type = uint4; };  // 8 halfs

// the raw 8 elements at element `index` of a cache (COHERENT as load_kv)
template <int KV, bool COHERENT>
__device__ __forceinline__ typename KvRaw<KV>::type load_raw(const void* cache, size_t index) {
  if constexpr (KV == onecat::kKvFp16) {
    return load_kv<COHERENT>(static_cast<const half*>(cache) + index);
  } else {
    const uint2* p = reinterpret_cast<const uint2*>(static_cast<const unsigned char*>(cache) + index);
    if constexpr (COHERENT) return __ldcg(p);
    return __ldg(p);
  }
}

// the scale of cache entry `entry` (= row * KVH + KV head): int8 only, 1 otherwise
template <int KV, bool COHERENT>
__device__ __forceinline__ float load_scale(const float* scales, size_t entry) {
  if constexpr (KV == onecat::kKvInt8) {
    if constexpr (COHERENT) return __ldcg(scales + entry);
    return __ldg(scales + entry);
  } else {
    return 1.f;
  }
}

template <int KV>
__device__ __forceinline__ typename KvRaw<KV>::type zero_raw() {
  if constexpr (KV == onecat::kKvFp16) return make_uint4(0, 0, 0, 0);
  else return make_uint2(0, 0);
}

// the 8 values as fp32
template <int KV>
__device__ __forceinline__ void unpack_kv(const typename KvRaw<KV>::type& raw, float scale, float (&f)[kVec]) {
  if constexpr (KV == onecat::kKvFp16) {
    unpack8(raw, f);
  } else if constexpr (KV == onecat::kKvFp8) {
    const uint2 lo = onecat::fp8_e5m2_decode4(raw.x), hi = onecat::fp8_e5m2_decode4(raw.y);
    unpack8(make_uint4(lo.x, lo.y, hi.x, hi.y), f);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      f[e] = onecat::int8_decode(raw.x, e, scale);
      f[4 + e] = onecat::int8_decode(raw.y, e, scale);
    }
  }
}

// Encodes 8 fp16 features (packed in x) of a head row; for int8 `scale` is the row's.
template <int KV>
__device__ __forceinline__ uint2 encode8(const uint4& x, float scale) {
  const half* h = reinterpret_cast<const half*>(&x);
  unsigned word[2] = {0u, 0u};
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const unsigned code = KV == onecat::kKvInt8 ? onecat::int8_encode(__half2float(h[e]), scale)
                                                : onecat::fp8_e5m2_encode(h[e]);
    word[e / 4] |= code << (8 * (e % 4));
  }
  return make_uint2(word[0], word[1]);
}

// Writes a lane's 8 fp16 features (x, at element index `index` of the row of cache entry
// `entry`) in the cache's encoding; for int8 the L lanes of the row (a token group) first meet
// on the row's amax, and the lane holding features 0..7 (`first`) writes the scale.  Call
// from all 32 lanes (the amax shuffles); `write` says which lanes store.
template <int KV, int L>
__device__ __forceinline__ void store_kv8(void* cache, float* scales, size_t entry, size_t index, const uint4& x,
                                          bool write, bool first) {
  if constexpr (KV == onecat::kKvFp16) {
    if (write) *reinterpret_cast<uint4*>(static_cast<half*>(cache) + index) = x;
  } else {
    float scale = 0.f;
    if constexpr (KV == onecat::kKvInt8) {
      const half* h = reinterpret_cast<const half*>(&x);
      float amax = 0.f;
#pragma unroll
      for (int e = 0; e < kVec; ++e) amax = fmaxf(amax, fabsf(__half2float(h[e])));
#pragma unroll
      for (int offset = 1; offset < L; offset <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      scale = onecat::int8_scale(amax);
      if (write && first) scales[entry] = scale;
    }
    if (write) *reinterpret_cast<uint2*>(static_cast<unsigned char*>(cache) + index) = encode8<KV>(x, scale);
  }
}

// RMSNorm with (1 + w) and partial RoPE of one head held 8 features a lane: lane `part` of a
// group of L lanes (L = D / 8, groups of the warp independent and alike) holds features
// 8*part .. 8*part+7 in `raw`.  Returns them rounded as attention_prep.cu rounds them.  Call
// from all 32 lanes.
template <int L>
__device__ __forceinline__ uint4 norm_rope8(uint4 raw, int part, const float* __restrict__ weight, float eps,
                                            int rotary_dim, const float* rot_cos, const float* rot_sin) {
  constexpr int kD = L * kVec;
  const int lane = threadIdx.x & 31;
  float x[kVec];
  unpack8(raw, x);
  float squares = 0.f;
#pragma unroll
  for (int e = 0; e < kVec; ++e) squares = fmaf(x[e], x[e], squares);
#pragma unroll
  for (int offset = 1; offset < L; offset <<= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
  const float inv_rms = rsqrtf(squares / (float)kD + eps);
  const int half_rot = rotary_dim >> 1;
  const int shift = half_rot / kVec;  // lanes between a feature and its rotation partner
  const int i0 = part * kVec;
  const int partner = i0 < half_rot ? lane + shift : (i0 < rotary_dim ? lane - shift : lane);
  float y[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e)
    y[e] = onecat::norm_feature(x[e], inv_rms, weight[i0 + e]);
  float out[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float other = __shfl_sync(0xffffffffu, y[e], partner & 31);
    const int i = i0 + e;
    if (i < half_rot) {
      out[e] = onecat::rotate_feature(y[e], other, rot_cos[i], rot_sin[i], true);
    } else if (i < rotary_dim) {
      out[e] = onecat::rotate_feature(y[e], other, rot_cos[i - half_rot], rot_sin[i - half_rot], false);
    } else {
      out[e] = y[e];
    }
  }
  return make_uint4(pack2(out[0], out[1]), pack2(out[2], out[3]), pack2(out[4], out[5]), pack2(out[6], out[7]));
}

// tokens per split: ceil(ctx / S) rounded up to whole kChunkTokens (the same rule in both kernels)
__device__ __forceinline__ int chunk_of(int ctx, int num_splits) {
  const int per = (ctx + num_splits - 1) / num_splits;
  return ((per + kChunkTokens - 1) / kChunkTokens) * kChunkTokens;
}

template <int D, int NG, bool PREP, int KV>
__device__ __forceinline__ void split(const half* __restrict__ q, long long q_sb, long long q_sh,
                                      const void* k_cache, const void* v_cache,
                                      const long long* __restrict__ block_tables, int width,
                                      const long long* __restrict__ context_lens,
                                      half* __restrict__ out, float* __restrict__ ws_acc,
                                      float* __restrict__ ws_ml, int num_heads, int num_kv_heads,
                                      int log2_block, int num_splits, float scale_log2,
                                      const half* __restrict__ gate, long long g_sb,
                                      long long g_sh, const long long* __restrict__ positions,
                                      const float* __restrict__ q_weight,
                                      const float* __restrict__ k_weight,
                                      const float* __restrict__ inv_freq, float eps, int rotary_dim,
                                      const long long* __restrict__ slot_mapping,
                                      long long num_slots, const float* k_scale,
                                      const float* v_scale) {
  static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head dim: a multiple of 32 up to 256");
  constexpr int kLanes1 = D / kVec;          // lanes per key row (phase 1)
  constexpr int kTokens1 = 32 / kLanes1;     // tokens per warp step (phase 1)
  constexpr int kKeep = NG > kLanes1 ? NG / kLanes1 : 1;  // head totals per lane (spread_sum)
  constexpr int kWriterMask = kLanes1 / (NG < kLanes1 ? NG : kLanes1) - 1;
  constexpr int kCols = D / kWarps;          // value columns per warp (phase 3)
  constexpr int kLanes3 = kCols / kVec;      // lanes per token's column slice (phase 3)
  constexpr int kTokens3 = 32 / kLanes3;     // tokens per warp step (phase 3)
  __shared__ float scores[NG][kTile];
  __shared__ int rows[kTile];
  __shared__ float m_run[NG], l_run[NG], alpha[NG];

  const int s = blockIdx.x, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = num_heads / num_kv_heads;
  const int head_chunks = (group + NG - 1) / NG;
  const int kvh = blockIdx.y / head_chunks;
  const int first = blockIdx.y % head_chunks * NG;
  const int h0 = kvh * group + first;        // first query head of this block
  const int heads = min(NG, group - first);  // its live query heads

  const int ctx = context_of(context_lens, b, width, log2_block);
  if (ctx == 0) {  // nothing to attend to: a zero output, written once
    if (s == 0)
      for (int i = tid; i < heads * D; i += kThreads)
        out[((size_t)b * num_heads + h0) * D + i] = __float2half(0.f);
    return;
  }
  const int chunk = chunk_of(ctx, num_splits);
  const int begin = s * chunk;
  if (begin >= ctx) return;
  const int end = min(ctx, begin + chunk);
  const bool single = chunk >= ctx;  // this block is the sequence's only split

  // query elements of this lane (phase 1 mapping), pre-scaled; idle head slots are zero
  const int part1 = lane % kLanes1, token1 = lane / kLanes1;
  float qr[NG][kVec];
  // PREP: the queries (roped, fp16) and cos / sin of the new token's angles
  __shared__ __align__(16) half q_prepped[PREP ? NG : 1][PREP ? D : 1];
  __shared__ float rot_cos[PREP ? D / 2 : 1], rot_sin[PREP ? D / 2 : 1];
  const bool has_fresh = PREP && end == ctx;
  const long long* table = block_tables + (size_t)b * width;
  const int block_mask = (1 << log2_block) - 1;
  // 0. cache rows of the tile's tokens from t0
  auto fill_rows = [&](int t0, int n) {
    for (int i = tid; i < n; i += kThreads) {
      const int t = t0 + i;
      rows[i] = (int)(table[t >> log2_block] << log2_block) + (t & block_mask);
    }
  };
  if constexpr (PREP) {
    // Every load first (the rows of the first tile too), then the angles, then the norms: the
    // block's NG query heads and (has_fresh) the key are spread over the warps, items j =
    // warp, warp + kWarps, ... of [key, heads 0..NG-1]; warp 1 also copies the value.
    const half* row = q + b * q_sb;  // the qkv row
    const long long slot = slot_mapping[b];
    const float position = (float)positions[b];
    constexpr int kItems = (NG + 1 + kWarps - 1) / kWarps;
    uint4 raw[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int item = warp + j * kWarps;  // 0: the key, 1 + g: query head g
      raw[j] = make_uint4(0, 0, 0, 0);
      if (item == 0 && has_fresh) raw[j] = load8(row + (2 * num_heads + kvh) * D + part1 * kVec);
      if (item >= 1 && item - 1 < heads) raw[j] = load8(row + (h0 + item - 1) * q_sh + part1 * kVec);
    }
    const uint4 v_raw = has_fresh && warp == 1
                            ? load8(row + (2 * num_heads + num_kv_heads + kvh) * D + part1 * kVec)
                            : make_uint4(0, 0, 0, 0);
    fill_rows(begin, min(kTile, end - begin));
    for (int i = tid; i < (rotary_dim >> 1); i += kThreads) {
      onecat::rope_angle(position, inv_freq[i], rot_cos[i], rot_sin[i]);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int item = warp + j * kWarps;
      if (item == 0 ? !has_fresh : item - 1 >= heads) continue;  // warp-uniform
      const uint4 out8 = norm_rope8<kLanes1>(raw[j], part1, item == 0 ? k_weight : q_weight, eps, rotary_dim,
                                             rot_cos, rot_sin);
      if (item > 0) {
        if (token1 == 0) *reinterpret_cast<uint4*>(&q_prepped[item - 1][part1 * kVec]) = out8;
      } else {  // the new key (all lanes: an int8 row's amax meets by shuffles)
        const size_t entry = (size_t)slot * num_kv_heads + kvh;
        store_kv8<KV, kLanes1>(const_cast<void*>(k_cache), const_cast<float*>(k_scale), entry,
                               entry * D + part1 * kVec, out8, token1 == 0 && slot >= 0 && slot < num_slots,
                               part1 == 0);
      }
    }
    if (has_fresh && warp == 1) {  // the new value (warp-uniform)
      const size_t entry = (size_t)slot * num_kv_heads + kvh;
      store_kv8<KV, kLanes1>(const_cast<void*>(v_cache), const_cast<float*>(v_scale), entry, entry * D + part1 * kVec,
                             v_raw, token1 == 0 && slot >= 0 && slot < num_slots, part1 == 0);
    }
    __syncthreads();  // the new row is in the cache (L2) for this block's coherent loads below
#pragma unroll
    for (int g = 0; g < NG; ++g) {
      float f[kVec];
      unpack8(g < heads ? *reinterpret_cast<const uint4*>(&q_prepped[g][part1 * kVec]) : make_uint4(0, 0, 0, 0), f);
#pragma unroll
      for (int e = 0; e < kVec; ++e) qr[g][e] = f[e] * scale_log2;
    }
  } else {
#pragma unroll
    for (int g = 0; g < NG; ++g) {
      const half* qh = q + b * q_sb + (h0 + g) * q_sh + part1 * kVec;
#pragma unroll
      for (int e = 0; e < kVec; ++e) qr[g][e] = g < heads ? __half2float(qh[e]) * scale_log2 : 0.f;
    }
  }
  if (tid < NG) {
    m_run[tid] = neg_inf();
    l_run[tid] = 0.f;
  }

  const int part3 = lane % kLanes3, token3 = lane / kLanes3;
  const int col = warp * kCols + part3 * kVec;  // first value column of this lane
  float acc[NG][kVec];
#pragma unroll
  for (int g = 0; g < NG; ++g)
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[g][e] = 0.f;

  const size_t row_stride = (size_t)num_kv_heads * D;  // elements per cache row
  const size_t k_head = (size_t)kvh * D + part1 * kVec;  // element offsets in a row
  const size_t v_head = (size_t)kvh * D + col;

  for (int t0 = begin; t0 < end; t0 += kTile) {
    const int n = min(kTile, end - t0);
    if (!PREP || t0 != begin) {  // (the prep form filled the first tile's rows already)
      fill_rows(t0, n);
      __syncthreads();
    }

    // 1. scores of the tile (warp-uniform loop: every lane takes part in the shuffles)
    for (int i0 = warp * kTokens1; i0 < n; i0 += kWarps * kTokens1 * kUnroll) {
      typename KvRaw<KV>::type raw[kUnroll];
      float ks[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kWarps * kTokens1 + token1;
        raw[u] = i < n ? load_raw<KV, PREP>(k_cache, k_head + (size_t)rows[i] * row_stride) : zero_raw<KV>();
        ks[u] = i < n ? load_scale<KV, PREP>(k_scale, (size_t)rows[i] * num_kv_heads + kvh) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kWarps * kTokens1 + token1;
        float kv[kVec];
        unpack_kv<KV>(raw[u], ks[u], kv);
        float dot[NG];
#pragma unroll
        for (int g = 0; g < NG; ++g) {
          dot[g] = 0.f;
#pragma unroll
          for (int e = 0; e < kVec; ++e) dot[g] = fmaf(qr[g][e], kv[e], dot[g]);
        }
        int head = 0;
        spread_sum<NG, NG, kLanes1 / 2>(dot, lane, head);
        if ((lane & kWriterMask) == 0 && i < n) {
#pragma unroll
          for (int j = 0; j < kKeep; ++j) scores[head + j][i] = dot[j];
        }
      }
    }
    __syncthreads();

    // 2. online softmax, one warp per head
    for (int g = warp; g < NG; g += kWarps) {
      float tile_max = neg_inf();
      for (int i = lane; i < n; i += 32) tile_max = fmaxf(tile_max, scores[g][i]);
#pragma unroll
      for (int offset = 16; offset; offset >>= 1)
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
      const float m_old = m_run[g];
      const float m_new = fmaxf(m_old, tile_max);
      float sum = 0.f;
      for (int i = lane; i < n; i += 32) {
        const float p = exp2f(scores[g][i] - m_new);
        scores[g][i] = p;
        sum += p;
      }
#pragma unroll
      for (int offset = 16; offset; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      if (lane == 0) {
        const float a = exp2f(m_old - m_new);  // 0 on the first tile (m_old = -inf)
        alpha[g] = a;
        l_run[g] = l_run[g] * a + sum;
        m_run[g] = m_new;
      }
    }
    __syncthreads();

    // 3. values: rescale the older sums, then add this tile's p_t v_t
#pragma unroll
    for (int g = 0; g < NG; ++g) {
      const float a = alpha[g];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[g][e] *= a;
    }
    for (int i0 = 0; i0 < n; i0 += kTokens3 * kUnroll) {
      typename KvRaw<KV>::type raw[kUnroll];
      float vs[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kTokens3 + token3;
        raw[u] = i < n ? load_raw<KV, PREP>(v_cache, v_head + (size_t)rows[i] * row_stride) : zero_raw<KV>();
        vs[u] = i < n ? load_scale<KV, PREP>(v_scale, (size_t)rows[i] * num_kv_heads + kvh) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kTokens3 + token3;
        if (i < n) {
          float vv[kVec];
          unpack_kv<KV>(raw[u], vs[u], vv);
#pragma unroll
          for (int g = 0; g < NG; ++g) {
            const float p = scores[g][i];
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[g][e] = fmaf(p, vv[e], acc[g][e]);
          }
        }
      }
    }
    __syncthreads();  // rows and scores are rewritten by the next tile
  }

  // lanes of the same columns (different tokens) sum their accumulators
#pragma unroll
  for (int g = 0; g < NG; ++g)
#pragma unroll
    for (int e = 0; e < kVec; ++e)
#pragma unroll
      for (int offset = kLanes3; offset < 32; offset <<= 1)
        acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], offset);
  if (token3 != 0) return;
#pragma unroll
  for (int g = 0; g < NG; ++g) {
    if (g >= heads) break;
    const size_t head = (size_t)b * num_heads + h0 + g;
    if (single) {
      const float inv = __fdividef(1.f, l_run[g]);
      float scale[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) scale[e] = inv;
      if (gate != nullptr) {
        const uint4 raw = load8(gate + b * g_sb + (h0 + g) * g_sh + col);
        const half* gh = reinterpret_cast<const half*>(&raw);
#pragma unroll
        for (int e = 0; e < kVec; ++e) scale[e] *= sigmoid_of(gh[e]);
      }
      *reinterpret_cast<uint4*>(out + head * D + col) = make_uint4(
          pack2(acc[g][0] * scale[0], acc[g][1] * scale[1]), pack2(acc[g][2] * scale[2], acc[g][3] * scale[3]),
          pack2(acc[g][4] * scale[4], acc[g][5] * scale[5]), pack2(acc[g][6] * scale[6], acc[g][7] * scale[7]));
    } else {
      float* dst = ws_acc + (head * num_splits + s) * D + col;
      reinterpret_cast<float4*>(dst)[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      reinterpret_cast<float4*>(dst)[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
      if (warp == 0 && part3 == 0)
        reinterpret_cast<float2*>(ws_ml)[head * num_splits + s] = make_float2(m_run[g], l_run[g]);
    }
  }
}

template <int D>
__device__ __forceinline__ void reduce(const long long* __restrict__ context_lens, int width,
                                       half* __restrict__ out, const float* __restrict__ ws_acc,
                                       const float* __restrict__ ws_ml, int num_heads,
                                       int log2_block, int num_splits,
                                       const half* __restrict__ gate, long long g_sb,
                                       long long g_sh) {
  const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const int ctx = context_of(context_lens, b, width, log2_block);
  if (ctx == 0) return;
  const int chunk = chunk_of(ctx, num_splits);
  const int used = (ctx + chunk - 1) / chunk;
  if (used <= 1) return;  // finished by the split kernel
  const size_t head = (size_t)b * num_heads + h;
  const float2* ml = reinterpret_cast<const float2*>(ws_ml) + head * num_splits;
  float m = neg_inf();
  for (int s = 0; s < used; ++s) m = fmaxf(m, ml[s].x);
  float num = 0.f, den = 0.f;
  for (int s = 0; s < used; ++s) {
    const float2 part = ml[s];
    const float w = exp2f(part.x - m);
    den = fmaf(w, part.y, den);
    num = fmaf(w, ws_acc[(head * num_splits + s) * D + d], num);
  }
  float o = __fdividef(num, den);
  if (gate != nullptr) o *= sigmoid_of(gate[b * g_sb + h * g_sh + d]);
  out[head * D + d] = __float2half(o);
}
}  // namespace onecat_attn

#define ONECAT_SPLIT_PARAMS                                                                  \
  const half *q, long long q_sb, long long q_sh, const void *k_cache, const void *v_cache,   \
      const long long *block_tables, int width, const long long *context_lens, half *out,    \
      float *ws_acc, float *ws_ml, int num_heads, int num_kv_heads, int log2_block,          \
      int num_splits, float scale_log2, const half *gate, long long g_sb, long long g_sh,    \
      const long long *positions, const float *q_weight, const float *k_weight,              \
      const float *inv_freq, float eps, int rotary_dim, const long long *slot_mapping,       \
      long long num_slots, const float *k_scale, const float *v_scale
#define ONECAT_SPLIT_ARGS                                                                    \
  q, q_sb, q_sh, k_cache, v_cache, block_tables, width, context_lens, out, ws_acc, ws_ml,    \
      num_heads, num_kv_heads, log2_block, num_splits, scale_log2, gate, g_sb, g_sh,         \
      positions, q_weight, k_weight, inv_freq, eps, rotary_dim, slot_mapping, num_slots, k_scale, \
      v_scale
#define ONECAT_REDUCE_PARAMS                                                                 \
  const long long *context_lens, int width, half *out, const float *ws_acc,                 \
      const float *ws_ml, int num_heads, int log2_block, int num_splits, const half *gate,      \
      long long g_sb, long long g_sh
#define ONECAT_REDUCE_ARGS                                                                   \
  context_lens, width, out, ws_acc, ws_ml, num_heads, log2_block, num_splits, gate, g_sb, g_sh

// One line per kernel (build.kernel_names reads these names): split (and split_prep) for head
// dim D and NG query heads per block over an fp16 cache, reduce for head dim D; then
// ONECAT_PA_SPLIT lines: the same over 8-bit caches (fp8_e5m2, int8) at head dims 128 and 256
// (attention.QUANTIZED_HEAD_DIMS).
#define ONECAT_PA_SPLIT(NAME, D, NG, PREP, KV)                                              \
  extern "C" __global__ void __launch_bounds__(128, 1) NAME(ONECAT_SPLIT_PARAMS) {          \
    onecat_attn::split<D, NG, PREP, KV>(ONECAT_SPLIT_ARGS);                                  \
  }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d32_g1(ONECAT_SPLIT_PARAMS) { onecat_attn::split<32, 1, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d32_g2(ONECAT_SPLIT_PARAMS) { onecat_attn::split<32, 2, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d32_g4(ONECAT_SPLIT_PARAMS) { onecat_attn::split<32, 4, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d32_g8(ONECAT_SPLIT_PARAMS) { onecat_attn::split<32, 8, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d64_g1(ONECAT_SPLIT_PARAMS) { onecat_attn::split<64, 1, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d64_g2(ONECAT_SPLIT_PARAMS) { onecat_attn::split<64, 2, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d64_g4(ONECAT_SPLIT_PARAMS) { onecat_attn::split<64, 4, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d64_g8(ONECAT_SPLIT_PARAMS) { onecat_attn::split<64, 8, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d128_g1(ONECAT_SPLIT_PARAMS) { onecat_attn::split<128, 1, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d128_g2(ONECAT_SPLIT_PARAMS) { onecat_attn::split<128, 2, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d128_g4(ONECAT_SPLIT_PARAMS) { onecat_attn::split<128, 4, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d128_g8(ONECAT_SPLIT_PARAMS) { onecat_attn::split<128, 8, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d256_g1(ONECAT_SPLIT_PARAMS) { onecat_attn::split<256, 1, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d256_g2(ONECAT_SPLIT_PARAMS) { onecat_attn::split<256, 2, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d256_g4(ONECAT_SPLIT_PARAMS) { onecat_attn::split<256, 4, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_d256_g8(ONECAT_SPLIT_PARAMS) { onecat_attn::split<256, 8, false, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d32_g1(ONECAT_SPLIT_PARAMS) { onecat_attn::split<32, 1, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d32_g2(ONECAT_SPLIT_PARAMS) { onecat_attn::split<32, 2, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d32_g4(ONECAT_SPLIT_PARAMS) { onecat_attn::split<32, 4, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d32_g8(ONECAT_SPLIT_PARAMS) { onecat_attn::split<32, 8, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d64_g1(ONECAT_SPLIT_PARAMS) { onecat_attn::split<64, 1, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d64_g2(ONECAT_SPLIT_PARAMS) { onecat_attn::split<64, 2, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d64_g4(ONECAT_SPLIT_PARAMS) { onecat_attn::split<64, 4, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d64_g8(ONECAT_SPLIT_PARAMS) { onecat_attn::split<64, 8, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d128_g1(ONECAT_SPLIT_PARAMS) { onecat_attn::split<128, 1, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d128_g2(ONECAT_SPLIT_PARAMS) { onecat_attn::split<128, 2, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d128_g4(ONECAT_SPLIT_PARAMS) { onecat_attn::split<128, 4, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d128_g8(ONECAT_SPLIT_PARAMS) { onecat_attn::split<128, 8, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d256_g1(ONECAT_SPLIT_PARAMS) { onecat_attn::split<256, 1, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d256_g2(ONECAT_SPLIT_PARAMS) { onecat_attn::split<256, 2, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d256_g4(ONECAT_SPLIT_PARAMS) { onecat_attn::split<256, 4, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention_split_prep_d256_g8(ONECAT_SPLIT_PARAMS) { onecat_attn::split<256, 8, true, onecat::kKvFp16>(ONECAT_SPLIT_ARGS); }
extern "C" __global__ void __launch_bounds__(256)
paged_attention_reduce_d32(ONECAT_REDUCE_PARAMS) { onecat_attn::reduce<32>(ONECAT_REDUCE_ARGS); }
extern "C" __global__ void __launch_bounds__(256)
paged_attention_reduce_d64(ONECAT_REDUCE_PARAMS) { onecat_attn::reduce<64>(ONECAT_REDUCE_ARGS); }
extern "C" __global__ void __launch_bounds__(256)
paged_attention_reduce_d128(ONECAT_REDUCE_PARAMS) { onecat_attn::reduce<128>(ONECAT_REDUCE_ARGS); }
extern "C" __global__ void __launch_bounds__(256)
paged_attention_reduce_d256(ONECAT_REDUCE_PARAMS) { onecat_attn::reduce<256>(ONECAT_REDUCE_ARGS); }
ONECAT_PA_SPLIT(paged_attention_split_fp8_d128_g1, 128, 1, false, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_fp8_d128_g2, 128, 2, false, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_fp8_d128_g4, 128, 4, false, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_fp8_d128_g8, 128, 8, false, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_fp8_d256_g1, 256, 1, false, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_fp8_d256_g2, 256, 2, false, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_fp8_d256_g4, 256, 4, false, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_fp8_d256_g8, 256, 8, false, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_prep_fp8_d128_g1, 128, 1, true, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_prep_fp8_d128_g2, 128, 2, true, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_prep_fp8_d128_g4, 128, 4, true, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_prep_fp8_d128_g8, 128, 8, true, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_prep_fp8_d256_g1, 256, 1, true, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_prep_fp8_d256_g2, 256, 2, true, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_prep_fp8_d256_g4, 256, 4, true, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_prep_fp8_d256_g8, 256, 8, true, onecat::kKvFp8)
ONECAT_PA_SPLIT(paged_attention_split_int8_d128_g1, 128, 1, false, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_int8_d128_g2, 128, 2, false, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_int8_d128_g4, 128, 4, false, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_int8_d128_g8, 128, 8, false, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_int8_d256_g1, 256, 1, false, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_int8_d256_g2, 256, 2, false, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_int8_d256_g4, 256, 4, false, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_int8_d256_g8, 256, 8, false, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_prep_int8_d128_g1, 128, 1, true, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_prep_int8_d128_g2, 128, 2, true, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_prep_int8_d128_g4, 128, 4, true, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_prep_int8_d128_g8, 128, 8, true, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_prep_int8_d256_g1, 256, 1, true, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_prep_int8_d256_g2, 256, 2, true, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_prep_int8_d256_g4, 256, 4, true, onecat::kKvInt8)
ONECAT_PA_SPLIT(paged_attention_split_prep_int8_d256_g8, 256, 8, true, onecat::kKvInt8)
