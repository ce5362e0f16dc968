// Runs the project's CUDA kernels on the CPU, for tests: the .cu sources are compiled by the host compiler
// with this header first. Each CUDA thread of a block is a fiber (ucontext) and a block's fibers run one at
// a time, each until it blocks: __syncthreads waits for the whole block, a warp shuffle for its warp. So the
// kernels' indexing, shared-memory layout, barriers and shuffles run as written; the instructions behind
// the few inline-PTX helpers run their host fallbacks.
//
// A fiber runs until it waits, so a thread that reads shared memory another thread of the same phase has
// not written yet reads the poison (0xFF) of fresh dynamic shared memory: a missing barrier shows up as a
// wrong result. `set_order` runs the fibers forwards, backwards or shuffled, which catches races the other
// way round. A barrier not reached by every thread (a divergent __syncthreads) is reported as a deadlock.
// The runtime calls of the kernels' launch code (cudaGetLastError, cudaMemsetAsync, ...) are defined by
// harness.cc, on host memory.
#pragma once
#define JAXHQ_EMU 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

// CUDA's qualifiers mean nothing on the host; in-kernel __shared__ arrays are per block, and one block runs
// at a time, so they are function statics.
#undef __global__
#undef __shared__
#undef __launch_bounds__
#define __global__
#define __shared__ static
#define __launch_bounds__(...)

namespace emu {

enum State { kReady, kBlockWait, kWarpWait, kDone };

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  uint3 tid;
  State state = kReady;
  unsigned gen = 0;  // the barrier generation it waits to pass
};

struct Block {
  dim3 grid, dim;
  uint3 idx;
  std::vector<Fiber> fibers;
  ucontext_t sched;
  int cur = -1;
  unsigned count = 0, gen = 0;                 // block barrier
  std::vector<unsigned> warp_count, warp_gen;  // warp barriers
  std::vector<uint64_t> exchange;              // shuffle slots, one per thread
  std::vector<unsigned char> smem;             // dynamic shared memory
  const std::function<void()>* body = nullptr;
  std::string error;
};

inline Block& block() {
  static Block b;
  return b;
}
inline int& order() {  // 0 forwards, 1 backwards, else shuffled with this seed
  static int o = 0;
  return o;
}
inline std::string& last_error() {
  static std::string e;
  return e;
}
inline void set_order(int o) { order() = o; }

inline Fiber& self() { return block().fibers[block().cur]; }
inline int linear(const uint3& t) { return int(t.x + block().dim.x * (t.y + block().dim.y * t.z)); }
inline int warp_size_of(int w) {
  const int n = int(block().fibers.size());
  return std::min(32, n - 32 * w);
}
inline void wait(State s, unsigned gen) {
  Fiber& f = self();
  f.state = s;
  f.gen = gen;
  swapcontext(&f.ctx, &block().sched);
}

inline void syncthreads() {
  Block& b = block();
  const unsigned gen = b.gen;
  if (++b.count == b.fibers.size()) {  // the last to arrive opens the barrier and goes on
    b.count = 0;
    ++b.gen;
    return;
  }
  wait(kBlockWait, gen);
}

inline void syncwarp() {
  Block& b = block();
  const int w = linear(self().tid) / 32;
  const unsigned gen = b.warp_gen[w];
  if (++b.warp_count[w] == unsigned(warp_size_of(w))) {
    b.warp_count[w] = 0;
    ++b.warp_gen[w];
    return;
  }
  wait(kWarpWait, gen);
}

