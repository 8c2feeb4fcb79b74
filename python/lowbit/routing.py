"""Typed Python entry points of the MoE routing operators and top-k.

Each function is a thin call into ``torch.ops.lowbit.*`` (defined in C++ with
CPU, CUDA and Meta kernels; math in csrc/lowbit/routing/routing.h), so it works in
eager mode, under ``torch.compile(fullgraph=True)``, in CUDA graphs and in
``torch.export``.

Routing outputs are ``(weights float32 [M, k], ids int32 [M, k])`` with ids
in descending order of the biased score and equal scores going to the lower
expert index.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ._autograd import register_inference_only

ScoreFunc = Literal["sqrtsoftplus", "sigmoid", "softmax"]


def route(
    logits: Tensor,
    bias: Tensor | None,
    k: int,
    score_func: ScoreFunc = "sqrtsoftplus",
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Routes tokens from router logits ``[M, E]`` (float32 or bfloat16).

    s = score_func(logits); experts are the top ``k`` of ``s + bias`` (bias
    float32 [E] selects only), restricted to the best ``topk_group`` of
    ``n_group`` contiguous expert groups when ``n_group > 1`` (group score:
    sum of its top-2 biased scores, as DeepSeek-V3). Weights are ``s`` at the
    chosen experts, divided by (their sum + 1e-20) when ``renormalize``, times
    ``routed_scaling_factor``.
    """
    return torch.ops.lowbit.route(logits, bias, k, score_func, n_group, topk_group, renormalize, routed_scaling_factor)


def dense_router(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    k: int,
    score_func: ScoreFunc = "sqrtsoftplus",
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Gate GEMM + :func:`route`: logits = hidden [M, H] @ weight [E, H]^T in
    float32 (bf16 or float32 operands). On the GPU, cuBLAS with float32
    output feeds the routing kernel (a fused GEMV + routing kernel is not
    there yet: docs/perf/log/routing.md)."""
    return torch.ops.lowbit.dense_router(
        hidden, weight, bias, k, score_func, n_group, topk_group, renormalize, routed_scaling_factor
    )


def hash_router(
    token_ids: Tensor,
    tid2eid: Tensor,
    logits: Tensor | None,
    score_func: Literal["sqrtsoftplus", "sigmoid"] = "sqrtsoftplus",
    weighting: Literal["gate", "uniform"] = "gate",
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    n_experts: int | None = None,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V4 hash router: ids = tid2eid[token_ids] (table int32 [V, k]).

    With ``weighting="gate"`` (the reference model) the weights are the gate's
    scores ``score_func(logits[m, id])`` (logits [M, E] from the learned gate),
    normalized and scaled as in :func:`route`; ``"uniform"`` gives
    ``routed_scaling_factor / k`` and uses ``logits`` only for E.

    E, the number of experts, is the width of ``logits``, else ``n_experts``
    (required with ``weighting="uniform"`` and no logits; if both are given
    they must agree). A token id outside [0, V) or a table entry outside
    [0, E) raises ValueError on CPU; on the GPU (where raising would need a
    host sync) nothing is read out of bounds and that token's ids are -1 and
    weights 0 (check ``(ids < 0).any()`` if needed; :class:`lowbit.nn.Router`
    validates its table once, when it is set). ``routed_scaling_factor``
    must be finite.
    """
    return torch.ops.lowbit.hash_router(
        token_ids, tid2eid, logits, score_func, weighting, renormalize, routed_scaling_factor, n_experts
    )


def topk(input: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Row-wise top-k of ``input`` [R, C] (float32 or bfloat16, C <= 131072,
    k <= 2048): values (input dtype) in descending order and int32 column
    indices. Equal values go to the lower index, NaN ranks above +inf."""
    return torch.ops.lowbit.topk(input, k)


register_inference_only("route")
register_inference_only("dense_router")
register_inference_only("hash_router")
register_inference_only("topk")
