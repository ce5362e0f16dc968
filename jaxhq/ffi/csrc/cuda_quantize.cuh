// What the quantize kernels (cuda_quantize.cu: the shared-memory tile kernel; cuda_quantize_regs.cu: the
// register-tile kernel) take: both copies' formats, outputs and shapes, and the per-batch scalars.
#pragma once
#include <string>
#include <type_traits>

#include "cuda_common.cuh"
#include "spec.h"

namespace jaxhq {

struct SideParams {
  int32_t fmt, opts;
  uint8_t* data;
  uint8_t* scale;
  int64_t R, C;            // the copy's shape
  int64_t dbytes, sbytes;  // per batch element
};

struct Params {
  const void* x;
  int64_t m, k;
  const float* scales[2];  // each copy's scalars (QuantizeArgs::scales)
  float amax_eps;
  const uint32_t* seed;
  SideParams side[2];  // 0: rowwise [m, k], 1: columnwise [k, m]
  float* amax;         // [batch] or null: max |x| (zeroed before the launch; one atomic per CTA on its bits)
  const void* dy;      // act != 0: x is the activation's input h and the copies are of its gradient (spec.h)
  int32_t act;
};

inline Params make_params(const QuantizeArgs& a) {
  Params p;
  p.x = a.x;
  p.m = a.m;
  p.k = a.k;
  p.scales[0] = a.scales[0];
  p.scales[1] = a.scales[1];
  p.amax_eps = a.amax_eps;
  p.seed = a.seed;
  p.amax = a.amax;
  p.dy = a.dy;
  p.act = a.act;
  const CopySpec* cs[2] = {&a.row, &a.col};
  for (int s = 0; s < 2; ++s) {
    const int64_t R = s == 0 ? a.m : a.k, C = s == 0 ? a.k : a.m;
    p.side[s] = SideParams{cs[s]->fmt, cs[s]->opts, static_cast<uint8_t*>(cs[s]->data),
                           static_cast<uint8_t*>(cs[s]->scale), R, C,
                           data_bytes(cs[s]->fmt, R, C, cs[s]->opts & kDecoded),
                           quantize_scale_bytes(cs[s]->fmt, R, C)};
  }
  return p;
}

template <typename T> __device__ constexpr int dtype_id() { return kF32; }
template <> __device__ constexpr int dtype_id<__nv_bfloat16>() { return kBF16; }
template <> __device__ constexpr int dtype_id<__half>() { return kF16; }

// p points to global memory: where the compiler cannot see it (a pointer read from shared memory), its stores are
// then global stores instead of generic ones.
__device__ __forceinline__ void assume_global(const void* p) {
#if defined(__CUDA_ARCH__)
  __builtin_assume(__isGlobal(p));
#endif
}

// What the tile kernel's chunks of one copy take from their tile's position, written by one thread per side before
// the encode phase (tile_out) and read from shared memory where a chunk uses it: the compiler otherwise formed each
// chunk's addresses from the block and batch indices, a 64-bit product at a time, or kept such values in registers
// that the encode needs (spilling them). The tile's copy rows and columns inside the copy (at least 1: the grid
// covers the copy and no more); NVFP4: the copy's first data and scale bytes of the tile, a copy row's data and
// scale bytes, a chunk's data bytes and whether the chunks' vector stores are aligned (store_words); stochastic
// rounding: the pair index (sr_pair) of the tile's first element, the pairs per copy row, whether the tile starts on
// an odd global column, and the seed words and sr_index's fields (SrStream).
struct TileOut {
  uint8_t* data;
  uint8_t* scale;
  int64_t drow, srow;
  uint64_t q;
  uint32_t hc, odd;
  uint32_t s0, s1, roff, coff, cols;
  int rows_in, cols_in;
  uint32_t cbytes;
  bool aligned;
};

// Where a chunk of N values goes: copy row gr from column gc of the copy (of batch element b), of which `valid`
// columns lie inside the copy (N or more: all). An NVFP4 chunk starts a block (N = 16) and lies at row cr and chunk
// ch of the tile `tile` describes; its addresses are formed where the stores are, so they take no registers before.
// The other formats form their addresses from gr and gc.
struct ChunkAt {
  int64_t b, gr, gc;
  int valid;
  const volatile TileOut* tile;
  uint32_t cr, ch;
  __device__ __forceinline__ uint8_t* data() const {
    uint8_t* d = tile->data + (uint64_t(cr) * tile->drow + ch * tile->cbytes);
    assume_global(d);
    return d;
  }
  __device__ __forceinline__ uint8_t* scale() const {
    uint8_t* d = tile->scale + (uint64_t(cr) * tile->srow + ch);
    assume_global(d);
    return d;
  }
  __device__ __forceinline__ bool aligned() const { return tile->aligned; }
  // sr_pair of the chunk's first element: (gr + roff) * hc + (gc + coff) / 2, with gr = cr0 + cr and gc = cc0 + 16 ch
  __device__ __forceinline__ uint64_t sr_pair() const { return tile->q + uint64_t(cr) * tile->hc + 8 * ch; }
};

// The E2M1 elements of N values (N even) of copy row gr from column gc: v * enc clipped to +-6, rounded to nearest
// even or, with `sr`, stochastically by global position (numerics.h sr_bits: a hash per two columns). The clip is
// implicit: the rounding functions saturate and pass NaN as the clip does. `finite`: every v * enc is finite, so
// the shorter forms apply. The choices are made once per chunk (each path is its own unrolled loop). An element is
// its code (E: Codes) or its value (E: Values, for decoded copies: numerics.h e2m1_round*, equal to the code's
// value); the columns from `valid` on (those at or past the copy's C) give 0. `put(i, e0, e1)` takes elements 2i
// and 2i + 1.
struct Codes {
  using T = uint32_t;
  JHQ_HD static T nearest(float y) { return e2m1_code(y); }
  JHQ_HD static T nearest_finite(float y) { return e2m1_code_finite(y); }
  template <bool kFinite> JHQ_HD static T sr(float y, uint32_t k) { return e2m1_code_sr<kFinite>(y, k); }
};
struct Values {
  using T = float;
  JHQ_HD static T nearest(float y) { return e2m1_round(y); }
  JHQ_HD static T nearest_finite(float y) { return e2m1_round_finite(y); }
  template <bool kFinite> JHQ_HD static T sr(float y, uint32_t k) { return e2m1_round_sr<kFinite>(y, k); }
};

template <int N, typename E, typename Elem, typename Put>
__device__ __forceinline__ void e2m1_pack(const float (&v)[N], float enc, int valid, Elem elem_of, Put put) {
  using T = typename E::T;
  auto pack = [&](auto masked) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      T c0 = elem_of(v[2 * i] * enc, 2 * i), c1 = elem_of(v[2 * i + 1] * enc, 2 * i + 1);
      if (decltype(masked)::value) {
        c0 = 2 * i < valid ? c0 : T(0);
        c1 = 2 * i + 1 < valid ? c1 : T(0);
      }
      put(i, c0, c1);
    }
  };
  if (valid >= N) pack(std::false_type{});
  else pack(std::true_type{});
}

