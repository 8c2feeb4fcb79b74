// CUDA kernels of the NVFP4 MoE (nvfp4_moe.h). Four launches (five on the
// wgmma path), grids sized from upper bounds known on the host (no host
// synchronization, so a CUDA graph captures them):
//   1. align (one CTA): counts the (token, slot) pairs per expert, gives each
//      pair a row in expert-sorted order and cuts each expert's rows into
//      work items (expert, first row, rows) of at most 16 rows (narrow
//      kernels), 8 MT (wide) or NT (wgmma). In the narrow plan with many
//      W tiles, experts of more than 16 rows get items of up to 64 rows in
//      a second, hot list.
//   2. up: per work item and 16-row tile of W13 the decode + mma main loop
//      (nvfp4_mainloops.cuh) over K = H, with x's rows gathered through the
//      sorted order; the epilogue applies the global scale and the clamped
//      SwiGLU (gate and up of one column are rows r and r + 8 of the
//      interleaved tile) and writes h, rounded to x's dtype, in sorted order.
//      The narrow form (few rows per expert) runs 1-8 warps per W tile and
//      1 or 4 tiles per CTA (narrow_shape), one or two 8-row m-tiles as
//      the item needs (one token: streaming warps, stream_mainloop, as the
//      Linear's stream kernel); with a hot list, the mixed form runs the
//      hot items as the wide form below and the narrow ones with one warp
//      per W tile, 8 tiles per CTA, in one launch. With more rows per expert
//      (plan()) the wide form takes 128 W rows per CTA with x staged in
//      shared memory; with many,
//      the wgmma form (nvfp4_wgmma.cuh: W decoded into shared memory by
//      warps of its own, wgmma) takes 128 W rows x NT rows per CTA, after a
//      kernel that writes x in sorted order.
//   3. down: the same over K = I with h's rows, writing each pair's expert
//      output (x's dtype) in sorted order.
//   4. combine: per token and 1024 columns, adds the token's k expert
//      outputs times their weights in FP32, in slot order, and rounds once.
// Only experts that received tokens have work items, so only their weights
// are read. A pair's row position depends on the order of shared-memory
// atomics, but every row is computed independently of its position (the
// mma's rows do not interact and every sum runs in a fixed order), so the
// output is bitwise reproducible.
//
// Chaining (docs/ARCHITECTURE.md, "Chained kernels"): every kernel but the
// wide ones is a programmatic dependent launch (the wgmma kernels' threads
// all wait before they read their item). The up kernel lets the down
// kernel start only after its own wait for the align kernel, so the down
// kernel's CTAs can pick W tiles from their items and prefetch them into L2
// while the up kernel drains, then wait for h.
#include <algorithm>
#include <cstddef>
#include <limits>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/linear/nvfp4_linear.h"
#include "lowbit/linear/nvfp4_linear_layout.h"
#include "lowbit/linear/nvfp4_mainloops.cuh"
#include "lowbit/linear/nvfp4_wgmma.cuh"
#include "lowbit/moe/nvfp4_moe.h"

namespace lowbit::nvfp4::moe {
namespace {

using gemm::kDecodeUnscale;
using gemm::kTileBytes;
using gemm::kTileK;
using gemm::kTileScaleBytes;
using gemm::padded_k;
using gemm::mma::kThreads;

constexpr int kAlignThreads = 1024;

// Work item: expert, first sorted row, number of rows (<= kNarrowItemRows
// in the narrow kernels, <= 8 MT in the wide ones).
struct Item {
  int32_t expert, row, rows, pad;
};

// Per-thread counts the align kernel scans over experts: rows, and work
// items of the narrow (or only) list and of the hot list.
struct AlignCounts {
  int rows, items, hot;
};
__device__ __forceinline__ AlignCounts warp_inclusive_scan(AlignCounts c, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int r = __shfl_up_sync(0xffffffffu, c.rows, o), i = __shfl_up_sync(0xffffffffu, c.items, o),
              h = __shfl_up_sync(0xffffffffu, c.hot, o);
    if (lane >= o) c = AlignCounts{c.rows + r, c.items + i, c.hot + h};
  }
  return c;
}

// Expert-sorted rows and work items. An expert with more than hot_above
// rows gets items of hot_chunk rows in hot_items (the hot list, counted in
// num_items[1]); every other expert gets items of `chunk` rows in items
// (num_items[0]). hot_above >= M: no hot list.
__global__ void __launch_bounds__(kAlignThreads)
    moe_align_kernel(const int32_t* ids, int64_t slots, int64_t k, int experts, int chunk,
                     int hot_above, int hot_chunk, int32_t* __restrict__ slot_pos, int32_t* __restrict__ sorted_token,
                     Item* __restrict__ items, Item* __restrict__ hot_items, int32_t* __restrict__ num_items) {
  extern __shared__ int32_t count[];  // [experts]: rows per expert, then each expert's first row
  __shared__ AlignCounts warp_counts[kAlignThreads / 32];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  cuda::allow_dependent_launch();  // the up kernel's CTAs get resident and wait for the items
  for (int e = tid; e < experts; e += kAlignThreads) count[e] = 0;
  __syncthreads();
  cuda::wait_for_previous_grid();  // ids come from the router
  // Rank of each pair within its expert (ids outside [0, E) are dropped).
  for (int64_t i = tid; i < slots; i += kAlignThreads) {
    const int32_t e = ids[i];
    slot_pos[i] = (e >= 0 && e < experts) ? atomicAdd(&count[e], 1) : -1;
  }
  __syncthreads();

  // Exclusive scans of rows and of both lists' items over experts; each
  // thread owns a contiguous range of experts.
  const int per = (experts + kAlignThreads - 1) / kAlignThreads;
  const int e0 = min(experts, tid * per), e1 = min(experts, e0 + per);
  AlignCounts own{0, 0, 0};
  for (int e = e0; e < e1; ++e) {
    const int c = count[e];
    own.rows += c;
    if (c > hot_above)
      own.hot += (c + hot_chunk - 1) / hot_chunk;
    else
      own.items += (c + chunk - 1) / chunk;
  }
  const AlignCounts incl = warp_inclusive_scan(own, lane);
  if (lane == 31) warp_counts[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const AlignCounts w = warp_counts[lane];
    const AlignCounts w_incl = warp_inclusive_scan(w, lane);
    warp_counts[lane] = AlignCounts{w_incl.rows - w.rows, w_incl.items - w.items, w_incl.hot - w.hot};
    if (lane == 31) {
      num_items[0] = w_incl.items;
      num_items[1] = w_incl.hot;
    }
  }
  __syncthreads();
  const AlignCounts base = warp_counts[warp];
  int row = base.rows + incl.rows - own.rows, item = base.items + incl.items - own.items,
      hot = base.hot + incl.hot - own.hot;
  for (int e = e0; e < e1; ++e) {
    const int c = count[e];
    if (c > hot_above)
      for (int s = 0; s < c; s += hot_chunk) hot_items[hot++] = Item{e, row + s, min(hot_chunk, c - s), 0};
    else
      for (int s = 0; s < c; s += chunk) items[item++] = Item{e, row + s, min(chunk, c - s), 0};
    count[e] = row;
    row += c;
  }
  __syncthreads();
  // Same i -> thread mapping as the ranking loop: each thread reads back its own writes.
  for (int64_t i = tid; i < slots; i += kAlignThreads) {
    const int32_t rank = slot_pos[i];
    if (rank < 0) continue;
    const int32_t pos = count[ids[i]] + rank;
    slot_pos[i] = pos;
    sorted_token[pos] = static_cast<int32_t>(i / k);
  }
}

// ---- pieces shared by the four GEMM kernels -------------------------------

// Where a GEMM kernel finds its work item blockIdx.y: the align kernel's
// list, or, for a single token (direct: no align kernel, no grouping to
// do), the token's slots themselves: slot y is the item (ids[y], row y, 1
// row), skipped when its id is outside [0, E). Rows are then in slot order.
struct WorkList {
  const Item* items;          // null: direct
  const int32_t* num_items;
  const int32_t* ids;         // direct: [slots]
  int32_t slots, experts;
  int32_t capacity;           // items' length (bounds a count read before the kernel's wait)

