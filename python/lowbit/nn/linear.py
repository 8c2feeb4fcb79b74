"""``Nvfp4Linear``: an inference Linear layer with an NVFP4 weight (W4A16).

Buffers (all in ``state_dict``): ``weight`` uint8 [N, Kp/2] and
``weight_scale`` uint8 [N, (2 Kp - K)/16] in the prepacked layout of
``lowbit.nvfp4_prepack`` (Kp = K rounded up to 128; the shapes record K, so
a state dict of a layer with another K does not load), ``weight_global``
float32 [] and, optionally,
``bias`` [N] (kept in the activation dtype it was created with). These
dtypes are part of the format: ``.to(dtype)`` / ``.half()`` keep them (a
model converted with ``.half()`` keeps its NVFP4 layers intact); the input
chooses the compute dtype.

``compute`` (an attribute, checked when set, not in ``state_dict``) picks
the arithmetic: ``"w4a16"`` (the default: the NVFP4 weight decoded to x's
dtype, BF16/FP16 tensor cores), ``"fp8"`` (every call on the FP8 tensor
cores: W's E4M3 form times x rounded to E4M3 per row, an extra error of
about 4e-2 relative against the W4A16 result) or ``"auto"`` (the FP8 path
from ``AUTO_FP8_MIN_ROWS`` (128) rows of x, W4A16 below; the
choice is made inside the op, per call, without a host synchronization, so one compiled
graph or CUDA graph serves every M). With ``"auto"`` or ``"fp8"`` the
layer keeps W's E4M3 form beside the NVFP4 weight, made once when the
mode is set (construction, ``quantize_``, loading), never per call: the
buffers ``weight_fp8`` float8_e4m3fn [N, K] and ``weight_fp8_scale``
float32 [N], 1 byte a weight and 4 a row more. They are derived, so not in
``state_dict``; ``load_state_dict`` makes them again, ``.to()`` moves them.
``"w4a16"`` holds no FP8 copy. ``fp8_min_rows`` (deprecated) is
``compute="auto"`` with its own threshold (0: ``"w4a16"``).

The layer is frozen (its state is buffers) but differentiable in its input
(:func:`lowbit.nvfp4_linear`): layers before it, and adapters beside it,
train through it.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from .._autocast import autocast_input
from ..linear import nvfp4_grouped_linear, nvfp4_linear, nvfp4_prepack, nvfp4_to_fp8, nvfp4_unprepack
from ..format import nvfp4_quantize
from ._format_dtypes import KeepsDtypes

# The prepacked layout's padding scale byte (E4M3 1.0 re-encoded,
# csrc/lowbit/linear/nvfp4_linear_layout.h), which fills the scale bytes that record K.
_PADDING_SCALE_BYTE = 0x8A


COMPUTE_MODES = ("w4a16", "auto", "fp8")

# compute="auto": the FP8 path from AUTO_FP8_MIN_ROWS rows of x, W4A16
# below. On an H200, with the FP8 path's unit-scale GEMM for small outputs
# (docs/perf/log/linear.md, "Linear v38"), the FP8 path was as fast as
# W4A16 or faster at 128 rows on every bench shape (4096 x 1536: 11.6 us
# against 11.5; the others 1.1-1.9x), and slower at 64 on all but one.
AUTO_FP8_MIN_ROWS = 128


def resolve_compute(where: str, compute: str, fp8_min_rows: int | None) -> tuple[str, int]:
    """(compute mode, fp8_min_rows for the layer's _set_compute) from the
    knob and the deprecated ``fp8_min_rows`` (0: "w4a16", n: "auto" from n
    rows), or ValueError naming ``where`` and the argument."""
    if not isinstance(compute, str) or compute not in COMPUTE_MODES:
        raise ValueError(f"{where}: compute must be 'w4a16', 'auto' or 'fp8', got {compute!r}")
    if fp8_min_rows is None:
        return compute, {"w4a16": 0, "auto": AUTO_FP8_MIN_ROWS, "fp8": 1}[compute]
    warnings.warn(f"{where}: fp8_min_rows is deprecated; use compute='auto' (the FP8 path from "
                  f"{AUTO_FP8_MIN_ROWS} rows, on an FP8 weight made once) or compute='fp8'; fp8_min_rows=n is "
                  "compute='auto' from n rows", DeprecationWarning, stacklevel=3)
    if isinstance(fp8_min_rows, bool) or not isinstance(fp8_min_rows, int) or fp8_min_rows < 0:
        raise ValueError(f"{where}: fp8_min_rows must be an int >= 0 (0: never the FP8 mode), got {fp8_min_rows!r}")
    if compute != "w4a16":
        raise ValueError(f"{where}: pass compute or the deprecated fp8_min_rows, not both (got compute={compute!r}, "
                         f"fp8_min_rows={fp8_min_rows})")
    return ("w4a16", 0) if fp8_min_rows == 0 else ("auto", fp8_min_rows)


def _padded_k(k: int) -> int:
    return (k + 127) // 128 * 128


def prepacked_scale_cols(k: int) -> int:
    """Columns of the prepacked scale tensor of a layer with ``k`` input
    features: (2 Kp - K) / 16, Kp = K rounded up to 128."""
    return (2 * _padded_k(k) - k) // 16


def _check_checkpoint(source: str, names: tuple[str, str, str], weight, weight_scale, global_scale, bias) -> None:
    """Checkpoint-layout tensors: weight uint8 [N, K/2], block scales
    float8_e4m3fn (or uint8 codes) [N, K/16], one global scale, bias [N];
    N and K multiples of 16. Errors name the argument as ``source`` calls it."""
    w_name, s_name, g_name = names

    def arg(name: str) -> str:
        return f"Nvfp4Linear.{source}: argument '{name}'"

    for name, t in ((w_name, weight), (s_name, weight_scale), (g_name, global_scale)) + (
        (("bias", bias),) if bias is not None else ()
    ):
        if not isinstance(t, Tensor):
            raise TypeError(f"{arg(name)} must be a Tensor, got {type(t).__name__}")
    if weight.dtype != torch.uint8:
        raise TypeError(f"{arg(w_name)} must have dtype torch.uint8 (two E2M1 codes a byte), got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{arg(w_name)} must be 2-D [N, K/2], got shape {list(weight.shape)}")
    n, k = weight.shape[0], weight.shape[1] * 2
    if n % 16 or k % 16:
        raise ValueError(f"{arg(w_name)} must be [N, K/2] with N and K multiples of 16, got shape {list(weight.shape)}")
    if weight_scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"{arg(s_name)} must have dtype torch.float8_e4m3fn (or uint8 codes), got {weight_scale.dtype}")
    if list(weight_scale.shape) != [n, k // 16]:
        raise ValueError(f"{arg(s_name)} must have shape [{n}, {k // 16}], got {list(weight_scale.shape)}")
    if global_scale.numel() != 1 or global_scale.dim() > 1:
        raise ValueError(f"{arg(g_name)} must hold one value (shape [] or [1]), got shape {list(global_scale.shape)}")
    if not global_scale.is_floating_point():
        raise TypeError(f"{arg(g_name)} must be floating point, got {global_scale.dtype}")
    if bias is not None:
        if list(bias.shape) != [n]:
            raise ValueError(f"{arg('bias')} must have shape [{n}], got {list(bias.shape)}")
        if not bias.is_floating_point():
            raise TypeError(f"{arg('bias')} must be floating point, got {bias.dtype}")


def global_from_compressed_tensors(weight_global_scale: Tensor) -> Tensor:
    """compressed-tensors' ``weight_global_scale`` (2688 / amax) as the
    global scale lowbit and ModelOpt use (amax / 2688), float32."""
    return 1.0 / weight_global_scale.float()


class Nvfp4Linear(KeepsDtypes):
    # 2: ``weight_scale`` [N, (2 Kp - K)/16] records K. State dicts of
    # version 1 (or without a version, e.g. rebuilt from a safetensors file)
    # may hold the earlier [N, Kp/16]: converted on load (_load_from_state_dict).
    _version = 2

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.bfloat16,
        fp8_min_rows: int | None = None,
        compute: str = "w4a16",
    ) -> None:
        super().__init__()
        mode, rows = resolve_compute("Nvfp4Linear", compute, fp8_min_rows)
        if in_features % 16 or out_features % 16:
            raise ValueError(
                f"Nvfp4Linear: in_features and out_features must be multiples of 16, got {in_features}, {out_features}"
            )
        self.in_features = in_features
        self.out_features = out_features
        kp = (in_features + 127) // 128 * 128
        self.register_buffer("weight", torch.zeros(out_features, kp // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, prepacked_scale_cols(in_features),
                                                         dtype=torch.uint8, device=device))
        self.register_buffer("weight_global", torch.ones((), dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device))
        else:
            self.bias = None
        # W's E4M3 form for compute "auto" / "fp8" (None for "w4a16"): derived
        # from the buffers above, so not in state_dict.
        self.register_buffer("weight_fp8", None, persistent=False)
        self.register_buffer("weight_fp8_scale", None, persistent=False)
        self._set_compute(mode, rows)

    @property
    def compute(self) -> str:
        """"w4a16", "auto" or "fp8" (module docstring); setting it makes or
        drops the FP8 copy of the weight."""
        return self._compute

    @compute.setter
    def compute(self, value: str) -> None:
        self._set_compute(*resolve_compute("Nvfp4Linear", value, None))

    def _set_compute(self, mode: str, fp8_min_rows: int) -> None:
        # Checked when set, not at the next forward. fp8_min_rows: what the
        # op gets (0 for "w4a16", 1 for "fp8", the threshold for "auto").
        self._compute, self._fp8_rows = mode, fp8_min_rows
        self.refresh_fp8_weight()

    @property
    def fp8_min_rows(self) -> int:
        """Deprecated: the rows from which the FP8 path runs (0: never).
        Setting n is ``compute = "auto"`` from n rows (0: ``"w4a16"``)."""
        warnings.warn("Nvfp4Linear.fp8_min_rows is deprecated; read compute", DeprecationWarning, stacklevel=2)
        return self._fp8_rows

    @fp8_min_rows.setter
    def fp8_min_rows(self, value: int) -> None:
        self._set_compute(*resolve_compute("Nvfp4Linear", "w4a16", value))

    def refresh_fp8_weight(self) -> None:
        """Makes the FP8 copy (``weight_fp8``, ``weight_fp8_scale``) from the
        NVFP4 buffers again, or drops it for ``"w4a16"``. Done when the
        compute mode is set and by ``load_state_dict``; call it after
        writing the NVFP4 buffers any other way."""
        if self._compute == "w4a16":
            self.weight_fp8 = self.weight_fp8_scale = None
            return
        with torch.no_grad():
            self.weight_fp8, self.weight_fp8_scale = nvfp4_to_fp8(
                self.weight, self.weight_scale, self.weight_global, self.in_features)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        # The earlier prepacked scales [N, Kp/16] did not record K: this
        # layer's K appends the bytes that do (the rest is the same layout).
        # Such a state dict of a layer with another K but the same Kp cannot
        # be told apart and loads; state dicts of version 2 are taken as they
        # are, so a layer of another K fails with PyTorch's size mismatch.
        key = prefix + "weight_scale"
        scale = state_dict.get(key)
        version = local_metadata.get("version")
        n, k = self.out_features, self.in_features
        kp = _padded_k(k)
        if (version is None or version < 2) and isinstance(scale, Tensor) and kp != k \
                and scale.dtype == torch.uint8 and tuple(scale.shape) == (n, kp // 16):
            tail = torch.full((n * (kp - k) // 16,), _PADDING_SCALE_BYTE, dtype=torch.uint8, device=scale.device)
            state_dict[key] = torch.cat([scale.reshape(-1), tail]).view(n, prepacked_scale_cols(k))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if self._compute != "w4a16" and not error_msgs:
            self.refresh_fp8_weight()  # from the loaded weight

    # ---- construction -----------------------------------------------------

    @classmethod
    def from_checkpoint(
        cls, weight: Tensor, weight_scale: Tensor, weight_global: Tensor, bias: Tensor | None = None, *,
        compute: str = "w4a16",
    ) -> "Nvfp4Linear":
        """From checkpoint-layout tensors: ``weight`` uint8 [N, K/2],
        ``weight_scale`` E4M3 [N, K/16], ``weight_global`` = amax / 2688
        (one value), ``bias`` [N]; ``compute`` as the module's (the FP8
        copy, if any, made here). Bad tensors raise ValueError (shapes) or
        TypeError (dtypes) naming the argument."""
        _check_checkpoint("from_checkpoint", ("weight", "weight_scale", "weight_global"), weight, weight_scale,
                          weight_global, bias)
        return cls._from_valid(weight, weight_scale, weight_global, bias, compute, "from_checkpoint")

    @classmethod
    def _from_valid(
        cls, weight: Tensor, weight_scale: Tensor, weight_global: Tensor, bias: Tensor | None,
        compute: str = "w4a16", where: str = "from_checkpoint",
    ) -> "Nvfp4Linear":
        """The layer from checkpoint-layout tensors that _check_checkpoint passed."""
        mode, rows = resolve_compute(f"Nvfp4Linear.{where}", compute, None)
        n, k = weight.shape[0], weight.shape[1] * 2
        mod = cls(k, n, bias=bias is not None, device=weight.device,
                  bias_dtype=bias.dtype if bias is not None else torch.bfloat16)
        w, s = nvfp4_prepack(weight, weight_scale)
        mod.weight.copy_(w)
        mod.weight_scale.copy_(s)
        mod.weight_global.copy_(weight_global.reshape(()).float())
        if bias is not None:
            mod.bias.copy_(bias)
        mod._set_compute(mode, rows)  # the FP8 copy from the weight just copied in
        return mod

    @classmethod
    def from_modelopt(
        cls, weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor, bias: Tensor | None = None, *,
        compute: str = "w4a16",
    ) -> "Nvfp4Linear":
        """NVIDIA ModelOpt tensors: ``weight``, ``weight_scale``, ``weight_scale_2`` (= amax / 2688)."""
        _check_checkpoint("from_modelopt", ("weight", "weight_scale", "weight_scale_2"), weight, weight_scale,
                          weight_scale_2, bias)
        return cls._from_valid(weight, weight_scale, weight_scale_2, bias, compute, "from_modelopt")

    @classmethod
    def from_compressed_tensors(
        cls, weight_packed: Tensor, weight_scale: Tensor, weight_global_scale: Tensor, bias: Tensor | None = None, *,
        compute: str = "w4a16",
    ) -> "Nvfp4Linear":
        """compressed-tensors (``nvfp4-pack-quantized``): ``weight_global_scale`` is 2688 / amax, the reciprocal."""
        names = ("weight_packed", "weight_scale", "weight_global_scale")
        _check_checkpoint("from_compressed_tensors", names, weight_packed, weight_scale, weight_global_scale, bias)
        return cls._from_valid(weight_packed, weight_scale, global_from_compressed_tensors(weight_global_scale), bias,
                               compute, "from_compressed_tensors")

    def to_modelopt(self) -> dict[str, Tensor]:
        """The layer as NVIDIA ModelOpt checkpoint tensors (the inverse of
        :meth:`from_modelopt`), on the CPU: ``weight`` uint8 [N, K/2],
        ``weight_scale`` float8_e4m3fn [N, K/16], ``weight_scale_2``
        float32 [] and ``bias`` when there is one."""
        codes, scales = nvfp4_unprepack(self.weight.cpu(), self.weight_scale.cpu(), self.in_features)
        out = {"weight": codes, "weight_scale": scales, "weight_scale_2": self.weight_global.detach().cpu().clone()}
        if self.bias is not None:
            out["bias"] = self.bias.detach().cpu().clone()
        return out

    @staticmethod
    def computes_like(linear: nn.Linear) -> bool:
        """Whether ``linear`` computes ``x W^T + b``: an ``nn.Linear`` whose
        class keeps ``nn.Linear.forward`` (a subclass may reuse the weight for
        something else, e.g. transformers' block-diagonal
        ``DeepseekV4GroupedLinear``)."""
        return isinstance(linear, nn.Linear) and type(linear).forward is nn.Linear.forward

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, compute: str = "w4a16") -> "Nvfp4Linear":
        """Quantizes ``linear.weight`` with the reference NVFP4 rule
        (lowbit.nvfp4_quantize); ``compute`` as the module's."""
        resolve_compute("Nvfp4Linear.from_linear", compute, None)
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
            return cls._from_valid(q.packed, q.block_scale, q.global_scale, bias, compute, "from_linear")

    # ---- forward ----------------------------------------------------------

    def forward(self, x: Tensor) -> Tensor:
        """x [..., in_features] -> [..., out_features] in x's dtype; under
        ``torch.autocast`` x is first cast to the autocast dtype, as
        nn.Linear's input is (so an FP32 x runs the BF16 kernels there)."""
        x = autocast_input(x)
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"Nvfp4Linear: argument 'x' must have {self.in_features} features (its last dimension), "
                             f"got shape {list(x.shape)}")
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return nvfp4_linear(x, self.weight, self.weight_scale, self.weight_global, bias, self._fp8_rows,
                            self.weight_fp8, self.weight_fp8_scale)

    def extra_repr(self) -> str:
        compute = ""
        if self._compute == "fp8":
            compute = ", compute=fp8"
        elif self._compute == "auto":
            compute = f", compute=auto (FP8 from {self._fp8_rows} rows)"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"format=nvfp4 (W4A16, group 16, prepacked), device={self.weight.device}{compute}"
        )


