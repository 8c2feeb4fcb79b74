// The NVFP4 Linear's FP8 path on CUDA: the prepacked weight (once, for
// lowbit::nvfp4_to_fp8, or per call in the op's FP8 mode) and x rounded to
// E4M3 with a scale per row, by the rule of nvfp4_linear.h (kE4m3Max), for
// an FP8 GEMM on the tensor cores (the caller runs it). The CPU loops in
// nvfp4_linear_cpu.cpp are the reference; these give the same bits.
#include <cuda_fp8.h>

#include <cstdint>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/linear/fp8_rows.cuh"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_mainloops.cuh"

namespace lowbit::nvfp4::gemm {
namespace {

constexpr int kFp8Threads = 256;

// The W kernels: thread i takes the 16 bytes i of the prepacked codes, lane
// words 4q..4q+3 (q = i % 64) of k-tile i / 64: 4 words of the same two
// rows (g and g + 8 of lane q % 32, as in unpack_kernel) at 16-column blocks
// kt = 4 (q / 32) + j, whose scales are the two words at byte g * 16 +
// 8 (q / 32) of the tile's. Words past K (padding blocks) are left out.
struct Fp8WeightQuad {
  int64_t tile, row, col;  // the k-tile, row g, column of word 0 (word j: + 16 j)
  int half, g;
  __device__ __forceinline__ Fp8WeightQuad(int64_t i, int64_t tiles_k) {
    const int q = static_cast<int>(i % 64), lane = q % 32;
    tile = i / 64;
    half = q / 32;
    g = lane / 4;
    row = (tile / tiles_k) * kTileN + g;
    col = (tile % tiles_k) * kTileK + 4 * half * 16 + (lane % 4) * 4;
  }
  // Word j of the 16 bytes, and its scale word.
  __device__ __forceinline__ static uint32_t word(const uint4& w4, int j) {
    return j == 0 ? w4.x : j == 1 ? w4.y : j == 2 ? w4.z : w4.w;
  }
  __device__ __forceinline__ static uint32_t scale_word(const uint2& s2, int j) { return j < 2 ? s2.x : s2.y; }
  // Word j's values, e2m1 * block scale (exact): rows g (lo) and g + 8
  // (hi), 4 columns each.
  __device__ __forceinline__ void decode(const uint4& w4, const uint2& s2, int j, float (&lo)[4],
                                         float (&hi)[4]) const {
    mma::decode_word_rows(word(w4, j), scale_word(s2, j), 4 * half + j, lo, hi);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lo[i] *= kDecodeUnscale;
      hi[i] *= kDecodeUnscale;
    }
  }
  __device__ __forceinline__ uint2 scales(const uint8_t* scale) const {
    return __ldg(reinterpret_cast<const uint2*>(scale + tile * kTileScaleBytes + g * 16 + 8 * half));
  }
};

// Each row's amax, as float bits (>= 0: they order as unsigned) maxed into
// row_amax (zeroed before): the 4 lanes of a row in a warp combine first.
__global__ void __launch_bounds__(kFp8Threads) fp8_weight_amax_kernel(const uint4* __restrict__ weight,
                                                                      const uint8_t* __restrict__ scale,
                                                                      int64_t quads, int64_t tiles_k, int64_t k,
                                                                      unsigned* __restrict__ row_amax) {
  const int64_t i = int64_t(blockIdx.x) * kFp8Threads + threadIdx.x;
  if (i >= quads) return;  // whole warps: quads is a multiple of 64
  const Fp8WeightQuad p(i, tiles_k);
  const uint4 w4 = __ldg(weight + i);
  const uint2 s2 = p.scales(scale);
  // Maxima of the decoded bf16 pairs (exact values: their max is exact),
  // widened once: fewer instructions than widening every value. __hmax2
  // returns the other operand for a NaN one, as fp8_absmax.
  __nv_bfloat162 max_lo = __float2bfloat162_rn(0.f), max_hi = max_lo;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (p.col + 16 * j >= k) continue;
    uint32_t a[4];  // bf16 pairs: a[0], a[2] row g; a[1], a[3] row g + 8
    mma::decode_fragment<__nv_bfloat16>(Fp8WeightQuad::word(w4, j), Fp8WeightQuad::scale_word(s2, j), 4 * p.half + j,
                                        a);
    const auto* b = reinterpret_cast<const __nv_bfloat162*>(a);
    max_lo = __hmax2(max_lo, __hmax2(__habs2(b[0]), __habs2(b[2])));
    max_hi = __hmax2(max_hi, __hmax2(__habs2(b[1]), __habs2(b[3])));
  }
  float amax_lo = fmaxf(__low2float(max_lo), __high2float(max_lo)) * kDecodeUnscale;
  float amax_hi = fmaxf(__low2float(max_hi), __high2float(max_hi)) * kDecodeUnscale;
  for (int o = 1; o < 4; o *= 2) {
    amax_lo = fmaxf(amax_lo, __shfl_xor_sync(0xffffffffu, amax_lo, o));
    amax_hi = fmaxf(amax_hi, __shfl_xor_sync(0xffffffffu, amax_hi, o));
  }
  if (threadIdx.x % 4 == 0) {
    atomicMax(row_amax + p.row, __float_as_uint(amax_lo));
    atomicMax(row_amax + p.row + 8, __float_as_uint(amax_hi));
  }
}

