"""``Fp8Linear``: a training Linear layer whose three GEMMs (forward, input
gradient, weight gradient) run in FP8, through :func:`lowbit.fp8.fp8_linear`.

A drop-in for ``nn.Linear`` (a subclass): the same high-precision
parameters ``weight`` [N, K] and ``bias`` [N], the same initialisation and
the same ``state_dict`` keys, so checkpoints move freely between the two.
The FP8 copies of x, W and the output gradient exist only inside the op.

Module state beyond the parameters: ``fp8_state``, the amax history of the
delayed recipe (empty for the stateless recipes), a non-persistent float32
buffer; with ``cache_weight=True`` the weight cache ``fp8_weight``,
``fp8_weight_scale``, ``fp8_weight_t``, ``fp8_weight_t_scale`` (W's FP8 cast
and its transposed copy, non-persistent too). Non-persistent so that a state
dict of either layer loads strictly into the other; the price is that a
delayed-scaling run resumed from a checkpoint starts its history over, as a
fresh layer does. ``.to(dtype)`` casts the parameters and leaves the
history, the cache and its scales in their own dtypes.

Eager fallback: an input the FP8 ops do not model (a dtype other than
bfloat16 / float16 / float32, a tensor subclass, a device other than the CPU
or a Hopper GPU, a torch.func transform or forward-mode AD) runs as
``nn.Linear`` would, in high precision, outside torch.compile's graph (a
graph break, not a tracing error deep in the op), with one warning per
layer and reason that says why.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._autocast import autocast_input
from ..fp8_fsdp import Fp8GatheredWeight, Fp8ShardedWeight
from ..fp8_parallel import (FP8_GATHER_RECIPES, check_group_device, check_parallel, fp8_gather_linear, group_name,
                            parallel_input, parallel_output, shard_of)

_OP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CACHE_BUFFERS = ("fp8_weight", "fp8_weight_scale", "fp8_weight_t", "fp8_weight_t_scale")


def _fp8_api():
    """lowbit.fp8 (the FP8 training ops), imported on first use so that
    ``lowbit.nn`` imports in a build without it."""
    try:
        from .. import fp8
    except ImportError as e:
        raise ImportError(
            "lowbit.nn.Fp8Linear needs lowbit.fp8 (the FP8 training ops), which this installation lacks"
        ) from e
    return fp8


def resolve_recipe(recipe, who: str = "Fp8Linear"):
    """``recipe`` as an ``Fp8Recipe``: a name ("tensorwise", "delayed",
    "rowwise", "blockwise") gets that recipe's defaults."""
    fp8 = _fp8_api()
    if isinstance(recipe, fp8.Fp8Recipe):
        return recipe
    if isinstance(recipe, str):
        return fp8.Fp8Recipe(name=recipe)
    raise TypeError(f"{who}: argument 'recipe' must be a recipe name or a lowbit.fp8.Fp8Recipe, "
                    f"got {type(recipe).__name__}")


def recipe_repr(recipe) -> str:
    """The recipe's name and the fields that differ from their defaults:
    ``delayed(amax_history_len=32)``."""
    changed = [
        f"{f.name}={getattr(recipe, f.name)}"
        for f in dataclasses.fields(recipe)
        if f.name != "name" and f.default is not dataclasses.MISSING and getattr(recipe, f.name) != f.default
    ]
    return recipe.name + (f"({', '.join(changed)})" if changed else "")


# ---- eager fallback ------------------------------------------------------------
# Each kind of configuration the FP8 ops do not model has its own disabled
# function, so that under torch.compile(fullgraph=True) the error Dynamo
# raises at the graph break names the kind; the warning names the details.

_FALLBACK_KINDS = {
    "dtype": "an input dtype other than bfloat16, float16 or float32",
    "subclass": "a tensor subclass as input or parameter",
    "device": "a device other than the CPU or a compute-capability-9.0 GPU",
    "transform": "a torch.func transform or forward-mode AD",
}


