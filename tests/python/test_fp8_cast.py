"""lowbit.fp8_cast against the independent reference in fp8_reference.py
(bit-exact codes, scales and amax for every scaling, format and input
dtype), edge cases, and the operator conventions: opcheck, torch.compile,
dynamic shapes, empty inputs, bad inputs, CUDA vs CPU."""

import zlib

import pytest
import torch
import torch._dynamo.testing

import fp8_reference as ref
import lowbit

SCALINGS = ["tensor", "row", "block", "block2d"]
FORMATS = ["e4m3", "e5m2"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def seeded(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def codes(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def assert_cast_matches(got, want, transpose=True):
    names = ["data", "scale", "data_t", "scale_t", "amax"]
    for name, g, w in zip(names, got, want):
        if w is None:
            assert g.shape == (0,), name
            continue
        g = codes(g).cpu()
        assert g.shape == w.shape, (name, g.shape, w.shape)
        if g.dtype == torch.uint8:
            bad = (g != w).nonzero()
            assert bad.numel() == 0, f"{name}: {bad.shape[0]} codes differ, first at {bad[:4].tolist()}"
        else:
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=name)


def check(x, scaling, fmt="e4m3", transpose=True, scale=None, pow2=False):
    got = lowbit.fp8_cast(x, scaling, fmt, transpose, scale, pow2)
    assert got.data.dtype == ref.DTYPE[fmt]
    want = ref.cast(x.cpu(), scaling, fmt, transpose, None if scale is None else scale.cpu(), pow2)
    assert_cast_matches(got, want)
    return got


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (7, 48), (130, 300), (256, 128)])
def test_random_matches_reference(scaling, fmt, dtype, shape):
    gen = seeded(scaling, fmt, dtype, shape)
    x = (torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 3).to(dtype)
    check(x, scaling, fmt)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_pow2_scales_are_powers_of_two(scaling):
    x = torch.randn(200, 260, generator=seeded("pow2", scaling)) * 7
    got = check(x, scaling, "e4m3", pow2=True)
    mant, _ = torch.frexp(got.scale)
    assert torch.all(mant == 0.5)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_edge_cases_match_reference(scaling, fmt):
    gen = seeded("edge", scaling, fmt)
    x = torch.randn(300, 260, generator=gen)
    x[3] = 0.0  # an all-zero row
    x[128:256, 128:256] = 0.0  # an all-zero 128 x 128 block
    x[5, ::7] = -0.0  # negative zeros keep their sign
    x[6, :] = 1e-30  # tiny values (subnormal codes / zeros)
    x[7, 3] = ref.FMAX[fmt] * 1.5  # above fmax
    x[8, 9] = -ref.FMAX[fmt]  # at -fmax
    x[9, :] = 3e4
    check(x, scaling, fmt)
    got = lowbit.fp8_cast(x, scaling, fmt)
    assert (codes(got.data)[5, ::7] == 0x80).all()  # -0 is code 0x80 in both formats


@pytest.mark.parametrize("scaling", SCALINGS)
def test_nonfinite_input(scaling):
    x = torch.randn(140, 140, generator=seeded("nan", scaling))
    x[2, 2] = float("nan")
    x[139, 139] = float("inf")
    got = check(x, scaling)
    assert torch.isnan(got.amax)
    deq = got.data.float() * (got.scale if scaling == "tensor" else 1.0)
    if scaling == "tensor":
        assert torch.isnan(deq).all()  # never finite garbage


def test_given_scale_saturates_and_still_reports_amax():
    x = torch.randn(33, 64, generator=seeded("given")) * 10
    x[0, 0] = float("inf")
    s = torch.tensor(0.01)
    got = check(x, "tensor", "e4m3", scale=s)
    assert got.scale.item() == pytest.approx(0.01)
    assert codes(got.data)[0, 0] == 0x7E  # inf saturates at 448 with a given scale
    assert torch.isinf(got.amax)
    check(x, "tensor", "e5m2", scale=s)


def test_zero_tensor_scale_is_one():
    got = check(torch.zeros(20, 40), "tensor")
    assert got.scale.item() == 1.0 and got.amax.item() == 0.0


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("shape", [(0, 64), (0, 300), (5, 0), (0, 0)])
def test_empty(scaling, shape):
    x = torch.randn(shape)
    got = check(x, scaling)
    assert got.data.shape == shape and got.data_t.shape == shape[::-1]


