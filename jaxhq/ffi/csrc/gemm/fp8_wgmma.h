// FP8 GEMM on Hopper FP8 tensor cores (sm_90a): out[M, N] = sum_k A[m, k] B[n, k] with the operands' scales
// applied in FP32 registers. Three scalings, the same on both operands:
//   kScaleMx:     MXFP8, 1x32 E8M0 scales; each 32-wide K step's partial sums scaled by sa[m, k/32] sb[n, k/32]
//                 (exact: powers of two);
//   kScaleBlock:  FP8 blockwise, fp32 scales per 128-wide K step: A 1x128, B 1x128 or 128x128;
//   kScaleTensor: per-tensor FP8, out = sa * sb[group] * the sum, promoted to FP32 every 128-wide K step.
// Dense, or grouped (MoE) with the group sizes read on the device (no host synchronisation). Returns "" or an
// error. NVFP4 has a kernel of its own (nvfp4_wgmma.cu, dense): codes and scales decoded to fp16 in shared memory,
// fp16 wgmma.
#pragma once
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace jaxhq {
namespace gemm {

enum WgmmaScaling : int { kScaleMx = 0, kScaleBlock = 1, kScaleTensor = 2 };

struct WgmmaOperand {
  const uint8_t* data;  // [rows, k] E4M3 or E5M2 codes, K-major
  // kScaleMx: E8M0 [rows, ceil(k / 32)]; kScaleBlock: fp32 [rows, ceil(k / 128)], or with blocks128 fp32
  // [groups][ceil(group_rows / 128)][ceil(k / 128)]; kScaleTensor: fp32 [groups] (dense: [1]).
  const void* scales;
  int64_t rows;          // groups * group_rows for a grouped B
  bool e5m2;
  bool blocks128 = false;  // kScaleBlock B with 128x128 scales
};

// Bytes of scratch that one operand's scales take once re-laid-out for the kernel (0 for kScaleTensor).
int64_t wgmma_scale_bytes(int scaling, int64_t rows, int64_t k);

// Why the kernel cannot take these operands ("" when it can): k % 16 (TMA row stride), n odd, alignment.
std::string wgmma_unsupported(const WgmmaOperand& a, const WgmmaOperand& b, int64_t n, int64_t k, const void* out);

// Dense (groups == 0; b.rows == n) or grouped: A's rows sorted by group, b = G stacked [n, k] weights
// (b.rows == groups * n), group_sizes [groups] int32 on the device (clamped to A's rows like the host path);
// rows past the groups are zeroed unless accumulating. bias: [n] ([groups, n]) of the output type or null;
// accumulate: out += result. sa_tmp / sb_tmp: scratch of wgmma_scale_bytes(scaling, rows, k) each.
std::string wgmma_gemm(int scaling, const WgmmaOperand& a, const WgmmaOperand& b, int64_t n, int64_t k,
                       const int32_t* group_sizes, int64_t groups, void* out, bool out_f32, const void* bias,
                       bool accumulate, void* sa_tmp, void* sb_tmp, cudaStream_t s);

// Zeroes rows [sum of the group sizes clamped to m, m) of out [m, n] (bf16 or fp32), the sizes read on the device.
std::string zero_past_groups(void* out, const int32_t* group_sizes, int64_t groups, int64_t m, int64_t n,
                             bool out_f32, cudaStream_t s);

// NVFP4 x NVFP4 (E2M1 codes [rows, k / 2] bytes, E4M3 scales [rows, k / 16]; `e5m2` unused), dense: out = the
// product of the decoded operands times *alpha (the two global decodes, on the device). sa_tmp / sb_tmp: scratch
// of nvfp4_wgmma_scale_bytes(rows, k) each.
int64_t nvfp4_wgmma_scale_bytes(int64_t rows, int64_t k);
std::string nvfp4_wgmma_gemm(const WgmmaOperand& a, const WgmmaOperand& b, int64_t n, int64_t k, const float* alpha,
                             void* out, bool out_f32, const void* bias, bool accumulate, void* sa_tmp, void* sb_tmp,
                             cudaStream_t s);

}  // namespace gemm
}  // namespace jaxhq
