// Grouped (MoE) per-tensor FP8 GEMM on CUTLASS's sm90 pointer-array kernel, with every group's problem read on
// the device: a one-block prologue turns the device-side group sizes into CUTLASS's per-group problem shapes,
// operand pointers, strides and alphas (sa * sb[g]) in the call's workspace, and the persistent kernel's group
// scheduler walks them there. No host synchronisation and no host-side per-group loop, so the call is recorded
// into CUDA graphs like the dense GEMMs.
#include "fp8_cutlass_grouped.h"

#include <algorithm>
#include <mutex>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace jaxhq {
namespace gemm {
namespace {

using namespace cute;
using Shape3 = Shape<int, int, int>;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape3>;

// A kernel's tile configuration: its tile (M x N, 128-wide K steps), cluster and schedule (cooperative: two
// consumer warpgroups split the tile's rows).
template <int M, int N, int CM, int CN, bool kFast>
struct Cfg {
  using TileShape = Shape<Int<M>, Int<N>, _128>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;
  using Schedule = cute::conditional_t<kFast, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// The two accumulations, chosen by measurement (docs/gemm.md, H100): promoted, the FP8 mainloop adds the tensor
// core's partial sums into FP32 registers every 128-wide K step, so a warpgroup holds 64 x 128 accumulators and
// as many partial sums: 128 x 128 tiles, clusters of two CTAs along N sharing A's tile (TMA multicast); fast, no
// promotion: 128 x 256 tiles, clusters of two along M sharing B's tile.
using Promoted = Cfg<128, 128, 1, 2, false>;
using Fast = Cfg<128, 256, 2, 1, true>;

template <typename TA, typename TB, typename TOut, typename C>
struct Kernel {
  using TileShape = typename C::TileShape;
  using ClusterShape = typename C::ClusterShape;
  using Schedule = typename C::Schedule;
  using EpilogueSchedule = typename C::EpilogueSchedule;
  using LayoutA = cutlass::layout::RowMajor;     // A [T, K]
  using LayoutB = cutlass::layout::ColumnMajor;  // B [N, K] read as K x N
  using LayoutD = cutlass::layout::RowMajor;     // out [T, N]
  static constexpr int kAlignAB = 16, kAlignD = 16 / sizeof(TOut);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, TOut, LayoutD*, kAlignD, TOut, LayoutD*, kAlignD,
      EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<TOut, float, TOut, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TA, LayoutA*, kAlignAB, TB, LayoutB*, kAlignAB, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
  static_assert(cute::is_same_v<StrideA, Stride<int64_t, _1, _0>> && cute::is_same_v<StrideB, Stride<int64_t, _1, _0>> &&
                    cute::is_same_v<StrideD, Stride<int64_t, _1, _0>>,
                "the prologue writes row strides (K, 1, 0) / (N, 1, 0)");
};

// The per-group tables the prologue writes, carved out of the workspace's front (each 256-byte aligned).
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
  size_t bytes;

