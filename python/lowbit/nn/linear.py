"""``Nvfp4Linear``: an inference Linear layer with an NVFP4 weight (W4A16).

Buffers (all in ``state_dict``): ``weight`` uint8 [N, Kp/2] and
``weight_scale`` uint8 [N, Kp/16] in the prepacked layout of
``lowbit.nvfp4_prepack``, ``weight_global`` float32 [] and, optionally,
``bias`` [N] (kept in the activation dtype it was created with). These
dtypes are part of the format: ``.to(dtype)`` / ``.half()`` keep them (a
model converted with ``.half()`` keeps its NVFP4 layers intact); the input
chooses the compute dtype.

``fp8_min_rows`` (an attribute, checked when set, not in ``state_dict``; 0 by default) turns
on the FP8 mode of ``lowbit.nvfp4_linear`` for inputs of at least that many
rows: faster at large M, with an extra error of about 4e-2 relative.

The layer is frozen (its state is buffers) but differentiable in its input
(:func:`lowbit.nvfp4_linear`): layers before it, and adapters beside it,
train through it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..linear import nvfp4_linear, nvfp4_prepack
from ..ops import nvfp4_quantize
from ._format_dtypes import KeepsDtypes


class Nvfp4Linear(KeepsDtypes):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.bfloat16,
        fp8_min_rows: int = 0,
    ) -> None:
        super().__init__()
        self.fp8_min_rows = fp8_min_rows
        if in_features % 16 or out_features % 16:
            raise ValueError(
                f"Nvfp4Linear: in_features and out_features must be multiples of 16, got {in_features}, {out_features}"
            )
        self.in_features = in_features
        self.out_features = out_features
        kp = (in_features + 127) // 128 * 128
        self.register_buffer("weight", torch.zeros(out_features, kp // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, kp // 16, dtype=torch.uint8, device=device))
        self.register_buffer("weight_global", torch.ones((), dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device))
        else:
            self.bias = None

    @property
    def fp8_min_rows(self) -> int:
        return self._fp8_min_rows

    @fp8_min_rows.setter
    def fp8_min_rows(self, value: int) -> None:
        # Checked when set, not at the next forward.
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"Nvfp4Linear: fp8_min_rows must be an int >= 0 (0: never the FP8 mode), got {value!r}")
        self._fp8_min_rows = value

    # ---- construction -----------------------------------------------------

    @classmethod
    def from_checkpoint(
        cls, weight: Tensor, weight_scale: Tensor, weight_global: Tensor, bias: Tensor | None = None
    ) -> "Nvfp4Linear":
        """From checkpoint-layout tensors: ``weight`` uint8 [N, K/2],
        ``weight_scale`` E4M3 [N, K/16], ``weight_global`` = amax / 2688."""
        n, k = weight.shape[0], weight.shape[1] * 2
        mod = cls(k, n, bias=bias is not None, device=weight.device,
                  bias_dtype=bias.dtype if bias is not None else torch.bfloat16)
        w, s = nvfp4_prepack(weight, weight_scale)
        mod.weight.copy_(w)
        mod.weight_scale.copy_(s)
        mod.weight_global.copy_(weight_global.reshape(()).float())
        if bias is not None:
            mod.bias.copy_(bias)
        return mod

    @classmethod
    def from_modelopt(
        cls, weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor, bias: Tensor | None = None
    ) -> "Nvfp4Linear":
        """NVIDIA ModelOpt tensors: ``weight``, ``weight_scale``, ``weight_scale_2`` (= amax / 2688)."""
        return cls.from_checkpoint(weight, weight_scale, weight_scale_2, bias)

    @classmethod
    def from_compressed_tensors(
        cls, weight_packed: Tensor, weight_scale: Tensor, weight_global_scale: Tensor, bias: Tensor | None = None
    ) -> "Nvfp4Linear":
        """compressed-tensors (``nvfp4-pack-quantized``): ``weight_global_scale`` is 2688 / amax, the reciprocal."""
        return cls.from_checkpoint(weight_packed, weight_scale, 1.0 / weight_global_scale.float(), bias)

    @staticmethod
    def computes_like(linear: nn.Linear) -> bool:
        """Whether ``linear`` computes ``x W^T + b``: an ``nn.Linear`` whose
        class keeps ``nn.Linear.forward`` (a subclass may reuse the weight for
        something else, e.g. transformers' block-diagonal
        ``DeepseekV4GroupedLinear``)."""
        return isinstance(linear, nn.Linear) and type(linear).forward is nn.Linear.forward

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Nvfp4Linear":
        """Quantizes ``linear.weight`` with the reference NVFP4 rule (lowbit.nvfp4_quantize)."""
        if not cls.computes_like(linear):
            raise TypeError(
                f"Nvfp4Linear.from_linear: argument 'linear' must be an nn.Linear computing x W^T + b, got "
                f"{type(linear).__name__}" + (", which overrides forward" if isinstance(linear, nn.Linear) else "")
            )
        with torch.no_grad():
            q = nvfp4_quantize(linear.weight.detach())
            bias = None if linear.bias is None else linear.bias.detach().to(
                linear.weight.dtype if linear.weight.dtype != torch.float32 else torch.bfloat16
            )
            return cls.from_checkpoint(q.packed, q.block_scale, q.global_scale, bias)

    # ---- forward ----------------------------------------------------------

    def forward(self, x: Tensor) -> Tensor:
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return nvfp4_linear(x, self.weight, self.weight_scale, self.weight_global, bias, self.fp8_min_rows)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"format=nvfp4 (W4A16, group 16, prepacked), device={self.weight.device}"
            + (f", fp8_min_rows={self.fp8_min_rows}" if self.fp8_min_rows else "")
        )


class Nvfp4GroupedLinear(KeepsDtypes):
    """A block-diagonal Linear with NVFP4 blocks: x [..., G, K] -> [..., G, N],
    group g multiplied by its own [N, K] block (one :class:`Nvfp4Linear`
    each, in ``groups``; its own global scale). It is transformers'
    ``DeepseekV4GroupedLinear`` (the V4 attention's ``o_a_proj``), whose
    weight [G * N, K] holds block g in rows g N .. g N + N - 1 and which
    ignores its bias; :meth:`from_hf` converts one without a bias."""

    def __init__(self, in_features: int, out_features: int, n_groups: int,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(n_groups, int) or n_groups < 1:
            raise ValueError(f"Nvfp4GroupedLinear: n_groups must be a positive int, got {n_groups!r}")
        self.in_features, self.out_features, self.n_groups = in_features, out_features, n_groups
        self.groups = nn.ModuleList(
            Nvfp4Linear(in_features, out_features, bias=False, device=device) for _ in range(n_groups)
        )

    @staticmethod
    def is_hf_grouped(module: nn.Module) -> bool:
        """Whether ``module`` is a transformers ``DeepseekV4GroupedLinear``."""
        return type(module).__name__ == "DeepseekV4GroupedLinear"

    @staticmethod
    def hf_grouped_supported(module: nn.Module) -> bool:
        """Whether :meth:`from_hf` converts ``module``: no bias (transformers
        ignores it), block sizes multiples of 16."""
        n = module.out_features // module.n_groups
        return module.bias is None and n * module.n_groups == module.out_features and n % 16 == 0 \
            and module.in_features % 16 == 0

    @classmethod
    def from_hf(cls, module: nn.Module) -> "Nvfp4GroupedLinear":
        """Quantizes a transformers ``DeepseekV4GroupedLinear``, each block
        with the reference NVFP4 rule."""
        if not cls.is_hf_grouped(module) or not cls.hf_grouped_supported(module):
            raise TypeError(
                "Nvfp4GroupedLinear.from_hf: argument 'module' must be a DeepseekV4GroupedLinear without bias and "
                f"with blocks whose sizes are multiples of 16, got {type(module).__name__}"
            )
        n = module.out_features // module.n_groups
        mod = cls(module.in_features, n, module.n_groups, device=module.weight.device)
        with torch.no_grad():
            for g, layer in enumerate(mod.groups):
                q = nvfp4_quantize(module.weight.detach()[g * n:(g + 1) * n])
                layer.load_state_dict(Nvfp4Linear.from_checkpoint(q.packed, q.block_scale, q.global_scale).state_dict())
        return mod

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 2 or x.shape[-2] != self.n_groups or x.shape[-1] != self.in_features:
            raise ValueError(
                f"Nvfp4GroupedLinear: argument 'x' must have shape [..., {self.n_groups}, {self.in_features}], "
                f"got {list(x.shape)}"
            )
        return torch.stack([layer(x[..., g, :]) for g, layer in enumerate(self.groups)], dim=-2)

    def extra_repr(self) -> str:
        return f"n_groups={self.n_groups}, in_features={self.in_features}, out_features={self.out_features} per group"
