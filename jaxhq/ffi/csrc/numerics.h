// Scalar numerics of every format, shared by the CPU handlers and the CUDA kernels.
// Each function mirrors one line of jaxhq/formats (the reference); comments name it. Bit-exact by design:
// no fast-math, explicit NaN propagation where jnp's min/max/clip propagate NaN.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

#if defined(__CUDACC__)
#define JHQ_HD __host__ __device__ __forceinline__
#else
#define JHQ_HD inline
#endif

namespace jaxhq {

// Format ids, shared with jaxhq/ffi/primitives.py (FORMAT_IDS).
enum Format : int32_t {
  kNone = 0,        // this copy is not produced
  kFp8Tensor = 1,   // FP8 per-tensor: scale given as an input scalar, or computed from the amax given
  kMxfp8 = 2,       // 1x32, E8M0 scale
  kNvfp4 = 3,       // 1x16 (or 16x16), E4M3 scale, global encode scale given as an input scalar
  kFp8Block1 = 4,   // 1x128, fp32 scale_inv
  kFp8Block2 = 5,   // 128x128, fp32 scale_inv
};
// Option bits of a copy.
enum Option : int32_t {
  kE5M2 = 1,        // FP8 element format E5M2 (else E4M3)
  kPow2 = 2,        // FP8 blockwise: power-of-2 scale
  kBlock2D = 4,     // NVFP4: 16x16 tiles
  kRHT = 8,         // NVFP4: random Hadamard transform along the copy's last axis
  kStochastic = 16, // NVFP4: stochastic rounding
  kFromAmax = 32,   // FP8 per-tensor / NVFP4: the input scalar is the amax; the scale is tensor_scale of it
                    // (NVFP4: the global encode is nvfp4_global_encode of it)
  kBf16Input = 64,  // the copy is made from float32 x rounded to bfloat16 as it is read (x.astype(bfloat16)); the
                    // two copies of a launch agree (the launch reads x once)
  kDecoded = 128,   // MXFP8 / NVFP4: the data output holds the copy's values instead of its codes, bfloat16 [R, C]:
                    // each code times its block's scale (NVFP4: not the global one), exactly what the GEMMs'
                    // dequantize pass writes for a bf16 GEMM (exact in bfloat16 within its range); scales as usual
};
// kF32AsBF16: float32 in memory, its values the bfloat16 roundings (kBf16Input), so the copies equal those of
// x.astype(bfloat16) without that copy of x being written.
enum InDtype : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kF32AsBF16 = 3 };
JHQ_HD int64_t in_bytes(int32_t dtype) { return dtype == kF32 || dtype == kF32AsBF16 ? 4 : 2; }

JHQ_HD uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
JHQ_HD float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
// (a & m) | (b & ~m): one LOP3 on the GPU (the compiler splits the two-mask form into two).
JHQ_HD uint32_t bit_select(uint32_t a, uint32_t b, uint32_t m) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(d) : "r"(a), "r"(b), "r"(m));
  return d;
#else
  return (a & m) | (b & ~m);
#endif
}
JHQ_HD bool is_nan(float x) { return x != x; }
JHQ_HD bool is_inf(float x) { return (f2u(x) & 0x7FFFFFFFu) == 0x7F800000u; }
// x with a NaN made the canonical quiet NaN (0x7FC00000, the bits jnp.nan and formats.base.canonical_nan give):
// the scale_inv a kernel writes for a NaN amax, whatever pattern the platform's division left.
JHQ_HD float canonical_nan(float x) { return is_nan(x) ? u2f(0x7FC00000u) : x; }
// jnp.maximum / jnp.minimum / jnp.clip: NaN in, NaN out.
JHQ_HD float nmax(float a, float b) { return (is_nan(a) || is_nan(b)) ? (is_nan(a) ? a : b) : (a > b ? a : b); }
JHQ_HD float nmin(float a, float b) { return (is_nan(a) || is_nan(b)) ? (is_nan(a) ? a : b) : (a < b ? a : b); }
JHQ_HD float nclip(float x, float lo, float hi) { return nmin(nmax(x, lo), hi); }
JHQ_HD float abs_f(float x) { return u2f(f2u(x) & 0x7FFFFFFFu); }
// abs_max of a block: NaN when any element is NaN (formats.base.abs_max).
JHQ_HD float amax_acc(float acc, float x) { return nmax(acc, abs_f(x)); }

