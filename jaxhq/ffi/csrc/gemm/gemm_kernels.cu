// Kernels of gemm_kernels.h. Memory-bound helpers with 16-byte stores; the dequantize kernels take a whole
// 32-element MX block (two NVFP4 blocks) per thread, 16-byte loads included, when K is a multiple of 32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "../cuda_common.cuh"
#include "gemm_kernels.h"

namespace jaxhq {
namespace gemm {
namespace {

constexpr int kThreads = 256;

std::string last_error() {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e));
}

unsigned blocks_for(int64_t n) { return unsigned((n + kThreads - 1) / kThreads); }

__global__ void fill_kernel(float* out, int64_t n, float v) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = v;
}

__global__ void relayout_kernel(const float* in, int64_t rows, int64_t cols, float* out, int64_t rs, int64_t cs) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  int64_t r = i / cols, c = i % cols;
  out[r * rs + c * cs] = in[i];
}

// 2**(e-127) as float; e == 0 gives 2**-127 (subnormal), e == 255 NaN.
__device__ __forceinline__ float e8m0_value(uint8_t e) {
  if (e == 0xFF) return __int_as_float(0x7FC00000);
  if (e == 0) return __int_as_float(0x00400000);
  return __int_as_float(int(e) << 23);
}

__device__ __forceinline__ float2 fp8x2_to_float2(uint16_t v, bool e5m2) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v), e5m2 ? __NV_E5M2 : __NV_E4M3);
  return __half22float2(__half2(h));
}

__global__ void mxfp8_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scales, int64_t rows,
                             int64_t k, bool e5m2, __nv_bfloat162* __restrict__ out) {
  // one thread: 8 consecutive elements of one row (k % 8 == 0, so a group never straddles rows)
  int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t groups_per_row = k / 8;
  if (g >= rows * groups_per_row) return;
  int64_t r = g / groups_per_row, c = (g % groups_per_row) * 8;
  int64_t sb = (k + 31) / 32;
  float s = e8m0_value(scales[r * sb + c / 32]);
  uint2 raw = *reinterpret_cast<const uint2*>(data + r * k + c);
  uint32_t w[2] = {raw.x, raw.y};
  __nv_bfloat162 o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint16_t pair = uint16_t(w[i / 2] >> (16 * (i % 2)));
    float2 f = fp8x2_to_float2(pair, e5m2);
    o[i] = __floats2bfloat162_rn(f.x * s, f.y * s);
  }
  *reinterpret_cast<uint4*>(out + (r * k + c) / 2) = *reinterpret_cast<uint4*>(o);
}

// One thread per 32-element MX block (K % 32 == 0, so block b is bytes [32b, 32b + 32) and scale b): two
// 16-byte loads, four 16-byte stores.
__global__ void mxfp8_block_kernel(const uint4* __restrict__ data, const uint8_t* __restrict__ scales,
                                   int64_t blocks, bool e5m2, uint4* __restrict__ out) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= blocks) return;
  const uint4 w0 = __ldg(data + 2 * b), w1 = __ldg(data + 2 * b + 1);
  const uint32_t w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
  const float s = e8m0_value(__ldg(scales + b));
  uint4 o[4];
  uint32_t* ow = reinterpret_cast<uint32_t*>(o);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float2 f = fp8x2_to_float2(uint16_t(w[i / 2] >> (16 * (i % 2))), e5m2);
    const __nv_bfloat162 h = __floats2bfloat162_rn(f.x * s, f.y * s);
    memcpy(ow + i, &h, 4);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) out[4 * b + j] = o[j];
}

// E2M1 code (4 bits, bit 3 the sign) to float.
__device__ __forceinline__ float e2m1_value(uint32_t code) {
  uint32_t m = code & 7u, e = m >> 1, mant = m & 1u;
  float v = e ? __int_as_float(int(((e + 126u) << 23) | (mant << 22))) : (mant ? 0.5f : 0.0f);
  return (code & 8u) ? -v : v;
}