def _make_fallback(kind: str):
    def fallback(layer: "Fp8Linear", x: Tensor, reason: str, bias: Tensor | None) -> Tensor:
        if reason not in layer._fallback_warned:
            layer._fallback_warned.add(reason)
            warnings.warn(f"lowbit.nn.Fp8Linear({layer.in_features} -> {layer.out_features}) runs eagerly in high "
                          f"precision, as nn.Linear: {reason}", RuntimeWarning, stacklevel=4)
        # As nn.Linear, in the promoted dtype, the result in x's dtype (the
        # layer's contract).
        dt = torch.promote_types(x.dtype, layer.weight.dtype)
        b = None if bias is None else bias.to(dt)
        return F.linear(x.to(dt), layer.weight.to(dt), b).to(x.dtype)

    fallback.__name__ = f"fp8_linear_eager_fallback_{kind}"
    return torch.compiler.disable(
        fallback, reason=f"lowbit.nn.Fp8Linear runs this layer eagerly: {_FALLBACK_KINDS[kind]} (not modelled by "
                         f"the FP8 ops)")


_FALLBACKS = {kind: _make_fallback(kind) for kind in _FALLBACK_KINDS}


def _capability_reason(index: int) -> str | None:
    # The ops' CUDA kernels are built for compute capability 9.0 only
    # (csrc/torch/cuda_checks.h).
    cap = torch.cuda.get_device_capability(index)
    if cap == (9, 0):
        return None
    return f"GPU cuda:{index} has compute capability {cap[0]}.{cap[1]}; the FP8 ops run on 9.0 (Hopper) and the CPU"


_CAPABILITY_REASONS: dict[int, str | None] = {}


# A plain dict rather than functools.lru_cache: Dynamo warns about tracing
# into an lru_cache wrapper even where assume_constant_result applies.
@torch._dynamo.assume_constant_result
def _gpu_unsupported(index: int) -> str | None:
    if index not in _CAPABILITY_REASONS:
        _CAPABILITY_REASONS[index] = _capability_reason(index)
    return _CAPABILITY_REASONS[index]


def _subclass(t) -> bool:
    # The FSDP2 FP8 all-gather's weights (lowbit.fp8_fsdp) are subclasses
    # the FP8 ops take.
    return t is not None and type(t) not in (torch.Tensor, nn.Parameter, Fp8ShardedWeight, Fp8GatheredWeight)


def fallback_reason(layer: "Fp8Linear", x: Tensor) -> tuple[str, str] | None:
    """(kind, reason) when ``layer(x)`` cannot run on the FP8 ops, else None.
    Decided from static properties only (types, dtypes, devices), which
    torch.compile guards on, so it never syncs with the device."""
    w, b = layer.weight, layer.bias
    if not x.dtype.is_floating_point:
        # nn.Linear refuses these too; a fallback would round its result
        # back into them.
        raise ValueError(f"Fp8Linear: argument 'x' must be a floating-point tensor, got dtype {x.dtype}")
    for name, t in (("x", x), ("weight", w), ("bias", b)):
        if _subclass(t):
            return "subclass", f"{name} is a {type(t).__name__}, a tensor subclass; the FP8 ops take plain tensors"
    for name, t in (("x", x), ("weight", w), ("bias", b)):
        if t is not None and t.dtype not in _OP_DTYPES:
            return "dtype", f"{name} has dtype {t.dtype}; the FP8 ops take bfloat16, float16 or float32"
    if x.device.type not in ("cpu", "cuda"):
        return "device", f"x is on {x.device}; the FP8 ops run on the CPU and on CUDA"
    if x.device.type == "cuda":
        why = _gpu_unsupported(x.device.index if x.device.index is not None else torch.cuda.current_device())
        if why is not None:
            return "device", why
    if not torch.compiler.is_compiling():
        # Eager only: under torch.compile these are traced by Dynamo itself.
        if torch._C._functorch.peek_interpreter_stack() is not None:
            return "transform", "called inside a torch.func transform (vmap, grad, jacrev, ...), which the FP8 "                                 "Linear's autograd.Function does not support"
        fwd = torch.autograd.forward_ad
        if fwd._current_level >= 0 and any(t is not None and fwd.unpack_dual(t).tangent is not None
                                           for t in (x, w, b)):
            return "transform", "forward-mode AD (a dual tensor), which the FP8 Linear does not implement"
    return None


