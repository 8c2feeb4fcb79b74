"""lowbit.fp8_linear (lowbit::fp8_linear_forward / fp8_linear_backward):
output and gradients against float64 math on the reference's quantized
operands (fp8_reference.py) for every recipe, the delayed-scaling history,
opcheck, torch.compile with one lowbit node per layer per direction,
dynamic shapes, empty batches, bad inputs, CUDA and CUDA graphs."""

import zlib

import pytest
import torch
import torch._dynamo.testing
from torch._dynamo.backends.common import aot_autograd
from functorch.compile import make_boxed_func

import fp8_reference as ref
import lowbit
from lowbit import Fp8Recipe

RECIPES = [
    Fp8Recipe("tensorwise"),
    Fp8Recipe("tensorwise", grad_format="e5m2"),
    Fp8Recipe("delayed", amax_history_len=4),
    Fp8Recipe("delayed", grad_format="e5m2", amax_history_len=3, amax_compute="most_recent", margin=1),
    Fp8Recipe("rowwise"),
    Fp8Recipe("rowwise", grad_format="e5m2", pow2_scales=True),
    Fp8Recipe("blockwise"),
    Fp8Recipe("blockwise", pow2_scales=True),
    # The forward GEMM promoting to FP32 too (on the GPU; the default
    # accumulates fast there, with a wider bound).
    Fp8Recipe("tensorwise", fast_accum=False),
    Fp8Recipe("rowwise", fast_accum=False),
]
IDS = [f"{r.name}-{r.grad_format}-{r.amax_compute}-m{r.margin}-p{int(r.pow2_scales)}-f{int(r.fast_accum)}"
       for r in RECIPES]


