// Flash-attention PREFILL for sm_70: the causal attention of every prompt chunk of a step in
// one launch (ragged: each sequence has its own chunk length and number of cached tokens),
// keys and values read in place from one layer's paged KV cache through the block table, so a
// prefix-cache hit or a later chunk of a long prompt needs no gather.  Compiled by NVRTC 12 for
// compute_70 / sm_70.  Tensor cores through wmma m16n16k16 (inline PTX, fp16 operands, fp32
// accumulation), which is native on Volta and on every later GPU (raw mma.m8n8k4 would be
// emulated there); no ldmatrix, cp.async or bf16.  Online softmax in fp32 (FlashAttention-2:
// the output is rescaled once per key tile and divided by the row sum at the end).
//
// Math, per query row: query token i of a chunk of L tokens after P cached tokens sees keys
// 0 .. P + i (the bottom-right causal offset); o = sum_j p_j v_j / sum_j p_j with
// p_j = 2^(s_j - m), s_j = (q . k_j) * scale * log2(e), m the running maximum.  P = exp2(..)
// is rounded to fp16 for the P V product (as FlashAttention does); everything else is fp32.
//
// Data layout (row-major, innermost dimension contiguous; element strides, 16-byte rows):
//   q        fp16 [T][H][D]      strides q_st (token), q_sh (head); T = rows of the flat batch
//   k, v     paged: [num_blocks][bs][KVH][D], one layer's cache; key j of a sequence is
//                   cache row  tables[table_offset + j / bs] * bs + j % bs.  Element by the
//                   kernel's KV (--kv-cache-dtype, kv_cache.py): fp16 (flash_prefill_r*),
//                   uint8 fp8_e5m2 codes (flash_prefill_fp8_r*: value = code << 8 as fp16,
//                   exact) or int8 codes q (flash_prefill_int8_r*: value = q * s)
//            fresh (tables == null, every P = 0): fp16 [T][KVH][D], key j at row q_start + j
//                   (the fp16 kernels only)
//   k_scale,
//   v_scale  fp32 [num_blocks][bs][KVH]   the int8 cache's scales s (null otherwise)
//   tables   int64 [...]         every sequence's block table, one after another
//   seqs     int32 [S][4]        (q_start, L, P, table_offset) per sequence
//   items    int32 [N][2]        (sequence, row tile) per work item, heaviest first
//   out      fp16 [T][H][D]      strides o_st, o_sh; only the chunks' rows are written
// H = KVH * G.  Query head h reads KV head h / G (grouped-query attention).
//
// Rows.  The G query heads of one KV head share every K and V tile: a block serves one KV
// head, and its M = 64 rows are 64 consecutive entries of the sequence's (token, head) list
// f = token * G + g, f in [0, L*G) (a tile of a group-6 chunk holds ~11 tokens of all 6
// heads).  Row f sees keys 0 .. P + f / G; the block walks keys 0 .. P + (last token of the
// tile) in tiles of 64 and masks per row.  Rows past L*G are zero queries (clamped to the
// last token's mask) and are not written.  Grid: one block per (work item, KV head), block
// b -> item b / KVH, KV head b % KVH; the host lists items by descending key count, so the
// longest blocks start first.
//
// Thread mapping: 256 threads = 8 warps.  Warp w has row group rg = w % 4 (rows 16rg ..
// 16rg+15) and half hf = w / 4.  Per key tile:
//   load    K (then V) tile: 64 keys x D halfs, thread t loads 16-byte pieces t + 256i (a warp
//           reads 512 contiguous bytes of one or two cache rows); loads go to registers first
//           and are stored to shared memory after the previous stage, so the global latency of
//           V hides under Q K^T and that of the next K under the softmax and P V (Volta has
//           no cp.async).  An 8-bit cache keeps the mapping with pieces of 8 codes (8 bytes;
//           int8 also loads the key's fp32 scale): the raw codes wait in registers and are
//           decoded to fp16 as they are stored (fp8 exactly; int8 as fp16(q * s), one
//           rounding), so the shared-memory tile and all that follows is the fp16 kernel's;
//   Q K^T   warp (rg, hf) computes S[16 rows][32 keys 32hf..] (two accumulators sharing each
//           Q fragment) over D/16 steps, Q and K fragments loaded from shared memory;
//   softmax thread t owns row t / 4 and columns 4(t%4) + 16c + {0..3}, c < 4 (the four
//           threads of a row are adjacent lanes: max and sum meet by two xor shuffles, and a
//           row stride of 80 floats keeps their float4 reads conflict-free); writes P (fp16)
//           over the first half of its own S row and the row's rescale factor alpha;
//   P V     variant r16: warp (rg, hf) owns O[16 rows][D/2 columns D/2*hf..]; variant r32: warp
//           w owns O[32 rows 32(w%2)..][D/4 columns D/4*(w/2)..] (each P fragment feeds twice
//           as many products: fewer shared-memory loads per tensor-core op); either way D/32
//           fp32 accumulators (64 registers at D = 256), rescaled by alpha, then += P V.
// The wmma accumulator's element -> row map is not specified by PTX (it differs between
// Volta's HMMA.884 and later tensor cores), so each thread reads it once from a fragment
// loaded from a matrix of row numbers and keeps it as eight 4-bit fields (row_map).
// At the end O goes through shared memory (over the Q and K/V tiles) and each thread writes
// 16-byte pieces of the output, divided by the row sums.
//
// Shared memory (dynamic; above 48 KB needs the opt-in attribute, which the host sets):
//   Q     fp16 [64][D+8]   the block's queries (8 halfs of padding against bank conflicts)
//   KV    fp16 [64][D+8]   the current K tile, then the current V tile
//   S     fp32 [64][80]    scores; P fp16 [64][160 halfs] lies over it (row r of P in the
//                          first 128 bytes of row r of S)
//   alpha fp32 [64]        per-row rescale factor, at the end 1 / row sum
// D = 256: 88,320 bytes (V100: 96 KB per block, one block per SM); D = 128: 55,552.
#include "w4a16_common.cuh"  // cuda_fp16.h and the KV-cache encodings

