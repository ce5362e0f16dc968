// XLA FFI handlers of the GEMMs (every one computes out[M, N] = A[M, K] @ B[N, K].T, both K-major):
//   jaxhq_gemm_fp8: FP8 x FP8 through cuBLASLt, scales read on the device: per-tensor fp32 scalars, or
//                   (Hopper, cuBLASLt >= 12.9) 1x128 / 128x128 fp32 block scales: the 1x128 ones taken
//                   [ceil(K/128), rows] as the quantize launch writes them and read where they lie (rows % 4
//                   == 0), other layouts re-laid-out in scratch.
//   jaxhq_gemm_dq:  MXFP8 or NVFP4 dequantized exactly to bf16 in scratch, then a cuBLASLt bf16 GEMM with
//                   the NVFP4 global scales as alpha on the device; MXFP8 scales taken [ceil(K/32), rows] as the
//                   quantize launch writes them (rows_inner), decoded operands used where they lie.
//   jaxhq_gemm_mxfp8: MXFP8 on Hopper FP8 tensor cores (fp8_wgmma.cu), the 1x32 scales applied in registers;
//                   its grouped version reads the group sizes on the device (no host synchronisation).
//   jaxhq_gemm_nvfp4: NVFP4 on Hopper fp16 tensor cores (nvfp4_wgmma.cu), the codes decoded in shared memory.
//   jaxhq_gemm_fp8_wgmma_grouped: per-tensor / blockwise FP8 grouped on the same kernel (Hopper), the group
//                   sizes read on the device; jaxhq_gemm_fp8_grouped is its cuBLASLt form (host sizes).
//   jaxhq_gemm_fp8_cutlass_grouped: per-tensor / blockwise FP8 grouped on CUTLASS's sm90 pointer-array
//                   kernels (built with CUTLASS's headers), the group sizes read on the device, its tables in a
//                   workspace result (graphable); jaxhq_gemm_cutlass_kgrouped groups along K instead (the MoE
//                   wgrad: out[g] = A[:, seg g] @ B[:, seg g].T, FP8 with 1x128 blocks along K on both operands,
//                   or bf16 decoded copies); jaxhq_gemm_bf16_cutlass_grouped is the bf16 grouped GEMM along rows.
// Optional bias [N] and accumulate-into (out aliases the `c` input). The dense handlers take their cuBLASLt
// workspace and temporaries from a workspace result that XLA allocates with the call (sized by
// jaxhq/ffi/gemm.py), so they are command-buffer compatible: XLA records them into its CUDA graphs with the
// fusions and quantize kernels around them. The grouped ones (a host synchronisation) use the scratch
// allocator. cuBLASLt row-major trick: D^T[N, M] = op(B_data)^T ... i.e. cuBLAS's A is our B
// (transposed), cuBLAS's B is our A.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <mutex>
#include <vector>
#include <string>
#include <thread>
#include <unordered_map>

