// Hopper (sm_90a) building blocks: mbarriers, tensor copies (TMA) into
// shared memory and L2 prefetches, cluster barriers and distributed shared
// memory, warpgroup MMA (wgmma) with both operands in shared memory or
// the A operand in registers, and the integer (rotate, prmt, lop3) and
// cp.async instructions of the mma.sync GEMMs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace lowbit::sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The kernel's dynamic shared memory as a T at the first 1024-byte boundary
// (the 128-byte swizzle's 8-row groups start there); launch with
// sizeof(T) + 1024 bytes.
template <typename T> __device__ __forceinline__ T& smem_1024_aligned(uint8_t* smem_raw) {
  return *reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
}

// ---- mbarriers ----------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
// Makes initialized barriers visible to the async proxy (tensor copies).
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// One arrival that also expects `bytes` of bulk-copy transactions this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// Waits until the phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// A 2-D box of a tensor (tensor map from cuTensorMapEncodeTiled, passed as a
// __grid_constant__ kernel parameter) into shared memory at column c0, row
// c1; out-of-range elements arrive as zeros and count toward the bytes.
__device__ __forceinline__ void tma_load_2d(void* dst, const void* tensor_map, int32_t c0, int32_t c1,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
          "r"(smem_addr(dst)),
      "l"(tensor_map), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

// tma_load_2d into the same shared-memory offset of every CTA of the cluster
// in cta_mask (bit r: rank r), each completing on its own mbarrier at bar's
// offset.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const void* tensor_map, int32_t c0, int32_t c1,
                                                      uint64_t* bar, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(smem_addr(dst)),
      "l"(tensor_map), "r"(c0), "r"(c1), "r"(smem_addr(bar)), "h"(cta_mask)
      : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to
// shared memory, completing as transactions on bar.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// Orders this thread's ordinary shared-memory writes before later reads of
// the async proxy (wgmma operands, tensor copies).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Starts moving bytes (a multiple of 16, 16-byte aligned) from global memory
// into L2 without waiting. L2 is coherent, so this is safe before
// griddepcontrol.wait even for data the previous grid writes.
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// ---- clusters --------------------------------------------------------------

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster arrives, then waits; orders
// shared-memory writes before the barrier with reads by other CTAs after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The shared::cluster address of CTA `rank`'s shared memory at the address
// that p has in this CTA.
__device__ __forceinline__ uint32_t peer_smem_addr(const void* p, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
  return remote;
}
// Copies `bytes` (a multiple of 16, 16-byte aligned) of this CTA's shared
// memory into another CTA's (dst and its mbarrier: peer_smem_addr), which
// counts them on that mbarrier's tx-count. The source is read by the async
// proxy: fence_proxy_async after writing it.
__device__ __forceinline__ void bulk_copy_s2peer(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   dst),
               "r"(smem_addr(src)), "r"(bytes), "r"(bar)
               : "memory");
}
// Arrives on an mbarrier of another CTA (address from peer_smem_addr), with
// the default semantics (release at CTA scope), enough to say "done reading
// a buffer" after wgmma.wait_group. .release.cluster stalled each arriving
// MMA warp: the paired wgmma kernel ran 0.65x cuBLAS with it, 0.93x without
// (docs/perf/log/linear.md, Linear v14).
__device__ __forceinline__ void mbar_arrive_remote(uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote_bar) : "memory");
}
// 16 bytes of CTA `rank`'s shared memory at the address that p has in this CTA.
__device__ __forceinline__ float4 ld_shared_cluster_f4(const void* p, uint32_t rank) {
  const uint32_t remote = peer_smem_addr(p, rank);
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

// ---- warpgroup register budget ----------------------------------------------

template <int kRegs> __device__ __forceinline__ void regs_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs> __device__ __forceinline__ void regs_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// ---- wgmma --------------------------------------------------------------------

// Shared-memory matrix descriptor of a K-major operand tile stored with the
// 128-byte swizzle: rows of 64 16-bit elements (128 bytes), the 16-byte
// chunk c of row r at chunk c ^ (r % 8), 8-row groups 1024 bytes apart; the
// group must start 1024-byte aligned. A k16 slice starts 32 bytes further.
__device__ __forceinline__ uint64_t desc_k_major_sw128(uint32_t saddr) {
  return static_cast<uint64_t>((saddr & 0x3ffffu) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// Descriptor of a K-major operand tile without swizzle: 8-row x 16-byte core
// matrices (each 128 contiguous bytes, row r at 16 r), core matrices
// adjacent in K `lbo` bytes apart and adjacent in M/N `sbo` bytes apart
// (both multiples of 16).
__device__ __forceinline__ uint64_t desc_k_major_interleave(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((saddr & 0x3ffffu) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accesses of v across the asynchronous MMA.
__device__ __forceinline__ void fence_operand(float& v) { asm volatile("" : "+f"(v)::"memory"); }

// Accumulator registers of an m64nNk16 wgmma: operands %0-%63 (N = 128), then
// %64-%127 (N = 256), as asm operand names and as "+f" operands of d.
#define LOWBIT_WGMMA_REGS_LO \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define LOWBIT_WGMMA_REGS_MID \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define LOWBIT_WGMMA_REGS_HI \
  LOWBIT_WGMMA_REGS_MID ", " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define LOWBIT_WGMMA_D64_OPERANDS \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define LOWBIT_WGMMA_D96_OPERANDS \
  LOWBIT_WGMMA_D64_OPERANDS, \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define LOWBIT_WGMMA_D128_OPERANDS \
  LOWBIT_WGMMA_D96_OPERANDS, \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define LOWBIT_WGMMA_D64 "{" LOWBIT_WGMMA_REGS_LO "}"
#define LOWBIT_WGMMA_D128 "{" LOWBIT_WGMMA_REGS_LO ", " LOWBIT_WGMMA_REGS_HI "}"

// d (64 x N, FP32) = (accumulate ? d : 0) + a (64 x 16) * b (16 x N), both
// K-major in shared memory (descriptors), N = 256 or 128. d[4j + 2h + e] is
// row 16 warp + lane / 4 + 8h, column 8j + 2 (lane % 4) + e.
#define LOWBIT_WGMMA_M64N256K16_SS(TYPE)                                                                          \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE \
               "." TYPE " " LOWBIT_WGMMA_D128 ", %128, %129, p, 1, 1, 0, 0;\n}"                                    \
               : LOWBIT_WGMMA_D128_OPERANDS                                                                       \
               : "l"(a_desc), "l"(b_desc), "r"(accumulate))

#define LOWBIT_WGMMA_M64N128K16_SS(TYPE)                                                                         \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE \
               "." TYPE " " LOWBIT_WGMMA_D64 ", %64, %65, p, 1, 1, 0, 0;\n}"                                      \
               : LOWBIT_WGMMA_D64_OPERANDS                                                                        \
               : "l"(a_desc), "l"(b_desc), "r"(accumulate))

template <typename T> struct Wgmma;
template <> struct Wgmma<__nv_bfloat16> {
  __device__ __forceinline__ static void m64n256k16_ss(float (&d)[128], uint64_t a_desc, uint64_t b_desc,
                                                       uint32_t accumulate) {
    LOWBIT_WGMMA_M64N256K16_SS("bf16");
  }
  __device__ __forceinline__ static void m64n128k16_ss(float (&d)[64], uint64_t a_desc, uint64_t b_desc,
                                                       uint32_t accumulate) {
    LOWBIT_WGMMA_M64N128K16_SS("bf16");
  }
};
template <> struct Wgmma<__half> {
  __device__ __forceinline__ static void m64n256k16_ss(float (&d)[128], uint64_t a_desc, uint64_t b_desc,
                                                       uint32_t accumulate) {
    LOWBIT_WGMMA_M64N256K16_SS("f16");
  }
  __device__ __forceinline__ static void m64n128k16_ss(float (&d)[64], uint64_t a_desc, uint64_t b_desc,
                                                       uint32_t accumulate) {
    LOWBIT_WGMMA_M64N128K16_SS("f16");
  }
};
// d (64 x 192, FP32) = (accumulate ? d : 0) + a (64 x 32) * b (32 x 192) with
// FP8 operands (kA5, kB5: E5M2, else E4M3), both K-major in shared memory
// with the 128-byte swizzle (rows of 128 codes; a k32 slice starts 32 bytes
// further); d[4j + 2h + e] is row 16 warp + lane / 4 + 8h, column
// 8j + 2 (lane % 4) + e, as in the 16-bit forms.
#define LOWBIT_WGMMA_D96 "{" LOWBIT_WGMMA_REGS_LO ", " LOWBIT_WGMMA_REGS_MID "}"
#define LOWBIT_WGMMA_M64N192K32_FP8(TA, TB)                                                                   \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %98, 0;\n wgmma.mma_async.sync.aligned.m64n192k32.f32." TA \
               "." TB " " LOWBIT_WGMMA_D96 ", %96, %97, p, 1, 1;\n}"                                             \
               : LOWBIT_WGMMA_D96_OPERANDS                                                                     \
               : "l"(a_desc), "l"(b_desc), "r"(accumulate))
template <bool kA5, bool kB5> struct WgmmaFp8;
#define LOWBIT_WGMMA_FP8_PAIR(A5, B5, TA, TB)                                                             \
  template <> struct WgmmaFp8<A5, B5> {                                                                   \
    __device__ __forceinline__ static void m64n192k32_ss(float (&d)[96], uint64_t a_desc, uint64_t b_desc, \
                                                         uint32_t accumulate) {                         \
      LOWBIT_WGMMA_M64N192K32_FP8(TA, TB);                                                                \
    }                                                                                                     \
  };
LOWBIT_WGMMA_FP8_PAIR(false, false, "e4m3", "e4m3")
LOWBIT_WGMMA_FP8_PAIR(true, false, "e5m2", "e4m3")
LOWBIT_WGMMA_FP8_PAIR(false, true, "e4m3", "e5m2")
#undef LOWBIT_WGMMA_FP8_PAIR
#undef LOWBIT_WGMMA_M64N192K32_FP8
#undef LOWBIT_WGMMA_D96

// d (64 x N, FP32) += a (64 x 16) * b (16 x N) with a in registers and b
// K-major in shared memory (descriptor), N = 16, 32 or 64 (a swapped-AB
// GEMM's W rows as a, its few x rows as b). a: this warp's 16 rows (16 (warp
// % 4) .. + 15) in the mma.m16n8k16 A-fragment layout; d[4j + 2h + e] is row
// 16 (warp % 4) + lane / 4 + 8h, column 8j + 2 (lane % 4) + e, the layout of
// N / 8 stacked mma.m16n8k16 accumulators.
#define LOWBIT_WGMMA_RS(SHAPE, TYPE, DREGS, AREGS, BREG, PREG, ...)                                        \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, " PREG ", 0;\n wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE \
               "." TYPE " {" DREGS "}, {" AREGS "}, " BREG ", p, 1, 1, 0;\n}"                                    \
               : __VA_ARGS__                                                                                    \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1u))
