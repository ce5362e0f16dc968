// CPU FFI handlers: amax, quantize (any rowwise/columnwise pair), dequantize, an activation's gradient.
#include "ffi_args.h"
#include "handlers.h"

namespace ffi = xla::ffi;
using namespace jaxhq;

static ffi::Error cpu_amax(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                           ffi::Result<ffi::Buffer<ffi::F32>> amax_rht, int32_t rht) {
  AmaxArgs a;
  if (auto e = make_amax_args(x, rht, &a); e.failure()) return e;
  amax_cpu(x.untyped_data(), a.dtype, a.batch, a.m, a.k, rht != 0, amax->typed_data(), amax_rht->typed_data());
  return ffi::Error::Success();
}

static ffi::Error cpu_quantize(ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::Buffer<ffi::F32> scale_row,
                               ffi::Buffer<ffi::F32> scale_col, ffi::Buffer<ffi::U32> seed,
                               ffi::Result<ffi::AnyBuffer> rd, ffi::Result<ffi::AnyBuffer> rs,
                               ffi::Result<ffi::AnyBuffer> cd, ffi::Result<ffi::AnyBuffer> cs,
                               ffi::Result<ffi::AnyBuffer> amax, int32_t row_fmt, int32_t row_opts, int32_t col_fmt,
                               int32_t col_opts, float amax_eps, int32_t act) {
  QuantizeArgs a;
  if (auto e = make_quantize_args(x, dy, act, scale_row, scale_col, seed, rd, rs, cd, cs, amax, row_fmt, row_opts,
                                  col_fmt, col_opts, amax_eps, &a);
      e.failure())
    return e;
  quantize_cpu(a);
  return ffi::Error::Success();
}

static ffi::Error cpu_dequantize(ffi::AnyBuffer data, ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> scalar,
                                 ffi::Result<ffi::Buffer<ffi::F32>> out, int32_t fmt, int32_t opts) {
  DequantizeArgs a;
  if (auto e = make_dequantize_args(data, scale, scalar, out, fmt, opts, &a); e.failure()) return e;
  dequantize_cpu(a);
  return ffi::Error::Success();
}

// The same quantize writing into buffers the caller provides (aliased inputs 5..8 = outputs 0..3; the
// amax output is not aliased): tests poison them first to prove every output element is written.
static ffi::Error cpu_quantize_into(ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::Buffer<ffi::F32> scale_row,
                                    ffi::Buffer<ffi::F32> scale_col, ffi::Buffer<ffi::U32> seed, ffi::AnyBuffer,
                                    ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> rd,
                                    ffi::Result<ffi::AnyBuffer> rs, ffi::Result<ffi::AnyBuffer> cd,
                                    ffi::Result<ffi::AnyBuffer> cs, ffi::Result<ffi::AnyBuffer> amax, int32_t row_fmt,
                                    int32_t row_opts, int32_t col_fmt, int32_t col_opts, float amax_eps, int32_t act) {
  return cpu_quantize(x, dy, scale_row, scale_col, seed, rd, rs, cd, cs, amax, row_fmt, row_opts, col_fmt, col_opts,
                      amax_eps, act);
}

static ffi::Error cpu_act_grad(ffi::AnyBuffer h, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> out, int32_t act) {
  QuantizeArgs a;
  if (auto e = make_act_grad_args(h, dy, act, out, &a); e.failure()) return e;
  act_grad_cpu(h.untyped_data(), dy.untyped_data(), act, a.batch * a.m, a.k,
               static_cast<uint16_t*>(out->untyped_data()));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cpu_amax, cpu_amax, bind_amax(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cpu_quantize, cpu_quantize, bind_quantize(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cpu_quantize_into, cpu_quantize_into, bind_quantize_into(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cpu_dequantize, cpu_dequantize, bind_dequantize(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cpu_act_grad, cpu_act_grad, bind_act_grad(ffi::Ffi::Bind()));
