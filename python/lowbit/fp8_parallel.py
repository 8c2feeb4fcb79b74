"""Tensor and sequence parallelism for :class:`lowbit.nn.Fp8Linear`: the
collectives around a layer's local FP8 GEMMs, as autograd functions over
``torch.distributed``'s functional collectives, so that ``torch.compile``
keeps them as graph nodes (no graph break) and CUDA graphs capture them.

The process group travels as its name (a string), the form functional
collectives and Dynamo take as a constant; nothing is global.

Layouts (Megatron-LM's, as TransformerEngine's Linear takes them), with tp
ranks in the group and M the tokens (x's leading dimensions flattened):

- ``parallel="column"``: W [N / tp, K] on each rank (rows of the full W in
  rank order), bias [N / tp]; x [M, K] replicated, y [M, N / tp]. The
  backward all-reduces dx. With ``sequence_parallel``: x [M / tp, K], its
  shard of the tokens (dimension 0), all-gathered before the GEMM; the
  backward reduce-scatters dx along dimension 0.
- ``parallel="row"``: W [N, K / tp] (columns of the full W), x [M, K / tp]
  (a column-parallel layer's output), partial y summed over ranks by an
  all-reduce, then the bias (kept whole on every rank) added; the backward
  needs no collective for dx. With ``sequence_parallel``: y reduce-scattered
  along dimension 0 to [M / tp, N]; the backward all-gathers dy. The bias's
  gradient, summed over a rank's tokens, is all-reduced so every rank holds
  the whole sum.

FP8 all-gather (``fp8_all_gather``, tensorwise and delayed recipes): the
column-parallel, sequence-parallel layer casts its shard of x with one scale
for the whole x and all-gathers the FP8 codes, half the bytes of BF16; the
backward transposes the gathered codes for the weight gradient. Tensorwise:
the scale from the ranks' amaxes all-reduced by max, then the scale rule of
fp8_cast. Delayed: the scale from the history's x row
(``lowbit::fp8_delayed_scale``), the same on every rank, and the ranks'
amaxes all-reduced by max and recorded in that row by the forward op
(``x_amax``), as a cast of the whole x would record it. Either way the codes
equal those of casting the gathered BF16 x, so the results and the history
are bitwise the BF16 all-gather's. The backward of that layer runs the
backward op's steps itself (dy's cast, the dx GEMM, dx's reduce-scatter
started, the dW GEMM, the wait), so the reduce-scatter can run during the
dW GEMM: eagerly it does; compiled, Inductor's peak-memory reordering
(``reorder_for_peak_memory``, on by default) moves the wait before that
GEMM unless it is turned off (``torch.compile(..., options=
{"reorder_for_peak_memory": False})``). Rowwise and blockwise gather BF16: their
weight gradient scales x^T along the tokens, across the ranks' shards, so
x^T cannot be the gathered codes transposed.

FSDP2 with the weights all-gathered in FP8: lowbit.fp8_fsdp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

PARALLEL_MODES = ("column", "row")


def _fc():
    import torch.distributed._functional_collectives as fc

    return fc


def _waited(t: Tensor) -> Tensor:
    # Eagerly, functional collectives return an AsyncCollectiveTensor (a
    # tensor subclass, which the FP8 ops do not take): wait for it here.
    # Traced, they return plain tensors and the graph holds the wait.
    fc = _fc()
    return t.wait() if isinstance(t, fc.AsyncCollectiveTensor) else t


class _CopyToParallel(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: str) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _waited(_fc().all_reduce(grad.contiguous(), "sum", ctx.group)), None


class _ReduceFromParallel(torch.autograd.Function):
    """All-reduce (sum) forward; identity gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: str) -> Tensor:
        return _waited(_fc().all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def _all_gather(x: Tensor, group: str) -> Tensor:
    """x's of every rank, concatenated along dimension 0 (the one all-gather
    of the sequence-parallel inputs)."""
    return _waited(_fc().all_gather_tensor(x.contiguous(), 0, group))


def _reduce_scatter(x: Tensor, group: str) -> Tensor:
    return _waited(_fc().reduce_scatter_tensor(x.contiguous(), "sum", 0, group))


class _GatherTokens(torch.autograd.Function):
    """All-gather along dimension 0 forward; reduce-scatter (sum) along
    dimension 0 of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: str) -> Tensor:
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _reduce_scatter(grad, ctx.group), None


class _ScatterTokens(torch.autograd.Function):
    """Reduce-scatter (sum) along dimension 0 forward; all-gather along
    dimension 0 of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: str) -> Tensor:
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather(grad, ctx.group), None