__global__ void nvfp4_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scales, int64_t rows,
                             int64_t k, __nv_bfloat162* __restrict__ out) {
  // one thread: one 16-element block = 8 packed bytes, the even element in the low nibble
  int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t blocks_per_row = k / 16;
  if (b >= rows * blocks_per_row) return;
  int64_t r = b / blocks_per_row, c = (b % blocks_per_row) * 16;
  __half_raw hs = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(scales[r * blocks_per_row + c / 16]),
                                          __NV_E4M3);
  float s = __half2float(__half(hs));
  uint2 raw = *reinterpret_cast<const uint2*>(data + (r * k + c) / 2);
  uint32_t w[2] = {raw.x, raw.y};
  __nv_bfloat162 o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t byte = (w[i / 4] >> (8 * (i % 4))) & 0xFFu;
    o[i] = __floats2bfloat162_rn(e2m1_value(byte & 0xFu) * s, e2m1_value(byte >> 4) * s);
  }
  uint4* dst = reinterpret_cast<uint4*>(out + (r * k + c) / 2);
  dst[0] = reinterpret_cast<uint4*>(o)[0];
  dst[1] = reinterpret_cast<uint4*>(o)[1];
}

// One thread per two 16-element NVFP4 blocks (K % 32 == 0): one 16-byte load of packed codes, one 2-byte load of
// the two E4M3 scales, four 16-byte stores.
__global__ void nvfp4_pair_kernel(const uint4* __restrict__ data, const uint16_t* __restrict__ scales, int64_t pairs,
                                  uint4* __restrict__ out) {
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= pairs) return;
  const uint4 v = __ldg(data + p);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  const uint16_t sc = __ldg(scales + p);
  float s[2];
#pragma unroll
  for (int j = 0; j < 2; ++j)
    s[j] = __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>((sc >> (8 * j)) & 0xFF),
                                                       __NV_E4M3)));
  uint4 o[4];
  uint32_t* ow = reinterpret_cast<uint32_t*>(o);
#pragma unroll
  for (int i = 0; i < 16; ++i) {  // byte i: elements 2i (low nibble) and 2i + 1, of block i / 8
    const uint32_t byte = (w[i / 4] >> (8 * (i % 4))) & 0xFFu;
    const float sc = s[i / 8];
    const __nv_bfloat162 h = __floats2bfloat162_rn(e2m1_value(byte & 0xFu) * sc, e2m1_value(byte >> 4) * sc);
    memcpy(ow + i, &h, 4);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) out[4 * p + j] = o[j];
}

__device__ __forceinline__ float inv_genc(const float* amax) {
  if (amax == nullptr) return 1.0f;
  float a = *amax;
  if (a == 0.0f) return 1.0f;
  return 1.0f / (448.0f * 6.0f / a);
}

__global__ void alpha_kernel(const float* amax_a, const float* amax_b, float beta, float* ab) {
  ab[0] = inv_genc(amax_a) * inv_genc(amax_b);
  ab[1] = beta;
}

template <typename T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void epilogue_kernel(T* out, const T* tmp, const T* bias, int64_t m, int64_t n, bool accumulate) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m * n) return;
  float v = to_f(tmp[i]);
  if (bias) v += to_f(bias[i % n]);
  if (accumulate) v += to_f(out[i]);
  out[i] = from_f<T>(v);
}

// One thread per output byte: tile (r / 128, c / 4) of 512 bytes, inside it [32][4][4] = (r % 32, r / 32 % 4, c % 4).
__global__ void swizzle_kernel(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out, int64_t prow, int64_t pcol) {
  int64_t o = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (o >= prow * pcol) return;
  int64_t tile = o / 512, w = o % 512;
  int64_t col_tiles = pcol / 4;
  int64_t tr = tile / col_tiles, tc = tile % col_tiles;
  int64_t r = tr * 128 + (w / 16) + 32 * ((w / 4) % 4), c = tc * 4 + w % 4;
  out[o] = (r < rows && c < cols) ? in[r * cols + c] : uint8_t(0);
}

}  // namespace

