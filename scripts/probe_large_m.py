"""Probe (development tool, GPU): where the large-M NVFP4 Linear loses to
cuBLAS BF16, and two ways around the weight's unpack (docs/PERF.md, Linear
v16: at M >= 4096 the unpack + cuBLAS path runs cuBLAS's own kernel, but
reads 0.84x in CUDA graphs against ~0.92x from eager kernel sums).

Variants, timed the bench's way (CUDA graphs, rotating sets, cold L2) and
eagerly, beside F.linear on the BF16 weight:
- ours: lowbit.nvfp4_linear (unpack all of W, then one cuBLAS GEMM);
- chunk<c>: W dequantized in c slices of rows, each followed by its GEMM
  into the matching columns of one output, so a slice is still in L2 when
  its GEMM reads it (Linear v12 tried this in the op: no consistent gain;
  here it is the baseline of the next variant);
- overlap<c>: as chunk<c>, but slice i + 1 is dequantized on a side stream
  while slice i's GEMM runs (double buffer). A slice's GEMM with fewer tiles
  than SMs leaves SMs for the dequantize.
The slices use the checkpoint-layout dequantize (lowbit.nvfp4_dequantize),
not the prepacked unpack kernel: close in cost, enough to decide whether a
chunked path in the op is worth building. Then, with --profile, the CUDA
kernels of ours and the peer (torch profiler, eager and in a CUDA graph).

  python scripts/probe_large_m.py --cases 7168x4096x4096,2048x4096x16384 --chunks 2,4 --profile
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import lowbit
from lowbit.bench.harness import rotation_count, time_calls


def _slices(n: int, chunks: int):
    step = math.ceil(n / chunks / 128) * 128  # rows per slice, a multiple of 128
    return [(n0, min(n, n0 + step)) for n0 in range(0, n, step)]


def _dequant_rows(q, n0: int, n1: int, dtype):
    return lowbit.nvfp4_dequantize(q.packed[n0:n1], q.block_scale[n0:n1], q.global_scale, dtype)


def chunked(x, q, chunks: int):
    out = torch.empty(x.shape[0], q.packed.shape[0], device=x.device, dtype=x.dtype)
    for n0, n1 in _slices(q.packed.shape[0], chunks):
        torch.mm(x, _dequant_rows(q, n0, n1, x.dtype).t(), out=out[:, n0:n1])
    return out


def overlapped(x, q, chunks: int, side: torch.cuda.Stream):
    main = torch.cuda.current_stream()
    slices = _slices(q.packed.shape[0], chunks)
    out = torch.empty(x.shape[0], q.packed.shape[0], device=x.device, dtype=x.dtype)
    ready = [torch.cuda.Event() for _ in slices]  # slice i dequantized
    freed = [torch.cuda.Event() for _ in slices]  # slice i's GEMM done (its buffer free)
    bufs = [None] * len(slices)
    side.wait_stream(main)
    for i, (n0, n1) in enumerate(slices):
        with torch.cuda.stream(side):
            if i >= 2:
                side.wait_event(freed[i - 2])  # the buffer slice i reuses
            bufs[i] = _dequant_rows(q, n0, n1, x.dtype)
            ready[i].record(side)
        if i >= 1:
            a, b = slices[i - 1]
            main.wait_event(ready[i - 1])
            torch.mm(x, bufs[i - 1].t(), out=out[:, a:b])
            freed[i - 1].record(main)
    a, b = slices[-1]
    main.wait_event(ready[-1])
    torch.mm(x, bufs[-1].t(), out=out[:, a:b])
    # No record_stream for the side stream's buffers: they live until this
    # returns, and the next call's side.wait_stream(main) orders any reuse
    # after these GEMMs.
    return out


def _profile(name: str, fn, n_sets: int) -> None:
    """Per-kernel device times of fn, launched eagerly and replayed in a
    CUDA graph (the bench's way: one call per set, so L2 is cold)."""
    from torch.profiler import ProfilerActivity, profile

    graph = torch.cuda.CUDAGraph()
    for _ in range(2):
        for i in range(n_sets):
            fn(i)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for i in range(n_sets):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    for mode in ("eager", "graph"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                if mode == "graph":
                    graph.replay()
                else:
                    for i in range(n_sets):
                        fn(i)
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if ev.device_type.name == "CUDA" and ev.count > 0:
                print(f"  PROF {mode} {name}: {ev.key[:70]} {ev.device_time_total / ev.count:.1f} us x{ev.count}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="7168x4096x4096,7168x18432x4096,2048x4096x16384,4096x4096x4096")
    p.add_argument("--chunks", default="2,4,8")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    side = torch.cuda.Stream()
    for case in args.cases.split(","):
        k, n, m = (int(v) for v in case.split("x"))
        n_sets = rotation_count(n * k * 2, 50 * 2**20, maximum=8)
        # The bench rotates the NVFP4 provider through as many sets as fit its
        # own (smaller) weight: "ours_bench_sets" times it that way.
        n_fp4_sets = rotation_count(n * k * 9 // 16, 50 * 2**20, maximum=8)
        sets = []
        for _ in range(max(n_sets, n_fp4_sets)):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            q = lowbit.nvfp4_quantize(w)
            pw, ps = lowbit.nvfp4_prepack(q.packed, q.block_scale)
            sets.append((w, pw, ps, q.global_scale, q))
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(len(sets))]
        ref = lowbit.nvfp4_linear(xs[0], *sets[0][1:4]).float()
        variants = {
            "bf16": lambda i: F.linear(xs[i], sets[i][0]),
            "ours": lambda i: lowbit.nvfp4_linear(xs[i], *sets[i][1:4]),
            "ours_bench_sets": lambda i: lowbit.nvfp4_linear(xs[i], *sets[i][1:4]),
        }
        counts = {"ours_bench_sets": n_fp4_sets}
        for c in (int(v) for v in args.chunks.split(",")):
            variants[f"chunk{c}"] = lambda i, c=c: chunked(xs[i], sets[i][4], c)
            variants[f"overlap{c}"] = lambda i, c=c: overlapped(xs[i], sets[i][4], c, side)
        parts = []
        for name, fn in variants.items():
            try:  # a variant that fails (e.g. under graph capture) is reported, the others still run
                if name != "bf16":
                    y = fn(0).float()
                    torch.cuda.synchronize()
                    err = ((y - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, (case, name, err)
                count = counts.get(name, n_sets)
                graph = time_calls(fn, count) * 1e6
                eager = time_calls(fn, count, use_graph=False, replays=10) * 1e6
            except Exception as e:  # noqa: BLE001 (a probe: report and go on)
                print(f"  {name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            parts.append((name, graph, eager))
        bf16 = parts[0][1]
        print(f"CASE {k}x{n} M={m} (us graph / eager, x = bf16 graph / graph)", flush=True)
        for name, graph, eager in parts:
            print(f"  {name:>10} {graph:9.1f} {eager:9.1f}  x={bf16 / graph:.3f}", flush=True)
        if args.profile:
            for name in ("ours", "ours_bench_sets", "bf16"):
                _profile(name, variants[name], counts.get(name, n_sets))
        del sets, xs, variants
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
