"""NVFP4 Linear (W4A16) against cuBLAS BF16 (F.linear) and FP8
torch._scaled_mm (per-tensor scales, row-major A, column-major B), all timed
the same way (CUDA graphs, cold L2 via rotating input sets), their samples
taken in turns (harness.time_calls_in_turns).

Floor per row: max(bytes / measured HBM bandwidth, flops / measured BF16
peak), bytes = x + NVFP4 weight (0.5625 B/weight) + output. Columns:
x_bf16 / x_fp8 = their time over ours (speedup), %bw = NVFP4 weight+x+out
bytes / time over measured bandwidth, %floor = floor / time.

Two FP8 paths are timed in the same turns. From FP8_MODE_MS rows, the
per-call FP8 mode (fp8_min_rows alone: W and x rounded to E4M3 per row on
every call, an FP8 GEMM): fp8mode_us, x_bf16_fp8mode (cuBLAS BF16 over it)
and %floor_fp8 (its floor with the measured FP8 peak). From FP8_CACHED_MS
rows, the FP8 path on W's E4M3 form made once (lowbit.nvfp4_to_fp8, what
Nvfp4Linear's compute "auto" / "fp8" run; only x rounded per call):
fp8w_us, x_bf16_fp8w and %floor_fp8w (floor bytes: x + the E4M3 weight,
1 B/weight, + output). auto_us / x_bf16_auto: what an Nvfp4Linear with
compute="auto" runs at that M (lowbit.nn.linear.AUTO_FP8_MIN_ROWS): the
FP8 row from its threshold, W4A16 below; the number the bars read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import lowbit
from lowbit.bench.harness import Hardware, rotation_count, time_calls, time_calls_in_turns
from lowbit.nn.linear import AUTO_FP8_MIN_ROWS

MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 16384]
SHAPES = [
    (4096, 1536), (1024, 32768), (8192, 4096), (4096, 4096), (2048, 4096),
    (7168, 18432), (18432, 7168), (7168, 4096), (2048, 7168), (1536, 24576),
]  # (K, N)
QUICK_MS = [1, 4, 16, 64, 256, 4096]
FP8_MODE_MS = 1024  # the per-call FP8 mode's rows from this M
# The cached FP8 path from this M: below compute="auto"'s threshold too
# (lowbit.nn.linear.AUTO_FP8_MIN_ROWS), to measure where it belongs.
FP8_CACHED_MS = 32
QUICK_SHAPES = [(4096, 4096), (7168, 18432), (2048, 7168), (4096, 1536)]


def _weights(k: int, n: int, count: int):
    sets = []
    for _ in range(count):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = lowbit.nvfp4_quantize(w)
        pw, ps = lowbit.nvfp4_prepack(q.packed, q.block_scale)
        sets.append((w, pw, ps, q.global_scale))
    return sets


def run(hw: Hardware, quick: bool):
    rows = []
    one = torch.ones((), device="cuda")
    for k, n in QUICK_SHAPES if quick else SHAPES:
        fp4_bytes = n * k * 9 // 16
        bf16_bytes = n * k * 2
        n_sets = rotation_count(fp4_bytes, hw.l2_bytes, maximum=8)
        # BF16 and FP8 peers rotate through as many sets as fit their own size
        n_bf16 = rotation_count(bf16_bytes, hw.l2_bytes, maximum=8)
        weights = _weights(k, n, max(n_sets, n_bf16))
        w8 = [w.to(torch.float8_e4m3fn).t() for w, *_ in weights]  # [K, N] column-major
        # W's E4M3 form for the cached FP8 path, made once per set as a layer does.
        cached = [lowbit.nvfp4_to_fp8(pw, ps, g, k) for _, pw, ps, g in weights[:n_sets]]
        # An untimed round of every provider on the new buffers first: the first
        # timed row of a shape came out up to 25% slow (the same kernel at M = 4
        # right after it did not), whoever ran it.
        x1 = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(n_sets, n_bf16))]
        time_calls(lambda i: lowbit.nvfp4_linear(x1[i], *weights[i][1:]), n_sets, replays=3)
        time_calls(lambda i: F.linear(x1[i], weights[i][0]), n_bf16, replays=3)
        for m in QUICK_MS if quick else MS:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(n_sets, n_bf16))]
            x8 = [x.to(torch.float8_e4m3fn) for x in xs]
            providers = [
                (lambda i: lowbit.nvfp4_linear(xs[i], *weights[i][1:]), n_sets),
                (lambda i: F.linear(xs[i], weights[i][0]), n_bf16),
                (lambda i: torch._scaled_mm(x8[i], w8[i], scale_a=one, scale_b=one, out_dtype=torch.bfloat16), n_bf16),
            ]
            extra = []
            if m >= FP8_MODE_MS:
                extra.append("fp8mode")
                providers.append((lambda i: lowbit.nvfp4_linear(xs[i], *weights[i][1:], fp8_min_rows=1), n_sets))
            if m >= FP8_CACHED_MS:
                extra.append("fp8w")
                providers.append((lambda i: lowbit.nvfp4_linear(xs[i], *weights[i][1:], None, 1, *cached[i]), n_sets))
            t4, tb, t8, *t_extra = time_calls_in_turns(providers)
            t_extra = dict(zip(extra, t_extra))
            moved = fp4_bytes + m * k * 2 + m * n * 2
            floor = hw.floor_s(moved, 2.0 * m * n * k)
            rows.append({
                "K": k, "N": n, "M": m, "wMB": fp4_bytes / 2**20,
                "nvfp4_us": t4 * 1e6, "bf16_us": tb * 1e6, "fp8_us": t8 * 1e6,
                "x_bf16": tb / t4, "x_fp8": t8 / t4,
                "TFLOP/s": 2.0 * m * n * k / t4 / 1e12,
                "%bw": 100 * moved / t4 / hw.hbm_bytes_per_s,
                "floor_us": floor * 1e6, "%floor": 100 * floor / t4,
            })
            if "fp8mode" in t_extra:
                t = t_extra["fp8mode"]
                floor8 = hw.floor_s(moved, 2.0 * m * n * k, fp8=True)
                rows[-1].update({"fp8mode_us": t * 1e6, "x_bf16_fp8mode": tb / t, "%floor_fp8": 100 * floor8 / t})
            if "fp8w" in t_extra:
                t = t_extra["fp8w"]
                floor8w = hw.floor_s(n * k + m * k * 2 + m * n * 2, 2.0 * m * n * k, fp8=True)
                rows[-1].update({"fp8w_us": t * 1e6, "x_bf16_fp8w": tb / t, "%floor_fp8w": 100 * floor8w / t})
            add_auto_columns(rows[-1])
            del xs, x8
        del weights, w8, cached
        torch.cuda.empty_cache()
    columns = ["K", "N", "M", "wMB", "nvfp4_us", "bf16_us", "fp8_us", "x_bf16", "x_fp8", "TFLOP/s", "%bw",
               "floor_us", "%floor", "fp8mode_us", "x_bf16_fp8mode", "%floor_fp8", "fp8w_us", "x_bf16_fp8w",
               "%floor_fp8w", "auto_us", "x_bf16_auto"]
    return rows, columns


def add_auto_columns(row: dict) -> None:
    """auto_us and x_bf16_auto of a row: its cached-FP8 time from
    compute="auto"'s threshold, its W4A16 time below. Rows from the
    threshold without a cached-FP8 time (not timed there) get neither."""
    fp8 = row["M"] >= AUTO_FP8_MIN_ROWS
    if fp8 and "fp8w_us" not in row:
        return
    t = row["fp8w_us"] if fp8 else row["nvfp4_us"]
    row.update({"auto_us": t, "x_bf16_auto": row["bf16_us"] / t})