  __device__ __forceinline__ bool fetch(Item& it) const { return fetch_at(static_cast<int>(blockIdx.y), it); }
  __device__ __forceinline__ int count() const { return min(max(*num_items, 0), capacity); }
  __device__ __forceinline__ bool fetch_at(int y, Item& it) const {
    if (items) {
      if (y >= count()) return false;
      it = items[y];
      return true;
    }
    if (y >= slots) return false;
    const int32_t e = ids[y];
    it = Item{e, y, 1, 0};
    return e >= 0 && e < experts;
  }
};
// scripts/check_dependent_loads.py (POINTERS_FIRST) takes the words past the
// pointers for counts, which may index non-coherent loads of module state.
static_assert(offsetof(WorkList, slots) == 3 * sizeof(void*), "WorkList: pointers first");

// Row r of an item: gathered through sorted_token (kGather, up: rows of x;
// null sorted_token: the direct list's one token), or the item's own row in
// sorted order (down: rows of h).
template <bool kGather, typename T>
__device__ __forceinline__ const T* item_row(const T* base, const int32_t* sorted_token, const Item& it, int r,
                                             int64_t row_elems) {
  const int64_t row = !kGather ? it.row + r : sorted_token ? sorted_token[it.row + r] : 0;
  return base + row * row_elems;
}

// silu(min(gate, L)) * clamp(up, -L, L); comparisons keep NaN, as torch.clamp does.
__device__ __forceinline__ float clamped_swiglu(float gate, float up, bool has_limit, float limit) {
  if (has_limit) {
    gate = gate > limit ? limit : gate;
    up = up > limit ? limit : (up < -limit ? -limit : up);
  }
  return gate / (1.f + expf(-gate)) * up;
}

// ---- narrow kernels: W warps per 16-row W tile, TP tiles per CTA ----------
// Warp w of the CTA works on W tile TP blockIdx.x + w / W of its item, on
// k-tiles w % W, + W, ... The TP tiles' warps read the same x rows at the
// same k-tiles, so the SM's L1 serves x to all but the first (x rows are
// read from L2 once per TP W tiles, not once per tile).
//
// Items hold up to 16 rows: an expert with more than 8 rows decodes its
// weights once per 16 rows (MT = 2 m-tiles, two register stages), not once
// per 8, while the many 1-8-row items keep the 3-stage one-m-tile loop.
// Each CTA branches on its item's row count (uniform across the CTA).
constexpr int kNarrowItemRows = 16;
__device__ __forceinline__ bool two_m_tiles(const Item& it) { return it.rows > 8; }

// CTAs per SM: 16 warps in all (the register budget of the main loop).
template <int W, int TP> constexpr int kNarrowCtasPerSm = gemm::mma::kWarps * 2 / (W * TP);

// Shared memory of the warps' partial sums, sized for the largest form
// (kMaxMT m-tiles) and viewed as the item's form.
template <int W, int TP, int kMaxMT>
struct NarrowSmem {
  gemm::mma::CtaPartials<kMaxMT, W> storage[TP];
  template <int MT>
  __device__ __forceinline__ gemm::mma::CtaPartials<MT, W> (&as())[TP] {
    static_assert(MT <= kMaxMT);
    return *reinterpret_cast<gemm::mma::CtaPartials<MT, W>(*)[TP]>(storage);
  }
};

// Streaming form (one token, so every item is one row; launch_narrow): the
// warps run nvfp4_mainloops.cuh stream_mainloop, each with a ring of
// stream_warp_bytes(kStreamRows) bytes of dynamic shared memory, 32 warps
// per SM.
constexpr int kStreamRows = 1;
constexpr int kStreamWarpsPerSm = 32;
template <int W, int TP, bool kStream>
constexpr int kNarrowMinCtas = kStream ? kStreamWarpsPerSm / (W * TP) : kNarrowCtasPerSm<W, TP>;

// The item's sums over K for the CTA's W tiles (ntiles per expert, tile
// TP blockIdx.x + i into partial[i]); returns after the barrier. kStream:
// stream_mainloop (MT = 1, items of kStreamRows rows).
template <typename T, int MT, int W, int TP, bool kGather, bool kStream>
__device__ __forceinline__ void narrow_tile_sums(gemm::mma::CtaPartials<MT, W> (&partial)[TP], const Item& it,
                                                 const T* xbase, const int32_t* sorted_token, int64_t k,
                                                 const uint8_t* w, const uint8_t* s, int64_t ntiles) {
  const int warp = threadIdx.x / 32 % W, sub = threadIdx.x / 32 / W, lane = threadIdx.x % 32;
  const int64_t nt = int64_t(blockIdx.x) * TP + sub;
  if (nt < ntiles) {
    const int64_t tiles_k = padded_k(k) / kTileK;
    const int64_t tile_row = int64_t(it.expert) * ntiles + nt;
    const uint4* wtiles = gemm::mma::tile_row_codes(w, tile_row, tiles_k);
    const uint4* stiles = gemm::mma::tile_row_scales(s, tile_row, tiles_k);
    float acc[MT][4];
    if constexpr (kStream) {
      static_assert(MT == 1 && kStreamRows <= 2, "one x row pair per streaming warp");
      const T* xsrc[1] = {item_row<kGather>(xbase, sorted_token, it, min(lane / 16, it.rows - 1), k) + (lane % 16) * 8};
      extern __shared__ uint4 stream_ring[];
      uint4* ring = stream_ring + (threadIdx.x / 32) * (gemm::mma::stream_warp_bytes(kStreamRows) / 16);
      gemm::mma::stream_mainloop<T, W, 1>(acc, ring, it.rows, xsrc, wtiles, stiles, k, 0, tiles_k, warp, lane);
    } else {
      const T* xrow[MT];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int r = min(mt * 8 + lane / 4, it.rows - 1);  // rows past the item: computed, never stored
        xrow[mt] = item_row<kGather>(xbase, sorted_token, it, r, k) + (lane % 4) * 4;
      }
      gemm::mma::warp_mainloop<T, MT, W>(acc, wtiles, stiles, xrow, k, 0, tiles_k, warp, lane);
    }
    partial[sub].store(acc, warp, lane);
  }
  __syncthreads();
}

