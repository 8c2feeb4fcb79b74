"""lowbit.route / dense_router / hash_router / topk and lowbit.nn.Router
against the independent float64 reference in routing_reference.py (ids
exactly equal, weights to 1e-6 relative), plus the operator conventions:
opcheck, torch.compile, dynamic shapes, empty inputs, bad inputs, CUDA
graphs."""

import zlib

import pytest
import torch

import lowbit
import routing_reference as ref
from lowbit.nn import Router

SCORE_FUNCS = ["sqrtsoftplus", "sigmoid", "softmax"]
# float32 scoring vs the float64 reference: a few ulps of the score, the
# normalization sum and the scale.
W_RTOL = 1e-6


def check_route(logits, bias, k, score_func, n_group=1, topk_group=1, renormalize=True, scale=1.0, op=None,
                exact=False):
    """ids must equal the float64 reference's. Where two experts' float64
    biased scores are closer than float32 can resolve (relative 2e-6), the
    float32 kernels may order them either way; such swaps are the only
    difference allowed (none with exact=True, used for exactly tied inputs).
    Weights are checked against float64 at the returned ids."""
    w, ids = (op or lowbit.route)(logits, bias, k, score_func, n_group, topk_group, renormalize, scale)
    x = logits.cpu()
    b64 = None if bias is None else bias.cpu().double()
    want_w, want_ids = ref.route(x, b64, k, score_func, n_group, topk_group, renormalize, scale)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert w.shape == ids.shape == (logits.shape[0], k)
    got = ids.cpu().long()
    mismatch = got != want_ids
    if mismatch.any():
        where = mismatch.nonzero()[:4].tolist()
        assert not exact, f"{int(mismatch.sum())} id mismatches, first at {where}"
        s = ref.scores(x, score_func)
        biased = s + b64 if b64 is not None else s
        gb, wb = biased.gather(1, got)[mismatch], biased.gather(1, want_ids)[mismatch]
        close = (gb - wb).abs() <= 2e-6 * wb.abs().clamp_min(1e-30)
        assert close.all(), f"{int((~close).sum())} id mismatches beyond float32 resolution, first at {where}"
        assert mismatch.any(-1).float().mean() <= 0.05  # a few tokens, never a systematic shift
    s = ref.scores(x, score_func).gather(1, got)
    if renormalize:
        s = s / (s.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(w.cpu().double(), s * scale, rtol=W_RTOL, atol=1e-30)
    if not mismatch.any():
        torch.testing.assert_close(w.cpu().double(), want_w, rtol=W_RTOL, atol=1e-30)
    return w, ids


def seed_of(*parts):
    """A per-case seed that is the same in every process (hash() of a str is not)."""
    return zlib.crc32(repr(parts).encode())


def random_logits(M, E, dtype, gen, scale=2.0):
    return (torch.randn(M, E, generator=gen) * scale).to(dtype)


# DeepSeek shapes and a spread of others (E > 512 and k > 32 take the
# general CUDA path).
CONFIGS = [
    # E, k, score_func, n_group, topk_group
    (256, 6, "sqrtsoftplus", 1, 1),
    (384, 6, "sqrtsoftplus", 1, 1),
    (256, 8, "sigmoid", 8, 4),
    (64, 8, "softmax", 1, 1),
    (8, 2, "softmax", 1, 1),
    (33, 5, "sigmoid", 1, 1),
    (512, 32, "sqrtsoftplus", 4, 2),
    (160, 6, "sigmoid", 32, 7),
    (1024, 8, "sigmoid", 8, 4),
    (640, 48, "sqrtsoftplus", 1, 1),
    (64, 64, "softmax", 1, 1),
    (128, 8, "softmax", 1, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,k,score_func,n_group,topk_group", CONFIGS)
def test_route_matches_reference(E, k, score_func, n_group, topk_group, dtype):
    gen = torch.Generator().manual_seed(seed_of(E, k, score_func, dtype))
    logits = random_logits(37, E, dtype, gen)
    bias = torch.randn(E, generator=gen) * 0.1
    check_route(logits, bias, k, score_func, n_group, topk_group, True, 2.5)
    check_route(logits, None, k, score_func, n_group, topk_group, False, 1.0)


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (8, 3)])
def test_route_many_exact_ties(score_func, n_group, topk_group):
    gen = torch.Generator().manual_seed(7)
    E = 256
    # Logits and bias from tiny sets: most scores tie with many others, and
    # whole groups tie on their group score.
    logits = torch.randint(-2, 3, (64, E), generator=gen).float() * 0.5
    logits[:4] = 1.0  # every expert equal
    bias = torch.randint(0, 2, (E,), generator=gen).float() * 0.25
    check_route(logits, bias, 8, score_func, n_group, topk_group, exact=True)
    _, ids = check_route(logits, None, 8, score_func, n_group, topk_group, exact=True)
    assert ids[0].tolist() == list(range(8))  # all equal, no bias: lowest indices
    check_route(logits, torch.zeros(E), 8, score_func, n_group, topk_group, exact=True)


def test_route_group_limit_excludes_other_groups():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 64, generator=gen)
    logits[:, 8:16] += 10.0  # group 1 is the best group by far
    _, ids = check_route(logits, None, 4, "sigmoid", 8, 1, exact=True)
    assert ((ids >= 8) & (ids < 16)).all()


