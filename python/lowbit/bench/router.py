"""MoE routing and top-k, on the DeepSeek shapes.

Rows:
  route         lowbit.route on float32 logits, beside the plain PyTorch chain
                the Hugging Face reference routers run (scores, bias, group
                top-2 / mask, topk, gather, renormalize, scale), eager and
                torch.compile'd (dynamic=True, one compile per model).
  dense_router  lowbit.dense_router (bf16 hidden + gate weight), beside
                cuBLAS gate GEMM with float32 output (torch.mm out_dtype)
                followed by lowbit.route.
  topk          lowbit.topk on 131072-wide float32 rows, beside torch.topk.

Floors: bytes the op must move (inputs once, outputs once) over the measured
HBM bandwidth. Every call starts with a cold L2 (the harness rotates input
sets); timings are CUDA-graph replays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import lowbit
from lowbit.bench.harness import Hardware, rotation_count, time_calls

# name: (H, E, k, score_func, n_group, topk_group, routed_scaling_factor)
MODELS = {
    "DSV4-Flash": (4096, 256, 6, "sqrtsoftplus", 1, 1, 1.5),
    "DSV4-Pro": (7168, 384, 6, "sqrtsoftplus", 1, 1, 2.5),
    "DSV3": (7168, 256, 8, "sigmoid", 8, 4, 2.5),
}
TOKENS = [1, 16, 128, 1024, 8192]
QUICK_TOKENS = [1, 128, 8192]
DENSE_TOKENS = [1, 16, 32, 64, 128, 1024]
TOPK_ROWS = [(1, 8), (1, 64), (16, 64), (128, 64), (128, 8)]


def hf_route(logits, bias, k: int, score_func: str, n_group: int, topk_group: int, scale: float):
    """The reference routers' PyTorch chain (DeepSeek-V3 / V4 modeling code)."""
    if score_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = F.softplus(logits).sqrt()
    choice = scores + bias
    if n_group > 1:
        E = logits.shape[-1]
        group_scores = choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
        choice = choice.masked_fill(~score_mask.bool(), 0.0)
    idx = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, idx


def _row(op, model, M, seconds, floor_bytes, hw, **peers) -> dict:
    floor = hw.floor_s(floor_bytes)
    row = {"op": op, "model": model, "M": M, "us": seconds * 1e6, "floor_us": floor * 1e6,
           "%floor": 100 * floor / seconds}
    for name, t in peers.items():
        if t is None:
            continue
        row[f"{name}_us"] = t * 1e6
        row[f"x{name}"] = t / seconds
    return row


def _time(fn, n):
    try:
        return time_calls(fn, n)
    except Exception as e:  # a peer that cannot run is reported, not fatal
        print(f"# peer failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        return None


def bench_route(hw: Hardware, quick: bool) -> list[dict]:
    rows = []
    torch._dynamo.config.cache_size_limit = 64
    for model, (H, E, k, sf, ng, tg, scale) in MODELS.items():
        compiled = torch.compile(hf_route, dynamic=True)
        for M in QUICK_TOKENS if quick else TOKENS:
            in_bytes = M * E * 4 + E * 4
            out_bytes = M * k * 8
            n = rotation_count(in_bytes + out_bytes, hw.l2_bytes)
            logits = [torch.randn(M, E, device="cuda") * 2 for _ in range(n)]
            bias = torch.randn(E, device="cuda") * 0.1
            ours = time_calls(lambda i: lowbit.route(logits[i], bias, k, sf, ng, tg, True, scale), n)
            eager = _time(lambda i: hf_route(logits[i], bias, k, sf, ng, tg, scale), n)
            comp = _time(lambda i: compiled(logits[i], bias, k, sf, ng, tg, scale), n)
            rows.append(_row("route", model, M, ours, in_bytes + out_bytes, hw, eager=eager, compiled=comp))
            del logits
    return rows


def bench_dense(hw: Hardware, quick: bool) -> list[dict]:
    rows = []
    for model, (H, E, k, sf, ng, tg, scale) in MODELS.items():
        for M in [1, 16, 64] if quick else DENSE_TOKENS:
            w_bytes = E * H * 2
            in_bytes = M * H * 2
            out_bytes = M * k * 8
            n = rotation_count(w_bytes + in_bytes, hw.l2_bytes)
            weights = [(torch.randn(E, H, device="cuda") * H**-0.5).bfloat16() for _ in range(n)]
            xs = [torch.randn(M, H, device="cuda").bfloat16() for _ in range(n)]
            bias = torch.randn(E, device="cuda") * 0.1

            def peer(i):
                logits = torch.mm(xs[i], weights[i].t(), out_dtype=torch.float32)
                return lowbit.route(logits, bias, k, sf, ng, tg, True, scale)

            ours = time_calls(lambda i: lowbit.dense_router(xs[i], weights[i], bias, k, sf, ng, tg, True, scale), n)
            cublas = _time(peer, n)
            gemm = _time(lambda i: torch.mm(xs[i], weights[i].t(), out_dtype=torch.float32), n)
            rows.append(_row("dense_router", model, M, ours, w_bytes + in_bytes + out_bytes, hw,
                             gemm_route=cublas, gemm_only=gemm))
            del weights, xs
            torch.cuda.empty_cache()
    return rows


def bench_topk(hw: Hardware, quick: bool) -> list[dict]:
    rows = []
    cols = 131072
    for R, k in TOPK_ROWS[1:3] if quick else TOPK_ROWS:
        in_bytes = R * cols * 4
        out_bytes = R * k * 8
        n = rotation_count(in_bytes, hw.l2_bytes)
        xs = [torch.randn(R, cols, device="cuda") for _ in range(n)]
        ours = time_calls(lambda i: lowbit.topk(xs[i], k), n)
        peer = _time(lambda i: torch.topk(xs[i], k), n)
        rows.append(_row("topk", f"{cols}w k={k}", R, ours, in_bytes + out_bytes, hw, torch_topk=peer))
        del xs
    return rows


def check_agreement() -> None:
    """Ids of the routers vs the PyTorch chain on one batch (sanity, not a test)."""
    for model, (H, E, k, sf, ng, tg, scale) in MODELS.items():
        logits = torch.randn(4096, E, device="cuda") * 2
        bias = torch.randn(E, device="cuda") * 0.1
        w, ids = lowbit.route(logits, bias, k, sf, ng, tg, True, scale)
        w2, ids2 = hf_route(logits.double(), bias.double(), k, sf, ng, tg, scale)
        same = (ids.long().sort(-1).values == ids2.sort(-1).values).all(-1).float().mean().item()
        print(f"# {model}: route ids agree with the PyTorch chain (float64) on {100 * same:.2f}% of tokens")


def run(hw: Hardware, quick: bool):
    check_agreement()
    rows = bench_route(hw, quick) + bench_dense(hw, quick) + bench_topk(hw, quick)
    columns = ["op", "model", "M", "us", "eager_us", "xeager", "compiled_us", "xcompiled", "gemm_route_us",
               "xgemm_route", "gemm_only_us", "torch_topk_us", "xtorch_topk", "floor_us", "%floor"]
    return rows, columns
