// The slice of the cuBLASLt C API the GEMM handlers use, loaded at run time with dlopen.
// Why: the CPU build machines have nvcc but no cuBLAS headers or libraries, and at run time the process
// already holds the libcublasLt that jaxlib loaded; binding to it by name avoids a second copy.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace jaxhq {
namespace lt {

using Status = int;  // cublasStatus_t; 0 = success
using Handle = void*;
using MatmulDesc = void*;
using Layout = void*;
using Pref = void*;

struct Algo {
  uint64_t data[8];
};
struct Heuristic {
  Algo algo;
  size_t workspace_size;
  Status state;
  float waves;
  int reserved[4];
};

// Enumerator values of cublasLt.h / library_types.h / cublas_api.h (stable across cuBLAS 12.x and 13.x).
enum : int32_t {
  kR32F = 0, kR16BF = 14, kR8F_E4M3 = 28, kR8F_E5M2 = 29, kR4F_E2M1 = 33,  // cudaDataType
  kCompute32F = 68,                                        // cublasComputeType_t
  kOpN = 0, kOpT = 1,                                      // cublasOperation_t
  kPointerHost = 0, kPointerDevice = 1,                    // cublasLtPointerMode_t
  kEpilogueDefault = 1, kEpilogueBias = 4,                 // cublasLtEpilogue_t
  kScaleScalar = 0, kScaleOuterVec = 3, kScaleVec128 = 4, kScaleBlk128 = 5,  // cublasLtMatmulMatrixScale_t
  kScaleVec32UE8M0 = 2, kScaleVec16UE4M3 = 1,
};
// cublasLtMatmulDescAttributes_t
enum : int32_t {
  kDescPointerMode = 2, kDescTransA = 3, kDescTransB = 4, kDescEpilogue = 7, kDescBiasPointer = 8,
  kDescAScalePointer = 17, kDescBScalePointer = 18, kDescFastAccum = 25, kDescBiasDataType = 26,
  kDescAScaleMode = 31, kDescBScaleMode = 32,
};
enum : int32_t { kPrefMaxWorkspace = 1 };  // cublasLtMatmulPreferenceAttributes_t

struct Api {
  Status (*Create)(Handle*);
  size_t (*GetVersion)();
  Status (*MatmulDescCreate)(MatmulDesc*, int32_t compute, int32_t scale_type);
  Status (*MatmulDescDestroy)(MatmulDesc);
  Status (*MatmulDescSetAttribute)(MatmulDesc, int32_t attr, const void* buf, size_t size);
  Status (*MatrixLayoutCreate)(Layout*, int32_t type, uint64_t rows, uint64_t cols, int64_t ld);
  Status (*MatrixLayoutDestroy)(Layout);
  Status (*MatmulPreferenceCreate)(Pref*);
  Status (*MatmulPreferenceDestroy)(Pref);
  Status (*MatmulPreferenceSetAttribute)(Pref, int32_t attr, const void* buf, size_t size);
  Status (*MatmulAlgoGetHeuristic)(Handle, MatmulDesc, Layout, Layout, Layout, Layout, Pref, int, Heuristic*, int*);
  Status (*Matmul)(Handle, MatmulDesc, const void* alpha, const void* A, Layout, const void* B, Layout,
                   const void* beta, const void* C, Layout, void* D, Layout, const Algo*, void* ws, size_t ws_size,
                   cudaStream_t);
  std::string error;  // empty when loaded
};

// The process-wide API table (loaded on first use; `error` says why when it could not be).
const Api& api();
// The cuBLASLt handle of the current device (created once per device).
Status handle(Handle* out);

}  // namespace lt
}  // namespace jaxhq
