// The CPU reference of the FP8 cast: plain loops over the rules of
// fp8_format.h (what the CUDA kernels must reproduce bit for bit).
#include <vector>

#include "lowbit/format/float_convert.h"
#include "lowbit/fp8/fp8_cast.h"

namespace lowbit::fp8 {
namespace {

std::vector<float> to_float(const CastArgs& a) {
  const int64_t n = a.rows * a.cols;
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    switch (a.input_dtype) {
      case DType::kFloat32: v[i] = static_cast<const float*>(a.input)[i]; break;
      case DType::kBFloat16: v[i] = bf16_bits_to_float(static_cast<const uint16_t*>(a.input)[i]); break;
      case DType::kFloat16: v[i] = half_bits_to_float(static_cast<const uint16_t*>(a.input)[i]); break;
    }
  }
  return v;
}

}  // namespace

void cast_cpu(const CastArgs& a) {
  const std::vector<float> x = to_float(a);
  const int64_t rows = a.rows, cols = a.cols;
  const float fmax = format_max(a.format);
  auto scale_of = [&](float amax) { return scale_from_amax(amax, fmax, 0, a.pow2); };
  auto at = [&](int64_t i, int64_t j) { return x[static_cast<size_t>(i * cols + j)]; };

  float total = 0.f;
  for (float v : x) total = nan_propagating_absmax(total, v);
  *a.amax = total;

  // Per element: the scale of data's group and of data_t's group.
  std::vector<float> row_s, col_s;  // kRow / kBlock: per row (per tile column) and per column (per tile row)
  const int64_t kb = ceil_div128(cols), mb = ceil_div128(rows);
  switch (a.scaling) {
    case Scaling::kTensor: {
      const float s = a.given_scale ? *a.given_scale : scale_of(total);
      *a.scale = s;
      if (a.transpose) *a.scale_t = s;
      break;
    }
    case Scaling::kRow: {
      row_s.assign(static_cast<size_t>(rows), 0.f);
      col_s.assign(static_cast<size_t>(cols), 0.f);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          row_s[i] = nan_propagating_absmax(row_s[i], at(i, j));
          col_s[j] = nan_propagating_absmax(col_s[j], at(i, j));
        }
      for (auto& s : row_s) s = scale_of(s);
      for (auto& s : col_s) s = scale_of(s);
      for (int64_t i = 0; i < rows; ++i) a.scale[i] = row_s[i];
      if (a.transpose)
        for (int64_t j = 0; j < cols; ++j) a.scale_t[j] = col_s[j];
      break;
    }
    case Scaling::kBlock: {
      // row_s[i * kb + b]: row i, columns [128 b, 128 b + 128); col_s[j * mb + b]:
      // column j, rows [128 b, 128 b + 128).
      row_s.assign(static_cast<size_t>(rows * kb), 0.f);
      col_s.assign(static_cast<size_t>(cols * mb), 0.f);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          float& r = row_s[i * kb + j / kBlockSize];
          float& c = col_s[j * mb + i / kBlockSize];
          r = nan_propagating_absmax(r, at(i, j));
          c = nan_propagating_absmax(c, at(i, j));
        }
      for (auto& s : row_s) s = scale_of(s);
      for (auto& s : col_s) s = scale_of(s);
      for (int64_t i = 0; i < rows * kb; ++i) a.scale[i] = row_s[i];
      if (a.transpose)
        for (int64_t i = 0; i < cols * mb; ++i) a.scale_t[i] = col_s[i];
      break;
    }
    case Scaling::kBlock2d: {
      row_s.assign(static_cast<size_t>(mb * kb), 0.f);  // tile (bi, bj) at bi * kb + bj
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          float& t = row_s[(i / kBlockSize) * kb + j / kBlockSize];
          t = nan_propagating_absmax(t, at(i, j));
        }
      for (auto& s : row_s) s = scale_of(s);
      for (int64_t bi = 0; bi < mb; ++bi)
        for (int64_t bj = 0; bj < kb; ++bj) {
          a.scale[bi * kb + bj] = row_s[bi * kb + bj];
          if (a.transpose) a.scale_t[bj * mb + bi] = row_s[bi * kb + bj];
        }
      break;
    }
  }

  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      float s = 0.f, st = 0.f;
      switch (a.scaling) {
        case Scaling::kTensor: s = st = *a.scale; break;
        case Scaling::kRow: s = row_s[i], st = col_s[j]; break;
        case Scaling::kBlock: s = row_s[i * kb + j / kBlockSize], st = col_s[j * mb + i / kBlockSize]; break;
        case Scaling::kBlock2d: s = st = row_s[(i / kBlockSize) * kb + j / kBlockSize]; break;
      }
      a.data[i * cols + j] = encode(at(i, j), s, a.format);
      if (a.transpose) a.data_t[j * rows + i] = encode(at(i, j), st, a.format);
    }
}

void scale_from_amax_cpu(const ScaleArgs& a) {
  for (int64_t i = 0; i < a.n; ++i) a.out[i] = scale_from_amax(a.amax[i], a.fmax, a.margin, a.pow2);
}

}  // namespace lowbit::fp8
