"""The op library itself: loadable from any CPython (no libpython), ops
registered after `import lowbit`, build flags reported."""

import re
import shutil
import subprocess

import pytest
import torch

import lowbit


def test_ops_are_registered_after_import():
    for name in ("nvfp4_quantize", "nvfp4_dequantize", "build_info"):
        assert hasattr(torch.ops.lowbit, name), name


def test_build_info_is_parsed():
    info = lowbit.build_info()
    assert info["cuda"] in ("0", "1")
    assert lowbit.has_cuda_kernels() == (info["cuda"] == "1")


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_op_library_does_not_link_libpython():
    path = lowbit._library.library_path()
    dynamic = subprocess.run(["readelf", "-d", str(path)], check=True, capture_output=True, text=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    assert any(n.startswith("libc10") for n in needed), needed  # the parse found the entries
    assert not [n for n in needed if "python" in n.lower()], needed


def test_ops_library_path_is_the_loaded_library():
    path = lowbit.ops_library_path()
    assert path.endswith("liblowbit_ops.so")
    with open("/proc/self/maps") as maps:  # mapped into this process, not just present on disk
        assert any(line.rstrip().endswith(path) for line in maps), path