def seeded(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def data(lead, n, k, key, dtype=torch.bfloat16):
    gen = seeded(lead, n, k, *key)
    x = (torch.randn(*lead, k, generator=gen) * 2).to(dtype)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    b = torch.randn(n, generator=gen) * 0.1
    dy = (torch.randn(*lead, n, generator=gen) * 1e-2).to(dtype)
    return x, w, b, dy


def run(x, w, b, dy, recipe, state, fn=lowbit.fp8_linear):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    y = fn(x, w, b, recipe=recipe, state=state)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, None if b is None else b.grad


def check_step(x, w, b, dy, recipe, state):
    """One step against the reference; returns the reference's new history."""
    history = state.clone()
    y, dx, dw, db = run(x, w, b, dy, recipe, state)
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    ops = ref.linear_operands(x2, w, dy2, recipe, history)
    y_ref, dx_ref, dw_ref = ref.linear_step(ops, b)
    cx, cw, cdy, act, wsc, g = ops["x"], ops["w"], ops["dy"], ops["act"], ops["wsc"], ops["grad"]
    acc, eps = ref.gemm_tolerance(cx[0], cx[1], cw[0], cw[1], act, wsc, "e4m3", "e4m3", y.dtype, y.device,
                                  recipe.fast_accum)
    if b is not None:
        acc = acc + b.abs().to(torch.float64) * 2.0**-23
    ref.assert_gemm_close(y.reshape(y_ref.shape), y_ref, acc, eps)
    acc, eps = ref.gemm_tolerance(cdy[0], cdy[1], cw[2], cw[3], act, wsc, g, "e4m3", dx.dtype, dx.device)
    ref.assert_gemm_close(dx.reshape(dx_ref.shape), dx_ref, acc, eps)
    acc, eps = ref.gemm_tolerance(cdy[2], cdy[3], cx[2], cx[3], act, act, g, "e4m3", dw.dtype, dw.device)
    ref.assert_gemm_close(dw, dw_ref, acc, eps)
    if b is not None:
        torch.testing.assert_close(db.double(), dy2.double().sum(0), rtol=1e-5, atol=1e-6)
    if recipe.name == "delayed":
        assert torch.equal(state, ops["history"]), (state, ops["history"])
    return y, dx, dw, db


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("shape", [((2, 37), 48, 300), ((130,), 256, 128), ((1,), 16, 16)])
def test_matches_float64_on_quantized_operands(recipe, shape):
    lead, n, k = shape
    x, w, b, dy = data(lead, n, k, ("ref", recipe))
    state = lowbit.fp8_state(recipe)
    for step in range(3 if recipe.name == "delayed" else 1):
        check_step(x * (1 + step), w, b, dy, recipe, state)


def test_delayed_history_rolls_and_scales_lag_one_step():
    recipe = Fp8Recipe("delayed", amax_history_len=3)
    state = lowbit.fp8_state(recipe)
    assert state.shape == (3, 3) and state.dtype == torch.float32 and not state.any()
    x, w, b, dy = data((16,), 32, 64, ("history",))
    amaxes = []
    for step in range(4):
        xs = x * (step + 1)
        run(xs, w, b, dy, recipe, state)
        amaxes.append(xs.float().abs().amax())
        want = torch.stack(amaxes[::-1][:3] + [torch.tensor(0.0)] * (3 - len(amaxes[:3])))[:3]
        assert torch.equal(state[0], want)
        assert torch.equal(state[1], torch.full((3,), w.abs().amax().item()).where(torch.arange(3) <= step, 0.0))
        assert state[2, 0] == dy.float().abs().amax()


@pytest.mark.parametrize("amax_compute", ["max", "most_recent"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_delayed_history_skips_a_non_finite_amax(amax_compute, bad):
    # One batch with an inf or NaN in x and in dy: that step's result is
    # what it is, but the history records the previous amaxes again, so the
    # steps after it are bitwise those of a twin that saw the step before
    # again instead (before: NaN scales for the next L steps).
    recipe = Fp8Recipe("delayed", amax_history_len=3, amax_compute=amax_compute)
    x, w, b, dy = data((16,), 32, 64, ("non-finite", amax_compute))
    state, twin = lowbit.fp8_state(recipe), lowbit.fp8_state(recipe)
    for step in range(2):
        run(x * (1 + step), w, b, dy * (1 + step), recipe, state)
        run(x * (1 + step), w, b, dy * (1 + step), recipe, twin)
    before = state.clone()
    x_bad, dy_bad = x * 2, dy * 2
    x_bad[3, 5], dy_bad[7, 1] = bad, bad
    run(x_bad, w, b, dy_bad, recipe, state)
    run(x * 2, w, b, dy * 2, recipe, twin)  # the amaxes of the step before, recorded again
    assert torch.equal(state, twin) and torch.isfinite(state).all()
    assert torch.equal(state[0, 0], before[0, 0]) and torch.equal(state[2, 0], before[2, 0])
    assert torch.equal(state[1, 0], w.abs().amax())  # W was finite: recorded
    for step in range(4):
        got, want = run(x * 3, w, b, dy * 3, recipe, state), run(x * 3, w, b, dy * 3, recipe, twin)
        assert all(torch.equal(g, h) for g, h in zip(got, want)) and torch.isfinite(got[0]).all(), step
    # A layer's first step with an inf: nothing finite to keep, 0 recorded (scale 1 next).
    first = lowbit.fp8_state(recipe)
    run(x_bad, w, b, dy, recipe, first)
    assert first[0, 0] == 0 and first[2, 0] == dy.float().abs().amax()


def test_stateless_recipes_have_empty_state():
    for name in ("tensorwise", "rowwise", "blockwise"):
        assert lowbit.fp8_state(Fp8Recipe(name)).shape == (0,)


def test_recipe_validation():
    with pytest.raises(ValueError, match="name must be one of"):
        Fp8Recipe("current")
    with pytest.raises(ValueError, match="grad_format"):
        Fp8Recipe(grad_format="e3m4")
    with pytest.raises(ValueError, match="amax_history_len"):
        Fp8Recipe("delayed", amax_history_len=0)


@pytest.mark.parametrize("recipe", [RECIPES[0], RECIPES[2], RECIPES[4], RECIPES[6]], ids=lambda r: r.name)
def test_empty_batch(recipe):
    x, w, b, dy = data((0,), 32, 64, ("empty",))
    state = lowbit.fp8_state(recipe)
    y, dx, dw, db = run(x, w, b, dy, recipe, state)
    assert y.shape == (0, 32) and dx.shape == (0, 64)
    assert torch.equal(dw, torch.zeros(32, 64)) and torch.equal(db, torch.zeros(32))


def test_gradients_only_where_asked():
    recipe = Fp8Recipe("rowwise")
    x, w, b, _ = data((8,), 16, 32, ("needs",))
    w.requires_grad_()
    y = lowbit.fp8_linear(x, w, recipe=recipe, state=lowbit.fp8_state(recipe))
    y.float().sum().backward()
    assert w.grad is not None and w.grad.shape == (16, 32)
    with torch.no_grad():
        assert lowbit.fp8_linear(x, w, b, recipe=recipe, state=lowbit.fp8_state(recipe)).shape == (8, 16)


# test_schema compares every argument of every op inside the op with
# torch.allclose (SchemaCheckMode), which has no float8 kernel on the CPU;
# these ops compute on FP8 tensors, so they run the other three tests.
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("recipe", [RECIPES[3], RECIPES[5], RECIPES[7]], ids=lambda r: r.name)
def test_opcheck(recipe):
    x, w, b, dy = data((40,), 48, 160, ("opcheck",))
    args = (recipe.name, recipe.grad_format, recipe.amax_compute, recipe.margin, recipe.pow2_scales)
    state = lowbit.fp8_state(recipe)
    fwd = torch.ops.lowbit.fp8_linear_forward.default
    torch.library.opcheck(fwd, (x, w, b, state, *args, True, True), test_utils=OPCHECK_UTILS)
    _, x_t, x_t_s, w_t, w_t_s, _ = fwd(x, w, b, state, *args, True, True)
    bwd = torch.ops.lowbit.fp8_linear_backward.default
    torch.library.opcheck(bwd, (dy, x_t, x_t_s, w_t, w_t_s, state, *args, torch.float32, torch.float32, True, True),
                          test_utils=OPCHECK_UTILS)
    torch.library.opcheck(bwd, (dy, x_t, x_t_s, w_t, w_t_s, state, *args, torch.float32, None, True, False),
                          test_utils=OPCHECK_UTILS)


def test_record_amax_op():
    # lowbit::fp8_record_amax: what the ops record after a cast (the row
    # rolls, column 0 gets the amax; a non-finite one repeats the previous),
    # for casts made outside them; opcheck; bad arguments named.
    state = torch.rand(3, 4, generator=seeded("record"))
    want = state.clone()
    op = torch.ops.lowbit.fp8_record_amax.default
    op(state, 2, torch.tensor(5.0))
    want[2] = torch.cat([torch.tensor([5.0]), want[2, :3]])
    assert torch.equal(state, want)
    op(state, 0, torch.tensor(float("inf")))
    want[0] = torch.cat([want[0, :1], want[0, :3]])
    assert torch.equal(state, want)
    torch.library.opcheck(op, (state.clone(), 1, torch.tensor(2.5)), test_utils=OPCHECK_UTILS)
    with pytest.raises(ValueError, match=r"argument 'row' must be 0 \(x\), 1 \(W\) or 2 \(dy\), got 3"):
        op(state, 3, torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"argument 'amax' must hold one value"):
        op(state, 0, torch.ones(2))


class TwoLayers(torch.nn.Module):
    def __init__(self, recipe, k=64, h=96, n=32):
        super().__init__()
        self.recipe = recipe
        self.l1 = torch.nn.Linear(k, h)
        self.l2 = torch.nn.Linear(h, n, bias=False)
        self.register_buffer("s1", lowbit.fp8_state(recipe))
        self.register_buffer("s2", lowbit.fp8_state(recipe))

    def forward(self, x):
        h = lowbit.fp8_linear(x, self.l1.weight, self.l1.bias, recipe=self.recipe, state=self.s1)
        return lowbit.fp8_linear(torch.relu(h), self.l2.weight, recipe=self.recipe, state=self.s2)


def lowbit_nodes(gm):
    names = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if "auto_functionalized" in str(target) and node.args:
            target = node.args[0]
        if "lowbit" in str(target):
            names.append(str(target).split(".")[-2] if str(target).endswith("default") else str(target))
    return names


@pytest.mark.parametrize("recipe", [RECIPES[0], RECIPES[2], RECIPES[4], RECIPES[6]], ids=lambda r: r.name)
def test_compile_one_node_per_layer_per_direction_and_eager_equal(recipe):
    graphs = {"fw": [], "bw": []}

    def keep(kind):
        def compiler(gm, _):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"), keep_inference_input_mutations=True)
    torch.manual_seed(0)
    eager = TwoLayers(recipe)
    compiled_model = TwoLayers(recipe)
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, backend=backend, fullgraph=True, dynamic=True)
    for step in range(3):
        x = torch.randn(3, 17 + step, 64, generator=seeded("compile", step)).to(torch.bfloat16)
        outs = []
        for model, fn in ((eager, eager), (compiled_model, compiled)):
            model.zero_grad()
            xx = x.clone().requires_grad_()
            y = fn(xx)
            y.float().square().sum().backward()
            outs.append([y, xx.grad] + [p.grad for p in model.parameters()] + [model.s1.clone(), model.s2.clone()])
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    fw, bw = graphs["fw"], graphs["bw"]
    assert len(fw) == 1 and len(bw) == 1, (len(fw), len(bw))
    assert lowbit_nodes(fw[0]) == ["fp8_linear_forward"] * 2, lowbit_nodes(fw[0])
    assert lowbit_nodes(bw[0]) == ["fp8_linear_backward"] * 2, lowbit_nodes(bw[0])


# Token counts from 2 up: dynamic shapes specialize sizes 0 and 1, and the
# blockwise scales' ceil(M / 128) specializes at 1 (one recompile when M
# first exceeds 128).
@pytest.mark.parametrize("recipe", [RECIPES[2], RECIPES[4], RECIPES[6]], ids=lambda r: r.name)
def test_dynamic_no_recompile_across_token_counts(recipe):
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    model = TwoLayers(recipe)
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for m in ((130, 200, 777) if recipe.name == "blockwise" else (5, 64, 200, 2)):
        x = torch.randn(m, 64, generator=seeded("dyn", m), requires_grad=True)
        compiled(x).sum().backward()
    assert counter.frame_count == 1


def test_bad_inputs_raise_clear_errors():
    x, w, b, _ = data((4,), 16, 32, ("bad",))
    state = lowbit.fp8_state(Fp8Recipe("delayed"))
    fwd = torch.ops.lowbit.fp8_linear_forward
    with pytest.raises(ValueError, match=r"argument 'recipe' must be \"tensorwise\", .*got \"mixed\""):
        fwd(x, w, b, state, "mixed")
    with pytest.raises(ValueError, match=r"argument 'weight' \[N, K\] must have the K of 'x'"):
        fwd(x, w[:, :16], b, state, "delayed")
    with pytest.raises(ValueError, match=r"argument 'amax_history' must have shape \[3, L\]"):
        fwd(x, w, b, torch.zeros(2, 4), "delayed")
    with pytest.raises(TypeError, match=r"argument 'amax_history' must have dtype Float"):
        fwd(x, w, b, torch.zeros(3, 4, dtype=torch.float64), "delayed")
    with pytest.raises(ValueError, match=r"argument 'bias' must have shape \[16\]"):
        fwd(x, w, b[:4], state, "delayed")
    with pytest.raises(ValueError, match=r"argument 'amax_compute' must be \"max\" or \"most_recent\""):
        fwd(x, w, b, state, "delayed", "e4m3", "mean")
    with pytest.raises(ValueError, match="must have the same K"):
        lowbit.fp8_linear(x, w[:, :16], recipe=Fp8Recipe(), state=lowbit.fp8_state(Fp8Recipe()))


# ---- CUDA (skipped without a GPU) ---------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("shape", [((4, 64), 512, 1024), ((37,), 48, 300)])
def test_cuda_matches_float64_and_cpu_state(recipe, shape):
    lead, n, k = shape
    x, w, b, dy = data(lead, n, k, ("cuda", recipe))
    state = lowbit.fp8_state(recipe, "cuda")
    cpu_state = lowbit.fp8_state(recipe)
    for step in range(2):
        xs = x * (1 + step)
        history = state.cpu()
        y, dx, dw, db = run(xs.cuda(), w.cuda(), b.cuda(), dy.cuda(), recipe, state)
        run(xs, w, b, dy, recipe, cpu_state)
        assert torch.equal(state.cpu(), cpu_state)  # the casts agree bit for bit, so do the amaxes
        x2, dy2 = xs.reshape(-1, k), dy.reshape(-1, n)
        ops = ref.linear_operands(x2, w, dy2, recipe, history)
        y_ref, dx_ref, dw_ref = ref.linear_step(ops, b)
        cx, cw, cdy, act, wsc, g = ops["x"], ops["w"], ops["dy"], ops["act"], ops["wsc"], ops["grad"]
        acc, eps = ref.gemm_tolerance(cx[0], cx[1], cw[0], cw[1], act, wsc, "e4m3", "e4m3", torch.bfloat16, "cuda",
                                      recipe.fast_accum)
        ref.assert_gemm_close(y.reshape(y_ref.shape), y_ref, acc + b.abs().double() * 2.0**-7, eps)
        acc, eps = ref.gemm_tolerance(cdy[0], cdy[1], cw[2], cw[3], act, wsc, g, "e4m3", torch.bfloat16, "cuda")
        ref.assert_gemm_close(dx.reshape(dx_ref.shape), dx_ref, acc, eps)
        acc, eps = ref.gemm_tolerance(cdy[2], cdy[3], cx[2], cx[3], act, act, g, "e4m3", torch.float32, "cuda")
        ref.assert_gemm_close(dw, dw_ref, acc, eps)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", RECIPES[:1] + RECIPES[2:3] + RECIPES[4:5] + RECIPES[6:7], ids=lambda r: r.name)
def test_cuda_reduce_overhead_training_steps_bitwise_equal_to_eager(recipe):
    # torch.compile(mode="reduce-overhead"): Inductor's CUDA graphs capture
    # the forward and backward and replay them step after step; no step may
    # be skipped from the graphs (a mutated history, a CPU tensor, a sync),
    # and every step's output, gradients and history are the eager step's.
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    model = TwoLayers(recipe, k=256, h=512, n=128).cuda()
    eager = TwoLayers(recipe, k=256, h=512, n=128).cuda()
    eager.load_state_dict(model.state_dict())
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for i in range(4):
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        outs = []
        for m in (compiled, eager):
            for p in model.parameters() if m is compiled else eager.parameters():
                p.grad = None
            y = m(x)
            y.float().square().sum().backward()
            outs.append(y.detach().clone())
        assert torch.equal(outs[0], outs[1]), i
        for p, q in zip(model.parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad), i
        assert torch.equal(model.s1, eager.s1) and torch.equal(model.s2, eager.s2), i
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


# Blockwise once replayed to outputs unlike eager's: cuBLASLt read 128 x 128
# scales with a padded leading dimension (test_fp8_graph_cuda.py); those
# shapes now take the fallback, and the test passes on an H100.
GRAPH_RECIPES = [RECIPES[0], RECIPES[2], RECIPES[4], RECIPES[6]]


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", GRAPH_RECIPES, ids=lambda r: r.name)
def test_cuda_graph_forward_backward_bitwise_equal_to_eager(recipe):
    torch.manual_seed(0)
    model = TwoLayers(recipe, k=256, h=512, n=128).cuda()
    eager = TwoLayers(recipe, k=256, h=512, n=128).cuda()
    static_x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def step(m, x):
        y = m(x)
        y.float().square().sum().backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model.zero_grad(set_to_none=False)
            step(model, static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        static_y = step(model, static_x)
    for i in range(3):
        static_x.copy_(torch.randn(64, 256, device="cuda", dtype=torch.bfloat16))
        eager.load_state_dict(model.state_dict())  # same weights and history before the step
        for p in model.parameters():
            p.grad.zero_()
        graph.replay()
        eager.zero_grad()
        y = step(eager, static_x.clone())
        assert torch.equal(static_y, y)
        for p, q in zip(model.parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert torch.equal(model.s1, eager.s1) and torch.equal(model.s2, eager.s2)


@pytest.mark.parametrize("amax_compute,margin,pow2", [("max", 0, False), ("most_recent", 1, False), ("max", -2, True)])
def test_delayed_scale_is_the_scale_the_forward_casts_with(amax_compute, margin, pow2):
    # lowbit::fp8_delayed_scale (what an FP8 all-gather casts x with before
    # the op) gives the scales the forward op's casts use: x's and W's,
    # returned with their transposed copies.
    recipe = Fp8Recipe("delayed", amax_history_len=4, amax_compute=amax_compute, margin=margin, pow2_scales=pow2)
    x, w, b, _ = data((16,), 64, 32, ("delayed scale", amax_compute, margin, pow2))
    history = torch.rand(3, 4, generator=seeded("history", margin)) * 50
    before = history.clone()
    _, _, x_t_scale, _, w_t_scale, _ = torch.ops.lowbit.fp8_linear_forward(
        x, w.bfloat16(), b.bfloat16(), history, *lowbit.fp8._recipe_args(recipe))
    args = (amax_compute, margin, pow2, "e4m3")
    assert torch.equal(torch.ops.lowbit.fp8_delayed_scale(before, 0, *args), x_t_scale)
    assert torch.equal(torch.ops.lowbit.fp8_delayed_scale(before, 1, *args), w_t_scale)
    assert torch.ops.lowbit.fp8_delayed_scale(before, 2, *args).shape == ()
    assert torch.ops.lowbit.fp8_delayed_scale(torch.zeros(3, 4), 0, *args) == 1.0  # no history yet
    torch.library.opcheck(torch.ops.lowbit.fp8_delayed_scale.default, (before, 2, *args))


def test_fp8_x_records_the_given_amax_in_the_delayed_history():
    # An FP8 x (x_scale) with x_amax: the history's x row takes x_amax, as
    # the cast of the high-precision x would have recorded it; without
    # x_amax only W's row moves.
    recipe = Fp8Recipe("delayed", amax_history_len=3)
    x, w, _, _ = data((8,), 32, 64, ("fp8 x amax",))
    history = torch.rand(3, 3, generator=seeded("fp8 x history")) + 1
    want = history.clone()
    torch.ops.lowbit.fp8_linear_forward(x, w, None, want, *lowbit.fp8._recipe_args(recipe), save_x_t=False,
                                        save_w_t=False)
    scale = torch.ops.lowbit.fp8_delayed_scale(history, 0)
    codes = lowbit.fp8_cast(x, "tensor", scale=scale)
    got = history.clone()
    torch.ops.lowbit.fp8_linear_forward(codes.data, w, None, got, *lowbit.fp8._recipe_args(recipe), save_x_t=False,
                                        save_w_t=False, x_scale=scale, out_dtype=x.dtype, x_amax=codes.amax)
    assert torch.equal(got, want)
    alone = history.clone()
    torch.ops.lowbit.fp8_linear_forward(codes.data, w, None, alone, *lowbit.fp8._recipe_args(recipe), save_x_t=False,
                                        save_w_t=False, x_scale=scale, out_dtype=x.dtype)
    assert torch.equal(alone[0], history[0]) and torch.equal(alone[1], want[1])


def test_delayed_scale_and_x_amax_bad_inputs_raise_clear_errors():
    h = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"argument 'row' must be 0 \(x\), 1 \(W\) or 2 \(dy\), got 3"):
        torch.ops.lowbit.fp8_delayed_scale(h, 3)
    with pytest.raises(ValueError, match=r"amax_history' must have shape \[3, L\]"):
        torch.ops.lowbit.fp8_delayed_scale(torch.zeros(2, 4), 0)
    with pytest.raises(ValueError, match="argument 'dtype'"):
        torch.ops.lowbit.fp8_delayed_scale(h, 0, dtype="e3m4")
    x, w, _, _ = data((8,), 32, 64, ("bad x amax",))
    recipe_args = lowbit.fp8._recipe_args(Fp8Recipe("delayed", amax_history_len=4))
    with pytest.raises(ValueError, match="'x_amax' is the amax of an FP8 'x' .* needs 'x_scale'"):
        torch.ops.lowbit.fp8_linear_forward(x, w, None, h, *recipe_args, x_amax=torch.tensor(1.0))
    codes = lowbit.fp8_cast(x, "tensor")
    with pytest.raises(ValueError, match="x_amax"):
        torch.ops.lowbit.fp8_linear_forward(codes.data, w, None, h, *recipe_args, save_x_t=False, x_scale=codes.scale,
                                            out_dtype=x.dtype, x_amax=torch.ones(2))


# ---- the delayed history's CUDA kernels against the CPU ops -------------------------
# One launch each for the scales and for the record (csrc/lowbit/fp8/fp8_history.cu);
# the CPU ops (ATen) are the reference, bit for bit.

HISTORY_LENS = [1, 2, 16, 1024, 1500]  # 1500: the record kernel's roll crosses chunks of 1024
INF, NAN = float("inf"), float("nan")


def random_history(length, *key):
    """[3, L] amaxes over 40 binades, never zero (a zero row is "no history yet")."""
    return torch.exp2(torch.empty(3, length).uniform_(-20, 20, generator=seeded("history kernels", length, *key)))


def bits(t):
    return t.cpu().view(torch.int32)


def same_bits_nan_as_nan(got, want):
    # CUDA arithmetic returns the canonical NaN, the CPU keeps the input's
    # payload: a NaN scale must be NaN on both, every other scale bit-equal.
    got, nan = got.cpu(), want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(bits(got.where(~nan, 0)), bits(want.where(~nan, 0)))


def column_major(h):
    return h.t().contiguous().t()


@pytest.mark.cuda
@pytest.mark.parametrize("length", HISTORY_LENS)
@pytest.mark.parametrize("amax_compute", ["max", "most_recent"])
@pytest.mark.parametrize("margin,pow2,dtype", [(0, False, "e4m3"), (2, False, "e5m2"), (-3, True, "e4m3"),
                                               (0, True, "e5m2")])
def test_cuda_delayed_scale_matches_cpu(length, amax_compute, margin, pow2, dtype):
    history = random_history(length, "scale", amax_compute, margin, pow2)
    history[1, length // 2] = INF  # row 0 finite, row 1 an inf, row 2 a NaN (NaN wins over inf)
    history[2, length - 1] = NAN
    history[2, length // 3] = INF
    for h in (history, column_major(history)):
        h_cuda = h.cuda()
        assert h_cuda.stride() == h.stride()
        for row in range(3):
            want = torch.ops.lowbit.fp8_delayed_scale(h, row, amax_compute, margin, pow2, dtype)
            got = torch.ops.lowbit.fp8_delayed_scale(h_cuda, row, amax_compute, margin, pow2, dtype)
            assert got.shape == () and got.is_cuda
            assert same_bits_nan_as_nan(got, want), (row, got, want)
        assert torch.equal(bits(h_cuda), bits(h))  # read only


@pytest.mark.cuda
@pytest.mark.parametrize("length", HISTORY_LENS)
def test_cuda_record_amax_matches_cpu(length):
    history = random_history(length, "record")
    history[2, 0] = NAN  # a NaN already recorded (by hand): a non-finite amax repeats it, bits and all
    op = torch.ops.lowbit.fp8_record_amax
    for want in (history.clone(), column_major(history)):
        got = want.cuda()
        assert got.stride() == want.stride()
        for i, amax in enumerate([3.5, INF, NAN, 0.0, -INF, 2.0**-140, 448.0, NAN, INF]):
            row = i % 3
            op(want, row, torch.tensor(amax))
            op(got, row, torch.tensor(amax, device="cuda"))
            assert torch.equal(bits(got), bits(want)), (i, amax)
        # An amax that is a view of the history itself (here the column the
        # roll drops), read before the row moves; a [1]-shaped amax.
        op(want, 1, want[1, -1])
        op(got, 1, got[1, -1])
        op(want, 0, torch.tensor([7.0]))
        op(got, 0, torch.tensor([7.0], device="cuda"))
        assert torch.equal(bits(got), bits(want))


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", RECIPES[2:4], ids=lambda r: r.amax_compute)
def test_cuda_forward_records_x_and_w_like_cpu(recipe):
    # The forward records x's and W's rows in one launch when it has both
    # amaxes (from its casts or given), one row when it has one, each with a
    # non-finite amax repeating the row's previous value; the same history
    # and the same delayed scales as the CPU op.
    x, w, _, _ = data((32,), 48, 64, ("cuda forward record", recipe.amax_compute))
    x_bad = x.clone()
    x_bad[3, 5] = INF
    cx, cw = lowbit.fp8_cast(x, "tensor"), lowbit.fp8_cast(w, "tensor")
    fp8_x = dict(x_scale=cx.scale, out_dtype=x.dtype)
    cached_w = dict(w_fp8=cw.data, w_fp8_scale=cw.scale)
    cases = {  # name: (x, kwargs)
        "x and W cast": (x, {}),
        "x with an inf cast, W cast": (x_bad, {}),
        "FP8 x with x_amax, W cast": (cx.data, dict(fp8_x, x_amax=cx.amax)),
        "FP8 x with an inf x_amax, cached W with w_amax": (cx.data, dict(fp8_x, **cached_w, x_amax=torch.tensor(INF),
                                                                         w_amax=cw.amax)),
        "x cast, cached W with a NaN w_amax": (x, dict(cached_w, w_amax=torch.tensor(NAN))),
        "FP8 x without x_amax, W cast (W only)": (cx.data, fp8_x),
        "FP8 x with x_amax, cached W without w_amax (x only)": (cx.data, dict(fp8_x, **cached_w, x_amax=cx.amax)),
        "x cast, cached W without w_amax (x only)": (x, cached_w),
    }
    args = lowbit.fp8._recipe_args(recipe)
    for name, (xs, kwargs) in cases.items():
        history = random_history(recipe.amax_history_len, "forward", name)
        outs = {}
        for device in ("cpu", "cuda"):
            h = history.clone().to(device)
            kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            out = torch.ops.lowbit.fp8_linear_forward(xs.to(device), w.to(device), None, h, *args, **kw)
            outs[device] = (h, out)
        (h_cpu, out_cpu), (h_cuda, out_cuda) = outs["cpu"], outs["cuda"]
        assert torch.equal(bits(h_cuda), bits(h_cpu)), name
        assert not torch.equal(h_cpu, history), name  # something was recorded
        if "x_scale" not in kwargs:  # x cast with the delayed scale: x_t_scale is it
            assert torch.equal(out_cuda[2].cpu(), out_cpu[2]), name
        if "w_fp8" not in kwargs:
            assert torch.equal(out_cuda[4].cpu(), out_cpu[4]), name


@pytest.mark.cuda
@pytest.mark.parametrize("length", [1, 3, 1500])
def test_cuda_graph_history_kernels_replay(length):
    # fp8_delayed_scale and fp8_record_amax captured in a CUDA graph: each
    # replay reads the history and the amax as they are then, so two
    # replays roll the history twice, as two CPU steps do.
    want = random_history(length, "graph")
    h = want.cuda()
    amax = torch.tensor(0.0, device="cuda")
    scale_args = ("max", 1, True, "e4m3")
    torch.ops.lowbit.fp8_delayed_scale(h.clone(), 0, *scale_args)  # first calls outside the capture
    torch.ops.lowbit.fp8_record_amax(h.clone(), 0, amax)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scale = torch.ops.lowbit.fp8_delayed_scale(h, 0, *scale_args)
        torch.ops.lowbit.fp8_record_amax(h, 0, amax)
        torch.ops.lowbit.fp8_record_amax(h, 2, amax)
    assert torch.equal(h.cpu(), want)  # the capture ran nothing
    original = want.clone()
    for value in (5.0, NAN):
        amax.fill_(value)
        want_scale = torch.ops.lowbit.fp8_delayed_scale(want, 0, *scale_args)
        torch.ops.lowbit.fp8_record_amax(want, 0, torch.tensor(value))
        torch.ops.lowbit.fp8_record_amax(want, 2, torch.tensor(value))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(scale), bits(want_scale)), value
        assert torch.equal(bits(h), bits(want)), value
    # Rolled twice: 5, then 5 again (the NaN was not recorded), then the old row.
    for row in (0, 2):
        assert torch.equal(h[row].cpu(), torch.cat([torch.tensor([5.0, 5.0]), original[row]])[:length]), row
    assert torch.equal(h[1].cpu(), original[1])
