"""FP8 training: the typed Python entry points of the FP8 family.

``fp8_linear`` is the differentiable Linear (y = x W^T + b with both GEMMs of
the backward in FP8 too), configured by an :class:`Fp8Recipe`; its state (the
amax history of delayed scaling) is a tensor from :func:`fp8_state` that the
module owning the layer registers as a buffer. The weight cache
(:func:`fp8_weight_cache`, :func:`fp8_cache_weight`) keeps W's FP8 cast
across the microbatches of one optimizer step; :class:`Fp8Activation`
carries a layer's FP8 output into the next layer. ``fp8_cast`` and
``fp8_gemm`` are the building blocks. Every function is a thin call into
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

from ._autocast import autocast_input

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
    fast_accum: the forward GEMM (y = x W^T) accumulates in the Hopper FP8
      tensor cores' own accumulator over all of K (about 14 significant bits)
      instead of promoting partial sums to FP32 at intervals: faster, and
      what TransformerEngine and torchao do by default in the forward. The
      backward GEMMs always promote. Tensorwise, delayed and rowwise only
      (block scales promote every 128 elements anyway); the CPU reference
      accumulates in FP32 either way.
    """

    name: str = "tensorwise"
    grad_format: str = "e4m3"
    amax_history_len: int = 16
    amax_compute: str = "max"
    margin: int = 0
    pow2_scales: bool = False
    fast_accum: bool = True

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
    fast_accum: bool = False,
) -> Tensor:
    """y = dequant(a) @ dequant(b)^T (+ bias): a [M, K], b [N, K] FP8 with
    scales as :func:`fp8_cast` returns them, FP32 accumulation, y [M, N] in
    ``out_dtype`` (bfloat16 by default, float16 or float32). Scalings
    (a, b): (tensor, tensor), (row, row), (block, block) or (block, block2d).
    ``fast_accum``: on a Hopper GPU with tensor or row scales, accumulate in
    the tensor cores' own accumulator (:class:`Fp8Recipe`'s ``fast_accum``).
    Not differentiable (:func:`fp8_linear` is)."""
    return torch.ops.lowbit.fp8_gemm(a, scale_a, b, scale_b, scaling_a, scaling_b, bias, out_dtype, fast_accum)


def _recipe_args(recipe: Fp8Recipe) -> tuple:
    """The recipe as the forward and backward ops take it (positional); the
    forward's fast_accum goes separately."""
    return recipe.name, recipe.grad_format, recipe.amax_compute, recipe.margin, recipe.pow2_scales


def activation_scaling(recipe: Fp8Recipe) -> str:
    """The fp8_cast scaling of x and dy under ``recipe``."""
    return {"rowwise": "row", "blockwise": "block"}.get(recipe.name, "tensor")


def weight_scaling(recipe: Fp8Recipe) -> str:
    """The fp8_cast scaling of W under ``recipe``."""
    return {"rowwise": "row", "blockwise": "block2d"}.get(recipe.name, "tensor")


def _scale_shape(rows: int, cols: int, scaling: str) -> tuple:
    blocks = lambda v: (v + 127) // 128  # noqa: E731
    return {"tensor": (), "row": (rows,), "block": (rows, blocks(cols)),
            "block2d": (blocks(rows), blocks(cols))}[scaling]


# ---- the weight cache ---------------------------------------------------------


class Fp8WeightCache(NamedTuple):
    """W's cast under a recipe, kept across the microbatches of one optimizer
    step: ``data`` E4M3 [N, K] and ``scale`` (what the forward GEMM takes),
    ``data_t`` E4M3 [K, N] and ``scale_t`` (what the input-gradient GEMM
    takes). Module buffers; filled in place by :func:`fp8_cache_weight`."""

    data: Tensor
    scale: Tensor
    data_t: Tensor
    scale_t: Tensor


def fp8_weight_cache(weight: Tensor, recipe: Fp8Recipe, device=None) -> Fp8WeightCache:
    """Empty cache buffers for ``weight`` [N, K] under ``recipe``. The scales
    start as NaN: a forward that reads a cache never filled gives NaN, not
    plausible numbers."""
    n, k = weight.shape
    device = weight.device if device is None else device
    sc = weight_scaling(recipe)
    q = dict(dtype=torch.float8_e4m3fn, device=device)
    f = dict(dtype=torch.float32, device=device)
    return Fp8WeightCache(torch.zeros(n, k, **q), torch.full(_scale_shape(n, k, sc), float("nan"), **f),
                          torch.zeros(k, n, **q), torch.full(_scale_shape(k, n, sc), float("nan"), **f))