def group_name(process_group) -> str:
    """The name functional collectives take for ``process_group``."""
    return process_group.group_name


def check_parallel(parallel, process_group, sequence_parallel: bool, in_features: int, out_features: int,
                   who: str = "Fp8Linear") -> int:
    """Validates the tensor-parallel arguments; returns the group's size
    (1 without ``parallel``). Errors name the argument and what it needs."""
    if parallel is None:
        if process_group is not None or sequence_parallel:
            raise ValueError(f"{who}: argument 'process_group' / 'sequence_parallel' needs parallel='column' or "
                             f"'row', got parallel=None")
        return 1
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"{who}: argument 'parallel' must be None, 'column' or 'row', got {parallel!r}")
    if not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(f"{who}: argument 'process_group' must be a torch.distributed.ProcessGroup for "
                         f"parallel={parallel!r}, got {type(process_group).__name__}")
    tp = process_group.size()
    name, size = ("out_features", out_features) if parallel == "column" else ("in_features", in_features)
    if size % tp:
        raise ValueError(f"{who}: argument '{name}' ({size}) must be divisible by the process group's size ({tp}) "
                         f"for parallel={parallel!r}")
    return tp


# The device types each backend's collectives take (a group made with
# backend="cpu:gloo,cuda:nccl" names both).
_BACKEND_DEVICES = {"gloo": ("cpu",), "nccl": ("cuda",), "ucc": ("cpu", "cuda"), "mpi": ("cpu", "cuda")}


def check_group_device(process_group, device: torch.device, who: str = "Fp8Linear") -> None:
    """A clear error where the group's backend cannot run collectives on
    tensors of ``device`` (e.g. an NCCL group with CPU tensors), instead of
    the backend's own error from inside a collective."""
    backend = str(dist.get_backend(process_group)).lower()
    takes = set()
    for part in backend.split(","):
        dev, _, name = part.rpartition(":")
        takes.update((dev,) if dev else _BACKEND_DEVICES.get(name, ("cpu", "cuda")))
    if device.type not in takes:
        raise ValueError(f"{who}: x is on {device}, but the process group's backend {backend!r} runs collectives on "
                         f"{' and '.join(sorted(takes))} tensors: move the layer and its input to such a device, or "
                         f"use a process group of a backend for {device.type}")


def shard_of(full: Tensor, parallel: str, process_group, dim_of_bias: bool = False) -> Tensor:
    """This rank's part of a full weight [N, K] (or bias [N] with
    ``dim_of_bias``): rows for "column", columns for "row" (the row
    layer's bias stays whole)."""
    tp, rank = process_group.size(), process_group.rank()
    if dim_of_bias:
        return full.chunk(tp, 0)[rank] if parallel == "column" else full
    return full.chunk(tp, 0 if parallel == "column" else 1)[rank]


def parallel_input(x: Tensor, parallel: str, group: str, sequence_parallel: bool) -> Tensor:
    """x as the local GEMM takes it (module docstring)."""
    if parallel == "column":
        if sequence_parallel:
            return _GatherTokens.apply(x, group)
        return _CopyToParallel.apply(x, group)
    return x


def parallel_output(y: Tensor, bias: Tensor | None, parallel: str, group: str, sequence_parallel: bool) -> Tensor:
    """The local GEMM's y as the layer returns it; ``bias`` is the row
    layer's (the column layer's is in its GEMM)."""
    if parallel == "column":
        return y
    if sequence_parallel:
        y = _ScatterTokens.apply(y, group)
        # Each rank's bias gradient sums its own tokens: all-reduced.
        return y if bias is None else y + _CopyToParallel.apply(bias, group)
    y = _ReduceFromParallel.apply(y, group)
    return y if bias is None else y + bias  # dy is whole on every rank, and so is the bias gradient


FP8_GATHER_RECIPES = ("tensorwise", "delayed")


