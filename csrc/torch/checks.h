// Argument checks shared by every op binding. Each failure raises a Python
// exception (ValueError for shapes/values, TypeError for dtypes) whose message
// names the op, the argument, what was expected and what was given.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <sstream>
#include <string>

#include "lowbit/common.h"

namespace lowbit::ops {

inline std::string describe_dtypes(std::initializer_list<at::ScalarType> allowed) {
  std::ostringstream os;
  bool first = true;
  for (auto t : allowed) {
    os << (first ? "" : " or ") << c10::toString(t);
    first = false;
  }
  return os.str();
}

inline void check_dtype(const at::Tensor& t, const char* op, const char* arg,
                        std::initializer_list<at::ScalarType> allowed) {
  for (auto a : allowed)
    if (t.scalar_type() == a) return;
  TORCH_CHECK_TYPE(false, "lowbit.", op, ": argument '", arg, "' must have dtype ", describe_dtypes(allowed),
                   ", got ", t.scalar_type());
}

inline void check_dims(const at::Tensor& t, const char* op, const char* arg, std::initializer_list<int64_t> dims) {
  for (auto d : dims)
    if (t.dim() == d) return;
  std::ostringstream os;
  bool first = true;
  for (auto d : dims) {
    os << (first ? "" : " or ") << d;
    first = false;
  }
  TORCH_CHECK_VALUE(false, "lowbit.", op, ": argument '", arg, "' must be ", os.str(), "-D, got shape ",
                    t.sym_sizes());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* arg,
                              const char* ref_arg) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "lowbit.", op, ": argument '", arg, "' must be on the device of '",
                    ref_arg, "' (", ref.device(), "), got ", t.device());
}

inline void check_last_dim_multiple(const at::Tensor& t, int64_t multiple, const char* op, const char* arg) {
  const c10::SymInt& k = t.sym_sizes().back();
  TORCH_CHECK_VALUE(k % multiple == 0, "lowbit.", op, ": argument '", arg, "' must have a last dimension divisible by ",
                    multiple, ", got shape ", t.sym_sizes());
}

inline void check_shape(const at::Tensor& t, c10::SymIntArrayRef expected, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(t.sym_sizes() == expected, "lowbit.", op, ": argument '", arg, "' must have shape ", expected,
                    ", got ", t.sym_sizes());
}

// Contiguous, with the data pointer aligned to `alignment` bytes so kernels
// can use vector accesses; copies only when the input is not already so.
inline at::Tensor contiguous_aligned(const at::Tensor& t, int64_t alignment) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % alignment != 0) c = c.clone();
  return c;
}

inline DType to_lowbit_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK_TYPE(false, "lowbit: unsupported dtype ", t);
  }
}

}  // namespace lowbit::ops
