// CUDA row-wise top-k (topk.h), two stages:
//   1. grid (rows, chunks): a CTA loads kChunk columns of a row as 32-bit
//      order keys into shared memory, finds the k-th largest key by radix
//      select (4 passes of 8 bits, warp-aggregated shared histograms) and
//      writes its top-k candidates (key, column) to the workspace in column
//      order, so position order is index order for the tie rule.
//   2. grid (rows): a CTA radix-selects the top k among the row's candidates,
//      sorts them by rank (key desc, column asc) and gathers the values from
//      the input, bit for bit.
#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/routing/topk.h"

namespace lowbit::topk {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads1 = 512;
constexpr int kThreads2 = 512;
constexpr uint32_t kPadKey = 0;  // below every real key (-inf maps to 0x007fffff)

template <typename T>
__device__ __forceinline__ uint32_t key_of(const T* p) {
  return order_key(cuda::to_float(*p));
}

// Exclusive prefix sums of two per-thread counts across the CTA.
template <int THREADS>
__device__ __forceinline__ void block_exclusive_scan2(uint32_t& a, uint32_t& b, uint32_t* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t ia = a, ib = b;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t xa = __shfl_up_sync(kFull, ia, off), xb = __shfl_up_sync(kFull, ib, off);
    if (lane >= off) {
      ia += xa;
      ib += xb;
    }
  }
  if (lane == 31) {
    scratch[warp] = ia;
    scratch[32 + warp] = ib;
  }
  __syncthreads();
  uint32_t oa = 0, ob = 0;
  for (int w = 0; w < warp; ++w) {
    oa += scratch[w];
    ob += scratch[32 + w];
  }
  a = oa + ia - a;
  b = ob + ib - b;
  __syncthreads();
}

struct SelectShared {
  uint32_t hist[256];
  uint32_t scratch[64];
  uint32_t prefix, remaining;
};

// Finds the k-th largest key T among keys[0, n) (generic pointer: shared or
// global). On return sh.prefix = T and sh.remaining = how many elements equal
// to T belong to the top k (the lowest-positioned ones).
template <int THREADS>
__device__ void radix_select(const uint32_t* keys, int n, int k, SelectShared& sh) {
  static_assert(THREADS >= 256, "one thread per histogram bin");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    sh.prefix = 0;
    sh.remaining = k;
  }
  uint32_t mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += THREADS) sh.hist[i] = 0;
    __syncthreads();
    const uint32_t prefix = sh.prefix;
    const uint32_t remaining = sh.remaining;
    // All lanes take part in each round so that __match_any_sync is safe.
    for (int base = 0; base < n; base += THREADS) {
      const int i = base + threadIdx.x;
      const uint32_t key = i < n ? keys[i] : kPadKey;
      const bool in = i < n && (key & mask) == prefix;
      const uint32_t digit = in ? (key >> shift) & 255u : 256u;
      const unsigned peers = __match_any_sync(kFull, digit);
      if (in && lane == __ffs(peers) - 1) atomicAdd(&sh.hist[digit], __popc(peers));
    }
    __syncthreads();
    // Suffix sums over the bins: the digit is the bin where the count of
    // larger-or-equal keys first reaches `remaining`.
    uint32_t c = 0, suffix = 0;
    if (threadIdx.x < 256) {
      c = sh.hist[255 - threadIdx.x];  // reversed: lane order = descending digit
      suffix = c;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const uint32_t x = __shfl_up_sync(kFull, suffix, off);
        if (lane >= off) suffix += x;
      }
      if (lane == 31) sh.scratch[warp] = suffix;
    }
    __syncthreads();
    if (threadIdx.x < 256) {
      for (int w = 0; w < warp; ++w) suffix += sh.scratch[w];
      if (suffix >= remaining && suffix - c < remaining) {
        sh.prefix = prefix | (uint32_t(255 - threadIdx.x) << shift);
        sh.remaining = remaining - (suffix - c);
      }
    }
    mask |= 255u << shift;
    __syncthreads();
  }
}

