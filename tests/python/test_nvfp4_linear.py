"""lowbit.nvfp4_linear / nvfp4_prepack and lowbit.nn.Nvfp4Linear.

References are independent of lowbit's GEMM code: the dequantized weight comes
from nvfp4_reference.dequantize (plain torch) on the checkpoint-layout
tensors, and the product is an FP32 (or FP64) matmul. Tolerances:
  * vs FP32 matmul with the dequantized weight: ||y - ref|| / ||ref|| <= 4e-3.
    The CPU kernel is exact up to the output rounding (bf16: ~1.1e-3 rms);
    the CUDA kernels add FP32 accumulation order (fused path) or a bf16
    rounding of weight * global (cuBLAS path, ~1.1e-3 more).
  * vs the unquantized BF16 Linear: cosine >= 0.99 (NVFP4 of Gaussian
    weights keeps ~9-10% RMS error per weight, cosine ~0.995).
"""

import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch._dynamo.testing
import torch.fx.experimental._config
import torch.nn.functional as F

import lowbit
import nvfp4_reference as ref
from lowbit.nn import Nvfp4Linear

REL_TOL = 4e-3


def rel_err(y, want):
    return ((y.double() - want.double()).norm() / want.double().norm()).item()


def make_weight(n, k, gen, device="cpu"):
    w = torch.randn(n, k, generator=gen) * 0.02
    q = lowbit.nvfp4_quantize(w)
    deq = ref.dequantize(q.packed, q.block_scale.view(torch.uint8), q.global_scale)
    pw, ps = lowbit.nvfp4_prepack(q.packed.to(device), q.block_scale.to(device))
    return w, q, deq, pw, ps, q.global_scale.to(device)


def reference(x, deq, bias=None):
    y = x.double() @ deq.double().T
    if bias is not None:
        y = y + bias.double()
    return y


def fp8_mode_reference(x, q, bias=None):
    """The FP8 mode's rule (README.md, Formats) from the checkpoint tensors, in
    plain torch: each W row (e2m1 * block scale, global left out) and each x
    row times 448 / its amax, rounded to E4M3; the codes' products summed in
    float64 and scaled by amax_x / 448 and amax_w * global / 448."""

    def rows(v):
        amax = v.abs().amax(1)
        # 448 / amax rounded once (`448.0 / amax` would multiply by a rounded reciprocal)
        r = torch.where(amax > 0, torch.full_like(amax, 448.0) / amax, torch.zeros_like(amax))
        return (v * r[:, None]).to(torch.float8_e4m3fn).double(), amax

    w = ref.dequantize(q.packed, q.block_scale.view(torch.uint8), torch.ones(()))
    w8, w_amax = rows(w)
    x8, x_amax = rows(x.reshape(-1, x.shape[-1]).float())
    w_scale = (w_amax * q.global_scale.float()) / 448.0
    y = (x8 @ w8.T) * (x_amax / 448.0).double()[:, None] * w_scale.double()[None, :]
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], -1)


# Extra error of the FP8 mode against the W4A16 result (E4M3 keeps 3
# mantissa bits of x and of W: ~3% per element each; measured 3.9-4.1e-2 on
# Gaussian data, docs/perf/log/linear.md).
FP8_MODE_TOL = 6e-2


# ---------------------------------------------------------------- CPU -------


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


def test_prepack_shapes_and_padding():
    gen = torch.Generator().manual_seed(1)
    _, q, _, pw, ps, _ = make_weight(32, 48, gen)
    assert pw.shape == (32, 64) and pw.dtype == torch.uint8  # K padded to 128
    # The tiles' 8 scale bytes a row, then one for each of the 5 padding
    # blocks: the shapes record K.
    assert ps.shape == (32, 8 + 5) and ps.dtype == torch.uint8
    # uint8 E4M3 codes are accepted as well as float8_e4m3fn
    pw2, ps2 = lowbit.nvfp4_prepack(q.packed, q.block_scale.view(torch.uint8))
    assert torch.equal(pw, pw2) and torch.equal(ps, ps2)


def test_special_block_scales():
    # zero, negative, subnormal and NaN E4M3 block scales are all exact
    gen = torch.Generator().manual_seed(2)
    q = lowbit.nvfp4_quantize(torch.randn(32, 128, generator=gen))
    codes = q.block_scale.view(torch.uint8).clone()
    codes[0, 0] = 0x00  # zero
    codes[1, 1] = codes[1, 1] | 0x80  # negative
    codes[2, 2] = 0x03  # subnormal 3 * 2^-9
    codes[3, 3] = 0x01  # smallest subnormal
    pw, ps = lowbit.nvfp4_prepack(q.packed, codes)
    deq = ref.dequantize(q.packed, codes, q.global_scale)
    eye = torch.eye(128)
    # y = I W^T gives W^T back: the unpacked weight, bit for bit
    w_back = lowbit.nvfp4_linear(eye, pw, ps, q.global_scale).T
    assert torch.equal(w_back, deq)
    codes[4, 4] = 0x7F  # NaN scale: output feature 4 is NaN (0 * NaN too), the others are not
    pw, ps = lowbit.nvfp4_prepack(q.packed, codes)
    w_back = lowbit.nvfp4_linear(eye, pw, ps, q.global_scale).T
    assert torch.isnan(w_back[4]).all() and torch.isfinite(w_back[torch.arange(32) != 4]).all()


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


