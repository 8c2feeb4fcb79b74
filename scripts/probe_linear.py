"""Probe: the NVFP4 Linear's kernel paths side by side (GPU; a development
tool, not the benchmark: `python -m lowbit.bench linear` is that).

Each --plan is a plan string (csrc/lowbit/linear/sm90_linear_plan.h,
"Overrides"; "default" or "" is the shipped plan) that every call of its
column runs with (lowbit::_nvfp4_linear_with_plan); every row also times
cuBLAS BF16 (F.linear), in turns with the first plan as the bench does, and
checks each output against the dequantized weight. --explain prints, for
each row and plan, the kernel that runs (lowbit.explain_plan).

  python scripts/probe_linear.py --plan default --plan path=unpack --ms 64,256,4096 \
      --shapes 8192x4096,7168x18432 [--json out.json]
  python scripts/probe_linear.py --plan path=wide --plan path=wide,wide_wgmma=1
"""

from __future__ import annotations

import argparse
import json

SHAPES = "8192x4096,7168x18432,18432x7168,4096x4096,2048x7168,1536x24576"


def measure(args, plans) -> dict[str, dict[tuple, dict]]:
    """{plan: {(K, N, M): row}} for every shape, M and plan."""
    import torch
    import torch.nn.functional as F

    import lowbit
    from lowbit.bench.harness import rotation_count, time_calls, time_calls_in_turns
    from lowbit.linear import _explain_plan, _nvfp4_linear_with_plan

    def linear(plan):
        if plan == "":
            return lowbit.nvfp4_linear  # the shipped op itself
        return lambda *a: _nvfp4_linear_with_plan(*a, plan=plan)

    results: dict[str, dict[tuple, dict]] = {p: {} for p in plans}
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        n_sets = rotation_count(n * k * 9 // 16, 50 * 2**20, maximum=8)
        n_bf16 = rotation_count(n * k * 2, 50 * 2**20, maximum=8) if args.bf16 else 0
        sets = []
        for _ in range(max(n_sets, n_bf16)):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            q = lowbit.nvfp4_quantize(w)
            pw, ps = lowbit.nvfp4_prepack(q.packed, q.block_scale)
            sets.append((w, pw, ps, q.global_scale, q))
        deq = lowbit.nvfp4_dequantize(sets[0][4].packed, sets[0][4].block_scale, sets[0][4].global_scale,
                                      torch.float32)
        for m in (int(v) for v in args.ms.split(",")):
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(n_sets, n_bf16))]
            ref = xs[0].float() @ deq.T
            for i, plan in enumerate(plans):
                run = linear(plan)
                y = run(xs[0], *sets[0][1:4]).float()
                err = ((y - ref).norm() / ref.norm()).item()
                ours = (lambda j, run=run: run(xs[j], *sets[j][1:4]), n_sets)
                peer = (lambda j: F.linear(xs[j], sets[j][0]), n_bf16)
                bf16 = args.bf16 and i == 0
                if bf16 and not args.eager:  # in turns, as the bench times them
                    t, tb = time_calls_in_turns([ours, peer])
                else:
                    t = time_calls(*ours, use_graph=not args.eager)
                    tb = time_calls(*peer) if bf16 else None
                row = {"K": k, "N": n, "M": m, "us": t * 1e6, "err": err,
                       "form": _explain_plan(m, n, k, "cuda", plan).form}
                if tb is not None:
                    row["bf16_us"] = tb * 1e6
                if args.explain:
                    print(f"K={k} N={n} M={m} plan {plan or 'default'}:\n{_explain_plan(m, n, k, 'cuda', plan).text}",
                          flush=True)
                results[plan][k, n, m] = row
            del xs
        del sets
        torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", action="append", default=[],
                    help="a plan string, one column each (repeatable; default: the shipped plan)")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ms", default="64,128,256,1024,4096,16384")
    ap.add_argument("--json")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="leave out cuBLAS BF16")
    ap.add_argument("--eager", action="store_true", help="time eager launches, not CUDA graphs")
    ap.add_argument("--explain", action="store_true", help="print each row's plan (lowbit.explain_plan)")
    args = ap.parse_args()
    plans = ["" if p == "default" else p for p in args.plan or ["default"]]
    names = [p or "default" for p in plans]
    results = measure(args, plans)
    keys = sorted({key for r in results.values() for key in r})
    for i, name in enumerate(names):
        print(f"plan {i}: {name}")
    print(f"{'K':>6} {'N':>6} {'M':>6} {'bf16_us':>9}" +
          "".join(f" {f'{i}_us':>8} {'x':>5} {'err':>7} {'form':>8}" for i in range(len(plans))))
    for key in keys:
        base = results[plans[0]].get(key, {}).get("bf16_us")
        line = f"{key[0]:>6} {key[1]:>6} {key[2]:>6} {base if base else float('nan'):>9.1f}"
        for p in plans:
            r = results[p].get(key)
            if r is None:
                line += f" {'-':>8} {'-':>5} {'-':>7} {'-':>8}"
            else:
                x = base / r["us"] if base else float("nan")
                line += f" {r['us']:>8.1f} {x:>5.2f} {r['err']:>7.1e} {r['form']:>8}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({n: list(results[p].values()) for n, p in zip(names, plans)}, f, indent=1)


if __name__ == "__main__":
    main()
