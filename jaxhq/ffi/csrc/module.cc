// The nanobind module: hands Python one PyCapsule per FFI handler, by platform.
#include <nanobind/nanobind.h>

#include "gemm/bindings.h"
#include "handlers.h"
#ifdef JAXHQ_WITH_CUDA
#include "gemm/registry.h"
#endif
#ifdef JAXHQ_WITH_CUTLASS
#include "gemm/fp8_cutlass_grouped.h"
#endif

namespace nb = nanobind;

namespace {
template <typename F>
nb::capsule capsule(F* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_jaxhq_ffi, m) {
  m.doc() = "jaxhq XLA FFI handlers (CPU always, CUDA when built with nvcc)";
  m.def("registrations", []() {
    nb::dict cpu, cuda, out;
    cpu["jaxhq_amax"] = capsule(jaxhq_cpu_amax);
    cpu["jaxhq_quantize"] = capsule(jaxhq_cpu_quantize);
    cpu["jaxhq_quantize_into"] = capsule(jaxhq_cpu_quantize_into);
    cpu["jaxhq_dequantize"] = capsule(jaxhq_cpu_dequantize);
    cpu["jaxhq_act_grad"] = capsule(jaxhq_cpu_act_grad);
    cpu["jaxhq_gemm_fp8"] = capsule(jaxhq_cpu_gemm_fp8);
    cpu["jaxhq_gemm_dq"] = capsule(jaxhq_cpu_gemm_dq);
    cpu["jaxhq_gemm_fp8_grouped"] = capsule(jaxhq_cpu_gemm_fp8_grouped);
    cpu["jaxhq_gemm_dq_grouped"] = capsule(jaxhq_cpu_gemm_dq_grouped);
#ifdef JAXHQ_WITH_CUDA
    cuda["jaxhq_amax"] = capsule(jaxhq_cuda_amax);
    cuda["jaxhq_quantize"] = capsule(jaxhq_cuda_quantize);
    cuda["jaxhq_quantize_into"] = capsule(jaxhq_cuda_quantize_into);
    cuda["jaxhq_dequantize"] = capsule(jaxhq_cuda_dequantize);
    cuda["jaxhq_act_grad"] = capsule(jaxhq_cuda_act_grad);
    for (const jaxhq::GemmHandler* h = jaxhq::gemm_cuda_handlers(); h->name; ++h) cuda[h->name] = capsule(h->fn);
#endif
    out["cpu"] = cpu;
    out["cuda"] = cuda;
    return out;
  });
  m.attr("lt_workspace_bytes") = size_t(jaxhq::gemm_bind::kLtWorkspace);  // jaxhq/ffi/gemm.py sizes calls with it
#ifdef JAXHQ_WITH_CUTLASS
  // the workspace result of jaxhq_gemm_fp8_cutlass_grouped (bf16: jaxhq_gemm_bf16_cutlass_grouped) on the current
  // device (jaxhq/ffi/gemm.py sizes calls)
  m.def("cutlass_grouped_workspace_bytes",
        [](int64_t groups, int64_t t, int64_t n, int64_t k, bool a_e5m2, bool fast_accum, bool blockwise,
           bool bf16) {
          jaxhq::gemm::CutlassGrouped p{};
          p.groups = groups, p.t = t, p.n = n, p.k = k;
          p.a_e5m2 = a_e5m2, p.fast_accum = fast_accum, p.blockwise = blockwise, p.bf16 = bf16;
          return jaxhq::gemm::cutlass_grouped_workspace_bytes(p);
        });
  // the workspace result of jaxhq_gemm_cutlass_kgrouped (grouped along K, the MoE wgrad)
  m.def("cutlass_kgrouped_workspace_bytes", [](int64_t groups, int64_t m, int64_t n, int64_t t, bool bf16) {
    jaxhq::gemm::CutlassKGrouped p{};
    p.groups = groups, p.m = m, p.n = n, p.t = t, p.bf16 = bf16;
    return jaxhq::gemm::cutlass_kgrouped_workspace_bytes(p);
  });
#endif
#ifdef JAXHQ_WITH_CUDA
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
}
