"""Typed Python entry points of the NVFP4 format family: the codecs between
high-precision tensors and NVFP4 (``nvfp4_quantize``, ``nvfp4_dequantize``).

Each function is a thin call into ``torch.ops.lowbit.*`` (defined in C++, with
CPU, CUDA and Meta kernels), so it works in eager mode, under
``torch.compile(fullgraph=True)``, in CUDA graphs and in ``torch.export``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._autograd import register_inference_only


class Nvfp4Tensor(NamedTuple):
    """An NVFP4 tensor in checkpoint layout.

    packed:       uint8 [..., N, K/2], element 2j in the low nibble.
    block_scale:  float8_e4m3fn [..., N, K/16], one per 16 elements along K.
    global_scale: float32 [] (or [E] for stacked experts), amax / (6 * 448):
                  ModelOpt's ``weight_scale_2``; compressed-tensors stores its
                  reciprocal as ``weight_global_scale``.
    """

    packed: Tensor
    block_scale: Tensor
    global_scale: Tensor


def nvfp4_quantize(input: Tensor, global_scale: Tensor | None = None) -> Nvfp4Tensor:
    """Quantizes ``input`` ([N, K] or stacked experts [E, N, K], K % 16 == 0,
    bf16/fp16/fp32) to NVFP4 with the reference rule of csrc/lowbit/format/nvfp4_format.h.

    ``global_scale`` ([] or [E], float32, amax / 2688 convention) is computed
    per tensor / per expert from the data unless given. A given scale must be
    positive and finite: on CPU anything else raises ValueError; on CUDA the
    value is not read on the host (that would synchronize, and CUDA graphs
    could not capture it), so a scale that is zero, negative or NaN becomes
    NaN: the returned global and block scales are NaN and the tensor
    dequantizes to NaN (as with +inf). Check such scales before the call if
    they can be bad.

    Not differentiable: asking for a gradient through it raises.
    """
    packed, block_scale, gscale = torch.ops.lowbit.nvfp4_quantize(input, global_scale)
    return Nvfp4Tensor(packed, block_scale, gscale)


def nvfp4_dequantize(
    packed: Tensor, block_scale: Tensor, global_scale: Tensor, out_dtype: torch.dtype | None = None
) -> Tensor:
    """Dequantizes an NVFP4 tensor to ``out_dtype`` (float32 by default, or
    bfloat16 / float16): value = e2m1 * float(block_scale) * global_scale.
    Not differentiable: asking for a gradient through it raises."""
    return torch.ops.lowbit.nvfp4_dequantize(packed, block_scale, global_scale, out_dtype)


# Inference ops: a gradient asked through them raises a clear error instead
# of PyTorch's fallback (a warning and None gradients). nvfp4_unpack (the
# Linear family's dequantize of the prepacked layout) is registered here as
# well: its only differentiable input is the global scale, as dequantize's.
register_inference_only("nvfp4_quantize")
register_inference_only("nvfp4_dequantize")
register_inference_only("nvfp4_unpack")
