// fp8_history.h: the delayed recipe's history kernels. Each is one tiny
// launch (the few ATen ops they replace were ~8 launches per forward and ~7
// per backward, each mostly launch overhead inside a CUDA graph).
#include "lowbit/fp8/fp8_history.h"

#include <cuda_runtime.h>

#include "lowbit/fp8/fp8_format.h"

namespace lowbit::fp8 {
namespace {

// max(a, b), NaN if either is NaN: at::amax's reduction (not |x|: the
// history is read as it is, whatever it holds).
__device__ __forceinline__ float nan_max(float a, float b) {
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
  return m;
}

// One warp per row: a strided max over the columns (or column 0), then the
// scale rule shared with the CPU (fp8_format.h scale_from_amax). Any
// order of the reduction gives at::amax's scale: max is exact (+0 and -0
// both give scale 1).
__global__ void history_scales_kernel(HistoryScaleArgs a) {
  const int row = threadIdx.x / 32, lane = threadIdx.x % 32;  // blockDim.x == 32 * rows
  const float* h = a.history + row * a.row_stride;
  float m;
  if (a.amax_max) {
    m = -INFINITY;
    for (int64_t j = lane; j < a.len; j += 32) m = nan_max(m, h[j * a.col_stride]);
    for (int o = 16; o > 0; o /= 2) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, o));
  } else {
    m = h[0];
  }
  if (lane == 0) a.out[row] = scale_from_amax(m, a.fmax, a.margin, a.pow2);
}

constexpr int kRecordThreads = 256;
constexpr int kRecordPerThread = 4;
constexpr int64_t kRecordChunk = kRecordThreads * kRecordPerThread;

// One CTA for all rows (at most three of a few thousand floats: a launch's
// worth of work). The roll goes from the old end down in chunks: a chunk is
// read into registers, the CTA synchronizes, then it is written one column
// on. A chunk writes only columns already read (its own, after the barrier;
// the first of the chunk above, an iteration earlier; or the oldest, which
// drops), and the chunk below reads none of them: one barrier per chunk.
__global__ void __launch_bounds__(kRecordThreads) history_record_kernel(HistoryRecordArgs a) {
  __shared__ float value[kMaxHistoryRows];
  const int t = threadIdx.x;
  if (t < a.rows) {
    const float amax = *a.amax[t];
    const float previous = a.history[t * a.row_stride];
    value[t] = amax < INFINITY ? amax : previous;  // false for inf and NaN
  }
  __syncthreads();
  for (int64_t r = 0; r < a.rows; ++r) {
    float* h = a.history + r * a.row_stride;
    for (int64_t end = a.len - 1; end > 0; end -= kRecordChunk) {  // moves columns [start, end) one on
      const int64_t start = end > kRecordChunk ? end - kRecordChunk : 0;
      float v[kRecordPerThread];
#pragma unroll
      for (int k = 0; k < kRecordPerThread; ++k) {
        const int64_t j = start + k * kRecordThreads + t;
        if (j < end) v[k] = h[j * a.col_stride];
      }
      __syncthreads();
#pragma unroll
      for (int k = 0; k < kRecordPerThread; ++k) {
        const int64_t j = start + k * kRecordThreads + t;
        if (j < end) h[(j + 1) * a.col_stride] = v[k];
      }
    }
  }
  // Column 0 is only read before a barrier above and only written here.
  if (t < a.rows) a.history[t * a.row_stride] = value[t];
}

}  // namespace

cudaError_t history_scales_cuda(const HistoryScaleArgs& a, cudaStream_t stream) {
  if (a.rows <= 0 || a.rows > kMaxHistoryRows || a.len < 1) return cudaErrorInvalidValue;
  history_scales_kernel<<<1, unsigned(32 * a.rows), 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t history_record_cuda(const HistoryRecordArgs& a, cudaStream_t stream) {
  if (a.rows <= 0 || a.rows > kMaxHistoryRows || a.len < 1) return cudaErrorInvalidValue;
  history_record_kernel<<<1, kRecordThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace lowbit::fp8
