// CUDA kernels of the FP8 cast (rules in fp8_format.h, reference in
// fp8_cast_cpu.cpp).
//
// A CTA owns one 128 x 128 tile of the input and holds it in registers:
// thread t reads 8 consecutive columns (one 16-byte vector of BF16) at column
// group t % 16 of rows 4 g .. 4 g + 3 and 64 + 4 g .. 64 + 4 g + 3 (g = t / 16),
// so half a warp reads one 256-byte row segment. Each row's codes go out as
// 8-byte stores. For the transposed copy, a thread's 4 consecutive rows give
// one 32-bit word per column; the words are staged in shared memory (word
// positions XOR-swizzled by column group, so a warp's stores hit 32 banks)
// and leave as 16-byte pieces of the transpose's rows.
//
// Tensor scaling with a computed scale and row scaling need the whole
// tensor's (row's, column's) amax before the first code: an amax pass over
// the same tiles runs first (row scaling: then a small kernel turns each
// row's and column's amax into its scale and reciprocal, once rather than
// in every tile). A given scale (delayed scaling) and block
// scaling need one pass, which also makes the amax.
// The element rule's division goes through the scale's reciprocal
// (div_by_scale in fp8_format.h, exact on the scales it is used for).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/fp8/fp8_cast.h"

namespace lowbit::fp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;                                        // columns per thread
constexpr int kColGroups = kBlockSize / kVec;                  // 16 threads span a tile row
constexpr int kRowGroups = kThreads / kColGroups;              // 16
constexpr int kGroupRows = 4;                                  // consecutive rows per thread and pass
constexpr int kPassRows = kRowGroups * kGroupRows;             // 64
constexpr int kPasses = kBlockSize / kPassRows;                // 2
constexpr int kWords = kBlockSize / kGroupRows;                // 32-bit words per transposed tile row
constexpr int kWarps = kThreads / 32;
static_assert(kPasses * kPassRows == kBlockSize && kColGroups * kVec == kBlockSize, "tile split");

// The tile's elements a thread owns, kept in the input's type (BF16 costs
// half the registers of FP32, which lets two CTAs share an SM).
template <typename T>
using TileValues = T[kPasses][kGroupRows][kVec];

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ void load8(const T* p, T* v) {
  static_assert(sizeof(T) * kVec % 16 == 0, "whole 16-byte vectors");
#pragma unroll
  for (int k = 0; k < int(sizeof(T)) * kVec / 16; ++k)
    reinterpret_cast<uint4*>(v)[k] = reinterpret_cast<const uint4*>(p)[k];
}

// NaN-propagating max of an amax (>= 0 or NaN) and |v|.
__device__ __forceinline__ float amax2(float a, float v) { return nan_propagating_absmax(a, v); }

// Amaxes are >= 0 (or a positive NaN, whose bits order above inf), so their
// bits order as unsigned and atomicMax on the bits is a float max.
__device__ __forceinline__ void atomic_amax(float* p, float v) {
  atomicMax(reinterpret_cast<unsigned*>(p), __float_as_uint(v));
}
__device__ __forceinline__ void atomic_amax(unsigned* p, float v) { atomicMax(p, __float_as_uint(v)); }

