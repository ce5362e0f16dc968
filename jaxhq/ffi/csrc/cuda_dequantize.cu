// Dequantize one copy to float32, one thread per output element (a reference-speed kernel: dequantize is
// off the training path; GEMMs read the quantized data directly).
#include "cuda_common.cuh"
#include "cuda_launch.h"

namespace jaxhq {
namespace {

__global__ void dequantize_kernel(DequantizeArgs a) {
  const int64_t n = a.r * a.c, C = a.c;
  const int64_t b = blockIdx.y;
  const uint8_t* d = static_cast<const uint8_t*>(a.data) + b * data_bytes(a.fmt, a.r, a.c);
  const uint8_t* s = static_cast<const uint8_t*>(a.scale) + b * scale_bytes(a.fmt, a.r, a.c);
  const float g = a.scalar[b];
  const bool e5 = a.opts & kE5M2;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / C, c = i % C;
    float v;
    switch (a.fmt) {
      case kFp8Tensor: v = fp8_decode(d[i], e5) * g; break;
      case kMxfp8: v = fp8_decode(d[i], e5) * e8m0_to_f32(s[r * ((C + 31) / 32) + c / 32]); break;
      case kNvfp4: {
        const uint8_t byte = d[r * ((C + 1) / 2) + c / 2];
        v = e2m1_value((c & 1) ? (byte >> 4) : (byte & 15)) * (fp8_decode(s[r * ((C + 15) / 16) + c / 16], false) * div_ref(1.0f, g));
        break;
      }
      case kFp8Block1: v = fp8_decode(d[i], false) * reinterpret_cast<const float*>(s)[r * ((C + 127) / 128) + c / 128]; break;
      case kFp8Block2:
        v = fp8_decode(d[i], false) * reinterpret_cast<const float*>(s)[(r / 128) * ((C + 127) / 128) + c / 128];
        break;
      default: v = 0.0f;
    }
    a.out[b * n + i] = v;
  }
}

}  // namespace

std::string launch_dequantize(const DequantizeArgs& a, void* stream) {
  const int64_t n = a.r * a.c;
  if (n * a.batch == 0) return std::string();
  int64_t blocks = (n + 255) / 256;
  if (blocks > 65535 * 8) blocks = 65535 * 8;
  launch_kernel(dequantize_kernel, dim3(unsigned(blocks), unsigned(a.batch)), dim3(256), 0,
                static_cast<cudaStream_t>(stream), a);
  return cuda_status();
}

}  // namespace jaxhq