def test_no_transpose_gives_empty_pair():
    got = lowbit.fp8_cast(torch.randn(8, 32), "row", "e4m3", False)
    assert got.data_t.shape == (0,) and got.scale_t.shape == (0,)


def test_noncontiguous_input():
    x = torch.randn(64, 200, generator=seeded("view")).t()
    for s in SCALINGS:
        assert_cast_matches(lowbit.fp8_cast(x, s, "e4m3", True), ref.cast(x.contiguous(), s, "e4m3", True))


@pytest.mark.parametrize("scaling", SCALINGS)
def test_opcheck(scaling):
    x = torch.randn(130, 144, generator=seeded("opcheck", scaling)).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.lowbit.fp8_cast.default, (x, scaling, "e4m3", True, None, False))
    torch.library.opcheck(torch.ops.lowbit.fp8_cast.default, (x, scaling, "e5m2", False, None, True))
    torch.library.opcheck(torch.ops.lowbit.fp8_cast.default, (x, "tensor", "e4m3", True, torch.tensor(0.5), False))


def test_compile_fullgraph_dynamic_no_recompile():
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def f(x):
        return lowbit.fp8_cast(x, "block", "e4m3", True)

    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    # from 129 rows: ceil(M / 128) == 1 would specialize (size-1 dims do)
    for m in (130, 257, 1000):
        x = torch.randn(m, 160, generator=seeded("compile", m))
        for g, w in zip(compiled(x), f(x)):
            assert torch.equal(codes(g), codes(w))
    assert counter.frame_count == 1


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"argument 'scaling' must be .*got \"col\""):
        lowbit.fp8_cast(x, "col")
    with pytest.raises(ValueError, match=r"argument 'dtype' must be \"e4m3\" or \"e5m2\", got \"e3m4\""):
        lowbit.fp8_cast(x, "tensor", "e3m4")
    with pytest.raises(TypeError, match=r"argument 'input' must have dtype .*got Int"):
        lowbit.fp8_cast(torch.ones(4, 32, dtype=torch.int32), "tensor")
    with pytest.raises(ValueError, match=r"argument 'input' must be 2-D, got shape \[2, 4, 32\]"):
        lowbit.fp8_cast(torch.randn(2, 4, 32), "tensor")
    with pytest.raises(ValueError, match=r"argument 'scale' may be given only with scaling \"tensor\""):
        lowbit.fp8_cast(x, "row", scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"argument 'scale' must have shape \[\], got \[1\]"):
        lowbit.fp8_cast(x, "tensor", scale=torch.ones(1))
    with pytest.raises(TypeError, match=r"argument 'scale' must have dtype Float"):
        lowbit.fp8_cast(x, "tensor", scale=torch.tensor(1.0, dtype=torch.float64))