// Over the 16 lanes of a tile row (lanes sharing bits 4.. of the lane id);
// every lane gets the result.
__device__ __forceinline__ float row_amax(float v) {
#pragma unroll
  for (int o = kColGroups / 2; o > 0; o /= 2) v = amax2(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_amax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = amax2(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

struct Tile {
  int64_t row0, col0;  // the tile's first element
  int cg, g;           // this thread's column group and row group
  __device__ Tile() : Tile(int64_t(blockIdx.x) * kBlockSize, int64_t(blockIdx.y) * kBlockSize) {}
  __device__ Tile(int64_t r0, int64_t c0)
      : row0(r0), col0(c0), cg(int(threadIdx.x) % kColGroups), g(int(threadIdx.x) / kColGroups) {}
  __device__ int row(int pass, int q) const { return pass * kPassRows + g * kGroupRows + q; }
  __device__ int col(int e) const { return cg * kVec + e; }
};

// The tile's elements this thread owns (0 outside the tensor). `vec`: rows
// are 16-byte aligned with whole 8-element vectors (cols % 8 == 0).
template <typename T>
__device__ __forceinline__ void load_tile(const T* x, int64_t rows, int64_t cols, bool vec, const Tile& t,
                                          TileValues<T>& v) {
  const int64_t j0 = t.col0 + t.col(0);
  const bool whole = vec && j0 + kVec <= cols;
#pragma unroll
  for (int p = 0; p < kPasses; ++p)
#pragma unroll
    for (int q = 0; q < kGroupRows; ++q) {
      const int64_t i = t.row0 + t.row(p, q);
      if (i < rows && whole) {
        load8(x + i * cols + j0, v[p][q]);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[p][q][e] = i < rows && j0 + e < cols ? x[i * cols + j0 + e] : T(0.f);
      }
    }
}

template <typename T>
__device__ __forceinline__ float thread_amax(const TileValues<T>& v) {
  float m = 0.f;
#pragma unroll
  for (int p = 0; p < kPasses; ++p)
#pragma unroll
    for (int q = 0; q < kGroupRows; ++q)
#pragma unroll
      for (int e = 0; e < kVec; ++e) m = amax2(m, to_float(v[p][q][e]));
  return m;
}

// This thread's amax of each of its columns over its rows of the tile.
template <typename T>
__device__ __forceinline__ void thread_column_amaxes(const TileValues<T>& v, float (&c)[kVec]) {
#pragma unroll
  for (int e = 0; e < kVec; ++e)
#pragma unroll
    for (int p = 0; p < kPasses; ++p)
#pragma unroll
      for (int q = 0; q < kGroupRows; ++q) c[e] = amax2(c[e], to_float(v[p][q][e]));
}

// Each of this thread's columns' amax over the CTA's threads' column amaxes
// `c` (every row group's), through shared memory (`red` [kWarps][128],
// `col` [128]).
__device__ __forceinline__ void cta_column_amaxes(const float (&c)[kVec], const Tile& t, unsigned (*red)[kBlockSize],
                                                  unsigned* col, float (&out)[kVec]) {
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float both = amax2(c[e], __shfl_xor_sync(0xffffffffu, c[e], 16));  // the warp's other row group
    if (threadIdx.x % 32 < kColGroups) red[warp][t.col(e)] = __float_as_uint(both);
  }
  __syncthreads();
  if (threadIdx.x < kBlockSize) {
    float c = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) c = amax2(c, __uint_as_float(red[w][threadIdx.x]));
    col[threadIdx.x] = __float_as_uint(c);
  }
  __syncthreads();
#pragma unroll
  for (int e = 0; e < kVec; ++e) out[e] = __uint_as_float(col[t.col(e)]);
}

// The CTA's amax (every thread gets it), through shared memory `red` [kWarps].
__device__ __forceinline__ float tile_amax(float m, unsigned* red) {
  m = warp_amax(m);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = __float_as_uint(m);
  __syncthreads();
  float all = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) all = amax2(all, __uint_as_float(red[w]));
  return all;
}

// The amax pass of row scaling (and of tensor scaling over an unaligned
// input): the tensor's amax and, with rows_out / cols_out, every row's and
// column's. A CTA walks a strip of 128 columns down `tiles_per_cta` tiles:
// no barrier between tiles, so its warps keep loads in flight while others
// reduce; column amaxes stay in registers until the strip's end (one shared
// reduction and one atomic per column per CTA), row amaxes go out per tile
// (16-lane shuffles, one atomic per row per strip).
// Residency: three CTAs per SM for 2-byte inputs (the tile in 32 registers),
// two for float (64).
template <typename T>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 3 : 2)
    amax_kernel(const T* x, int64_t rows, int64_t cols, bool vec, int64_t tiles_per_cta, float* total,
                unsigned* rows_out, unsigned* cols_out) {
  __shared__ unsigned red[kWarps][kBlockSize];
  __shared__ unsigned col[kBlockSize];
  const int64_t first = int64_t(blockIdx.x) * tiles_per_cta * kBlockSize;
  const int64_t last = std::min<int64_t>(rows, first + tiles_per_cta * kBlockSize);
  const Tile strip(first, int64_t(blockIdx.y) * kBlockSize);
  float m = 0.f, c[kVec] = {};
  for (int64_t row0 = first; row0 < last; row0 += kBlockSize) {
    const Tile t(row0, strip.col0);
    TileValues<T> v;
    load_tile(x, rows, cols, vec, t, v);
    if (rows_out == nullptr) {
      m = amax2(m, thread_amax(v));
      continue;
    }
    thread_column_amaxes(v, c);
#pragma unroll
    for (int p = 0; p < kPasses; ++p)
#pragma unroll
      for (int q = 0; q < kGroupRows; ++q) {
        float r = 0.f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) r = amax2(r, to_float(v[p][q][e]));
        r = row_amax(r);
        m = amax2(m, r);
        const int64_t i = row0 + t.row(p, q);
        if (t.cg == 0 && i < rows) atomic_amax(rows_out + i, r);
      }
  }
  m = warp_amax(m);
  if (threadIdx.x % 32 == 0) atomic_amax(total, m);
  if (rows_out == nullptr) return;
  float out[kVec];
  cta_column_amaxes(c, strip, red, col, out);
  if (strip.g == 0) {
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      if (strip.col0 + strip.col(e) < cols) atomic_amax(cols_out + strip.col0 + strip.col(e), out[e]);
  }
}

