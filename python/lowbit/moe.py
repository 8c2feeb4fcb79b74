"""Fused NVFP4 MoE experts (W4A16): typed wrappers of
``lowbit::nvfp4_moe_prepack`` / ``lowbit::nvfp4_moe``.

The stacked expert weights of a checkpoint (gate+up ``w13`` [E, 2I, H/2] and
down ``w2`` [E, H, I/2], E4M3 block scales along K, one float32 global scale
per expert) are prepacked once, at load time, into an opaque layout (gate and
up rows interleaved, K padded to a multiple of 128) that is the same on CPU
and GPU, so prepacked tensors can be moved with ``.to()``. One call of
:func:`nvfp4_moe` then runs, for every token and each of its top-k experts,
the clamped SwiGLU MLP and the weighted combine. The CPU kernel is the
reference; the CUDA kernel runs the two grouped GEMMs with FP4 decoded to
BF16/FP16 in registers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._autograd import register_inference_only


class Nvfp4MoePrepacked(NamedTuple):
    """Prepacked expert weights (opaque layout, the same on every device).

    w13:       uint8 [E, 2I, Hp/2]   gate and up rows, interleaved inside
    w13_scale: uint8 [E, 2I, Hp/16]  E4M3 codes
    w2:        uint8 [E, H, Ip/2]
    w2_scale:  uint8 [E, H, Ip/16]   E4M3 codes
    Hp, Ip = H, I rounded up to a multiple of 128.
    """

    w13: Tensor
    w13_scale: Tensor
    w2: Tensor
    w2_scale: Tensor


def nvfp4_moe_prepack(w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor) -> Nvfp4MoePrepacked:
    """Checkpoint layout -> the prepacked layout that :func:`nvfp4_moe` takes.

    ``w13`` uint8 [E, 2I, H/2] (NVFP4 codes, gate rows 0..I-1 then up rows
    I..2I-1, element 2j in the low nibble), ``w13_scale`` float8_e4m3fn or
    uint8 E4M3 codes [E, 2I, H/16]; ``w2`` uint8 [E, H, I/2], ``w2_scale``
    [E, H, I/16]. H and I must be multiples of 16. The global scales are not
    touched: pass them to :func:`nvfp4_moe` as they are.
    """
    return Nvfp4MoePrepacked(*torch.ops.lowbit.nvfp4_moe_prepack(w13, w13_scale, w2, w2_scale))


def nvfp4_moe_unprepack(
    w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor, hidden_size: int, intermediate_size: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The inverse of :func:`nvfp4_moe_prepack` for experts of ``hidden_size``
    H and ``intermediate_size`` I: (w13 uint8 [E, 2I, H/2], gate rows then
    up rows, w13_scale float8_e4m3fn [E, 2I, H/16], w2 [E, H, I/2],
    w2_scale [E, H, I/16]), as :func:`lowbit.nvfp4_unprepack` restores a
    Linear's (runs on the host, outputs on the inputs' device)."""
    return torch.ops.lowbit.nvfp4_moe_unprepack(w13, w13_scale, w2, w2_scale, hidden_size, intermediate_size)


