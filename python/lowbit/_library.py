"""Loads the op library (liblowbit_ops.so), which registers torch.ops.lowbit.

The library links libtorch but not libpython, so the same file serves every
CPython version and plain C++ programs.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

_LIBRARY_NAME = "liblowbit_ops.so"
_loaded_path: str | None = None


def library_path() -> Path:
    """Where the op library is: $LOWBIT_OPS_LIBRARY if set; else beside this
    file (pip installs); else the build folder of a source checkout
    (python/lowbit -> build/, as `bash run.sh build` makes it)."""
    override = os.environ.get("LOWBIT_OPS_LIBRARY")
    if override:
        return Path(override)
    installed = Path(__file__).with_name(_LIBRARY_NAME)
    checkout = Path(__file__).resolve().parents[2] / "build" / _LIBRARY_NAME
    return installed if installed.is_file() or not checkout.is_file() else checkout


def load() -> str:
    global _loaded_path
    if _loaded_path is None:
        path = library_path()
        if not path.is_file():
            raise ImportError(
                f"lowbit: op library not found at {path}. Build it with `bash run.sh build` "
                "(developer checkout) or install the package with `pip install --no-build-isolation .`."
            )
        torch.ops.load_library(str(path))
        _loaded_path = str(path)
    return _loaded_path


def ops_library_path() -> str:
    """The op library (liblowbit_ops.so) this process loaded: what a C++
    program must load (dlopen) before it runs an AOTInductor package of a
    lowbit model, since the package calls lowbit's ops by name. An
    absolute path, links resolved."""
    return str(Path(load()).resolve())


def build_info() -> dict[str, str]:
    """Build flags of the loaded library, e.g. {'cuda': '1', 'arch': 'sm_90a'}."""
    return dict(item.split("=", 1) for item in torch.ops.lowbit.build_info().split())


def has_cuda_kernels() -> bool:
    return build_info().get("cuda") == "1"
