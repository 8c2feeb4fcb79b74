"""``quantize_``: a model's Linear layers swapped in place for NVFP4 ones,
each quantized from its own weights with the reference rule
(:func:`lowbit.nvfp4_quantize`)."""

from __future__ import annotations

import sys
from typing import Callable

from torch import nn


def _progress(done: int, total: int, name: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\rlowbit.quantize_ [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {name[:40]:<40}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _swappable_linear(mod: nn.Module) -> bool:
    from .nn.linear import Nvfp4Linear

    return (
        isinstance(mod, nn.Linear)
        and not isinstance(mod, Nvfp4Linear)
        and Nvfp4Linear.computes_like(mod)
        and mod.in_features % 16 == 0
        and mod.out_features % 16 == 0
    )


def quantize_(
    model: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    progress: bool = True,
    fp8_min_rows: int = 0,
) -> nn.Module:
    """Replaces, in place, each ``nn.Linear`` of ``model`` for which
    ``filter_fn(module, qualified_name)`` is true (all by default) with an
    :class:`lowbit.nn.Nvfp4Linear`, in the FP8 mode from ``fp8_min_rows``
    rows (0: never; see :func:`lowbit.nvfp4_linear`). Skipped always:
    layers whose in or out features are not multiples of 16, and subclasses
    of ``nn.Linear`` with a ``forward`` of their own, which compute
    something other than ``x W^T + b`` (transformers'
    ``DeepseekV4GroupedLinear``, the V4 attention's block-diagonal
    ``o_a_proj``, is one).

    ``model`` itself is never replaced (``Nvfp4Linear.from_linear``
    converts a single layer). Returns model."""
    from .nn.linear import Nvfp4Linear

    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if name  # the root: it cannot be replaced in place
        and _swappable_linear(mod)
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
