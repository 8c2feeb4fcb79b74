"""python -m lowbit.bench <suite> [--json PATH] [--quick] [--shapes M,K,N;...] [--profile]

Each suite is a module lowbit.bench.<suite> with
``run(hw: Hardware, quick: bool) -> (rows, columns)``; the table is printed
and the rows, with the measured hardware, written as JSON. ``--shapes``
(suites whose run takes ``shapes``: fp8_train, (M, K, N) each; moe, token
counts M) measures those shapes instead of the suite's own, e.g. half of
them per run. ``--profile`` (suites whose run takes ``profile``: model)
also prints where each measured step's time goes, by op. Files a suite
writes beside the table (bench model's plot) go to the --json file's
folder.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import pkgutil
import sys

import torch

import lowbit.bench as bench_pkg
from lowbit.bench.harness import format_table, measure_hardware, write_json

_NOT_SUITES = {"harness"}


def available_suites() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench_pkg.__path__) if m.name not in _NOT_SUITES | {"__main__"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowbit.bench", description=__doc__.splitlines()[0])
    parser.add_argument("suite", choices=available_suites())
    parser.add_argument("--json", help="write rows and measured hardware to this file")
    parser.add_argument("--quick", action="store_true", help="fewer shapes, for smoke runs")
    parser.add_argument("--shapes", help="semicolon-separated comma-separated sizes, e.g. '16384,4096,14336;2048,4096,4096'")
    parser.add_argument("--profile", action="store_true", help="also print each step's time by op (suite model)")
    args = parser.parse_args(argv)
    suite = importlib.import_module(f"lowbit.bench.{args.suite}")
    kwargs = {}
    if args.profile:
        if "profile" not in inspect.signature(suite.run).parameters:
            parser.error(f"--profile: suite {args.suite!r} has no profile")
        kwargs["profile"] = True
    if args.shapes:
        if "shapes" not in inspect.signature(suite.run).parameters:
            parser.error(f"--shapes: suite {args.suite!r} has no shape selection")
        try:
            kwargs["shapes"] = [tuple(int(v) for v in part.split(",")) for part in args.shapes.split(";") if part]
        except ValueError:
            parser.error(f"--shapes: expected sizes like '16384,4096,14336;2048,4096,4096', got {args.shapes!r}")
    if "out_dir" in inspect.signature(suite.run).parameters:
        # Files a suite writes beside its table (plots) go where the JSON goes.
        kwargs["out_dir"] = os.path.dirname(os.path.abspath(args.json)) if args.json else "."
    if not torch.cuda.is_available():
        print("lowbit.bench: benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    hw = measure_hardware()
    print(
        f"# {hw.name}: {hw.sms} SMs, L2 {hw.l2_bytes / 2**20:.0f} MiB, measured HBM {hw.hbm_bytes_per_s / 1e12:.2f} TB/s, "
        f"BF16 {hw.bf16_flops / 1e12:.0f} TFLOP/s, FP8 {hw.fp8_flops / 1e12:.0f} TFLOP/s"
    )
    rows, columns = suite.run(hw, args.quick, **kwargs)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun (fp8_parallel) one rank reports
        return 0
    print(format_table(rows, columns))
    if args.json:
        write_json(args.json, args.suite, hw, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
