"""FP8 training: the typed Python entry points of the FP8 family.

``fp8_linear`` is the differentiable Linear (y = x W^T + b with both GEMMs of
the backward in FP8 too), configured by an :class:`Fp8Recipe`; its state (the
amax history of delayed scaling) is a tensor from :func:`fp8_state` that the
module owning the layer registers as a buffer. ``fp8_cast`` and ``fp8_gemm``
are the building blocks. Every function is a thin call into
``torch.ops.lowbit.*`` (schemas in C++ with CPU, CUDA and Meta kernels), so it
works eagerly, under ``torch.compile(fullgraph=True)`` (one lowbit op per
layer in the forward graph and one in the backward graph) and in CUDA graphs.
The rules are in docs/fp8.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_HISTORY_ROWS = 3  # x, W, dy


@dataclass(frozen=True)
class Fp8Recipe:
    """How one FP8 Linear scales its operands (docs/fp8.md).

    name:
      ``"tensorwise"``  current scaling, one scale per tensor (x, W, dy) from
                        this call's amax;
      ``"delayed"``     TransformerEngine's delayed scaling: one scale per
                        tensor from an amax history (the state);
      ``"rowwise"``     one scale per row along each GEMM's reduction dim;
      ``"blockwise"``   DeepSeek-V3: 1 x 128 tiles for x and dy, 128 x 128
                        tiles for W.
    grad_format: the FP8 format of dy, ``"e4m3"`` or ``"e5m2"`` (x and W are
      always E4M3).
    amax_history_len, amax_compute (``"max"`` or ``"most_recent"``), margin:
      delayed scaling only: scale = reduce(history) / fmax * 2^margin.
    pow2_scales: every scale rounded up to a power of two.
    """

    name: str = "tensorwise"
    grad_format: str = "e4m3"
    amax_history_len: int = 16
    amax_compute: str = "max"
    margin: int = 0
    pow2_scales: bool = False

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"Fp8Recipe: name must be one of {RECIPES}, got {self.name!r}")
        if self.grad_format not in FP8_DTYPES:
            raise ValueError(f"Fp8Recipe: grad_format must be 'e4m3' or 'e5m2', got {self.grad_format!r}")
        if self.amax_compute not in ("max", "most_recent"):
            raise ValueError(f"Fp8Recipe: amax_compute must be 'max' or 'most_recent', got {self.amax_compute!r}")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"Fp8Recipe: amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if not isinstance(self.margin, int) or not -64 <= self.margin <= 64:
            raise ValueError(f"Fp8Recipe: margin must be an int in [-64, 64], got {self.margin!r}")

    @property
    def stateful(self) -> bool:
        return self.name == "delayed"


def fp8_state(recipe: Fp8Recipe, device=None) -> Tensor:
    """The state of one FP8 Linear under ``recipe``, to register as a module
    buffer and pass to :func:`fp8_linear`: for ``"delayed"`` the amax history,
    float32 zeros [3, amax_history_len] (rows x, W, dy; column 0 the most
    recent amax), which the ops update in place; an empty float32 tensor for
    the stateless recipes. An all-zero history gives scale 1 (the first step,
    as TransformerEngine)."""
    shape = (_HISTORY_ROWS, recipe.amax_history_len) if recipe.stateful else (0,)
    return torch.zeros(shape, dtype=torch.float32, device=device)


class Fp8CastResult(NamedTuple):
    """data: FP8 [M, K]; scale: float32, shape by scaling; data_t: FP8 [K, M]
    (the transposed copy, [0] unless asked for); scale_t: its scales ([0]
    unless asked for); amax: float32 [], max |input|."""

    data: Tensor
    scale: Tensor
    data_t: Tensor
    scale_t: Tensor
    amax: Tensor


def fp8_cast(
    input: Tensor,
    scaling: str,
    dtype: str = "e4m3",
    transpose: bool = False,
    scale: Tensor | None = None,
    pow2_scales: bool = False,
) -> Fp8CastResult:
    """Quantizes ``input`` [M, K] (bf16/fp16/fp32) to FP8 ``dtype``
    (``"e4m3"`` or ``"e5m2"``): q = fp8(x / s), s = amax / fmax per scaling
    group (1 where the amax is 0), round to nearest even, saturating.

    ``scaling``: ``"tensor"`` (scale []), ``"row"`` ([M]), ``"block"`` (1 x 128
    tiles along K: [M, ceil(K/128)]) or ``"block2d"`` (128 x 128 tiles:
    [ceil(M/128), ceil(K/128)]). With ``transpose`` the transposed copy
    [K, M] comes too, scaled along its own rows (per column of the input for
    ``"row"``, 1 x 128 tiles along M for ``"block"``, the same tiles for
    ``"block2d"``, the same scale for ``"tensor"``): what the backward GEMMs
    need. ``scale`` ([] float32, ``"tensor"`` only) quantizes with a given
    scale (delayed scaling); the amax is returned either way."""
    return Fp8CastResult(*torch.ops.lowbit.fp8_cast(input, scaling, dtype, transpose, scale, pow2_scales))


def fp8_gemm(
    a: Tensor,
    scale_a: Tensor,
    b: Tensor,
    scale_b: Tensor,
    scaling_a: str = "tensor",
    scaling_b: str = "tensor",
    bias: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """y = dequant(a) @ dequant(b)^T (+ bias): a [M, K], b [N, K] FP8 with
    scales as :func:`fp8_cast` returns them, FP32 accumulation, y [M, N] in
    ``out_dtype`` (bfloat16 by default, float16 or float32). Scalings
    (a, b): (tensor, tensor), (row, row), (block, block) or (block, block2d).
    Not differentiable (:func:`fp8_linear` is)."""
    return torch.ops.lowbit.fp8_gemm(a, scale_a, b, scale_b, scaling_a, scaling_b, bias, out_dtype)


def _recipe_args(recipe: Fp8Recipe) -> tuple:
    return recipe.name, recipe.grad_format, recipe.amax_compute, recipe.margin, recipe.pow2_scales


class _Fp8LinearFunction(torch.autograd.Function):
    # The state is mutated by both ops (forward: rows x, W; backward: row
    # dy), so it is kept on ctx, not saved: a saved tensor would fail the
    # version check whenever the layer's next forward runs before this
    # backward. Under torch.compile the compiled graph does save it, so there
    # each backward must run before the layer's next forward (docs/fp8.md).

    @staticmethod
    def forward(ctx, x2, weight, bias, state, recipe_args, needs_dx, needs_dw):
        y, x_t, x_t_scale, w_t, w_t_scale = torch.ops.lowbit.fp8_linear_forward(
            x2, weight, bias, state, *recipe_args, save_x_t=needs_dw, save_w_t=needs_dx
        )
        ctx.save_for_backward(x_t, x_t_scale, w_t, w_t_scale)
        ctx.state = state
        ctx.recipe_args = recipe_args
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x_t, x_t_scale, w_t, w_t_scale = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dx, dw, db = torch.ops.lowbit.fp8_linear_backward(
            dy.contiguous(),
            x_t,
            x_t_scale,
            w_t,
            w_t_scale,
            ctx.state,
            *ctx.recipe_args,
            weight_dtype=ctx.weight_dtype,
            bias_dtype=ctx.bias_dtype if needs[2] else None,
            compute_dx=needs[0],
            compute_dw=needs[1],
        )
        return (dx if needs[0] else None, dw if needs[1] else None, db if needs[2] else None, None, None, None,
                None)


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, recipe: Fp8Recipe, state: Tensor) -> Tensor:
    """y = x W^T (+ bias) with FP8 GEMMs: x [..., K] (bf16/fp16/fp32),
    ``weight`` [N, K] in high precision (the bf16 or fp32 parameter, cast to
    FP8 on every call), ``bias`` [N]; returns [..., N] in x's dtype.

    Differentiable in x, weight and bias: the backward casts dy to
    ``recipe.grad_format`` and runs dgrad (dy W) and wgrad (dy^T x) in FP8
    on the FP8 copies the forward saved (x^T and W^T, not the bf16 x); dbias
    is the FP32 sum of dy. ``state`` comes from :func:`fp8_state` (the amax
    history for ``"delayed"``, updated in place by the forward (x, W) and the
    backward (dy); unused otherwise).

    Not done yet: the weight's FP8 copy is not cached across microbatches,
    and the output is not handed to the next layer in FP8."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"lowbit.fp8_linear: x [..., K] and weight [N, K] must have the same K, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    x2 = x.reshape(-1, x.shape[-1])
    needs_dx = x.requires_grad and torch.is_grad_enabled()
    needs_dw = weight.requires_grad and torch.is_grad_enabled()
    y = _Fp8LinearFunction.apply(x2, weight, bias, state, _recipe_args(recipe), needs_dx, needs_dw)
    return y.reshape(*x.shape[:-1], weight.shape[0])
