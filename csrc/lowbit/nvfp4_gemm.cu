// CUDA kernels of the NVFP4 Linear: prepack, unpack (dequantize the prepacked
// weight, used by the large-M path: unpack + cuBLAS in the binding), and the
// fused small-M GEMM.
//
// Fused small-M GEMM (M <= kFusedMaxM): one CTA of 8 warps per 16-row tile of
// W (and per split of K, and per 16 rows of x); its warps take the CTA's
// 128-column tiles in turn, so the weight is read once, in 1 KB coalesced
// pieces, by all SMs at once. Each warp decodes its A fragments in registers
// (rotate + mask puts each FP4 code into a bf16/fp16 whose value is
// e2m1 * 2^-126 / 2^-14, one packed multiply by the re-encoded block scale
// makes it e2m1 * scale * 2^-8 exactly) and issues mma.m16n8k16 with the
// weights as the 16-row operand and x as the 8-wide one ("swap AB"), FP32
// accumulators. The warps' partial sums are added in a fixed order in shared
// memory; with one split the CTA applies global * 2^8 and the bias and
// writes the output, otherwise it writes an FP32 partial and a second kernel
// adds the splits in order (deterministic: no atomics).
#include "lowbit/cuda_utils.cuh"
#include "lowbit/nvfp4_gemm.h"
#include "lowbit/nvfp4_gemm_layout.h"

namespace lowbit::nvfp4::gemm {
namespace {

// ---- prepack / unpack ---------------------------------------------------------

// One thread per (row, 16-column block): encodes the block's scale and ORs
// its 16 codes into the lane words. Blocks never share bits of a word but do
// share words (a word holds codes of two rows), hence the atomicOr.
__global__ void prepack_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ block_scale, int64_t n,
                               int64_t k, int64_t kp, uint32_t* __restrict__ weight, uint8_t* __restrict__ scale) {
  const int64_t blocks = k / 16;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n * blocks) return;
  const int64_t row = i / blocks, b = i % blocks;
  const ScaleCode s = encode_scale(block_scale[i]);
  scale[element_pos(row, b * 16, kp).scale_byte] = s.byte;
  for (int64_t kk = b * 16; kk < b * 16 + 16; ++kk) {
    uint32_t code = (codes[row * (k / 2) + kk / 2] >> (4 * (kk & 1))) & 0xfu;
    if (s.zero) code = 0;
    if (s.negative) code ^= 8u;
    const ElementPos p = element_pos(row, kk, kp);
    const uint32_t bits = ((code & 7u) << p.slot.mag) | ((code >> 3) << p.slot.sign);
    if (bits) atomicOr(weight + p.word_byte / 4, bits);
  }
}

__global__ void fill_scale_kernel(uint8_t* __restrict__ scale, int64_t count, uint8_t value) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) scale[i] = value;
}

// ---- fused small-M GEMM -------------------------------------------------------

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

__device__ __forceinline__ uint32_t rotl(uint32_t x, int r) { return __funnelshift_l(x, x, r); }

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(d) : "r"(a), "r"(sel));
  return d;
}

template <typename T> struct Mma;

