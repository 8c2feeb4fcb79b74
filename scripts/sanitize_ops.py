"""Every lowbit op and kernel form once, at small sizes, for compute-sanitizer.

    compute-sanitizer --tool memcheck --kernel-name kns=lowbit --target-processes all \\
        python scripts/sanitize_ops.py

(scripts/gpu_check.sh MODE=sanitize runs it under memcheck, racecheck,
synccheck and initcheck.) The cases are the concurrency test's
(tests/python/test_concurrency.py build_cases, small sizes): quantize,
dequantize, prepack, unpack, the MoE prepack, nvfp4_linear in each kernel
form small shapes reach (narrow, stream, panel, wide on mma.sync and on
wgmma, wgmma, CTA pairs, unpack + cuBLAS, the FP8 mode), the grouped
Linear (wgmma, unpack + bmm), route (each score function, group limits,
CTA-per-token, warp-per-token and general paths), dense_router (the gate
kernel's forms and cuBLAS), hash_router, topk, and nvfp4_moe in every plan
(direct one token, narrow, mixed with a hot list, wide MT 4 / 8, wgmma
128 / 256) under dense, grouped and hash routing. Each first result is
checked against the CPU op (or, where that is slow, float32 math on the
dequantized weights); a mismatch makes the exit status 1.

Forms the small shapes do not reach run as the concurrency test's Linear
and MoE cases under its plan strings (PLAN_SETS, in this process);
--no-plans leaves those cases out. --list prints the cases; --device cpu
runs everything on the CPU kernels (a dry run of this script).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402

import test_concurrency as tc  # noqa: E402


def run_cases(device, families, only, skip, plans):
    t0 = time.monotonic()
    tc.REFERENCE_DEVICE = "cpu"  # no cuBLAS kernel in the checked process but the cases' own
    cases = tc.build_cases(device, small=True, families=families)
    if not plans:
        cases = [c for c in cases if not c.plan]
    if only:
        cases = [c for c in cases if any(s in c.name for s in only)]
    if skip:
        cases = [c for c in cases if not any(s in c.name for s in skip)]
    failures = 0
    with torch.no_grad():
        for case in cases:
            try:
                out = case.run()
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                problem = case.check(out)
            except Exception as e:  # noqa: BLE001 - reported per case
                problem = f"{type(e).__name__}: {str(e)[:300]}"
            failures += problem is not None
            print(f"{'ok  ' if problem is None else 'FAIL'} {case.name}{'' if problem is None else ': ' + problem}",
                  flush=True)
    print(f"{len(cases)} cases, {failures} failed, {time.monotonic() - t0:.1f} s", flush=True)
    return failures


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--families", default=None, help="comma-separated: " + ",".join(tc.FAMILIES))
    p.add_argument("--only", action="append", default=[], help="cases whose name contains this (repeatable)")
    p.add_argument("--skip", action="append", default=[], help="leave out cases whose name contains this (repeatable)")
    p.add_argument("--no-plans", action="store_true", help="leave out the cases under forcing plan strings")
    p.add_argument("--list", action="store_true")
    a = p.parse_args(argv)
    families = set(a.families.split(",")) if a.families else None
    if a.list:
        for c in tc.build_cases("cpu", small=True, families=families):
            if c.plan and a.no_plans:
                continue
            print(f"{c.op:<22} {c.name}")
        return 0
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("sanitize_ops.py: no CUDA device", file=sys.stderr)
        return 2
    return 1 if run_cases(a.device, families, a.only, a.skip, not a.no_plans) > 0 else 0


if __name__ == "__main__":
    sys.exit(main())