def check_k_zero(device):
    # K = 0: no products, so y is the bias (or zeros), as in F.linear.
    pw, ps = lowbit.nvfp4_prepack(torch.zeros(32, 0, dtype=torch.uint8), torch.zeros(32, 0, dtype=torch.uint8))
    pw, ps, g = pw.to(device), ps.to(device), torch.tensor(0.5, device=device)
    x = torch.randn(2, 3, 0, device=device).to(torch.bfloat16)
    bias = torch.randn(32, device=device).to(torch.bfloat16)
    assert torch.equal(lowbit.nvfp4_linear(x, pw, ps, g, bias), bias.expand(2, 3, 32))
    assert torch.equal(lowbit.nvfp4_linear(x, pw, ps, g), torch.zeros(2, 3, 32, device=device, dtype=torch.bfloat16))


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


def test_fp8_mode_in_the_module():
    gen = torch.Generator().manual_seed(32)
    lin = torch.nn.Linear(128, 64).to(torch.bfloat16)
    q = Nvfp4Linear.from_linear(lin)
    assert q.fp8_min_rows == 0 and "fp8_min_rows" not in repr(q)
    x = torch.randn(8, 128, generator=gen).to(torch.bfloat16)
    w4 = q(x)
    q.fp8_min_rows = 8
    assert "fp8_min_rows=8" in repr(q)
    for bad in (-1, 1.5, True):  # checked when set, not at the next forward
        with pytest.raises(ValueError, match=r"fp8_min_rows must be an int >= 0"):
            q.fp8_min_rows = bad
    assert q.fp8_min_rows == 8
    model = torch.nn.Sequential(torch.nn.Linear(128, 64))
    with pytest.raises(ValueError, match=r"quantize_: fp8_min_rows must be an int >= 0"):
        lowbit.quantize_(model, fp8_min_rows=-1, progress=False)
    assert type(model[0]) is torch.nn.Linear  # untouched
    assert set(q.state_dict()) == {"weight", "weight_scale", "weight_global", "bias"}
    y = q(x)
    assert not torch.equal(y, w4) and rel_err(y, w4) <= FP8_MODE_TOL
    assert torch.equal(q(x[:7]), w4[:7])
    model = lowbit.quantize_(torch.nn.Sequential(torch.nn.Linear(128, 64)).to(torch.bfloat16), progress=False,
                             fp8_min_rows=1024)
    assert model[0].fp8_min_rows == 1024
    with pytest.raises(ValueError, match=r"fp8_min_rows must be an int >= 0"):
        Nvfp4Linear(128, 64, fp8_min_rows=-1)


def test_opcheck():
    gen = torch.Generator().manual_seed(6)
    _, q, _, pw, ps, g = make_weight(32, 144, gen)
    x = torch.randn(5, 144, generator=gen).to(torch.bfloat16)
    bias = torch.randn(32, generator=gen).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.lowbit.nvfp4_linear.default, (x, pw, ps, g, bias))
    torch.library.opcheck(torch.ops.lowbit.nvfp4_linear.default, (x.view(5, 1, 144), pw, ps, g))
    torch.library.opcheck(torch.ops.lowbit.nvfp4_linear.default, (x, pw, ps, g, bias, 4))  # the FP8 mode
    # uint8 E4M3 codes: all four default tests (float8 inputs cannot be
    # compared by test_schema, see test_nvfp4_quant.test_opcheck)
    torch.library.opcheck(torch.ops.lowbit.nvfp4_prepack.default, (q.packed, q.block_scale.view(torch.uint8)))


@pytest.mark.parametrize("n,k", [(16, 16), (48, 144), (32, 1024)])
def test_unpack_is_the_dequantized_weight(n, k):
    gen = torch.Generator().manual_seed(n + k)
    _, q, deq, pw, ps, g = make_weight(n, k, gen)
    w32 = lowbit.nvfp4_unpack(pw, ps, g, k, torch.float32)
    assert w32.shape == (n, k) and torch.equal(w32, deq)
    for dtype in (torch.bfloat16, torch.float16):  # one rounding, of the FP32 value
        assert torch.equal(lowbit.nvfp4_unpack(pw, ps, g, k, dtype), deq.to(dtype))
    torch.library.opcheck(torch.ops.lowbit.nvfp4_unpack.default, (pw, ps, g, k, torch.bfloat16))
    with pytest.raises(ValueError, match=r"'k' must be a multiple of 16 \(>= 0\), got 40"):
        lowbit.nvfp4_unpack(pw, ps, g, 40)
    with pytest.raises(ValueError, match=rf"'k' must be the K the weight was prepacked for \({k}\), got 2048"):
        lowbit.nvfp4_unpack(pw, ps, g, 2048)
    with pytest.raises(TypeError, match=r"'dtype' must be torch.float32, torch.bfloat16 or torch.float16, got Int"):
        lowbit.nvfp4_unpack(pw, ps, g, k, torch.int32)


