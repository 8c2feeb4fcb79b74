"""Independent float64 reference of the NVFP4 MoE experts, in plain torch
(never calling lowbit): weights are dequantized from the checkpoint layout by
nvfp4_reference.dequantize, and each expert runs its tokens one expert at a
time, written from the DeepSeek-V3 / V4 math:

    out[t] = sum_j w[t, j] * W2_e h,  h = silu(gate) * up,  [gate | up] = W13_e x[t]
    gate = min(gate, L), up = clamp(up, -L, L)  (with a SwiGLU limit L)

``h_dtype`` rounds h to the activation dtype before the second GEMM, as the
kernels must (their second GEMM reads h in x's dtype); everything else stays
float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import nvfp4_reference as nvref


def dequantize_experts(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Stacked checkpoint tensors uint8 [E, N, K/2], E4M3 [E, N, K/16] (float8 or
    uint8 codes), float32 [E] -> float64 [E, N, K] on the same device."""
    codes = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    return nvref.dequantize(packed, codes, global_scale.float().reshape(-1)).double()


@dataclass
class ClampStats:
    gate_clamped: int = 0  # gate values above L
    up_clamped: int = 0  # up values outside [-L, L]
    total: int = 0  # gate (or up) values computed


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None, stats: ClampStats | None = None):
    if limit is not None:
        if stats is not None:
            stats.gate_clamped += int((gate > limit).sum())
            stats.up_clamped += int((up.abs() > limit).sum())
            stats.total += gate.numel()
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, limit: float | None = None,
               h_dtype: torch.dtype | None = None, stats: ClampStats | None = None) -> torch.Tensor:
    """x [T, H], w13 [2I, H] (gate rows first), w2 [H, I] -> float64 [T, H]."""
    gate_up = x.double() @ w13.double().T
    inter = w13.shape[0] // 2
    h = swiglu(gate_up[:, :inter], gate_up[:, inter:], limit, stats)
    if h_dtype is not None:
        h = h.to(h_dtype).double()
    return h @ w2.double().T


def moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        limit: float | None = None, h_dtype: torch.dtype | None = None, drop_invalid: bool = False,
        stats: ClampStats | None = None) -> torch.Tensor:
    """Routed experts in float64: x [M, H], topk_weights [M, k], topk_ids [M, k],
    w13 [E, 2I, H], w2 [E, H, I] (dequantized or unquantized) -> [M, H].

    Runs on w13's device. Slots with an id outside [0, E) raise unless
    ``drop_invalid``, which leaves them out (what the GPU kernel does)."""
    dev = w13.device
    x = x.to(dev)
    ids = topk_ids.to(dev).long()
    w = topk_weights.to(dev).double()
    n_experts = w13.shape[0]
    valid = (ids >= 0) & (ids < n_experts)
    if not drop_invalid and not bool(valid.all()):
        raise ValueError("moe_reference: topk_ids outside [0, E)")
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=dev)
    for e in range(n_experts):
        hits = ids == e  # [M, k]; an expert may sit in several slots of one token
        tokens = hits.any(1).nonzero().flatten()
        if tokens.numel() == 0:
            continue
        y = expert_mlp(x[tokens], w13[e], w2[e], limit, h_dtype, stats)
        coef = (w * hits).sum(1)[tokens]  # each token's summed weight of expert e
        out[tokens] += coef.unsqueeze(1) * y
    return out


def e4m3_rows(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The E4M3 row rule (README.md, Formats): each row of float32 values v
    [R, C] times 448 / its amax (rounded once in float32), rounded to E4M3.
    -> (the codes as float64, the row amaxes float32)."""
    v = v.float()
    amax = v.abs().amax(1)
    r = torch.where(amax > 0, torch.full_like(amax, 448.0) / amax, torch.zeros_like(amax))
    return (v * r[:, None]).to(torch.float8_e4m3fn).double(), amax


def fp8_expert_rows(values: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's weight rows [N, K] (e2m1 x block scale, the global left
    out) -> (codes float64, row scales float32 amax x global / 448)."""
    codes, amax = e4m3_rows(values)
    return codes, (amax * global_scale.float()) / 448.0


def fp8_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_values: torch.Tensor,
            g13: torch.Tensor, w2_values: torch.Tensor, g2: torch.Tensor, limit: float | None = None,
            drop_invalid: bool = False) -> torch.Tensor:
    """The MoE's FP8 path, float64 on w13_values' device: x rows and each
    expert's weight rows (``*_values`` [E, N, K]: e2m1 x block scale, globals
    ``g13`` / ``g2`` [E] apart) rounded to E4M3 by the row rule; each GEMM the
    codes' products summed in float64, times the two row scales, rounded to
    BF16 (the grouped GEMMs' output); the clamped SwiGLU of those, rounded to
    E4M3 per row; the combine over the slots in float64. -> [M, H]."""
    dev = w13_values.device
    ids = topk_ids.to(dev).long()
    w = topk_weights.to(dev).double()
    n_experts = w13_values.shape[0]
    inter = w13_values.shape[1] // 2
    valid = (ids >= 0) & (ids < n_experts)
    if not drop_invalid and not bool(valid.all()):
        raise ValueError("moe_reference: topk_ids outside [0, E)")
    x8, x_amax = e4m3_rows(x.to(dev).float())
    x_scale = x_amax / 448.0
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=dev)
    for e in range(n_experts):
        hits = ids == e
        tokens = hits.any(1).nonzero().flatten()
        if tokens.numel() == 0:
            continue
        w13_8, w13_s = fp8_expert_rows(w13_values[e], g13[e])
        w2_8, w2_s = fp8_expert_rows(w2_values[e], g2[e])
        gu = (x8[tokens] @ w13_8.T) * x_scale[tokens].double()[:, None] * w13_s.double()[None, :]
        gu = gu.to(torch.bfloat16).float()
        h = swiglu(gu[:, :inter], gu[:, inter:], limit)
        h8, h_amax = e4m3_rows(h)
        y = (h8 @ w2_8.T) * (h_amax / 448.0).double()[:, None] * w2_s.double()[None, :]
        y = y.to(torch.bfloat16).double()
        out[tokens] += (w * hits).sum(1)[tokens].unsqueeze(1) * y
    return out