template <typename T, int N> struct WgmmaRs;
// The three shapes for one type (TY, its PTX name PTX).
#define LOWBIT_WGMMA_RS_SHAPES(TY, PTX)                                                                        \
  template <> struct WgmmaRs<TY, 16> {                                                                        \
    __device__ __forceinline__ static void run(float (&d)[8], const uint32_t (&a)[4], uint64_t b_desc) {     \
      LOWBIT_WGMMA_RS("m64n16k16", PTX, "%0, %1, %2, %3, %4, %5, %6, %7", "%8, %9, %10, %11", "%12", "%13",  \
                      LOWBIT_WGMMA_D8_OPERANDS);                                                             \
    }                                                                                                         \
  };                                                                                                          \
  template <> struct WgmmaRs<TY, 32> {                                                                        \
    __device__ __forceinline__ static void run(float (&d)[16], const uint32_t (&a)[4], uint64_t b_desc) {    \
      LOWBIT_WGMMA_RS("m64n32k16", PTX, LOWBIT_WGMMA_RS_D16, "%16, %17, %18, %19", "%20", "%21",             \
                      LOWBIT_WGMMA_D8_OPERANDS, LOWBIT_WGMMA_D8_OPERANDS_FROM8);                             \
    }                                                                                                         \
  };                                                                                                          \
  template <> struct WgmmaRs<TY, 64> {                                                                        \
    __device__ __forceinline__ static void run(float (&d)[32], const uint32_t (&a)[4], uint64_t b_desc) {    \
      LOWBIT_WGMMA_RS("m64n64k16", PTX, LOWBIT_WGMMA_RS_D16 ", " LOWBIT_WGMMA_RS_D16_HI, "%32, %33, %34, %35", \
                      "%36", "%37", LOWBIT_WGMMA_D8_OPERANDS, LOWBIT_WGMMA_D8_OPERANDS_FROM8,               \
                      LOWBIT_WGMMA_D16_OPERANDS_FROM16);                                                     \
    }                                                                                                         \
  };
