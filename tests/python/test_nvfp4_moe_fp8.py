"""The MoE's FP8 path (lowbit.nvfp4_moe from fp8_min_rows rows, on the
experts' E4M3 form from lowbit.nvfp4_moe_to_fp8) against the independent
float64 reference moe_reference.fp8_moe, and the CUDA kernels against the
CPU op.

Tolerances: the quantized weights are compared bit for bit. The outputs
differ from the reference only by the order of FP32 sums, which can move a
BF16 rounding of gate / up or y by one unit (2^-8 relative), and through
that, rarely, an activation's E4M3 code by one step: FP8_REF_TOL. Against
the W4A16 result: E4M3 keeps 3 mantissa bits (unit roundoff 2^-4, a
relative error of ~2^-4 / sqrt(3) = 3.6% RMS per rounded element), and the
path rounds four operands in series (x, W13, h, W2), so ~sqrt(4) x 3.6% =
7.2% (measured 6.7-6.9% without a SwiGLU clamp): FP8_PATH_TOL.
"""

import pytest
import torch

import lowbit
import moe_reference as ref
from test_nvfp4_moe import Experts, random_routing, random_x, rel_err, seed_of

FP8_REF_TOL = 4e-3
FP8_PATH_TOL = 9e-2
# CUDA against the CPU op: torch's grouped FP8 GEMMs accumulate with the
# tensor cores' fast accumulation (moe_fp8_cuda in csrc/torch/moe_ops_cuda.cpp:
# up to 256 rows per expert on average) where the CPU op sums exactly: their outputs differ by 1.6-2.3e-3
# relative (measured on an H200 at K = 2048-7168, docs/perf/log/moe.md, "MoE
# v14"), and each SwiGLU value that lies that close to an E4M3 rounding
# midpoint moves its code a step (6% of the value): 1.7e-2 measured at H =
# 7168 (4.4-5.6e-3 with exact accumulation), less at smaller H.
FP8_CUDA_TOL = 3e-2
cuda = pytest.mark.cuda


def values(q):
    """Stacked checkpoint weights -> e2m1 x block scale, the global left out."""
    return ref.dequantize_experts(q.packed, q.block_scale, torch.ones(q.packed.shape[0]))


def fp8_form(exp):
    return lowbit.nvfp4_moe_to_fp8(*exp.args())


def run_fp8(exp, x, w, ids, limit=None, fp8_min_rows=1, form=None):
    form = fp8_form(exp) if form is None else form
    return lowbit.nvfp4_moe(x, w, ids, *exp.args(), limit, fp8_min_rows, *form)


def small_case(seed, M):
    """4 experts of H = 144, I = 48 with their E4M3 form, M tokens routed to 2."""
    gen = torch.Generator().manual_seed(seed)
    exp = Experts(4, 144, 48, gen)
    x = random_x(M, 144, torch.bfloat16, gen)
    w, ids = random_routing(M, 4, 2, gen)
    return gen, exp, fp8_form(exp), x, w, ids


def reference(exp, x, w, ids, limit=None, drop_invalid=False):
    return ref.fp8_moe(x, w, ids, values(exp.q13), exp.q13.global_scale, values(exp.q2), exp.q2.global_scale,
                       limit, drop_invalid)


@pytest.mark.parametrize("E,H,I", [(4, 144, 48), (8, 256, 128), (3, 1024, 272)])
def test_fp8_form_matches_the_rule_bit_for_bit(E, H, I):
    gen = torch.Generator().manual_seed(seed_of("form", E, H, I))
    exp = Experts(E, H, I, gen)
    form = fp8_form(exp)
    assert form.w13_fp8.shape == (E, 2 * I, H) and form.w13_fp8.dtype == torch.float8_e4m3fn
    assert form.w2_fp8.shape == (E, H, I) and form.w13_fp8_scale.shape == (E, 2 * I)
    assert form.w2_fp8_scale.shape == (E, H) and form.w2_fp8_scale.dtype == torch.float32
    v13, v2 = values(exp.q13), values(exp.q2)
    for e in range(E):
        for got, got_scale, vals, g in ((form.w13_fp8[e], form.w13_fp8_scale[e], v13[e], exp.q13.global_scale[e]),
                                        (form.w2_fp8[e], form.w2_fp8_scale[e], v2[e], exp.q2.global_scale[e])):
            codes, scale = ref.fp8_expert_rows(vals, g)
            assert torch.equal(got.double(), codes)
            assert torch.equal(got_scale, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M,H,I,E,k,limit", [(16, 256, 128, 8, 2, None), (24, 512, 256, 16, 6, 0.05),
                                             (5, 144, 48, 4, 3, None), (33, 256, 128, 64, 6, 0.02)])