def linear_grads(x, pw, ps, g, bias, grad_y, fp8_min_rows=0, fn=lowbit.nvfp4_linear):
    x = x.detach().requires_grad_()
    bias = bias.detach().requires_grad_()
    fn(x, pw, ps, g, bias, fp8_min_rows).backward(grad_y)
    return x.grad, bias.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_backward_is_grad_y_times_the_dequantized_weight(dtype):
    gen = torch.Generator().manual_seed(41)
    _, _, deq, pw, ps, g = make_weight(48, 400, gen)
    x = torch.randn(2, 5, 400, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    grad_y = torch.randn(2, 5, 48, generator=gen).to(dtype)
    grad_x, grad_bias = linear_grads(x, pw, ps, g, bias, grad_y)
    assert grad_x.dtype == dtype and grad_x.shape == x.shape
    # W rounded once to grad_y's dtype, the product once more (2^-9 each
    # for bf16; 2^-12 for fp16; FP32 sums).
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    assert rel_err(grad_x, grad_y.double() @ deq.double()) <= tol
    assert rel_err(grad_bias, grad_y.double().sum((0, 1))) <= tol
    # The FP8 mode's gradient goes straight through its rounding: the same.
    fp8_grad_x, _ = linear_grads(x, pw, ps, g, bias, grad_y, fp8_min_rows=1)
    assert torch.equal(fp8_grad_x, grad_x)
    # Traced by AOTAutograd (dynamic shapes): the same gradients.
    compiled = torch.compile(lowbit.nvfp4_linear, backend="aot_eager", fullgraph=True, dynamic=True)
    for got, want in zip(linear_grads(x, pw, ps, g, bias, grad_y, fn=compiled), (grad_x, grad_bias)):
        assert torch.equal(got, want)


def test_layers_before_a_frozen_nvfp4_layer_train():
    # The student's gradients pass through the NVFP4 layer's backward; the
    # target is reachable (a teacher of the same shape through that layer).
    torch.manual_seed(42)
    frozen = Nvfp4Linear.from_linear(torch.nn.Linear(64, 32))
    teacher, student = torch.nn.Linear(16, 64), torch.nn.Linear(16, 64)
    x = torch.randn(256, 16)
    with torch.no_grad():
        target = frozen(teacher(x))
    opt = torch.optim.Adam(student.parameters(), lr=3e-2)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = F.mse_loss(frozen(student(x)), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0], losses[::10]
    assert all(not b.requires_grad for b in frozen.buffers())


def test_module_roundtrip_state_dict_and_repr():
    gen = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(128, 64).to(torch.bfloat16)
    q = Nvfp4Linear.from_linear(lin)
    assert "in_features=128, out_features=64, bias=True" in repr(q) and "nvfp4" in repr(q)
    fresh = Nvfp4Linear(128, 64)
    fresh.load_state_dict(q.state_dict())
    x = torch.randn(3, 128, generator=gen).to(torch.bfloat16)
    assert torch.equal(fresh(x), q(x))
    assert set(q.state_dict()) == {"weight", "weight_scale", "weight_global", "bias"}
    moved = q.to("cpu")
    assert moved is q and torch.equal(moved(x), q(x))


def test_module_keeps_its_dtypes_through_dtype_conversions():
    layer = Nvfp4Linear.from_linear(torch.nn.Linear(64, 32).to(torch.bfloat16))
    x = torch.randn(3, 64).to(torch.bfloat16)
    want = layer(x)
    dtypes = {n: b.dtype for n, b in layer.named_buffers()}
    for convert in (lambda m: m.half(), lambda m: m.to(torch.float16), lambda m: m.float(), lambda m: m.double()):
        assert convert(layer) is layer
        assert {n: b.dtype for n, b in layer.named_buffers()} == dtypes
        assert torch.equal(layer(x), want)
    # A model converted whole after quantize_ (weight_global was cast to
    # float16, which the op rejects, before the module kept its dtypes).
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    lowbit.quantize_(model, progress=False)
    want = model(x)
    model.half()
    assert model[0].weight_global.dtype == torch.float32
    got = model(x.half())
    assert got.dtype == torch.float16
    assert rel_err(got, want) <= 2e-2  # fp16 against bf16 activations


def test_module_from_checkpoint_conventions():
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(64, 256, generator=gen) * 0.02
    qt = lowbit.nvfp4_quantize(w)
    deq = ref.dequantize(qt.packed, qt.block_scale.view(torch.uint8), qt.global_scale)
    x = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
    want = reference(x, deq)
    mo = Nvfp4Linear.from_modelopt(qt.packed, qt.block_scale, qt.global_scale)
    ct = Nvfp4Linear.from_compressed_tensors(qt.packed, qt.block_scale, 1.0 / qt.global_scale)
    assert mo.bias is None
    assert rel_err(mo(x), want) <= REL_TOL
    assert rel_err(ct(x), want) <= REL_TOL


def test_quantize_swaps_linears_in_place(capsys):
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32), torch.nn.Linear(32, 10)
    ).to(torch.bfloat16)
    x = torch.randn(4, 64).to(torch.bfloat16)
    want = model(x)
    out = lowbit.quantize_(model, lambda mod, name: name != "2")
    assert out is model
    assert isinstance(model[0], Nvfp4Linear)
    assert type(model[2]) is torch.nn.Linear  # filtered out
    assert type(model[3]) is torch.nn.Linear  # 10 outputs: not a multiple of 16
    assert "lowbit.quantize_" in capsys.readouterr().err
    got = model(x)
    assert F.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0) > 0.98


def test_quantize_leaves_linear_subclasses_with_their_own_forward():
    class Doubled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Tagged(torch.nn.Linear):  # the same math: converted
        pass

    model = torch.nn.Sequential(Doubled(64, 64), Tagged(64, 64)).to(torch.bfloat16)
    lowbit.quantize_(model, progress=False)
    assert type(model[0]) is Doubled
    assert isinstance(model[1], Nvfp4Linear)
    with pytest.raises(TypeError, match="argument 'linear' must be an nn.Linear computing x W\\^T \\+ b, got Doubled"):
        Nvfp4Linear.from_linear(Doubled(64, 64))


def test_quantize_frees_each_layer_as_it_goes(monkeypatch):
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).to(torch.bfloat16)
    originals = [weakref.ref(m) for m in model]
    alive = []  # unquantized layers alive at each conversion
    from_linear = Nvfp4Linear.from_linear

    def counting(linear):
        alive.append(sum(r() is not None for r in originals))
        return from_linear(linear)

    monkeypatch.setattr(Nvfp4Linear, "from_linear", counting)
    lowbit.quantize_(model, progress=False)
    assert alive == [4, 3, 2, 1]


