// dlopen-based loader of cuBLASLt: prefers the copy already in the process (the one jaxlib loaded),
// then the sonames of cuBLAS 13 and 12, then $JAXHQ_CUBLASLT (a full path).
#include "cublaslt.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <unordered_map>

namespace jaxhq {
namespace lt {
namespace {

void* open_library(std::string* err) {
  const char* names[] = {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"};
  for (const char* n : names)
    if (void* h = dlopen(n, RTLD_NOW | RTLD_NOLOAD)) return h;  // already loaded by jaxlib
  if (const char* p = std::getenv("JAXHQ_CUBLASLT"))
    if (void* h = dlopen(p, RTLD_NOW | RTLD_GLOBAL)) return h;
  for (const char* n : names)
    if (void* h = dlopen(n, RTLD_NOW | RTLD_GLOBAL)) return h;
  const char* e = dlerror();
  *err = std::string("cannot load libcublasLt (tried the loaded copy, $JAXHQ_CUBLASLT, libcublasLt.so.13/.12): ") +
         (e ? e : "unknown error");
  return nullptr;
}

template <typename F>
bool bind(void* lib, const char* name, F* fn, std::string* err) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (!*fn && err->empty()) *err = std::string("libcublasLt lacks ") + name;
  return *fn != nullptr;
}

Api load() {
  Api a{};
  void* lib = open_library(&a.error);
  if (!lib) return a;
  bind(lib, "cublasLtCreate", &a.Create, &a.error);
  bind(lib, "cublasLtGetVersion", &a.GetVersion, &a.error);
  bind(lib, "cublasLtMatmulDescCreate", &a.MatmulDescCreate, &a.error);
  bind(lib, "cublasLtMatmulDescDestroy", &a.MatmulDescDestroy, &a.error);
  bind(lib, "cublasLtMatmulDescSetAttribute", &a.MatmulDescSetAttribute, &a.error);
  bind(lib, "cublasLtMatrixLayoutCreate", &a.MatrixLayoutCreate, &a.error);
  bind(lib, "cublasLtMatrixLayoutDestroy", &a.MatrixLayoutDestroy, &a.error);
  bind(lib, "cublasLtMatmulPreferenceCreate", &a.MatmulPreferenceCreate, &a.error);
  bind(lib, "cublasLtMatmulPreferenceDestroy", &a.MatmulPreferenceDestroy, &a.error);
  bind(lib, "cublasLtMatmulPreferenceSetAttribute", &a.MatmulPreferenceSetAttribute, &a.error);
  bind(lib, "cublasLtMatmulAlgoGetHeuristic", &a.MatmulAlgoGetHeuristic, &a.error);
  bind(lib, "cublasLtMatmul", &a.Matmul, &a.error);
  return a;
}

}  // namespace

const Api& api() {
  static const Api a = load();
  return a;
}

Status handle(Handle* out) {
  static std::mutex mu;
  static std::unordered_map<int, Handle> handles;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return -1;
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(dev);
  if (it != handles.end()) {
    *out = it->second;
    return 0;
  }
  Handle h = nullptr;
  Status s = api().Create(&h);
  if (s != 0) return s;
  handles[dev] = h;
  *out = h;
  return 0;
}

}  // namespace lt
}  // namespace jaxhq
