"""Independent NVFP4 reference for the tests, in plain torch (never lowbit).

Written from the format description, not from lowbit's code: E2M1 rounding is
a nearest-neighbour search over the 8 magnitudes with ties to the even index,
done in float64 so that ties are exact; E4M3 rounding is torch's own cast.
"""

from __future__ import annotations

import torch

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
E4M3_NAN_CODE = 0x7F


def e2m1_magnitude(q: torch.Tensor) -> torch.Tensor:
    """|q| (float32, clamped to 6) -> magnitude code 0..7; NaN -> 0."""
    mags = E2M1_MAGNITUDES.to(q.device)
    dist = (q.double().abs().unsqueeze(-1) - mags).abs()
    is_min = dist == dist.min(dim=-1, keepdim=True).values
    even = (torch.arange(8, device=q.device) % 2 == 0).to(torch.int64)
    index = (is_min.to(torch.int64) * (1 + even)).argmax(dim=-1).to(torch.uint8)
    return torch.where(torch.isnan(q), torch.zeros_like(index), index)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    mag = E2M1_MAGNITUDES.to(code.device).float()[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def e4m3_encode(r: torch.Tensor) -> torch.Tensor:
    """float32 in [2^-6, 448] or NaN -> uint8 E4M3 codes (NaN normalised to 0x7f)."""
    code = r.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(r), torch.full_like(code, E4M3_NAN_CODE), code)


def quantize(x: torch.Tensor, global_scale: torch.Tensor | None = None):
    """x [..., N, K] -> (packed uint8, scale codes uint8, global float32); the
    leading dimension of a 3-D x is the expert (one global scale each)."""
    xf = x.float()
    stacked = xf.dim() == 3
    if global_scale is None:
        amax = xf.abs().amax(dim=(-2, -1)) if stacked else xf.abs().max()
        global_scale = amax / 2688.0
    s = global_scale.float().reshape(-1, 1, 1) if stacked else global_scale.float()
    blocks = xf.unflatten(-1, (-1, 16))
    block_amax = blocks.abs().amax(dim=-1)  # propagates NaN
    ratio = torch.where(s == 0, torch.zeros_like(block_amax), block_amax / 6.0 / s)
    scale_code = e4m3_encode(ratio.clamp(2.0**-6, 448.0))
    denom = (s * scale_code.view(torch.float8_e4m3fn).float()).unsqueeze(-1)
    magnitude = e2m1_magnitude((blocks / denom).clamp(-6.0, 6.0))
    # every code carries the sign of its input element (zeros and NaN too)
    codes = (magnitude | (torch.signbit(blocks).to(torch.uint8) << 3)).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scale_code, global_scale.float().reshape(global_scale.shape)


def dequantize(packed: torch.Tensor, scale_code: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    vals = e2m1_decode(codes).unflatten(-1, (-1, 16))
    b = scale_code.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    s = global_scale.float().reshape(-1, 1, 1, 1) if packed.dim() == 3 else global_scale.float()
    return ((vals * b) * s).flatten(-2)
