// The hybrid tile kernel: one CTA reads a 128x128 tile of x into shared memory once, then runs the
// rowwise copy's format epilogue (blocks along the tile's rows) and the columnwise copy's (blocks along its
// columns, written transposed). A single-format quantization is this kernel with the same (or no) format on
// the other side. It runs every call the register-tile kernel (cuda_quantize_regs.cu) does not take: an NVFP4
// side, or float32 input. Numerics: numerics.h, equal to the CPU handlers bit for bit.
//
// Work split: each copy's tile is 128 copy-rows x 8 chunks of 16 elements, taken in 4 rounds of 256; in a
// round a warp holds 8 consecutive copy rows x 4 consecutive chunks (`chunk_of`), so its stores are whole
// 32-byte sectors (FP4: 8 rows x 32 bytes; FP8: 8 rows x 64) and its shared reads of a tile row hit 32
// banks (columns: 2-way; the smem row stride is odd). Phase A: per-chunk amax into shared memory;
// phase B: block amax from the chunk amaxes, scale, encode, store.
#include "cuda_common.cuh"
#include "cuda_launch.h"
#include "cuda_quantize.cuh"

#include <cstdlib>
#include <type_traits>

namespace jaxhq {
namespace {

constexpr int kTile = 128, kThreads = 256, kChunks = kTile / 16;

// The tile is kept in the input dtype; the row stride (in 4-byte words: 129 for float, 65 for 16-bit types)
// is odd, so reading 32 consecutive rows or 32 consecutive columns hits 32 different banks.
template <typename T>
struct Smem {
  static constexpr int kStride = sizeof(T) == 4 ? kTile + 1 : kTile + 2;
  T tile[kTile * kStride];
  float camax[2][kTile * kChunks];  // [side][copy_row * 8 + chunk]
  uint32_t bamax[2][kTile / 16 * kChunks];  // NVFP4 16x16 blocks: [side][copy_row / 16 * 8 + chunk], |v| bits
  float tamax[2];
  unsigned xamax[kThreads / 32];  // per-warp max |x| (the amax output)
  TileOut out[2];  // [side] (tile_out)
};

// 8 consecutive elements of x (row r, columns c..c+7 of the tile) as raw bytes, zero outside x; one 16-byte
// load (two for float) when the row is 16-byte aligned and the 8 are in bounds.
template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ x, int64_t m, int64_t k, int64_t gr, int64_t gc,
                                      bool vec_ok, uint4 (&raw)[sizeof(T) / 2]) {
  if (gr < m && gc + 8 <= k && vec_ok) {
    const uint4* p = reinterpret_cast<const uint4*>(x + gr * k + gc);
#pragma unroll
    for (int j = 0; j < int(sizeof(T) / 2); ++j) raw[j] = __ldg(p + j);
  } else {
    T v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = (gr < m && gc + i < k) ? x[gr * k + gc + i] : T(0.0f);
    memcpy(raw, v, sizeof(v));
  }
}

// 16 loaded bytes of a 16-bit tile row as four 4-byte shared stores (rows start 4-byte aligned: an odd stride of
// 65 words keeps the banks apart).
__device__ __forceinline__ void put16(uint32_t* dst, const uint4& raw) {
  dst[0] = raw.x, dst[1] = raw.y, dst[2] = raw.z, dst[3] = raw.w;
}

// The tile [r0, r0+128) x [c0, c0+128) of x into shared memory: each thread loads 16 bytes (32 for float) and
// stores them before its next load. In: x's type in memory; T: the tile's (In, or bfloat16 from float: kF32AsBF16).
// kFast: 16-bit tiles wholly inside x take a path without per-load index arithmetic (what pays is the arithmetic:
// one, four or all eight loads in flight per thread measured the same).
template <typename In, typename T, bool kFast = true>
__device__ __forceinline__ void load_tile(const In* __restrict__ x, int64_t m, int64_t k, int64_t r0, int64_t c0,
                                          T* tile) {
  constexpr int kStride = Smem<T>::kStride;
  const bool vec_ok = (k * sizeof(In)) % 16 == 0;
  if constexpr (kFast && std::is_same_v<In, T> && sizeof(T) == 2) {
    // A tile inside x with 16-byte aligned rows: rows threadIdx.x / 16 + 16 j of the tile at a fixed step, four
    // loads issued before their stores.
    if (vec_ok && r0 + kTile <= m && c0 + kTile <= k) {
      constexpr int kRowsPerPass = kThreads / (kTile / 8), kGroup = 4;
      const int r = threadIdx.x / (kTile / 8), c = (threadIdx.x % (kTile / 8)) * 8;
      const uint4* src = reinterpret_cast<const uint4*>(x + (r0 + r) * k + c0 + c);
      const int64_t step = kRowsPerPass * k / 8;  // in uint4
      uint32_t* dst = reinterpret_cast<uint32_t*>(tile + r * kStride + c);
#pragma unroll
      for (int j0 = 0; j0 < kTile / kRowsPerPass; j0 += kGroup) {
        uint4 raw[kGroup];
#pragma unroll
        for (int j = 0; j < kGroup; ++j) raw[j] = __ldg(src + (j0 + j) * step);
#pragma unroll
        for (int j = 0; j < kGroup; ++j) put16(dst + (j0 + j) * kRowsPerPass * kStride / 2, raw[j]);
      }
      return;
    }
  }
  for (int idx = threadIdx.x; idx < kTile * kTile / 8; idx += kThreads) {
    const int r = idx / (kTile / 8), c = (idx % (kTile / 8)) * 8;
    uint4 raw[sizeof(In) / 2];
    load8<In>(x, m, k, r0 + r, c0 + c, vec_ok, raw);
    if constexpr (std::is_same_v<In, T> && sizeof(T) == 2) {
      put16(reinterpret_cast<uint32_t*>(tile + r * kStride + c), raw[0]);
    } else {
      In v[8];
      memcpy(v, raw, sizeof(v));
#pragma unroll
      for (int i = 0; i < 8; ++i) tile[r * kStride + c + i] = as_value<T>(v[i]);
    }
  }
}

// 16 values of chunk `ch` of copy row `cr` of the rowwise side (s = 0) from a 16-bit tile, read as 8 value pairs
// (4-byte loads: the row stride is even), and their bits_amax, taken on the 16-bit |x| patterns two at a time
// (they order as the values do, NaN patterns above inf; the same float as bits_amax of the values).
template <typename T>
__device__ __forceinline__ float read_row_chunk_amax(const T* tile, int cr, int ch, float* v) {
  if constexpr (sizeof(T) != 2) return 0.0f;  // not called: float tiles read value by value
  const uint32_t* w = reinterpret_cast<const uint32_t*>(tile + cr * Smem<T>::kStride + ch * 16);
  uint32_t pair = 0u;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t x = w[i];
    v[2 * i] = bits_to_f32<T>(x & 0xFFFFu);
    v[2 * i + 1] = bits_to_f32<T>(x >> 16);
    pair = vmax2(pair, x & 0x7FFF7FFFu);
  }
  return bits_to_f32<T>(max_halves(pair));
}