template <> struct Mma<__nv_bfloat16> {
  // Codes as bf16 e2m1 * 2^-126 (bf16 subnormal for 0.5).
  __device__ __forceinline__ static void decode(uint32_t w, uint32_t (&r)[4]) {
    constexpr uint32_t kS = 0x80008000u, kM = 0x01c001c0u;
    r[0] = w & (kS | kM);
    r[1] = rotl(w, 3) & (kS | kM);
    r[2] = (rotl(w, 6) & kM) | (rotl(w, 1) & kS);
    r[3] = (rotl(w, 13) & kM) | (rotl(w, 2) & kS);
  }
  // scale * 2^118 in both halves, from the byte picked by sel.
  __device__ __forceinline__ static uint32_t multiplier(uint32_t word, uint32_t sel) {
    return (prmt(word, sel) & 0x0ff00ff0u) | 0x70007000u;
  }
  __device__ __forceinline__ static uint32_t mul(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  __device__ __forceinline__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <> struct Mma<__half> {
  // Codes as fp16 e2m1 * 2^-14: the bf16 pattern with the magnitude moved up 3.
  __device__ __forceinline__ static void decode(uint32_t w, uint32_t (&r)[4]) {
    Mma<__nv_bfloat16>::decode(w, r);
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = (r[i] & 0x80008000u) | ((r[i] << 3) & 0x0e000e00u);
  }
  // scale * 2^6 in both halves.
  __device__ __forceinline__ static uint32_t multiplier(uint32_t word, uint32_t sel) {
    return (prmt(word, sel) & 0x0ff00ff0u) << 3;
  }
  __device__ __forceinline__ static uint32_t mul(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  __device__ __forceinline__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Unpack: one thread per lane word (8 codes of two rows in one k-tile),
// decoded exactly as the GEMM does (e2m1 * scale * 2^-8 in bf16), then
// * global * 2^8 in FP32 and one rounding to T; each row's 4 values are
// consecutive columns (the K permutation of the layout), one 8-byte store.
template <typename T>
__global__ void unpack_kernel(const uint32_t* __restrict__ weight, const uint8_t* __restrict__ scale,
                              const float* __restrict__ global_scale, int64_t n, int64_t k, int64_t kp,
                              T* __restrict__ out) {
  const int64_t words = n * kp / 8;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= words) return;
  const int64_t tile = i / 256;
  const int within = static_cast<int>(i % 256);
  const int half = within / 128, lane = (within % 128) / 4, kt = half * 4 + within % 4;
  const int64_t tiles_k = kp / kTileK;
  const int64_t col = (tile % tiles_k) * kTileK + kt * 16 + (lane % 4) * 4;
  if (col >= k) return;
  const int64_t row = (tile / tiles_k) * kTileN + lane / 4;
  const uint32_t word = __ldg(weight + i);
  const uint32_t sw = __ldg(reinterpret_cast<const uint32_t*>(scale + tile * kTileScaleBytes + (lane / 4) * 16) + kt / 2);
  uint32_t a[4];
  Mma<__nv_bfloat16>::decode(word, a);
  const uint32_t mult_lo = Mma<__nv_bfloat16>::multiplier(sw, (kt & 1) ? 0x2222u : 0x0000u);
  const uint32_t mult_hi = Mma<__nv_bfloat16>::multiplier(sw, (kt & 1) ? 0x3333u : 0x1111u);
  const float g = __ldg(global_scale) * kDecodeUnscale;
  const uint32_t lo[2] = {Mma<__nv_bfloat16>::mul(a[0], mult_lo), Mma<__nv_bfloat16>::mul(a[2], mult_lo)};
  const uint32_t hi[2] = {Mma<__nv_bfloat16>::mul(a[1], mult_hi), Mma<__nv_bfloat16>::mul(a[3], mult_hi)};
  float v_lo[4], v_hi[4];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    v_lo[2 * j] = __uint_as_float(lo[j] << 16) * g;
    v_lo[2 * j + 1] = __uint_as_float(lo[j] & 0xffff0000u) * g;
    v_hi[2 * j] = __uint_as_float(hi[j] << 16) * g;
    v_hi[2 * j + 1] = __uint_as_float(hi[j] & 0xffff0000u) * g;
  }
  cuda::store4(out + row * k + col, v_lo);
  cuda::store4(out + (row + 8) * k + col, v_hi);
}

// One 128-column tile's operands held by a lane.
template <int MT>
struct Stage {
  uint4 w[2];      // k-tiles 0..3, 4..7
  uint4 s;         // scales of rows g, g+8
  uint2 x[MT][8];  // activations of row (m-tile, g), 4 values per k-tile
};

// xrow[mt]: this lane's activation row (m-tile mt, row g; rows past M are
// clamped to M - 1, whose results the epilogue never stores) at column 4 t,
// computed once per kernel, so a full tile's 8 activation loads need no
// address arithmetic or predicates. Only a partial last tile (K not a
// multiple of 128) checks columns.
template <typename T, int MT>
__device__ __forceinline__ void load_stage(Stage<MT>& st, const uint4* __restrict__ wtile,
                                           const uint4* __restrict__ stile, const T* const (&xrow)[MT],
                                           int64_t k, int64_t col0, int lane) {
  st.w[0] = __ldg(wtile + lane);
  st.w[1] = __ldg(wtile + 32 + lane);
  st.s = __ldg(stile + lane / 4);
  if (col0 + kTileK <= k) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kt = 0; kt < 8; ++kt) st.x[mt][kt] = __ldg(reinterpret_cast<const uint2*>(xrow[mt] + col0 + kt * 16));
  } else {
    const int t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kt = 0; kt < 8; ++kt)
        st.x[mt][kt] = col0 + kt * 16 + t * 4 < k ? __ldg(reinterpret_cast<const uint2*>(xrow[mt] + col0 + kt * 16))
                                                  : make_uint2(0, 0);
  }
}

