"""lowbit.nvfp4_quantize / nvfp4_dequantize against the independent reference
in nvfp4_reference.py (bit-exact), plus the operator conventions: opcheck,
torch.compile, dynamic shapes, empty inputs, bad inputs, CUDA graphs."""

import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit
import nvfp4_reference as ref

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def assert_bitwise_equal(got, want):
    got, want = got.contiguous(), want.contiguous()
    assert got.shape == want.shape, (got.shape, want.shape)
    if got.dtype == torch.float8_e4m3fn:
        got = got.view(torch.uint8)
    if want.dtype == torch.float8_e4m3fn:
        want = want.view(torch.uint8)
    if got.dtype.is_floating_point:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    else:
        mismatch = (got != want).nonzero()
        assert mismatch.numel() == 0, f"{mismatch.shape[0]} mismatches, first at {mismatch[:4].tolist()}"


def check_against_reference(x, global_scale=None):
    packed, block_scale, gscale = lowbit.nvfp4_quantize(x, global_scale)
    want_packed, want_scale, want_global = ref.quantize(x.cpu(), None if global_scale is None else global_scale.cpu())
    assert packed.dtype == torch.uint8 and block_scale.dtype == torch.float8_e4m3fn and gscale.dtype == torch.float32
    assert_bitwise_equal(packed.cpu(), want_packed)
    assert_bitwise_equal(block_scale.cpu(), want_scale)
    assert_bitwise_equal(gscale.cpu(), want_global)
    deq = lowbit.nvfp4_dequantize(packed, block_scale, gscale)
    assert_bitwise_equal(deq.cpu(), ref.dequantize(want_packed, want_scale, want_global))
    return packed, block_scale, gscale


def heavy_tailed(shape, dtype, gen):
    # Student's t with 2 degrees of freedom, z / sqrt(chi2_2 / 2) with
    # chi2_2 / 2 = -log(u), drawn from `gen` (StudentT.sample takes no
    # generator): the same distribution, reproducible.
    z = torch.randn(shape, generator=gen)
    t = z / torch.sqrt(-torch.log(torch.rand(shape, generator=gen)))
    return (t * torch.rand(shape, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (7, 48), (64, 256), (3, 5, 32)])
def test_random_gaussian_matches_reference(dtype, shape):
    # crc32, not hash(): str hashes change per process, failures must reproduce
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{shape}".encode()))
    check_against_reference((torch.randn(shape, generator=gen) * 0.05).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_heavy_tailed_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    check_against_reference(heavy_tailed((33, 512), dtype, gen))


def test_exact_ties_round_to_even():
    # global 1/448 and block amax 6 give block scale 448, so x / (s * b) = x:
    # every E2M1 midpoint lands exactly on a tie.
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    row = torch.cat([torch.tensor([6.0]), mids, -mids, torch.tensor([-0.0])])
    x = row.repeat(4, 2)
    packed, _, _ = check_against_reference(x, torch.tensor(1.0 / 448.0))
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2)[0, :16]
    assert codes.tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 8]


def test_edge_cases_match_reference():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 64, generator=gen)
    x[0, :16] = 0.0  # an all-zero block
    x[7, ::3] = -0.0  # negative zeros inside ordinary blocks keep their sign
    x[1, :16] = -1e-30  # tiny negatives round to -0
    x[2, 16:32] = 1e-12  # block ratio clamps up to 2^-6
    x[3, :] = 3e4  # large values
    check_against_reference(x)
    check_against_reference(torch.zeros(4, 32))  # all-zero tensor: global 0, zeros back
    x_inf = x.clone()
    x_inf[5, 7] = float("inf")
    check_against_reference(x_inf)
    x_nan = x.clone()
    x_nan[6, 40] = float("nan")
    check_against_reference(x_nan)
    # a caller-given scale too small for the data saturates at +-6 x 448
    check_against_reference(x, torch.tensor(1e-6))
    nan_block = x.clone()
    nan_block[4, 3] = float("nan")
    check_against_reference(nan_block, torch.tensor(0.01))


