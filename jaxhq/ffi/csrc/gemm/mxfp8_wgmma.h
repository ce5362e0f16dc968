// MXFP8 GEMM on Hopper FP8 tensor cores (sm_90a): out[M, N] = sum_k A[m, k] sa[m, k/32] B[n, k] sb[n, k/32],
// with each 32-wide K step's wgmma partial sums scaled by sa * sb in FP32 registers (exact: the E8M0 scales
// are powers of two). Dense, or grouped (MoE) with the group sizes read on the device. Returns "" or an error.
#pragma once
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace jaxhq {
namespace gemm {

struct Mxfp8Operand {
  const uint8_t* data;    // [rows, k] E4M3 or E5M2 codes, K-major
  const uint8_t* scales;  // [rows, ceil(k / 32)] E8M0
  int64_t rows;
  bool e5m2;
};

// Bytes of scratch that one operand's scales take once re-laid-out for the kernel (fp32, 256-byte multiple).
int64_t mxfp8_scale_bytes(int64_t rows, int64_t k);

// Why the kernel cannot take these operands ("" when it can): k % 16 (TMA row stride), n odd, alignment.
std::string mxfp8_wgmma_unsupported(const Mxfp8Operand& a, const Mxfp8Operand& b, int64_t n, int64_t k,
                                    const void* out);

// Dense (groups == 0; b.rows == n) or grouped: A's rows sorted by group, b = G stacked [n, k] weights
// (b.rows == groups * n), group_sizes [groups] int32 on the device (clamped to A's rows like the host path);
// rows past the groups are zeroed unless accumulating. bias: [n] ([groups, n]) of the output type or null;
// accumulate: out += result. sa_tmp / sb_tmp: scratch of mxfp8_scale_bytes(rows, k) each.
std::string mxfp8_wgmma_gemm(const Mxfp8Operand& a, const Mxfp8Operand& b, int64_t n, int64_t k,
                             const int32_t* group_sizes, int64_t groups, void* out, bool out_f32, const void* bias,
                             bool accumulate, void* sa_tmp, void* sb_tmp, cudaStream_t s);

}  // namespace gemm
}  // namespace jaxhq