// The amax pass of tensor scaling over a 16-byte aligned input: a
// grid-stride reduction over 16-byte vectors with kAmaxUnroll loads in
// flight per thread (the tile kernel's syncs and per-tile CTAs leave HBM
// idle between tiles).
constexpr int kAmaxUnroll = 4;

template <typename T>
__global__ void __launch_bounds__(kThreads) tensor_amax_kernel(const T* x, int64_t n, float* total) {
  constexpr int kPer = 16 / int(sizeof(T));
  const int64_t vecs = n / kPer;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float m = 0.f;
  const int64_t stride = int64_t(gridDim.x) * kThreads * kAmaxUnroll;
  for (int64_t base = int64_t(blockIdx.x) * kThreads * kAmaxUnroll + threadIdx.x; base < vecs; base += stride) {
    uint4 u[kAmaxUnroll];
#pragma unroll
    for (int k = 0; k < kAmaxUnroll; ++k) {
      const int64_t idx = base + int64_t(k) * kThreads;
      u[k] = idx < vecs ? xv[idx] : make_uint4(0u, 0u, 0u, 0u);  // zero bits: +0 in every type
    }
#pragma unroll
    for (int k = 0; k < kAmaxUnroll; ++k) {
      const T* e = reinterpret_cast<const T*>(&u[k]);
#pragma unroll
      for (int j = 0; j < kPer; ++j) m = amax2(m, to_float(e[j]));
    }
  }
  if (blockIdx.x == 0)  // the last n % kPer elements
    for (int64_t i = vecs * kPer + threadIdx.x; i < n; i += kThreads) m = amax2(m, to_float(x[i]));
  m = warp_amax(m);
  if (threadIdx.x % 32 == 0) atomic_amax(total, m);
}

struct CastParams {
  int64_t rows, cols;
  Scaling scaling;
  bool pow2;
  bool vec_in;   // input rows 16-byte aligned, cols % 8 == 0
  bool vec_out;  // data rows take 8-byte stores (cols % 8 == 0)
  bool vec_t;    // data_t rows take 16-byte stores (rows % 16 == 0, aligned)
  const float* given_scale;
  const float2* row_div;  // kRow: [rows] and [cols] (scale, reciprocal), from row_scales_kernel
  const float2* col_div;
  uint8_t* data;
  float* scale;
  bool transpose;
  uint8_t* data_t;
  float* scale_t;
  float* amax;
};

// A scale and its reciprocal.
struct Divisor {
  float s = 1.f, r = 1.f;
  Divisor() = default;
  __device__ explicit Divisor(float scale) : s(scale), r(nvfp4::reciprocal_rn(scale)) {}
  __device__ explicit Divisor(float2 sr) : s(sr.x), r(sr.y) {}
};

// How the encoding loop divides by a scale, chosen once per thread from its
// scales (cast_kernel): the element rule (IEEE division, NaN to 0x7f) where
// a scale is extreme or an element NaN; else the reciprocal division with a
// paired conversion: guarded (div_by_scale) for a given scale, bounded
// (div_by_bounded_scale) for scales computed from the elements' amaxes, a
// bare multiplication for powers of two (pow2_division_ok). All give the
// element rule's codes.
enum class Division { kElement, kGuarded, kBounded, kPow2 };

// Codes of a and b in the low and high byte.
template <Format F, Division D>
__device__ __forceinline__ uint32_t encode2(float a, float b, const Divisor& d) {
  if constexpr (D == Division::kElement) {
    return uint32_t(encode(a, d.s, F)) | uint32_t(encode(b, d.s, F)) << 8;
  } else {
    float2 q;
    if constexpr (D == Division::kPow2) {
      q = make_float2(__fmul_rn(a, d.r), __fmul_rn(b, d.r));
    } else if constexpr (D == Division::kBounded) {
      q = make_float2(div_by_bounded_scale(a, d.s, d.r), div_by_bounded_scale(b, d.s, d.r));
    } else {
      q = make_float2(div_by_scale(a, d.s, d.r), div_by_scale(b, d.s, d.r));
    }
    return __nv_cvt_float2_to_fp8x2(q, __NV_SATFINITE, F == Format::kE4M3 ? __NV_E4M3 : __NV_E5M2);
  }
}

