"""lowbit.nn.Fp8Linear and lowbit.convert_to_fp8_training: parity with
nn.Linear (parameters, state dicts both ways, initialisation), forward and
backward against an FP64 reference within FP8 tolerance, the shape policy,
conversion of a model, torch.compile (no graph break, one lowbit op per
layer and direction, one graph across token counts).
"""

import copy
import functools

import pytest
import torch
import torch._dynamo.testing
from torch._dynamo.backends.debugging import aot_eager
from functorch.compile import make_boxed_func

import lowbit
from linear_reference import size_oblivious
from lowbit.fp8 import Fp8Recipe
from lowbit.fp8_training import FP8_MIN_FEATURES, FP8_MIN_TOKENS, fp8_skip_reason
from lowbit.nn import Fp8Linear

cuda = pytest.mark.cuda

RECIPES = ["tensorwise", "delayed", "rowwise", "blockwise"]

# Relative error of an FP8 GEMM against FP64 on Gaussian data: E4M3 keeps 3
# mantissa bits (a rounding error up to 2^-4 of each element, about 3% RMS)
# on both operands, so ~4e-2 on the product; E5M2 (2 bits) about twice that
# on the gradient it carries.
E4M3_TOL = 6e-2
E5M2_TOL = 1.2e-1


def rel_err(y, want):
    return ((y.double() - want.double()).norm() / want.double().norm()).item()


def cosine(y, want):
    return torch.nn.functional.cosine_similarity(y.double().flatten(), want.double().flatten(), dim=0).item()


def recipe_of(name, grad_format="e4m3", **fields):
    return Fp8Recipe(name=name, grad_format=grad_format, **fields)


def warm_delayed(layer, x, calls=2):
    # The delayed recipe scales with the amaxes of earlier calls: a fresh
    # history has none, so the layer first sees data of this scale.
    if layer.recipe.name == "delayed":
        with torch.no_grad():
            for _ in range(calls):
                layer(x)


# ---- the shape policy (no ops needed) ---------------------------------------


def test_policy_rule():
    big = FP8_MIN_FEATURES
    assert lowbit.fp8_wins(big, 2 * big)
    for recipe, tokens in FP8_MIN_TOKENS.items():
        assert lowbit.fp8_wins(big, big, tokens_hint=tokens, recipe=recipe)
        assert not lowbit.fp8_wins(big, big, tokens_hint=tokens - 128, recipe=recipe)
    assert not lowbit.fp8_wins(big - 16, 4 * big)
    assert not lowbit.fp8_wins(4 * big, big - 16)
    assert not lowbit.fp8_wins(big + 8, big)  # not a multiple of 16
    assert "multiples of 16" in fp8_skip_reason(big + 8, big)
    assert "min(in, out)" in fp8_skip_reason(1024, 8192)
    assert "tokens_hint 16 < " in fp8_skip_reason(big, big, tokens_hint=16)
    # Every GEMM's reduction dimension (K, N, M) on the tensor-core path: 16,
    # or 128 for blockwise.
    assert "tokens_hint 8200 not a multiple of 16" in fp8_skip_reason(big, big, tokens_hint=8200)
    assert lowbit.fp8_wins(big + 16, big, tokens_hint=8208)
    assert not lowbit.fp8_wins(big + 16, big, recipe="blockwise")
    assert "not multiples of 128" in fp8_skip_reason(big, big + 64, recipe=Fp8Recipe(name="blockwise"))
    assert "tokens_hint 8208 not a multiple of 128" in fp8_skip_reason(big, big, 8208, recipe="blockwise")
    assert lowbit.fp8_wins(big, big + 128, tokens_hint=8192, recipe="blockwise")


class Tiny(torch.nn.Module):
    # Shapes on both sides of the policy's threshold, a shared module, an
    # unaligned layer and a subclass of nn.Linear with a forward of its own.
    def __init__(self):
        super().__init__()
        f = FP8_MIN_FEATURES
        self.up = torch.nn.Linear(f, 2 * f, bias=False, device="meta")
        self.down = torch.nn.Linear(2 * f, f, device="meta")
        self.small = torch.nn.Linear(f, 64, device="meta")
        self.odd = torch.nn.Linear(f, f + 8, device="meta")
        self.tied = self.up
        self.other = Scaled(f, f, device="meta")


