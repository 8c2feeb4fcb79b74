"""``Router``: the MoE gate of DeepSeek-V3 / V4 style models.

Mode ``"dense"``: experts from the learned gate (``lowbit.dense_router``).
Mode ``"hash"`` (DeepSeek-V4's first layers): experts from the table
``tid2eid[token_id]``, weighted by the learned gate's scores at those experts
(``lowbit.hash_router`` with ``weighting="gate"``).

State (names as in the public DeepSeek checkpoints): ``weight`` [E, H]
(bf16), ``e_score_correction_bias`` float32 [E] (when ``bias=True``), and in
hash mode ``tid2eid`` int32 [vocab, k]. The table is validated once, when it
is loaded or set (ids in [0, E), shape [vocab, k]); int64 checkpoint tables
are converted to int32.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..routing import dense_router, hash_router

_MODES = ("dense", "hash")
_SCORE_FUNCS = {"dense": ("sqrtsoftplus", "sigmoid", "softmax"), "hash": ("sqrtsoftplus", "sigmoid")}


def _check_config(hidden_size, n_experts, k, mode, score_func, n_group, topk_group, routed_scaling_factor,
                  vocab_size) -> None:
    """The constructor's arguments, checked as the routing ops would check
    them on every call, but named as the Router's."""
    if mode not in _MODES:
        raise ValueError(f"Router: argument 'mode' must be 'dense' or 'hash', got {mode!r}")
    for name, value in (("hidden_size", hidden_size), ("n_experts", n_experts)):
        if value < 1:
            raise ValueError(f"Router: argument '{name}' must be >= 1, got {value}")
    if not 1 <= k <= n_experts:
        raise ValueError(f"Router: argument 'k' must be in [1, {n_experts}] (n_experts), got {k}")
    funcs = _SCORE_FUNCS[mode]
    if score_func not in funcs:
        names = " or ".join(", ".join(repr(f) for f in funcs).rsplit(", ", 1))
        where = " with mode='hash'" if mode == "hash" else ""
        raise ValueError(f"Router: argument 'score_func' must be {names}{where}, got {score_func!r}")
    if mode == "dense":  # the hash table selects the experts in hash mode: no groups there
        if n_group < 1 or n_experts % n_group:
            raise ValueError(f"Router: argument 'n_group' must divide n_experts ({n_experts}), got {n_group}")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"Router: argument 'topk_group' must be in [1, {n_group}] (n_group), got {topk_group}")
        if k > n_experts // n_group * topk_group:
            raise ValueError(
                f"Router: argument 'k' ({k}) exceeds the experts in the kept groups (topk_group {topk_group} x "
                f"{n_experts // n_group})"
            )
    if not math.isfinite(routed_scaling_factor):
        raise ValueError(f"Router: argument 'routed_scaling_factor' must be finite, got {routed_scaling_factor}")
    if mode == "hash":
        if vocab_size is None:
            raise ValueError("Router: argument 'vocab_size' is required with mode='hash'")
        if vocab_size < 1:
            raise ValueError(f"Router: argument 'vocab_size' must be >= 1, got {vocab_size}")


class Router(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        n_experts: int,
        k: int,
        mode: str = "dense",
        score_func: str = "sqrtsoftplus",
        n_group: int = 1,
        topk_group: int = 1,
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        vocab_size: int | None = None,
        bias: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        _check_config(hidden_size, n_experts, k, mode, score_func, n_group, topk_group, routed_scaling_factor,
                      vocab_size)
        self.hidden_size, self.n_experts, self.k, self.mode = hidden_size, n_experts, k, mode
        self.score_func, self.n_group, self.topk_group = score_func, n_group, topk_group
        self.renormalize, self.routed_scaling_factor = renormalize, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(n_experts, hidden_size, dtype=dtype, device=device), requires_grad=False)
        nn.init.normal_(self.weight, std=hidden_size**-0.5)
        if bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32, device=device))
        else:
            self.e_score_correction_bias = None
        if mode == "hash":
            self.register_buffer("tid2eid", torch.zeros(vocab_size, k, dtype=torch.int32, device=device))

    def _check_table(self, table: Tensor) -> None:
        if table.dim() != 2 or table.shape[1] != self.k or table.dtype.is_floating_point:
            raise ValueError(
                f"Router: 'tid2eid' must be an integer table of shape [vocab, {self.k}], "
                f"got {tuple(table.shape)} {table.dtype}"
            )
        if table.numel() and (int(table.min()) < 0 or int(table.max()) >= self.n_experts):
            raise ValueError(
                f"Router: 'tid2eid' holds expert ids in [{int(table.min())}, {int(table.max())}], "
                f"outside [0, {self.n_experts})"
            )

    def set_hash_table(self, table: Tensor) -> None:
        """Validates and installs a [vocab, k] table (any integer dtype)."""
        self._check_table(table)
        self.tid2eid = table.to(device=self.weight.device, dtype=torch.int32).contiguous()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "tid2eid"
        if self.mode == "hash" and key in state_dict:
            table = state_dict[key]
            self._check_table(table)
            state_dict[key] = table.to(torch.int32)
            self.tid2eid = torch.empty_like(state_dict[key], device=self.tid2eid.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def gate_logits(self, hidden: Tensor) -> Tensor:
        """hidden [M, H] -> float32 logits [M, E] (float32 accumulation)."""
        if hidden.is_cuda and hidden.dtype == torch.bfloat16:
            return torch.mm(hidden, self.weight.t(), out_dtype=torch.float32)
        return hidden.float() @ self.weight.float().t()

    def forward(self, hidden: Tensor, token_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """hidden [..., H] (and token_ids [...] in hash mode) ->
        (weights float32 [..., k], ids int32 [..., k])."""
        if hidden.dim() < 1 or hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"Router: argument 'hidden' must have last dimension {self.hidden_size} (hidden_size), "
                f"got shape {tuple(hidden.shape)}"
            )
        if hidden.dtype != self.weight.dtype:
            raise TypeError(
                f"Router: argument 'hidden' must have dtype {self.weight.dtype} (the gate weight's), got {hidden.dtype}"
            )
        lead = hidden.shape[:-1]
        x = hidden.reshape(-1, self.hidden_size)
        if self.mode == "dense":
            w, ids = dense_router(
                x, self.weight, self.e_score_correction_bias, self.k, self.score_func, self.n_group,
                self.topk_group, self.renormalize, self.routed_scaling_factor,
            )
        else:
            if token_ids is None:
                raise ValueError("Router: argument 'token_ids' is required in hash mode")
            if token_ids.dtype not in (torch.int64, torch.int32):
                raise TypeError(
                    f"Router: argument 'token_ids' must have dtype torch.int64 or torch.int32, got {token_ids.dtype}"
                )
            if token_ids.shape != lead:
                raise ValueError(
                    f"Router: argument 'token_ids' must have shape {tuple(lead)} (the leading dimensions of "
                    f"'hidden'), got {tuple(token_ids.shape)}"
                )
            w, ids = hash_router(
                token_ids.reshape(-1), self.tid2eid, self.gate_logits(x), self.score_func, "gate",
                self.renormalize, self.routed_scaling_factor,
            )
        return w.view(*lead, self.k), ids.view(*lead, self.k)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, n_experts={self.n_experts}, k={self.k}, mode={self.mode}, "
            f"score_func={self.score_func}, n_group={self.n_group}, topk_group={self.topk_group}, "
            f"routed_scaling_factor={self.routed_scaling_factor}"
        )