// 16 values of chunk `ch` of copy row `cr`; columnwise copies read the tile transposed. `sums`: the Hadamard
// transform's sums without its factor 1/4 (rht_sums_only).
template <typename T>
__device__ __forceinline__ void read_chunk(const T* tile, int s, int cr, int ch, bool rht, float* v,
                                           bool sums = false) {
  constexpr int kStride = Smem<T>::kStride;
#pragma unroll
  for (int e = 0; e < 16; ++e)
    v[e] = to_f32(s == 0 ? tile[cr * kStride + ch * 16 + e] : tile[(ch * 16 + e) * kStride + cr]);
  if (rht && sums) hadamard16_signed(v);
  else if (rht) rht16(v);
}

// Whether a Hadamard-transformed NVFP4 side of a 16-bit tile leaves the transform's factor 1/4 to the encode
// multiplier (encode_chunk's vscale): the sums of 16-bit values are multiples of their format's least subnormal
// (2^-133 for bfloat16), so a quarter of every sum is exact in float32, subnormal or not; and with a global encode
// genc >= 2^-115 every block's enc >= genc / 448 keeps enc / 4 normal, so v * (enc / 4) == (v / 4) * enc. (A lower
// genc means an amax above 1.1e38, more than a quarter of any finite float32 sum: only a scalar given from
// elsewhere takes the other branch.)
template <typename T>
__device__ __forceinline__ bool rht_sums_only(const SideParams& sp, float genc) {
  return sizeof(T) == 2 && sp.fmt == kNvfp4 && (sp.opts & kRHT) && genc >= 0x1p-115f;
}