def test_export_with_dynamic_batch():
    model = lowbit.quantize_(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
                             .to(torch.bfloat16), progress=False)
    x = torch.randn(5, 64).to(torch.bfloat16)
    exported = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    assert sum("lowbit.nvfp4_linear" in str(n.target) for n in exported.graph.nodes) == 2
    for m in (1, 9):
        x = torch.randn(m, 64).to(torch.bfloat16)
        assert torch.equal(exported.module()(x), model(x))


class Stack(torch.nn.Module):
    def __init__(self, dims, device="cpu", fp8_min_rows=0):
        super().__init__()
        layers = []
        for i in range(len(dims) - 1):
            lin = torch.nn.Linear(dims[i], dims[i + 1]).to(device=device, dtype=torch.bfloat16)
            layers.append(Nvfp4Linear.from_linear(lin))
            layers[-1].fp8_min_rows = fp8_min_rows
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


# Dynamo specializes sizes 0 and 1 unless told not to: backed_size_oblivious
# is torch's switch for that (serving stacks set it, or mark_unbacked), so
# one graph serves M = 1 too.
size_oblivious = torch.fx.experimental._config.patch(backed_size_oblivious=True)


@pytest.mark.parametrize("fp8_min_rows", [0, 64])
def test_compile_fullgraph_dynamic_no_recompile(fp8_min_rows):
    # With the FP8 mode from 64 rows, M crosses it inside the op: one graph.
    model = Stack([64, 128, 48, 32], fp8_min_rows=fp8_min_rows)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    with size_oblivious:
        for m in (1, 5, 64, 300, 4096):
            x = torch.randn(m, 64).to(torch.bfloat16)
            assert torch.equal(compiled(x), model(x))
    assert counter.frame_count == 1


def test_compile_inductor_fullgraph():
    model = Stack([64, 32])
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    x = torch.randn(7, 64).to(torch.bfloat16)
    assert torch.equal(compiled(x), model(x))


# ---------------------------------------------------------------- CUDA ------

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
def test_cuda_unpack_and_backward_match_cpu(dtype):
    gen = torch.Generator().manual_seed(43)
    n, k = 256, 2176
    _, _, deq, pw, ps, g = make_weight(n, k, gen)
    pw_c, ps_c, g_c = pw.cuda(), ps.cuda(), g.cuda()
    for out in (torch.float32, dtype):
        assert torch.equal(lowbit.nvfp4_unpack(pw_c, ps_c, g_c, k, out).cpu(), lowbit.nvfp4_unpack(pw, ps, g, k, out))
    bias = torch.randn(n, generator=gen).to(dtype).cuda()
    for m in (1, 16, 300, 3000):  # every forward path; one backward
        x = torch.randn(m, k, generator=gen).to(dtype).cuda()
        grad_y = torch.randn(m, n, generator=gen).to(dtype).cuda()
        grad_x, grad_bias = linear_grads(x, pw_c, ps_c, g_c, bias, grad_y)
        assert rel_err(grad_x, grad_y.double() @ deq.double().cuda()) <= 1e-2, m
        assert rel_err(grad_bias, grad_y.double().sum(0)) <= 1e-2, m


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


def _outputs_in_fresh_process(script, tmp_path, run, **knobs):
    """The outputs `script` saves for tmp_path/cases.pt, run in a new process
    with the kernel knobs (environment variables) set."""
    path = os.pathsep.join([os.path.dirname(os.path.dirname(lowbit.__file__)), os.environ.get("PYTHONPATH", "")])
    out_file = tmp_path / f"out{run}.pt"
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "cases.pt"), str(out_file)],
                   env=dict(os.environ, PYTHONPATH=path, **knobs), check=True)
    return torch.load(out_file)


# Run in a fresh process: the kernel knobs are read once per process. Each
# case runs twice (the second output checks determinism).
_STREAM_OUTPUTS = """
import sys, torch, lowbit
cases = torch.load(sys.argv[1])
outs = [[lowbit.nvfp4_linear(x.cuda(), pw.cuda(), ps.cuda(), g.cuda(), None if b is None else b.cuda()).cpu()
         for _ in range(2)] for x, pw, ps, g, b in cases]
torch.save(outs, sys.argv[2])
"""


def _check_stream_runs(tmp_path, seed, shapes, ms, knob_sets):
    """Every case of _small_m_cases(shapes, ms) in one fresh process per knob
    set: each output against the reference, repeatable, and bit for bit the
    first knob set's (the later sets must change no product nor the order
    of the sums)."""
    gen = torch.Generator().manual_seed(seed)
    cases, wants = _small_m_cases(gen, shapes, ms)
    torch.save(cases, tmp_path / "cases.pt")
    first = None
    for i, knobs in enumerate(knob_sets):
        runs = _outputs_in_fresh_process(_STREAM_OUTPUTS, tmp_path, i, **knobs)
        first = runs if first is None else first
        for (x, pw, *_), want, (y, again), (y_first, _) in zip(cases, wants, runs, first):
            assert rel_err(y, want) <= REL_TOL, (knobs, x.shape, pw.shape, x.dtype)
            assert torch.equal(y, again), (knobs, x.shape, pw.shape, x.dtype)
            assert torch.equal(y, y_first), (knobs, x.shape, pw.shape, x.dtype)