// The down kernels' early prefetch: the first `ktiles` k-tiles of W2 tile
// nt (of ntiles per expert) of the item's expert start moving into L2. The
// item is read before the kernel's wait, a hint: its expert is clamped to
// the stack.
__device__ __forceinline__ void prefetch_down_tile(const uint8_t* w2, const uint8_t* s2, const Item& it, int experts,
                                                   int64_t nt, int64_t ntiles, int64_t inter, int ktiles) {
  if (nt >= ntiles) return;
  const int64_t expert = min(max(it.expert, 0), experts - 1);
  const int64_t tiles_k = padded_k(inter) / kTileK, tile_row = expert * ntiles + nt;
  gemm::mma::prefetch_ktiles_l2(gemm::mma::tile_row_codes(w2, tile_row, tiles_k),
                                gemm::mma::tile_row_scales(s2, tile_row, tiles_k), 0,
                                min(tiles_k, int64_t(ktiles)));
}

// Up projection + SwiGLU of one item of at most 8 MT rows.
template <typename T, int MT, int W, int TP, bool kStream, typename Smem>
__device__ __forceinline__ void up_item(Smem& smem, const Item& it, const T* __restrict__ x,
                                        const int32_t* __restrict__ sorted_token, const uint8_t* __restrict__ w13,
                                        const uint8_t* __restrict__ s13, const float* __restrict__ g13,
                                        T* __restrict__ act, int64_t h, int64_t inter, bool has_limit, float limit) {
  const int64_t ntiles = 2 * inter / 16;
  auto& partial = smem.template as<MT>();
  narrow_tile_sums<T, MT, W, TP, true, kStream>(partial, it, x, sorted_token, h, w13, s13, ntiles);
  const float gs = __ldg(g13 + it.expert) * kDecodeUnscale;
  for (int e = threadIdx.x; e < TP * 8 * 8 * MT; e += 32 * W * TP) {
    const int c = e % 8, mc = e / 8 % (8 * MT), sub = e / (64 * MT);
    const int64_t nt = int64_t(blockIdx.x) * TP + sub;  // intermediate columns 8 nt .. 8 nt + 7
    if (mc >= it.rows || nt >= ntiles) continue;
    const float hv =
        clamped_swiglu(partial[sub].sum(c, mc) * gs, partial[sub].sum(c + 8, mc) * gs, has_limit, limit);
    act[int64_t(it.row + mc) * inter + nt * 8 + c] = cuda::from_float<T>(hv);
  }
}

// grid: (2I / (16 TP), work items upper bound); kStream: dynamic shared
// memory W TP stream_warp_bytes(kStreamRows), one token.
template <typename T, int W, int TP, bool kStream>
__global__ void __launch_bounds__(32 * W * TP, (kNarrowMinCtas<W, TP, kStream>)) moe_up_kernel(
    const T* x, const int32_t* sorted_token, const WorkList work,
    cuda::ReadOnly<uint8_t> w13, cuda::ReadOnly<uint8_t> s13, cuda::ReadOnly<float> g13,
    T* __restrict__ act, int64_t h, int64_t inter, bool has_limit, float limit) {
  cuda::wait_for_previous_grid();  // the items (direct: the ids)
  // From here the items are final: the down kernel may start (once every
  // CTA of this one has) and read them before its wait.
  cuda::allow_dependent_launch();
  Item it;
  if (!work.fetch(it)) return;
  __shared__ NarrowSmem<W, TP, kStream ? 1 : 2> smem;
  if constexpr (kStream)
    up_item<T, 1, W, TP, true>(smem, it, x, sorted_token, w13, s13, g13, act, h, inter, has_limit, limit);
  else if (two_m_tiles(it))
    up_item<T, 2, W, TP, false>(smem, it, x, sorted_token, w13, s13, g13, act, h, inter, has_limit, limit);
  else
    up_item<T, 1, W, TP, false>(smem, it, x, sorted_token, w13, s13, g13, act, h, inter, has_limit, limit);
}

// Down projection of one item of at most 8 MT rows.
template <typename T, int MT, int W, int TP, bool kStream, typename Smem>
__device__ __forceinline__ void down_item(Smem& smem, const Item& it, const T* __restrict__ act,
                                          const uint8_t* __restrict__ w2, const uint8_t* __restrict__ s2,
                                          const float* __restrict__ g2, T* __restrict__ expert_out, int64_t h,
                                          int64_t inter) {
  const int64_t ntiles = h / 16;
  auto& partial = smem.template as<MT>();
  narrow_tile_sums<T, MT, W, TP, false, kStream>(partial, it, act, nullptr, inter, w2, s2, ntiles);
  const float gs = __ldg(g2 + it.expert) * kDecodeUnscale;
  for (int e = threadIdx.x; e < TP * 16 * 8 * MT; e += 32 * W * TP) {
    const int r = e % 16, mc = e / 16 % (8 * MT), sub = e / (128 * MT);
    const int64_t nt = int64_t(blockIdx.x) * TP + sub;
    if (mc >= it.rows || nt >= ntiles) continue;
    expert_out[int64_t(it.row + mc) * h + nt * 16 + r] = cuda::from_float<T>(partial[sub].sum(r, mc) * gs);
  }
}

// grid: (H / (16 TP), work items upper bound); kStream as the up kernel.
template <typename T, int W, int TP, bool kStream>
__global__ void __launch_bounds__(32 * W * TP, (kNarrowMinCtas<W, TP, kStream>)) moe_down_kernel(
    const T* act, const WorkList work, cuda::ReadOnly<uint8_t> w2, cuda::ReadOnly<uint8_t> s2,
    cuda::ReadOnly<float> g2, T* __restrict__ expert_out, int64_t h, int64_t inter) {
  cuda::allow_dependent_launch();
  const int64_t ntiles = h / 16;
  // While the up kernel drains, the first k-tiles of this CTA's W tiles go
  // into L2. The work item chosen from is read before the wait, so it is
  // only a hint (it is final: the up kernel let this kernel start after its
  // own wait for the align kernel; a stale copy would only waste the
  // prefetch, and the expert is clamped to the stack). The item computed
  // with is read again after the wait.
  Item it;
  if (threadIdx.x % (32 * W) == 0 && work.fetch(it)) {
    const int stages = kStream           ? gemm::mma::kStreamStages - 1
                       : two_m_tiles(it) ? gemm::mma::kStages<2>
                                         : gemm::mma::kStages<1>;
    prefetch_down_tile(w2, s2, it, work.experts, int64_t(blockIdx.x) * TP + threadIdx.x / (32 * W), ntiles, inter,
                       stages * W);
  }
  cuda::wait_for_previous_grid();  // h (and, again, the items)
  if (!work.fetch(it)) return;
  __shared__ NarrowSmem<W, TP, kStream ? 1 : 2> smem;
  if constexpr (kStream)
    down_item<T, 1, W, TP, true>(smem, it, act, w2, s2, g2, expert_out, h, inter);
  else if (two_m_tiles(it))
    down_item<T, 2, W, TP, false>(smem, it, act, w2, s2, g2, expert_out, h, inter);
  else
    down_item<T, 1, W, TP, false>(smem, it, act, w2, s2, g2, expert_out, h, inter);
}

