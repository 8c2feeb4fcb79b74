// CUDA kernels of the FP8 cast (rules in fp8_format.h, reference in
// fp8_cast_cpu.cpp). A CTA owns one 128 x 128 tile of the input: thread t
// reads column t % 128 of rows t / 128, t / 128 + 2, ..., so a warp reads 32
// consecutive elements of one row. The transposed copy is staged in shared
// memory and stored row by row of the transpose.
//
// First version, not tuned (no vector loads, byte stores); tensor and row
// scaling read the input twice (amax pass, cast pass): fusing them needs the
// amax before the codes, e.g. from the previous step (delayed scaling) or a
// grid-wide barrier.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "lowbit/fp8/fp8_cast.h"

namespace lowbit::fp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kRowStep = kThreads / kBlockSize;  // rows a CTA pass advances by

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

// NaN-propagating max of two amaxes (>= 0 or NaN).
__device__ __forceinline__ float amax2(float a, float b) { return nan_propagating_absmax(a, b); }

// Amaxes are >= 0 (or a positive NaN, whose bits order above inf), so their
// bits order as unsigned and atomicMax on the bits is a float max.
__device__ __forceinline__ void atomic_amax(float* p, float v) {
  atomicMax(reinterpret_cast<unsigned*>(p), __float_as_uint(v));
}
__device__ __forceinline__ void atomic_amax(unsigned* p, float v) { atomicMax(p, __float_as_uint(v)); }

__device__ __forceinline__ float warp_amax(float v) {
  for (int o = 16; o > 0; o /= 2) v = amax2(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

struct Tile {
  int64_t row0, col0;  // the tile's first element
  int c, r0;           // this thread's column in the tile, its first row
  __device__ Tile() {
    row0 = int64_t(blockIdx.x) * kBlockSize;
    col0 = int64_t(blockIdx.y) * kBlockSize;
    c = threadIdx.x % kBlockSize;
    r0 = threadIdx.x / kBlockSize;
  }
};

// Amaxes of the tile: every thread's column amax (returned), each row's amax
// through `row_sink(r, v)` (from lane 0 of the warp that read it), and the
// CTA's share of the tensor amax through atomic_amax(total).
template <typename T, typename RowSink>
__device__ float tile_amaxes(const T* x, int64_t rows, int64_t cols, const Tile& t, float* total, RowSink row_sink) {
  const int64_t j = t.col0 + t.c;
  float col = 0.f;
  for (int r = t.r0; r < kBlockSize; r += kRowStep) {
    const int64_t i = t.row0 + r;
    if (i >= rows) break;  // whole warps: i depends on the warp only
    const float v = j < cols ? to_float(x[i * cols + j]) : 0.f;
    col = amax2(col, v);
    const float row = warp_amax(fabsf(v));
    if (threadIdx.x % 32 == 0) row_sink(r, row);
  }
  const float cta = warp_amax(col);
  if (threadIdx.x % 32 == 0) atomic_amax(total, cta);
  return col;
}

// Tensor amax (and, with row_amax / col_amax, every row's and column's).
template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* x, int64_t rows, int64_t cols, float* total,
                                                        unsigned* row_amax, unsigned* col_amax) {
  const Tile t;
  const float col = tile_amaxes(x, rows, cols, t, total, [&](int r, float v) {
    if (row_amax) atomic_amax(row_amax + t.row0 + r, v);
  });
  const int64_t j = t.col0 + t.c;
  if (col_amax && j < cols) atomic_amax(col_amax + j, col);
}

struct CastParams {
  int64_t rows, cols;
  Scaling scaling;
  Format format;
  bool pow2;
  const float* given_scale;
  const unsigned* row_amax;  // kRow: [rows] then [cols], from amax_kernel
  const unsigned* col_amax;
  uint8_t* data;
  float* scale;
  bool transpose;
  uint8_t* data_t;
  float* scale_t;
  float* amax;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) cast_kernel(const T* x, CastParams p) {
  __shared__ unsigned row_bits[kBlockSize], col_bits[kBlockSize];
  __shared__ float row_s[kBlockSize], col_s[kBlockSize];
  __shared__ uint8_t tile_t[kBlockSize][kBlockSize + 4];
  const Tile t;
  const float fmax = format_max(p.format);
  auto scale_of = [&](float amax) { return scale_from_amax(amax, fmax, 0, p.pow2); };
  const int64_t kb = ceil_div128(p.cols), mb = ceil_div128(p.rows);
  const int64_t j = t.col0 + t.c;

  if (p.scaling == Scaling::kBlock || p.scaling == Scaling::kBlock2d) {
    if (threadIdx.x < kBlockSize) row_bits[threadIdx.x] = 0u;
    __syncthreads();
    const float col = tile_amaxes(x, p.rows, p.cols, t, p.amax, [&](int r, float v) { atomicMax(row_bits + r, __float_as_uint(v)); });
    // The two threads of a column combine theirs.
    if (t.r0 == 0) col_bits[t.c] = __float_as_uint(col);
    __syncthreads();
    if (t.r0 == 1) atomicMax(col_bits + t.c, __float_as_uint(col));
    __syncthreads();
  }

  if (threadIdx.x < kBlockSize) {
    const int k = threadIdx.x;
    float rs = 0.f, cs = 0.f;
    switch (p.scaling) {
      case Scaling::kTensor:
        rs = cs = p.given_scale ? *p.given_scale : scale_of(*p.amax);
        break;
      case Scaling::kRow:
        rs = t.row0 + k < p.rows ? scale_of(__uint_as_float(p.row_amax[t.row0 + k])) : 1.f;
        cs = t.col0 + k < p.cols ? scale_of(__uint_as_float(p.col_amax[t.col0 + k])) : 1.f;
        break;
      case Scaling::kBlock:
        rs = scale_of(__uint_as_float(row_bits[k]));
        cs = scale_of(__uint_as_float(col_bits[k]));
        break;
      case Scaling::kBlock2d: {
        float m = 0.f;  // the tile's amax: every thread reads the 128 column amaxes
        for (int q = 0; q < kBlockSize; ++q) m = amax2(m, __uint_as_float(col_bits[q]));
        rs = cs = scale_of(m);
        break;
      }
    }
    row_s[k] = rs;
    col_s[k] = cs;
    const int64_t i = t.row0 + k, jj = t.col0 + k;
    switch (p.scaling) {
      case Scaling::kTensor:
        if (blockIdx.x == 0 && blockIdx.y == 0 && k == 0) {
          *p.scale = rs;
          if (p.transpose) *p.scale_t = rs;
        }
        break;
      case Scaling::kRow:
        if (blockIdx.y == 0 && i < p.rows) p.scale[i] = rs;
        if (p.transpose && blockIdx.x == 0 && jj < p.cols) p.scale_t[jj] = cs;
        break;
      case Scaling::kBlock:
        if (i < p.rows) p.scale[i * kb + blockIdx.y] = rs;
        if (p.transpose && jj < p.cols) p.scale_t[jj * mb + blockIdx.x] = cs;
        break;
      case Scaling::kBlock2d:
        if (k == 0) {
          p.scale[int64_t(blockIdx.x) * kb + blockIdx.y] = rs;
          if (p.transpose) p.scale_t[int64_t(blockIdx.y) * mb + blockIdx.x] = rs;
        }
        break;
    }
  }
  __syncthreads();

  for (int r = t.r0; r < kBlockSize; r += kRowStep) {
    const int64_t i = t.row0 + r;
    if (i >= p.rows || j >= p.cols) continue;
    const float v = to_float(x[i * p.cols + j]);
    p.data[i * p.cols + j] = encode(v, row_s[r], p.format);
    if (p.transpose) tile_t[t.c][r] = encode(v, col_s[t.c], p.format);
  }
  if (!p.transpose) return;
  __syncthreads();
  for (int e = threadIdx.x; e < kBlockSize * kBlockSize; e += kThreads) {
    const int cc = e / kBlockSize, rr = e % kBlockSize;
    const int64_t jj = t.col0 + cc, i = t.row0 + rr;
    if (jj < p.cols && i < p.rows) p.data_t[jj * p.rows + i] = tile_t[cc][rr];
  }
}

// Scales of an empty tensor (no element, amax 0): 1, or the given scale.
__global__ void fill_scales_kernel(float* s, int64_t n, const float* given) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) s[i] = given ? *given : 1.f;
}

