// The MLP activations' derivatives as jaxhq computes them: in the gradient's quantization from the activation's
// input (jaxhq_quantize's `act`) and on their own (jaxhq_act_grad, the unfused composition), the same functions on
// one platform, so the two agree bit for bit there. The CPU computes exactly specified float32 (a polynomial e^x,
// IEEE reciprocals; fmaf is correctly rounded), which tests/test_activation.py restates in numpy; the GPU takes the
// hardware's ex2.approx and rcp.approx (a few float32 ulps, as XLA's own GPU exp), so the two platforms agree
// within one bfloat16 ulp of the gradient, as numerics.h's div_ref differs by platform. Against jax.nn's functions
// differentiated by JAX in bfloat16: closer to the exact gradient than that (tests/test_activation.py).
#pragma once
#include "numerics.h"

namespace jaxhq {

// Activation ids, shared with jaxhq/ffi/primitives.py (ACT_*, GATED); kActGated: act(first half) * second half.
enum Activation : int32_t { kActGelu = 1, kActSilu = 2, kActRelu = 3 };
constexpr int32_t kActGated = 16;

JHQ_HD float fma_act(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fmaf(a, b, c);
#endif
}

// e^x. GPU: ex2.approx of x log2 e (one instruction: subnormal results flush to 0, where every use of it adds 1).
// CPU: x = n ln2 + r (n = rint(x log2 e), r with a two-part ln2), e^r by its degree-7 Taylor polynomial
// (|r| <= 0.35: truncation below 2^-27), times 2^n in two exact power-of-2 steps (subnormal results round once).
JHQ_HD float exp_act(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.44269504f));
  return r;
#else
  if (is_nan(x)) return x;
  if (x > 88.72284f) return u2f(0x7F800000u);
  if (x < -103.97208f) return 0.0f;
  const float n = rintf(x * 1.44269504f);
  float r = fma_act(n, -0.693359375f, x);  // ln2 = 0.693359375 - 2.12194440e-4 (the first part exact times n)
  r = fma_act(n, 2.12194440e-4f, r);
  float p = 1.98412698e-4f;  // 1/7!
  p = fma_act(p, r, 1.38888889e-3f);
  p = fma_act(p, r, 8.33333333e-3f);
  p = fma_act(p, r, 4.16666667e-2f);
  p = fma_act(p, r, 1.66666667e-1f);
  p = fma_act(p, r, 0.5f);
  p = fma_act(p, r, 1.0f);
  p = fma_act(p, r, 1.0f);
  const int ni = int(n), n1 = ni / 2, n2 = ni - n1;  // n in [-150, 128]: 2^n1, 2^n2 normal
  return (p * u2f(uint32_t(n1 + 127) << 23)) * u2f(uint32_t(n2 + 127) << 23);
#endif
}

// 1 / x (x >= 1 here): IEEE on the CPU, rcp.approx on the GPU.
JHQ_HD float recip_act(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return 1.0f / x;
#endif
}

JHQ_HD float sigmoid_act(float x) { return recip_act(1.0f + exp_act(-x)); }

// jax.nn.gelu(approximate=True): x * 0.5 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(z) = 1 - 2 / (1 + e^2z).
struct GeluParts {
  float cdf, th;
};
JHQ_HD GeluParts gelu_parts(float x) {
  const float z = 0.797884561f * fma_act(0.044715f * x, x * x, x);
  const float th = 1.0f - 2.0f * recip_act(1.0f + exp_act(z + z));
  return {0.5f * (1.0f + th), th};
}

// act(x) and act'(x) of activation `kind` (kActGelu, kActSilu, kActRelu), from one exponential and reciprocal
// (inlined, a caller that takes one of them computes only that one).
JHQ_HD void act_value_slope(int32_t kind, float x, float& value, float& slope) {
  if (kind == kActGelu) {
    const GeluParts g = gelu_parts(x);
    const float dz = 0.797884561f * fma_act(0.134145f * x, x, 1.0f);  // d/dx of the tanh's argument
    value = x * g.cdf;
    slope = fma_act((0.5f * x) * fma_act(-g.th, g.th, 1.0f), dz, g.cdf);
  } else if (kind == kActSilu) {
    const float s = sigmoid_act(x);
    value = x * s;
    slope = s * fma_act(x, 1.0f - s, 1.0f);
  } else {
    value = nmax(x, 0.0f);
    slope = x > 0.0f ? 1.0f : 0.0f;
  }
}
JHQ_HD float act_value(int32_t kind, float x) {
  float v, s;
  act_value_slope(kind, x, v, s);
  return v;
}
JHQ_HD float act_slope(int32_t kind, float x) {
  float v, s;
  act_value_slope(kind, x, v, s);
  return s;
}

// The gradient of act(h) (plain) or of act(g) * u (gated: h = [g, u] along its last axis, halves of F columns)
// given dy, before its rounding: a plain column, a gate column (g, its u, dy) and an up column (its g, dy).
JHQ_HD float act_grad_plain(int32_t kind, float x, float dy) { return dy * act_slope(kind, x); }
JHQ_HD float act_grad_gate(int32_t kind, float g, float u, float dy) { return (dy * u) * act_slope(kind, g); }
JHQ_HD float act_grad_up(int32_t kind, float g, float dy) { return dy * act_value(kind, g); }

// A gate column's and its up column's gradients from one g, u and dy: act_grad_gate's and act_grad_up's floats,
// the activation's exponential and reciprocal taken once for both.
JHQ_HD void act_grad_gate_up(int32_t kind, float g, float u, float dy, float& gate, float& up) {
  float value, slope;
  act_value_slope(kind, g, value, slope);
  gate = (dy * u) * slope;
  up = dy * value;
}

// Column c of the gradient of a row of h (bfloat16 bits, k values) given its row of dy (k, gated k / 2 = dk).
JHQ_HD float act_grad_at(int32_t act, const uint16_t* h_row, const uint16_t* dy_row, int64_t c, int64_t dk) {
  const int32_t kind = act & ~kActGated;
  if (!(act & kActGated)) return act_grad_plain(kind, bf16_bits_to_f32(h_row[c]), bf16_bits_to_f32(dy_row[c]));
  if (c < dk) {
    return act_grad_gate(kind, bf16_bits_to_f32(h_row[c]), bf16_bits_to_f32(h_row[c + dk]),
                         bf16_bits_to_f32(dy_row[c]));
  }
  return act_grad_up(kind, bf16_bits_to_f32(h_row[c - dk]), bf16_bits_to_f32(dy_row[c - dk]));
}

}  // namespace jaxhq
