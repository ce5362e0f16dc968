// The register-tile quantize kernel (QuantizeVariant kRegisterTile, the default) for bf16/fp16 inputs (and
// float32 read as bf16: kF32AsBF16) and the FP8 formats (per-tensor, MXFP8, blockwise). A CTA of 256 threads
// covers a 128x128 tile of x. Each thread loads an 8x8 block of it with eight 16-byte loads issued together
// (sixteen for float) and keeps it in registers as 16-bit values: its rowwise copy is 8 rows of 8 values, its
// columnwise copy the same registers read the other way. No element of x
// passes through shared memory. Block amaxes start as per-thread partials: the integer max of the 16-bit |x|
// patterns, which orders as the values do, with NaN patterns above inf. They meet in 17 KB of shared memory, where
// a thread per copy row turns them into the row's MXFP8 / 1x128 scales (row_scales), kept as float multipliers in
// 8 KB more, before the chunks are encoded (encode_rows: interior tiles without per-chunk checks).
// Numerics: cuda_quantize.cuh (mx_scale_byte, block_scale, encode_fp8_chunk, encode_chunk), shared with the tile
// kernel. With an activation (Params::act) the block is the activation's gradient, made from h and dy as it is
// loaded (load_block_act_grad; jaxhq_act_grad's kernel, act_grad_kernel, writes the same values).
//
// Thread layout: warp w, lane l -> block row rg = 4 (w % 4) + l / 8, block column cg = 8 (w / 4) + l % 8.
// Eight lanes read 128 contiguous bytes of a row; an MXFP8 block of either copy is 4 lanes of
// one warp. Stores: a rowwise FP8 row of a warp is 64 contiguous bytes, a columnwise one 32.
#include "cuda_common.cuh"
#include "cuda_launch.h"
#include "activation.h"
#include "cuda_quantize.cuh"

#include <algorithm>
#include <string>
#include <type_traits>

namespace jaxhq {
namespace {

constexpr int kTile = 128, kThreads = 256, kPart = 17;  // partial-amax row stride (odd: fewer bank conflicts)

// A copy row's block multipliers (row_scales) sit at [side][block of the tile][copy row] with a row stride of
// kTile + 1 words: the rowwise chunks of a warp read two blocks of four rows each, in eight banks.
constexpr int kRowStride = kTile + 1;

struct RegSmem {
  uint32_t part[2][kTile * kPart];  // [side][copy row * kPart + 8-element group]: max |x| pattern
  float mult[2][4 * kRowStride];    // [side][block * kRowStride + copy row]: the encode multiplier (1x128: block 0)
  float dec[2][4 * kRowStride];     // MXFP8: the block's scale, which a decoded copy's values take
  uint32_t tile;                    // max |x| pattern over the tile (128x128 blocks)
  unsigned xamax[kThreads / 32];    // per-warp max |x| (the amax output)
};

// One thread per copy row of side s (format F): the row's block scales in this tile, computed once instead of by
// every chunk of the block, stored to the scale array rows-inner (spec.h rows_inner_scale_index; MXFP8: the E8M0
// bytes of the tile's four blocks; 1x128: scale_inv) and kept in sm.mult (and, MXFP8, sm.dec) as the floats the
// chunks use, so that a chunk reads its multiplier instead of decoding its block's byte again. Returns the row's
// max |x| pattern over the tile's 128 columns.
template <typename T, int F>
__device__ __forceinline__ uint32_t row_scales(const Params& p, RegSmem& sm, int s, int64_t b, int cr, int64_t gr,
                                               int64_t gc0) {
  const uint32_t* part = sm.part[s] + cr * kPart;
  uint32_t blk[4], a = 0u;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    blk[i] = maxu(maxu(part[4 * i], part[4 * i + 1]), maxu(part[4 * i + 2], part[4 * i + 3]));
    a = maxu(a, blk[i]);
  }
  if constexpr (F == kMxfp8 || F == kFp8Block1) {
    const SideParams& sp = p.side[s];
    if (gr < sp.R) {
      uint8_t* scale = sp.scale + b * sp.sbytes;
      if constexpr (F == kMxfp8) {
        const int64_t nb = (sp.C + 31) / 32, blk0 = gc0 / 32;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint8_t e = mx_scale_byte<T>(bits_to_f32<T>(blk[i]), sp.opts & kE5M2);
          sm.mult[s][i * kRowStride + cr] = e8m0_reciprocal(e);
          sm.dec[s][i * kRowStride + cr] = e8m0_to_f32(e);
          // a byte per block column, the warp's 32 rows side by side (spec.h rows_inner_scale_index)
          if (blk0 + i < nb) scale[rows_inner_scale_index(gr, blk0 + i, sp.R)] = e;
        }
      } else {
        const float mult = block_scale(bits_to_f32<T>(a), sp.opts & kPow2);
        sm.mult[s][cr] = mult;
        reinterpret_cast<float*>(scale)[rows_inner_scale_index(gr, gc0 / 128, sp.R)] = scale_inv_of(mult);
      }
    }
  }
  return a;
}

