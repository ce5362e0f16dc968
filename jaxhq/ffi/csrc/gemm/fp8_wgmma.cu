// FP8 GEMM on Hopper FP8 tensor cores; see fp8_wgmma.h and docs/gemm.md ("FP8 on wgmma").
//
// Persistent: one CTA per SM takes 128 x 128 output tiles in turn, with three warpgroups: warpgroup 0 (one thread)
// streams 128-wide K tiles of A, B and their scales into a 5-stage shared-memory ring with TMA (128-byte swizzle,
// completion on mbarriers), running on into the next output tile; warpgroups 1 and 2 each own 64 rows. CTAs run in
// clusters of two that take two adjacent tile columns of one tile row: each loads one 64-row half of the shared A
// tile into both CTAs (TMA multicast), so a ring slot is free again only when the consumers of both CTAs have
// released it (remote mbarrier arrives). MXFP8: per 32-wide K step (one MX block) a consumer runs one m64n128k32 FP8
// wgmma into a fresh partial accumulator, waits for it, and adds partial * (sa[m] * sb[n]) into its FP32
// accumulator. Blockwise and per-tensor FP8: the four wgmmas of a 128-wide K tile run into the partial accumulator,
// which is then added (blockwise: times sa[m] * sb[n]) into the FP32 one: the promotion that keeps Hopper's reduced-
// precision accumulation inside the tensor core to 128 products; two partial accumulators alternate, so a K tile's
// wgmmas run while the previous one is promoted. The two consumers interleave, so one's FP32 work overlaps the
// other's wgmma.
// MX and block scales are re-laid-out first by a small kernel into fp32 [ceil(K/128)][J][rows rounded to 4]
// (J = 4 MX blocks or 1 block per K tile; blocks past K are 0, so a partial last K tile adds 0 x 0; TMA fills
// data past K and past the last row with zeros); per-tensor scales are read in the epilogue.
// CUTLASS's sm90 blockwise-scaled mainloop cannot do MX (its K scale granularity must span >= 4 wgmma
// K steps, i.e. >= 128 for FP8), hence the hand-written mainloop in PTX.
#include <cstdlib>

#include "fp8_wgmma.h"
#include "wgmma_common.cuh"