// NVFP4 and MXFP8 scales read only whether an amax is NaN, not which NaN: the max of the |v| bit patterns (NaN
// patterns above Inf) is that amax in two integer operations per element.
__device__ __forceinline__ float bits_amax(const float (&v)[16]) {
  uint32_t m = 0u;
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    const uint32_t u = f2u(v[e]) & 0x7FFFFFFFu;
    m = u > m ? u : m;
  }
  return u2f(m);
}

__device__ __forceinline__ bool one_chunk_blocks(const SideParams& sp) {
  return sp.fmt == kNvfp4 && !(sp.opts & kBlock2D);
}
// Side s reads its chunks from a 16-bit tile as value pairs with their amax (read_row_chunk_amax): the rowwise
// side, unless it is Hadamard-transformed.
template <typename T>
__device__ __forceinline__ bool reads_row_pairs(const SideParams& sp, int s) {
  return sizeof(T) == 2 && s == 0 && !(sp.fmt == kNvfp4 && (sp.opts & kRHT));
}
__device__ __forceinline__ bool both_2d_nvfp4(const Params& p) {
  const auto is_2d = [](const SideParams& sp) {
    return sp.fmt == kNvfp4 && (sp.opts & kBlock2D) && !(sp.opts & kRHT);
  };
  return is_2d(p.side[0]) && is_2d(p.side[1]);
}

// Round `it` of this thread: its copy row `cr` in the tile and its chunk `ch` along that row (see the top). Thread q
// of round it is thread q + 256 it of a flat numbering whose 32-thread groups g take rows 8 (g & 15) .. + 7 and
// chunks 4 (g >> 4) .. + 3, so a thread's four chunks are rows cr_t and cr_t + 64 (it & 1) by chunks ch_t and
// ch_t + 4 (it >> 1), with cr_t = 8 warp + (lane & 7), ch_t = lane >> 3 (chunk_origin).
__device__ __forceinline__ void chunk_origin(int& cr_t, int& ch_t) {
  const int w = int(threadIdx.x) >> 5, l = int(threadIdx.x) & 31;
  cr_t = 8 * w + (l & 7);
  ch_t = l >> 3;
}
__device__ __forceinline__ void chunk_of(int it, int cr_t, int ch_t, int& cr, int& ch) {
  cr = cr_t + 64 * (it & 1);
  ch = ch_t + 4 * (it >> 1);
}

