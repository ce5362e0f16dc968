// NVFP4 GEMM on Hopper tensor cores with the operands decoded on chip; see fp8_wgmma.h and docs/gemm.md ("NVFP4
// decoded on chip").
//
// The E2M1 codes and E4M3 block scales stream from HBM into a 3-stage shared-memory ring (TMA, one producer
// thread), a 128-wide K tile of both operands per stage: 0.5 byte per element plus a scale per 16, a quarter of
// what the bf16 operands of the dequantize path move. Output tiles are 128 x 256, each consumer warpgroup 64 rows
// (decoding costs instructions per element, and a wide tile spreads each decoded element over more products). For
// each 64-wide half of a K tile the two consumer warpgroups decode their A fragments straight into registers and
// B's 256 rows into an fp16 tile in shared memory (128-byte swizzle, the layout wgmma reads; each warpgroup half of
// the rows), meet at a named barrier, and run four m64n256k16 fp16 wgmmas (A from registers), FP32 accumulation.
// Three B buffers let a half be decoded while the tensor core works on the one before (the buffer written at half
// h was last read by the wgmmas of half h - 3, which both warpgroups have waited for before they met at the
// barrier of half h - 1), and two sets of A fragments alternate likewise.
//
// Exactness: the decoded operand is e2m1 * scale * 2^-8, exact in fp16 (nvfp4_decode.cuh), and products of fp16
// operands are exact in the tensor core, so the result is the dequantize path's up to summation order; the
// epilogue multiplies by 2^16 times the two global decodes (2^16 is exact: this rounds as that path's alpha). The
// decode writes the eight elements of a 32-bit code word in the order 0, 4, 1, 5, 2, 6, 3, 7 (two shifts and a mask
// per fp16 pair), and a thread's A fragment (K pairs 2c, 2c + 1 and 2c + 8, 2c + 9 of a k16 step) takes codes c,
// c + 4 of the block's two words: A and B are permuted alike, so the contraction is unchanged.
#include "fp8_wgmma.h"
#include "nvfp4_decode.cuh"
#include "wgmma_common.cuh"