namespace jaxhq {
namespace gemm {
namespace {

using namespace wg;

constexpr int kStages = 5, kThreads = 384;
constexpr int kABytes = kBM * kBK, kBBytes = kBN * kBK;            // one byte per FP8 code
// A tile's scales: 4 MX blocks x kSRows fp32 (wgmma_common.cuh), each scale slot padded to 128 bytes, TMA's
// shared-memory alignment. A tile's scale box holds J = 4 (MX) or 1 (block) slots of kSRows fp32, in a slot
// sized for 4.
constexpr int kSBoxBytes = 4 * kSRows * 4, kSABytes = (kSBoxBytes + 127) / 128 * 128;
constexpr int kStageBytes = (kABytes + kBBytes + 2 * kSABytes + 1023) / 1024 * 1024;  // 37 KiB
// What TMA brings per stage, with J scale slots per operand.
constexpr int tx_bytes(int j) { return kABytes + kBBytes + 2 * j * kSRows * 4; }
constexpr int kSmemBytes = kStages * kStageBytes + 1024 + 2 * kStages * 8;
static_assert(kStageBytes % 1024 == 0, "stages must keep the 1024-byte alignment of 128-byte swizzling");

#define WGMMA_BODY \
"{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k32.f32." TA "." TB " " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "l"(da), "l"(db), "r"(scale_d)

template <bool kE5M2A, bool kE5M2B>
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (kE5M2A && kE5M2B) {
#define TA "e5m2"
#define TB "e5m2"
    asm volatile(WGMMA_BODY);
#undef TA
#undef TB
  } else if constexpr (kE5M2A) {
#define TA "e5m2"
#define TB "e4m3"
    asm volatile(WGMMA_BODY);
#undef TA
#undef TB
  } else if constexpr (kE5M2B) {
#define TA "e4m3"
#define TB "e5m2"
    asm volatile(WGMMA_BODY);
#undef TA
#undef TB
  } else {
#define TA "e4m3"
#define TB "e4m3"
    asm volatile(WGMMA_BODY);
#undef TA
#undef TB
  }
}

__device__ __forceinline__ float e8m0_value(uint8_t e) {  // 2^(e - 127); 0xFF is NaN
  if (e == 0xFF) return __int_as_float(0x7FC00000);
  if (e == 0) return __int_as_float(0x00400000);
  return __int_as_float(int(e) << 23);
}

// An operand's MX or block scales -> fp32 [ceil(k/128)][j][ld], zero past K and past the last row: j = 4
// (E8M0 [rows, ceil(k/32)]) or 1 (fp32 [rows, ceil(k/128)], or with group_rows > 0 128x128 scales
// [groups][ceil(group_rows/128)][ceil(k/128)]).
__global__ void tile_scales_kernel(const void* __restrict__ s, int j, int64_t rows, int64_t k, int64_t ld,
                                   int64_t group_rows, float* __restrict__ out) {
  const int64_t nb = cdiv(k, j == 4 ? 32 : 128), total = cdiv(k, 128) * j * ld;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i % ld, blk = i / ld;  // blk = kt * j + slot: the scale block along K
    float v = 0.0f;
    if (r < rows && blk < nb) {
      if (j == 4) {
        v = e8m0_value(static_cast<const uint8_t*>(s)[r * nb + blk]);
      } else if (group_rows > 0) {
        const int64_t g = r / group_rows, br = (r % group_rows) / 128;
        v = static_cast<const float*>(s)[(g * cdiv(group_rows, 128) + br) * nb + blk];
      } else {
        v = static_cast<const float*>(s)[r * nb + blk];
      }
    }
    out[i] = v;
  }
}

// Zeroes out rows [sum of the clamped group sizes, m) of out [m, n] (elem_bytes 2 or 4).
__global__ void zero_past_groups_kernel(void* out, const int32_t* __restrict__ gs, int groups, int64_t m, int64_t n,
                                        int elem_bytes) {
  __shared__ int64_t used;
  if (threadIdx.x == 0) {
    int64_t at = 0;
    for (int g = 0; g < groups; ++g) at += clamp_size(gs[g], m - at);
    used = at;
  }
  __syncthreads();
  const int64_t begin = used * n, end = m * n;
  for (int64_t i = begin + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end; i += int64_t(gridDim.x) * blockDim.x) {
    if (elem_bytes == 4) static_cast<float*>(out)[i] = 0.0f;
    else static_cast<uint16_t*>(out)[i] = 0;
  }
}

// acc += d * (sa[row] * sb[col]) over this thread's fragment: rows rl, rl + 8; columns 8 i + cl, + 1.
__device__ __forceinline__ void scale_add(float (&acc)[64], const float (&d)[64], const float* sa, const float* sb,
                                          int rl, int cl) {
  const float sa0 = sa[rl], sa1 = sa[rl + 8];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float2 sbv = *reinterpret_cast<const float2*>(sb + 8 * i + cl);  // N, brow0 even
    acc[4 * i + 0] = fmaf(d[4 * i + 0], sa0 * sbv.x, acc[4 * i + 0]);
    acc[4 * i + 1] = fmaf(d[4 * i + 1], sa0 * sbv.y, acc[4 * i + 1]);
    acc[4 * i + 2] = fmaf(d[4 * i + 2], sa1 * sbv.x, acc[4 * i + 2]);
    acc[4 * i + 3] = fmaf(d[4 * i + 3], sa1 * sbv.y, acc[4 * i + 3]);
  }
}