// ---- wide kernels (nvfp4_mainloops.cuh, wide_mainloop) ------------------------
// One CTA per (128 rows of W, work item of 8 MT rows), warp w on W tile
// 8 blockIdx.x + w; each lane ends with whole sums, so the epilogue reads its
// own accumulators: c[0..1] are W row g at x rows 2t, 2t+1 of the m-tile,
// c[2..3] W row g + 8 (in the up kernel: gate and up of column 8 nt + g).

// This warp's whole-K sums for its W tile nt (ntiles per expert); false for
// warps past the expert's last tile (they still staged x for the others).
template <typename T, int MT, bool kGather>
__device__ __forceinline__ bool wide_tile_sums(float (&acc)[MT][4], int64_t& nt, const Item& it, const T* xbase,
                                               const int32_t* sorted_token, int64_t k, const uint8_t* w,
                                               const uint8_t* s, int64_t ntiles) {
  nt = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  const bool active = nt < ntiles;
  const int64_t tiles_k = padded_k(k) / kTileK;
  const int64_t tile_row = int64_t(it.expert) * ntiles + (active ? nt : 0);
  const T* xsrc[MT / 2];
#pragma unroll
  for (int j = 0; j < MT / 2; ++j) {
    const int r = min(int(threadIdx.x) / 16 + 16 * j, it.rows - 1);
    xsrc[j] = item_row<kGather>(xbase, sorted_token, it, r, k) + (threadIdx.x % 16) * 8;
  }
  extern __shared__ uint4 wide_smem[];  // sizeof(WideSmem<T, MT>), set at launch
  auto& sm = *reinterpret_cast<gemm::mma::WideSmem<T, MT>*>(wide_smem);
  gemm::mma::wide_mainloop<T, MT>(acc, sm, xsrc, gemm::mma::tile_row_codes(w, tile_row, tiles_k),
                                  gemm::mma::tile_row_scales(s, tile_row, tiles_k), active, k, 0, tiles_k);
  return active;
}

// Up projection + SwiGLU of one item of at most 8 MT rows (every thread of
// the CTA calls it).
template <typename T, int MT>
__device__ __forceinline__ void up_wide_item(const Item& it, const T* __restrict__ x,
                                             const int32_t* __restrict__ sorted_token,
                                             const uint8_t* __restrict__ w13, const uint8_t* __restrict__ s13,
                                             const float* __restrict__ g13, T* __restrict__ act, int64_t h,
                                             int64_t inter, bool has_limit, float limit) {
  float acc[MT][4];
  int64_t nt;
  if (!wide_tile_sums<T, MT, true>(acc, nt, it, x, sorted_token, h, w13, s13, 2 * inter / 16)) return;
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const float gs = __ldg(g13 + it.expert) * kDecodeUnscale;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int mc = mt * 8 + 2 * t + i;
      if (mc >= it.rows) continue;
      const float hv = clamped_swiglu(acc[mt][i] * gs, acc[mt][2 + i] * gs, has_limit, limit);
      act[int64_t(it.row + mc) * inter + nt * 8 + g] = cuda::from_float<T>(hv);
    }
}

// Down projection of one item of at most 8 MT rows.
template <typename T, int MT>
__device__ __forceinline__ void down_wide_item(const Item& it, const T* __restrict__ act,
                                               const uint8_t* __restrict__ w2, const uint8_t* __restrict__ s2,
                                               const float* __restrict__ g2, T* __restrict__ expert_out, int64_t h,
                                               int64_t inter) {
  float acc[MT][4];
  int64_t nt;
  if (!wide_tile_sums<T, MT, false>(acc, nt, it, act, nullptr, inter, w2, s2, h / 16)) return;
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const float gs = __ldg(g2 + it.expert) * kDecodeUnscale;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int mc = mt * 8 + 2 * t + i;
      if (mc >= it.rows) continue;
      T* o = expert_out + int64_t(it.row + mc) * h + nt * 16 + g;
      o[0] = cuda::from_float<T>(acc[mt][i] * gs);
      o[8] = cuda::from_float<T>(acc[mt][2 + i] * gs);
    }
}

template <typename T, int MT>
__global__ void __launch_bounds__(kThreads, 2) moe_up_wide_kernel(
    const T* x, const int32_t* sorted_token, const WorkList work,
    cuda::ReadOnly<uint8_t> w13, cuda::ReadOnly<uint8_t> s13, cuda::ReadOnly<float> g13,
    T* __restrict__ act, int64_t h, int64_t inter, bool has_limit, float limit) {
  cuda::wait_for_previous_grid();  // the items
  cuda::allow_dependent_launch();
  Item it;
  if (work.fetch(it)) up_wide_item<T, MT>(it, x, sorted_token, w13, s13, g13, act, h, inter, has_limit, limit);
}

template <typename T, int MT>
__global__ void __launch_bounds__(kThreads, 2) moe_down_wide_kernel(
    const T* act, const WorkList work, cuda::ReadOnly<uint8_t> w2, cuda::ReadOnly<uint8_t> s2,
    cuda::ReadOnly<float> g2, T* __restrict__ expert_out, int64_t h, int64_t inter) {
  cuda::allow_dependent_launch();
  cuda::wait_for_previous_grid();  // h
  Item it;
  if (work.fetch(it)) down_wide_item<T, MT>(it, act, w2, s2, g2, expert_out, h, inter);
}

// ---- mixed kernels: the narrow plan with a hot list -------------------------
// In the narrow plan, an expert with more than kNarrowItemRows rows (the hot
// list: skewed routing, the shared expert) would be cut into 16-row items
// that each decode its weights again. With a hot list, one launch per GEMM
// takes both lists: CTAs of 8 warps over 8 W tiles, the first (grid y below
// the hot count) on hot items of up to kHotItemRows rows with the wide main
// loop (4 m-tiles for items of up to 32 rows, else 8), the rest on narrow
// items with one warp per W tile (W = 1, TP = 8). The hot items, the
// longest, start first and overlap with the narrow ones (docs/perf/log/moe.md, MoE
// v11).
constexpr int kHotItemRows = 64;
constexpr int kMixedTiles = gemm::mma::kWarps;
using MixedNarrowSmem = NarrowSmem<1, kMixedTiles, 2>;
template <typename T>
constexpr int kMixedSmemBytes =
    static_cast<int>(std::max(sizeof(gemm::mma::WideSmem<T, kHotItemRows / 8>), sizeof(MixedNarrowSmem)));