// A division that the reference writes as `a / b` on a runtime value: IEEE on the CPU (XLA's CPU backend
// divides exactly) and `div.full.f32` on the GPU, which is how XLA's GPU backend lowers every f32 division
// (it passes -nvptx-prec-divf32=1 to LLVM). Kernels equal the reference compiled for their own platform.
JHQ_HD float div_ref(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a / b;
#endif
}
// The scale_inv a copy stores for its multiplier `scale` (FP8 per-tensor and blockwise): 1 / scale as the reference
// divides, a NaN written as the canonical one.
JHQ_HD float scale_inv_of(float scale) { return canonical_nan(div_ref(1.0f, scale)); }

JHQ_HD float bf16_bits_to_f32(uint16_t b) { return u2f(uint32_t(b) << 16); }
// float32 to bfloat16 bits, round to nearest even (NaN stays a quiet NaN), as XLA's convert does.
JHQ_HD uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = f2u(f);
  if (is_nan(f)) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
JHQ_HD float f16_bits_to_f32(uint16_t h) {
  uint32_t s = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float32
    float v = float(m) * 5.9604644775390625e-08f;
    return u2f(f2u(v) | s);
  }
  if (e == 31) return u2f(s | 0x7F800000u | (m << 13));
  return u2f(s | ((e + 112) << 23) | (m << 13));
}

// Round a non-negative finite float to the nearest (ties to even) value of a small float format with
// `mbits` mantissa bits and exponent bias `bias` (subnormals included, no overflow handling: callers clip).
JHQ_HD float round_small(float a, int mbits, int bias) {
  uint32_t b = f2u(a);
  int e = int((b >> 23) & 0xFF) - 127;
  if (e < 1 - bias) {  // subnormal range of the small format: a multiple of 2^(1-bias-mbits)
    float q = ldexpf(1.0f, 1 - bias - mbits);
    return rintf(a / q) * q;
  }
  int shift = 23 - mbits;
  uint32_t r = b + ((1u << (shift - 1)) - 1u) + ((b >> shift) & 1u);
  return u2f(r & ~((1u << shift) - 1u));
}

// Magnitude bits of a non-negative value already representable in the small format (after round_small).
JHQ_HD uint32_t small_bits(float a, int mbits, int bias) {
  if (a == 0.0f) return 0;
  int e = int((f2u(a) >> 23) & 0xFF) - 127;
  if (e < 1 - bias) return uint32_t(a / ldexpf(1.0f, 1 - bias - mbits));
  return (uint32_t(e + bias) << mbits) | ((f2u(a) & 0x7FFFFFu) >> (23 - mbits));
}

// casts.FP8_MAX: the largest finite E5M2 / E4M3 value.
JHQ_HD float fp8_max(bool e5m2) { return e5m2 ? 57344.0f : 448.0f; }

// saturating_fp8: clip to +-max then cast round-to-nearest-even. NaN -> 0x7F | sign (E4M3) / 0x7F (E5M2).
JHQ_HD uint8_t fp8_encode_sw(float x, bool e5m2) {
  const float m = fp8_max(e5m2);
  if (is_nan(x)) return uint8_t((f2u(x) >> 24) & 0x80) | 0x7F;
  float c = nclip(x, -m, m);
  const int mb = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
  float r = round_small(abs_f(c), mb, bias);
  uint32_t bits = small_bits(r, mb, bias) & 0x7F;
  return uint8_t(bits | ((f2u(c) >> 24) & 0x80));
}
JHQ_HD float fp8_decode(uint8_t b, bool e5m2) {
  uint32_t s = uint32_t(b & 0x80) << 24;
  const int mb = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
  uint32_t e = (b & 0x7F) >> mb, m = b & ((1u << mb) - 1);
  if (!e5m2 && (b & 0x7F) == 0x7F) return u2f(0x7FC00000u | s);
  if (e5m2 && e == 31) return m ? u2f(0x7FC00000u | s) : u2f(0x7F800000u | s);
  float v = (e == 0) ? float(m) * ldexpf(1.0f, 1 - bias - mb) : ldexpf(1.0f + float(m) / float(1 << mb), int(e) - bias);
  return u2f(f2u(v) | s);
}