class Nvfp4GroupedLinear(KeepsDtypes):
    """A block-diagonal Linear with an NVFP4 weight: x [..., G, K] ->
    [..., G, N], group g multiplied by block g of the weight [G * N, K]
    (rows g N .. g N + N - 1). It is transformers' ``DeepseekV4GroupedLinear``
    (the V4 attention's ``o_a_proj``), which ignores its bias;
    :meth:`from_hf` converts one without a bias. The weight is one
    :class:`Nvfp4Linear` (``linear``, one global scale, as the checkpoint's
    one tensor).

    It runs :func:`lowbit.nvfp4_grouped_linear`, which on CUDA, up to
    ``max_fused_rows`` rows of x (tokens times G), runs one nvfp4_linear
    over all groups, every token's G slices against the whole weight, and
    keeps the diagonal blocks: G times the products, but the weight is read
    once, which is what decode is bound by; above, one wgmma kernel, each
    group on its own columns of x. The choice is made inside the op, so a
    graph traced or exported with a dynamic token count serves decode and
    prefill alike.

    ``compute`` is ``"w4a16"`` only: the grouped op has no FP8 path yet, so
    ``"auto"`` and ``"fp8"`` raise NotImplementedError (``quantize_`` and
    ``load_pretrained`` leave these layers at W4A16 whatever their
    ``compute``).
    """

    # On an H100, V4-Flash's o_a_proj (8 x 4096 -> 1024; docs/perf/log/grouped.md,
    # "Nvfp4GroupedLinear" v3): the fused form 2.48x BF16 at 8 rows, 1.18x
    # at 128, 0.85x at 256, 0.55x at 512; nvfp4_grouped_linear 0.80-0.82x
    # up to 512 rows, 0.88-0.98x at 1024-2048.
    max_fused_rows = 256

    def __init__(self, in_features: int, out_features: int, n_groups: int,
                 device: torch.device | str | None = None, compute: str = "w4a16") -> None:
        super().__init__()
        self.compute = compute
        if not isinstance(n_groups, int) or n_groups < 1:
            raise ValueError(f"Nvfp4GroupedLinear: n_groups must be a positive int, got {n_groups!r}")
        self.in_features, self.out_features, self.n_groups = in_features, out_features, n_groups
        self.linear = Nvfp4Linear(in_features, n_groups * out_features, bias=False, device=device)

    @property
    def compute(self) -> str:
        return "w4a16"

    @compute.setter
    def compute(self, value: str) -> None:
        mode, _ = resolve_compute("Nvfp4GroupedLinear", value, None)
        if mode != "w4a16":
            raise NotImplementedError(f"Nvfp4GroupedLinear: compute={mode!r} is not implemented yet "
                                      "(lowbit.nvfp4_grouped_linear has no FP8 path); it computes 'w4a16' only")

    @staticmethod
    def is_hf_grouped(module: nn.Module) -> bool:
        """Whether ``module`` is a transformers ``DeepseekV4GroupedLinear``."""
        return type(module).__name__ == "DeepseekV4GroupedLinear"

    @staticmethod
    def hf_grouped_supported(module: nn.Module) -> bool:
        """Whether :meth:`from_hf` converts ``module``: no bias (transformers
        ignores it), sizes multiples of 16."""
        n = module.out_features // module.n_groups
        return module.bias is None and n * module.n_groups == module.out_features and n % 16 == 0 \
            and module.in_features % 16 == 0

    @classmethod
    def from_hf(cls, module: nn.Module) -> "Nvfp4GroupedLinear":
        """Quantizes a transformers ``DeepseekV4GroupedLinear``'s weight with
        the reference NVFP4 rule."""
        if not cls.is_hf_grouped(module) or not cls.hf_grouped_supported(module):
            raise TypeError(
                "Nvfp4GroupedLinear.from_hf: argument 'module' must be a DeepseekV4GroupedLinear without bias and "
                f"with sizes that are multiples of 16, got {type(module).__name__}"
            )
        with torch.no_grad():
            q = nvfp4_quantize(module.weight.detach())
            return cls.from_checkpoint(module.n_groups, q.packed, q.block_scale, q.global_scale)

    @classmethod
    def from_checkpoint(
        cls, n_groups: int, weight: Tensor, weight_scale: Tensor, weight_global: Tensor
    ) -> "Nvfp4GroupedLinear":
        """From the checkpoint-layout tensors of the whole [G * N, K] weight
        (as :meth:`Nvfp4Linear.from_checkpoint` takes them)."""
        n_rows = weight.shape[0]
        if not isinstance(n_groups, int) or n_groups < 1 or n_rows % n_groups:
            raise ValueError(
                f"Nvfp4GroupedLinear.from_checkpoint: argument 'n_groups' must be a positive divisor of the weight's "
                f"{n_rows} rows, got {n_groups!r}"
            )
        mod = cls(weight.shape[1] * 2, n_rows // n_groups, n_groups, device="meta")
        mod.linear = Nvfp4Linear.from_checkpoint(weight, weight_scale, weight_global)
        return mod

    def to_modelopt(self) -> dict[str, Tensor]:
        """The whole [G N, K] weight as ModelOpt tensors (:meth:`Nvfp4Linear.to_modelopt`)."""
        return self.linear.to_modelopt()

    def forward(self, x: Tensor) -> Tensor:
        """x [..., G, K] -> [..., G, N]; under ``torch.autocast`` x is
        first cast to the autocast dtype (as Nvfp4Linear's)."""
        x = autocast_input(x)
        g, k, n = self.n_groups, self.in_features, self.out_features
        if x.dim() < 2 or x.shape[-2] != g or x.shape[-1] != k:
            raise ValueError(f"Nvfp4GroupedLinear: argument 'x' must have shape [..., {g}, {k}], got {list(x.shape)}")
        lin = self.linear
        return nvfp4_grouped_linear(x, lin.weight, lin.weight_scale, lin.weight_global, g, self.max_fused_rows)

    def extra_repr(self) -> str:
        return f"n_groups={self.n_groups}, in_features={self.in_features}, out_features={self.out_features} per group"