// This CTA's item: hot item y, or narrow item y - (hot count); false past both.
__device__ __forceinline__ bool fetch_mixed(const WorkList& work, const WorkList& hot, Item& it, bool& is_hot) {
  const int y = static_cast<int>(blockIdx.y), hot_items = hot.count();
  is_hot = y < hot_items;
  return is_hot ? hot.fetch_at(y, it) : work.fetch_at(y - hot_items, it);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) moe_up_mixed_kernel(
    const T* x, const int32_t* sorted_token, const WorkList work, const WorkList hot,
    cuda::ReadOnly<uint8_t> w13, cuda::ReadOnly<uint8_t> s13, cuda::ReadOnly<float> g13,
    T* __restrict__ act, int64_t h, int64_t inter, bool has_limit, float limit) {
  cuda::wait_for_previous_grid();  // the items
  cuda::allow_dependent_launch();  // as moe_up_kernel
  Item it;
  bool is_hot;
  if (!fetch_mixed(work, hot, it, is_hot)) return;
  if (is_hot) {
    if (it.rows <= 32) return up_wide_item<T, 4>(it, x, sorted_token, w13, s13, g13, act, h, inter, has_limit, limit);
    return up_wide_item<T, 8>(it, x, sorted_token, w13, s13, g13, act, h, inter, has_limit, limit);
  }
  extern __shared__ uint4 mixed_smem[];
  auto& smem = *reinterpret_cast<MixedNarrowSmem*>(mixed_smem);
  if (two_m_tiles(it))
    up_item<T, 2, 1, kMixedTiles, false>(smem, it, x, sorted_token, w13, s13, g13, act, h, inter, has_limit, limit);
  else
    up_item<T, 1, 1, kMixedTiles, false>(smem, it, x, sorted_token, w13, s13, g13, act, h, inter, has_limit, limit);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) moe_down_mixed_kernel(
    const T* act, const WorkList work, const WorkList hot, cuda::ReadOnly<uint8_t> w2,
    cuda::ReadOnly<uint8_t> s2, cuda::ReadOnly<float> g2, T* __restrict__ expert_out, int64_t h,
    int64_t inter) {
  cuda::allow_dependent_launch();
  // As moe_down_kernel: the first k-tiles of the warp's W tile go into L2
  // while the up kernel drains, from an item read before the wait (a hint).
  Item it;
  bool is_hot;
  if (threadIdx.x % 32 == 0 && fetch_mixed(work, hot, it, is_hot)) {
    const int stages = is_hot            ? gemm::mma::kWideStages<8> - 1
                       : two_m_tiles(it) ? gemm::mma::kStages<2>
                                         : gemm::mma::kStages<1>;
    prefetch_down_tile(w2, s2, it, work.experts, int64_t(blockIdx.x) * kMixedTiles + threadIdx.x / 32, h / 16,
                       inter, stages);
  }
  cuda::wait_for_previous_grid();  // h (and, again, the items)
  if (!fetch_mixed(work, hot, it, is_hot)) return;
  if (is_hot) {
    if (it.rows <= 32) return down_wide_item<T, 4>(it, act, w2, s2, g2, expert_out, h, inter);
    return down_wide_item<T, 8>(it, act, w2, s2, g2, expert_out, h, inter);
  }
  extern __shared__ uint4 mixed_smem[];
  auto& smem = *reinterpret_cast<MixedNarrowSmem*>(mixed_smem);
  if (two_m_tiles(it))
    down_item<T, 2, 1, kMixedTiles, false>(smem, it, act, w2, s2, g2, expert_out, h, inter);
  else
    down_item<T, 1, 1, kMixedTiles, false>(smem, it, act, w2, s2, g2, expert_out, h, inter);
}

// ---- wgmma kernels (nvfp4_wgmma.cuh), for experts with many rows ------------
// One CTA per (128 rows of W, work item of up to NT rows). The up kernel's
// x operand is x in sorted order, written by moe_sort_x_kernel into the
// expert_out buffer (free until the down kernel writes it), so a TMA box
// takes an item's rows; the down kernel's is h, already in sorted order.
// Rows of a box past the item are other items' rows (or zeros past the
// buffer): computed, never stored.

// x_sorted[slot_pos[i]] = x[i / k] for every valid slot i; grid: slots,
// 8 columns per thread.
template <typename T>
__global__ void __launch_bounds__(128) moe_sort_x_kernel(const T* x, const int32_t* slot_pos,
                                                          int64_t k, int64_t h, T* __restrict__ x_sorted) {
  cuda::allow_dependent_launch();
  cuda::wait_for_previous_grid();  // slot_pos (align); x_sorted's buffer is free
  const int64_t i = blockIdx.x;
  const int32_t pos = slot_pos[i];
  if (pos < 0) return;
  const uint4* src = reinterpret_cast<const uint4*>(x + (i / k) * h);
  uint4* dst = reinterpret_cast<uint4*>(x_sorted + int64_t(pos) * h);
  for (int64_t c = threadIdx.x; c < h / 8; c += blockDim.x) dst[c] = src[c];  // coherent: x may be the previous grid's
}

// The work item blockIdx.z (items final once the previous kernel is done:
// every thread waits, then reads it) and its W block blockIdx.y.
__device__ __forceinline__ bool moe_wgmma_tile(const WorkList& work, int64_t ntiles, gemm::wgmma::Tile& t) {
  cuda::wait_for_previous_grid();
  Item it;
  if (!work.fetch_at(static_cast<int>(blockIdx.z), it)) return false;
  t.w_tile_row = static_cast<int32_t>(int64_t(it.expert) * ntiles + int64_t(blockIdx.y) * (gemm::wgmma::kBN / 16));
  t.x_row = it.row;
  t.x_col = 0;
  t.group = it.expert;
  t.rows = it.rows;
  return true;
}

// Up projection + SwiGLU: W tile j of the expert (interleaved rows: gate of
// intermediate columns 8 j .. 8 j + 7, then their up) gives h columns
// 8 j .. 8 j + 7.
template <typename T, int NT>
struct MoeUpProblem {
  WorkList work;
  const float* g13;
  T* act;  // [M k, I]
  int64_t inter;
  bool has_limit;
  float limit;

  __device__ __forceinline__ bool tile(gemm::wgmma::Tile& t) const { return moe_wgmma_tile(work, 2 * inter / 16, t); }
  __device__ __forceinline__ void store(const gemm::wgmma::DumpView<NT>& dump, const gemm::wgmma::Tile& t, int r0,
                                        int r1) const {
    // A plain load: the problem is one by-value parameter that also holds
    // previous-grid pointers, so only coherent loads may read through it.
    const float gs = g13[t.group] * kDecodeUnscale;
    constexpr int kTiles = gemm::wgmma::kBN / 16;
    r1 = min(r1, t.rows);
    for (int e = threadIdx.x; e < (r1 - r0) * kTiles; e += 256) {
      const int r = r0 + e / kTiles, i = e % kTiles;
      const int64_t j = int64_t(blockIdx.y) * kTiles + i;  // intermediate columns 8 j ..
      if (j >= 2 * inter / 16) continue;
      float gate[8], up[8], hv[8];
      dump.sum8(r, 16 * i, gate);
      dump.sum8(r, 16 * i + 8, up);
#pragma unroll
      for (int c = 0; c < 8; ++c) hv[c] = clamped_swiglu(gate[c] * gs, up[c] * gs, has_limit, limit);
      cuda::store8(act + int64_t(t.x_row + r) * inter + 8 * j, hv);
    }
  }
};