// x.astype(input dtype).astype(float32) for the MXFP8 scale computation (non-negative finite or NaN/Inf).
JHQ_HD float round_to_dtype_sw(float a, int dtype) {
  if (dtype == kF32 || is_nan(a) || is_inf(a)) return a;
  if (dtype == kBF16 || dtype == kF32AsBF16) return u2f((f2u(a) + 0x7FFFu + ((f2u(a) >> 16) & 1u)) & 0xFFFF0000u);
  if (a >= 65520.0f) return INFINITY;  // float16 overflow rounds to inf
  return round_small(a, 10, 15);
}

// casts.e8m0_round_up: exponent byte of positive q, rounded up; non-finite -> 0xFF.
JHQ_HD uint8_t e8m0_round_up(float q) {
  uint32_t bits = f2u(q), exp = bits >> 23, mant = bits & 0x7FFFFF;
  bool up = (mant > 0) && (exp != 0xFE) && !((exp == 0) && (mant <= 0x400000));
  if (up) exp += 1;
  if (is_nan(q) || is_inf(q)) exp = 0xFF;
  return uint8_t(exp);
}
// casts.e8m0_reciprocal: 2^(127-e) for e <= 253; NaN for 0xFF.
JHQ_HD float e8m0_reciprocal(uint8_t e) {
  if (e == 0xFF) return NAN;
  uint32_t c = e < 253 ? e : 253;
  return u2f((254u - c) << 23);
}
JHQ_HD float e8m0_to_f32(uint8_t e) {
  if (e == 0xFF) return NAN;
  if (e == 0) return 5.877471754111438e-39f;  // 2^-127
  return u2f(uint32_t(e) << 23);
}
// casts.pow2_floor
JHQ_HD float pow2_floor(float x) { return u2f(f2u(x) & 0xFF800000u); }

// The scale caps of the reference: fp8.MAX_SCALE and nvfp4.MAX_GLOBAL_ENCODE.
constexpr float kMaxFp8Scale = 0x1p126f, kMaxNvfp4GlobalEncode = 0x1p118f;

// fp8.scale_from_amax: fmt_max / max(amax, eps) (1 when that is 0; at most 2^126, so that scale_inv stays a
// normal float; NaN for a NaN amax), optionally rounded down to a power of 2.
JHQ_HD float tensor_scale(float amax, float fmt_max, float eps, bool pow2) {
  float a = nmax(amax, eps);
  float s = (a == 0.0f) ? 1.0f : div_ref(fmt_max, a);
  if (s > kMaxFp8Scale) s = kMaxFp8Scale;
  if (is_nan(amax)) s = NAN;
  if (pow2 && !is_nan(s) && !is_inf(s) && s > 0.0f) s = pow2_floor(s);
  return s;
}
// The FP8 blockwise scale (E4M3, eps = 0).
JHQ_HD float block_scale(float amax, bool pow2) { return tensor_scale(amax, fp8_max(false), 0.0f, pow2); }

// nvfp4.global_encode: min(448 * 6 / amax, 2^118), 1 for a zero amax (NaN for NaN, 0 for inf).
JHQ_HD float nvfp4_global_encode(float amax) {
  return amax == 0.0f ? 1.0f : nmin(div_ref(448.0f * 6.0f, amax), kMaxNvfp4GlobalEncode);
}

// The scalar a quantized copy uses, from the value it is given: with kFromAmax that value is the amax, and the
// scalar is tensor_scale of it (FP8 per-tensor) or nvfp4_global_encode of it; otherwise it is the scale (FP8) or
// NVFP4's global encode itself.
JHQ_HD float copy_scalar_of(float given, int32_t fmt, int32_t opts, float amax_eps) {
  if (!(opts & kFromAmax)) return given;
  if (fmt == kNvfp4) return nvfp4_global_encode(given);
  if (fmt != kFp8Tensor) return given;
  return tensor_scale(given, fp8_max(opts & kE5M2), amax_eps, opts & kPow2);
}