def fp8_cache_weight(weight: Tensor, cache: Fp8WeightCache, *, recipe: Fp8Recipe, state: Tensor) -> None:
    """Casts ``weight`` into ``cache`` in place (one op,
    ``lowbit::fp8_linear_cache_weight``): what the first microbatch of an
    optimizer step runs. For ``"delayed"`` W's scale comes from row 1 of
    ``state`` and W's amax is recorded there, once per refresh. Not
    differentiable (the gradient of W flows through :func:`fp8_linear`)."""
    with torch.no_grad():
        torch.ops.lowbit.fp8_linear_cache_weight(weight, state, *cache, recipe.name, recipe.amax_compute,
                                                 recipe.margin, recipe.pow2_scales)
    if not torch.compiler.is_compiling():
        # Eagerly the dispatcher does not bump a custom op's mutated
        # arguments' versions; bumped here so that autograd's saved-tensor
        # check reports a refresh that comes before an earlier microbatch's
        # backward. (Compiled graphs save the tensors themselves.)
        torch.autograd.graph.increment_version(list(cache))


# ---- FP8 output into the next layer ----------------------------------------------


class Fp8Activation(NamedTuple):
    """A layer's output handed to the next FP8 layer in FP8: ``data`` E4M3
    [..., N], ``scale`` over the flattened rows [M, N] as :func:`fp8_cast`
    gives it under ``scaling`` (the recipe's activation scaling), and
    ``dtype``, the high-precision dtype the output would have had. A plain
    tuple of tensors and constants (no tensor subclass), so torch.compile
    traces it. Carries no gradient."""

    data: Tensor
    scale: Tensor
    scaling: str
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self) -> Tensor:
        """The values ``code * scale`` in ``dtype`` (FP32 products, one rounding)."""
        d = self.data.reshape(-1, self.data.shape[-1]).float()
        m, n = d.shape
        if self.scaling == "tensor":
            v = d * self.scale
        elif self.scaling == "row":
            v = d * self.scale.unsqueeze(1)
        else:  # "block": 1 x 128 tiles along the last dim
            v = d * self.scale.repeat_interleave(128, dim=1)[:, :n]
        return v.to(self.dtype).reshape(self.data.shape)


class _Fp8LinearFunction(torch.autograd.Function):
    # The state is mutated by both ops (forward: rows x, W; backward: row
    # dy), so it is kept on ctx, not saved: a saved tensor would fail the
    # version check whenever the layer's next forward runs before this
    # backward. Under torch.compile the compiled graph does save it, so there
    # each backward must run before the layer's next forward (docs/fp8.md).

    @staticmethod
    def forward(ctx, x2, weight, bias, state, recipe_args, fast_accum, needs_dx, needs_dw, w_data, w_scale, cache_w_t,
                cache_w_t_scale):
        # With a weight cache (w_data not None) the op reads W's cast from it
        # and the backward reads W's transposed copy from it: saved, so the
        # version check catches a cache refreshed before this backward ran.
        cached = w_data is not None
        y, x_t, x_t_scale, w_t, w_t_scale, _ = torch.ops.lowbit.fp8_linear_forward(
            x2, weight, bias, state, *recipe_args, save_x_t=needs_dw, save_w_t=needs_dx and not cached,
            w_fp8=w_data, w_fp8_scale=w_scale, fast_accum=fast_accum,
        )
        if cached:
            w_t, w_t_scale = cache_w_t, cache_w_t_scale
        ctx.save_for_backward(x_t, x_t_scale, w_t, w_t_scale)
        ctx.state = state
        ctx.recipe_args = recipe_args
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        return _linear_backward(ctx, dy, *ctx.saved_tensors) + (None,) * 9


def _linear_backward(ctx, dy, x_t, x_t_scale, w_t, w_t_scale) -> tuple:
    """(dx, dW, db) of a Linear autograd Function whose inputs start with
    (x, weight, bias): the backward op on the FP8 copies its forward saved,
    None where no gradient is needed. ``ctx`` carries state, recipe_args,
    weight_dtype and bias_dtype."""
    needs = ctx.needs_input_grad
    dx, dw, db = torch.ops.lowbit.fp8_linear_backward(
        dy.contiguous(), x_t, x_t_scale, w_t, w_t_scale, ctx.state, *ctx.recipe_args,
        weight_dtype=ctx.weight_dtype, bias_dtype=ctx.bias_dtype if needs[2] else None,
        compute_dx=needs[0], compute_dw=needs[1])
    return dx if needs[0] else None, dw if needs[1] else None, db if needs[2] else None


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _fp8_linear_no_grad(x, weight, bias, recipe, state, weight_cache, fp8_output):
    # The FP8 hand-over (Fp8Activation in, fp8_output out): the forward op
    # alone, no autograd Function, since neither side has a gradient.
    fp8_in = isinstance(x, Fp8Activation)
    if fp8_in and x.scaling != activation_scaling(recipe):
        raise ValueError(
            f"lowbit.fp8_linear: the FP8 input is scaled {x.scaling!r}, but recipe {recipe.name!r} takes "
            f"{activation_scaling(recipe)!r} activations: give both layers recipes of one activation scaling")
    data = x.data if fp8_in else x
    x2 = data.reshape(-1, data.shape[-1])
    cache = (None, None) if weight_cache is None else (weight_cache.data, weight_cache.scale)
    y, *_, y_scale = torch.ops.lowbit.fp8_linear_forward(
        x2, weight, bias, state, *_recipe_args(recipe), save_x_t=False, save_w_t=False, w_fp8=cache[0],
        w_fp8_scale=cache[1], x_scale=x.scale if fp8_in else None, out_dtype=x.dtype if fp8_in else None,
        fp8_out=fp8_output, fast_accum=recipe.fast_accum)
    y = y.reshape(*data.shape[:-1], weight.shape[0])
    if fp8_output:
        return Fp8Activation(y, y_scale, activation_scaling(recipe), x.dtype)
    return y


