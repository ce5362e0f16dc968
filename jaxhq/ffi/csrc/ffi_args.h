// Turning FFI buffers and attributes into QuantizeArgs / DequantizeArgs, shared by the CPU and CUDA handlers.
#pragma once
#include <string>
#include <utility>

#include "cpu_quantize.h"
#include "activation.h"
#include "numerics.h"
#include "xla/ffi/api/ffi.h"

namespace jaxhq {
namespace ffi = xla::ffi;

inline ffi::Error in_dtype(ffi::DataType t, int32_t* out) {
  switch (t) {
    case ffi::DataType::F32: *out = kF32; return ffi::Error::Success();
    case ffi::DataType::BF16: *out = kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: *out = kF16; return ffi::Error::Success();
    default: return ffi::Error::InvalidArgument("jaxhq quantize: input must be float32, bfloat16 or float16");
  }
}

// [..., M, K] -> batch, M, K
inline ffi::Error split_dims(const ffi::AnyBuffer& x, int64_t* batch, int64_t* m, int64_t* k) {
  auto d = x.dimensions();
  if (d.size() < 2) return ffi::Error::InvalidArgument("jaxhq: input must have rank >= 2");
  *batch = 1;
  for (size_t i = 0; i + 2 < d.size(); ++i) *batch *= d[i];
  *m = d[d.size() - 2];
  *k = d[d.size() - 1];
  return ffi::Error::Success();
}

inline ffi::Error check_bytes(const char* what, const ffi::AnyBuffer& b, int64_t want) {
  if (int64_t(b.size_bytes()) != want)
    return ffi::Error::InvalidArgument(std::string("jaxhq quantize: output ") + what + " has " +
                                       std::to_string(b.size_bytes()) + " bytes, expected " +
                                       std::to_string(want));
  return ffi::Error::Success();
}

// The amax handlers' input: x [batch, m, k] and its dtype; the RHT groups 16 rows.
struct AmaxArgs {
  int32_t dtype = 0;
  int64_t batch = 1, m = 0, k = 0;
};
inline ffi::Error make_amax_args(const ffi::AnyBuffer& x, int32_t rht, AmaxArgs* a) {
  if (auto e = in_dtype(x.element_type(), &a->dtype); e.failure()) return e;
  if (auto e = split_dims(x, &a->batch, &a->m, &a->k); e.failure()) return e;
  if (rht && a->m % 16) return ffi::Error::InvalidArgument("jaxhq amax: RHT needs rows to be a multiple of 16");
  return ffi::Error::Success();
}

// The activation-gradient input (act != 0): h bfloat16 [..., M, K] in x's place, dy bfloat16 [..., M, K] (gated:
// K / 2); dy empty when act is 0.
inline ffi::Error check_act_grad(const ffi::AnyBuffer& h, const ffi::AnyBuffer& dy, int32_t act, QuantizeArgs* a) {
  if (act == 0) {
    if (dy.size_bytes() != 0) return ffi::Error::InvalidArgument("jaxhq quantize: dy given without an activation");
    return ffi::Error::Success();
  }
  const int32_t kind = act & ~kActGated;
  if (kind < kActGelu || kind > kActRelu || (act & ~(kActGated | 3)))
    return ffi::Error::InvalidArgument("jaxhq quantize: unknown activation id " + std::to_string(act));
  const bool gated = act & kActGated;
  const auto hd = h.dimensions(), dd = dy.dimensions();
  bool ok = h.element_type() == ffi::DataType::BF16 && dy.element_type() == ffi::DataType::BF16 &&
            hd.size() == dd.size() && (!gated || a->k % 2 == 0);
  for (size_t i = 0; ok && i < hd.size(); ++i)
    ok = dd[i] == (i + 1 == hd.size() && gated ? hd[i] / 2 : hd[i]);
  if (!ok)
    return ffi::Error::InvalidArgument("jaxhq quantize: the activation gradient takes h and dy in bfloat16, dy of h's "
                                       "shape (gated: half its last axis, which must be even)");
  a->dy = dy.untyped_data();
  a->act = act;
  return ffi::Error::Success();
}

// jaxhq_act_grad: h [..., M, K], dy as for the quantize's `act`, the result of h's shape in bfloat16.
inline ffi::Error make_act_grad_args(const ffi::AnyBuffer& h, const ffi::AnyBuffer& dy, int32_t act,
                                     ffi::Result<ffi::AnyBuffer>& out, QuantizeArgs* a) {
  if (auto e = split_dims(h, &a->batch, &a->m, &a->k); e.failure()) return e;
  if (act == 0) return ffi::Error::InvalidArgument("jaxhq act_grad: an activation id is needed");
  if (auto e = check_act_grad(h, dy, act, a); e.failure()) return e;
  if (out->element_type() != ffi::DataType::BF16 || out->element_count() != h.element_count())
    return ffi::Error::InvalidArgument("jaxhq act_grad: the result must be bfloat16 of h's shape");
  a->x = h.untyped_data();
  return ffi::Error::Success();
}

inline ffi::Error make_quantize_args(const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy, int32_t act,
                                     const ffi::Buffer<ffi::F32>& scale_row, const ffi::Buffer<ffi::F32>& scale_col,
                                     const ffi::Buffer<ffi::U32>& seed, ffi::Result<ffi::AnyBuffer>& rd,
                                     ffi::Result<ffi::AnyBuffer>& rs, ffi::Result<ffi::AnyBuffer>& cd,
                                     ffi::Result<ffi::AnyBuffer>& cs, ffi::Result<ffi::AnyBuffer>& amax,
                                     int32_t row_fmt, int32_t row_opts, int32_t col_fmt, int32_t col_opts,
                                     float amax_eps, QuantizeArgs* a) {
  if (auto e = in_dtype(x.element_type(), &a->dtype); e.failure()) return e;
  if (auto e = split_dims(x, &a->batch, &a->m, &a->k); e.failure()) return e;
  if (row_fmt < 0 || row_fmt > 5 || col_fmt < 0 || col_fmt > 5)
    return ffi::Error::InvalidArgument("jaxhq quantize: unknown format id");
  const bool row_b = row_fmt && (row_opts & kBf16Input), col_b = col_fmt && (col_opts & kBf16Input);
  if (row_b || col_b) {  // x is read as x.astype(bfloat16)
    if (a->dtype != kF32 || (row_fmt && !row_b) || (col_fmt && !col_b))
      return ffi::Error::InvalidArgument("jaxhq quantize: the bfloat16-input option needs float32 x and both "
                                         "copies of the launch to ask for it");
    a->dtype = kF32AsBF16;
  }
  if ((col_fmt == kNvfp4 && (col_opts & kRHT) && a->m % 16) || (row_fmt == kNvfp4 && (row_opts & kRHT) && a->k % 16))
    return ffi::Error::InvalidArgument("jaxhq quantize: RHT needs the transformed axis to be a multiple of 16");
  const int64_t nr = int64_t(scale_row.element_count()), nc = int64_t(scale_col.element_count()),
                ns = int64_t(seed.element_count());
  if (nr != a->batch || nc != a->batch || ns != kSeedWords * a->batch)
    return ffi::Error::InvalidArgument(
        "jaxhq quantize: scale_row and scale_col must hold one float32 per batch element and seed six uint32 (batch " +
        std::to_string(a->batch) + "), got " + std::to_string(nr) + ", " + std::to_string(nc) + " and " +
        std::to_string(ns));
  a->amax_eps = amax_eps;
  for (auto [fmt, opts] : {std::pair{row_fmt, row_opts}, std::pair{col_fmt, col_opts}})
    if ((opts & kDecoded) && fmt != kMxfp8 && fmt != kNvfp4)
      return ffi::Error::InvalidArgument("jaxhq quantize: only MXFP8 and NVFP4 copies can be decoded (format id " +
                                         std::to_string(fmt) + ")");
  const int64_t B = a->batch, M = a->m, K = a->k;
  if (auto e = check_bytes("row data", *rd, B * data_bytes(row_fmt, M, K, row_opts & kDecoded)); e.failure()) return e;
  if (auto e = check_bytes("row scale", *rs, B * quantize_scale_bytes(row_fmt, M, K)); e.failure()) return e;
  if (auto e = check_bytes("col data", *cd, B * data_bytes(col_fmt, K, M, col_opts & kDecoded)); e.failure()) return e;
  if (auto e = check_bytes("col scale", *cs, B * quantize_scale_bytes(col_fmt, K, M)); e.failure()) return e;
  // the amax output: empty (not asked for) or float32 [batch]
  if (amax->size_bytes() != 0) {
    if (amax->element_type() != ffi::DataType::F32 || int64_t(amax->element_count()) != B)
      return ffi::Error::InvalidArgument("jaxhq quantize: the amax output must be empty or float32 [batch]");
    a->amax = static_cast<float*>(amax->untyped_data());
  }
  if (auto e = check_act_grad(x, dy, act, a); e.failure()) return e;
  a->x = x.untyped_data();
  a->scales[0] = scale_row.typed_data();
  a->scales[1] = scale_col.typed_data();
  a->seed = seed.typed_data();
  a->row = CopySpec{row_fmt, row_opts, rd->untyped_data(), rs->untyped_data()};
  a->col = CopySpec{col_fmt, col_opts, cd->untyped_data(), cs->untyped_data()};
  return ffi::Error::Success();
}

inline ffi::Error make_dequantize_args(const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale,
                                       const ffi::Buffer<ffi::F32>& scalar, ffi::Result<ffi::Buffer<ffi::F32>>& out,
                                       int32_t fmt, int32_t opts, DequantizeArgs* a) {
  auto d = out->dimensions();
  if (d.size() < 2) return ffi::Error::InvalidArgument("jaxhq dequantize: output must have rank >= 2");
  a->batch = 1;
  for (size_t i = 0; i + 2 < d.size(); ++i) a->batch *= d[i];
  a->r = d[d.size() - 2];
  a->c = d[d.size() - 1];
  if (fmt < 1 || fmt > 5) return ffi::Error::InvalidArgument("jaxhq dequantize: unknown format id");
  if (int64_t(data.size_bytes()) != a->batch * data_bytes(fmt, a->r, a->c) ||
      int64_t(scale.size_bytes()) != a->batch * scale_bytes(fmt, a->r, a->c) ||
      int64_t(scalar.element_count()) != a->batch)
    return ffi::Error::InvalidArgument("jaxhq dequantize: data/scale/scalar sizes do not match the output shape");
  a->data = data.untyped_data();
  a->scale = scale.untyped_data();
  a->scalar = scalar.typed_data();
  a->out = out->typed_data();
  a->fmt = fmt;
  a->opts = opts;
  return ffi::Error::Success();
}

// FFI bindings shared by the CPU and CUDA handlers; each platform passes its Bind() (CUDA: with the stream).
// Binding's builder methods take *this as an rvalue, hence the moves.
template <typename B>
auto bind_amax(B&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int32_t>("rht");
}

template <typename B>
auto bind_quantize_outputs(B&& b) {  // row data, row scale, col data, col scale, amax; the format attributes
  return std::move(b).template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int32_t>("row_fmt")
      .template Attr<int32_t>("row_opts")
      .template Attr<int32_t>("col_fmt")
      .template Attr<int32_t>("col_opts")
      .template Attr<float>("amax_eps")
      .template Attr<int32_t>("act");
}

template <typename B>
auto bind_quantize_inputs(B&& b) {  // x, dy (empty unless `act`), scale_row and scale_col [batch, 1], seed [batch, 6]
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::U32>>();
}

template <typename B>
auto bind_quantize(B&& b) {
  return bind_quantize_outputs(bind_quantize_inputs(std::move(b)));
}

template <typename B>
auto bind_quantize_into(B&& b) {  // + the four output buffers, aliased to the results
  return bind_quantize_outputs(bind_quantize_inputs(std::move(b))
                                   .template Arg<ffi::AnyBuffer>()
                                   .template Arg<ffi::AnyBuffer>()
                                   .template Arg<ffi::AnyBuffer>()
                                   .template Arg<ffi::AnyBuffer>());
}

template <typename B>
auto bind_act_grad(B&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int32_t>("act");
}

template <typename B>
auto bind_dequantize(B&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int32_t>("fmt")
      .template Attr<int32_t>("opts");
}

}  // namespace jaxhq
