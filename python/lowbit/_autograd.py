"""Autograd for ops without a backward: a clear error when a gradient is
asked of them, instead of PyTorch's fallback, which warns and then produces
gradients that are silently wrong (zero through the CUDA kernels)."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("lowbit::no_backward", mutates_args=())
def _no_backward(op: str, like: Tensor) -> Tensor:
    """Stands in for the gradient of an input of lowbit::<op>; raises when it
    runs (in eager backward, or in a compiled graph's backward)."""
    raise NotImplementedError(
        f"lowbit.{op} has no backward (an inference op): run it under torch.no_grad(), or keep the layers "
        "you train off the path from it to the loss"
    )


@_no_backward.register_fake
def _(op: str, like: Tensor) -> Tensor:
    return torch.empty_like(like)


def register_inference_only(op: str) -> None:
    """Registers an autograd formula for ``lowbit::<op>`` whose backward
    raises (when it runs: torch.compile traces it without running it), so
    the forward works, and compiles, with inputs that require grad."""

    def setup_context(ctx, inputs, output) -> None:
        ctx.inputs_like = [t.new_empty(()).expand(t.shape) if isinstance(t, Tensor) else None for t in inputs]

    def backward(ctx, *grads):
        return tuple(
            _no_backward(op, like) if needs else None for like, needs in zip(ctx.inputs_like, ctx.needs_input_grad)
        )

    torch.library.register_autograd(f"lowbit::{op}", backward, setup_context=setup_context)