@cuda
def test_cuda_stream_kernel_every_row_pair_build(tmp_path):
    # The stream kernel is built for 1, 2 and 4 pairs of x rows (M <= 2,
    # <= 4, <= 8; Linear v17). The stream path is forced, so every build
    # runs with every warps-per-tile count (1, 2, 4 or 8, from the tile
    # counts), K split through partials (few tiles), a partial last k-tile
    # and odd M (the last pair's second row, past M, is copied from a valid
    # row and never read: Linear v20), in bf16 and fp16. Then again with a
    # forced cap (3 CTAs per SM, the probes' knob).
    shapes = [(48, 400), (1024, 2176), (16 * 2048, 1168), (16 * 1152, 1168), (4096, 7168)]
    stream = {"LOWBIT_LINEAR_PATH": "stream", "LOWBIT_STREAM_TILES": "1"}
    _check_stream_runs(tmp_path, 21, shapes, (1, 2, 3, 4, 5, 7, 8),
                       [stream, dict(stream, LOWBIT_STREAM_CTAS_PER_SM="3")])


@cuda
def test_cuda_stream_kernel_two_tiles_per_warp(tmp_path):
    # The stream kernel with two W tiles per warp (Linear v23), forced at
    # 5..16 rows: its 4-pair (M <= 8) and 8-pair builds (two m-tiles of x),
    # odd tile counts (the last warp's second tile a stand-in that is read
    # but never stored), K split through partials (65 tiles), one warp per
    # tile pair (1354 pairs), a partial last k-tile, odd M with a bias, bf16
    # and fp16. Then again capped at one CTA per SM.
    shapes = [(48, 400), (1040, 2176), (16 * 2707, 400), (16 * 1152, 1168), (4096, 7168)]
    pairs = {"LOWBIT_LINEAR_PATH": "stream", "LOWBIT_STREAM_TILES": "2"}
    _check_stream_runs(tmp_path, 23, shapes, (5, 7, 8, 9, 12, 13, 16),
                       [pairs, dict(pairs, LOWBIT_STREAM_CTAS_PER_SM="1")])


@cuda
def test_cuda_stream_kernel_eight_warp_pairs(tmp_path):
    # Two W tiles per warp in 8-warp CTAs over the whole K (the plan's at
    # 9..16 rows on some shapes, Linear v27), forced on every shape: warps
    # with no k-tile (K = 400: 4 k-tiles), runs of 1-7 k-tiles, several
    # waves (1354 pairs), odd tile counts, a partial last k-tile, odd M with
    # a bias, bf16 and fp16. Then capped at one CTA per SM (no sum changes:
    # bit for bit the same).
    shapes = [(48, 400), (1040, 2176), (16 * 2707, 400), (16 * 1152, 1168), (4096, 7168)]
    eights = {"LOWBIT_LINEAR_PATH": "stream", "LOWBIT_STREAM_TILES": "2", "LOWBIT_STREAM_WARPS": "8",
              "LOWBIT_STREAM_SPLITS": "1"}
    _check_stream_runs(tmp_path, 27, shapes, (9, 12, 13, 16),
                       [eights, dict(eights, LOWBIT_STREAM_CTAS_PER_SM="1")])


@cuda
def test_cuda_stream_kernel_ring_slots(tmp_path):
    # The stream kernel's rings of 2 and 3 slots (Linear v25; the plan takes
    # 2 for short runs), each forced on every row-pair build and on two tiles
    # per warp: runs of 1-4 k-tiles (K = 400, split K), long runs (4096 x
    # 7168), a partial last k-tile, odd M with a bias, bf16 and fp16. The
    # slots change no product nor the order of the sums: bit for bit equal.
    shapes = [(48, 400), (1040, 2176), (16 * 1152, 1168), (4096, 7168)]
    for tiles, ms in (("1", (1, 3, 4, 8)), ("2", (5, 9, 16))):
        stream = {"LOWBIT_LINEAR_PATH": "stream", "LOWBIT_STREAM_TILES": tiles}
        _check_stream_runs(tmp_path, 31, shapes, ms,
                           [dict(stream, LOWBIT_STREAM_STAGES="3"), dict(stream, LOWBIT_STREAM_STAGES="2")])


# Each case eagerly twice, then captured in a CUDA graph and replayed three
# times (the stream-K kernel's flags must be back at zero after every
# launch, whatever launch id the replay carries).
_GRAPH_OUTPUTS = """
import sys, torch, lowbit
cases = torch.load(sys.argv[1])
outs = []
for x, pw, ps, g, b in cases:
    args = [t if t is None else t.cuda() for t in (x, pw, ps, g, b)]
    eager = [lowbit.nvfp4_linear(*args).cpu() for _ in range(2)]
    graph = torch.cuda.CUDAGraph()
    lowbit.nvfp4_linear(*args)  # warm-up outside the capture
    with torch.cuda.graph(graph):
        y = lowbit.nvfp4_linear(*args)
    replays = []
    for _ in range(3):
        y.zero_()
        graph.replay()
        replays.append(y.cpu())
    outs.append(eager + replays)
torch.save(outs, sys.argv[2])
"""


