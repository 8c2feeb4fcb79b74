"""lowbit.nvfp4_linear against references on CPU and CUDA: dtypes, the FP8
mode, batch dimensions, bad input (tolerances: linear_reference.py)."""

import pytest
import torch
import torch.nn.functional as F

import lowbit
import nvfp4_reference as ref
from linear_reference import FP8_MODE_TOL, REL_TOL, check_k_zero, fp8_mode_reference, make_weight, reference, rel_err
from lowbit.nn import Nvfp4Linear


cuda = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(16, 16), (48, 144), (64, 400), (32, 1024)])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_cpu_matches_fp32_reference(dtype, n, k, m):
    gen = torch.Generator().manual_seed(n * 1000 + k + m)
    _, _, deq, pw, ps, g = make_weight(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    for b in (None, bias):
        y = lowbit.nvfp4_linear(x, pw, ps, g, b)
        assert y.shape == (m, n) and y.dtype == dtype
        assert rel_err(y, reference(x, deq, b)) <= REL_TOL


def test_cosine_vs_unquantized_linear():
    gen = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(512, 256, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(256, 512, generator=gen))
    q = Nvfp4Linear.from_linear(lin)
    x = torch.randn(8, 512, generator=gen).to(torch.bfloat16)
    cos = F.cosine_similarity(q(x).float().flatten(), lin(x).float().flatten(), dim=0)
    assert cos >= 0.99


def test_batch_dims_and_empty():
    gen = torch.Generator().manual_seed(4)
    _, _, deq, pw, ps, g = make_weight(32, 64, gen)
    x = torch.randn(2, 3, 64, generator=gen).to(torch.bfloat16)
    y = lowbit.nvfp4_linear(x, pw, ps, g)
    assert y.shape == (2, 3, 32)
    assert rel_err(y, reference(x, deq)) <= REL_TOL
    assert lowbit.nvfp4_linear(torch.empty(0, 64, dtype=torch.bfloat16), pw, ps, g).shape == (0, 32)
    assert lowbit.nvfp4_linear(torch.empty(4, 0, 64, dtype=torch.bfloat16), pw, ps, g).shape == (4, 0, 32)
    check_k_zero("cpu")


def test_bad_inputs_raise_clear_errors():
    gen = torch.Generator().manual_seed(5)
    _, q, _, pw, ps, g = make_weight(32, 64, gen)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"'x' must have a last dimension divisible by 16, got shape \[4, 40\]"):
        lowbit.nvfp4_linear(torch.randn(4, 40, dtype=torch.bfloat16), pw, ps, g)
    with pytest.raises(TypeError, match=r"'x' must have dtype .*got Int"):
        lowbit.nvfp4_linear(torch.ones(4, 64, dtype=torch.int32), pw, ps, g)
    with pytest.raises(ValueError, match=r"'x' must have K = 64 columns \(the K 'weight' and 'weight_scale' were "
                                         r"prepacked for\), got shape \[4, 256\]"):
        lowbit.nvfp4_linear(torch.randn(4, 256, dtype=torch.bfloat16), pw, ps, g)
    with pytest.raises(ValueError, match=r"'weight' must be prepacked .* for K = 64, i.e. have shape \[N, 64\], got \[32, 16\]"):
        lowbit.nvfp4_linear(x, pw[:, :16], ps, g)
    with pytest.raises(ValueError, match=r"'weight_scale' must have shape \[32, 12\], got \[32, 4\]"):
        lowbit.nvfp4_linear(x, pw, ps[:, :4], g)
    with pytest.raises(TypeError, match=r"'weight_scale' must have dtype Byte, got Float"):
        lowbit.nvfp4_linear(x, pw, ps.float(), g)
    with pytest.raises(ValueError, match=r"'weight_global' must have shape \[\], got \[1\]"):
        lowbit.nvfp4_linear(x, pw, ps, g.reshape(1))
    with pytest.raises(ValueError, match=r"'bias' must have shape \[32\], got \[16\]"):
        lowbit.nvfp4_linear(x, pw, ps, g, torch.zeros(16, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"'bias' must have the dtype of 'x' \(BFloat16\), got Float"):
        lowbit.nvfp4_linear(x, pw, ps, g, torch.zeros(32))
    with pytest.raises(ValueError, match=r"'weight' must have a first dimension \(N\) divisible by 16, got shape \[8, 32\]"):
        lowbit.nvfp4_prepack(q.packed[:8], q.block_scale[:8])
    with pytest.raises(ValueError, match=r"'weight_scale' must have shape \[32, 4\], got \[32, 2\]"):
        lowbit.nvfp4_prepack(q.packed, q.block_scale[:, :2])
    with pytest.raises(ValueError, match=r"'weight' must have a last dimension divisible by 8, got shape \[32, 4\]"):
        lowbit.nvfp4_prepack(q.packed[:, :4], q.block_scale[:, :1])
    with pytest.raises(TypeError, match=r"'weight' must have dtype Byte, got Float"):
        lowbit.nvfp4_prepack(q.packed.float(), q.block_scale)
    with pytest.raises(ValueError, match=r"in_features and out_features must be multiples of 16"):
        Nvfp4Linear(20, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_mode_matches_its_rule(dtype):
    # fp8_min_rows: from that many rows of x (the product of the leading
    # dimensions) W and x are rounded to E4M3 per row. The CPU kernel is the
    # mode's reference; here it is checked against the rule written out in
    # plain torch, and against the W4A16 result within the mode's error.
    gen = torch.Generator().manual_seed(31)
    _, q, deq, pw, ps, g = make_weight(48, 400, gen)
    bias = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(2, 3, 400, generator=gen).to(dtype)
    x[1, 2] = 0  # a zero row: its output is the bias
    for b in (None, bias):
        y = lowbit.nvfp4_linear(x, pw, ps, g, b, fp8_min_rows=6)
        want = fp8_mode_reference(x, q, b)
        tol = 1e-6 if dtype == torch.float32 else 4e-3  # float32 sums in another order / the output's rounding
        assert rel_err(y, want) <= tol
        assert rel_err(y, reference(x, deq, b)) <= FP8_MODE_TOL
        assert torch.equal(y[1, 2], b if b is not None else torch.zeros(48, dtype=dtype))
        # below the threshold: the W4A16 result, bit for bit
        assert torch.equal(lowbit.nvfp4_linear(x, pw, ps, g, b, fp8_min_rows=7), lowbit.nvfp4_linear(x, pw, ps, g, b))
    assert not torch.equal(y, lowbit.nvfp4_linear(x, pw, ps, g, bias))
    assert lowbit.nvfp4_linear(x[:0], pw, ps, g, bias, fp8_min_rows=1).shape == (0, 3, 48)
    with pytest.raises(ValueError, match=r"'fp8_min_rows' must be >= 0 \(0: never the FP8 mode\), got -2"):
        lowbit.nvfp4_linear(x, pw, ps, g, fp8_min_rows=-2)


@cuda
def test_cuda_special_scales_and_determinism():
    gen = torch.Generator().manual_seed(10)
    q = lowbit.nvfp4_quantize(torch.randn(64, 2048, generator=gen))
    codes = q.block_scale.view(torch.uint8).clone()
    codes[0, 0], codes[1, 1], codes[2, 2] = 0x00, codes[1, 1] | 0x80, 0x03
    deq = ref.dequantize(q.packed, codes, q.global_scale).cuda()
    pw, ps = lowbit.nvfp4_prepack(q.packed.cuda(), codes.cuda())
    g = q.global_scale.cuda()
    for m in (1, 16, 100, 300):
        x = torch.randn(m, 2048, generator=gen).to(torch.bfloat16).cuda()
        y = lowbit.nvfp4_linear(x, pw, ps, g)
        assert rel_err(y, x.float() @ deq.T) <= REL_TOL
        assert torch.equal(y, lowbit.nvfp4_linear(x, pw, ps, g))  # deterministic


@cuda
def test_cuda_wrong_device_arguments():
    gen = torch.Generator().manual_seed(12)
    _, _, _, pw, ps, g = make_weight(32, 64, gen)
    with pytest.raises(ValueError, match=r"'weight' must be on the device of 'x'"):
        lowbit.nvfp4_linear(torch.randn(2, 64, device="cuda", dtype=torch.bfloat16), pw, ps, g)
    with pytest.raises(TypeError, match=r"'x' must have dtype .*, got Double"):
        lowbit.nvfp4_linear(torch.randn(2, 64, device="cuda", dtype=torch.float64), pw.cuda(), ps.cuda(), g.cuda())


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(48, 1168), (4096, 2048), (1024, 7168), (32, 8192), (48, 8208)])
def test_cuda_fp8_mode_matches_cpu(dtype, n, k):
    # The FP8 mode on the GPU (E4M3 rows by lowbit's kernels, cuBLASLt's FP8
    # GEMM) against the CPU kernel, its reference: the same codes and
    # scales, so only the order of the FP32 sums and the output's rounding
    # differ. K = 1168 leaves the last k-tile partial (its padding blocks
    # must not enter a row's amax). x's rows stay in registers up to K =
    # 8192 and are read twice above (8208). Odd M with a bias; fresh data
    # per M.
    gen = torch.Generator().manual_seed(n + k)
    _, q, deq, pw, ps, g = make_weight(n, k, gen)
    bias = torch.randn(n, generator=gen).to(dtype)
    for m in (1, 17, 300, 2100):
        x = torch.randn(m, k, generator=gen).to(dtype)
        b = bias if m % 2 else None
        want = lowbit.nvfp4_linear(x, pw, ps, g, b, fp8_min_rows=1)
        args = (x.cuda(), pw.cuda(), ps.cuda(), g.cuda(), None if b is None else b.cuda())
        y = lowbit.nvfp4_linear(*args, fp8_min_rows=1)
        assert y.dtype == dtype and y.shape == (m, n)
        assert rel_err(y.cpu(), want) <= 4e-3, m
        assert rel_err(y.cpu(), reference(x, deq, b)) <= FP8_MODE_TOL, m
        assert torch.equal(y, lowbit.nvfp4_linear(*args, fp8_min_rows=1))  # deterministic
        assert torch.equal(lowbit.nvfp4_linear(*args, fp8_min_rows=m + 1), lowbit.nvfp4_linear(*args))


