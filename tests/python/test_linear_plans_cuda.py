"""Every plan of lowbit.nvfp4_linear on CUDA computes the right answer: each M
of 1..2048 (every form of the dispatch, gemm::linear_plan: stream, stream-K,
two W tiles per warp, narrow, panel, wide, wgmma; their K splits, partial
row blocks and tiles) on a few weight shapes, against a float32 reference,
with the shipped plan and with plan strings that force other forms
(lowbit::_nvfp4_linear_with_plan). Which plan each M gets is not looked at,
so a retuned heuristic is checked as it is (tests/cpp/test_linear_plan.cpp
checks the plans' invariants); lowbit.explain_plan is checked against the
kernel that runs."""

import pytest
import torch

import lowbit
from linear_reference import REL_TOL, make_weight
from lowbit.linear import _explain_plan, _nvfp4_linear_with_plan

MAX_M = 2048
SHAPES = [
    (256, 512),  # 16 W tiles: K split over the SMs
    (4096, 1024),  # 256 W tiles, K unsplit
    (1536, 1168),  # a partial last k-tile
]
# Plan strings that move many M to forms the shipped plan takes rarely:
# stream-K wherever it can run, the wide kernel always on wgmma, wgmma CTAs
# in pairs wherever the tiles allow; two W tiles per warp at 5..16 rows
# wherever the stream kernel can run with rings of 3 slots, the wide kernel
# on mma.sync, wgmma CTAs never paired (test_concurrency.py runs the same).
FORCING_PLANS = [
    "stream_k=1,wide_wgmma=1,wgmma_pair=1",
    "stream_tiles=2,stream_stages=3,wide_wgmma=0,wgmma_pair=0",
]


def _every_m_errors(n, k, dtype, run):
    """Per M of 1..MAX_M the largest relative row error of run(x, pw, ps,
    g, bias) against a float32 reference, a bias at odd M; the M whose
    error exceeds REL_TOL."""
    gen = torch.Generator().manual_seed(n + k)
    _, _, deq, pw, ps, g = make_weight(n, k, gen, "cuda")
    x = torch.randn(MAX_M, k, generator=gen).to(dtype).cuda()
    bias = torch.randn(n, generator=gen).to(dtype).cuda()
    # The reference once, for the most rows; each M checks its first rows
    # (an output row depends on its own row of x only). Odd M with a bias.
    base = x.float() @ deq.cuda().T
    errs = []
    for m in range(1, MAX_M + 1):
        b = bias if m % 2 else None
        y = run(x[:m], pw, ps, g, b)
        want = base[:m] if b is None else base[:m] + b.float()
        # Per row: a wrong row (a partial tile, the last row block) shows
        # however many rows are right.
        errs.append(((y.float() - want).norm(dim=1) / want.norm(dim=1)).max())
    errs = torch.stack(errs).cpu()
    return [(m, round(e, 5)) for m, e in zip(range(1, MAX_M + 1), errs.tolist()) if not e <= REL_TOL]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_cuda_every_m_matches_reference(dtype, n, k):
    bad = _every_m_errors(n, k, dtype, lowbit.nvfp4_linear)
    assert not bad, bad[:20]


@pytest.mark.cuda
@pytest.mark.parametrize("plan", FORCING_PLANS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_cuda_every_m_matches_reference_under_forcing_plans(plan, n, k):
    bad = _every_m_errors(n, k, torch.bfloat16, lambda *args: _nvfp4_linear_with_plan(*args, plan=plan))
    assert not bad, (plan, bad[:20])


# The kernel each form of explain_plan launches (csrc/lowbit/linear/: the
# forms' __global__ functions; unpack: the weight unpacked, then cuBLAS).
FORM_KERNELS = {
    "stream": "linear_stream_kernel",
    "stream-k": "linear_stream_k_kernel",
    "narrow": "linear_narrow_kernel",
    "panel": "linear_panel_kernel",
    "wide": "linear_wide_kernel",
    "wgmma": "wgmma::gemm_kernel",
    "unpack": "unpack_kernel",
}
# (M, N, K, plan): the shipped plan at each range of M, and each form forced.
EXPLAINED = [(m, 4096, 1024, "") for m in (1, 4, 5, 8, 9, 12, 16, 17, 64, 128, 129, 1000, 2048, 2049)] + [
    (1, 256, 512, ""),
    (2, 16 * 350, 1168, ""),
    (1, 4096, 7168, "stream_k=1"),
    (3, 4096, 1024, "path=narrow"),
    (12, 4096, 1024, "path=narrow"),
    (16, 4096, 1024, "path=panel"),
    (12, 4096, 1024, "path=stream,stream_tiles=2"),
    (8, 4096, 1024, "path=wide"),
    (64, 4096, 1024, "path=wide,wide_wgmma=1"),
    (64, 4096, 1024, "path=wide,wide_wgmma=0"),
    (64, 4096, 1024, "path=wgmma"),
    (1000, 4096, 1024, "path=wgmma,wgmma_pair=1"),
    (16, 4096, 1024, "path=unpack"),
]


@pytest.mark.cuda
def test_cuda_explain_plan_names_the_kernel_that_runs():
    from torch.profiler import ProfilerActivity, profile

    weights = {}
    for m, n, k, plan in EXPLAINED:
        told = _explain_plan(m, n, k, "cuda", plan)
        if plan.startswith("path="):  # each forced path here within its rows and K
            assert told.path == plan.split(",")[0][len("path="):], (m, n, k, plan, told.why)
        if (n, k) not in weights:
            weights[n, k] = make_weight(n, k, torch.Generator().manual_seed(n + k), "cuda")[3:]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        _nvfp4_linear_with_plan(x, *weights[n, k], plan=plan)  # first-call setup outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _nvfp4_linear_with_plan(x, *weights[n, k], plan=plan)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        if not names:
            pytest.skip("the profiler records no CUDA kernels here")
        ran = [name for name in names if any(kernel in name for kernel in FORM_KERNELS.values())]
        assert ran and all(FORM_KERNELS[told.form] in name for name in ran), (m, n, k, plan, told.form, ran)