// Phase A of side s: chunk amaxes for the formats whose blocks span several chunks (a 1x16 NVFP4
// block is one chunk: phase B takes its amax from the values it encodes, reading and transforming them once).
template <typename T>
__device__ __forceinline__ void chunk_amaxes(const Params& p, Smem<T>& sm, int s) {
  const SideParams& sp = p.side[s];
  const int fmt = sp.fmt;
  if (fmt == kNone || fmt == kFp8Tensor || one_chunk_blocks(sp)) return;
  const bool rht = fmt == kNvfp4 && (sp.opts & kRHT);
  const bool bits = fmt == kNvfp4 || fmt == kMxfp8;
  const bool row_pairs = bits && reads_row_pairs<T>(sp, s);  // read_row_chunk_amax: the same amax
  int cr_t, ch_t;
  chunk_origin(cr_t, ch_t);
  for (int it = 0; it < kTile * kChunks / kThreads; ++it) {
    int cr, ch;
    chunk_of(it, cr_t, ch_t, cr, ch);
    float v[16];
    if (row_pairs) {
      sm.camax[s][cr * kChunks + ch] = read_row_chunk_amax(sm.tile, cr, ch, v);
      continue;
    }
    read_chunk(sm.tile, s, cr, ch, rht, v);
    float a = 0.0f;
    if (bits) {
      a = bits_amax(v);
    } else {
#pragma unroll
      for (int e = 0; e < 16; ++e) a = amax_acc(a, v[e]);
    }
    sm.camax[s][cr * kChunks + ch] = a;
  }
}

// Side s's TileOut for the CTA's tile (r0, c0) of batch element b.
template <bool kSR, bool kDec>
__device__ __forceinline__ void tile_out(const Params& p, TileOut& o, int s, int64_t b, int64_t r0, int64_t c0) {
  const SideParams& sp = p.side[s];
  const int64_t cr0 = s == 0 ? r0 : c0, cc0 = s == 0 ? c0 : r0;  // the tile's origin in the copy
  const auto in_tile = [](int64_t n) { return n < kTile ? int(n) : kTile; };
  o.rows_in = in_tile(sp.R - cr0), o.cols_in = in_tile(sp.C - cc0);
  // NVFP4: codes pack two columns a byte; decoded copies hold bfloat16 values (a row's bytes a multiple of the
  // chunk's: every chunk's vector stores aligned, the data's base being 16-byte aligned)
  const bool dec_side = kDec && (sp.opts & kDecoded);
  o.drow = dec_side ? 2 * sp.C : (sp.C + 1) / 2, o.srow = (sp.C + 15) / 16;
  o.cbytes = dec_side ? 32 : 8;
  o.aligned = dec_side ? sp.C % 16 == 0 : o.drow % 8 == 0;
  o.data = sp.data + b * sp.dbytes + cr0 * o.drow + cc0 / 16 * o.cbytes;
  o.scale = sp.scale + b * sp.sbytes + cr0 * o.srow + cc0 / 16;  // a 1x16 block per 16 columns
  if (kSR) {  // the seed is given to the stochastic instantiations
    const uint32_t* seed = p.seed + kSeedWords * b;
    const SrIndex si = sr_index(seed, s);
    const uint32_t roff = uint32_t(si.roff), coff = uint32_t(si.coff), cols = uint32_t(si.cols);
    o.q = sr_pair(uint64_t(cr0) + roff, uint64_t(cc0) + coff, cols);
    o.hc = uint32_t((uint64_t(cols) + 1) / 2);  // sr_pair's pairs per row
    o.odd = uint32_t((uint64_t(cc0) + coff) & 1);
    o.s0 = seed[0], o.s1 = seed[1];
    o.roff = roff, o.coff = coff, o.cols = cols;
  }
}