// casts.e2m1_codes (magnitude thresholds, round to nearest even, saturating; NaN -> 0 | sign).
JHQ_HD uint8_t e2m1_code(float y) {
  float a = abs_f(y);
  uint8_t mag = uint8_t((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                        (a > 5.0f));
  return mag | ((f2u(y) >> 31) ? 8 : 0);
}
// a + p * s where p * s is exact (s a power of 2): the float of that addition, one FFMA on the GPU.
JHQ_HD float add_exact_product(float a, float p, float s) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(p, s, a);
#else
  return a + p * s;
#endif
}
// Round a = min(|y|, 6) (not NaN) to E2M1's grid, nearest even, in integer and add operations only (no
// rounding or conversion instruction: those run at a quarter of the rate on the GPU). E2M1's grid step at a is
// half of a's binade floor (0.5 below 1), so adding M = 2^(22 + e') (e' = max(e, 0), e: a's exponent) rounds a to
// the grid in the float addition itself: r = a + M is M + k steps, k = a / step rounded to nearest even, and the
// code is 2 e' + k. `e2m1_pow(a)` = the bits of 2^e' (the step is half of it); M = 2^e' * 2^22 is added as an
// exact product (add_exact_product: one FFMA).
JHQ_HD uint32_t e2m1_pow(float a) {
  const uint32_t eb = f2u(a) & 0xFF800000u;
  return eb > 0x3F800000u ? eb : 0x3F800000u;
}
// The code 2 e' + k in bits 0..2 of the result (the bits above are not the code's). It adds M + 6 steps (2^e' *
// (2^22 + 3), exact) instead of M: an even number of steps, so the same k (ties go to an even k either way), and
// r stays in M's binade, so r's bits are (149 + e') << 23 | (6 + k), and r + (r >> 22) = ... + 304 + 2 e' + k
// (r >> 22 is 2 (149 + e'): bit 22 of r is 0), whose low three bits are the code. Two instructions after the
// FFMA (one LEA on the GPU) where subtracting M and adding 2 e' took three.
JHQ_HD uint32_t e2m1_nearest_bits(float a) {
  const uint32_t r = f2u(add_exact_product(a, u2f(e2m1_pow(a)), 0x1p22f + 3.0f));
  return r + (r >> 22);
}
// e2m1_code for a y that is not NaN, by e2m1_nearest_bits: the code's bits 0..2 and y's sign as bit 3 (bit 31 of
// y shifted down; the three bits below it are dropped by the select: one LOP3). Equal to e2m1_code for every float
// but NaN (checked over all of them: tests/test_cuda_emu.py). 32 bits: 0..15 exactly, so no byte truncation.
JHQ_HD uint32_t e2m1_code_finite(float y) {
  return bit_select(e2m1_nearest_bits(fminf(fabsf(y), 6.0f)), f2u(y) >> 28, 7u);  // f2u(y) >> 28 < 16: ~7 keeps bit 3
}
// Magnitude of E2M1 code c in 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (no table: registers only on the GPU).
JHQ_HD float e2m1_grid(int c) { return c < 4 ? 0.5f * float(c) : (c < 6 ? float(c - 2) : 2.0f * float(c - 4)); }
// Stochastic E2M1 from 16 random bits k: a = min(|y|, 6) goes up to the next grid point with probability
// (a - lo) / (hi - lo) to within 2^-16, by one integer addition. E2M1's step at a >= 1 is bit 22 of a's float
// bits (one mantissa bit kept), so adding r = 64 k + 31 (uniform below 2^22, centred) carries into bit 22 exactly
// when k is large enough; below 1 the step is 0.5, bit 22 of t = a + 1 (rounded to 2^-23: the probability moves
// by at most 2^-23). The code is t's bits after the carry, shifted down, minus the offset of its binade. NaN gives
// 0 | sign; `finite`: the caller knows y is not NaN.
template <bool kFinite = false>
JHQ_HD uint32_t e2m1_code_sr(float y, uint32_t k) {  // 0..15 (32 bits, as e2m1_code_finite)
  const float a = kFinite ? fminf(fabsf(y), 6.0f) : nmin(fabsf(y), 6.0f);
  const bool sub = a < 1.0f;
  const float t = sub ? a + 1.0f : a;
  uint32_t code = ((f2u(t) + (k << 6) + 31u) >> 22) - (sub ? 254u : 252u);
  if (!kFinite && is_nan(a)) code = 0u;
  return code | ((f2u(y) >> 28) & 8u);
}
JHQ_HD float e2m1_value(uint8_t c) {
  float x = e2m1_grid(c & 7);
  return (c & 8) ? -x : x;
}
// The values of the E2M1 roundings above, for decoded copies: e2m1_value of e2m1_code_finite(y), e2m1_code(y) and
// e2m1_code_sr(y, k), without forming the code (checked on every float: tests/test_cuda_emu.py). Nearest: the
// float addition r = a + M (e2m1_pow) rounds a to the grid, so r - M is the value (both in M's binade: exact).
// Stochastic: t's bits after the carry, cut below the kept mantissa bit, are the value (minus the 1 added below 1).
JHQ_HD float e2m1_round_finite(float y) {
  const float a = fminf(fabsf(y), 6.0f), p = u2f(e2m1_pow(a));
  const float r = add_exact_product(a, p, 0x1p22f);  // a + M, then r - M (exact)
  return u2f(f2u(add_exact_product(r, p, -0x1p22f)) | (f2u(y) & 0x80000000u));
}
JHQ_HD float e2m1_round(float y) {
  return is_nan(y) ? u2f(f2u(y) & 0x80000000u) : e2m1_round_finite(y);
}
template <bool kFinite = false>
JHQ_HD float e2m1_round_sr(float y, uint32_t k) {
  const float a = kFinite ? fminf(fabsf(y), 6.0f) : nmin(fabsf(y), 6.0f);
  const bool sub = a < 1.0f;
  const float t = sub ? a + 1.0f : a;
  float v = u2f((f2u(t) + (k << 6) + 31u) & 0xFFC00000u);
  v = sub ? v - 1.0f : v;
  if (!kFinite && is_nan(a)) v = 0.0f;
  return u2f(f2u(v) | (f2u(y) & 0x80000000u));
}

