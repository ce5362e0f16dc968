// Grouped (MoE) per-tensor and blockwise FP8 GEMMs on CUTLASS's sm90 pointer-array kernels, with every group's
// problem read on the device: a one-block prologue turns the device-side group sizes into CUTLASS's per-group
// problem shapes, operand pointers, strides and alphas (sa * sb[g]; blockwise: scale pointers) in the call's
// workspace, and the persistent kernel's group scheduler walks them there. No host synchronisation and no
// host-side per-group loop, so the call is recorded into CUDA graphs like the dense GEMMs. Two groupings: along
// the rows of A (the forward and dgrad of MoE: each group's rows times its own weight) and along K (the wgrad:
// each group's segment of the token axis, out[g] = A[:, seg] @ B[:, seg]^T). This file: the blockwise and bf16
// kernels, the grouping along K and the entry points; the per-tensor kernels are in fp8_cutlass_grouped_tensor.cu,
// the shared machinery in cutlass_grouped.cuh.
#include "cutlass_grouped.cuh"

namespace jaxhq {
namespace gemm {
namespace {

// ---- Grouped along K (the MoE wgrad): out[g] = A[:, seg g] @ B[:, seg g]^T, A [m, t] and B [n, t] FP8 with
// 1x128 blocks along t on both (or bf16 values, no scales), consecutive segments of the sizes rounded up to 128
// (each segment whole blocks).
using KGroupedFp8 = Kernel<E4, E4, BF, Blockwise, 1>;
using KGroupedBf16 = Kernel<BF, BF, BF, Bf16>;

// A segment's length: its size rounded up to whole 128-blocks, clamped to the `left` columns (a multiple of 128).
__device__ __forceinline__ int64_t segment_cols(int32_t size, int64_t left) {
  const int64_t r = size <= 0 ? 0 : cdiv(size, 128) * 128;
  return r < left ? r : left;
}

__device__ __forceinline__ void segment_of(const int32_t* __restrict__ sizes, int g, int64_t t, int64_t* start,
                                           int64_t* cols) {
  int64_t at = 0;
  for (int i = 0; i < g; ++i) at += segment_cols(sizes[i], t - at);
  *start = at;
  *cols = segment_cols(sizes[g], t - at);
}

// The scales come [t/128][rows] (M- and N-major, as the quantize launch writes 1x128 scales), so every segment's
// scales sit compact at (its first column / 128) * rows, as the kernel reads them: no re-layout.
template <typename K>
__global__ void kgrouped_prologue_kernel(Tables<K> tab, const int32_t* __restrict__ sizes, int groups, int64_t t,
                                         int m, int n, const void* a, const void* b, void* out,
                                         const float* __restrict__ sa, const float* __restrict__ sb) {
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    int64_t start, cols;
    segment_of(sizes, g, t, &start, &cols);
    const int k = cols ? int(cols) : 128;  // an empty segment: no rows, so no tiles (zero_empty_segments writes 0)
    tab.shapes[g] = Shape3{cols ? m : 0, n, k};
    tab.a[g] = static_cast<const typename K::Gemm::ElementA*>(a) + start;
    tab.b[g] = static_cast<const typename K::Gemm::ElementB*>(b) + start;
    tab.d[g] = static_cast<typename K::Gemm::ElementD*>(out) + int64_t(g) * m * n;
    typename K::StrideA sta{};
    typename K::StrideB stb{};
    typename K::StrideD std_{};
    get<0>(sta) = t, get<0>(stb) = t, get<0>(std_) = n;  // both operands' rows span all t columns
    tab.sa[g] = sta, tab.sb[g] = stb, tab.sd[g] = std_;
    if constexpr (K::kBlockwise) {
      tab.sfa[g] = sa + start / 128 * m;
      tab.sfb[g] = sb + start / 128 * n;
      tab.layout_sfa[g] = K::ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
      tab.layout_sfb[g] = K::ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
    } else {
      tab.alpha[g] = 1.f;
    }
  }
}

// out[g] = 0 for the groups whose segment is empty (the kernel computes no tile of theirs).
__global__ void zero_empty_segments_kernel(const int32_t* __restrict__ sizes, int64_t t, uint16_t* out, int64_t mn) {
  __shared__ int64_t cols;
  if (threadIdx.x == 0) {
    int64_t start;
    segment_of(sizes, int(blockIdx.y), t, &start, &cols);
  }
  __syncthreads();
  if (cols) return;
  uint16_t* o = out + int64_t(blockIdx.y) * mn;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < mn; i += int64_t(gridDim.x) * blockDim.x)
    o[i] = 0;
}

template <typename K>
Tables<K> kgrouped_tables(void* base, const CutlassKGrouped& p) {
  return Tables<K>(base, p.groups, 0, 0);  // the scales are read where they lie
}

template <typename K>
int64_t kgrouped_workspace_bytes(const CutlassKGrouped& p) {
  Tables<K> tab = kgrouped_tables<K>(nullptr, p);
  return int64_t(tab.bytes + K::Gemm::get_workspace_size(arguments<K>(tab, p.groups, false)));
}

template <typename K>
std::string run_kgrouped(const CutlassKGrouped& p, cudaStream_t s) {
  Tables<K> tab = kgrouped_tables<K>(p.workspace, p);
  const TileOrder order = tile_order();
  if (!order.error.empty()) return order.error;
  auto args = arguments<K>(tab, p.groups, false, order);
  if (std::string e = enough(tab, args, p.workspace_bytes); !e.empty()) return e;
  kgrouped_prologue_kernel<K><<<1, int(std::min<int64_t>(p.groups, 1024)), 0, s>>>(
      tab, p.segment_sizes, int(p.groups), p.t, int(p.m), int(p.n), p.a, p.b, p.out, p.scale_a, p.scale_b);
  zero_empty_segments_kernel<<<dim3(unsigned(std::min<int64_t>(cdiv(p.m * p.n, 256), 64)), unsigned(p.groups)), 256,
                               0, s>>>(p.segment_sizes, p.t, static_cast<uint16_t*>(p.out), p.m * p.n);
  return launch(tab, args, p.workspace, p.workspace_bytes, s);
}

// The row-grouped kernels of this file, bf16 out: blockwise (1x128 A, 128x128 B) E4M3 x E4M3, and bf16 x bf16
// (dequantized MXFP8 / NVFP4, the bf16 recipe: the same kernel as the bf16 grouping along K). The per-tensor ones
// (promoted or fast accumulation, E4M3 or E5M2 A) are in fp8_cutlass_grouped_tensor.cu.
using BlockRows = Kernel<E4, E4, BF, Blockwise>;
using Bf16Rows = KGroupedBf16;

// Why no kernel takes p's operands and options ("" when one does).
std::string no_kernel(const CutlassGrouped& p) {
  if (p.b_e5m2) return "B in E5M2 has no grouped CUTLASS kernel";
  if (p.out_f32) return "fp32 output has no grouped CUTLASS kernel";
  if (p.bf16) {
    if (p.blockwise || p.fast_accum || p.a_e5m2 || p.scale_a || p.scale_b)
      return "bf16 operands take no scales or FP8 options";
    if (!p.nvfp4_amax_a != !p.nvfp4_amax_b) return "NVFP4 global scales need both operands' amaxes";
  } else if (p.blockwise) {
    if (p.fast_accum) return "blockwise scaling has no fast accumulation";
    if (p.a_e5m2) return "blockwise E5M2 A has no grouped CUTLASS kernel";  // the blockwise quantizer is E4M3
  }
  return "";
}

}  // namespace