#include "bindings.h"
#include "cublaslt.h"
#include "gemm_kernels.h"
#include "fp8_wgmma.h"
#include "registry.h"
#ifdef JAXHQ_WITH_CUTLASS
#include "fp8_cutlass_grouped.h"
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxhq {
namespace {

constexpr size_t kWorkspace = gemm_bind::kLtWorkspace;
constexpr size_t kScratchAlign = 16;  // the most XLA's FFI scratch allocator accepts (its BFC blocks are 256-aligned)

enum ScaleMode : int32_t { kTensor = 0, kVec128 = 1, kBlk128 = 2 };
int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t rup(int64_t a, int64_t b) { return cdiv(a, b) * b; }
enum DqFmt : int32_t { kMxE4M3 = 1, kMxE5M2 = 2, kNvfp4 = 3 };

ffi::Error invalid(const std::string& msg) { return ffi::Error::InvalidArgument("jaxhq gemm: " + msg); }
ffi::Error internal(const std::string& msg) { return ffi::Error::Internal("jaxhq gemm: " + msg); }

std::string dims(const ffi::AnyBuffer& b) {
  std::string s = "[";
  auto d = b.dimensions();
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

bool is_2d(const ffi::AnyBuffer& b, int64_t r, int64_t c) {
  auto d = b.dimensions();
  return d.size() == 2 && d[0] == r && d[1] == c;
}

uint32_t alignment_of(const void* p) {
  uintptr_t v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && (v % a)) a /= 2;
  return a;
}

// A call's temporaries: 256-byte aligned pieces of its workspace result (bump allocation), or XLA scratch
// memory when built from an allocator. A workspace too small for a path leaves `needed` set for the error.
struct Scratch {
  ffi::ScratchAllocator* alloc = nullptr;
  char* base = nullptr;
  size_t cap = 0, used = 0, needed = 0;
  void* ws = nullptr;  // the cuBLASLt workspace, taken on first use and shared by all GEMMs of a call

  explicit Scratch(ffi::ScratchAllocator& a) : alloc(&a) {}
  explicit Scratch(ffi::Result<ffi::AnyBuffer>& w) {
    uintptr_t p = reinterpret_cast<uintptr_t>(w->untyped_data()), q = (p + 255) / 256 * 256;
    base = reinterpret_cast<char*>(q);
    cap = w->size_bytes() > q - p ? w->size_bytes() - (q - p) : 0;
  }
  void* get(size_t bytes) {
    bytes = std::max<size_t>((bytes + 255) / 256 * 256, 256);  // keep later pieces 256-byte aligned
    if (alloc) {
      auto p = alloc->Allocate(bytes, kScratchAlign);
      return p.has_value() ? *p : nullptr;
    }
    if (used + bytes > cap) {
      needed = used + bytes;
      return nullptr;
    }
    used += bytes;
    return base + used - bytes;
  }
  void* workspace() {
    if (!ws) ws = get(kWorkspace);
    return ws;
  }
};

// The error of a failed Scratch::get: names the workspace size when that is what ran out.
ffi::Error out_of_scratch(const Scratch& s, const std::string& what) {
  if (s.alloc || !s.needed) return internal("scratch allocation of " + what + " failed");
  return internal("the workspace (" + std::to_string(s.cap) + " bytes) is too small for " + what + ": " +
                  std::to_string(s.needed) + " bytes needed (jaxhq/ffi/gemm.py sizes it)");
}

// One cuBLASLt call in our terms.
struct LtCall {
  int32_t type_a, type_b;           // data types of our A [M, K] and B [N, K]
  const void *a, *b;                // our A and B
  int64_t m, n, k;
  const void *scale_a, *scale_b;    // device scale pointers (null: 1)
  int32_t mode_a, mode_b;           // cuBLASLt scale modes
  int32_t out_type;                 // kR32F or kR16BF
  void* d;                          // out [M, N]
  const void* bias;                 // [N] of out_type, or null
  bool accumulate;                  // out += ...
  bool fast_accum;
  const float* alpha_beta;          // device {alpha, beta} (null: host 1 and accumulate ? 1 : 0)
  bool b_kn;                        // our B is stored [K, N] (a transposed bf16 operand)
};

struct Plan {
  lt::Heuristic h;
  bool found;
};

std::string lt_error(const char* what, lt::Status s) { return std::string(what) + " failed (cublasStatus " + std::to_string(s) + ")"; }

// RAII holders for the descriptor objects.
struct Descs {
  lt::MatmulDesc op = nullptr;
  lt::Layout la = nullptr, lb = nullptr, lc = nullptr;
  lt::Pref pref = nullptr;
  ~Descs() {
    const auto& A = lt::api();
    if (op) A.MatmulDescDestroy(op);
    if (la) A.MatrixLayoutDestroy(la);
    if (lb) A.MatrixLayoutDestroy(lb);
    if (lc) A.MatrixLayoutDestroy(lc);
    if (pref) A.MatmulPreferenceDestroy(pref);
  }
};

#define LT_TRY(expr, what)                         \
  do {                                             \
    lt::Status _s = (expr);                        \
    if (_s != 0) return lt_error(what, _s);        \
  } while (0)

// Builds descriptors for `c` with or without the fused epilogue (bias in cuBLASLt, beta from accumulate).
std::string build(const LtCall& c, bool fused, uint32_t align_d, Descs* ds) {
  const auto& A = lt::api();
  LT_TRY(A.MatmulDescCreate(&ds->op, lt::kCompute32F, lt::kR32F), "cublasLtMatmulDescCreate");
  int32_t ta = c.b_kn ? lt::kOpN : lt::kOpT, tb = lt::kOpN;
  LT_TRY(A.MatmulDescSetAttribute(ds->op, lt::kDescTransA, &ta, sizeof(ta)), "set TRANSA");
  LT_TRY(A.MatmulDescSetAttribute(ds->op, lt::kDescTransB, &tb, sizeof(tb)), "set TRANSB");
  if (c.alpha_beta) {
    int32_t pm = lt::kPointerDevice;
    LT_TRY(A.MatmulDescSetAttribute(ds->op, lt::kDescPointerMode, &pm, sizeof(pm)), "set POINTER_MODE");
  }
  // cuBLAS's A is our B and vice versa.
  if (c.scale_b) {
    LT_TRY(A.MatmulDescSetAttribute(ds->op, lt::kDescAScalePointer, &c.scale_b, sizeof(void*)), "set A_SCALE_POINTER");
    if (c.mode_b != lt::kScaleScalar)
      LT_TRY(A.MatmulDescSetAttribute(ds->op, lt::kDescAScaleMode, &c.mode_b, sizeof(int32_t)), "set A_SCALE_MODE");
  }
  if (c.scale_a) {
    LT_TRY(A.MatmulDescSetAttribute(ds->op, lt::kDescBScalePointer, &c.scale_a, sizeof(void*)), "set B_SCALE_POINTER");
    if (c.mode_a != lt::kScaleScalar)
      LT_TRY(A.MatmulDescSetAttribute(ds->op, lt::kDescBScaleMode, &c.mode_a, sizeof(int32_t)), "set B_SCALE_MODE");
  }
  if (c.type_a == lt::kR8F_E4M3 || c.type_a == lt::kR8F_E5M2) {
    int8_t fa = c.fast_accum ? 1 : 0;
    LT_TRY(A.MatmulDescSetAttribute(ds->op, lt::kDescFastAccum, &fa, sizeof(fa)), "set FAST_ACCUM");
  }
  if (fused && c.bias) {
    int32_t epi = lt::kEpilogueBias;
    LT_TRY(A.MatmulDescSetAttribute(ds->op, lt::kDescEpilogue, &epi, sizeof(epi)), "set EPILOGUE");
    LT_TRY(A.MatmulDescSetAttribute(ds->op, lt::kDescBiasPointer, &c.bias, sizeof(void*)), "set BIAS_POINTER");
    LT_TRY(A.MatmulDescSetAttribute(ds->op, lt::kDescBiasDataType, &c.out_type, sizeof(int32_t)), "set BIAS_DATA_TYPE");
  }
  if (c.b_kn) LT_TRY(A.MatrixLayoutCreate(&ds->la, c.type_b, c.n, c.k, c.n), "layout A");
  else LT_TRY(A.MatrixLayoutCreate(&ds->la, c.type_b, c.k, c.n, c.k), "layout A");
  LT_TRY(A.MatrixLayoutCreate(&ds->lb, c.type_a, c.k, c.m, c.k), "layout B");
  LT_TRY(A.MatrixLayoutCreate(&ds->lc, c.out_type, c.n, c.m, c.n), "layout C/D");
  LT_TRY(A.MatmulPreferenceCreate(&ds->pref), "preference");
  uint64_t ws = kWorkspace;
  LT_TRY(A.MatmulPreferenceSetAttribute(ds->pref, lt::kPrefMaxWorkspace, &ws, sizeof(ws)), "set MAX_WORKSPACE");
  uint32_t al[4] = {alignment_of(c.b), alignment_of(c.a), align_d, align_d};
  for (int i = 0; i < 4; ++i)
    LT_TRY(A.MatmulPreferenceSetAttribute(ds->pref, 5 + i, &al[i], sizeof(uint32_t)), "set MIN_ALIGNMENT");
  return "";
}

std::string plan_key(const LtCall& c, bool fused, uint32_t align_d) {
  char buf[320];
  int dev = 0;
  cudaGetDevice(&dev);
  snprintf(buf, sizeof(buf), "%d|%d,%d|%lld,%lld,%lld|%d,%d,%d,%d|%d|%d,%d,%d|%d|%d|%u,%u,%u|%d", dev, c.type_a,
           c.type_b, (long long)c.m, (long long)c.n, (long long)c.k, c.scale_a != nullptr, c.scale_b != nullptr,
           c.mode_a, c.mode_b, c.out_type, fused && c.bias != nullptr, fused && c.accumulate, c.fast_accum,
           c.alpha_beta != nullptr, int(fused), alignment_of(c.a), alignment_of(c.b), align_d, int(c.b_kn));
  return buf;
}

// JAXHQ_GEMM_TUNE: unset or "1" times cuBLASLt's candidate algorithms, "0" takes its first heuristic, "verbose"
// also prints each choice to stderr.
int tuning_mode() {
  static const int mode = [] {
    const char* e = std::getenv("JAXHQ_GEMM_TUNE");
    std::string v = e ? e : "1";
    return v == "0" ? 0 : v == "verbose" ? 2 : 1;
  }();
  return mode;
}

// One cuBLASLt call of `c` with algorithm `algo`: alpha and beta from the device (c.alpha_beta) or 1 and
// (accumulate ? 1 : 0) on the host; C = D.
lt::Status matmul(cudaStream_t stream, lt::Handle h, const Descs& ds, const LtCall& c, const lt::Algo& algo,
                  void* ws) {
  static const float one = 1.0f, zero = 0.0f;
  const void* alpha = c.alpha_beta ? static_cast<const void*>(c.alpha_beta) : &one;
  const void* beta = c.alpha_beta ? static_cast<const void*>(c.alpha_beta + 1) : (c.accumulate ? &one : &zero);
  return lt::api().Matmul(h, ds.op, alpha, c.b, ds.la, c.a, ds.lb, beta, c.d, ds.lc, c.d, ds.lc, &algo, ws, kWorkspace,
                          stream);
}

// Times kTimed back-to-back runs of one algorithm on the call's own operands (the output is written; the real run
// rewrites it). A negative result means cuBLASLt refused the algorithm.
constexpr int kCandidates = 16, kTimed = 3, kRounds = 4;
constexpr float kMargin = 0.02f;  // how much faster a candidate must be than the first pick to replace it
float time_algo(cudaStream_t stream, lt::Handle h, const Descs& ds, const LtCall& c, const lt::Algo& algo, void* ws,
                cudaEvent_t e0, cudaEvent_t e1) {
  cudaEventRecord(e0, stream);
  for (int i = 0; i < kTimed; ++i)
    if (matmul(stream, h, ds, c, algo, ws) != 0) return -1.0f;
  cudaEventRecord(e1, stream);
  float ms = -1.0f;
  if (cudaEventSynchronize(e1) != cudaSuccess || cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) return -1.0f;
  return ms;
}

// Each candidate's time over kRounds rounds (negative: refused), after one warm-up run of each. The rounds
// alternate the order (first to last, then last to first), so a clock that drifts during the tuning (the GPU
// warming up under the load) adds the same to every candidate instead of favouring the ones timed first.
std::vector<float> time_candidates(cudaStream_t stream, lt::Handle h, const Descs& ds, const LtCall& c,
                                   const lt::Heuristic* r, int n, void* ws) {
  std::vector<float> total(n, 0.0f);
  for (int i = 0; i < n; ++i)
    if (r[i].state != 0 || matmul(stream, h, ds, c, r[i].algo, ws) != 0) total[i] = -1.0f;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int round = 0; round < kRounds; ++round)
    for (int j = 0; j < n; ++j) {
      const int i = round % 2 ? n - 1 - j : j;
      if (total[i] < 0) continue;
      const float ms = time_algo(stream, h, ds, c, r[i].algo, ws, e0, e1);
      total[i] = ms < 0 ? -1.0f : total[i] + ms;
    }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaGetLastError();  // a refused candidate leaves no sticky error; clear the last one
  return total;
}

// The index of the fastest of cuBLASLt's candidates r[0..n) for `c` (0 when none beats the first pick by more
// than kMargin), timed on c's operands, its output written by every timed run.
int fastest(cudaStream_t stream, lt::Handle h, const Descs& ds, const LtCall& c, const lt::Heuristic* r, int n,
            void* ws, float* best_ms, float* first_ms) {
  *best_ms = *first_ms = -1.0f;
  if (n < 2) return 0;
  const std::vector<float> t = time_candidates(stream, h, ds, c, r, n, ws);
  int chosen = 0;
  float best = -1.0f;
  for (int i = 0; i < n; ++i)
    if (t[i] >= 0 && (best < 0 || t[i] < best)) best = t[i], chosen = i;
  if (t[0] >= 0 && best > t[0] * (1.0f - kMargin)) best = t[0], chosen = 0;  // near-ties keep the heuristic's pick
  *best_ms = best / (kTimed * kRounds), *first_ms = t[0] / (kTimed * kRounds);
  return chosen;
}

// A pointer into `base` (256-byte aligned) with the alignment of `like` (at most 256), so that cuBLASLt, told the
// stand-in's alignments, offers the real call's candidates.
char* aligned_like(char* base, const void* like) {
  const uint32_t a = alignment_of(like);
  return base + (a < 256 ? a : 0);
}

// Times the candidates for `c` on stand-ins of its operands, scales, bias, alpha/beta and output (same shapes,
// types, modes and alignments; constant values) allocated on a stream of a thread of its own. So it runs while
// XLA captures the caller's stream into a CUDA graph (a capture forbids the capturing thread to synchronise, not
// another thread) and for an accumulating call (the stand-in output takes the timed runs' sums). Returns the
// chosen index into cuBLASLt's candidates for the stand-ins, whose list *r_out receives (n_out entries).
std::string tune_on_standins(lt::Handle h, const LtCall& c, bool fused, uint32_t align_d, lt::Heuristic* r_out,
                             int* n_out, int* chosen, float* best_ms, float* first_ms) {
  int dev = 0;
  cudaGetDevice(&dev);
  std::string err;
  std::thread worker([&] {
    cudaSetDevice(dev);
    cudaStream_t st = nullptr;
    if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess) {
      err = "tuning stream";
      return;
    }
    auto elem = [](int32_t t) -> size_t { return t == lt::kR8F_E4M3 || t == lt::kR8F_E5M2 ? 1 : t == lt::kR32F ? 4 : 2; };
    const size_t out_bytes = elem(c.out_type), kb = size_t(cdiv(c.k, 128));
    // scales of any layout the handler stages (rows padded to 128, K blocks to 16), or one scalar
    auto scale_bytes = [&](int64_t rows, int32_t mode) -> size_t {
      return mode == lt::kScaleScalar ? 4 : size_t(rup(rows, 128) + 128) * (kb + 16) * 4;
    };
    const size_t sizes[7] = {size_t(c.m) * c.k * elem(c.type_a), size_t(c.n) * c.k * elem(c.type_b),
                             size_t(c.m) * c.n * out_bytes, c.scale_a ? scale_bytes(c.m, c.mode_a) : 0,
                             c.scale_b ? scale_bytes(c.n, c.mode_b) : 0, c.bias ? size_t(c.n) * out_bytes : 0,
                             kWorkspace + (c.alpha_beta ? 2 * sizeof(float) : 0)};
    void* mem[7] = {};
    bool ok = true;
    for (int i = 0; i < 7 && ok; ++i)
      if (sizes[i]) {
        ok = cudaMallocAsync(&mem[i], sizes[i] + 256, st) == cudaSuccess;
        // FP8 codes 0x3A (1.25 in E4M3), bf16 0x3A3A, scales 0x3F3F3F3F (0.75), bias / alpha / beta 0
        if (ok) cudaMemsetAsync(mem[i], i < 2 ? 0x3A : i < 5 ? 0x3F : 0, sizes[i] + 256, st);
      }
    if (ok) {
      LtCall p = c;
      char* m[7];
      for (int i = 0; i < 7; ++i) m[i] = static_cast<char*>(mem[i]);
      p.a = aligned_like(m[0], c.a), p.b = aligned_like(m[1], c.b), p.d = aligned_like(m[2], c.d);
      p.scale_a = c.scale_a ? m[3] : nullptr, p.scale_b = c.scale_b ? m[4] : nullptr;
      p.bias = c.bias ? aligned_like(m[5], c.bias) : nullptr;
      p.alpha_beta = c.alpha_beta ? reinterpret_cast<const float*>(m[6] + kWorkspace) : nullptr;
      Descs ds;
      err = build(p, fused, align_d, &ds);
      if (err.empty()) {
        lt::Status s = lt::api().MatmulAlgoGetHeuristic(h, ds.op, ds.la, ds.lb, ds.lc, ds.lc, ds.pref, kCandidates,
                                                        r_out, n_out);
        if (s != 0 || *n_out < 1) *n_out = 0;
        else *chosen = fastest(st, h, ds, p, r_out, *n_out, m[6], best_ms, first_ms);
      }
    } else {
      err = "tuning buffers";
    }
    for (void* q : mem)
      if (q) cudaFreeAsync(q, st);
    cudaStreamSynchronize(st);
    cudaStreamDestroy(st);
    cudaGetLastError();  // a refused candidate or allocation leaves no sticky error; clear the last one
  });
  worker.join();
  return err;
}