__global__ void scale_from_amax_kernel(ScaleArgs a) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < a.n) a.out[i] = scale_from_amax(a.amax[i], a.fmax, a.margin, a.pow2);
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

template <typename T>
cudaError_t launch(const CastArgs& a, cudaStream_t stream) {
  const T* x = static_cast<const T*>(a.input);
  const dim3 grid(unsigned(ceil_div128(a.rows)), unsigned(ceil_div128(a.cols)));
  CastParams p{a.rows, a.cols, a.scaling, a.format, a.pow2, a.given_scale, nullptr, nullptr,
               a.data, a.scale, a.transpose, a.data_t, a.scale_t, a.amax};
  if (a.scaling == Scaling::kTensor || a.scaling == Scaling::kRow) {
    unsigned* row_amax = nullptr;
    unsigned* col_amax = nullptr;
    if (a.scaling == Scaling::kRow) {
      row_amax = static_cast<unsigned*>(a.workspace);
      col_amax = row_amax + a.rows;
      cudaError_t err = cudaMemsetAsync(row_amax, 0, cast_workspace_bytes(a), stream);
      if (err != cudaSuccess) return err;
    }
    amax_kernel<T><<<grid, kThreads, 0, stream>>>(x, a.rows, a.cols, a.amax, row_amax, col_amax);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    p.row_amax = row_amax;
    p.col_amax = col_amax;
  }
  cast_kernel<T><<<grid, kThreads, 0, stream>>>(x, p);
  return cudaGetLastError();
}

}  // namespace

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

cudaError_t scale_from_amax_cuda(const ScaleArgs& a, cudaStream_t stream) {
  if (a.n == 0) return cudaSuccess;
  scale_from_amax_kernel<<<unsigned((a.n + 255) / 256), 256, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace lowbit::fp8
