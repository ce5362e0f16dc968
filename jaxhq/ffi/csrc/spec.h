// What one launch of the quantize kernel produces: up to two copies (rowwise, columnwise) of a [M, K] tensor.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define JHQ_SPEC_HD __host__ __device__
#else
#define JHQ_SPEC_HD
#endif

namespace jaxhq {

struct CopySpec {
  int32_t fmt = 0;       // Format
  int32_t opts = 0;      // Option bits
  void* data = nullptr;  // fp8 [R, C] or packed fp4 [R, ceil(C/2)]; kDecoded: bf16 values [R, C]
  void* scale = nullptr; // per-block scales (layout per format); kFp8Tensor: the f32 scale_inv
};

struct QuantizeArgs {
  const void* x = nullptr;       // [batch, M, K] in `dtype`
  int32_t dtype = 0;             // InDtype
  int64_t batch = 1, m = 0, k = 0;
  // Each copy's scalar [batch] (rowwise, columnwise; the two may point at the same values): the per-tensor scale
  // (kFromAmax: the amax) or the NVFP4 global encode.
  const float* scales[2] = {nullptr, nullptr};
  float amax_eps = 0.0f;         // kFromAmax: the eps of tensor_scale
  const uint32_t* seed = nullptr;// [batch, kSeedWords], see below
  CopySpec row, col;             // rowwise copy [M, K]; columnwise copy [K, M]
  float* amax = nullptr;         // [batch] or null: max |x| of each batch element, taken from the values read
                                 // for the copies (NaN when any is NaN; which NaN is unspecified)
  // act != 0 (activation.h: kind | kActGated): the copies are of the activation's gradient, not of x: x holds the
  // activation's input h (bfloat16 [batch, M, K]) and dy the gradient of its output (bfloat16 [batch, M, K], gated:
  // [batch, M, K / 2]); each element is rounded to bfloat16 before it is quantized (jaxhq_quantize's `act`).
  const void* dy = nullptr;
  int32_t act = 0;
};

// Seed words per batch element: the stochastic-rounding key (2 words), this shard's offset in the global x
// (row m0, column k0) and the global shape of x (M, K). A shard then draws the numbers of its global
// positions, so a sharded call equals the unsharded one bit for bit. Unsharded: {key, 0, 0, m, k}.
constexpr int kSeedWords = 6;
struct SrIndex {
  uint64_t roff, coff, cols;  // element (r, c) of a copy draws number (r + roff) * cols + (c + coff)
};
// side 0: the rowwise copy [M, K]; side 1: the columnwise copy [K, M]
JHQ_SPEC_HD inline SrIndex sr_index(const uint32_t* seed, int side) {
  return side == 0 ? SrIndex{seed[2], seed[3], seed[5]} : SrIndex{seed[3], seed[2], seed[4]};
}

// The value copy `side` of batch element b reads (QuantizeArgs::scales).
JHQ_SPEC_HD inline float side_scalar(const float* const (&scales)[2], int64_t b, int side) {
  return scales[side][b];
}

// Bytes per batch element of each output, for a copy of shape [R, C]; the quantize kernel's scale output of a
// per-tensor copy is its f32 scale_inv (quantize_scale_bytes), the dequantize kernel reads none. `decoded`: the
// copy's data is its bf16 values (option kDecoded).
JHQ_SPEC_HD inline int64_t data_bytes(int32_t fmt, int64_t r, int64_t c, bool decoded = false) {
  if (fmt == 0) return 0;
  if (decoded) return 2 * r * c;
  return fmt == 3 ? r * ((c + 1) / 2) : r * c;
}
JHQ_SPEC_HD inline int64_t scale_bytes(int32_t fmt, int64_t r, int64_t c) {
  switch (fmt) {
    case 2: return r * ((c + 31) / 32);
    case 3: return r * ((c + 15) / 16);
    case 4: return 4 * r * ((c + 127) / 128);
    case 5: return 4 * ((r + 127) / 128) * ((c + 127) / 128);
    default: return 0;
  }
}
// Where a quantize launch writes the scale of block j (of ceil(C / 128) for 1x128, ceil(C / 32) for MXFP8) of copy
// row r: at [j, r] of a [blocks, R] array, each block column's rows contiguous. A launch's CTA holds 128 copy rows
// of a tile, so its threads write their rows' scales side by side (one sector per warp and block column, where
// the [R, blocks] layout took a sector per row). For 1x128 it is the layout cuBLASLt's block scaling reads, so
// jaxhq_gemm_fp8 takes those scales where they lie (no re-layout launch per GEMM). The Python wrapper
// (ffi/primitives.py) hands both on as [R, blocks], the layout every other target reads.
JHQ_SPEC_HD inline int64_t rows_inner_scale_index(int64_t r, int64_t j, int64_t R) { return j * R + r; }
JHQ_SPEC_HD inline int64_t quantize_scale_bytes(int32_t fmt, int64_t r, int64_t c) {
  return fmt == 1 ? 4 : scale_bytes(fmt, r, c);
}

}  // namespace jaxhq