// Finds (and caches) an algorithm; *found = false when cuBLASLt has none for this configuration. The first call
// of a configuration times cuBLASLt's candidates and keeps the fastest when it beats the first pick by more than
// kMargin (docs/gemm.md, "Algorithm choice", has the figures): on its own operands where it can, or on stand-ins
// (tune_on_standins) for an accumulating call and while XLA captures the stream into a CUDA graph (a call recorded
// before it ever ran; the pick of a capture whose stand-ins failed is not cached, so a later call tunes).
std::string get_plan(lt::Handle h, const LtCall& c, bool fused, uint32_t align_d, Descs* ds, Plan* plan,
                     cudaStream_t stream = nullptr, void* ws = nullptr) {
  static std::mutex mu;
  static std::unordered_map<std::string, Plan> cache;
  std::string err = build(c, fused, align_d, ds);
  if (!err.empty()) {
    plan->found = false;
    return fused ? std::string() : err;  // a fused epilogue attribute may be unsupported: try unfused
  }
  std::string key = plan_key(c, fused, align_d);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) {
      *plan = it->second;
      return "";
    }
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (stream) cudaStreamIsCapturing(stream, &capture);
  const bool tune = stream && ws && tuning_mode();
  const bool on_operands = tune && !c.accumulate && capture == cudaStreamCaptureStatusNone;
  int n = 0;
  lt::Heuristic r[kCandidates];
  std::memset(r, 0, sizeof(r));
  lt::Status s = lt::api().MatmulAlgoGetHeuristic(h, ds->op, ds->la, ds->lb, ds->lc, ds->lc, ds->pref,
                                                  tune ? kCandidates : 1, r, &n);
  plan->found = (s == 0 && n > 0);
  bool standins = false;  // tuned on stand-ins
  if (plan->found) {
    plan->h = r[0];
    int chosen = 0;
    float best = -1.0f, first = -1.0f;
    if (on_operands) {
      chosen = fastest(stream, h, *ds, c, r, n, ws, &best, &first);
    } else if (tune && n > 1) {
      lt::Heuristic rs[kCandidates];
      std::memset(rs, 0, sizeof(rs));
      int ns = 0, cs = 0;
      // the stand-ins' pick, where it is one of this call's candidates (the same problem, types and alignments)
      if (tune_on_standins(h, c, fused, align_d, rs, &ns, &cs, &best, &first).empty())
        for (int i = 0; i < n && !standins; ++i)
          if (cs < ns && std::memcmp(&r[i].algo, &rs[cs].algo, sizeof(r[i].algo)) == 0) chosen = i, standins = true;
    }
    plan->h = r[chosen];
    if (tuning_mode() == 2 && tune)
      fprintf(stderr, "jaxhq gemm tune %s: candidate %d of %d, %.4f ms (first %.4f ms)%s\n", key.c_str(), chosen, n,
              best, first, n < 2 ? " (one candidate)" : on_operands ? "" : standins ? " on stand-ins"
                                                                      : " (stand-ins: no pick, the first)");
  }
  if (capture != cudaStreamCaptureStatusNone && tune && n > 1 && !standins) return "";  // untuned: not kept
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = *plan;
  return "";
}

// `unsupported` (optional) is set when cuBLASLt itself refused (no algorithm, or the call failed), so the
// caller may retry with a padded problem.
ffi::Error run_lt(cudaStream_t stream, Scratch& scratch, const LtCall& c, bool* unsupported = nullptr) {
  bool dummy = false;
  bool& unsup = unsupported ? *unsupported : dummy;
  unsup = false;
  const auto& A = lt::api();
  if (!A.error.empty()) return internal(A.error);
  lt::Handle h;
  if (lt::Status s = lt::handle(&h); s != 0) return internal(lt_error("cublasLtCreate", s));
  void* ws = scratch.workspace();
  if (!ws) return out_of_scratch(scratch, "the cuBLASLt workspace");
  // Tuning only for the dense calls (workspace result): the grouped ones meet a new M per group and step.
  cudaStream_t tune_stream = scratch.alloc ? nullptr : stream;
  const size_t out_bytes = c.out_type == lt::kR32F ? 4 : 2;

  // 1. fused: bias in the epilogue, accumulate through beta with C = D.
  {
    Descs ds;
    Plan p{};
    std::string err = get_plan(h, c, true, alignment_of(c.d), &ds, &p, tune_stream, ws);
    if (!err.empty()) return internal(err);
    if (p.found) {
      lt::Status s = matmul(stream, h, ds, c, p.h.algo, ws);
      if (s == 0) return ffi::Error::Success();
      if (!c.bias && !c.accumulate) return unsup = true, internal(lt_error("cublasLtMatmul", s));
    } else if (!c.bias && !c.accumulate) {
 unsup = true;
      return internal("cuBLASLt has no algorithm for this GEMM (types " + std::to_string(c.type_a) + "x" +
                      std::to_string(c.type_b) + ", scale modes " + std::to_string(c.mode_a) + "/" +
                      std::to_string(c.mode_b) + ", out " + std::to_string(c.out_type) + ")");
    }
  }
  // 2. unfused: plain GEMM into a temporary, then out = tmp + bias + (accumulate ? out : 0).
  LtCall plain = c;
  plain.bias = nullptr;
  plain.accumulate = false;
  void* tmp = scratch.get(size_t(c.m) * c.n * out_bytes);
  if (!tmp) return out_of_scratch(scratch, "the GEMM temporary");
  plain.d = tmp;
  float* ab = nullptr;
  if (c.alpha_beta) {  // device alpha with beta = 0 for the temporary
    ab = static_cast<float*>(scratch.get(2 * sizeof(float)));
    if (!ab) return out_of_scratch(scratch, "alpha and beta");
    cudaMemcpyAsync(ab, c.alpha_beta, sizeof(float), cudaMemcpyDeviceToDevice, stream);
    cudaMemsetAsync(ab + 1, 0, sizeof(float), stream);
    plain.alpha_beta = ab;
  }
  Descs ds;
  Plan p{};
  std::string err = get_plan(h, plain, false, alignment_of(tmp), &ds, &p, tune_stream, ws);
  if (!err.empty()) return internal(err);
  if (!p.found) return unsup = true, internal("cuBLASLt has no algorithm for this GEMM");
  lt::Status s = matmul(stream, h, ds, plain, p.h.algo, ws);  // plain.d is tmp
  if (s != 0) return unsup = true, internal(lt_error("cublasLtMatmul", s));
  std::string e = gemm::epilogue(c.d, tmp, c.bias, c.m, c.n, c.out_type == lt::kR32F, c.accumulate, stream);
  return e.empty() ? ffi::Error::Success() : internal("epilogue: " + e);
}

// One FP8 operand's scales for cuBLASLt: where they are (`src`: fp32, a scalar (kTensor), [rows, ceil(K/128)]
// (kVec128; `rows_inner`: [ceil(K/128), rows], as the quantize launch writes them) or [ceil(rows/128),
// ceil(K/128)] (kBlk128)), their mode and rows, and where the pointer and scale mode to pass go. `layout_rows`
// (> rows) pads the layout's rows (the retry with A's rows padded).
struct ScaleArg {
  const float* src = nullptr;  // null: no operand
  int32_t mode = kTensor;
  int64_t rows = 0, layout_rows = 0;
  const void** ptr = nullptr;
  int32_t* lt_mode = nullptr;
  bool rows_inner = false;
};

// Sets *arg.ptr and *arg.lt_mode and, where the scales must be re-laid-out first, the job that stages them
// (job->out stays null where cuBLASLt reads them as they are: 1x128 scales given rows-inner for rows a multiple
// of `pad`, the 128x128 weight scales when ceil(K/128) is a multiple of `pad`). `layout` picks the candidate
// layout (0: the one cuBLASLt documents; others exist for probing), `pad` the leading-dimension multiple.
ffi::Error scale_layout(cudaStream_t stream, Scratch& scratch, int64_t k, int32_t layout, int32_t pad,
                        const ScaleArg& arg, gemm::ScaleStage* job) {
  *job = gemm::ScaleStage{};
  const float* src = arg.src;
  if (arg.mode == kTensor) {
    if (reinterpret_cast<uintptr_t>(src) % 16) {  // e.g. one scalar of a stacked [G]: give cuBLASLt an aligned copy
      float* copy = static_cast<float*>(scratch.get(sizeof(float)));
      if (!copy) return out_of_scratch(scratch, "an aligned scale");
      if (cudaMemcpyAsync(copy, src, sizeof(float), cudaMemcpyDeviceToDevice, stream) != cudaSuccess)
        return internal("copying a scale failed");
      src = copy;
    }
    *arg.ptr = src;
    *arg.lt_mode = lt::kScaleScalar;
    return ffi::Error::Success();
  }
  const bool vec = arg.mode == kVec128;
  *arg.lt_mode = vec ? lt::kScaleVec128 : lt::kScaleBlk128;
  const int64_t kb = cdiv(k, 128);
  const int64_t sr = vec ? arg.rows : cdiv(arg.rows, 128);
  const int64_t lr = std::max(sr, vec ? arg.layout_rows : cdiv(arg.layout_rows, 128));  // rows of the layout
  if (pad < 1) pad = 1;
  const bool transpose = vec ? (layout == 0) : (layout != 0);
  // transposed: [kb, rup(lr)], rows contiguous; else [lr, rup(kb)], kb contiguous
  const int64_t out_rows = transpose ? kb : lr, ld = transpose ? rup(lr, pad) : rup(kb, pad);
  const bool inner = vec && arg.rows_inner;  // src is [kb, sr]: the transposed layout with ld = sr
  const bool as_is = inner ? (transpose && ld == sr) : (!transpose && out_rows == sr && ld == kb);
  if (as_is && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    *arg.ptr = src;
    return ffi::Error::Success();
  }
  float* out = static_cast<float*>(scratch.get(size_t(out_rows * ld) * sizeof(float)));
  if (!out) return out_of_scratch(scratch, "a scale re-layout");
  *job = inner ? gemm::ScaleStage{src, kb, sr, out, out_rows, ld, !transpose}
               : gemm::ScaleStage{src, sr, kb, out, out_rows, ld, transpose};
  *arg.ptr = out;
  return ffi::Error::Success();
}

// The scales of A and B (or A alone) in cuBLASLt's layouts, the re-layouts in one launch.
ffi::Error scale_ptrs(cudaStream_t stream, Scratch& scratch, int64_t k, int32_t layout, int32_t pad, const ScaleArg& a,
                      const ScaleArg& b = ScaleArg{}) {
  gemm::ScaleStage job[2];
  const ScaleArg* args[2] = {&a, &b};
  for (int i = 0; i < 2; ++i)
    if (args[i]->src)
      if (auto e = scale_layout(stream, scratch, k, layout, pad, *args[i], &job[i]); e.failure()) return e;
  std::string e = gemm::stage_scales(job[0], job[1], stream);
  return e.empty() ? ffi::Error::Success() : internal("scale re-layout: " + e);
}

// Runs `c`; when cuBLASLt refuses it (seen: block-scaled FP8 with M = 1 or 17 on cuBLASLt 13.1), runs it
// again with A's rows zero-padded to a multiple of 16 into scratch (A's 1x128 scales re-laid-out for the
// padded rows from `sa_src`), into a scratch temporary whose first M rows the epilogue kernel moves to the
// output with bias and accumulation.
struct ScaleSrc {
  const float* src = nullptr;
  int32_t mode = kTensor;
  int32_t layout = 0, pad = 4;
  bool rows_inner = false;  // ScaleArg::rows_inner
};