def nvfp4_moe(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w13_global: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    w2_global: Tensor,
    swiglu_limit: float | None = None,
    fp8_min_rows: int = 0,
    w13_fp8: Tensor | None = None,
    w13_fp8_scale: Tensor | None = None,
    w2_fp8: Tensor | None = None,
    w2_fp8_scale: Tensor | None = None,
) -> Tensor:
    """Routed NVFP4 experts: returns ``out`` [M, H] in x's dtype with

        out[t] = sum_j topk_weights[t, j] * Expert_{topk_ids[t, j]}(x[t])
        Expert_e(x) = W2_e (silu(gate) * up),  [gate | up] = W13_e x

    where, with ``swiglu_limit`` L (> 0), gate = min(gate, L) and
    up = clamp(up, -L, L) (DeepSeek-V4's clamped SwiGLU).

    ``x`` [M, H] bfloat16 / float16 (float32 too on CPU); ``topk_weights``
    float32 [M, k]; ``topk_ids`` int32 [M, k]; ``w13`` / ``w13_scale`` /
    ``w2`` / ``w2_scale`` from :func:`nvfp4_moe_prepack`; ``w13_global``,
    ``w2_global`` float32 [E] (ModelOpt's ``weight_scale_2``:
    value = e2m1 * block_scale * global).

    Numerics: both GEMMs accumulate in FP32; h = silu(gate) * up is rounded
    to x's dtype before the second GEMM; the weighted sum over the k experts
    is FP32 and rounded once. Repeated identical calls are bitwise identical.
    An id outside [0, E) raises ValueError on CPU; on the GPU that slot
    contributes nothing (nothing is read out of bounds), so the -1 ids that
    :func:`lowbit.hash_router` gives to bad tokens are dropped. M = 0 works.

    FP8 path: from ``fp8_min_rows`` rows of x (0, the default: never), the
    experts run on their E4M3 form made once by :func:`nvfp4_moe_to_fp8`
    (pass its four tensors): x rounded to E4M3 per token row, both GEMMs on
    FP8 tensor cores (grouped, FP32 sums, BF16 outputs), the activations
    rounded to E4M3 per row, the combine in FP32 (README.md, "Formats").
    The choice is made inside the op from M, so one compiled graph or CUDA
    graph serves every batch size.
    """
    return torch.ops.lowbit.nvfp4_moe(
        x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit,
        fp8_min_rows, w13_fp8, w13_fp8_scale, w2_fp8, w2_fp8_scale
    )


class Nvfp4MoeFp8(NamedTuple):
    """The experts' E4M3 form (:func:`nvfp4_moe_to_fp8`), 1 byte per weight.

    w13_fp8:       float8_e4m3fn [E, 2I, H]  gate rows, then up rows
    w13_fp8_scale: float32 [E, 2I]           row scales, global folded in
    w2_fp8:        float8_e4m3fn [E, H, I]
    w2_fp8_scale:  float32 [E, H]
    """
    w13_fp8: Tensor
    w13_fp8_scale: Tensor
    w2_fp8: Tensor
    w2_fp8_scale: Tensor


def nvfp4_moe_to_fp8(w13: Tensor, w13_scale: Tensor, w13_global: Tensor, w2: Tensor, w2_scale: Tensor,
                     w2_global: Tensor) -> Nvfp4MoeFp8:
    """Prepacked experts -> their E4M3 form for :func:`nvfp4_moe`'s FP8 path,
    made once (at load time): every expert row by the Linear's rule
    (:func:`lowbit.nvfp4_to_fp8`): the row's values e2m1 x block scale, times
    448 / their amax, rounded to E4M3; the row scale amax x global / 448."""
    return Nvfp4MoeFp8(*torch.ops.lowbit.nvfp4_moe_to_fp8(w13, w13_scale, w13_global, w2, w2_scale, w2_global))


register_inference_only("nvfp4_moe")


def _nvfp4_moe_with_plan(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w13_global: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    w2_global: Tensor,
    swiglu_limit: float | None = None,
    *,
    plan: str = "",
) -> Tensor:
    """:func:`nvfp4_moe` with kernel choices forced for this call, for tests
    and probes (private). ``plan``: "key=value" items separated by commas,
    keys ``stream`` (0|1), ``hot`` (0|1), ``stream_warps`` (1|2|4|8)
    (csrc/lowbit/moe/nvfp4_moe.h, MoePlanOverrides); "" is the shipped plan.
    A bad item raises ValueError naming its key, on every device; the CPU
    kernel has one path and leaves the plan unused."""
    return torch.ops.lowbit._nvfp4_moe_with_plan(
        x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit, plan
    )


register_inference_only("_nvfp4_moe_with_plan")