def test_route_nan_ranks_last():
    logits = torch.randn(4, 16)
    logits[:, 3] = float("nan")
    _, ids = lowbit.route(logits, None, 16, "sigmoid")
    assert (ids[:, -1] == 3).all()


def test_route_weights_sum_to_scale():
    gen = torch.Generator().manual_seed(1)
    w, _ = lowbit.route(random_logits(100, 256, torch.float32, gen), None, 6, "sqrtsoftplus", 1, 1, True, 1.5)
    torch.testing.assert_close(w.sum(-1), torch.full((100,), 1.5), rtol=1e-6, atol=0)


def test_route_noncontiguous_logits():
    gen = torch.Generator().manual_seed(2)
    base = random_logits(256, 50, torch.float32, gen)
    check_route(base.t(), None, 4, "sigmoid")  # [50, 256] view


def exact_dense_inputs(M, H, E, gen):
    # Multiples of 1/8 in [-1, 1]: every product and partial sum is exact in
    # float32, so float32 and float64 logits are identical (ties included).
    hidden = (torch.randint(-8, 9, (M, H), generator=gen) / 8).to(torch.bfloat16)
    weight = (torch.randint(-8, 9, (E, H), generator=gen) / 8).to(torch.bfloat16)
    return hidden, weight


@pytest.mark.parametrize("E,k,score_func,n_group,topk_group", CONFIGS[:4])
def test_dense_router_matches_reference(E, k, score_func, n_group, topk_group):
    gen = torch.Generator().manual_seed(E + k)
    hidden, weight = exact_dense_inputs(19, 128, E, gen)
    bias = torch.randn(E, generator=gen) * 0.1
    w, ids = lowbit.dense_router(hidden, weight, bias, k, score_func, n_group, topk_group, True, 2.5)
    logits = hidden.double() @ weight.double().t()
    want_w, want_ids = ref.route(logits, bias, k, score_func, n_group, topk_group, True, 2.5)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w.double(), want_w, rtol=W_RTOL, atol=0)


def test_dense_router_float32_operands():
    gen = torch.Generator().manual_seed(4)
    hidden, weight = (t.float() for t in exact_dense_inputs(5, 64, 32, gen))
    w, ids = lowbit.dense_router(hidden, weight, None, 4, "sigmoid")
    want_w, want_ids = ref.route(hidden.double() @ weight.double().t(), None, 4, "sigmoid")
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w.double(), want_w, rtol=W_RTOL, atol=0)


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_hash_router_matches_reference(score_func, id_dtype):
    gen = torch.Generator().manual_seed(9)
    V, E, k, M = 1000, 256, 6, 41
    table = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(V)]).int()
    tids = torch.randint(0, V, (M,), generator=gen).to(id_dtype)
    logits = random_logits(M, E, torch.float32, gen)
    w, ids = lowbit.hash_router(tids, table, logits, score_func, "gate", True, 1.5)
    want_w, want_ids = ref.hash_route(tids, table, logits, score_func, "gate", True, 1.5)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w.double(), want_w, rtol=W_RTOL, atol=0)
    w, ids = lowbit.hash_router(tids, table, logits.bfloat16(), score_func, "gate", False, 1.0)
    want_w, _ = ref.hash_route(tids, table, logits.bfloat16(), score_func, "gate", False, 1.0)
    torch.testing.assert_close(w.double(), want_w, rtol=W_RTOL, atol=0)


def test_hash_router_uniform_weighting():
    table = torch.tensor([[3, 1], [0, 2], [2, 2]], dtype=torch.int32)
    tids = torch.tensor([2, 0, 1, 0])
    w, ids = lowbit.hash_router(tids, table, None, weighting="uniform", routed_scaling_factor=3.0, n_experts=4)
    assert ids.tolist() == [[2, 2], [3, 1], [0, 2], [3, 1]]
    assert torch.equal(w, torch.full((4, 2), 1.5))


