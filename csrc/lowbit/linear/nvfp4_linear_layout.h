// Prepacked NVFP4 weight layout of lowbit::nvfp4_linear, shared by the CPU
// reference, the prepack kernels and the CUDA GEMM kernels (host + device).
//
// Checkpoint layout: codes uint8 [N, K/2] (element 2j low nibble), E4M3 block
// scales [N, K/16]. Prepacked layout (the same on every device, so a module
// can move between CPU and GPU):
//   weight uint8 [N, Kp/2], scale uint8 [N, (2 Kp - K)/16], Kp = K rounded up
//   to 128.
// The scale tensor's N Kp/16 leading bytes are the tiles' scales; after them
// come N (Kp - K)/16 bytes (one per row and padding block; value: the
// padding scale, read by nothing) whose only purpose is that the shapes
// record K: Kp/2 weight columns and S scale columns give K = 128 (S / 8) -
// 16 (S % 8) (prepacked_k below). Kernels index both buffers by tile from
// their start and never read the trailing bytes. Prepacked scales from
// before this record ([N, Kp/16]) only carry Kp; python/lowbit/nn/linear.py
// converts them when a state dict is loaded.
// Both are sequences of tiles of 16 rows (n) x 128 columns (k), tile
// (nt, kc) at tile index nt * (Kp / 128) + kc: 1024 bytes of codes and 128
// bytes of scales, so a warp reads one tile with 16-byte coalesced loads.
//
// Within a tile the 128 columns are 8 k-tiles of 16, each the A operand of one
// mma.m16n8k16 (weights are the 16-row side: N fills it, the activations are
// the 8-wide side). Lane L = 4 g + t holds the 8 codes of its A fragment for
// k-tile kt in one 32-bit word at byte (kt / 4) * 512 + L * 16 + (kt % 4) * 4:
//   register 0: row g,   logical cols 2t, 2t+1      register 1: row g+8, same
//   register 2: row g,   logical cols 2t+8, 2t+9    register 3: row g+8, same
// Logical column c of k-tile kt is physical column k of the tile with
//   k = 16 kt + 4 t + {2t: 0, 2t+1: 1, 2t+8: 2, 2t+9: 3}
// (a permutation of K inside each 16-column block, applied to both operands;
// the dot product does not change, and a k-tile still has one block scale
// per row), so a lane reads its activation fragment of a k-tile as one
// 8-byte load of 4 consecutive x values.
// Bits of the word: each register's two codes sit where a shift/rotate and a
// mask turn them into a bf16x2 whose halves are e2m1 * 2^-126 (sign bit 15,
// magnitude bits 8..6; see code_slot below and the decode in nvfp4_mainloops.cuh).
//
// Scales: the 128 bytes of a tile hold, at g * 16 + 2 kt + (0: row g, 1: row
// g+8), a re-encoded scale byte: c = (E5 << 3) | M with value
// 2^(E5 - 21) * (1 + M / 8) (every E4M3 value, subnormals included, is one of
// these, E5 in 12..29), stored nibble-swapped; 0xFF is NaN. A kernel turns
// it into a bf16 multiplier scale * 2^118 or an fp16 one scale * 2^6 with a
// byte permute and one logic op, so decoded weights are e2m1 * scale * 2^-8,
// exact, and the epilogue multiplies by global * 2^8 in FP32.
// Zero block scales zero their 16 codes; negative ones flip their codes' sign
// bits; padding columns k >= K have code 0 and scale 1.
#pragma once

#include "lowbit/format/nvfp4_format.h"