// The 4 lanes of a row (lane % 4 = s) hold its codes at columns 16 j + 4 s
// (word j, j = 0..3, from a base): transposed, lane r gets those at 16 r ..
// 16 r + 15 (codes[0..3] = columns 16 r + 4 s, s = 0..3), for one 16-byte
// store.
__device__ __forceinline__ uint4 transpose_quad(const uint32_t (&codes)[4]) {
  const int r = static_cast<int>(threadIdx.x % 4);
  uint32_t got[4];
#pragma unroll
  for (int d = 0; d < 4; ++d) {
    const int send = (r - d) & 3, from = (r + d) & 3;  // this lane sends word `send`, reads lane `from`'s
    const uint32_t mine = send == 0 ? codes[0] : send == 1 ? codes[1] : send == 2 ? codes[2] : codes[3];
    const uint32_t v = d == 0 ? mine : __shfl_sync(0xffffffffu, mine, (threadIdx.x & ~3u) | unsigned(from));
    if (from == 0) got[0] = v;
    if (from == 1) got[1] = v;
    if (from == 2) got[2] = v;
    if (from == 3) got[3] = v;
  }
  return make_uint4(got[0], got[1], got[2], got[3]);
}

// The codes, from row_amax; the first k-tile's threads of lane % 4 == 0
// and half 0 write their rows' scales.
__global__ void __launch_bounds__(kFp8Threads) fp8_weight_codes_kernel(
    const uint4* __restrict__ weight, const uint8_t* __restrict__ scale, const float* __restrict__ global_scale,
    const unsigned* __restrict__ row_amax, int64_t quads, int64_t tiles_k, int64_t k, uint8_t* __restrict__ out,
    float* __restrict__ row_scale) {
  const int64_t i = int64_t(blockIdx.x) * kFp8Threads + threadIdx.x;
  if (i >= quads) return;
  const Fp8WeightQuad p(i, tiles_k);
  const uint4 w4 = __ldg(weight + i);
  const uint2 s2 = p.scales(scale);
  const float max_lo = __uint_as_float(__ldg(row_amax + p.row)), max_hi = __uint_as_float(__ldg(row_amax + p.row + 8));
  const float r_lo = fp8_row_reciprocal(max_lo), r_hi = fp8_row_reciprocal(max_hi);
  if (p.tile % tiles_k == 0 && p.half == 0 && threadIdx.x % 4 == 0) {
    const float gs = __ldg(global_scale);
    row_scale[p.row] = fp8_row_scale(max_lo, gs);
    row_scale[p.row + 8] = fp8_row_scale(max_hi, gs);
  }
  uint32_t codes_lo[4], codes_hi[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float lo[4], hi[4];
    p.decode(w4, s2, j, lo, hi);  // padding blocks decode to zeros, not stored
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      lo[e] *= r_lo;
      hi[e] *= r_hi;
    }
    codes_lo[j] = e4m3x4(lo);
    codes_hi[j] = e4m3x4(hi);
  }
  const uint4 row_lo = transpose_quad(codes_lo), row_hi = transpose_quad(codes_hi);
  const int64_t col = p.col - (threadIdx.x % 4) * 4 + 16 * (threadIdx.x % 4);  // the block this lane stores
  if (col < k) {
    *reinterpret_cast<uint4*>(out + p.row * k + col) = row_lo;
    *reinterpret_cast<uint4*>(out + (p.row + 8) * k + col) = row_hi;
  }
}

// Chunks of 8 elements a thread of fp8_rows_kernel keeps in registers: rows
// of up to 256 x 4 x 8 = 8192 elements are read once.
constexpr int kRowsKeptChunks = 4;

