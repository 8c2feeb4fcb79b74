"""The Linear's FP8 path on a cached FP8 weight: lowbit.nvfp4_to_fp8 (W's
E4M3 form, made once) against an independent reference of its rule, bit for
bit; nvfp4_linear with weight_fp8 / weight_fp8_scale; Nvfp4Linear's compute
modes ("w4a16", "auto", "fp8"): numerics, state dicts, compile, bad input;
CUDA against CPU (helpers: linear_reference.py)."""

import pytest
import torch
import torch._dynamo.testing

import lowbit
import nvfp4_reference as ref
from linear_reference import FP8_MODE_TOL, Stack, make_weight, reference, rel_err, size_oblivious
from lowbit.nn import Nvfp4GroupedLinear, Nvfp4Linear
from lowbit.nn.linear import AUTO_FP8_MIN_ROWS

cuda = pytest.mark.cuda

# Extra error of the FP8 path against the float64 W4A16 result on realistic
# random data (Gaussian or Student-t weights, Gaussian x with or without
# hot channels; M = 64; 1024 x 2048 .. 1536 x 7168): measured 3.4-4.0e-2 on
# the CPU (README.md, Formats). The bar: the per-call FP8 mode's error
# (3.8-4.1e-2 measured when it was built), with a small margin.
FP8_PATH_TOL = 4.2e-2


def to_fp8_reference(q, n, k):
    """nvfp4_to_fp8's rule written out in plain torch from the checkpoint
    tensors: each row v = e2m1 * block scale (global left out), amax = the
    largest |v| that is not NaN, r = 448 / amax rounded once (0 for amax 0),
    codes = E4M3(v * r) to nearest even (NaN: 0x7F), scale = amax * global
    / 448. Returns (codes as uint8 [N, K], scales float32 [N]). Blocks of
    a zero scale are +0 (the prepacked layout stores them as zero codes,
    csrc/lowbit/linear/nvfp4_linear.h, UnprepackArgs)."""
    codes = q.block_scale.view(torch.uint8)
    v = ref.dequantize(q.packed, codes, torch.ones(())).float().view(n, k)
    zero_block = ((codes & 0x7F) == 0).repeat_interleave(16, dim=1)
    v = torch.where(zero_block, torch.zeros_like(v), v)
    nan = v.isnan()
    amax = torch.where(nan, torch.zeros_like(v), v.abs()).amax(1)
    r = torch.where(amax > 0, torch.full_like(amax, 448.0) / amax, torch.zeros_like(amax))
    codes = (v * r[:, None]).to(torch.float8_e4m3fn).view(torch.uint8).clone()
    codes[nan] = 0x7F
    return codes, amax * q.global_scale.float() / 448.0