class _Fp8GatherLinear(torch.autograd.Function):
    """The tensorwise or delayed column-parallel, sequence-parallel layer
    with its x all-gathered in FP8 (module docstring): y [M, N / tp] from
    this rank's x [M / tp, K]."""

    @staticmethod
    def forward(ctx, x, weight, bias, state, recipe_args, fast_accum, group, group_size, needs_dx, needs_dw):
        from .fp8 import _tensor_amax, _tensor_scale

        ops = torch.ops.lowbit
        name, _, amax_compute, margin, pow2 = recipe_args
        x = x.contiguous()
        x_amax = None
        if name == "delayed":
            # The scale is the history's (synchronized across ranks); the
            # whole x's amax goes into the history through the op.
            scale = ops.fp8_delayed_scale(state, 0, amax_compute, margin, pow2, "e4m3")
            codes, _, _, _, local = ops.fp8_cast(x, "tensor", "e4m3", False, scale, pow2)
            x_amax = _waited(_fc().all_reduce(local.reshape(1), "max", group)).reshape(())
        else:
            # The whole x's amax, then its scale by fp8_cast's own rule.
            amax = _waited(_fc().all_reduce(_tensor_amax(x), "max", group))
            scale = _tensor_scale(amax, pow2)
            codes = ops.fp8_cast(x, "tensor", "e4m3", False, scale, pow2)[0]
        # Gathered as bytes: collectives move them whatever the backend
        # makes of FP8 dtypes.
        gathered = _all_gather(codes.view(torch.uint8), group).view(torch.float8_e4m3fn)
        # Tensor scaling: x^T's codes are the gathered codes transposed (the
        # op's transpose kernel), under the same scale.
        y, x_t, x_t_scale, w_t, w_t_scale, _ = ops.fp8_linear_forward(
            gathered, weight, bias, state, *recipe_args, save_x_t=needs_dw, save_w_t=needs_dx, x_scale=scale,
            out_dtype=x.dtype, fast_accum=fast_accum, x_amax=x_amax)
        ctx.save_for_backward(x_t, x_t_scale, w_t, w_t_scale)
        ctx.state, ctx.recipe_args, ctx.group, ctx.group_size = state, recipe_args, group, group_size
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        # The backward op's steps, split so that the reduce-scatter of dx
        # (the gathered x's gradient, back to shards) runs while the weight
        # gradient's GEMM does: dy cast once (its scale and history as the op
        # takes and records them), the dx GEMM, the reduce-scatter started,
        # the dW GEMM, then the wait. The same kernels on the same operands
        # as lowbit::fp8_linear_backward, so the same bits.
        ops, c10d = torch.ops.lowbit, torch.ops._c10d_functional
        x_t, x_t_scale, w_t, w_t_scale = ctx.saved_tensors
        name, grad_format, amax_compute, margin, pow2 = ctx.recipe_args
        needs_dx, needs_dw, needs_db = ctx.needs_input_grad[:3]
        dy = dy.contiguous()
        scale = ops.fp8_delayed_scale(ctx.state, 2, amax_compute, margin, pow2, grad_format) \
            if name == "delayed" else None
        data, s, data_t, s_t, amax = ops.fp8_cast(dy, "tensor", grad_format, needs_dw, scale, pow2)
        dx = dw = db = None
        if needs_dx:
            dx = ops.fp8_gemm(data, s, w_t, w_t_scale, "tensor", "tensor", None, dy.dtype, False)
            dx = c10d.reduce_scatter_tensor(dx, "sum", ctx.group_size, ctx.group)
        if needs_dw:
            dw = ops.fp8_gemm(data_t, s_t, x_t, x_t_scale, "tensor", "tensor", None, ctx.weight_dtype, False)
        if needs_db:
            db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        if name == "delayed":
            ops.fp8_record_amax(ctx.state, 2, amax)
        if dx is not None:
            dx = c10d.wait_tensor(dx)
        return (dx, dw, db) + (None,) * 7


def fp8_gather_linear(x: Tensor, weight: Tensor, bias: Tensor | None, recipe, state: Tensor, group: str,
                      group_size: int) -> Tensor:
    """y = all_gather(x) W^T + b with x all-gathered in FP8 (tensorwise or
    delayed recipe; module docstring). x [..., K]: this rank's tokens;
    ``group_size``: the ranks of ``group``."""
    from .fp8 import _recipe_args

    x2 = x.reshape(-1, x.shape[-1])
    grad = torch.is_grad_enabled()
    y = _Fp8GatherLinear.apply(x2, weight, bias, state, _recipe_args(recipe), recipe.fast_accum, group, group_size,
                               grad and x.requires_grad, grad and weight.requires_grad)
    return y.reshape(-1, *x.shape[1:-1], weight.shape[0])
