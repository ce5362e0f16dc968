// What the hand-written Hopper wgmma GEMM kernels share (fp8_wgmma.cu, nvfp4_wgmma.cu): the persistent tile
// schedule, PTX wrappers for mbarriers, TMA and clusters, the epilogue's paired stores, TMA descriptors and the
// persistent launch. Every kernel takes 128 x 128 output tiles with a one-thread TMA producer warpgroup and two
// consumer warpgroups of 64 rows each.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

namespace jaxhq {
namespace gemm {
namespace wg {

constexpr int kBM = 128, kBN = 128, kBK = 128;  // output tile rows x columns; K elements per ring stage
constexpr int kBand = 8;                        // output tiles are visited in bands of 8 tile rows (see tile_of)
// A tile's scale box: TMA needs the box's first row at a 16-byte boundary, so a box starts at the tile's first
// row rounded down to a multiple of 4 and spans 4 rows more (a group's first row, and group * N for B, can be
// anywhere).
constexpr int kSRows = kBM + 4;

__host__ __device__ inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ inline int64_t rows4(int64_t r) { return (r + 3) / 4 * 4; }

struct Params {
  void* out;
  const void* bias;
  const int32_t* group_sizes;
  const float* alpha_a;  // kScaleTensor: A's scale [1] and B's per group [groups] (dense: [1])
  const float* alpha_b;
  int64_t m, n, k;
  int32_t groups, accumulate;
  int32_t slots, cols;  // tile row slots (ceil(m / 128) + groups) and tile columns
  int32_t cluster;      // CTAs per cluster (1 or 2): a cluster takes `cluster` adjacent tile columns of one tile row
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}
// Arrives on the barrier at b's offset in the shared memory of cluster CTA `rank`.
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* b, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(b)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster (a plain CTA is a cluster of one).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred P1;\nLAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(smem_u32(b)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void tma_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_u32(dst)), "l"(map), "r"(smem_u32(bar)), "r"(x), "r"(y) : "memory");
}
// The same box into the same shared-memory offset (and completion on the same barrier offset) of every CTA in
// the cluster that `mask` names.
__device__ __forceinline__ void tma_2d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y,
                                                 uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;"
      ::"r"(smem_u32(dst)), "l"(map), "r"(smem_u32(bar)), "r"(x), "r"(y), "h"(mask) : "memory");
}
__device__ __forceinline__ void tma_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y, int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
      ::"r"(smem_u32(dst)), "l"(map), "r"(smem_u32(bar)), "r"(x), "r"(y), "r"(z) : "memory");
}

// wgmma shared-memory descriptor of a K-major tile with 128-byte swizzling (8-row core groups 1024 bytes apart).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Output tile `pid` (in the order the persistent CTAs take them) -> (tile row slot, tile column). Consecutive
// tiles run down a band of kBand tile rows column by column: the ~132 tiles in flight at once share 8 A row
// tiles and ~17 B tiles, which stay in L2, instead of sweeping one tile row across every B tile (which reads B
// from HBM once per tile row when N x K is larger than L2).
__device__ __forceinline__ void tile_of(int pid, int nt, int mt, int* slot, int* col) {
  const int band = pid / (kBand * nt), first = band * kBand, rows = min(kBand, mt - first);
  const int within = pid - band * kBand * nt;
  *slot = first + within % rows, *col = within / rows;
}

// Keeps the compiler from moving accesses of `r` across a wgmma wait (the tensor core writes an accumulator
// asynchronously), or from reusing a register-operand fragment's register before the wgmma reading it is waited for.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// A consumer warp is done with ring slot s: released in this CTA and, in a cluster of two, in the other one
// (whose producer multicasts its half of A into this CTA's slot, so it waits for both CTAs' consumers).
__device__ __forceinline__ void release(uint64_t* empty, int s, int lane, int cluster, int rank) {
  __syncwarp();
  if (lane == 0) {
    mbar_arrive(&empty[s]);
    if (cluster == 2) mbar_arrive_cluster(&empty[s], rank ^ 1);
  }
}