// Stochastic elements of a chunk whose N columns' hash pairs do not cross a 2^32 boundary of the pair index: one
// key, N / 2 hashes when the chunk starts on an even global column (element 2i: the low half of pair q0 + i,
// 2i + 1: the high half), N / 2 + 1 when odd (element 2i: the high half of pair q0 + i, 2i + 1: the low half of
// q0 + i + 1).
template <int N, typename E, bool kFinite, typename Put>
__device__ __forceinline__ void e2m1_pack_sr(const float (&v)[N], float enc, int valid, uint32_t key,
                                             uint32_t q0, bool odd, Put put) {
  using T = typename E::T;
  auto pack = [&](auto masked, auto odd_start) {
    uint32_t h = odd_start ? mix32(key ^ q0) : 0u;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      uint32_t k0, k1;
      if (decltype(odd_start)::value) {
        k0 = h >> 16;
        h = mix32(key ^ (q0 + uint32_t(i + 1)));
        k1 = h & 0xFFFFu;
      } else {
        h = mix32(key ^ (q0 + uint32_t(i)));
        k0 = h & 0xFFFFu;
        k1 = h >> 16;
      }
      T c0 = E::template sr<kFinite>(v[2 * i] * enc, k0), c1 = E::template sr<kFinite>(v[2 * i + 1] * enc, k1);
      if (decltype(masked)::value) {
        c0 = 2 * i < valid ? c0 : T(0);
        c1 = 2 * i + 1 < valid ? c1 : T(0);
      }
      put(i, c0, c1);
    }
  };
  if (odd) {
    if (valid >= N) pack(std::false_type{}, std::true_type{});
    else pack(std::true_type{}, std::true_type{});
  } else {
    if (valid >= N) pack(std::false_type{}, std::false_type{});
    else pack(std::true_type{}, std::false_type{});
  }
}