@cuda
@pytest.mark.parametrize("m", [128, 256, 300])
def test_cuda_fp8_mode_without_a_fast_accumulation_algorithm(m):
    # From 128 rows the FP8 GEMM asks cuBLASLt for fast accumulation; for
    # N = 256, K = 7168 with a bias it has none at these row counts
    # (CUBLAS_STATUS_NOT_SUPPORTED, measured on an H200 with torch 2.11), and
    # the op runs the exact form instead. These small outputs now go first to
    # the unit-scale form (fp8_row_gemm_cuda.h: cuBLASLt's per-tensor GEMM,
    # which steps aside to the row-scaled path if cuBLASLt refuses it).
    # Whichever runs: the same result as the CPU kernel, also inside a CUDA
    # graph.
    n, k = 256, 7168
    gen = torch.Generator().manual_seed(m)
    _, q, deq, pw, ps, g = make_weight(n, k, gen)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    want = lowbit.nvfp4_linear(x, pw, ps, g, b, fp8_min_rows=1)
    args = (x.cuda(), pw.cuda(), ps.cuda(), g.cuda(), b.cuda())
    y = lowbit.nvfp4_linear(*args, fp8_min_rows=1)
    assert rel_err(y.cpu(), want) <= 4e-3
    assert rel_err(y.cpu(), reference(x, deq, b)) <= FP8_MODE_TOL
    assert torch.equal(y, lowbit.nvfp4_linear(*args, fp8_min_rows=1))
    graph = torch.cuda.CUDAGraph()  # the refused query inside a capture leaves it valid
    with torch.cuda.graph(graph):
        y_graph = lowbit.nvfp4_linear(*args, fp8_min_rows=1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, y)


