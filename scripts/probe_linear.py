"""Probe: the NVFP4 Linear's kernel paths side by side (GPU; a development
tool, not the benchmark: `python -m lowbit.bench linear` is that).

Each path runs in its own process with LOWBIT_LINEAR_PATH set (the plan
reads it once); every row also times cuBLAS BF16 (F.linear) in the first
path's process, in turns with it as the bench does, and checks the output
against the dequantized weight.

  python scripts/probe_linear.py --paths default,unpack --ms 64,256,4096 \
      --shapes 8192x4096,7168x18432 [--json out.json]

A path may carry environment knobs for its process after colons:
--paths wide,wide:LOWBIT_LINEAR_WIDE_WGMMA=1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SHAPES = "8192x4096,7168x18432,18432x7168,4096x4096,2048x7168,1536x24576"


def worker(args) -> None:
    import torch
    import torch.nn.functional as F

    import lowbit
    from lowbit.bench.harness import rotation_count, time_calls, time_calls_in_turns

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
            y = lowbit.nvfp4_linear(xs[0], *sets[0][1:4]).float()
            ref = xs[0].float() @ deq.T
            err = ((y - ref).norm() / ref.norm()).item()
            ours = (lambda i: lowbit.nvfp4_linear(xs[i], *sets[i][1:4]), n_sets)
            peer = (lambda i: F.linear(xs[i], sets[i][0]), n_bf16)
            if args.bf16 and not args.eager:  # in turns, as the bench times them
                t, tb = time_calls_in_turns([ours, peer])
            else:
                t = time_calls(*ours, use_graph=not args.eager)
                tb = time_calls(*peer) if args.bf16 else None
            row = {"K": k, "N": n, "M": m, "us": t * 1e6, "err": err}
            if tb is not None:
                row["bf16_us"] = tb * 1e6
            print("ROW " + json.dumps(row), flush=True)
            del xs
        del sets
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--paths", default="default")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ms", default="64,128,256,1024,4096,16384")
    ap.add_argument("--json")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--eager", action="store_true", help="time eager launches, not CUDA graphs")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    results: dict[str, dict[tuple, dict]] = {}
    paths = args.paths.split(",")
    for i, path in enumerate(paths):
        env = dict(os.environ)
        env.pop("LOWBIT_LINEAR_PATH", None)
        name, *knobs = path.split(":")
        if name != "default":
            env["LOWBIT_LINEAR_PATH"] = name
        env.update(knob.split("=", 1) for knob in knobs)
        cmd = [sys.executable, __file__, "--worker", "--shapes", args.shapes, "--ms", args.ms]
        if args.eager:
            cmd.append("--eager")
        if i == 0:
            cmd.append("--bf16")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"path {path} failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        results[path] = {(r["K"], r["N"], r["M"]): r for r in rows}
    keys = sorted({key for r in results.values() for key in r}, key=lambda x: (x[0], x[1], x[2]))
    head = f"{'K':>6} {'N':>6} {'M':>6} {'bf16_us':>9}" + "".join(f" {p + '_us':>12} {'x':>5} {'err':>7}" for p in paths)
    print(head)
    for key in keys:
        base = results[paths[0]].get(key, {}).get("bf16_us")
        line = f"{key[0]:>6} {key[1]:>6} {key[2]:>6} {base if base else float('nan'):>9.1f}"
        for p in paths:
            r = results[p].get(key)
            if r is None:
                line += f" {'-':>12} {'-':>5} {'-':>7}"
            else:
                x = base / r["us"] if base else float("nan")
                line += f" {r['us']:>12.1f} {x:>5.2f} {r['err']:>7.1e}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({p: list(r.values()) for p, r in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
