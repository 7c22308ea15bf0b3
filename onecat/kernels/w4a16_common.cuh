// Shared pieces of onecat's sm_70 W4A16 kernels: the packed layout, the in-register dequant
// and the split-K finish; also the 8-half vector helpers of the norm, router and all-reduce
// kernels, and the attention inputs' norm / RoPE roundings (attention_prep.cu and the decode
// attention's prep form in paged_attention.cu).  Compiled by NVRTC 12 for compute_70 / sm_70; no torch headers.
//
// Packed layout (version 1, docs/FORMAT.md, onecat/pack/volta_layout.py), W [N out, K in]:
//   qweight      u32   [N/32][K/32][32 lanes][4 words]   one 32x32 tile = 512 contiguous bytes
//   scales_zeros half2 [N/32][K/g][32 lanes]             (s, fp16(-z*s)) per column and group
// Lane l of a tile owns output column 8*((l%16)/4) + (l%4) + 4*(l>=16) (the m8n8k4 B .col
// rule), so ONE 128-bit load per lane reads a whole 32x32 tile and lane l holds the 32 k
// values of its column.  Word w holds k = 8w..8w+7; nibble j holds k offset
// [0,2,4,6,1,3,5,7][j], so masking nibbles j and j+4 (bits 4j and 16+4j) gives the fp16 pair
// (k 2j, k 2j+1) in k order.
//
// Dequant contract (the CPU reference reproduces it bit for bit):
//   w = fma.rn.f16x2(q, s, nzs)   with nzs = fp16(-z*s): one rounding per weight.
#pragma once
#include <cuda_fp16.h>