// Byte e of rows r[0..3] (each 4 codes of consecutive columns) gathered into
// word e: a 4 x 4 byte transpose.
__device__ __forceinline__ void transpose4x4(const uint32_t (&r)[4], uint32_t* w) {
  const uint32_t a01 = __byte_perm(r[0], r[1], 0x5140), b01 = __byte_perm(r[0], r[1], 0x7362);
  const uint32_t a23 = __byte_perm(r[2], r[3], 0x5140), b23 = __byte_perm(r[2], r[3], 0x7362);
  w[0] = __byte_perm(a01, a23, 0x5410);
  w[1] = __byte_perm(a01, a23, 0x7632);
  w[2] = __byte_perm(b01, b23, 0x5410);
  w[3] = __byte_perm(b01, b23, 0x7632);
}

// The codes of this thread's elements: each row's 8 go out at once; the
// transposed copy's are gathered into words (4 rows of one column): a byte
// transpose of the row codes where data and data_t share the scale, else
// codes of their own.
template <typename T, Format F, Scaling S, Division D>
__device__ __forceinline__ void encode_tile(const TileValues<T>& v, const Divisor (&rd)[kPasses][kGroupRows],
                                            const Divisor (&dc)[kVec], const Tile& t, const CastParams& p,
                                            uint32_t (&words)[kPasses][kVec]) {
  constexpr bool same_scale = S == Scaling::kTensor || S == Scaling::kBlock2d;
  const int64_t j0 = t.col0 + t.col(0);
#pragma unroll
  for (int a = 0; a < kPasses; ++a) {
    uint32_t lo[kGroupRows], hi[kGroupRows];  // codes of columns 0-3 and 4-7, per row
#pragma unroll
    for (int q = 0; q < kGroupRows; ++q) {
      const Divisor& d = rd[a][q];
      auto f = [&](int e) { return to_float(v[a][q][e]); };
      lo[q] = encode2<F, D>(f(0), f(1), d) | encode2<F, D>(f(2), f(3), d) << 16;
      hi[q] = encode2<F, D>(f(4), f(5), d) | encode2<F, D>(f(6), f(7), d) << 16;
      const int64_t i = t.row0 + t.row(a, q);
      if (i < p.rows) {
        uint8_t* out = p.data + i * p.cols + j0;
        if (p.vec_out && j0 + kVec <= p.cols) {
          *reinterpret_cast<uint2*>(out) = make_uint2(lo[q], hi[q]);
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e)
            if (j0 + e < p.cols) out[e] = static_cast<uint8_t>((e < 4 ? lo[q] : hi[q]) >> (8 * (e % 4)));
        }
      }
    }
    if (!p.transpose) continue;
    if constexpr (same_scale) {
      transpose4x4(lo, words[a]);
      transpose4x4(hi, words[a] + 4);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        auto f = [&](int q) { return to_float(v[a][q][e]); };
        words[a][e] = encode2<F, D>(f(0), f(1), dc[e]) | encode2<F, D>(f(2), f(3), dc[e]) << 16;
      }
    }
  }
}

// Residency: tensor scaling's tile fits 80 registers, three CTAs per SM;
// the others keep a scale pair per row and column (or, block2d, spill at
// 80), two CTAs per SM. The cast is bound by issue at two: a third CTA
// hides more of each warp's latency.
template <Scaling S>
constexpr int kCastCtasPerSm = S == Scaling::kTensor ? 3 : 2;