def test_nonfinite_input_never_dequantizes_to_finite():
    x = torch.randn(4, 32)
    x[1, 2] = float("inf")
    y = lowbit.nvfp4_dequantize(*lowbit.nvfp4_quantize(x))
    assert torch.isnan(y).all()
    x[1, 2] = 1.0
    x[2, 20] = float("nan")
    q = lowbit.nvfp4_quantize(x, torch.tensor(0.01))
    y = lowbit.nvfp4_dequantize(*q)
    assert torch.isnan(y[2, 16:32]).all() and torch.isfinite(y[2, :16]).all()


def test_stacked_experts_get_one_global_each():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 16, 64, generator=gen) * torch.tensor([1.0, 10.0, 0.1, 100.0]).view(4, 1, 1)
    _, _, gscale = check_against_reference(x.to(torch.bfloat16))
    assert gscale.shape == (4,)
    assert torch.equal(gscale, x.to(torch.bfloat16).float().abs().amax(dim=(1, 2)) / 2688.0)
    check_against_reference(x, torch.rand(4) + 0.01)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 20),
    blocks=st.integers(1, 6),
    experts=st.sampled_from([None, 1, 3]),
    dtype=st.sampled_from(DTYPES),
    log_scale=st.floats(-20, 20),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_matches_reference(rows, blocks, experts, dtype, log_scale, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, blocks * 16) if experts is None else (experts, rows, blocks * 16)
    x = (torch.randn(shape, generator=gen) * 2.0**log_scale).to(dtype)
    check_against_reference(x)


def test_dequantize_dtypes_and_default():
    x = torch.randn(8, 64)
    q = lowbit.nvfp4_quantize(x)
    y32 = lowbit.nvfp4_dequantize(*q)
    assert y32.dtype == torch.float32
    for dtype in (torch.bfloat16, torch.float16):
        y = lowbit.nvfp4_dequantize(*q, out_dtype=dtype)
        assert y.dtype == dtype
        assert torch.equal(y, y32.to(dtype))


def test_roundtrip_error_is_format_precision():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1024, generator=gen)
    y = lowbit.nvfp4_dequantize(*lowbit.nvfp4_quantize(x))
    rel = ((y - x).norm() / x.norm()).item()
    # E2M1 keeps 1 mantissa bit; Gaussian blocks quantize at ~9-10% RMS error.
    assert 0.05 < rel < 0.12
    assert torch.nn.functional.cosine_similarity(y.flatten(), x.flatten(), dim=0) > 0.99


def test_noncontiguous_input_is_handled():
    x = torch.randn(64, 48)
    view = x.t()  # [48, 64], not contiguous
    assert not view.is_contiguous()
    got = lowbit.nvfp4_quantize(view)
    want = lowbit.nvfp4_quantize(view.contiguous())
    for a, b in zip(got, want):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("shape", [(0, 64), (0, 8, 32), (2, 0, 32)])
