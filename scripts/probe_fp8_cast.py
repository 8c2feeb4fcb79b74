"""Probe: the FP8 training cast alone (GPU; a development tool, not the
benchmark: `python -m lowbit.bench fp8_train` times the casts inside whole
training steps). For each input and scaling, `lowbit.fp8_cast` with the
transposed copy, timed in CUDA graphs with a cold L2 (lowbit.bench.harness),
with the bytes it must move (input read once, codes and transposed codes
written) over the time; "tensor-given" is tensor scaling with a given scale
(the delayed recipe's single pass). With --ncu each variant runs twice under
an NVTX range named after it, for Nsight Compute:

  python scripts/probe_fp8_cast.py [--shapes 16384x14336,16384x4096] [--json out.json]
  ncu --clock-control none --nvtx -k regex:cast_kernel --section SpeedOfLight \\
      --section InstructionStats python scripts/probe_fp8_cast.py --ncu
"""

from __future__ import annotations

import argparse
import json

import torch

import lowbit  # noqa: F401  (loads the ops)
from lowbit.bench.harness import rotation_count, time_calls

VARIANTS = [("tensor", True), ("tensor", False), ("row", False), ("block", False), ("block2d", False)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="16384x14336,16384x4096,4096x14336", help="ROWSxCOLS,... (bf16 inputs)")
    p.add_argument("--ncu", action="store_true", help="run each variant twice (no timing), for Nsight Compute")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    s = torch.tensor(0.01, device="cuda")
    rows = []
    for r, c in shapes:
        in_bytes = r * c * 2
        n_sets = 1 if a.ncu else rotation_count(2 * in_bytes, l2, maximum=4)
        xs = [torch.randn(r, c, device="cuda", dtype=torch.bfloat16) for _ in range(n_sets)]
        for scaling, given in VARIANTS:
            name = scaling + ("-given" if given else "")

            def call(i, scaling=scaling, given=given):
                torch.ops.lowbit.fp8_cast(xs[i], scaling, "e4m3", True, s if given else None, False)

            if a.ncu:
                call(0)
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push(name)
                call(0)
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
                continue
            t = time_calls(call, n_sets)
            moved = in_bytes + 2 * r * c  # input read, codes and transposed codes written
            rows.append(dict(rows=r, cols=c, scaling=name, us=round(t * 1e6, 1), tb_per_s=round(moved / t / 1e12, 2)))
            print(rows[-1], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