// A consumer warpgroup's view of the stage ring, for the pipelined loop of block and per-tensor scaling.
struct Consumer {
  uint8_t* smem;
  uint64_t* full;
  uint64_t* empty;
  int cw, rl, cl, lane;  // warpgroup (0, 1), this thread's fragment rows / columns, lane
  int a_shift, b_shift;  // where the tile's first A / B row sits in its scale box (row0 & 3, brow0 & 3)
  int cluster, rank;
};

// The partial sums d (finished) of the K tile in ring position q promoted into acc, times sa[m] * sb[n] for
// blocks; its stage released.
template <int kJ>
__device__ __forceinline__ void finish_tile(const Consumer& c, int q, float (&acc)[64], const float (&d)[64]) {
  const int s = q % kStages;
  if constexpr (kJ == 1) {
    const uint8_t* st = c.smem + s * kStageBytes;
    const float* sa = reinterpret_cast<const float*>(st + kABytes + kBBytes) + c.a_shift + c.cw * 64;
    const float* sb = reinterpret_cast<const float*>(st + kABytes + kBBytes + kSABytes) + c.b_shift;
    scale_add(acc, d, sa, sb, c.rl, c.cl);
  } else {
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] += d[i];
  }
  release(c.empty, s, c.lane, c.cluster, c.rank);
}

// Issues the four wgmmas of the K tile in ring position q into cur, waits for the previous one's (in prev,
// unless this is an output tile's first) and finishes that.
template <int kJ, bool kE5M2A, bool kE5M2B>
__device__ __forceinline__ void pipelined_tile(const Consumer& c, int q, bool first, float (&acc)[64],
                                               float (&cur)[64], float (&prev)[64]) {
  const int s = q % kStages;
  mbar_wait(&c.full[s], (q / kStages) & 1);
  const uint8_t* st = c.smem + s * kStageBytes;
  const uint32_t a_addr = smem_u32(st) + c.cw * 64 * kBK, b_addr = smem_u32(st + kABytes);
#pragma unroll
  for (int i = 0; i < 64; ++i) fence_operand(cur[i]);
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
  for (int j = 0; j < 4; ++j)
    wgmma_m64n128k32<kE5M2A, kE5M2B>(cur, sw128_desc(a_addr + 32 * j), sw128_desc(b_addr + 32 * j), j > 0);
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
#pragma unroll
  for (int i = 0; i < 64; ++i) fence_operand(prev[i]);
  if (!first) finish_tile<kJ>(c, q - 1, acc, prev);
}

// kJ: scale slots per 128-wide K tile: 4 (MX), 1 (block), 0 (per-tensor).
template <int kJ, bool kE5M2A, bool kE5M2B, bool kF32>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_wgmma_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                       const __grid_constant__ CUtensorMap tm_sa, const __grid_constant__ CUtensorMap tm_sb,
                       const Params p) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma and setmaxnreg exist on sm_90a only; the host never launches this elsewhere
