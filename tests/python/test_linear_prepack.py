"""nvfp4_prepack, nvfp4_unpack and the prepacked weight's format: shapes,
padding, special block scales, the K it records (helpers: linear_reference.py)."""

import pytest
import torch

import lowbit
import nvfp4_reference as ref
from linear_reference import make_weight
from lowbit.nn import Nvfp4Linear


cuda = pytest.mark.cuda


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


@cuda
def test_cuda_prepack_matches_cpu_bitwise():
    gen = torch.Generator().manual_seed(9)
    q = lowbit.nvfp4_quantize(torch.randn(96, 400, generator=gen))
    codes = q.block_scale.view(torch.uint8).clone()
    codes[0, 0], codes[1, 1], codes[2, 2] = 0x00, codes[1, 1] | 0x80, 0x03
    want = lowbit.nvfp4_prepack(q.packed, codes)
    got = lowbit.nvfp4_prepack(q.packed.cuda(), codes.cuda())
    assert torch.equal(got.weight.cpu(), want.weight) and torch.equal(got.scale.cpu(), want.scale)