// A group's rows as the host path counts them: negative sizes are 0, and no group runs past the rows there are.
__device__ __forceinline__ int64_t clamp_size(int32_t size, int64_t left) {
  const int64_t v = size < 0 ? 0 : size;
  return v < left ? v : left;
}

// The cluster's output tile `tile` -> this CTA's rows [row0, row_end), column tile (rank `rank` of the
// cluster's p.cluster adjacent columns; it may lie past N) and group (-1: a slot past the groups). Groups take
// ceil(size / 128) tile row slots in order (dense: one group of m rows).
__device__ __forceinline__ int64_t tile_rows(const Params& p, int tile, int rank, int64_t* row0, int64_t* row_end,
                                             int* col) {
  int slot;
  tile_of(tile, int(cdiv(p.cols, p.cluster)), p.slots, &slot, col);
  *col = *col * p.cluster + rank;
  *row0 = int64_t(slot) * kBM, *row_end = p.m;
  if (p.groups == 0) return *row0 < p.m ? 0 : -1;
  int64_t at = 0, slots = 0;
  for (int g = 0; g < p.groups; ++g) {
    const int64_t size = clamp_size(p.group_sizes[g], p.m - at), t = cdiv(size, kBM);
    if (int64_t(slot) < slots + t) {
      *row0 = at + (int64_t(slot) - slots) * kBM, *row_end = at + size;
      return g;
    }
    slots += t, at += size;
  }
  return -1;
}

template <bool kF32>
__device__ __forceinline__ void store_pair(void* out, int64_t idx, float v0, float v1, const void* bias, int64_t bi,
                                           bool accumulate) {
  if constexpr (kF32) {
    float2* p = reinterpret_cast<float2*>(static_cast<float*>(out) + idx);
    if (bias) v0 += static_cast<const float*>(bias)[bi], v1 += static_cast<const float*>(bias)[bi + 1];
    if (accumulate) {
      const float2 o = *p;
      v0 += o.x, v1 += o.y;
    }
    *p = make_float2(v0, v1);
  } else {
    __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(out) + idx);
    if (bias) {
      const __nv_bfloat16* b = static_cast<const __nv_bfloat16*>(bias) + bi;
      v0 += __bfloat162float(b[0]), v1 += __bfloat162float(b[1]);
    }
    if (accumulate) {
      const float2 o = __bfloat1622float2(*p);
      v0 += o.x, v1 += o.y;
    }
    *p = __floats2bfloat162_rn(v0, v1);
  }
}

// A consumer warpgroup's accumulator fragment (wgmma's m64 layout: acc[4i + 2h], acc[4i + 2h + 1] at row + 8h,
// columns col + 8i and + 1) times `scale`, stored with store_pair; rows from row_end and columns from N on skipped,
// bias read at bias_off + the column.
template <bool kF32, int kAcc>
__device__ __forceinline__ void store_fragment(const Params& p, const float (&acc)[kAcc], int64_t row,
                                               int64_t row_end, int64_t col, float scale, int64_t bias_off) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (row + 8 * h >= row_end) continue;
#pragma unroll
    for (int i = 0; i < kAcc / 4; ++i) {
      if (col + 8 * i >= p.n) continue;
      store_pair<kF32>(p.out, (row + 8 * h) * p.n + col + 8 * i, acc[4 * i + 2 * h] * scale,
                       acc[4 * i + 2 * h + 1] * scale, p.bias, bias_off + col + 8 * i, p.accumulate != 0);
    }
  }
}

inline PFN_cuTensorMapEncodeTiled_v12000 encode_fn(std::string* err) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  });
  if (!fn) *err = "cuTensorMapEncodeTiled is not available from the driver";
  return fn;
}