namespace onecat_fap {
constexpr int kRows = 64;     // query rows per block
constexpr int kKeys = 64;     // keys per tile
constexpr int kThreads = 256;
constexpr int kLdS = 80;      // floats per S row
constexpr int kLdP = 160;     // halfs per P row (P over S)
__device__ __forceinline__ float infinity() { return __int_as_float(0x7f800000); }

template <int D> struct Shape {
  static constexpr int kLd = D + 8;                           // halfs per Q / K / V row
  static constexpr int kLdO = D + 4;                          // floats per O staging row
  static constexpr int kPieces = kRows * D / 8 / kThreads;    // 16-byte loads per thread per tile
  static constexpr int kPiecesPerRow = D / 8;
  static constexpr int kTileBytes = kRows * kLd * 2;
  static constexpr int kSmem = 2 * kTileBytes + kRows * kLdS * 4 + kRows * 4;
  static_assert(kRows * kLdO * 4 <= 2 * kTileBytes, "O staging must fit over Q and KV");
};

struct Frag { unsigned r[8]; };  // an A or B operand: 16 fp16 as 8 pairs
struct Acc { float r[8]; };      // an fp32 accumulator

__device__ __forceinline__ unsigned shared_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Operand loads from shared memory.  volatile: they stay between the barriers around them.
#define FAP_LOAD(NAME, WHICH, LAYOUT)                                                          \
  __device__ __forceinline__ void NAME(Frag& f, const half* p, int ld) {                       \
    asm volatile("wmma.load." #WHICH ".sync.aligned." #LAYOUT ".m16n16k16.shared.f16 "         \
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"                                        \
                 : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3]), "=r"(f.r[4]),       \
                   "=r"(f.r[5]), "=r"(f.r[6]), "=r"(f.r[7])                                    \
                 : "r"(shared_addr(p)), "r"(ld));                                              \
  }
FAP_LOAD(load_a_row, a, row)  // Q rows, P rows
FAP_LOAD(load_b_col, b, col)  // K^T: the K tile read column-major
FAP_LOAD(load_b_row, b, row)  // V

// d += a b
#define FAP_MMA(NAME, AL, BL)                                                                  \
  __device__ __forceinline__ void NAME(Acc& d, const Frag& a, const Frag& b) {                 \
    asm volatile("wmma.mma.sync.aligned." #AL "." #BL ".m16n16k16.f32.f32 "                    \
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11,%12,%13,%14,%15}, "                \
                 "{%16,%17,%18,%19,%20,%21,%22,%23}, {%0,%1,%2,%3,%4,%5,%6,%7};"               \
                 : "+f"(d.r[0]), "+f"(d.r[1]), "+f"(d.r[2]), "+f"(d.r[3]), "+f"(d.r[4]),       \
                   "+f"(d.r[5]), "+f"(d.r[6]), "+f"(d.r[7])                                    \
                 : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(a.r[4]),            \
                   "r"(a.r[5]), "r"(a.r[6]), "r"(a.r[7]), "r"(b.r[0]), "r"(b.r[1]),            \
                   "r"(b.r[2]), "r"(b.r[3]), "r"(b.r[4]), "r"(b.r[5]), "r"(b.r[6]),            \
                   "r"(b.r[7]));                                                               \
  }
FAP_MMA(mma_row_col, row, col)
FAP_MMA(mma_row_row, row, row)

__device__ __forceinline__ void store_acc(float* p, const Acc& c, int ld) {
  asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.shared.f32 "
               "[%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
               :: "r"(shared_addr(p)), "f"(c.r[0]), "f"(c.r[1]), "f"(c.r[2]), "f"(c.r[3]),
                  "f"(c.r[4]), "f"(c.r[5]), "f"(c.r[6]), "f"(c.r[7]), "r"(ld) : "memory");
}

__device__ __forceinline__ void load_acc(Acc& c, const float* p, int ld) {
  asm volatile("wmma.load.c.sync.aligned.row.m16n16k16.shared.f32 "
               "{%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
               : "=f"(c.r[0]), "=f"(c.r[1]), "=f"(c.r[2]), "=f"(c.r[3]), "=f"(c.r[4]),
                 "=f"(c.r[5]), "=f"(c.r[6]), "=f"(c.r[7])
               : "r"(shared_addr(p)), "r"(ld) : "memory");
}

// One staged piece of a K / V tile (8 features of one key) as loaded: 8 fp16, or 8 codes of an
// 8-bit cache and (int8) the key's scale.
template <int KV> struct Piece { uint2 codes; float scale; };
template <> struct Piece<onecat::kKvFp16> { uint4 halfs; };

// Where the piece e of a 64 x D tile of keys comes from: key k0 + e / (D/8), features
// 8 (e % (D/8)) ..; zero past the block's last key (those scores are masked, and a zero value
// row keeps P V finite whatever the cache holds there).
template <int D, int KV>
__device__ __forceinline__ void load_tile(Piece<KV> (&r)[Shape<D>::kPieces], const void* __restrict__ src,
                                          const float* __restrict__ scales,
                                          const long long* __restrict__ tables, int table_offset,
                                          int q_start, int k0, int n_keys, int kvh, int kv_heads,
                                          int log2_bs) {
#pragma unroll
  for (int i = 0; i < Shape<D>::kPieces; ++i) {
    const int e = threadIdx.x + kThreads * i;
    const int key = k0 + e / Shape<D>::kPiecesPerRow;
    const int piece = e % Shape<D>::kPiecesPerRow;
    if constexpr (KV == onecat::kKvFp16) {
      r[i].halfs = make_uint4(0u, 0u, 0u, 0u);
    } else {
      r[i].codes = make_uint2(0u, 0u);
      r[i].scale = 0.f;
    }
    if (key < n_keys) {
      long long row;
      if (tables) {
        const long long block = __ldg(tables + table_offset + (key >> log2_bs));
        row = (block << log2_bs) | (key & ((1 << log2_bs) - 1));
      } else {
        row = q_start + key;
      }
      const long long entry = row * kv_heads + kvh;  // (cache row, KV head)
      if constexpr (KV == onecat::kKvFp16) {
        r[i].halfs = __ldg(reinterpret_cast<const uint4*>(static_cast<const half*>(src) + entry * D) + piece);
      } else {
        r[i].codes = __ldg(reinterpret_cast<const uint2*>(static_cast<const unsigned char*>(src) + entry * D) + piece);
        if constexpr (KV == onecat::kKvInt8) r[i].scale = __ldg(scales + entry);
      }
    }
  }
}

// 8 fp16 features of a staged piece: as loaded, or decoded (fp8: exact; int8: fp16(q * s))
template <int KV>
__device__ __forceinline__ uint4 piece_halfs(const Piece<KV>& p) {
  if constexpr (KV == onecat::kKvFp16) {
    return p.halfs;
  } else if constexpr (KV == onecat::kKvFp8) {
    const uint2 lo = onecat::fp8_e5m2_decode4(p.codes.x), hi = onecat::fp8_e5m2_decode4(p.codes.y);
    return make_uint4(lo.x, lo.y, hi.x, hi.y);
  } else {
    half2 h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned w = j < 2 ? p.codes.x : p.codes.y;
      const int e = 2 * (j % 2);
      h[j] = __floats2half2_rn(onecat::int8_decode(w, e, p.scale), onecat::int8_decode(w, e + 1, p.scale));
    }
    return make_uint4(*reinterpret_cast<const unsigned*>(&h[0]), *reinterpret_cast<const unsigned*>(&h[1]),
                      *reinterpret_cast<const unsigned*>(&h[2]), *reinterpret_cast<const unsigned*>(&h[3]));
  }
}

template <int D, int KV>
__device__ __forceinline__ void store_tile(half* tile, const Piece<KV> (&r)[Shape<D>::kPieces]) {
#pragma unroll
  for (int i = 0; i < Shape<D>::kPieces; ++i) {
    const int e = threadIdx.x + kThreads * i;
    *reinterpret_cast<uint4*>(tile + (e / Shape<D>::kPiecesPerRow) * Shape<D>::kLd +
                              8 * (e % Shape<D>::kPiecesPerRow)) = piece_halfs<KV>(r[i]);
  }
}

template <int D, int R, int KV>
__device__ __forceinline__ void flash_prefill(
    const half* __restrict__ q, long long q_st, long long q_sh, const void* __restrict__ k,
    const void* __restrict__ v, const long long* __restrict__ tables, const int* __restrict__ seqs,
    const int* __restrict__ items, half* __restrict__ out, long long o_st, long long o_sh,
    int kv_heads, int group, int log2_bs, float scale_log2, const float* __restrict__ k_scale,
    const float* __restrict__ v_scale) {
  using Sh = Shape<D>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  half* q_s = reinterpret_cast<half*>(smem_raw);
  half* kv_s = reinterpret_cast<half*>(smem_raw + Sh::kTileBytes);
  float* s_s = reinterpret_cast<float*>(smem_raw + 2 * Sh::kTileBytes);
  half* p_s = reinterpret_cast<half*>(s_s);
  float* alpha_s = s_s + kRows * kLdS;
  float* o_s = reinterpret_cast<float*>(smem_raw);  // at the end, over Q and KV

  const int tid = threadIdx.x, warp = tid >> 5;
  const int item = blockIdx.x / kv_heads, kvh = blockIdx.x % kv_heads;
  const int seq = items[2 * item], tile = items[2 * item + 1];
  const int q_start = seqs[4 * seq], length = seqs[4 * seq + 1], past = seqs[4 * seq + 2];
  const int table_offset = seqs[4 * seq + 3];
  const int rows = length * group, r0 = tile * kRows;
  const int last_token = min(length - 1, (r0 + kRows - 1) / group);
  const int n_keys = past + last_token + 1;
  const int n_tiles = (n_keys + kKeys - 1) / kKeys;

  // the accumulator's row map: a fragment loaded from a 16 x 16 matrix holding row numbers
  s_s[(tid >> 4) * kLdS + (tid & 15)] = static_cast<float>(tid >> 4);
  // this block's queries
#pragma unroll
  for (int i = 0; i < Sh::kPieces; ++i) {
    const int e = tid + kThreads * i;
    const int row = e / Sh::kPiecesPerRow, piece = e % Sh::kPiecesPerRow;
    const int f = r0 + row;
    uint4 value = make_uint4(0u, 0u, 0u, 0u);
    if (f < rows) {
      const int token = f / group, head = kvh * group + f % group;
      value = __ldg(reinterpret_cast<const uint4*>(q + (q_start + token) * q_st + head * q_sh) + piece);
    }
    *reinterpret_cast<uint4*>(q_s + row * Sh::kLd + 8 * piece) = value;
  }
  Piece<KV> staged[Sh::kPieces];
  load_tile<D, KV>(staged, k, k_scale, tables, table_offset, q_start, 0, n_keys, kvh, kv_heads, log2_bs);
  __syncthreads();
  unsigned row_map = 0;
  {
    Acc rows_acc;
    load_acc(rows_acc, s_s, kLdS);
#pragma unroll
    for (int i = 0; i < 8; ++i) row_map |= static_cast<unsigned>(rows_acc.r[i]) << (4 * i);
  }

  const int rg = warp & 3, hf = warp >> 2;  // Q K^T: 16 rows x 32 keys per warp
  // P V: R rows x kCols columns per warp (R = 16: 4 x 2 warps; R = 32: 2 x 4 warps)
  constexpr int kRowFrags = R / 16, kColParts = 8 * R / kRows, kCols = D / kColParts, kColFrags = kCols / 16;
  const int pr = warp % (kRows / R), pc = warp / (kRows / R);
  Acc o[kRowFrags][kColFrags];
#pragma unroll
  for (int r = 0; r < kRowFrags; ++r)
#pragma unroll
    for (int n = 0; n < kColFrags; ++n)
#pragma unroll
      for (int i = 0; i < 8; ++i) o[r][n].r[i] = 0.f;

  // the softmax thread's row and its state (the four threads of a row hold the same m and l)
  const int srow = tid >> 2, quarter = tid & 3;
  const int limit = past + min(length - 1, (r0 + srow) / group);  // last visible key
  float m = -infinity(), l = 0.f;

  for (int t = 0; t < n_tiles; ++t) {
    const int k0 = t * kKeys;
    __syncthreads();  // the previous tile's P V is done with KV (and, at t = 0, the row map with S)
    store_tile<D, KV>(kv_s, staged);
    load_tile<D, KV>(staged, v, v_scale, tables, table_offset, q_start, k0, n_keys, kvh, kv_heads, log2_bs);
    __syncthreads();
    {  // S = Q K^T for rows 16rg.. and keys 32hf..
      Acc s0, s1;
#pragma unroll
      for (int i = 0; i < 8; ++i) s0.r[i] = s1.r[i] = 0.f;
      const half* qa = q_s + rg * 16 * Sh::kLd;
      const half* kb = kv_s + hf * 32 * Sh::kLd;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        Frag a, b0, b1;
        load_a_row(a, qa + 16 * kk, Sh::kLd);
        load_b_col(b0, kb + 16 * kk, Sh::kLd);
        load_b_col(b1, kb + 16 * Sh::kLd + 16 * kk, Sh::kLd);
        mma_row_col(s0, a, b0);
        mma_row_col(s1, a, b1);
      }
      store_acc(s_s + rg * 16 * kLdS + hf * 32, s0, kLdS);
      store_acc(s_s + rg * 16 * kLdS + hf * 32 + 16, s1, kLdS);
    }
    __syncthreads();  // S complete; KV (K) free
    store_tile<D, KV>(kv_s, staged);
    if (t + 1 < n_tiles)
      load_tile<D, KV>(staged, k, k_scale, tables, table_offset, q_start, k0 + kKeys, n_keys, kvh, kv_heads, log2_bs);
    {  // online softmax of row srow
      float x[16];
      const float* srow_p = s_s + srow * kLdS + 4 * quarter;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float4 s4 = *reinterpret_cast<const float4*>(srow_p + 16 * c);
        const int key = k0 + 4 * quarter + 16 * c;
        x[4 * c + 0] = key + 0 <= limit ? s4.x * scale_log2 : -infinity();
        x[4 * c + 1] = key + 1 <= limit ? s4.y * scale_log2 : -infinity();
        x[4 * c + 2] = key + 2 <= limit ? s4.z * scale_log2 : -infinity();
        x[4 * c + 3] = key + 3 <= limit ? s4.w * scale_log2 : -infinity();
      }
      float mx = x[0];
#pragma unroll
      for (int i = 1; i < 16; ++i) mx = fmaxf(mx, x[i]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m, mx);
      // a row whose keys are all masked so far (never a real row: key 0 is visible to all)
      const float base = m_new == -infinity() ? 0.f : m_new;
      const float alpha = exp2f(m - base);
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        x[i] = exp2f(x[i] - base);
        sum += x[i];
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      l = l * alpha + sum;
      m = m_new;
      __syncwarp();  // the row's S values are read (P overwrites them)
      half* prow = p_s + srow * kLdP + 4 * quarter;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const half2 lo = __floats2half2_rn(x[4 * c], x[4 * c + 1]);
        const half2 hi = __floats2half2_rn(x[4 * c + 2], x[4 * c + 3]);
        uint2 packed;
        packed.x = *reinterpret_cast<const unsigned*>(&lo);
        packed.y = *reinterpret_cast<const unsigned*>(&hi);
        *reinterpret_cast<uint2*>(prow + 16 * c) = packed;
      }
      if (quarter == 0) alpha_s[srow] = alpha;
    }
    __syncthreads();  // P, alpha and the V tile visible
    {  // O = alpha O + P V for rows R pr.. and columns kCols pc..
#pragma unroll
      for (int r = 0; r < kRowFrags; ++r)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float a = alpha_s[pr * R + 16 * r + ((row_map >> (4 * i)) & 15)];
#pragma unroll
          for (int n = 0; n < kColFrags; ++n) o[r][n].r[i] *= a;
        }
      const half* pa = p_s + pr * R * kLdP;
      const half* vb = kv_s + pc * kCols;
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        Frag a[kRowFrags];
#pragma unroll
        for (int r = 0; r < kRowFrags; ++r) load_a_row(a[r], pa + 16 * r * kLdP + 16 * kk, kLdP);
#pragma unroll
        for (int n = 0; n < kColFrags; ++n) {
          Frag b;
          load_b_row(b, vb + 16 * kk * Sh::kLd + 16 * n, Sh::kLd);
#pragma unroll
          for (int r = 0; r < kRowFrags; ++r) mma_row_row(o[r][n], a[r], b);
        }
      }
    }
  }
  __syncthreads();  // every read of Q, KV and alpha is done
  if (quarter == 0) alpha_s[srow] = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int r = 0; r < kRowFrags; ++r)