// The 8x8 block of x at tile rows 8 rg.., columns 8 cg.. as 8 rows of 4 packed 16-bit words, zero outside x.
// In = float: float32 x read as its bfloat16 roundings (kF32AsBF16), two 16-byte loads per row.
template <typename In>
__device__ __forceinline__ void load_block(const In* __restrict__ x, int64_t m, int64_t k, int64_t r, int64_t c,
                                           bool vec, uint32_t (&w)[8][4]) {
  if constexpr (std::is_same_v<In, float>) {
    if (vec) {
      float4 q[8][2];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) q[j][h] = __ldg(reinterpret_cast<const float4*>(x + (r + j) * k + c) + h);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          w[j][2 * h] = bf16_pair(q[j][h].x, q[j][h].y);
          w[j][2 * h + 1] = bf16_pair(q[j][h].z, q[j][h].w);
        }
      return;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t rr = r + j, c0 = c + 2 * i;
        const float lo = (rr < m && c0 < k) ? x[rr * k + c0] : 0.0f;
        const float hi = (rr < m && c0 + 1 < k) ? x[rr * k + c0 + 1] : 0.0f;
        w[j][i] = bf16_pair(lo, hi);
      }
    return;
  }
  if (vec) {
    uint4 q[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = __ldg(reinterpret_cast<const uint4*>(x + (r + j) * k + c));
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      w[j][0] = q[j].x;
      w[j][1] = q[j].y;
      w[j][2] = q[j].z;
      w[j][3] = q[j].w;
    }
    return;
  }
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t rr = r + j, c0 = c + 2 * i;
      const uint32_t lo = (rr < m && c0 < k) ? xs[rr * k + c0] : 0u;
      const uint32_t hi = (rr < m && c0 + 1 < k) ? xs[rr * k + c0 + 1] : 0u;
      w[j][i] = lo | (hi << 16);
    }
}