// One CTA per row of x: its amax, then its codes. A row of up to 8192
// elements stays in registers between the two; a longer one is read again
// (from L2) for its codes.
template <typename T>
__global__ void __launch_bounds__(kFp8Threads) fp8_rows_kernel(const T* __restrict__ x, int64_t k,
                                                               uint8_t* __restrict__ out,
                                                               float* __restrict__ row_scale) {
  __shared__ float red[kFp8Threads / 32];
  const int64_t row = blockIdx.x;
  const T* src = x + row * k;  // 8 elements a load
  const int64_t chunks = k / 8;
  uint2* dst = reinterpret_cast<uint2*>(out + row * k);
  float amax = 0.f;
  if (chunks <= int64_t(kFp8Threads) * kRowsKeptChunks) {
    float v[kRowsKeptChunks][8];
#pragma unroll
    for (int j = 0; j < kRowsKeptChunks; ++j) {
      const int64_t c = threadIdx.x + int64_t(j) * kFp8Threads;
      if (c < chunks) {
        cuda::load8(src + 8 * c, v[j]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[j][i] = 0.f;  // |0| leaves the amax as it is
      }
    }
#pragma unroll
    for (int j = 0; j < kRowsKeptChunks; ++j)
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fp8_absmax(amax, v[j][i]);
    amax = cta_max<kFp8Threads>(amax, red);
    const float r = fp8_row_reciprocal(amax);
    if (threadIdx.x == 0) row_scale[row] = fp8_row_scale(amax, 1.f);
#pragma unroll
    for (int j = 0; j < kRowsKeptChunks; ++j) {
      const int64_t c = threadIdx.x + int64_t(j) * kFp8Threads;
      if (c < chunks) dst[c] = e4m3x8(v[j], r);
    }
    return;
  }
#pragma unroll 4
  for (int64_t c = threadIdx.x; c < chunks; c += kFp8Threads) {
    float v[8];
    cuda::load8(src + 8 * c, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fp8_absmax(amax, v[i]);
  }
  amax = cta_max<kFp8Threads>(amax, red);
  const float r = fp8_row_reciprocal(amax);
  if (threadIdx.x == 0) row_scale[row] = fp8_row_scale(amax, 1.f);
#pragma unroll 4
  for (int64_t c = threadIdx.x; c < chunks; c += kFp8Threads) {
    float v[8];
    cuda::load8(src + 8 * c, v);
    dst[c] = e4m3x8(v, r);
  }
}

}  // namespace

cudaError_t fp8_weight_cuda(const Fp8WeightArgs& a, cudaStream_t stream) {
  if (a.n == 0 || a.k == 0) return cudaSuccess;
  const int64_t kp = padded_k(a.k), quads = a.n * kp / 32, tiles_k = kp / kTileK;
  const unsigned blocks = unsigned(cuda::ceil_div(quads, kFp8Threads));
  auto* amax = reinterpret_cast<unsigned*>(a.row_amax);
  cudaError_t err = cudaMemsetAsync(amax, 0, a.n * sizeof(unsigned), stream);
  if (err != cudaSuccess) return err;
  const auto* w = reinterpret_cast<const uint4*>(a.weight);
  fp8_weight_amax_kernel<<<blocks, kFp8Threads, 0, stream>>>(w, a.scale, quads, tiles_k, a.k, amax);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  fp8_weight_codes_kernel<<<blocks, kFp8Threads, 0, stream>>>(w, a.scale, a.global_scale, amax, quads, tiles_k, a.k,
                                                             a.out, a.row_scale);
  return cudaGetLastError();
}

cudaError_t fp8_rows_cuda(const Fp8RowsArgs& a, cudaStream_t stream) {
  if (a.m == 0 || a.k == 0) return cudaSuccess;
  if (a.dtype == DType::kBFloat16)
    fp8_rows_kernel<__nv_bfloat16><<<unsigned(a.m), kFp8Threads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(a.x), a.k, a.out, a.row_scale);
  else if (a.dtype == DType::kFloat16)
    fp8_rows_kernel<__half><<<unsigned(a.m), kFp8Threads, 0, stream>>>(static_cast<const __half*>(a.x), a.k,
                                                                       a.out, a.row_scale);
  else if (a.dtype == DType::kFloat32)
    fp8_rows_kernel<float><<<unsigned(a.m), kFp8Threads, 0, stream>>>(static_cast<const float*>(a.x), a.k, a.out,
                                                                      a.row_scale);
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace lowbit::nvfp4::gemm
