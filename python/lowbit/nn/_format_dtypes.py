"""A module whose stored dtypes are part of its format."""

from __future__ import annotations

import itertools

from torch import nn


class KeepsDtypes(nn.Module):
    """``.to(dtype)``, ``.half()``, ``.float()`` and friends move nothing
    between dtypes (uint8 codes, float32 global scales and what else the
    module stores keep theirs; the activations choose the compute dtype);
    ``.to(device)`` applies. Converting a whole model with ``.half()`` thus
    leaves its NVFP4 layers intact."""

    def _apply(self, fn, recurse=True):
        # The originals are kept (detached views) so that a lossy cast is
        # never undone from its result.
        before = {name: t.detach() for name, t in
                  itertools.chain(self.named_parameters(), self.named_buffers()) if t is not None}
        super()._apply(fn, recurse)
        for name, t in list(itertools.chain(self.named_parameters(), self.named_buffers())):
            old = before.get(name)
            if old is None or t.dtype == old.dtype:
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = self.get_submodule(owner_name) if owner_name else self
            restored = old.to(device=t.device)
            if leaf in owner._parameters:
                owner._parameters[leaf] = nn.Parameter(restored, requires_grad=t.requires_grad)
            else:
                owner._buffers[leaf] = restored
        return self
