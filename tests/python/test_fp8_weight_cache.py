"""The FP8 weight cache (lowbit::fp8_linear_cache_weight, Fp8Linear's
cache_weight, lowbit.fp8_microbatch): W cast once per optimizer step and
reused by every microbatch, bitwise equal to the uncached path, the
delayed-scaling history rules, torch.compile (fullgraph, two graphs, one
forward op per layer), opcheck, bad inputs, CUDA."""

import copy

import pytest
import torch
import torch._dynamo.testing

import lowbit
from lowbit.fp8 import Fp8Recipe, fp8_cache_weight, fp8_weight_cache, weight_scaling
from lowbit.nn import Fp8Linear
from test_fp8_linear import OPCHECK_UTILS
from test_nn_fp8_linear import GraphRecorder, lowbit_ops

RECIPES = ["tensorwise", "delayed", "rowwise", "blockwise"]
STATELESS = ["tensorwise", "rowwise", "blockwise"]


def same(a, b):
    """Bitwise equal (FP8 compared as codes; NaN equal to NaN)."""
    if a.element_size() == 1 and a.is_floating_point():
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def weights(n=96, k=160, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16)


@pytest.mark.parametrize("recipe", RECIPES)
def test_cache_op_writes_the_cast_in_place(recipe):
    recipe = Fp8Recipe(recipe, amax_history_len=3)
    w = weights()
    state = lowbit.fp8_state(recipe)
    cache = fp8_weight_cache(w, recipe)
    assert torch.isnan(cache.scale).all()  # never filled: NaN, not plausible numbers
    ptrs = [t.data_ptr() for t in cache]
    fp8_cache_weight(w, cache, recipe=recipe, state=state)
    assert [t.data_ptr() for t in cache] == ptrs  # in place
    given = None
    if recipe.name == "delayed":  # the first refresh: an empty history scales by 1
        given = torch.tensor(1.0)
        assert state[1, 0] == w.float().abs().amax() and not state[1, 1:].any() and not state[0].any()
    want = lowbit.fp8_cast(w, weight_scaling(recipe), transpose=True, scale=given)
    for got, exp in zip(cache, want[:4]):
        assert same(got, exp)


def run_microbatches(layer, xs, dys, mode):
    """One optimizer step's microbatches; mode None (no cache), or the cache
    refreshed on the first. Returns the outputs, x grads and accumulated
    parameter grads."""
    ys, gxs = [], []
    for i, (x, dy) in enumerate(zip(xs, dys)):
        x = x.clone().requires_grad_()
        y = layer(x, is_first_microbatch=None if mode is None else i == 0)
        y.backward(dy)
        ys.append(y.detach())
        gxs.append(x.grad)
    return ys, gxs, [p.grad.clone() for p in layer.parameters()]


def data(steps=2, micro=3, m=40, k=160, n=96, seed=1):
    gen = torch.Generator().manual_seed(seed)
    xs = [[torch.randn(m, k, generator=gen).to(torch.bfloat16) for _ in range(micro)] for _ in range(steps)]
    dys = [[torch.randn(m, n, generator=gen).to(torch.bfloat16) for _ in range(micro)] for _ in range(steps)]
    return xs, dys


def layers(recipe, k=160, n=96):
    torch.manual_seed(2)
    plain = Fp8Linear(k, n, recipe=recipe, dtype=torch.bfloat16)
    cached = Fp8Linear.from_linear(copy.deepcopy(torch.nn.Linear(k, n, dtype=torch.bfloat16)), recipe=recipe,
                                   cache_weight=True)
    cached.load_state_dict(plain.state_dict())
    return plain, cached


@pytest.mark.parametrize("recipe", STATELESS)
def test_cached_steps_bitwise_equal_uncached_and_cast_once_per_step(recipe):
    plain, cached = layers(recipe)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.5)
    opt_c = torch.optim.SGD(cached.parameters(), lr=0.5)
    xs, dys = data()
    for step in range(2):
        version = cached.fp8_weight._version
        want = run_microbatches(plain, xs[step], dys[step], None)
        got = run_microbatches(cached, xs[step], dys[step], "cached")
        # The cast of W wrote the cache once this step (the first microbatch).
        assert cached.fp8_weight._version == version + 1
        for a, b in zip(sum(got, []), sum(want, [])):
            assert torch.equal(a, b)
        for opt in (opt_p, opt_c):
            opt.step()
            opt.zero_grad()
    assert torch.equal(cached.weight, plain.weight)


def test_delayed_history_rows_move_per_refresh_and_per_microbatch():
    recipe = Fp8Recipe("delayed", amax_history_len=8)
    plain, cached = layers(recipe)
    xs, dys = data(steps=2, micro=3)
    for step in range(2):
        before = cached.fp8_state.clone()
        got = run_microbatches(cached, xs[step], dys[step], "cached")
        h = cached.fp8_state
        # W (row 1): one amax per optimizer step, at the refresh; x (row 0)
        # and dy (row 2): one per microbatch.
        assert torch.equal(h[1, 1:], before[1, :-1]) and h[1, 0] == cached.weight.float().abs().amax()
        assert torch.equal(h[0, 3:], before[0, :-3]) and torch.equal(h[2, 3:], before[2, :-3])
        want_x = torch.stack([x.float().abs().amax() for x in xs[step][::-1]])
        assert torch.equal(h[0, :3], want_x)
        if step == 0:
            # The first microbatch is the uncached call (same history before it).
            want = run_microbatches(plain, xs[0][:1], dys[0][:1], None)
            assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[1][0], want[1][0])
        cached.zero_grad()


def test_version_check_catches_a_refresh_before_backward():
    _, layer = layers("tensorwise")
    x = torch.randn(8, 160).to(torch.bfloat16).requires_grad_()
    y = layer(x, is_first_microbatch=True)
    layer(x, is_first_microbatch=True)  # the next step's refresh, before y's backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()