def test_empty_inputs(shape):
    x = torch.randn(shape)
    packed, block_scale, gscale = lowbit.nvfp4_quantize(x)
    assert packed.shape == (*shape[:-1], shape[-1] // 2)
    assert block_scale.shape == (*shape[:-1], shape[-1] // 16)
    assert gscale.shape == (() if len(shape) == 2 else (shape[0],))
    assert torch.all(gscale == 0)
    assert lowbit.nvfp4_dequantize(packed, block_scale, gscale).shape == shape


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"'input' must have a last dimension divisible by 16, got shape \[3, 20\]"):
        lowbit.nvfp4_quantize(torch.randn(3, 20))
    with pytest.raises(TypeError, match=r"'input' must have dtype .*BFloat16.*got Int"):
        lowbit.nvfp4_quantize(torch.ones(3, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"'input' must be 2 or 3-D, got shape \[16\]"):
        lowbit.nvfp4_quantize(torch.randn(16))
    with pytest.raises(ValueError, match=r"'global_scale' must have shape \[\], got \[2\]"):
        lowbit.nvfp4_quantize(torch.randn(4, 16), torch.ones(2))
    with pytest.raises(TypeError, match=r"'global_scale' must have dtype Float"):
        lowbit.nvfp4_quantize(torch.randn(4, 16), torch.ones((), dtype=torch.float64))
    q = lowbit.nvfp4_quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match=r"'block_scale' must have shape \[4, 2\], got \[4, 1\]"):
        lowbit.nvfp4_dequantize(q.packed, q.block_scale[:, :1], q.global_scale)
    with pytest.raises(TypeError, match=r"'out_dtype' must be float32, bfloat16 or float16"):
        lowbit.nvfp4_dequantize(*q, out_dtype=torch.int8)
    with pytest.raises(TypeError, match=r"'block_scale' must have dtype Float8_e4m3fn or Byte, got Float"):
        lowbit.nvfp4_dequantize(q.packed, q.block_scale.float(), q.global_scale)


def test_given_global_scale_must_be_positive_and_finite():
    x = torch.randn(4, 32)
    for bad in (-0.5, 0.0, -0.0, float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValueError, match=r"'global_scale' must be positive and finite, got .* at index 0"):
            lowbit.nvfp4_quantize(x, torch.tensor(bad))
    scales = torch.tensor([0.5, 1.0, -2.0])
    with pytest.raises(ValueError, match=r"'global_scale' must be positive and finite, got -2 at index 2"):
        lowbit.nvfp4_quantize(torch.randn(3, 4, 32), scales)
    # the smallest positive scale is accepted (it saturates, as documented)
    lowbit.nvfp4_quantize(x, torch.tensor(torch.finfo(torch.float32).tiny))


def test_arguments_on_mixed_devices_raise_device_error():
    # A meta tensor beside a CPU tensor selects the Meta kernel, which must
    # refuse the mix as the CPU and CUDA kernels do, not return empty memory.
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"'global_scale' must be on the device of 'input' \(cpu\), got meta"):
        lowbit.nvfp4_quantize(x, torch.ones((), device="meta"))
    with pytest.raises(ValueError, match=r"'global_scale' must be on the device of 'input' \(meta\), got cpu"):
        lowbit.nvfp4_quantize(x.to("meta"), torch.ones(()))
    q = lowbit.nvfp4_quantize(x)
    with pytest.raises(ValueError, match=r"'block_scale' must be on the device of 'packed' \(cpu\), got meta"):
        lowbit.nvfp4_dequantize(q.packed, q.block_scale.to("meta"), q.global_scale)
    with pytest.raises(ValueError, match=r"'global_scale' must be on the device of 'packed' \(cpu\), got meta"):
        lowbit.nvfp4_dequantize(q.packed, q.block_scale, q.global_scale.to("meta"))


def test_format_ops_have_no_backward():
    # Rounding to NVFP4 has no useful gradient: asking for one raises a clear
    # error instead of PyTorch's fallback (a warning and None gradients).
    x = torch.randn(16, 256, requires_grad=True)
    q = lowbit.nvfp4_quantize(x)
    assert q.global_scale.requires_grad
    with pytest.raises(NotImplementedError, match=r"lowbit.nvfp4_quantize has no backward \(an inference op\)"):
        q.global_scale.sum().backward()
    q = lowbit.nvfp4_quantize(x.detach())
    gs = q.global_scale.clone().requires_grad_()
    y = lowbit.nvfp4_dequantize(q.packed, q.block_scale, gs)
    assert y.requires_grad
    with pytest.raises(NotImplementedError, match=r"lowbit.nvfp4_dequantize has no backward \(an inference op\)"):
        y.sum().backward()
    w, s = lowbit.nvfp4_prepack(q.packed, q.block_scale)
    y = lowbit.nvfp4_unpack(w, s, gs, 256, torch.float32)
    assert y.requires_grad
    with pytest.raises(NotImplementedError, match=r"lowbit.nvfp4_unpack has no backward \(an inference op\)"):
        y.sum().backward()
    # without inputs that require grad nothing changes
    assert not lowbit.nvfp4_dequantize(*q).requires_grad


