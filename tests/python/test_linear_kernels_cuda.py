"""The CUDA forms of lowbit.nvfp4_linear (narrow, stream, stream-K, wide,
panel, wgmma, unpack + cuBLAS) at their edges, forced through a plan string
(lowbit::_nvfp4_linear_with_plan) where the plan would not pick them, and in
CUDA graphs (tolerances: linear_reference.py)."""

import pytest
import torch

import lowbit
from linear_reference import REL_TOL, Stack, make_weight, reference, rel_err
from lowbit.linear import _explain_plan, _nvfp4_linear_with_plan


cuda = pytest.mark.cuda


# Every path of the CUDA dispatch and its edges: the narrow kernel (one or
# two m-tiles), the wide kernel (32 or 64 rows per CTA, several row blocks),
# the wgmma kernel (129..2048 rows: partial token tiles, K split over
# clusters when the tiles are few), unpack + cuBLAS (above 2048 rows).
CUDA_M = [1, 2, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 300, 1000, 2100]


@cuda
def test_cuda_unpack_path_is_exact():
    # Above 2048 rows the weight is unpacked (unpack_kernel) and multiplied
    # by cuBLAS. With x = I, y = W^T is the unpacked weight bit for bit
    # (one nonzero product per output): the dequantized weight rounded once
    # to x's dtype. K = 2064: 16 whole k-tiles and a partial one; N = 48:
    # three tile rows.
    gen = torch.Generator().manual_seed(20)
    n, k = 48, 2064
    _, _, deq, pw, ps, g = make_weight(n, k, gen, "cuda")
    for dtype in (torch.bfloat16, torch.float16):
        w_back = lowbit.nvfp4_linear(torch.eye(k, dtype=dtype, device="cuda"), pw, ps, g).T
        assert torch.equal(w_back.cpu(), deq.to(dtype)), dtype


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "n,k",
    [
        (16, 16),
        (48, 400),  # one warp per whole W tile row: no partials
        (1024, 128),  # whole W tile rows, several per warp
        (1536, 4096),
        (4096, 1024),
        (256, 7168),  # W tile rows cut between many warps
        (2048, 2176),  # K not a multiple of 128, every run crossing rows
    ],
)
def test_cuda_matches_fp32_reference_every_m(dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    _, _, deq, pw, ps, g = make_weight(n, k, gen, "cuda")
    deq_cuda = deq.cuda()
    bias = torch.randn(n, generator=gen).to(dtype).cuda()
    for m in CUDA_M:
        x = torch.randn(m, k, generator=gen).to(dtype).cuda()
        for b in (None, bias):
            y = lowbit.nvfp4_linear(x, pw, ps, g, b)
            want = x.float() @ deq_cuda.T + (0 if b is None else b.float())
            assert torch.isfinite(y).all()
            err = rel_err(y, want)
            assert err <= REL_TOL, (m, err)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "n,k,ms",
    [
        # 97 blocks of 128 W rows, the last cut at 16 rows; a partial last
        # k-tile; partial 256-token tiles, K split in two at M = 300; CTAs
        # in pairs (linear_wgmma_pairs) at M = 1000 and 1100, whose fifth
        # token tile pairs with one past M.
        (16 * 769, 2176, (300, 1000, 1100)),
        # 8 output tiles: K (15 k-tiles, the last one partial) split over
        # clusters of 8 CTAs, the last split one k-tile long.
        (1024, 1904, (129, 256)),
    ],
)
def test_cuda_wgmma_edges(dtype, n, k, ms):
    gen = torch.Generator().manual_seed(n + k)
    _, _, deq, pw, ps, g = make_weight(n, k, gen, "cuda")
    deq_cuda = deq.cuda()
    bias = torch.randn(n, generator=gen).to(dtype).cuda()
    for m in ms:
        x = torch.randn(m, k, generator=gen).to(dtype).cuda()
        for b in (None, bias):
            y = lowbit.nvfp4_linear(x, pw, ps, g, b)
            want = x.float() @ deq_cuda.T + (0 if b is None else b.float())
            assert rel_err(y, want) <= REL_TOL, m
        assert torch.equal(y, lowbit.nvfp4_linear(x, pw, ps, g, bias))  # deterministic


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [16 * 385, 16 * 449, 16 * 521])
def test_cuda_wide_wgmma_edges(dtype, n):
    # On an H100 (gemm::linear_plan) the wide kernel runs on wgmma: from 2^25
    # weights (N >= 7184 here) at 9..16 rows of x (MT = 2), with K >= 7168 at
    # 17..32 (MT = 4), and 33..128 uses MT = 8 with one and two row blocks.
    # K splits go through partials at N = 6160 (and at N = 7184 with MT 2
    # or 4) and add up in a cluster at N = 7184 with MT = 8 and at N = 8336.
    # N / 16 = 385, 449 or 521 W tiles: the last CTA has one warp with a tile
    # (the other seven decode a stand-in tile); K = 585 * 16 leaves the last
    # k-tile partial.
    k = 16 * 585
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda") * 0.02
    q = lowbit.nvfp4_quantize(w)
    pw, ps = lowbit.nvfp4_prepack(q.packed, q.block_scale)
    deq = lowbit.nvfp4_dequantize(q.packed, q.block_scale, q.global_scale, torch.float32)
    bias = torch.randn(n, device="cuda").to(dtype)
    for m in (12, 16, 17, 32, 33, 64, 65, 128):
        x = torch.randn(m, k, device="cuda").to(dtype)
        for b in (None, bias):
            y = lowbit.nvfp4_linear(x, pw, ps, q.global_scale, b)
            want = x.float() @ deq.T + (0 if b is None else b.float())
            assert torch.isfinite(y).all()
            assert rel_err(y, want) <= REL_TOL, m
        assert torch.equal(y, lowbit.nvfp4_linear(x, pw, ps, q.global_scale, bias))  # deterministic