  Tables(void* base, int64_t groups) {
    char* p = static_cast<char*>(base);
    size_t at = 0;
    auto take = [&](auto*& field, size_t each) {
      field = reinterpret_cast<std::remove_reference_t<decltype(field)>>(p ? p + at : nullptr);
      at += (each * size_t(groups) + 255) / 256 * 256;
    };
    take(shapes, sizeof(Shape3));
    take(a, sizeof(void*));
    take(b, sizeof(void*));
    take(d, sizeof(void*));
    take(sa, sizeof(typename K::StrideA));
    take(sb, sizeof(typename K::StrideB));
    take(sd, sizeof(typename K::StrideD));
    take(alpha, sizeof(float));
    bytes = at;
  }
};

__device__ __forceinline__ int64_t clamp_rows(int32_t size, int64_t left) {
  return size < 0 ? 0 : (int64_t(size) < left ? int64_t(size) : left);
}

// One block, one thread per group: group g's rows start where the clamped sizes before it end.
template <typename K>
__global__ void prologue_kernel(Tables<K> tab, const int32_t* __restrict__ gs, int groups, int64_t t, int n, int k,
                                const uint8_t* a, const uint8_t* b, void* out, const float* __restrict__ sa,
                                const float* __restrict__ sb) {
  using TOut = typename K::Gemm::ElementD;
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    int64_t start = 0;
    for (int i = 0; i < g; ++i) start += clamp_rows(gs[i], t - start);
    const int m = int(clamp_rows(gs[g], t - start));
    tab.shapes[g] = Shape3{m, n, k};
    tab.a[g] = reinterpret_cast<const typename K::Gemm::ElementA*>(a + start * k);
    tab.b[g] = reinterpret_cast<const typename K::Gemm::ElementB*>(b + int64_t(g) * n * k);
    tab.d[g] = static_cast<TOut*>(out) + start * n;
    // row strides of the K-major A and B and the row-major output (the other modes are static 1 and 0)
    typename K::StrideA sta{};
    typename K::StrideB stb{};
    typename K::StrideD std_{};
    get<0>(sta) = k, get<0>(stb) = k, get<0>(std_) = n;
    tab.sa[g] = sta, tab.sb[g] = stb, tab.sd[g] = std_;
    tab.alpha[g] = sa[0] * sb[g];
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

template <typename K>
typename K::Gemm::Arguments arguments(const Tables<K>& tab, int64_t groups, bool accumulate) {
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count();
  typename K::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {int(groups), tab.shapes, nullptr},  // the problem shapes live on the device only
      {tab.a, tab.sa, tab.b, tab.sb},
      {{}, const_cast<const typename K::Gemm::ElementD**>(tab.d), tab.sd, tab.d, tab.sd},
      hw};
  auto& f = args.epilogue.thread;
  f.alpha_ptr = tab.alpha;  // one alpha per group: alpha_ptr[g]
  f.dAlpha = {_0{}, _0{}, 1};
  f.beta = accumulate ? 1.f : 0.f;  // out += result reads C = out in place
  return args;
}

template <typename K>
size_t workspace_bytes_of(int64_t groups) {
  Tables<K> tab(nullptr, groups);
  return tab.bytes + K::Gemm::get_workspace_size(arguments<K>(tab, groups, false));
}

template <typename K>
std::string run(const CutlassGrouped& p, cudaStream_t s) {
  Tables<K> tab(p.workspace, p.groups);
  auto args = arguments<K>(tab, p.groups, p.accumulate);
  const size_t need = tab.bytes + K::Gemm::get_workspace_size(args);
  if (size_t(p.workspace_bytes) < need)
    return "workspace of " + std::to_string(p.workspace_bytes) + " bytes, needs " + std::to_string(need);
  prologue_kernel<K><<<1, int(std::min<int64_t>(p.groups, 1024)), 0, s>>>(
      tab, p.group_sizes, int(p.groups), p.t, int(p.n), int(p.k), p.a, p.b, p.out, p.scale_a, p.scale_b);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return std::string("prologue: ") + cudaGetErrorString(e);
  typename K::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "CUTLASS cannot implement this problem";
  void* ws = static_cast<char*>(p.workspace) + tab.bytes;
  if (cutlass::Status st = gemm.initialize(args, ws, s); st != cutlass::Status::kSuccess)
    return std::string("CUTLASS initialize: ") + cutlassGetStatusString(st);
  if (cutlass::Status st = gemm.run(s); st != cutlass::Status::kSuccess)
    return std::string("CUTLASS run: ") + cutlassGetStatusString(st);
  return "";
}

// The instantiations: E4M3 x E4M3 (forward) and E5M2 x E4M3 (dgrad of an E5M2 gradient), bf16 out.
template <typename F>
std::string dispatch(const CutlassGrouped& p, F&& f) {
  using e4 = cutlass::float_e4m3_t;
  using e5 = cutlass::float_e5m2_t;
  using bf = cutlass::bfloat16_t;
  if (p.b_e5m2) return "B in E5M2 has no grouped CUTLASS kernel";
  if (p.out_f32) return "fp32 output has no grouped CUTLASS kernel";
  if (p.fast_accum) return p.a_e5m2 ? f(Kernel<e5, e4, bf, Fast>{}) : f(Kernel<e4, e4, bf, Fast>{});
  return p.a_e5m2 ? f(Kernel<e5, e4, bf, Promoted>{}) : f(Kernel<e4, e4, bf, Promoted>{});
}

}  // namespace

std::string cutlass_grouped_unsupported(const CutlassGrouped& p) {
  if (p.k % 16) return "K % 16 != 0 (TMA row stride)";
  if (p.n % 8) return "N % 8 != 0 (output rows of 16 bytes)";
  if (p.groups > 1024) return "more than 1024 groups";
  if (p.t > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX) return "a dimension past int32";
  return dispatch(p, [](auto) { return std::string(); });
}

int64_t cutlass_grouped_workspace_bytes(const CutlassGrouped& p) {
  int64_t bytes = 0;
  dispatch(p, [&](auto kernel) {
    bytes = int64_t(workspace_bytes_of<decltype(kernel)>(std::max<int64_t>(p.groups, 1)));
    return std::string();
  });
  return bytes;
}

std::string cutlass_grouped_gemm(const CutlassGrouped& p, cudaStream_t s) {
  if (std::string why = cutlass_grouped_unsupported(p); !why.empty()) return why;
  if (p.groups == 0 || p.t == 0 || p.n == 0) return "";
  return dispatch(p, [&](auto kernel) { return run<decltype(kernel)>(p, s); });
}

}  // namespace gemm
}  // namespace jaxhq
