// W4A16 tensor-core GEMM for small batches (M = 3..~64 tokens, more via grid.z):
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp16 in, fp32 accumulate, fp16 out.
//
// Why wmma: it is the tensor-core route that exists on sm_70 (HMMA.884 underneath) AND runs
// natively when the same compute_70 PTX is JIT-compiled for a newer GPU.  It is written as
// inline PTX (wmma.load / wmma.mma / wmma.store), so NVRTC needs only cuda_fp16.h, not the
// crt/ headers behind mma.h.  sm_70 has no cp.async and no ldmatrix: tiles go
// global -> registers -> shared, and the fragments are read from shared by wmma.load.
//
// Data layout: weights as in w4a16_common.cuh (lane l holds the 32 k of column
// lane_column(l) of a tile in one uint4).  x [M, K] fp16 row-major, y [M, N] fp16 row-major.
//
// Thread mapping:
//   grid  = (ceil(N/32 / WARPS), S splits of K, ceil(M / MT))     block = WARPS warps
//   warp w of block (bx, s, bz) owns column tile t = bx*WARPS + w (32 output columns) and rows
//   bz*MT .. bz*MT+MT-1, over k tiles [s*kps, (s+1)*kps), in chunks of KC = 32*CT k
//   (CT = 2 or 4 k tiles: CT uint4 per lane in flight).
//   Per chunk:
//     1. every warp dequantises its CT uint4 fragments (loaded one chunk earlier) into its
//        own slice of shared memory, sB[w][column 0..31][k 0..KC-1] (k contiguous, i.e. the
//        col-major B operand of wmma), one row per lane, 128-bit stores;
//        all threads store the x chunk they loaded into sA[row 0..MT-1][k 0..KC-1];
//     2. __syncthreads, then the loads of the NEXT chunk are issued into registers
//        (register double buffering: their latency overlaps this chunk's MMAs);
//     3. the warp runs KC/16 wmma steps: m8n32k16 for MT = 8 (one fragment covers the tile's
//        32 columns), otherwise m16n16k16 with (MT/16) x 2 fragments.
//   Rows are padded by 8 halves (to 144 or 272 bytes): fragment addresses stay 32-byte
//   aligned and consecutive rows start 4 banks apart.
//   Epilogue: accumulators go through shared memory (fp32, row stride 36) so that each warp
//   writes full 64-byte rows of y.  With S > 1, up to MT = 32 each split stores them in its
//   own fp32 slice of a workspace (plain stores, any content on entry) and the last block of
//   the (column group, row tile) adds the slices in split order (arrive_last: a fence, a
//   counter, a read-back); at MT = 64 they are added to a zeroed fp32 [M, N] with atomics and
//   read back by the last block.
//
// Register-dequant variant (w4a16_wmmar_*, group sizes that are multiples of 64): step 1
// above moves 4 bytes of fp16 through shared memory per weight (a store, then the wmma.load
// of B), which on a GPU whose memory is fast next to its shared memory bounds the kernel.
// Here the PACKED words go through shared memory instead (half a byte per weight) and the
// dequantisation happens on the B fragment itself:
//   - Every 64 k of a column (two k tiles, two uint4 of its lane) are stored as one column of
//     a 16 x 32 "packed" matrix sP[w][sub][column][16] of 16-bit elements, exactly as loaded:
//     element kk = 8t + 2v + h is half h of word v of tile t, i.e. the nibbles of
//     k = 32t + 8v + 2j + h for j = 0..3 (the layout's nibble order, w4a16_common.cuh).
//   - wmma.load.b of sP gives a fragment whose every 16-bit slot holds such an element, WHERE
//     the slot's (kk, column) sits in the fragment being unknown (wmma fragment layouts are
//     not specified, and differ between GPUs).  Only element-wise work is done on it: masking
//     nibble j of every slot (the magic-number trick of dequant_word) and one
//     fma.rn.f16x2(q, s, nzs) gives the B fragment of "step j": B_j[kk][n] = w[k(j, kk)][n],
//     bit for bit the dequant contract.  Four steps per packed fragment.
//   - The scale of a slot depends on its column: which lane owns the column of each slot is
//     found once per launch by loading a fragment of lane ids (lane l writes l into its
//     column), and each group's (s, nzs) pairs come from those lanes by shuffles.
//   - A is staged permuted to match: sA[sub*4 + j][m][kk] = x[m][k(j, kk)], so step j's MMA
//     sums over the same 16 k as B_j (the order of a dot product's terms is free).
//   Shared-memory traffic per weight: 1 byte (store + load of the packed word) instead of 4.
#include "w4a16_common.cuh"