namespace jaxhq {
namespace gemm {
namespace {

using namespace wg;

constexpr int kTN = 256;  // output tile columns
constexpr int kStages = 3, kThreads = 384, kBufs = 3;
constexpr int kCodeBytesA = kBM * kBK / 2, kCodeBytesB = kTN * kBK / 2;  // E2M1 codes of a K tile: 8 / 16 KiB
constexpr int kSlots = kBK / 16;                                         // NVFP4 blocks per K tile
constexpr int kSBytes = (kSlots * kSRows * 4 + 127) / 128 * 128;         // one 132-row scale box
// A's codes, B's codes, A's scale box, B's two scale boxes (rows 0-127 and 128-255 of its tile)
constexpr int kStageBytes = (kCodeBytesA + kCodeBytesB + 3 * kSBytes + 1023) / 1024 * 1024;  // 37 KiB
constexpr int kTxBytes = kCodeBytesA + kCodeBytesB + 3 * kSlots * kSRows * 4;
constexpr int kHalf = 64;                                 // K per decoded half: one 128-byte fp16 row
constexpr int kBufBytes = kTN * kHalf * 2;                // B's 256 rows, 32 KiB
constexpr int kSmemBytes = kStages * kStageBytes + kBufs * kBufBytes + 1024 + 2 * kStages * 8;
static_assert(kStageBytes % 1024 == 0 && kBufBytes % 1024 == 0, "decode buffers keep 128-byte swizzle alignment");

// NVFP4 scales E4M3 [rows, k / 16] -> words [ceil(k / 128)][8][ld] (nvfp4_scale_word), zero past K and past the
// last row.
__global__ void nvfp4_tile_scales_kernel(const uint8_t* __restrict__ s, int64_t rows, int64_t k, int64_t ld,
                                         uint32_t* __restrict__ out) {
  const int64_t nb = k / 16, total = cdiv(k, kBK) * kSlots * ld;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i % ld, blk = i / ld;
    out[i] = r < rows && blk < nb ? nvfp4_scale_word(s[r * nb + blk]) : 0u;
  }
}

// One m64n256k16 fp16 wgmma, A from registers (this thread's fragment: rows rl and rl + 8, K pairs 2c and
// 2c + 8 of the 16, c = lane % 4), B from shared memory.
__device__ __forceinline__ void wgmma_f16_m64n256k16(float (&d)[128], const uint32_t* a, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, "
      "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

template <bool kF32>
__global__ void __launch_bounds__(kThreads, 1)
    nvfp4_wgmma_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                       const __grid_constant__ CUtensorMap tm_sa, const __grid_constant__ CUtensorMap tm_sb,
                       const Params p) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma and setmaxnreg exist on sm_90a only; the host never launches this elsewhere
#else
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  uint8_t* bufs = smem + kStages * kStageBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(bufs + kBufs * kBufBytes);
  uint64_t* empty = full + kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 8);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  // Persistent: CTA b takes tiles b, b + gridDim.x, ...; q counts K tiles over all of them (ring slot q % kStages,
  // phase (q / kStages) & 1), h counts decoded halves (buffer h % kBufs).
  const int tiles = p.slots * p.cols, ktiles = int(cdiv(p.k, kBK)), wg = threadIdx.x / 128;

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int q = 0;
      for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int64_t row0, row_end;
        int col;
        if (tile_rows(p, tile, 0, &row0, &row_end, &col) < 0) continue;
        const int brow0 = col * kTN;
        for (int kt = 0; kt < ktiles; ++kt, ++q) {
          const int s = q % kStages;
          if (q >= kStages) mbar_wait(&empty[s], ((q / kStages) - 1) & 1);
          uint8_t* st = smem + s * kStageBytes;
          mbar_expect_tx(&full[s], kTxBytes);
          tma_2d(st, &tm_a, &full[s], kt * (kBK / 2), int(row0));
          tma_2d(st + kCodeBytesA, &tm_b, &full[s], kt * (kBK / 2), brow0);
          uint8_t* sc = st + kCodeBytesA + kCodeBytesB;
          tma_3d(sc, &tm_sa, &full[s], int(row0) & ~3, 0, kt);
          tma_3d(sc + kSBytes, &tm_sb, &full[s], brow0, 0, kt);  // brow0: a multiple of 256
          tma_3d(sc + 2 * kSBytes, &tm_sb, &full[s], brow0 + 128, 0, kt);
        }
      }
    }
  } else {  // consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int cw = wg - 1, t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
    const int rl = warp * 16 + lane / 4;  // this thread's accumulator rows in the warpgroup's 64: rl and rl + 8
    const int cl = 2 * (lane % 4);        // its columns: 8 i + cl and 8 i + cl + 1, i < 32
    const int chunk = t % 8, rgroup = t / 8;  // B decode: 8-element chunk `chunk` of rows cw * 128 + rgroup + 16 i
    const int ra = cw * 64 + rl, c4 = lane % 4;  // A fragment rows ra, ra + 8 of the tile
    float acc[128];
    uint32_t af[2][16];  // the A fragments of the two halves in flight: [half][4 * k16 step + register]
#pragma unroll
    for (int i = 0; i < 16; ++i) af[0][i] = 0u, af[1][i] = 0u;
    int q = 0, h = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      int64_t row0, row_end;
      int tcol;
      if (tile_rows(p, tile, 0, &row0, &row_end, &tcol) < 0) continue;
      const int n0 = tcol * kTN;
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
      for (int kt = 0; kt < ktiles; ++kt, ++q) {
        const int s = q % kStages;
        mbar_wait(&full[s], (q / kStages) & 1);
        const uint8_t* st = smem + s * kStageBytes;
        const uint32_t* sc_a = reinterpret_cast<const uint32_t*>(st + kCodeBytesA + kCodeBytesB) + (row0 & 3);
#pragma unroll
        for (int half = 0; half < 2; ++half, ++h) {
          // A: this thread's fragments of the half's four k16 steps, decoded into registers. Block j's two code
          // words give K pairs (c, c + 4) and (8 + c, 12 + c) of the block: the order decode8 writes B in.
          uint32_t w[2][8];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const uint4* src = reinterpret_cast<const uint4*>(st + (ra + 8 * e) * (kBK / 2) + half * 32);
            const uint4 lo = src[0], hi = src[1];
            w[e][0] = lo.x, w[e][1] = lo.y, w[e][2] = lo.z, w[e][3] = lo.w;
            w[e][4] = hi.x, w[e][5] = hi.y, w[e][6] = hi.z, w[e][7] = hi.w;
          }
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            const int j = 4 * half + jj;
            const uint32_t s0 = sc_a[j * kSRows + ra], s1 = sc_a[j * kSRows + ra + 8];
            af[half][4 * jj + 0] = decode_pair(w[0][2 * jj], c4, s0);
            af[half][4 * jj + 1] = decode_pair(w[1][2 * jj], c4, s1);
            af[half][4 * jj + 2] = decode_pair(w[0][2 * jj + 1], c4, s0);
            af[half][4 * jj + 3] = decode_pair(w[1][2 * jj + 1], c4, s1);
          }
          // B: this warpgroup's 128 of the 256 rows (its own scale box), into the shared decode buffer
          uint8_t* buf = bufs + (h % kBufs) * kBufBytes;
          const uint32_t* sc_b = reinterpret_cast<const uint32_t*>(st + kCodeBytesA + kCodeBytesB + (1 + cw) * kSBytes);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int r = cw * 128 + rgroup + 16 * i;
            const uint32_t wb =
                *reinterpret_cast<const uint32_t*>(st + kCodeBytesA + r * (kBK / 2) + half * 32 + chunk * 4);
            const uint32_t scale = sc_b[(4 * half + chunk / 2) * kSRows + r - cw * 128];
            *reinterpret_cast<uint4*>(buf + r * 128 + ((chunk ^ (r & 7)) << 4)) = decode8(wb, scale);
          }
          if (half == 1) release(empty, s, lane, 1, 0);  // this warp has read stage s
          // the decoded tile, written through the generic proxy, is read by wgmma (the async proxy)
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          asm volatile("bar.sync 1, 256;" ::: "memory");
#pragma unroll
          for (int i = 0; i < 128; ++i) fence_operand(acc[i]);