@cuda
@pytest.mark.parametrize(
    "n,k",
    [(16 * t, 1168) for t in (3200, 2048, 1400, 1152, 700, 350)] + [(16 * 1400, 2064), (16 * 700, 4112)],
)
def test_cuda_small_m_kernel_shapes(n, k):
    # On a 132-SM H100 (gemm::linear_plan). K = 1168 (9 full k-tiles and a
    # partial one): the stream kernel runs M 5..8 always and M 1..4 on all
    # but 350 tiles (there: the narrow kernel, 4 warps per tile): on 2048
    # and 1400 tiles one warp per tile, at most 16 and 11 CTAs per SM; on
    # 1152 and 700 two warps per tile, at most 8 and 6 CTAs per SM; on 3200
    # two warps per tile, uncapped (more than 1.5 waves). K = 2064 on 1400
    # tiles: one warp per tile as well (its 17 k-tiles), at most 11 CTAs
    # per SM, M 1..8. K = 4112 gives the stream kernel 8 warps per tile, too
    # many for the cap, so M 1..4 run the narrow kernel (2 warps per tile).
    # M = 9 runs the wide kernel on all but 350 tiles: on wgmma from 2^25
    # weights (3200 and 2048 tiles at K = 1168, both larger K), on
    # mma.sync below (1400, 1152 and 700 tiles at K = 1168). M = 16 runs the
    # panel kernel where its grid fits one wave (panel_shape: most of
    # these), else the wide kernel (3200 tiles at K = 1168 and 1400 at
    # K = 2064, on wgmma).
    gen = torch.Generator().manual_seed(n)
    _, _, deq, pw, ps, g = make_weight(n, k, gen, "cuda")
    deq_cuda = deq.cuda()
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).cuda()
    for m in (1, 5, 8, 9, 16):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
        y = lowbit.nvfp4_linear(x, pw, ps, g, bias)
        assert rel_err(y, x.float() @ deq_cuda.T + bias.float()) <= REL_TOL, m
        assert torch.equal(y, lowbit.nvfp4_linear(x, pw, ps, g, bias))  # deterministic


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "n,k",
    [
        # On an H100 (gemm::linear_plan, panel_shape) 12..16 rows run the
        # panel kernel here (9 the narrow or wide kernel, as a check of the
        # plan's edge), every shape with a partial last k-tile and a last CTA
        # with fewer W tiles than warps: K unsplit (257 CTAs, one warp of the
        # last with a tile); K in two splits added in a cluster (13 k-tiles:
        # 7 + 6); K in eight splits through partials (57 k-tiles, the last
        # split one long; 5 of the last CTA's warps with a tile).
        (16 * 2049, 1168),
        (16 * 1537, 1552),
        (16 * 261, 7184),
    ],
)
def test_cuda_panel_edges(dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    _, _, deq, pw, ps, g = make_weight(n, k, gen, "cuda")
    deq_cuda = deq.cuda()
    bias = torch.randn(n, generator=gen).to(dtype).cuda()
    for m in (9, 12, 16):  # at 12, rows past M arrive as zeros (the x copy's bounds)
        x = torch.randn(m, k, generator=gen).to(dtype).cuda()
        for b in (None, bias):
            y = lowbit.nvfp4_linear(x, pw, ps, g, b)
            want = x.float() @ deq_cuda.T + (0 if b is None else b.float())
            assert torch.isfinite(y).all()
            assert rel_err(y, want) <= REL_TOL, (m, b is None)
        assert torch.equal(y, lowbit.nvfp4_linear(x, pw, ps, g, bias))  # deterministic


@cuda
@pytest.mark.parametrize("m", [1, 16])
def test_cuda_chained_layers_in_a_graph(m):
    # Each layer's input is the previous layer's output. The kernels are
    # programmatic dependent launches that prefetch W before waiting for the
    # previous grid: a read of x before that wait would show up here, most
    # likely under graph replay, where launches overlap the most. Every layer
    # is checked against its own actual input, so errors do not compound.
    # M = 1: N = 4096 runs unsplit, N = 2048 with split-K and the reduce
    # kernel. M = 16: the panel kernel, K split through partials and the
    # reduce kernel, which lets the next layer's kernel start early.
    gen = torch.Generator().manual_seed(m)
    layers = [make_weight(n, k, gen, "cuda") for n, k in [(4096, 2048), (2048, 4096)] * 2]
    x0 = torch.randn(m, 2048, generator=gen).to(torch.bfloat16).cuda()

    def forward(x):
        outs = []
        for *_, pw, ps, g in layers:
            x = lowbit.nvfp4_linear(x, pw, ps, g)  # W ~ 0.02 randn, K >= 2048: outputs stay O(1)
            outs.append(x)
        return outs

    forward(x0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = forward(x0)
    for _ in range(3):
        x0.copy_(torch.randn(m, 2048, generator=gen).to(torch.bfloat16))  # stale intermediates would differ
        graph.replay()
        torch.cuda.synchronize()
        inputs = [x0] + outs[:-1]
        for (_, _, deq, *_), xin, y in zip(layers, inputs, outs):
            assert rel_err(y, xin.float() @ deq.cuda().T) <= REL_TOL


@cuda
def test_cuda_more_w_tiles_than_grid_y_holds():
    # N = 16 * 65536: one 16-row W tile more than the stream and narrow
    # kernels can put on grid y (65535, a launch error beyond), so the plan
    # runs the wide kernel there (linear_plan). K = 32 keeps it small (64 MB
    # prepacked, K padded to 128).
    gen = torch.Generator().manual_seed(22)
    n, k = 16 * 65536, 32
    _, _, deq, pw, ps, g = make_weight(n, k, gen, "cuda")
    deq_cuda = deq.cuda()
    for m in (1, 5, 12):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
        y = lowbit.nvfp4_linear(x, pw, ps, g)
        assert rel_err(y, x.float() @ deq_cuda.T) <= REL_TOL, m


def _small_m_cases(gen, shapes, ms):
    """(x, prepacked weight, scale, global, bias or None) per (N, K) shape,
    dtype (bf16, fp16) and M, with a bias at odd M, and each reference."""
    cases, wants = [], []
    for n, k in shapes:
        _, _, deq, pw, ps, g = make_weight(n, k, gen)
        for dtype in (torch.bfloat16, torch.float16):
            bias = torch.randn(n, generator=gen).to(dtype)
            for m in ms:
                x = torch.randn(m, k, generator=gen).to(dtype)
                b = bias if m % 2 else None
                cases.append((x, pw, ps, g, b))
                wants.append(reference(x, deq, b))
    return cases, wants


def _cuda(t):
    return None if t is None else t.cuda()


def _check_stream_runs(seed, shapes, ms, plans):
    """Every case of _small_m_cases(shapes, ms) under each (plan string,
    expect) of `plans`: the plan runs the stream kernel with `expect` in its
    description (explain_plan), and each output matches the reference, is
    the same on a second call, and bit for bit the first plan's (the later
    plans must change no product nor the order of the sums)."""
    gen = torch.Generator().manual_seed(seed)
    cases, wants = _small_m_cases(gen, shapes, ms)
    first = None
    for plan, expect in plans:
        runs = []
        for x, pw, ps, g, b in cases:
            told = _explain_plan(x.shape[0], pw.shape[0], x.shape[1], "cuda", plan)
            assert told.form == "stream" and expect in told.kernel, (plan, x.shape, pw.shape, told.kernel)
            args = [_cuda(t) for t in (x, pw, ps, g, b)]
            runs.append([_nvfp4_linear_with_plan(*args, plan=plan).cpu() for _ in range(2)])
        first = runs if first is None else first
        for (x, pw, *_), want, (y, again), (y_first, _) in zip(cases, wants, runs, first):
            assert rel_err(y, want) <= REL_TOL, (plan, x.shape, pw.shape, x.dtype)
            assert torch.equal(y, again), (plan, x.shape, pw.shape, x.dtype)
            assert torch.equal(y, y_first), (plan, x.shape, pw.shape, x.dtype)


@cuda
def test_cuda_stream_kernel_every_row_pair_build():
    # The stream kernel is built for 1, 2 and 4 pairs of x rows (M <= 2,
    # <= 4, <= 8; Linear v17). The stream path is forced, so every build
    # runs with every warps-per-tile count (1, 2, 4 or 8, from the tile
    # counts), K split through partials (few tiles), a partial last k-tile
    # and odd M (the last pair's second row, past M, is copied from a valid
    # row and never read: Linear v20), in bf16 and fp16. Then again with a
    # forced cap (3 CTAs per SM).
    shapes = [(48, 400), (1024, 2176), (16 * 2048, 1168), (16 * 1152, 1168), (4096, 7168)]
    stream = "path=stream,stream_tiles=1"
    _check_stream_runs(21, shapes, (1, 2, 3, 4, 5, 7, 8),
                       [(stream, "1 W tile per warp"), (stream + ",stream_ctas_per_sm=3", "1 W tile per warp")])


@cuda
def test_cuda_stream_kernel_two_tiles_per_warp():
    # The stream kernel with two W tiles per warp (Linear v23), forced at
    # 5..16 rows: its 4-pair (M <= 8) and 8-pair builds (two m-tiles of x),
    # odd tile counts (the last warp's second tile a stand-in that is read
    # but never stored), K split through partials (65 tiles), one warp per
    # tile pair (1354 pairs), a partial last k-tile, odd M with a bias, bf16
    # and fp16. Then again capped at one CTA per SM.
    shapes = [(48, 400), (1040, 2176), (16 * 2707, 400), (16 * 1152, 1168), (4096, 7168)]
    pairs = "path=stream,stream_tiles=2"
    _check_stream_runs(23, shapes, (5, 7, 8, 9, 12, 13, 16),
                       [(pairs, "2 W tiles per warp"), (pairs + ",stream_ctas_per_sm=1", "at most 1 CTA per SM")])


@cuda
def test_cuda_stream_kernel_eight_warp_pairs():
    # Two W tiles per warp in 8-warp CTAs over the whole K (the plan's at
    # 9..16 rows on some shapes, Linear v27), forced on every shape: warps
    # with no k-tile (K = 400: 4 k-tiles), runs of 1-7 k-tiles, several
    # waves (1354 pairs), odd tile counts, a partial last k-tile, odd M with
    # a bias, bf16 and fp16. Then capped at one CTA per SM (no sum changes:
    # bit for bit the same).
    shapes = [(48, 400), (1040, 2176), (16 * 2707, 400), (16 * 1152, 1168), (4096, 7168)]
    eights = "path=stream,stream_tiles=2,stream_warps=8,stream_splits=1"
    _check_stream_runs(27, shapes, (9, 12, 13, 16),
                       [(eights, "2 W tiles per warp"), (eights + ",stream_ctas_per_sm=1", "at most 1 CTA per SM")])


@cuda
def test_cuda_stream_kernel_ring_slots():
    # The stream kernel's rings of 2 and 3 slots (Linear v25; the plan takes
    # 2 for short runs), each forced on every row-pair build and on two tiles
    # per warp: runs of 1-4 k-tiles (K = 400, split K), long runs (4096 x
    # 7168), a partial last k-tile, odd M with a bias, bf16 and fp16. The
    # slots change no product nor the order of the sums: bit for bit equal.
    shapes = [(48, 400), (1040, 2176), (16 * 1152, 1168), (4096, 7168)]
    for tiles, ms in ((1, (1, 3, 4, 8)), (2, (5, 9, 16))):
        stream = f"path=stream,stream_tiles={tiles}"
        _check_stream_runs(31, shapes, ms, [(stream + ",stream_stages=3", "rings of 3 slots"),
                                            (stream + ",stream_stages=2", "rings of 2 slots")])


def _graph_outputs(args, plan):
    """The Linear of `args` under `plan` eagerly twice, then captured in a
    CUDA graph and replayed three times (no stream-K flag may carry over
    from one launch or replay to the next)."""
    eager = [_nvfp4_linear_with_plan(*args, plan=plan).cpu() for _ in range(2)]
    graph = torch.cuda.CUDAGraph()
    _nvfp4_linear_with_plan(*args, plan=plan)  # warm-up outside the capture
    with torch.cuda.graph(graph):
        y = _nvfp4_linear_with_plan(*args, plan=plan)
    replays = []
    for _ in range(3):
        y.zero_()
        graph.replay()
        replays.append(y.cpu())
    return eager + replays


@cuda
def test_cuda_stream_k_kernel():
    # The stream-K kernel (stream_k=1 forces it wherever it can run: M <= 8
    # and warps per tile <= k-tiles) cuts the (tile, k-tile) units into one
    # run per CTA. Shapes where a run holds several whole tiles and pieces
    # (4096 x 7168), where runs are shorter than a tile so a tile has many
    # pieces (N = 48, K = 7168: 168 units on as many CTAs, one unit each), a
    # partial last k-tile (K = 1168), odd M, bias, bf16 and fp16; then with
    # one CTA per SM (longer runs, other cuts). Every output matches the
    # reference, is the same on a second call, and the same in three CUDA
    # graph replays (deterministic: pieces added in k order).
    gen = torch.Generator().manual_seed(23)
    cases, wants = _small_m_cases(gen, [(48, 7168), (16 * 1152, 1168), (4096, 7168), (7168, 2048)], (1, 3, 4, 5, 8))
    for plan in ("stream_k=1", "stream_k=1,stream_ctas_per_sm=1"):
        for (x, pw, ps, g, b), want in zip(cases, wants):
            told = _explain_plan(x.shape[0], pw.shape[0], x.shape[1], "cuda", plan)
            assert told.form == "stream-k", (plan, x.shape, pw.shape, told.kernel)
            outs = _graph_outputs([_cuda(t) for t in (x, pw, ps, g, b)], plan)
            assert rel_err(outs[0], want) <= REL_TOL, (plan, x.shape, pw.shape, x.dtype)
            for y in outs[1:]:
                assert torch.equal(y, outs[0]), (plan, x.shape, pw.shape, x.dtype)


@cuda
def test_cuda_no_host_sync_in_forward():
    models = [Stack([512, 256, 256], device="cuda"), Stack([512, 256, 256], device="cuda", auto_rows=100)]
    xs = [torch.randn(m, 512, device="cuda", dtype=torch.bfloat16) for m in (1, 16, 200)]
    for model in models:
        for x in xs:
            model(x)  # warm up (allocator, cuBLAS handles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for model in models:
            for x in xs:
                model(x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
