// Per-tensor amax: max |x| over [M, K] (and, for NVFP4 with RHT, max |RHT(x.T)| over 16-row groups of each
// column) in one read. Atomic max on the float bits (non-negative floats, NaN included, order as uints).
//
// 16-bit inputs whose rows are 16-byte aligned (K % 8 == 0) take the vector kernel: a warp owns one 16-row group
// of 128 columns, a thread 4 adjacent columns of it, read as sixteen 8-byte loads issued together (a warp reads
// 256 contiguous bytes per row); a CTA is 8 warps over 128 rows, so even a small tensor spreads over the SMs (and
// a thread's 32 registers of x leave room for four CTAs per SM). Its plain amax is the integer max of the 16-bit
// |x| patterns (which orders as the values do, NaN patterns above inf), and each of its 4 columns' 16 values is
// transformed in registers for the RHT amax: the max of the Hadamard sums' |bit patterns|, times 1/4 once at the
// end (rounding is monotone, so that equals the max of rht16's values, which scale every sum by 1/4). Other inputs
// take the scalar kernel (a thread per column).
#include "cuda_common.cuh"
#include "cuda_launch.h"

namespace jaxhq {
namespace {

constexpr int kThreads = 256, kRowsPerBlock = 128;

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

// The 16-bit kernel: CTA = 8 warps over 128 columns (32 threads x 4) and kRowsPerBlock rows, warp w the 16-row
// group w.
template <typename T>
__global__ void __launch_bounds__(kThreads) amax_vec_kernel(const T* __restrict__ x, int64_t m, int64_t k, bool rht,
                                                            float* amax, float* amax_rht) {
  static_assert(kRowsPerBlock == 16 * (kThreads / 32), "one 16-row group per warp");
  const int64_t b = blockIdx.z;
  x += b * m * k;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t c = (int64_t(blockIdx.x) * 32 + lane) * 4;  // this thread's first column
  const int64_t g = int64_t(blockIdx.y) * kRowsPerBlock + 16 * warp;  // this warp's first row
  uint32_t a = 0u, ar = 0u;  // max |x| pattern (16 bits); max |Hadamard sum| pattern (float bits)
  if (c < k && g < m) {
    uint2 q[16];
#pragma unroll
    for (int i = 0; i < 16; ++i)
      q[i] = g + i < m ? __ldg(reinterpret_cast<const uint2*>(x + (g + i) * k + c)) : make_uint2(0, 0);
    constexpr uint32_t kAbs = 0x7FFF7FFFu;  // |x| of both halves: the sign bits cleared before the max
    uint32_t pair = 0u;                     // per-halfword max of the |x| patterns
#pragma unroll
    for (int i = 0; i < 16; ++i) pair = vmax2(pair, vmax2(q[i].x & kAbs, q[i].y & kAbs));
    a = max_halves(pair);
    if (rht && g + 16 <= m) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // column c + j: half j % 2 of word j / 2 of each row's load
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = bits_to_f32<T>(half_of(j / 2 == 0 ? q[i].x : q[i].y, j % 2));
        hadamard16_signed(v);
#pragma unroll
        for (int i = 0; i < 16; ++i) ar = maxu(ar, f2u(v[i]) & 0x7FFFFFFFu);
      }
    }
  }
  cta_amaxes(bits_to_f32<T>(a), u2f(ar) * 0.25f, rht, amax + b, amax_rht + b);
}

template <typename T>
void launch_vec(const void* x, int64_t batch, int64_t m, int64_t k, bool rht, float* amax, float* amax_rht,
                cudaStream_t s) {
  dim3 grid(unsigned((k + 127) / 128), unsigned((m + kRowsPerBlock - 1) / kRowsPerBlock), unsigned(batch));
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
