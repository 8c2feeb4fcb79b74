"""A model's modules on several devices (pipeline style, as transformers'
``device_map``): which device each module's tensors go to, and forward hooks
that move each placed module's inputs to its device.

A device map is {module name: device}; a tensor goes to the device of the
longest module name that prefixes it ("" is the default). ``"auto"`` puts
the decoder layers (the classes in the model's ``_no_split_modules``) on
the visible CUDA devices in order, balanced by their bytes, what comes
before the layers (embeddings) on the first device and what comes after
(final norm, output head) on the last.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn


def _err(message: str) -> str:
    return f"lowbit.load_checkpoint_: device_map {message}"


def placer(device_map: Mapping[str, torch.device], default: torch.device) -> Callable[[str], torch.device]:
    """name -> the device of the longest entry of ``device_map`` that is the
    name or one of its parent modules (``default`` when none is)."""
    entries = sorted(device_map.items(), key=lambda item: -len(item[0]))

    def place(name: str) -> torch.device:
        for prefix, device in entries:
            if prefix == "" or name == prefix or name.startswith(prefix + "."):
                return device
        return default

    return place


def checked_device_map(model: nn.Module, device_map: Mapping[str, object]) -> dict[str, torch.device]:
    """``device_map`` with its devices as torch.device; raises for names
    the model does not have."""
    if not isinstance(device_map, Mapping):
        raise TypeError(_err(f"must be None, 'auto' or a dict {{module name: device}}, got {type(device_map).__name__}"))
    out = {}
    for name, device in device_map.items():
        if not isinstance(name, str):
            raise TypeError(_err(f"keys must be module names (str), got {type(name).__name__} {name!r}"))
        if name:
            try:
                model.get_submodule(name)
            except AttributeError:
                raise ValueError(_err(f"names {name!r}, which is not a module of the model")) from None
        try:
            out[name] = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(_err(f"maps {name!r} to {device!r}, which is not a torch device")) from None
    return out


def auto_device_map(model: nn.Module, nbytes: Mapping[str, int], devices: list[torch.device]) -> dict[str, torch.device]:
    """The decoder layers of ``model`` over ``devices`` in order, each
    device taking about an equal share of the bytes (``nbytes``: tensor
    name -> bytes, e.g. a checkpoint's), what comes before the first layer
    on the first device and what comes after the last on the last."""
    unit_classes = set(getattr(model, "_no_split_modules", None) or ())
    units = [name for name, mod in model.named_modules() if type(mod).__name__ in unit_classes]
    if not units:
        raise ValueError(_err(f"'auto' needs the model's decoder layer classes (_no_split_modules), "
                              f"which {type(model).__name__} does not name"))
    ancestors = {""}
    for unit in units:
        parts = unit.split(".")
        ancestors.update(".".join(parts[:i]) for i in range(1, len(parts)))
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    first_unit, last_unit = order[units[0]], order[units[-1]]
    # Modules beside the layers (children of the layers' ancestors), by side.
    siblings = [name for name, _ in model.named_modules()
                if name and name not in ancestors and name.rpartition(".")[0] in ancestors and name not in units]
    before = [s for s in siblings if order[s] < first_unit]
    after = [s for s in siblings if order[s] > last_unit]

    # Bytes per placed module: each tensor to its innermost enclosing one.
    size = dict.fromkeys([*units, *before], 0)
    for key, b in nbytes.items():
        parts = key.split(".")
        owner = next((p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)) if p in size), None)
        if owner is not None:
            size[owner] += b
    sizes = [size[u] for u in units]
    total = sum(nbytes.values())
    share = total / len(devices)
    placed: dict[str, torch.device] = {"": devices[0]}
    placed.update({name: devices[0] for name in before})
    placed.update({name: devices[-1] for name in after})
    acc, d = sum(size[b] for b in before), 0
    for unit, s in zip(units, sizes):
        # The device whose share the middle of this layer falls in, never going back.
        d = max(d, min(len(devices) - 1, int((acc + s / 2) // share)))
        placed[unit] = devices[d]
        acc += s
    return placed


def _to(value: object, device: torch.device) -> object:
    if isinstance(value, torch.Tensor):
        return value.to(device) if value.device != device else value
    if isinstance(value, (tuple, list)):
        moved = [_to(v, device) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)  # namedtuples by field
    if isinstance(value, dict) and type(value) is dict:
        return {k: _to(v, device) for k, v in value.items()}
    return value


def dispatch(model: nn.Module, device_map: Mapping[str, torch.device]) -> None:
    """Forward hooks: the tensor inputs of each module of ``device_map``, and
    of the modules beside them (the other children of their parents, e.g.
    a final norm left to the default device), move to its device; the
    model's tensor outputs (the logits, not the cache) move to the device
    of its first tensor input, as they would be on one device."""
    entries = [name for name in device_map if name]
    ancestors = {".".join(e.split(".")[:i]) for e in entries for i in range(len(e.split(".")))}
    parents = {e.rpartition(".")[0] for e in entries}
    hooked = set(entries) | {name for name, _ in model.named_modules()
                             if name and name.rpartition(".")[0] in parents and name not in ancestors}
    place = placer(device_map, device_map.get("", next(iter(device_map.values()))))
    for name in sorted(hooked):
        device = place(name)
        model.get_submodule(name).register_forward_pre_hook(
            lambda mod, args, kwargs, device=device: (_to(args, device), _to(kwargs, device)), with_kwargs=True)

    def remember_input_device(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        mod._lowbit_input_device = first.device if first is not None else None

    def outputs_to_input_device(mod: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
        device = getattr(mod, "_lowbit_input_device", None)
        if device is None:
            return output
        if isinstance(output, dict):  # transformers' ModelOutput: update in place, keep the type
            for key, value in list(output.items()):
                if isinstance(value, torch.Tensor):
                    output[key] = _to(value, device)
            return output
        return _to(output, device)

    model.register_forward_pre_hook(remember_input_device, with_kwargs=True)
    model.register_forward_hook(outputs_to_input_device, with_kwargs=True)
