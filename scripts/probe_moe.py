"""Probe: the NVFP4 MoE experts under environment variants side by side (GPU;
a development tool, not the benchmark: `python -m lowbit.bench moe` is that).

Weights are random prepacked bytes (no 0xFF scale byte, the NaN code),
which time like real ones; each variant runs in its own process with
the given environment. Same routing and timing as the benchmark (routing_set:
k routed experts + the shared expert; CUDA graphs, rotating input sets).

  python scripts/probe_moe.py --variants "stream:,regs:LOWBIT_MOE_STREAM=0" \
      --layers flash,v3 --ms 1 --routings uniform,skewed

A variant is name:ENV=VALUE;ENV2=VALUE2 (the kernels read their knobs once
per process: LOWBIT_MOE_STREAM, LOWBIT_MOE_HOT, LOWBIT_STREAM_WARPS).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

LAYERS = {  # H, E, k, I, swiglu limit
    "flash": (4096, 256, 6, 2048, 10.0),
    "pro": (7168, 384, 6, 3072, 10.0),
    "v3": (7168, 256, 8, 2048, None),
}


def worker(args) -> None:
    import torch

    import lowbit
    from lowbit.bench.harness import time_calls
    from lowbit.bench.moe import routing_set

    gen = torch.Generator().manual_seed(0)
    for name in args.layers.split(","):
        h, e, k, inter, limit = LAYERS[name]
        n = e + 1

        def stack(rows, cols):
            w = torch.randint(0, 256, (n, rows, cols // 2), dtype=torch.uint8, device="cuda")
            s = torch.randint(0, 255, (n, rows, cols // 16), dtype=torch.uint8, device="cuda")
            return w, s

        w13, s13 = stack(2 * inter, h)
        w2, s2 = stack(h, inter)
        g13 = torch.full((n,), 1e-3, device="cuda")
        g2 = torch.full((n,), 1e-3, device="cuda")
        for routing in args.routings.split(","):
            for m in (int(v) for v in args.ms.split(",")):
                sets = []
                for _ in range(2):
                    ids, wts, _ = routing_set(routing, m, e, k, gen)
                    x = torch.randn(m, h, generator=gen).to(torch.bfloat16).cuda()
                    sets.append((x, wts.cuda(), ids.cuda()))

                def call(i):
                    x, wts, ids = sets[i]
                    return lowbit.nvfp4_moe(x, wts, ids, w13, s13, g13, w2, s2, g2, limit)

                y = call(0).float()
                t = time_calls(call, len(sets), replays=10)
                print("ROW " + json.dumps({"layer": name, "routing": routing, "M": m, "us": t * 1e6,
                                           "finite": bool(torch.isfinite(y).all())}), flush=True)
        del w13, s13, w2, s2
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="default:")
    ap.add_argument("--layers", default="flash,pro,v3")
    ap.add_argument("--ms", default="1024,4096")
    ap.add_argument("--routings", default="uniform,skewed")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    results = {}
    names = []
    for spec in args.variants.split(","):
        name, _, envs = spec.partition(":")
        names.append(name)
        env = dict(os.environ)
        for kv in filter(None, envs.split(";")):
            key, _, value = kv.partition("=")
            env[key] = value
        cmd = [sys.executable, __file__, "--worker", "--layers", args.layers, "--ms", args.ms,
               "--routings", args.routings]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"variant {name} failed:\n{proc.stderr[-3000:]}")
        for line in proc.stdout.splitlines():
            if line.startswith("ROW "):
                r = json.loads(line[4:])
                results.setdefault((r["layer"], r["routing"], r["M"]), {})[name] = r
    print(f"{'layer':>6} {'routing':>8} {'M':>6}" + "".join(f" {n + '_us':>12}" for n in names))
    for key in sorted(results):
        line = f"{key[0]:>6} {key[1]:>8} {key[2]:>6}"
        for n in names:
            r = results[key].get(n)
            line += f" {r['us']:>12.1f}" if r else f" {'-':>12}"
        print(line)


if __name__ == "__main__":
    main()
