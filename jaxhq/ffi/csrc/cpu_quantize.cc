// Plain C++ quantization of one copy, element by element in the reference's order: the CPU handlers' math
// and a readable statement of what the CUDA tile kernel computes.
#include "cpu_quantize.h"

#include <vector>

#include "activation.h"
#include "numerics.h"

namespace jaxhq {
namespace {

float load(const void* x, int32_t dtype, int64_t i) {
  switch (dtype) {
    case kBF16: return bf16_bits_to_f32(static_cast<const uint16_t*>(x)[i]);
    case kF16: return f16_bits_to_f32(static_cast<const uint16_t*>(x)[i]);
    case kF32AsBF16: return bf16_bits_to_f32(f32_to_bf16_bits(static_cast<const float*>(x)[i]));
    default: return static_cast<const float*>(x)[i];
  }
}

// The copy as a [R, C] matrix view over x: rowwise reads x[r, c]; columnwise reads x[c, r].
struct View {
  const void* x;
  int32_t dtype;
  int64_t R, C, stride_r, stride_c;
  float operator()(int64_t r, int64_t c) const { return load(x, dtype, r * stride_r + c * stride_c); }
};

// Element i of a decoded copy (kDecoded): its value as bfloat16.
void store_decoded(const CopySpec& s, int64_t i, float value) {
  static_cast<uint16_t*>(s.data)[i] = f32_to_bf16_bits(value);
}

void fp8_tensor(const View& v, const CopySpec& s, float scale) {
  uint8_t* d = static_cast<uint8_t*>(s.data);
  bool e5 = s.opts & kE5M2;
  for (int64_t r = 0; r < v.R; ++r)
    for (int64_t c = 0; c < v.C; ++c) d[r * v.C + c] = fp8_encode_sw(v(r, c) * scale, e5);
}

void mxfp8(const View& v, const CopySpec& s) {
  uint8_t* d = static_cast<uint8_t*>(s.data);
  uint8_t* sc = static_cast<uint8_t*>(s.scale);
  bool e5 = s.opts & kE5M2;
  int64_t nb = (v.C + 31) / 32;
  for (int64_t r = 0; r < v.R; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      int64_t c0 = b * 32, c1 = c0 + 32 < v.C ? c0 + 32 : v.C;
      float a = 0.0f;
      for (int64_t c = c0; c < c1; ++c) a = amax_acc(a, v(r, c));
      uint8_t e = e8m0_round_up(round_to_dtype_sw(mx_q(a, e5), v.dtype));
      float inv = e8m0_reciprocal(e);
      sc[rows_inner_scale_index(r, b, v.R)] = e;
      for (int64_t c = c0; c < c1; ++c) {
        uint8_t code = fp8_encode_sw(v(r, c) * inv, e5);
        if (s.opts & kDecoded) store_decoded(s, r * v.C + c, fp8_decode(code, e5) * e8m0_to_f32(e));
        else d[r * v.C + c] = code;
      }
    }
}

void nvfp4(const View& v, const CopySpec& s, float genc, const uint32_t* seed, uint32_t stream) {
  const uint32_t s0 = seed[0], s1 = seed[1];
  const SrIndex si = sr_index(seed, int(stream));
  const int64_t R = v.R, C = v.C, nb = (C + 15) / 16, Cp = nb * 16, pc = (C + 1) / 2;
  const bool rht = s.opts & kRHT, sr = s.opts & kStochastic, two_d = s.opts & kBlock2D;
  std::vector<float> y(R * Cp, 0.0f);  // the (transformed) values, zero-padded to whole blocks
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) y[r * Cp + c] = v(r, c);
    if (rht)
      for (int64_t b = 0; b < nb; ++b) rht16(&y[r * Cp + b * 16]);
  }
  std::vector<float> am(R * nb, 0.0f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      float a = 0.0f;
      for (int i = 0; i < 16; ++i) a = amax_acc(a, y[r * Cp + b * 16 + i]);
      am[r * nb + b] = a;
    }
  if (two_d) {
    for (int64_t r0 = 0; r0 < R; r0 += 16)
      for (int64_t b = 0; b < nb; ++b) {
        float a = 0.0f;
        for (int64_t r = r0; r < r0 + 16 && r < R; ++r) a = nmax(a, am[r * nb + b]);
        for (int64_t r = r0; r < r0 + 16 && r < R; ++r) am[r * nb + b] = a;
      }
  }
  uint8_t* d = static_cast<uint8_t*>(s.data);
  uint8_t* sc = static_cast<uint8_t*>(s.scale);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      float dec = nvfp4_decode_value(am[r * nb + b], genc);
      sc[r * nb + b] = fp8_encode_sw(dec, false);
      float enc = nvfp4_encode_mult(dec, genc);
      for (int i = 0; i < 16; i += 2) {
        int64_t c = b * 16 + i;
        if (c >= C) break;
        uint8_t code[2];
        for (int j = 0; j < 2; ++j) {
          float t = nclip(y[r * Cp + c + j] * enc, -6.0f, 6.0f);
          if (c + j >= C) { code[j] = 0; continue; }
          code[j] = sr ? e2m1_code_sr(t, sr_bits(s0, s1, stream, uint64_t(r) + si.roff, uint64_t(c + j) + si.coff, si.cols))
                       : e2m1_code(t);
        }
        if (s.opts & kDecoded) {
          for (int j = 0; j < 2 && c + j < C; ++j) store_decoded(s, r * C + c + j, e2m1_value(code[j]) * dec);
        } else {
          d[r * pc + c / 2] = uint8_t(code[0] | (code[1] << 4));
        }
      }
    }
}