// A decoded copy's (kDecoded) two values as the bits of a bfloat16 pair (low half: a), rounded to nearest even: the
// hardware conversion on the GPU, which the GEMMs' dequantize pass uses too (NaN payloads aside, the same bits).
JHQ_HD uint32_t bf16x2_bits(float a, float b) {
#if defined(__CUDA_ARCH__)
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
#else
  return uint32_t(f32_to_bf16_bits(a)) | (uint32_t(f32_to_bf16_bits(b)) << 16);
#endif
}
// bf16x2_bits(a * d, c * d) for E2M1 values a, c and an E4M3 value d (or NaN): every such product is exact in
// bfloat16 (at most 6 significant bits, inside its range), so on the GPU the pair is packed first (exact) and
// multiplied by d in bfloat16, one instruction for both values.
JHQ_HD uint32_t bf16x2_e2m1_times(float a, float c, float d) {
#if defined(__CUDA_ARCH__)
  const __nv_bfloat162 h = __hmul2(__floats2bfloat162_rn(a, c), __float2bfloat162_rn(d));
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
#else
  return bf16x2_bits(a * d, c * d);
#endif
}
// The values of two FP8 codes (low byte first): the hardware conversion on the GPU, fp8_decode elsewhere.
JHQ_HD void fp8x2_values(uint16_t pair, bool e5m2, float& lo, float& hi) {
#if defined(__CUDA_ARCH__)
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), e5m2 ? __NV_E5M2 : __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  lo = f.x, hi = f.y;
#else
  lo = fp8_decode(uint8_t(pair & 0xFFu), e5m2), hi = fp8_decode(uint8_t(pair >> 8), e5m2);
#endif
}

// NVFP4 per-block scales (nvfp4.quantize_2d): decode = e4m3(min(amax_b / 6 * genc, 448)) and the encode
// multiplier 1 / (decode / genc), 0 when decode is 0, computed the way XLA compiles those lines under jit
// (its algebraic simplifier turns a division by a broadcast scalar into a multiplication by the reciprocal
// and folds the scalar factors): decode = e4m3(min(amax_b * (genc * (1/6)), 448)), enc = genc / decode.
// The E4M3 scale byte of a block (its value: fp8_decode); on the GPU the hardware conversions, which equal the
// software ones for the non-negative (or NaN) values this sees.
JHQ_HD uint8_t nvfp4_scale_byte(float amax_b, float genc) {
  float d = nmin(amax_b * (genc * (1.0f / 6.0f)), 448.0f);
#if defined(__CUDA_ARCH__)
  return uint8_t(__nv_cvt_float_to_fp8(d, __NV_SATFINITE, __NV_E4M3));
#else
  return fp8_encode_sw(d, false);
#endif
}
JHQ_HD float e4m3_value(uint8_t b) {
#if defined(__CUDA_ARCH__)
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));
#else
  return fp8_decode(b, false);