template <typename T, Format F, Scaling S>
__global__ void __launch_bounds__(kThreads, kCastCtasPerSm<S>) cast_kernel(const T* x, CastParams p) {
  __shared__ unsigned red[kWarps][kBlockSize];
  __shared__ __align__(16) float2 col_div[kBlockSize];  // kBlock: each column's (scale, reciprocal)
  __shared__ __align__(16) uint32_t tile_t[kBlockSize][kWords];  // [column][row word], swizzled (store_transposed)
  const Tile t;
  TileValues<T> v;
  load_tile(x, p.rows, p.cols, p.vec_in, t, v);
  const float fmax = format_max(F);
  auto scale_of = [&](float amax) { return scale_from_amax(amax, fmax, 0, p.pow2); };
  const int64_t kb = ceil_div128(p.cols), mb = ceil_div128(p.rows);
  const bool first_tile = blockIdx.x == 0 && blockIdx.y == 0;

  // Every scale (and its reciprocal) this thread's elements need: per row
  // (rd) and per column (cd; the transposed copy's where its scales are
  // not data's). A NaN element makes its group's computed scale NaN, which
  // takes the element rule; only a given scale needs `clean`.
  Divisor rd[kPasses][kGroupRows], cd[kVec];
  bool clean = true;
  bool fast = true, pow2 = true, decided = false;
  bool given_bounded = false;  // a given scale under which no element's x * r overflows
  if constexpr (S == Scaling::kTensor) {
    float s, mine = 0.f;
    if (p.given_scale) {  // one pass: this pass makes the amax
      s = *p.given_scale;
      mine = thread_amax(v);
      clean = !is_nan(mine);  // a given scale does not reveal a NaN
      const float m = warp_amax(mine);
      if (threadIdx.x % 32 == 0) atomic_amax(p.amax, m);
    } else {
      s = scale_of(*p.amax);
    }
    const Divisor d(s);
    // |x| * r <= mine * r (rounding is monotone): where that is finite no
    // x * r overflows, and the guard of div_by_scale has nothing to catch.
    given_bounded = p.given_scale != nullptr && __fmul_rn(mine, d.r) < INFINITY;
    for (auto& r : rd) for (Divisor& e : r) e = d;
    if (first_tile && threadIdx.x == 0) {
      *p.scale = s;
      if (p.transpose) *p.scale_t = s;
    }
  } else if constexpr (S == Scaling::kRow) {  // scales (written out already) and reciprocals from row_scales_kernel
#pragma unroll
    for (int a = 0; a < kPasses; ++a)
#pragma unroll
      for (int q = 0; q < kGroupRows; ++q) {
        const int64_t i = t.row0 + t.row(a, q);
        if (i < p.rows) rd[a][q] = Divisor(p.row_div[i]);
      }
    if (p.transpose)
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int64_t j = t.col0 + t.col(e);
        if (j < p.cols) cd[e] = Divisor(p.col_div[j]);
      }
  } else if constexpr (S == Scaling::kBlock) {
    // Each of the tile's 128 row scales and 128 column scales is computed
    // once (a division and a reciprocal each) and shared: row (a, q) of a
    // row group by lane cg == a * kGroupRows + q of its 16, then shuffled
    // to the other 15; column c by thread c, through shared memory.
    float ra[kPasses][kGroupRows], mine = 0.f;
#pragma unroll
    for (int a = 0; a < kPasses; ++a)
#pragma unroll
      for (int q = 0; q < kGroupRows; ++q) {
        float r = 0.f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) r = amax2(r, to_float(v[a][q][e]));
        ra[a][q] = row_amax(r);
        mine = amax2(mine, ra[a][q]);
      }
    mine = warp_amax(mine);
    if (threadIdx.x % 32 == 0) atomic_amax(p.amax, mine);
    constexpr int kThreadRows = kPasses * kGroupRows;
    const int own = t.cg % kThreadRows;  // the row of the thread's 8 whose scale this lane computes
    float own_amax = ra[0][0];
#pragma unroll
    for (int k = 1; k < kThreadRows; ++k) own_amax = own == k ? ra[k / kGroupRows][k % kGroupRows] : own_amax;
    const Divisor own_d(scale_of(own_amax));
    const int64_t own_row = t.row0 + t.row(own / kGroupRows, own % kGroupRows);
    if (t.cg < kThreadRows && own_row < p.rows) p.scale[own_row * kb + blockIdx.y] = own_d.s;
    const int lane_base = int(threadIdx.x) % 32 & ~(kColGroups - 1);
#pragma unroll
    for (int a = 0; a < kPasses; ++a)
