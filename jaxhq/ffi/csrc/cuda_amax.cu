// Per-tensor amax: max |x| over [M, K] (and, for NVFP4 with RHT, max |RHT(x.T)| over 16-row groups of each
// column) in one read. Atomic max on the float bits (non-negative floats, NaN included, order as uints).
#include "cuda_common.cuh"
#include "cuda_launch.h"

namespace jaxhq {
namespace {

constexpr int kThreads = 256, kRowsPerBlock = 256;

template <typename T>
__global__ void amax_kernel(const T* __restrict__ x, int64_t m, int64_t k, bool rht, float* amax, float* amax_rht) {
  const int64_t b = blockIdx.z;
  x += b * m * k;
  const int64_t col = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * kRowsPerBlock;
  float a = 0.0f, ar = 0.0f;
  if (col < k) {
    for (int64_t g = r0; g < r0 + kRowsPerBlock && g < m; g += 16) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = (g + i < m) ? to_f32(x[(g + i) * k + col]) : 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) a = amax_acc(a, v[i]);
      if (rht && g + 16 <= m) {
        rht16(v);
#pragma unroll
        for (int i = 0; i < 16; ++i) ar = amax_acc(ar, v[i]);
      }
    }
  }
  __shared__ float sa[2][kThreads / 32];
  a = warp_nmax(a);
  ar = warp_nmax(ar);
  if ((threadIdx.x & 31) == 0) {
    sa[0][threadIdx.x / 32] = a;
    sa[1][threadIdx.x / 32] = ar;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) {
      a = nmax(a, sa[0][w]);
      ar = nmax(ar, sa[1][w]);
    }
    atomicMax(reinterpret_cast<unsigned int*>(amax + b), f2u(a));
    if (rht) atomicMax(reinterpret_cast<unsigned int*>(amax_rht + b), f2u(ar));
  }
}

}  // namespace

std::string launch_amax(const void* x, int32_t dtype, int64_t batch, int64_t m, int64_t k, bool rht, float* amax,
                        float* amax_rht, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaMemsetAsync(amax, 0, sizeof(float) * batch, s);
  cudaMemsetAsync(amax_rht, 0, sizeof(float) * batch, s);
  if (m * k > 0) {
    dim3 grid(unsigned((k + kThreads - 1) / kThreads), unsigned((m + kRowsPerBlock - 1) / kRowsPerBlock),
              unsigned(batch));
    const dim3 block(kThreads);
    switch (dtype) {
      case kBF16:
        launch_kernel(amax_kernel<__nv_bfloat16>, grid, block, 0, s, static_cast<const __nv_bfloat16*>(x), m, k, rht,
                      amax, amax_rht);
        break;
      case kF16:
        launch_kernel(amax_kernel<__half>, grid, block, 0, s, static_cast<const __half*>(x), m, k, rht, amax, amax_rht);
        break;
      default:
        launch_kernel(amax_kernel<float>, grid, block, 0, s, static_cast<const float*>(x), m, k, rht, amax, amax_rht);
    }
  }
  return cuda_status();
}

}  // namespace jaxhq