#endif
}
JHQ_HD float nvfp4_decode_value(float amax_b, float genc) { return e4m3_value(nvfp4_scale_byte(amax_b, genc)); }
// nvfp4.global_encode's reciprocal, the factor the GEMMs apply per operand: 1 / nvfp4_global_encode(amax), of the
// very global encode the quantize kernels used (1 for a zero amax; NaN for NaN, inf for inf).
JHQ_HD float nvfp4_global_decode(float amax) { return 1.0f / nvfp4_global_encode(amax); }
// genc / dec as div_ref computes it. On the GPU, div.full.f32 scales its operands only for a divisor outside
// [2^-126, 2^126] and is otherwise a * rcp.approx(b); a nonzero E4M3 value lies in [2^-9, 448] (or is NaN), so
// that is the whole division here: two instructions instead of the range checks (GPU tests: bit for bit).
JHQ_HD float nvfp4_encode_mult(float dec, float genc) {
  if (dec == 0.0f) return 0.0f;
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(dec));
  return genc * r;
#else
  return div_ref(genc, dec);
#endif
}
// MXFP8: q = amax / fmt_max, likewise computed as amax * (1 / fmt_max).
JHQ_HD float mx_q(float amax, bool e5m2) { return amax * (e5m2 ? (1.0f / 57344.0f) : (1.0f / 448.0f)); }

// Counter-based random bits for stochastic rounding: 16 per element, two elements per hash. Element (r, c) of a
// copy, at its global position (sr_index's offsets added), takes half c & 1 (low half first) of the hash of pair
// q = r * ceil(cols / 2) + c / 2: one `mix32` round of key ^ (q mod 2^32), where the key (`sr_key`) mixes the
// seed, the stream (the copy) and q's high word (kernels compute it once per chunk).
JHQ_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
  return x;
}
JHQ_HD uint32_t sr_key(uint32_t s0, uint32_t s1, uint32_t stream, uint32_t index_high) {
  return mix32(s0 ^ mix32(s1 ^ mix32(index_high + 0x85ebca6bu) ^ (0x9e3779b9u * (stream + 1u))));
}
JHQ_HD uint64_t sr_pair(uint64_t r, uint64_t c, uint64_t cols) { return r * ((cols + 1) / 2) + c / 2; }
JHQ_HD uint32_t sr_bits(uint32_t s0, uint32_t s1, uint32_t stream, uint64_t r, uint64_t c, uint64_t cols) {
  const uint64_t q = sr_pair(r, c, cols);
  const uint32_t h = mix32(sr_key(s0, s1, stream, uint32_t(q >> 32)) ^ uint32_t(q));
  return (c & 1) ? h >> 16 : h & 0xFFFFu;
}

// The 16-point Hadamard sums of signs * v (rht16 before its factor 1/4), in place. Sylvester H, fixed signs.
JHQ_HD void hadamard16_signed(float* v) {
  constexpr uint32_t kNeg = 0xC5B2u;  // bit i set: sign i is -1 (1,-1,1,1,-1,-1,1,-1,-1,1,-1,1,1,1,-1,-1)
#pragma unroll
  for (int i = 0; i < 16; ++i)
    if ((kNeg >> i) & 1u) v[i] = -v[i];
#pragma unroll
  for (int h = 1; h < 16; h *= 2) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if ((i & h) == 0) {
        float a = v[i], b = v[i + h];
        v[i] = a + b;
        v[i + h] = a - b;
      }
    }
  }
}

// 16-point random Hadamard transform (nvfp4.apply_rht): v -> H (signs * v) / 4, in place.
JHQ_HD void rht16(float* v) {
  hadamard16_signed(v);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] *= 0.25f;
}

}  // namespace jaxhq