def test_hash_router_uniform_refuses_table_ids_outside_the_experts():
    table = torch.tensor([[3, 1], [-5, 2], [2, 1000]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"'tid2eid' row 1 \(token_ids position 0\) holds an expert id outside \[0, 4\)"):
        lowbit.hash_router(torch.tensor([1, 0]), table, None, weighting="uniform", n_experts=4)
    with pytest.raises(ValueError, match=r"'tid2eid' row 2 \(token_ids position 1\) holds an expert id outside \[0, 4\)"):
        lowbit.hash_router(torch.tensor([0, 2]), table, None, weighting="uniform", n_experts=4)
    # without logits the number of experts must be given, or ids cannot be checked
    with pytest.raises(ValueError, match=r"'n_experts' is required with weighting='uniform' and no 'logits'"):
        lowbit.hash_router(torch.tensor([0]), table, None, weighting="uniform")
    with pytest.raises(ValueError, match=r"'n_experts' must be in \[1, 2147483647\], got 0"):
        lowbit.hash_router(torch.tensor([0]), table, None, weighting="uniform", n_experts=0)
    with pytest.raises(ValueError, match=r"'n_experts' \(5\) must equal the experts of 'logits' \(4\)"):
        lowbit.hash_router(torch.tensor([0]), table, torch.randn(1, 4), weighting="uniform", n_experts=5)
    # with logits their width is the number of experts
    with pytest.raises(ValueError, match=r"'tid2eid' row 2 .* outside \[0, 4\)"):
        lowbit.hash_router(torch.tensor([2]), table, torch.randn(1, 4), weighting="uniform")
    w, ids = lowbit.hash_router(torch.tensor([0]), table, torch.randn(1, 4), weighting="uniform", n_experts=4)
    assert ids.tolist() == [[3, 1]] and w.tolist() == [[0.5, 0.5]]


def test_hash_router_refuses_nonfinite_scaling_factor():
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValueError, match=r"'routed_scaling_factor' must be finite, got"):
            lowbit.hash_router(torch.tensor([0]), table, torch.randn(1, 4), routed_scaling_factor=bad)
        with pytest.raises(ValueError, match=r"'routed_scaling_factor' must be finite, got"):
            lowbit.hash_router(torch.tensor([0]), table, None, weighting="uniform", routed_scaling_factor=bad,
                               n_experts=4)


def test_routing_ops_refuse_arguments_on_mixed_devices():
    # A meta tensor beside CPU tensors selects the Meta kernel; it must give
    # the device error the CPU and CUDA kernels give.
    meta = torch.device("meta")
    logits = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"'bias' must be on the device of 'logits' \(cpu\), got meta"):
        lowbit.route(logits, torch.zeros(16, device=meta), 2)
    with pytest.raises(ValueError, match=r"'bias' must be on the device of 'logits' \(meta\), got cpu"):
        lowbit.route(logits.to(meta), torch.zeros(16), 2)
    hidden, gate = torch.randn(4, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match=r"'weight' must be on the device of 'hidden' \(cpu\), got meta"):
        lowbit.dense_router(hidden, gate.to(meta), None, 2)
    with pytest.raises(ValueError, match=r"'bias' must be on the device of 'hidden' \(cpu\), got meta"):
        lowbit.dense_router(hidden, gate, torch.zeros(16, device=meta), 2)
    table = torch.zeros(10, 2, dtype=torch.int32)
    tids = torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"'tid2eid' must be on the device of 'token_ids' \(cpu\), got meta"):
        lowbit.hash_router(tids, table.to(meta), logits)
    with pytest.raises(ValueError, match=r"'logits' must be on the device of 'token_ids' \(cpu\), got meta"):
        lowbit.hash_router(tids, table, logits.to(meta))


def test_hash_router_out_of_range_raises_on_cpu():
    table = torch.zeros(10, 2, dtype=torch.int32)
    logits = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"'token_ids' holds 10 at position 1, outside the table's vocabulary \[0, 10\)"):
        lowbit.hash_router(torch.tensor([0, 10, 2]), table, logits)
    with pytest.raises(ValueError, match=r"'token_ids' holds -1 at position 0"):
        lowbit.hash_router(torch.tensor([-1, 0, 2], dtype=torch.int32), table, logits)
    table[5, 1] = 4
    with pytest.raises(ValueError, match=r"'tid2eid' row 5 .* outside \[0, 4\)"):
        lowbit.hash_router(torch.tensor([0, 5, 2]), table, logits)


def test_routing_ops_have_no_backward():
    # Inference ops: outputs of logits that require grad raise clearly when a
    # gradient is asked of them (instead of PyTorch's fallback: a warning and
    # wrong gradients).
    logits = torch.randn(6, 16, requires_grad=True)
    hidden = torch.randn(6, 32, requires_grad=True)
    gate = torch.randn(16, 32)
    table = torch.stack([torch.randperm(16)[:2] for _ in range(10)]).to(torch.int32)
    outputs = {
        "route": lowbit.route(logits, None, 2, "sigmoid")[0],
        "dense_router": lowbit.dense_router(hidden, gate, None, 2, "sigmoid")[0],
        "hash_router": lowbit.hash_router(torch.arange(6), table, logits)[0],
        "topk": lowbit.topk(logits, 2)[0],
    }
    for op, out in outputs.items():
        assert out.requires_grad
        with pytest.raises(NotImplementedError, match=rf"lowbit.{op} has no backward \(an inference op\)"):
            out.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols,k", [(3, 100, 1), (5, 4097, 64), (2, 131072, 64), (2, 20000, 2048), (1, 7, 7)])