// Phase B of side s: each chunk's block amax, then encode and store. A chunk's position is kept as its offsets in
// the tile (32-bit), and what it needs of the tile's position is read from shared memory (TileOut), so a chunk
// takes no more 64-bit index arithmetic than two multiply-adds for its NVFP4 addresses (the SASS formed both
// addresses and the bounds checks from the block and batch indices per chunk, about 25 instructions).
template <typename T, bool kSR, bool kDec, int kF, int kKnown, int kBits>
__device__ __forceinline__ void encode_tile_side(const Params& p, const Smem<T>& sm, int s, int64_t b, int64_t r0,
                                                 int64_t c0, float ts) {
  const SideParams& sp = p.side[s];
  if (sp.fmt == kNone) return;
  const int fmt = kF == kAnyFormat ? sp.fmt : kF;
  const int64_t cr0 = s == 0 ? r0 : c0, cc0 = s == 0 ? c0 : r0;  // this tile's origin in the copy
  int cr_t, ch_t;
  chunk_origin(cr_t, ch_t);
  const volatile TileOut& to = sm.out[s];
  SrStream srs(&to, s);  // read only by the stochastic instantiation
  const bool sums = rht_sums_only<T>(sp, ts);
  const float vscale = sums ? 0.25f : 1.0f;  // what the values read still lack
  for (int it = 0; it < kTile * kChunks / kThreads; ++it) {
    int cr, ch;
    chunk_of(it, cr_t, ch_t, cr, ch);
    const int valid = to.cols_in - 16 * ch;  // the chunk's columns inside the copy
    if (cr >= to.rows_in || valid <= 0) continue;
    // the side's options, tested on `fmt` (known to the NVFP4-only instantiation); a rowwise NVFP4 1x16 chunk of a
    // 16-bit tile takes its values and amax together (read_row_chunk_amax: one_chunk_blocks and reads_row_pairs)
    const int opts = side_opts<kKnown, kBits>(sp);
    const bool rht = fmt == kNvfp4 && (opts & kRHT), two_d = fmt == kNvfp4 && (opts & kBlock2D);
    const bool row_pairs = fmt == kNvfp4 && sizeof(T) == 2 && s == 0 && !(opts & (kBlock2D | kRHT));
    float v[16];
    float a = 0.0f;  // the chunk's block amax (per-tensor FP8 has none)
    if (row_pairs) a = read_row_chunk_amax(sm.tile, cr, ch, v);
    else read_chunk(sm.tile, s, cr, ch, rht, v, sums);
    const float* ca = sm.camax[s];
    if (two_d) {
      a = u2f(sm.bamax[s][(cr / 16) * kChunks + ch]);
    } else if (fmt == kNvfp4) {
      if (!row_pairs) a = bits_amax(v) * vscale;
    } else if (fmt == kMxfp8) {
      a = nmax(ca[cr * kChunks + (ch & ~1)], ca[cr * kChunks + (ch | 1)]);
    } else if (fmt == kFp8Block1) {
#pragma unroll
      for (int i = 0; i < kChunks; ++i) a = nmax(a, ca[cr * kChunks + i]);
    } else if (fmt == kFp8Block2) {
      a = sm.tamax[s];
    }
    const ChunkAt at{b, cr0 + cr, cc0 + 16 * ch, valid, &to, uint32_t(cr), uint32_t(ch)};
    encode_chunk<16, T, kF, kSR, kDec, kKnown, kBits>(p, s, at, a, ts, v, &srs, vscale);
  }
}

