"""Independent reference of the FP8 training recipes (docs/fp8.md), written
with plain torch ops and never calling lowbit: the quantized operands bit for
bit, and the GEMMs / Linear gradients in float64 on those operands."""

from __future__ import annotations

import torch

FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCK = 128
SMALLEST_SUBNORMAL = torch.tensor(2.0**-149, dtype=torch.float32)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= s for finite s > 0; others unchanged."""
    mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
    up = torch.where(mant == 0.5, s, torch.ldexp(torch.ones_like(s), exp))
    return torch.where(torch.isfinite(s) & (s > 0), up, s)


def scale_from_amax(amax: torch.Tensor, fmt: str, margin: int = 0, pow2: bool = False) -> torch.Tensor:
    amax = amax.to(torch.float32)
    s = amax / torch.tensor(FMAX[fmt], dtype=torch.float32)
    s = s * torch.tensor(2.0**margin, dtype=torch.float32)
    if pow2:
        s = pow2_ceil(s)
    s = torch.where(s == 0, SMALLEST_SUBNORMAL, s)
    return torch.where(amax == 0, torch.ones_like(s), s)


def encode(x: torch.Tensor, s: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP8 codes (uint8) of x / s: IEEE float32 division, clamp to +-fmax
    (saturation, also of inf), round to nearest even; NaN -> 0x7f."""
    q = x.to(torch.float32) / s
    codes = q.clamp(-FMAX[fmt], FMAX[fmt]).to(DTYPE[fmt]).view(torch.uint8)
    return torch.where(torch.isnan(q), torch.full_like(codes, 0x7F), codes)


