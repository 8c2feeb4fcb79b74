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


# Ops defined in Python (torch.library.custom_op), not by the C++ library.
PYTHON_OPS = {"lowbit::no_backward"}


def test_every_op_runs_without_autocast():
    # Each C++ op has an Autocast kernel that turns autocast off for its
    # kernels (csrc/torch/registry.cpp, kOps): none is missing from the list.
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("lowbit::"))
    assert len(names) >= 27
    for name in set(names) - PYTHON_OPS:
        for key in ("AutocastCPU", "AutocastCUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), (name, key)


def test_autocast_does_not_reach_inside_the_ops():
    # Under autocast the ops compute as without it: the CPU references'
    # matmuls ran in bfloat16 before (fp8_gemm off by up to 0.2 here).
    gen = torch.Generator().manual_seed(0)
    a = lowbit.fp8_cast(torch.randn(64, 256, generator=gen), "tensor")
    b = lowbit.fp8_cast(torch.randn(32, 256, generator=gen), "tensor")
    w = lowbit.nn.Nvfp4Linear.from_linear(torch.nn.Linear(256, 64))
    x = torch.randn(3, 256, generator=gen)

    def linear(x):  # the op itself (the module casts x first, as nn.Linear)
        return lowbit.nvfp4_linear(x, w.weight, w.weight_scale, w.weight_global, w.bias.to(x.dtype))

    plain = (lowbit.fp8_gemm(a.data, a.scale, b.data, b.scale, out_dtype=torch.float32), linear(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = (lowbit.fp8_gemm(a.data, a.scale, b.data, b.scale, out_dtype=torch.float32), linear(x))
    for p, u in zip(plain, under):
        assert u.dtype == torch.float32 and torch.equal(p, u)


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


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_op_library_imports_libstdcxx_stream_code():
    # The library must call the loaded libstdc++'s stream code, not copies of
    # its own: a host compiler that instantiated them into the library
    # (nvcc's, from an inherited CUDAHOSTCXX) made every error message that
    # formats an integer crash (docs/ARCHITECTURE.md, "Toolchain").
    path = lowbit._library.library_path()
    symbols = subprocess.run(["nm", "-C", str(path)], check=True, capture_output=True, text=True).stdout
    imported = re.findall(r"^\s+U std::ostream& std::ostream::_M_insert<long>\(long\)", symbols, re.M)
    defined = re.findall(r"^[0-9a-f]+ [TWtw] (?:.* )?std::(?:basic_ostream<[^ ]*>|ostream|num_put<[^ ]*>)::.*$",
                         symbols, re.M)
    assert not defined, defined[:5]
    assert imported, "the library formats integers through libstdc++'s ostream (the parse found the import)"
