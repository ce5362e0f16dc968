// Per-tensor amax: max |x| over [M, K] (and, for NVFP4 with RHT, max |RHT(x.T)| over 16-row groups of each
// column) in one read. Atomic max on the float bits (non-negative floats, NaN included, order as uints).
//
// 16-bit inputs whose rows are 16-byte aligned (K % 8 == 0) take the vector kernel: a thread owns 8 adjacent
// columns and reads a 16-row group of them as sixteen 16-byte loads issued together (a warp reads 512
// contiguous bytes per row); its plain amax is the integer max of the 16-bit |x| patterns (which orders as the
// values do, NaN patterns above inf), and each of its 8 columns' 16 values is transformed in registers for the
// RHT amax. Other inputs take the scalar kernel (a thread per column).
#include "cuda_common.cuh"
#include "cuda_launch.h"

namespace jaxhq {
namespace {

constexpr int kThreads = 256, kRowsPerBlock = 256;

// The CTA's plain and RHT amaxes (per-thread partials, non-negative) into the batch element's outputs.
__device__ __forceinline__ void cta_amaxes(float a, float ar, bool rht, float* amax, float* amax_rht) {
  __shared__ unsigned slot[2][kThreads / 32];
  cta_amax_partial(f2u(a), slot[0]);
  cta_amax_partial(f2u(ar), slot[1]);
  __syncthreads();
  cta_amax_finish(slot[0], kThreads / 32, amax);
  if (rht) cta_amax_finish(slot[1], kThreads / 32, amax_rht);
}

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
  cta_amaxes(a, ar, rht, amax + b, amax_rht + b);
}

// The 16-bit kernel: CTA = 8 warps over 256 columns (32 threads x 8) and kRowsPerBlock rows (warp w takes the
// 16-row groups w, w + 8, ...).
template <typename T>
__global__ void amax_vec_kernel(const T* __restrict__ x, int64_t m, int64_t k, bool rht, float* amax,
                                float* amax_rht) {
  const int64_t b = blockIdx.z;
  x += b * m * k;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t c = (int64_t(blockIdx.x) * 32 + lane) * 8;  // this thread's first column
  const int64_t r0 = int64_t(blockIdx.y) * kRowsPerBlock;
  uint32_t a = 0u;  // max |x| pattern (16 bits)
  float ar = 0.0f;
  if (c < k) {
    for (int64_t g = r0 + 16 * warp; g < r0 + kRowsPerBlock && g < m; g += 16 * (kThreads / 32)) {
      uint4 q[16];
#pragma unroll
      for (int i = 0; i < 16; ++i)
        q[i] = g + i < m ? __ldg(reinterpret_cast<const uint4*>(x + (g + i) * k + c)) : make_uint4(0, 0, 0, 0);
      constexpr uint32_t kAbs = 0x7FFF7FFFu;  // |x| of both halves: the sign bits cleared before the max
      uint32_t pair = 0u;                     // per-halfword max of the |x| patterns
#pragma unroll
      for (int i = 0; i < 16; ++i)
        pair = vmax2(pair, vmax2(vmax2(q[i].x & kAbs, q[i].y & kAbs), vmax2(q[i].z & kAbs, q[i].w & kAbs)));
      a = maxu(a, max_halves(pair));
      if (rht && g + 16 <= m) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // column c + j: half j % 2 of word j / 2 of each row's load
          float v[16];
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            const uint32_t word = j / 2 == 0 ? q[i].x : j / 2 == 1 ? q[i].y : j / 2 == 2 ? q[i].z : q[i].w;
            v[i] = bits_to_f32<T>(half_of(word, j % 2));
          }
          rht16(v);
#pragma unroll
          for (int i = 0; i < 16; ++i) ar = amax_acc(ar, v[i]);
        }
      }
    }
  }
  cta_amaxes(bits_to_f32<T>(a), ar, rht, amax + b, amax_rht + b);
}

template <typename T>
void launch_vec(const void* x, int64_t batch, int64_t m, int64_t k, bool rht, float* amax, float* amax_rht,
                cudaStream_t s) {
  dim3 grid(unsigned((k + 255) / 256), unsigned((m + kRowsPerBlock - 1) / kRowsPerBlock), unsigned(batch));
  launch_kernel(amax_vec_kernel<T>, grid, dim3(kThreads), 0, s, static_cast<const T*>(x), m, k, rht, amax, amax_rht);
}

}  // namespace

std::string launch_amax(const void* x, int32_t dtype, int64_t batch, int64_t m, int64_t k, bool rht, float* amax,
                        float* amax_rht, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaMemsetAsync(amax, 0, sizeof(float) * batch, s);
  cudaMemsetAsync(amax_rht, 0, sizeof(float) * batch, s);
  const bool vec = (dtype == kBF16 || dtype == kF16) && k % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(x) % 16 == 0;
  if (m * k > 0 && vec) {
    if (dtype == kBF16) launch_vec<__nv_bfloat16>(x, batch, m, k, rht, amax, amax_rht, s);
    else launch_vec<__half>(x, batch, m, k, rht, amax, amax_rht, s);
  } else if (m * k > 0) {
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
