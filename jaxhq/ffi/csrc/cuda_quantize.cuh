// What the quantize kernels (cuda_quantize.cu: the shared-memory tile kernel; cuda_quantize_regs.cu: the
// register-tile kernel) take: both copies' formats, outputs and shapes, and the per-batch scalars.
#pragma once
#include <string>

#include "cuda_common.cuh"
#include "spec.h"

namespace jaxhq {

struct SideParams {
  int32_t fmt, opts;
  uint8_t* data;
  uint8_t* scale;
  int64_t R, C;            // the copy's shape
  int64_t dbytes, sbytes;  // per batch element
};

struct Params {
  const void* x;
  int64_t m, k;
  const float* scales;
  const uint32_t* seed;
  SideParams side[2];  // 0: rowwise [m, k], 1: columnwise [k, m]
};

inline Params make_params(const QuantizeArgs& a) {
  Params p;
  p.x = a.x;
  p.m = a.m;
  p.k = a.k;
  p.scales = a.scales;
  p.seed = a.seed;
  const CopySpec* cs[2] = {&a.row, &a.col};
  for (int s = 0; s < 2; ++s) {
    const int64_t R = s == 0 ? a.m : a.k, C = s == 0 ? a.k : a.m;
    p.side[s] = SideParams{cs[s]->fmt, cs[s]->opts, static_cast<uint8_t*>(cs[s]->data),
                           static_cast<uint8_t*>(cs[s]->scale), R, C, data_bytes(cs[s]->fmt, R, C),
                           scale_bytes(cs[s]->fmt, R, C)};
  }
  return p;
}

template <typename T> __device__ constexpr int dtype_id() { return kF32; }
template <> __device__ constexpr int dtype_id<__nv_bfloat16>() { return kBF16; }
template <> __device__ constexpr int dtype_id<__half>() { return kF16; }

// The register-tile kernel (cuda_quantize_regs.cu): 16-bit inputs, no RHT.
bool register_tile_takes(const QuantizeArgs& a);
std::string launch_register_tile(const Params& p, int32_t dtype, int64_t batch, cudaStream_t s);

}  // namespace jaxhq