namespace onecat {

constexpr int kTile = 32;  // columns per column tile, and k values per k tile

// Output column (0..31 inside its tile) owned by lane l: the layout's lane -> column rule.
__device__ __forceinline__ int lane_column(int l) {
  return 8 * ((l & 15) >> 2) + (l & 3) + ((l >> 4) << 2);
}

// Weights are read exactly once: load them past L1 (sm_70 has .L1::no_allocate).
__device__ __forceinline__ uint4 load_weights_streaming(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// (a & b) | c in one lop3 instruction (immLut 0xEA = (0xF0 & 0xCC) | 0xAA).
__device__ __forceinline__ unsigned and_or(unsigned a, unsigned b, unsigned c) {
  unsigned r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

__device__ __forceinline__ half2 as_half2(unsigned u) {
  return *reinterpret_cast<half2*>(&u);
}

// --- 8 fp16 values in a uint4 (residual adds, RMSNorms, all-reduce sums) --------------------

// The 8 values of v in fp32.
__device__ __forceinline__ void unpack(uint4 v, float (&out)[8]) {
  const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __half22float2(as_half2(words[j]));
    out[2 * j] = f.x;
    out[2 * j + 1] = f.y;
  }
}

// acc[i] += value i of v, in fp32.
__device__ __forceinline__ void accumulate(float (&acc)[8], uint4 v) {
  float f[8];
  unpack(v, f);
#pragma unroll
  for (int k = 0; k < 8; ++k) acc[k] += f[k];
}

// The 8 values rounded to fp16 (to nearest) and packed.
__device__ __forceinline__ uint4 round_to_half(const float (&v)[8]) {
  unsigned words[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const half2 h = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
    words[j] = *reinterpret_cast<const unsigned*>(&h);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// fp16(a + b) of 8 values each: fp32 sums, one rounding (torch's fp16 add).
__device__ __forceinline__ uint4 add_rounded(uint4 a, uint4 b) {
  float sum[8], fb[8];
  unpack(a, sum);
  unpack(b, fb);
#pragma unroll
  for (int k = 0; k < 8; ++k) sum[k] += fb[k];
  return round_to_half(sum);
}

// Qwen3.5's (1 + w) RMSNorm of 8 values r of a row whose rstd is known:
// fp16(r * rstd * (1 + w)), (w0, w1) the norm's fp32 weights of those 8 columns.
__device__ __forceinline__ uint4 rms_scale(const float (&r)[8], float rstd, float4 w0, float4 w1) {
  const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
  float y[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) y[k] = r[k] * rstd * (1.f + w[k]);
  return round_to_half(y);
}

// --- gated attention's inputs: per-head RMSNorm (1 + w), then partial RoPE ------------------
// The roundings of the torch reference (runtime.models.qwen3_5.attention_inputs), in one
// place for both kernels that prepare queries and keys.

// cos and sin of the fp32 angle fp32(position) * inv_freq, evaluated in double (sincospi: an
// exact range reduction, no Payne-Hanek stack frame for angles past 1e5), rounded to fp32.
__device__ __forceinline__ void rope_angle(float position, float inv_freq, float& cos_out, float& sin_out) {
  constexpr double kInvPi = 0.318309886183790671537767526745;
  const float angle = __fmul_rn(position, inv_freq);
  double s, c;  // in half turns
  sincospi((double)angle * kInvPi, &s, &c);
  cos_out = (float)c;
  sin_out = (float)s;
}

// One normed feature as the activations hold it: fp16(x * inv_rms * (1 + w)), back in fp32.
__device__ __forceinline__ float norm_feature(float x, float inv_rms, float w) {
  return __half2float(__float2half_rn(__fmul_rn(__fmul_rn(x, inv_rms), 1.f + w)));
}

// One rotated feature (rotate-half): y cos - partner sin in the first half of the rotary
// features, y cos + partner sin in the second; products and sums rounded one by one (no fused
// multiply-add), as torch computes them elementwise.
__device__ __forceinline__ float rotate_feature(float y, float partner, float c, float s, bool first_half) {
  return first_half ? __fsub_rn(__fmul_rn(y, c), __fmul_rn(partner, s)) : __fadd_rn(__fmul_rn(y, c), __fmul_rn(partner, s));
}

// --- KV-cache encodings (--kv-cache-dtype; onecat/kernels/kv_cache.py is the contract) -------
// fp16 stores the value; fp8_e5m2 the top byte of its fp16 bit pattern; int8 a code per value
// and one fp32 scale per (token, KV head) beside the codes.  Writers: attention_prep.cu and the
// decode kernel's prep form; readers: paged_attention.cu and flash_prefill.cu (a template
// parameter KV, so an fp16 cache compiles to exactly the code it had).
enum KvFormat : int { kKvFp16 = 0, kKvFp8 = 1, kKvInt8 = 2 };

// fp8_e5m2 code of an fp16 value: the bit pattern rounded to nearest even at bit 8 (the bias
// 0x7f plus the kept lowest bit added to the dropped byte), its top byte; overflow and
// infinities saturate to the largest finite code 0x7b (57344), NaN stays NaN (0x7f).
__device__ __forceinline__ unsigned fp8_e5m2_encode(half x) {
  const unsigned bits = __half_as_ushort(x);
  const unsigned magnitude = bits & 0x7fffu;
  unsigned code = (magnitude + 0x7fu + ((magnitude >> 8) & 1u)) >> 8;
  if (code > 0x7bu) code = 0x7bu;
  if (magnitude > 0x7c00u) code = 0x7fu;
  return ((bits & 0x8000u) >> 8) | code;
}

// Four fp8_e5m2 codes (the bytes of w, lowest first) -> four fp16 (two packed pairs, lowest
// first): each code becomes the high byte of its half.  __byte_perm(0, w, s) picks result byte
// i by selector nibble i: 0 is a zero byte of the first operand, 4..7 are w's bytes 0..3.
__device__ __forceinline__ uint2 fp8_e5m2_decode4(unsigned w) {
  return make_uint2(__byte_perm(0u, w, 0x5040u), __byte_perm(0u, w, 0x7060u));
}

// int8: the scale of a head row with largest magnitude amax (fp32 division, as torch)
__device__ __forceinline__ float int8_scale(float amax) { return amax / 127.f; }

// int8 code of x: clamp(rne(x / s), -127, 127), 0 where s is not positive (an all-zero row)
__device__ __forceinline__ unsigned int8_encode(float x, float scale) {
  if (!(scale > 0.f)) return 0u;
  const int q = max(-127, min(127, __float2int_rn(x / scale)));
  return static_cast<unsigned>(q) & 0xffu;
}

// Byte e (0..3) of w as a signed int8 code, times the scale (fp32)
__device__ __forceinline__ float int8_decode(unsigned w, int e, float scale) {
  return static_cast<float>(static_cast<signed char>((w >> (8 * e)) & 0xffu)) * scale;
}

// One packed word (8 nibbles) -> 4 fp16 pairs (k0,k1) (k2,k3) (k4,k5) (k6,k7), dequantised.
// Magic-number trick: OR-ing a nibble into the mantissa of the fp16 1024 (0x6400) gives
// exactly 1024 + q (nibble at bits 0-3) or 1024 + 16q (nibble at bits 4-7), so
// q = h - 1024 or q = h/16 - 64, both exact.  Masks 0x000F000F and 0x00F000F0 pick nibbles
// j and j+4 of the low or high byte pair without a shift; one shift by 8 serves the other two
// pairs.  Then one fma.rn.f16x2 per pair applies the contract w = fp16(q*s + nzs).
__device__ __forceinline__ void dequant_word(unsigned word, half2 s2, half2 nzs2, half2 out[4]) {
  const unsigned kMagic = 0x64006400u;  // fp16 1024.0 in both halves
  const half2 k1024 = as_half2(kMagic);
  const half2 k16th = as_half2(0x2C002C00u);   // 1/16
  const half2 kMinus64 = as_half2(0xD400D400u);  // -64
  const unsigned hi = word >> 8;
  const half2 q0 = __hsub2(as_half2(and_or(word, 0x000F000Fu, kMagic)), k1024);
  const half2 q1 = __hfma2(as_half2(and_or(word, 0x00F000F0u, kMagic)), k16th, kMinus64);
  const half2 q2 = __hsub2(as_half2(and_or(hi, 0x000F000Fu, kMagic)), k1024);
  const half2 q3 = __hfma2(as_half2(and_or(hi, 0x00F000F0u, kMagic)), k16th, kMinus64);
  out[0] = __hfma2(q0, s2, nzs2);
  out[1] = __hfma2(q1, s2, nzs2);
  out[2] = __hfma2(q2, s2, nzs2);
  out[3] = __hfma2(q3, s2, nzs2);
}

// A whole lane fragment (one uint4 = 32 k of one column) -> 16 dequantised fp16 pairs.
__device__ __forceinline__ void dequant_tile(uint4 v, half2 sz, half2 out[16]) {
  const half2 s2 = __half2half2(__low2half(sz));
  const half2 nzs2 = __half2half2(__high2half(sz));
  dequant_word(v.x, s2, nzs2, out + 0);
  dequant_word(v.y, s2, nzs2, out + 4);
  dequant_word(v.z, s2, nzs2, out + 8);
  dequant_word(v.w, s2, nzs2, out + 12);
}

// n / d for 0 <= n with n * d < 2^32 (tile counts) by one multiply-high instead of an integer
// division: magic = ceil(2^32 / d), exact in that range; d = 1 is kept as magic 0.
struct SmallDivisor {
  unsigned magic;
  __device__ __forceinline__ explicit SmallDivisor(int d) : magic(d > 1 ? 0xFFFFFFFFu / (unsigned)d + 1u : 0u) {}
  __device__ __forceinline__ int div(int n) const { return magic ? (int)__umulhi((unsigned)n, magic) : n; }
};

// Walks the (s, nzs) pairs of one lane along k tiles in increasing order without an integer
// division per tile: `next()` returns the pair of the current k tile and advances.
struct ScaleCursor {
  const half2* p;    // current group's pair for this lane
  int rem;           // k tiles already used from the current group
  int tiles_per_group;

  // Start at k tile `kt` of a column tile whose pairs (for this lane) begin at `base`.
  __device__ __forceinline__ ScaleCursor(const half2* base, int kt, int tiles_per_group_)
      : tiles_per_group(tiles_per_group_) {
    const int group = kt / tiles_per_group;
    p = base + (size_t)group * 32;
    rem = kt - group * tiles_per_group;
  }
  __device__ __forceinline__ half2 next() {
    const half2 v = __ldg(p);
    if (++rem == tiles_per_group) {
      rem = 0;
      p += 32;
    }
    return v;
  }
};

// This lane's CT k tiles (the first `valid` of them), dequantised, as 32*CT consecutive k of
// column lane_column(lane) of the fp16 col-major B matrix at `sB` (row stride `ld` halves),
// with 128-bit stores: the fp16-staging kernels' B operand.
template <int CT>
__device__ __forceinline__ void store_dequantised_column(half* sB, int ld, int lane, const uint4 (&wv)[CT],
                                                         const half2 (&sz)[CT], int valid) {
  half* row = sB + lane_column(lane) * ld;
#pragma unroll
  for (int u = 0; u < CT; ++u) {
    if (u < valid) {
      half2 w[16];
      dequant_tile(wv[u], sz[u], w);
      uint4* dst = reinterpret_cast<uint4*>(row + u * kTile);
#pragma unroll
      for (int q = 0; q < 4; ++q) dst[q] = *reinterpret_cast<uint4*>(w + 4 * q);
    }
  }
}

// Split-K sums in ONE 64-bit word per output, so that the last contributor learns it is last
// from the same atomic that adds its partial sum: no fence, no arrival counter, no read-back.
// Word = count << 56 | sum of (round(partial * 2^24) + 2^47): each contributor adds its fp32
// partial as a 2^-24 fixed-point integer (partials saturate at +-2^23, 128 x fp16's largest
// number; NaN counts as +2^23) biased to be non-negative, and 1 to the count; 255
// contributors at most (the GEMV's plans ensure it: variants.SPLIT_MAX_ARRIVALS; the MoE
// down's splits stay far below: moe.MAX_DOWN_SPLITS) keep the
// biased sum below 2^56.  The integer sum is exact, so the result does not depend on the
// order of arrival.  The last contributor gets the total (fp32) and zeroes the word again for
// the next launch (`words` start zeroed).
constexpr int kSplitCountShift = 56;
constexpr float kSplitScale = 16777216.0f;                      // 2^24
constexpr float kSplitLimit = 140737479966720.0f;               // 2^47 - 2^23 (exact in fp32)
constexpr long long kSplitBias = 1ll << 47;

// Adds `partial` to `word`; returns the word as this atomic left it.  Issue all of a thread's
// adds before looking at their results (split_sum_total), so that the round trips overlap.
__device__ __forceinline__ unsigned long long split_sum_add(unsigned long long* word, float partial) {
  // A NaN partial sums as the largest one, so that the output overflows (fp16 inf) rather
  // than looking finite.
  const float product = partial * kSplitScale;
  const float scaled = product != product ? kSplitLimit : fminf(fmaxf(product, -kSplitLimit), kSplitLimit);
  const unsigned long long add =
      (1ull << kSplitCountShift) + static_cast<unsigned long long>(__float2ll_rn(scaled) + kSplitBias);
  return atomicAdd(word, add) + add;
}

// Whether the add that returned `now` was the last of `arrivals`; then `total` is the sum and
// `word` is zeroed again.
__device__ __forceinline__ bool split_sum_total(unsigned long long now, int arrivals, unsigned long long* word,
                                                float& total) {
  if (static_cast<int>(now >> kSplitCountShift) != arrivals) return false;
  const long long biased = static_cast<long long>(now & ((1ull << kSplitCountShift) - 1));
  total = __ll2float_rn(biased - arrivals * kSplitBias) * (1.0f / kSplitScale);
  *word = 0ull;
  return true;
}

// Split-K finish, called by every thread of a block after its partial sums were written to
// global memory (atomicAdd into a workspace, or plain stores into its own slice).  The last
// block to arrive for `counter` (a zeroed int per output tile) returns true and may then read
// the complete sums (with ld.global.cg: the other blocks' writes live in L2, never in this
// SM's L1).  Classic threadfence reduction.
__device__ __forceinline__ bool arrive_last(int* counter, int arrivals) {
  __shared__ int is_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = (atomicAdd(counter, 1) == arrivals - 1);
  __syncthreads();
  if (is_last) {
    __threadfence();
    if (threadIdx.x == 0) *counter = 0;  // leave the counter zeroed for the next launch
  }
  return is_last != 0;
}

// SwiGLU of one output column pair as torch computes ``silu(gate) * up`` on fp16 tensors:
// silu in fp32 rounded to fp16, then the product rounded to fp16 (the epilogues of the
// ``silu_mul`` launches write this instead of the gate and up columns).
__device__ __forceinline__ half silu_mul(half gate, half up) {
  const float g = __half2float(gate);
  const half silu = __float2half_rn(g / (1.0f + expf(-g)));
  return __float2half_rn(__half2float(silu) * __half2float(up));
}

// A row tile of the MoE align kernel's meta (w4a16_moe_wmma.cu: expert_start [E+1] |
// tile_start [E+1] | sorted_pairs [P]): the expert `e` whose tiles hold `tile_index` and the
// sorted positions r0 .. r0+rows-1 (rows <= rows_per_tile) of its rows.  False for a tile
// past tile_start[E] (the grids are sized by a bound on the tile count).
struct RowTile {
  int e, r0, rows;
};
// The largest e with tile_start[e] <= tile_index (experts without pairs have empty ranges) is
// found by the whole warp at once: each round the 32 lanes load 32 evenly spaced candidates
// of the remaining range and a ballot keeps the last one not past tile_index, so E = 257
// takes 2 rounds of loads instead of a binary search's 9 dependent ones, which every block
// would wait for before its first weight load.  Call with all 32 lanes of the warp.
__device__ __forceinline__ bool find_row_tile(const int* __restrict__ meta, int E, int rows_per_tile,
                                              int tile_index, RowTile& rt) {
  const int* expert_start = meta;
  const int* tile_start = meta + E + 1;
  const int lane = threadIdx.x & 31;
  const int total = __ldg(tile_start + E);  // in flight with the first round
  int lo = 0, n = E, first_tile = 0;        // candidates lo .. lo+n-1, tile_start[lo] = first_tile
  while (n > 1) {
    const int stride = (n + 31) / 32;
    const int at = lane * stride;
    const int value = at < n ? __ldg(tile_start + lo + at) : 0x7fffffff;
    // tile_start is non-decreasing and tile_start[lo] <= tile_index: a non-empty prefix of lanes
    const unsigned fits = __ballot_sync(0xffffffffu, value <= tile_index);
    const int last = 31 - __clz(fits);
    first_tile = __shfl_sync(0xffffffffu, value, last);
    lo += last * stride;
    n = min(stride, n - last * stride);
  }
  if (tile_index >= total) return false;
  rt.e = lo;
  rt.r0 = __ldg(expert_start + lo) + (tile_index - first_tile) * rows_per_tile;
  rt.rows = min(rows_per_tile, __ldg(expert_start + lo + 1) - rt.r0);
  return true;
}

// wmma through inline PTX (wmma.load / wmma.mma / wmma.store on shared memory), so NVRTC
// needs only cuda_fp16.h, not the crt/ headers behind mma.h.  A and B fragments are 8 u32
// (fp16 pairs), accumulators 8 floats; A row-major, B col-major, C/D row-major fp32.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

struct FragAB { unsigned r[8]; };
struct FragC { float r[8]; };

#define ONECAT_WMMA_FUNCS(SHAPE)                                                               \
  __device__ __forceinline__ void load_a_##SHAPE(FragAB& f, const half* p, int ld) {            \
    asm volatile("wmma.load.a.sync.aligned.row." #SHAPE ".shared.f16 "                          \
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"                                         \
                 : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3]), "=r"(f.r[4]),        \
                   "=r"(f.r[5]), "=r"(f.r[6]), "=r"(f.r[7])                                     \
                 : "r"(smem_addr(p)), "r"(ld));                                                 \
  }                                                                                             \
  __device__ __forceinline__ void load_b_##SHAPE(FragAB& f, const half* p, int ld) {            \
    asm volatile("wmma.load.b.sync.aligned.col." #SHAPE ".shared.f16 "                          \
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"                                         \
                 : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3]), "=r"(f.r[4]),        \
                   "=r"(f.r[5]), "=r"(f.r[6]), "=r"(f.r[7])                                     \
                 : "r"(smem_addr(p)), "r"(ld));                                                 \
  }                                                                                             \
  __device__ __forceinline__ void mma_##SHAPE(FragC& d, const FragAB& a, const FragAB& b) {     \
    asm volatile("wmma.mma.sync.aligned.row.col." #SHAPE ".f32.f32 "                            \
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11,%12,%13,%14,%15}, "                 \
                 "{%16,%17,%18,%19,%20,%21,%22,%23}, {%0,%1,%2,%3,%4,%5,%6,%7};"                \
                 : "+f"(d.r[0]), "+f"(d.r[1]), "+f"(d.r[2]), "+f"(d.r[3]), "+f"(d.r[4]),        \
                   "+f"(d.r[5]), "+f"(d.r[6]), "+f"(d.r[7])                                     \
                 : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(a.r[4]),             \
                   "r"(a.r[5]), "r"(a.r[6]), "r"(a.r[7]), "r"(b.r[0]), "r"(b.r[1]),             \
                   "r"(b.r[2]), "r"(b.r[3]), "r"(b.r[4]), "r"(b.r[5]), "r"(b.r[6]),             \
                   "r"(b.r[7]));                                                                \
  }                                                                                             \
  __device__ __forceinline__ void store_c_##SHAPE(float* p, const FragC& c, int ld) {           \
    asm volatile("wmma.store.d.sync.aligned.row." #SHAPE ".shared.f32 "                         \
                 "[%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"                                         \
                 :                                                                              \
                 : "r"(smem_addr(p)), "f"(c.r[0]), "f"(c.r[1]), "f"(c.r[2]), "f"(c.r[3]),       \
                   "f"(c.r[4]), "f"(c.r[5]), "f"(c.r[6]), "f"(c.r[7]), "r"(ld)                  \
                 : "memory");                                                                   \
  }

ONECAT_WMMA_FUNCS(m16n16k16)
ONECAT_WMMA_FUNCS(m8n32k16)

// --- Dequantisation on packed wmma fragments (register-dequant kernels) -------------------
// See w4a16_wmma.cu ("Register-dequant variant") for the scheme.  In short: 64 k of a column
// (its lane's two uint4 of tiles t = 0, 1) are stored unchanged as one 16-element column of a
// packed matrix; element kk = 8t + 2v + h is half h of word v of tile t and holds in nibble j
// (j = 0..3) the weight at k = 32t + 8v + 2j + h.  wmma.load.b of that matrix puts packed
// elements in fragment slots whose positions are unknown; everything done on them below is
// slot-wise, so it holds whatever the GPU's fragment layout.

template <int V>
struct IntConst { static constexpr int value = V; };

constexpr int kPackedLd = 24;  // row stride (halves) of packed columns and of permuted A steps

// Nibble J (0..3) of both 16-bit elements of `r` as an fp16 pair, then fma(q, s, nzs): the
// dequant contract applied to two slots of a packed fragment.
template <int J>
__device__ __forceinline__ unsigned dequant_slots(unsigned r, unsigned s2, unsigned nzs2) {
  const unsigned kMagic = 0x64006400u;
  const unsigned v = (J >= 2) ? (r >> 8) : r;
  half2 q;
  if constexpr ((J & 1) == 0) {
    q = __hsub2(as_half2(and_or(v, 0x000F000Fu, kMagic)), as_half2(kMagic));
  } else {
    q = __hfma2(as_half2(and_or(v, 0x00F000F0u, kMagic)), as_half2(0x2C002C00u), as_half2(0xD400D400u));
  }
  const half2 w = __hfma2(q, as_half2(s2), as_half2(nzs2));
  return *reinterpret_cast<const unsigned*>(&w);
}

// Eight activations x[m][k0 .. k0+7] (k0 = c8, a multiple of 8 inside a chunk of 64-k
// sub-chunks) into the permuted A steps: step (sub*4 + j) is a [rows][kPackedLd] matrix and
// holds at element kk the value of k = 32t + 8v + 2j + h.
__device__ __forceinline__ void stage_a_permuted(half* sA, int rows, int row, int c8, uint4 x8) {
  const int sub = c8 >> 6, t = (c8 >> 5) & 1, v = (c8 >> 3) & 3;
  const unsigned words[4] = {x8.x, x8.y, x8.z, x8.w};
#pragma unroll
  for (int j = 0; j < 4; ++j)  // values 2j, 2j+1 -> step j, elements kk = 8t + 2v + {0, 1}
    *reinterpret_cast<unsigned*>(sA + ((sub * 4 + j) * rows + row) * kPackedLd + 8 * t + 2 * v) = words[j];
}

// This lane's two packed uint4 of a 64-k sub-chunk as column lane_column(lane) of the packed
// matrix at `sP` ([32 columns][kPackedLd] halves).
__device__ __forceinline__ void store_packed_column(half* sP, int lane, uint4 tile0, uint4 tile1) {
  uint4* dst = reinterpret_cast<uint4*>(sP + lane_column(lane) * kPackedLd);
  dst[0] = tile0;
  dst[1] = tile1;
}

// Lane ids into the packed matrix at `sP` (each lane fills its column): a fragment loaded from
// it tells, per slot, which lane owns the slot's column.
__device__ __forceinline__ void store_lane_ids(half* sP, int lane) {
  const unsigned id2 = (unsigned)lane | ((unsigned)lane << 16);
  store_packed_column(sP, lane, make_uint4(id2, id2, id2, id2), make_uint4(id2, id2, id2, id2));
}

// Per slot pair of NF fragments: (s, s) and (nzs, nzs) of the slots' columns, gathered by
// shuffles from the owning lanes' (s, nzs) pairs `mine`.  Call from the whole warp.
template <int NF>
__device__ __forceinline__ void slot_scales(const FragAB (&owner)[NF], half2 mine, FragAB (&s2)[NF],
                                            FragAB (&nzs2)[NF]) {
  const unsigned m = *reinterpret_cast<const unsigned*>(&mine);
#pragma unroll
  for (int f = 0; f < NF; ++f)
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const unsigned lo = __shfl_sync(0xffffffffu, m, owner[f].r[r] & 0xFFFFu);
      const unsigned hi = __shfl_sync(0xffffffffu, m, owner[f].r[r] >> 16);
      s2[f].r[r] = __byte_perm(lo, hi, 0x5410);    // (s of the low slot, s of the high slot)
      nzs2[f].r[r] = __byte_perm(lo, hi, 0x7632);  // (nzs of the low slot, nzs of the high slot)
    }
}

// The NF B fragments of a warp's 32 columns from the packed matrix at `sP`: one m8n32k16
// fragment (M8), else two m16n16k16 fragments (columns 0-15, 16-31).
template <bool M8, int NF>
__device__ __forceinline__ void load_packed_b(FragAB (&f)[NF], const half* sP) {
#pragma unroll
  for (int i = 0; i < NF; ++i) {
    if constexpr (M8) load_b_m8n32k16(f[i], sP, kPackedLd);
    else load_b_m16n16k16(f[i], sP + i * 16 * kPackedLd, kPackedLd);
  }
}

// The four k-steps of one packed 64-k sub-chunk: step J's B fragments dequantised slot-wise
// from `packed`, its A fragments from the permuted step matrix sA + J * rows * kPackedLd
// (MF of 16 rows, or one of 8 rows with M8), accumulated into acc.
template <bool M8, int MF, int NF>
__device__ __forceinline__ void mma_packed_steps(const FragAB (&packed)[NF], const FragAB (&s2)[NF],
                                                 const FragAB (&nzs2)[NF], const half* sA, int rows,
                                                 FragC (&acc)[MF][NF]) {
  auto step = [&](auto j_const) {
    constexpr int J = decltype(j_const)::value;
    FragAB b[NF];
#pragma unroll
    for (int f = 0; f < NF; ++f)
#pragma unroll
      for (int r = 0; r < 8; ++r) b[f].r[r] = dequant_slots<J>(packed[f].r[r], s2[f].r[r], nzs2[f].r[r]);
    const half* a_step = sA + J * rows * kPackedLd;
    if constexpr (M8) {
      FragAB a;
      load_a_m8n32k16(a, a_step, kPackedLd);
      mma_m8n32k16(acc[0][0], a, b[0]);
    } else {
#pragma unroll
      for (int i = 0; i < MF; ++i) {
        FragAB a;
        load_a_m16n16k16(a, a_step + i * 16 * kPackedLd, kPackedLd);
#pragma unroll
        for (int f = 0; f < NF; ++f) mma_m16n16k16(acc[i][f], a, b[f]);
      }
    }
  };
  step(IntConst<0>{});
  step(IntConst<1>{});
  step(IntConst<2>{});
  step(IntConst<3>{});
}

}  // namespace onecat