std::string cutlass_kgrouped_unsupported(const CutlassKGrouped& p) {
  if (p.t % 128) return "T % 128 != 0 (segments of whole 128-blocks)";
  if (p.n % 8) return "N % 8 != 0 (output rows of 16 bytes)";
  if (p.groups > 1024) return "more than 1024 groups";
  if (p.t > INT32_MAX || p.m > INT32_MAX || p.n > INT32_MAX) return "a dimension past int32";
  return "";
}

int64_t cutlass_kgrouped_workspace_bytes(const CutlassKGrouped& p) {
  return p.bf16 ? kgrouped_workspace_bytes<KGroupedBf16>(p) : kgrouped_workspace_bytes<KGroupedFp8>(p);
}

std::string cutlass_kgrouped_gemm(const CutlassKGrouped& p, cudaStream_t s) {
  if (std::string why = cutlass_kgrouped_unsupported(p); !why.empty()) return why;
  if (p.groups == 0 || p.m == 0 || p.n == 0) return "";
  return p.bf16 ? run_kgrouped<KGroupedBf16>(p, s) : run_kgrouped<KGroupedFp8>(p, s);
}

std::string cutlass_grouped_unsupported(const CutlassGrouped& p) {
  if (p.k % 16) return "K % 16 != 0 (TMA row stride)";
  if (p.n % 8) return "N % 8 != 0 (output rows of 16 bytes)";
  if (p.groups > 1024) return "more than 1024 groups";
  if (p.t > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX) return "a dimension past int32";
  return no_kernel(p);
}

int64_t cutlass_grouped_workspace_bytes(const CutlassGrouped& p) {
  if (!no_kernel(p).empty()) return 0;
  return p.bf16        ? int64_t(workspace_bytes_of<Bf16Rows>(p))
         : p.blockwise ? int64_t(workspace_bytes_of<BlockRows>(p))
                       : tensor_grouped_workspace_bytes(p);
}

std::string cutlass_grouped_gemm(const CutlassGrouped& p, cudaStream_t s) {
  if (std::string why = cutlass_grouped_unsupported(p); !why.empty()) return why;
  if (p.groups > 0 && p.t > 0 && p.n > 0) {
    const std::string e = p.bf16 ? run<Bf16Rows>(p, s) : p.blockwise ? run<BlockRows>(p, s) : tensor_grouped_gemm(p, s);
    if (!e.empty()) return e;
  }
  if (p.accumulate) return "";
  const std::string e = zero_past_groups(p.out, p.group_sizes, p.groups, p.t, p.n, p.out_f32, s);  // no groups: all
  return e.empty() ? "" : "zeroing the rows past the groups: " + e;
}

}  // namespace gemm
}  // namespace jaxhq
