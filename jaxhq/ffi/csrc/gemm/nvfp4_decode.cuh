// The NVFP4 wgmma kernel's decode (nvfp4_wgmma.cu): E2M1 codes and E4M3 block scales to exact fp16 operands.
// Host fallbacks let the CPU emulator (tests/cuda_emu) check it against ml_dtypes.
//
// An E2M1 value times its E4M3 scale has at most 6 significant bits: exact in fp16 once shifted into range. The
// operand is e2m1 * scale * 2^-8 (largest 6 * 448 / 256 = 10.5, lowest bit 2^-18, above fp16's 2^-24). A code's
// magnitude bits go into fp16 bits 9-11 and its sign into bit 15, which reads as e2m1 * 2^-14 (subnormal below 1);
// one exact fp16 product with the scale word `scale * 2^6` (at most 28672, at least 2^-3) gives the operand.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "numerics.h"

namespace jaxhq {
namespace gemm {

// An E4M3 scale byte -> the word the decode multiplies by: scale * 2^6 in both fp16 halves (NaN stays NaN).
JHQ_HD uint32_t nvfp4_scale_word(uint8_t s) {
  const uint32_t h = __half_as_ushort(__float2half_rn(e4m3_value(s) * 64.0f));
  return h | (h << 16);
}

// a * b on two fp16 pairs, rounded to nearest (exact here: every product is representable).
JHQ_HD uint32_t hmul2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  const auto mul = [](uint32_t x, uint32_t y) -> uint32_t {  // the float product of two halves is exact
    return __half_as_ushort(__float2half_rn(__half2float(__ushort_as_half(uint16_t(x))) *
                                            __half2float(__ushort_as_half(uint16_t(y)))));
  };
  return mul(a & 0xFFFFu, b & 0xFFFFu) | (mul(a >> 16, b >> 16) << 16);
#endif
}

// Codes c and c + 4 of the 32-bit word w (code i in bits 4i..4i+3) -> their fp16 pair times the scale word.
JHQ_HD uint32_t decode_pair(uint32_t w, int c, uint32_t scale) {
  const uint32_t x = w >> (4 * c);
  return hmul2(((x << 9) & 0x0E000E00u) | ((x << 12) & 0x80008000u), scale);
}

// Eight codes -> fp16 pairs (0, 4), (1, 5), (2, 6), (3, 7): decode_pair for c = 0..3, each with fixed shifts.
JHQ_HD uint4 decode8(uint32_t w, uint32_t scale) {
  constexpr uint32_t kMag = 0x0E000E00u, kSign = 0x80008000u;
  uint4 o;
  o.x = hmul2(((w << 9) & kMag) | ((w << 12) & kSign), scale);
  o.y = hmul2(((w << 5) & kMag) | ((w << 8) & kSign), scale);
  o.z = hmul2(((w << 1) & kMag) | ((w << 4) & kSign), scale);
  o.w = hmul2(((w >> 3) & kMag) | (w & kSign), scale);
  return o;
}

}  // namespace gemm
}  // namespace jaxhq
