// FFI bindings of the GEMM targets, shared by the CUDA handlers (gemm_handlers.cc, whose Bind() carries the
// stream, and the scratch allocator for the grouped ones) and the CPU ones (cpu_gemm.cc): one argument and
// attribute list per target. The dense targets end with a workspace result (uint8 [bytes], sized by
// jaxhq/ffi/gemm.py): their temporaries live there, not in scratch memory, so XLA can record them into its
// CUDA graphs (scratch memory is freed once the call returns, while a graph replays the recorded pointers).
#pragma once
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxhq {
namespace gemm_bind {
namespace ffi = xla::ffi;

// The cuBLASLt workspace of a call (Hopper recommends 32 MiB); the module exports it to the Python sizing.
constexpr size_t kLtWorkspace = 32u << 20;

// A, its scales, B, its scales (per-tensor fp32 scalars, or 1x128 / 128x128 fp32 block scales)
template <typename B>
auto fp8(B&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // a [M, K] (grouped: [T, K])
      .template Arg<ffi::AnyBuffer>()                 // scale_inv a
      .template Arg<ffi::AnyBuffer>()                 // b [N, K] (grouped: [G, N, K])
      .template Arg<ffi::AnyBuffer>();                // scale_inv b (grouped: stacked)
}

template <typename B>
auto fp8_tail(B&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // bias [N] (grouped: [G, N]) or [0]
      .template Arg<ffi::AnyBuffer>()                 // c (aliased to out when accumulating)
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int32_t>("mode_a")
      .template Attr<int32_t>("mode_b")
      .template Attr<int32_t>("layout")
      .template Attr<int32_t>("pad")
      .template Attr<int32_t>("accumulate")
      .template Attr<int32_t>("fast_accum");
}

template <typename B>
auto gemm_fp8(B&& b) {
  return fp8_tail(fp8(std::move(b))).template Ret<ffi::AnyBuffer>();  // + workspace
}

template <typename B>
auto gemm_fp8_grouped(B&& b) {
  return fp8_tail(fp8(std::move(b)).template Arg<ffi::AnyBuffer>());  // + group_sizes [G] int32
}

// The same operands on the FP8 wgmma kernel (Hopper, CUDA only): group sizes read on the device.
template <typename B>
auto gemm_fp8_wgmma_grouped(B&& b) {
  return fp8(std::move(b))
      .template Arg<ffi::AnyBuffer>()  // group_sizes [G] int32
      .template Arg<ffi::AnyBuffer>()  // bias [G, N] or [0]
      .template Arg<ffi::AnyBuffer>()  // c
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int32_t>("mode_a")
      .template Attr<int32_t>("mode_b")
      .template Attr<int32_t>("accumulate");
}

// MXFP8 or NVFP4 operands as bytes: data, scales, NVFP4 amax (or [0]) for A, then for B
template <typename B>
auto dq(B&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // a data
      .template Arg<ffi::AnyBuffer>()                 // a scales (uint8 bytes)
      .template Arg<ffi::AnyBuffer>()                 // a amax (NVFP4) or [0]
      .template Arg<ffi::AnyBuffer>()                 // b data (grouped: [G, N, ...])
      .template Arg<ffi::AnyBuffer>()                 // b scales
      .template Arg<ffi::AnyBuffer>();                // b amax (grouped: [G]) or [0]
}

template <typename B>
auto dq_tail(B&& b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // bias
      .template Arg<ffi::AnyBuffer>()                 // c
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int32_t>("fmt_a")
      .template Attr<int32_t>("fmt_b")
      .template Attr<int64_t>("k")
      .template Attr<int32_t>("accumulate");
}

// b_kn: B's data is [K, N], a decoded copy read transposed (jaxhq.formats.Storage.transposed); rows_inner: MXFP8
// scales come [ceil(K/32), rows], as the quantize launch writes them (csrc/spec.h rows_inner_scale_index)
template <typename B>
auto gemm_dq(B&& b) {
  return dq_tail(dq(std::move(b)))
      .template Attr<int32_t>("b_kn")
      .template Attr<int32_t>("rows_inner")
      .template Ret<ffi::AnyBuffer>();  // + workspace
}

template <typename B>
auto gemm_dq_grouped(B&& b) {
  return dq_tail(dq(std::move(b)).template Arg<ffi::AnyBuffer>())  // + group_sizes [G] int32
      .template Attr<int32_t>("rows_inner");  // as gemm_dq's (B: each group's scales [ceil(K/32), N])
}

}  // namespace gemm_bind
}  // namespace jaxhq
