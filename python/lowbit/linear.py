"""NVFP4 Linear (W4A16): typed wrappers of ``lowbit::nvfp4_prepack`` /
``lowbit::nvfp4_linear`` (:func:`lowbit.quantize_` swaps a model's
``nn.Linear`` layers for :class:`lowbit.nn.Nvfp4Linear`).

The weight is prepacked once, at load time, into the layout of
``csrc/lowbit/linear/nvfp4_linear_layout.h`` (the same on CPU and GPU, so a module can
be moved with ``.to()``). On CUDA, fused decode + tensor core kernels run
M <= 2048 rows (mma.sync up to 16 rows, then wgmma; the dispatch table is in
``csrc/lowbit/linear/sm90_linear_plan.h``); above that the weight is unpacked to x's
dtype and cuBLAS runs. The CPU kernel (the reference) unpacks to FP32 and
does an FP32 matmul.

The FP8 path (``fp8_min_rows``) multiplies E4M3 forms of W and x on the
FP8 tensor cores; W's form is made once by :func:`nvfp4_to_fp8` and passed
as ``weight_fp8`` / ``weight_fp8_scale`` (what ``Nvfp4Linear(compute=...)``
does), or made on every call without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ._autograd import register_inference_only
from ._library import has_cuda_kernels


class Nvfp4PrepackedWeight(NamedTuple):
    """weight: uint8 [N, Kp/2], scale: uint8 [N, (2 Kp - K)/16], Kp = K
    rounded up to 128: the tiles' scales, then one byte per row and padding
    block of 16 columns, so that the shapes record K (the ops check x's K,
    or their ``k``, against it)."""

    weight: Tensor
    scale: Tensor


def nvfp4_prepack(weight: Tensor, weight_scale: Tensor) -> Nvfp4PrepackedWeight:
    """Checkpoint layout (``weight`` uint8 [N, K/2], ``weight_scale``
    float8_e4m3fn or uint8 codes [N, K/16]; N, K multiples of 16) -> the
    prepacked layout that :func:`nvfp4_linear` takes."""
    w, s = torch.ops.lowbit.nvfp4_prepack(weight, weight_scale)
    return Nvfp4PrepackedWeight(w, s)


class Nvfp4CheckpointWeight(NamedTuple):
    """weight: uint8 [N, K/2] codes, weight_scale: float8_e4m3fn [N, K/16]."""

    weight: Tensor
    weight_scale: Tensor


def nvfp4_unprepack(weight: Tensor, weight_scale: Tensor, k: int) -> Nvfp4CheckpointWeight:
    """The inverse of :func:`nvfp4_prepack`: the prepacked weight of a layer
    with ``k`` input features back in the checkpoint layout, to save it.
    Byte for byte the original for positive finite block scales (all that
    quantizers write); zero, negative and NaN block scales, which the
    prepacked layout folds into the codes, come back as the same values
    (see csrc/lowbit/linear/nvfp4_linear.h). Runs on the host; the outputs are on
    the weight's device."""
    w, s = torch.ops.lowbit.nvfp4_unprepack(weight, weight_scale, k)
    return Nvfp4CheckpointWeight(w, s)