def test_cpu_matches_reference(M, H, I, E, k, limit, dtype):
    gen = torch.Generator().manual_seed(seed_of("fp8", M, H, I, E, k, str(dtype)))
    exp = Experts(E, H, I, gen)
    x = random_x(M, H, dtype, gen)
    w, ids = random_routing(M, E, k, gen)
    y = run_fp8(exp, x, w, ids, limit)
    assert y.dtype == dtype and y.shape == (M, H)
    assert rel_err(y, reference(exp, x, w, ids, limit)) <= FP8_REF_TOL
    if limit is None:  # the price of E4M3 against the W4A16 path on the same NVFP4 weights
        assert rel_err(y, exp.reference(x, w, ids)) <= FP8_PATH_TOL


def test_threshold_picks_the_path_inside_the_op():
    gen = torch.Generator().manual_seed(3)
    exp = Experts(8, 256, 128, gen)
    form = fp8_form(exp)
    for M in (3, 4, 9):
        x = random_x(M, 256, torch.bfloat16, gen)
        w, ids = random_routing(M, 8, 2, gen)
        y = run_fp8(exp, x, w, ids, fp8_min_rows=4, form=form)
        want = run_fp8(exp, x, w, ids, fp8_min_rows=1, form=form) if M >= 4 else exp.run(x, w, ids)
        assert torch.equal(y, want), M
    # the two paths differ, so the check above can tell them apart
    assert not torch.equal(run_fp8(exp, x, w, ids, form=form), exp.run(x, w, ids))


def test_empty_batch_and_uint8_codes():
    gen = torch.Generator().manual_seed(4)
    exp = Experts(4, 144, 48, gen)
    form = fp8_form(exp)
    w, ids = random_routing(0, 4, 2, gen)
    assert run_fp8(exp, random_x(0, 144, torch.bfloat16, gen), w, ids, form=form).shape == (0, 144)
    x = random_x(6, 144, torch.bfloat16, gen)
    w, ids = random_routing(6, 4, 2, gen)
    as_bytes = form._replace(w13_fp8=form.w13_fp8.view(torch.uint8), w2_fp8=form.w2_fp8.view(torch.uint8))
    assert torch.equal(run_fp8(exp, x, w, ids, form=as_bytes), run_fp8(exp, x, w, ids, form=form))


def test_bad_fp8_arguments_raise_clear_errors():
    gen, exp, form, x, w, ids = small_case(5, 3)
    args = (x, w, ids, *exp.args(), None)
    with pytest.raises(ValueError, match=r"'fp8_min_rows' must be >= 0"):
        lowbit.nvfp4_moe(*args, -1)
    with pytest.raises(ValueError, match=r"argument 'w13_fp8' is used only by the FP8 path"):
        lowbit.nvfp4_moe(*args, 0, *form)
    with pytest.raises(ValueError, match=r"argument 'w2_fp8_scale' is missing \(lowbit.nvfp4_moe_to_fp8"):
        lowbit.nvfp4_moe(*args, 1, *form[:3])
    with pytest.raises(ValueError, match=r"argument 'w13_fp8' must have shape"):
        lowbit.nvfp4_moe(*args, 1, form.w13_fp8[:, :-16], *form[1:])
    with pytest.raises(TypeError, match=r"argument 'w2_fp8_scale' must have dtype"):
        lowbit.nvfp4_moe(*args, 1, *form[:3], form.w2_fp8_scale.double())
    many = Experts(1024, 64, 16, gen)
    xm = random_x(2, 64, torch.bfloat16, gen)
    wm, idm = random_routing(2, 1024, 2, gen)
    with pytest.raises(ValueError, match=r"the FP8 path \(fp8_min_rows > 0\) takes at most 1023 experts"):
        lowbit.nvfp4_moe(xm, wm, idm, *many.args(), None, 1, *fp8_form(many))
    with pytest.raises(ValueError, match=r"nvfp4_moe_to_fp8: argument 'w13' must be prepacked"):
        lowbit.nvfp4_moe_to_fp8(exp.packed.w13[:, :, :-8], *exp.args()[1:])
    with pytest.raises(ValueError, match=r"nvfp4_moe_to_fp8: argument 'w2_global' must have shape"):
        lowbit.nvfp4_moe_to_fp8(*exp.args()[:5], exp.g2[:-1])