// The activation's gradient (activation.h) of 8 consecutive columns of one row, rounded to bfloat16 pairs, from
// 16-byte words of h (x, or the gate g), of the gate's partner u (gated, gate half) and of dy. part: 0 plain,
// 1 a gate column, 2 an up column. Not inlined: eight calls per block instead of 64 inlined copies of every
// activation's code (which made the kernel ten times the size of the one without an activation, and slow).
__device__ JHQ_NOINLINE uint4 act_grad8(int32_t kind, int part, uint4 hq, uint4 uq, uint4 dq) {
  const uint32_t hw[4] = {hq.x, hq.y, hq.z, hq.w}, uw[4] = {uq.x, uq.y, uq.z, uq.w}, dw[4] = {dq.x, dq.y, dq.z, dq.w};
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float v[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float x = bf16_bits_to_f32(uint16_t(hw[i] >> (16 * e))), d = bf16_bits_to_f32(uint16_t(dw[i] >> (16 * e)));
      v[e] = part == 1 ? act_grad_gate(kind, x, bf16_bits_to_f32(uint16_t(uw[i] >> (16 * e))), d)
                       : part == 2 ? act_grad_up(kind, x, d) : act_grad_plain(kind, x, d);
    }
    o[i] = bf16_pair(v[0], v[1]);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// act_grad8 for a gate column group and its up column group at once (from one read of g, u and dy): the gate's
// gradient returned, the up's in `up`.
__device__ JHQ_NOINLINE uint4 act_grad8_pair(int32_t kind, uint4 gq, uint4 uq, uint4 dq, uint4& up) {
  const uint32_t gw[4] = {gq.x, gq.y, gq.z, gq.w}, uw[4] = {uq.x, uq.y, uq.z, uq.w}, dw[4] = {dq.x, dq.y, dq.z, dq.w};
  uint32_t o[4], q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float a[2], c[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float g = bf16_bits_to_f32(uint16_t(gw[i] >> (16 * e))), d = bf16_bits_to_f32(uint16_t(dw[i] >> (16 * e)));
      act_grad_gate_up(kind, g, bf16_bits_to_f32(uint16_t(uw[i] >> (16 * e))), d, a[e], c[e]);
    }
    o[i] = bf16_pair(a[0], a[1]);
    q[i] = bf16_pair(c[0], c[1]);
  }
  up = make_uint4(q[0], q[1], q[2], q[3]);
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// A gated activation whose halves are whole tiles: a CTA makes a gate tile and the up tile F columns to its right
// from one read of g, u and dy (paired_tiles), the up block waiting in shared memory (the stash).
__host__ __device__ inline bool paired_tiles(const Params& p) {
  return (p.act & kActGated) && (p.k / 2) % kTile == 0;
}
// Not MXFP8's instantiation: it spilled with a pair's second block in flight at three CTAs per SM (0.6x the launch
// of one tile per CTA, docs/ffi.md), so it makes one tile per CTA (the pair code is not compiled into it).
template <bool kAct, int F>
constexpr bool kPairs = kAct && F != kMxfp8;
// The stash: 32 words (an 8x8 bf16 block) per thread, word i of thread t at i * 256 + t.
constexpr int kStashWords = 32 * kThreads;

// activation.h's act_grad_at kept out of line (partial blocks call it per element).
__device__ JHQ_NOINLINE float act_grad_elem(int32_t act, const uint16_t* h_row, const uint16_t* dy_row, int64_t c,
                                           int64_t dk) {
  return act_grad_at(act, h_row, dy_row, c, dk);
}

// load_block's 8x8 block of the activation's gradient (p.act) instead of x's, from h (x's place) and dy. A block
// inside h (16-byte aligned rows; gated: half widths a multiple of 8, so the block lies in one half) takes 16-byte
// loads, four rows' loads issued before their arithmetic.
__device__ __forceinline__ void load_block_act_grad(const Params& p, int64_t b, int64_t r, int64_t c, bool vec,
                                                    uint32_t (&w)[8][4]) {
  const int32_t kind = p.act & ~kActGated;
  const bool gated = p.act & kActGated;
  const int64_t m = p.m, k = p.k, dk = gated ? k / 2 : k;
  const uint16_t* h = static_cast<const uint16_t*>(p.x) + b * m * k;
  const uint16_t* dy = static_cast<const uint16_t*>(p.dy) + b * m * dk;
  if (vec && (!gated || dk % 8 == 0)) {
    const int part = !gated ? 0 : c < dk ? 1 : 2;
    const int64_t hc = part == 2 ? c - dk : c;  // the column of g (or x) in h, and of dy
#pragma unroll
    for (int j0 = 0; j0 < 8; j0 += 4) {
      uint4 hq[4], dq[4], uq[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        hq[j] = __ldg(reinterpret_cast<const uint4*>(h + (r + j0 + j) * k + hc));
        dq[j] = __ldg(reinterpret_cast<const uint4*>(dy + (r + j0 + j) * dk + hc));
        uq[j] = part == 1 ? __ldg(reinterpret_cast<const uint4*>(h + (r + j0 + j) * k + hc + dk)) : hq[j];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 o = act_grad8(kind, part, hq[j], uq[j], dq[j]);
        w[j0 + j][0] = o.x, w[j0 + j][1] = o.y, w[j0 + j][2] = o.z, w[j0 + j][3] = o.w;
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float v[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t rr = r + j, cc = c + 2 * i + e;
        v[e] = rr < m && cc < k ? act_grad_elem(p.act, h + rr * k, dy + rr * dk, cc, dk) : 0.0f;
      }
      w[j][i] = bf16_pair(v[0], v[1]);
    }
}

// load_block_act_grad for a gate block (columns c.. of h's first half) and its up block, a whole tile pair inside h
// or not: the gate block into w, the up block into `stash` (kStashWords: word i of thread t at i * 256 + t).
__device__ __forceinline__ void load_block_act_grad_pair(const Params& p, int64_t b, int64_t r, int64_t c, bool vec,
                                                         uint32_t (&w)[8][4], uint32_t* stash) {
  const int32_t kind = p.act & ~kActGated;
  const int64_t m = p.m, k = p.k, dk = k / 2;
  const uint16_t* h = static_cast<const uint16_t*>(p.x) + b * m * k;
  const uint16_t* dy = static_cast<const uint16_t*>(p.dy) + b * m * dk;
  if (vec) {
#pragma unroll
    for (int j0 = 0; j0 < 8; j0 += 4) {
      uint4 gq[4], dq[4], uq[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        gq[j] = __ldg(reinterpret_cast<const uint4*>(h + (r + j0 + j) * k + c));
        uq[j] = __ldg(reinterpret_cast<const uint4*>(h + (r + j0 + j) * k + c + dk));
        dq[j] = __ldg(reinterpret_cast<const uint4*>(dy + (r + j0 + j) * dk + c));
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint4 up;
        const uint4 o = act_grad8_pair(kind, gq[j], uq[j], dq[j], up);
        w[j0 + j][0] = o.x, w[j0 + j][1] = o.y, w[j0 + j][2] = o.z, w[j0 + j][3] = o.w;
        const int i0 = 4 * (j0 + j);
        stash[(i0 + 0) * kThreads + threadIdx.x] = up.x;
        stash[(i0 + 1) * kThreads + threadIdx.x] = up.y;
        stash[(i0 + 2) * kThreads + threadIdx.x] = up.z;
        stash[(i0 + 3) * kThreads + threadIdx.x] = up.w;
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float v[2], u[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t rr = r + j, cc = c + 2 * i + e;
        const bool in = rr < m && cc < dk;
        v[e] = in ? act_grad_elem(p.act, h + rr * k, dy + rr * dk, cc, dk) : 0.0f;
        u[e] = in ? act_grad_elem(p.act, h + rr * k, dy + rr * dk, cc + dk, dk) : 0.0f;
      }
      w[j][i] = bf16_pair(v[0], v[1]);
      stash[(4 * j + i) * kThreads + threadIdx.x] = bf16_pair(u[0], u[1]);
    }
}

// jaxhq_act_grad: the gradient written as bfloat16 [rows, k], 8 columns per thread.
__global__ void act_grad_kernel(const uint16_t* __restrict__ h, const uint16_t* __restrict__ dy, int32_t act,
                                int64_t rows, int64_t k, uint16_t* __restrict__ out) {
  const bool gated = act & kActGated;
  const int64_t dk = gated ? k / 2 : k, groups = (k + 7) / 8;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * groups;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / groups, c = (i % groups) * 8;
    const uint16_t* hr = h + row * k;
    const uint16_t* dr = dy + row * dk;
    if (k % 8 == 0 && (!gated || dk % 8 == 0)) {
      const int part = !gated ? 0 : c < dk ? 1 : 2;
      const int64_t hc = part == 2 ? c - dk : c;
      const uint4 hq = __ldg(reinterpret_cast<const uint4*>(hr + hc));
      const uint4 dq = __ldg(reinterpret_cast<const uint4*>(dr + hc));
      const uint4 uq = part == 1 ? __ldg(reinterpret_cast<const uint4*>(hr + hc + dk)) : hq;
      *reinterpret_cast<uint4*>(out + row * k + c) = act_grad8(act & ~kActGated, part, hq, uq, dq);
    } else {
      for (int64_t cc = c; cc < c + 8 && cc < k; ++cc)
        out[row * k + cc] = f32_to_bf16_bits(act_grad_elem(act, hr, dr, cc, dk));
    }
  }
}

// Element e (0..7) of copy row t (0..7) of this thread's block: side 0 reads row t, side 1 column t.
__device__ __forceinline__ uint32_t element(const uint32_t (&w)[8][4], int s, int t, int e) {
  return s == 0 ? half_of(w[t][e / 2], e % 2) : half_of(w[e][t / 2], t % 2);
}

// This thread's 8 chunks of side s's copy (format F): copy rows tr0 + cr0 + t, 8 elements from column gc. FP8
// formats take their multiplier as row_scales (MXFP8, 1x128), the tile (128x128, from `tmult`) or the copy (per
// tensor) gives it, without recomputing it per chunk. kInside: the whole tile lies inside the copy and its rows'
// 8-byte stores are aligned (no per-chunk checks); kE5: the codes' format when fixed (encode_fp8_chunk).
template <typename T, int F, bool kInside, int kE5>
__device__ __forceinline__ void encode_rows(const Params& p, const RegSmem& sm, int s, int64_t b, int cr0, int grp,
                                            int64_t tr0, int64_t gc, const uint32_t (&w)[8][4], float ts,
                                            float tmult) {
  const SideParams& sp = p.side[s];
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const int cr = cr0 + t;
    const int64_t gr = tr0 + cr;
    if (!kInside && (gr >= sp.R || gc >= sp.C)) continue;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = bits_to_f32<T>(element(w, s, t, e));
    const int64_t off = gr * sp.C + gc;
    if constexpr (F == kMxfp8) {  // the scales are row_scales'
      const int i = (grp >> 2) * kRowStride + cr;
      encode_fp8_chunk<8, true, kE5, kInside>(sp, b, off, gc, sm.mult[s][i], v, sm.dec[s][i]);
    } else if constexpr (F == kFp8Block1) {
      encode_fp8_chunk<8, false, kE5, kInside>(sp, b, off, gc, sm.mult[s][cr], v);
    } else {
      encode_fp8_chunk<8, false, kE5, kInside>(sp, b, off, gc, F == kFp8Block2 ? tmult : ts, v);
    }
  }
}

// Side s's copy (format F, fixed at compile time) of this thread's 8 copy rows. A tile inside the copy whose rows
// take aligned 8-byte stores (every tile of a copy with whole tiles and C % 8 == 0) runs encode_rows with no
// per-chunk checks and the codes' format fixed; the others check each chunk.
template <typename T, int F>
__device__ __forceinline__ void encode_side(const Params& p, const RegSmem& sm, int s, int64_t b, int rg, int cg,
                                            int64_t r0, int64_t c0, const uint32_t (&w)[8][4], float ts) {
  if constexpr (F != kNone) {
    const SideParams& sp = p.side[s];
    const int cr0 = s == 0 ? 8 * rg : 8 * cg;  // this thread's first copy row in the tile
    const int grp = s == 0 ? cg : rg;          // its 8-element group along the copy row
    const int64_t tr0 = s == 0 ? r0 : c0, tc0 = s == 0 ? c0 : r0, gc = tc0 + 8 * grp;  // in the copy
    float tmult = 0.0f;
    if constexpr (F == kFp8Block2) {  // the tile is one 128x128 block: its scale, written by the first thread
      tmult = block_scale(bits_to_f32<T>(sm.tile), sp.opts & kPow2);
      if (threadIdx.x == 0)
        reinterpret_cast<float*>(sp.scale + b * sp.sbytes)[(tr0 / kTile) * ((sp.C + kTile - 1) / kTile) +
                                                            tc0 / kTile] = scale_inv_of(tmult);
    }
    if (tr0 + kTile <= sp.R && tc0 + kTile <= sp.C && sp.C % 8 == 0) {
      if (sp.opts & kE5M2) encode_rows<T, F, true, 1>(p, sm, s, b, cr0, grp, tr0, gc, w, ts, tmult);
      else encode_rows<T, F, true, 0>(p, sm, s, b, cr0, grp, tr0, gc, w, ts, tmult);
    } else {
      encode_rows<T, F, false, -1>(p, sm, s, b, cr0, grp, tr0, gc, w, ts, tmult);
    }
  }
}

// F0, F1: the rowwise and columnwise formats (kNone: that copy is not made), fixed per instantiation so that a
// kernel holds only its formats' code (one kernel for every pair was 44k instructions, and warps waited on the
// instruction cache).
// In: x's type in memory (T, or float read as bfloat16: kF32AsBF16).
// With 16-bit x, four CTAs per SM: the bound holds the compiler to 64 registers (it took 64-80, so three fit, and the
// kernel, one load phase per CTA, waited on memory; spills of 8-16 bytes at most). H200, 16384^2 bf16, three
// alternating rounds: mxfp8 0.515 -> 0.443 ms, fp8_block 1x128 0.451 -> 0.379, 128x128 0.392 -> 0.320; no change
// on the H100, whose HBM needs fewer bytes in flight. Float32 x keeps the compiler's choice (four CTAs: 3-5%
// slower on the H100, docs/ffi.md).
template <typename In>
constexpr int kMinBlocks = sizeof(In) == 2 ? 4 : 1;

// A tile's copies from this thread's block w of it (x's, or the activation's gradient): the partial amaxes, the
// block scales, the encoded chunks.
template <typename T, int F0, int F1>
__device__ __forceinline__ void encode_tile(const Params& p, RegSmem& sm, int64_t b, int64_t r0, int64_t c0, int rg,
                                            int cg, const uint32_t (&w)[8][4], const float (&ts)[2]) {
  // Per-thread partials: max |x| of each of its 8 rows (over 8 columns) and 8 columns (over 8 rows).
  uint32_t colw[4] = {0u, 0u, 0u, 0u}, xm = 0u;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    uint32_t rw = 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t a = w[j][i] & 0x7FFF7FFFu;
      rw = vmax2(rw, a);
      colw[i] = vmax2(colw[i], a);
    }
    sm.part[0][(8 * rg + j) * kPart + cg] = max_halves(rw);
    xm = maxu(xm, max_halves(rw));
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) sm.part[1][(8 * cg + i) * kPart + rg] = half_of(colw[i / 2], i % 2);
  if (threadIdx.x == 0) sm.tile = 0u;
  if (p.amax) cta_amax_partial(f2u(bits_to_f32<T>(xm)), sm.xamax);  // the 16-bit |x| pattern as float bits
  __syncthreads();
  if (p.amax) cta_amax_finish(sm.xamax, kThreads / 32, p.amax + b);

  // Block scales per copy row (MXFP8, 1x128) and the tile's amax (128x128): a thread per (side, copy row).
  constexpr bool kRowPhase = F0 == kMxfp8 || F1 == kMxfp8 || F0 == kFp8Block1 || F1 == kFp8Block1 ||
                             F0 == kFp8Block2 || F1 == kFp8Block2;
  if constexpr (kRowPhase) {
    const int s = threadIdx.x / kTile, cr = threadIdx.x % kTile;
    const int64_t gr = (s == 0 ? r0 : c0) + cr, gc0 = s == 0 ? c0 : r0;  // the copy row, the tile's first column
    const uint32_t a =
        s == 0 ? row_scales<T, F0>(p, sm, 0, b, cr, gr, gc0) : row_scales<T, F1>(p, sm, 1, b, cr, gr, gc0);
    if (s == 0) atomicMax(&sm.tile, a);
    __syncthreads();
  }
  encode_side<T, F0>(p, sm, 0, b, rg, cg, r0, c0, w, ts[0]);
  encode_side<T, F1>(p, sm, 1, b, rg, cg, r0, c0, w, ts[1]);
}

// kAct: the copies are of the activation's gradient (load_block_act_grad; In is bfloat16, h's type); a gated one
// whose halves are whole tiles makes a gate tile and its up tile per CTA (paired_tiles; kPairs: the FP8 formats).
template <typename In, typename T, int F0, int F1, bool kAct = false>
__global__ void __launch_bounds__(kThreads, kAct ? 3 : kMinBlocks<In>) quantize_regs_kernel(Params p) {
  RegSmem& sm = *dynamic_smem<RegSmem>();
  const int64_t b = blockIdx.z;
  const int64_t r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rg = 4 * (warp & 3) + (lane >> 3), cg = 8 * (warp >> 2) + (lane & 7);
  const In* x = static_cast<const In*>(p.x) + b * p.m * p.k;
  const bool vec = r0 + kTile <= p.m && c0 + kTile <= p.k && p.k % 8 == 0;  // the same for the whole CTA
  const bool paired = kPairs<kAct, F0> && paired_tiles(p);
  uint32_t* stash = reinterpret_cast<uint32_t*>(&sm + 1);  // kAct: the up block of a paired gate block

  uint32_t w[8][4];
  if constexpr (!kAct) load_block<In>(x, p.m, p.k, r0 + 8 * rg, c0 + 8 * cg, vec, w);
  else if (paired) load_block_act_grad_pair(p, b, r0 + 8 * rg, c0 + 8 * cg, vec, w, stash);
  else load_block_act_grad(p, b, r0 + 8 * rg, c0 + 8 * cg, vec, w);
  const float ts[2] = {copy_scalar(p, 0, b), copy_scalar(p, 1, b)};
  write_scale_inv(p, b, ts);
  encode_tile<T, F0, F1>(p, sm, b, r0, c0, rg, cg, w, ts);
  if (paired) {  // the up tile, F columns to the right, once every thread is done with the gate tile
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 32; ++i) w[i / 4][i % 4] = stash[i * kThreads + threadIdx.x];
    encode_tile<T, F0, F1>(p, sm, b, r0, c0 + p.k / 2, rg, cg, w, ts);
  }
}