// A copy's stochastic-rounding numbers as one thread walks its chunks of that copy: the seed words and the copy's
// offsets (TileOut, read when used), and the last key made (sr_key of the pair index's high word, which a thread's
// chunks rarely cross), so a chunk costs its N / 2 hashes and no more.
struct SrStream {
  const volatile TileOut* t;
  uint32_t hi, key;
  int side;
  bool keyed;
  __device__ __forceinline__ SrStream(const volatile TileOut* tile, int s)
      : t(tile), hi(0u), key(0u), side(s), keyed(false) {}
  __device__ __forceinline__ uint32_t key_of(uint32_t h) {
    if (!keyed || h != hi) {
      key = sr_key(t->s0, t->s1, uint32_t(side), h);
      hi = h;
      keyed = true;
    }
    return key;
  }
};

// kMaySR: the kernel takes stochastic copies (a separate instantiation: the stochastic path's registers would
// cost the others occupancy); `srs`: this side's stream (used when `sr`). The chunk is `at`'s (ChunkAt).
template <int N, bool kMaySR, typename E, typename Put>
__device__ __forceinline__ void nvfp4_elements(const float (&v)[N], float enc, bool sr, bool finite, SrStream* srs,
                                               const ChunkAt& at, Put put) {
  const int valid = at.valid;
  if (kMaySR && sr) {
    const uint64_t q0 = at.sr_pair();
    if (uint32_t(q0) <= 0xFFFFFFFFu - N) {  // the chunk's pairs share their high word: one key
      const uint32_t key = srs->key_of(uint32_t(q0 >> 32));
      const bool odd = srs->t->odd;
      if (finite) e2m1_pack_sr<N, E, true>(v, enc, valid, key, uint32_t(q0), odd, put);
      else e2m1_pack_sr<N, E, false>(v, enc, valid, key, uint32_t(q0), odd, put);
    } else {  // each element its own key (sr_bits), at its global position
      const volatile TileOut& t = *srs->t;
      const uint64_t row = uint64_t(at.gr) + t.roff, col = uint64_t(at.gc) + t.coff;
      const uint32_t s0 = t.s0, s1 = t.s1, side = uint32_t(srs->side), cols = t.cols;
      e2m1_pack<N, E>(v, enc, valid, [&](float q, int e) {
        return E::template sr<false>(q, sr_bits(s0, s1, side, row, col + uint64_t(e), cols));
      }, put);
    }
  } else if (finite) {
    e2m1_pack<N, E>(v, enc, valid, [](float q, int) { return E::nearest_finite(q); }, put);
  } else {
    e2m1_pack<N, E>(v, enc, valid, [](float q, int) { return E::nearest(q); }, put);
  }
}

// NB (4, 8, 16 or 32) output bytes, given as NB / 4 little-endian 32-bit words, at dst: vector stores when all NB
// lie in the row and `aligned`, else the first `valid` bytes one by one. The words go to the vector stores as they
// are: staging them in a byte array made the compiler split every word into bytes and put it back together
// (about 60 instructions per 16-element decoded chunk, in the SASS of sm_90a). Int: valid's type (the tile
// kernel's NVFP4 chunks give a 32-bit count, so its compares are 32-bit).
template <int NB, typename Int>
__device__ __forceinline__ void store_words(uint8_t* dst, const uint32_t (&w)[NB / 4], Int valid, bool aligned) {
  if (valid >= NB && aligned) {
    if constexpr (NB == 4) {
      *reinterpret_cast<uint32_t*>(dst) = w[0];
    } else if constexpr (NB == 8) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
    } else {
#pragma unroll
      for (int i = 0; i < NB / 16; ++i)
        reinterpret_cast<uint4*>(dst)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    }
  } else {  // a row's last chunk: its bytes (only here) one by one
    uint8_t out[NB];
    memcpy(out, w, NB);
    for (int i = 0; i < NB && i < valid; ++i) dst[i] = out[i];
  }
}