#pragma unroll
      for (int q = 0; q < kGroupRows; ++q) {
        const int src = lane_base + a * kGroupRows + q;
        rd[a][q].s = __shfl_sync(0xffffffffu, own_d.s, src);
        rd[a][q].r = __shfl_sync(0xffffffffu, own_d.r, src);
      }
    // The column amaxes over the CTA (every row group's), then column c's
    // divisor by thread c, shared through col_div.
    float c[kVec] = {};
    thread_column_amaxes(v, c);
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float both = amax2(c[e], __shfl_xor_sync(0xffffffffu, c[e], 16));  // the warp's other row group
      if (threadIdx.x % 32 < kColGroups) red[warp][t.col(e)] = __float_as_uint(both);
    }
    bool ok = fast_division_ok(own_d.s), ok2 = pow2_division_ok(own_d.s);
    __syncthreads();
    if (threadIdx.x < kBlockSize) {
      float m = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) m = amax2(m, __uint_as_float(red[w][threadIdx.x]));
      const Divisor d(scale_of(m));
      col_div[threadIdx.x] = make_float2(d.s, d.r);
      const int64_t j = t.col0 + threadIdx.x;
      if (p.transpose && j < p.cols) p.scale_t[j * mb + blockIdx.x] = d.s;
      ok = ok && fast_division_ok(d.s);
      ok2 = ok2 && pow2_division_ok(d.s);
    }
    // One division form for the whole tile (the barrier also publishes col_div).
    fast = __syncthreads_and(ok);
    pow2 = __syncthreads_and(ok2);
    decided = true;
    if (p.transpose) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) cd[e] = Divisor(col_div[t.col(e)]);
    }
  } else {  // kBlock2d
    const float m = tile_amax(thread_amax(v), red[0]);
    if (threadIdx.x == 0) atomic_amax(p.amax, m);
    const float s = scale_of(m);
    const Divisor d(s);
    for (auto& r : rd) for (Divisor& e : r) e = d;
    if (threadIdx.x == 0) {
      p.scale[int64_t(blockIdx.x) * kb + blockIdx.y] = s;
      if (p.transpose) p.scale_t[int64_t(blockIdx.y) * mb + blockIdx.x] = s;
    }
  }

  // One branch per thread between the forms of the encoding loop (a branch
  // per element would replicate them all in the unrolled code); block
  // scaling chose one per tile above. A NaN element makes its group's
  // computed scale NaN, which fails fast_division_ok; only a given scale
  // needs `clean`. The transposed copy's column scales are data's where they
  // are shared (tensor, block2d) and unused where there is no copy (cd
  // stays 1).
  if (!decided) {
    fast = clean;
#pragma unroll
    for (int a = 0; a < kPasses; ++a)
#pragma unroll
      for (int q = 0; q < kGroupRows; ++q) {
        fast = fast && fast_division_ok(rd[a][q].s);
        pow2 = pow2 && pow2_division_ok(rd[a][q].s);
      }
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      fast = fast && fast_division_ok(cd[e].s);
      pow2 = pow2 && pow2_division_ok(cd[e].s);
    }
  }
  uint32_t words[kPasses][kVec];
  if (!fast) {
    encode_tile<T, F, S, Division::kElement>(v, rd, cd, t, p, words);
  } else if (pow2) {
    encode_tile<T, F, S, Division::kPow2>(v, rd, cd, t, p, words);
  } else if (S != Scaling::kTensor || p.given_scale == nullptr || given_bounded) {  // no x * r overflows
    encode_tile<T, F, S, Division::kBounded>(v, rd, cd, t, p, words);
  } else if constexpr (S == Scaling::kTensor) {  // only a given scale can need the guard
    encode_tile<T, F, S, Division::kGuarded>(v, rd, cd, t, p, words);
  }
  if (!p.transpose) return;

  // Word w of transposed row c (rows 4 w .. 4 w + 3 of the tile) sits at
  // position w ^ (2 * (c / 8)): a warp's 32 stores (16 column groups x 2 row
  // groups) land in 32 different banks.
#pragma unroll
  for (int a = 0; a < kPasses; ++a)
#pragma unroll
    for (int e = 0; e < kVec; ++e) tile_t[t.col(e)][(a * kRowGroups + t.g) ^ (2 * t.cg)] = words[a][e];
  __syncthreads();
  // Thread reads 16 bytes (transposed row c, rows 16 k .. 16 k + 15).
  constexpr int kPieces = kBlockSize / 16;
#pragma unroll
  for (int it = 0; it < kBlockSize * kPieces / kThreads; ++it) {
    const int c = it * (kThreads / kPieces) + int(threadIdx.x) / kPieces, k = int(threadIdx.x) % kPieces;
    const int64_t j = t.col0 + c;
    if (j >= p.cols) continue;
    const int swz = 2 * (c / kVec);
    uint4 w = *reinterpret_cast<const uint4*>(&tile_t[c][(4 * k) ^ (swz & ~3)]);
    if (swz & 2) w = make_uint4(w.z, w.w, w.x, w.y);  // the XOR swapped the halves
    const int64_t i0 = t.row0 + 16 * k;
    uint8_t* out = p.data_t + j * p.rows + i0;
    if (p.vec_t && i0 + 16 <= p.rows) {
      *reinterpret_cast<uint4*>(out) = w;
    } else {
      const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
      for (int b = 0; b < 16 && i0 + b < p.rows; ++b) out[b] = static_cast<uint8_t>(ws[b / 4] >> (8 * (b % 4)));
    }
  }
}

