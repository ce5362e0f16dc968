// Kernels of gemm_kernels.h. Memory-bound helpers with 16-byte stores; the dequantize kernels stream the operand
// in groups of 8 elements per thread when K is a multiple of the block.
#include <algorithm>

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

struct ScaleStages {
  ScaleStage job[2];
};

// A 32 x 32 tile of a job's input coordinates through shared memory, so that both the reads of `in` and the
// writes of `out` run along rows (the transposed 1x128 scales are the common case). blockIdx.z picks the job.
constexpr int kTile = 32, kTileRows = 8;
__global__ void stage_kernel(ScaleStages s) {
  const ScaleStage& j = s.job[blockIdx.z];
  const int64_t ext_r = j.transpose ? j.ld : j.out_rows, ext_c = j.transpose ? j.out_rows : j.ld;
  const int64_t r0 = int64_t(blockIdx.x) * kTile, c0 = int64_t(blockIdx.y) * kTile;
  if (j.out == nullptr || r0 >= ext_r || c0 >= ext_c) return;  // the same for the whole block
  float* tile = dynamic_smem<float>();  // [kTile][kTile + 1]
  const int tx = threadIdx.x;
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t r = r0 + i, c = c0 + tx;
    tile[i * (kTile + 1) + tx] = (r < j.rows && c < j.cols) ? j.in[r * j.cols + c] : 1.0f;
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t orow = j.transpose ? c0 + i : r0 + i, ocol = j.transpose ? r0 + tx : c0 + tx;
    if (orow < j.out_rows && ocol < j.ld)
      j.out[orow * j.ld + ocol] = j.transpose ? tile[tx * (kTile + 1) + i] : tile[i * (kTile + 1) + tx];
  }
}

// 2**(e-127) as float; e == 0 gives 2**-127 (subnormal), e == 255 NaN.
__device__ __forceinline__ float e8m0_value(uint8_t e) {
  if (e == 0xFF) return __int_as_float(0x7FC00000);
  if (e == 0) return __int_as_float(0x00400000);
  return __int_as_float(int(e) << 23);
}

__device__ __forceinline__ float2 fp8x2_to_float2(uint16_t v, bool e5m2) {
  float2 f;
  fp8x2_values(v, e5m2, f.x, f.y);
  return f;
}

__global__ void mxfp8_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scales, int64_t rows,
                             int64_t k, bool e5m2, bool rows_inner, int64_t rows_each,
                             __nv_bfloat162* __restrict__ out) {
  // one thread: 8 consecutive elements of one row (k % 8 == 0, so a group never straddles rows)
  int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t groups_per_row = k / 8;
  if (g >= rows * groups_per_row) return;
  int64_t r = g / groups_per_row, c = (g % groups_per_row) * 8;
  int64_t sb = (k + 31) / 32;
  const int64_t b = r / rows_each;  // the batch element (rows_inner: each one's scales [sb, rows_each])
  float s = e8m0_value(scales[rows_inner ? (b * sb + c / 32) * rows_each + (r - b * rows_each) : r * sb + c / 32]);
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

// The streaming dequantize kernels. With K a multiple of the block (32 MXFP8, 16 NVFP4) the operand is one stream:
// element e has scale e / block. A thread takes groups of 8 consecutive elements (8 bytes of MXFP8 codes, 4 of
// NVFP4) and writes 16 bytes of bf16, so a warp's loads and stores are each contiguous (256/128 and 512 bytes:
// whole sectors); kGroups groups per thread, a block apart, their loads issued before the first store. (A thread
// per 32-element block, 64 contiguous output bytes per thread, ran at 1.9 TB/s on an H100 with its memory pipe
// 89% busy.)
constexpr int kGroups = 4;

unsigned stream_blocks(int64_t groups) { return unsigned((groups + kThreads * kGroups - 1) / (kThreads * kGroups)); }

// E2M1 code (4 bits, bit 3 the sign) to float.
__device__ __forceinline__ float e2m1_value(uint32_t code) {
  uint32_t m = code & 7u, e = m >> 1, mant = m & 1u;
  float v = e ? __int_as_float(int(((e + 126u) << 23) | (mant << 22))) : (mant ? 0.5f : 0.0f);
  return (code & 8u) ? -v : v;
}

// The groups of one format: Word holds a group's codes, kPerScale groups share a scale byte, and decode turns
// (codes, scale byte) into the 8 bf16 values.
struct Mxfp8Groups {
  using Word = uint2;
  static constexpr int kPerScale = 4;
  bool e5m2;
  // rows_inner: each batch element's scales come [k / 32, rows] (the quantize launch's layout); group g is row
  // g / gpr, block (g % gpr) / 4 of it (gpr = k / 8 groups a row)
  bool rows_inner;
  int64_t rows, gpr;
  __device__ __forceinline__ int64_t scale_index(int64_t g) const {
    if (!rows_inner) return g / kPerScale;
    const int64_t r = g / gpr, b = r / rows;
    return b * rows * (gpr / kPerScale) + ((g - r * gpr) / kPerScale) * rows + (r - b * rows);
  }
  __device__ __forceinline__ uint4 decode(uint2 w, uint8_t e) const {
    const float s = e8m0_value(e);
    const uint32_t v[2] = {w.x, w.y};
    uint4 o;
    uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = fp8x2_to_float2(uint16_t(v[j / 2] >> (16 * (j % 2))), e5m2);
      const __nv_bfloat162 h = __floats2bfloat162_rn(f.x * s, f.y * s);
      memcpy(ow + j, &h, 4);
    }
    return o;
  }
};

