"""NVFP4 MoE experts (torch.ops.lowbit.nvfp4_moe) against a BF16 MoE built on
torch._grouped_mm, on the DeepSeek-V4-Flash / V4-Pro / V3 expert shapes.

What one call computes (both sides): out[t] = sum_j w[t, j] *
W2_e(silu(min(g, L)) * clamp(u, -L, L)), [g; u] = W13_e x[t], over the k
routed experts of token t plus the shared expert. The shared expert is
expert index E of a stack of E + 1 experts and every token gets an extra
slot (id E, weight 1.0): that is how the module fuses it, and the peer runs
the same stack and the same ids. L = 10 for DSV4, no clamp for DSV3.

Routing ("routing" column; k distinct experts per token, random positive
weights normalized per token):
  uniform     each token draws k experts uniformly.
  skewed      experts drawn from a Zipf law (p ~ 1 / rank^1.2, ranks randomly
              assigned per input set): at M = 4096 the hottest expert is in
              ~86% of the tokens and 8 experts take half the (token, slot)
              pairs.
  one-expert  slot 0 of every token is expert 0 (the rest uniform over the
              others): the all-tokens-on-one-expert case; its bar is to be
              no more than 2x the uniform time at the same M.

Peer: bf16_grouped_moe below: (token, slot) pairs sorted by expert on the
GPU, group end offsets by searchsorted (int32, no host sync, so it runs in a
CUDA graph like ours), x rows gathered, torch._grouped_mm for W13 (weights
[E, 2I, H] passed as the transposed view [E, H, 2I]), the clamped SwiGLU in
BF16 torch ops, torch._grouped_mm for W2, the weights applied in FP32 and
index_add_ back to [M, H] in FP32, cast to BF16. Its BF16 weights are the
dequantized NVFP4 weights, so both sides compute the same function and the
rel_err column (||ours - peer|| / ||peer|| on the first input set) is a
sanity check of the kernel (the tests are the correctness check).

Providers ("provider" column), each against the same peer times:
  lowbit        nvfp4_moe as Nvfp4MoE's compute="w4a16" runs it (W4A16).
  lowbit:auto   compute="auto": the experts' E4M3 form (nvfp4_moe_to_fp8,
                made once) passed with the layer's fp8_min_rows as
                Nvfp4MoE sets it (lowbit.nn.moe.auto_moe_fp8_min_rows: 32
                routed rows per expert on average), so the op runs W4A16
                below that many tokens and the FP8 path from it.
  lowbit:fp8    compute="fp8": the FP8 path at every M (fp8_min_rows = 1).

Memory plan, one layer at a time (DSV4-Pro: 385 experts of 3 x 3072 x 7168:
BF16 51 GB, NVFP4 14 GB, E4M3 25 GB): phase 1 fills the BF16 stacks chunk by
chunk (randn, quantize the chunk with lowbit.nvfp4_quantize, keep the NVFP4
chunk, write its dequantized BF16 back in place), so the peak is BF16 + NVFP4
(~65 GB for Pro) and the peer is timed on every row. Phase 2 frees the BF16
weights, prepacks the NVFP4 stacks (checkpoint + prepacked copy, ~29 GB),
frees the checkpoint copy, makes the E4M3 form (~40 GB with the prepacked
stacks) and times every provider on the same input sets. Everything is
freed between layers.

Timing: lowbit.bench.harness.time_calls (CUDA graphs, median of 30
samples of back-to-back replays, 10 above M = 256 where calls take ms; a
side whose capture fails is timed eagerly and says so, one that fails is
left blank).
Each row rotates >= 2 input sets, as many as make one pass over the
distinct experts they read >= 3x L2 (at most 8); every set draws fresh ids
and x, so the routed weights come from HBM (the shared expert is common to
the sets; the other sets stream >= 2x L2 between two reads of it).

Floor per row (mean over the sets): hw.floor_s(bytes, flops) with bytes =
NVFP4 bytes (0.5625 B/weight) of the distinct routed experts the set
selects (counted on the host at setup) + the shared expert + x + out +
ids/weights, flops = 2 * M * (k + 1) * 3 * H * I. Where the FP8 path runs
(lowbit:fp8, lowbit:auto from its threshold) the weight bytes are the E4M3
form's (1 B/weight + a 4-byte scale per row) and the flops are at the
measured FP8 peak, hw.floor_s(..., fp8=True). Columns: lowbit_us / bf16_us
(time per call of the row's provider / of the peer), x_bf16 = bf16 time /
ours, %floor = floor / ours, GB/s = our bytes / our time, active_experts =
mean distinct routed experts per set (the shared one comes on top), rel_err
as above (the FP8 path adds ~7%: warned above FP8_REL_ERR_WARN), bar = the
targets: lowbit and lowbit:auto at M <= 64 need %floor >= 70 and x_bf16 >=
3; lowbit at M = 4096 needs x_bf16 >= 1, lowbit:auto x_bf16 >= 2 (issue 42,
every layer and routing, one-expert included); one-expert needs <= 2x the
same provider's uniform time at its M.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import lowbit
from lowbit.bench.harness import Hardware, rotation_count, time_calls
from lowbit.nn.moe import auto_moe_fp8_min_rows

# name: (H, E routed, k, I, swiglu_limit); one shared expert of the same I
LAYERS = {
    "DSV4-Flash": (4096, 256, 6, 2048, 10.0),
    "DSV4-Pro": (7168, 384, 6, 3072, 10.0),
    "DSV3": (7168, 256, 8, 2048, None),
}
MS = [1, 4, 16, 64, 256, 1024, 4096]
QUICK_LAYERS = ["DSV4-Flash"]
QUICK_MS = [1, 16, 64, 4096]
ROUTINGS = ["uniform", "skewed"]
ONE_EXPERT_M = 4096
ZIPF_EXPONENT = 1.2
MAX_SETS = 8
CHUNK_BYTES = 1 << 30  # BF16 bytes of experts generated and quantized at once
REL_ERR_WARN = 2e-2  # BF16 rounding of the intermediates gives ~5e-3
FP8_REL_ERR_WARN = 1e-1  # the FP8 path's E4M3 x, weights and activations: ~7e-2
PROVIDERS = ("lowbit", "lowbit:auto", "lowbit:fp8")
AUTO_BAR_M, AUTO_BAR_X = 4096, 2.0  # issue 42: "auto" >= 2.0x the BF16 MoE at M = 4096


def fp8_min_rows(provider: str, n_experts: int, k: int) -> int:
    """nvfp4_moe's fp8_min_rows for ``provider`` on a layer of ``n_experts``
    routed experts, ``k`` per token (0: W4A16, no FP8 form passed)."""
    return auto_moe_fp8_min_rows(n_experts, k) if provider == "lowbit:auto" else int(provider == "lowbit:fp8")


def runs_fp8(provider: str, row: dict) -> bool:
    """Whether ``provider``'s call on ``row`` (a case of bench_layer) takes
    the FP8 path."""
    return 0 < row["fp8_min_rows"][provider] <= row["M"]


def bf16_grouped_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    swiglu_limit: float | None,
    expert_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """BF16 MoE on torch._grouped_mm: x [M, H] bf16, topk_weights float32
    [M, k], topk_ids int32 [M, k], w13 bf16 [E, 2I, H] (gate rows first, then
    up), w2 bf16 [E, H, I]. Returns [M, H] bf16. No host synchronization.
    ``expert_index`` (arange(E), int32, on x's device) may be given to save
    its launch."""
    m, k = topk_ids.shape
    n_experts, inter = w2.shape[0], w2.shape[2]
    if expert_index is None:
        expert_index = torch.arange(n_experts, dtype=torch.int32, device=x.device)
    flat_ids = topk_ids.reshape(-1).to(torch.int32)
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    # offs[e] = number of pairs with id <= e: the end of group e (int32)
    offs = torch.searchsorted(sorted_ids, expert_index, right=True, out_int32=True)
    token = torch.div(order, k, rounding_mode="floor")
    xs = x.index_select(0, token)
    h = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)  # [T, 2I]
    gate, up = h[:, :inter], h[:, inter:]
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
    act = F.silu(gate) * up
    y = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)  # [T, H]
    weighted = y.float().mul_(topk_weights.reshape(-1).index_select(0, order).unsqueeze(1))
    out = torch.zeros(m, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token, weighted)
    return out.to(x.dtype)


def routing_set(kind: str, m: int, n_experts: int, k: int, gen: torch.Generator):
    """Host tensors for one input set: ids int32 [m, k + 1] (k distinct
    routed experts, then the shared expert n_experts), weights float32
    [m, k + 1] (routed ones positive, summing to 1; shared 1.0), and the
    number of distinct routed experts selected."""
    if kind == "uniform":
        ids = torch.multinomial(torch.ones(n_experts).expand(m, n_experts), k, generator=gen)
    elif kind == "skewed":
        ranks = torch.randperm(n_experts, generator=gen)
        probs = (ranks.double() + 1.0).pow(-ZIPF_EXPONENT).float()
        ids = torch.multinomial(probs.expand(m, n_experts), k, generator=gen)
    elif kind == "one-expert":
        probs = torch.ones(n_experts)
        probs[0] = 0.0
        rest = torch.multinomial(probs.expand(m, n_experts), k - 1, generator=gen)
        ids = torch.cat([torch.zeros(m, 1, dtype=rest.dtype), rest], dim=1)
    else:
        raise ValueError(f"unknown routing {kind!r}")
    weights = torch.rand(m, k, generator=gen) + 0.05
    weights = weights / weights.sum(dim=1, keepdim=True)
    distinct = int(ids.unique().numel())
    ids = torch.cat([ids, torch.full((m, 1), n_experts, dtype=ids.dtype)], dim=1).to(torch.int32)
    weights = torch.cat([weights, torch.ones(m, 1)], dim=1)
    return ids, weights, distinct


def build_experts(n: int, rows: int, cols: int, std: float, device, chunk: int | None = None):
    """A BF16 expert stack [n, rows, cols] of random weights and its NVFP4
    quantization (packed, block_scale, global [n]), made chunk by chunk; the
    BF16 stack holds the dequantized NVFP4 values, so the two are the same
    weights."""
    w = torch.empty(n, rows, cols, dtype=torch.bfloat16, device=device)
    if chunk is None:
        chunk = max(1, CHUNK_BYTES // (rows * cols * 2))
    packed = scale = glob = None
    for e0 in range(0, n, chunk):
        part = w[e0 : e0 + chunk]
        part.normal_(0.0, std)
        q = lowbit.nvfp4_quantize(part)
        if packed is None:
            packed = torch.empty((n, *q.packed.shape[1:]), dtype=q.packed.dtype, device=device)
            scale = torch.empty((n, *q.block_scale.shape[1:]), dtype=q.block_scale.dtype, device=device)
            glob = torch.empty(n, dtype=q.global_scale.dtype, device=device)
        packed[e0 : e0 + chunk].copy_(q.packed)
        scale[e0 : e0 + chunk].copy_(q.block_scale)
        glob[e0 : e0 + chunk].copy_(q.global_scale.reshape(-1))
        part.copy_(lowbit.nvfp4_dequantize(q.packed, q.block_scale, q.global_scale, out_dtype=torch.bfloat16))
        del q
    return w, (packed, scale, glob)


def _time(fn, n: int, m: int, what: str):
    """Seconds per call in a CUDA graph; eager if capture fails; None (and a
    message) if the call fails. Fewer replays at large M (calls of ms), to
    keep the suite within minutes."""
    replays, warmup = (30, 3) if m <= 256 else (10, 1)
    try:
        return time_calls(fn, n, replays=replays, warmup=warmup)
    except Exception as e:
        print(f"# {what}: graph timing failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    torch.cuda.synchronize()
    try:
        t = time_calls(fn, n, use_graph=False, replays=replays, warmup=warmup)
        print(f"# {what}: timed eagerly")
        return t
    except Exception as e:
        print(f"# {what}: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
        return None


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def bench_layer(hw: Hardware, layer: str, ms: list[int], has_moe: bool, device: str = "cuda") -> list[dict]:
    """Rows of one layer config: input sets, then phase 1 (BF16 weights, the
    peer), then phase 2 (prepacked NVFP4, ours); frees all of it on return.
    ``device`` is "cuda" in the suite (another device only for a dry run of
    the data flow with the timing stubbed out)."""
    H, E, k, inter, limit = LAYERS[layer]
    dev = torch.device(device)
    n_all = E + 1  # routed + shared
    kp = k + 1
    expert_bytes = 3 * H * inter * 9 // 16  # NVFP4 codes + e4m3 block scales
    expert_fp8_bytes = 3 * H * inter + 4 * (2 * inter + H)  # E4M3 weights + float32 row scales
    gen = torch.Generator().manual_seed(sum(map(ord, layer)))

    # Input sets for every row, made before the weights (host-side counts).
    cases = [(routing, m) for m in ms for routing in ROUTINGS]
    if ONE_EXPERT_M in ms:
        cases.append(("one-expert", ONE_EXPERT_M))
    rows = []
    for routing, m in cases:
        sets = []
        n_sets = MAX_SETS
        while len(sets) < n_sets:
            ids, w, distinct = routing_set(routing, m, E, k, gen)
            x = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
            io_bytes = 2 * m * H * 2 + m * kp * 8
            nbytes = (distinct + 1) * expert_bytes + io_bytes
            sets.append({"x": x, "ids": ids.to(dev), "w": w.to(dev), "distinct": distinct, "bytes": nbytes,
                         "bytes_fp8": (distinct + 1) * expert_fp8_bytes + io_bytes})
            if len(sets) == 1:
                n_sets = rotation_count(nbytes, hw.l2_bytes, maximum=MAX_SETS)
        flops = 2.0 * m * kp * 3 * H * inter
        rows.append({
            "layer": layer, "routing": routing, "M": m, "sets": sets,
            "active": sum(s["distinct"] for s in sets) / len(sets),
            "bytes": sum(s["bytes"] for s in sets) / len(sets),
            "floor_s": sum(hw.floor_s(s["bytes"], flops) for s in sets) / len(sets),
            "bytes_fp8": sum(s["bytes_fp8"] for s in sets) / len(sets),
            "floor_fp8_s": sum(hw.floor_s(s["bytes_fp8"], flops, fp8=True) for s in sets) / len(sets),
            "lowbit_s": {}, "rel_err": {}, "fp8_min_rows": {p: fp8_min_rows(p, E, k) for p in PROVIDERS},
        })

    # Phase 1: BF16 weights (dequantized NVFP4) and the peer.
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    w13, q13 = build_experts(n_all, 2 * inter, H, H**-0.5, dev)
    w2, q2 = build_experts(n_all, H, inter, inter**-0.5, dev)
    torch.cuda.synchronize()
    print(f"# {layer}: {E} routed + 1 shared experts, BF16 {_gb(w13.nbytes + w2.nbytes)}, "
          f"NVFP4 {_gb(n_all * expert_bytes)}, built in {time.perf_counter() - t0:.1f} s")
    index = torch.arange(n_all, dtype=torch.int32, device=dev)
    for row in rows:
        sets = row["sets"]

        def peer(i, sets=sets, w13=w13, w2=w2):  # bound here: the stacks are deleted below
            s = sets[i]
            return bf16_grouped_moe(s["x"], s["w"], s["ids"], w13, w2, limit, index)

        what = f"{layer} {row['routing']} M={row['M']} bf16 peer"
        try:
            row["ref"] = peer(0)
        except Exception as e:
            print(f"# {what}: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            row["ref"] = None
            continue
        row["bf16_s"] = _time(peer, len(sets), row["M"], what)
        torch.cuda.empty_cache()
    print(f"# {layer}: phase 1 (BF16 peer) peak {_gb(torch.cuda.max_memory_allocated())}")
    del w13, w2, peer
    torch.cuda.empty_cache()

    # Phase 2: prepacked NVFP4 (and its E4M3 form) and ours.
    if has_moe:
        torch.cuda.reset_peak_memory_stats()
        w13p, w13sp, w2p, w2sp = torch.ops.lowbit.nvfp4_moe_prepack(q13[0], q13[1], q2[0], q2[1])
        g13, g2 = q13[2], q2[2]
        del q13, q2
        torch.cuda.empty_cache()
        providers = list(PROVIDERS)
        fp8 = ()
        if hasattr(torch.ops.lowbit, "nvfp4_moe_to_fp8"):
            fp8 = tuple(torch.ops.lowbit.nvfp4_moe_to_fp8(w13p, w13sp, g13, w2p, w2sp, g2))
        else:
            print("# torch.ops.lowbit.nvfp4_moe_to_fp8 is not in this build: timing lowbit (W4A16) only")
            providers = ["lowbit"]
        for row in rows:
            sets = row["sets"]
            for provider in providers:
                min_rows = row["fp8_min_rows"][provider]
                extra = (min_rows, *fp8) if min_rows else ()  # "lowbit": the call as before, no FP8 form

                def ours(i, sets=sets, extra=extra):
                    s = sets[i]
                    return torch.ops.lowbit.nvfp4_moe(s["x"], s["w"], s["ids"], w13p, w13sp, g13, w2p, w2sp, g2,
                                                      limit, *extra)

                what = f"{layer} {row['routing']} M={row['M']} {provider}"
                try:
                    out = ours(0)
                    if row["ref"] is not None:
                        ref = row["ref"].float()
                        err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                        row["rel_err"][provider] = err
                        warn = FP8_REL_ERR_WARN if runs_fp8(provider, row) else REL_ERR_WARN
                        if not err < warn:
                            print(f"# {what}: rel_err {err:.3g} against the BF16 peer (expected < {warn})")
                        del ref
                    del out
                except Exception as e:
                    print(f"# {what}: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
                    continue
                row["lowbit_s"][provider] = _time(ours, len(sets), row["M"], what)
                torch.cuda.empty_cache()
        print(f"# {layer}: phase 2 (NVFP4 + E4M3) peak {_gb(torch.cuda.max_memory_allocated())}")
        del w13p, w13sp, w2p, w2sp, g13, g2, fp8
    else:
        del q13, q2
    for row in rows:
        row["n_sets"] = len(row["sets"])
        del row["sets"], row["ref"]
    torch.cuda.empty_cache()
    return rows


def _bar(row: dict, provider: str, uniform_s: float | None) -> str:
    ours, peer, m = row["lowbit_s"].get(provider), row.get("bf16_s"), row["M"]
    if ours is None:
        return "n/a"
    fails = []
    auto_bar = m == AUTO_BAR_M and provider == "lowbit:auto"  # on every routing, one-expert too
    if row["routing"] == "one-expert":
        if uniform_s is None:
            return "n/a"
        ratio = ours / uniform_s
        if ratio > 2.0:
            fails.append(f"{ratio:.2f}x uniform")
    elif m <= 64 and provider != "lowbit:fp8":
        floor = row["floor_fp8_s"] if runs_fp8(provider, row) else row["floor_s"]
        pct = 100 * floor / ours
        if pct < 70:
            fails.append(f"%floor {pct:.0f}<70")
        if peer is None or peer / ours < 3.0:
            fails.append("x_bf16<3")
    elif m == 4096 and provider == "lowbit":
        if peer is None or peer / ours < 1.0:
            fails.append("x_bf16<1")
    elif not auto_bar:
        return "-"
    if auto_bar and (peer is None or peer / ours < AUTO_BAR_X):
        fails.append(f"x_bf16<{AUTO_BAR_X:g}")
    return "pass" if not fails else "FAIL " + ", ".join(fails)


def _finish(rows: list[dict]) -> list[dict]:
    """One table row per (case, provider) from bench_layer's cases."""
    uniform = {(r["layer"], r["M"]): r["lowbit_s"] for r in rows if r["routing"] == "uniform"}
    out = []
    for r in rows:
        for provider in PROVIDERS:
            ours, peer = r["lowbit_s"].get(provider), r.get("bf16_s")
            fp8 = runs_fp8(provider, r)
            floor_s, nbytes = (r["floor_fp8_s"], r["bytes_fp8"]) if fp8 else (r["floor_s"], r["bytes"])
            row = {"layer": r["layer"], "routing": r["routing"], "M": r["M"], "provider": provider,
                   "active_experts": r["active"], "n_sets": r["n_sets"], "bytes": nbytes}
            if ours is not None:
                row["lowbit_us"] = ours * 1e6
            if peer is not None:
                row["bf16_us"] = peer * 1e6
            if ours is not None and peer is not None:
                row["x_bf16"] = peer / ours
            row["floor_us"] = floor_s * 1e6
            if ours is not None:
                row["%floor"] = 100 * floor_s / ours
                row["GB/s"] = nbytes / ours / 1e9
            if provider in r["rel_err"]:
                row["rel_err"] = r["rel_err"][provider]
            row["bar"] = _bar(r, provider, uniform.get((r["layer"], r["M"]), {}).get(provider))
            out.append(row)
    return out


def token_counts(shapes) -> list[int]:
    """``--shapes "256;1024"``: the token counts M to run (every layer)."""
    ms = []
    for shape in shapes:
        if len(shape) != 1 or shape[0] < 1:
            raise ValueError(f"moe: --shapes are token counts M >= 1 separated by ';', got {tuple(shape)}")
        ms.append(shape[0])
    return ms


def run(hw: Hardware, quick: bool, shapes=None):
    """The suite; ``shapes`` (1-tuples of M, from --shapes) runs those token
    counts on every layer (the quick layers with --quick)."""
    ms = token_counts(shapes) if shapes else (QUICK_MS if quick else MS)
    has_moe = hasattr(torch.ops.lowbit, "nvfp4_moe") and hasattr(torch.ops.lowbit, "nvfp4_moe_prepack")
    if not has_moe:
        print("# torch.ops.lowbit.nvfp4_moe / nvfp4_moe_prepack are not in this build: timing the peer only")
    torch.cuda.empty_cache()
    rows = []
    for layer in QUICK_LAYERS if quick else LAYERS:
        rows += bench_layer(hw, layer, ms, has_moe)
    columns = ["layer", "routing", "M", "provider", "lowbit_us", "bf16_us", "x_bf16", "floor_us", "%floor", "GB/s",
               "active_experts", "rel_err", "bar"]
    return _finish(rows), columns