// Writes the top-k of keys[0, n) in position order: out_key/out_idx[j] for
// the j-th selected element; idx_of(i) gives the index stored for position i.
template <int THREADS, typename IdxOf>
__device__ void compact_selected(const uint32_t* keys, int n, const SelectShared& sh, IdxOf idx_of,
                                 uint32_t* out_key, int32_t* out_idx, uint32_t* scratch) {
  const uint32_t t = sh.prefix, ties = sh.remaining;
  const int seg = (n + THREADS - 1) / THREADS;
  const int lo = min(n, int(threadIdx.x) * seg), hi = min(n, lo + seg);
  uint32_t gt = 0, eq = 0;
  for (int i = lo; i < hi; ++i) {
    const uint32_t key = keys[i];
    gt += key > t;
    eq += key == t;
  }
  block_exclusive_scan2<THREADS>(gt, eq, scratch);
  for (int i = lo; i < hi; ++i) {
    const uint32_t key = keys[i];
    if (key > t || (key == t && eq < ties)) {
      const uint32_t pos = gt + min(eq, ties);
      out_key[pos] = key;
      out_idx[pos] = idx_of(i);
    }
    gt += key > t;
    eq += key == t;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads1)
    stage1_kernel(const T* __restrict__ input, int64_t cols, int32_t k, int64_t chunks, uint32_t* __restrict__ ws_key,
                  int32_t* __restrict__ ws_idx) {
  __shared__ uint32_t keys[kChunk];
  __shared__ SelectShared sh;
  const int64_t row = blockIdx.x;
  const int64_t c0 = int64_t(blockIdx.y) * kChunk;
  const int n = static_cast<int>(min(kChunk, cols - c0));
  const T* src = input + row * cols + c0;
  for (int i = threadIdx.x; i < n; i += kThreads1) keys[i] = key_of(src + i);
  __syncthreads();
  const int kk = min(k, n);
  uint32_t* out_key = ws_key + (row * chunks + blockIdx.y) * k;
  int32_t* out_idx = ws_idx + (row * chunks + blockIdx.y) * k;
  for (int j = kk + threadIdx.x; j < k; j += kThreads1) {
    out_key[j] = kPadKey;
    out_idx[j] = 0x7fffffff;
  }
  radix_select<kThreads1>(keys, n, kk, sh);
  compact_selected<kThreads1>(
      keys, n, sh, [&](int i) { return static_cast<int32_t>(c0 + i); }, out_key, out_idx, sh.scratch);
}

template <typename T>
__global__ void __launch_bounds__(kThreads2)
    stage2_kernel(const T* __restrict__ input, int64_t cols, int32_t k, int64_t chunks, const uint32_t* ws_key,
                  const int32_t* ws_idx, T* __restrict__ values, int32_t* __restrict__ indices) {
  __shared__ uint32_t sel_key[kMaxK];
  __shared__ int32_t sel_idx[kMaxK];
  __shared__ SelectShared sh;
  const int64_t row = blockIdx.x;
  const int n = static_cast<int>(chunks * k);
  const uint32_t* keys = ws_key + row * n;
  const int32_t* idx = ws_idx + row * n;
  radix_select<kThreads2>(keys, n, k, sh);
  compact_selected<kThreads2>(keys, n, sh, [&](int i) { return idx[i]; }, sel_key, sel_idx, sh.scratch);
  __syncthreads();
  for (int j = threadIdx.x; j < k; j += kThreads2) {
    const uint32_t kj = sel_key[j];
    const int32_t ij = sel_idx[j];
    int rank = 0;
    for (int o = 0; o < k; ++o) {
      const uint32_t ko = sel_key[o];
      rank += ko > kj || (ko == kj && sel_idx[o] < ij);
    }
    indices[row * k + rank] = ij;
    values[row * k + rank] = input[row * cols + ij];
  }
}

template <typename T>
cudaError_t topk_typed(const TopkArgs& a, cudaStream_t stream) {
  const int64_t chunks = cuda::ceil_div(a.cols, kChunk);
  uint32_t* ws_key = a.workspace;
  int32_t* ws_idx = reinterpret_cast<int32_t*>(a.workspace + a.rows * chunks * a.k);
  const T* in = static_cast<const T*>(a.input);
  stage1_kernel<T><<<dim3(static_cast<unsigned>(a.rows), static_cast<unsigned>(chunks)), kThreads1, 0, stream>>>(
      in, a.cols, a.k, chunks, ws_key, ws_idx);
  stage2_kernel<T><<<static_cast<unsigned>(a.rows), kThreads2, 0, stream>>>(in, a.cols, a.k, chunks, ws_key, ws_idx,
                                                                            static_cast<T*>(a.values), a.indices);
  return cudaGetLastError();
}

}  // namespace

cudaError_t topk_cuda(const TopkArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  return a.input_dtype == DType::kBFloat16 ? topk_typed<__nv_bfloat16>(a, stream) : topk_typed<float>(a, stream);
}

}  // namespace lowbit::topk