ffi::Error run_with_retry(cudaStream_t stream, Scratch& scratch, LtCall c, size_t a_row_bytes, ScaleSrc sa) {
  bool unsup = false;
  ffi::Error first = run_lt(stream, scratch, c, &unsup);
  if (!first.failure() || !unsup) return first;
  const int64_t mp = rup(std::max<int64_t>(c.m, 1), 16);
  const size_t out_bytes = c.out_type == lt::kR32F ? 4 : 2;
  void* ap = scratch.get(size_t(mp) * a_row_bytes);
  void* tmp = scratch.get(size_t(mp) * c.n * out_bytes);
  if (!ap || !tmp) return out_of_scratch(scratch, "the padded GEMM");
  if (cudaMemsetAsync(ap, 0, size_t(mp) * a_row_bytes, stream) != cudaSuccess ||
      cudaMemcpyAsync(ap, c.a, size_t(c.m) * a_row_bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess)
    return internal("padding A failed");
  LtCall p = c;
  p.a = ap, p.m = mp, p.d = tmp, p.bias = nullptr, p.accumulate = false;
  if (sa.src && sa.mode != kTensor)
    if (auto e = scale_ptrs(stream, scratch, c.k, sa.layout, sa.pad,
                            ScaleArg{sa.src, sa.mode, c.m, mp, &p.scale_a, &p.mode_a, sa.rows_inner});
        e.failure())
      return e;
  if (c.alpha_beta) {
    float* ab = static_cast<float*>(scratch.get(2 * sizeof(float)));
    if (!ab) return out_of_scratch(scratch, "alpha and beta");
    cudaMemcpyAsync(ab, c.alpha_beta, sizeof(float), cudaMemcpyDeviceToDevice, stream);
    cudaMemsetAsync(ab + 1, 0, sizeof(float), stream);
    p.alpha_beta = ab;
  }
  if (auto e = run_lt(stream, scratch, p); e.failure()) return e;
  std::string e = gemm::epilogue(c.d, tmp, c.bias, c.m, c.n, c.out_type == lt::kR32F, c.accumulate, stream);
  return e.empty() ? ffi::Error::Success() : internal("epilogue: " + e);
}

ffi::Error out_type_of(const ffi::AnyBuffer::Dimensions&, ffi::DataType t, int32_t* out) {
  if (t == ffi::DataType::F32) *out = lt::kR32F;
  else if (t == ffi::DataType::BF16) *out = lt::kR16BF;
  else return invalid("output must be float32 or bfloat16");
  return ffi::Error::Success();
}

// Shared checks of out / bias / c; fills the output side of `c`.
ffi::Error check_out(int64_t m, int64_t n, const ffi::AnyBuffer& bias, const ffi::AnyBuffer& cin,
                     ffi::Result<ffi::AnyBuffer>& out, int32_t accumulate, LtCall* c) {
  if (!is_2d(*out, m, n)) return invalid("output is " + dims(*out) + ", expected [" + std::to_string(m) + ", " + std::to_string(n) + "]");
  if (auto e = out_type_of(out->dimensions(), out->element_type(), &c->out_type); e.failure()) return e;
  c->d = out->untyped_data();
  c->bias = nullptr;
  if (bias.element_count() > 0) {
    if (int64_t(bias.element_count()) != n || bias.element_type() != out->element_type())
      return invalid("bias must have N = " + std::to_string(n) + " elements of the output dtype, got " + dims(bias));
    c->bias = bias.untyped_data();
  }
  c->accumulate = accumulate != 0;
  if (c->accumulate) {
    if (!is_2d(cin, m, n) || cin.element_type() != out->element_type())
      return invalid("accumulate needs c of the output's shape and dtype, got " + dims(cin));
    if (cin.untyped_data() != out->untyped_data())
      return invalid("accumulate needs c aliased to the output (input_output_aliases)");
  }
  return ffi::Error::Success();
}

int32_t fp8_type(ffi::DataType t) {
  if (t == ffi::DataType::F8E4M3FN) return lt::kR8F_E4M3;
  if (t == ffi::DataType::F8E5M2) return lt::kR8F_E5M2;
  return -1;
}


// Number of fp32 scales of one [rows, K] operand in `mode`.
int64_t scale_count(int32_t mode, int64_t rows, int64_t k) {
  if (mode == kTensor) return 1;
  return (mode == kVec128 ? rows : cdiv(rows, 128)) * cdiv(k, 128);
}

ffi::Error check_scale(const ffi::AnyBuffer& s, int32_t mode, int64_t rows, int64_t k, const char* which) {
  if (s.element_type() != ffi::DataType::F32) return invalid(std::string(which) + " scale_inv must be float32");
  if (int64_t(s.element_count()) != scale_count(mode, rows, k))
    return invalid(std::string(which) + " scale_inv is " + dims(s) + ", expected " + std::to_string(scale_count(mode, rows, k)) +
                   " float32 values (scale mode " + std::to_string(mode) + ")");
  return ffi::Error::Success();
}

ffi::Error gemm_fp8(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer sa, ffi::AnyBuffer b, ffi::AnyBuffer sb,
                    ffi::AnyBuffer bias, ffi::AnyBuffer cin, ffi::Result<ffi::AnyBuffer> out, int32_t mode_a,
                    int32_t mode_b, int32_t layout, int32_t pad, int32_t accumulate, int32_t fast_accum,
                    ffi::Result<ffi::AnyBuffer> workspace) {
  Scratch scratch{workspace};
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != 2 || db.size() != 2 || da[1] != db[1])
    return invalid("A and B must be [M, K] and [N, K], got " + dims(a) + " and " + dims(b));
  LtCall c{};
  c.m = da[0], c.n = db[0], c.k = da[1];
  c.type_a = fp8_type(a.element_type()), c.type_b = fp8_type(b.element_type());
  if (c.type_a < 0 || c.type_b < 0) return invalid("FP8 GEMM operands must be float8_e4m3fn or float8_e5m2");
  if (c.type_a == lt::kR8F_E5M2 && c.type_b == lt::kR8F_E5M2) return invalid("E5M2 x E5M2 is not supported by FP8 GEMMs");
  if (c.k % 16) return invalid("FP8 GEMM needs K % 16 == 0, got K = " + std::to_string(c.k));
  if (mode_a < 0 || mode_a > 2 || mode_b < 0 || mode_b > 2) return invalid("unknown scale mode");
  if ((mode_a == kTensor) != (mode_b == kTensor)) return invalid("per-tensor and block scales cannot be mixed");
  if (mode_a == kBlk128 && mode_b == kBlk128) return invalid("128x128 x 128x128 block scales are not supported");
  if (auto e = check_out(c.m, c.n, bias, cin, out, accumulate, &c); e.failure()) return e;
  if (c.m == 0 || c.n == 0) return ffi::Error::Success();
  c.a = a.untyped_data(), c.b = b.untyped_data();
  c.fast_accum = fast_accum != 0;
  if (auto e = check_scale(sa, mode_a, c.m, c.k, "A"); e.failure()) return e;
  if (auto e = check_scale(sb, mode_b, c.n, c.k, "B"); e.failure()) return e;
  const float* fa = static_cast<const float*>(sa.untyped_data());
  const float* fb = static_cast<const float*>(sb.untyped_data());
  // 1x128 scales come [ceil(K/128), rows], as the quantize launch writes them (ffi/gemm.py fp8_gemm)
  if (auto e = scale_ptrs(stream, scratch, c.k, layout, pad,
                          ScaleArg{fa, mode_a, c.m, 0, &c.scale_a, &c.mode_a, mode_a == kVec128},
                          ScaleArg{fb, mode_b, c.n, 0, &c.scale_b, &c.mode_b, mode_b == kVec128});
      e.failure())
    return e;
  return run_with_retry(stream, scratch, c, size_t(c.k), ScaleSrc{fa, mode_a, layout, pad, mode_a == kVec128});
}

// Dequantizes `rows` rows of an MXFP8/NVFP4 operand (data and scale bytes at the given pointers) to bf16;
// rows_inner: MXFP8 scales [ceil(k/32), rows / batch] for each of `batch` stacked operands (the quantize launch's
// layout).
ffi::Error dequant_ptr(cudaStream_t stream, Scratch& scratch, const uint8_t* x, const uint8_t* s, int64_t rows,
                       int32_t fmt, int64_t k, void** out, bool rows_inner = false, int64_t batch = 1) {
  void* buf = scratch.get(size_t(rows) * k * 2);
  if (!buf) return out_of_scratch(scratch, "a dequantized operand");
  std::string e;
  if (fmt == kNvfp4) e = gemm::dequant_nvfp4(x, s, rows, k, buf, stream);
  else e = gemm::dequant_mxfp8(x, s, rows, k, fmt == kMxE5M2, rows_inner, buf, stream, batch);
  if (!e.empty()) return internal("dequantize: " + e);
  *out = buf;
  return ffi::Error::Success();
}

// Checks the data/scale sizes of `groups` stacked [rows, K] operands of format `fmt`.
ffi::Error check_dq(const ffi::AnyBuffer& x, const ffi::AnyBuffer& s, int64_t groups, int64_t rows, int32_t fmt,
                    int64_t k, const char* which) {
  int64_t data_cols, scale_cols;
  if (fmt == kNvfp4) {
    if (k % 16) return invalid("NVFP4 GEMM needs K % 16 == 0, got " + std::to_string(k));
    data_cols = k / 2, scale_cols = k / 16;
  } else if (fmt == kMxE4M3 || fmt == kMxE5M2) {
    if (k % 8) return invalid("MXFP8 GEMM needs K % 8 == 0, got " + std::to_string(k));
    data_cols = k, scale_cols = cdiv(k, 32);
  } else {
    return invalid("unknown block-scaled format id " + std::to_string(fmt));
  }
  if (int64_t(x.size_bytes()) != groups * rows * data_cols || int64_t(s.size_bytes()) != groups * rows * scale_cols)
    return invalid(std::string(which) + " data/scales are " + dims(x) + "/" + dims(s) + " for " + std::to_string(groups) +
                   " x [" + std::to_string(rows) + ", K = " + std::to_string(k) + "] (format " + std::to_string(fmt) + ")");
  return ffi::Error::Success();
}

// A decoded operand (the quantize kernels' kDecoded copies: bfloat16 [rows, K], the values the dequantize pass
// would write) is used where it lies.
bool decoded(const ffi::AnyBuffer& x) { return x.element_type() == ffi::DataType::BF16; }

// `groups` stacked operands [rows, K] of the grouped dequantize path as bf16: a decoded copy where it lies, codes
// dequantized into scratch.
ffi::Error dequant_stacked(cudaStream_t stream, Scratch& scratch, const ffi::AnyBuffer& x, const ffi::AnyBuffer& s,
                           int64_t groups, int64_t rows, int32_t fmt, int64_t k, bool rows_inner, const char* which,
                           void** out) {
  if (decoded(x)) {
    if (int64_t(x.element_count()) != groups * rows * k)
      return invalid(std::string(which) + " is decoded " + dims(x) + ", expected " + std::to_string(groups) + " x [" +
                     std::to_string(rows) + ", " + std::to_string(k) + "]");
    *out = const_cast<void*>(x.untyped_data());
    return ffi::Error::Success();
  }
  if (auto e = check_dq(x, s, groups, rows, fmt, k, which); e.failure()) return e;
  return dequant_ptr(stream, scratch, static_cast<const uint8_t*>(x.untyped_data()),
                     static_cast<const uint8_t*>(s.untyped_data()), groups * rows, fmt, k, out, rows_inner, groups);
}

// One operand [rows, K] as bf16 (dequant_stacked's one group), or a decoded copy stored [K, rows] (kn: read
// transposed, where it lies); rows_inner: dequant_ptr's.
ffi::Error dequant(cudaStream_t stream, Scratch& scratch, const ffi::AnyBuffer& x, const ffi::AnyBuffer& s,
                   int32_t fmt, int64_t k, const char* which, void** out, int64_t* rows, bool kn, bool rows_inner) {
  auto d = x.dimensions();
  if (d.size() != 2) return invalid(std::string(which) + " data must be 2D, got " + dims(x));
  *rows = d[kn ? 1 : 0];
  if (!kn) return dequant_stacked(stream, scratch, x, s, 1, d[0], fmt, k, rows_inner, which, out);
  if (!decoded(x)) return invalid(std::string(which) + " is read transposed, which needs a decoded (bf16) copy");
  if (d[0] != k) return invalid(std::string(which) + " is decoded " + dims(x) + " ([K, N]), K = " + std::to_string(k));
  *out = const_cast<void*>(x.untyped_data());
  return ffi::Error::Success();
}