// kSR: a side rounds stochastically (its own instantiation, see nvfp4_elements); kDec: a side is decoded
// (likewise: that path's registers and code would cost the others). Five CTAs per SM (the shared memory allows five for
// 16-bit inputs): 48 registers, no spills; four for the stochastic and decoded one (64 registers, no spills; at 48
// it spilled 88 bytes).
// kKnown, kBits0 / kBits1: option bits fixed per side at compile time (encode_chunk), for the launch that has an
// instantiation of its own (launch_t).
template <typename In, typename T, bool kSR, bool kDec, int kF, int kKnown = 0, int kBits0 = 0, int kBits1 = 0>
__global__ void __launch_bounds__(kThreads, kSR && kDec ? 4 : 5) quantize_tile_kernel(Params p) {
  Smem<T>& sm = *dynamic_smem<Smem<T>>();
  // load_tile's path for whole tiles: measured (H100, 16384^2 bf16) 7-8% faster for the NVFP4 kernels writing codes
  // and 6% for the stochastic decoded one, but 3% slower for the round-to-nearest decoded one, which keeps the loop
  constexpr bool kFastLoad = kSR || !kDec;
  const int64_t b = blockIdx.z;
  const int64_t r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const float ts[2] = {copy_scalar(p, 0, b), copy_scalar(p, 1, b)};
  write_scale_inv(p, b, ts);
  load_tile<In, T, kFastLoad>(static_cast<const In*>(p.x) + b * p.m * p.k, p.m, p.k, r0, c0, sm.tile);
  __syncthreads();
  if (p.amax) {  // max |x| of the tile (zeros outside x), reduced after the next barrier
    constexpr int kStride = Smem<T>::kStride;
    float a = 0.0f;
    for (int i = threadIdx.x; i < kTile * kTile; i += kThreads)
      a = amax_acc(a, to_f32(sm.tile[(i / kTile) * kStride + i % kTile]));
    cta_amax_partial(f2u(a), sm.xamax);
  }
  // Both copies in NVFP4 16x16 blocks of the same values (no RHT): the columnwise copy's blocks are the rowwise
  // copy's transposed, so are their amaxes, and its chunk amaxes are not needed.
  const bool same_2d = both_2d_nvfp4(p);
  chunk_amaxes(p, sm, 0);
  if (!same_2d) chunk_amaxes(p, sm, 1);
  __syncthreads();
  // 128x128 tiles: one amax for the whole tile (the first warp). NVFP4 16x16 blocks: one amax per block, the max
  // of its 16 chunk amaxes (threads 128..255, 64 blocks per side). Those chunk amaxes are |v| bit patterns
  // (bits_amax), so their integer max is the block's.
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    if (p.side[s].fmt != kFp8Block2) continue;
    if (threadIdx.x < 32) {
      float a = 0.0f;
      for (int i = threadIdx.x; i < kTile * kChunks; i += 32) a = nmax(a, sm.camax[s][i]);
      a = warp_nmax(a);
      if (threadIdx.x == 0) sm.tamax[s] = a;
    }
  }
  if (p.amax) cta_amax_finish(sm.xamax, kThreads / 32, p.amax + b);
  if (threadIdx.x < 2) tile_out<kSR, kDec>(p, sm.out[threadIdx.x], threadIdx.x, b, r0, c0);
  if (threadIdx.x >= kThreads / 2) {
    const int s = (threadIdx.x - kThreads / 2) / 64, j = threadIdx.x % 64, rb = j / kChunks, ch = j % kChunks;
    if (p.side[s].fmt == kNvfp4 && (p.side[s].opts & kBlock2D)) {
      // block (rb, ch) of copy s; with same_2d, the columnwise block (rb, ch) is the rowwise block (ch, rb)
      const bool t = same_2d && s == 1;
      const float* ca = sm.camax[t ? 0 : s];
      const int brow = t ? ch : rb, bcol = t ? rb : ch;
      uint32_t m = 0u;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const uint32_t u = f2u(ca[(16 * brow + i) * kChunks + bcol]);
        m = u > m ? u : m;
      }
      sm.bamax[s][j] = m;
    }
  }
  __syncthreads();
  encode_tile_side<T, kSR, kDec, kF, kKnown, kBits0>(p, sm, 0, b, r0, c0, ts[0]);
  encode_tile_side<T, kSR, kDec, kF, kKnown, kBits1>(p, sm, 1, b, r0, c0, ts[1]);
}

// JAXHQ_QUANTIZE_VARIANT = registers (default) | alternating: the kernel the FFI handlers launch (the same
// results; see docs/ffi.md). `registers` hands the calls it does not take to the tile kernel.
int default_variant() {
  static const int v = [] {
    const char* e = std::getenv("JAXHQ_QUANTIZE_VARIANT");
    return std::string(e ? e : "") == "alternating" ? kAlternatingLoad : kRegisterTile;
  }();
  return v;
}

// The NVFP4 recipe's output gradients (both copies 1x16, stochastic and decoded, the columnwise one
// Hadamard-transformed) have an instantiation with only their path, these option bits fixed (the one for every NVFP4
// option is 22.8k instructions, and its warps waited on instruction fetch: docs/ffi.md).
constexpr int kGradKnown = kRHT | kBlock2D | kStochastic | kDecoded;
constexpr int kGradRow = kStochastic | kDecoded, kGradCol = kGradRow | kRHT;