def _tensor_amax(t: Tensor) -> Tensor:
    """max |t| as float32 [1, 1] (0 for an empty t; NaN propagates): one read
    of t, no |t| temporary. What a shard contributes to a whole tensor's
    amax before the ranks all-reduce it (lowbit.fp8_parallel, fp8_fsdp)."""
    if not t.numel():
        return torch.zeros(1, 1, dtype=torch.float32, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.maximum(lo.abs(), hi.abs()).float().reshape(1, 1)


def _tensor_scale(amax: Tensor, pow2: bool) -> Tensor:
    """The E4M3 tensor scale of a tensor whose amax is ``amax``, by
    fp8_cast's own rule (the cast of a one-element tensor holding it)."""
    return torch.ops.lowbit.fp8_cast(amax.reshape(1, 1), "tensor", "e4m3", False, None, pow2)[1]


def fp8_linear(
    x: Tensor | Fp8Activation,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    recipe: Fp8Recipe,
    state: Tensor,
    weight_cache: Fp8WeightCache | None = None,
    fp8_output: bool = False,
) -> Tensor | Fp8Activation:
    """y = x W^T (+ bias) with FP8 GEMMs: x [..., K] (bf16/fp16/fp32),
    ``weight`` [N, K] in high precision (the bf16 or fp32 parameter, cast to
    FP8 on every call unless ``weight_cache`` is given), ``bias`` [N];
    returns [..., N] in x's dtype.

    Differentiable in x, weight and bias: the backward casts dy to
    ``recipe.grad_format`` and runs dgrad (dy W) and wgrad (dy^T x) in FP8
    on the FP8 copies the forward saved (x^T and W^T, not the bf16 x); dbias
    is the FP32 sum of dy. ``state`` comes from :func:`fp8_state` (the amax
    history for ``"delayed"``, updated in place by the forward (x, W) and the
    backward (dy); unused otherwise).

    ``weight_cache``: W's cast, filled by :func:`fp8_cache_weight` (on the
    first microbatch of an optimizer step) and read here instead of casting
    W; the results are bitwise those of the uncached call that would have
    cast W at the refresh. For ``"delayed"`` W's history row then moves once
    per refresh, not per call (docs/fp8.md).

    ``fp8_output``: return an :class:`Fp8Activation` (y cast to E4M3 for the
    next layer) instead of y. ``x`` may be an :class:`Fp8Activation` (the
    output of a layer with ``fp8_output``). Both carry no gradient: they
    need grad disabled or no input requiring grad (RuntimeError otherwise).
    Not done yet: a gradient through the FP8 hand-over.

    Under ``torch.autocast`` x is first cast to the autocast dtype (as
    ``F.linear``'s input is), so y has that dtype."""
    x = autocast_input(x)
    fp8_in = isinstance(x, Fp8Activation)
    if fp8_in or fp8_output:
        if _needs_grad(None if fp8_in else x, weight, bias):
            what = "an FP8 input (Fp8Activation)" if fp8_in else "fp8_output=True"
            raise RuntimeError(
                f"lowbit.fp8_linear: {what} carries no gradient, but gradients are required here (grad mode on and "
                f"x, weight or bias requiring grad): run it under torch.no_grad(), or set fp8_output=False for "
                f"training")
        if x.shape[-1] != weight.shape[-1]:
            raise ValueError(f"lowbit.fp8_linear: x [..., K] and weight [N, K] must have the same K, got "
                             f"{tuple(x.shape)} and {tuple(weight.shape)}")
        return _fp8_linear_no_grad(x, weight, bias, recipe, state, weight_cache, fp8_output)
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"lowbit.fp8_linear: x [..., K] and weight [N, K] must have the same K, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    x2 = x.reshape(-1, x.shape[-1])
    needs_dx = x.requires_grad and torch.is_grad_enabled()
    needs_dw = weight.requires_grad and torch.is_grad_enabled()
    cache = (None,) * 4 if weight_cache is None else tuple(weight_cache)
    y = _Fp8LinearFunction.apply(x2, weight, bias, state, _recipe_args(recipe), recipe.fast_accum, needs_dx, needs_dw,
                                 *cache)
    return y.reshape(*x.shape[:-1], weight.shape[0])
