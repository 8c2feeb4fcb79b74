"""lowbit.fp8_gemm against a float64 product of the same FP8 operands (the
operands from fp8_reference.py, bit-exact), within FP32-accumulation plus
output-rounding tolerance; opcheck, compile, empty, bad inputs, CUDA."""

import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
import torch._dynamo.testing

import fp8_reference as ref
import lowbit

PAIRS = [("tensor", "tensor"), ("row", "row"), ("block", "block"), ("block", "block2d")]
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def seeded(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def operands(m, n, k, pair, fmt_a="e4m3", fmt_b="e4m3", key=()):
    gen = seeded("gemm", m, n, k, pair, fmt_a, fmt_b, *key)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    w = torch.randn(n, k, generator=gen) * 0.05
    qa, sa = ref.quantize(x, pair[0], fmt_a)
    qb, sb = ref.quantize(w, pair[1], fmt_b)
    return qa.view(ref.DTYPE[fmt_a]), sa, qb.view(ref.DTYPE[fmt_b]), sb


def check(a, sa, b, sb, pair, bias=None, out_dtype=torch.bfloat16, device="cpu", fast_accum=False):
    fa = "e4m3" if a.dtype == torch.float8_e4m3fn else "e5m2"
    fb = "e4m3" if b.dtype == torch.float8_e4m3fn else "e5m2"
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    y = lowbit.fp8_gemm(dev(a), dev(sa), dev(b), dev(sb), pair[0], pair[1], dev(bias), out_dtype, fast_accum)
    assert y.dtype == out_dtype and y.shape == (a.shape[0], b.shape[0])
    a8, b8 = a.view(torch.uint8), b.view(torch.uint8)
    want = ref.gemm(a8, sa, b8, sb, pair[0], pair[1], fa, fb, bias)
    acc, out_eps = ref.gemm_tolerance(a8, sa, b8, sb, pair[0], pair[1], fa, fb, out_dtype, device, fast_accum)
    if bias is not None:
        acc = acc + bias.abs().to(torch.float64) * 2.0**-23
    ref.assert_gemm_close(y, want, acc, out_eps)
    return y


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("mnk", [(1, 16, 16), (37, 48, 300), (130, 256, 384)])
def test_matches_float64(pair, out_dtype, mnk):
    check(*operands(*mnk, pair), pair, out_dtype=out_dtype)


@pytest.mark.parametrize("pair", PAIRS)
def test_e5m2_operand_and_bias(pair):
    a, sa, b, sb = operands(64, 80, 256, pair, "e5m2", "e4m3")
    bias = torch.randn(80, generator=seeded("bias", pair)).to(torch.bfloat16)
    check(a, sa, b, sb, pair, bias=bias)
    check(a, sa, b, sb, pair, bias=bias.float(), out_dtype=torch.float32)


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("mnk", [(0, 32, 64), (5, 16, 0), (0, 0, 16)])
def test_empty(pair, mnk):
    a, sa, b, sb = operands(*mnk, pair)
    bias = torch.ones(mnk[1])
    y = lowbit.fp8_gemm(a, sa, b, sb, pair[0], pair[1], bias)
    assert y.shape == mnk[:2]
    assert torch.equal(y, torch.ones(mnk[:2], dtype=torch.bfloat16))


# test_schema runs the op under SchemaCheckMode, which compares every
# argument of every op inside it with torch.allclose; that has no float8
# kernel on the CPU, so the ops that compute on FP8 tensors run the other
# three default tests.
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("pair", PAIRS)
def test_opcheck(pair):
    a, sa, b, sb = operands(40, 48, 272, pair, key=("opcheck",))
    torch.library.opcheck(torch.ops.lowbit.fp8_gemm.default, (a, sa, b, sb, pair[0], pair[1], None, None), test_utils=OPCHECK_UTILS)
    torch.library.opcheck(
        torch.ops.lowbit.fp8_gemm.default, (a, sa, b, sb, pair[0], pair[1], torch.randn(48), torch.float32),
        test_utils=OPCHECK_UTILS,
    )


def test_compile_fullgraph_dynamic_no_recompile():
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def f(x, w):
        cx = lowbit.fp8_cast(x, "block")
        cw = lowbit.fp8_cast(w, "block2d")
        return lowbit.fp8_gemm(cx.data, cx.scale, cw.data, cw.scale, "block", "block2d")

    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    w = torch.randn(64, 256)
    for m in (130, 300, 1000):
        x = torch.randn(m, 256, generator=seeded("compile", m))
        assert torch.equal(compiled(x, w), f(x, w))
    assert counter.frame_count == 1


def test_bad_inputs_raise_clear_errors():
    a, sa, b, sb = operands(8, 16, 32, ("row", "row"))
    gemm = lowbit.fp8_gemm
    with pytest.raises(TypeError, match=r"argument 'a' must have dtype Float8_e4m3fn or Float8_e5m2, got BFloat16"):
        gemm(a.to(torch.bfloat16), sa, b, sb, "row", "row")
    with pytest.raises(ValueError, match=r"'a' \[M, K\] and 'b' \[N, K\] must have the same K"):
        gemm(a, sa, b[:, :16], sb, "row", "row")
    with pytest.raises(ValueError, match=r"argument 'scale_a' must have shape \[8\], got \[7\]"):
        gemm(a, sa[:7], b, sb, "row", "row")
    with pytest.raises(ValueError, match=r"scalings \(\"row\", \"tensor\"\) .* not a supported pair"):
        gemm(a, sa, b, sb.amax(), "row", "tensor")
    with pytest.raises(ValueError, match=r"argument 'scaling_a' must be \"tensor\", \"row\", \"block\", got \"block2d\""):
        gemm(a, sa, b, sb, "block2d", "block2d")
    with pytest.raises(TypeError, match=r"argument 'out_dtype' must be bfloat16, float16 or float32"):
        gemm(a, sa, b, sb, "row", "row", None, torch.int32)
    with pytest.raises(ValueError, match=r"argument 'bias' must have shape \[16\], got \[8\]"):
        gemm(a, sa, b, sb, "row", "row", torch.zeros(8))


@pytest.mark.cuda
@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
# (256, 512, 1024): cuBLASLt's paths (_scaled_mm); (37, 48, 300) and
# (130, 200, 384): the FP32 fallback (K or N not what cuBLASLt takes);
# (64, 512, 256) and (64, 512, 128): K/128 not a multiple of 4 with several
# N-blocks, where cuBLASLt misreads unpadded 128 x 128 scales (block x
# block2d takes the fallback there; test_fp8_graph_cuda.py).
@pytest.mark.parametrize("mnk", [(256, 512, 1024), (37, 48, 300), (130, 200, 384), (64, 128, 128), (64, 512, 256),
                                 (64, 512, 128)])
def test_cuda_matches_float64(pair, out_dtype, mnk):
    a, sa, b, sb = operands(*mnk, pair, key=("cuda",))
    bias = torch.randn(mnk[1], generator=seeded("cuda-bias", mnk)).to(out_dtype)
    check(a, sa, b, sb, pair, device="cuda", out_dtype=out_dtype)
    check(a, sa, b, sb, pair, bias=bias, device="cuda", out_dtype=out_dtype)
    check(a, sa, b, sb, pair, bias=bias, device="cuda", out_dtype=out_dtype, fast_accum=True)


BLOCK_PAIRS = [("block", "block2d"), ("block", "block")]


@pytest.mark.cuda
@pytest.mark.parametrize("pair", BLOCK_PAIRS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
# lowbit's block-scaled kernel (fp8_block_gemm.h): a float32 output, and a
# bfloat16 one with M % 4 != 0, are shapes cuBLASLt's block scaling does not
# take. Edge tiles in M and N (301 x 272: an odd number of row tiles, so one
# CTA of a cluster has no rows), more K-blocks than pipeline stages (K =
# 2048: the stages' phases wrap), more tile pairs than clusters (2101 x
# 2112: 99 pairs, a cluster takes several), one row, one K-block.
@pytest.mark.parametrize("mnk", [(301, 272, 640), (521, 1040, 2048), (2101, 2112, 256), (1, 16, 128), (129, 144, 128)])
def test_cuda_block_kernel_matches_float64(pair, out_dtype, mnk):
    a, sa, b, sb = operands(*mnk, pair, key=("cuda-block",))
    bias = torch.randn(mnk[1], generator=seeded("cuda-block-bias", mnk)).to(out_dtype)
    check(a, sa, b, sb, pair, device="cuda", out_dtype=out_dtype)
    check(a, sa, b, sb, pair, bias=bias, device="cuda", out_dtype=out_dtype)
    # a bias of another dtype joins the FP32 sum before the output's one rounding
    check(a, sa, b, sb, pair, bias=bias.to(torch.float16), device="cuda", out_dtype=out_dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("pair", BLOCK_PAIRS)
@pytest.mark.parametrize("formats", [("e5m2", "e4m3"), ("e4m3", "e5m2")])
def test_cuda_block_kernel_e5m2_operand(pair, formats):
    a, sa, b, sb = operands(201, 160, 384, pair, *formats, key=("cuda-e5m2",))
    check(a, sa, b, sb, pair, device="cuda")
    check(a, sa, b, sb, pair, device="cuda", out_dtype=torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("pair", BLOCK_PAIRS)
def test_cuda_block_kernel_on_views_and_nan(pair):
    """Operands that are row slices of larger tensors (offset, still
    contiguous) give the same bits as copies; a NaN scale of one row block
    of A makes exactly that row NaN, nothing else (float32 outputs: lowbit's
    kernel)."""
    a, sa, b, sb = (t.cuda() for t in operands(256, 256, 512, pair, key=("cuda-views",)))
    b_rows = 16 if pair[1] == "block" else 128  # a whole 128-row scale block for block2d
    views = (a[128:], sa[128:], b[b_rows:], sb[b_rows:] if pair[1] == "block" else sb[1:])
    assert views[0].storage_offset() > 0 and views[2].storage_offset() > 0
    y = lowbit.fp8_gemm(*views, *pair, None, torch.float32)
    assert torch.equal(y, lowbit.fp8_gemm(*(t.clone() for t in views), *pair, None, torch.float32))
    sa_nan = sa.clone()
    sa_nan[5, 1] = float("nan")
    y = lowbit.fp8_gemm(a, sa_nan, b, sb, *pair, None, torch.float32)
    assert y[5].isnan().all() and not y[:5].isnan().any() and not y[6:].isnan().any()


def _kernel_names(fn) -> set:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


UNIT_SCALE_PASS = "scale_out_kernel"


@pytest.mark.cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
# Row x row E4M3 outputs small enough for lowbit's form (fp8_row_gemm_cuda.h:
# cuBLASLt's per-tensor GEMM with unit scales into FP32, then the scaling
# pass): one row (1 x 16 x 8192); partial tiles everywhere (200 x 1040 x
# 3088); 300 x 272 x 4096; the Linear bench's narrow weight at 256 rows
# (256 x 1536 x 4096); the largest output it takes with K < 3072 (2^19:
# 256 x 2048 x 2048).
@pytest.mark.parametrize("mnk", [(1, 16, 8192), (200, 1040, 3088), (300, 272, 4096), (256, 1536, 4096),
                                 (256, 2048, 2048)])
def test_cuda_unit_scale_form_matches_float64(out_dtype, mnk):
    a, sa, b, sb = operands(*mnk, ("row", "row"), key=("cuda-unit",))
    bias = torch.randn(mnk[1], generator=seeded("cuda-unit-bias", mnk)).to(out_dtype)
    assert UNIT_SCALE_PASS in " ".join(_kernel_names(
        lambda: lowbit.fp8_gemm(a.cuda(), sa.cuda(), b.cuda(), sb.cuda(), "row", "row", None, out_dtype)))
    for fast_accum in (False, True):
        check(a, sa, b, sb, ("row", "row"), device="cuda", out_dtype=out_dtype, fast_accum=fast_accum)
        y_bias = check(a, sa, b, sb, ("row", "row"), bias=bias, device="cuda", out_dtype=out_dtype,
                       fast_accum=fast_accum)
        again = lowbit.fp8_gemm(a.cuda(), sa.cuda(), b.cuda(), sb.cuda(), "row", "row", bias.cuda(), out_dtype,
                                fast_accum)
        assert torch.equal(y_bias, again)


@pytest.mark.cuda
def test_cuda_unit_scale_form_only_for_small_outputs():
    """Outputs past 2^20 elements (2^19 where K < 3072) stay on cuBLASLt's
    row-scaled GEMM; the same operands cut to fewer rows take lowbit's form."""
    a, sa, b, sb = (t.cuda() for t in operands(4096, 2048, 4096, ("row", "row"), key=("cuda-unit-many",)))
    assert UNIT_SCALE_PASS not in " ".join(_kernel_names(lambda: lowbit.fp8_gemm(a, sa, b, sb, "row", "row")))
    assert UNIT_SCALE_PASS in " ".join(_kernel_names(
        lambda: lowbit.fp8_gemm(a[:512], sa[:512], b, sb, "row", "row")))  # 2^20 outputs, K = 4096
    assert UNIT_SCALE_PASS not in " ".join(_kernel_names(
        lambda: lowbit.fp8_gemm(a[:513], sa[:513], b, sb, "row", "row")))
    short_k = a[:, :2048].contiguous(), b[:, :2048].contiguous()
    assert UNIT_SCALE_PASS in " ".join(_kernel_names(
        lambda: lowbit.fp8_gemm(short_k[0][:256], sa[:256], short_k[1], sb, "row", "row")))  # 2^19, K = 2048
    assert UNIT_SCALE_PASS not in " ".join(_kernel_names(
        lambda: lowbit.fp8_gemm(short_k[0][:257], sa[:257], short_k[1], sb, "row", "row")))


@pytest.mark.cuda
def test_cuda_unit_scale_form_nan_rows_views_and_graphs():
    """A NaN scale of one row of A makes exactly that output row NaN; row
    slices of larger tensors give the bits of copies; a CUDA graph (the unit
    scales are device constants, valid before any kernel ran) replays the
    same bits."""
    a, sa, b, sb = (t.cuda() for t in operands(400, 528, 3072, ("row", "row"), key=("cuda-unit-nan",)))
    views = (a[144:], sa[144:], b[16:], sb[16:])
    y = lowbit.fp8_gemm(*views, "row", "row")
    assert UNIT_SCALE_PASS in " ".join(_kernel_names(lambda: lowbit.fp8_gemm(*views, "row", "row")))
    assert torch.equal(y, lowbit.fp8_gemm(*(t.clone() for t in views), "row", "row"))
    sa_nan = sa.clone()
    sa_nan[5] = float("nan")
    y = lowbit.fp8_gemm(a, sa_nan, b, sb, "row", "row")
    assert y[5].isnan().all() and not y[:5].isnan().any() and not y[6:].isnan().any()
    want = lowbit.fp8_gemm(a, sa, b, sb, "row", "row")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = lowbit.fp8_gemm(a, sa, b, sb, "row", "row")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, want)


_FIRST_CALL_IN_A_GRAPH = textwrap.dedent("""
    import torch
    import lowbit
    g = torch.Generator(device="cuda").manual_seed(7)
    a = lowbit.fp8_cast(torch.randn(96, 1024, device="cuda", generator=g), "row")
    b = lowbit.fp8_cast(torch.randn(256, 1024, device="cuda", generator=g), "row")
    one = torch.ones((), device="cuda")
    torch._scaled_mm(a.data, b.data.t(), one, one, out_dtype=torch.float32)  # cuBLASLt set up, not lowbit
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lowbit.fp8_gemm(a.data, a.scale, b.data, b.scale, "row", "row")
    graph.replay()
    torch.cuda.synchronize()
    want = (a.data.double() * a.scale.double()[:, None]) @ (b.data.double() * b.scale.double()[:, None]).t()
    err = float((y.double() - want).norm() / want.norm())
    assert torch.equal(y, lowbit.fp8_gemm(a.data, a.scale, b.data, b.scale, "row", "row")), "replay != eager"
    assert err < 1e-2, err
    print("ok", err)
""")


@pytest.mark.cuda
def test_cuda_unit_scale_form_first_call_inside_a_graph():
    """In a fresh process the form's first call (the unit-scale constant's
    first use, the scaling pass's first launch) is inside a CUDA graph's
    capture; the replay gives the eager bits, close to float64."""
    run = subprocess.run([sys.executable, "-c", _FIRST_CALL_IN_A_GRAPH], capture_output=True, text=True,
                         env=dict(os.environ), timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