def nvfp4_unpack(
    weight: Tensor, weight_scale: Tensor, weight_global: Tensor, k: int, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """The prepacked weight (:func:`nvfp4_prepack`) dequantized: [N, K] in
    ``dtype`` (float32, bfloat16 or float16), e2m1 * block scale * global
    rounded once. ``k``: the layer's K (the layout pads it to 128)."""
    return torch.ops.lowbit.nvfp4_unpack(weight, weight_scale, weight_global, k, dtype)


class Nvfp4Fp8Weight(NamedTuple):
    """weight: float8_e4m3fn [N, K] codes, scale: float32 [N] row scales
    (the global scale folded in): W ~= weight * scale[:, None]."""

    weight: Tensor
    scale: Tensor


def nvfp4_to_fp8(weight: Tensor, weight_scale: Tensor, weight_global: Tensor, k: int) -> Nvfp4Fp8Weight:
    """The prepacked weight (:func:`nvfp4_prepack`, ``k`` input features)
    in the E4M3 form the FP8 path of :func:`nvfp4_linear` multiplies, made
    once (at load time) instead of on every call: 1 byte a weight and 4 a
    row, beside the NVFP4 weight's 0.5625 a weight.

    The rule, per row of values v = e2m1 * block scale (exact in FP32, the
    global scale left out), in FP32: amax = the largest |v| that is not NaN
    (0 if none); r = 448 / amax (0 when amax is 0); code = E4M3(v * r)
    rounded to nearest even, saturating at +-448, NaN to NaN, zeros keeping
    their sign; scale = amax * weight_global / 448. The CPU kernel is the
    reference (csrc/lowbit/linear/nvfp4_linear.h); the CUDA kernel gives
    the same bits."""
    w8, scale = torch.ops.lowbit.nvfp4_to_fp8(weight, weight_scale, weight_global, k)
    return Nvfp4Fp8Weight(w8, scale)


register_inference_only("nvfp4_to_fp8")


def nvfp4_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    weight_global: Tensor,
    bias: Tensor | None = None,
    fp8_min_rows: int = 0,
    weight_fp8: Tensor | None = None,
    weight_fp8_scale: Tensor | None = None,
) -> Tensor:
    """y = x W^T * weight_global (+ bias): x [..., K] bf16/fp16/fp32 (fp32:
    on CUDA the weight unpacked to FP32 and an FP32 matmul, as on the CPU),
    ``weight`` / ``weight_scale`` from :func:`nvfp4_prepack`, ``weight_global``
    float32 [] (ModelOpt's ``weight_scale_2``), bias [N] in x's dtype.
    Returns [..., N] in x's dtype.

    ``fp8_min_rows`` > 0 turns on the FP8 path for calls with at least that
    many rows of x (the product of its leading dimensions; the choice is
    made inside the op, so one traced graph serves every M): W and x are
    rounded to FP8 E4M3 with one scale per row and multiplied on the FP8
    tensor cores, with an extra error of about 4e-2 relative (README.md,
    Formats); 0, the default, never uses it. ``weight_fp8`` /
    ``weight_fp8_scale`` (from :func:`nvfp4_to_fp8` on the same weight;
    only with ``fp8_min_rows`` > 0) are W's E4M3 form made once; without
    them the FP8 path makes it on every call. Both give the same result:
    the cached form only saves the per-call W pass.

    Differentiable in ``x`` (and ``bias``): the gradient is ``grad_y @ W``
    with W unpacked to grad_y's dtype (:func:`nvfp4_unpack`; on the FP8 path
    too, i.e. straight through its rounding), so adapters such as LoRA can
    be trained on a frozen NVFP4 layer. The weight itself gets none."""
    return torch.ops.lowbit.nvfp4_linear(
        x, weight, weight_scale, weight_global, bias, fp8_min_rows, weight_fp8, weight_fp8_scale
    )


def _linear_setup_context(ctx, inputs, output) -> None:
    x, weight, weight_scale, weight_global = inputs[:4]
    ctx.save_for_backward(weight, weight_scale, weight_global)
    ctx.k = x.shape[-1]


def _linear_backward(ctx, grad_y: Tensor):
    # One gradient per argument passed: the dispatcher drops trailing
    # arguments left at their defaults (bias, fp8_min_rows, the FP8
    # weight), so needs_input_grad may hold only x's and the weight's.
    weight, weight_scale, weight_global = ctx.saved_tensors
    needs = ctx.needs_input_grad
    grads: list[Tensor | None] = [None] * len(needs)
    if needs[0]:
        grads[0] = grad_y @ nvfp4_unpack(weight, weight_scale, weight_global, ctx.k, grad_y.dtype)
    if len(needs) > 4 and needs[4]:
        grads[4] = grad_y.reshape(-1, grad_y.shape[-1]).sum(0)
    return tuple(grads)


torch.library.register_autograd("lowbit::nvfp4_linear", _linear_backward, setup_context=_linear_setup_context)


def _nvfp4_linear_with_plan(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    weight_global: Tensor,
    bias: Tensor | None = None,
    fp8_min_rows: int = 0,
    *,
    plan: str = "",
) -> Tensor:
    """:func:`nvfp4_linear` with kernel choices forced for this call, for
    tests and probes (private; no backward). ``plan``: "key=value" items
    separated by commas, e.g. ``"path=stream,stream_tiles=2"`` (the keys:
    csrc/lowbit/linear/sm90_linear_plan.h, "Overrides"); "" is the shipped
    plan. A bad item raises ValueError naming its key, on every device; the
    CPU kernel has one path and leaves the plan unused, as do the FP8 path
    (no cached FP8 weight here: made per call) and float32 x on CUDA."""
    return torch.ops.lowbit._nvfp4_linear_with_plan(x, weight, weight_scale, weight_global, bias, fp8_min_rows, plan)


register_inference_only("_nvfp4_linear_with_plan")


@dataclass(frozen=True)
class LinearPlanExplanation:
    """Which kernel runs an NVFP4 Linear of M rows of x, N outputs and K
    inputs, and why (:func:`explain_plan`); ``str()`` gives all of it."""

    m: int
    n: int
    k: int
    device: str
    path: str  # stream, narrow, panel, wide, wgmma or unpack (CUDA); reference (CPU); none (M, N or K is 0)
    form: str  # the kernel form that runs: the path, or stream-k
    kernel: str  # the form and its shape: warps, K splits, clusters, CTAs per SM
    why: str  # the rule of the plan that picked it (and a limit that then moved it, if any)
    workspace_bytes: int  # device memory the call takes beside x, W and the output
    text: str  # every line of the plan, "key: value"

    def __str__(self) -> str:
        body = "\n".join("  " + line for line in self.text.splitlines())
        return f"lowbit.nvfp4_linear, M={self.m} N={self.n} K={self.k} on {self.device}:\n{body}"


