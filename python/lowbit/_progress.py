"""A one-line progress bar on stderr for model conversions."""

from __future__ import annotations

import sys


def progress_bar(label: str, done: int, total: int, name: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {name[:40]:<40}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