class Scaled(torch.nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_training_plan_policy_filter_and_shared_modules():
    model = Tiny()
    plan = lowbit.fp8_training_plan(model)
    by_name = {c.names[0]: c for c in plan}
    assert list(by_name) == ["up", "down", "small", "odd"]  # not the subclass; the shared one once
    assert by_name["up"].names == ("up", "tied")
    assert by_name["up"].converted and by_name["down"].converted
    assert "min(in, out)" in by_name["small"].reason and "multiples of 16" in by_name["odd"].reason
    # policy="all": everything; the tokens hint applies to "auto" only.
    plan = {c.names[0]: c for c in lowbit.fp8_training_plan(model, policy="all", tokens_hint=16)}
    assert all(c.converted for c in plan.values())
    plan = {c.names[0]: c for c in lowbit.fp8_training_plan(model, tokens_hint=16)}
    assert not plan["up"].converted and "tokens_hint" in plan["up"].reason
    plan = {c.names[0]: c for c in lowbit.fp8_training_plan(model, filter_fn=lambda m, n: n != "down")}
    assert plan["down"].reason == "filter_fn" and plan["up"].converted
    with pytest.raises(ValueError, match=r"filter_fn accepts the module named 'up' but not its other name 'tied'"):
        lowbit.fp8_training_plan(model, filter_fn=lambda m, n: n != "tied")
    with pytest.raises(ValueError, match=r"policy must be one of"):
        lowbit.fp8_training_plan(model, policy="fast")
    text = lowbit.fp8_training.format_fp8_plan(lowbit.fp8_training_plan(model))
    assert text.splitlines()[0].endswith("2 of 4 Linear layers to FP8, 2 kept in high precision")
    assert "kept  small" in text and "fp8   up" in text


# ---- the module -------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_parameters_and_state_dicts_match_nn_linear(recipe):
    torch.manual_seed(3)
    lin = torch.nn.Linear(256, 128)
    torch.manual_seed(3)
    mod = Fp8Linear(256, 128, recipe=recipe)
    # The same parameters, drawn the same way (nn.Linear's initialisation).
    assert [(n, p.shape, p.dtype) for n, p in mod.named_parameters()] == \
        [(n, p.shape, p.dtype) for n, p in lin.named_parameters()]
    assert torch.equal(mod.weight, lin.weight) and torch.equal(mod.bias, lin.bias)
    assert isinstance(mod, torch.nn.Linear)
    assert list(mod.state_dict()) == list(lin.state_dict()) == ["weight", "bias"]
    # Strict loading both ways.
    other = torch.nn.Linear(256, 128)
    mod.load_state_dict(other.state_dict())
    assert torch.equal(mod.weight, other.weight) and torch.equal(mod.bias, other.bias)
    back = torch.nn.Linear(256, 128)
    back.load_state_dict(mod.state_dict())
    assert torch.equal(back.weight, other.weight)
    assert mod.fp8_state.dtype == torch.float32 or mod.fp8_state.numel() == 0
    no_bias = Fp8Linear(256, 128, bias=False, recipe=recipe)
    assert no_bias.bias is None and list(no_bias.state_dict()) == ["weight"]


def test_from_linear_shares_parameters_and_repr():
    lin = torch.nn.Linear(256, 128, dtype=torch.bfloat16)
    mod = Fp8Linear.from_linear(lin, recipe="rowwise")
    assert mod.weight is lin.weight and mod.bias is lin.bias
    assert mod.weight.dtype == torch.bfloat16 and mod.recipe.name == "rowwise"
    assert repr(mod) == "Fp8Linear(in_features=256, out_features=128, bias=True, recipe=rowwise)"
    delayed = Fp8Linear.from_linear(torch.nn.Linear(256, 128, bias=False),
                                    recipe=recipe_of("delayed", amax_history_len=32))
    assert "bias=False, recipe=delayed(amax_history_len=32)" in repr(delayed)
    with pytest.raises(TypeError, match=r"overrides forward"):
        Fp8Linear.from_linear(Scaled(256, 128))
    with pytest.raises(TypeError, match=r"overrides forward"):
        Fp8Linear.from_linear(mod)  # already converted
    with pytest.raises(TypeError, match=r"argument 'recipe' must be a recipe name or a lowbit.fp8.Fp8Recipe"):
        Fp8Linear(256, 128, recipe=3)
    with pytest.raises(ValueError):
        Fp8Linear(256, 128, recipe="per-channel")  # the recipe refuses an unknown name


def test_dtype_conversion_keeps_the_history_float32():
    mod = Fp8Linear(256, 128, recipe="delayed")
    state_dtype = mod.fp8_state.dtype
    assert mod.to(torch.bfloat16) is mod
    assert mod.weight.dtype == torch.bfloat16 and mod.bias.dtype == torch.bfloat16
    assert mod.fp8_state.dtype == state_dtype
    mod.half()
    assert mod.weight.dtype == torch.float16 and mod.fp8_state.dtype == state_dtype


def fresh_layer(recipe, k, n, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * k ** -0.5)
        lin.bias.copy_(torch.randn(n, generator=gen))
    return Fp8Linear.from_linear(lin.to(device), recipe=recipe), gen


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("m", [96, 37])  # 37: tokens not a multiple of 16
def test_forward_close_to_fp64(recipe, m):
    layer, gen = fresh_layer(recipe, 256, 128, seed=5)
    x = torch.randn(m, 2, 256, generator=gen).to(torch.bfloat16)
    warm_delayed(layer, x)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 2, 128)
    want = x.double() @ layer.weight.double().T + layer.bias.double()
    assert rel_err(y, want) <= E4M3_TOL and cosine(y, want) >= 0.998
    # Against nn.Linear in BF16 too (the layer it replaces).
    assert rel_err(y, torch.nn.functional.linear(x, layer.weight, layer.bias)) <= E4M3_TOL