void fp8_block(const View& v, const CopySpec& s) {
  const int64_t R = v.R, C = v.C, nb = (C + 127) / 128;
  const bool two_d = s.fmt == kFp8Block2, pow2 = s.opts & kPow2;
  uint8_t* d = static_cast<uint8_t*>(s.data);
  float* sc = static_cast<float*>(s.scale);
  const int64_t br = two_d ? 128 : 1;
  for (int64_t r0 = 0; r0 < R; r0 += br)
    for (int64_t b = 0; b < nb; ++b) {
      int64_t r1 = r0 + br < R ? r0 + br : R, c0 = b * 128, c1 = c0 + 128 < C ? c0 + 128 : C;
      float a = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) a = amax_acc(a, v(r, c));
      float scale = block_scale(a, pow2);
      sc[two_d ? (r0 / br) * nb + b : rows_inner_scale_index(r0, b, R)] = scale_inv_of(scale);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) d[r * C + c] = fp8_encode_sw(v(r, c) * scale, false);
    }
}

void one_copy(const View& v, const CopySpec& s, float scale, const uint32_t* seed, uint32_t stream) {
  switch (s.fmt) {
    case kFp8Tensor: fp8_tensor(v, s, scale); break;
    case kMxfp8: mxfp8(v, s); break;
    case kNvfp4: nvfp4(v, s, scale, seed, stream); break;
    case kFp8Block1:
    case kFp8Block2: fp8_block(v, s); break;
    default: break;
  }
}

CopySpec offset(const CopySpec& s, int64_t b, int64_t r, int64_t c) {
  CopySpec o = s;
  if (s.data) o.data = static_cast<uint8_t*>(s.data) + b * data_bytes(s.fmt, r, c, s.opts & kDecoded);
  if (s.scale) o.scale = static_cast<uint8_t*>(s.scale) + b * quantize_scale_bytes(s.fmt, r, c);
  return o;
}

// The per-tensor scale (kFromAmax: from the amax given, fp8.scale_from_amax) or NVFP4 global encode of a copy;
// a per-tensor copy also records scale_inv = 1 / scale.
float copy_scalar(const QuantizeArgs& a, const CopySpec& s, int64_t b, int side) {
  const float v = copy_scalar_of(side_scalar(a.scales, b, side), s.fmt, s.opts, a.amax_eps);
  if (s.fmt == kFp8Tensor) *static_cast<float*>(s.scale) = scale_inv_of(v);
  return v;
}

}  // namespace

void act_grad_cpu(const void* h, const void* dy, int32_t act, int64_t rows, int64_t k, uint16_t* out) {
  const int64_t dk = (act & kActGated) ? k / 2 : k;  // dy's columns
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t c = 0; c < k; ++c)
      out[row * k + c] = f32_to_bf16_bits(act_grad_at(act, static_cast<const uint16_t*>(h) + row * k,
                                                      static_cast<const uint16_t*>(dy) + row * dk, c, dk));
}