def special_weight(n, k, gen):
    """A quantized weight with the block scales a checkpoint may hold beside
    positive ones: zero, negative, NaN; and a row of all-zero values."""
    w = torch.randn(n, k, generator=gen) * 0.02
    w[3] = 0
    q = lowbit.nvfp4_quantize(w)
    codes = q.block_scale.view(torch.uint8).clone()
    codes[0, 0], codes[1, 1], codes[2, k // 16 - 1] = 0x00, codes[1, 1] | 0x80, 0x7F
    return q._replace(block_scale=codes.view(torch.float8_e4m3fn))


@pytest.mark.parametrize("n,k", [(16, 32), (48, 400), (32, 1168), (64, 2048)])
def test_to_fp8_matches_its_rule_bit_for_bit(n, k):
    # Fresh random data; K = 400 and 1168 leave the last 128-column tile
    # partial (its padding must not enter a row's amax).
    gen = torch.Generator().manual_seed(n * 7 + k)
    for q in (lowbit.nvfp4_quantize(torch.randn(n, k, generator=gen) * 0.02), special_weight(n, k, gen)):
        pw, ps = lowbit.nvfp4_prepack(q.packed, q.block_scale)
        w8, scale = lowbit.nvfp4_to_fp8(pw, ps, q.global_scale, k)
        assert w8.dtype == torch.float8_e4m3fn and w8.shape == (n, k)
        assert scale.dtype == torch.float32 and scale.shape == (n,)
        want_codes, want_scale = to_fp8_reference(q, n, k)
        assert torch.equal(w8.view(torch.uint8), want_codes)
        assert torch.equal(scale, want_scale)
    assert torch.equal(scale[3], torch.tensor(0.0))  # the all-zero row: amax 0, scale 0, codes 0
    # W ~= codes * scale (the row's own E4M3 rounding: 2^-4 relative at most).
    deq = ref.dequantize(q.packed, q.block_scale.view(torch.uint8), q.global_scale).float()
    fine = ~deq.isnan().any(1)
    approx = w8.float() * scale[:, None]
    assert ((approx - deq).abs() <= deq.abs() * 2**-4 + 1e-30)[fine].all()


def test_to_fp8_edge_shapes_and_bad_input():
    gen = torch.Generator().manual_seed(3)
    _, q, _, pw, ps, g = make_weight(32, 64, gen)
    w8, scale = lowbit.nvfp4_to_fp8(pw[:0], ps[:0], g, 64)  # N = 0
    assert w8.shape == (0, 64) and scale.shape == (0,)
    pw0, ps0 = lowbit.nvfp4_prepack(torch.zeros(32, 0, dtype=torch.uint8), torch.zeros(32, 0, dtype=torch.uint8))
    w8, scale = lowbit.nvfp4_to_fp8(pw0, ps0, g, 0)  # K = 0: scale 0
    assert w8.shape == (32, 0) and torch.equal(scale, torch.zeros(32))
    with pytest.raises(ValueError, match=r"nvfp4_to_fp8: argument 'k' must be a multiple of 16 \(>= 0\), got 60"):
        lowbit.nvfp4_to_fp8(pw, ps, g, 60)
    with pytest.raises(ValueError, match=r"nvfp4_to_fp8: argument 'k' must be the K the weight was prepacked for "
                                         r"\(64\), got 48"):
        lowbit.nvfp4_to_fp8(pw, ps, g, 48)
    with pytest.raises(TypeError, match=r"nvfp4_to_fp8: argument 'weight' must have dtype Byte, got Float"):
        lowbit.nvfp4_to_fp8(pw.float(), ps, g, 64)
    with pytest.raises(TypeError, match=r"nvfp4_to_fp8: argument 'weight_global' must have dtype Float"):
        lowbit.nvfp4_to_fp8(pw, ps, g.double(), 64)
    with pytest.raises(ValueError, match=r"nvfp4_to_fp8: argument 'weight' must be prepacked"):
        lowbit.nvfp4_to_fp8(q.packed, ps, g, 64)  # the checkpoint layout


def test_to_fp8_opcheck_and_meta():
    gen = torch.Generator().manual_seed(4)
    _, _, _, pw, ps, g = make_weight(48, 400, gen)
    torch.library.opcheck(torch.ops.lowbit.nvfp4_to_fp8.default, (pw, ps, g, 400))
    w8, scale = torch.ops.lowbit.nvfp4_to_fp8(pw.to("meta"), ps.to("meta"), g.to("meta"), 400)
    assert w8.shape == (48, 400) and w8.dtype == torch.float8_e4m3fn and scale.shape == (48,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cached_fp8_weight_gives_the_fp8_mode_bit_for_bit(dtype):
    # The cached form only saves the per-call W pass: the same codes, the
    # same result; and within the FP8 path's bar of the W4A16 reference.
    gen = torch.Generator().manual_seed(21)
    _, q, deq, pw, ps, g = make_weight(96, 1168, gen)
    w8, scale = lowbit.nvfp4_to_fp8(pw, ps, g, 1168)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(2, 37, 1168, generator=gen).to(dtype)
    for b in (None, bias):
        per_call = lowbit.nvfp4_linear(x, pw, ps, g, b, 1)
        cached = lowbit.nvfp4_linear(x, pw, ps, g, b, 1, w8, scale)
        assert torch.equal(cached, per_call)
        assert torch.equal(lowbit.nvfp4_linear(x, pw, ps, g, b, 1, w8.view(torch.uint8), scale), cached)  # codes
        assert rel_err(cached, reference(x, deq, b)) <= FP8_PATH_TOL
        # Below the threshold: W4A16 bit for bit, the cached weight unused.
        assert torch.equal(lowbit.nvfp4_linear(x, pw, ps, g, b, 75, w8, scale), lowbit.nvfp4_linear(x, pw, ps, g, b))
    assert lowbit.nvfp4_linear(x[:0], pw, ps, g, bias, 1, w8, scale).shape == (0, 37, 96)  # M = 0


def test_fp8_path_error_on_realistic_weights():
    # The numbers quoted in README.md (Formats): Gaussian and heavy-tailed
    # (Student-t, 3 degrees of freedom) weights, x with a few hot channels.
    gen = torch.Generator().manual_seed(2024)
    n, k = 512, 2048
    for w in (torch.randn(n, k, generator=gen) * 0.02,
              torch.distributions.StudentT(3.0).sample((n, k)) * 0.02):
        q = lowbit.nvfp4_quantize(w)
        deq = ref.dequantize(q.packed, q.block_scale.view(torch.uint8), q.global_scale)
        pw, ps = lowbit.nvfp4_prepack(q.packed, q.block_scale)
        w8, scale = lowbit.nvfp4_to_fp8(pw, ps, q.global_scale, k)
        x = torch.randn(64, k, generator=gen)
        x[:, torch.randperm(k, generator=gen)[: k // 100]] *= 30
        x = x.to(torch.bfloat16)
        y = lowbit.nvfp4_linear(x, pw, ps, q.global_scale, None, 1, w8, scale)
        assert rel_err(y, reference(x, deq)) <= FP8_PATH_TOL
        assert rel_err(lowbit.nvfp4_linear(x, pw, ps, q.global_scale), reference(x, deq)) <= 4e-3


def test_linear_with_fp8_weight_opcheck():
    gen = torch.Generator().manual_seed(6)
    _, _, _, pw, ps, g = make_weight(32, 144, gen)
    w8, scale = lowbit.nvfp4_to_fp8(pw, ps, g, 144)
    x = torch.randn(5, 144, generator=gen).to(torch.bfloat16)
    bias = torch.randn(32, generator=gen).to(torch.bfloat16)
    op = torch.ops.lowbit.nvfp4_linear.default
    # uint8 codes: all four default tests; float8_e4m3fn: test_schema
    # compares inputs with allclose, which has no float8 kernel.
    torch.library.opcheck(op, (x, pw, ps, g, bias, 4, w8.view(torch.uint8), scale))
    torch.library.opcheck(op, (x, pw, ps, g, None, 1, w8, scale),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_linear_with_fp8_weight_bad_input():
    gen = torch.Generator().manual_seed(8)
    _, _, _, pw, ps, g = make_weight(32, 64, gen)
    w8, scale = lowbit.nvfp4_to_fp8(pw, ps, g, 64)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"'weight_fp8' and 'weight_fp8_scale' must be given together .* got only "
                                         r"'weight_fp8'"):
        lowbit.nvfp4_linear(x, pw, ps, g, None, 1, w8)
    with pytest.raises(ValueError, match=r"'weight_fp8' is used only by the FP8 path, so 'fp8_min_rows' must be > 0"):
        lowbit.nvfp4_linear(x, pw, ps, g, None, 0, w8, scale)
    with pytest.raises(TypeError, match=r"'weight_fp8' must have dtype .*, got BFloat16"):
        lowbit.nvfp4_linear(x, pw, ps, g, None, 1, w8.to(torch.bfloat16), scale)
    with pytest.raises(ValueError, match=r"'weight_fp8' must have shape \[32, 64\], got \[16, 64\]"):
        lowbit.nvfp4_linear(x, pw, ps, g, None, 1, w8[:16], scale)
    with pytest.raises(ValueError, match=r"'weight_fp8_scale' must have shape \[32\], got \[1, 32\]"):
        lowbit.nvfp4_linear(x, pw, ps, g, None, 1, w8, scale[None])
    with pytest.raises(TypeError, match=r"'weight_fp8_scale' must have dtype Float, got Double"):
        lowbit.nvfp4_linear(x, pw, ps, g, None, 1, w8, scale.double())


# ---- Nvfp4Linear(compute=...) ---------------------------------------------


def test_compute_modes_numerics_and_memory():
    gen = torch.Generator().manual_seed(33)
    lin = torch.nn.Linear(256, 96).to(torch.bfloat16)
    w4 = Nvfp4Linear.from_linear(lin)
    assert w4.compute == "w4a16" and w4.weight_fp8 is None and w4.weight_fp8_scale is None  # no FP8 copy
    fp8 = Nvfp4Linear.from_linear(lin, compute="fp8")
    auto = Nvfp4Linear.from_linear(lin, compute="auto")
    assert "compute=fp8" in repr(fp8) and "compute=auto" in repr(auto) and "compute" not in repr(w4)
    assert fp8.weight_fp8.dtype == torch.float8_e4m3fn and fp8.weight_fp8.shape == (96, 256)
    assert fp8.weight_fp8_scale.dtype == torch.float32 and fp8.weight_fp8_scale.shape == (96,)
    want8 = lowbit.nvfp4_to_fp8(w4.weight, w4.weight_scale, w4.weight_global, 256)
    assert torch.equal(fp8.weight_fp8.view(torch.uint8), want8.weight.view(torch.uint8))
    assert torch.equal(fp8.weight_fp8_scale, want8.scale)
    deq = lowbit.nvfp4_unpack(w4.weight, w4.weight_scale, w4.weight_global, 256, torch.float32)
    for m in (0, 1, 7, AUTO_FP8_MIN_ROWS - 1, AUTO_FP8_MIN_ROWS):
        x = torch.randn(m, 256, generator=gen).to(torch.bfloat16)
        y4, y8, ya = w4(x), fp8(x), auto(x)
        assert y8.shape == (m, 96)
        per_call = lowbit.nvfp4_linear(x, w4.weight, w4.weight_scale, w4.weight_global, w4.bias, 1)
        assert torch.equal(y8, per_call)
        assert torch.equal(ya, y8 if m >= AUTO_FP8_MIN_ROWS else y4)
        if m:
            assert rel_err(y8, reference(x, deq, w4.bias)) <= FP8_PATH_TOL
    # The setter makes and drops the copy.
    w4.compute = "auto"
    assert torch.equal(w4.weight_fp8.view(torch.uint8), fp8.weight_fp8.view(torch.uint8))
    w4.compute = "w4a16"
    assert w4.weight_fp8 is None


def test_compute_state_dict_round_trip_and_moves():
    gen = torch.Generator().manual_seed(34)
    src = Nvfp4Linear.from_linear(torch.nn.Linear(128, 64).to(torch.bfloat16), compute="auto")
    sd = src.state_dict()
    assert set(sd) == {"weight", "weight_scale", "weight_global", "bias"}  # the FP8 copy is derived, not saved
    dst = Nvfp4Linear(128, 64, compute="fp8")
    dst.load_state_dict(sd)
    assert torch.equal(dst.weight_fp8.view(torch.uint8), src.weight_fp8.view(torch.uint8))  # made from the loaded W
    assert torch.equal(dst.weight_fp8_scale, src.weight_fp8_scale)
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16)
    assert torch.equal(dst(x), lowbit.nvfp4_linear(x, src.weight, src.weight_scale, src.weight_global, src.bias, 1))
    # .half() keeps the stored dtypes; .to(device) moves the copy with the rest.
    dst.half()
    assert dst.weight_fp8.dtype == torch.float8_e4m3fn and dst.weight_fp8_scale.dtype == torch.float32
    moved = dst.to("meta")
    assert moved.weight_fp8.device.type == "meta" and moved.weight_fp8_scale.device.type == "meta"


def test_compute_bad_values_and_grouped():
    with pytest.raises(ValueError, match=r"Nvfp4Linear: compute must be 'w4a16', 'auto' or 'fp8', got 'FP8'"):
        Nvfp4Linear(128, 64, compute="FP8")
    layer = Nvfp4Linear(128, 64)
    with pytest.raises(ValueError, match=r"compute must be 'w4a16', 'auto' or 'fp8', got None"):
        layer.compute = None
    assert layer.compute == "w4a16"
    with pytest.raises(ValueError, match=r"Nvfp4Linear.from_linear: compute must be"):
        Nvfp4Linear.from_linear(torch.nn.Linear(128, 64), compute="w4a8")
    model = torch.nn.Sequential(torch.nn.Linear(128, 64))
    with pytest.raises(ValueError, match=r"quantize_: compute must be 'w4a16', 'auto' or 'fp8'"):
        lowbit.quantize_(model, compute="fast", progress=False)
    assert type(model[0]) is torch.nn.Linear  # untouched
    with pytest.raises(NotImplementedError, match=r"Nvfp4GroupedLinear: compute='auto' is not implemented yet"):
        Nvfp4GroupedLinear(128, 64, 4, compute="auto")
    grouped = Nvfp4GroupedLinear(128, 64, 4)
    assert grouped.compute == "w4a16"
    with pytest.raises(NotImplementedError, match=r"compute='fp8' is not implemented yet"):
        grouped.compute = "fp8"


def test_auto_threshold():
    """compute="auto" runs the FP8 path from AUTO_FP8_MIN_ROWS (128) rows on
    every layer, whichever way the mode is set; the deprecated
    fp8_min_rows=n keeps its own n."""
    assert AUTO_FP8_MIN_ROWS == 128
    wide = Nvfp4Linear(2048, 7168, bias=False, device="meta", compute="auto")
    narrow = Nvfp4Linear(8192, 64, bias=False, device="meta", compute="auto")
    assert (wide._fp8_rows, narrow._fp8_rows) == (128, 128)
    assert "compute=auto (FP8 from 128 rows)" in repr(wide)
    wide.compute = "w4a16"
    assert wide._fp8_rows == 0
    wide.compute = "auto"
    assert wide._fp8_rows == 128 and wide.weight_fp8.shape == (7168, 2048)
    with pytest.deprecated_call():
        assert Nvfp4Linear(2048, 7168, bias=False, device="meta", fp8_min_rows=256)._fp8_rows == 256
    model = torch.nn.Sequential(torch.nn.Linear(2048, 7168, bias=False, device="meta"),
                                torch.nn.Linear(7168, 64, bias=False, device="meta"))
    model = lowbit.quantize_(model.to(torch.bfloat16), compute="auto", progress=False)
    assert [m._fp8_rows for m in model] == [128, 128]


def test_quantize_compute():
    gen = torch.Generator().manual_seed(35)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    model = lowbit.quantize_(model.to(torch.bfloat16), compute="fp8", progress=False)
    assert [m.compute for m in (model[0], model[2])] == ["fp8", "fp8"]
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    h = lowbit.nvfp4_linear(x, model[0].weight, model[0].weight_scale, model[0].weight_global, model[0].bias, 1)
    assert torch.equal(model[0](x), h)


def test_compile_auto_one_op_per_layer_no_recompile():
    # "auto": one lowbit op per Linear call (the FP8 weight a buffer, not
    # made in the graph), one graph across M on both sides of the threshold.
    model = Stack([64, 128, 48], compute="auto")
    x = torch.randn(5, 64).to(torch.bfloat16)
    exported = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert sum("lowbit.nvfp4_linear" in t for t in targets) == 2
    assert not any("nvfp4_to_fp8" in t for t in targets)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    with size_oblivious:
        for m in (1, 3, AUTO_FP8_MIN_ROWS - 1, AUTO_FP8_MIN_ROWS, 1500):
            x = torch.randn(m, 64).to(torch.bfloat16)
            assert torch.equal(compiled(x), model(x))
    assert counter.frame_count == 1


# ---- CUDA -----------------------------------------------------------------


@cuda
@pytest.mark.parametrize("n,k", [(48, 1168), (4096, 2048), (1024, 7168)])
def test_cuda_to_fp8_matches_cpu_bit_for_bit(n, k):
    gen = torch.Generator().manual_seed(n + k)
    for q in (lowbit.nvfp4_quantize(torch.randn(n, k, generator=gen) * 0.02), special_weight(n, k, gen)):
        pw, ps = lowbit.nvfp4_prepack(q.packed, q.block_scale)
        want = lowbit.nvfp4_to_fp8(pw, ps, q.global_scale, k)
        got = lowbit.nvfp4_to_fp8(pw.cuda(), ps.cuda(), q.global_scale.cuda(), k)
        assert torch.equal(got.weight.cpu().view(torch.uint8), want.weight.view(torch.uint8))
        assert torch.equal(got.scale.cpu(), want.scale)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_cached_fp8_path_matches_cpu(dtype):
    # The same codes on both devices (x's rounding too): only the FP32 sums'
    # order and the output's rounding differ. Odd M, a bias on odd M.
    gen = torch.Generator().manual_seed(77)
    n, k = 1024, 1168
    _, q, deq, pw, ps, g = make_weight(n, k, gen)
    w8, scale = lowbit.nvfp4_to_fp8(pw, ps, g, k)
    w8_c, scale_c = lowbit.nvfp4_to_fp8(pw.cuda(), ps.cuda(), g.cuda(), k)
    bias = torch.randn(n, generator=gen).to(dtype)
    for m in (1, 17, 300, 2100):
        x = torch.randn(m, k, generator=gen).to(dtype)
        b = bias if m % 2 else None
        want = lowbit.nvfp4_linear(x, pw, ps, g, b, 1, w8, scale)
        args = (x.cuda(), pw.cuda(), ps.cuda(), g.cuda(), None if b is None else b.cuda(), 1)
        y = lowbit.nvfp4_linear(*args, w8_c, scale_c)
        assert y.dtype == dtype and y.shape == (m, n)
        assert rel_err(y.cpu(), want) <= 4e-3, m
        assert rel_err(y.cpu(), reference(x, deq, b)) <= FP8_MODE_TOL, m
        assert torch.equal(y, lowbit.nvfp4_linear(*args))  # per call: the same codes, the same GEMM
        assert torch.equal(y, lowbit.nvfp4_linear(*args, w8_c, scale_c))  # deterministic


@cuda
def test_cuda_auto_graph_capture_and_no_host_sync():
    # compute="auto" (threshold 64 here): CUDA graphs of calls on both sides
    # replay bitwise the eager result; no host synchronization in forward.
    model = Stack([512, 1024, 256], device="cuda", auto_rows=64)
    xs = [torch.randn(m, 512, device="cuda", dtype=torch.bfloat16) for m in (8, 64, 300)]
    wants = [model(x) for x in xs]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs:
            model(x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for x, want in zip(xs, wants):
        static_x = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(static_x)  # warm up off the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(static_x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), x.shape