@pytest.mark.parametrize("recipe,grad_format", [(r, "e4m3") for r in RECIPES] + [("tensorwise", "e5m2"),
                                                                                  ("delayed", "e5m2")])
def test_backward_close_to_fp64(recipe, grad_format):
    layer, gen = fresh_layer(recipe_of(recipe, grad_format), 256, 384, seed=9)
    x = torch.randn(4, 32, 256, generator=gen).to(torch.bfloat16)
    grad_y = torch.randn(4, 32, 384, generator=gen).to(torch.bfloat16)
    if recipe == "delayed":  # the histories of x, W and grad_y see data of these scales
        for _ in range(2):
            layer(x).backward(grad_y)
        layer.zero_grad(set_to_none=True)
    x.requires_grad_()
    layer(x).backward(grad_y)
    w, b = layer.weight, layer.bias
    assert x.grad.shape == x.shape and w.grad.shape == w.shape and b.grad.shape == b.shape
    assert x.grad.dtype == x.dtype and w.grad.dtype == w.dtype
    dy = grad_y.double().reshape(-1, 384)
    tol = E4M3_TOL if grad_format == "e4m3" else E5M2_TOL
    assert rel_err(x.grad, (dy @ w.double()).reshape(x.shape)) <= tol
    assert rel_err(w.grad, dy.T @ x.detach().double().reshape(-1, 256)) <= tol
    assert rel_err(b.grad, dy.sum(0)) <= 1e-2  # the bias gradient needs no FP8 GEMM


