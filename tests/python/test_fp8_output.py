"""FP8 output into the next layer (Fp8Linear(fp8_output=True),
lowbit.Fp8Activation, the forward op's x_scale / fp8_out): without grad the
hand-over is bitwise the unfused pair; with grad a clear error; torch.compile
fullgraph; opcheck; bad inputs."""

import copy

import pytest
import torch

import lowbit
from lowbit import Fp8Activation
from lowbit.fp8 import Fp8Recipe
from lowbit.nn import Fp8Linear
from test_fp8_linear import OPCHECK_UTILS
from test_fp8_weight_cache import same
from test_nn_fp8_linear import GraphRecorder, lowbit_ops

STATELESS = ["tensorwise", "rowwise", "blockwise"]


def pair(recipe, k=160, h=272, n=96, cache_weight=False):
    torch.manual_seed(3)
    first = Fp8Linear(k, h, recipe=recipe, fp8_output=True, cache_weight=cache_weight, dtype=torch.bfloat16)
    second = Fp8Linear(h, n, recipe=recipe, cache_weight=cache_weight, dtype=torch.bfloat16)
    plain = Fp8Linear(k, h, recipe=recipe, dtype=torch.bfloat16)
    plain.load_state_dict(first.state_dict())
    return first, second, plain


@pytest.mark.parametrize("recipe", STATELESS)
def test_handover_bitwise_equal_to_the_unfused_pair(recipe):
    first, second, plain = pair(recipe)
    x = torch.randn(3, 50, 160).to(torch.bfloat16)
    with torch.no_grad():
        act = first(x)
        assert isinstance(act, Fp8Activation)
        assert act.data.dtype == torch.float8_e4m3fn and act.data.shape == (3, 50, 272)
        assert act.dtype == torch.bfloat16 and act.scaling == lowbit.fp8.activation_scaling(first.recipe)
        y_plain = plain(x)
        # The codes are those the next layer's own cast of y gives.
        want = lowbit.fp8_cast(y_plain.reshape(-1, 272), act.scaling)
        assert same(act.data.reshape(-1, 272), want.data) and same(act.scale, want.scale)
        rel = (act.dequantize().float() - y_plain.float()).norm() / y_plain.float().norm()
        assert rel < 0.05
        assert same(second(act), second(y_plain))


def test_delayed_handover_uses_current_scaling_and_leaves_the_x_row():
    recipe = Fp8Recipe("delayed", amax_history_len=4)
    first, second, plain = pair(recipe)
    x = torch.randn(40, 160).to(torch.bfloat16)
    with torch.no_grad():
        act = first(x)
        y_plain = plain(x)
        assert act.scaling == "tensor"
        assert torch.equal(act.scale, lowbit.fp8_cast(y_plain, "tensor").scale)
        y = second(act)
    h = second.fp8_state
    assert not h[0].any() and h[1, 0] == second.weight.float().abs().amax()  # x row untouched, W row recorded
    want = torch.nn.functional.linear(y_plain.float(), second.weight.float(), second.bias.float())
    assert ((y.float() - want).norm() / want.norm()) < 0.08


def test_handover_with_the_weight_cache():
    first, second, _ = pair("rowwise", cache_weight=True)
    x = torch.randn(40, 160).to(torch.bfloat16)
    with torch.no_grad():
        a = second(first(x, is_first_microbatch=True), is_first_microbatch=True)
        b = second(first(x, is_first_microbatch=False), is_first_microbatch=False)
        c = second(first(x))
    assert same(a, b) and same(a, c)


def test_with_grad_a_clear_error():
    first, second, _ = pair("tensorwise")
    x = torch.randn(8, 160).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"fp8_output=True carries no gradient.*torch.no_grad\(\)"):
        first(x)
    with torch.no_grad():
        act = first(x)
    with pytest.raises(RuntimeError, match=r"an FP8 input \(Fp8Activation\) carries no gradient"):
        second(act)
    # Frozen layers need no gradient: fine with grad mode on.
    for p in list(first.parameters()) + list(second.parameters()):
        p.requires_grad_(False)
    assert second(first(x)).shape == (8, 96)