class Fp8Linear(nn.Linear):
    """``y = x W^T + b`` with the GEMMs in FP8 under ``recipe`` (a name or a
    ``lowbit.fp8.Fp8Recipe``; see docs/fp8.md for the arithmetic of each).
    ``y`` has x's dtype; gradients flow to x, ``weight`` and ``bias``.

    ``cache_weight``: hold W's FP8 cast in buffers, refreshed on the first
    microbatch of each optimizer step and reused by the others
    (``is_first_microbatch``, a forward argument, or the attribute of the
    same name that :func:`lowbit.fp8_weight_cache` sets on every layer of a
    model). ``fp8_output``: return a :class:`lowbit.fp8.Fp8Activation` (FP8
    data and scales) for the next ``Fp8Linear`` instead of y; without grad
    only (docs/fp8-training.md). ``min_tokens``: calls with fewer tokens
    (rows of x) run ``F.linear`` in x's dtype instead, where FP8's casts
    would cost more than its GEMMs save (``convert_to_fp8_training``'s
    default policy sets the measured crossover; 0, the default here: every
    call in FP8; ignored with ``fp8_output``). Under ``torch.compile`` the
    choice is a guard on the token count, so a dynamic-shape graph is
    compiled at most once more when the count crosses it.

    Tensor parallelism: ``parallel="column"`` or ``"row"`` with
    ``process_group`` (and ``sequence_parallel``) splits the layer over the
    group's ranks (layouts and collectives: :mod:`lowbit.fp8_parallel`).
    ``in_features`` / ``out_features`` given here are the whole layer's;
    the attributes of the same name, like ``weight``, are this rank's
    shard. :meth:`from_linear` takes a whole ``nn.Linear`` and keeps this
    rank's part (a copy, not the original parameters). ``fp8_all_gather``
    (default on): a column-parallel, sequence-parallel layer under the
    tensorwise or delayed recipe all-gathers x in FP8, half the bytes, with
    results (and history) bitwise those of the BF16 all-gather (rowwise and
    blockwise gather BF16)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe="tensorwise",
        cache_weight: bool = False,
        fp8_output: bool = False,
        min_tokens: int = 0,
        parallel: str | None = None,
        process_group=None,
        sequence_parallel: bool = False,
        fp8_all_gather: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        recipe = resolve_recipe(recipe)  # before any allocation: a bad recipe costs nothing
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise ValueError(f"Fp8Linear: argument 'min_tokens' must be an int >= 0, got {min_tokens!r}")
        tp = check_parallel(parallel, process_group, bool(sequence_parallel), in_features, out_features)
        if parallel is not None and fp8_output:
            raise ValueError("Fp8Linear: fp8_output=True is not available with parallel= (not done yet)")
        if parallel == "column":
            out_features //= tp
        elif parallel == "row":
            in_features //= tp
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.parallel = parallel
        self.process_group = process_group
        self.sequence_parallel = bool(sequence_parallel)
        self.fp8_all_gather = bool(fp8_all_gather)
        self.tp_size = tp
        self.recipe = recipe
        self.cache_weight = bool(cache_weight)
        self.fp8_output = bool(fp8_output)
        self.min_tokens = min_tokens
        # None: cast W on every call; True: refresh the cache; False: reuse it.
        self.is_first_microbatch: bool | None = None
        self._fallback_warned: set[str] = set()
        self._group_checked_for: torch.device | None = None  # the x device check_group_device passed
        self._register_state(self.weight.device)

    def _register_state(self, device) -> None:
        fp8 = _fp8_api()
        self.register_buffer("fp8_state", fp8.fp8_state(self.recipe, device), persistent=False)
        if self.cache_weight:
            cache = fp8.fp8_weight_cache(self.weight, self.recipe, device)
            for name, t in zip(_CACHE_BUFFERS, cache):
                self.register_buffer(name, t, persistent=False)

    def weight_cache(self):
        """The cache buffers as a :class:`lowbit.fp8.Fp8WeightCache` (None
        without ``cache_weight``)."""
        if not self.cache_weight:
            return None
        return _fp8_api().Fp8WeightCache(*(getattr(self, n) for n in _CACHE_BUFFERS))

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe="tensorwise", *, cache_weight: bool = False,
                    fp8_output: bool = False, min_tokens: int = 0, parallel: str | None = None,
                    process_group=None, sequence_parallel: bool = False,
                    fp8_all_gather: bool = True) -> "Fp8Linear":
        """An ``Fp8Linear`` sharing ``linear``'s parameters (the same
        ``Parameter`` objects: an optimizer built over ``linear`` trains it,
        and nothing is copied). ``linear`` must compute ``x W^T + b``: an
        ``nn.Linear`` whose class keeps ``nn.Linear.forward``."""
        if not (isinstance(linear, nn.Linear) and type(linear).forward is nn.Linear.forward):
            what = type(linear).__name__
            raise TypeError(f"Fp8Linear.from_linear: argument 'linear' must be an nn.Linear computing x W^T + b, "
                            f"got {what}" + (", which overrides forward" if isinstance(linear, nn.Linear) else ""))
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in linear.parameters(recurse=False)):
            raise ValueError(f"Fp8Linear.from_linear: argument 'linear' ({type(linear).__name__}) has uninitialized "
                             f"parameters (a lazy module): run a forward through it first")
        recipe = resolve_recipe(recipe, "Fp8Linear.from_linear")
        # Built on the meta device (no allocation, no initialisation), then
        # given the originals' parameters.
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe=recipe,
                  cache_weight=cache_weight, fp8_output=fp8_output, min_tokens=min_tokens, parallel=parallel,
                  process_group=process_group, sequence_parallel=sequence_parallel,
                  fp8_all_gather=fp8_all_gather, device="meta",
                  dtype=linear.weight.dtype)
        if parallel is None:
            mod.weight = linear.weight
            mod.bias = linear.bias
        else:  # this rank's shard, a parameter of its own
            with torch.no_grad():
                mod.weight = nn.Parameter(shard_of(linear.weight, parallel, process_group).clone(),
                                          linear.weight.requires_grad)
                if linear.bias is not None:
                    mod.bias = nn.Parameter(shard_of(linear.bias, parallel, process_group, dim_of_bias=True).clone(),
                                            linear.bias.requires_grad)
        mod._register_state(linear.weight.device)
        mod.train(linear.training)
        return mod

    def forward(self, x, is_first_microbatch: bool | None = None):
        """``x`` [..., in_features] or an Fp8Activation. ``is_first_microbatch``
        (default: the attribute): None casts W here; True casts W into the
        cache (once per optimizer step) and uses it; False uses the cache as
        the last True call left it (the weight must not have changed since).
        Under ``torch.autocast`` x is cast to the autocast dtype first, as
        nn.Linear's input is."""
        x = autocast_input(x)
        if self.parallel is None:
            return self._local(x, self.bias, is_first_microbatch)
        if isinstance(x, _fp8_api().Fp8Activation):
            raise ValueError("Fp8Linear: an FP8 input (Fp8Activation) is not available with parallel= (not done yet)")
        if not torch.compiler.is_compiling() and x.device != self._group_checked_for:
            # Eagerly, once per device (a compiled graph was traced from an
            # eager-checked call or fails inside its collective).
            check_group_device(self.process_group, x.device)
            self._group_checked_for = x.device
        group = group_name(self.process_group)
        if self._gathers_fp8(x, is_first_microbatch):
            return fp8_gather_linear(x, self.weight, self.bias, self.recipe, self.fp8_state, group, self.tp_size)
        x = parallel_input(x, self.parallel, group, self.sequence_parallel)
        column = self.parallel == "column"
        y = self._local(x, self.bias if column else None, is_first_microbatch)
        return parallel_output(y, None if column else self.bias, self.parallel, group, self.sequence_parallel)

    def _gathers_fp8(self, x, is_first_microbatch) -> bool:
        """Whether this call all-gathers x in FP8 (see fp8_all_gather): the
        tensorwise or delayed column-parallel, sequence-parallel layer
        casting W on this call, in FP8 (no fallback, enough tokens)."""
        if not (self.fp8_all_gather and self.parallel == "column" and self.sequence_parallel
                and self.recipe.name in FP8_GATHER_RECIPES):
            return False
        if is_first_microbatch is None:
            is_first_microbatch = self.is_first_microbatch
        if is_first_microbatch is not None or fallback_reason(self, x) is not None:
            return False
        return not self.min_tokens or x.shape[:-1].numel() * self.tp_size >= self.min_tokens

    def _local(self, x, bias, is_first_microbatch):
        """This rank's y = x W^T (+ bias): the whole layer without ``parallel``."""
        fp8 = _fp8_api()
        if is_first_microbatch is None:
            is_first_microbatch = self.is_first_microbatch
        if not isinstance(x, fp8.Fp8Activation):
            why = fallback_reason(self, x)
            if why is not None:
                return _FALLBACKS[why[0]](self, x, why[1], bias)
        cache = None
        if is_first_microbatch is not None:
            if not self.cache_weight:
                raise ValueError(f"Fp8Linear: is_first_microbatch={is_first_microbatch} needs the weight cache; "
                                 f"build the layer with cache_weight=True")
            cache = self.weight_cache()
            if is_first_microbatch:  # also before a high-precision call: later microbatches may use it
                fp8.fp8_cache_weight(self.weight, cache, recipe=self.recipe, state=self.fp8_state)
        if self.min_tokens and not self.fp8_output and not isinstance(x, fp8.Fp8Activation) \
                and x.shape[:-1].numel() < self.min_tokens:
            return F.linear(x, self.weight, bias)
        return fp8.fp8_linear(x, self.weight, bias, recipe=self.recipe, state=self.fp8_state,
                              weight_cache=cache, fp8_output=self.fp8_output)

    def _apply(self, fn, recurse=True):
        # The amax history, the FP8 cache and its scales keep their dtypes
        # whatever dtype the parameters take (.to(dtype) would otherwise cast
        # every floating buffer, FP8 included); kept from before the cast, so
        # no rounding is undone from its result.
        names = [n for n in ("fp8_state",) + _CACHE_BUFFERS if self._buffers.get(n) is not None]
        before = {n: self._buffers[n].detach() for n in names}
        super()._apply(fn, recurse)
        for n in names:
            if self._buffers[n].dtype != before[n].dtype:
                self._buffers[n] = before[n].to(device=self._buffers[n].device)
        return self

    def extra_repr(self) -> str:
        extra = "".join(f", {k}=True" for k in ("cache_weight", "fp8_output") if getattr(self, k))
        if self.min_tokens:
            extra += f", min_tokens={self.min_tokens}"
        if self.parallel is not None:
            extra += f", parallel={self.parallel}, tp={self.tp_size}" + (", sequence_parallel=True"
                                                                         if self.sequence_parallel else "")
            if not self.fp8_all_gather:
                extra += ", fp8_all_gather=False"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={recipe_repr(self.recipe)}{extra}")
