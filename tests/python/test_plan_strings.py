"""Kernel choices are API, not environment: plan strings (the private ops
lowbit::_nvfp4_linear_with_plan and lowbit::_nvfp4_moe_with_plan) are
checked alike on every device, leave the CPU reference unchanged, and
lowbit.explain_plan describes the CPU path; no source file of the library
reads a kernel-choice variable from the environment. The CUDA side:
test_linear_kernels_cuda.py, test_linear_plans_cuda.py."""

import re
from pathlib import Path

import pytest
import torch

import lowbit
from linear_reference import make_weight
from lowbit.linear import _explain_plan, _nvfp4_linear_with_plan
from lowbit.moe import _nvfp4_moe_with_plan

ROOT = Path(__file__).resolve().parents[2]

# One valid value per key (csrc/lowbit/linear/sm90_linear_plan.h, "Overrides").
LINEAR_KEYS = {
    "path": ["stream", "narrow", "panel", "wide", "wgmma", "unpack"],
    "stream_warps": ["1", "2", "4", "8"],
    "stream_ctas_per_sm": ["1", "65535"],
    "stream_k": ["0", "1"],
    "stream_tiles": ["1", "2"],
    "stream_stages": ["2", "3"],
    "stream_splits": ["1", "7"],
    "panel_splits": ["3"],
    "wide_wgmma": ["0", "1"],
    "wgmma_pair": ["0", "1"],
}
LINEAR_BAD = [
    ("bogus=1", 'unknown key "bogus"'),
    ("path=fast", 'key "path" takes stream, narrow, panel, wide, wgmma or unpack, got "fast"'),
    ("stream_warps=3", 'key "stream_warps" takes 1, 2, 4 or 8, got "3"'),
    ("stream_k=yes", 'key "stream_k" takes 0 or 1, got "yes"'),
    ("stream_splits=0", 'key "stream_splits" takes an integer of 1 to 65535, got "0"'),
    ("stream_ctas_per_sm=-1", 'key "stream_ctas_per_sm" takes an integer of 1 to 65535, got "-1"'),
    ("stream_stages=", 'key "stream_stages" takes 2 or 3, got ""'),
    ("stream_k", 'item "stream_k" is not key=value'),
    ("=1", 'item "=1" is not key=value'),
    ("stream_k=1,,path=wide", 'item "" is not key=value'),
    ("stream_k=1,stream_k=0", 'key "stream_k" given twice'),
]
MOE_BAD = [
    ("bogus=1", 'unknown key "bogus" (keys: stream, hot, stream_warps)'),
    ("stream=2", 'key "stream" takes 0 or 1, got "2"'),
    ("stream_warps=16", 'key "stream_warps" takes 1, 2, 4 or 8, got "16"'),
    ("hot=0,hot=0", 'key "hot" given twice'),
]


@pytest.fixture(scope="module")
def linear_case():
    gen = torch.Generator().manual_seed(3)
    _, _, _, pw, ps, g = make_weight(64, 272, gen)
    x = torch.randn(5, 272, generator=gen).to(torch.bfloat16)
    bias = torch.randn(64, generator=gen).to(torch.bfloat16)
    return x, pw, ps, g, bias


@pytest.fixture(scope="module")
def moe_case():
    gen = torch.Generator().manual_seed(4)
    e, h, i, m, k = 4, 64, 32, 6, 2
    q13 = lowbit.nvfp4_quantize(torch.randn(e, 2 * i, h, generator=gen) * 0.02)
    q2 = lowbit.nvfp4_quantize(torch.randn(e, h, i, generator=gen) * 0.02)
    p = lowbit.nvfp4_moe_prepack(q13.packed, q13.block_scale, q2.packed, q2.block_scale)
    x = torch.randn(m, h, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, e, (m, k), generator=gen, dtype=torch.int32)
    w = torch.rand(m, k, generator=gen)
    return (x, w, ids, p.w13, p.w13_scale, q13.global_scale, p.w2, p.w2_scale, q2.global_scale, 0.5)


def test_private_ops_are_registered():
    for name in ("_nvfp4_linear_with_plan", "_nvfp4_moe_with_plan", "_explain_linear_plan"):
        assert hasattr(torch.ops.lowbit, name), name


@pytest.mark.parametrize("key", sorted(LINEAR_KEYS))
def test_every_linear_key_leaves_the_cpu_reference_as_it_is(linear_case, key):
    x, pw, ps, g, bias = linear_case
    want = lowbit.nvfp4_linear(x, pw, ps, g, bias)
    for value in LINEAR_KEYS[key]:
        plan = f" {key} = {value} "  # spaces around items, keys and values are ignored
        assert torch.equal(_nvfp4_linear_with_plan(x, pw, ps, g, bias, plan=plan), want), plan


def test_a_plan_of_several_items_and_the_empty_plan(linear_case):
    x, pw, ps, g, bias = linear_case
    want = lowbit.nvfp4_linear(x, pw, ps, g, bias)
    for plan in ("", "  ", "stream_k=1,wide_wgmma=1,wgmma_pair=1",
                 "stream_tiles=2, stream_stages=3, wide_wgmma=0, wgmma_pair=0"):
        assert torch.equal(_nvfp4_linear_with_plan(x, pw, ps, g, bias, plan=plan), want), plan


