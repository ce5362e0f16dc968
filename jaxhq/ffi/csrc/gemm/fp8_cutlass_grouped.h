// Grouped (MoE) FP8 GEMM on CUTLASS's sm90 pointer-array kernels (built when the CUTLASS headers are found;
// JAXHQ_WITH_CUTLASS): out[t] = A[t] @ B[g]^T for the rows t of group g, scaled per tensor (sa * sb[g]) or per
// block (A 1x128, B 128x128), or bf16 operands (no scales: dequantized MXFP8 or NVFP4, the bf16 recipe), A [T, K] sorted by
// group, B [G, N, K], the group sizes [G] int32 read on the device (clamped to A's rows like the host path).
// Rows past the groups are zeroed (kept when accumulating). CutlassKGrouped below groups along K instead (the MoE
// wgrad). Each call returns "" or why it cannot run.
#pragma once
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace jaxhq {
namespace gemm {

struct CutlassGrouped {
  const void* a;               // [t, k] E4M3 or E5M2 (bf16: bf16)
  const void* b;               // [groups, n, k] E4M3 (bf16: bf16)
  const float* scale_a;        // per-tensor: [1]; blockwise: [ceil(k / 128), t] (the quantize launch's layout)
  const float* scale_b;        // per-tensor: [groups]; blockwise: [groups, ceil(n / 128), ceil(k / 128)]
  const int32_t* group_sizes;  // [groups], on the device
  void* out;                   // [t, n] bf16
  int64_t t, n, k, groups;
  bool a_e5m2, b_e5m2, out_f32, accumulate, fast_accum, blockwise;
  bool bf16;        // bf16 operands, no scales (alpha 1, or the NVFP4 global scales below)
  void* workspace;  // cutlass_grouped_workspace_bytes of device memory
  int64_t workspace_bytes;
  // bf16 operands decoded from NVFP4 (codes times block scales): the amaxes of their global scales, A's [1] and
  // B's [groups]; alpha[g] = nvfp4_global_decode(amax_a) * nvfp4_global_decode(amax_b[g]). Null: alpha 1.
  const float* nvfp4_amax_a = nullptr;
  const float* nvfp4_amax_b = nullptr;
};

std::string cutlass_grouped_unsupported(const CutlassGrouped& p);
int64_t cutlass_grouped_workspace_bytes(const CutlassGrouped& p);  // for p's kernel and sizes, on this device
std::string cutlass_grouped_gemm(const CutlassGrouped& p, cudaStream_t s);

// Grouped along K (the MoE wgrad): out[g] = A[:, seg g] @ B[:, seg g]^T with 1x128 FP8 blocks along t on both
// operands (or bf16 operands, no scales: decoded MXFP8 copies), for consecutive segments of t whose lengths are
// segment_sizes[g] (read on the device) rounded up to a multiple of 128 and clamped to t; a group whose segment
// is empty gets zeros.
struct CutlassKGrouped {
  const void* a;                 // [m, t] E4M3, or bf16
  const void* b;                 // [n, t] E4M3, or bf16
  const float* scale_a;          // [t / 128, m] (FP8; the quantize launch's 1x128 layout)
  const float* scale_b;          // [t / 128, n] (FP8)
  const int32_t* segment_sizes;  // [groups], on the device
  void* out;                     // [groups, m, n] bf16
  int64_t m, n, t, groups;
  bool bf16;        // bf16 operands (no scales) instead of FP8
  void* workspace;  // cutlass_kgrouped_workspace_bytes of device memory
  int64_t workspace_bytes;
};

std::string cutlass_kgrouped_unsupported(const CutlassKGrouped& p);
int64_t cutlass_kgrouped_workspace_bytes(const CutlassKGrouped& p);
std::string cutlass_kgrouped_gemm(const CutlassKGrouped& p, cudaStream_t s);

}  // namespace gemm
}  // namespace jaxhq
