"""``Fp8Linear``: a training Linear layer whose three GEMMs (forward, input
gradient, weight gradient) run in FP8, through :func:`lowbit.fp8.fp8_linear`.

A drop-in for ``nn.Linear`` (a subclass): the same high-precision
parameters ``weight`` [N, K] and ``bias`` [N], the same initialisation and
the same ``state_dict`` keys, so checkpoints move freely between the two.
The FP8 copies of x, W and the output gradient exist only inside the op.

Module state beyond the parameters: ``fp8_state``, the amax history of the
delayed recipe (empty for the stateless recipes), a non-persistent float32
buffer. Non-persistent so that a state dict of either layer loads strictly
into the other; the price is that a delayed-scaling run resumed from a
checkpoint starts its history over, as a fresh layer does. ``.to(dtype)``
casts the parameters and leaves the history in float32.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn


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


class Fp8Linear(nn.Linear):
    """``y = x W^T + b`` with the GEMMs in FP8 under ``recipe`` (a name or a
    ``lowbit.fp8.Fp8Recipe``; see docs/fp8.md for the arithmetic of each).
    ``y`` has x's dtype; gradients flow to x, ``weight`` and ``bias``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe="tensorwise",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        recipe = resolve_recipe(recipe)  # before any allocation: a bad recipe costs nothing
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe
        self._register_state(self.weight.device)

    def _register_state(self, device) -> None:
        state = _fp8_api().fp8_state(self.recipe, device)
        self.register_buffer("fp8_state", state, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe="tensorwise") -> "Fp8Linear":
        """An ``Fp8Linear`` sharing ``linear``'s parameters (the same
        ``Parameter`` objects: an optimizer built over ``linear`` trains it,
        and nothing is copied). ``linear`` must compute ``x W^T + b``: an
        ``nn.Linear`` whose class keeps ``nn.Linear.forward``."""
        if not (isinstance(linear, nn.Linear) and type(linear).forward is nn.Linear.forward):
            what = type(linear).__name__
            raise TypeError(f"Fp8Linear.from_linear: argument 'linear' must be an nn.Linear computing x W^T + b, "
                            f"got {what}" + (", which overrides forward" if isinstance(linear, nn.Linear) else ""))
        recipe = resolve_recipe(recipe, "Fp8Linear.from_linear")
        # Built on the meta device (no allocation, no initialisation), then
        # given the originals' parameters.
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe=recipe,
                  device="meta", dtype=linear.weight.dtype)
        mod.weight = linear.weight
        mod.bias = linear.bias
        mod._register_state(linear.weight.device)
        mod.train(linear.training)
        return mod

    def forward(self, x: Tensor) -> Tensor:
        return _fp8_api().fp8_linear(x, self.weight, self.bias, recipe=self.recipe, state=self.fp8_state)

    def _apply(self, fn, recurse=True):
        # The amax history stays float32 whatever dtype the parameters take
        # (kept from before the cast, so no rounding is undone from its result).
        before = self.fp8_state.detach()
        super()._apply(fn, recurse)
        if self.fp8_state.dtype != before.dtype:
            self._buffers["fp8_state"] = before.to(device=self.fp8_state.device)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={recipe_repr(self.recipe)}")