@cuda
def test_cuda_stream_k_kernel(tmp_path):
    # The stream-K kernel (LOWBIT_STREAM_K=1 forces it wherever it can run:
    # M <= 8 and warps per tile <= k-tiles) cuts the (tile, k-tile) units
    # into one run per CTA. Shapes where a run holds several whole tiles and
    # pieces (4096 x 7168), where runs are shorter than a tile so a tile has
    # many pieces (N = 48, K = 7168: 168 units on as many CTAs, one unit
    # each), a partial last k-tile (K = 1168), odd M, bias, bf16 and fp16;
    # then with one CTA per SM (longer runs, other cuts). Every output
    # matches the reference, is the same on a second call, and the same in
    # three CUDA graph replays (deterministic: pieces added in k order).
    gen = torch.Generator().manual_seed(23)
    cases, wants = _small_m_cases(gen, [(48, 7168), (16 * 1152, 1168), (4096, 7168), (7168, 2048)], (1, 3, 4, 5, 8))
    torch.save(cases, tmp_path / "cases.pt")
    for i, extra in enumerate([{}, {"LOWBIT_STREAM_CTAS_PER_SM": "1"}]):
        runs = _outputs_in_fresh_process(_GRAPH_OUTPUTS, tmp_path, i, LOWBIT_STREAM_K="1", **extra)
        for (x, pw, *_), want, outs in zip(cases, wants, runs):
            assert rel_err(outs[0], want) <= REL_TOL, (extra, x.shape, pw.shape, x.dtype)
            for y in outs[1:]:
                assert torch.equal(y, outs[0]), (extra, x.shape, pw.shape, x.dtype)


@cuda
def test_cuda_prepack_matches_cpu_bitwise():
    gen = torch.Generator().manual_seed(9)
    q = lowbit.nvfp4_quantize(torch.randn(96, 400, generator=gen))
    codes = q.block_scale.view(torch.uint8).clone()
    codes[0, 0], codes[1, 1], codes[2, 2] = 0x00, codes[1, 1] | 0x80, 0x03
    want = lowbit.nvfp4_prepack(q.packed, codes)
    got = lowbit.nvfp4_prepack(q.packed.cuda(), codes.cuda())
    assert torch.equal(got.weight.cpu(), want.weight) and torch.equal(got.scale.cpu(), want.scale)


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
def test_cuda_module_and_empty_and_cosine():
    gen = torch.Generator().manual_seed(11)
    lin = torch.nn.Linear(1024, 512).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(512, 1024, generator=gen))
    q = Nvfp4Linear.from_linear(lin).to("cuda")
    lin = lin.cuda()
    for m in (1, 16, 4096):
        x = torch.randn(m, 1024, generator=gen).to(torch.bfloat16).cuda()
        cos = F.cosine_similarity(q(x).float().flatten(), lin(x).float().flatten(), dim=0)
        assert cos >= 0.99
    assert q(torch.empty(0, 1024, device="cuda", dtype=torch.bfloat16)).shape == (0, 512)
    check_k_zero("cuda")
    # CPU prepack, moved to the GPU, gives the CPU reference's answer
    x = torch.randn(3, 1024, generator=gen).to(torch.bfloat16)
    assert rel_err(q(x.cuda()).cpu(), q.to("cpu")(x).float()) <= REL_TOL


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
@pytest.mark.parametrize("n,k", [(48, 1168), (4096, 2048), (1024, 7168)])
def test_cuda_fp8_mode_matches_cpu(dtype, n, k):
    # The FP8 mode on the GPU (E4M3 rows by lowbit's kernels, cuBLASLt's FP8
    # GEMM) against the CPU kernel, its reference: the same codes and
    # scales, so only the order of the FP32 sums and the output's rounding
    # differ. K = 1168 leaves the last k-tile partial (its padding blocks
    # must not enter a row's amax). Odd M with a bias; fresh data per M.
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
@pytest.mark.parametrize(
    "fp8_min_rows,ms,graph_ms",
    [(0, (1, 7, 64, 65, 4096), (4, 4, 4, 32, 32, 32)), (64, (1, 63, 64, 300, 4096), (300, 300, 300))],
)
def test_cuda_compile_no_recompile_and_reduce_overhead_bitwise(fp8_min_rows, ms, graph_ms):
    # One graph across M (with the FP8 mode from 64 rows: as M crosses it
    # too), and CUDA graphs bitwise the eager result.
    model = Stack([1024, 2048, 512], device="cuda", fp8_min_rows=fp8_min_rows)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    with size_oblivious:
        for m in ms:
            x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(compiled(x), model(x))
    assert counter.frame_count == 1
    torch._dynamo.reset()
    graphed = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for m in graph_ms:
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(graphed(x), model(x))


@cuda
def test_cuda_no_host_sync_in_forward():
    models = [Stack([512, 256, 256], device="cuda"), Stack([512, 256, 256], device="cuda", fp8_min_rows=100)]
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


# ------------------------------------------------------- grouped Linear ----

def grouped_reference(x, deq, n_groups):
    """x [..., G, K] times the dequantized [G N, K] weight's diagonal blocks, in float64."""
    w = deq.double().view(n_groups, -1, deq.shape[-1])
    return torch.einsum("...gk,gnk->...gn", x.double(), w)