// Scales of an empty tensor (no element, amax 0): 1, or the given scale.
__global__ void fill_scales_kernel(float* s, int64_t n, const float* given) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) s[i] = given ? *given : 1.f;
}

// Row scaling, between the amax pass and the cast: each row's and column's
// scale from its amax, written out (scale, and scale_t with the transposed
// copy) and kept with its reciprocal for the cast ([rows] then [cols]).
__global__ void row_scales_kernel(const unsigned* amax, int64_t rows, int64_t cols, float fmax, bool pow2,
                                  float* scale, float* scale_t, float2* div) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows + cols) return;
  const float s = scale_from_amax(__uint_as_float(amax[i]), fmax, 0, pow2);
  div[i] = make_float2(s, nvfp4::reciprocal_rn(s));
  if (i < rows) {
    scale[i] = s;
  } else if (scale_t != nullptr) {
    scale_t[i - rows] = s;
  }
}

int64_t scale_count(const CastArgs& a, bool transposed) {
  const int64_t rows = transposed ? a.cols : a.rows, cols = transposed ? a.rows : a.cols;
  switch (a.scaling) {
    case Scaling::kTensor: return 1;
    case Scaling::kRow: return rows;
    case Scaling::kBlock: return rows * ceil_div128(cols);
    case Scaling::kBlock2d: return ceil_div128(rows) * ceil_div128(cols);
  }
  return 0;
}

