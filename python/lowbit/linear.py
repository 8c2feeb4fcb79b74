"""NVFP4 Linear (W4A16): typed wrappers of ``lowbit::nvfp4_prepack`` /
``lowbit::nvfp4_linear`` and ``quantize_``, which swaps ``nn.Linear`` layers
for :class:`lowbit.nn.Nvfp4Linear` in place.

The weight is prepacked once, at load time, into the layout of
``csrc/lowbit/nvfp4_gemm_layout.h`` (the same on CPU and GPU, so a module can
be moved with ``.to()``). On CUDA, fused decode + tensor core kernels run
M <= 2048 rows (mma.sync up to 16 rows, then wgmma; the dispatch table is in
``csrc/lowbit/nvfp4_gemm.h``); above that the weight is unpacked to x's
dtype and cuBLAS runs. The CPU kernel (the reference) unpacks to FP32 and
does an FP32 matmul.
"""

from __future__ import annotations

import sys
from typing import Callable, NamedTuple

import torch
from torch import Tensor, nn


class Nvfp4PrepackedWeight(NamedTuple):
    """weight: uint8 [N, Kp/2], scale: uint8 [N, Kp/16], Kp = K rounded up to 128."""

    weight: Tensor
    scale: Tensor


def nvfp4_prepack(weight: Tensor, weight_scale: Tensor) -> Nvfp4PrepackedWeight:
    """Checkpoint layout (``weight`` uint8 [N, K/2], ``weight_scale``
    float8_e4m3fn or uint8 codes [N, K/16]; N, K multiples of 16) -> the
    prepacked layout that :func:`nvfp4_linear` takes."""
    w, s = torch.ops.lowbit.nvfp4_prepack(weight, weight_scale)
    return Nvfp4PrepackedWeight(w, s)


def nvfp4_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    weight_global: Tensor,
    bias: Tensor | None = None,
    fp8_min_rows: int = 0,
) -> Tensor:
    """y = x W^T * weight_global (+ bias): x [..., K] bf16/fp16 (fp32 on CPU),
    ``weight`` / ``weight_scale`` from :func:`nvfp4_prepack`, ``weight_global``
    float32 [] (ModelOpt's ``weight_scale_2``), bias [N] in x's dtype.
    Returns [..., N] in x's dtype.

    ``fp8_min_rows`` > 0 turns on the FP8 mode for calls with at least that
    many rows of x (the product of its leading dimensions): W and x are
    rounded to FP8 E4M3 with one scale per row and multiplied on the FP8
    tensor cores. Faster at large M (docs/PERF.md), with an extra error of
    about 4e-2 relative (README.md, Formats); 0, the default, never uses it."""
    return torch.ops.lowbit.nvfp4_linear(x, weight, weight_scale, weight_global, bias, fp8_min_rows)


def _progress(done: int, total: int, name: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\rlowbit.quantize_ [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {name[:40]:<40}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def quantize_(
    model: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    progress: bool = True,
    fp8_min_rows: int = 0,
) -> nn.Module:
    """Replaces, in place, every ``nn.Linear`` of ``model`` for which
    ``filter_fn(module, qualified_name)`` is true (all by default; layers whose
    in/out features are not multiples of 16 are always skipped) with an
    :class:`lowbit.nn.Nvfp4Linear` quantized from its weight, in the FP8 mode
    from ``fp8_min_rows`` rows (0: never; see :func:`nvfp4_linear`).
    Returns model."""
    from .nn.linear import Nvfp4Linear

    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear)
        and not isinstance(mod, Nvfp4Linear)
        and mod.in_features % 16 == 0
        and mod.out_features % 16 == 0
        and (filter_fn is None or filter_fn(mod, name))
    ]
    for i, (name, mod) in enumerate(targets):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = Nvfp4Linear.from_linear(mod)
        layer.fp8_min_rows = fp8_min_rows
        setattr(parent, child, layer)
        if progress:
            _progress(i + 1, len(targets), name)
    return model