// The tile kernel's instantiation for the launch's options (kF: its sides' format, when one is known).
template <typename In, typename T, int kF>
void launch_f(const Params& p, dim3 grid, cudaStream_t s) {
  const bool sr = (p.side[0].fmt == kNvfp4 && (p.side[0].opts & kStochastic)) ||
                  (p.side[1].fmt == kNvfp4 && (p.side[1].opts & kStochastic));
  const bool dec = (p.side[0].opts | p.side[1].opts) & kDecoded;
  const size_t smem = sizeof(Smem<T>);
  if constexpr (kF == kNvfp4) {
    const auto has = [](const SideParams& sp, int bits) { return sp.fmt == kNvfp4 && (sp.opts & kGradKnown) == bits; };
    if (has(p.side[0], kGradRow) && has(p.side[1], kGradCol)) {
      launch_kernel(quantize_tile_kernel<In, T, true, true, kNvfp4, kGradKnown, kGradRow, kGradCol>, grid,
                    dim3(kThreads), smem, s, p);
      return;
    }
  }
  if (sr && dec) launch_kernel(quantize_tile_kernel<In, T, true, true, kF>, grid, dim3(kThreads), smem, s, p);
  else if (sr) launch_kernel(quantize_tile_kernel<In, T, true, false, kF>, grid, dim3(kThreads), smem, s, p);
  else if (dec) launch_kernel(quantize_tile_kernel<In, T, false, true, kF>, grid, dim3(kThreads), smem, s, p);
  else launch_kernel(quantize_tile_kernel<In, T, false, false, kF>, grid, dim3(kThreads), smem, s, p);
}

// 16-bit inputs whose copies are all NVFP4 (the NVFP4 recipes' launches) run an instantiation with only NVFP4's
// code (about 15% less code than the generic one, which carries every format's paths; 1-2% faster, docs/ffi.md).
template <typename In, typename T = In>
std::string launch_t(const Params& p, int64_t batch, cudaStream_t s) {
  dim3 grid(unsigned((p.k + kTile - 1) / kTile), unsigned((p.m + kTile - 1) / kTile), unsigned(batch));
  const auto nv = [](const SideParams& sp) { return sp.fmt == kNone || sp.fmt == kNvfp4; };
  if constexpr (sizeof(In) == 2) {
    if (nv(p.side[0]) && nv(p.side[1])) {
      launch_f<In, T, kNvfp4>(p, grid, s);
      return cuda_status();
    }
  }
  launch_f<In, T, kAnyFormat>(p, grid, s);
  return cuda_status();
}

}  // namespace

std::string launch_quantize(const QuantizeArgs& a, void* stream) {
  return launch_quantize(a, stream, default_variant());
}

std::string launch_quantize(const QuantizeArgs& a, void* stream, int variant) {
  if (a.m * a.k * a.batch == 0) return std::string();
  const Params p = make_params(a);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a.amax) cudaMemsetAsync(a.amax, 0, sizeof(float) * a.batch, s);
  if (a.act) {  // the activation's gradient: made in the register-tile kernel's loads, never written
    if (!act_grad_takes(a))
      return "the activation gradient's copies are made on the GPU for one FP8 per-tensor, MXFP8 or FP8 blockwise "
             "format on both sides (rowwise " + std::to_string(a.row.fmt) + ", columnwise " +
             std::to_string(a.col.fmt) + ")";
    return launch_register_tile(p, a.dtype, a.batch, s);
  }
  if (variant == kRegisterTile && register_tile_takes(a)) return launch_register_tile(p, a.dtype, a.batch, s);
  switch (a.dtype) {
    case kBF16: return launch_t<__nv_bfloat16>(p, a.batch, s);
    case kF16: return launch_t<__half>(p, a.batch, s);
    case kF32AsBF16: return launch_t<float, __nv_bfloat16>(p, a.batch, s);
    default: return launch_t<float>(p, a.batch, s);
  }
}

}  // namespace jaxhq