# (G, N per group, K, lead shapes): the wgmma kernel's shapes (N and K
# multiples of 128) at one token tile, several, K split, and past 2048
# tokens; and shapes it does not take (the unpack + bmm form on CUDA).
GROUPED_CASES = [
    (2, 128, 256, [(1,), (5,), (3, 100)]),
    (4, 256, 1024, [(257,), (2500,)]),
    (8, 128, 128, [(33,)]),
    (2, 48, 144, [(7,), (2, 3)]),
    (3, 128, 176, [(40,)]),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("n_groups,n,k,leads", GROUPED_CASES)
def test_grouped_linear_matches_reference(device, n_groups, n, k, leads):
    gen = torch.Generator().manual_seed(n_groups * 1000 + n + k)
    _, _, deq, pw, ps, g = make_weight(n_groups * n, k, gen, device)
    for lead in leads:
        if device == "cpu" and lead[0] > 1000:
            continue  # the CPU reference at 2500 tokens is slow and adds nothing
        x = torch.randn(*lead, n_groups, k, generator=gen).to(torch.bfloat16)
        y = lowbit.nvfp4_grouped_linear(x.to(device), pw, ps, g, n_groups)
        assert y.shape == (*lead, n_groups, n) and y.dtype == torch.bfloat16 and y.device.type == device
        assert y.is_contiguous()  # as the Meta kernel says: compiled code reads it by those strides
        assert rel_err(y.cpu(), grouped_reference(x, deq, n_groups)) <= REL_TOL, (lead, rel_err(y.cpu(), grouped_reference(x, deq, n_groups)))


@pytest.mark.cuda
def test_grouped_linear_cuda_fp16_empty_and_graph():
    gen = torch.Generator().manual_seed(3)
    _, _, deq, pw, ps, g = make_weight(4 * 128, 256, gen, "cuda")
    x = torch.randn(300, 4, 256, generator=gen).to(torch.float16)
    y = lowbit.nvfp4_grouped_linear(x.cuda(), pw, ps, g, 4)
    assert y.dtype == torch.float16 and rel_err(y.cpu(), grouped_reference(x, deq, 4)) <= REL_TOL
    assert lowbit.nvfp4_grouped_linear(x[:0].cuda(), pw, ps, g, 4).shape == (0, 4, 128)
    xb = x.to(torch.bfloat16).cuda()
    eager = lowbit.nvfp4_grouped_linear(xb, pw, ps, g, 4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = lowbit.nvfp4_grouped_linear(xb, pw, ps, g, 4)
    graph.replay()
    assert torch.equal(captured, eager)


def test_grouped_linear_opcheck_grad_compile_and_bad_input():
    gen = torch.Generator().manual_seed(4)
    _, _, deq, pw, ps, g = make_weight(2 * 48, 144, gen)
    x = torch.randn(5, 2, 144, generator=gen).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.lowbit.nvfp4_grouped_linear.default, (x, pw, ps, g, 2))
    xg = x.float().requires_grad_()
    lowbit.nvfp4_grouped_linear(xg, pw, ps, g, 2).sum().backward()
    want = deq.view(2, 48, 144).sum(1)  # d/dx of sum_n x_g . w_gn
    torch.testing.assert_close(xg.grad, want.expand_as(xg), rtol=1e-5, atol=1e-6)
    compiled = torch.compile(lambda x: lowbit.nvfp4_grouped_linear(x, pw, ps, g, 2), fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x), lowbit.nvfp4_grouped_linear(x, pw, ps, g, 2))
    with pytest.raises(ValueError, match=r"argument 'x' must have shape \[\.\.\., n_groups \(3\), K\]"):
        lowbit.nvfp4_grouped_linear(x, pw, ps, g, 3)
    with pytest.raises(ValueError, match="argument 'n_groups' must be >= 1"):
        lowbit.nvfp4_grouped_linear(x, pw, ps, g, 0)
    _, _, _, pw3, ps3, g3 = make_weight(3 * 16, 144, gen)
    x3 = torch.randn(2, 4, 144).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"argument 'weight' must have n_groups \(4\) blocks of rows"):
        lowbit.nvfp4_grouped_linear(x3, pw3, ps3, g3, 4)


# ------------------------------------------- no bias, K, dtypes, export ----

def test_backward_without_bias_eager_compiled_and_opcheck():
    # The call every quantize_'d layer without a bias makes: bias and
    # fp8_min_rows left at their defaults.
    gen = torch.Generator().manual_seed(51)
    _, _, deq, pw, ps, g = make_weight(32, 144, gen)
    x = torch.randn(3, 144, generator=gen).to(torch.bfloat16)
    grad_y = torch.randn(3, 32, generator=gen).to(torch.bfloat16)

    def grad_x(fn):
        xg = x.detach().requires_grad_()
        fn(xg, pw, ps, g).backward(grad_y)
        return xg.grad

    eager = grad_x(lowbit.nvfp4_linear)
    assert rel_err(eager, grad_y.double() @ deq.double()) <= 1e-2
    compiled = torch.compile(lowbit.nvfp4_linear, backend="aot_eager", fullgraph=True, dynamic=True)
    assert torch.equal(grad_x(compiled), eager)
    torch.library.opcheck(torch.ops.lowbit.nvfp4_linear.default, (x.detach().requires_grad_(), pw, ps, g))
    # A layer without a bias trains the layers before it.
    frozen = Nvfp4Linear.from_linear(torch.nn.Linear(144, 32, bias=False).to(torch.bfloat16))
    before = torch.nn.Linear(16, 144).to(torch.bfloat16)
    frozen(before(torch.randn(4, 16).to(torch.bfloat16))).sum().backward()
    assert before.weight.grad is not None and before.weight.grad.abs().sum() > 0