// MXFP8's E8M0 scale byte of a block from its amax (x's dtype T: the quotient is rounded to it first, as the
// reference computes it in x's dtype).
template <typename T>
__device__ __forceinline__ uint8_t mx_scale_byte(float amax, bool e5) {
  return e8m0_round_up(round_to_dtype_sw(mx_q(amax, e5), dtype_id<T>()));
}

// An FP8 copy's N values at element `off` (= gr * C + gc: copy row gr from column gc) of batch element b's data,
// times the multiplier of their block (or tensor), encoded and stored (the scales are the caller's). A decoded
// MXFP8 copy stores the codes' values times `dec`, the block's scale (kMayDecode: that path is compiled in; kernels
// without it keep their code as small as before). kE5: the codes' format when the caller fixes it (0 E4M3, 1
// E5M2; -1: the side's option, both conversions issued under predicates). kInside: the caller knows that the N
// values lie in the row and that the row's vector stores are aligned (C % N == 0), so the stores take no checks.
template <int N, bool kMayDecode, int kE5 = -1, bool kInside = false>
__device__ __forceinline__ void encode_fp8_chunk(const SideParams& sp, int64_t b, int64_t off, int64_t gc, float mult,
                                                 const float (&v)[N], float dec = 0.0f) {
  const bool e5 = kE5 < 0 ? bool(sp.opts & kE5M2) : kE5 == 1;
  const int64_t valid = kInside ? N : sp.C - gc;
  const bool aligned = kInside || sp.C % N == 0;
  uint8_t* data = sp.data + b * sp.dbytes;
  uint16_t codes[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) codes[i] = fp8x2(v[2 * i] * mult, v[2 * i + 1] * mult, e5);
  if (kMayDecode && (sp.opts & kDecoded)) {  // bfloat16 values: 2N bytes
    uint32_t pairs[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      float lo, hi;
      fp8x2_values(codes[i], e5, lo, hi);
      pairs[i] = bf16x2_bits(lo * dec, hi * dec);
    }
    store_words<2 * N>(data + 2 * off, pairs, 2 * valid, aligned);
    return;
  }
  uint32_t words[N / 4];
#pragma unroll
  for (int i = 0; i < N / 4; ++i) words[i] = uint32_t(codes[2 * i]) | (uint32_t(codes[2 * i + 1]) << 16);
  store_words<N>(data + off, words, valid, aligned);
}

// The scalar that copy s of batch element b uses: the FP8 per-tensor scale (with kFromAmax, computed here from
// the amax given, as fp8.scale_from_amax does) or the NVFP4 global encode. Kernels take both once per thread.
__device__ __forceinline__ float copy_scalar(const Params& p, int s, int64_t b) {
  return copy_scalar_of(side_scalar(p.scales, b, s), p.side[s].fmt, p.side[s].opts, p.amax_eps);
}

// The first thread of the grid's first tile writes each per-tensor copy's scale_inv = 1 / scale.
__device__ __forceinline__ void write_scale_inv(const Params& p, int64_t b, const float (&ts)[2]) {
  if (blockIdx.x != 0 || blockIdx.y != 0 || threadIdx.x != 0) return;
#pragma unroll
  for (int s = 0; s < 2; ++s)
    if (p.side[s].fmt == kFp8Tensor)
      *reinterpret_cast<float*>(p.side[s].scale + b * p.side[s].sbytes) = scale_inv_of(ts[s]);
}

// Side s's copy: N values (16 or 8) at `at`, their block's amax given (block formats) and the copy's scalar
// (copy_scalar), encoded and stored; the chunk that starts a block also writes the block's scale. Both kernels call
// this, so the numerics (numerics.h, as the CPU handlers) and the layouts are written once. F: the side's format
// when the caller fixes it at compile time (only that format's code is emitted), or kAnyFormat to read it from the
// parameters; kMaySR: NVFP4 copies may round stochastically (nvfp4_elements).
constexpr int kAnyFormat = -1;
// A side's option bits, those in kKnown fixed at compile time to kBits (an instantiation for one option set).
template <int kKnown, int kBits>
__device__ __forceinline__ int side_opts(const SideParams& sp) {
  return (sp.opts & ~kKnown) | kBits;
}
// NVFP4 only: v may hold the values times 1 / vscale (a power of 2: the Hadamard sums before their factor 1/4),
// which joins the encode multiplier instead (the caller makes sure that vscale * v and vscale * enc are exact).
// kKnown / kBits: option bits the caller fixes at compile time (kKnown: which; kBits: their values), so only their
// path is emitted.
template <int N, typename T, int F = kAnyFormat, bool kMaySR = false, bool kMayDecode = false, int kKnown = 0,
          int kBits = 0>
