// The CUDA GEMM handlers of jaxhq/ffi/csrc/gemm, as a null-terminated {name, handler} table that the
// extension module hands to Python (one PyCapsule each) next to the quantize handlers.
#pragma once

namespace jaxhq {
struct GemmHandler {
  const char* name;
  void* fn;
};
// {"jaxhq_gemm_fp8", ...}, {"jaxhq_gemm_dq", ...}, {nullptr, nullptr}
const GemmHandler* gemm_cuda_handlers();
}  // namespace jaxhq
