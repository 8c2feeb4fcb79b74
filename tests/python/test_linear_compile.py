"""lowbit.nvfp4_linear under torch.library.opcheck, torch.compile (one graph
across M), torch.export and autograd (helpers: linear_reference.py)."""

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

import lowbit
from linear_reference import Stack, linear_grads, make_weight, rel_err, size_oblivious
from lowbit.nn import Nvfp4Linear


cuda = pytest.mark.cuda


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


def test_export_with_dynamic_batch():
    model = lowbit.quantize_(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
                             .to(torch.bfloat16), progress=False)
    x = torch.randn(5, 64).to(torch.bfloat16)
    exported = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    assert sum("lowbit.nvfp4_linear" in str(n.target) for n in exported.graph.nodes) == 2
    for m in (1, 9):
        x = torch.randn(m, 64).to(torch.bfloat16)
        assert torch.equal(exported.module()(x), model(x))


@pytest.mark.parametrize("compute", ["w4a16", "auto", "fp8"])
def test_compile_fullgraph_dynamic_no_recompile(compute):
    # "auto" (the FP8 path from AUTO_FP8_MIN_ROWS rows): M crosses
    # the threshold inside the op, one graph.
    model = Stack([64, 128, 48, 32], compute=compute)
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


@cuda
@pytest.mark.parametrize(
    "auto_rows,ms,graph_ms",
    [(None, (1, 7, 64, 65, 4096), (4, 4, 4, 32, 32, 32)), (64, (1, 63, 64, 300, 4096), (300, 300, 300))],
)
def test_cuda_compile_no_recompile_and_reduce_overhead_bitwise(auto_rows, ms, graph_ms):
    # One graph across M (with compute="auto" from 64 rows, on the cached
    # FP8 weight: as M crosses it too), and CUDA graphs bitwise the eager
    # result.
    model = Stack([1024, 2048, 512], device="cuda", auto_rows=auto_rows)
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