def test_topk_matches_reference(rows, cols, k, dtype):
    gen = torch.Generator().manual_seed(rows * cols + k)
    x = torch.randn(rows, cols, generator=gen).to(dtype)
    values, idx = lowbit.topk(x, k)
    want_v, want_i = ref.topk(x, k)
    assert idx.dtype == torch.int32 and values.dtype == dtype
    assert torch.equal(idx.long(), want_i)
    assert torch.equal(values, want_v)


def test_topk_ties_nan_and_signed_zero():
    gen = torch.Generator().manual_seed(12)
    x = torch.randint(-3, 4, (6, 5000), generator=gen).float()
    x[0, 17] = float("nan")
    x[0, 3] = float("nan")
    x[1, :] = -0.0
    x[1, ::3] = 0.0
    x[2, 100] = float("inf")
    x[3, :] = float("-inf")
    values, idx = lowbit.topk(x, 50)
    want_v, want_i = ref.topk(x, 50)
    assert torch.equal(idx.long(), want_i)
    assert idx[0, :2].tolist() == [3, 17]
    assert torch.equal(values.view(torch.int32), want_v.view(torch.int32))  # bit for bit, -0.0 kept


# ---------------------------------------------------------- module ----------

def dsv4_state(E=16, H=32, V=50, k=3, gen=None):
    return {
        "weight": torch.randn(E, H, generator=gen).bfloat16(),
        "e_score_correction_bias": torch.randn(E, generator=gen) * 0.1,
        "tid2eid": torch.randint(0, E, (V, k), generator=gen),
    }


def test_router_module_dense_and_hash():
    gen = torch.Generator().manual_seed(21)
    state = dsv4_state(gen=gen)
    dense = Router(32, 16, 3, score_func="sqrtsoftplus", routed_scaling_factor=1.5)
    dense.load_state_dict({k: v for k, v in state.items() if k != "tid2eid"})
    x = torch.randn(7, 32, generator=gen).bfloat16()
    w, ids = dense(x)
    want_w, want_ids = lowbit.dense_router(x, state["weight"], state["e_score_correction_bias"], 3, "sqrtsoftplus",
                                           1, 1, True, 1.5)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)

    hashed = Router(32, 16, 3, mode="hash", vocab_size=50, routed_scaling_factor=1.5)
    hashed.load_state_dict(state)
    assert hashed.tid2eid.dtype == torch.int32
    tids = torch.randint(0, 50, (7,), generator=gen)
    w, ids = hashed(x, tids)
    logits = x.double() @ state["weight"].double().t()
    want_w, want_ids = ref.hash_route(tids, state["tid2eid"], logits, "sqrtsoftplus", "gate", True, 1.5)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w.double(), want_w, rtol=1e-5, atol=0)


def test_router_module_validates_table_once():
    state = dsv4_state()
    state["tid2eid"][4, 1] = 16
    hashed = Router(32, 16, 3, mode="hash", vocab_size=50)
    with pytest.raises(ValueError, match=r"tid2eid.*\[0, 16\)"):
        hashed.load_state_dict(state)
    with pytest.raises(ValueError, match="mode"):
        Router(32, 16, 3, mode="random")


def test_router_module_refuses_bad_configuration():
    with pytest.raises(ValueError, match=r"Router: argument 'k' must be in \[1, 16\] \(n_experts\), got 17"):
        Router(32, 16, 17)
    with pytest.raises(ValueError, match=r"Router: argument 'k' must be in \[1, 16\] \(n_experts\), got 0"):
        Router(32, 16, 0)
    with pytest.raises(ValueError, match=r"Router: argument 'n_experts' must be >= 1, got 0"):
        Router(32, 0, 1)
    with pytest.raises(ValueError, match=r"Router: argument 'hidden_size' must be >= 1, got 0"):
        Router(0, 16, 2)
    with pytest.raises(ValueError, match=r"Router: argument 'n_group' must divide n_experts \(16\), got 3"):
        Router(32, 16, 2, score_func="sigmoid", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match=r"Router: argument 'topk_group' must be in \[1, 4\] \(n_group\), got 5"):
        Router(32, 16, 2, score_func="sigmoid", n_group=4, topk_group=5)
    with pytest.raises(ValueError, match=r"Router: argument 'k' \(9\) exceeds the experts in the kept groups"):
        Router(32, 16, 9, score_func="sigmoid", n_group=4, topk_group=2)
    with pytest.raises(ValueError, match=r"Router: argument 'score_func' must be 'sqrtsoftplus', 'sigmoid' or "
                                         r"'softmax', got 'relu'"):
        Router(32, 16, 2, score_func="relu")
    with pytest.raises(ValueError, match=r"Router: argument 'score_func' must be 'sqrtsoftplus' or 'sigmoid' with "
                                         r"mode='hash', got 'softmax'"):
        Router(32, 16, 2, mode="hash", vocab_size=10, score_func="softmax")
    with pytest.raises(ValueError, match=r"Router: argument 'routed_scaling_factor' must be finite, got nan"):
        Router(32, 16, 2, routed_scaling_factor=float("nan"))
    with pytest.raises(ValueError, match=r"Router: argument 'vocab_size' must be >= 1, got 0"):
        Router(32, 16, 2, mode="hash", vocab_size=0)