template <typename T, int MT>
__device__ __forceinline__ void compute_stage(const Stage<MT>& st, float (&acc)[MT][4]) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(st.w);
  const uint32_t* s = reinterpret_cast<const uint32_t*>(&st.s);
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) {
    uint32_t a[4];
    Mma<T>::decode(w[kt], a);
    const uint32_t sw = s[kt / 2];
    const uint32_t mult_lo = Mma<T>::multiplier(sw, (kt & 1) ? 0x2222u : 0x0000u);  // row g
    const uint32_t mult_hi = Mma<T>::multiplier(sw, (kt & 1) ? 0x3333u : 0x1111u);  // row g+8
    a[0] = Mma<T>::mul(a[0], mult_lo);
    a[1] = Mma<T>::mul(a[1], mult_hi);
    a[2] = Mma<T>::mul(a[2], mult_lo);
    a[3] = Mma<T>::mul(a[3], mult_hi);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      Mma<T>::mma(acc[mt], a, st.x[mt][kt].x, st.x[mt][kt].y);
    }
  }
}

// grid: (ceil(M / (8 MT)), N / 16, splits). Output tile: 16 rows of W x 8 MT
// rows of x.
template <typename T, int MT>
__global__ void __launch_bounds__(kThreads, 2) linear_fused_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ weight, const uint8_t* __restrict__ scale,
    const float* __restrict__ global_scale, const T* __restrict__ bias, T* __restrict__ out,
    float* __restrict__ workspace, int64_t m, int64_t n, int64_t k, int64_t tiles_per_split) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t m0 = int64_t(blockIdx.x) * 8 * MT;
  const int64_t nt = blockIdx.y;
  const int64_t tiles_k = padded_k(k) / kTileK;
  const int64_t kc_begin = int64_t(blockIdx.z) * tiles_per_split;
  const int64_t kc_end = min(tiles_k, kc_begin + tiles_per_split);
  const uint4* wbase = reinterpret_cast<const uint4*>(weight) + nt * tiles_k * (kTileBytes / 16);
  const uint4* sbase = reinterpret_cast<const uint4*>(scale) + nt * tiles_k * (kTileScaleBytes / 16);

  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;

  const T* xrow[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int64_t row = min(m0 + mt * 8 + lane / 4, m - 1);
    xrow[mt] = x + row * k + (lane % 4) * 4;
  }
  auto load = [&](Stage<MT>& st, int64_t kc) {
    if (kc < kc_end) load_stage<T, MT>(st, wbase + kc * 64, sbase + kc * 8, xrow, k, kc * kTileK, lane);
  };
  const int64_t kc0 = kc_begin + warp;
  if constexpr (MT == 1) {
    // Three register stages: two tiles in flight while one is decoded.
    Stage<MT> s0, s1, s2;
    load(s0, kc0);
    load(s1, kc0 + kWarps);
    for (int64_t kc = kc0; kc < kc_end; kc += 3 * kWarps) {
      load(s2, kc + 2 * kWarps);
      compute_stage<T, MT>(s0, acc);
      if (kc + kWarps >= kc_end) break;
      load(s0, kc + 3 * kWarps);
      compute_stage<T, MT>(s1, acc);
      if (kc + 2 * kWarps >= kc_end) break;
      load(s1, kc + 4 * kWarps);
      compute_stage<T, MT>(s2, acc);
    }
  } else {
    // Two stages: three would need 177 registers (one CTA per SM), which
    // measured slower at M = 16 than this.
    Stage<MT> cur, nxt;
    load(cur, kc0);
    for (int64_t kc = kc0; kc < kc_end; kc += kWarps) {
      load(nxt, kc + kWarps);
      compute_stage<T, MT>(cur, acc);
      cur = nxt;
    }
  }

  // Fixed-order sum of the warps' fragments.
  __shared__ float partial[kWarps][MT][4][32];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][mt][i][lane] = acc[mt][i];
  __syncthreads();
  for (int e = threadIdx.x; e < 16 * 8 * MT; e += kThreads) {
    const int r = e % 16, mc = e / 16;  // r: row of the W tile, mc: row of x in the CTA
    const int mt = mc / 8, col = mc % 8;
    const int src_lane = (r % 8) * 4 + col / 2, reg = (r / 8) * 2 + (col % 2);
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += partial[w][mt][reg][src_lane];
    const int64_t row = m0 + mc, o = nt * 16 + r;
    if (row >= m) continue;
    if (gridDim.z == 1) {
      float y = sum * (__ldg(global_scale) * kDecodeUnscale);
      if (bias) y += cuda::to_float(bias[o]);
      out[row * n + o] = cuda::from_float<T>(y);
    } else {
      workspace[(int64_t(blockIdx.z) * m + row) * n + o] = sum;
    }
  }
}

template <typename T>
__global__ void split_reduce_kernel(const float* __restrict__ workspace, int64_t splits, int64_t m, int64_t n,
                                    const float* __restrict__ global_scale, const T* __restrict__ bias,
                                    T* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m * n) return;
  float sum = 0.f;
  for (int64_t s = 0; s < splits; ++s) sum += workspace[s * m * n + i];
  float y = sum * (__ldg(global_scale) * kDecodeUnscale);
  if (bias) y += cuda::to_float(bias[i % n]);
  out[i] = cuda::from_float<T>(y);
}