// Down projection: the expert's output rows in sorted order.
template <typename T, int NT>
struct MoeDownProblem {
  WorkList work;
  const float* g2;
  T* expert_out;  // [M k, H]
  int64_t h;

  __device__ __forceinline__ bool tile(gemm::wgmma::Tile& t) const { return moe_wgmma_tile(work, h / 16, t); }
  __device__ __forceinline__ void store(const gemm::wgmma::DumpView<NT>& dump, const gemm::wgmma::Tile& t, int r0,
                                        int r1) const {
    // A plain load: the problem is one by-value parameter that also holds
    // previous-grid pointers, so only coherent loads may read through it.
    const float gs = g2[t.group] * kDecodeUnscale;
    constexpr int kChunks = gemm::wgmma::kBN / 8;
    r1 = min(r1, t.rows);
    for (int e = threadIdx.x; e < (r1 - r0) * kChunks; e += 256) {
      const int r = r0 + e / kChunks, c = 8 * (e % kChunks);
      const int64_t o = int64_t(blockIdx.y) * gemm::wgmma::kBN + c;
      if (o >= h) continue;
      float v[8];
      dump.sum8(r, c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] *= gs;
      cuda::store8(expert_out + int64_t(t.x_row + r) * h + o, v);
    }
  }
};

// out[t] = sum_j w[t, j] * expert_out[slot_pos[t, j]], FP32, slot order
// (direct list: slot_pos is null and slot j's row is j when its id is valid).
// grid: (M, H / kCombineCols); 8 columns per thread. The slots' rows are
// loaded kCombineBatch at a time so their latencies overlap.
constexpr int kCombineThreads = 128, kCombineCols = 8 * kCombineThreads, kCombineBatch = 8;
template <typename T>
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(const T* expert_out,
                                                                      const int32_t* slot_pos,
                                                                      const int32_t* ids, int experts,
                                                                      const float* weights, int64_t k,
                                                                      int64_t h, T* __restrict__ out) {
  cuda::allow_dependent_launch();
  cuda::wait_for_previous_grid();
  const int64_t t = blockIdx.x;
  const int64_t c = int64_t(blockIdx.y) * kCombineCols + int64_t(threadIdx.x) * 8;
  if (c >= h) return;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t j0 = 0; j0 < k; j0 += kCombineBatch) {
    int32_t pos[kCombineBatch];
    float w[kCombineBatch], v[kCombineBatch][8];
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j) {
      const int64_t slot = t * k + j0 + j;
      if (j0 + j >= k)
        pos[j] = -1;
      else if (slot_pos)
        pos[j] = slot_pos[slot];
      else
        pos[j] = ids[slot] >= 0 && ids[slot] < experts ? static_cast<int32_t>(slot) : -1;
      w[j] = pos[j] >= 0 ? weights[t * k + j0 + j] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j)
      if (pos[j] >= 0) cuda::load8_coherent(expert_out + int64_t(pos[j]) * h + c, v[j]);  // the down kernel's
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j)
      if (pos[j] >= 0)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += w[j] * v[j][i];
  }
  cuda::store8(out + t * h + c, acc);
}

// Shape of a narrow kernel of `tiles` (work item, W tile) pairs (an upper
// bound: work items x W tiles per expert). As in the Linear (docs/perf/log/linear.md,
// Linear v7): the fewest warps per W tile that give every SM 10 to 16 warps
// in one wave (the longest K run per warp: no pipeline fill per few
// k-tiles, no cross-warp sum); fewer tiles, 8 warps. More tiles: 2 warps per
// tile up to 8 waves of one-warp tiles, where the last wave's tail costs
// less with half-length runs; beyond, one warp per tile and 4 tiles per CTA,
// which read the same x rows through the SM's L1 (docs/perf/log/moe.md, MoE v7).
struct NarrowShape {
  int warps, tiles_per_cta;
};
NarrowShape narrow_shape(int64_t tiles) {
  if (const int w = gemm::one_wave_warps_per_tile(tiles)) return {w, 1};
  const int64_t wave = 16 * cuda::num_sms();  // one-warp CTAs resident at once
  if (tiles < wave) return {8, 1};
  return tiles <= 8 * wave ? NarrowShape{2, 1} : NarrowShape{1, 4};
}

// Kernel plan from the mean rows per expert that can get any: few rows ->
// the narrow kernels (warps split K, one 16-row W tile per CTA, x from
// global memory, items of up to kNarrowItemRows; with a hot list, the mixed
// kernels, which give experts of more rows items of up to kHotItemRows);
// more -> the wide kernels
// (x staged in shared memory and shared by 128 W rows, items of 8 MT rows);
// many -> the wgmma kernels (items of up to NT rows, x sorted first).
// One token needs no grouping: its slots are the work items (direct), and
// the align kernel is left out of the chain.
// The wgmma kernels' token tile (items of up to that many rows) follows the
// mean too: measured on the DeepSeek layers at M = 4096 (docs/perf/log/moe.md, MoE
// v9), 256-row tiles win from 128 rows per expert on (half-empty tiles
// cost less than decoding each expert's weights twice), 128-row tiles from
// 80, the wide kernels below. The override hot=0 leaves the hot experts in
// the narrow list (16-row items).
enum class Kernels { kNarrow, kWide, kWgmma };
struct Plan {
  Kernels kernels;
  int mt;       // wide: 8-row m-tiles per item; wgmma: rows per item (NT)
  bool direct;  // one token: WorkList's direct form, no align kernel
  bool hot;     // narrow: experts with more than kNarrowItemRows rows in a hot list
  int item_rows() const {
    return kernels == Kernels::kNarrow ? kNarrowItemRows : kernels == Kernels::kWide ? 8 * mt : mt;
  }
};
Plan plan(const MoeArgs& a, const MoePlanOverrides& o) {
  const int64_t slots = a.m * a.k;
  const int64_t active = std::min<int64_t>(a.e, slots);
  const int64_t mean = active > 0 ? slots / active : 0;
  if (mean <= 16) {
    Plan p{Kernels::kNarrow, 0, a.m == 1, false};
    // A hot list where an expert can get more than one narrow item and both
    // GEMMs have the many (item, W tile) pairs that one warp per tile suits.
    const int64_t items = active + slots / kNarrowItemRows;
    if (a.m > kNarrowItemRows && narrow_shape(items * (2 * a.inter / 16)).tiles_per_cta == 4 &&
        narrow_shape(items * (a.h / 16)).tiles_per_cta == 4)
      p.hot = o.hot.value_or(true);
    return p;
  }
  if (mean <= 40) return {Kernels::kWide, 4, false, false};
  if (mean < 80) return {Kernels::kWide, 8, false, false};
  return {Kernels::kWgmma, mean < 128 ? 128 : 256, false, false};
}

