// The machinery of the grouped GEMMs on CUTLASS's sm90 pointer-array kernels (fp8_cutlass_grouped.h): kernel
// configurations, the per-group tables, their device-side prologues and the launch. Included by the two files that
// instantiate the kernels, fp8_cutlass_grouped_tensor.cu (per-tensor FP8) and fp8_cutlass_grouped.cu (the rest),
// split so that the build compiles them in parallel (each kernel's device code takes most of a file's compile).
#pragma once
#include "fp8_cutlass_grouped.h"

#include "fp8_wgmma.h"  // zero_past_groups
#include "numerics.h"   // nvfp4_global_decode

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace jaxhq {
namespace gemm {

// The per-tensor FP8 kernels (promoted or fast accumulation, E4M3 or E5M2 A), in fp8_cutlass_grouped_tensor.cu.
int64_t tensor_grouped_workspace_bytes(const CutlassGrouped& p);
std::string tensor_grouped_gemm(const CutlassGrouped& p, cudaStream_t s);

namespace {

using namespace cute;
using Shape3 = Shape<int, int, int>;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape3>;

// A kernel's configuration: its tile (M x N, K-wide steps: 128 for FP8), cluster and schedule (cooperative: two
// consumer warpgroups split the tile's rows).
template <int M, int N, int CM, int CN, typename S, int K = 128>
struct Cfg {
  using TileShape = Shape<Int<M>, Int<N>, Int<K>>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;
  using Schedule = S;
};

// Chosen by measurement (docs/gemm.md, H100). Promoted: the FP8 mainloop adds the tensor core's partial sums
// into FP32 registers every 128-wide K step, so a warpgroup holds its accumulators twice: 128 x 192 tiles (64 x
// 192 per warpgroup, the widest that fits the registers), no cluster. Fast: no promotion, 128 x 256 tiles,
// clusters of two along M sharing B's tile (TMA multicast). Blockwise: 1x128 A and 128x128 B scales applied at
// each promotion (B's 128-wide scale blocks fix the tile's N), 128 x 128 tiles, clusters of two along M.
using Promoted = Cfg<128, 192, 1, 1, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
using Fast = Cfg<128, 256, 2, 1, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum>;
using Blockwise = Cfg<128, 128, 2, 1, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>;
// bf16 operands (decoded MXFP8 / NVFP4 copies, the bf16 recipe): 128 x 256 tiles, 64-wide K steps, clusters of
// two along M.
using Bf16 = Cfg<128, 256, 2, 1, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative, 64>;

using E4 = cutlass::float_e4m3_t;
using E5 = cutlass::float_e5m2_t;
using BF = cutlass::bfloat16_t;

// SFN: the columns of B (rows of the [N, K] operand) one blockwise scale covers: 128 (a 128x128 weight block) or
// 1 (1x128 blocks of an activation or gradient, the wgrad's B).
template <typename TA, typename TB, typename TOut, typename C, int SFN = 128>
struct Kernel {
  static constexpr bool kBlockwise = cute::is_same_v<C, Blockwise>;
  using LayoutA = cutlass::layout::RowMajor;     // A [T, K]
  using LayoutB = cutlass::layout::ColumnMajor;  // B [N, K] read as K x N
  using LayoutD = cutlass::layout::RowMajor;     // out [T, N]
  // blockwise scales, M- (N-) major: A's [ceil(K/128)][rows], B's [ceil(K/128)][ceil(N/SFN)] per group
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, SFN, 128>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using OperandA = cute::conditional_t<kBlockwise, cute::tuple<LayoutA*, LayoutSFA*>, LayoutA*>;
  using OperandB = cute::conditional_t<kBlockwise, cute::tuple<LayoutB*, LayoutSFB*>, LayoutB*>;
  static constexpr int kAlignAB = 16 / sizeof(TA), kAlignD = 16 / sizeof(TOut);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename C::TileShape, typename C::ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, TOut, LayoutD*, kAlignD, TOut, LayoutD*, kAlignD,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<TOut, float, TOut, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TA, OperandA, kAlignAB, TB, OperandB, kAlignAB, float,
      typename C::TileShape, typename C::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename C::Schedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
  static_assert(cute::is_same_v<StrideA, Stride<int64_t, _1, _0>> && cute::is_same_v<StrideB, Stride<int64_t, _1, _0>> &&
                    cute::is_same_v<StrideD, Stride<int64_t, _1, _0>>,
                "the prologue writes row strides (K, 1, 0) / (N, 1, 0)");
};

__host__ __device__ inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The per-group tables the prologue writes, and the blockwise scales re-laid-out M-major, carved out of the
// workspace's front (each piece 256-byte aligned); CUTLASS's own workspace follows.
template <typename K>
struct Tables {
  Shape3* shapes;
  const typename K::Gemm::ElementA** a;
  const typename K::Gemm::ElementB** b;
  typename K::Gemm::ElementD** d;
  typename K::StrideA* sa;
  typename K::StrideB* sb;
  typename K::StrideD* sd;
  float* alpha;
  const float** sfa;  // blockwise: group g's A scales (into scales_a); layout_sfa / _sfb as the kernel derives them
  const float** sfb;
  typename K::LayoutSFA* layout_sfa;
  typename K::LayoutSFB* layout_sfb;
  float* scales_a;  // blockwise, M- (N-) major as the kernel reads them (see the prologues)
  float* scales_b;
  size_t bytes;

  // count_a, count_b: the floats of the re-laid-out blockwise scales (0 for per-tensor kernels)
  Tables(void* base, int64_t groups, int64_t count_a, int64_t count_b) {
    char* p = static_cast<char*>(base);
    size_t at = 0;
    auto take = [&](auto*& field, size_t each, int64_t count) {
      field = reinterpret_cast<std::remove_reference_t<decltype(field)>>(p ? p + at : nullptr);
      at += (each * size_t(count) + 255) / 256 * 256;
    };
    take(shapes, sizeof(Shape3), groups);
    take(a, sizeof(void*), groups);
    take(b, sizeof(void*), groups);
    take(d, sizeof(void*), groups);
    take(sa, sizeof(typename K::StrideA), groups);
    take(sb, sizeof(typename K::StrideB), groups);
    take(sd, sizeof(typename K::StrideD), groups);
    take(alpha, sizeof(float), groups);
    const int64_t blk = K::kBlockwise ? 1 : 0;
    take(sfa, sizeof(void*), blk * groups);
    take(sfb, sizeof(void*), blk * groups);
    take(layout_sfa, sizeof(typename K::LayoutSFA), blk * groups);
    take(layout_sfb, sizeof(typename K::LayoutSFB), blk * groups);
    take(scales_a, sizeof(float), blk * count_a);
    take(scales_b, sizeof(float), blk * count_b);
    bytes = at;
  }
};

// Row grouping: A's scales of group g at ceil(k/128) * its first row ([kb][its rows]), B's [groups][kb][nb].
template <typename K>
Tables<K> row_tables(void* base, const CutlassGrouped& p) {
  const int64_t kb = cdiv(p.k, 128);
  return Tables<K>(base, p.groups, kb * p.t, p.groups * kb * cdiv(p.n, 128));
}

__device__ __forceinline__ int64_t clamp_rows(int32_t size, int64_t left) {
  return size < 0 ? 0 : (int64_t(size) < left ? int64_t(size) : left);
}

// The first row of group g and its clamped size (one thread's loop over the sizes before it).
__device__ __forceinline__ void group_rows(const int32_t* __restrict__ gs, int g, int64_t t, int64_t* start, int* m) {
  int64_t at = 0;
  for (int i = 0; i < g; ++i) at += clamp_rows(gs[i], t - at);
  *start = at;
  *m = int(clamp_rows(gs[g], t - at));
}

// Blockwise scales from the layouts they come in (A [kb][t], as the quantize launch writes 1x128 scales; B
// [groups][nb][kb]) to the M-major ones CUTLASS's grouped kernel reads (it derives each group's scale layout from
// the group's problem shape): A's scales of group g compact at kb * start, [kb][m]; B's [groups][kb][nb]. Block
// row y < groups re-lays group y of A, the last one B; the writes are coalesced, and A's reads.
__global__ void scales_mn_major_kernel(const float* __restrict__ sa, const int32_t* __restrict__ gs, int groups,
                                       int64_t t, int64_t kb, const float* __restrict__ sb, int64_t nb, float* out_a,
                                       float* out_b) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x, first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (int(blockIdx.y) == groups) {
    for (int64_t j = first; j < groups * kb * nb; j += stride) {
      const int64_t g = j / (kb * nb), r = j % (kb * nb);
      out_b[j] = sb[(g * nb + r % nb) * kb + r / nb];
    }
    return;
  }
  __shared__ int64_t start;
  __shared__ int m;
  if (threadIdx.x == 0) group_rows(gs, int(blockIdx.y), t, &start, &m);
  __syncthreads();
  for (int64_t i = first; i < kb * m; i += stride) out_a[kb * start + i] = sa[(i / m) * t + start + i % m];
}

// One block, one thread per group: group g's rows start where the clamped sizes before it end.
template <typename K>
__global__ void prologue_kernel(Tables<K> tab, const int32_t* __restrict__ gs, int groups, int64_t t, int n, int k,
                                const void* a, const void* b, void* out, const float* __restrict__ sa,
                                const float* __restrict__ sb, const float* __restrict__ amax_a,
                                const float* __restrict__ amax_b) {
  using TOut = typename K::Gemm::ElementD;
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    int64_t start;
    int m;
    group_rows(gs, g, t, &start, &m);
    tab.shapes[g] = Shape3{m, n, k};
    tab.a[g] = static_cast<const typename K::Gemm::ElementA*>(a) + start * k;
    tab.b[g] = static_cast<const typename K::Gemm::ElementB*>(b) + int64_t(g) * n * k;
    tab.d[g] = static_cast<TOut*>(out) + start * n;
    // row strides of the K-major A and B and the row-major output (the other modes are static 1 and 0)
    typename K::StrideA sta{};
    typename K::StrideB stb{};
    typename K::StrideD std_{};
    get<0>(sta) = k, get<0>(stb) = k, get<0>(std_) = n;
    tab.sa[g] = sta, tab.sb[g] = stb, tab.sd[g] = std_;
    if constexpr (K::kBlockwise) {  // the group's scales, where scales_mn_major_kernel wrote them
      const int64_t kb = cdiv(k, 128);
      tab.sfa[g] = tab.scales_a + kb * start;
      tab.sfb[g] = tab.scales_b + int64_t(g) * kb * cdiv(n, 128);
      tab.layout_sfa[g] = K::ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
      tab.layout_sfb[g] = K::ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
    } else {
      // bf16 operands: no scales, or NVFP4's global ones (the factor the dense dequantize path's alpha applies)
      tab.alpha[g] = sa       ? sa[0] * sb[g]
                     : amax_a ? nvfp4_global_decode(amax_a[0]) * nvfp4_global_decode(amax_b[g])
                              : 1.f;
    }
  }
}

int sm_count() {
  static std::mutex mu;
  static int counts[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  std::lock_guard<std::mutex> lock(mu);
  if (counts[dev] == 0) counts[dev] = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(dev);
  return counts[dev];
}

// The order the persistent kernels visit a problem's output tiles in: along M or N, in bands of `swizzle` (1, 2,
// 4 or 8) tiles across. Along M in bands of 4 by measurement (docs/gemm.md, "Tile order": CUTLASS's default for
// grouped problems, bands of 1, ran the per-tensor grouped and the K-grouped kernels 2-8% slower on the H200; along
// N was slower still). JAXHQ_CUTLASS_SWIZZLE and JAXHQ_CUTLASS_RASTER (m or n), read once per call before anything
// is launched, override it; `error` names a value they may not take (the call fails with it, launching nothing).
struct TileOrder {
  int swizzle = 4;
  bool along_n = false;
  std::string error;
};

TileOrder tile_order() {
  TileOrder o;
  if (const char* v = std::getenv("JAXHQ_CUTLASS_SWIZZLE")) {
    const std::string s = v;
    if (s == "1" || s == "2" || s == "4" || s == "8") o.swizzle = std::atoi(v);
    else o.error = "JAXHQ_CUTLASS_SWIZZLE must be 1, 2, 4 or 8, got '" + s + "'";
  }
  if (const char* v = std::getenv("JAXHQ_CUTLASS_RASTER")) {
    const std::string r = v;
    if (r == "n" || r == "m") o.along_n = r == "n";
    else o.error = "JAXHQ_CUTLASS_RASTER must be m or n, got '" + r + "'";
  }
  return o;
}

// CUTLASS's arguments. The tile order takes no workspace (CUTLASS's group scheduler asks for none), so the sizing
// takes the default; `enough` checks each call's own arguments.
template <typename K>
typename K::Gemm::Arguments arguments(const Tables<K>& tab, int64_t groups, bool accumulate,
                                      const TileOrder& order = TileOrder{}) {
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count();
  typename K::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {int(groups), tab.shapes, nullptr};  // the problem shapes live on the device only
  if constexpr (K::kBlockwise)
    args.mainloop = {tab.a, tab.sa, tab.b, tab.sb, tab.sfa, tab.layout_sfa, tab.sfb, tab.layout_sfb};
  else
    args.mainloop = {tab.a, tab.sa, tab.b, tab.sb};
  args.epilogue = {{}, const_cast<const typename K::Gemm::ElementD**>(tab.d), tab.sd, tab.d, tab.sd};
  args.hw_info = hw;
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  args.scheduler.max_swizzle_size = order.swizzle;
  args.scheduler.raster_order = order.along_n ? Raster::AlongN : Raster::AlongM;
  auto& f = args.epilogue.thread;
  if constexpr (!K::kBlockwise) {
    f.alpha_ptr = tab.alpha;  // one alpha per group: alpha_ptr[g]
    f.dAlpha = {_0{}, _0{}, 1};
  }
  f.beta = accumulate ? 1.f : 0.f;  // out += result reads C = out in place
  return args;
}

template <typename K>
size_t workspace_bytes_of(const CutlassGrouped& p) {
  Tables<K> tab = row_tables<K>(nullptr, p);
  return tab.bytes + K::Gemm::get_workspace_size(arguments<K>(tab, p.groups, false));
}

// The workspace check and CUTLASS's launch, once the prologue has written the tables.
template <typename K>
std::string launch(const Tables<K>& tab, const typename K::Gemm::Arguments& args, void* workspace,
                   int64_t workspace_bytes, cudaStream_t s) {
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return std::string("prologue: ") + cudaGetErrorString(e);
  typename K::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "CUTLASS cannot implement this problem";
  void* ws = static_cast<char*>(workspace) + tab.bytes;
  if (cutlass::Status st = gemm.initialize(args, ws, s); st != cutlass::Status::kSuccess)
    return std::string("CUTLASS initialize: ") + cutlassGetStatusString(st);
  if (cutlass::Status st = gemm.run(s); st != cutlass::Status::kSuccess)
    return std::string("CUTLASS run: ") + cutlassGetStatusString(st);
  return "";
}

template <typename K>
std::string enough(const Tables<K>& tab, const typename K::Gemm::Arguments& args, int64_t workspace_bytes) {
  const size_t need = tab.bytes + K::Gemm::get_workspace_size(args);
  return size_t(workspace_bytes) < need
             ? "workspace of " + std::to_string(workspace_bytes) + " bytes, needs " + std::to_string(need)
             : "";
}

template <typename K>
std::string run(const CutlassGrouped& p, cudaStream_t s) {
  Tables<K> tab = row_tables<K>(p.workspace, p);
  const TileOrder order = tile_order();
  if (!order.error.empty()) return order.error;
  auto args = arguments<K>(tab, p.groups, p.accumulate, order);
  if (std::string e = enough(tab, args, p.workspace_bytes); !e.empty()) return e;
  if constexpr (K::kBlockwise) {
    const int64_t kb = cdiv(p.k, 128), nb = cdiv(p.n, 128);
    const dim3 grid(unsigned(std::min<int64_t>(cdiv(kb * std::max(p.t / p.groups, p.groups * nb), 256), 256)),
                    unsigned(p.groups + 1));
    scales_mn_major_kernel<<<grid, 256, 0, s>>>(p.scale_a, p.group_sizes, int(p.groups), p.t, kb, p.scale_b, nb,
                                                tab.scales_a, tab.scales_b);
  }
  prologue_kernel<K><<<1, int(std::min<int64_t>(p.groups, 1024)), 0, s>>>(
      tab, p.group_sizes, int(p.groups), p.t, int(p.n), int(p.k), p.a, p.b, p.out, p.scale_a, p.scale_b,
      p.nvfp4_amax_a, p.nvfp4_amax_b);
  return launch(tab, args, p.workspace, p.workspace_bytes, s);
}

}  // namespace
}  // namespace gemm
}  // namespace jaxhq
