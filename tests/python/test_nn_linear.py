"""lowbit.nn.Nvfp4Linear and lowbit.quantize_: construction (from_linear,
from_modelopt, from_compressed_tensors), state dicts, dtype conversions,
the FP8 mode's setting."""

import weakref

import pytest
import torch
import torch.nn.functional as F

import lowbit
import nvfp4_reference as ref
from linear_reference import FP8_MODE_TOL, REL_TOL, check_k_zero, reference, rel_err
from lowbit.nn import Nvfp4Linear


cuda = pytest.mark.cuda


def test_deprecated_fp8_min_rows_maps_to_compute():
    # fp8_min_rows (module attribute, constructor, quantize_) still works,
    # with a DeprecationWarning: n is compute="auto" from n rows, 0 "w4a16".
    gen = torch.Generator().manual_seed(32)
    lin = torch.nn.Linear(128, 64).to(torch.bfloat16)
    q = Nvfp4Linear.from_linear(lin)
    assert q.compute == "w4a16" and q.weight_fp8 is None and "compute" not in repr(q)
    x = torch.randn(8, 128, generator=gen).to(torch.bfloat16)
    w4 = q(x)
    with pytest.deprecated_call(match="fp8_min_rows is deprecated"):
        q.fp8_min_rows = 8
    assert q.compute == "auto" and "compute=auto (FP8 from 8 rows)" in repr(q)
    assert q.weight_fp8 is not None  # made when set, not per call
    with pytest.deprecated_call():
        assert q.fp8_min_rows == 8
    for bad in (-1, 1.5, True):  # checked when set, not at the next forward
        with pytest.deprecated_call(), pytest.raises(ValueError, match=r"fp8_min_rows must be an int >= 0"):
            q.fp8_min_rows = bad
    assert q.compute == "auto"
    model = torch.nn.Sequential(torch.nn.Linear(128, 64))
    with pytest.deprecated_call(), pytest.raises(ValueError, match=r"quantize_: fp8_min_rows must be an int >= 0"):
        lowbit.quantize_(model, fp8_min_rows=-1, progress=False)
    assert type(model[0]) is torch.nn.Linear  # untouched
    with pytest.raises(ValueError, match=r"quantize_: pass compute or the deprecated fp8_min_rows, not both"):
        with pytest.deprecated_call():
            lowbit.quantize_(model, fp8_min_rows=8, compute="fp8", progress=False)
    assert set(q.state_dict()) == {"weight", "weight_scale", "weight_global", "bias"}
    y = q(x)
    assert not torch.equal(y, w4) and rel_err(y, w4) <= FP8_MODE_TOL
    assert torch.equal(q(x[:7]), w4[:7])
    # The same numbers as the op's per-call FP8 mode from 8 rows.
    assert torch.equal(y, lowbit.nvfp4_linear(x, q.weight, q.weight_scale, q.weight_global, q.bias, 8))
    with pytest.deprecated_call():
        q.fp8_min_rows = 0
    assert q.compute == "w4a16" and q.weight_fp8 is None and torch.equal(q(x), w4)
    with pytest.deprecated_call():
        model = lowbit.quantize_(torch.nn.Sequential(torch.nn.Linear(128, 64)).to(torch.bfloat16), progress=False,
                                 fp8_min_rows=1024)
    assert model[0].compute == "auto" and model[0]._fp8_rows == 1024
    with pytest.deprecated_call(), pytest.raises(ValueError, match=r"fp8_min_rows must be an int >= 0"):
        Nvfp4Linear(128, 64, fp8_min_rows=-1)
    with pytest.deprecated_call():
        assert Nvfp4Linear(128, 64, fp8_min_rows=16).compute == "auto"


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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_module_follows_autocast_as_nn_linear_does(device):
    # Under torch.autocast nn.Linear computes in the autocast dtype; so does
    # Nvfp4Linear (an FP32 x would otherwise take the reference path on a
    # GPU). Outside autocast it keeps x's dtype.
    gen = torch.Generator().manual_seed(31)
    lin = torch.nn.Linear(128, 64).to(device, torch.bfloat16)
    q = Nvfp4Linear.from_linear(lin)
    x = torch.randn(5, 128, generator=gen).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = q(x)
        assert lin(x).dtype == got.dtype == torch.bfloat16
    assert torch.equal(got, q(x.to(torch.bfloat16)))
    assert q(x).dtype == torch.float32
