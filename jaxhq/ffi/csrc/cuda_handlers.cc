// CUDA FFI handlers: the same targets and signatures as cpu_handlers.cc, on the call's stream.
#include <cuda_runtime.h>

#include "cuda_launch.h"
#include "ffi_args.h"
#include "handlers.h"

namespace ffi = xla::ffi;
using namespace jaxhq;

static ffi::Error status(const std::string& err, const char* what) {
  if (err.empty()) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jaxhq ") + what + ": CUDA error: " + err);
}

static ffi::Error cuda_amax(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                            ffi::Result<ffi::Buffer<ffi::F32>> amax_rht, int32_t rht) {
  AmaxArgs a;
  if (auto e = make_amax_args(x, rht, &a); e.failure()) return e;
  return status(launch_amax(x.untyped_data(), a.dtype, a.batch, a.m, a.k, rht != 0, amax->typed_data(),
                            amax_rht->typed_data(), stream),
                "amax");
}

static ffi::Error cuda_quantize(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                                ffi::Buffer<ffi::F32> scale_row, ffi::Buffer<ffi::F32> scale_col,
                                ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> rd,
                                ffi::Result<ffi::AnyBuffer> rs, ffi::Result<ffi::AnyBuffer> cd,
                                ffi::Result<ffi::AnyBuffer> cs, ffi::Result<ffi::AnyBuffer> amax, int32_t row_fmt,
                                int32_t row_opts, int32_t col_fmt, int32_t col_opts, float amax_eps, int32_t act) {
  QuantizeArgs a;
  if (auto e = make_quantize_args(x, dy, act, scale_row, scale_col, seed, rd, rs, cd, cs, amax, row_fmt, row_opts,
                                  col_fmt, col_opts, amax_eps, &a);
      e.failure())
    return e;
  return status(launch_quantize(a, stream), "quantize");
}

static ffi::Error cuda_dequantize(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                                  ffi::Buffer<ffi::F32> scalar, ffi::Result<ffi::Buffer<ffi::F32>> out, int32_t fmt,
                                  int32_t opts) {
  DequantizeArgs a;
  if (auto e = make_dequantize_args(data, scale, scalar, out, fmt, opts, &a); e.failure()) return e;
  return status(launch_dequantize(a, stream), "dequantize");
}

// The same quantize writing into buffers the caller provides (aliased inputs 5..8 = outputs 0..3; the
// amax output is not aliased): tests poison them first to prove every output element is written.
static ffi::Error cuda_quantize_into(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                                     ffi::Buffer<ffi::F32> scale_row, ffi::Buffer<ffi::F32> scale_col,
                                     ffi::Buffer<ffi::U32> seed, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                                     ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> rd,
                                     ffi::Result<ffi::AnyBuffer> rs, ffi::Result<ffi::AnyBuffer> cd,
                                     ffi::Result<ffi::AnyBuffer> cs, ffi::Result<ffi::AnyBuffer> amax, int32_t row_fmt,
                                     int32_t row_opts, int32_t col_fmt, int32_t col_opts, float amax_eps, int32_t act) {
  return cuda_quantize(stream, x, dy, scale_row, scale_col, seed, rd, rs, cd, cs, amax, row_fmt, row_opts, col_fmt,
                       col_opts, amax_eps, act);
}

static ffi::Error cuda_act_grad(cudaStream_t stream, ffi::AnyBuffer h, ffi::AnyBuffer dy,
                                ffi::Result<ffi::AnyBuffer> out, int32_t act) {
  QuantizeArgs a;
  if (auto e = make_act_grad_args(h, dy, act, out, &a); e.failure()) return e;
  return status(launch_act_grad(h.untyped_data(), dy.untyped_data(), act, a.batch * a.m, a.k,
                                static_cast<uint16_t*>(out->untyped_data()), stream),
                "act_grad");
}

static auto cuda_bind() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }

// Kernel launches on the call's stream and nothing else (no host synchronisation, no allocation): XLA may
// record them into its CUDA graphs (command buffers) with the fusions around them.
#define JAXHQ_GRAPHABLE {ffi::Traits::kCmdBufferCompatible}
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_amax, cuda_amax, bind_amax(cuda_bind()), JAXHQ_GRAPHABLE);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_quantize, cuda_quantize, bind_quantize(cuda_bind()), JAXHQ_GRAPHABLE);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_quantize_into, cuda_quantize_into, bind_quantize_into(cuda_bind()),
                              JAXHQ_GRAPHABLE);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_dequantize, cuda_dequantize, bind_dequantize(cuda_bind()), JAXHQ_GRAPHABLE);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_act_grad, cuda_act_grad, bind_act_grad(cuda_bind()), JAXHQ_GRAPHABLE);
