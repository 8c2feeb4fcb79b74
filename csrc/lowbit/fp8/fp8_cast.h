// FP8 cast (the training recipes' quantizer): one high-precision tensor
// [rows, cols] -> FP8 codes, optionally their transposed copy [cols, rows]
// (scaled as the backward GEMMs need), the scales and the tensor's amax. The
// rules are in fp8_format.h; the arguments are validated by the caller
// (csrc/torch does it), these functions trust shapes and pointers.
#pragma once

#include "lowbit/common.h"
#include "lowbit/fp8/fp8_format.h"

#if defined(LOWBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace lowbit::fp8 {

// Scales of data (`scale`) and of the transposed copy (`scale_t`, whose rows
// are the input's columns), by Scaling:
//   kTensor   scale [],                          scale_t []  (the same value)
//   kRow      scale [rows] (amax over cols),     scale_t [cols] (amax over rows)
//   kBlock    scale [rows, ceil(cols / 128)],    scale_t [cols, ceil(rows / 128)]
//             (1 x 128 tiles of the input, 1 x 128 tiles of its transpose)
//   kBlock2d  scale [ceil(rows/128), ceil(cols/128)], scale_t its transpose
//             (the same tiles: the codes of data_t are data's, transposed)
struct CastArgs {
  const void* input;  // [rows, cols] contiguous, input_dtype
  DType input_dtype;
  int64_t rows, cols;
  Scaling scaling;
  Format format;
  bool pow2;                 // scales rounded up to powers of two
  const float* given_scale;  // [] kTensor only (delayed scaling), or null: from the amax
  uint8_t* data;             // [rows, cols] codes
  float* scale;
  bool transpose;            // write data_t / scale_t
  uint8_t* data_t;           // [cols, rows] codes (may be null when empty)
  float* scale_t;
  float* amax;               // [] max |x| over the tensor (NaN if any is NaN)
  void* workspace;           // CUDA, kRow: cast_workspace_bytes, else unused
};

LOWBIT_HD int64_t ceil_div128(int64_t v) { return (v + kBlockSize - 1) / kBlockSize; }

// Device workspace the CUDA cast needs (0: none). Row scaling: each row's
// and column's scale and its reciprocal (2 floats), then their amaxes.
inline int64_t cast_workspace_bytes(const CastArgs& a) {
  return a.scaling == Scaling::kRow ? (a.rows + a.cols) * int64_t(3 * sizeof(float)) : 0;
}

// out[i] = scale_from_amax(amax[i], fmax, margin, pow2), i < n: the delayed
// recipe's scales from its reduced history (the CPU's; CUDA reduces and
// scales in one kernel, fp8_history.h).
struct ScaleArgs {
  const float* amax;  // [n]
  int64_t n;
  float fmax;
  int margin;
  bool pow2;
  float* out;  // [n]
};

void cast_cpu(const CastArgs& args);
void scale_from_amax_cpu(const ScaleArgs& args);

#if defined(LOWBIT_WITH_CUDA)
// Tensor scaling with a computed scale and row scaling: an amax pass, then
// the cast pass (the scales need the whole tensor's / column's amax before
// any code is written). A given scale and block scaling: one pass, each CTA
// owning whole 128 x 128 tiles.
cudaError_t cast_cuda(const CastArgs& args, cudaStream_t stream);
// out [cols, rows] = in [rows, cols] transposed, one byte per element: the
// transposed copy of FP8 codes that are already made (an FP8 operand whose
// scale is one for the whole tensor, e.g. x all-gathered in FP8). Column
// tiles of 64 run on the grid's y dimension: cols <= kMaxTransposeCols.
constexpr int64_t kMaxTransposeColTiles = 65535;
constexpr int64_t kMaxTransposeCols = kMaxTransposeColTiles * 64;
cudaError_t transpose_codes_cuda(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out, cudaStream_t stream);
#endif

}  // namespace lowbit::fp8
