"""lowbit.nvfp4_grouped_linear and lowbit.nn.Nvfp4GroupedLinear (block-diagonal
weights: each group's rows on its own columns of x)."""

import pytest
import torch

import lowbit
from linear_reference import REL_TOL, make_weight, rel_err


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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_grouped_module_follows_autocast(device):
    gen = torch.Generator().manual_seed(37)
    w = torch.randn(2 * 64, 128, generator=gen).to(torch.bfloat16)
    q = lowbit.nvfp4_quantize(w)
    mod = lowbit.nn.Nvfp4GroupedLinear.from_checkpoint(2, q.packed, q.block_scale, q.global_scale).to(device)
    x = torch.randn(3, 2, 128, generator=gen).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = mod(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, mod(x.to(torch.bfloat16)))
    if device == "cpu":  # FP32 x outside autocast: the CPU's (the CUDA op takes bf16 / fp16)
        assert mod(x).dtype == torch.float32
