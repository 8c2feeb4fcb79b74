"""``quantize_``: a model's layers swapped in place for NVFP4 ones, each
quantized from its own weights with the reference rule
(:func:`lowbit.nvfp4_quantize`)."""

from __future__ import annotations

from typing import Callable

from torch import nn

from ._progress import progress_bar


def _swappable_linear(mod: nn.Module) -> bool:
    from .nn.linear import Nvfp4Linear

    return Nvfp4Linear.computes_like(mod) and mod.in_features % 16 == 0 and mod.out_features % 16 == 0


def quantize_(
    model: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    progress: bool = True,
    fp8_min_rows: int = 0,
    moe: bool = True,
) -> nn.Module:
    """Replaces, in place, the layers of ``model`` for which
    ``filter_fn(module, qualified_name)`` is true (all by default):

    - each ``nn.Linear`` with an :class:`lowbit.nn.Nvfp4Linear`, in the FP8
      mode from ``fp8_min_rows`` rows (0: never; see
      :func:`lowbit.nvfp4_linear`). Skipped always: layers whose in or out
      features are not multiples of 16, and subclasses of ``nn.Linear``
      with a ``forward`` of their own, which compute something other than
      ``x W^T + b`` (but see the next item);
    - each transformers ``DeepseekV4GroupedLinear`` (the V4 attention's
      block-diagonal ``o_a_proj``) without a bias with an
      :class:`lowbit.nn.Nvfp4GroupedLinear` (``fp8_min_rows`` does not
      apply to it);
    - with ``moe=True``, each Hugging Face transformers DeepSeek MoE block
      (``DeepseekV3MoE``, ``DeepseekV4SparseMoeBlock``) with an
      :class:`lowbit.nn.Nvfp4MoE` (:meth:`Nvfp4MoE.from_hf`: router,
      routed experts and shared expert in one module, so the Linear layers
      of its shared expert go with it). Blocks whose sizes are not
      multiples of 16 are skipped.

    ``model`` itself is never replaced (``Nvfp4Linear.from_linear``,
    ``Nvfp4GroupedLinear.from_hf`` and ``Nvfp4MoE.from_hf`` convert a single
    layer). Returns model."""
    from .nn.linear import Nvfp4GroupedLinear, Nvfp4Linear
    from .nn.moe import Nvfp4MoE

    if isinstance(fp8_min_rows, bool) or not isinstance(fp8_min_rows, int) or fp8_min_rows < 0:
        # Before any layer is replaced: a bad argument leaves the model as it was.
        raise ValueError(f"quantize_: fp8_min_rows must be an int >= 0 (0: never the FP8 mode), got {fp8_min_rows!r}")
    # Names only: each layer is looked up when it is converted, so that the
    # unquantized one is freed as soon as it is replaced (peak memory: the
    # model plus one layer's conversion, not the model twice).
    targets: list[str] = []
    swapped_blocks: list[str] = []
    for name, mod in model.named_modules():
        if not name:
            continue  # the root: it cannot be replaced in place
        if any(name.startswith(block + ".") for block in swapped_blocks):
            continue  # inside a MoE block that is swapped whole
        block = moe and Nvfp4MoE.is_hf_block(mod) and Nvfp4MoE.hf_block_sizes_supported(mod)
        grouped = Nvfp4GroupedLinear.is_hf_grouped(mod) and Nvfp4GroupedLinear.hf_grouped_supported(mod)
        if not (block or grouped or _swappable_linear(mod)) or (filter_fn is not None and not filter_fn(mod, name)):
            continue
        targets.append(name)
        if block:
            swapped_blocks.append(name)
    for i, name in enumerate(targets):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        mod = getattr(parent, child)
        if Nvfp4GroupedLinear.is_hf_grouped(mod):
            layer = Nvfp4GroupedLinear.from_hf(mod)
        elif isinstance(mod, nn.Linear):
            layer = Nvfp4Linear.from_linear(mod)
            layer.fp8_min_rows = fp8_min_rows
        else:
            layer = Nvfp4MoE.from_hf(mod)
        del mod  # the parent's was the last reference
        setattr(parent, child, layer)
        if progress:
            progress_bar("lowbit.quantize_", i + 1, len(targets), name)
    return model
