"""Fp8Linear's eager fallback: configurations the FP8 ops do not model run
as nn.Linear, with one warning per layer and reason that says why, and
under torch.compile as a graph break (fullgraph: an error naming the
reason), never a tracing error deep in the op."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from lowbit.nn import Fp8Linear
from lowbit.nn import fp8_linear as fp8_linear_module


def layer(recipe="tensorwise", dtype=torch.bfloat16):
    torch.manual_seed(0)
    return Fp8Linear(64, 32, recipe=recipe, dtype=dtype)


def reference(mod, x):
    dt = torch.promote_types(x.dtype, mod.weight.dtype)
    return F.linear(x.to(dt), mod.weight.to(dt), mod.bias.to(dt)).to(x.dtype)


def fallback_warnings(record):
    return [str(w.message) for w in record if "runs eagerly in high precision" in str(w.message)]


def test_float64_input_warns_once_and_matches_nn_linear():
    mod = layer()
    x = torch.randn(5, 64, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        y = mod(x)
        mod(x)
    msgs = fallback_warnings(record)
    assert len(msgs) == 1 and "x has dtype torch.float64" in msgs[0] and "Fp8Linear(64 -> 32)" in msgs[0]
    assert y.dtype == torch.float64 and torch.equal(y, reference(mod, x))
    y.sum().backward()  # differentiable, as nn.Linear
    assert x.grad is not None and mod.weight.grad is not None
    # Another layer warns on its own.
    with pytest.warns(RuntimeWarning, match="runs eagerly"):
        layer()(x)


def test_weight_dtype():
    mod = layer(dtype=torch.float64)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match=r"weight has dtype torch.float64"):
        y = mod(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, reference(mod, x))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_non_floating_input_is_an_error(dtype):
    # nn.Linear refuses these; a fallback must not compute and round back
    # into them (int32 x gave int32 zeros before).
    mod = layer()
    with pytest.raises(ValueError, match=rf"argument 'x' must be a floating-point tensor, got dtype {dtype}"):
        mod(torch.ones(3, 64, dtype=dtype))


class Tagged(torch.Tensor):
    pass


def test_tensor_subclass():
    mod = layer()
    x = torch.randn(3, 64).to(torch.bfloat16).as_subclass(Tagged)
    with pytest.warns(RuntimeWarning, match=r"x is a Tagged, a tensor subclass"):
        y = mod(x)
    assert torch.equal(y.as_subclass(torch.Tensor), reference(mod, x.as_subclass(torch.Tensor)))


def test_vmap():
    mod = layer("rowwise")
    x = torch.randn(4, 3, 64).to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match=r"torch.func transform"):
        y = torch.func.vmap(mod)(x)
    assert torch.equal(y, torch.func.vmap(lambda v: reference(mod, v))(x))


def test_forward_mode_ad():
    import torch.autograd.forward_ad as fwAD

    mod = layer(dtype=torch.float32)
    x, t = torch.randn(3, 64), torch.randn(3, 64)
    with fwAD.dual_level():
        with pytest.warns(RuntimeWarning, match=r"forward-mode AD"):
            y = mod(fwAD.make_dual(x, t))
        tangent = fwAD.unpack_dual(y).tangent
    torch.testing.assert_close(tangent, t @ mod.weight.detach().T)


def test_gpu_capability_reason(monkeypatch):
    check = fp8_linear_module._capability_reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 0))
    assert "compute capability 8.0; the FP8 ops run on 9.0" in check(0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    assert check(0) is None


def test_capability_check_traces_without_warnings(monkeypatch):
    # Dynamo evaluates the check once at trace time (assume_constant_result)
    # and warns about nothing, e.g. not about a functools.lru_cache wrapper.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(fp8_linear_module, "_CAPABILITY_REASONS", {})

    def f(x):
        return x + 1 if fp8_linear_module._gpu_unsupported(0) is None else x - 1

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2))
    assert torch.equal(y, torch.full((2,), 2.0))


def test_supported_inputs_take_the_ops():
    mod = layer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mod(torch.randn(3, 64).to(torch.bfloat16))
        mod(torch.randn(3, 64, dtype=torch.float16))
        with torch.inference_mode():
            mod(torch.randn(3, 64))


def test_compile_graph_break_runs_eagerly_and_fullgraph_names_the_reason():
    mod = layer()
    x = torch.randn(5, 64, dtype=torch.float64)
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match=r"x has dtype torch.float64"):
        y = torch.compile(mod, backend="aot_eager")(x)
    assert torch.equal(y, reference(mod, x))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"an input dtype other than bfloat16, float16 or float32"):
        torch.compile(layer(), backend="aot_eager", fullgraph=True)(x)
