"""FSDP2 with the sharded weights of :class:`lowbit.nn.Fp8Linear` all-gathered
in FP8 (half the bytes of BF16), through FSDP2's all-gather extension
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the parameter's local
tensor), as torchao's float8 all-gather does.

:func:`enable_fsdp_fp8_all_gather` (before ``fully_shard``) wraps the weight
of each tensorwise or delayed ``Fp8Linear`` in an :class:`Fp8ShardedWeight`: a tensor
that behaves as its high-precision data everywhere (optimizer, state dict,
checkpoints see the plain values) and that FSDP2 all-gathers in FP8:

- before the all-gather, on each rank: the amax of its shard, all-reduced
  (max) over the FSDP mesh, so every rank has the whole W's amax; the scale
  (tensorwise: from that amax by fp8_cast's rule; delayed: from the layer's
  history row for W, as the forward op would take it); the shard's E4M3
  codes under that scale;
- the gathered codes and the scale become the unsharded weight, an
  :class:`Fp8GatheredWeight` (dtype and shape of the parameter, codes
  inside). The layer's forward op takes W's codes and scale from it instead
  of casting W (delayed: and W's amax, which it records in the history as
  its own cast would), and makes W's transposed copy for the input gradient
  from the codes (one scale: the codes transposed). The weight gradient
  comes out in the parameter's dtype and FSDP2 reduce-scatters it as usual.
  The all-gather FSDP2 repeats for the backward (after resharding) reads
  the history but records nothing, and its codes go unused: the backward
  takes the transposed copy the forward saved.

The codes are those of casting the whole W with fp8_cast (the same amax,
the same scale rule, elementwise rounding), so a step is bitwise the step
with W gathered in BF16 and cast inside the op (where FSDP2 gathers the
parameter's own dtype: with a lower ``param_dtype`` in its mixed precision
policy the codes come from the high-precision shard, one rounding fewer). A call the layer runs in
high precision (fewer tokens than ``min_tokens``, an eager fallback) sees
the gathered weight's dequantized values (W rounded to E4M3), not W.

The tensorwise and delayed recipes gather in FP8. Row and block scaling
scale W per output row / 128 x 128 tile, which the shards could cast alone,
but the input gradient needs W^T scaled along the other dimension, which
the gathered codes cannot give: those layers keep the BF16 all-gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_map

FSDP_FP8_RECIPES = ("tensorwise", "delayed")

_aten = torch.ops.aten
# Ops whose result is still "the weight" (views and copies: what FSDP2's
# sharding does to a parameter); in-place ops return the wrapper written.
_KEEPS_WRAPPER = {
    _aten.detach.default, _aten.alias.default, _aten.view.default, _aten._unsafe_view.default,
    _aten.as_strided.default, _aten.slice.Tensor, _aten.split.Tensor, _aten.split_with_sizes.default,
    _aten.chunk.default, _aten.narrow.default, _aten.clone.default, _aten.empty_like.default,
    _aten.new_zeros.default, _aten.new_empty.default, _aten.new_empty_strided.default, _aten.zeros_like.default,
    _aten._to_copy.default, _aten.t.default, _aten.transpose.int,
}


def _unwrap_sharded(t):
    return t._tensor if isinstance(t, Fp8ShardedWeight) else t


class Fp8ShardedWeight(torch.Tensor):
    """The high-precision weight of a tensorwise or delayed Fp8Linear (``_tensor``),
    all-gathered in FP8 by FSDP2 (module docstring). Every op sees the plain
    values; views, copies and in-place updates stay wrapped."""

    @staticmethod
    def __new__(cls, tensor: Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: Tensor):
        self._tensor = tensor

    def __repr__(self):
        return f"Fp8ShardedWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*tree_map(_unwrap_sharded, args), **tree_map(_unwrap_sharded, kwargs))
        if func._schema.name.endswith("_"):
            # In place: copy_, add_, lerp_, ... return the wrapper of the
            # tensor written; the optimizers' _foreach_*_ return nothing.
            return args[0] if func._schema.returns else None
        if func not in _KEEPS_WRAPPER:
            return out
        return tree_map(lambda t: cls(t) if isinstance(t, Tensor) and not isinstance(t, cls) else t, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8ShardedWeight(inner["_tensor"])

    # ---- FSDP2's all-gather extension ----------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's shard as E4M3 codes (uint8, padded to FSDP2's sharded
        size) under the scale of the whole W; the scale and W's amax as
        metadata. ``module``: the Fp8Linear owning the weight (its recipe
        and, delayed, its history)."""
        from .fp8 import _tensor_amax, _tensor_scale
        from .nn.fp8_linear import Fp8Linear

        if not isinstance(module, Fp8Linear) or module.recipe.name not in FSDP_FP8_RECIPES:
            raise ValueError(f"lowbit: an Fp8ShardedWeight is all-gathered for an Fp8Linear of a recipe in "
                             f"{FSDP_FP8_RECIPES}, got {type(module).__name__}"
                             + (f" of recipe {module.recipe.name!r}" if isinstance(module, Fp8Linear) else ""))
        recipe = module.recipe
        shard = self._tensor
        amax = _tensor_amax(shard)
        if mesh.size() > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        ops = torch.ops.lowbit
        if recipe.name == "delayed":
            scale = ops.fp8_delayed_scale(module.fp8_state, 1, recipe.amax_compute, recipe.margin, recipe.pow2_scales,
                                          "e4m3")
        else:
            scale = _tensor_scale(amax, recipe.pow2_scales)
        codes = ops.fp8_cast(shard.contiguous(), "tensor", "e4m3", False, scale, recipe.pow2_scales)[0]
        codes = codes.view(torch.uint8)
        rows = -(-outer_size[0] // mesh.size())  # FSDP2's padded shard: ceil(N / world) rows
        if codes.shape[0] < rows:  # an uneven last shard: zero rows to the padded size
            codes = torch.cat([codes, codes.new_zeros(rows - codes.shape[0], codes.shape[1])])
        return (codes,), (scale, amax.reshape(()))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (codes,) = all_gather_outputs
        scale, amax = metadata
        if out is not None:  # the unsharded weight of an earlier step: its codes were gathered in place
            out._scale, out._amax = scale, amax
            return None
        return Fp8GatheredWeight(codes.view(torch.float8_e4m3fn), scale, param_dtype, amax), (codes,)


class Fp8GatheredWeight(torch.Tensor):
    """An unsharded weight all-gathered in FP8: E4M3 codes ``_data`` [N, K],
    the float32 scale ``_scale`` [] and W's amax ``_amax`` [], shaped and
    typed as the parameter (``dtype``). The FP8 forward op takes them
    directly (its dispatch below); any other op sees the dequantized
    values."""

    @staticmethod
    def __new__(cls, data: Tensor, scale: Tensor, dtype: torch.dtype, amax: Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=dtype,
            device=data.device, requires_grad=False)

    def __init__(self, data: Tensor, scale: Tensor, dtype: torch.dtype, amax: Tensor):
        self._data, self._scale, self._amax = data, scale, amax

    def __repr__(self):
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, scale={self._scale})"

    def dequantize(self) -> Tensor:
        return (self._data.float() * self._scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.lowbit.fp8_linear_forward.default:
            return _forward_with_gathered_weight(*args, **kwargs)
        first = args[0] if args else None
        if isinstance(first, cls) and func in (_aten.detach.default, _aten.alias.default, _aten.view.default,
                                               _aten.as_strided.default, _aten._unsafe_view.default):
            # FSDP2 makes the unsharded parameter as a view of the gathered
            # buffer, and nn.Parameter detaches it: the codes follow.
            return cls(func(first._data, *args[1:], **kwargs), first._scale, first.dtype, first._amax)
        unwrap = lambda t: t.dequantize() if isinstance(t, cls) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    def __tensor_flatten__(self):
        return ["_data", "_scale", "_amax"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Fp8GatheredWeight(inner["_data"], inner["_scale"], dtype, inner["_amax"])


def _forward_with_gathered_weight(x, weight, bias, amax_history, recipe, *args, **kwargs):
    """lowbit::fp8_linear_forward with W given by an Fp8GatheredWeight: its
    codes and scale as the op's w_fp8 / w_fp8_scale (the op then casts
    nothing for W, and makes W's transposed copy from the codes when
    save_w_t), delayed: its amax as w_amax (recorded in W's history row),
    and a stand-in of W's shape and dtype (no memory) for the op's shape
    checks."""
    op = torch.ops.lowbit.fp8_linear_forward.default
    bound = dict(zip((a.name for a in op._schema.arguments), (x, weight, bias, amax_history, recipe, *args)))
    bound.update(kwargs)
    if bound["recipe"] not in FSDP_FP8_RECIPES:
        raise ValueError(f"lowbit: a weight all-gathered in FP8 serves the recipes {FSDP_FP8_RECIPES}, got "
                         f"{bound['recipe']!r}")
    if bound.get("w_fp8") is not None:
        raise ValueError("lowbit: a weight all-gathered in FP8 is already W's FP8 form; no 'w_fp8' may be given")
    bound["weight"] = torch.zeros((), dtype=weight.dtype, device=weight._data.device).expand(weight.shape)
    bound["w_fp8"], bound["w_fp8_scale"] = weight._data, weight._scale
    if bound["recipe"] == "delayed":
        bound["w_amax"] = weight._amax
    return op(**bound)


def _plain(t):
    """``t`` (a state-dict value) with an Fp8ShardedWeight inside replaced by
    its plain data (a view of the same memory), so checkpoints hold plain
    tensors and load in place into the parameter."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) and isinstance(t._local_tensor, Fp8ShardedWeight):
        return DTensor.from_local(t._local_tensor._tensor, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t._tensor if isinstance(t, Fp8ShardedWeight) else t


def _plain_state_dict_weight(module, state_dict, prefix, local_metadata):
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = _plain(state_dict[key])


def enable_fsdp_fp8_all_gather(model: nn.Module) -> int:
    """Before ``fully_shard``: gives each :class:`lowbit.nn.Fp8Linear` of
    ``model`` under a recipe that allows it (tensorwise, delayed) an
    :class:`Fp8ShardedWeight` weight, so that FSDP2 all-gathers it in FP8.
    The parameter objects are replaced (build the optimizer afterwards, as
    with ``fully_shard``); ``state_dict`` gives their plain values, so
    checkpoints (``torch.distributed.checkpoint`` included) hold plain
    tensors. Returns the number of layers changed."""
    from .nn.fp8_linear import Fp8Linear

    changed = 0
    for mod in model.modules():
        if isinstance(mod, Fp8Linear) and mod.recipe.name in FSDP_FP8_RECIPES \
                and not isinstance(mod.weight.data, Fp8ShardedWeight):
            if mod.parallel is not None:
                raise ValueError("lowbit.enable_fsdp_fp8_all_gather: a tensor-parallel Fp8Linear (parallel=) "
                                 "with FSDP2's FP8 all-gather is not done yet")
            if mod.cache_weight:
                raise ValueError("lowbit.enable_fsdp_fp8_all_gather: an Fp8Linear with the weight cache "
                                 "(cache_weight=True) casts W itself; FSDP2's FP8 all-gather replaces that cast: "
                                 "build it with cache_weight=False")
            w = mod.weight
            mod.weight = nn.Parameter(Fp8ShardedWeight(w.data), requires_grad=w.requires_grad)
            mod.register_state_dict_post_hook(_plain_state_dict_weight)
            changed += 1
    return changed