#pragma unroll
    for (int n = 0; n < kColFrags; ++n)
      store_acc(o_s + (pr * R + 16 * r) * Sh::kLdO + pc * kCols + 16 * n, o[r][n], Sh::kLdO);
  __syncthreads();
#pragma unroll
  for (int i = 0; i < Sh::kPieces; ++i) {
    const int e = tid + kThreads * i;
    const int row = e / Sh::kPiecesPerRow, piece = e % Sh::kPiecesPerRow;
    const int f = r0 + row;
    if (f >= rows) continue;
    const int token = f / group, head = kvh * group + f % group;
    const float inv = alpha_s[row];
    const float4 lo = *reinterpret_cast<const float4*>(o_s + row * Sh::kLdO + 8 * piece);
    const float4 hi = *reinterpret_cast<const float4*>(o_s + row * Sh::kLdO + 8 * piece + 4);
    const half2 h0 = __floats2half2_rn(lo.x * inv, lo.y * inv), h1 = __floats2half2_rn(lo.z * inv, lo.w * inv);
    const half2 h2 = __floats2half2_rn(hi.x * inv, hi.y * inv), h3 = __floats2half2_rn(hi.z * inv, hi.w * inv);
    uint4 packed;
    packed.x = *reinterpret_cast<const unsigned*>(&h0);
    packed.y = *reinterpret_cast<const unsigned*>(&h1);
    packed.z = *reinterpret_cast<const unsigned*>(&h2);
    packed.w = *reinterpret_cast<const unsigned*>(&h3);
    *(reinterpret_cast<uint4*>(out + (q_start + token) * o_st + head * o_sh) + piece) = packed;
  }
}
}  // namespace onecat_fap

