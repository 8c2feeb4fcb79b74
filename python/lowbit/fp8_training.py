"""``convert_to_fp8_training``: a model's ``nn.Linear`` layers swapped in
place for :class:`lowbit.nn.Fp8Linear` (sharing their parameters), and the
shape policy that decides which layers FP8 can speed up.

The shape policy (``fp8_wins``). An FP8 layer pays for casting x, W and the
output gradient to FP8 (memory-bound passes over BF16 data) and wins only
when its three GEMMs are long enough for the faster FP8 tensor cores to
repay that. The casts cost O(M K + N K + M N) bytes, the GEMMs O(M N K)
FLOPs, so the win grows with the smallest of M, N and K. The rule:

- K and N, and M when the caller gives it, multiples of the recipe's
  alignment: 16 (cuBLASLt's FP8 GEMMs), 128 for blockwise (its block-scaled
  GEMMs). Each of the three is the reduction dimension of one GEMM; other
  shapes run the op's fallback, a dequantize and an FP32 matmul
  (docs/fp8.md, "What runs where"), which cannot win;
- min(K, N) >= FP8_MIN_FEATURES, checked when converting;
- M >= FP8_MIN_TOKENS[recipe], checked on every call: a converted layer
  runs calls with fewer tokens as a plain BF16 ``F.linear``
  (``Fp8Linear(min_tokens=...)``), and a ``tokens_hint`` below it keeps the
  layer unconverted.

The thresholds come from ``python -m lowbit.bench fp8_train`` on an H100
(docs/fp8-training.md quotes the table): on (2048, 4096, 4096) no recipe
reaches BF16 (tensorwise 0.97x, delayed 0.95x, rowwise 0.80x, blockwise
0.83x), while tensorwise and delayed win from 4096 tokens on the bench's
other shapes; rowwise and blockwise are held to 8192 tokens. 4096 features
is the smallest the bench measured a win on, so smaller layers stay in
BF16.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ._progress import progress_bar

# Measured crossovers (module docstring).
FP8_MIN_FEATURES = 4096
FP8_MIN_TOKENS = {"tensorwise": 4096, "delayed": 4096, "rowwise": 8192, "blockwise": 8192}
# The sizes the op's tensor-core GEMMs take (module docstring), by recipe.
FP8_ALIGNMENT = 16
BLOCKWISE_ALIGNMENT = 128

POLICIES = ("auto", "all")

_log = logging.getLogger("lowbit.fp8_training")


def _recipe_name(recipe) -> str:
    return recipe if isinstance(recipe, str) else recipe.name


def fp8_skip_reason(in_features: int, out_features: int, tokens_hint: int | None = None,
                    recipe="tensorwise") -> str | None:
    """Why the shape policy keeps a layer of this shape in high precision
    under ``recipe`` (a name or an Fp8Recipe), or None when FP8 is expected
    to win (see the module docstring)."""
    align = BLOCKWISE_ALIGNMENT if _recipe_name(recipe) == "blockwise" else FP8_ALIGNMENT
    if in_features % align or out_features % align:
        return f"features {in_features} -> {out_features} not multiples of {align}"
    if tokens_hint is not None and tokens_hint % align:
        return f"tokens_hint {tokens_hint} not a multiple of {align}"
    if min(in_features, out_features) < FP8_MIN_FEATURES:
        return f"min(in, out) = {min(in_features, out_features)} < {FP8_MIN_FEATURES}"
    min_tokens = FP8_MIN_TOKENS[_recipe_name(recipe)]
    if tokens_hint is not None and tokens_hint < min_tokens:
        return f"tokens_hint {tokens_hint} < {min_tokens}"
    return None


def fp8_wins(in_features: int, out_features: int, tokens_hint: int | None = None, recipe="tensorwise") -> bool:
    """Whether an FP8 Linear of this shape under ``recipe`` is expected to
    be faster than BF16 for a training step of ``tokens_hint`` tokens
    (unknown: None), forward and backward together (the measured
    thresholds of the module docstring)."""
    return fp8_skip_reason(in_features, out_features, tokens_hint, recipe) is None


@dataclass(frozen=True)
class Fp8LayerChoice:
    """What :func:`fp8_training_plan` decided for one ``nn.Linear``: its
    names (several when one module is registered under several), its
    shape, and ``reason`` why it stays as it is (None: converted)."""

    names: tuple[str, ...]
    in_features: int
    out_features: int
    reason: str | None

    @property
    def converted(self) -> bool:
        return self.reason is None


def _computes_linear(mod: nn.Module) -> bool:
    # Subclasses with a forward of their own (Fp8Linear among them) compute
    # something else, or are converted already.
    return isinstance(mod, nn.Linear) and type(mod).forward is nn.Linear.forward


def _is_lazy(mod: nn.Module) -> bool:
    # nn.LazyLinear before its first forward: in_features 0, no weight yet.
    return any(isinstance(p, nn.parameter.UninitializedParameter) for p in mod.parameters(recurse=False))


def _check_policy(policy: str, who: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"{who}: policy must be one of {POLICIES}, got {policy!r}")


def fp8_training_plan(
    model: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    policy: str = "auto",
    tokens_hint: int | None = None,
    recipe="tensorwise",
) -> list[Fp8LayerChoice]:
    """What :func:`convert_to_fp8_training` would do to ``model`` under
    ``recipe`` (a name or an Fp8Recipe), changing nothing: one entry per
    ``nn.Linear`` computing ``x W^T + b`` (other subclasses of ``nn.Linear``
    are not listed), in module order."""
    _check_policy(policy, "fp8_training_plan")
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_to_fp8_training: argument 'model' must be an nn.Module, got {type(model).__name__}")
    names_of: dict[int, list[str]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        if name:  # not the root: it cannot be replaced in place
            names_of.setdefault(id(mod), []).append(name)
    plan = []
    for name, mod in model.named_modules():
        if not name or not _computes_linear(mod):
            continue
        names = tuple(names_of[id(mod)])
        reason = "a lazy layer whose shape is not known yet (run a forward first)" if _is_lazy(mod) else None
        if reason is None and filter_fn is not None:
            chosen = [bool(filter_fn(mod, n)) for n in names]
            if any(chosen) and not all(chosen):
                yes, no = names[chosen.index(True)], names[chosen.index(False)]
                raise ValueError(
                    f"convert_to_fp8_training: filter_fn accepts the module named {yes!r} but not its other name "
                    f"{no!r}; it is one module, so it is replaced everywhere or nowhere")
            if not chosen[0]:
                reason = "filter_fn"
        if reason is None:
            if policy == "auto":
                reason = fp8_skip_reason(mod.in_features, mod.out_features, tokens_hint, recipe)
        plan.append(Fp8LayerChoice(names, mod.in_features, mod.out_features, reason))
    return plan


def format_fp8_plan(plan: list[Fp8LayerChoice]) -> str:
    """A readable summary of a plan: counts, then one line per layer."""
    done = sum(c.converted for c in plan)
    lines = [f"lowbit.convert_to_fp8_training: {done} of {len(plan)} Linear layers to FP8, "
             f"{len(plan) - done} kept in high precision"]
    for c in plan:
        what = "fp8 " if c.converted else "kept"
        lines.append(f"  {what}  {c.names[0]}  ({c.in_features} -> {c.out_features})"
                     + ("" if c.converted else f": {c.reason}"))
    return "\n".join(lines)


def convert_to_fp8_training(
    model: nn.Module,
    recipe="tensorwise",
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    policy: str = "auto",
    progress: bool = True,
    tokens_hint: int | None = None,
    cache_weight: bool = False,
    fsdp_fp8_all_gather: bool = False,
) -> nn.Module:
    """Replaces, in place, each ``nn.Linear`` of ``model`` (those computing
    ``x W^T + b``: subclasses with a ``forward`` of their own are left
    alone) with an :class:`lowbit.nn.Fp8Linear` under ``recipe`` that
    shares its parameters, so an optimizer built before or after the
    conversion trains the same tensors.

    A layer is converted when ``filter_fn(module, qualified_name)`` is true
    (always, without a filter) and the ``policy`` allows it:
    ``"auto"`` converts only the shapes on which FP8 is expected to beat
    BF16 (:func:`fp8_wins`, with ``tokens_hint`` the tokens per step when
    known) and gives each converted layer ``min_tokens``, the recipe's
    measured crossover: calls with fewer tokens run in BF16; ``"all"``
    converts every layer and runs every call in FP8 (features not
    multiples of 16 run the op's slow fallback).

    A module registered under several names is converted once and the
    replacement put under every name; ``filter_fn`` must give one answer
    for all of them (ValueError otherwise, before anything is replaced).

    The summary (:func:`format_fp8_plan`: what was converted, what was
    kept and why) goes to the ``lowbit.fp8_training`` logger at INFO, and to
    stderr after the progress bar when ``progress`` is true;
    :func:`fp8_training_plan` gives it as data without converting.
    ``model`` itself is never replaced (``Fp8Linear.from_linear`` converts
    a single layer). ``cache_weight`` gives every converted layer the FP8
    weight cache (:func:`fp8_microbatch`). ``fsdp_fp8_all_gather``: the
    converted tensorwise and delayed layers' weights all-gathered in FP8 by FSDP2
    (:func:`lowbit.enable_fsdp_fp8_all_gather`; convert before
    ``fully_shard``). Returns ``model``."""
    from .nn.fp8_linear import Fp8Linear, resolve_recipe

    recipe = resolve_recipe(recipe, "convert_to_fp8_training")  # bad arguments leave the model as it was
    if fsdp_fp8_all_gather and cache_weight:
        raise ValueError("convert_to_fp8_training: fsdp_fp8_all_gather=True replaces the weight cache's cast of W "
                         "(FSDP2 gathers W's FP8 codes): give cache_weight=False")
    plan = fp8_training_plan(model, filter_fn, policy, tokens_hint, recipe)
    todo = [c for c in plan if c.converted]
    for i, choice in enumerate(todo):
        layer = Fp8Linear.from_linear(model.get_submodule(choice.names[0]), recipe=recipe, cache_weight=cache_weight,
                                      min_tokens=FP8_MIN_TOKENS[recipe.name] if policy == "auto" else 0)
        for name in choice.names:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        if progress:
            progress_bar("lowbit.convert_to_fp8_training", i + 1, len(todo), choice.names[0])
    if fsdp_fp8_all_gather:
        from .fp8_fsdp import enable_fsdp_fp8_all_gather

        enable_fsdp_fp8_all_gather(model)
    summary = format_fp8_plan(plan)
    _log.info("%s", summary)
    if progress:
        sys.stderr.write(summary + "\n")
        sys.stderr.flush()
    return model


@contextlib.contextmanager
def fp8_microbatch(model: nn.Module, is_first_microbatch: bool):
    """Within the block, every :class:`lowbit.nn.Fp8Linear` of ``model`` built
    with ``cache_weight=True`` casts its weight into its cache
    (``is_first_microbatch=True``: the first microbatch after an optimizer
    step) or reuses the cache (False: the other microbatches); afterwards
    the layers cast W on every call again. Under gradient accumulation::

        for i, batch in enumerate(microbatches):
            with lowbit.fp8_microbatch(model, is_first_microbatch=i == 0):
                loss_fn(model(batch)).backward()
        optimizer.step()

    The flag is a Python attribute of each layer: torch.compile guards on it
    and keeps two graphs (with and without the weight's cast), so switching
    costs no recompilation after the first step. ValueError when ``model``
    has no layer with the cache (nothing would be cached)."""
    from .nn.fp8_linear import Fp8Linear

    layers = [m for m in model.modules() if isinstance(m, Fp8Linear) and m.cache_weight]
    if not layers:
        raise ValueError("lowbit.fp8_microbatch: the model has no Fp8Linear with cache_weight=True "
                         "(build them with cache_weight=True, or convert_to_fp8_training(..., cache_weight=True))")
    before = [m.is_first_microbatch for m in layers]
    for m in layers:
        m.is_first_microbatch = bool(is_first_microbatch)
    try:
        yield model
    finally:
        for m, b in zip(layers, before):
            m.is_first_microbatch = b


def fp8_state_dict(model: nn.Module) -> dict:
    """The FP8 state of every :class:`lowbit.nn.Fp8Linear` in ``model`` that
    has one (the delayed recipe's amax histories), by the layer's qualified
    name plus ``".fp8_state"``: the buffers themselves, not copies.

    The layers keep these buffers out of ``state_dict()`` (their keys stay
    ``nn.Linear``'s); save them beside it. With
    ``torch.distributed.checkpoint``, which loads in place, one dict serves
    both ways::

        state = {"model": model.state_dict(), "fp8": lowbit.fp8_state_dict(model)}
        dcp.save(state, checkpoint_id=path)
        ...
        state = {"model": model.state_dict(), "fp8": lowbit.fp8_state_dict(model)}
        dcp.load(state, checkpoint_id=path)  # fills the histories in place
        model.load_state_dict(state["model"])

    (:func:`load_fp8_state_dict` takes a plain dict, e.g. from ``torch.load``.)"""
    from .nn.fp8_linear import Fp8Linear

    return {f"{name}.fp8_state" if name else "fp8_state": m.fp8_state for name, m in model.named_modules()
            if isinstance(m, Fp8Linear) and m.fp8_state.numel()}


def load_fp8_state_dict(model: nn.Module, state: dict) -> None:
    """Copies ``state`` (as :func:`fp8_state_dict` gives it) into ``model``'s
    FP8 state buffers. ValueError, before anything is copied, when the keys
    differ from the model's, a shape does not match or a value is not an
    amax (finite, >= 0: an inf or NaN would give the next steps' scales)."""
    mine = fp8_state_dict(model)
    missing, unexpected = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
    if missing or unexpected:
        raise ValueError(f"lowbit.load_fp8_state_dict: keys differ from the model's FP8 state: missing {missing}, "
                         f"unexpected {unexpected}")
    for key, buf in mine.items():
        if tuple(state[key].shape) != tuple(buf.shape):
            raise ValueError(f"lowbit.load_fp8_state_dict: {key!r} must have shape {list(buf.shape)} (the layer's "
                             f"amax history), got {list(state[key].shape)}")
        value = state[key]
        if not (value.dtype.is_floating_point and bool(torch.isfinite(value).all()) and bool((value >= 0).all())):
            raise ValueError(f"lowbit.load_fp8_state_dict: {key!r} must hold amaxes (finite floats >= 0), got "
                             f"{value.dtype} with min {value.float().min().item()} and max {value.float().max().item()}")
    with torch.no_grad():
        for key, buf in mine.items():
            buf.copy_(state[key])


def fp8_sync_amax(model: nn.Module, process_group=None) -> None:
    """Makes the delayed recipe's amax histories the same on every rank of
    ``process_group`` (default: all ranks) by an all-reduce (max) of all of
    them at once. Under data parallelism (FSDP2, DDP) each rank records the
    amaxes of its own batch, so the histories, and with them the next
    step's scales, drift apart; call this after each optimizer step (before
    the next forward) to keep one scale per tensor across the ranks, as
    TransformerEngine's amax reduction does, and before saving a checkpoint
    (a replicated buffer is saved from one rank). No-op without delayed
    layers."""
    import torch.distributed as dist

    state = list(fp8_state_dict(model).values())
    if not state:
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("lowbit.fp8_sync_amax: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group first); with one process there is nothing to sync")
    with torch.no_grad():
        flat = torch.cat([s.reshape(-1) for s in state])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=process_group)
        for s, part in zip(state, flat.split([s.numel() for s in state])):
            s.copy_(part.view_as(s))