namespace onecat {

constexpr int kLdc = 36;  // epilogue row stride in floats (144 bytes)

template <int MT, int WARPS, int CT, bool PACKED>
struct WmmaSmem {
  static constexpr int kLds = CT * kTile + 8;           // shared row stride in halves
  // sA: MT rows of a chunk, or (PACKED) 2*CT step matrices of MT rows x 16 k
  static constexpr int kA = PACKED ? 2 * CT * MT * kPackedLd * 2 : MT * kLds * 2;
  // sB: fp16 [WARPS][32 columns][chunk k], or (PACKED) packed [WARPS][CT/2][32 columns][16]
  static constexpr int kB = PACKED ? WARPS * (CT / 2) * kTile * kPackedLd * 2 : WARPS * kTile * kLds * 2;
  static constexpr int kC = WARPS * MT * kLdc * 4;      // bytes of the epilogue
  static constexpr int kBytes = (kA + kB) > kC ? (kA + kB) : kC;
};

template <int MT, int WARPS, int CT, bool PACKED>
__device__ __forceinline__ void wmma_body(const half* __restrict__ x, const uint4* __restrict__ qweight,
                                          const half2* __restrict__ scales_zeros,
                                          const half* __restrict__ bias, half* __restrict__ y,
                                          float* __restrict__ workspace, int* __restrict__ counters,
                                          int M, int N, int K, int group_size, int ktiles_per_split) {
  using Smem = WmmaSmem<MT, WARPS, CT, PACKED>;
  static_assert(!PACKED || CT % 2 == 0, "the register-dequant variant works in 64-k sub-chunks");
  constexpr int kChunkTiles = CT;               // k tiles per chunk
  constexpr int kChunk = CT * kTile;            // k per chunk
  constexpr int kLds = Smem::kLds;
  constexpr bool kM8 = MT == 8;
  constexpr int kMFrags = kM8 ? 1 : MT / 16;
  constexpr int kNFrags = kM8 ? 1 : 2;
  constexpr int kThreads = 32 * WARPS;
  constexpr int kXVecs = MT * kChunk / 8;                          // uint4 per x chunk
  constexpr int kXPerThread = (kXVecs + kThreads - 1) / kThreads;

  __shared__ __align__(128) unsigned char smem[Smem::kBytes];
  half* sA = reinterpret_cast<half*>(smem);
  half* sB = reinterpret_cast<half*>(smem + Smem::kA);
  float* sC = reinterpret_cast<float*>(smem);

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int tiles_n = N / kTile;
  const int tile = blockIdx.x * WARPS + warp;
  const bool tile_ok = tile < tiles_n;
  const int m0 = blockIdx.z * MT;
  const int ktiles = K / kTile;
  const int groups = K / group_size;
  const int tiles_per_group = group_size / kTile;
  const int k_begin = blockIdx.y * ktiles_per_split;
  const int k_end = min(ktiles, k_begin + ktiles_per_split);

  const uint4* w_tile = qweight + (size_t)(tile_ok ? tile : 0) * ktiles * 32 + lane;
  ScaleCursor scales(scales_zeros + (size_t)(tile_ok ? tile : 0) * groups * 32 + lane, k_begin,
                     tiles_per_group);

  uint4 wv[kChunkTiles];
  half2 sz[kChunkTiles];
  uint4 xv[kXPerThread];

  auto load_chunk = [&](int kc) {
#pragma unroll
    for (int u = 0; u < kChunkTiles; ++u) {
      const int kt = kc + u;
      if (tile_ok && kt < k_end) {
        wv[u] = load_weights_streaming(w_tile + (size_t)kt * 32);
        sz[u] = scales.next();
      }
    }
#pragma unroll
    for (int i = 0; i < kXPerThread; ++i) {
      const int idx = threadIdx.x + i * kThreads;
      const int row = idx / (kChunk / 8);
      const int col = (idx % (kChunk / 8)) * 8;
      const int m = m0 + row;
      const int kt = kc + col / kTile;
      xv[i] = make_uint4(0u, 0u, 0u, 0u);
      if (idx < kXVecs && m < M && kt < k_end)
        xv[i] = __ldg(reinterpret_cast<const uint4*>(x + (size_t)m * K + (size_t)kc * kTile + col));
    }
  };

  FragC acc[kMFrags][kNFrags];
#pragma unroll
  for (int i = 0; i < kMFrags; ++i)
#pragma unroll
    for (int j = 0; j < kNFrags; ++j)
#pragma unroll
      for (int r = 0; r < 8; ++r) acc[i][j].r[r] = 0.0f;

  if constexpr (PACKED) {
    // Which lane owns the column of each 16-bit slot of this warp's packed B fragment(s).
    half* sP_warp = sB + warp * (CT / 2) * kTile * kPackedLd;
    store_lane_ids(sP_warp, lane);
    __syncthreads();
    FragAB owner[kNFrags];
    load_packed_b<kM8>(owner, sP_warp);
    FragAB s2[kNFrags], nzs2[kNFrags];  // per slot pair: (s, s) and (nzs, nzs) of its columns
    // s2 / nzs2 hold the scales of k tiles below group_end: first those of k_begin's group,
    // gathered once the first chunk's loads are back.  Sub-chunks step by 2 k tiles from an
    // even k_begin and groups are whole pairs of them, so the loop meets every later group's
    // first tile exactly: no division in it.
    int group_end = (k_begin / tiles_per_group + 1) * tiles_per_group;
    if (k_begin < k_end) {
      load_chunk(k_begin);
      if (tile_ok) slot_scales(owner, sz[0], s2, nzs2);
    }
    for (int kc = k_begin; kc < k_end; kc += kChunkTiles) {
      const int valid_tiles = min(kChunkTiles, k_end - kc);  // even: K % 64 == 0
      __syncthreads();  // the previous chunk's fragments have been read
#pragma unroll
      for (int i = 0; i < kXPerThread; ++i) {
        const int idx = threadIdx.x + i * kThreads;
        if (idx < kXVecs) stage_a_permuted(sA, MT, idx / (kChunk / 8), (idx % (kChunk / 8)) * 8, xv[i]);
      }
      if (tile_ok) {
#pragma unroll
        for (int sub = 0; sub < CT / 2; ++sub) store_packed_column(sP_warp + sub * kTile * kPackedLd, lane, wv[2 * sub], wv[2 * sub + 1]);
      }
      half2 sz_chunk[CT / 2];
#pragma unroll
      for (int sub = 0; sub < CT / 2; ++sub) sz_chunk[sub] = sz[2 * sub];
      __syncthreads();
      if (kc + kChunkTiles < k_end) load_chunk(kc + kChunkTiles);  // overlaps the MMAs below
      if (tile_ok) {
#pragma unroll
        for (int sub = 0; sub < CT / 2; ++sub) {
          if (2 * sub < valid_tiles) {
            if (kc + 2 * sub == group_end) {  // warp-uniform: the next group's (s, nzs) for every slot
              group_end += tiles_per_group;
              slot_scales(owner, sz_chunk[sub], s2, nzs2);
            }
            FragAB packed[kNFrags];
            load_packed_b<kM8>(packed, sP_warp + sub * kTile * kPackedLd);
            mma_packed_steps<kM8>(packed, s2, nzs2, sA + sub * 4 * MT * kPackedLd, MT, acc);
          }
        }
      }
    }
  } else {
    half* sB_warp = sB + warp * kTile * kLds;
    if (k_begin < k_end) load_chunk(k_begin);
    for (int kc = k_begin; kc < k_end; kc += kChunkTiles) {
      const int valid_tiles = min(kChunkTiles, k_end - kc);
      __syncthreads();  // the previous chunk's fragments have been read
#pragma unroll
      for (int i = 0; i < kXPerThread; ++i) {
        const int idx = threadIdx.x + i * kThreads;
        if (idx < kXVecs)
          *reinterpret_cast<uint4*>(sA + (idx / (kChunk / 8)) * kLds + (idx % (kChunk / 8)) * 8) = xv[i];
      }
      if (tile_ok) store_dequantised_column(sB_warp, kLds, lane, wv, sz, valid_tiles);
      __syncthreads();
      if (kc + kChunkTiles < k_end) load_chunk(kc + kChunkTiles);  // overlaps the MMAs below
#pragma unroll
      for (int ks = 0; ks < kChunk / 16; ++ks) {
        if (ks < 2 * valid_tiles) {
          if constexpr (kM8) {
            FragAB a, b;
            load_a_m8n32k16(a, sA + ks * 16, kLds);
            load_b_m8n32k16(b, sB_warp + ks * 16, kLds);
            mma_m8n32k16(acc[0][0], a, b);
          } else {
            FragAB b[kNFrags];
#pragma unroll
            for (int j = 0; j < kNFrags; ++j) load_b_m16n16k16(b[j], sB_warp + j * 16 * kLds + ks * 16, kLds);
#pragma unroll
            for (int i = 0; i < kMFrags; ++i) {
              FragAB a;
              load_a_m16n16k16(a, sA + i * 16 * kLds + ks * 16, kLds);
#pragma unroll
              for (int j = 0; j < kNFrags; ++j) mma_m16n16k16(acc[i][j], a, b[j]);
            }
          }
        }
      }
    }
  }

  // Epilogue: fragments -> shared (fp32) -> full rows of y (or the split slices).
  __syncthreads();
  float* sC_warp = sC + warp * MT * kLdc;
  if constexpr (kM8) {
    store_c_m8n32k16(sC_warp, acc[0][0], kLdc);
  } else {
#pragma unroll
    for (int i = 0; i < kMFrags; ++i)
#pragma unroll
      for (int j = 0; j < kNFrags; ++j) store_c_m16n16k16(sC_warp + i * 16 * kLdc + j * 16, acc[i][j], kLdc);
  }
  __syncwarp();
  const int n = tile * kTile + lane;
  const int rows = min(MT, M - m0);
  if (gridDim.y == 1) {
    if (tile_ok) {
      const float b = bias ? __half2float(bias[n]) : 0.0f;
      for (int r = 0; r < rows; ++r) y[(size_t)(m0 + r) * N + n] = __float2half_rn(sC_warp[r * kLdc + lane] + b);
    }
    return;
  }
  const float b = tile_ok && bias ? __half2float(bias[n]) : 0.0f;
  // Split K from 8 to 32 rows: each split stores its fp32 partials in its own slice of a
  // workspace laid out [S][row tiles][column tiles][MT][32] (one 128-byte row of a warp's
  // tile after another: one base pointer and constant offsets), with plain stores: no
  // atomics, nothing to re-zero.  The last block of the (column group, row tile)
  // (arrive_last) adds the S slices in split order, so the sum does not depend on the order
  // of arrival.  64 rows (no registers to spare for loads in flight): fp32 atomics into a
  // zeroed [M, N], read back and re-zeroed by the last block.  Return-valued 64-bit atomics
  // for every output cost more than either here (H200, 27B b32).
  const int splits = gridDim.y;
  const size_t slice = (size_t)gridDim.z * tiles_n * MT * 32;  // floats per split
  float* mine = workspace + ((size_t)blockIdx.z * tiles_n + (tile_ok ? tile : 0)) * MT * 32 + lane;
  if constexpr (MT >= 64) {
    if (tile_ok)
      for (int r = 0; r < rows; ++r) atomicAdd(workspace + (size_t)(m0 + r) * N + n, sC_warp[r * kLdc + lane]);
  } else if (tile_ok) {
#pragma unroll
    for (int r = 0; r < MT; ++r)
      if (r < rows) mine[blockIdx.y * slice + r * 32] = sC_warp[r * kLdc + lane];
  }
  if (!arrive_last(counters + blockIdx.z * gridDim.x + blockIdx.x, splits) || !tile_ok) return;
  if constexpr (MT >= 64) {
    for (int r = 0; r < rows; ++r) {
      const size_t at = (size_t)(m0 + r) * N + n;
      y[at] = __float2half_rn(__ldcg(workspace + at) + b);
      workspace[at] = 0.0f;  // the last block leaves the sums zeroed for the next launch
    }
  } else {
    // kSlices slices of all MT rows per round, their loads in flight together (a loop over
    // rows would wait on one L2 round trip per row).
    constexpr int kSlices = MT >= 16 ? 2 : 4;
    float total[MT];
#pragma unroll
    for (int r = 0; r < MT; ++r) total[r] = 0.0f;
#pragma unroll 1
    for (int s0 = 0; s0 < splits; s0 += kSlices) {
      float v[kSlices][MT];
#pragma unroll
      for (int u = 0; u < kSlices; ++u) {
        const float* from = mine + (size_t)min(s0 + u, splits - 1) * slice;
#pragma unroll
        for (int r = 0; r < MT; ++r) v[u][r] = r < rows ? __ldcg(from + r * 32) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kSlices; ++u)
#pragma unroll
        for (int r = 0; r < MT; ++r)
          if (s0 + u < splits) total[r] += v[u][r];
    }
#pragma unroll
    for (int r = 0; r < MT; ++r)
      if (r < rows) y[(size_t)(m0 + r) * N + n] = __float2half_rn(total[r] + b);
  }
}

}  // namespace onecat