void quantize_cpu(const QuantizeArgs& a) {
  if (a.act) {  // the copies of the activation's gradient: made here, then quantized as any bfloat16 x
    std::vector<uint16_t> x(size_t(a.batch * a.m * a.k));
    act_grad_cpu(a.x, a.dy, a.act, a.batch * a.m, a.k, x.data());
    QuantizeArgs b = a;
    b.x = x.data();
    b.dy = nullptr;
    b.act = 0;
    quantize_cpu(b);
    return;
  }
  const int64_t M = a.m, K = a.k;
  const int64_t esize = in_bytes(a.dtype);
  for (int64_t b = 0; b < a.batch; ++b) {
    const void* xb = static_cast<const uint8_t*>(a.x) + b * M * K * esize;
    const uint32_t* seed = a.seed + kSeedWords * b;
    if (a.row.fmt) {
      const CopySpec s = offset(a.row, b, M, K);
      one_copy(View{xb, a.dtype, M, K, K, 1}, s, copy_scalar(a, s, b, 0), seed, 0);
    }
    if (a.col.fmt) {
      const CopySpec s = offset(a.col, b, K, M);
      one_copy(View{xb, a.dtype, K, M, 1, K}, s, copy_scalar(a, s, b, 1), seed, 1);
    }
  }
  if (a.amax) {
    float unused = 0.0f;
    for (int64_t b = 0; b < a.batch; ++b)
      amax_cpu(static_cast<const uint8_t*>(a.x) + b * M * K * esize, a.dtype, 1, M, K, false, a.amax + b, &unused);
  }
}

void amax_cpu(const void* x, int32_t dtype, int64_t batch, int64_t m, int64_t k, bool rht, float* amax,
              float* amax_rht) {
  for (int64_t b = 0; b < batch; ++b) {
    const View v{static_cast<const uint8_t*>(x) + b * m * k * in_bytes(dtype), dtype, m, k, k, 1};
    float a = 0.0f, ar = 0.0f;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < k; ++c) a = amax_acc(a, v(r, c));
    if (rht) {  // amax of the columnwise copy after the transform: 16-row groups of each column
      float t[16];
      for (int64_t r0 = 0; r0 + 16 <= m; r0 += 16)
        for (int64_t c = 0; c < k; ++c) {
          for (int i = 0; i < 16; ++i) t[i] = v(r0 + i, c);
          rht16(t);
          for (int i = 0; i < 16; ++i) ar = amax_acc(ar, t[i]);
        }
    }
    amax[b] = a;
    amax_rht[b] = ar;
  }
}

void dequantize_cpu(const DequantizeArgs& a) {
  const int64_t R = a.r, C = a.c;
  const bool e5 = a.opts & kE5M2;
  for (int64_t b = 0; b < a.batch; ++b) {
    const uint8_t* d = static_cast<const uint8_t*>(a.data) + b * data_bytes(a.fmt, R, C);
    const uint8_t* s = static_cast<const uint8_t*>(a.scale) + b * scale_bytes(a.fmt, R, C);
    float* out = a.out + b * R * C;
    const float g = a.scalar[b];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) {
        float v;
        switch (a.fmt) {
          case kFp8Tensor: v = fp8_decode(d[r * C + c], e5) * g; break;
          case kMxfp8: v = fp8_decode(d[r * C + c], e5) * e8m0_to_f32(s[r * ((C + 31) / 32) + c / 32]); break;
          case kNvfp4: {
            uint8_t byte = d[r * ((C + 1) / 2) + c / 2];
            float sc = fp8_decode(s[r * ((C + 15) / 16) + c / 16], false) * (1.0f / g);
            v = e2m1_value((c & 1) ? (byte >> 4) : (byte & 15)) * sc;
            break;
          }
          case kFp8Block1:
            v = fp8_decode(d[r * C + c], false) * reinterpret_cast<const float*>(s)[r * ((C + 127) / 128) + c / 128];
            break;
          case kFp8Block2:
            v = fp8_decode(d[r * C + c], false) *
                reinterpret_cast<const float*>(s)[(r / 128) * ((C + 127) / 128) + c / 128];
            break;
          default: v = 0.0f;
        }
        out[r * C + c] = v;
      }
  }
}

}  // namespace jaxhq
