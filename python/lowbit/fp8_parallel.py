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

What is not here yet (issue 41): the FP8 all-gather of x (codes and scales
instead of BF16), FSDP2 with FP8 weight all-gathers, distributed checkpoints
of the FP8 state, and runs on several GPUs.
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


class _GatherTokens(torch.autograd.Function):
    """All-gather along dimension 0 forward; reduce-scatter (sum) along
    dimension 0 of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: str) -> Tensor:
        ctx.group = group
        return _waited(_fc().all_gather_tensor(x.contiguous(), 0, group))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _waited(_fc().reduce_scatter_tensor(grad.contiguous(), "sum", 0, ctx.group)), None


class _ScatterTokens(torch.autograd.Function):
    """Reduce-scatter (sum) along dimension 0 forward; all-gather along
    dimension 0 of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: str) -> Tensor:
        ctx.group = group
        return _waited(_fc().reduce_scatter_tensor(x.contiguous(), "sum", 0, group))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _waited(_fc().all_gather_tensor(grad.contiguous(), 0, ctx.group)), None


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