def test_scaling_mismatch_and_bad_inputs():
    first, _, _ = pair("rowwise")
    other = Fp8Linear(272, 96, recipe="tensorwise", dtype=torch.bfloat16)
    x = torch.randn(8, 160).to(torch.bfloat16)
    with torch.no_grad():
        act = first(x)
        with pytest.raises(ValueError, match=r"FP8 input is scaled 'row', but recipe 'tensorwise' takes 'tensor'"):
            other(act)
    fwd = torch.ops.lowbit.fp8_linear_forward
    w, state = other.weight, other.fp8_state
    data = torch.zeros(8, 272, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"'out_dtype' must be given when 'x' is FP8"):
        fwd(data, w, None, state, "tensorwise", save_x_t=False, x_scale=torch.ones(()))
    rowwise_x = torch.zeros(8, 160, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scaled per row or block has no transposed copy for the weight gradient: "
                                         r"save_x_t must be False"):
        fwd(rowwise_x, first.weight, None, first.fp8_state, "rowwise", x_scale=torch.ones(8), out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"scaled per row or block has no transposed copy for the input gradient: "
                                         r"save_w_t must be False"):
        fwd(x, first.weight, None, first.fp8_state, "rowwise", save_x_t=False,
            w_fp8=torch.zeros(272, 160, dtype=torch.float8_e4m3fn), w_fp8_scale=torch.ones(272))
    with pytest.raises(ValueError, match=r"argument 'x_scale' must have shape \[\]"):
        fwd(data, w, None, state, "tensorwise", save_x_t=False, x_scale=torch.ones(8), out_dtype=torch.bfloat16)


def fp8_operand(rows, cols, gen, device="cpu"):
    """Random E4M3 codes (every byte pattern but NaN) and a tensor scale."""
    codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x11
    return codes.view(torch.float8_e4m3fn).to(device), (torch.rand((), generator=gen) + 0.5).to(device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("m, k", [(8, 272), (130, 48), (64, 64), (37, 300), (1, 16), (0, 32)])
def test_fp8_operands_give_their_codes_transposed(device, m, k):
    # One scale for the tensor (tensorwise, delayed): an x or W given in FP8
    # gets its transposed copy for the backward as its codes transposed,
    # under the same scale (the x all-gathered in FP8 by lowbit.fp8_parallel
    # and the FP8-gathered weights of FSDP2). Odd shapes take the CUDA
    # kernel's byte path, multiples of 16 its 16-byte path.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(m * 1000 + k)
    n = 96
    xd, xs = fp8_operand(m, k, gen, device)
    wd, ws = fp8_operand(n, k, gen, device)
    weight = torch.randn(n, k, generator=gen).to(device, torch.bfloat16)  # not read: W is given in FP8
    state = lowbit.fp8_state(Fp8Recipe("tensorwise"), device)
    y, x_t, x_t_scale, w_t, w_t_scale, _ = torch.ops.lowbit.fp8_linear_forward(
        xd, weight, None, state, "tensorwise", x_scale=xs, out_dtype=torch.bfloat16, w_fp8=wd, w_fp8_scale=ws)
    assert torch.equal(x_t.view(torch.uint8).cpu(), xd.view(torch.uint8).cpu().t())
    assert torch.equal(w_t.view(torch.uint8).cpu(), wd.view(torch.uint8).cpu().t())
    assert x_t.is_contiguous() and w_t.is_contiguous()
    assert x_t_scale.item() == xs.item() and w_t_scale.item() == ws.item()
    want = ((xd.double() * xs.double()) @ (wd.double() * ws.double()).t()).to(torch.bfloat16)
    scale = want.abs().amax().item() if want.numel() else 1.0
    torch.testing.assert_close(y.cpu(), want.cpu(), rtol=1e-2, atol=1e-2 * max(1.0, scale))
    if device == "cpu" and m:  # the schema: no output aliases an input (the scales are copies)
        torch.library.opcheck(torch.ops.lowbit.fp8_linear_forward.default, (xd, weight, None, state, "tensorwise"),
                              dict(x_scale=xs, out_dtype=torch.bfloat16, w_fp8=wd, w_fp8_scale=ws),
                              test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_opcheck(recipe):
    recipe = Fp8Recipe(recipe)
    torch.manual_seed(0)
    w = (torch.randn(160, 272) * 0.1).to(torch.bfloat16)
    state = lowbit.fp8_state(recipe)
    x = torch.randn(40, 272).to(torch.bfloat16)
    act = lowbit.fp8_cast(x, lowbit.fp8.activation_scaling(recipe))
    fwd = torch.ops.lowbit.fp8_linear_forward.default
    torch.library.opcheck(fwd, (act.data, w, None, state, recipe.name),
                          dict(save_x_t=False, save_w_t=False, x_scale=act.scale, out_dtype=torch.bfloat16,
                               fp8_out=True), test_utils=OPCHECK_UTILS)
    torch.library.opcheck(fwd, (x, w, None, state, recipe.name), dict(fp8_out=True), test_utils=OPCHECK_UTILS)


class Chain(torch.nn.Module):
    def __init__(self, recipe):
        super().__init__()
        self.a, self.b, _ = pair(recipe)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("recipe", STATELESS)
def test_compile_fullgraph_no_grad(recipe):
    model = Chain(recipe)
    eager = copy.deepcopy(model)
    recorder = GraphRecorder()
    compiled = torch.compile(model, backend=recorder.backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for m in (33, 150):
            x = torch.randn(m, 160).to(torch.bfloat16)
            assert same(compiled(x), eager(x))
    assert all(lowbit_ops(g) == ["lowbit::fp8_linear_forward"] * 2 for g in recorder.forward)
