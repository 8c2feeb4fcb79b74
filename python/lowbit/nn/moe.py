"""``Nvfp4MoE``: a DeepSeek-V3 / V4 style mixture-of-experts layer with NVFP4
expert weights, for inference.

    y = sum_j w[t, j] * Expert_{ids[t, j]}(x[t])  (+ SharedExpert(x[t]))
    Expert(x) = W2 (silu(gate) * up),  [gate | up] = W13 x,
    gate = min(gate, L), up = clamp(up, -L, L) when ``swiglu_limit`` L is set

Routing is a :class:`lowbit.nn.Router` (``"dense"``: learned gate with
sqrt-softplus / sigmoid / softmax scores, optional DeepSeek-V3 group-limited
selection; ``"hash"``: DeepSeek-V4's token-id table, weighted by the gate).
The routed experts run in one :func:`lowbit.nvfp4_moe` call.

The optional shared expert (same clamped SwiGLU MLP, weight 1, every token)
is *fused* with the routed experts when its intermediate size equals the
experts' ``I``: it is stored as one more expert, index E, in the stacked
buffers, and every token gets one more (id E, weight 1.0) slot. Otherwise it
runs as two :class:`lowbit.nn.Nvfp4Linear` (gate+up, down) with the clamped
SwiGLU in torch, and its output (in x's dtype) is added to the experts' (so
that path rounds twice more: the gate/up output and the sum).

``compute`` (an attribute, checked when set, not in ``state_dict``) picks
the experts' arithmetic as :class:`lowbit.nn.Nvfp4Linear`'s does: ``"w4a16"``
(the default), ``"fp8"`` (every call on the experts' E4M3 form: x and the
SwiGLU output rounded to E4M3 per row, FP8 tensor cores) or ``"auto"`` (the
FP8 path from ``AUTO_MOE_FP8_ROWS_PER_EXPERT`` (32) routed rows per expert on
average, i.e. from ``ceil(32 E / k)`` tokens, W4A16 below; chosen inside
:func:`lowbit.nvfp4_moe`, so one graph serves every token count). An
unfused shared expert (its Nvfp4Linear layers) gets the same mode, with the
Linear's own ``"auto"`` threshold. With ``"auto"`` or ``"fp8"`` the module
keeps the experts' E4M3 form (:func:`lowbit.nvfp4_moe_to_fp8`, 1 byte per
weight more), made when the mode is set (construction, ``quantize_``,
loading) and by ``load_state_dict``, never per call: the non-persistent
buffers ``w13_fp8`` float8_e4m3fn [Es, 2I, H], ``w13_fp8_scale`` float32
[Es, 2I], ``w2_fp8`` [Es, H, I], ``w2_fp8_scale`` [Es, H]. They are derived,
so not in ``state_dict`` (checkpoints stay NVFP4); ``.to()`` moves them.
``"w4a16"`` holds none.

State (all buffers, in ``state_dict``):

    router.weight [E, H] (bf16 or fp32), router.e_score_correction_bias
    float32 [E], router.tid2eid int32 [vocab, k] (hash mode)
    w13 uint8 [Es, 2I, Hp/2], w13_scale uint8 [Es, 2I, Hp/16], w13_global float32 [Es]
    w2 uint8 [Es, H, Ip/2],   w2_scale uint8 [Es, H, Ip/16],   w2_global float32 [Es]
    shared_gate_up.*, shared_down.* (Nvfp4Linear; unfused shared expert only)

with Es = E (+1 for a fused shared expert) and the prepacked layout of
:func:`lowbit.nvfp4_moe_prepack` (the same on every device, so ``.to()``
moves the module). The dtypes of the state are part of the format:
``.to(dtype)`` / ``.half()`` move nothing between dtypes (the activations
choose the compute dtype), only ``.to(device)`` applies.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._autocast import autocast_input
from ..moe import nvfp4_moe, nvfp4_moe_prepack, nvfp4_moe_to_fp8, nvfp4_moe_unprepack
from ..format import nvfp4_quantize
from ._format_dtypes import KeepsDtypes
from .linear import Nvfp4Linear, resolve_compute
from .router import Router

# compute="auto": the experts' FP8 path from this many routed rows per
# expert on average (tokens x k / E). bench moe on an H100 (docs/perf/log/
# moe.md, "MoE v13"): FP8 won every layer and routing from 32 rows per expert
# (DSV3 at 1024 tokens, DSV4-Pro at 2048), lost at 16 (DSV4-Pro at 1024:
# 10.1 against W4A16's 8.3 ms) and split at 24 (DSV4-Flash at 1024).
AUTO_MOE_FP8_ROWS_PER_EXPERT = 32
_FP8_BUFFERS = ("w13_fp8", "w13_fp8_scale", "w2_fp8", "w2_fp8_scale")

_SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
_HASH_SCORE_FUNCS = ("sqrtsoftplus", "sigmoid")
_ROUTER_DTYPES = (torch.bfloat16, torch.float32)
_ALL_OR_NONE = "shared_up_proj and shared_down_proj: give all three or none"
_ONE_W13_GLOBAL = (
    "The fused gate+up weight has one global scale per expert, and the NVFP4 codes cannot be requantized to a "
    "common scale without loss; export the checkpoint with shared gate/up global scales (ModelOpt does so for "
    "fused layers)"
)
# Hugging Face transformers' DeepSeek MoE blocks (Nvfp4MoE.from_hf), and the
# class names of their experts' activation and their gates' score functions.
_HF_MOE_BLOCKS = {"DeepseekV3MoE": "v3", "DeepseekV4SparseMoeBlock": "v4"}
_HF_SILU = ("SiLUActivation", "SiLU")
_HF_SCORE_FUNCS = {"SqrtSoftplusActivation": "sqrtsoftplus", "Sigmoid": "sigmoid"}


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _err(where: str, arg: str, message: str) -> str:
    return f"Nvfp4MoE{where}: argument '{arg}' {message}"


def _check_multiple_of_16(value: object, where: str, arg: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % 16:
        raise ValueError(_err(where, arg, f"must be a positive multiple of 16, got {value!r}"))


def _check_tensor(t: object, where: str, arg: str, ndim: int, floating: bool | None = None) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(_err(where, arg, f"must be a Tensor, got {type(t).__name__}"))
    if t.dim() != ndim:
        raise ValueError(_err(where, arg, f"must be {ndim}-D, got shape {list(t.shape)}"))
    if floating is True and not t.dtype.is_floating_point:
        raise TypeError(_err(where, arg, f"must have a floating-point dtype, got {t.dtype}"))
    if floating is False and t.dtype != torch.uint8:
        raise TypeError(_err(where, arg, f"must have dtype torch.uint8 (packed NVFP4 codes), got {t.dtype}"))
    return t


def _check_shape(t: Tensor, shape: Sequence[int], where: str, arg: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(_err(where, arg, f"must have shape {list(shape)}, got {list(t.shape)}"))


def _scale_codes(t: Tensor, where: str, arg: str) -> Tensor:
    """E4M3 block scales as uint8 codes (float8_e4m3fn or uint8 accepted)."""
    if not isinstance(t, Tensor):
        raise TypeError(_err(where, arg, f"must be a Tensor, got {type(t).__name__}"))
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    if t.dtype != torch.uint8:
        raise TypeError(
            _err(where, arg, f"must have dtype torch.float8_e4m3fn or torch.uint8 (E4M3 codes), got {t.dtype}")
        )
    return t


def _per_expert_global(t: object, n: int, where: str, arg: str, allow_pair: bool) -> Tensor:
    """ModelOpt ``weight_scale_2`` of stacked experts -> float32 [n].

    Accepted: [n], [n, 1] and, for the gate+up tensor, [n, 2] (separate gate
    and up globals), which must then be equal: the prepacked w13 applies one
    global per expert to all 2I rows, and folding two different globals into
    one would need the E4M3 block scales (3 mantissa bits) or the FP4 codes
    to be requantized, which is lossy.
    """
    if not isinstance(t, Tensor):
        raise TypeError(_err(where, arg, f"must be a Tensor, got {type(t).__name__}"))
    g = t.detach().float()
    forms = f"[{n}], [{n}, 1] or [{n}, 2]" if allow_pair else f"[{n}] or [{n}, 1]"
    if g.dim() == 2 and g.shape[0] == n and (g.shape[1] == 1 or (allow_pair and g.shape[1] == 2)):
        if g.shape[1] == 2:
            differ = (g[:, 0] != g[:, 1]).nonzero().flatten()
            if differ.numel():
                e = int(differ[0])
                raise ValueError(_err(
                    where, arg,
                    f"holds different gate and up global scales for {differ.numel()} expert(s), first expert {e}: "
                    f"{g[e, 0].item()!r} vs {g[e, 1].item()!r}. {_ONE_W13_GLOBAL}",
                ))
        g = g[:, 0]
    if tuple(g.shape) != (n,):
        raise ValueError(_err(where, arg, f"must have shape {forms}, got {list(t.shape)}"))
    return g.contiguous()


def _scalar_global(t: object, where: str, arg: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(_err(where, arg, f"must be a Tensor, got {type(t).__name__}"))
    if t.numel() != 1:
        raise ValueError(_err(where, arg, f"must hold one global scale, got shape {list(t.shape)}"))
    return t.detach().float().reshape(())


def resolve_moe_compute(where: str, compute: str) -> str:
    """The compute mode, or ValueError naming ``where`` and the argument."""
    return resolve_compute(where, compute, None)[0]


def auto_moe_fp8_min_rows(n_experts: int, k: int) -> int:
    """The token count from which ``compute="auto"`` runs the experts' FP8
    path: AUTO_MOE_FP8_ROWS_PER_EXPERT routed rows per expert on average."""
    return -(-AUTO_MOE_FP8_ROWS_PER_EXPERT * n_experts // k)


def _split_triplet(t: object, where: str, arg: str) -> tuple[Tensor, Tensor, Tensor]:
    if not isinstance(t, (tuple, list)) or len(t) != 3:
        raise TypeError(_err(where, arg, "must be a (weight, weight_scale, weight_scale_2) tuple of ModelOpt tensors"))
    return t[0], t[1], t[2]


class Nvfp4MoE(KeepsDtypes):
    """Router + NVFP4 routed experts (+ optional shared expert).

    Args:
        hidden_size: H (multiple of 16).
        intermediate_size: I of each routed expert (multiple of 16).
        n_experts: E, the routed experts.
        k: experts per token.
        mode: ``"dense"`` or ``"hash"`` (then ``vocab_size`` is required and
            ``forward`` needs ``token_ids``).
        score_func: ``"sqrtsoftplus"`` (DeepSeek-V4), ``"sigmoid"``
            (DeepSeek-V3) or ``"softmax"`` (dense mode only).
        n_group, topk_group: DeepSeek-V3 group-limited selection.
        renormalize, routed_scaling_factor: as :func:`lowbit.route`.
        router_bias: keep an ``e_score_correction_bias`` (selects only).
        swiglu_limit: L of the clamped SwiGLU (DeepSeek-V4: 10), or None.
        shared_intermediate_size: Is of the shared expert, or None for none.
        router_dtype: dtype of the gate weight (bfloat16 or float32).
        compute: ``"w4a16"``, ``"auto"`` or ``"fp8"`` (module docstring).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        n_experts: int,
        k: int,
        mode: str = "dense",
        score_func: str = "sqrtsoftplus",
        n_group: int = 1,
        topk_group: int = 1,
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        vocab_size: int | None = None,
        router_bias: bool = True,
        swiglu_limit: float | None = None,
        shared_intermediate_size: int | None = None,
        router_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        compute: str = "w4a16",
    ) -> None:
        super().__init__()
        compute_mode = resolve_moe_compute("Nvfp4MoE", compute)
        _check_multiple_of_16(hidden_size, "", "hidden_size")
        _check_multiple_of_16(intermediate_size, "", "intermediate_size")
        if not isinstance(n_experts, int) or n_experts < 1:
            raise ValueError(_err("", "n_experts", f"must be a positive int, got {n_experts!r}"))
        if not isinstance(k, int) or not 1 <= k <= n_experts:
            raise ValueError(_err("", "k", f"must be in [1, {n_experts}] (n_experts), got {k!r}"))
        if mode not in ("dense", "hash"):
            raise ValueError(_err("", "mode", f"must be 'dense' or 'hash', got {mode!r}"))
        allowed = _HASH_SCORE_FUNCS if mode == "hash" else _SCORE_FUNCS
        if score_func not in allowed:
            raise ValueError(_err("", "score_func", f"must be one of {allowed} in {mode} mode, got {score_func!r}"))
        if not isinstance(n_group, int) or n_group < 1 or n_experts % n_group:
            raise ValueError(
                _err("", "n_group", f"must be a positive divisor of n_experts ({n_experts}), got {n_group!r}")
            )
        if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
            raise ValueError(_err("", "topk_group", f"must be in [1, {n_group}] (n_group), got {topk_group!r}"))
        if n_experts // n_group * topk_group < k:
            raise ValueError(_err(
                "", "k", f"({k}) exceeds the {n_experts // n_group * topk_group} experts of the "
                f"{topk_group} kept group(s) of {n_experts // n_group}",
            ))
        if swiglu_limit is not None:
            if isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float)) or not (
                math.isfinite(swiglu_limit) and swiglu_limit > 0
            ):
                raise ValueError(_err("", "swiglu_limit", f"must be None or a finite number > 0, got {swiglu_limit!r}"))
            swiglu_limit = float(swiglu_limit)
        if shared_intermediate_size is not None:
            _check_multiple_of_16(shared_intermediate_size, "", "shared_intermediate_size")
        if router_dtype not in _ROUTER_DTYPES:
            raise TypeError(_err("", "router_dtype", f"must be torch.bfloat16 or torch.float32, got {router_dtype}"))

        self.hidden_size, self.intermediate_size, self.n_experts, self.k = hidden_size, intermediate_size, n_experts, k
        self.mode = mode
        self.swiglu_limit = swiglu_limit
        self.shared_intermediate_size = shared_intermediate_size
        self.shared_fused = shared_intermediate_size == intermediate_size
        self.router = Router(
            hidden_size, n_experts, k, mode=mode, score_func=score_func, n_group=n_group, topk_group=topk_group,
            renormalize=renormalize, routed_scaling_factor=routed_scaling_factor, vocab_size=vocab_size,
            bias=router_bias, dtype=router_dtype, device=device,
        )
        stacked = n_experts + (1 if self.shared_fused else 0)
        hp, ip = _round_up(hidden_size, 128), _round_up(intermediate_size, 128)
        u8 = dict(dtype=torch.uint8, device=device)
        self.register_buffer("w13", torch.zeros(stacked, 2 * intermediate_size, hp // 2, **u8))
        self.register_buffer("w13_scale", torch.zeros(stacked, 2 * intermediate_size, hp // 16, **u8))
        self.register_buffer("w13_global", torch.ones(stacked, dtype=torch.float32, device=device))
        self.register_buffer("w2", torch.zeros(stacked, hidden_size, ip // 2, **u8))
        self.register_buffer("w2_scale", torch.zeros(stacked, hidden_size, ip // 16, **u8))
        self.register_buffer("w2_global", torch.ones(stacked, dtype=torch.float32, device=device))
        if shared_intermediate_size is not None and not self.shared_fused:
            self.shared_gate_up = Nvfp4Linear(hidden_size, 2 * shared_intermediate_size, bias=False, device=device)
            self.shared_down = Nvfp4Linear(shared_intermediate_size, hidden_size, bias=False, device=device)
        else:
            self.shared_gate_up = None
            self.shared_down = None
        # The experts' E4M3 form for compute "auto" / "fp8" (None for
        # "w4a16"): derived from the buffers above, so not in state_dict.
        for name in _FP8_BUFFERS:
            self.register_buffer(name, None, persistent=False)
        self._set_compute(compute_mode)

    # ---- compute mode -----------------------------------------------------

    @property
    def compute(self) -> str:
        """"w4a16", "auto" or "fp8" (module docstring); setting it makes or
        drops the experts' FP8 form."""
        return self._compute

    @compute.setter
    def compute(self, value: str) -> None:
        self._set_compute(resolve_moe_compute("Nvfp4MoE", value))

    def _set_compute(self, mode: str, fp8_min_rows: int | None = None) -> None:
        # Checked when set, not at the next forward. _fp8_rows: the op's
        # fp8_min_rows (0 for "w4a16", 1 for "fp8", the threshold for "auto":
        # this layer's by default, or the one given).
        self._compute = mode
        if fp8_min_rows is None:
            fp8_min_rows = auto_moe_fp8_min_rows(self.n_experts, self.k) if mode == "auto" else int(mode == "fp8")
        self._fp8_rows = fp8_min_rows
        for layer in (self.shared_gate_up, self.shared_down):
            if layer is not None:
                layer.compute = mode  # a Linear's "auto" threshold is its own
        self.refresh_fp8_weight()

    def refresh_fp8_weight(self) -> None:
        """Makes the experts' FP8 form (``w13_fp8``, ``w13_fp8_scale``,
        ``w2_fp8``, ``w2_fp8_scale``) from the NVFP4 buffers again, or drops
        it for ``"w4a16"``. Done when the compute mode is set and by
        ``load_state_dict``; call it after writing the expert buffers any
        other way."""
        for name in _FP8_BUFFERS:  # the old form freed before a new one is made
            setattr(self, name, None)
        if self._compute == "w4a16":
            return
        with torch.no_grad():
            fp8 = nvfp4_moe_to_fp8(self.w13, self.w13_scale, self.w13_global, self.w2, self.w2_scale, self.w2_global)
        for name in _FP8_BUFFERS:
            setattr(self, name, getattr(fp8, name))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if self._compute != "w4a16" and not error_msgs:
            self.refresh_fp8_weight()  # from the loaded experts

    # ---- construction -----------------------------------------------------

    def _load_expert(self, e: int, w13: Tensor, w13_scale: Tensor, w13_global: Tensor, w2: Tensor,
                     w2_scale: Tensor, w2_global: Tensor) -> None:
        """Checkpoint-layout expert ``e`` (index E: a fused shared expert) ->
        its slice of the prepacked buffers. One expert at a time: converting
        a layer needs the module and one expert's copies, not the layer's."""
        packed = nvfp4_moe_prepack(w13.unsqueeze(0), w13_scale.unsqueeze(0), w2.unsqueeze(0), w2_scale.unsqueeze(0))
        self.w13[e].copy_(packed.w13[0])
        self.w13_scale[e].copy_(packed.w13_scale[0])
        self.w2[e].copy_(packed.w2[0])
        self.w2_scale[e].copy_(packed.w2_scale[0])
        self.w13_global[e] = w13_global
        self.w2_global[e] = w2_global

    def _load_experts(self, w13: Tensor, w13_scale: Tensor, w13_global: Tensor, w2: Tensor, w2_scale: Tensor,
                      w2_global: Tensor) -> None:
        """Checkpoint-layout stacked experts -> prepacked buffers (from expert 0)."""
        for e in range(w13.shape[0]):
            self._load_expert(e, w13[e], w13_scale[e], w13_global[e], w2[e], w2_scale[e], w2_global[e])

    def _load_router(self, weight: Tensor, bias: Tensor | None, tid2eid: Tensor | None, where: str) -> None:
        _check_shape(weight, (self.n_experts, self.hidden_size), where, "router_weight")
        self.router.weight.copy_(weight)
        if bias is not None:
            _check_tensor(bias, where, "e_score_correction_bias", 1)
            _check_shape(bias, (self.n_experts,), where, "e_score_correction_bias")
            self.router.e_score_correction_bias.copy_(bias)
        if tid2eid is not None:
            self.router.set_hash_table(tid2eid)

    @staticmethod
    def _router_config(where: str, router_weight: object, e_score_correction_bias: object, mode: str,
                       tid2eid: object, vocab_size: int | None) -> dict:
        w = _check_tensor(router_weight, where, "router_weight", 2, floating=True)
        if w.dtype not in _ROUTER_DTYPES:
            raise TypeError(
                _err(where, "router_weight", f"must have dtype torch.bfloat16 or torch.float32, got {w.dtype}")
            )
        if mode == "hash":
            if tid2eid is None:
                raise ValueError(_err(where, "tid2eid", "is required with mode='hash'"))
            _check_tensor(tid2eid, where, "tid2eid", 2)
            vocab_size = tid2eid.shape[0]
        elif tid2eid is not None:
            raise ValueError(_err(where, "tid2eid", "is only used with mode='hash'"))
        return dict(router_bias=e_score_correction_bias is not None, router_dtype=w.dtype, vocab_size=vocab_size,
                    mode=mode, device=w.device)

    @classmethod
    def from_bf16(
        cls,
        gate_up_proj: Tensor,
        down_proj: Tensor,
        router_weight: Tensor,
        e_score_correction_bias: Tensor | None = None,
        *,
        k: int,
        mode: str = "dense",
        tid2eid: Tensor | None = None,
        score_func: str = "sqrtsoftplus",
        n_group: int = 1,
        topk_group: int = 1,
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        swiglu_limit: float | None = None,
        shared_gate_proj: Tensor | None = None,
        shared_up_proj: Tensor | None = None,
        shared_down_proj: Tensor | None = None,
        compute: str = "w4a16",
    ) -> "Nvfp4MoE":
        """Quantizes unquantized (BF16/FP16/FP32) weights with the reference
        NVFP4 rule (:func:`lowbit.nvfp4_quantize`, one global per expert).

        Layouts as in Hugging Face transformers' DeepseekV3 / DeepseekV4 MoE:
        ``gate_up_proj`` [E, 2I, H] (gate rows first), ``down_proj`` [E, H, I],
        ``router_weight`` [E, H] (bf16 or fp32, kept unquantized),
        ``e_score_correction_bias`` [E]; in hash mode ``tid2eid`` [vocab, k].
        Optional shared expert: ``shared_gate_proj`` / ``shared_up_proj``
        [Is, H] and ``shared_down_proj`` [H, Is] (all three or none); gate and
        up share one global scale. ``compute`` as the module's (the FP8
        form, if any, made here).
        """
        where = ".from_bf16"
        compute_mode = resolve_moe_compute(f"Nvfp4MoE{where}", compute)
        gu = _check_tensor(gate_up_proj, where, "gate_up_proj", 3, floating=True)
        down = _check_tensor(down_proj, where, "down_proj", 3, floating=True)
        e, two_i, h = gu.shape
        if two_i % 2:
            raise ValueError(_err(where, "gate_up_proj", f"must have shape [E, 2I, H], got {list(gu.shape)}"))
        i = two_i // 2
        _check_shape(down, (e, h, i), where, "down_proj")
        shared = (shared_gate_proj, shared_up_proj, shared_down_proj)
        if any(t is not None for t in shared) and any(t is None for t in shared):
            raise ValueError(_err(where, "shared_gate_proj", _ALL_OR_NONE))
        shared_i = None
        if shared_gate_proj is not None:
            sg = _check_tensor(shared_gate_proj, where, "shared_gate_proj", 2, floating=True)
            su = _check_tensor(shared_up_proj, where, "shared_up_proj", 2, floating=True)
            sd = _check_tensor(shared_down_proj, where, "shared_down_proj", 2, floating=True)
            shared_i = sg.shape[0]
            _check_shape(sg, (shared_i, h), where, "shared_gate_proj")
            _check_shape(su, (shared_i, h), where, "shared_up_proj")
            _check_shape(sd, (h, shared_i), where, "shared_down_proj")
        cfg = cls._router_config(where, router_weight, e_score_correction_bias, mode, tid2eid, None)
        cfg["device"] = gu.device
        mod = cls(h, i, e, k, score_func=score_func, n_group=n_group, topk_group=topk_group, renormalize=renormalize,
                  routed_scaling_factor=routed_scaling_factor, swiglu_limit=swiglu_limit,
                  shared_intermediate_size=shared_i, **cfg)
        with torch.no_grad():
            gu, down = gu.detach(), down.detach()
            if shared_i is not None:
                shared_gu = torch.cat([shared_gate_proj.detach(), shared_up_proj.detach()]).to(gu.dtype)
            mod._load_experts(*nvfp4_quantize(gu), *nvfp4_quantize(down))
            if mod.shared_fused:
                # The shared expert (expert E) quantized on its own: the same
                # bytes as quantizing it stacked with the others (one global
                # per expert), without a stacked copy of every expert's
                # unquantized weights (8.6 GB for a DeepSeek-V4-Flash gate_up).
                q13 = nvfp4_quantize(shared_gu)
                q2 = nvfp4_quantize(shared_down_proj.detach().to(down.dtype))
                mod._load_expert(e, *q13, *q2)
            if shared_i is not None and not mod.shared_fused:
                mod.shared_gate_up.load_state_dict(Nvfp4Linear.from_checkpoint(*nvfp4_quantize(shared_gu)).state_dict())
                mod.shared_down.load_state_dict(
                    Nvfp4Linear.from_checkpoint(*nvfp4_quantize(shared_down_proj.detach())).state_dict()
                )
            mod._load_router(router_weight.detach(), e_score_correction_bias, tid2eid, where)
        mod._set_compute(compute_mode)  # the FP8 form from the experts just loaded
        return mod

    @classmethod
    def from_modelopt(
        cls,
        w13_weight: Tensor,
        w13_weight_scale: Tensor,
        w13_weight_scale_2: Tensor,
        w2_weight: Tensor,
        w2_weight_scale: Tensor,
        w2_weight_scale_2: Tensor,
        router_weight: Tensor,
        e_score_correction_bias: Tensor | None = None,
        *,
        k: int,
        mode: str = "dense",
        tid2eid: Tensor | None = None,
        score_func: str = "sqrtsoftplus",
        n_group: int = 1,
        topk_group: int = 1,
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        swiglu_limit: float | None = None,
        shared_gate_proj: Sequence[Tensor] | None = None,
        shared_up_proj: Sequence[Tensor] | None = None,
        shared_down_proj: Sequence[Tensor] | None = None,
        compute: str = "w4a16",
    ) -> "Nvfp4MoE":
        """From NVIDIA ModelOpt NVFP4 tensors of stacked experts (no requantization).

        ``w13_weight`` uint8 [E, 2I, H/2] (gate rows, then up rows),
        ``w13_weight_scale`` float8_e4m3fn (or uint8 codes) [E, 2I, H/16],
        ``w13_weight_scale_2`` float32 [E], [E, 1] or [E, 2]; ``w2_weight``
        uint8 [E, H, I/2], ``w2_weight_scale`` [E, H, I/16],
        ``w2_weight_scale_2`` [E] or [E, 1] (global = amax / 2688; dequant =
        e2m1 * block_scale * global).

        A [E, 2] ``w13_weight_scale_2`` (separate gate and up globals) must
        hold equal columns: the prepacked w13 has one global per expert and
        exact requantization to a common (max) global is impossible (the E4M3
        block scales would need more mantissa bits), so unequal globals raise
        ValueError rather than silently losing accuracy.

        Optional shared expert: ``shared_gate_proj``, ``shared_up_proj``,
        ``shared_down_proj``, each a ModelOpt Linear's (weight, weight_scale,
        weight_scale_2) triple; gate and up must have equal weight_scale_2.
        Router arguments and ``compute`` as in :meth:`from_bf16`. ModelOpt's
        ``input_scale`` (activation quantization, W4A4) is not used.
        """
        where = ".from_modelopt"
        compute_mode = resolve_moe_compute(f"Nvfp4MoE{where}", compute)
        w13 = _check_tensor(w13_weight, where, "w13_weight", 3, floating=False)
        w2 = _check_tensor(w2_weight, where, "w2_weight", 3, floating=False)
        e, two_i, h_half = w13.shape
        h, i = 2 * h_half, two_i // 2
        if two_i % 2 or two_i == 0:
            raise ValueError(_err(where, "w13_weight", f"must have shape [E, 2I, H/2], got {list(w13.shape)}"))
        _check_shape(w2, (e, h, i // 2), where, "w2_weight")
        s13 = _scale_codes(w13_weight_scale, where, "w13_weight_scale")
        s2 = _scale_codes(w2_weight_scale, where, "w2_weight_scale")
        _check_shape(s13, (e, two_i, h // 16), where, "w13_weight_scale")
        _check_shape(s2, (e, h, i // 16), where, "w2_weight_scale")
        g13 = _per_expert_global(w13_weight_scale_2, e, where, "w13_weight_scale_2", allow_pair=True)
        g2 = _per_expert_global(w2_weight_scale_2, e, where, "w2_weight_scale_2", allow_pair=False)
        routing = dict(k=k, mode=mode, tid2eid=tid2eid, score_func=score_func, n_group=n_group, topk_group=topk_group,
                       renormalize=renormalize, routed_scaling_factor=routed_scaling_factor, swiglu_limit=swiglu_limit)
        return cls._from_experts(
            where, h, i, e, lambda j: (w13[j], s13[j], g13[j], w2[j], s2[j], g2[j]), w13.device,
            (shared_gate_proj, shared_up_proj, shared_down_proj), router_weight, e_score_correction_bias, routing,
            compute_mode,
        )

    @classmethod
    def _from_experts(
        cls, where: str, h: int, i: int, n_experts: int, expert: Callable[[int], tuple[Tensor, ...]],
        device: torch.device, shared: tuple, router_weight: Tensor, e_score_correction_bias: Tensor | None,
        routing: dict, compute_mode: str,
    ) -> "Nvfp4MoE":
        """The module from checked ModelOpt tensors, ``expert(e)`` giving
        expert e's (w13 [2I, H/2], w13 scale codes, global [], w2 [H, I/2],
        w2 scale codes, global []), called once per expert, in order;
        ``shared``: the shared expert's three triples, or three Nones;
        ``compute_mode`` from resolve_moe_compute."""
        if any(t is not None for t in shared) and any(t is None for t in shared):
            raise ValueError(_err(where, "shared_gate_proj", _ALL_OR_NONE))
        shared_i = None
        if shared[0] is not None:
            gw, gs, gg = _split_triplet(shared[0], where, "shared_gate_proj")
            uw, us, ug = _split_triplet(shared[1], where, "shared_up_proj")
            dw, ds, dg = _split_triplet(shared[2], where, "shared_down_proj")
            gw = _check_tensor(gw, where, "shared_gate_proj", 2, floating=False)
            shared_i = gw.shape[0]
            _check_shape(gw, (shared_i, h // 2), where, "shared_gate_proj")
            _check_shape(_check_tensor(uw, where, "shared_up_proj", 2, floating=False), (shared_i, h // 2), where,
                         "shared_up_proj")
            _check_shape(_check_tensor(dw, where, "shared_down_proj", 2, floating=False), (h, shared_i // 2), where,
                         "shared_down_proj")
            gs, us, ds = (_scale_codes(s, where, n) for s, n in
                          ((gs, "shared_gate_proj"), (us, "shared_up_proj"), (ds, "shared_down_proj")))
            gg, ug, dg = (_scalar_global(g, where, n) for g, n in
                          ((gg, "shared_gate_proj"), (ug, "shared_up_proj"), (dg, "shared_down_proj")))
            if not torch.equal(gg, ug):
                raise ValueError(_err(
                    where, "shared_up_proj",
                    f"has weight_scale_2 {ug.item()!r} but shared_gate_proj has {gg.item()!r}; the fused gate+up "
                    "weight has one global scale and the NVFP4 codes cannot be requantized to a common one without "
                    "loss, so gate and up must share their weight_scale_2",
                ))
            shared_w13, shared_s13 = torch.cat([gw, uw]), torch.cat([gs, us])
        cfg = cls._router_config(where, router_weight, e_score_correction_bias, routing["mode"], routing["tid2eid"],
                                 None)
        cfg["device"] = device
        kwargs = {k: v for k, v in routing.items() if k not in ("mode", "tid2eid")}
        mod = cls(h, i, n_experts, shared_intermediate_size=shared_i, **kwargs, **cfg)
        with torch.no_grad():
            for e in range(n_experts):
                mod._load_expert(e, *expert(e))
            if shared_i is not None and mod.shared_fused:
                mod._load_expert(n_experts, shared_w13, shared_s13, gg, dw, ds, dg)
            elif shared_i is not None:
                mod.shared_gate_up.load_state_dict(Nvfp4Linear.from_modelopt(shared_w13, shared_s13, gg).state_dict())
                mod.shared_down.load_state_dict(Nvfp4Linear.from_modelopt(dw, ds, dg).state_dict())
            mod._load_router(router_weight.detach().to(mod.router.weight.device), e_score_correction_bias,
                             routing["tid2eid"], where)
        mod._set_compute(compute_mode)  # the FP8 form from the experts just loaded
        return mod

    @staticmethod
    def is_hf_block(module: nn.Module) -> bool:
        """Whether ``module`` is a Hugging Face transformers DeepSeek MoE
        block that :meth:`from_hf` converts."""
        return type(module).__name__ in _HF_MOE_BLOCKS

    @staticmethod
    def hf_block_sizes_supported(block: nn.Module) -> bool:
        """Whether ``block``'s hidden and intermediate sizes (routed and
        shared experts) are multiples of 16, as the NVFP4 blocks need."""
        _, two_i, h = block.experts.gate_up_proj.shape
        shared = block.shared_experts.gate_proj.out_features
        return all(v % 16 == 0 for v in (h, two_i // 2, shared))

    @classmethod
    def _hf_routing(cls, block: nn.Module, where: str) -> tuple[Tensor, Tensor | None, dict]:
        """A transformers DeepSeek MoE block's router weight, correction
        bias and the routing/activation keyword arguments of
        :meth:`from_bf16` / :meth:`from_modelopt` (see :meth:`from_hf`)."""
        family = _HF_MOE_BLOCKS.get(type(block).__name__)
        if family is None:
            raise TypeError(_err(where, "block", f"must be one of {sorted(_HF_MOE_BLOCKS)}, got {type(block).__name__}"))
        gate, experts, shared = block.gate, block.experts, block.shared_experts
        act = type(experts.act_fn).__name__
        if act not in _HF_SILU:
            raise ValueError(_err(where, "block", f"experts must use SiLU (SwiGLU), got {act}"))
        if any(lin.bias is not None for lin in (shared.gate_proj, shared.up_proj, shared.down_proj)):
            raise ValueError(_err(where, "block", "has a shared expert with biases, which Nvfp4MoE does not hold"))
        hash_mode = family == "v4" and bool(block.is_hash)
        if family == "v3":
            score_func, n_group, topk_group, renormalize, limit = (
                "sigmoid", gate.num_group, gate.topk_group, bool(gate.norm_topk_prob), None)
        else:
            score_name = type(gate.score_fn).__name__
            if score_name not in _HF_SCORE_FUNCS:
                raise ValueError(_err(where, "block", f"gate scores with {score_name}, which Nvfp4MoE does not run"))
            score_func, n_group, topk_group, renormalize, limit = (
                _HF_SCORE_FUNCS[score_name], 1, 1, True, experts.limit)
        router_weight = gate.weight.detach()
        if router_weight.dtype not in _ROUTER_DTYPES:
            router_weight = router_weight.float()
        bias = None if hash_mode else gate.e_score_correction_bias
        routing = dict(
            k=gate.top_k, mode="hash" if hash_mode else "dense", tid2eid=gate.tid2eid if hash_mode else None,
            score_func=score_func, n_group=n_group, topk_group=topk_group, renormalize=renormalize,
            routed_scaling_factor=float(gate.routed_scaling_factor), swiglu_limit=limit,
        )
        return router_weight, bias, routing

    @classmethod
    def from_hf(cls, block: nn.Module, *, compute: str = "w4a16") -> "Nvfp4MoE":
        """Quantizes a Hugging Face transformers (5.x) DeepSeek MoE block,
        ``DeepseekV3MoE`` or ``DeepseekV4SparseMoeBlock``, into an equivalent
        ``Nvfp4MoE`` (router, routed experts and shared expert; the experts
        with :meth:`from_bf16`'s rule, the gate unquantized):

        - V3: sigmoid scores, group-limited selection (``n_group``,
          ``topk_group``), ``norm_topk_prob``, unclamped SwiGLU;
        - V4: the gate's score function (sqrtsoftplus or sigmoid), clamped
          SwiGLU (the experts' ``limit``), and for hash layers
          (``block.is_hash``) the ``tid2eid`` table; ``forward`` takes the
          token ids as ``input_ids``, as V4's decoder layer passes them.

        The router runs in float32 from the gate weight (V3 does too; V4
        rounds its gate logits to the model's dtype first, so near-tied
        expert choices can differ). An fp16 gate weight is kept as float32.
        ``compute`` as the module's.
        """
        resolve_moe_compute("Nvfp4MoE.from_hf", compute)  # before any expert is quantized
        router_weight, bias, routing = cls._hf_routing(block, ".from_hf")
        experts, shared = block.experts, block.shared_experts
        return cls.from_bf16(
            experts.gate_up_proj, experts.down_proj, router_weight, bias, **routing,
            shared_gate_proj=shared.gate_proj.weight, shared_up_proj=shared.up_proj.weight,
            shared_down_proj=shared.down_proj.weight, compute=compute,
        )

    @classmethod
    def from_hf_modelopt(
        cls,
        block: nn.Module,
        expert: Callable[[int], Sequence[Tensor]],
        *,
        shared_gate_proj: Sequence[Tensor],
        shared_up_proj: Sequence[Tensor],
        shared_down_proj: Sequence[Tensor],
        compute: str = "w4a16",
    ) -> "Nvfp4MoE":
        """A transformers DeepSeek MoE block whose experts come from an NVFP4
        checkpoint: the routing (router weight, correction bias, hash table,
        score function, groups, clamp) from ``block`` as :meth:`from_hf`
        reads it; ``block``'s own expert weights are not read (they may be on
        the meta device).

        ``expert(e)`` gives routed expert e's ModelOpt tensors, as one
        expert of :meth:`from_modelopt`'s stacks: ``(w13_weight [2I, H/2],
        w13_weight_scale [2I, H/16], w13_weight_scale_2 (one global, or
        equal gate and up globals), w2_weight [H, I/2], w2_weight_scale
        [H, I/16], w2_weight_scale_2)``. It is called once per expert, in
        order, so that a checkpoint can be read one expert at a time: the
        conversion holds the module and one expert's tensors. The shared
        expert as in :meth:`from_modelopt`; ``compute`` as the module's.
        """
        where = ".from_hf_modelopt"
        compute_mode = resolve_moe_compute(f"Nvfp4MoE{where}", compute)
        router_weight, bias, routing = cls._hf_routing(block, where)
        n_experts, two_i, h = block.experts.gate_up_proj.shape
        i = two_i // 2

        def checked(e: int) -> tuple[Tensor, ...]:
            tensors = expert(e)
            arg = f"expert({e})"
            if not isinstance(tensors, (tuple, list)) or len(tensors) != 6:
                raise TypeError(_err(where, arg, "must return the 6 ModelOpt tensors (w13_weight, w13_weight_scale, "
                                                 "w13_weight_scale_2, w2_weight, w2_weight_scale, w2_weight_scale_2)"))
            w13, s13, g13, w2, s2, g2 = tensors
            _check_shape(_check_tensor(w13, where, f"{arg} w13_weight", 2, floating=False), (two_i, h // 2), where,
                         f"{arg} w13_weight")
            _check_shape(_check_tensor(w2, where, f"{arg} w2_weight", 2, floating=False), (h, i // 2), where,
                         f"{arg} w2_weight")
            s13 = _scale_codes(s13, where, f"{arg} w13_weight_scale")
            s2 = _scale_codes(s2, where, f"{arg} w2_weight_scale")
            _check_shape(s13, (two_i, h // 16), where, f"{arg} w13_weight_scale")
            _check_shape(s2, (h, i // 16), where, f"{arg} w2_weight_scale")
            if not isinstance(g13, Tensor) or g13.numel() not in (1, 2):
                raise ValueError(_err(where, f"{arg} w13_weight_scale_2", "must hold one global scale, or equal "
                                                                          "gate and up ones"))
            g13 = g13.detach().float().flatten()
            if g13.numel() == 2 and g13[0] != g13[1]:
                raise ValueError(_err(where, f"{arg} w13_weight_scale_2", "holds different gate and up global "
                                      f"scales, {g13[0].item()!r} vs {g13[1].item()!r}. {_ONE_W13_GLOBAL}"))
            return w13, s13, g13[0], w2, s2, _scalar_global(g2, where, f"{arg} w2_weight_scale_2")

        return cls._from_experts(
            where, h, i, n_experts, checked, router_weight.device, (shared_gate_proj, shared_up_proj, shared_down_proj),
            router_weight, bias, routing, compute_mode,
        )

    def to_hf_modelopt(self) -> dict[str, Tensor]:
        """The layer as NVIDIA ModelOpt checkpoint tensors named as in a
        transformers DeepSeek MoE block (the inverse of
        :meth:`from_hf_modelopt`), on the CPU: ``experts.<e>.gate_proj`` /
        ``up_proj`` / ``down_proj`` (``weight``, ``weight_scale``,
        ``weight_scale_2``; gate and up share the expert's global),
        ``shared_experts.*`` likewise, and the router as ``gate.weight``,
        ``gate.e_score_correction_bias`` and ``gate.tid2eid`` (hash mode)."""
        h, i, e = self.hidden_size, self.intermediate_size, self.n_experts
        w13, s13, w2, s2 = nvfp4_moe_unprepack(self.w13.cpu(), self.w13_scale.cpu(), self.w2.cpu(),
                                               self.w2_scale.cpu(), h, i)
        g13, g2 = self.w13_global.detach().cpu(), self.w2_global.detach().cpu()
        out: dict[str, Tensor] = {}

        def add(prefix: str, weight: Tensor, scale: Tensor, global_: Tensor) -> None:
            # Clones: a view would share the stacked tensor's storage.
            out.update({f"{prefix}.weight": weight.clone(), f"{prefix}.weight_scale": scale.clone(),
                        f"{prefix}.weight_scale_2": global_.clone()})

        for j in range(e + (1 if self.shared_fused else 0)):
            prefix = f"experts.{j}" if j < e else "shared_experts"
            add(f"{prefix}.gate_proj", w13[j, :i], s13[j, :i], g13[j])
            add(f"{prefix}.up_proj", w13[j, i:], s13[j, i:], g13[j])
            add(f"{prefix}.down_proj", w2[j], s2[j], g2[j])
        if self.shared_gate_up is not None:
            si = self.shared_intermediate_size
            gate_up, down = self.shared_gate_up.to_modelopt(), self.shared_down.to_modelopt()
            add("shared_experts.gate_proj", gate_up["weight"][:si], gate_up["weight_scale"][:si],
                gate_up["weight_scale_2"])
            add("shared_experts.up_proj", gate_up["weight"][si:], gate_up["weight_scale"][si:],
                gate_up["weight_scale_2"])
            add("shared_experts.down_proj", down["weight"], down["weight_scale"], down["weight_scale_2"])
        router = self.router
        out["gate.weight"] = router.weight.detach().cpu().clone()
        if router.e_score_correction_bias is not None:
            out["gate.e_score_correction_bias"] = router.e_score_correction_bias.detach().cpu().clone()
        if self.mode == "hash":
            out["gate.tid2eid"] = router.tid2eid.detach().cpu().clone()
        return out

    # ---- forward ----------------------------------------------------------

    def _swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        limit = self.swiglu_limit
        if limit is not None:
            gate = gate.clamp(max=limit)
            up = up.clamp(-limit, limit)
        return F.silu(gate) * up

    def _shared_unfused(self, x: Tensor) -> Tensor:
        gate_up = self.shared_gate_up(x).float()
        gate, up = gate_up.split(self.shared_intermediate_size, dim=-1)
        return self.shared_down(self._swiglu(gate, up).to(x.dtype))

    def forward(self, hidden_states: Tensor, token_ids: Tensor | None = None, *,
                input_ids: Tensor | None = None) -> Tensor:
        """hidden_states [..., H] (bf16/fp16; fp32 on CPU) and, in hash mode,
        token_ids [...] (int64/int32) -> [..., H] in hidden_states' dtype.
        ``input_ids`` is another name for ``token_ids`` (transformers'
        DeepSeek-V4 decoder layers pass it to every MoE block; unused in
        dense mode).

        Routing sees hidden_states in the gate weight's dtype (fp16 input is
        cast to bf16 for the gate GEMM). Under ``torch.autocast``
        hidden_states is first cast to the autocast dtype, as the
        ``nn.Linear`` experts it replaces would see it."""
        hidden_states = autocast_input(hidden_states)
        if input_ids is not None:
            if token_ids is not None:
                raise ValueError("Nvfp4MoE: give the token ids as 'token_ids' or 'input_ids', not both")
            token_ids = input_ids
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"Nvfp4MoE: argument 'hidden_states' must have shape [..., {self.hidden_size}], "
                f"got {list(hidden_states.shape)}"
            )
        if self.mode == "hash":
            if token_ids is None:
                raise ValueError("Nvfp4MoE: argument 'token_ids' is required in hash mode")
            if token_ids.shape != hidden_states.shape[:-1]:
                raise ValueError(
                    f"Nvfp4MoE: argument 'token_ids' must have shape {list(hidden_states.shape[:-1])} "
                    f"(hidden_states' leading dimensions), got {list(token_ids.shape)}"
                )
            token_ids = token_ids.reshape(-1)
        x = hidden_states.reshape(-1, self.hidden_size)
        gate_in = x if x.dtype == self.router.weight.dtype else x.to(self.router.weight.dtype)
        weights, ids = self.router(gate_in, token_ids)
        if self.shared_fused:
            # The shared expert is expert E: one more slot per token, weight 1.
            ids = torch.cat([ids, torch.full_like(ids[:, :1], self.n_experts)], dim=1)
            weights = torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1)
        y = nvfp4_moe(x, weights, ids, self.w13, self.w13_scale, self.w13_global, self.w2, self.w2_scale,
                      self.w2_global, self.swiglu_limit, self._fp8_rows,
                      self.w13_fp8, self.w13_fp8_scale, self.w2_fp8, self.w2_fp8_scale)
        if self.shared_gate_up is not None:
            y = y + self._shared_unfused(x)
        return y.view(hidden_states.shape)

    def extra_repr(self) -> str:
        if self.shared_intermediate_size is None:
            shared = "none"
        else:
            how = f"fused as expert {self.n_experts}" if self.shared_fused else "separate Nvfp4Linear"
            shared = f"{self.shared_intermediate_size} ({how})"
        compute = ""
        if self._compute == "fp8":
            compute = ", compute=fp8"
        elif self._compute == "auto":
            compute = f", compute=auto (FP8 from {self._fp8_rows} tokens)"
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"n_experts={self.n_experts}, k={self.k}, mode={self.mode}, swiglu_limit={self.swiglu_limit}, "
            f"shared_expert={shared}, format=nvfp4 (W4A16, group 16, prepacked), device={self.w13.device}{compute}"
        )
