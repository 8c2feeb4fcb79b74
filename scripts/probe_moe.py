"""Probe: the NVFP4 MoE experts under plan variants side by side (GPU; a
development tool, not the benchmark: `python -m lowbit.bench moe` is that).

Weights are random prepacked bytes (no 0xFF scale byte, the NaN code),
which time like real ones; each variant runs every call with its plan
string (lowbit::_nvfp4_moe_with_plan; keys stream, hot, stream_warps:
csrc/lowbit/moe/nvfp4_moe.h, MoePlanOverrides). Same routing and timing as
the benchmark (routing_set: k routed experts + the shared expert; CUDA
graphs, rotating input sets).

  python scripts/probe_moe.py --variant stream: --variant regs:stream=0 \
      --layers flash,v3 --ms 1 --routings uniform,skewed

A variant is name:plan (an empty plan: the shipped one).
"""

from __future__ import annotations

import argparse

LAYERS = {  # H, E, k, I, swiglu limit
    "flash": (4096, 256, 6, 2048, 10.0),
    "pro": (7168, 384, 6, 3072, 10.0),
    "v3": (7168, 256, 8, 2048, None),
}


def measure(args, variants) -> dict[tuple, dict[str, float]]:
    """{(layer, routing, M): {variant name: microseconds}}."""
    import torch

    from lowbit.bench.harness import time_calls
    from lowbit.bench.moe import routing_set
    from lowbit.moe import _nvfp4_moe_with_plan

    results: dict[tuple, dict[str, float]] = {}
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
                for variant, plan in variants:
                    def call(i, plan=plan):
                        x, wts, ids = sets[i]
                        return _nvfp4_moe_with_plan(x, wts, ids, w13, s13, g13, w2, s2, g2, limit, plan=plan)

                    if not torch.isfinite(call(0)).all():
                        print(f"{name} {routing} M={m} {variant}: non-finite output", flush=True)
                    t = time_calls(call, len(sets), replays=10)
                    results.setdefault((name, routing, m), {})[variant] = t * 1e6
        del w13, s13, w2, s2
        torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", default=[],
                    help="name:plan, one column each (repeatable; default: the shipped plan)")
    ap.add_argument("--layers", default="flash,pro,v3")
    ap.add_argument("--ms", default="1024,4096")
    ap.add_argument("--routings", default="uniform,skewed")
    args = ap.parse_args()
    variants = [tuple(spec.partition(":")[::2]) for spec in args.variant or ["default:"]]
    names = [name for name, _ in variants]
    results = measure(args, variants)
    print(f"{'layer':>6} {'routing':>8} {'M':>6}" + "".join(f" {n + '_us':>12}" for n in names))
    for key in sorted(results):
        line = f"{key[0]:>6} {key[1]:>8} {key[2]:>6}"
        for n in names:
            us = results[key].get(n)
            line += f" {us:>12.1f}" if us is not None else f" {'-':>12}"
        print(line)


if __name__ == "__main__":
    main()