# (op, arguments): one dtype the CUDA kernels reject per argument. The Meta
# kernels (fake tensors, device="meta") reject the same, with the same words.
def bad_dtype_calls():
    gen = torch.Generator().manual_seed(56)
    _, q, _, pw, ps, g = make_weight(32, 64, gen)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    xg = torch.randn(4, 2, 64, generator=gen).to(torch.bfloat16)
    ops = torch.ops.lowbit
    return [
        (ops.nvfp4_linear, (x.double(), pw, ps, g), "'x' must have dtype"),
        (ops.nvfp4_linear, (x.to(torch.int32), pw, ps, g), "'x' must have dtype"),
        (ops.nvfp4_linear, (x, pw.to(torch.int8), ps, g), "'weight' must have dtype"),
        (ops.nvfp4_linear, (x, pw, ps.float(), g), "'weight_scale' must have dtype"),
        (ops.nvfp4_linear, (x, pw, ps, g.bfloat16()), "'weight_global' must have dtype"),
        (ops.nvfp4_linear, (x, pw, ps, g, torch.zeros(32)), "'bias' must have the dtype of 'x'"),
        (ops.nvfp4_grouped_linear, (xg.double(), pw, ps, g, 2), "'x' must have dtype"),
        (ops.nvfp4_grouped_linear, (xg, pw, ps.float(), g, 2), "'weight_scale' must have dtype"),
        (ops.nvfp4_grouped_linear, (xg, pw, ps, g.double(), 2), "'weight_global' must have dtype"),
        (ops.nvfp4_prepack, (q.packed.to(torch.int8), q.block_scale), "'weight' must have dtype"),
        (ops.nvfp4_prepack, (q.packed, q.block_scale.float()), "'weight_scale' must have dtype"),
        (ops.nvfp4_unpack, (pw, ps, g, 64, torch.float64), "'dtype' must be"),
        (ops.nvfp4_unpack, (pw, ps.float(), g, 64, torch.bfloat16), "'weight_scale' must have dtype"),
        (ops.nvfp4_unpack, (pw, ps, g.half(), 64, torch.bfloat16), "'weight_global' must have dtype"),
        (ops.nvfp4_unprepack, (pw.to(torch.int8), ps, 64), "'weight' must have dtype"),
        (ops.nvfp4_unprepack, (pw, ps.to(torch.int16), 64), "'weight_scale' must have dtype"),
    ]