template <typename T, int MT>
cudaError_t launch_fused(const LinearArgs& a, int64_t splits, cudaStream_t stream) {
  const int64_t tiles_k = padded_k(a.k) / kTileK;
  const int64_t per_split = cuda::ceil_div(tiles_k, splits);
  dim3 grid(static_cast<unsigned>(cuda::ceil_div(a.m, 8 * MT)), static_cast<unsigned>(a.n / kTileN),
            static_cast<unsigned>(splits));
  linear_fused_kernel<T, MT><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(a.x), a.weight, a.scale, a.global_scale, static_cast<const T*>(a.bias),
      static_cast<T*>(a.out), a.workspace, a.m, a.n, a.k, per_split);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || splits == 1) return err;
  split_reduce_kernel<T><<<cuda::ceil_div(a.m * a.n, 256), 256, 0, stream>>>(
      a.workspace, splits, a.m, a.n, a.global_scale, static_cast<const T*>(a.bias), static_cast<T*>(a.out));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fused_typed(const LinearArgs& a, int64_t splits, cudaStream_t stream) {
  if (a.m <= 8) return launch_fused<T, 1>(a, splits, stream);
  return launch_fused<T, 2>(a, splits, stream);
}

}  // namespace

cudaError_t prepack_cuda(const PrepackArgs& a, cudaStream_t stream) {
  const int64_t kp = padded_k(a.k);
  if (a.n == 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(a.weight, 0, a.n * kp / 2, stream);
  if (err != cudaSuccess) return err;
  const int64_t scale_bytes = a.n * kp / 16;
  fill_scale_kernel<<<cuda::ceil_div(scale_bytes, 256), 256, 0, stream>>>(a.scale, scale_bytes,
                                                                          encode_scale(0x38).byte);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  const int64_t blocks = a.n * (a.k / 16);
  if (blocks == 0) return cudaSuccess;
  prepack_kernel<<<cuda::ceil_div(blocks, 256), 256, 0, stream>>>(a.codes, a.block_scale, a.n, a.k, kp,
                                                                  reinterpret_cast<uint32_t*>(a.weight), a.scale);
  return cudaGetLastError();
}

cudaError_t unpack_cuda(const UnpackArgs& a, cudaStream_t stream) {
  const int64_t kp = padded_k(a.k);
  const int64_t count = a.n * kp / 8;
  if (count == 0 || a.k == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(cuda::ceil_div(count, 256));
  switch (a.out_dtype) {
    case DType::kBFloat16:
      unpack_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(a.weight), a.scale, a.global_scale, a.n, a.k, kp,
                                                             static_cast<__nv_bfloat16*>(a.out));
      break;
    case DType::kFloat16:
      unpack_kernel<__half><<<grid, 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(a.weight), a.scale, a.global_scale, a.n, a.k, kp,
                                                      static_cast<__half*>(a.out));
      break;
    case DType::kFloat32:
      unpack_kernel<float><<<grid, 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(a.weight), a.scale, a.global_scale, a.n, a.k, kp,
                                                     static_cast<float*>(a.out));
      break;
  }
  return cudaGetLastError();
}

int64_t fused_splits(int64_t m, int64_t n, int64_t k) {
  // At least one CTA per SM (they hold 8 warps each, 2-3 fit on an SM); no
  // split when the N tiles alone give that, which saves the reduce kernel.
  const int64_t tiles_k = padded_k(k) / kTileK;
  const int64_t ctas = cuda::ceil_div(m, m <= 8 ? 8 : 16) * (n / kTileN);
  const int64_t target = int64_t(cuda::num_sms());
  int64_t splits = ctas >= target ? 1 : cuda::ceil_div(target, ctas);
  // each warp of a split should get at least one tile
  const int64_t max_splits = tiles_k / kWarps > 1 ? tiles_k / kWarps : 1;
  if (splits > max_splits) splits = max_splits;
  // no empty split
  const int64_t per = cuda::ceil_div(tiles_k, splits);
  return cuda::ceil_div(tiles_k, per);
}

cudaError_t linear_fused_cuda(const LinearArgs& a, int64_t splits, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return cudaSuccess;
  if (a.dtype == DType::kBFloat16) return launch_fused_typed<__nv_bfloat16>(a, splits, stream);
  if (a.dtype == DType::kFloat16) return launch_fused_typed<__half>(a, splits, stream);
  return cudaErrorInvalidValue;
}

}  // namespace lowbit::nvfp4::gemm
