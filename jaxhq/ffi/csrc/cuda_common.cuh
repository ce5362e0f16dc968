// Device helpers shared by the CUDA kernels: input loads, NaN-propagating reductions, hardware FP8 casts.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>
#include <utility>

#include "numerics.h"

// A device function kept out of line (its callers hold one call, not a copy of its code); the CPU emulator
// (tests/cuda_emu) compiles it as an ordinary function.
#if defined(JAXHQ_EMU)
#define JHQ_NOINLINE
#else
#define JHQ_NOINLINE __noinline__
#endif

namespace jaxhq {

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

// An input element as the kernel's value type: itself, or float32 rounded to bfloat16 (kF32AsBF16) with the
// CPU handlers' rounding (numerics.h), so NaNs keep their sign there as here.
template <typename T, typename In> __device__ __forceinline__ T as_value(In v) {
  if constexpr (std::is_same_v<T, In>) {
    return v;
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16> && std::is_same_v<In, float>, "float32 -> bfloat16 only");
    __nv_bfloat16_raw r;
    r.x = f32_to_bf16_bits(v);
    return __nv_bfloat16(r);
  }
}
// Two float32 values rounded to bfloat16, packed as a 16-bit load would hold them (the first in the low half).
__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  return uint32_t(f32_to_bf16_bits(lo)) | (uint32_t(f32_to_bf16_bits(hi)) << 16);
}

__device__ __forceinline__ float warp_nmax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = nmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// 16-bit inputs as raw bits: the quantize and amax kernels read x 16 bytes at a time and take |x| maxima on
// the patterns (non-negative patterns order as the values do, NaN patterns above inf).
// The float value of 16 input bits (sign included).
template <typename T> __device__ __forceinline__ float bits_to_f32(uint32_t h);
template <> __device__ __forceinline__ float bits_to_f32<__nv_bfloat16>(uint32_t h) { return u2f(h << 16); }
template <> __device__ __forceinline__ float bits_to_f32<__half>(uint32_t h) { return f16_bits_to_f32(uint16_t(h)); }

__device__ __forceinline__ uint32_t half_of(uint32_t w, int i) { return i ? (w >> 16) : (w & 0xFFFFu); }
__device__ __forceinline__ uint32_t maxu(uint32_t a, uint32_t b) { return a > b ? a : b; }
__device__ __forceinline__ uint32_t max_halves(uint32_t w) { return maxu(w & 0xFFFFu, w >> 16); }
// Per-halfword max of two packed |x| patterns.
__device__ __forceinline__ uint32_t vmax2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __vmaxu2(a, b);
#else
  return maxu(a & 0xFFFFu, b & 0xFFFFu) | (maxu(a >> 16, b >> 16) << 16);
#endif
}

// The CTA's max |x| into the batch element's amax: `bits` is this thread's partial as non-negative float bits
// (which order as uints, NaN patterns above inf); one atomic per CTA. Every thread calls `partial` between two
// __syncthreads of the kernel, with `slot` a word per warp in shared memory, and `finish` after the second.
__device__ __forceinline__ void cta_amax_partial(unsigned bits, unsigned* slot) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) bits = maxu(bits, __shfl_xor_sync(0xffffffffu, bits, o));
  if ((threadIdx.x & 31) == 0) slot[threadIdx.x / 32] = bits;
}
__device__ __forceinline__ void cta_amax_finish(const unsigned* slot, int warps, float* amax) {
  if (threadIdx.x != 0) return;
  unsigned m = 0u;
  for (int w = 0; w < warps; ++w) m = maxu(m, slot[w]);
  // a NaN as the canonical one (above inf, so it still wins the max): the amax's bits do not depend on the
  // payload of the NaN in x (formats.base.abs_max)
  atomicMax(reinterpret_cast<unsigned*>(amax), m > 0x7F800000u ? 0x7FC00000u : m);
}

// saturating_fp8 on the hardware converter (round to nearest even, saturate to finite, NaN stays NaN).
__device__ __forceinline__ uint16_t fp8x2(float a, float b, bool e5m2) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}

// Launches `kernel` (a __global__ function) on grid x block threads with `smem` bytes of dynamic shared
// memory on `stream` (above 48 KB after the per-kernel opt-in). Compiled by a host compiler for the CPU
// emulator (tests/cuda_emu), it runs the blocks there instead.
template <typename... P, typename... A>
void launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A&&... args) {
#if defined(JAXHQ_EMU)
  emu::launch(grid, block, smem, [&] { kernel(args...); });
#else
  if (smem > 48 * 1024)
    cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                         int(smem));
  kernel<<<grid, block, smem, stream>>>(std::forward<A>(args)...);
#endif
}

// The block's dynamic shared memory (16-byte aligned) as a T.
template <typename T>
__device__ __forceinline__ T* dynamic_smem() {
#if defined(JAXHQ_EMU)
  return reinterpret_cast<T*>(emu::block().smem.data());
#else
  extern __shared__ __align__(16) unsigned char smem_raw[];
  return reinterpret_cast<T*>(smem_raw);
#endif
}

inline std::string cuda_status() {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e));
}

}  // namespace jaxhq
