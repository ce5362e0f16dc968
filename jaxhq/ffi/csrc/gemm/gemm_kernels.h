// Small CUDA kernels around the cuBLASLt GEMMs: scale re-layout, exact dequantization of MXFP8/NVFP4 to
// bf16, the NVFP4 global-scale factor, and a fallback epilogue (bias, accumulate). All return "" or the
// CUDA error string.
#pragma once
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace jaxhq {
namespace gemm {

// One operand's fp32 block scales staged in the layout cuBLASLt reads: out [out_rows, ld] row-major, element
// (i, j) = in(j, i) when `transpose`, else in(i, j), for in [rows, cols] row-major; 1 where that lies outside in.
struct ScaleStage {
  const float* in = nullptr;
  int64_t rows = 0, cols = 0;
  float* out = nullptr;  // null: nothing to stage
  int64_t out_rows = 0, ld = 0;
  bool transpose = false;
};

// Stages up to two operands' scales in one launch (jobs whose `out` is null are skipped).
std::string stage_scales(const ScaleStage& a, const ScaleStage& b, cudaStream_t s);

// MXFP8 [rows, k] fp8 (e5m2 when `e5m2`) with E8M0 scales [rows, ceil(k/32)] -> bf16 [rows, k]; k % 8 == 0.
// rows_inner: the rows are `batch` stacked operands, each one's scales [ceil(k/32), rows / batch] (the quantize
// launch's layout).
std::string dequant_mxfp8(const uint8_t* data, const uint8_t* scales, int64_t rows, int64_t k, bool e5m2,
                          bool rows_inner, void* out_bf16, cudaStream_t s, int64_t batch = 1);

// NVFP4 [rows, k/2] packed E2M1 with E4M3 scales [rows, k/16] -> bf16 [rows, k] of e2m1 * e4m3 (exact; the
// global scale is left out); k % 16 == 0.
std::string dequant_nvfp4(const uint8_t* data, const uint8_t* scales, int64_t rows, int64_t k, void* out_bf16,
                          cudaStream_t s);

// alpha_beta[0] = (1 / genc(amax_a)) * (1 / genc(amax_b)) (a null amax counts as genc 1), alpha_beta[1] = beta.
std::string nvfp4_alpha(const float* amax_a, const float* amax_b, float beta, float* alpha_beta, cudaStream_t s);

// out[m, n] = tmp[m, n] + bias[n] + (accumulate ? out[m, n] : 0); out/tmp/bias of `f32` (else bf16) type.
std::string epilogue(void* out, const void* tmp, const void* bias, int64_t m, int64_t n, bool f32, bool accumulate,
                     cudaStream_t s);

// Block scales [rows, cols] (one byte each, row-major; rows_inner: [cols, rows]) -> the 128x4-tile interleaved
// layout of cuBLASLt's VEC32_UE8M0 / VEC16_UE4M3 modes (Blackwell): rows padded to 128, cols to 4, padding 0.
std::string swizzle_block_scales(const uint8_t* in, int64_t rows, int64_t cols, bool rows_inner, uint8_t* out,
                                 cudaStream_t s);
inline int64_t swizzled_bytes(int64_t rows, int64_t cols) { return (rows + 127) / 128 * 128 * ((cols + 3) / 4 * 4); }

}  // namespace gemm
}  // namespace jaxhq