int compute_major() {  // of the current device (0 when it cannot be read)
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
    return 0;
  return major;
}

bool native_block_scaling() { return compute_major() >= 10; }  // Blackwell (sm_100+): block scaling in cuBLASLt

int32_t dq_lt_type(int32_t fmt) { return fmt == kNvfp4 ? lt::kR4F_E2M1 : fmt == kMxE5M2 ? lt::kR8F_E5M2 : lt::kR8F_E4M3; }

// UNTESTED (no Blackwell GPU here): MXFP8 / NVFP4 straight into cuBLASLt's block-scaled matmul, the block
// scales swizzled into its 128x4 tiles, the NVFP4 global scales as device alpha.
ffi::Error gemm_native(cudaStream_t stream, Scratch& scratch, const ffi::AnyBuffer& a, const ffi::AnyBuffer& sa,
                       const ffi::AnyBuffer& amax_a, const ffi::AnyBuffer& b, const ffi::AnyBuffer& sb,
                       const ffi::AnyBuffer& amax_b, LtCall c, int32_t fmt_a, int32_t fmt_b, bool rows_inner) {
  const int64_t block = fmt_a == kNvfp4 ? 16 : 32;
  const int64_t cols = cdiv(c.k, block);
  if (c.k % (fmt_a == kNvfp4 ? 32 : 16)) return invalid("native block-scaled GEMM needs K % 32 (NVFP4) / 16 (MXFP8)");
  uint8_t* ssa = static_cast<uint8_t*>(scratch.get(gemm::swizzled_bytes(c.m, cols)));
  uint8_t* ssb = static_cast<uint8_t*>(scratch.get(gemm::swizzled_bytes(c.n, cols)));
  if (!ssa || !ssb) return out_of_scratch(scratch, "swizzled scales");
  const bool inner = rows_inner && fmt_a != kNvfp4;  // MXFP8 scales as the quantize launch writes them
  std::string e =
      gemm::swizzle_block_scales(static_cast<const uint8_t*>(sa.untyped_data()), c.m, cols, inner, ssa, stream);
  if (e.empty())
    e = gemm::swizzle_block_scales(static_cast<const uint8_t*>(sb.untyped_data()), c.n, cols, inner, ssb, stream);
  if (!e.empty()) return internal("swizzle: " + e);
  c.type_a = dq_lt_type(fmt_a), c.type_b = dq_lt_type(fmt_b);
  c.a = a.untyped_data(), c.b = b.untyped_data();
  c.scale_a = ssa, c.scale_b = ssb;
  c.mode_a = c.mode_b = fmt_a == kNvfp4 ? lt::kScaleVec16UE4M3 : lt::kScaleVec32UE8M0;
  if (fmt_a == kNvfp4) {
    float* ab = static_cast<float*>(scratch.get(2 * sizeof(float)));
    if (!ab) return out_of_scratch(scratch, "alpha and beta");
    e = gemm::nvfp4_alpha(static_cast<const float*>(amax_a.untyped_data()), static_cast<const float*>(amax_b.untyped_data()),
                          c.accumulate ? 1.f : 0.f, ab, stream);
    if (!e.empty()) return internal("alpha: " + e);
    c.alpha_beta = ab;
  }
  return run_with_retry(stream, scratch, c, size_t(fmt_a == kNvfp4 ? c.k / 2 : c.k), ScaleSrc{});
}

ffi::Error gemm_dq(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer sa, ffi::AnyBuffer amax_a, ffi::AnyBuffer b,
                   ffi::AnyBuffer sb, ffi::AnyBuffer amax_b, ffi::AnyBuffer bias, ffi::AnyBuffer cin,
                   ffi::Result<ffi::AnyBuffer> out, int32_t fmt_a, int32_t fmt_b, int64_t k, int32_t accumulate,
                   int32_t b_kn, int32_t rows_inner, ffi::Result<ffi::AnyBuffer> workspace) {
  Scratch scratch{workspace};
  if (native_block_scaling() && k % 32 == 0 && !(fmt_a == kMxE5M2 && fmt_b == kMxE5M2) && !decoded(a) && !decoded(b)) {
    auto da = a.dimensions(), db = b.dimensions();
    if (da.size() != 2 || db.size() != 2) return invalid("A and B data must be 2D");
    LtCall c{};
    c.m = da[0], c.n = db[0], c.k = k;
    if (auto e = check_dq(a, sa, 1, c.m, fmt_a, k, "A"); e.failure()) return e;
    if (auto e = check_dq(b, sb, 1, c.n, fmt_b, k, "B"); e.failure()) return e;
    if (auto e = check_out(c.m, c.n, bias, cin, out, accumulate, &c); e.failure()) return e;
    if (c.m == 0 || c.n == 0) return ffi::Error::Success();
    return gemm_native(stream, scratch, a, sa, amax_a, b, sb, amax_b, c, fmt_a, fmt_b, rows_inner != 0);
  }
  LtCall c{};
  void *da = nullptr, *db = nullptr;
  if ((fmt_a == kNvfp4) != (fmt_b == kNvfp4)) return invalid("NVFP4 pairs only with NVFP4");
  if (auto e = dequant(stream, scratch, a, sa, fmt_a, k, "A", &da, &c.m, false, rows_inner && fmt_a != kNvfp4);
      e.failure())
    return e;
  if (auto e = dequant(stream, scratch, b, sb, fmt_b, k, "B", &db, &c.n, b_kn != 0, rows_inner && fmt_b != kNvfp4);
      e.failure())
    return e;
  c.k = k;
  c.b_kn = b_kn != 0;
  if (auto e = check_out(c.m, c.n, bias, cin, out, accumulate, &c); e.failure()) return e;
  if (c.m == 0 || c.n == 0) return ffi::Error::Success();
  c.type_a = c.type_b = lt::kR16BF;
  c.a = da, c.b = db;
  if (fmt_a == kNvfp4) {
    for (const ffi::AnyBuffer* am : {&amax_a, &amax_b})
      if (am->element_type() != ffi::DataType::F32 || am->element_count() != 1)
        return invalid("NVFP4 amax must be a float32 scalar");
    float* ab = static_cast<float*>(scratch.get(2 * sizeof(float)));
    if (!ab) return out_of_scratch(scratch, "alpha and beta");
    std::string e = gemm::nvfp4_alpha(static_cast<const float*>(amax_a.untyped_data()),
                                      static_cast<const float*>(amax_b.untyped_data()), c.accumulate ? 1.f : 0.f, ab, stream);
    if (!e.empty()) return internal("alpha: " + e);
    c.alpha_beta = ab;
  }
  return run_with_retry(stream, scratch, c, size_t(c.k) * 2, ScaleSrc{});
}


// ---- Grouped (MoE): A [T, K] sorted by group, B stacked [G, N, K], group_sizes [G] (int32, on the device).
// One FFI call: the sizes are copied to the host (one stream synchronisation), then one GEMM per non-empty
// group on row range [start, start + size); rows past the sum are zero (unless accumulating).

ffi::Error check_sizes(const ffi::AnyBuffer& gs, int64_t groups) {
  if (gs.element_type() != ffi::DataType::S32 || int64_t(gs.element_count()) != groups)
    return invalid("group_sizes must be int32 [" + std::to_string(groups) + "], got " + dims(gs));
  return ffi::Error::Success();
}

ffi::Error host_sizes(cudaStream_t stream, const ffi::AnyBuffer& gs, int64_t groups, int64_t t,
                      std::vector<int64_t>* starts, std::vector<int64_t>* sizes) {
  if (auto e = check_sizes(gs, groups); e.failure()) return e;
  std::vector<int32_t> h(groups);
  if (groups > 0) {
    if (cudaMemcpyAsync(h.data(), gs.untyped_data(), groups * sizeof(int32_t), cudaMemcpyDeviceToHost, stream) !=
            cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess)
      return internal(std::string("reading group_sizes: ") + cudaGetErrorString(cudaGetLastError()));
  }
  int64_t at = 0;
  for (int64_t g = 0; g < groups; ++g) {
    int64_t n = h[g] < 0 ? 0 : std::min<int64_t>(h[g], t - at);  // clamp to the rows there are
    starts->push_back(at);
    sizes->push_back(n);
    at += n;
  }
  return ffi::Error::Success();
}

// The groups' GEMMs once the operands are set up: `base` holds the shared fields; per_group fills the rest.
template <typename F>
ffi::Error run_groups(cudaStream_t stream, Scratch& scratch, LtCall base, const std::vector<int64_t>& starts,
                      const std::vector<int64_t>& sizes, int64_t t, void* out, const void* bias, size_t out_bytes,
                      size_t a_row_bytes, F per_group) {
  int64_t used = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    if (sizes[g] == 0) continue;
    LtCall c = base;
    c.m = sizes[g];
    c.d = static_cast<char*>(out) + size_t(starts[g]) * base.n * out_bytes;
    c.bias = bias ? static_cast<const char*>(bias) + g * base.n * out_bytes : nullptr;
    ScaleSrc sa;
    if (auto e = per_group(g, starts[g], &c, &sa); e.failure()) return e;
    if (auto e = run_with_retry(stream, scratch, c, a_row_bytes, sa); e.failure()) return e;
    used = starts[g] + sizes[g];
  }
  if (!base.accumulate && used < t)
    if (cudaMemsetAsync(static_cast<char*>(out) + size_t(used) * base.n * out_bytes, 0,
                        size_t(t - used) * base.n * out_bytes, stream) != cudaSuccess)
      return internal("zeroing rows past the groups failed");
  return ffi::Error::Success();
}

ffi::Error check_grouped_out(int64_t t, int64_t g, int64_t n, const ffi::AnyBuffer* bias, const ffi::AnyBuffer& cin,
                             ffi::Result<ffi::AnyBuffer>& out, int32_t accumulate, LtCall* c) {
  if (!is_2d(*out, t, n)) return invalid("output is " + dims(*out) + ", expected [" + std::to_string(t) + ", " + std::to_string(n) + "]");
  if (auto e = out_type_of(out->dimensions(), out->element_type(), &c->out_type); e.failure()) return e;
  c->d = out->untyped_data();
  c->accumulate = accumulate != 0;
  if (c->accumulate && (!is_2d(cin, t, n) || cin.element_type() != out->element_type() ||
                        cin.untyped_data() != out->untyped_data()))
    return invalid("accumulate needs c [T, N] of the output dtype, aliased to the output; got " + dims(cin));
  c->bias = nullptr;
  if (bias && bias->element_count() > 0) {
    if (int64_t(bias->element_count()) != g * n || bias->element_type() != out->element_type())
      return invalid("grouped bias must be [G, N] = [" + std::to_string(g) + ", " + std::to_string(n) + "] of the output dtype, got " + dims(*bias));
    c->bias = bias->untyped_data();
  }
  return ffi::Error::Success();
}