std::string swizzle_block_scales(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out, cudaStream_t s) {
  int64_t prow = (rows + 127) / 128 * 128, pcol = (cols + 3) / 4 * 4;
  if (prow * pcol > 0)
    launch_kernel(swizzle_kernel, blocks_for(prow * pcol), kThreads, 0, s, in, rows, cols, out, prow, pcol);
  return last_error();
}

std::string relayout_scales(const float* in, int64_t rows, int64_t cols, float* out, int64_t out_rs,
                            int64_t out_cs, int64_t out_elems, cudaStream_t s) {
  if (out_elems > 0) launch_kernel(fill_kernel, blocks_for(out_elems), kThreads, 0, s, out, out_elems, 1.0f);
  if (rows * cols > 0)
    launch_kernel(relayout_kernel, blocks_for(rows * cols), kThreads, 0, s, in, rows, cols, out, out_rs, out_cs);
  return last_error();
}

std::string dequant_mxfp8(const uint8_t* data, const uint8_t* scales, int64_t rows, int64_t k, bool e5m2,
                          void* out_bf16, cudaStream_t s) {
  if (k % 32 == 0) {
    const int64_t blocks = rows * (k / 32);
    if (blocks > 0)
      launch_kernel(mxfp8_block_kernel, blocks_for(blocks), kThreads, 0, s, reinterpret_cast<const uint4*>(data),
                    scales, blocks, e5m2, static_cast<uint4*>(out_bf16));
    return last_error();
  }
  int64_t n = rows * (k / 8);
  if (n > 0)
    launch_kernel(mxfp8_kernel, blocks_for(n), kThreads, 0, s, data, scales, rows, k, e5m2,
                  static_cast<__nv_bfloat162*>(out_bf16));
  return last_error();
}

std::string dequant_nvfp4(const uint8_t* data, const uint8_t* scales, int64_t rows, int64_t k, void* out_bf16,
                          cudaStream_t s) {
  if (k % 32 == 0) {
    const int64_t pairs = rows * (k / 32);
    if (pairs > 0)
      launch_kernel(nvfp4_pair_kernel, blocks_for(pairs), kThreads, 0, s, reinterpret_cast<const uint4*>(data),
                    reinterpret_cast<const uint16_t*>(scales), pairs, static_cast<uint4*>(out_bf16));
    return last_error();
  }
  int64_t n = rows * (k / 16);
  if (n > 0)
    launch_kernel(nvfp4_kernel, blocks_for(n), kThreads, 0, s, data, scales, rows, k,
                  static_cast<__nv_bfloat162*>(out_bf16));
  return last_error();
}

std::string nvfp4_alpha(const float* amax_a, const float* amax_b, float beta, float* alpha_beta, cudaStream_t s) {
  launch_kernel(alpha_kernel, 1, 1, 0, s, amax_a, amax_b, beta, alpha_beta);
  return last_error();
}

std::string epilogue(void* out, const void* tmp, const void* bias, int64_t m, int64_t n, bool f32, bool accumulate,
                     cudaStream_t s) {
  int64_t total = m * n;
  if (total == 0) return last_error();
  if (f32)
    launch_kernel(epilogue_kernel<float>, blocks_for(total), kThreads, 0, s, static_cast<float*>(out),
                  static_cast<const float*>(tmp), static_cast<const float*>(bias), m, n, accumulate);
  else
    launch_kernel(epilogue_kernel<__nv_bfloat16>, blocks_for(total), kThreads, 0, s, static_cast<__nv_bfloat16*>(out),
                  static_cast<const __nv_bfloat16*>(tmp), static_cast<const __nv_bfloat16*>(bias), m, n, accumulate);
  return last_error();
}

}  // namespace gemm
}  // namespace jaxhq