cudaError_t fill(float* s, int64_t n, const float* given, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  fill_scales_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(s, n, given);
  return cudaGetLastError();
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename T, Format F>
cudaError_t launch(const CastArgs& a, cudaStream_t stream) {
  const T* x = static_cast<const T*>(a.input);
  const dim3 grid(unsigned(ceil_div128(a.rows)), unsigned(ceil_div128(a.cols)));
  const bool vec_in = a.cols % kVec == 0 && aligned(x, 16);
  CastParams p{a.rows, a.cols, a.scaling, a.pow2,
               vec_in, a.cols % kVec == 0 && aligned(a.data, 8), a.rows % 16 == 0 && aligned(a.data_t, 16),
               a.given_scale, nullptr, nullptr, a.data, a.scale, a.transpose, a.data_t, a.scale_t, a.amax};
  if ((a.scaling == Scaling::kTensor && a.given_scale == nullptr) || a.scaling == Scaling::kRow) {
    float2* div = nullptr;  // kRow: workspace [rows + cols] (scale, reciprocal), then the amaxes
    unsigned* row_amax = nullptr;
    unsigned* col_amax = nullptr;
    if (a.scaling == Scaling::kRow) {
      div = static_cast<float2*>(a.workspace);
      row_amax = reinterpret_cast<unsigned*>(div + a.rows + a.cols);
      col_amax = row_amax + a.rows;
      cudaError_t err = cudaMemsetAsync(row_amax, 0, (a.rows + a.cols) * sizeof(unsigned), stream);
      if (err != cudaSuccess) return err;
    }
    if (a.scaling == Scaling::kTensor && aligned(x, 16)) {
      const int64_t n = a.rows * a.cols, per_cta = int64_t(kThreads) * kAmaxUnroll * (16 / int64_t(sizeof(T)));
      const int64_t ctas = std::min<int64_t>((n + per_cta - 1) / per_cta, int64_t(cuda::num_sms()) * 8);
      tensor_amax_kernel<T><<<unsigned(ctas), kThreads, 0, stream>>>(x, n, a.amax);
    } else {
      // Strips of 128 columns, each split into row ranges so that about 8
      // CTAs per SM run (two to four waves of the resident CTAs).
      const int64_t row_tiles = ceil_div128(a.rows), strips = ceil_div128(a.cols);
      const int64_t want = int64_t(cuda::num_sms()) * 8;
      const int64_t splits = std::clamp<int64_t>((want + strips - 1) / strips, 1, row_tiles);
      const int64_t tiles_per_cta = (row_tiles + splits - 1) / splits;
      const dim3 amax_grid(unsigned((row_tiles + tiles_per_cta - 1) / tiles_per_cta), unsigned(strips));
      amax_kernel<T><<<amax_grid, kThreads, 0, stream>>>(x, a.rows, a.cols, vec_in, tiles_per_cta, a.amax, row_amax,
                                                         col_amax);
    }
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    if (a.scaling == Scaling::kRow) {
      const int64_t n = a.rows + a.cols;
      row_scales_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(
          row_amax, a.rows, a.cols, format_max(F), a.pow2, a.scale, a.transpose ? a.scale_t : nullptr, div);
      err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      p.row_div = div;
      p.col_div = div + a.rows;
    }
  }
  switch (a.scaling) {
    case Scaling::kTensor: cast_kernel<T, F, Scaling::kTensor><<<grid, kThreads, 0, stream>>>(x, p); break;
    case Scaling::kRow: cast_kernel<T, F, Scaling::kRow><<<grid, kThreads, 0, stream>>>(x, p); break;
    case Scaling::kBlock: cast_kernel<T, F, Scaling::kBlock><<<grid, kThreads, 0, stream>>>(x, p); break;
    case Scaling::kBlock2d: cast_kernel<T, F, Scaling::kBlock2d><<<grid, kThreads, 0, stream>>>(x, p); break;
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch(const CastArgs& a, cudaStream_t stream) {
  return a.format == Format::kE4M3 ? launch<T, Format::kE4M3>(a, stream) : launch<T, Format::kE5M2>(a, stream);
}

// ---- transpose of FP8 codes ----------------------------------------------
// One 64 x 64 byte tile per CTA of 256 threads, through shared memory. Load:
// 4 threads per input row (16 bytes each); store: 4 threads per output row
// (16 input rows each), so both global sides move whole 32-byte sectors.
// kVec: rows and cols multiples of 16 and both pointers 16-byte aligned
// (16-byte loads and stores, a 16-byte chunk is either wholly inside or
// wholly outside the tensor); otherwise byte by byte, bounds checked.
constexpr int kTransposeTile = 64;
constexpr int kTransposePitch = kTransposeTile + 16;  // 16-byte aligned rows

template <bool kVec>
__global__ void __launch_bounds__(256) transpose_codes_kernel(const uint8_t* __restrict__ in, int64_t rows,
                                                              int64_t cols, uint8_t* __restrict__ out) {
  __shared__ __align__(16) uint8_t tile[kTransposeTile][kTransposePitch];
  const int64_t r0 = int64_t(blockIdx.x) * kTransposeTile, c0 = int64_t(blockIdx.y) * kTransposeTile;
  const int lane_row = threadIdx.x / 4, chunk = (threadIdx.x % 4) * 16;
  {
    const int64_t r = r0 + lane_row, c = c0 + chunk;
    if (kVec) {
      if (r < rows && c < cols)
        *reinterpret_cast<uint4*>(&tile[lane_row][chunk]) = *reinterpret_cast<const uint4*>(in + r * cols + c);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i)
        if (r < rows && c + i < cols) tile[lane_row][chunk + i] = in[r * cols + c + i];
    }
  }
  __syncthreads();
  // Output row c0 + lane_row (input column), input rows r0 + chunk ... + 15.
  const int64_t oc = c0 + lane_row, orow = r0 + chunk;
  if (oc >= cols) return;
  uint8_t v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = tile[chunk + i][lane_row];
  if (kVec) {
    if (orow < rows) {
      uint4 packed;
      memcpy(&packed, v, 16);
      *reinterpret_cast<uint4*>(out + oc * rows + orow) = packed;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if (orow + i < rows) out[oc * rows + orow + i] = v[i];
  }
}

}  // namespace

cudaError_t transpose_codes_cuda(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const int64_t tiles_r = (rows + kTransposeTile - 1) / kTransposeTile;
  const int64_t tiles_c = (cols + kTransposeTile - 1) / kTransposeTile;
  if (tiles_c > kMaxTransposeColTiles || tiles_r > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 grid{unsigned(tiles_r), unsigned(tiles_c)};
  const bool vec = rows % 16 == 0 && cols % 16 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (vec) {
    transpose_codes_kernel<true><<<grid, 256, 0, stream>>>(in, rows, cols, out);
  } else {
    transpose_codes_kernel<false><<<grid, 256, 0, stream>>>(in, rows, cols, out);
  }
  return cudaGetLastError();
}

cudaError_t cast_cuda(const CastArgs& a, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(a.amax, 0, sizeof(float), stream);
  if (err != cudaSuccess) return err;
  if (a.rows == 0 || a.cols == 0) {
    err = fill(a.scale, scale_count(a, false), a.given_scale, stream);
    if (err == cudaSuccess && a.transpose) err = fill(a.scale_t, scale_count(a, true), a.given_scale, stream);
    return err;
  }
  switch (a.input_dtype) {
    case DType::kFloat32: return launch<float>(a, stream);
    case DType::kBFloat16: return launch<__nv_bfloat16>(a, stream);
    case DType::kFloat16: return launch<__half>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace lowbit::fp8