// The operands of a grouped per-tensor / blockwise FP8 call: A [T, K], B [G, N, K], their fp32 scales.
ffi::Error check_fp8_grouped(const ffi::AnyBuffer& a, const ffi::AnyBuffer& sa, const ffi::AnyBuffer& b,
                             const ffi::AnyBuffer& sb, int32_t mode_a, int32_t mode_b, LtCall* c, int64_t* t,
                             int64_t* groups) {
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != 2 || db.size() != 3 || da[1] != db[2])
    return invalid("grouped FP8: A must be [T, K] and B [G, N, K], got " + dims(a) + " and " + dims(b));
  const int64_t k = da[1], n = db[1];
  *t = da[0], *groups = db[0];
  c->n = n, c->k = k;
  c->type_a = fp8_type(a.element_type()), c->type_b = fp8_type(b.element_type());
  if (c->type_a < 0 || c->type_b < 0) return invalid("FP8 GEMM operands must be float8_e4m3fn or float8_e5m2");
  if (c->type_a == lt::kR8F_E5M2 && c->type_b == lt::kR8F_E5M2) return invalid("E5M2 x E5M2 is not supported");
  if (k % 16) return invalid("FP8 GEMM needs K % 16 == 0, got K = " + std::to_string(k));
  if (mode_a == kBlk128) return invalid("grouped FP8: A (ragged rows) cannot have 128x128 scales");
  if (mode_a < 0 || mode_b < 0 || mode_b > 2 || (mode_a == kTensor) != (mode_b == kTensor))
    return invalid("grouped FP8: bad scale modes");
  if (sa.element_type() != ffi::DataType::F32 || sb.element_type() != ffi::DataType::F32) return invalid("scale_inv must be float32");
  if (int64_t(sa.element_count()) != scale_count(mode_a, *t, k) ||
      int64_t(sb.element_count()) != *groups * scale_count(mode_b, n, k))
    return invalid("grouped FP8: scale_inv sizes " + dims(sa) + " / " + dims(sb) + " do not match the operands");
  return ffi::Error::Success();
}

ffi::Error gemm_fp8_grouped(cudaStream_t stream, ffi::ScratchAllocator alloc, ffi::AnyBuffer a, ffi::AnyBuffer sa,
                            ffi::AnyBuffer b, ffi::AnyBuffer sb, ffi::AnyBuffer gs, ffi::AnyBuffer bias,
                            ffi::AnyBuffer cin, ffi::Result<ffi::AnyBuffer> out, int32_t mode_a, int32_t mode_b,
                            int32_t layout, int32_t pad, int32_t accumulate, int32_t fast_accum) {
  Scratch scratch{alloc};
  LtCall c{};
  int64_t t, groups;
  if (auto e = check_fp8_grouped(a, sa, b, sb, mode_a, mode_b, &c, &t, &groups); e.failure()) return e;
  const int64_t k = c.k, n = c.n;
  if (auto e = check_grouped_out(t, groups, n, &bias, cin, out, accumulate, &c); e.failure()) return e;
  std::vector<int64_t> starts, sizes;
  if (auto e = host_sizes(stream, gs, groups, t, &starts, &sizes); e.failure()) return e;
  c.fast_accum = fast_accum != 0;
  const size_t out_bytes = c.out_type == lt::kR32F ? 4 : 2;
  const float* fa = static_cast<const float*>(sa.untyped_data());
  const float* fb = static_cast<const float*>(sb.untyped_data());
  const int64_t kb = cdiv(k, 128);
  auto per_group = [&](size_t g, int64_t start, LtCall* cg, ScaleSrc* src) -> ffi::Error {
    cg->a = static_cast<const uint8_t*>(a.untyped_data()) + size_t(start) * k;
    cg->b = static_cast<const uint8_t*>(b.untyped_data()) + g * size_t(n) * k;
    const float* sa_g = mode_a == kTensor ? fa : fa + start * kb;
    *src = ScaleSrc{sa_g, mode_a, layout, pad};
    return scale_ptrs(stream, scratch, k, layout, pad, ScaleArg{sa_g, mode_a, cg->m, 0, &cg->scale_a, &cg->mode_a},
                      ScaleArg{fb + g * scale_count(mode_b, n, k), mode_b, n, 0, &cg->scale_b, &cg->mode_b});
  };
  return run_groups(stream, scratch, c, starts, sizes, t, c.d, c.bias, out_bytes, size_t(k), per_group);
}

#ifdef JAXHQ_WITH_CUTLASS
// The dequantize path of grouped MXFP8 / NVFP4 with the group sizes read on the device: CUTLASS's bf16 grouped
// kernel (fp8_cutlass_grouped.h) on the dequantized operands (NVFP4's global scales as per-group alphas), so the
// call does not synchronise the stream. Taken on a Hopper for bf16 output without bias; JAXHQ_DQ_GROUPED=host
// keeps the cuBLASLt loop over host-read sizes (A/B).
bool dq_grouped_on_device(const LtCall& c, const gemm::CutlassGrouped& p) {
  const char* env = std::getenv("JAXHQ_DQ_GROUPED");
  return !(env && std::string(env) == "host") && c.out_type == lt::kR16BF && !c.bias && compute_major() == 9 &&
         gemm::cutlass_grouped_unsupported(p).empty();
}
#endif

ffi::Error gemm_dq_grouped(cudaStream_t stream, ffi::ScratchAllocator alloc, ffi::AnyBuffer a, ffi::AnyBuffer sa,
                           ffi::AnyBuffer amax_a, ffi::AnyBuffer b, ffi::AnyBuffer sb, ffi::AnyBuffer amax_b,
                           ffi::AnyBuffer gs, ffi::AnyBuffer bias, ffi::AnyBuffer cin, ffi::Result<ffi::AnyBuffer> out,
                           int32_t fmt_a, int32_t fmt_b, int64_t k, int32_t accumulate, int32_t rows_inner) {
  Scratch scratch{alloc};
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != 2 || db.size() != 3) return invalid("grouped: A must be 2D and B 3D, got " + dims(a) + " and " + dims(b));
  if ((fmt_a == kNvfp4) != (fmt_b == kNvfp4)) return invalid("NVFP4 pairs only with NVFP4");
  const int64_t t = da[0], groups = db[0], n = db[1];
  if (auto e = check_sizes(gs, groups); e.failure()) return e;
  if (fmt_a == kNvfp4 && (amax_a.element_type() != ffi::DataType::F32 || amax_a.element_count() != 1 ||
                          amax_b.element_type() != ffi::DataType::F32 || int64_t(amax_b.element_count()) != groups))
    return invalid("grouped NVFP4: amax must be float32, a scalar for A and [G] for B, got " + dims(amax_a) +
                   " and " + dims(amax_b));
  const float* nv_amax_a = fmt_a == kNvfp4 ? static_cast<const float*>(amax_a.untyped_data()) : nullptr;
  const float* nv_amax_b = fmt_a == kNvfp4 ? static_cast<const float*>(amax_b.untyped_data()) : nullptr;
  LtCall c{};
  c.n = n, c.k = k;
  if (auto e = check_grouped_out(t, groups, n, &bias, cin, out, accumulate, &c); e.failure()) return e;
  void *dqa = nullptr, *dqb = nullptr;
  const bool inner = rows_inner && fmt_a != kNvfp4;  // MXFP8 scales as the quantize launch writes them
  if (auto e = dequant_stacked(stream, scratch, a, sa, 1, t, fmt_a, k, inner, "A", &dqa); e.failure()) return e;
  if (auto e = dequant_stacked(stream, scratch, b, sb, groups, n, fmt_b, k, inner, "B", &dqb); e.failure()) return e;
#ifdef JAXHQ_WITH_CUTLASS
  gemm::CutlassGrouped p{};
  p.a = dqa, p.b = dqb, p.group_sizes = static_cast<const int32_t*>(gs.untyped_data()), p.out = c.d;
  p.t = t, p.n = n, p.k = k, p.groups = groups, p.accumulate = c.accumulate, p.bf16 = true;
  p.nvfp4_amax_a = nv_amax_a, p.nvfp4_amax_b = nv_amax_b;
  if (dq_grouped_on_device(c, p)) {
    p.workspace_bytes = gemm::cutlass_grouped_workspace_bytes(p);
    p.workspace = scratch.get(size_t(p.workspace_bytes));
    if (!p.workspace) return out_of_scratch(scratch, "the grouped kernel's tables");
    if (std::string e = gemm::cutlass_grouped_gemm(p, stream); !e.empty())
      return invalid(std::string(fmt_a == kNvfp4 ? "grouped NVFP4" : "grouped MXFP8") + " (dequantized, CUTLASS), A " +
                     dims(a) + ": " + e);
    return ffi::Error::Success();
  }
#endif
  std::vector<int64_t> starts, sizes;
  if (auto e = host_sizes(stream, gs, groups, t, &starts, &sizes); e.failure()) return e;
  c.type_a = c.type_b = lt::kR16BF;
  float* ab = nullptr;
  if (fmt_a == kNvfp4) {
    ab = static_cast<float*>(scratch.get(2 * sizeof(float) * std::max<int64_t>(groups, 1)));
    if (!ab) return out_of_scratch(scratch, "alpha and beta");
    for (int64_t g = 0; g < groups; ++g) {
      std::string e = gemm::nvfp4_alpha(nv_amax_a, nv_amax_b + g, accumulate ? 1.f : 0.f, ab + 2 * g, stream);
      if (!e.empty()) return internal("alpha: " + e);
    }
  }
  const size_t out_bytes = c.out_type == lt::kR32F ? 4 : 2;
  auto per_group = [&](size_t g, int64_t start, LtCall* cg, ScaleSrc*) -> ffi::Error {
    cg->a = static_cast<const char*>(dqa) + size_t(start) * k * 2;
    cg->b = static_cast<const char*>(dqb) + g * size_t(n) * k * 2;
    cg->alpha_beta = ab ? ab + 2 * g : nullptr;
    return ffi::Error::Success();
  };
  return run_groups(stream, scratch, c, starts, sizes, t, c.d, c.bias, out_bytes, size_t(k) * 2, per_group);
}
// ---- MXFP8 on FP8 wgmma (Hopper). Dense: A [M, K], B [N, K]; grouped: A [T, K], B [G, N, K], group_sizes [G]
// read by the kernel on the device, so the call never synchronises the stream.
ffi::Error mx_operand(const ffi::AnyBuffer& x, const ffi::AnyBuffer& s, int64_t groups, int64_t rows, int32_t fmt,
                      int64_t k, const char* which, gemm::WgmmaOperand* op) {
  if (fmt != kMxE4M3 && fmt != kMxE5M2)
    return invalid(std::string(which) + ": the MXFP8 kernel takes E4M3/E5M2 MXFP8 only (format id " + std::to_string(fmt) + ")");
  if (auto e = check_dq(x, s, groups, rows, fmt, k, which); e.failure()) return e;
  *op = gemm::WgmmaOperand{static_cast<const uint8_t*>(x.untyped_data()), static_cast<const uint8_t*>(s.untyped_data()),
                           groups * rows, fmt == kMxE5M2};
  return ffi::Error::Success();
}

ffi::Error run_wgmma(cudaStream_t stream, Scratch& scratch, int scaling, const gemm::WgmmaOperand& a,
                     const gemm::WgmmaOperand& b, int64_t n, int64_t k, const int32_t* gs, int64_t groups,
                     const LtCall& c) {
  void *sa = nullptr, *sb = nullptr;
  if (scaling != gemm::kScaleTensor) {
    sa = scratch.get(gemm::wgmma_scale_bytes(scaling, a.rows, k));
    sb = scratch.get(gemm::wgmma_scale_bytes(scaling, b.rows, k));
    if (!sa || !sb) return out_of_scratch(scratch, "the wgmma kernel's scales");
  }
  std::string e = gemm::wgmma_gemm(scaling, a, b, n, k, gs, groups, c.d, c.out_type == lt::kR32F, c.bias,
                                   c.accumulate, sa, sb, stream);
  return e.empty() ? ffi::Error::Success() : invalid("FP8 wgmma GEMM: " + e);
}