int64_t align_up(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// The align kernel's outputs (none for a direct list) and the GEMMs' rows.
struct Workspace {
  int32_t* slot_pos;      // [M k] (null: direct)
  int32_t* sorted_token;  // [M k] (null: direct)
  Item* items;            // [max_items] (null: direct)
  Item* hot_items;        // [max_hot_items] (null: no hot list)
  int32_t* num_items;     // [2]: items, hot items (null: direct)
  WorkList work;          // what the GEMM kernels read: items, or the ids
  WorkList hot_work;      // the hot list
  void* act;              // [M k, I]
  void* expert_out;       // [M k, H]
  int64_t max_items, max_hot_items;
  int64_t bytes;
};

Workspace carve(const MoeArgs& a, const MoePlanOverrides& o, char* base) {
  const int64_t slots = a.m * a.k;
  const Plan p = plan(a, o);
  Workspace w{};
  w.max_items = p.direct ? slots : std::min<int64_t>(a.e, slots) + slots / p.item_rows();
  // Hot experts have more than kNarrowItemRows rows each.
  w.max_hot_items = p.hot ? slots / (kNarrowItemRows + 1) + slots / kHotItemRows : 0;
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    char* ptr = base ? base + off : nullptr;
    off += align_up(bytes);
    return ptr;
  };
  if (!p.direct) {
    w.slot_pos = reinterpret_cast<int32_t*>(take(slots * 4));
    w.sorted_token = reinterpret_cast<int32_t*>(take(slots * 4));
    w.items = reinterpret_cast<Item*>(take(w.max_items * int64_t(sizeof(Item))));
    if (p.hot) w.hot_items = reinterpret_cast<Item*>(take(w.max_hot_items * int64_t(sizeof(Item))));
    w.num_items = reinterpret_cast<int32_t*>(take(2 * 4));
  }
  w.work = WorkList{w.items, w.num_items, a.topk_ids, static_cast<int32_t>(slots), static_cast<int32_t>(a.e),
                    static_cast<int32_t>(w.max_items)};
  w.hot_work = WorkList{w.hot_items, w.num_items ? w.num_items + 1 : nullptr, a.topk_ids,
                        static_cast<int32_t>(slots), static_cast<int32_t>(a.e), static_cast<int32_t>(w.max_hot_items)};
  w.act = take(slots * a.inter * 2);
  w.expert_out = take(slots * a.h * 2);
  w.bytes = off;
  return w;
}

// One narrow GEMM launch (kUp: W13 + SwiGLU, else W2) of shape <W, TP>;
// kStream: streaming warps (one token).
template <bool kUp, typename T, int W, int TP, bool kStream>
cudaError_t launch_narrow(const MoeArgs& a, const Workspace& ws, cudaStream_t stream) {
  const dim3 block(32 * W * TP);
  const int smem = kStream ? W * TP * gemm::mma::stream_warp_bytes(kStreamRows) : 0;
  if constexpr (kUp) {
    auto* kernel = moe_up_kernel<T, W, TP, kStream>;
    if (const cudaError_t err = cuda::allow_dynamic_smem(kernel, smem); err != cudaSuccess) return err;
    const dim3 grid(unsigned(cuda::ceil_div(2 * a.inter / 16, TP)), unsigned(ws.max_items));
    return cuda::launch_dependent(kernel, grid, block, smem, stream, static_cast<const T*>(a.x), ws.sorted_token,
                                  ws.work, a.w13, a.w13_scale, a.w13_global, static_cast<T*>(ws.act), a.h, a.inter,
                                  a.has_limit, a.swiglu_limit);
  } else {
    auto* kernel = moe_down_kernel<T, W, TP, kStream>;
    if (const cudaError_t err = cuda::allow_dynamic_smem(kernel, smem); err != cudaSuccess) return err;
    const dim3 grid(unsigned(cuda::ceil_div(a.h / 16, TP)), unsigned(ws.max_items));
    return cuda::launch_dependent(kernel, grid, block, smem, stream, static_cast<const T*>(ws.act), ws.work, a.w2,
                                  a.w2_scale, a.w2_global, static_cast<T*>(ws.expert_out), a.h, a.inter);
  }
}
// The same with the shape narrow_shape picks for `tiles` (item, W tile)
// pairs; for one token, streaming warps (stream_warps_per_tile of them per W
// tile). At M = 4 and 8 they measured 3-4% slower than the register stages
// (docs/perf/log/moe.md, MoE v10): the ring is sized for M rows, the items mostly
// hold one. The overrides stream=0 (register stages for one token too) and
// stream_warps apply here.
template <bool kUp, typename T>
cudaError_t launch_narrow(int64_t tiles, const MoeArgs& a, const Workspace& ws, const MoePlanOverrides& o,
                          cudaStream_t stream) {
  if (a.m == kStreamRows && o.stream.value_or(true)) {
    const int64_t k = kUp ? a.h : a.inter;
    const int warps =
        o.stream_warps ? *o.stream_warps : gemm::stream_warps_per_tile(tiles, padded_k(k) / kTileK, kStreamRows);
    switch (warps) {
      case 1: return launch_narrow<kUp, T, 1, 1, true>(a, ws, stream);
      case 2: return launch_narrow<kUp, T, 2, 1, true>(a, ws, stream);
      case 4: return launch_narrow<kUp, T, 4, 1, true>(a, ws, stream);
      default: return launch_narrow<kUp, T, 8, 1, true>(a, ws, stream);
    }
  }
  const NarrowShape shape = narrow_shape(tiles);
  if (shape.tiles_per_cta == 4) return launch_narrow<kUp, T, 1, 4, false>(a, ws, stream);
  switch (shape.warps) {
    case 1: return launch_narrow<kUp, T, 1, 1, false>(a, ws, stream);
    case 2: return launch_narrow<kUp, T, 2, 1, false>(a, ws, stream);
    case 4: return launch_narrow<kUp, T, 4, 1, false>(a, ws, stream);
    default: return launch_narrow<kUp, T, 8, 1, false>(a, ws, stream);
  }
}

// The wide kernels are launched plainly: as dependent launches they measured
// 2-4% slower at M = 4096 on DSV4-Flash and DSV3 (docs/perf/log/moe.md, MoE v7).
template <typename T, int MT>
cudaError_t launch_wide(const MoeArgs& a, const Workspace& ws, cudaStream_t stream) {
  constexpr int smem = sizeof(gemm::mma::WideSmem<T, MT>);
  cudaError_t err;
  if ((err = cuda::allow_dynamic_smem(moe_up_wide_kernel<T, MT>, smem)) != cudaSuccess ||
      (err = cuda::allow_dynamic_smem(moe_down_wide_kernel<T, MT>, smem)) != cudaSuccess)
    return err;
  const unsigned items = static_cast<unsigned>(ws.max_items);
  moe_up_wide_kernel<T, MT><<<dim3(unsigned(cuda::ceil_div(2 * a.inter / 16, 8)), items), kThreads, smem, stream>>>(
      static_cast<const T*>(a.x), ws.sorted_token, ws.work, a.w13, a.w13_scale, a.w13_global,
      static_cast<T*>(ws.act), a.h, a.inter, a.has_limit, a.swiglu_limit);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  moe_down_wide_kernel<T, MT><<<dim3(unsigned(cuda::ceil_div(a.h / 16, 8)), items), kThreads, smem, stream>>>(
      static_cast<const T*>(ws.act), ws.work, a.w2, a.w2_scale, a.w2_global, static_cast<T*>(ws.expert_out), a.h,
      a.inter);
  return cudaGetLastError();
}