def test_format_ops_compile_with_inputs_that_require_grad():
    def f(x):
        return lowbit.nvfp4_dequantize(*lowbit.nvfp4_quantize(x))

    x = torch.randn(8, 64, requires_grad=True)
    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x.detach()))


def test_opcheck():
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.lowbit.nvfp4_quantize.default, (x,))
    torch.library.opcheck(torch.ops.lowbit.nvfp4_quantize.default, (x.float().view(2, 8, 64), torch.rand(2)))
    q = lowbit.nvfp4_quantize(x)
    # Block scales as raw uint8 codes: all four default tests.
    codes = q.block_scale.view(torch.uint8)
    torch.library.opcheck(torch.ops.lowbit.nvfp4_dequantize.default, (q.packed, codes, q.global_scale, torch.bfloat16))
    # As float8_e4m3fn: torch's schema check compares inputs with allclose,
    # which has no float8 kernel, so that one test is left out here.
    torch.library.opcheck(
        torch.ops.lowbit.nvfp4_dequantize.default,
        (*q, torch.bfloat16),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_dequantize_accepts_uint8_block_scale_codes():
    q = lowbit.nvfp4_quantize(torch.randn(8, 64))
    assert torch.equal(
        lowbit.nvfp4_dequantize(q.packed, q.block_scale.view(torch.uint8), q.global_scale), lowbit.nvfp4_dequantize(*q)
    )


def roundtrip(x):
    return lowbit.nvfp4_dequantize(*lowbit.nvfp4_quantize(x), out_dtype=torch.bfloat16)


def test_compile_fullgraph_matches_eager():
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    compiled = torch.compile(roundtrip, fullgraph=True)
    assert torch.equal(compiled(x), roundtrip(x))


def test_dynamic_rows_do_not_recompile():
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(roundtrip, backend=counter, fullgraph=True, dynamic=True)
    for rows in (3, 17, 64, 250):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(compiled(x), roundtrip(x))
    assert counter.frame_count == 1


# ---------------------------------------------------------------- CUDA ------

cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (129, 4096), (3, 256, 1024), (4096, 7168)])
def test_cuda_matches_cpu_bitwise(dtype, shape):
    gen = torch.Generator().manual_seed(17)
    x = heavy_tailed(shape, dtype, gen)
    got = lowbit.nvfp4_quantize(x.cuda())
    want = lowbit.nvfp4_quantize(x)
    for a, b in zip(got, want):
        assert_bitwise_equal(a.cpu(), b)
    for out_dtype in DTYPES:
        assert_bitwise_equal(
            lowbit.nvfp4_dequantize(*got, out_dtype=out_dtype).cpu(), lowbit.nvfp4_dequantize(*want, out_dtype=out_dtype)
        )


@cuda
def test_cuda_signed_zeros_keep_their_sign():
    x = torch.randn(64, 256)
    x[::3, ::5] = -0.0
    x[1::3, ::7] = 0.0
    got = lowbit.nvfp4_quantize(x.cuda())
    want = lowbit.nvfp4_quantize(x)
    for a, b in zip(got, want):
        assert_bitwise_equal(a.cpu(), b)


@cuda
def test_cuda_exact_ties_match_cpu():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    row = torch.cat([torch.tensor([6.0]), mids, -mids, torch.tensor([-0.0])])
    x = row.repeat(64, 8) * torch.rand(64, 1)  # several block scales per tie pattern
    for gs in (None, torch.tensor(1.0 / 448.0)):
        got = lowbit.nvfp4_quantize(x.cuda(), None if gs is None else gs.cuda())
        want = lowbit.nvfp4_quantize(x, gs)
        for a, b in zip(got, want):
            assert_bitwise_equal(a.cpu(), b)