@pytest.mark.parametrize("case", range(len(bad_dtype_calls())))
def test_meta_kernels_reject_the_dtypes_the_kernels_reject(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, args, words = bad_dtype_calls()[case]
    devices = ["cpu", "meta"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(TypeError, match=words):
            op(*moved)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(TypeError, match=words):
            op(*fake)


def test_linear_ops_accept_the_same_dtypes_on_every_device():
    # One validation for CPU, CUDA and Meta: x in float32 too (on CUDA the
    # weight unpacked to FP32 and an FP32 matmul), so a graph traced with
    # fake tensors runs on either device.
    gen = torch.Generator().manual_seed(57)
    _, _, deq, pw, ps, g = make_weight(32, 64, gen)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    x = torch.randn(4, 64, generator=gen)
    xg = torch.randn(4, 2, 64, generator=gen)
    want = lowbit.nvfp4_linear(x, pw, ps, g)
    want8 = lowbit.nvfp4_linear(x, pw, ps, g, None, 1)
    want_g = lowbit.nvfp4_grouped_linear(xg, pw, ps, g, 2)
    assert rel_err(want, reference(x, deq)) <= 1e-5
    for device in devices + ["meta"]:
        d = [t.to(device) for t in (x, pw, ps, g)]
        y = lowbit.nvfp4_linear(*d)
        y8 = lowbit.nvfp4_linear(*d, None, 1)
        yg = lowbit.nvfp4_grouped_linear(xg.to(device), *d[1:], 2)
        assert y.dtype == y8.dtype == yg.dtype == torch.float32
        if device != "meta":
            torch.testing.assert_close(y.cpu(), want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(y8.cpu(), want8, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(yg.cpu(), want_g, rtol=1e-5, atol=1e-6)