def test_prepacked_weight_records_k():
    gen = torch.Generator().manual_seed(52)
    _, q, _, pw, ps, g = make_weight(32, 64, gen)
    x48 = torch.randn(4, 48, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"lowbit.nvfp4_linear: argument 'x' must have K = 64 columns \(the K "
                                         r"'weight' and 'weight_scale' were prepacked for\), got shape \[4, 48\]$"):
        lowbit.nvfp4_linear(x48, pw, ps, g)
    meta = [t.to("meta") for t in (x48, pw, ps, g)]
    with pytest.raises(ValueError, match=r"argument 'x' must have K = 64 columns"):
        torch.ops.lowbit.nvfp4_linear(*meta)
    with pytest.raises(ValueError, match=r"argument 'k' must be the K the weight was prepacked for \(64\), got 48"):
        lowbit.nvfp4_unpack(pw, ps, g, 48)
    with pytest.raises(ValueError, match=r"argument 'k' must be the K the weight was prepacked for \(64\), got 48"):
        lowbit.nvfp4_unprepack(pw, ps, 48)
    # The grouped Linear: 2 groups of 16 rows.
    with pytest.raises(ValueError, match=r"lowbit.nvfp4_grouped_linear: argument 'x' must have K = 64 columns"):
        lowbit.nvfp4_grouped_linear(torch.randn(5, 2, 48).to(torch.bfloat16), pw, ps, g, 2)
    # The modules.
    layer = Nvfp4Linear.from_checkpoint(q.packed, q.block_scale, q.global_scale)
    with pytest.raises(ValueError, match=r"Nvfp4Linear: argument 'x' must have 64 features \(its last dimension\), "
                                         r"got shape \[4, 48\]"):
        layer(x48)
    with pytest.raises(RuntimeError, match=r"size mismatch for weight_scale"):
        Nvfp4Linear(128, 32, bias=False).load_state_dict(layer.state_dict())
    with pytest.raises(RuntimeError, match=r"size mismatch for weight_scale"):
        Nvfp4Linear(48, 32, bias=False).load_state_dict(layer.state_dict())
    grouped = lowbit.nn.Nvfp4GroupedLinear.from_checkpoint(2, q.packed, q.block_scale, q.global_scale)
    with pytest.raises(RuntimeError, match=r"size mismatch for linear.weight_scale"):
        lowbit.nn.Nvfp4GroupedLinear(128, 16, 2).load_state_dict(grouped.state_dict())


def test_module_loads_a_state_dict_of_the_format_without_k():
    # Earlier prepacked scales [N, Kp/16] did not record K: a layer converts
    # them when it loads (it knows its K).
    gen = torch.Generator().manual_seed(53)
    layer = Nvfp4Linear.from_linear(torch.nn.Linear(48, 32).to(torch.bfloat16))
    state = layer.state_dict()
    old = dict(state)
    old["weight_scale"] = state["weight_scale"].flatten()[: 32 * 8].view(32, 8).clone()
    old = type(state)(old)
    old._metadata = {"": {"version": 1}}
    fresh = Nvfp4Linear(48, 32)
    fresh.load_state_dict(old)
    assert torch.equal(fresh.weight_scale, layer.weight_scale)
    x = torch.randn(3, 48, generator=gen).to(torch.bfloat16)
    assert torch.equal(fresh(x), layer(x))
    # Without metadata (a state dict rebuilt from a plain dict) as well.
    fresh = Nvfp4Linear(48, 32)
    fresh.load_state_dict({k: v for k, v in old.items()})
    assert torch.equal(fresh(x), layer(x))


def test_from_modelopt_names_bad_tensors():
    gen = torch.Generator().manual_seed(54)
    q = lowbit.nvfp4_quantize(torch.randn(32, 64, generator=gen))
    with pytest.raises(ValueError, match=r"Nvfp4Linear.from_modelopt: argument 'weight_scale_2' must hold one value "
                                         r"\(shape \[\] or \[1\]\), got shape \[2\]"):
        Nvfp4Linear.from_modelopt(q.packed, q.block_scale, q.global_scale.reshape(1).repeat(2))
    with pytest.raises(ValueError, match=r"Nvfp4Linear.from_modelopt: argument 'bias' must have shape \[32\], "
                                         r"got \[16\]"):
        Nvfp4Linear.from_modelopt(q.packed, q.block_scale, q.global_scale, torch.zeros(16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"Nvfp4Linear.from_modelopt: argument 'weight' must be 2-D \[N, K/2\], "
                                         r"got shape \[2, 16, 32\]"):
        Nvfp4Linear.from_modelopt(q.packed.view(2, 16, 32), q.block_scale, q.global_scale)
    with pytest.raises(ValueError, match=r"Nvfp4Linear.from_modelopt: argument 'weight_scale' must have shape "
                                         r"\[32, 4\], got \[32, 2\]"):
        Nvfp4Linear.from_modelopt(q.packed, q.block_scale[:, :2], q.global_scale)
    with pytest.raises(ValueError, match=r"from_compressed_tensors: argument 'weight_global_scale' must hold one"):
        Nvfp4Linear.from_compressed_tensors(q.packed, q.block_scale, torch.ones(2))


def test_grouped_module_exports_one_graph_for_every_token_count():
    # Decode (few rows: one nvfp4_linear over all groups on CUDA) and
    # prefill (nvfp4_grouped_linear's own kernel) in one exported graph.
    gen = torch.Generator().manual_seed(55)
    q = lowbit.nvfp4_quantize(torch.randn(2 * 32, 64, generator=gen) * 0.02)
    mod = lowbit.nn.Nvfp4GroupedLinear.from_checkpoint(2, q.packed, q.block_scale, q.global_scale)
    limit = mod.max_fused_rows // 2  # tokens of 2 rows each
    x = torch.randn(5, 2, 64, generator=gen).to(torch.bfloat16)
    exported = torch.export.export(mod, (x,), dynamic_shapes=({0: torch.export.Dim("tokens", max=4096)},))
    for tokens in (1, 3, limit, limit + 1, 3 * limit):
        x = torch.randn(tokens, 2, 64, generator=gen).to(torch.bfloat16)
        assert torch.equal(exported.module()(x), mod(x)), tokens


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