namespace lowbit::nvfp4::gemm {

constexpr int kTileN = 16;
constexpr int kTileK = 128;
constexpr int kTileBytes = kTileN * kTileK / 2;         // 1024
constexpr int kTileScaleBytes = kTileN * kTileK / 16;   // 128
constexpr float kDecodeUnscale = 256.0f;                // 2^8, applied with the global scale

LOWBIT_HD int64_t padded_k(int64_t k) { return (k + kTileK - 1) / kTileK * kTileK; }
// Columns of the prepacked scale tensor for K (see the header comment), and
// the K that S scale columns record.
LOWBIT_HD int64_t prepacked_scale_cols(int64_t k) { return (2 * padded_k(k) - k) / 16; }
LOWBIT_HD int64_t prepacked_k(int64_t scale_cols) { return kTileK * (scale_cols / 8) - 16 * (scale_cols % 8); }

// Bit positions of a code in a lane word: (magnitude bit 0, sign bit) for
// register r, half h (h = 0: the lower logical column).
struct CodeSlot { uint8_t mag, sign; };
LOWBIT_HD CodeSlot code_slot(int reg, int half) {
  constexpr uint8_t mag[4][2] = {{6, 22}, {3, 19}, {0, 16}, {25, 9}};
  constexpr uint8_t sign[4][2] = {{15, 31}, {12, 28}, {14, 30}, {13, 29}};
  return CodeSlot{mag[reg][half], sign[reg][half]};
}

// Where element (n, k) of the weight lives in the prepacked layout.
struct ElementPos {
  int64_t word_byte;   // byte offset of its 32-bit lane word in the weight
  int64_t scale_byte;  // byte offset of its re-encoded scale
  CodeSlot slot;
};
LOWBIT_HD ElementPos element_pos(int64_t n, int64_t k, int64_t kp) {
  const int64_t tiles_k = kp / kTileK;
  const int64_t tile = (n / kTileN) * tiles_k + k / kTileK;
  const int r = static_cast<int>(n % kTileN), kk = static_cast<int>(k % kTileK);
  const int g = r % 8, hi = r / 8;
  const int kt = kk / 16, t = (kk % 16) / 4, e = kk % 4;
  const int lane = 4 * g + t;
  ElementPos p;
  p.word_byte = tile * kTileBytes + (kt / 4) * 512 + lane * 16 + (kt % 4) * 4;
  p.scale_byte = tile * kTileScaleBytes + g * 16 + 2 * kt + hi;
  p.slot = code_slot((e / 2) * 2 + hi, e % 2);
  return p;
}

// Re-encoding of an E4M3 block scale (see the header comment).
struct ScaleCode {
  uint8_t byte;     // stored byte (nibble-swapped c)
  bool negative;    // flip the block's code signs
  bool zero;        // zero the block's codes
};
LOWBIT_HD uint8_t swap_nibbles(uint32_t c) { return static_cast<uint8_t>(((c >> 4) | (c << 4)) & 0xffu); }
LOWBIT_HD ScaleCode encode_scale(uint32_t e4m3) {
  const uint32_t mag = e4m3 & 0x7fu;
  ScaleCode s{swap_nibbles(21u << 3), (e4m3 & 0x80u) != 0, false};  // default: 1.0
  if (mag == 0x7fu) {
    s.byte = 0xff;
    s.negative = false;
    return s;
  }
  if (mag == 0) {
    s.zero = true;
    s.negative = false;
    return s;
  }
  uint32_t exp = mag >> 3, m = mag & 7u;
  int e;
  if (exp) {
    e = static_cast<int>(exp) - 7;
  } else {  // subnormal m * 2^-9: normalise
    int top = m >= 4 ? 2 : (m >= 2 ? 1 : 0);
    e = top - 9;
    m = (m << (3 - top)) & 7u;
  }
  s.byte = swap_nibbles((static_cast<uint32_t>(e + 21) << 3) | m);
  return s;
}
LOWBIT_HD float decode_scale(uint8_t byte) {
  const uint32_t c = swap_nibbles(byte);
  if (c == 0xffu) return bits_float(0x7fc00000u);
  return bits_float(((((c >> 3) - 21u + 127u) & 0xffu) << 23) | ((c & 7u) << 20));
}

}  // namespace lowbit::nvfp4::gemm
