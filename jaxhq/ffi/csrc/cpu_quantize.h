// CPU implementations behind the CPU FFI handlers.
#pragma once
#include "spec.h"

namespace jaxhq {

struct DequantizeArgs {
  const void* data = nullptr;    // [batch, R, C] fp8 or packed fp4
  const void* scale = nullptr;   // per-block scales, layout per format
  const float* scalar = nullptr; // [batch]: scale_inv (FP8 per-tensor) or global encode (NVFP4); else unused
  float* out = nullptr;          // [batch, R, C] float32
  int32_t fmt = 0, opts = 0;
  int64_t batch = 1, r = 0, c = 0;
};

void quantize_cpu(const QuantizeArgs& a);
void amax_cpu(const void* x, int32_t dtype, int64_t batch, int64_t m, int64_t k, bool rht, float* amax,
              float* amax_rht);
void dequantize_cpu(const DequantizeArgs& a);
// The gradient of activation `act` (activation.h) given its input h and its output's gradient dy (bfloat16 bits,
// rows of k and of k or k / 2 values) as bfloat16 bits [rows, k].
void act_grad_cpu(const void* h, const void* dy, int32_t act, int64_t rows, int64_t k, uint16_t* out);

}  // namespace jaxhq