#define ONECAT_WMMA_KERNEL(NAME, MT, WARPS, CT, PACKED, MINB)                                  \
  extern "C" __global__ void __launch_bounds__(32 * WARPS, MINB) NAME(                          \
      const half* x, const uint4* qweight, const half2* scales_zeros, const half* bias,       \
      half* y, float* workspace, int* counters, int M, int N, int K, int group_size,          \
      int ktiles_per_split) {                                                                  \
    onecat::wmma_body<MT, WARPS, CT, PACKED>(x, qweight, scales_zeros, bias, y, workspace,      \
                                             counters, M, N, K, group_size, ktiles_per_split); \
  }
// MINB: resident blocks per SM asked of ptxas (a register cap; 1: none).
#define ONECAT_WMMA(MT, WARPS, CT) ONECAT_WMMA_KERNEL(w4a16_wmma_mt##MT##_w##WARPS##_c##CT, MT, WARPS, CT, false, 1)
#define ONECAT_WMMAR(MT, WARPS, CT, MINB) \
  ONECAT_WMMA_KERNEL(w4a16_wmmar_mt##MT##_w##WARPS##_c##CT, MT, WARPS, CT, true, MINB)

ONECAT_WMMA(8, 4, 2)
ONECAT_WMMA(8, 4, 4)
ONECAT_WMMA(8, 8, 2)
ONECAT_WMMA(16, 4, 2)
ONECAT_WMMA(16, 4, 4)
ONECAT_WMMA(16, 8, 2)
ONECAT_WMMA(32, 4, 2)
ONECAT_WMMA(32, 4, 4)
ONECAT_WMMA(64, 4, 2)
// register-dequant variants (group size a multiple of 64)
ONECAT_WMMAR(8, 4, 2, 5)  // 96 registers: 5 blocks of 4 warps an SM (the b8 decode kernel)
ONECAT_WMMAR(8, 4, 4, 1)
ONECAT_WMMAR(8, 8, 2, 1)
ONECAT_WMMAR(16, 4, 2, 1)
ONECAT_WMMAR(16, 8, 2, 1)
ONECAT_WMMAR(32, 4, 2, 1)
ONECAT_WMMAR(32, 8, 2, 1)
ONECAT_WMMAR(64, 4, 2, 1)