#else
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  // A ring slot is free once the consumers of every CTA of the cluster have released it (8 warps each).
  const int rank = int(cluster_rank());
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 8 * p.cluster);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  cluster_sync();  // the other CTA's barriers are initialised before anything arrives on them
  // Persistent: this cluster takes the cluster tiles blockIdx.x / cluster, + gridDim.x / cluster, ...; the
  // producer runs ahead into the next tile's K tiles while the consumers store this one. q counts K tiles over
  // all of the CTA's tiles: the ring slot is q % kStages and its phase (q / kStages) & 1. Both CTAs of a
  // cluster take the same tile row, so they skip the same tiles and count the same q.
  const int tiles = p.slots * int(cdiv(p.cols, p.cluster)), ktiles = int(cdiv(p.k, kBK)), wg = threadIdx.x / 128;
  const int first = blockIdx.x / p.cluster, step = gridDim.x / p.cluster;

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int q = 0;
      const uint16_t everyone = uint16_t((1 << p.cluster) - 1);
      for (int tile = first; tile < tiles; tile += step) {
        int64_t row0, row_end;
        int col;
        const int64_t group = tile_rows(p, tile, rank, &row0, &row_end, &col);
        if (group < 0) continue;
        const int brow0 = int(group * p.n) + col * kBN;
        for (int kt = 0; kt < ktiles; ++kt, ++q) {
          const int s = q % kStages;
          if (q >= kStages) mbar_wait(&empty[s], ((q / kStages) - 1) & 1);
          uint8_t* st = smem + s * kStageBytes;
          mbar_expect_tx(&full[s], tx_bytes(kJ));
          // the A tile's two 64-row halves: in a pair, each CTA loads its own into both CTAs
          for (int h = rank; h < 2; h += p.cluster) {
            uint8_t* half = st + h * (kABytes / 2);
            if (p.cluster == 1) tma_2d(half, &tm_a, &full[s], kt * kBK, int(row0) + h * (kBM / 2));
            else tma_2d_multicast(half, &tm_a, &full[s], kt * kBK, int(row0) + h * (kBM / 2), everyone);
          }
          tma_2d(st + kABytes, &tm_b, &full[s], kt * kBK, brow0);
          if constexpr (kJ > 0) {
            tma_3d(st + kABytes + kBBytes, &tm_sa, &full[s], int(row0) & ~3, 0, kt);
            tma_3d(st + kABytes + kBBytes + kSABytes, &tm_sb, &full[s], brow0 & ~3, 0, kt);
          }
        }
      }
    }
  } else {  // consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int cw = wg - 1, t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
    const int rl = warp * 16 + lane / 4;  // this thread's rows in the warpgroup's 64: rl and rl + 8
    const int cl = 2 * (lane % 4);        // its columns: 8 i + cl and 8 i + cl + 1, i < 16
    float acc[64], d[64], d2[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.0f, d2[i] = 0.0f;
    int q = 0;
    for (int tile = first; tile < tiles; tile += step) {
      int64_t row0, row_end;
      int tcol;
      const int64_t group = tile_rows(p, tile, rank, &row0, &row_end, &tcol);
      if (group < 0) continue;
      const int n0 = tcol * kBN, brow0 = int(group * p.n) + n0;
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.0f;

      if constexpr (kJ == 4) {
        for (int kt = 0; kt < ktiles; ++kt) {
          const int s = (q + kt) % kStages;
          mbar_wait(&full[s], ((q + kt) / kStages) & 1);
          uint8_t* st = smem + s * kStageBytes;
          const uint32_t a_addr = smem_u32(st) + cw * 64 * kBK, b_addr = smem_u32(st + kABytes);
          const float* sa = reinterpret_cast<const float*>(st + kABytes + kBBytes) + (row0 & 3) + cw * 64;
          const float* sb = reinterpret_cast<const float*>(st + kABytes + kBBytes + kSABytes) + (brow0 & 3);
#pragma unroll
          for (int j = 0; j < 4; ++j) {  // one MX block: 32 K = 32 bytes along the swizzled 128-byte rows
#pragma unroll
            for (int i = 0; i < 64; ++i) fence_operand(d[i]);
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
            wgmma_m64n128k32<kE5M2A, kE5M2B>(d, sw128_desc(a_addr + 32 * j), sw128_desc(b_addr + 32 * j), 0);
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
            for (int i = 0; i < 64; ++i) fence_operand(d[i]);
            scale_add(acc, d, sa + j * kSRows, sb + j * kSRows, rl, cl);
          }
          release(empty, s, lane, p.cluster, rank);
        }
      } else {  // two partial sets: tile kt's wgmmas run into one while tile kt - 1's is promoted from the other
        const Consumer c{smem, full, empty, cw, rl, cl, lane, int(row0 & 3), brow0 & 3, p.cluster, rank};
        int kt = 0;
        for (; kt + 1 < ktiles; kt += 2) {
          pipelined_tile<kJ, kE5M2A, kE5M2B>(c, q + kt, kt == 0, acc, d, d2);
          pipelined_tile<kJ, kE5M2A, kE5M2B>(c, q + kt + 1, false, acc, d2, d);
        }
        if (kt < ktiles) {  // an odd count: the last tile into d
          pipelined_tile<kJ, kE5M2A, kE5M2B>(c, q + kt, kt == 0, acc, d, d2);
          asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
          for (int i = 0; i < 64; ++i) fence_operand(d[i]);
          finish_tile<kJ>(c, q + kt, acc, d);
        } else {
          asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
          for (int i = 0; i < 64; ++i) fence_operand(d2[i]);
          finish_tile<kJ>(c, q + kt - 1, acc, d2);
        }
      }

      const float alpha = kJ == 0 ? p.alpha_a[0] * p.alpha_b[group] : 1.0f;  // per-tensor scales
      store_fragment<kF32>(p, acc, row0 + cw * 64 + rl, row_end, n0 + cl, alpha, group * p.n);
      q += ktiles;
    }
  }
  cluster_sync();  // no CTA leaves while the other may still arrive on its barriers
#endif
}

