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
    fp8_min_rows: int | None = None,
    moe: bool = True,
    compute: str = "w4a16",
) -> nn.Module:
    """Replaces, in place, the layers of ``model`` for which
    ``filter_fn(module, qualified_name)`` is true (all by default):

    - each ``nn.Linear`` with an :class:`lowbit.nn.Nvfp4Linear` computing
      as ``compute`` says: ``"w4a16"`` (the default), ``"auto"`` (the FP8
      path from ``lowbit.nn.linear.AUTO_FP8_MIN_ROWS`` (128) rows of x) or
      ``"fp8"`` (always), the last two with W's FP8 copy made here (1 byte
      a weight more; see :class:`lowbit.nn.Nvfp4Linear`). ``fp8_min_rows``
      is deprecated: n is ``compute="auto"`` from n rows, 0 ``"w4a16"``.
      Skipped always: layers whose in or out
      features are not multiples of 16, and subclasses of ``nn.Linear``
      with a ``forward`` of their own, which compute something other than
      ``x W^T + b`` (but see the next item);
    - each transformers ``DeepseekV4GroupedLinear`` (the V4 attention's
      block-diagonal ``o_a_proj``) without a bias with an
      :class:`lowbit.nn.Nvfp4GroupedLinear`, W4A16 whatever ``compute``
      (its op has no FP8 path yet);
    - with ``moe=True``, each Hugging Face transformers DeepSeek MoE block
      (``DeepseekV3MoE``, ``DeepseekV4SparseMoeBlock``) with an
      :class:`lowbit.nn.Nvfp4MoE` (:meth:`Nvfp4MoE.from_hf`: router,
      routed experts and shared expert in one module, so the Linear layers
      of its shared expert go with it), computing as ``compute`` says
      (``"auto"``: the FP8 path from
      ``lowbit.nn.moe.AUTO_MOE_FP8_ROWS_PER_EXPERT`` routed rows per expert
      on average; with ``"auto"`` or
      ``"fp8"`` the experts' FP8 form is made here, 1 byte a weight more;
      see :class:`lowbit.nn.Nvfp4MoE`; the deprecated ``fp8_min_rows``
      n > 0 gives them ``"auto"`` at their own threshold). Blocks whose
      sizes are not multiples of 16 are skipped.

    A module used under several names (the same object registered twice)
    is converted once and the replacement put under every name, so it
    stays shared; ``filter_fn`` is asked for each name and must give one
    answer for all of them (ValueError otherwise, before anything is
    replaced).

    ``model`` itself is never replaced (``Nvfp4Linear.from_linear``,
    ``Nvfp4GroupedLinear.from_hf`` and ``Nvfp4MoE.from_hf`` convert a single
    layer). Returns model."""
    from .nn.linear import Nvfp4GroupedLinear, Nvfp4Linear
    from .nn.moe import Nvfp4MoE

    from .nn.linear import resolve_compute

    # Before any layer is replaced: a bad argument leaves the model as it was.
    mode, fp8_rows = resolve_compute("quantize_", compute, fp8_min_rows)
    # Names only: each layer is looked up when it is converted, so that the
    # unquantized one is freed as soon as it is replaced (peak memory: the
    # model plus one layer's conversion, not the model twice). A module
    # registered under several names (shared) is converted once and the
    # replacement put under every name, so that it stays shared.
    names_of: dict[int, list[str]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        if name:  # not the root: it cannot be replaced in place
            names_of.setdefault(id(mod), []).append(name)
    targets: list[list[str]] = []
    swapped_blocks: list[str] = []
    for name, mod in model.named_modules():
        if not name:
            continue
        if any(name.startswith(block + ".") for block in swapped_blocks):
            continue  # inside a MoE block that is swapped whole
        block = moe and Nvfp4MoE.is_hf_block(mod) and Nvfp4MoE.hf_block_sizes_supported(mod)
        grouped = Nvfp4GroupedLinear.is_hf_grouped(mod) and Nvfp4GroupedLinear.hf_grouped_supported(mod)
        if not (block or grouped or _swappable_linear(mod)):
            continue
        names = names_of[id(mod)]
        if filter_fn is not None:
            chosen = [filter_fn(mod, n) for n in names]
            if any(chosen) and not all(chosen):
                yes, no = names[chosen.index(True)], names[chosen.index(False)]
                raise ValueError(f"quantize_: filter_fn accepts the module named {yes!r} but not its other name "
                                 f"{no!r}; it is one module, so it is replaced everywhere or nowhere: accept or "
                                 "refuse all of its names")
            if not all(chosen):
                continue
        targets.append(names)
        if block:
            swapped_blocks.extend(names)
    for i, names in enumerate(targets):
        mod = model.get_submodule(names[0])
        if Nvfp4GroupedLinear.is_hf_grouped(mod):
            layer = Nvfp4GroupedLinear.from_hf(mod)
        elif isinstance(mod, nn.Linear):
            layer = Nvfp4Linear.from_linear(mod)
            layer._set_compute(mode, fp8_rows)
        else:
            layer = Nvfp4MoE.from_hf(mod, compute=mode)
        del mod  # the parents' were the last references
        for name in names:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        if progress:
            progress_bar("lowbit.quantize_", i + 1, len(targets), names[0])
    return model


def nvfp4_round_trip_(model: nn.Module, moe: bool = True) -> nn.Module:
    """Replaces, in place, every weight that :func:`quantize_` (with the same
    ``moe``) would convert by its NVFP4 round trip (quantized by the same
    rule and grouping, then dequantized to the weight's dtype), leaving the
    model's classes as they are: the high-precision model that computes
    what the quantized one does, up to the kernels' rounding (the
    reference of the transformers tests and of ``bench model``). MoE
    blocks as :meth:`Nvfp4MoE.from_hf` quantizes them: one global scale per
    expert, the shared expert's gate and up rows together. Returns model."""
    import torch

    from .format import nvfp4_dequantize, nvfp4_quantize
    from .nn.linear import Nvfp4GroupedLinear
    from .nn.moe import Nvfp4MoE

    def round_trip(w):
        if w.dim() == 3:  # experts [E, rows, cols]: one global scale each, one at a time (FP32 temporaries)
            out = torch.empty_like(w)
            for e in range(w.shape[0]):
                out[e] = round_trip(w[e])
            return out
        q = nvfp4_quantize(w)
        return nvfp4_dequantize(q.packed, q.block_scale, q.global_scale, torch.float32).to(w.dtype)

    in_blocks = set()
    with torch.no_grad():
        for mod in model.modules():
            if moe and Nvfp4MoE.is_hf_block(mod) and Nvfp4MoE.hf_block_sizes_supported(mod):
                experts, shared = mod.experts, mod.shared_experts
                experts.gate_up_proj.copy_(round_trip(experts.gate_up_proj))
                experts.down_proj.copy_(round_trip(experts.down_proj))
                i = shared.gate_proj.out_features
                gate_up = round_trip(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
                shared.gate_proj.weight.copy_(gate_up[:i])
                shared.up_proj.weight.copy_(gate_up[i:])
                shared.down_proj.weight.copy_(round_trip(shared.down_proj.weight))
                in_blocks.update(id(m) for m in mod.modules())
        for mod in model.modules():
            if id(mod) in in_blocks:
                continue
            grouped = Nvfp4GroupedLinear.is_hf_grouped(mod) and Nvfp4GroupedLinear.hf_grouped_supported(mod)
            if grouped or _swappable_linear(mod):
                mod.weight.copy_(round_trip(mod.weight))
    return model