struct Nvfp4Groups {
  using Word = uint32_t;
  static constexpr int kPerScale = 2;
  __device__ __forceinline__ int64_t scale_index(int64_t g) const { return g / kPerScale; }
  __device__ __forceinline__ uint4 decode(uint32_t w, uint8_t sc) const {
    const float s = __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(sc), __NV_E4M3)));
    uint4 o;
    uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // byte j: elements 2j (low nibble) and 2j + 1
      const uint32_t byte = (w >> (8 * j)) & 0xFFu;
      const __nv_bfloat162 h = __floats2bfloat162_rn(e2m1_value(byte & 0xFu) * s, e2m1_value(byte >> 4) * s);
      memcpy(ow + j, &h, 4);
    }
    return o;
  }
};

template <typename F>
__global__ void stream_kernel(const typename F::Word* __restrict__ data, const uint8_t* __restrict__ scales,
                              int64_t groups, F fmt, uint4* __restrict__ out) {
  const int64_t g0 = int64_t(blockIdx.x) * kThreads * kGroups + threadIdx.x;
  typename F::Word w[kGroups];
  uint8_t sc[kGroups];
#pragma unroll
  for (int i = 0; i < kGroups; ++i) {
    const int64_t g = g0 + int64_t(i) * kThreads;
    if (g < groups) {
      w[i] = __ldg(data + g);
      sc[i] = __ldg(scales + fmt.scale_index(g));
    }
  }
#pragma unroll
  for (int i = 0; i < kGroups; ++i) {
    const int64_t g = g0 + int64_t(i) * kThreads;
    if (g >= groups) break;
    out[g] = fmt.decode(w[i], sc[i]);
  }
}

__device__ __forceinline__ float inv_genc(const float* amax) { return amax ? nvfp4_global_decode(*amax) : 1.0f; }

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
// rows_inner: `in` is [cols, rows] (the quantize launch's MXFP8 layout).
__global__ void swizzle_kernel(const uint8_t* in, int64_t rows, int64_t cols, bool rows_inner, uint8_t* out,
                               int64_t prow, int64_t pcol) {
  int64_t o = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (o >= prow * pcol) return;
  int64_t tile = o / 512, w = o % 512;
  int64_t col_tiles = pcol / 4;
  int64_t tr = tile / col_tiles, tc = tile % col_tiles;
  int64_t r = tr * 128 + (w / 16) + 32 * ((w / 4) % 4), c = tc * 4 + w % 4;
  out[o] = (r < rows && c < cols) ? in[rows_inner ? c * rows + r : r * cols + c] : uint8_t(0);
}

}  // namespace

std::string swizzle_block_scales(const uint8_t* in, int64_t rows, int64_t cols, bool rows_inner, uint8_t* out,
                                 cudaStream_t s) {
  int64_t prow = (rows + 127) / 128 * 128, pcol = (cols + 3) / 4 * 4;
  if (prow * pcol > 0)
    launch_kernel(swizzle_kernel, blocks_for(prow * pcol), kThreads, 0, s, in, rows, cols, rows_inner, out, prow, pcol);
  return last_error();
}

std::string stage_scales(const ScaleStage& a, const ScaleStage& b, cudaStream_t s) {
  ScaleStages st{{a, b}};
  int64_t gx = 0, gy = 0;
  for (const ScaleStage& j : st.job) {
    if (!j.out) continue;
    gx = std::max(gx, ((j.transpose ? j.ld : j.out_rows) + kTile - 1) / kTile);
    gy = std::max(gy, ((j.transpose ? j.out_rows : j.ld) + kTile - 1) / kTile);
  }
  if (gx * gy == 0) return "";
  if (gy > 65535) return "scale staging: too many scale columns (" + std::to_string(gy * kTile) + ")";
  launch_kernel(stage_kernel, dim3(unsigned(gx), unsigned(gy), b.out ? 2u : 1u), dim3(kTile, kTileRows),
                kTile * (kTile + 1) * sizeof(float), s, st);
  return last_error();
}

std::string dequant_mxfp8(const uint8_t* data, const uint8_t* scales, int64_t rows, int64_t k, bool e5m2,
                          bool rows_inner, void* out_bf16, cudaStream_t s, int64_t batch) {
  if (rows == 0) return "";
  if (batch < 1 || rows % batch)
    return "dequant_mxfp8: " + std::to_string(rows) + " rows in " + std::to_string(batch) + " batch elements";
  const int64_t each = rows / batch;
  if (k % 32 == 0) {
    const int64_t groups = rows * (k / 8);
    if (groups > 0)
      launch_kernel(stream_kernel<Mxfp8Groups>, stream_blocks(groups), kThreads, 0, s,
                    reinterpret_cast<const uint2*>(data), scales, groups, Mxfp8Groups{e5m2, rows_inner, each, k / 8},
                    static_cast<uint4*>(out_bf16));
    return last_error();
  }
  int64_t n = rows * (k / 8);
  if (n > 0)
    launch_kernel(mxfp8_kernel, blocks_for(n), kThreads, 0, s, data, scales, rows, k, e5m2, rows_inner, each,
                  static_cast<__nv_bfloat162*>(out_bf16));
  return last_error();
}

std::string dequant_nvfp4(const uint8_t* data, const uint8_t* scales, int64_t rows, int64_t k, void* out_bf16,
                          cudaStream_t s) {
  if (k % 16) return "NVFP4 dequantize needs K % 16 == 0";
  const int64_t groups = rows * (k / 8);
  if (groups > 0)
    launch_kernel(stream_kernel<Nvfp4Groups>, stream_blocks(groups), kThreads, 0, s,
                  reinterpret_cast<const uint32_t*>(data), scales, groups, Nvfp4Groups{}, static_cast<uint4*>(out_bf16));
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