def test_router_module_refuses_bad_inputs_naming_its_arguments():
    dense = Router(32, 16, 3)
    with pytest.raises(ValueError, match=r"Router: argument 'hidden' must have last dimension 32 \(hidden_size\), "
                                         r"got shape \(7, 30\)"):
        dense(torch.randn(7, 30).bfloat16())
    with pytest.raises(TypeError, match=r"Router: argument 'hidden' must have dtype torch.bfloat16 \(the gate "
                                        r"weight's\), got torch.float32"):
        dense(torch.randn(7, 32))
    hashed = Router(32, 16, 3, mode="hash", vocab_size=50)
    x = torch.randn(2, 5, 32).bfloat16()
    with pytest.raises(ValueError, match=r"Router: argument 'token_ids' is required in hash mode"):
        hashed(x)
    with pytest.raises(ValueError, match=r"Router: argument 'token_ids' must have shape \(2, 5\) \(the leading "
                                         r"dimensions of 'hidden'\), got \(10,\)"):
        hashed(x, torch.zeros(10, dtype=torch.long))
    with pytest.raises(TypeError, match=r"Router: argument 'token_ids' must have dtype torch.int64 or torch.int32, "
                                        r"got torch.float32"):
        hashed(x, torch.zeros(2, 5))
    w, ids = hashed(x, torch.zeros(2, 5, dtype=torch.long))
    assert w.shape == ids.shape == (2, 5, 3)


# ------------------------------------------------------ conventions ---------

def test_opcheck():
    gen = torch.Generator().manual_seed(5)
    logits = random_logits(12, 64, torch.float32, gen)
    bias = torch.randn(64, generator=gen)
    torch.library.opcheck(torch.ops.lowbit.route.default, (logits, bias, 6, "sigmoid", 4, 2, True, 2.5))
    torch.library.opcheck(torch.ops.lowbit.route.default, (logits.bfloat16(), None, 3, "softmax", 1, 1, False, 1.0))
    hidden, weight = exact_dense_inputs(6, 64, 32, gen)
    torch.library.opcheck(torch.ops.lowbit.dense_router.default, (hidden, weight, None, 4, "sqrtsoftplus", 1, 1,
                                                                   True, 1.0))
    table = torch.randint(0, 64, (30, 4), generator=gen).int()
    tids = torch.randint(0, 30, (12,), generator=gen)
    torch.library.opcheck(torch.ops.lowbit.hash_router.default, (tids, table, logits, "sqrtsoftplus", "gate", True,
                                                                  1.5))
    torch.library.opcheck(torch.ops.lowbit.topk.default, (torch.randn(3, 300, generator=gen), 10))


def router_chain(x, w, bias, tids, table):
    logits_w, ids = lowbit.dense_router(x, w, bias, 6, "sqrtsoftplus", 1, 1, True, 1.5)
    hw, hids = lowbit.hash_router(tids, table, x.float() @ w.float().t())
    v, i = lowbit.topk(x.float(), 4)
    return logits_w, ids, hw, hids, v, i


def chain_inputs(M, gen):
    x, w = exact_dense_inputs(M, 64, 32, gen)
    return x, w, torch.randn(32, generator=gen) * 0.1, torch.randint(0, 20, (M,), generator=gen), \
        torch.randint(0, 32, (20, 6), generator=gen).int()


def test_compile_fullgraph_matches_eager():
    gen = torch.Generator().manual_seed(8)
    args = chain_inputs(9, gen)
    compiled = torch.compile(router_chain, fullgraph=True)
    for a, b in zip(compiled(*args), router_chain(*args)):
        assert torch.equal(a, b)


