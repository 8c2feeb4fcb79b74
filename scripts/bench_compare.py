"""Compare two runs of one benchmark suite (the JSON of `--json`), row by row.

    python scripts/bench_compare.py before.json after.json [more pairs...]

A row is named by its integer and string fields (K, N, M; layer, routing,
M); every `*_us` field is a time. For each time column the table shows
after / before per row and the geometric mean over the rows both runs hold.
The peers' columns (bf16_us, fp8_us) changed by nothing but the machine's
noise between the runs, so their spread is the yardstick for lowbit's.
"""

from __future__ import annotations

import json
import math
import sys


def _key(row: dict) -> tuple:
    return tuple((k, v) for k, v in row.items() if isinstance(v, (int, str)) and not isinstance(v, bool))


def compare(before_path: str, after_path: str) -> str:
    with open(before_path) as f:
        before = json.load(f)
    with open(after_path) as f:
        after = json.load(f)
    old = {_key(r): r for r in before["rows"]}
    pairs = [(old[_key(r)], r) for r in after["rows"] if _key(r) in old]
    times = [c for c in after["rows"][0] if c.endswith("_us") and c != "floor_us"] if pairs else []
    lines = [f"## {after.get('suite', '?')}: {after_path} / {before_path} ({len(pairs)} rows in both)", ""]
    lines.append(" | ".join(["row"] + times))
    lines.append(" | ".join(["---"] * (len(times) + 1)))
    logs = {c: [] for c in times}
    for b, a in pairs:
        cells = []
        for c in times:
            if isinstance(b.get(c), (int, float)) and isinstance(a.get(c), (int, float)) and b[c] > 0:
                ratio = a[c] / b[c]
                logs[c].append(math.log(ratio))
                cells.append(f"{ratio:.3f}")
            else:
                cells.append("-")
        lines.append(" | ".join([" ".join(f"{k}={v}" for k, v in _key(a))] + cells))
    summary = []
    for c in times:
        xs = logs[c]
        if xs:
            summary.append(f"{c}: geomean {math.exp(sum(xs) / len(xs)):.3f}, "
                           f"range {math.exp(min(xs)):.3f}-{math.exp(max(xs)):.3f}")
    lines += ["", "after / before: " + "; ".join(summary), ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or len(argv) % 2:
        print(__doc__, file=sys.stderr)
        return 2
    for i in range(0, len(argv), 2):
        print(compare(argv[i], argv[i + 1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