def test_a_model_trains():
    # A regression a BF16 model learns: the FP8 one reaches its loss too.
    torch.manual_seed(0)
    teacher = torch.nn.Linear(256, 128)
    x = torch.randn(512, 256)
    target = teacher(x).detach().to(torch.bfloat16)
    x = x.to(torch.bfloat16)
    losses = {}
    for recipe in [None] + RECIPES:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
        model.to(torch.bfloat16)
        if recipe:
            lowbit.convert_to_fp8_training(model, recipe=recipe, policy="all", progress=False)
            assert all(isinstance(model[i], Fp8Linear) for i in (0, 2))
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        for _ in range(60):
            loss = torch.nn.functional.mse_loss(model(x).float(), target.float())
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[recipe] = loss.item()
    first = torch.nn.functional.mse_loss(torch.zeros_like(target).float(), target.float()).item()
    for recipe in RECIPES:
        assert losses[recipe] < 0.2 * first, losses
        assert losses[recipe] < 1.5 * losses[None] + 1e-3, losses


# ---- conversion ---------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, d=256, f=512):
        super().__init__()
        self.up = torch.nn.Linear(d, f)
        self.down = torch.nn.Linear(f, d, bias=False)
        self.head = torch.nn.Linear(d, 24)  # 24: not a multiple of 16

    def forward(self, x):
        return self.head(x + self.down(torch.relu(self.up(x))))


def test_convert_in_place_shares_parameters(capsys):
    model = Block().to(torch.bfloat16)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the conversion
    assert lowbit.convert_to_fp8_training(model, recipe="tensorwise", policy="all",
                                          filter_fn=lambda m, name: name != "head") is model
    err = capsys.readouterr().err
    assert "2 of 3 Linear layers to FP8" in err and "kept  head" in err and "filter_fn" in err
    assert isinstance(model.up, Fp8Linear) and isinstance(model.down, Fp8Linear)
    assert type(model.head) is torch.nn.Linear
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert list(model.state_dict()) == list(Block().state_dict())
    x = torch.randn(64, 256).to(torch.bfloat16)
    before = model.up.weight.detach().clone()
    model(x).float().pow(2).mean().backward()
    opt.step()
    assert not torch.equal(model.up.weight, before)
    # With the default policy the small layers stay (thresholds above 512).
    model = lowbit.convert_to_fp8_training(Block(), progress=False)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    # "all" takes the unaligned head too (the op's fallback runs it).
    model = lowbit.convert_to_fp8_training(Block().to(torch.bfloat16), policy="all", progress=False,
                                           filter_fn=lambda m, name: name != "down")
    assert isinstance(model.up, Fp8Linear) and type(model.down) is torch.nn.Linear
    assert isinstance(model.head, Fp8Linear)
    y = model(torch.randn(5, 256).to(torch.bfloat16))
    assert y.shape == (5, 24) and torch.isfinite(y.float()).all()
    # Converting again leaves the Fp8Linear layers alone.
    assert [c.names[0] for c in lowbit.fp8_training_plan(model, policy="all")] == ["down"]
    with pytest.raises(ValueError, match=r"policy must be one of"):
        lowbit.convert_to_fp8_training(Block(), policy="fast", progress=False)


def test_convert_refuses_a_bad_recipe_before_changing_anything():
    model = Block()
    with pytest.raises(TypeError, match=r"convert_to_fp8_training: argument 'recipe'"):
        lowbit.convert_to_fp8_training(model, recipe=1.0, policy="all", progress=False)
    assert type(model.up) is torch.nn.Linear


