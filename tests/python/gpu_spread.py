"""Which GPU a pytest-xdist worker sees when scripts/gpu_check.sh
(SPREAD_GPUS=n) spreads the workers over a machine's GPUs (conftest.py sets
it before CUDA starts; no imports here that would start it)."""

from __future__ import annotations


def spread_device(worker: str, n: int, visible: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for xdist worker ``worker`` ("gw<k>"): the (k mod
    n)-th of the GPUs the run was given (``visible``, the inherited
    CUDA_VISIBLE_DEVICES; all of 0..n-1 when unset), or None where nothing
    is spread (n <= 1, or not an xdist worker)."""
    if n <= 1 or not worker.startswith("gw"):
        return None
    k = int(worker[2:])
    given = [d.strip() for d in visible.split(",") if d.strip()] if visible else []
    if given:
        return given[k % min(n, len(given))]
    return str(k % n)
