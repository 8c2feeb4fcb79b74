// The FP4 decoder of the NVFP4 GEMMs' mma.sync paths (nvfp4_mainloops.cuh,
// the Linear's unpack in nvfp4_linear.cu, the MoE): per dtype T (Mma<T>),
// rotate + mask put each FP4 code into a bf16/fp16 whose value is
// e2m1 * 2^-126 / 2^-14, and one packed multiply by the re-encoded block
// scale makes it e2m1 * scale * 2^-8 exactly; Mma<T>::mma is the
// mma.m16n8k16 of that dtype. Codes and scales are read in the register
// layout of nvfp4_linear_layout.h.
#pragma once

#include <cstdint>

#include "lowbit/arch/cuda_utils.cuh"
#include "lowbit/arch/sm90.cuh"
#include "lowbit/linear/nvfp4_linear_layout.h"

namespace lowbit::nvfp4::gemm::mma {

template <typename T> struct Mma;

template <> struct Mma<__nv_bfloat16> {
  // Codes as bf16 e2m1 * 2^-126 (bf16 subnormal for 0.5).
  // The integer pipe is what limits the small-M GEMM (ncu: ALU ~70% busy),
  // so the rotates whose masked bits do not wrap are written as multiplies
  // by powers of two, which the compiler issues on the FMA pipe (IMAD.SHL).
  __device__ __forceinline__ static void decode(uint32_t w, uint32_t (&r)[4]) {
    constexpr uint32_t kS = 0x80008000u, kM = 0x01c001c0u;
    r[0] = w & (kS | kM);
    r[1] = (w * 8u) & (kS | kM);                                  // rotl 3
    r[2] = sm90::lop3<0xf8>((w * 2u) & kS, w * 64u, kM);            // rotl 1 (sign) | rotl 6 (magnitude)
    r[3] = sm90::lop3<0xf8>((w * 4u) & kS, sm90::rotl(w, 13), kM);  // rotl 2 | rotl 13 (wraps)
  }
  // scale * 2^118 in both halves, from the byte picked by sel: one LOP3
  // (a & mask) | bias with the bias in a register.
  __device__ __forceinline__ static uint32_t multiplier(uint32_t word, uint32_t sel) {
    return sm90::lop3<0xea>(sm90::prmt(word, sel), 0x0ff00ff0u, 0x70007000u);
  }
  __device__ __forceinline__ static uint32_t mul(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  __device__ __forceinline__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <> struct Mma<__half> {
  // Codes as fp16 e2m1 * 2^-14: the bf16 pattern with the magnitude moved up 3.
  __device__ __forceinline__ static void decode(uint32_t w, uint32_t (&r)[4]) {
    Mma<__nv_bfloat16>::decode(w, r);
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = (r[i] & 0x80008000u) | ((r[i] << 3) & 0x0e000e00u);
  }
  // scale * 2^6 in both halves.
  __device__ __forceinline__ static uint32_t multiplier(uint32_t word, uint32_t sel) {
    return (sm90::prmt(word, sel) & 0x0ff00ff0u) << 3;
  }
  __device__ __forceinline__ static uint32_t mul(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  __device__ __forceinline__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// A fragment of k-tile kt, e2m1 * block scale * 2^-8 exactly: the lane word
// w of the codes and the scale word sw = scale words[kt / 2] of its tile
// (rows g and g + 8; see nvfp4_linear_layout.h).
template <typename T>
__device__ __forceinline__ void decode_fragment(uint32_t w, uint32_t sw, int kt, uint32_t (&a)[4]) {
  Mma<T>::decode(w, a);
  const uint32_t mult_lo = Mma<T>::multiplier(sw, (kt & 1) ? 0x2222u : 0x0000u);  // row g
  const uint32_t mult_hi = Mma<T>::multiplier(sw, (kt & 1) ? 0x3333u : 0x1111u);  // row g+8
  a[0] = Mma<T>::mul(a[0], mult_lo);
  a[1] = Mma<T>::mul(a[1], mult_hi);
  a[2] = Mma<T>::mul(a[2], mult_lo);
  a[3] = Mma<T>::mul(a[3], mult_hi);
}

// Lane word w of k-tile kt (scale word sw, as decode_fragment) as floats,
// e2m1 * block scale * 2^-8 exactly: rows g (lo) and g + 8 (hi), 4
// consecutive columns each (the layout's K permutation). For the passes that
// unpack or re-round the weight.
__device__ __forceinline__ void decode_word_rows(uint32_t w, uint32_t sw, int kt, float (&lo)[4], float (&hi)[4]) {
  uint32_t a[4];
  decode_fragment<__nv_bfloat16>(w, sw, kt, a);
  const uint32_t l[2] = {a[0], a[2]}, h[2] = {a[1], a[3]};
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    lo[2 * j] = __uint_as_float(l[j] << 16);
    lo[2 * j + 1] = __uint_as_float(l[j] & 0xffff0000u);
    hi[2 * j] = __uint_as_float(h[j] << 16);
    hi[2 * j + 1] = __uint_as_float(h[j] & 0xffff0000u);
  }
}

// b's low (kHigh false) or high half in both halves. Feeding a multiply,
// ptxas folds it into the operand (HMUL2 ... R.H0_H0): no instruction.
template <bool kHigh>
__device__ __forceinline__ uint32_t half_broadcast(uint32_t b) {
  uint32_t m;
  if constexpr (kHigh) {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n mov.b32 %0, {h, h};\n}" : "=r"(m) : "r"(b));
  } else {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n mov.b32 %0, {l, l};\n}" : "=r"(m) : "r"(b));
  }
  return m;
}

// The A fragments of k-tiles kt and kt + 1 (kt even), which share the scale
// word sw: as decode_fragment, but the multipliers of both are built at once
// (row g's two scales in one register, row g + 8's in another) and each
// multiply takes its half: 4 instructions for the multipliers, not 8.
template <typename T>
__device__ __forceinline__ void decode_fragment_pair(uint32_t w0, uint32_t w1, uint32_t sw, uint32_t (&a)[2][4]) {
  Mma<T>::decode(w0, a[0]);
  Mma<T>::decode(w1, a[1]);
  const uint32_t mult_lo = Mma<T>::multiplier(sw, 0x2200u);  // row g: k-tile kt in h0, kt + 1 in h1
  const uint32_t mult_hi = Mma<T>::multiplier(sw, 0x3311u);  // row g + 8
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // k-tile kt + i takes half i of each multiplier
    const uint32_t lo = i ? half_broadcast<true>(mult_lo) : half_broadcast<false>(mult_lo);
    const uint32_t hi = i ? half_broadcast<true>(mult_hi) : half_broadcast<false>(mult_hi);
    a[i][0] = Mma<T>::mul(a[i][0], lo);
    a[i][1] = Mma<T>::mul(a[i][1], hi);
    a[i][2] = Mma<T>::mul(a[i][2], lo);
    a[i][3] = Mma<T>::mul(a[i][3], hi);
  }
}

}  // namespace lowbit::nvfp4::gemm::mma
