// C entry points for tests/test_cuda_emu.py: each call runs either the CUDA kernel (on the emulator of
// cuda_emu.h, in the scheduling order asked for) or the CPU handlers' implementation on the same buffers.
// Returns "" or the error text.
#include "cuda_emu.h"
#include "cuda_launch.h"
#include "gemm/gemm_kernels.h"
#include "gemm/nvfp4_decode.cuh"
#include "numerics.h"

#include <cmath>

namespace {
thread_local std::string g_status, g_error;

const char* status(const std::string& s) {
  g_status = s;
  return g_status.c_str();
}
}  // namespace

// The runtime functions the kernels' launch code calls, on host memory (declared by cuda_runtime.h).
// cudaGetLastError returns the last launch's error and clears it; its text stays for cudaGetErrorString.
cudaError_t cudaGetLastError() {
  if (emu::last_error().empty()) return cudaSuccess;
  g_error = emu::last_error();
  emu::last_error().clear();
  return cudaErrorLaunchFailure;
}
const char* cudaGetErrorString(cudaError_t) { return g_error.c_str(); }
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  std::memset(p, v, n);
  return cudaSuccess;
}

extern "C" {

// variant < 0: the CPU handlers' quantize_cpu; else the kernel variant (jaxhq::QuantizeVariant). amax: the
// optional amax output [batch] (null: not asked for); scale_row, scale_col: each copy's scalar [batch] (they may
// be the same array); act, dy: the copies of an activation's gradient (x is its input h), QuantizeArgs::act.
const char* emu_quantize(const void* x, int dtype, int64_t batch, int64_t m, int64_t k, const float* scale_row,
                         const float* scale_col, float amax_eps, const uint32_t* seed, int row_fmt, int row_opts, void* rd,
                         void* rs, int col_fmt, int col_opts, void* cd, void* cs, float* amax, int variant,
                         int order, const void* dy, int act) {
  jaxhq::QuantizeArgs a;
  a.x = x;
  a.dtype = dtype;
  a.batch = batch;
  a.m = m;
  a.k = k;
  a.scales[0] = scale_row;
  a.scales[1] = scale_col;
  a.amax_eps = amax_eps;
  a.seed = seed;
  a.row = jaxhq::CopySpec{row_fmt, row_opts, rd, rs};
  a.col = jaxhq::CopySpec{col_fmt, col_opts, cd, cs};
  a.amax = amax;
  a.dy = dy;  // act != 0: x is the activation's input h (spec.h)
  a.act = act;
  if (variant < 0) {
    jaxhq::quantize_cpu(a);
    return status("");
  }
  emu::set_order(order);
  return status(jaxhq::launch_quantize(a, nullptr, variant));
}

const char* emu_amax(const void* x, int dtype, int64_t batch, int64_t m, int64_t k, int rht, float* amax,
                     float* amax_rht, int kernel, int order) {
  if (!kernel) {
    jaxhq::amax_cpu(x, dtype, batch, m, k, rht != 0, amax, amax_rht);
    return status("");
  }
  emu::set_order(order);
  return status(jaxhq::launch_amax(x, dtype, batch, m, k, rht != 0, amax, amax_rht, nullptr));
}

const char* emu_dequantize(const void* data, const void* scale, const float* scalar, float* out, int fmt, int opts,
                           int64_t batch, int64_t r, int64_t c, int kernel, int order) {
  jaxhq::DequantizeArgs a;
  a.data = data;
  a.scale = scale;
  a.scalar = scalar;
  a.out = out;
  a.fmt = fmt;
  a.opts = opts;
  a.batch = batch;
  a.r = r;
  a.c = c;
  if (!kernel) {
    jaxhq::dequantize_cpu(a);
    return status("");
  }
  emu::set_order(order);
  return status(jaxhq::launch_dequantize(a, nullptr));
}

// The GEMMs' dequantization of an MXFP8 / NVFP4 operand [rows, k] to bf16 (gemm/gemm_kernels.cu).
const char* emu_dequant_mxfp8(const uint8_t* data, const uint8_t* scales, int64_t rows, int64_t k, int e5m2,
                              int rows_inner, int64_t batch, void* out, int order) {
  emu::set_order(order);
  return status(jaxhq::gemm::dequant_mxfp8(data, scales, rows, k, e5m2 != 0, rows_inner != 0, out, nullptr, batch));
}

const char* emu_dequant_nvfp4(const uint8_t* data, const uint8_t* scales, int64_t rows, int64_t k, void* out,
                              int order) {
  emu::set_order(order);
  return status(jaxhq::gemm::dequant_nvfp4(data, scales, rows, k, out, nullptr));
}

// The FP8 GEMMs' staging of two operands' fp32 block scales into cuBLASLt's layouts (gemm/gemm_kernels.cu);
// a null out_b stages A alone.
const char* emu_stage_scales(const float* in_a, int64_t rows_a, int64_t cols_a, float* out_a, int64_t out_rows_a,
                             int64_t ld_a, int transpose_a, const float* in_b, int64_t rows_b, int64_t cols_b,
                             float* out_b, int64_t out_rows_b, int64_t ld_b, int transpose_b, int order) {
  emu::set_order(order);
  jaxhq::gemm::ScaleStage a{in_a, rows_a, cols_a, out_a, out_rows_a, ld_a, transpose_a != 0};
  jaxhq::gemm::ScaleStage b{in_b, rows_b, cols_b, out_b, out_rows_b, ld_b, transpose_b != 0};
  return status(jaxhq::gemm::stage_scales(a, b, nullptr));
}

// Bit patterns in [lo, hi] (not NaN) where the kernels' short E2M1 rounding (e2m1_code_finite) differs from
// the threshold form (e2m1_code, the reference's casts.e2m1_codes line for line).
uint64_t emu_e2m1_mismatches(uint32_t lo, uint32_t hi) {
  uint64_t bad = 0;
  for (uint64_t i = lo; i <= hi; ++i) {
    const float y = jaxhq::u2f(uint32_t(i));
    bad += !jaxhq::is_nan(y) && jaxhq::e2m1_code_finite(y) != jaxhq::e2m1_code(y);
  }
  return bad;
}

// Bit patterns y in [lo, hi] where a decoded copy's element (e2m1_round*: the rounded value itself) differs in
// its bits from the value of the code the same rounding gives (e2m1_value of e2m1_code*), for nearest (every y,
// and the finite form for every y but NaN) and stochastic rounding with bits k (both forms).
uint64_t emu_e2m1_value_mismatches(uint32_t lo, uint32_t hi, uint32_t k) {
  using namespace jaxhq;
  uint64_t bad = 0;
  auto differ = [](float a, float b) { return f2u(a) != f2u(b); };
  for (uint64_t i = lo; i <= hi; ++i) {
    const float y = u2f(uint32_t(i));
    bad += differ(e2m1_round(y), e2m1_value(e2m1_code(y)));
    bad += differ(e2m1_round_sr<false>(y, k), e2m1_value(e2m1_code_sr<false>(y, k)));
    if (!is_nan(y)) {
      bad += differ(e2m1_round_finite(y), e2m1_value(e2m1_code_finite(y)));
      bad += differ(e2m1_round_sr<true>(y, k), e2m1_value(e2m1_code_sr<true>(y, k)));
    }
  }
  return bad;
}

// Bit patterns y in [lo, hi] where the kernels' stochastic E2M1 rounding (e2m1_code_sr) with random bits k
// differs from its definition, computed in double: lo = the largest grid value <= a = min(|y|, 6), up when
// (a - lo) / (hi - lo) >= 1 - (64 k + 31) / 2^22; NaN encodes 0 | sign. Below 1 the kernels round a + 1 to
// float first (the probability moves by at most 2^-23): a difference within that of the threshold is not
// counted there, but in `near`.
uint64_t emu_e2m1_sr_mismatches(uint32_t lo, uint32_t hi, uint32_t k, uint64_t* near) {
  static const double grid[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  const double u = 1.0 - (64.0 * k + 31.0) / 4194304.0;
  uint64_t bad = 0;
  *near = 0;
  for (uint64_t i = lo; i <= hi; ++i) {
    const float y = jaxhq::u2f(uint32_t(i));
    const double a = std::fmin(std::fabs(double(y)), 6.0);
    int c = 0;
    while (c < 7 && grid[c + 1] <= a) ++c;
    const double p = c < 7 ? (a - grid[c]) / (grid[c + 1] - grid[c]) : 0.0;
    if (c < 7 && p >= u) ++c;
    if (jaxhq::is_nan(y)) c = 0;
    if (jaxhq::e2m1_code_sr(y, k) != uint8_t(c | (std::signbit(y) ? 8 : 0))) {
      const bool window = a < 1.0 && std::fabs(p - u) <= 0x1p-23;
      *near += window;
      bad += !window;
    }
  }
  return bad;
}

// The NVFP4 wgmma kernel's decode (gemm/nvfp4_decode.cuh) of n code words, word i with the E4M3 scale byte
// scales[i]: out8 [n][8] fp16 bits in the order decode8 writes them, pairs [n][4][2] decode_pair's for c = 0..3.
void emu_nvfp4_decode(const uint32_t* words, const uint8_t* scales, int64_t n, uint16_t* out8, uint16_t* pairs) {
  using namespace jaxhq::gemm;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t sw = nvfp4_scale_word(scales[i]);
    const uint4 o = decode8(words[i], sw);
    const uint32_t v[4] = {o.x, o.y, o.z, o.w};
    for (int c = 0; c < 4; ++c) {
      const uint32_t p = decode_pair(words[i], c, sw);
      out8[8 * i + 2 * c] = uint16_t(v[c]), out8[8 * i + 2 * c + 1] = uint16_t(v[c] >> 16);
      pairs[8 * i + 2 * c] = uint16_t(p), pairs[8 * i + 2 * c + 1] = uint16_t(p >> 16);
    }
  }
}

}  // extern "C"
