// Host-side entry points of the CUDA kernels (plain C++: the handlers include no CUDA headers of ours).
#pragma once
#include <string>

#include "cpu_quantize.h"

namespace jaxhq {
// Each returns an empty string on success, else the CUDA error text.
std::string launch_amax(const void* x, int32_t dtype, int64_t batch, int64_t m, int64_t k, bool rht, float* amax,
                        float* amax_rht, void* stream);
std::string launch_quantize(const QuantizeArgs& a, void* stream);  // the variant JAXHQ_QUANTIZE_VARIANT names
// Variants of the quantize kernel (same results): the shared-memory tile kernel for every call, or the
// register-tile kernel (16-bit inputs, FP8 formats; it hands the other calls to the tile kernel).
enum QuantizeVariant : int { kAlternatingLoad = 0, kRegisterTile = 2 };
std::string launch_quantize(const QuantizeArgs& a, void* stream, int variant);
std::string launch_dequantize(const DequantizeArgs& a, void* stream);
std::string launch_act_grad(const void* h, const void* dy, int32_t act, int64_t rows, int64_t k, uint16_t* out,
                            void* stream);  // act_grad_cpu's result on the GPU (activation.h: its numerics there)
}  // namespace jaxhq
