// The delayed recipe's amax history on the GPU, one launch per step each:
// the scales from the history, and the new amaxes recorded into it. The
// history is float32 [rows, len], row r at history + r * row_stride, column j
// (0: the most recent) at + j * col_stride. The reference is the binding's
// CPU path (ATen ops over the same history, csrc/torch/fp8_ops.cpp); these
// agree with it bit for bit. Arguments are validated by the caller.
#pragma once

#include "lowbit/common.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace lowbit::fp8 {

constexpr int kMaxHistoryRows = 3;  // x, W, dy

// out[i] = scale_from_amax(reduced row i, fmax, margin, pow2), i < rows,
// where a row reduces to its max over the len columns (NaN if any is NaN, as
// at::amax) when amax_max, else to its column 0.
struct HistoryScaleArgs {
  const float* history;  // the first of the rows
  int64_t rows;          // 1 .. kMaxHistoryRows
  int64_t len;           // >= 1
  int64_t row_stride, col_stride;
  bool amax_max;
  float fmax;
  int margin;
  bool pow2;
  float* out;  // [rows]
};

// For each row i < rows, in place: columns [0, len - 1) move to [1, len) and
// column 0 takes *amax[i] where amax < inf, else keeps its previous value (an
// inf or NaN amax is not recorded). Every amax and old column 0 is read
// before the history is written, so an amax may point into the history.
struct HistoryRecordArgs {
  float* history;  // the first of the rows
  int64_t rows;    // 1 .. kMaxHistoryRows
  int64_t len;     // >= 1
  int64_t row_stride, col_stride;
  const float* amax[kMaxHistoryRows];  // [] each, the first `rows` used
};

#if defined(LOWBIT_WITH_CUDA)
// One small kernel each on `stream`; no allocation, no host synchronization
// (capturable in a CUDA graph).
cudaError_t history_scales_cuda(const HistoryScaleArgs& args, cudaStream_t stream);
cudaError_t history_record_cuda(const HistoryRecordArgs& args, cudaStream_t stream);
#endif

}  // namespace lowbit::fp8
