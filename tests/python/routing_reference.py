"""Independent float64 references of the MoE routers and top-k, in plain
torch (never calling lowbit), written from the rules of the DeepSeek-V3 / V4
reference models: selection by a stable descending sort, so equal scores go
to the lower index."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    x = logits.double()
    if score_func == "sqrtsoftplus":
        return F.softplus(x).sqrt()
    if score_func == "sigmoid":
        return torch.sigmoid(x)
    if score_func == "softmax":
        return torch.softmax(x, dim=-1)
    raise ValueError(score_func)


def _order_desc(values: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Indices sorting each row by value descending, ties by lower index;
    NaN counts as -inf; entries with keep == False go last."""
    v = torch.nan_to_num(values, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    order = torch.sort(-v, dim=-1, stable=True).indices
    if keep is not None:
        dropped = (~keep).gather(-1, order).to(torch.int8)
        order = order.gather(-1, torch.sort(dropped, dim=-1, stable=True).indices)
    return order


def route(logits, bias, k, score_func="sqrtsoftplus", n_group=1, topk_group=1, renormalize=True, scale=1.0):
    s = scores(logits, score_func)
    biased = s + bias.double() if bias is not None else s.clone()
    biased = torch.nan_to_num(biased, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    keep = None
    if n_group > 1:
        M, E = biased.shape
        grouped = biased.view(M, n_group, E // n_group)
        per_group = grouped.gather(-1, _order_desc(grouped)[..., : min(2, E // n_group)])
        group_scores = per_group.sum(-1)
        chosen = _order_desc(group_scores)[:, :topk_group]
        group_keep = torch.zeros(M, n_group, dtype=torch.bool).scatter_(1, chosen, True)
        keep = group_keep.repeat_interleave(E // n_group, dim=1)
    ids = _order_desc(biased, keep)[:, :k]
    w = s.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids


def hash_route(token_ids, tid2eid, logits, score_func="sqrtsoftplus", weighting="gate", renormalize=True, scale=1.0):
    ids = tid2eid.long()[token_ids.long()]
    if weighting == "uniform":
        return torch.full(ids.shape, scale / ids.shape[1], dtype=torch.float64), ids
    w = scores(logits, score_func).gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids


def topk(x: torch.Tensor, k: int):
    """NaN ranks highest (as torch.topk), -0.0 equals +0.0, ties to lower index."""
    v = x.double()
    key = torch.where(torch.isnan(v), torch.full_like(v, float("inf")), v)
    nan_first = torch.isnan(v).to(torch.int8)
    order = torch.sort(-key, dim=-1, stable=True).indices
    order = order.gather(-1, torch.sort(-nan_first.gather(-1, order), dim=-1, stable=True).indices)
    ids = order[:, :k]
    return x.gather(1, ids), ids