@cuda
def test_cuda_edge_cases_and_given_scale_match_cpu():
    x = torch.randn(6, 4, 96)
    x[0, 0, :16] = 0.0
    x[1, 2, 5] = float("nan")
    x[2, 1, 50] = float("inf")
    x[3, 3, :] = -1e-30
    for gs in (None, torch.rand(6) * 0.01):
        got = lowbit.nvfp4_quantize(x.cuda(), None if gs is None else gs.cuda())
        want = lowbit.nvfp4_quantize(x, gs)
        for a, b in zip(got, want):
            assert_bitwise_equal(a.cpu(), b)


@cuda
def test_cuda_misaligned_and_empty_inputs():
    base = torch.randn(1, 16 * 65, device="cuda", dtype=torch.bfloat16)
    view = base[:, 16:].view(64, 16)  # storage offset of 32 bytes, still aligned
    odd = torch.randn(16 * 64 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(64, 16)  # 2-byte offset
    for t in (view, odd):
        got = lowbit.nvfp4_quantize(t)
        want = lowbit.nvfp4_quantize(t.cpu())
        for a, b in zip(got, want):
            assert_bitwise_equal(a.cpu(), b)
    packed, block_scale, gscale = lowbit.nvfp4_quantize(torch.empty(0, 64, device="cuda"))
    assert packed.shape == (0, 32) and gscale.item() == 0.0
    _, _, gscale = lowbit.nvfp4_quantize(torch.empty(3, 0, 64, device="cuda"), torch.full((3,), 0.5, device="cuda"))
    assert gscale.tolist() == [0.5, 0.5, 0.5]


@cuda
def test_cuda_wrong_device_arguments():
    with pytest.raises(ValueError, match=r"'global_scale' must be on the device of 'input'"):
        lowbit.nvfp4_quantize(torch.randn(4, 16, device="cuda"), torch.tensor(1.0))


@cuda
def test_cuda_nonpositive_given_scale_dequantizes_to_nan():
    # On the GPU the scale's value is not read on the host (no sync): a scale
    # that is not positive gives NaN block and global scales, never a
    # negated or zeroed tensor.
    x = torch.randn(2, 4, 64, device="cuda")
    q = lowbit.nvfp4_quantize(x, torch.tensor([0.01, -0.01], device="cuda"))
    assert q.global_scale[0].item() == pytest.approx(0.01) and torch.isnan(q.global_scale[1])
    y = lowbit.nvfp4_dequantize(*q)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()
    for bad in (0.0, -0.0, float("nan")):
        y = lowbit.nvfp4_dequantize(*lowbit.nvfp4_quantize(x[0], torch.tensor(bad, device="cuda")))
        assert torch.isnan(y).all()


@cuda
def test_cuda_format_ops_refuse_mixed_devices():
    x = torch.randn(4, 32, device="cuda")
    q = lowbit.nvfp4_quantize(x)
    with pytest.raises(ValueError, match=r"'block_scale' must be on the device of 'packed'"):
        lowbit.nvfp4_dequantize(q.packed, q.block_scale.cpu(), q.global_scale)
    with pytest.raises(ValueError, match=r"'global_scale' must be on the device of 'input'"):
        lowbit.nvfp4_quantize(x.cpu(), torch.ones((), device="cuda"))


@cuda
def test_cuda_graph_capture_and_replay():
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    expected = roundtrip(x)
    static_in = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        roundtrip(static_in)  # warm up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = roundtrip(static_in)
    static_in.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, roundtrip(static_in))
    static_in.copy_(x)
    graph.replay()
    assert torch.equal(static_out, expected)


@cuda
def test_cuda_compile_reduce_overhead_matches_eager():
    compiled = torch.compile(roundtrip, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        assert torch.equal(compiled(x), roundtrip(x))