template <int kJ, bool kE5M2A, bool kE5M2B, bool kF32>
std::string launch(const CUtensorMap* maps, const Params& p, cudaStream_t s) {
  return launch_persistent(fp8_wgmma_kernel<kJ, kE5M2A, kE5M2B, kF32>, kThreads, kSmemBytes, maps, p, s);
}

template <int kJ>
std::string launch_types(bool e5m2_a, bool e5m2_b, bool f32, const CUtensorMap* maps, const Params& p,
                         cudaStream_t s) {
  if (e5m2_a) {
    if (e5m2_b) return f32 ? launch<kJ, true, true, true>(maps, p, s) : launch<kJ, true, true, false>(maps, p, s);
    return f32 ? launch<kJ, true, false, true>(maps, p, s) : launch<kJ, true, false, false>(maps, p, s);
  }
  if (e5m2_b) return f32 ? launch<kJ, false, true, true>(maps, p, s) : launch<kJ, false, true, false>(maps, p, s);
  return f32 ? launch<kJ, false, false, true>(maps, p, s) : launch<kJ, false, false, false>(maps, p, s);
}

// CTAs per cluster: 2 (the pair shares its A tile through multicast, 0.75x the L2 traffic per output tile),
// unless an odd number of tile columns would leave a spare column computed for nothing in more than 1/9 of the
// work (1, 3, 5 or 7 columns); JAXHQ_WGMMA_CLUSTER=1 turns the pairing off (for measurements).
int cluster_size(int64_t cols) {
  const char* env = std::getenv("JAXHQ_WGMMA_CLUSTER");
  return (cols % 2 == 0 || cols >= 9) && !(env && std::string(env) == "1") ? 2 : 1;
}

int slots_of(int scaling) { return scaling == kScaleMx ? 4 : scaling == kScaleBlock ? 1 : 0; }

}  // namespace

int64_t wgmma_scale_bytes(int scaling, int64_t rows, int64_t k) {
  return (cdiv(k, kBK) * slots_of(scaling) * rows4(rows) * 4 + 255) / 256 * 256;
}

std::string wgmma_unsupported(const WgmmaOperand& a, const WgmmaOperand& b, int64_t n, int64_t k, const void* out) {
  if (k <= 0) return "K = " + std::to_string(k) + " (nothing to contract)";
  if (k % 16) return "K = " + std::to_string(k) + " is not a multiple of 16 (TMA row stride)";
  if (n % 2) return "N = " + std::to_string(n) + " is odd (paired output stores)";
  for (const void* ptr : {static_cast<const void*>(a.data), static_cast<const void*>(b.data), out})
    if (reinterpret_cast<uintptr_t>(ptr) % 16) return "an operand is not 16-byte aligned";
  if ((cdiv(a.rows, kBM) + 1024) * cdiv(n, kBN) >= (int64_t(1) << 31) || b.rows > (int64_t(1) << 30))
    return "too many output tiles for one launch";
  return "";
}