def test_dynamic_tokens_do_not_recompile():
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(router_chain, backend=counter, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(9)
    for M in (3, 17, 64, 250):
        args = chain_inputs(M, gen)
        for a, b in zip(compiled(*args), router_chain(*args)):
            assert torch.equal(a, b)
    assert counter.frame_count == 1


def test_empty_batch():
    w, ids = lowbit.route(torch.empty(0, 64), torch.zeros(64), 4, "sigmoid", 8, 2)
    assert w.shape == ids.shape == (0, 4)
    w, ids = lowbit.dense_router(torch.empty(0, 32, dtype=torch.bfloat16), torch.randn(16, 32).bfloat16(), None, 2)
    assert w.shape == (0, 2)
    w, ids = lowbit.hash_router(torch.empty(0, dtype=torch.long), torch.zeros(5, 3, dtype=torch.int32),
                                torch.empty(0, 8))
    assert ids.shape == (0, 3)
    v, i = lowbit.topk(torch.empty(0, 100), 5)
    assert v.shape == i.shape == (0, 5)


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"'k' must be in \[1, 64\] \(experts\), got 65"):
        lowbit.route(x, None, 65)
    with pytest.raises(ValueError, match=r"'score_func' must be 'sqrtsoftplus', 'sigmoid' or 'softmax', got 'relu'"):
        lowbit.route(x, None, 4, "relu")
    with pytest.raises(TypeError, match=r"'logits' must have dtype Float or BFloat16, got Half"):
        lowbit.route(x.half(), None, 4)
    with pytest.raises(ValueError, match=r"'logits' must be 2-D, got shape \[64\]"):
        lowbit.route(x[0], None, 4)
    with pytest.raises(ValueError, match=r"'bias' must have shape \[64\], got \[32\]"):
        lowbit.route(x, torch.zeros(32), 4)
    with pytest.raises(TypeError, match=r"'bias' must have dtype Float, got BFloat16"):
        lowbit.route(x, torch.zeros(64, dtype=torch.bfloat16), 4)
    with pytest.raises(ValueError, match=r"'n_group' must divide the number of experts \(64\), got 6"):
        lowbit.route(x, None, 4, "sigmoid", 6, 2)
    with pytest.raises(ValueError, match=r"'topk_group' must be in \[1, 8\]"):
        lowbit.route(x, None, 4, "sigmoid", 8, 9)
    with pytest.raises(ValueError, match=r"'k' \(20\) exceeds the experts in the kept groups"):
        lowbit.route(x, None, 20, "sigmoid", 8, 2)
    with pytest.raises(ValueError, match=r"'weight' must have shape \[E, 64\]"):
        lowbit.dense_router(x.bfloat16(), torch.randn(8, 32).bfloat16(), None, 2)
    with pytest.raises(TypeError, match=r"'weight' must have dtype BFloat16, got Float"):
        lowbit.dense_router(x.bfloat16(), torch.randn(8, 64), None, 2)
    with pytest.raises(TypeError, match=r"'tid2eid' must have dtype Int, got Long"):
        lowbit.hash_router(torch.zeros(4, dtype=torch.long), torch.zeros(5, 2, dtype=torch.long), x)
    with pytest.raises(ValueError, match=r"'logits' is required with weighting='gate'"):
        lowbit.hash_router(torch.zeros(4, dtype=torch.long), torch.zeros(5, 2, dtype=torch.int32), None)
    with pytest.raises(ValueError, match=r"'score_func' must be 'sqrtsoftplus' or 'sigmoid', got 'softmax'"):
        lowbit.hash_router(torch.zeros(4, dtype=torch.long), torch.zeros(5, 2, dtype=torch.int32), x, "softmax")
    with pytest.raises(ValueError, match=r"'logits' must have shape \[3, E\]"):
        lowbit.hash_router(torch.zeros(3, dtype=torch.long), torch.zeros(5, 2, dtype=torch.int32), x)
    with pytest.raises(ValueError, match=r"'k' must be in \[1, min\(100 \(row width\), 2048\)\], got 101"):
        lowbit.topk(torch.randn(2, 100), 101)
    with pytest.raises(ValueError, match=r"'input' rows may be at most 131072 wide"):
        lowbit.topk(torch.randn(1, 131073), 4)


# ---------------------------------------------------------------- CUDA ------

cuda = pytest.mark.cuda