@pytest.mark.cuda
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
# Shapes reach the kernel's vector and element paths: cols % 8 != 0
# (element loads; 3 x 37 also leaves the tensor amax pass a tail), partial 128 x 128 tiles with whole vectors (200 x 264:
# transposed rows stored bytewise, 272 x 520: in 16-byte pieces), whole tiles.
@pytest.mark.parametrize("shape", [(1, 16), (3, 37), (130, 300), (200, 264), (272, 520), (512, 384), (0, 64)])
def test_cuda_matches_cpu_bitwise(scaling, fmt, dtype, shape):
    x = torch.randn(shape, generator=seeded("cuda", scaling, fmt, dtype, shape)).to(dtype) * 5
    if x.numel() > 200:
        x[1, :] = 0.0
        x[2, 7] = -0.0
        x[3, 5] = float("inf")
    for pow2 in (False, True):
        got = lowbit.fp8_cast(x.cuda(), scaling, fmt, True, None, pow2)
        want = lowbit.fp8_cast(x, scaling, fmt, True, None, pow2)
        for g, w in zip(got, want):
            assert g.is_cuda
            torch.testing.assert_close(codes(g).cpu(), codes(w), rtol=0, atol=0, equal_nan=True)
    if scaling == "tensor":
        # Given scales: the guarded reciprocal division (0.03), a power of two
        # (one multiplication), and both with quotients past float's range
        # (x * 1e30 / 2^-80 overflows: saturated codes, as the rule's).
        for xs, scale in ((x, 0.03), (x, 0.03125), (x.float() * 1e30, 2.0**-80), (x.float() * 1e30, 3 * 2.0**-80)):
            s = torch.tensor(scale)
            got = lowbit.fp8_cast(xs.cuda(), scaling, fmt, True, s.cuda())
            for g, w in zip(got, lowbit.fp8_cast(xs, scaling, fmt, True, s)):
                torch.testing.assert_close(codes(g).cpu(), codes(w), rtol=0, atol=0, equal_nan=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
# The row amax pass walks strips of 128 columns, several 128-row tiles per
# CTA once the strips alone would not fill the GPU: 4000 x 8192 (64 strips,
# a ragged last tile) and 140000 x 24 (one strip, misaligned rows: the
# element loads) take that loop; an unaligned input's tensor amax too.
@pytest.mark.parametrize("shape", [(4000, 8192), (140000, 24)])
def test_cuda_amax_pass_over_many_tiles_per_cta(dtype, shape):
    gen = seeded("many tiles", dtype, shape)
    x = (torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 8).to(dtype)
    x[shape[0] - 1, 3] = -300.0  # the last row's and a column's amax from the ragged tile
    base = torch.empty(x.numel() + 1, dtype=dtype, device="cuda")
    xc = base[1:].view(shape)  # 2 or 4 bytes off: the tensor amax takes the strip kernel too
    xc.copy_(x)
    for scaling, inp in (("row", x.cuda()), ("row", xc), ("tensor", xc)):
        got = lowbit.fp8_cast(inp, scaling, "e4m3", True)
        want = lowbit.fp8_cast(x, scaling, "e4m3", True)
        for g, w in zip(got, want):
            torch.testing.assert_close(codes(g).cpu(), codes(w), rtol=0, atol=0, equal_nan=True)


@pytest.mark.cuda
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("magnitude", [1e-33, 1e-25, 3e30, 3e33])
def test_cuda_extreme_magnitudes_and_misaligned_input(scaling, magnitude):
    # Scales far from 1 leave the kernel's reciprocal division for the IEEE
    # one (below 2^-80, above 2^100); an input starting 2 bytes into its
    # storage takes the element loads.
    gen = seeded("extreme", scaling, magnitude)
    base = (torch.randn(272 * 264 + 1, generator=gen) * magnitude).to(torch.bfloat16)
    x = base[1:].view(272, 264)
    xc = base.cuda()[1:].view(272, 264)
    assert xc.data_ptr() % 16 != 0
    for fmt in FORMATS:
        got = lowbit.fp8_cast(xc, scaling, fmt, True)
        want = lowbit.fp8_cast(x, scaling, fmt, True)
        for g, w in zip(got, want):
            torch.testing.assert_close(codes(g).cpu(), codes(w), rtol=0, atol=0, equal_nan=True)


@pytest.mark.cuda
@pytest.mark.parametrize("scaling", SCALINGS)
def test_cuda_tile_mixing_scale_ranges(scaling):
    # One 128 x 128 tile whose rows and columns need different division forms:
    # rows and a column far below 2^-80 in scale (the IEEE division), powers of
    # two, and ordinary ones. Block scaling picks one form per tile, the other
    # scalings one per thread; every form must give the rule's codes.
    gen = seeded("mixed tile", scaling)
    x = torch.randn(256, 384, generator=gen) * 3
    x[5] *= 1e-30  # scale ~1e-32: below 2^-80
    x[70, :] = 0.5  # amax 0.5: a power-of-two scale under pow2_scales only
    x[:, 9] *= 1e-31
    x[130:140] *= 1e25
    x = x.to(torch.bfloat16)
    for fmt in FORMATS:
        for pow2 in (False, True):
            got = lowbit.fp8_cast(x.cuda(), scaling, fmt, True, None, pow2)
            assert_cast_matches(got, ref.cast(x, scaling, fmt, True, None, pow2))
    if scaling == "tensor":
        # Given scales: x * (1 / s) overflows in some tiles only (the guarded
        # division there, the bounded one elsewhere).
        xs = x.float()
        xs[200:210] *= 1e30
        s = torch.tensor(3 * 2.0**-80)
        got = lowbit.fp8_cast(xs.cuda(), scaling, "e4m3", True, s.cuda())
        assert_cast_matches(got, ref.cast(xs, scaling, "e4m3", True, s))


@pytest.mark.cuda
def test_cuda_graph_capture_replays_the_cast():
    x = torch.randn(300, 260, device="cuda")
    f = lambda: lowbit.fp8_cast(x, "row", "e4m3", True)  # noqa: E731
    want = f()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = f()
    x.mul_(2)
    g.replay()
    want = f()
    for a, b in zip(out, want):
        assert torch.equal(codes(a), codes(b))