// rank-2 (uint8 [rows, k] bytes, box box_rows x box_k, 128-byte swizzle or none; j == 0) or rank-3 (fp32
// [ceil(k / 128)][j][ld], box 132 x j x 1; k in elements).
inline std::string make_map(CUtensorMap* map, const void* ptr, int j, int64_t rows, int64_t k, int box_rows = kBM,
                            int box_k = kBK, bool swizzle = true) {
  std::string err;
  auto enc = encode_fn(&err);
  if (!enc) return err;
  CUresult r;
  const cuuint32_t ones[3] = {1, 1, 1};
  if (j == 0) {
    const cuuint64_t dim[2] = {cuuint64_t(k), cuuint64_t(rows)}, stride[1] = {cuuint64_t(k)};
    const cuuint32_t box[2] = {cuuint32_t(box_k), cuuint32_t(box_rows)};
    r = enc(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(ptr), dim, stride, box, ones,
            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  } else {
    const int64_t ld = rows4(rows);
    const cuuint64_t dim[3] = {cuuint64_t(ld), cuuint64_t(j), cuuint64_t(cdiv(k, kBK))};
    const cuuint64_t stride[2] = {cuuint64_t(ld * 4), cuuint64_t(ld * j * 4)};
    const cuuint32_t box[3] = {kSRows, cuuint32_t(j), 1};
    r = enc(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, const_cast<void*>(ptr), dim, stride, box, ones,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  }
  return r == CUDA_SUCCESS ? "" : "cuTensorMapEncodeTiled failed (CUresult " + std::to_string(int(r)) + ")";
}

// Persistent launch of a wgmma kernel: as many clusters of p.cluster CTAs as the GPU holds at once (one CTA per
// SM), at most one per cluster tile. The shared-memory limit and the resident cluster count are per kernel, device
// and cluster size: set and queried on the first launch of each, not on every call.
using WgmmaKernel = void (*)(CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap, Params);
inline std::string launch_persistent(WgmmaKernel kernel, int threads, int smem_bytes, const CUtensorMap* maps,
                                     const Params& p, cudaStream_t s) {
  cudaLaunchAttribute cluster_dim[1];
  cluster_dim[0].id = cudaLaunchAttributeClusterDimension;
  cluster_dim[0].val.clusterDim.x = unsigned(p.cluster), cluster_dim[0].val.clusterDim.y = 1;
  cluster_dim[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(p.cluster)), cfg.blockDim = dim3(unsigned(threads)), cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = s, cfg.attrs = cluster_dim, cfg.numAttrs = 1;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return "cannot read the current device";
  static std::mutex mu;
  static std::map<std::tuple<WgmmaKernel, int, int>, int> resident_of;  // (kernel, device, cluster) -> clusters
  int resident = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = resident_of.find({kernel, device, p.cluster});
    if (it != resident_of.end()) {
      resident = it->second;
    } else {
      const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
      if (attr != cudaSuccess) return std::string("raising the shared-memory limit: ") + cudaGetErrorString(attr);
      const cudaError_t occ = cudaOccupancyMaxActiveClusters(&resident, kernel, &cfg);
      if (occ != cudaSuccess || resident <= 0)
        return std::string("no cluster of ") + std::to_string(p.cluster) + " CTAs fits on this GPU" +
               (occ != cudaSuccess ? std::string(": ") + cudaGetErrorString(occ) : std::string());
      resident_of[{kernel, device, p.cluster}] = resident;
    }
  }
  const int64_t cluster_tiles = int64_t(p.slots) * cdiv(p.cols, p.cluster);
  cfg.gridDim = dim3(unsigned(std::min<int64_t>(cluster_tiles, resident) * p.cluster));
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, maps[0], maps[1], maps[2], maps[3], p);
  return e == cudaSuccess ? "" : cudaGetErrorString(e);
}

}  // namespace wg
}  // namespace gemm
}  // namespace jaxhq