// Every lane writes its value, the warp meets, each reads its partner's, the warp meets again (so no value is
// overwritten before it is read).
template <typename T>
T shuffle(unsigned mask, T v, int src_of_lane_xor, bool xor_mode) {
  Block& b = block();
  const int me = linear(self().tid), w = me / 32, lane = me % 32, n = warp_size_of(w);
  const unsigned full = n == 32 ? 0xffffffffu : ((1u << n) - 1u);
  if (mask != full && b.error.empty()) b.error = "shuffle with a partial mask (the emulator needs whole warps)";
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a type wider than 8 bytes");
  std::memcpy(&b.exchange[me], &v, sizeof(T));
  syncwarp();
  const int src = xor_mode ? (lane ^ src_of_lane_xor) : src_of_lane_xor;
  T r = v;
  if (src >= 0 && src < n) std::memcpy(&r, &b.exchange[w * 32 + src], sizeof(T));
  syncwarp();
  return r;
}

inline void entry() {
  (*block().body)();
  self().state = kDone;
}

inline bool ready(const Fiber& f, const Block& b) {
  switch (f.state) {
    case kReady: return true;
    case kBlockWait: return f.gen != b.gen;
    case kWarpWait: return f.gen != b.warp_gen[linear(f.tid) / 32];
    default: return false;
  }
}

// One block: fresh fibers, shared memory poisoned, run until every fiber is done.
inline void run_block(const dim3& grid, const dim3& dim, const uint3& idx, size_t smem,
                      const std::function<void()>& body) {
  Block& b = block();
  const int n = int(dim.x * dim.y * dim.z);
  b.grid = grid;
  b.dim = dim;
  b.idx = idx;
  b.body = &body;
  b.count = b.gen = 0;
  b.warp_count.assign((n + 31) / 32, 0);
  b.warp_gen.assign((n + 31) / 32, 0);
  b.exchange.assign(n, 0);
  b.smem.assign(smem, 0xFF);
  if (int(b.fibers.size()) != n) b.fibers = std::vector<Fiber>(n);
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.tid = uint3{unsigned(i % dim.x), unsigned(i / dim.x % dim.y), unsigned(i / (dim.x * dim.y))};
    f.state = kReady;
    f.stack.resize(256 * 1024);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &b.sched;
    makecontext(&f.ctx, entry, 0);
  }
  std::vector<int> seq(n);
  std::iota(seq.begin(), seq.end(), 0);
  if (order() == 1) std::reverse(seq.begin(), seq.end());
  std::mt19937 rng(unsigned(order()) * 7919u + idx.x * 131u + idx.y * 17u + idx.z);
  for (;;) {
    if (order() > 1) std::shuffle(seq.begin(), seq.end(), rng);
    bool ran = false, all_done = true;
    for (int i : seq) {
      Fiber& f = b.fibers[i];
      if (f.state != kDone) all_done = false;
      if (!ready(f, b)) continue;
      ran = true;
      b.cur = i;
      f.state = kReady;
      swapcontext(&b.sched, &f.ctx);
    }
    if (all_done) break;
    if (!ran) {
      b.error = "deadlock: a barrier that not every thread of the block (or warp) reaches";
      break;
    }
  }
}

template <typename F>
void launch(dim3 grid, dim3 dim, size_t smem, F&& kernel_call) {
  const std::function<void()> body(std::forward<F>(kernel_call));
  block().error.clear();
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        run_block(grid, dim, uint3{x, y, z}, smem, body);
        if (!block().error.empty()) {
          last_error() = block().error;
          return;
        }
      }
}

}  // namespace emu

#define threadIdx (::emu::self().tid)
#define blockIdx (::emu::block().idx)
#define blockDim (::emu::block().dim)
#define gridDim (::emu::block().grid)

inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::syncwarp(); }
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int = 32) {
  return emu::shuffle(mask, v, lane_mask, true);
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane, int = 32) {
  return emu::shuffle(mask, v, src_lane, false);
}
template <typename T>
T __ldg(const T* p) {
  return *p;
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
// One block runs at a time and its fibers switch only at barriers: a plain read-modify-write is atomic.
inline unsigned atomicMax(unsigned* p, unsigned v) {
  const unsigned old = *p;
  if (v > old) *p = v;
  return old;
}