#pragma unroll
          for (int i = 0; i < 16; ++i) fence_operand(af[half][i]);
          asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
          const uint32_t b_addr = smem_u32(buf);
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) wgmma_f16_m64n256k16(acc, &af[half][4 * jj], sw128_desc(b_addr + 32 * jj));
          asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
          asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
#pragma unroll
          for (int i = 0; i < 128; ++i) fence_operand(acc[i]);
#pragma unroll
          for (int i = 0; i < 16; ++i) fence_operand(af[half ^ 1][i]);  // the previous half's wgmmas are done
        }
      }
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
      for (int i = 0; i < 128; ++i) fence_operand(acc[i]);
      // 2^16 undoes the operands' 2^-8 each
      store_fragment<kF32>(p, acc, row0 + cw * 64 + rl, row_end, n0 + cl, 65536.0f * p.alpha_a[0], 0);
    }
  }
#endif
}

// Why the kernel cannot take these operands ("" when it can).
std::string nvfp4_wgmma_unsupported(int64_t a_rows, int64_t n, int64_t k) {
  if (k <= 0 || k % 32) return "K = " + std::to_string(k) + " is not a positive multiple of 32 (TMA row stride)";
  if (n % 2) return "N = " + std::to_string(n) + " is odd (paired output stores)";
  if (cdiv(a_rows, kBM) * cdiv(n, kTN) >= (int64_t(1) << 31) || n > (int64_t(1) << 30))
    return "too many output tiles for one launch";
  return "";
}

}  // namespace

int64_t nvfp4_wgmma_scale_bytes(int64_t rows, int64_t k) {
  return (cdiv(k, kBK) * kSlots * rows4(rows) * 4 + 255) / 256 * 256;
}

std::string nvfp4_wgmma_gemm(const WgmmaOperand& a, const WgmmaOperand& b, int64_t n, int64_t k, const float* alpha,
                             void* out, bool out_f32, const void* bias, bool accumulate, void* sa_tmp, void* sb_tmp,
                             cudaStream_t s) {
  if (std::string why = nvfp4_wgmma_unsupported(a.rows, n, k); !why.empty()) return why;
  for (const void* ptr :
       {static_cast<const void*>(a.data), static_cast<const void*>(b.data), static_cast<const void*>(out)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16) return "an operand is not 16-byte aligned";
  if (a.rows == 0 || n == 0) return "";
  for (int i = 0; i < 2; ++i) {
    const WgmmaOperand& o = i ? b : a;
    const int64_t ld = rows4(o.rows), total = cdiv(k, kBK) * kSlots * ld;
    nvfp4_tile_scales_kernel<<<unsigned(std::min<int64_t>(cdiv(total, 256), 4096)), 256, 0, s>>>(
        static_cast<const uint8_t*>(o.scales), o.rows, k, ld,
        static_cast<uint32_t*>(i ? sb_tmp : sa_tmp));
  }
  if (cudaError_t ce = cudaGetLastError(); ce != cudaSuccess)
    return std::string("scale re-layout: ") + cudaGetErrorString(ce);
  CUtensorMap maps[4] = {};
  for (const std::string& e : {make_map(&maps[0], a.data, 0, a.rows, k / 2, kBM, kBK / 2, false),
                        make_map(&maps[1], b.data, 0, b.rows, k / 2, kTN, kBK / 2, false),
                        make_map(&maps[2], sa_tmp, kSlots, a.rows, k),
                                 make_map(&maps[3], sb_tmp, kSlots, b.rows, k)})
    if (!e.empty()) return e;
  const Params p{out, bias, nullptr, alpha, nullptr, a.rows, n, k, 0, int32_t(accumulate),
                 int32_t(cdiv(a.rows, kBM)), int32_t(cdiv(n, kTN)), 1};
  return out_f32 ? launch_persistent(nvfp4_wgmma_kernel<true>, kThreads, kSmemBytes, maps, p, s)
                 : launch_persistent(nvfp4_wgmma_kernel<false>, kThreads, kSmemBytes, maps, p, s);
}

}  // namespace gemm
}  // namespace jaxhq