# The CUDA fast path routes a token with a whole CTA up to 256 tokens
# (E > 64) and with one warp above that: M = 5 and M = 1000 take one each.
@cuda
@pytest.mark.parametrize("M", [5, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,k,score_func,n_group,topk_group", CONFIGS)
def test_cuda_route_matches_reference_and_cpu(E, k, score_func, n_group, topk_group, dtype, M):
    gen = torch.Generator().manual_seed(E * 31 + k + M)
    logits = random_logits(M, E, dtype, gen)
    bias = torch.randn(E, generator=gen) * 0.1
    w, ids = check_route(logits.cuda(), bias.cuda(), k, score_func, n_group, topk_group, True, 2.5)
    cw, cids = lowbit.route(logits, bias, k, score_func, n_group, topk_group, True, 2.5)
    # CPU and GPU libm differ by ulps: only float32-level near-ties may differ.
    same = (ids.cpu() == cids).all(-1)
    assert same.float().mean() > 0.99
    torch.testing.assert_close(w.cpu()[same], cw[same], rtol=1e-6, atol=0)


@cuda
@pytest.mark.parametrize("score_func", SCORE_FUNCS)
def test_cuda_route_many_exact_ties(score_func):
    gen = torch.Generator().manual_seed(70)
    logits = torch.randint(-2, 3, (512, 256), generator=gen).float() * 0.5
    bias = torch.randint(0, 2, (256,), generator=gen).float() * 0.25
    for ng, tg in ((1, 1), (8, 4)):
        for rows in (512, 40):  # warp-per-token and CTA-per-token paths
            check_route(logits[:rows].cuda(), bias.cuda(), 8, score_func, ng, tg, exact=True)
            check_route(logits[:rows].cuda(), None, 8, score_func, ng, tg, exact=True)


@cuda
@pytest.mark.parametrize("E,k,score_func,n_group,topk_group",
                         [(256, 6, "sqrtsoftplus", 1, 1), (384, 6, "sqrtsoftplus", 1, 1), (256, 8, "sigmoid", 8, 4),
                          (512, 32, "sqrtsoftplus", 4, 2), (160, 6, "sigmoid", 32, 7), (128, 8, "softmax", 1, 1)])
def test_cuda_route_team_and_warp_paths_agree(E, k, score_func, n_group, topk_group):
    # 300 tokens take the warp-per-token kernel, their first 100 alone the
    # CTA-per-token one: same picks in the same order, same weight sums.
    gen = torch.Generator().manual_seed(E + k)
    logits = random_logits(300, E, torch.float32, gen).cuda()
    bias = (torch.randn(E, generator=gen) * 0.1).cuda()
    w_all, ids_all = lowbit.route(logits, bias, k, score_func, n_group, topk_group, True, 2.5)
    w_few, ids_few = lowbit.route(logits[:100], bias, k, score_func, n_group, topk_group, True, 2.5)
    assert torch.equal(ids_few, ids_all[:100])
    if score_func == "softmax":  # the normalizer is summed per warp first
        torch.testing.assert_close(w_few, w_all[:100], rtol=1e-6, atol=0)
    else:
        assert torch.equal(w_few, w_all[:100])


@cuda
# M <= 64 (bf16, E % 16 == 0, H % 64 == 0) takes the split-K gate GEMM, in
# its M = 1-8, 9-16, 17-32 and 33-64 forms (E = 48: one 16-expert tile per
# warp, and the warp-per-token route); H = 1032, E = 1024 or M > 64 take
# cuBLAS.
@pytest.mark.parametrize("M", [1, 3, 4, 16, 33, 64, 65, 300])
@pytest.mark.parametrize("E,k,score_func,n_group,topk_group,H",
                         [(256, 6, "sqrtsoftplus", 1, 1, 512), (384, 6, "sqrtsoftplus", 1, 1, 7168),
                          (256, 8, "sigmoid", 8, 4, 1032), (256, 8, "sigmoid", 8, 4, 1024),
                          (48, 4, "sigmoid", 1, 1, 256), (1024, 8, "sigmoid", 1, 1, 256)])
def test_cuda_dense_router_exact_inputs(M, E, k, score_func, n_group, topk_group, H):
    gen = torch.Generator().manual_seed(M * 7 + E)
    hidden, weight = exact_dense_inputs(M, H, E, gen)
    bias = torch.randn(E, generator=gen) * 0.1
    w, ids = lowbit.dense_router(hidden.cuda(), weight.cuda(), bias.cuda(), k, score_func, n_group, topk_group,
                                 True, 2.5)
    want_w, want_ids = ref.route(hidden.double() @ weight.double().t(), bias, k, score_func, n_group, topk_group,
                                 True, 2.5)
    assert torch.equal(ids.cpu().long(), want_ids)
    torch.testing.assert_close(w.cpu().double(), want_w, rtol=W_RTOL, atol=0)


@cuda
@pytest.mark.parametrize("M", [1, 8, 64, 200])
def test_cuda_dense_router_random_matches_fp32_logits(M):
    gen = torch.Generator().manual_seed(M)
    hidden = torch.randn(M, 4096, generator=gen).bfloat16().cuda()
    weight = (torch.randn(256, 4096, generator=gen) * 0.02).bfloat16().cuda()
    w, ids = lowbit.dense_router(hidden, weight, None, 6)
    logits = hidden.double() @ weight.double().t()
    want_w, want_ids = ref.route(logits.cpu(), None, 6, "sqrtsoftplus")
    # float32 accumulation over H = 4096 differs from float64 by ~1e-6
    # relative: ids can only differ where two scores are that close.
    agree = (ids.cpu().long() == want_ids).all(-1).float().mean().item()
    assert agree > 0.99
    torch.testing.assert_close(w.cpu().double(), want_w, rtol=1e-4, atol=1e-6)


@cuda
@pytest.mark.parametrize("M", [1, 16, 33, 64])
def test_cuda_dense_router_small_m_path_is_deterministic_and_matches_cublas_path(M):
    # M <= 64 with bf16, E % 16 == 0, H % 64 == 0 takes lowbit's split-K gate
    # GEMM; a misaligned copy of the same hidden states takes cuBLAS.
    gen = torch.Generator().manual_seed(100 + M)
    hidden = torch.randn(M, 7168, generator=gen).bfloat16().cuda()
    weight = (torch.randn(384, 7168, generator=gen) * 0.02).bfloat16().cuda()
    first = lowbit.dense_router(hidden, weight, None, 6)
    for _ in range(3):
        again = lowbit.dense_router(hidden, weight, None, 6)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    storage = torch.empty(M * 7168 + 1, dtype=torch.bfloat16, device="cuda")
    misaligned = storage[1:].view(M, 7168)
    misaligned.copy_(hidden)
    other = lowbit.dense_router(misaligned, weight, None, 6)
    same = (other[1] == first[1]).all(-1)
    assert same.float().mean() >= 0.9  # float32 sums in another order: only near-ties may swap
    torch.testing.assert_close(other[0][same], first[0][same], rtol=1e-5, atol=1e-7)


@cuda
def test_cuda_hash_router_and_out_of_range_guard():
    gen = torch.Generator().manual_seed(10)
    V, E, k, M = 129280, 256, 6, 500
    table = torch.randint(0, E, (V, k), generator=gen).int()
    tids = torch.randint(0, V, (M,), generator=gen)
    logits = random_logits(M, E, torch.float32, gen)
    w, ids = lowbit.hash_router(tids.cuda(), table.cuda(), logits.cuda(), "sqrtsoftplus", "gate", True, 1.5)
    want_w, want_ids = ref.hash_route(tids, table, logits, "sqrtsoftplus", "gate", True, 1.5)
    assert torch.equal(ids.cpu().long(), want_ids)
    torch.testing.assert_close(w.cpu().double(), want_w, rtol=W_RTOL, atol=0)
    bad = tids.clone()
    bad[3] = V
    bad[7] = -5
    table_bad = table.clone()
    table_bad[bad[11]] = E  # whole row of token 11 invalid
    w, ids = lowbit.hash_router(bad.cuda(), table_bad.cuda(), logits.cuda())
    valid = (bad >= 0) & (bad < V)
    invalid = ~valid
    invalid[valid] = (table_bad[bad[valid]] >= E).any(1)
    assert invalid[[3, 7, 11]].all()
    assert (ids.cpu()[invalid] == -1).all() and (w.cpu()[invalid] == 0).all()
    assert torch.equal(ids.cpu()[~invalid].long(), want_ids[~invalid])


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols,k", [(1, 131072, 64), (33, 131072, 8), (7, 5000, 2048), (100, 256, 6),
                                         (3, 131072, 2048), (2, 4096, 4096 // 2)])
def test_cuda_topk_matches_reference(rows, cols, k, dtype):
    gen = torch.Generator().manual_seed(rows + cols + k)
    x = torch.randn(rows, cols, generator=gen).to(dtype)
    x[:, ::97] = x[:, 5:6]  # plenty of exact ties
    values, idx = lowbit.topk(x.cuda(), k)
    want_v, want_i = ref.topk(x, k)
    assert torch.equal(idx.cpu().long(), want_i)
    assert torch.equal(values.cpu(), want_v)


@cuda
def test_cuda_topk_ties_nan():
    x = torch.randint(-3, 4, (6, 70000)).float()
    x[0, 17] = float("nan")
    x[1, :] = -0.0
    x[1, ::3] = 0.0
    x[3, :] = float("-inf")
    values, idx = lowbit.topk(x.cuda(), 64)
    want_v, want_i = ref.topk(x, 64)
    assert torch.equal(idx.cpu().long(), want_i)
    assert torch.equal(values.cpu().view(torch.int32), want_v.view(torch.int32))


@cuda
def test_cuda_graph_capture_and_replay():
    gen = torch.Generator().manual_seed(11)
    args = [t.cuda() for t in chain_inputs(48, gen)]
    expected = router_chain(*args)
    static = [a.clone() for a in args]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        router_chain(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = router_chain(*static)
    fresh = [t.cuda() for t in chain_inputs(48, gen)]
    for s, f in zip(static, fresh):
        s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, router_chain(*fresh)):
        assert torch.equal(a, b)
    for s, a in zip(static, args):
        s.copy_(a)
    graph.replay()
    for a, b in zip(outs, expected):
        assert torch.equal(a, b)


@cuda
def test_cuda_compile_reduce_overhead_matches_eager():
    gen = torch.Generator().manual_seed(12)
    args = [t.cuda() for t in chain_inputs(16, gen)]
    compiled = torch.compile(router_chain, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        for a, b in zip(compiled(*args), router_chain(*args)):
            assert torch.equal(a, b)


@cuda
def test_cuda_router_module():
    gen = torch.Generator().manual_seed(13)
    state = dsv4_state(E=256, H=512, V=1000, k=6, gen=gen)
    r = Router(512, 256, 6, mode="hash", vocab_size=1000).cuda()
    r.load_state_dict(state)
    x = torch.randn(9, 512, generator=gen).bfloat16().cuda()
    tids = torch.randint(0, 1000, (9,), generator=gen).cuda()
    w, ids = r(x, tids)
    assert torch.equal(ids.cpu().long(), state["tid2eid"][tids.cpu()])