// (one block per SM: a V100 has 96 KB of shared memory per SM and the d256 block takes 86 KB)
// (KV: the cache's encoding, onecat::KvFormat; the 8-bit kernels read a paged cache only)
#define FAP_KERNEL(NAME, D, R, KV)                                                             \
  extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                   \
      const half* __restrict__ q, long long q_st, long long q_sh, const void* __restrict__ k,  \
      const void* __restrict__ v, const long long* __restrict__ tables,                        \
      const int* __restrict__ seqs, const int* __restrict__ items, half* __restrict__ out,     \
      long long o_st, long long o_sh, int kv_heads, int group, int log2_bs, float scale_log2,  \
      const float* __restrict__ k_scale, const float* __restrict__ v_scale) {                  \
    onecat_fap::flash_prefill<D, R, KV>(q, q_st, q_sh, k, v, tables, seqs, items, out, o_st,   \
                                        o_sh, kv_heads, group, log2_bs, scale_log2, k_scale,   \
                                        v_scale);                                              \
  }

FAP_KERNEL(flash_prefill_r16_d128, 128, 16, onecat::kKvFp16)
FAP_KERNEL(flash_prefill_r16_d256, 256, 16, onecat::kKvFp16)
FAP_KERNEL(flash_prefill_r32_d128, 128, 32, onecat::kKvFp16)
FAP_KERNEL(flash_prefill_r32_d256, 256, 32, onecat::kKvFp16)
FAP_KERNEL(flash_prefill_fp8_r16_d128, 128, 16, onecat::kKvFp8)
FAP_KERNEL(flash_prefill_fp8_r16_d256, 256, 16, onecat::kKvFp8)
FAP_KERNEL(flash_prefill_fp8_r32_d128, 128, 32, onecat::kKvFp8)
FAP_KERNEL(flash_prefill_fp8_r32_d256, 256, 32, onecat::kKvFp8)
FAP_KERNEL(flash_prefill_int8_r16_d128, 128, 16, onecat::kKvInt8)
FAP_KERNEL(flash_prefill_int8_r16_d256, 256, 16, onecat::kKvInt8)
FAP_KERNEL(flash_prefill_int8_r32_d128, 128, 32, onecat::kKvInt8)
FAP_KERNEL(flash_prefill_int8_r32_d256, 256, 32, onecat::kKvInt8)