// A grouped call on the wgmma kernel once its operands are checked: the sizes and the output checked, then the
// kernel, which reads the sizes on the device (no groups: every row is past them, zero unless accumulating).
ffi::Error run_wgmma_grouped(cudaStream_t stream, Scratch& scratch, int scaling, const gemm::WgmmaOperand& a,
                             const gemm::WgmmaOperand& b, int64_t t, int64_t n, int64_t k, const ffi::AnyBuffer& gs,
                             int64_t groups, const ffi::AnyBuffer& bias, const ffi::AnyBuffer& cin,
                             ffi::Result<ffi::AnyBuffer>& out, int32_t accumulate) {
  if (auto e = check_sizes(gs, groups); e.failure()) return e;
  LtCall c{};
  if (auto e = check_grouped_out(t, groups, n, &bias, cin, out, accumulate, &c); e.failure()) return e;
  if (groups > 0)
    return run_wgmma(stream, scratch, scaling, a, b, n, k, static_cast<const int32_t*>(gs.untyped_data()), groups, c);
  if (!c.accumulate && t * n > 0 &&
      cudaMemsetAsync(c.d, 0, size_t(t * n) * (c.out_type == lt::kR32F ? 4 : 2), stream) != cudaSuccess)
    return internal("zeroing the output failed");
  return ffi::Error::Success();
}

ffi::Error gemm_mxfp8(cudaStream_t stream, ffi::ScratchAllocator alloc, ffi::AnyBuffer a, ffi::AnyBuffer sa,
                      ffi::AnyBuffer b, ffi::AnyBuffer sb, ffi::AnyBuffer bias, ffi::AnyBuffer cin,
                      ffi::Result<ffi::AnyBuffer> out, int32_t fmt_a, int32_t fmt_b, int64_t k, int32_t accumulate) {
  Scratch scratch{alloc};
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != 2 || db.size() != 2) return invalid("MXFP8: A and B data must be 2D, got " + dims(a) + " and " + dims(b));
  gemm::WgmmaOperand oa, ob;
  if (auto e = mx_operand(a, sa, 1, da[0], fmt_a, k, "A", &oa); e.failure()) return e;
  if (auto e = mx_operand(b, sb, 1, db[0], fmt_b, k, "B", &ob); e.failure()) return e;
  LtCall c{};
  if (auto e = check_out(da[0], db[0], bias, cin, out, accumulate, &c); e.failure()) return e;
  return run_wgmma(stream, scratch, gemm::kScaleMx, oa, ob, db[0], k, nullptr, 0, c);
}

ffi::Error gemm_mxfp8_grouped(cudaStream_t stream, ffi::ScratchAllocator alloc, ffi::AnyBuffer a, ffi::AnyBuffer sa,
                              ffi::AnyBuffer b, ffi::AnyBuffer sb, ffi::AnyBuffer gs, ffi::AnyBuffer bias,
                              ffi::AnyBuffer cin, ffi::Result<ffi::AnyBuffer> out, int32_t fmt_a, int32_t fmt_b,
                              int64_t k, int32_t accumulate) {
  Scratch scratch{alloc};
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != 2 || db.size() != 3)
    return invalid("grouped MXFP8: A must be [T, K] and B [G, N, K] data, got " + dims(a) + " and " + dims(b));
  const int64_t t = da[0], groups = db[0], n = db[1];
  gemm::WgmmaOperand oa, ob;
  if (auto e = mx_operand(a, sa, 1, t, fmt_a, k, "A", &oa); e.failure()) return e;
  if (auto e = mx_operand(b, sb, groups, n, fmt_b, k, "B", &ob); e.failure()) return e;
  return run_wgmma_grouped(stream, scratch, gemm::kScaleMx, oa, ob, t, n, k, gs, groups, bias, cin, out, accumulate);
}

// ---- NVFP4 decoded on chip (Hopper): A [M, K], B [N, K] codes and E4M3 scales, each operand's amax for its
// global decode.
ffi::Error gemm_nvfp4(cudaStream_t stream, ffi::ScratchAllocator alloc, ffi::AnyBuffer a, ffi::AnyBuffer sa,
                      ffi::AnyBuffer amax_a, ffi::AnyBuffer b, ffi::AnyBuffer sb, ffi::AnyBuffer amax_b,
                      ffi::AnyBuffer bias, ffi::AnyBuffer cin, ffi::Result<ffi::AnyBuffer> out, int64_t k,
                      int32_t accumulate) {
  Scratch scratch{alloc};
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != 2 || db.size() != 2) return invalid("NVFP4: A and B data must be 2D, got " + dims(a) + " and " + dims(b));
  if (auto e = check_dq(a, sa, 1, da[0], kNvfp4, k, "A"); e.failure()) return e;
  if (auto e = check_dq(b, sb, 1, db[0], kNvfp4, k, "B"); e.failure()) return e;
  if (amax_a.element_count() != 1 || amax_b.element_count() != 1 || amax_a.element_type() != ffi::DataType::F32 ||
      amax_b.element_type() != ffi::DataType::F32)
    return invalid("NVFP4: each operand needs one float32 amax, got " + dims(amax_a) + " and " + dims(amax_b));
  LtCall c{};
  if (auto e = check_out(da[0], db[0], bias, cin, out, accumulate, &c); e.failure()) return e;
  auto* ab = static_cast<float*>(scratch.get(2 * sizeof(float)));
  void* sa_tmp = scratch.get(gemm::nvfp4_wgmma_scale_bytes(da[0], k));
  void* sb_tmp = scratch.get(gemm::nvfp4_wgmma_scale_bytes(db[0], k));
  if (!ab || !sa_tmp || !sb_tmp) return out_of_scratch(scratch, "the NVFP4 wgmma kernel's scales");
  if (std::string e = gemm::nvfp4_alpha(static_cast<const float*>(amax_a.untyped_data()),
                                        static_cast<const float*>(amax_b.untyped_data()), 0.f, ab, stream);
      !e.empty())
    return internal("alpha: " + e);
  const gemm::WgmmaOperand oa{static_cast<const uint8_t*>(a.untyped_data()), sa.untyped_data(), da[0], false};
  const gemm::WgmmaOperand ob{static_cast<const uint8_t*>(b.untyped_data()), sb.untyped_data(), db[0], false};
  std::string e = gemm::nvfp4_wgmma_gemm(oa, ob, db[0], k, ab, c.d, c.out_type == lt::kR32F, c.bias, c.accumulate,
                                         sa_tmp, sb_tmp, stream);
  return e.empty() ? ffi::Error::Success() : invalid("NVFP4 wgmma GEMM: " + e);
}

// ---- Per-tensor and blockwise FP8 on the same wgmma kernel, grouped: the group sizes read on the device.
ffi::Error gemm_fp8_wgmma_grouped(cudaStream_t stream, ffi::ScratchAllocator alloc, ffi::AnyBuffer a,
                                  ffi::AnyBuffer sa, ffi::AnyBuffer b, ffi::AnyBuffer sb, ffi::AnyBuffer gs,
                                  ffi::AnyBuffer bias, ffi::AnyBuffer cin, ffi::Result<ffi::AnyBuffer> out,
                                  int32_t mode_a, int32_t mode_b, int32_t accumulate) {
  Scratch scratch{alloc};
  LtCall c{};
  int64_t t, groups;
  if (auto e = check_fp8_grouped(a, sa, b, sb, mode_a, mode_b, &c, &t, &groups); e.failure()) return e;
  const gemm::WgmmaOperand oa{static_cast<const uint8_t*>(a.untyped_data()), sa.untyped_data(), t,
                              c.type_a == lt::kR8F_E5M2};
  const gemm::WgmmaOperand ob{static_cast<const uint8_t*>(b.untyped_data()), sb.untyped_data(), groups * c.n,
                              c.type_b == lt::kR8F_E5M2, mode_b == kBlk128};
  return run_wgmma_grouped(stream, scratch, mode_a == kTensor ? gemm::kScaleTensor : gemm::kScaleBlock, oa, ob, t,
                           c.n, c.k, gs, groups, bias, cin, out, accumulate);
}
#ifdef JAXHQ_WITH_CUTLASS
// ---- Per-tensor / blockwise (1x128 x 128x128) FP8 grouped on CUTLASS (fp8_cutlass_grouped.cu): the group sizes
// read on the device, the per-group tables and CUTLASS's own workspace in the workspace result (graphable).
ffi::Error gemm_fp8_cutlass_grouped(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer sa, ffi::AnyBuffer b,
                                    ffi::AnyBuffer sb, ffi::AnyBuffer gs, ffi::AnyBuffer cin,
                                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                                    int32_t mode_a, int32_t mode_b, int32_t accumulate, int32_t fast_accum) {
  LtCall c{};
  int64_t t, groups;
  if (!(mode_a == kTensor && mode_b == kTensor) && !(mode_a == kVec128 && mode_b == kBlk128))
    return invalid("grouped FP8 (CUTLASS): per-tensor scales, or 1x128 A and 128x128 B scales");
  if (auto e = check_fp8_grouped(a, sa, b, sb, mode_a, mode_b, &c, &t, &groups); e.failure()) return e;
  if (auto e = check_sizes(gs, groups); e.failure()) return e;
  if (auto e = check_grouped_out(t, groups, c.n, nullptr, cin, out, accumulate, &c); e.failure()) return e;
  gemm::CutlassGrouped p{a.untyped_data(), b.untyped_data(), static_cast<const float*>(sa.untyped_data()),
                         static_cast<const float*>(sb.untyped_data()), static_cast<const int32_t*>(gs.untyped_data()),
                         c.d, t, c.n, c.k, groups, c.type_a == lt::kR8F_E5M2, c.type_b == lt::kR8F_E5M2,
                         c.out_type == lt::kR32F, c.accumulate, fast_accum != 0, mode_a == kVec128, false,
                         workspace->untyped_data(), int64_t(workspace->size_bytes())};
  if (std::string e = gemm::cutlass_grouped_gemm(p, stream); !e.empty())
    return invalid("grouped FP8 (CUTLASS), A " + dims(a) + " x B " + dims(b) + ": " + e);
  return ffi::Error::Success();
}

