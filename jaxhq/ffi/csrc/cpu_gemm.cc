// CPU FFI handlers of the GEMM targets (the same names, operands and attributes as the CUDA ones in
// gemm/gemm_handlers.cc), so that a CPU program holds the same custom calls as a GPU one and the sharding of
// those calls can be tested without a GPU. Simple and exact, not fast: each operand is decoded to float32 with
// the dequantize kernel's numerics (block scales applied, per-tensor and NVFP4 global scales left out), the
// products are summed in double, then the per-tensor scales (or the NVFP4 alpha), bias and `c` are applied
// and the result is rounded once to the output dtype.
#include <cstring>
#include <string>
#include <vector>

#include "cpu_quantize.h"
#include "gemm/bindings.h"
#include "handlers.h"
#include "numerics.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace jaxhq;

namespace {

enum ScaleMode : int32_t { kTensor = 0, kVec128 = 1, kBlk128 = 2 };
enum DqFmt : int32_t { kMxE4M3 = 1, kMxE5M2 = 2, kNvfp4Fmt = 3 };

ffi::Error invalid(const std::string& msg) { return ffi::Error::InvalidArgument("jaxhq gemm (cpu): " + msg); }

std::string dims(const ffi::AnyBuffer& b) {
  std::string s = "[";
  auto d = b.dimensions();
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// One operand [rows, k] of a (batch of) GEMM(s): which dequantize format decodes it, and its global factor.
struct Operand {
  const void* data;
  const void* scale;
  int32_t fmt, opts;
  int64_t rows, k, batch;
  bool decoded = false;     // data is the bf16 values [rows, k] (a kDecoded copy)
  // 1x128 or MXFP8 scales [blocks, rows] (as the quantize launch writes them: jaxhq_gemm_fp8's 1x128 layout,
  // jaxhq_gemm_dq's with rows_inner) instead of [rows, blocks]
  bool rows_inner = false;
};

// Decodes batch element `g` of an operand to float32 [rows, k], block scales applied.
std::vector<float> decode(const Operand& o, int64_t g) {
  std::vector<float> out(size_t(o.rows * o.k));
  if (o.decoded) {
    const uint16_t* v = static_cast<const uint16_t*>(o.data) + g * o.rows * o.k;
    for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_bits_to_f32(v[i]);
    return out;
  }
  float one = 1.0f;
  DequantizeArgs a;
  a.data = static_cast<const uint8_t*>(o.data) + g * data_bytes(o.fmt, o.rows, o.k);
  a.scale = static_cast<const uint8_t*>(o.scale) + g * scale_bytes(o.fmt, o.rows, o.k);
  std::vector<uint8_t> scales;  // rows_inner: the scales as the dequantize code reads them, [rows, blocks]
  if (o.rows_inner) {
    const int64_t block = o.fmt == kFp8Block1 ? 128 : 32, size = o.fmt == kFp8Block1 ? 4 : 1;
    const int64_t kb = (o.k + block - 1) / block;
    const uint8_t* in = static_cast<const uint8_t*>(a.scale);
    scales.resize(size_t(o.rows * kb * size));
    for (int64_t r = 0; r < o.rows; ++r)
      for (int64_t j = 0; j < kb; ++j) memcpy(&scales[(r * kb + j) * size], in + (j * o.rows + r) * size, size);
    a.scale = scales.data();
  }
  a.scalar = &one;
  a.out = out.data();
  a.fmt = o.fmt;
  a.opts = o.opts;
  a.r = o.rows;
  a.c = o.k;
  dequantize_cpu(a);
  return out;
}

float load(const ffi::AnyBuffer& b, int64_t i) {
  if (b.element_type() == ffi::DataType::F32) return static_cast<const float*>(b.untyped_data())[i];
  uint16_t v;
  std::memcpy(&v, static_cast<const uint8_t*>(b.untyped_data()) + 2 * i, 2);
  return bf16_bits_to_f32(v);
}

void store(ffi::AnyBuffer& b, int64_t i, float v) {
  if (b.element_type() == ffi::DataType::F32) {
    static_cast<float*>(b.untyped_data())[i] = v;
    return;
  }
  uint16_t h = f32_to_bf16_bits(v);
  std::memcpy(static_cast<uint8_t*>(b.untyped_data()) + 2 * i, &h, 2);
}

// out rows [r0, r1) = A rows [r0, r1) @ B.T * alpha (+ bias) (+ c); the other rows are not touched.
void gemm_rows(const std::vector<float>& a, const std::vector<float>& b, int64_t r0, int64_t r1, int64_t n,
               int64_t k, double alpha, const ffi::AnyBuffer& bias, int64_t bias_off, const ffi::AnyBuffer& c,
               bool accumulate, ffi::AnyBuffer& out) {
  const bool has_bias = bias.element_count() > 0;
  for (int64_t i = r0; i < r1; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      const float* ar = a.data() + i * k;
      const float* br = b.data() + j * k;
      for (int64_t t = 0; t < k; ++t) acc += double(ar[t]) * double(br[t]);
      float v = float(acc * alpha);
      if (has_bias) v += load(bias, bias_off + j);
      if (accumulate) v += load(c, i * n + j);
      store(out, i * n + j, v);
    }
}

ffi::Error check_out(const ffi::AnyBuffer& bias, const ffi::AnyBuffer& c, const ffi::AnyBuffer& out, int64_t m,
                     int64_t n, int64_t bias_n, bool accumulate) {
  auto t = out.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16) return invalid("output must be float32 or bfloat16");
  if (int64_t(out.element_count()) != m * n) return invalid("output is " + dims(out) + ", expected [M, N]");
  if (bias.element_count() && (bias.element_type() != t || int64_t(bias.element_count()) != bias_n))
    return invalid("bias " + dims(bias) + " does not match the output");
  if (accumulate && (c.element_type() != t || int64_t(c.element_count()) != m * n))
    return invalid("accumulate input " + dims(c) + " does not match the output " + dims(out));
  return ffi::Error::Success();
}

// FP8 operand of the fp8 target: dequantize format from the scale mode, E5M2 from the buffer's dtype.
ffi::Error fp8_operand(const ffi::AnyBuffer& d, const ffi::AnyBuffer& s, int32_t mode, int64_t batch,
                       const char* who, Operand* o) {
  auto dd = d.dimensions();
  if (dd.size() < 2) return invalid(std::string(who) + " must be [rows, K], got " + dims(d));
  if (d.element_type() != ffi::DataType::F8E4M3FN && d.element_type() != ffi::DataType::F8E5M2)
    return invalid(std::string(who) + " must be float8_e4m3fn or float8_e5m2");
  int32_t fmt = mode == kTensor ? kFp8Tensor : mode == kVec128 ? kFp8Block1 : mode == kBlk128 ? kFp8Block2 : -1;
  if (fmt < 0) return invalid(std::string(who) + ": unknown scale mode " + std::to_string(mode));
  *o = Operand{d.untyped_data(), s.untyped_data(), fmt, d.element_type() == ffi::DataType::F8E5M2 ? kE5M2 : 0,
               dd[dd.size() - 2], dd[dd.size() - 1], batch};
  int64_t want = mode == kTensor ? 4 * batch : batch * scale_bytes(fmt, o->rows, o->k);
  if (s.element_type() != ffi::DataType::F32 || int64_t(s.size_bytes()) != want)
    return invalid(std::string(who) + " scales " + dims(s) + " do not match its data " + dims(d));
  return ffi::Error::Success();
}

ffi::Error dq_operand(const ffi::AnyBuffer& d, const ffi::AnyBuffer& s, int32_t fmt, int64_t k, int64_t batch,
                      const char* who, Operand* o) {
  auto dd = d.dimensions();
  if (dd.size() < 2) return invalid(std::string(who) + " must be [rows, ...], got " + dims(d));
  if (fmt != kMxE4M3 && fmt != kMxE5M2 && fmt != kNvfp4Fmt)
    return invalid(std::string(who) + ": unknown format " + std::to_string(fmt));
  int32_t f = fmt == kNvfp4Fmt ? kNvfp4 : kMxfp8;
  const bool dec = d.element_type() == ffi::DataType::BF16;
  *o = Operand{d.untyped_data(), s.untyped_data(), f, fmt == kMxE5M2 ? kE5M2 : 0, dd[dd.size() - 2], k, batch, dec};
  if (int64_t(d.size_bytes()) != batch * data_bytes(f, o->rows, k, dec) ||
      int64_t(s.size_bytes()) != batch * scale_bytes(f, o->rows, k))
    return invalid(std::string(who) + " data " + dims(d) + " / scales " + dims(s) + " do not match K = " +
                   std::to_string(k));
  return ffi::Error::Success();
}

float scalar(const ffi::AnyBuffer& b, int64_t i) { return static_cast<const float*>(b.untyped_data())[i]; }

ffi::Error gemm_fp8(ffi::AnyBuffer a, ffi::AnyBuffer sa, ffi::AnyBuffer b, ffi::AnyBuffer sb, ffi::AnyBuffer bias,
                    ffi::AnyBuffer c, ffi::Result<ffi::AnyBuffer> out, int32_t mode_a, int32_t mode_b, int32_t,
                    int32_t, int32_t accumulate, int32_t, ffi::Result<ffi::AnyBuffer> /*workspace*/) {
  Operand oa, ob;
  if (auto e = fp8_operand(a, sa, mode_a, 1, "A", &oa); e.failure()) return e;
  if (auto e = fp8_operand(b, sb, mode_b, 1, "B", &ob); e.failure()) return e;
  oa.rows_inner = mode_a == kVec128, ob.rows_inner = mode_b == kVec128;  // as the quantize launch writes them
  if (oa.k != ob.k) return invalid("K differs: A " + dims(a) + ", B " + dims(b));
  if (auto e = check_out(bias, c, *out, oa.rows, ob.rows, ob.rows, accumulate); e.failure()) return e;
  double alpha = (mode_a == kTensor ? double(scalar(sa, 0)) : 1.0) * (mode_b == kTensor ? double(scalar(sb, 0)) : 1.0);
  gemm_rows(decode(oa, 0), decode(ob, 0), 0, oa.rows, ob.rows, oa.k, alpha, bias, 0, c, accumulate, *out);
  return ffi::Error::Success();
}

ffi::Error nvfp4_amaxes(const ffi::AnyBuffer& amax_a, const ffi::AnyBuffer& amax_b, int64_t groups) {
  if (amax_a.element_type() != ffi::DataType::F32 || amax_a.element_count() != 1 ||
      amax_b.element_type() != ffi::DataType::F32 || int64_t(amax_b.element_count()) != groups)
    return invalid("NVFP4 amax must be float32: a scalar for A and one per group for B");
  return ffi::Error::Success();
}

// B stored [K, N] (b_kn: a decoded copy read transposed) -> the operand [N, K] as gemm_rows reads it.
ffi::Error transposed_operand(const ffi::AnyBuffer& d, const ffi::AnyBuffer& s, int32_t fmt, int64_t k,
                              const char* who, Operand* o, std::vector<float>* values) {
  auto dd = d.dimensions();
  if (d.element_type() != ffi::DataType::BF16 || dd.size() != 2 || dd[0] != k)
    return invalid(std::string(who) + " is read transposed: a decoded (bf16) copy [K, N] with K = " + std::to_string(k) +
                   " is needed, got " + dims(d));
  Operand t;  // the copy as it is stored: [K, N]
  if (auto e = dq_operand(d, s, fmt, dd[1], 1, who, &t); e.failure()) return e;
  const std::vector<float> kn = decode(t, 0);
  const int64_t n = dd[1];
  values->resize(size_t(n * k));
  for (int64_t i = 0; i < k; ++i)
    for (int64_t j = 0; j < n; ++j) (*values)[j * k + i] = kn[i * n + j];
  *o = t;
  o->rows = n, o->k = k;
  return ffi::Error::Success();
}

ffi::Error gemm_dq(ffi::AnyBuffer a, ffi::AnyBuffer sa, ffi::AnyBuffer amax_a, ffi::AnyBuffer b, ffi::AnyBuffer sb,
                   ffi::AnyBuffer amax_b, ffi::AnyBuffer bias, ffi::AnyBuffer c, ffi::Result<ffi::AnyBuffer> out,
                   int32_t fmt_a, int32_t fmt_b, int64_t k, int32_t accumulate, int32_t b_kn, int32_t rows_inner,
                   ffi::Result<ffi::AnyBuffer> /*workspace*/) {
  Operand oa, ob;
  std::vector<float> bv;
  if (auto e = dq_operand(a, sa, fmt_a, k, 1, "A", &oa); e.failure()) return e;
  oa.rows_inner = rows_inner && fmt_a != kNvfp4Fmt;
  if (b_kn) {
    if (auto e = transposed_operand(b, sb, fmt_b, k, "B", &ob, &bv); e.failure()) return e;
  } else {
    if (auto e = dq_operand(b, sb, fmt_b, k, 1, "B", &ob); e.failure()) return e;
    ob.rows_inner = rows_inner && fmt_b != kNvfp4Fmt;
    bv = decode(ob, 0);
  }
  if ((fmt_a == kNvfp4Fmt) != (fmt_b == kNvfp4Fmt)) return invalid("NVFP4 pairs only with NVFP4");
  double alpha = 1.0;
  if (fmt_a == kNvfp4Fmt) {
    if (auto e = nvfp4_amaxes(amax_a, amax_b, 1); e.failure()) return e;
    alpha = double(nvfp4_global_decode(scalar(amax_a, 0)) * nvfp4_global_decode(scalar(amax_b, 0)));
  }
  if (auto e = check_out(bias, c, *out, oa.rows, ob.rows, ob.rows, accumulate); e.failure()) return e;
  gemm_rows(decode(oa, 0), bv, 0, oa.rows, ob.rows, k, alpha, bias, 0, c, accumulate, *out);
  return ffi::Error::Success();
}

// Rows past the groups' total: zero, or `c` where accumulating (as on the GPU).
void tail(int64_t from, int64_t t, int64_t n, const ffi::AnyBuffer& c, bool accumulate, ffi::AnyBuffer& out) {
  for (int64_t i = from * n; i < t * n; ++i) store(out, i, accumulate ? load(c, i) : 0.0f);
}

ffi::Error group_sizes(const ffi::AnyBuffer& sizes, int64_t groups, int64_t t, std::vector<int64_t>* starts) {
  if (sizes.element_type() != ffi::DataType::S32 || int64_t(sizes.element_count()) != groups)
    return invalid("group_sizes must be int32 [G] with G = " + std::to_string(groups));
  const int32_t* s = static_cast<const int32_t*>(sizes.untyped_data());
  starts->assign(1, 0);
  for (int64_t g = 0; g < groups; ++g) {
    if (s[g] < 0) return invalid("negative group size");
    starts->push_back(starts->back() + s[g]);
  }
  if (starts->back() > t) return invalid("group sizes sum to more than the " + std::to_string(t) + " rows of A");
  return ffi::Error::Success();
}

ffi::Error gemm_fp8_grouped(ffi::AnyBuffer a, ffi::AnyBuffer sa, ffi::AnyBuffer b, ffi::AnyBuffer sb,
                            ffi::AnyBuffer sizes, ffi::AnyBuffer bias, ffi::AnyBuffer c,
                            ffi::Result<ffi::AnyBuffer> out, int32_t mode_a, int32_t mode_b, int32_t, int32_t,
                            int32_t accumulate, int32_t) {
  auto bd = b.dimensions();
  if (bd.size() != 3) return invalid("grouped B must be [G, N, K], got " + dims(b));
  int64_t groups = bd[0];
  Operand oa, ob;
  if (auto e = fp8_operand(a, sa, mode_a, 1, "A", &oa); e.failure()) return e;
  if (auto e = fp8_operand(b, sb, mode_b, groups, "B", &ob); e.failure()) return e;
  if (oa.k != ob.k) return invalid("K differs: A " + dims(a) + ", B " + dims(b));
  std::vector<int64_t> starts;
  if (auto e = group_sizes(sizes, groups, oa.rows, &starts); e.failure()) return e;
  if (auto e = check_out(bias, c, *out, oa.rows, ob.rows, groups * ob.rows, accumulate); e.failure()) return e;
  std::vector<float> av = decode(oa, 0);
  for (int64_t g = 0; g < groups; ++g) {
    double alpha = (mode_a == kTensor ? double(scalar(sa, 0)) : 1.0) * (mode_b == kTensor ? double(scalar(sb, g)) : 1.0);
    gemm_rows(av, decode(ob, g), starts[g], starts[g + 1], ob.rows, oa.k, alpha, bias, g * ob.rows, c, accumulate,
              *out);
  }
  tail(starts.back(), oa.rows, ob.rows, c, accumulate, *out);
  return ffi::Error::Success();
}

ffi::Error gemm_dq_grouped(ffi::AnyBuffer a, ffi::AnyBuffer sa, ffi::AnyBuffer amax_a, ffi::AnyBuffer b,
                           ffi::AnyBuffer sb, ffi::AnyBuffer amax_b, ffi::AnyBuffer sizes, ffi::AnyBuffer bias,
                           ffi::AnyBuffer c, ffi::Result<ffi::AnyBuffer> out, int32_t fmt_a, int32_t fmt_b,
                           int64_t k, int32_t accumulate, int32_t rows_inner) {
  auto bd = b.dimensions();
  if (bd.size() != 3) return invalid("grouped B must be [G, N, K / per byte], got " + dims(b));
  int64_t groups = bd[0];
  Operand oa, ob;
  if (auto e = dq_operand(a, sa, fmt_a, k, 1, "A", &oa); e.failure()) return e;
  if (auto e = dq_operand(b, sb, fmt_b, k, groups, "B", &ob); e.failure()) return e;
  oa.rows_inner = ob.rows_inner = rows_inner && fmt_a != kNvfp4Fmt;
  if ((fmt_a == kNvfp4Fmt) != (fmt_b == kNvfp4Fmt)) return invalid("NVFP4 pairs only with NVFP4");
  if (fmt_a == kNvfp4Fmt)
    if (auto e = nvfp4_amaxes(amax_a, amax_b, groups); e.failure()) return e;
  std::vector<int64_t> starts;
  if (auto e = group_sizes(sizes, groups, oa.rows, &starts); e.failure()) return e;
  if (auto e = check_out(bias, c, *out, oa.rows, ob.rows, groups * ob.rows, accumulate); e.failure()) return e;
  std::vector<float> av = decode(oa, 0);
  for (int64_t g = 0; g < groups; ++g) {
    const double alpha =
        fmt_a == kNvfp4Fmt ? double(nvfp4_global_decode(scalar(amax_a, 0)) * nvfp4_global_decode(scalar(amax_b, g)))
                           : 1.0;
    gemm_rows(av, decode(ob, g), starts[g], starts[g + 1], ob.rows, k, alpha, bias, g * ob.rows, c, accumulate,
              *out);
  }
  tail(starts.back(), oa.rows, ob.rows, c, accumulate, *out);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cpu_gemm_fp8, gemm_fp8,
                              jaxhq::gemm_bind::gemm_fp8(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cpu_gemm_dq, gemm_dq,
                              jaxhq::gemm_bind::gemm_dq(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cpu_gemm_fp8_grouped, gemm_fp8_grouped,
                              jaxhq::gemm_bind::gemm_fp8_grouped(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cpu_gemm_dq_grouped, gemm_dq_grouped,
                              jaxhq::gemm_bind::gemm_dq_grouped(ffi::Ffi::Bind()));