#define LOWBIT_WGMMA_RS_D16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define LOWBIT_WGMMA_RS_D16_HI "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define LOWBIT_WGMMA_D8_OPERANDS \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), \
  "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define LOWBIT_WGMMA_D8_OPERANDS_FROM8 \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
  "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define LOWBIT_WGMMA_D16_OPERANDS_FROM16 \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
LOWBIT_WGMMA_RS_SHAPES(__nv_bfloat16, "bf16")
LOWBIT_WGMMA_RS_SHAPES(__half, "f16")
#undef LOWBIT_WGMMA_RS_SHAPES
#undef LOWBIT_WGMMA_RS_D16
#undef LOWBIT_WGMMA_RS_D16_HI
#undef LOWBIT_WGMMA_D8_OPERANDS
#undef LOWBIT_WGMMA_D8_OPERANDS_FROM8
#undef LOWBIT_WGMMA_D16_OPERANDS_FROM16
#undef LOWBIT_WGMMA_RS
#undef LOWBIT_WGMMA_M64N256K16_SS
#undef LOWBIT_WGMMA_M64N128K16_SS
#undef LOWBIT_WGMMA_D64_OPERANDS
#undef LOWBIT_WGMMA_D64
#undef LOWBIT_WGMMA_D96_OPERANDS
#undef LOWBIT_WGMMA_D128_OPERANDS
#undef LOWBIT_WGMMA_D128

// ---- integer and cp.async instructions of the mma.sync GEMMs -------------
__device__ __forceinline__ uint32_t rotl(uint32_t x, int r) { return __funnelshift_l(x, x, r); }

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(d) : "r"(a), "r"(sel));
  return d;
}

// d = f(a, b, c) for the 3-input truth table kLut (0xf8: a | (b & c),
// 0xea: (a & b) | c).
template <int kLut>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(kLut));
  return d;
}

// 16 bytes (the first src_bytes of them from gmem, the rest zeros) to the
// shared-memory address saddr; .cg bypasses L1, .ca goes through it.
__device__ __forceinline__ void cp_async16_cg(uint32_t saddr, const void* gmem, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(saddr), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async16_ca(uint32_t saddr, const void* gmem, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(saddr), "l"(gmem), "r"(src_bytes));
}
// 16 bytes from gmem to smem past L1, or 16 zeros when !valid.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  cp_async16_cg(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), gmem, valid ? 16 : 0);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

}  // namespace lowbit::sm90
