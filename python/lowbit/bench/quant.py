"""NVFP4 quantize / dequantize bandwidth.

Bytes counted are the fewest the op must move: input read once, outputs
written once. Quantize with a caller-given global scale is one pass and is
held to that floor; with the scale computed from the data, amax needs a full
read before any block can be encoded, so its floor ("floor 2-pass") counts the
input twice. Peer: the same round trip in plain PyTorch ops is not a useful
peer (it is a chain of ~15 kernels); the floor is the comparison.
"""

from __future__ import annotations

import torch

import lowbit
from lowbit.bench.harness import Hardware, rotation_count, time_calls

SHAPES = [(8192, 8192), (4096, 4096), (7168, 18432), (256, 4096, 2048)]
QUICK_SHAPES = [(8192, 8192)]


def _row(op: str, shape, dtype, seconds: float, bytes_moved: int, floor_bytes: int, hw: Hardware) -> dict:
    floor = hw.floor_s(floor_bytes)
    return {
        "op": op,
        "shape": "x".join(map(str, shape)),
        "dtype": str(dtype).replace("torch.", ""),
        "us": seconds * 1e6,
        "GB/s": bytes_moved / seconds / 1e9,
        "floor_us": floor * 1e6,
        "%floor": 100 * floor / seconds,
    }


def run(hw: Hardware, quick: bool):
    rows = []
    for shape in QUICK_SHAPES if quick else SHAPES:
        dtype = torch.bfloat16
        numel = 1
        for d in shape:
            numel *= d
        groups = shape[0] if len(shape) == 3 else 1
        in_bytes = numel * 2
        out_bytes = numel // 2 + numel // 16 + 4 * groups
        n = rotation_count(in_bytes + out_bytes, hw.l2_bytes)
        xs = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(n)]
        gshape = (groups,) if len(shape) == 3 else ()
        given = [x.float().abs().amax(dim=(-2, -1)).reshape(gshape) / 2688.0 for x in xs]

        t = time_calls(lambda i: lowbit.nvfp4_quantize(xs[i], given[i]), n)
        rows.append(_row("quantize (given scale)", shape, dtype, t, in_bytes + out_bytes, in_bytes + out_bytes, hw))
        t = time_calls(lambda i: lowbit.nvfp4_quantize(xs[i]), n)
        row = _row("quantize (amax)", shape, dtype, t, in_bytes + out_bytes, in_bytes + out_bytes, hw)
        row["%floor 2-pass"] = 100 * hw.floor_s(2 * in_bytes + out_bytes) / t
        rows.append(row)

        qs = [lowbit.nvfp4_quantize(x, g) for x, g in zip(xs, given)]
        del xs
        t = time_calls(lambda i: lowbit.nvfp4_dequantize(*qs[i], out_dtype=torch.bfloat16), n)
        rows.append(_row("dequantize", shape, dtype, t, in_bytes + out_bytes, in_bytes + out_bytes, hw))
        del qs
        torch.cuda.empty_cache()
    columns = ["op", "shape", "dtype", "us", "GB/s", "floor_us", "%floor", "%floor 2-pass"]
    return rows, columns