def _plan_device_index(device) -> tuple[str, int]:
    """(name, index for lowbit::_explain_linear_plan: -1 for the CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() and has_cuda_kernels() else "cpu"
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu", -1
    if device.type != "cuda":
        raise ValueError(f"lowbit.explain_plan: device must be a CUDA device or the CPU, got {device}")
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return f"cuda:{index}", index


def _explain_plan(m: int, n: int, k: int, device=None, plan: str = "") -> LinearPlanExplanation:
    """:func:`explain_plan` under a plan string (private: tests, probes)."""
    name, index = _plan_device_index(device)
    text = torch.ops.lowbit._explain_linear_plan(m, n, k, index, plan)
    fields = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    return LinearPlanExplanation(m, n, k, name, fields["path"], fields["form"], fields["kernel"], fields["why"],
                                 int(fields["workspace"].split()[0]), text)


def explain_plan(m: int, n: int, k: int, device=None) -> LinearPlanExplanation:
    """Which kernel :func:`nvfp4_linear` runs for ``m`` rows of x (the
    product of its leading dimensions), ``n`` outputs and ``k`` inputs (N
    and K multiples of 16) on ``device``, and why: the form (stream,
    stream-k, narrow, panel, wide, wgmma, or the weight unpacked + cuBLAS),
    its shape (warps, K splits, CTAs per SM), the rule of the plan that
    picked it, and the workspace it takes. ``device``: a CUDA device (by
    default the current one when CUDA is available) or ``"cpu"``, where one
    reference path runs every shape. For bfloat16 / float16 x without the
    FP8 mode (float32 x runs the reference on every device; calls of
    ``fp8_min_rows`` rows or more run the FP8 GEMM). The plan depends on the
    GPU (SM count, shared memory, occupancy), so ask on the GPU that runs
    the model. Raises ValueError for negative sizes or N, K not multiples of
    16, NotImplementedError on a GPU lowbit has no kernels for."""
    return _explain_plan(m, n, k, device)


def nvfp4_grouped_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, weight_global: Tensor, n_groups: int, max_fused_rows: int = 256
) -> Tensor:
    """The block-diagonal Linear (DeepSeek-V4's ``o_a_proj``): x [..., G, K]
    -> [..., G, N], y[..., g, :] = x[..., g, :] W_g^T * weight_global, W_g
    rows [g N, (g + 1) N) of the weight [G N, K] (prepacked by
    :func:`nvfp4_prepack`), G = ``n_groups``. Accumulates in FP32, rounds
    once to x's dtype.

    On CUDA, up to ``max_fused_rows`` rows of x (tokens times G) one
    nvfp4_linear runs over all groups, every token's G slices against the
    whole weight, and the diagonal blocks are kept: G times the products,
    but the weight is read once, which is what decode is bound by. Above,
    where N and K are multiples of 128, one wgmma kernel runs all groups,
    each 128-row W block on its group's columns of x; otherwise the weight
    is unpacked to x's dtype and one batched matmul runs. The choice is made
    inside the op, so one traced or exported graph serves every token
    count. The CPU kernel (the reference) unpacks to FP32 (the same math
    whatever ``max_fused_rows``). Differentiable in x, as
    :func:`nvfp4_linear`."""
    return torch.ops.lowbit.nvfp4_grouped_linear(x, weight, weight_scale, weight_global, n_groups, max_fused_rows)


def _grouped_setup_context(ctx, inputs, output) -> None:
    x, weight, weight_scale, weight_global, n_groups, _max_fused_rows = inputs
    ctx.save_for_backward(weight, weight_scale, weight_global)
    ctx.k, ctx.n_groups = x.shape[-1], n_groups


def _grouped_backward(ctx, grad_y: Tensor):
    weight, weight_scale, weight_global = ctx.saved_tensors
    grads: list[Tensor | None] = [None] * len(ctx.needs_input_grad)  # one per argument passed
    if ctx.needs_input_grad[0]:
        w = nvfp4_unpack(weight, weight_scale, weight_global, ctx.k, grad_y.dtype)
        grads[0] = torch.einsum("...gn,gnk->...gk", grad_y, w.view(ctx.n_groups, -1, ctx.k))
    return tuple(grads)


torch.library.register_autograd(
    "lowbit::nvfp4_grouped_linear", _grouped_backward, setup_context=_grouped_setup_context
)
