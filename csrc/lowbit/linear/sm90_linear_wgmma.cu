// The wgmma form of the NVFP4 Linear (kWideMaxM < M <= kWgmmaMaxM;
// sm90_linear_plan.h says where, and picks its tiles, splits and pairs): the
// shared wgmma GEMM of nvfp4_wgmma.cuh on token tiles of x, with the global
// scale and the bias in the epilogue. The same kernel runs the grouped
// (block-diagonal) Linear: each W block reads its group's columns of x.
#include <algorithm>
#include <cstdint>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_wgmma.cuh"
#include "lowbit/linear/sm90_linear_forms.cuh"

namespace lowbit::nvfp4::gemm {
namespace {

using wgmma::kBN;
static_assert(kBN == kWgmmaBlockRows, "sm90_linear_plan.h names the wgmma block's rows for the bindings");

// Token tile blockIdx.z of NT tokens (pairs: 2 blockIdx.z + blockIdx.x),
// W block blockIdx.y of 128 rows. Grouped (group_n > 0): W rows
// [g group_n, (g + 1) group_n) multiply x columns [g K, (g + 1) K).
template <typename T, int NT, bool kPair = false>
struct LinearProblem {
  const float* global_scale;
  const T* bias;  // [N] or null
  T* out;         // [M, N]
  int64_t m, n;
  int64_t group_n;  // W rows per group (a multiple of 128), or 0
  int64_t k;

  __device__ __forceinline__ bool tile(wgmma::Tile& t) const {
    t.w_tile_row = static_cast<int32_t>(blockIdx.y * (kBN / kTileN));
    t.x_row = static_cast<int32_t>((kPair ? 2 * blockIdx.z + blockIdx.x : blockIdx.z) * NT);
    t.x_col = group_n ? static_cast<int32_t>(int64_t(blockIdx.y) * kBN / group_n * k) : 0;
    t.group = 0;
    t.rows = NT;
    return true;
  }
  // y[token][o..o + 7] = sum * global * 2^8 + bias for tokens [r0, r1) of the tile.
  __device__ __forceinline__ void store(const wgmma::DumpView<NT>& dump, const wgmma::Tile& t, int r0, int r1) const {
    // A plain load: the problem is one by-value parameter that also holds x's
    // pointer, so only coherent loads may read through it.
    const float gs = *global_scale * kDecodeUnscale;
    const int64_t n0 = int64_t(blockIdx.y) * kBN;
    for (int e = threadIdx.x; e < (r1 - r0) * (kBN / 8); e += 256) {
      const int r = r0 + e / (kBN / 8), c = 8 * (e % (kBN / 8));
      const int64_t token = int64_t(t.x_row) + r, o = n0 + c;
      if (token >= m || o >= n) continue;
      float v[8];
      dump.sum8(r, c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = v[i] * gs + (bias ? cuda::to_float(bias[o + i]) : 0.f);
      cuda::store8(out + token * n + o, v);
    }
  }
};

template <typename T, int NT, bool kPair>
cudaError_t launch_nt(const LinearArgs& a, int splits, int64_t group_n, cudaStream_t stream) {
  wgmma::Maps maps;
  const int64_t x_cols = group_n ? a.n / group_n * a.k : a.k;
  cudaError_t err = wgmma::make_maps(maps, a.x, a.dtype, a.m, a.k, NT, a.weight, a.scale, a.n,
                                     wgmma::Config<NT, kPair>::kRawTilesCta, x_cols);
  if (err != cudaSuccess) return err;
  const LinearProblem<T, NT, kPair> problem{a.global_scale, static_cast<const T*>(a.bias), static_cast<T*>(a.out),
                                            a.m, a.n, group_n, a.k};
  return wgmma::launch<T, NT, kPair>(maps, problem, a.k, splits, cuda::ceil_div(a.n, kBN), cuda::ceil_div(a.m, NT),
                                     stream);
}

template <typename T>
cudaError_t launch_typed(const LinearArgs& a, const LinearPlan& p, int64_t group_n, cudaStream_t stream) {
  const int splits = static_cast<int>(p.splits);
  if (p.wgmma_pair) return launch_nt<T, 256, true>(a, splits, group_n, stream);
  return p.mt == 128 ? launch_nt<T, 128, false>(a, splits, group_n, stream)
                     : launch_nt<T, 256, false>(a, splits, group_n, stream);
}

cudaError_t launch_dtype(const LinearArgs& a, const LinearPlan& p, int64_t group_n, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return cudaSuccess;
  if (a.dtype == DType::kBFloat16) return launch_typed<__nv_bfloat16>(a, p, group_n, stream);
  if (a.dtype == DType::kFloat16) return launch_typed<__half>(a, p, group_n, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

int64_t linear_wgmma_resident_clusters(int tokens, int splits) {
  return tokens == 128 ? wgmma::resident_clusters<128, LinearProblem<__nv_bfloat16, 128>>(splits)
                       : wgmma::resident_clusters<256, LinearProblem<__nv_bfloat16, 256>>(splits);
}

cudaError_t linear_wgmma_cuda(const LinearArgs& a, const LinearPlan& plan, cudaStream_t stream) {
  return launch_dtype(a, plan, 0, stream);
}

cudaError_t grouped_linear_wgmma_cuda(const LinearArgs& a, int64_t group_n, cudaStream_t stream) {
  if (group_n <= 0 || group_n % kBN || a.n % group_n || a.k % kTileK) return cudaErrorInvalidValue;
  LinearPlan p{};
  p.path = LinearPath::kWgmma;
  p.mt = linear_wgmma_tokens(a.m);
  p.splits = linear_wgmma_splits(a.m, a.n, a.k);
  p.wgmma_pair = linear_wgmma_pairs(a.m, p.splits);
  return launch_dtype(a, p, group_n, stream);
}

}  // namespace lowbit::nvfp4::gemm