template <typename In, typename T, int F0, int F1, bool kAct = false>
std::string launch_pair(const Params& p, int64_t batch, cudaStream_t s) {
  const bool paired = kPairs<kAct, F0> && paired_tiles(p);  // a CTA per gate tile, which makes its up tile too
  const int64_t cols = paired ? p.k / 2 : p.k;
  dim3 grid(unsigned((cols + kTile - 1) / kTile), unsigned((p.m + kTile - 1) / kTile), unsigned(batch));
  const size_t smem = sizeof(RegSmem) + (paired ? sizeof(uint32_t) * kStashWords : 0);
  launch_kernel(quantize_regs_kernel<In, T, F0, F1, kAct>, grid, dim3(kThreads), smem, s, p);
  return cuda_status();
}

// fn(std::integral_constant<int, F>) for the format f the register-tile kernel takes (register_tile_takes).
template <typename Fn>
std::string with_format(int f, Fn&& fn) {
  switch (f) {
    case kNone: return fn(std::integral_constant<int, kNone>{});
    case kFp8Tensor: return fn(std::integral_constant<int, kFp8Tensor>{});
    case kMxfp8: return fn(std::integral_constant<int, kMxfp8>{});
    case kFp8Block1: return fn(std::integral_constant<int, kFp8Block1>{});
    case kFp8Block2: return fn(std::integral_constant<int, kFp8Block2>{});
    default: return "the register-tile kernel does not take format " + std::to_string(f);
  }
}

