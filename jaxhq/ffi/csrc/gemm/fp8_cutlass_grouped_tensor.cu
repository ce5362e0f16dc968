// The per-tensor FP8 grouped GEMMs on CUTLASS (fp8_cutlass_grouped.h): promoted or fast accumulation, E4M3 x E4M3
// (forward) and E5M2 x E4M3 (dgrad of an E5M2 gradient), bf16 out; the machinery is cutlass_grouped.cuh's, the
// other kernels are in fp8_cutlass_grouped.cu (two files, compiled in parallel).
#include "cutlass_grouped.cuh"

namespace jaxhq {
namespace gemm {
namespace {

template <typename F>
auto per_tensor(const CutlassGrouped& p, F&& f) {  // f(kernel) for the kernel that takes p
  if (p.fast_accum) return p.a_e5m2 ? f(Kernel<E5, E4, BF, Fast>{}) : f(Kernel<E4, E4, BF, Fast>{});
  return p.a_e5m2 ? f(Kernel<E5, E4, BF, Promoted>{}) : f(Kernel<E4, E4, BF, Promoted>{});
}

}  // namespace

int64_t tensor_grouped_workspace_bytes(const CutlassGrouped& p) {
  return per_tensor(p, [&](auto kernel) { return int64_t(workspace_bytes_of<decltype(kernel)>(p)); });
}

std::string tensor_grouped_gemm(const CutlassGrouped& p, cudaStream_t s) {
  return per_tensor(p, [&](auto kernel) { return run<decltype(kernel)>(p, s); });
}

}  // namespace gemm
}  // namespace jaxhq