@pytest.mark.parametrize("plan,message", LINEAR_BAD)
def test_a_bad_linear_plan_names_the_key_on_every_device(linear_case, plan, message):
    x, pw, ps, g, bias = linear_case
    expected = re.escape(f'lowbit._nvfp4_linear_with_plan: plan "{plan}": {message}')
    with pytest.raises(ValueError, match=expected):
        _nvfp4_linear_with_plan(x, pw, ps, g, bias, plan=plan)
    meta = [t.to("meta") for t in (x, pw, ps, g, bias)]
    with pytest.raises(ValueError, match=expected):
        _nvfp4_linear_with_plan(*meta, plan=plan)
    with pytest.raises(ValueError, match=re.escape(f'lowbit.explain_plan: plan "{plan}": {message}')):
        _explain_plan(1, 64, 272, "cpu", plan)


def test_an_unknown_key_lists_the_keys(linear_case):
    x, pw, ps, g, _ = linear_case
    with pytest.raises(ValueError, match="keys: " + ", ".join(LINEAR_KEYS)):
        _nvfp4_linear_with_plan(x, pw, ps, g, plan="stream_k=1,strem_tiles=2")


def test_moe_plans_on_the_cpu(moe_case):
    want = lowbit.nvfp4_moe(*moe_case)
    for plan in ("", "stream=0", "hot=0", "stream=1,hot=1,stream_warps=4"):
        assert torch.equal(_nvfp4_moe_with_plan(*moe_case, plan=plan), want), plan
    meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in moe_case]
    for plan, message in MOE_BAD:
        expected = re.escape(f'lowbit._nvfp4_moe_with_plan: plan "{plan}": {message}')
        with pytest.raises(ValueError, match=expected):
            _nvfp4_moe_with_plan(*moe_case, plan=plan)
        with pytest.raises(ValueError, match=expected):
            _nvfp4_moe_with_plan(*meta, plan=plan)


def test_private_ops_pass_opcheck(linear_case, moe_case):
    x, pw, ps, g, bias = linear_case
    torch.library.opcheck(torch.ops.lowbit._nvfp4_linear_with_plan.default, (x, pw, ps, g, bias, 0, "path=wide"))
    torch.library.opcheck(torch.ops.lowbit._nvfp4_moe_with_plan.default, (*moe_case, "stream=0"))


def test_private_ops_have_no_backward(linear_case):
    x, pw, ps, g, _ = linear_case
    y = _nvfp4_linear_with_plan(x.float().requires_grad_(), pw, ps, g, plan="path=stream")
    with pytest.raises(NotImplementedError, match="_nvfp4_linear_with_plan has no backward"):
        y.sum().backward()


def test_explain_plan_on_the_cpu():
    told = lowbit.explain_plan(1, 4096, 4096, "cpu")
    assert (told.m, told.n, told.k, told.device) == (1, 4096, 4096, "cpu")
    assert (told.path, told.form, told.workspace_bytes) == ("reference", "reference", 0)
    assert "FP32 matmul" in told.kernel and told.why
    text = str(told)
    assert text.startswith("lowbit.nvfp4_linear, M=1 N=4096 K=4096 on cpu:")
    assert "path: reference" in text and "plan: the shipped plan" in text
    assert "plan: checked, unused on the CPU" in _explain_plan(1, 4096, 4096, "cpu", "path=wide").text
    assert lowbit.explain_plan(0, 16, 16, torch.device("cpu")).path == "reference"


def test_explain_plan_picks_the_device():
    told = lowbit.explain_plan(2, 64, 128)
    cuda = torch.cuda.is_available() and lowbit.has_cuda_kernels()
    assert told.device == (f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")


def test_explain_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="N and K must be multiples of 16"):
        lowbit.explain_plan(1, 17, 16, "cpu")
    with pytest.raises(ValueError, match="M, N and K must be >= 0"):
        lowbit.explain_plan(-1, 16, 16, "cpu")
    with pytest.raises(ValueError, match="a CUDA device or the CPU, got meta"):
        lowbit.explain_plan(1, 16, 16, "meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_explain_plan_without_a_gpu():
    with pytest.raises((ValueError, NotImplementedError), match="no CUDA device 0|no CUDA kernels"):
        lowbit.explain_plan(1, 16, 16, "cuda")


# Variables of the environment the library may read: none chooses a kernel.
# (LOWBIT_OPS_LIBRARY: which op library python/lowbit/_library.py loads.)
ALLOWED_ENV = {"LOWBIT_OPS_LIBRARY"}


@pytest.mark.skipif(not (ROOT / "csrc").is_dir(), reason="needs the source tree")
def test_no_kernel_choice_from_the_environment():
    found = []
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix not in (".h", ".cuh", ".cpp", ".cu"):
            continue
        text = path.read_text()
        # Any read of the environment in the op library (getenv, secure_getenv,
        # std::getenv, environ), and any LOWBIT_* name in a string literal.
        found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in re.finditer(r"\b\w*getenv\s*\(|\benviron\b", text)]
        found += [f"{path.relative_to(ROOT)}: {name}" for name in re.findall(r'"(LOWBIT_\w+)', text)
                  if name not in ALLOWED_ENV]
    for path in sorted((ROOT / "python" / "lowbit").rglob("*.py")):
        names = re.findall(r"""environ(?:\.get)?\s*[\[(]\s*["'](LOWBIT_\w+)""", path.read_text())
        found += [f"{path.relative_to(ROOT)}: {name}" for name in names if name not in ALLOWED_ENV]
    assert not found, found