// ---- bf16 grouped on CUTLASS (the MoE layer of the bf16 recipe): out[t] = A[t] @ B[g]^T, the group sizes read on
// the device.
ffi::Error gemm_bf16_cutlass_grouped(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer gs,
                                     ffi::AnyBuffer cin, ffi::Result<ffi::AnyBuffer> out,
                                     ffi::Result<ffi::AnyBuffer> workspace, int32_t accumulate) {
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != 2 || db.size() != 3 || da[1] != db[2] || a.element_type() != ffi::DataType::BF16 ||
      b.element_type() != ffi::DataType::BF16)
    return invalid("grouped bf16 (CUTLASS): A must be bfloat16 [T, K] and B [G, N, K], got " + dims(a) + " and " +
                   dims(b));
  const int64_t t = da[0], groups = db[0];
  LtCall c{};
  c.n = db[1], c.k = da[1];
  if (auto e = check_sizes(gs, groups); e.failure()) return e;
  if (auto e = check_grouped_out(t, groups, c.n, nullptr, cin, out, accumulate, &c); e.failure()) return e;
  if (c.out_type != lt::kR16BF) return invalid("grouped bf16 (CUTLASS): bfloat16 output only");
  gemm::CutlassGrouped p{};
  p.a = a.untyped_data(), p.b = b.untyped_data(), p.group_sizes = static_cast<const int32_t*>(gs.untyped_data());
  p.out = c.d, p.t = t, p.n = c.n, p.k = c.k, p.groups = groups, p.accumulate = c.accumulate, p.bf16 = true;
  p.workspace = workspace->untyped_data(), p.workspace_bytes = int64_t(workspace->size_bytes());
  if (std::string e = gemm::cutlass_grouped_gemm(p, stream); !e.empty())
    return invalid("grouped bf16 (CUTLASS), A " + dims(a) + " x B " + dims(b) + ": " + e);
  return ffi::Error::Success();
}

// ---- Grouped along K on CUTLASS (the MoE wgrad): out[g] = A[:, seg g] @ B[:, seg g]^T, FP8 with 1x128 blocks
// along t on both operands, or bf16 values (decoded MXFP8 copies; empty scales), the segment sizes read on the
// device.
ffi::Error gemm_cutlass_kgrouped(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer sa, ffi::AnyBuffer b,
                                 ffi::AnyBuffer sb, ffi::AnyBuffer sizes, ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::AnyBuffer> workspace) {
  auto da = a.dimensions(), db = b.dimensions(), dout = out->dimensions();
  const std::string what = "GEMM grouped along K (CUTLASS), A " + dims(a) + " x B " + dims(b);
  if (da.size() != 2 || db.size() != 2 || da[1] != db[1])
    return invalid(what + ": A must be [M, T] and B [N, T]");
  const int64_t m = da[0], n = db[0], t = da[1], groups = int64_t(sizes.element_count());
  const bool bf16 = a.element_type() == ffi::DataType::BF16;
  if (a.element_type() != b.element_type() || (!bf16 && a.element_type() != ffi::DataType::F8E4M3FN))
    return invalid(what + ": both operands must be float8_e4m3fn (1x128 blocks) or both bfloat16");
  if (!bf16 && (sa.element_type() != ffi::DataType::F32 || sb.element_type() != ffi::DataType::F32 ||
                !is_2d(sa, cdiv(t, 128), m) || !is_2d(sb, cdiv(t, 128), n)))
    return invalid(what + ": scale_inv must be float32 [T/128, M] and [T/128, N] (as the quantize launch writes "
                   "1x128 scales), got " + dims(sa) + " and " + dims(sb));
  if (auto e = check_sizes(sizes, groups); e.failure()) return e;
  if (out->element_type() != ffi::DataType::BF16 || dout.size() != 3 || dout[0] != groups || dout[1] != m ||
      dout[2] != n)
    return invalid(what + ": out must be bfloat16 [G, M, N], got " + dims(*out));
  gemm::CutlassKGrouped p{a.untyped_data(), b.untyped_data(), static_cast<const float*>(sa.untyped_data()),
                          static_cast<const float*>(sb.untyped_data()), static_cast<const int32_t*>(sizes.untyped_data()),
                          out->untyped_data(), m, n, t, groups, bf16, workspace->untyped_data(),
                          int64_t(workspace->size_bytes())};
  if (std::string e = gemm::cutlass_kgrouped_gemm(p, stream); !e.empty()) return invalid(what + ": " + e);
  return ffi::Error::Success();
}
#endif

// The CUDA handlers' binding prefixes: the stream (dense: temporaries in the workspace result), then XLA's
// scratch allocator (grouped).
auto stream_bind() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }
auto cuda_bind() { return stream_bind().Ctx<ffi::ScratchAllocator>(); }
}  // namespace
}  // namespace jaxhq

// Dense GEMMs: launches on the call's stream into XLA-allocated buffers, no synchronisation: graphable.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_gemm_fp8, jaxhq::gemm_fp8, jaxhq::gemm_bind::gemm_fp8(jaxhq::stream_bind()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_gemm_dq, jaxhq::gemm_dq, jaxhq::gemm_bind::gemm_dq(jaxhq::stream_bind()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_gemm_fp8_grouped, jaxhq::gemm_fp8_grouped, jaxhq::gemm_bind::gemm_fp8_grouped(jaxhq::cuda_bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_gemm_dq_grouped, jaxhq::gemm_dq_grouped, jaxhq::gemm_bind::gemm_dq_grouped(jaxhq::cuda_bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_gemm_mxfp8, jaxhq::gemm_mxfp8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // a data [M, K] (uint8 codes)
                                  .Arg<ffi::AnyBuffer>()  // a E8M0 scales [M, ceil(K/32)]
                                  .Arg<ffi::AnyBuffer>()  // b data [N, K]
                                  .Arg<ffi::AnyBuffer>()  // b scales
                                  .Arg<ffi::AnyBuffer>()  // bias [N] or [0]
                                  .Arg<ffi::AnyBuffer>()  // c
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt_a")
                                  .Attr<int32_t>("fmt_b")
                                  .Attr<int64_t>("k")
                                  .Attr<int32_t>("accumulate"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_gemm_nvfp4, jaxhq::gemm_nvfp4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // a codes [M, K / 2] (uint8)
                                  .Arg<ffi::AnyBuffer>()  // a E4M3 scales [M, K / 16]
                                  .Arg<ffi::AnyBuffer>()  // a amax [] float32
                                  .Arg<ffi::AnyBuffer>()  // b codes [N, K / 2]
                                  .Arg<ffi::AnyBuffer>()  // b scales
                                  .Arg<ffi::AnyBuffer>()  // b amax
                                  .Arg<ffi::AnyBuffer>()  // bias [N] or [0]
                                  .Arg<ffi::AnyBuffer>()  // c
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("k")
                                  .Attr<int32_t>("accumulate"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_gemm_fp8_wgmma_grouped, jaxhq::gemm_fp8_wgmma_grouped,
                              jaxhq::gemm_bind::gemm_fp8_wgmma_grouped(jaxhq::cuda_bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_gemm_mxfp8_grouped, jaxhq::gemm_mxfp8_grouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // a data [T, K]
                                  .Arg<ffi::AnyBuffer>()  // a scales
                                  .Arg<ffi::AnyBuffer>()  // b data [G, N, K]
                                  .Arg<ffi::AnyBuffer>()  // b scales [G, N, ceil(K/32)]
                                  .Arg<ffi::AnyBuffer>()  // group_sizes [G] int32 (read on the device)
                                  .Arg<ffi::AnyBuffer>()  // bias [G, N] or [0]
                                  .Arg<ffi::AnyBuffer>()  // c
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt_a")
                                  .Attr<int32_t>("fmt_b")
                                  .Attr<int64_t>("k")
                                  .Attr<int32_t>("accumulate"));

#ifdef JAXHQ_WITH_CUTLASS
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_gemm_fp8_cutlass_grouped, jaxhq::gemm_fp8_cutlass_grouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // a [T, K] E4M3 / E5M2
                                  .Arg<ffi::AnyBuffer>()  // scale_inv a: [] or [T, ceil(K/128)] fp32
                                  .Arg<ffi::AnyBuffer>()  // b [G, N, K] E4M3
                                  .Arg<ffi::AnyBuffer>()  // scale_inv b: [G] or [G, ceil(N/128), ceil(K/128)]
                                  .Arg<ffi::AnyBuffer>()  // group_sizes [G] int32 (read on the device)
                                  .Arg<ffi::AnyBuffer>()  // c (aliased to out when accumulating)
                                  .Ret<ffi::AnyBuffer>()  // out [T, N]
                                  .Ret<ffi::AnyBuffer>()  // workspace (uint8 [cutlass_grouped_workspace_bytes])
                                  .Attr<int32_t>("mode_a")
                                  .Attr<int32_t>("mode_b")
                                  .Attr<int32_t>("accumulate")
                                  .Attr<int32_t>("fast_accum"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_gemm_bf16_cutlass_grouped, jaxhq::gemm_bf16_cutlass_grouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // a [T, K] bf16
                                  .Arg<ffi::AnyBuffer>()  // b [G, N, K] bf16
                                  .Arg<ffi::AnyBuffer>()  // group_sizes [G] int32 (read on the device)
                                  .Arg<ffi::AnyBuffer>()  // c (aliased to out when accumulating)
                                  .Ret<ffi::AnyBuffer>()  // out [T, N] bf16
                                  .Ret<ffi::AnyBuffer>()  // workspace (uint8 [cutlass_grouped_workspace_bytes])
                                  .Attr<int32_t>("accumulate"),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhq_cuda_gemm_cutlass_kgrouped, jaxhq::gemm_cutlass_kgrouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // a [M, T] E4M3 or bf16
                                  .Arg<ffi::AnyBuffer>()  // scale_inv a [M, T/128] fp32 (bf16: empty)
                                  .Arg<ffi::AnyBuffer>()  // b [N, T] E4M3 or bf16
                                  .Arg<ffi::AnyBuffer>()  // scale_inv b [N, T/128] fp32 (bf16: empty)
                                  .Arg<ffi::AnyBuffer>()  // segment_sizes [G] int32 (read on the device)
                                  .Ret<ffi::AnyBuffer>()  // out [G, M, N] bf16
                                  .Ret<ffi::AnyBuffer>(),  // workspace (uint8 [cutlass_kgrouped_workspace_bytes])
                              {ffi::Traits::kCmdBufferCompatible});
#endif

namespace jaxhq {
const GemmHandler* gemm_cuda_handlers() {
  static const GemmHandler table[] = {
      {"jaxhq_gemm_fp8", reinterpret_cast<void*>(jaxhq_cuda_gemm_fp8)},
      {"jaxhq_gemm_dq", reinterpret_cast<void*>(jaxhq_cuda_gemm_dq)},
      {"jaxhq_gemm_fp8_grouped", reinterpret_cast<void*>(jaxhq_cuda_gemm_fp8_grouped)},
      {"jaxhq_gemm_dq_grouped", reinterpret_cast<void*>(jaxhq_cuda_gemm_dq_grouped)},
      {"jaxhq_gemm_mxfp8", reinterpret_cast<void*>(jaxhq_cuda_gemm_mxfp8)},
      {"jaxhq_gemm_mxfp8_grouped", reinterpret_cast<void*>(jaxhq_cuda_gemm_mxfp8_grouped)},
      {"jaxhq_gemm_fp8_wgmma_grouped", reinterpret_cast<void*>(jaxhq_cuda_gemm_fp8_wgmma_grouped)},
      {"jaxhq_gemm_nvfp4", reinterpret_cast<void*>(jaxhq_cuda_gemm_nvfp4)},
#ifdef JAXHQ_WITH_CUTLASS
      {"jaxhq_gemm_fp8_cutlass_grouped", reinterpret_cast<void*>(jaxhq_cuda_gemm_fp8_cutlass_grouped)},
      {"jaxhq_gemm_cutlass_kgrouped", reinterpret_cast<void*>(jaxhq_cuda_gemm_cutlass_kgrouped)},
      {"jaxhq_gemm_bf16_cutlass_grouped", reinterpret_cast<void*>(jaxhq_cuda_gemm_bf16_cutlass_grouped)},
#endif
      {nullptr, nullptr},
  };
  return table;
}
}  // namespace jaxhq
