"""AOTInductor: models built from lowbit's layers, exported with a dynamic
token count, compiled ahead of time into a package (.pt2) and run

- from Python (torch._inductor.aoti_load_package), and
- from a C++ program with no Python in the process (examples/aoti_runner.cpp,
  built as lowbit_aoti_runner beside the op library),

each bit for bit as the eager model. AOTInductor has no C shim for lowbit's
operators: it calls them through the dispatcher by name, so this also checks
that the arguments of the ops these models call (optional tensors, ints,
floats, strings, an optional float) survive that path.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

import lowbit
from lowbit.nn import Nvfp4MoE

# Every test here compiles an AOTInductor package: the slow tier (-m 'not slow' leaves it out).
pytestmark = pytest.mark.slow

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
H, E, I, K, VOCAB = 128, 8, 64, 2, 50


def linear_stack(gen):
    """Two Nvfp4Linear layers (one with a bias) around a GELU."""
    layers = torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.GELU(), torch.nn.Linear(2 * H, H, bias=False))
    with torch.no_grad():
        for p in layers.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return lowbit.quantize_(layers.bfloat16(), progress=False)


def hash_moe(gen):
    """A DeepSeek-V4-like hash-routed MoE with a fused shared expert: the
    routing ops and nvfp4_moe in one graph, two inputs."""
    return Nvfp4MoE.from_bf16(
        (torch.randn(E, 2 * I, H, generator=gen) * 0.05).bfloat16(),
        (torch.randn(E, H, I, generator=gen) * 0.05).bfloat16(),
        (torch.randn(E, H, generator=gen) * H**-0.5).bfloat16(),
        k=K, mode="hash", tid2eid=torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(VOCAB)]),
        routed_scaling_factor=1.5, swiglu_limit=0.5,
        shared_gate_proj=(torch.randn(I, H, generator=gen) * 0.05).bfloat16(),
        shared_up_proj=(torch.randn(I, H, generator=gen) * 0.05).bfloat16(),
        shared_down_proj=(torch.randn(H, I, generator=gen) * 0.05).bfloat16())


def dense_moe(gen):
    """A DeepSeek-V3-like MoE: sigmoid scores, group-limited top-k with a
    correction bias (dense_router), no shared expert."""
    return Nvfp4MoE.from_bf16(
        (torch.randn(E, 2 * I, H, generator=gen) * 0.05).bfloat16(),
        (torch.randn(E, H, I, generator=gen) * 0.05).bfloat16(),
        (torch.randn(E, H, generator=gen) * H**-0.5).bfloat16(), torch.randn(E, generator=gen) * 0.1,
        k=K, score_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)


MODELS = {"linear": linear_stack, "hash_moe": hash_moe, "dense_moe": dense_moe}
# The lowbit ops each exported graph must hold (what the package then calls).
OPS = {"linear": {"nvfp4_linear"}, "hash_moe": {"hash_router", "nvfp4_moe"},
       "dense_moe": {"dense_router", "nvfp4_moe"}}


def inputs(name, m, gen, device):
    x = torch.randn(m, H, generator=gen).bfloat16().to(device)
    return (x, torch.randint(0, VOCAB, (m,), generator=gen).to(device)) if name == "hash_moe" else (x,)


def runner_path() -> Path:
    """The C++ runner, or a skip (a failure under CI, which builds it)."""
    runner = Path(lowbit.ops_library_path()).with_name("lowbit_aoti_runner")
    if not runner.is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{runner} was not built (CMake option LOWBIT_BUILD_EXAMPLES)")
        pytest.skip(f"{runner} not built (a pip install builds no examples)")
    return runner


def run_from_cpp(package: Path, args, tmp_path: Path) -> tuple:
    """The package's outputs for args, computed by the C++ runner."""
    torch.save([a.cpu() for a in args], tmp_path / "in.pt")
    run = subprocess.run([str(runner_path()), lowbit.ops_library_path(), str(package),
                          str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(tmp_path / "out.pt")


@pytest.fixture(scope="module", params=DEVICES)
def packages(request, tmp_path_factory):
    """{name: (eager model, package path)} for one device. Compiling a package
    takes tens of seconds, so each is made once per module."""
    device = request.param
    gen = torch.Generator().manual_seed(11)
    tokens = torch.export.Dim("tokens")
    out = {}
    with torch.no_grad():
        for name, make in MODELS.items():
            model = make(gen).to(device).eval()
            args = inputs(name, 7, gen, device)
            exported = torch.export.export(model, args, dynamic_shapes=tuple({0: tokens} for _ in args))
            ops = {n.target.name().split("::")[1] for n in exported.graph.nodes
                   if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "lowbit"}
            assert ops == OPS[name], ops
            path = tmp_path_factory.mktemp(f"aoti-{device}") / f"{name}.pt2"
            torch._inductor.aoti_compile_and_package(exported, package_path=str(path))
            out[name] = (model, path)
    return device, out


@pytest.mark.parametrize("name", list(MODELS))
def test_package_runs_in_python(packages, name):
    device, built = packages
    model, path = built[name]
    runner = torch._inductor.aoti_load_package(str(path))
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for m in (1, 9, 33, 0):
            args = inputs(name, m, gen, device)
            got, want = runner(*args), model(*args)
            assert got.shape == (m, H) and got.device == want.device
            assert torch.equal(got, want), (name, m)
            if m:
                assert got.abs().sum() > 0  # the comparison saw real outputs


@pytest.mark.parametrize("name", list(MODELS))
def test_package_runs_from_cpp(packages, name, tmp_path):
    device, built = packages
    model, path = built[name]
    gen = torch.Generator().manual_seed(13)
    for m in (5, 40):
        args = inputs(name, m, gen, device)
        (got,) = run_from_cpp(path, args, tmp_path)
        with torch.no_grad():
            want = model(*args).cpu()
        assert torch.equal(got, want), (name, m)
        assert got.abs().sum() > 0


def test_runner_reports_a_missing_op_library(packages, tmp_path):
    runner = runner_path()
    _, built = packages
    run = subprocess.run([str(runner), str(tmp_path / "missing.so"), str(built["linear"][1]), "in.pt", "out.pt"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "cannot load the op library" in run.stderr, run.stderr