def test_errors_and_stale_cache():
    plain, layer = layers("rowwise")
    x = torch.randn(8, 160).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"is_first_microbatch=True needs the weight cache; .*cache_weight=True"):
        plain(x, is_first_microbatch=True)
    with torch.no_grad():
        assert torch.isnan(layer(x, is_first_microbatch=False).float()).all()  # never filled
    with pytest.raises(ValueError, match="no Fp8Linear with cache_weight=True"):
        with lowbit.fp8_microbatch(torch.nn.Sequential(plain), True):
            pass
    assert "cache_weight=True" in repr(layer)


def test_dtype_conversion_keeps_cache_dtypes():
    _, layer = layers("blockwise")
    layer.half()
    assert layer.weight.dtype == torch.float16
    assert layer.fp8_weight.dtype == torch.float8_e4m3fn and layer.fp8_weight_t.dtype == torch.float8_e4m3fn
    assert layer.fp8_weight_scale.dtype == torch.float32 and layer.fp8_weight_t_scale.dtype == torch.float32
    assert "fp8_weight" not in layer.state_dict()


def test_bad_cache_inputs():
    recipe = Fp8Recipe("rowwise")
    w = weights()
    state = lowbit.fp8_state(recipe)
    cache = fp8_weight_cache(w, recipe)
    op = torch.ops.lowbit.fp8_linear_cache_weight
    with pytest.raises(ValueError, match=r"argument 'w_scale' must have shape \[96\]"):
        op(w, state, cache.data, cache.scale[:4], cache.data_t, cache.scale_t, "rowwise")
    with pytest.raises(TypeError, match=r"argument 'w_t_data' must have dtype Float8_e4m3fn"):
        op(w, state, cache.data, cache.scale, cache.data_t.float(), cache.scale_t, "rowwise")
    with pytest.raises(ValueError, match=r"argument 'w_t_data' must be contiguous"):
        op(w, state, cache.data, cache.scale, cache.data.t(), cache.scale_t, "rowwise")
    fwd = torch.ops.lowbit.fp8_linear_forward
    x = torch.randn(4, 160)
    with pytest.raises(ValueError, match=r"'w_fp8' and 'w_fp8_scale' must be given together"):
        fwd(x, w, None, state, "rowwise", save_w_t=False, w_fp8=cache.data)
    with pytest.raises(ValueError, match=r"save_w_t must be False"):
        fwd(x, w, None, state, "rowwise", w_fp8=cache.data, w_fp8_scale=cache.scale)


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_opcheck(recipe):
    recipe = Fp8Recipe(recipe)
    w = weights(128, 256)
    state = lowbit.fp8_state(recipe)
    cache = fp8_weight_cache(w, recipe)
    args = (recipe.name, recipe.amax_compute, recipe.margin, recipe.pow2_scales)
    torch.library.opcheck(torch.ops.lowbit.fp8_linear_cache_weight.default, (w, state, *cache, *args),
                          test_utils=OPCHECK_UTILS)
    fp8_cache_weight(w, cache, recipe=recipe, state=state)
    x = torch.randn(40, 256).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.lowbit.fp8_linear_forward.default,
                          (x, w, None, state, recipe.name),
                          dict(save_w_t=False, w_fp8=cache.data, w_fp8_scale=cache.scale),
                          test_utils=OPCHECK_UTILS)


class Stack(torch.nn.Module):
    def __init__(self, recipe, dims=(160, 256, 96)):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            Fp8Linear(dims[i], dims[i + 1], recipe=recipe, cache_weight=True, dtype=torch.bfloat16)
            for i in range(len(dims) - 1))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


@pytest.mark.parametrize("recipe", RECIPES)
def test_compile_fullgraph_two_graphs_bitwise_equal_eager(recipe):
    torch.manual_seed(7)
    model = Stack(recipe)
    eager = copy.deepcopy(model)
    recorder = GraphRecorder()
    counter = torch._dynamo.testing.CompileCounterWithBackend(recorder.backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(8)
    for step in range(3):
        for i in range(3):
            x = torch.randn(48, 160, generator=gen).to(torch.bfloat16)
            outs = []
            for m, fn in ((model, compiled), (eager, eager)):
                with lowbit.fp8_microbatch(m, is_first_microbatch=i == 0):
                    y = fn(x)
                y.float().square().sum().backward()
                outs.append([y] + [p.grad for p in m.parameters()] + [b for b in m.buffers()])
            for a, b in zip(*outs):
                assert same(a, b)
        for m in (model, eager):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
            m.zero_grad()
    # Two graphs (first microbatch, the others), none after the first step.
    assert counter.frame_count == 2, counter.frame_count
    # One forward op per layer in each; the refresh graph casts W per layer.
    fw = sorted(sorted(lowbit_ops(g)) for g in recorder.forward)
    assert fw == [["lowbit::fp8_linear_cache_weight"] * 2 + ["lowbit::fp8_linear_forward"] * 2,
                  ["lowbit::fp8_linear_forward"] * 2], fw
    assert all(lowbit_ops(g) == ["lowbit::fp8_linear_backward"] * 2 for g in recorder.backward)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_cache_matches_cpu(recipe):
    recipe = Fp8Recipe(recipe)
    w = weights(256, 512)
    caches = []
    for device in ("cpu", "cuda"):
        state = lowbit.fp8_state(recipe, device)
        cache = fp8_weight_cache(w.to(device), recipe)
        fp8_cache_weight(w.to(device), cache, recipe=recipe, state=state)
        caches.append([t.cpu() for t in cache] + [state.cpu()])
    for a, b in zip(*caches):
        assert same(a, b)