std::string wgmma_gemm(int scaling, const WgmmaOperand& a, const WgmmaOperand& b, int64_t n, int64_t k,
                       const int32_t* group_sizes, int64_t groups, void* out, bool out_f32, const void* bias,
                       bool accumulate, void* sa_tmp, void* sb_tmp, cudaStream_t s) {
  if (std::string why = wgmma_unsupported(a, b, n, k, out); !why.empty()) return why;
  if (scaling != kScaleMx && scaling != kScaleBlock && scaling != kScaleTensor)
    return "unknown scaling " + std::to_string(scaling);
  if (a.blocks128) return "A (ragged rows) cannot have 128x128 scales";
  if (groups > 1024) return "more than 1024 groups";
  if (a.rows == 0 || n == 0) return "";
  const int j = slots_of(scaling);
  CUtensorMap maps[4] = {};
  // A in 64-row halves (one per CTA of a cluster), B in whole 128-row tiles
  for (std::string e : {make_map(&maps[0], a.data, 0, a.rows, k, kBM / 2), make_map(&maps[1], b.data, 0, b.rows, k)})
    if (!e.empty()) return e;
  if (j > 0) {
    for (int i = 0; i < 2; ++i) {
      const WgmmaOperand& o = i ? b : a;
      const int64_t ld = rows4(o.rows), total = cdiv(k, kBK) * j * ld;
      const int64_t group_rows = o.blocks128 ? (groups > 0 ? n : o.rows) : 0;
      tile_scales_kernel<<<unsigned(std::min<int64_t>(cdiv(total, 256), 4096)), 256, 0, s>>>(
          o.scales, j, o.rows, k, ld, group_rows, static_cast<float*>(i ? sb_tmp : sa_tmp));
    }
    if (cudaError_t ce = cudaGetLastError(); ce != cudaSuccess)
      return std::string("scale re-layout: ") + cudaGetErrorString(ce);
    for (std::string e : {make_map(&maps[2], sa_tmp, j, a.rows, k), make_map(&maps[3], sb_tmp, j, b.rows, k)})
      if (!e.empty()) return e;
  }
  const int64_t slots = cdiv(a.rows, kBM) + groups, cols = cdiv(n, kBN);
  Params p{out, bias, group_sizes, nullptr, nullptr, a.rows, n, k, int32_t(groups), int32_t(accumulate),
           int32_t(slots), int32_t(cols), cluster_size(cols)};
  if (j == 0) p.alpha_a = static_cast<const float*>(a.scales), p.alpha_b = static_cast<const float*>(b.scales);
  std::string e = j == 4   ? launch_types<4>(a.e5m2, b.e5m2, out_f32, maps, p, s)
                  : j == 1 ? launch_types<1>(a.e5m2, b.e5m2, out_f32, maps, p, s)
                           : launch_types<0>(a.e5m2, b.e5m2, out_f32, maps, p, s);
  if (!e.empty() || groups == 0 || accumulate) return e;
  return zero_past_groups(out, group_sizes, groups, a.rows, n, out_f32, s);
}

std::string zero_past_groups(void* out, const int32_t* group_sizes, int64_t groups, int64_t m, int64_t n,
                             bool out_f32, cudaStream_t s) {
  if (m * n == 0) return "";
  zero_past_groups_kernel<<<unsigned(std::min<int64_t>(cdiv(m * n, 256), 1024)), 256, 0, s>>>(
      out, group_sizes, int(groups), m, n, out_f32 ? 4 : 2);
  cudaError_t ce = cudaGetLastError();
  return ce == cudaSuccess ? "" : cudaGetErrorString(ce);
}

}  // namespace gemm
}  // namespace jaxhq