// Both mixed kernels (the narrow plan with a hot list), dependent launches
// as the narrow ones.
template <typename T>
cudaError_t launch_mixed(const MoeArgs& a, const Workspace& ws, cudaStream_t stream) {
  constexpr int smem = kMixedSmemBytes<T>;
  auto* up = moe_up_mixed_kernel<T>;
  auto* down = moe_down_mixed_kernel<T>;
  cudaError_t err;
  if ((err = cuda::allow_dynamic_smem(up, smem)) != cudaSuccess ||
      (err = cuda::allow_dynamic_smem(down, smem)) != cudaSuccess)
    return err;
  const unsigned items = static_cast<unsigned>(ws.max_items + ws.max_hot_items);
  err = cuda::launch_dependent(up, dim3(unsigned(cuda::ceil_div(2 * a.inter / 16, kMixedTiles)), items),
                               dim3(kThreads), smem, stream, static_cast<const T*>(a.x),
                               static_cast<const int32_t*>(ws.sorted_token), ws.work, ws.hot_work, a.w13,
                               a.w13_scale, a.w13_global, static_cast<T*>(ws.act), a.h, a.inter, a.has_limit,
                               a.swiglu_limit);
  if (err != cudaSuccess) return err;
  return cuda::launch_dependent(down, dim3(unsigned(cuda::ceil_div(a.h / 16, kMixedTiles)), items), dim3(kThreads),
                                smem, stream, static_cast<const T*>(ws.act), ws.work, ws.hot_work, a.w2, a.w2_scale,
                                a.w2_global, static_cast<T*>(ws.expert_out), a.h, a.inter);
}

// The wgmma path: sort x into the expert_out buffer, then up (+ SwiGLU) and
// down (nvfp4_wgmma.cuh), all programmatic dependent launches.
template <typename T, int NT>
cudaError_t launch_wgmma(const MoeArgs& a, const Workspace& ws, cudaStream_t stream) {
  namespace wg = gemm::wgmma;
  const int64_t slots = a.m * a.k;
  T* x_sorted = static_cast<T*>(ws.expert_out);
  cudaError_t err = cuda::launch_dependent(moe_sort_x_kernel<T>, dim3(unsigned(slots)), dim3(128), 0, stream,
                                           static_cast<const T*>(a.x), ws.slot_pos, a.k, a.h, x_sorted);
  if (err != cudaSuccess) return err;
  wg::Maps up_maps, down_maps;
  if ((err = wg::make_maps(up_maps, x_sorted, a.dtype, slots, a.h, NT, a.w13, a.w13_scale, a.e * 2 * a.inter)) !=
          cudaSuccess ||
      (err = wg::make_maps(down_maps, ws.act, a.dtype, slots, a.inter, NT, a.w2, a.w2_scale, a.e * a.h)) !=
          cudaSuccess)
    return err;
  const MoeUpProblem<T, NT> up{ws.work, a.w13_global, static_cast<T*>(ws.act), a.inter, a.has_limit, a.swiglu_limit};
  err = wg::launch<T, NT>(up_maps, up, a.h, 1, cuda::ceil_div(2 * a.inter, wg::kBN), ws.max_items, stream);
  if (err != cudaSuccess) return err;
  const MoeDownProblem<T, NT> down{ws.work, a.w2_global, static_cast<T*>(ws.expert_out), a.h};
  return wg::launch<T, NT>(down_maps, down, a.inter, 1, cuda::ceil_div(a.h, wg::kBN), ws.max_items, stream);
}

// align (not for a direct list), up, down, combine. Launched as
// programmatic dependent launches (but for the wide kernels), so each
// kernel's CTAs get resident while the previous one finishes; every kernel
// waits for its inputs with griddepcontrol.wait.
template <typename T>
cudaError_t launch(const MoeArgs& a, const Workspace& ws, const MoePlanOverrides& o, cudaStream_t stream) {
  const Plan p = plan(a, o);
  cudaError_t err = cudaSuccess;
  if (!p.direct)
    err = cuda::launch_dependent(moe_align_kernel, dim3(1), dim3(kAlignThreads), a.e * sizeof(int32_t), stream,
                                 a.topk_ids, a.m * a.k, a.k, static_cast<int>(a.e), p.item_rows(),
                                 p.hot ? kNarrowItemRows : std::numeric_limits<int>::max(), kHotItemRows,
                                 ws.slot_pos, ws.sorted_token, ws.items, ws.hot_items, ws.num_items);
  if (err != cudaSuccess) return err;
  if (ws.max_items > 0) {
    if (p.kernels == Kernels::kNarrow && p.hot) {
      err = launch_mixed<T>(a, ws, stream);
    } else if (p.kernels == Kernels::kNarrow) {
      err = launch_narrow<true, T>(ws.max_items * (2 * a.inter / 16), a, ws, o, stream);
      if (err == cudaSuccess) err = launch_narrow<false, T>(ws.max_items * (a.h / 16), a, ws, o, stream);
    } else if (p.kernels == Kernels::kWide) {
      err = p.mt == 4 ? launch_wide<T, 4>(a, ws, stream) : launch_wide<T, 8>(a, ws, stream);
    } else {
      err = p.mt == 256 ? launch_wgmma<T, 256>(a, ws, stream) : launch_wgmma<T, 128>(a, ws, stream);
    }
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(unsigned(a.m), unsigned(cuda::ceil_div(a.h, kCombineCols)));
  return cuda::launch_dependent(moe_combine_kernel<T>, grid, dim3(kCombineThreads), 0, stream,
                                static_cast<const T*>(ws.expert_out), ws.slot_pos, a.topk_ids, static_cast<int>(a.e),
                                a.topk_weights, a.k, a.h, static_cast<T*>(a.out));
}

}  // namespace

int64_t moe_workspace_bytes(const MoeArgs& a, const MoePlanOverrides& o) { return carve(a, o, nullptr).bytes; }
int64_t moe_max_work_items(const MoeArgs& a, const MoePlanOverrides& o) {
  const Workspace ws = carve(a, o, nullptr);
  return ws.max_items + ws.max_hot_items;
}

cudaError_t moe_cuda(const MoeArgs& a, void* workspace, cudaStream_t stream, const MoePlanOverrides& o) {
  if (a.m == 0) return cudaSuccess;
  const Workspace ws = carve(a, o, static_cast<char*>(workspace));
  if (ws.max_items + ws.max_hot_items > kMaxWorkItems) return cudaErrorInvalidConfiguration;
  if (a.dtype == DType::kBFloat16) return launch<__nv_bfloat16>(a, ws, o, stream);
  if (a.dtype == DType::kFloat16) return launch<__half>(a, ws, o, stream);
  return cudaErrorInvalidValue;
}

}  // namespace lowbit::nvfp4::moe
