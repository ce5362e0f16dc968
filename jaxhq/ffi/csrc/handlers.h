// The FFI handler symbols of the extension, one per (target, platform).
#pragma once
#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* jaxhq_cpu_amax(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jaxhq_cpu_quantize(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jaxhq_cpu_quantize_into(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jaxhq_cpu_dequantize(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jaxhq_cpu_act_grad(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jaxhq_cpu_gemm_fp8(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jaxhq_cpu_gemm_dq(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jaxhq_cpu_gemm_fp8_grouped(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jaxhq_cpu_gemm_dq_grouped(XLA_FFI_CallFrame* call_frame);
#ifdef JAXHQ_WITH_CUDA
XLA_FFI_Error* jaxhq_cuda_amax(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jaxhq_cuda_quantize(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jaxhq_cuda_quantize_into(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jaxhq_cuda_dequantize(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* jaxhq_cuda_act_grad(XLA_FFI_CallFrame* call_frame);
#endif
}