def test_opcheck():
    _, exp, form, x, w, ids = small_case(6, 5)
    torch.library.opcheck(torch.ops.lowbit.nvfp4_moe_to_fp8.default, exp.args())
    # float8 inputs: every test but test_schema, which compares inputs with
    # allclose (no float8 kernel); uint8 codes: all four.
    torch.library.opcheck(torch.ops.lowbit.nvfp4_moe.default, (x, w, ids, *exp.args(), 0.25, 1, *form),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    as_bytes = (form.w13_fp8.view(torch.uint8), form.w13_fp8_scale, form.w2_fp8.view(torch.uint8), form.w2_fp8_scale)
    torch.library.opcheck(torch.ops.lowbit.nvfp4_moe.default, (x, w, ids, *exp.args(), None, 2, *as_bytes))


# ---------------------------------------------------------------- CUDA ------

@cuda
def test_cuda_fp8_form_matches_cpu_bit_for_bit():
    gen = torch.Generator().manual_seed(7)
    exp = Experts(6, 1024, 272, gen)
    want = fp8_form(exp)
    got = fp8_form(exp.to("cuda"))
    for g, w in zip(got, want):
        assert g.device.type == "cuda" and torch.equal(g.cpu().view(torch.uint8) if g.dtype != torch.float32
                                                       else g.cpu(), w.view(torch.uint8) if w.dtype != torch.float32
                                                       else w)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,H,I,E,k", [(1, 256, 128, 8, 2), (37, 1024, 512, 64, 6), (300, 2048, 1024, 32, 8),
                                       (1024, 7168, 256, 16, 8), (64, 144, 48, 4, 3), (600, 1024, 256, 16, 5),
                                       (10000, 256, 64, 600, 8)])
def test_cuda_matches_cpu(M, H, I, E, k, dtype):
    gen = torch.Generator().manual_seed(seed_of("fp8 cuda", M, H, I, E, k, str(dtype)))
    exp = Experts(E, H, I, gen)
    x = random_x(M, H, dtype, gen)
    w, ids = random_routing(M, E, k, gen)
    limit = 0.05 if M % 2 else None
    form = fp8_form(exp)
    want = run_fp8(exp, x, w, ids, limit, form=form)
    exp.to("cuda")
    form_c = fp8_form(exp)
    y = run_fp8(exp, x.cuda(), w.cuda(), ids.cuda(), limit, form=form_c)
    assert y.dtype == dtype and y.shape == (M, H)
    assert rel_err(y.cpu(), want) <= FP8_CUDA_TOL
    assert rel_err(y.cpu(), reference(exp, x, w, ids, limit)) <= FP8_CUDA_TOL
    assert torch.equal(y, run_fp8(exp, x.cuda(), w.cuda(), ids.cuda(), limit, form=form_c))  # deterministic


@cuda
@pytest.mark.parametrize("M", [200, 640])
def test_cuda_skewed_routing_empty_experts_and_invalid_ids(M):
    # Every token on expert 0 or 1 (most experts get no row), some ids -1
    # or E (dropped, as in the W4A16 kernels). At 640 tokens (160 pairs per
    # expert) the grouped GEMMs get an empty group after each expert's.
    gen = torch.Generator().manual_seed(8)
    E, H, I, k = 16, 512, 256, 4
    exp = Experts(E, H, I, gen).to("cuda")
    form = fp8_form(exp)
    x = random_x(M, H, torch.bfloat16, gen, "cuda")
    w, _ = random_routing(M, E, k, gen, "cuda")
    ids = torch.randint(0, 2, (M, k), generator=gen, dtype=torch.int32)
    ids[::7, 1] = -1
    ids[::11, 2] = E
    y = run_fp8(exp, x, w, ids.cuda(), form=form)
    assert rel_err(y, reference(exp, x, w, ids, drop_invalid=True)) <= FP8_CUDA_TOL
    none_valid = torch.full((M, k), -1, dtype=torch.int32, device="cuda")
    assert torch.equal(run_fp8(exp, x, w, none_valid, form=form), torch.zeros_like(x))


@cuda
def test_cuda_graph_capture_auto_and_no_host_sync():
    # fp8_min_rows = 64: CUDA graphs of both sides of the threshold replay
    # what eager calls give, with no host synchronization inside; at 640
    # tokens (160 rows per expert) with the grouped GEMMs' empty groups.
    gen = torch.Generator().manual_seed(9)
    exp = Experts(16, 1024, 512, gen).to("cuda")
    form = fp8_form(exp)
    for M in (8, 256, 640):
        x = random_x(M, 1024, torch.bfloat16, gen, "cuda")
        w, ids = random_routing(M, 16, 4, gen, "cuda")
        want = run_fp8(exp, x, w, ids, fp8_min_rows=64, form=form)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run_fp8(exp, x, w, ids, fp8_min_rows=64, form=form)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = run_fp8(exp, x, w, ids, fp8_min_rows=64, form=form)
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want), M