__device__ __forceinline__ void encode_chunk(const Params& p, int s, const ChunkAt& at, float amax, float tscale,
                                             const float (&v)[N], SrStream* srs = nullptr, float vscale = 1.0f) {
  const SideParams& sp = p.side[s];
  const int fmt = F == kAnyFormat ? sp.fmt : F, opts = side_opts<kKnown, kBits>(sp);
  const int64_t C = sp.C, b = at.b, gr = at.gr, gc = at.gc;
  uint8_t* scale = sp.scale + b * sp.sbytes;
  if (fmt == kNvfp4) {
    static_assert(N == 16 || F != kNvfp4, "NVFP4 chunks are whole 1x16 blocks");
    const uint8_t sbyte = nvfp4_scale_byte(amax, tscale);  // the scale's E4M3 byte; dec is its value
    const float dec = e4m3_value(sbyte);
    *at.scale() = sbyte;
    const float enc = nvfp4_encode_mult(dec, tscale);
    // |v| <= amax, so amax * enc finite (not NaN) bounds every v * enc
    const bool sr = opts & kStochastic, finite = amax * enc <= 3.4e38f;
    const float mult = vscale * enc;  // (v * vscale) * enc, the same float: both products exact
    if (kMayDecode && (opts & kDecoded)) {  // the values (times the block's scale) instead of the codes
      uint32_t pairs[N / 2];
      nvfp4_elements<N, kMaySR, Values>(v, mult, sr, finite, srs, at, [&](int i, float a, float c) {
        pairs[i] = bf16x2_e2m1_times(a, c, dec);
      });
      store_words<2 * N>(at.data(), pairs, 2 * at.valid, at.aligned());  // bfloat16: 2N bytes
      return;
    }
    // element pair i is byte i, the low nibble the even element; codes are 0..15, so the nibbles are added (a
    // shift and an addition each: one LEA) instead of shifted and ORed
    uint32_t words[N / 8] = {};
    nvfp4_elements<N, kMaySR, Codes>(v, mult, sr, finite, srs, at, [&](int i, uint32_t c0, uint32_t c1) {
      words[i / 4] += (c0 + (c1 << 4)) << (8 * (i % 4));
    });
    store_words<N / 2>(at.data(), words, (at.valid + 1) / 2, at.aligned());
    return;
  }
  float mult;
  if (fmt == kFp8Tensor) {
    mult = tscale;
  } else if (fmt == kMxfp8) {
    const uint8_t e = mx_scale_byte<T>(amax, sp.opts & kE5M2);
    mult = e8m0_reciprocal(e);
    if (gc % 32 == 0) scale[rows_inner_scale_index(gr, gc / 32, sp.R)] = e;
    encode_fp8_chunk<N, kMayDecode>(sp, b, gr * C + gc, gc, mult, v, e8m0_to_f32(e));
    return;
  } else {  // FP8 blockwise: 1x128 (a scale per row and 128 columns) or 128x128
    mult = block_scale(amax, sp.opts & kPow2);
    const int64_t nb = (C + 127) / 128;
    if (gc % 128 == 0 && (fmt == kFp8Block1 || gr % 128 == 0))
      reinterpret_cast<float*>(scale)[fmt == kFp8Block1 ? rows_inner_scale_index(gr, gc / 128, sp.R)
                                                        : (gr / 128) * nb + gc / 128] = scale_inv_of(mult);
  }
  encode_fp8_chunk<N, false>(sp, b, gr * C + gc, gc, mult, v);
}

// The register-tile kernel (cuda_quantize_regs.cu): 16-bit inputs, FP8 formats (register_tile_takes); it also
// makes the copies of an activation's gradient (act_grad_takes).
bool register_tile_takes(const QuantizeArgs& a);
bool act_grad_takes(const QuantizeArgs& a);
std::string launch_register_tile(const Params& p, int32_t dtype, int64_t batch, cudaStream_t s);

}  // namespace jaxhq