def decode(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    return codes.view(DTYPE[fmt]).to(torch.float64)


def _amax(x: torch.Tensor, dims) -> torch.Tensor:
    a = x.to(torch.float32).abs()
    if a.numel() == 0:
        shape = [n for d, n in enumerate(a.shape) if d not in dims]
        return torch.zeros(shape, dtype=torch.float32)
    return a.amax(dim=dims)


def _pad(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros(rows, cols, dtype=torch.float32)
    out[: x.shape[0], : x.shape[1]] = x.to(torch.float32)
    return out


def scales(x: torch.Tensor, scaling: str, fmt: str, pow2: bool = False) -> torch.Tensor:
    """The scales of x [M, K] under `scaling` (fp8_cast's shapes)."""
    m, k = x.shape
    if scaling == "tensor":
        return scale_from_amax(_amax(x, (0, 1)), fmt, pow2=pow2)
    if scaling == "row":
        return scale_from_amax(_amax(x, (1,)), fmt, pow2=pow2)
    kb, mb = ceil_div(k, BLOCK), ceil_div(m, BLOCK)
    if scaling == "block":
        padded = _pad(x, m, kb * BLOCK).reshape(m, kb, BLOCK)
        return scale_from_amax(_amax(padded, (2,)), fmt, pow2=pow2)
    if scaling == "block2d":
        padded = _pad(x, mb * BLOCK, kb * BLOCK).reshape(mb, BLOCK, kb, BLOCK)
        return scale_from_amax(_amax(padded, (1, 3)), fmt, pow2=pow2)
    raise ValueError(scaling)


def expand_scales(s: torch.Tensor, scaling: str, m: int, k: int) -> torch.Tensor:
    """Per-element scale [M, K]."""
    if scaling == "tensor":
        return s.expand(m, k)
    if scaling == "row":
        return s.unsqueeze(1).expand(m, k)
    if scaling == "block":
        return s.repeat_interleave(BLOCK, dim=1)[:, :k]
    return s.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:m, :k]


def quantize(x: torch.Tensor, scaling: str, fmt: str = "e4m3", pow2: bool = False, scale=None):
    """(codes uint8 [M, K], scales float32) of x [M, K]; `scale` ([]) given:
    tensor scaling with it."""
    s = scale.to(torch.float32).reshape(()) if scale is not None else scales(x, scaling, fmt, pow2)
    m, k = x.shape
    return encode(x, expand_scales(s, scaling, m, k), fmt), s


def cast(x: torch.Tensor, scaling: str, fmt: str = "e4m3", transpose: bool = False, scale=None, pow2=False):
    """What lowbit.fp8_cast returns: (data, scale, data_t, scale_t, amax)
    with the codes as uint8."""
    data, s = quantize(x, scaling, fmt, pow2, scale)
    amax = _amax(x, (0, 1))
    if not transpose:
        return data, s, None, None, amax
    if scaling == "tensor":
        return data, s, data.t().contiguous(), s, amax
    if scaling == "block2d":
        return data, s, data.t().contiguous(), s.t().contiguous(), amax
    data_t, s_t = quantize(x.t(), scaling, fmt, pow2)
    return data, s, data_t, s_t, amax


def dequantize(codes: torch.Tensor, s: torch.Tensor, scaling: str, fmt: str) -> torch.Tensor:
    m, k = codes.shape
    return decode(codes, fmt) * expand_scales(s.to(torch.float64), scaling, m, k)


def gemm(a, sa, b, sb, scaling_a, scaling_b, fmt_a="e4m3", fmt_b="e4m3", bias=None) -> torch.Tensor:
    """float64 y = dequant(a) dequant(b)^T (+ bias), a, b uint8 codes."""
    y = dequantize(a, sa, scaling_a, fmt_a) @ dequantize(b, sb, scaling_b, fmt_b).t()
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y


def gemm_tolerance(a, sa, b, sb, scaling_a, scaling_b, fmt_a, fmt_b, out_dtype, device="cpu",
                   fast_accum=False) -> torch.Tensor:
    """Bound on |fp8_gemm - float64 product| per element: FP32 accumulation
    (each of the K products and partial sums rounded at most once per
    addition: K * 2^-24 times the sum of |products|, doubled for slack and
    the dequantization roundings), plus one rounding to out_dtype.

    On a Hopper GPU (device "cuda") the FP8 tensor cores accumulate with
    about 14 significant bits (DeepSeek-V3 technical report, section 3.3.2),
    and cuBLASLt promotes their partial sums to FP32 at intervals; so the
    bound there adds 2^-10 of the sum of |products| (the differences seen on
    an H100 reached about 2^-12.5 of it). That is still 64 times below one
    E4M3 rounding, so a wrong scale or block still fails.

    With ``fast_accum`` (tensor or row scales) nothing is promoted: the
    accumulator takes one add per 32-wide MMA step along K, each rounding
    off at most 2^-13 of a partial sum bounded by the sum of |products|, so
    the bound adds ceil(K/32) * 2^-13 of it (2^-8 at K = 1024: still 16
    times below one E4M3 rounding)."""
    abs_prod = dequantize(a, sa, scaling_a, fmt_a).abs() @ dequantize(b, sb, scaling_b, fmt_b).abs().t()
    k = a.shape[1]
    acc = abs_prod * (2 * (k + 2) * 2.0**-24) + 1e-30
    if str(device).startswith("cuda"):
        acc = acc + abs_prod * 2.0**-10
        if fast_accum and scaling_a != "block":
            acc = acc + abs_prod * (-(-k // 32) * 2.0**-13)
    out_eps = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[out_dtype]
    return acc, out_eps


def assert_gemm_close(got: torch.Tensor, want: torch.Tensor, acc: torch.Tensor, out_eps: float) -> None:
    got64 = got.to(torch.float64).cpu()
    bound = acc + out_eps * (want.abs() + acc)
    err = (got64 - want).abs()
    bad = err > bound
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.numel()} elements off; worst excess {float((err - bound).max())} at "
        f"{torch.nonzero(bad)[0].tolist()}"
    )


# ---- the Linear ---------------------------------------------------------------

ACT = {"tensorwise": "tensor", "delayed": "tensor", "rowwise": "row", "blockwise": "block"}
WEIGHT = {"tensorwise": "tensor", "delayed": "tensor", "rowwise": "row", "blockwise": "block2d"}


def delayed_scale(history_row: torch.Tensor, fmt: str, amax_compute: str, margin: int, pow2: bool):
    reduced = history_row.amax() if amax_compute == "max" else history_row[0]
    return scale_from_amax(reduced, fmt, margin, pow2)


def roll(history_row: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The row after recording ``amax``; a non-finite amax records the
    row's most recent value again (docs/fp8.md, delayed scaling)."""
    amax = amax.reshape(1).to(torch.float32)
    if not torch.isfinite(amax).all():
        amax = history_row[:1].clone()
    return torch.cat([amax, history_row[:-1]])


def linear_operands(x, w, dy, recipe, history=None):
    """The quantized operands of one Linear step (forward and backward) and
    the history after it: a dict of (codes, scales) pairs with the formats.
    recipe: lowbit.Fp8Recipe (or anything with its fields)."""
    act, wsc = ACT[recipe.name], WEIGHT[recipe.name]
    g = recipe.grad_format
    sx = sw = sdy = None
    new_history = None
    if recipe.name == "delayed":
        args = (recipe.amax_compute, recipe.margin, recipe.pow2_scales)
        sx = delayed_scale(history[0], "e4m3", *args)
        sw = delayed_scale(history[1], "e4m3", *args)
        sdy = delayed_scale(history[2], g, *args)
    cx = cast(x, act, "e4m3", True, sx, recipe.pow2_scales)
    cw = cast(w, wsc, "e4m3", True, sw, recipe.pow2_scales)
    cdy = cast(dy, act, g, True, sdy, recipe.pow2_scales)
    if recipe.name == "delayed":
        new_history = torch.stack([roll(history[0], cx[4]), roll(history[1], cw[4]), roll(history[2], cdy[4])])
    return {"x": cx, "w": cw, "dy": cdy, "act": act, "wsc": wsc, "grad": g, "history": new_history}


def linear_step(ops, bias=None):
    """float64 (y, dx, dw, dbias-less) of a Linear step on the quantized
    operands `ops` (linear_operands)."""
    cx, cw, cdy = ops["x"], ops["w"], ops["dy"]
    act, wsc, g = ops["act"], ops["wsc"], ops["grad"]
    y = gemm(cx[0], cx[1], cw[0], cw[1], act, wsc, "e4m3", "e4m3", bias)
    dx = gemm(cdy[0], cdy[1], cw[2], cw[3], act, wsc, g, "e4m3")
    dw = gemm(cdy[2], cdy[3], cx[2], cx[3], act, act, g, "e4m3")
    return y, dx, dw