// The instantiation for this call's (rowwise, columnwise) formats; an activation gradient's copies: one format on
// both sides (act_grad_takes).
template <typename In, typename T = In>
std::string launch_t(const Params& p, int64_t batch, cudaStream_t s) {
  if constexpr (std::is_same_v<In, __nv_bfloat16>) {
    if (p.act) {
      return with_format(p.side[0].fmt, [&](auto f) {
        return launch_pair<In, T, decltype(f)::value, decltype(f)::value, true>(p, batch, s);
      });
    }
  }
  return with_format(p.side[0].fmt, [&](auto f0) {
    return with_format(p.side[1].fmt, [&](auto f1) {
      return launch_pair<In, T, decltype(f0)::value, decltype(f1)::value>(p, batch, s);
    });
  });
}

}  // namespace

// bf16/fp16 (or float32 read as bf16) without an NVFP4 side. NVFP4 runs slower here than in the tile kernel
// (H100, 16384^2: 3.08 against 1.99 ms; twice the per-block scale work on 8-element chunks), and the RHT is not
// written here; FP8 per-tensor, MXFP8 and FP8 blockwise run 1.3-1.6x faster (docs/ffi.md).
bool register_tile_takes(const QuantizeArgs& a) {
  return (a.dtype == kBF16 || a.dtype == kF16 || a.dtype == kF32AsBF16) && a.row.fmt != kNvfp4 &&
         a.col.fmt != kNvfp4;
}

std::string launch_act_grad(const void* h, const void* dy, int32_t act, int64_t rows, int64_t k, uint16_t* out,
                            void* stream) {
  const int64_t n = rows * ((k + 7) / 8);
  if (n == 0) return std::string();
  const unsigned blocks = unsigned(std::min<int64_t>((n + 255) / 256, int64_t(1) << 30));  // a grid-stride loop
  launch_kernel(act_grad_kernel, dim3(blocks), dim3(256), 0, static_cast<cudaStream_t>(stream),
                static_cast<const uint16_t*>(h), static_cast<const uint16_t*>(dy), act, rows, k, out);
  return cuda_status();
}

bool act_grad_takes(const QuantizeArgs& a) {
  return a.dtype == kBF16 && a.row.fmt == a.col.fmt && a.row.fmt != kNone && register_tile_takes(a);
}

std::string launch_register_tile(const Params& p, int32_t dtype, int64_t batch, cudaStream_t s) {
  switch (dtype) {
    case kBF16: return launch_t<__nv_bfloat16>(p, batch, s);
    case kF32AsBF16: return launch_t<float, __nv_bfloat16>(p, batch, s);
    default: return launch_t<__half>(p, batch, s);
  }
}

}  // namespace jaxhq