def test_convert_names_a_non_module_and_keeps_lazy_layers():
    with pytest.raises(TypeError, match=r"argument 'model' must be an nn.Module, got int"):
        lowbit.convert_to_fp8_training(42, progress=False)
    # A LazyLinear before its first forward has no shape: kept, with the
    # reason; from_linear refuses it (it made an in_features=0 layer before).
    model = torch.nn.Sequential(torch.nn.LazyLinear(64), torch.nn.Linear(64, 64))
    plan = lowbit.fp8_training_plan(model, policy="all")
    assert plan[0].reason.startswith("a lazy layer") and plan[1].converted
    lowbit.convert_to_fp8_training(model, policy="all", progress=False)
    assert type(model[0]) is torch.nn.LazyLinear and isinstance(model[1], Fp8Linear)
    with pytest.raises(ValueError, match=r"argument 'linear' \(LazyLinear\) has uninitialized parameters"):
        Fp8Linear.from_linear(torch.nn.LazyLinear(8))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_autocast_casts_x_as_nn_linear_does(recipe):
    # Under torch.autocast nn.Linear computes in the autocast dtype; so does
    # Fp8Linear (x cast first, as TransformerEngine and torchao do): y in
    # bfloat16, bitwise the layer on x cast by hand, gradients in the
    # parameters' and x's own dtypes; compiled the same.
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128)
    layers = [Fp8Linear.from_linear(copy.deepcopy(lin), recipe) for _ in range(3)]
    x = torch.randn(8, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16
        y = layers[0](x)
        compiled = torch.compile(layers[2], backend="aot_eager", fullgraph=True)(x)
    want = layers[1](x.detach().to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.equal(y, want) and torch.equal(compiled, want)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layers[0].weight.grad.dtype == torch.float32
    assert layers[0](x).dtype == torch.float32  # outside autocast: x's dtype


# ---- torch.compile ------------------------------------------------------------


class Stack(torch.nn.Module):
    def __init__(self, dims, recipe, device="cpu"):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            Fp8Linear(dims[i], dims[i + 1], recipe=recipe, device=device, dtype=torch.bfloat16)
            for i in range(len(dims) - 1))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def lowbit_ops(gm):
    """The lowbit ops a traced graph calls, looking through the wrapper that
    functionalization puts around ops that mutate an input (the amax
    history)."""
    names = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if "auto_functionalized" in str(target):
            target = node.args[0]
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "lowbit":
            names.append(target.name())
    return names


class GraphRecorder:
    """A torch.compile backend that keeps the AOT forward and backward graphs."""

    def __init__(self):
        self.forward, self.backward = [], []
        # aot_eager's settings (Inductor's partitioner, input mutations kept
        # in the graph), so the graphs are those torch.compile makes.
        self.backend = functools.partial(aot_eager, fw_compiler=self._keep(self.forward),
                                         bw_compiler=self._keep(self.backward))

    @staticmethod
    def _keep(graphs):
        def compiler(gm, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)

        return compiler


@pytest.mark.parametrize("recipe", RECIPES)
def test_compile_one_graph_one_op_per_layer_and_direction(recipe):
    torch.manual_seed(4)
    model = Stack([256, 512, 256, 128], recipe)
    x = torch.randn(64, 256).to(torch.bfloat16)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    recorder = GraphRecorder()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=recorder.backend, fullgraph=True)
    y = compiled(x)
    y.float().sum().backward()
    want = eager(x)
    want.float().sum().backward()
    assert torch.equal(y, want)
    for a, b in zip(model.parameters(), eager.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert len(recorder.forward) == 1 and len(recorder.backward) == 1
    forward_ops, backward_ops = lowbit_ops(recorder.forward[0]), lowbit_ops(recorder.backward[0])
    assert len(forward_ops) == 3 and len(set(forward_ops)) == 1, forward_ops
    assert len(backward_ops) == 3 and len(set(backward_ops)) == 1, backward_ops


@pytest.mark.parametrize("recipe", RECIPES)
def test_compile_dynamic_no_recompile(recipe):
    torch.manual_seed(5)
    model = Stack([256, 384, 128], recipe)
    eager = copy.deepcopy(model)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    # size_oblivious: blockwise's scales have ceil(M / 128) rows, 1 up to
    # 128 tokens, and Dynamo would specialize that size of 1 (one more graph
    # when M crosses 128) unless told not to.
    with size_oblivious:
        for m in (2, 17, 64, 300):
            x = torch.randn(m, 256).to(torch.bfloat16)
            y, want = compiled(x), eager(x)
            assert torch.equal(y, want), m
            y.float().sum().backward()
            want.float().sum().backward()
    assert counter.frame_count == 1
    for a, b in zip(model.parameters(), eager.parameters()):
        assert torch.equal(a.grad, b.grad)


# ---- CUDA -------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_forward_backward_close_to_fp64(recipe):
    layer, gen = fresh_layer(recipe, 1024, 2048, device="cuda", seed=11)
    x = torch.randn(512, 1024, generator=gen).to(torch.bfloat16).cuda()
    grad_y = torch.randn(512, 2048, generator=gen).to(torch.bfloat16).cuda()
    if recipe == "delayed":
        for _ in range(2):
            layer(x).backward(grad_y)
        layer.zero_grad(set_to_none=True)
    x.requires_grad_()
    y = layer(x)
    y.backward(grad_y)
    w = layer.weight.double()
    assert rel_err(y, x.detach().double() @ w.T + layer.bias.double()) <= E4M3_TOL
    assert rel_err(x.grad, grad_y.double() @ w) <= E4M3_TOL
    assert rel_err(layer.weight.grad, grad_y.double().T @ x.detach().double()) <= E4M3_TOL


@cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_inductor_matches_eager(recipe):
    torch.manual_seed(6)
    model = Stack([1024, 2048, 1024], recipe, device="cuda")
    eager = copy.deepcopy(model)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for m in (256, 1000, 4096):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        y, want = compiled(x), eager(x)
        assert rel_err(y, want) <= 1e-2, m  # Inductor may fuse the ReLU differently; the op is the same
        y.float().sum().backward()
    assert counter.frame_count == 1


@cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_graph_of_a_training_step(recipe):
    # Forward and both gradients captured in one CUDA graph (what the
    # fp8_train benchmark times): replays on new data give eager's results
    # (for delayed, whose history moves on with every call, within FP8
    # tolerance of an eager layer warmed up alike).
    layer, gen = fresh_layer(recipe, 1024, 1024, device="cuda", seed=12)
    eager = copy.deepcopy(layer)
    x = torch.randn(256, 1024, generator=gen).to(torch.bfloat16).cuda().requires_grad_()
    dy = torch.randn(256, 1024, generator=gen).to(torch.bfloat16).cuda()

    def step(layer=layer):
        return torch.autograd.grad(layer(x), (x, layer.weight), dy)

    for _ in range(3):
        step(eager)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gx, gw = step()
    for _ in range(2):
        with torch.no_grad():
            x.copy_(torch.randn(256, 1024, generator=gen).to(torch.bfloat16))
            dy.copy_(torch.randn(256, 1024, generator=gen).to(torch.bfloat16))
        graph.replay()
        want_x, want_w = torch.autograd.grad(eager(x), (x, eager.weight), dy)
        if recipe == "delayed":
            assert rel_err(gx, want_x) <= E4M3_TOL and rel_err(gw, want_w) <= E4M3_TOL
        else:
            assert torch.equal(gx, want_x) and torch.equal(gw, want_w)


def test_min_tokens_runs_small_calls_in_high_precision():
    gen = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(64, 32)
    layer = Fp8Linear.from_linear(lin, min_tokens=8)
    assert "min_tokens=8" in repr(layer)
    small = torch.randn(2, 3, 64, generator=gen)  # 6 tokens: F.linear
    assert torch.equal(layer(small), torch.nn.functional.linear(small, lin.weight, lin.bias))
    big = torch.randn(2, 4, 64, generator=gen)  # 8 tokens: FP8, as a layer without the threshold
    got = layer(big)
    assert torch.equal(got, Fp8Linear.from_linear(lin)(big))
    assert not torch.equal(got, torch.nn.functional.linear(big, lin.weight, lin.bias))  # FP8's rounding shows
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=f"argument 'min_tokens' must be an int >= 0, got {bad!r}"):
            Fp8Linear(4, 4, min_tokens=bad)
    # The default policy gives converted layers the recipe's crossover; "all" none.
    for policy, recipe, want in (("auto", "rowwise", FP8_MIN_TOKENS["rowwise"]), ("all", "tensorwise", 0)):
        model = torch.nn.Sequential(torch.nn.Linear(FP8_MIN_FEATURES, FP8_MIN_FEATURES, device="meta"))
        lowbit.convert_to_fp8_training(model, recipe=recipe, policy=policy, progress=False)
        assert isinstance(model[0], Fp8Linear) and model[0].min_tokens == want
