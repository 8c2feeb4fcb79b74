"""Every plan of lowbit.nvfp4_linear on CUDA computes the right answer: each M
of 1..2048 (every form of the dispatch, gemm::linear_plan: stream, stream-K,
two W tiles per warp, narrow, panel, wide, wgmma; their K splits, partial
row blocks and tiles) on a few weight shapes, against a float32 reference.
Which plan each M gets is not looked at, so a retuned heuristic is checked
as it is (tests/cpp/test_linear_plan.cpp checks the plans' invariants)."""

import pytest
import torch

import lowbit
from linear_reference import REL_TOL, make_weight

MAX_M = 2048


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "n,k",
    [
        (256, 512),  # 16 W tiles: K split over the SMs
        (4096, 1024),  # 256 W tiles, K unsplit
        (1536, 1168),  # a partial last k-tile
    ],
)
def test_cuda_every_m_matches_reference(dtype, n, k):
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
        y = lowbit.nvfp4_linear(x[:m], pw, ps, g, b)
        want = base[:m] if b is None else base[:m] + b.float()
        # Per row: a wrong row (a partial tile, the last row block) shows
        # however many rows are right.
        errs.append(((y.float() - want).norm(dim=1) / want.norm(dim=1)).max())
    errs = torch.stack(errs).cpu()
    bad = [(m, round(e, 5)) for m, e in zip(range(1, MAX_M + 1), errs.tolist()) if not e <= REL_TOL]
    assert not bad, bad[:20]
