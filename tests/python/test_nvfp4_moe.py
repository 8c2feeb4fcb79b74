"""lowbit.nvfp4_moe_prepack / nvfp4_moe against the independent float64
reference in moe_reference.py (weights dequantized from the checkpoint
layout by nvfp4_reference, experts run one at a time), plus the operator
conventions: opcheck, torch.compile with dynamic shapes, empty batch, bad
inputs, CUDA graphs, CUDA vs CPU.

Tolerances (||y - ref|| / ||ref||):
  * bf16 / fp16 activations: 5e-3. The reference rounds h to x's dtype as
    the kernels do and is otherwise exact, so what is left is the single
    rounding of the output to x's dtype (bf16: <= 2^-9 relative per element,
    1.7e-3 in norm as measured on these data; fp16 8x less), the kernels'
    FP32 accumulation order (~1e-6) and the rare element where h lands on
    the other side of a bf16 rounding boundary in FP32 than in float64 (one
    bf16 ulp of one of I terms). 5e-3 is ~3x the bf16 output rounding.
  * fp32 activations (CPU only): 1e-5. Everything is FP32 (h rounded to FP32
    too), so only FP32 accumulation over H or I terms (sqrt(1024) * 2^-24
    ~ 2e-6) separates kernel and reference; a kernel that rounded a weight or
    an activation through bf16 (~1e-3) would fail.
  * vs the unquantized BF16 MoE: cosine >= 0.98. NVFP4 keeps ~9.5% RMS error
    per Gaussian weight; gate, up and down each add theirs to the expert's
    output, ~sqrt(3) * 0.095 = 0.165 relative, i.e. cosine ~0.986 for the
    exact float64 MoE on the dequantized weights itself (see
    test_cosine_vs_unquantized_moe, which also checks the kernel sits within
    1e-3 of that reference cosine).
"""

import zlib

import pytest
import torch
import torch._dynamo.testing
import torch.fx.experimental._config
import torch.nn.functional as F

import lowbit
import moe_reference as ref

LOW_TOL = 5e-3  # bf16 / fp16 activations, see the module docstring
FP32_TOL = 1e-5


def rel_err(y, want):
    y, want = y.double().to(want.device), want.double()
    return ((y - want).norm() / want.norm()).item()


def tol_for(dtype):
    return FP32_TOL if dtype == torch.float32 else LOW_TOL


def seed_of(*parts):
    return zlib.crc32(repr(parts).encode())


class Experts:
    """Random stacked experts (0.02 * randn, as trained weights) made on
    `device`, their NVFP4 checkpoint tensors, the reference's dequantized
    float64 copies (on `device` too, so a GPU test's reference runs there)
    and the prepacked tensors (moved with .to())."""

    def __init__(self, E, H, I, gen, device="cpu", std=0.02):
        self.E, self.H, self.I = E, H, I
        self.w13_bf16 = (torch.randn(E, 2 * I, H, generator=gen) * std).bfloat16().to(device)
        self.w2_bf16 = (torch.randn(E, H, I, generator=gen) * std).bfloat16().to(device)
        self.q13 = lowbit.nvfp4_quantize(self.w13_bf16)
        self.q2 = lowbit.nvfp4_quantize(self.w2_bf16)
        self.d13 = ref.dequantize_experts(*self.q13)
        self.d2 = ref.dequantize_experts(*self.q2)
        self.to(device)

    def to(self, device):
        self.packed = lowbit.nvfp4_moe_prepack(
            self.q13.packed.to(device), self.q13.block_scale.to(device),
            self.q2.packed.to(device), self.q2.block_scale.to(device),
        )
        self.g13 = self.q13.global_scale.to(device)
        self.g2 = self.q2.global_scale.to(device)
        return self

    def args(self):
        p = self.packed
        return p.w13, p.w13_scale, self.g13, p.w2, p.w2_scale, self.g2

    def run(self, x, w, ids, limit=None):
        return lowbit.nvfp4_moe(x, w, ids, *self.args(), limit)

    def reference(self, x, w, ids, limit=None, drop_invalid=False, stats=None, dequantized=True):
        """float64 on the device the experts were made on. dequantized=False:
        the unquantized (bf16) MoE, h not rounded."""
        if dequantized:
            return ref.moe(x, w, ids, self.d13, self.d2, limit, x.dtype, drop_invalid, stats)
        return ref.moe(x, w, ids, self.w13_bf16.double(), self.w2_bf16.double(), limit, None, drop_invalid, stats)


def random_routing(M, E, k, gen, device="cpu"):
    """Distinct experts per token and positive weights (the top-k of random
    scores, normalized, times a routed scaling factor of 2.5)."""
    ids = torch.rand(M, E, generator=gen).topk(k, dim=1).indices.int()
    w = torch.rand(M, k, generator=gen) + 0.05
    w = w / w.sum(1, keepdim=True) * 2.5
    return w.to(device), ids.to(device)


def random_x(M, H, dtype, gen, device="cpu"):
    return torch.randn(M, H, generator=gen).to(dtype).to(device)


def pick_limit(exp, x):
    """A SwiGLU limit at ~the 80th percentile of |gate_up| of expert 0, so
    that clamping is active on a good share of gate and up values (the
    callers assert it)."""
    d = exp.d13[0]
    gu = x.double().to(d.device) @ d.T
    q = torch.quantile(gu.abs().flatten(), 0.8).item()
    return float(f"{q:.2g}")


# ---------------------------------------------------------------- CPU -------

# M, H, I, E, k: small DeepSeek-V4-like configs (CPU time matters) and odd
# sizes (H, I not multiples of 128: padded inside the prepacked layout).
CPU_SHAPES = [
    (16, 256, 128, 8, 2),
    (24, 512, 256, 16, 6),
    (7, 1024, 512, 8, 8),
    (33, 256, 128, 64, 6),
    (5, 144, 48, 4, 3),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M,H,I,E,k", CPU_SHAPES)
def test_cpu_matches_reference(M, H, I, E, k, dtype):
    gen = torch.Generator().manual_seed(seed_of(M, H, I, E, k, str(dtype)))
    exp = Experts(E, H, I, gen)
    x = random_x(M, H, dtype, gen)
    w, ids = random_routing(M, E, k, gen)
    y = exp.run(x, w, ids)
    assert y.shape == (M, H) and y.dtype == dtype
    err = rel_err(y, exp.reference(x, w, ids))
    assert err <= tol_for(dtype), err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,H,I,E,k", CPU_SHAPES[:3])
def test_cpu_swiglu_limit(M, H, I, E, k, dtype):
    gen = torch.Generator().manual_seed(seed_of("limit", M, H, I, E, k, str(dtype)))
    exp = Experts(E, H, I, gen)
    x = random_x(M, H, dtype, gen)
    w, ids = random_routing(M, E, k, gen)
    limit = pick_limit(exp, x)
    stats = ref.ClampStats()
    want = exp.reference(x, w, ids, limit, stats=stats)
    # the clamp must actually bite, on both sides of the SwiGLU
    assert stats.gate_clamped > 0.02 * stats.total and stats.up_clamped > 0.02 * stats.total, stats
    y = exp.run(x, w, ids, limit)
    err = rel_err(y, want)
    assert err <= tol_for(dtype), err
    # and it changes the answer far beyond the tolerance
    assert rel_err(y, exp.reference(x, w, ids)) > 20 * tol_for(dtype)


def test_cosine_vs_unquantized_moe():
    gen = torch.Generator().manual_seed(11)
    exp = Experts(16, 512, 256, gen)
    x = random_x(32, 512, torch.bfloat16, gen)
    w, ids = random_routing(32, 16, 6, gen)
    y = exp.run(x, w, ids).double().flatten()
    exact = exp.reference(x, w, ids, dequantized=False).flatten()
    ref_cos = F.cosine_similarity(exp.reference(x, w, ids).flatten(), exact, dim=0).item()
    cos = F.cosine_similarity(y, exact, dim=0).item()
    assert cos >= 0.98, (cos, ref_cos)
    assert abs(cos - ref_cos) <= 1e-3, (cos, ref_cos)


def test_prepack_shapes_and_scale_forms():
    gen = torch.Generator().manual_seed(1)
    exp = Experts(3, 144, 48, gen)
    p = exp.packed
    assert p.w13.shape == (3, 96, 256 // 2) and p.w13.dtype == torch.uint8  # H = 144 -> Hp = 256
    assert p.w13_scale.shape == (3, 96, 256 // 16) and p.w13_scale.dtype == torch.uint8
    assert p.w2.shape == (3, 144, 128 // 2) and p.w2.dtype == torch.uint8  # I = 48 -> Ip = 128
    assert p.w2_scale.shape == (3, 144, 128 // 16) and p.w2_scale.dtype == torch.uint8
    # uint8 E4M3 codes are accepted as well as float8_e4m3fn, with the same result
    again = lowbit.nvfp4_moe_prepack(exp.q13.packed, exp.q13.block_scale.view(torch.uint8),
                                     exp.q2.packed, exp.q2.block_scale.view(torch.uint8))
    for a, b in zip(p, again):
        assert torch.equal(a, b)
    assert isinstance(p, lowbit.Nvfp4MoePrepacked)


def test_empty_batch():
    gen = torch.Generator().manual_seed(2)
    exp = Experts(4, 256, 128, gen)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.empty(0, 256, dtype=dtype)
        y = exp.run(x, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32), 7.0)
        assert y.shape == (0, 256) and y.dtype == dtype


def test_routing_patterns():
    """Experts with no tokens, every token on one expert, and the same expert
    twice in one token's row (it counts twice, with each weight)."""
    gen = torch.Generator().manual_seed(3)
    M, H, I, E = 20, 256, 128, 8
    exp = Experts(E, H, I, gen)
    x = random_x(M, H, torch.bfloat16, gen)
    w, _ = random_routing(M, E, 3, gen)
    cases = {
        "two experts only": torch.randint(0, 2, (M, 3), generator=gen).int() * 5,  # experts 0 and 5, dups too
        "all on one expert": torch.full((M, 3), 6, dtype=torch.int32),
        "duplicates": torch.tensor([[1, 1, 2]] * M, dtype=torch.int32),
    }
    for name, ids in cases.items():
        y = exp.run(x, w, ids)
        err = rel_err(y, exp.reference(x, w, ids))
        assert err <= LOW_TOL, (name, err)
    # a duplicate slot is the same as one slot with the summed weight
    ids = torch.tensor([[4, 4]] * M, dtype=torch.int32)
    merged = exp.reference(x, w[:, :1] + w[:, 1:2], ids[:, :1])
    assert rel_err(exp.run(x, w[:, :2].contiguous(), ids), merged) <= LOW_TOL


def test_single_token_single_expert_exact_weights():
    # M = 1, k = 1, weight 1: the output is one expert's MLP
    gen = torch.Generator().manual_seed(4)
    exp = Experts(2, 128, 64, gen)
    x = random_x(1, 128, torch.float32, gen)
    ids = torch.tensor([[1]], dtype=torch.int32)
    w = torch.ones(1, 1)
    want = ref.expert_mlp(x, exp.d13[1], exp.d2[1], h_dtype=torch.float32)
    assert rel_err(exp.run(x, w, ids), want) <= FP32_TOL


def check_noncontiguous_inputs(device):
    gen = torch.Generator().manual_seed(5)
    M, H, I, E, k = 9, 256, 128, 8, 3
    exp = Experts(E, H, I, gen, device)
    x_base = random_x(M, H + 32, torch.bfloat16, gen, device)
    x = x_base[:, 16 : 16 + H]  # rows with a stride of H + 32
    w, ids = random_routing(M, E, k, gen, device)
    w_t = w.t().contiguous().t()  # column-major
    ids_base = torch.zeros(M, 2 * k, dtype=torch.int32, device=device)
    ids_base[:, ::2] = ids
    ids_strided = ids_base[:, ::2]
    assert not x.is_contiguous() and not w_t.is_contiguous() and not ids_strided.is_contiguous()
    want = exp.run(x.contiguous(), w, ids)
    for args in ((x, w, ids), (x.contiguous(), w_t, ids), (x.contiguous(), w, ids_strided), (x, w_t, ids_strided)):
        assert torch.equal(exp.run(*args), want)


def test_noncontiguous_inputs():
    check_noncontiguous_inputs("cpu")


def test_cpu_deterministic():
    gen = torch.Generator().manual_seed(6)
    exp = Experts(8, 256, 128, gen)
    x = random_x(17, 256, torch.bfloat16, gen)
    w, ids = random_routing(17, 8, 4, gen)
    y = exp.run(x, w, ids, 0.5)
    for _ in range(2):
        assert torch.equal(exp.run(x, w, ids, 0.5), y)


def test_cpu_out_of_range_ids_raise():
    gen = torch.Generator().manual_seed(7)
    exp = Experts(4, 128, 64, gen)
    x = random_x(3, 128, torch.bfloat16, gen)
    w = torch.ones(3, 2)
    for bad in (-1, 4, 1000):
        ids = torch.tensor([[0, 1], [2, bad], [3, 0]], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"argument 'topk_ids' must hold expert ids in \[0, 4\)"):
            exp.run(x, w, ids)


def test_bad_inputs_raise_clear_errors():
    gen = torch.Generator().manual_seed(8)
    E, H, I = 4, 128, 128
    exp = Experts(E, H, I, gen)
    x = random_x(3, H, torch.bfloat16, gen)
    w, ids = random_routing(3, E, 2, gen)
    p, g13, g2 = exp.packed, exp.g13, exp.g2
    moe = lowbit.nvfp4_moe

    # dtypes -> TypeError naming the argument
    with pytest.raises(TypeError, match=r"argument 'x' must have dtype BFloat16 or Half or Float, got Int"):
        moe(x.int(), w, ids, *exp.args())
    with pytest.raises(TypeError, match=r"argument 'topk_ids' must have dtype Int, got Long"):
        moe(x, w, ids.long(), *exp.args())
    with pytest.raises(TypeError, match=r"argument 'topk_weights' must have dtype Float, got BFloat16"):
        moe(x, w.bfloat16(), ids, *exp.args())
    with pytest.raises(TypeError, match=r"argument 'w13' must have dtype Byte, got Float"):
        moe(x, w, ids, p.w13.float(), p.w13_scale, g13, p.w2, p.w2_scale, g2)
    with pytest.raises(TypeError, match=r"argument 'w2_global' must have dtype Float, got Double"):
        moe(x, w, ids, p.w13, p.w13_scale, g13, p.w2, p.w2_scale, g2.double())
    # shapes -> ValueError naming the argument
    with pytest.raises(ValueError, match=r"argument 'w13' must be prepacked .* for H = 256"):
        moe(random_x(3, 2 * H, torch.bfloat16, gen), w, ids, *exp.args())
    with pytest.raises(ValueError, match=r"argument 'x' must be 2-D, got shape \[1, 3, 128\]"):
        moe(x.unsqueeze(0), w, ids, *exp.args())
    with pytest.raises(ValueError, match=r"argument 'x' must have a last dimension divisible by 16"):
        moe(random_x(3, 136, torch.bfloat16, gen), w, ids, *exp.args())
    with pytest.raises(ValueError, match=r"argument 'topk_ids' must have shape \[3, 1\], got \[3, 2\]"):
        moe(x, w[:, :1], ids, *exp.args())
    with pytest.raises(ValueError, match=r"argument 'topk_weights' must have one row per row of 'x' \(3\)"):
        moe(x, w[:2], ids[:2], *exp.args())
    # expert count E: w13 has 4, the others fewer
    with pytest.raises(ValueError, match=r"argument 'w2' must have shape \[4, 128, 64\], got \[3, 128, 64\]"):
        moe(x, w, ids, p.w13, p.w13_scale, g13, p.w2[:3], p.w2_scale[:3], g2)
    with pytest.raises(ValueError, match=r"argument 'w13_global' must have shape \[4\], got \[3\]"):
        moe(x, w, ids, p.w13, p.w13_scale, g13[:3], p.w2, p.w2_scale, g2)
    with pytest.raises(ValueError, match=r"argument 'w2_global' must have shape \[4\], got \[3\]"):
        moe(x, w, ids, p.w13, p.w13_scale, g13, p.w2, p.w2_scale, g2[:3])
    with pytest.raises(ValueError, match=r"argument 'w13_scale' must have shape"):
        moe(x, w, ids, p.w13, p.w13_scale[:, :, :4], g13, p.w2, p.w2_scale, g2)
    with pytest.raises(ValueError, match=r"argument 'w2_scale' must have shape"):
        moe(x, w, ids, p.w13, p.w13_scale, g13, p.w2, p.w2_scale[:, :16], g2)
    # I of w2 inconsistent with w13's 2I (I = 128 and 256 pad differently)
    other = Experts(E, H, 2 * I, gen)
    with pytest.raises(ValueError, match=r"argument 'w2' must have shape \[4, 128, 64\], got \[4, 128, 128\]"):
        moe(x, w, ids, p.w13, p.w13_scale, g13, other.packed.w2, other.packed.w2_scale, g2)
    # a SwiGLU limit must be positive
    for limit in (0.0, -1.0):
        with pytest.raises(ValueError, match=r"argument 'swiglu_limit' must be > 0"):
            moe(x, w, ids, *exp.args(), limit)

    # prepack
    q13, q2 = exp.q13, exp.q2
    prepack = lowbit.nvfp4_moe_prepack
    with pytest.raises(TypeError, match=r"argument 'w13' must have dtype Byte, got Float"):
        prepack(q13.packed.float(), q13.block_scale, q2.packed, q2.block_scale)
    with pytest.raises(TypeError, match=r"argument 'w2_scale' must have dtype .*got Float"):
        prepack(q13.packed, q13.block_scale, q2.packed, q2.block_scale.float())
    with pytest.raises(ValueError, match=r"argument 'w13' must be 3-D"):
        prepack(q13.packed[0], q13.block_scale[0], q2.packed, q2.block_scale)
    with pytest.raises(ValueError, match=r"argument 'w13_scale' must have shape \[4, 256, 8\], got \[4, 256, 2\]"):
        prepack(q13.packed, q13.block_scale[:, :, :2], q2.packed, q2.block_scale)
    with pytest.raises(ValueError, match=r"argument 'w2_scale' must have shape \[4, 128, 8\], got \[3, 128, 8\]"):
        prepack(q13.packed, q13.block_scale, q2.packed, q2.block_scale[:3])
    with pytest.raises(ValueError, match=r"argument 'w2' must have shape \[4, 128, 64\], got \[3, 128, 64\]"):
        prepack(q13.packed, q13.block_scale, q2.packed[:3], q2.block_scale[:3])  # E mismatch
    with pytest.raises(ValueError, match=r"argument 'w2' must have shape \[4, 128, 64\], got \[4, 64, 64\]"):
        prepack(q13.packed, q13.block_scale, q2.packed[:, :64], q2.block_scale[:, :64])  # rows != H
    with pytest.raises(ValueError, match=r"argument 'w2' must have shape \[4, 128, 64\], got \[4, 128, 16\]"):
        prepack(q13.packed, q13.block_scale, q2.packed[:, :, :16], q2.block_scale[:, :, :2])  # I != half of 2I
    with pytest.raises(ValueError, match=r"argument 'w13' must be .*H a positive multiple of 16"):  # H = 40
        prepack(torch.zeros(E, 2 * I, 20, dtype=torch.uint8), torch.zeros(E, 2 * I, 2, dtype=torch.uint8),
                torch.zeros(E, 40, I // 2, dtype=torch.uint8), torch.zeros(E, 40, I // 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"argument 'w13' must be .*I a positive multiple of 16"):  # I = 24
        prepack(torch.zeros(E, 48, H // 2, dtype=torch.uint8), torch.zeros(E, 48, H // 16, dtype=torch.uint8),
                torch.zeros(E, H, 12, dtype=torch.uint8), torch.zeros(E, H, 1, dtype=torch.uint8))


def test_opcheck():
    gen = torch.Generator().manual_seed(9)
    exp = Experts(4, 144, 48, gen)
    x = random_x(5, 144, torch.bfloat16, gen)
    w, ids = random_routing(5, 4, 2, gen)
    # Block scales as uint8 codes: all four default tests (float8 inputs
    # cannot be compared by test_schema, see test_nvfp4_quant.test_opcheck).
    torch.library.opcheck(torch.ops.lowbit.nvfp4_moe_prepack.default,
                          (exp.q13.packed, exp.q13.block_scale.view(torch.uint8), exp.q2.packed,
                           exp.q2.block_scale.view(torch.uint8)))
    # As float8_e4m3fn: every test but test_schema, which compares inputs
    # with allclose (no float8 kernel).
    torch.library.opcheck(torch.ops.lowbit.nvfp4_moe_prepack.default,
                          (exp.q13.packed, exp.q13.block_scale, exp.q2.packed, exp.q2.block_scale),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.lowbit.nvfp4_moe.default, (x, w, ids, *exp.args(), 0.25))
    torch.library.opcheck(torch.ops.lowbit.nvfp4_moe.default, (x.float(), w, ids, *exp.args(), None))


def test_no_backward_raises_clearly():
    # An inference op: its forward runs (and compiles) with inputs that
    # require grad; a gradient asked of it raises instead of PyTorch's
    # warning and wrong (zero on CUDA) gradients.
    gen = torch.Generator().manual_seed(10)
    exp = Experts(4, 144, 48, gen)
    x = random_x(5, 144, torch.float32, gen).requires_grad_()
    w, ids = random_routing(5, 4, 2, gen)
    for fn in (moe_fn, torch.compile(moe_fn, backend="aot_eager", fullgraph=True)):
        y = fn(x, w, ids, *exp.args())
        assert y.requires_grad
        with pytest.raises(NotImplementedError, match=r"lowbit.nvfp4_moe has no backward \(an inference op\)"):
            y.sum().backward()


def moe_fn(x, w, ids, w13, w13s, g13, w2, w2s, g2):
    return lowbit.nvfp4_moe(x, w, ids, w13, w13s, g13, w2, w2s, g2, 0.5)


# Dynamo specializes sizes 0 and 1 unless told not to (see linear_reference.size_oblivious).
size_oblivious = torch.fx.experimental._config.patch(backed_size_oblivious=True)


def test_compile_fullgraph_dynamic_no_recompile():
    gen = torch.Generator().manual_seed(10)
    exp = Experts(8, 256, 128, gen)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(moe_fn, backend=counter, fullgraph=True, dynamic=True)
    with size_oblivious:
        for M in (1, 3, 16, 61):
            x = random_x(M, 256, torch.bfloat16, gen)
            w, ids = random_routing(M, 8, 4, gen)
            assert torch.equal(compiled(x, w, ids, *exp.args()), moe_fn(x, w, ids, *exp.args()))
    assert counter.frame_count == 1


# ---------------------------------------------------------------- CUDA ------

cuda = pytest.mark.cuda

CUDA_M = [1, 2, 7, 16, 33, 64, 300, 1024]
# H, I, E, k: DeepSeek-V4-like, smaller and odd
CUDA_SHAPES = [
    (256, 128, 8, 2),
    (1024, 512, 64, 6),
    (2048, 1024, 32, 8),
    (4096, 2048, 8, 6),
    (7168, 256, 16, 8),
    (144, 48, 4, 3),
]


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,I,E,k", CUDA_SHAPES)
def test_cuda_matches_reference_every_m(H, I, E, k, dtype):
    gen = torch.Generator().manual_seed(seed_of("cuda", H, I, E, k, str(dtype)))
    exp = Experts(E, H, I, gen, "cuda")
    for M in CUDA_M:
        x = random_x(M, H, dtype, gen, "cuda")
        w, ids = random_routing(M, E, k, gen, "cuda")
        for limit in (None, pick_limit(exp, x)):
            y = exp.run(x, w, ids, limit)
            assert y.shape == (M, H) and y.dtype == dtype and torch.isfinite(y).all()
            err = rel_err(y, exp.reference(x, w, ids, limit))
            assert err <= LOW_TOL, (M, limit, err)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [200, 600])
def test_cuda_wgmma_experts_edges(M, dtype):
    # Many rows per expert: the wgmma kernels (nvfp4_wgmma.cuh) with items
    # of 128 rows at M = 200 (100 per expert) and 256 at M = 600. H = 144
    # and I = 48: W blocks of 128 rows cut at 16 (down) and 96 (up), K
    # shorter than one 64-column step. Expert 1 gets most rows (several
    # items), expert 3 none; the limit clamps.
    gen = torch.Generator().manual_seed(seed_of("wgmma", M, str(dtype)))
    E, H, I, k = 4, 144, 48, 2
    exp = Experts(E, H, I, gen, "cuda")
    x = random_x(M, H, dtype, gen, "cuda")
    w, _ = random_routing(M, E, k, gen, "cuda")
    ids = torch.stack([torch.ones(M, dtype=torch.int32), torch.randint(0, 3, (M,), generator=gen).int() * 2 % 3],
                      dim=1)
    ids[:, 1] = torch.where(ids[:, 1] == 1, torch.zeros_like(ids[:, 1]), ids[:, 1])  # experts 0 and 2
    ids = ids.cuda()
    for limit in (None, pick_limit(exp, x)):
        y = exp.run(x, w, ids, limit)
        assert torch.isfinite(y).all()
        assert rel_err(y, exp.reference(x, w, ids, limit)) <= LOW_TOL, limit
        assert torch.equal(exp.run(x, w, ids, limit), y)  # bitwise repeatable


@cuda
@pytest.mark.parametrize("M", [30, 50])
def test_cuda_narrow_one_warp_four_tiles_per_cta(M):
    # The narrow kernels' form for many (work item, W tile) pairs: one warp
    # per W tile, 4 tiles per CTA (narrow_shape in nvfp4_moe.cu). On a
    # 132-SM H100 the down GEMM takes it here (H = 8208: 513 W tiles, so the
    # last CTA of each item has one tile and three idle warps), at M = 30
    # with 8-row work items and at M = 50 with 16-row ones; the up GEMM
    # (2I / 16 = 16 tiles) takes 2 warps per tile. CUDA_SHAPES cover the
    # other forms (1, 2, 4 and 8 warps per tile).
    H, I, E, k = 8208, 128, 32, 6
    gen = torch.Generator().manual_seed(seed_of("narrow 1x4", M))
    exp = Experts(E, H, I, gen, "cuda")
    x = random_x(M, H, torch.bfloat16, gen, "cuda")
    w, ids = random_routing(M, E, k, gen, "cuda")
    y = exp.run(x, w, ids)
    assert rel_err(y, exp.reference(x, w, ids)) <= LOW_TOL
    assert torch.equal(exp.run(x, w, ids), y)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_narrow_items_of_one_and_two_m_tiles(dtype):
    # Narrow work items hold up to 16 rows; each CTA runs the one-m-tile loop
    # for items of 1-8 rows and the two-m-tile loop for 9-16 (nvfp4_moe.cu).
    # Expert rows here: 40 and 17 (the hot list's wide items), 12, 9 and 2
    # (narrow items) in one narrow plan (mean rows per expert <= 16).
    M, H, I, E, k = 40, 512, 256, 32, 2
    gen = torch.Generator().manual_seed(seed_of("narrow 16-row items", str(dtype)))
    exp = Experts(E, H, I, gen, "cuda")
    x = random_x(M, H, dtype, gen, "cuda")
    w, _ = random_routing(M, E, k, gen, "cuda")
    first = torch.zeros(M, dtype=torch.int32)  # slot 0: expert 0 for all 40 tokens
    rows = [(1, 17), (2, 12), (3, 9), (4, 2)]  # slot 1: experts 1-4 for the first 40 tokens
    second = torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in rows])
    ids = torch.stack([first, second], dim=1)
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert counts[:5].tolist() == [40, 17, 12, 9, 2]
    y = exp.run(x, w, ids.cuda())
    assert rel_err(y, exp.reference(x, w, ids.cuda())) <= LOW_TOL
    assert torch.equal(exp.run(x, w, ids.cuda()), y)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,H,I,E", [(128, 880, 464, 256), (1000, 400, 208, 512)])
def test_cuda_narrow_plan_hot_experts(M, H, I, E, dtype):
    # In the narrow plan (mean rows per expert <= 16) with many (item, W
    # tile) pairs, experts with more than 16 rows go to the hot list: the
    # mixed kernels (nvfp4_moe.cu) run them with the wide main loop beside
    # the narrow items, in items of up to 64 rows (4 m-tiles up to 32 rows,
    # else 8). Both GEMMs have over 8 waves of one-warp (item, W tile) pairs
    # on a 132-SM H100 (320 items x 55 or 58 tiles; 1012 x 25 or 26).
    # Expert rows: M (several hot items), 40 (8 m-tiles), 20 (4 m-tiles), 16
    # (the largest narrow item), 12 (two m-tiles), the rest random. H and I
    # are not multiples of 128 (partial k-tiles) and cut the last W block
    # of 128 rows short.
    k = 8
    gen = torch.Generator().manual_seed(seed_of("narrow hot experts", M, str(dtype)))
    exp = Experts(E, H, I, gen, "cuda")
    x = random_x(M, H, dtype, gen, "cuda")
    w, _ = random_routing(M, E, k, gen, "cuda")
    ids = torch.randint(5, E, (M, k), generator=gen, dtype=torch.int32)
    ids[:, 0] = 0
    first = 0
    for expert, rows in ((1, 40), (2, 20), (3, 16), (4, 12)):
        ids[first : first + rows, 1] = expert
        first += rows
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert counts[:5].tolist() == [M, 40, 20, 16, 12] and ((counts > 0) & (counts <= 8)).any()
    ids = ids.cuda()
    for limit in (None, pick_limit(exp, x)):
        y = exp.run(x, w, ids, limit)
        assert torch.isfinite(y).all()
        assert rel_err(y, exp.reference(x, w, ids, limit)) <= LOW_TOL, limit
        assert torch.equal(exp.run(x, w, ids, limit), y)


@cuda
def test_cuda_one_token_repeats_eagerly_and_in_a_graph():
    # One token takes the direct path (its slots are the work items, no
    # align kernel). Calls back to back, eagerly and as graph replays, must
    # all give the same output.
    gen = torch.Generator().manual_seed(31)
    H, I, E, k = 1024, 512, 16, 6
    exp = Experts(E, H, I, gen, "cuda")
    x = random_x(1, H, torch.bfloat16, gen, "cuda")
    w, ids = random_routing(1, E, k, gen, "cuda")
    y = exp.run(x, w, ids)
    assert rel_err(y, exp.reference(x, w, ids)) <= LOW_TOL
    for _ in range(3):
        assert torch.equal(exp.run(x, w, ids), y)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        exp.run(x, w, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [exp.run(x, w, ids) for _ in range(3)]
    for _ in range(2):
        for o in outs:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for o in outs:
            assert torch.equal(o, y)


@cuda
def test_cuda_swiglu_limit_active_and_cpu_agreement():
    gen = torch.Generator().manual_seed(20)
    exp = Experts(16, 1024, 512, gen)
    x = random_x(200, 1024, torch.bfloat16, gen)
    w, ids = random_routing(200, 16, 6, gen)
    limit = pick_limit(exp, x)
    stats = ref.ClampStats()
    want = exp.reference(x, w, ids, limit, stats=stats)
    assert stats.gate_clamped > 0.02 * stats.total and stats.up_clamped > 0.02 * stats.total, stats
    y_cpu = exp.run(x, w, ids, limit)
    exp.to("cuda")
    y = exp.run(x.cuda(), w.cuda(), ids.cuda(), limit)
    assert rel_err(y, want) <= LOW_TOL
    # CUDA vs the CPU kernel: both within LOW_TOL of the reference, apart by
    # output rounding flips (a bf16 ulp on a few elements) at most
    assert rel_err(y.cpu(), y_cpu.double()) <= LOW_TOL


@cuda
def test_cuda_prepack_matches_cpu_bitwise():
    gen = torch.Generator().manual_seed(21)
    exp = Experts(6, 400 - 400 % 16, 80, gen)
    cpu = exp.packed
    gpu = exp.to("cuda").packed
    for a, b in zip(cpu, gpu):
        assert b.is_cuda and torch.equal(a, b.cpu())


@cuda
def test_cuda_deterministic_and_cosine():
    gen = torch.Generator().manual_seed(22)
    exp = Experts(64, 1024, 512, gen, "cuda")
    x = random_x(500, 1024, torch.bfloat16, gen, "cuda")
    w, ids = random_routing(500, 64, 6, gen, "cuda")
    y = exp.run(x, w, ids, 0.4)
    for _ in range(3):
        assert torch.equal(exp.run(x, w, ids, 0.4), y)
    exact = exp.reference(x, w, ids, 0.4, dequantized=False).flatten()
    cos = F.cosine_similarity(y.double().flatten(), exact, dim=0).item()
    ref_cos = F.cosine_similarity(exp.reference(x, w, ids, 0.4).flatten(), exact, dim=0).item()
    assert cos >= 0.98 and abs(cos - ref_cos) <= 1e-3, (cos, ref_cos)


@cuda
def test_cuda_routing_patterns_and_empty():
    gen = torch.Generator().manual_seed(23)
    M, H, I, E = 2048, 1024, 512, 16
    exp = Experts(E, H, I, gen, "cuda")
    x = random_x(M, H, torch.bfloat16, gen, "cuda")
    w, _ = random_routing(M, E, 4, gen, "cuda")
    cases = {
        "all on one expert": torch.full((M, 4), 3, dtype=torch.int32),
        "two experts, duplicates": torch.randint(0, 2, (M, 4), generator=gen).int() * 9,
        "one hot token": torch.cat([torch.full((1, 4), 0), torch.randint(1, E, (M - 1, 4), generator=gen)]).int(),
    }
    for name, ids in cases.items():
        y = exp.run(x, w, ids.cuda())
        assert rel_err(y, exp.reference(x, w, ids.cuda())) <= LOW_TOL, name
    y = exp.run(x[:0], w[:0], torch.empty(0, 4, dtype=torch.int32, device="cuda"))
    assert y.shape == (0, H)


@cuda
def test_cuda_out_of_range_ids_are_dropped():
    gen = torch.Generator().manual_seed(24)
    M, H, I, E, k = 300, 512, 256, 8, 4
    exp = Experts(E, H, I, gen, "cuda")
    x = random_x(M, H, torch.bfloat16, gen, "cuda")
    w, ids = random_routing(M, E, k, gen, "cuda")
    ids = ids.clone()
    ids[3, :] = -1  # a bad token of lowbit.hash_router: every slot -1
    ids[5, 1] = E
    ids[7, 0] = -1
    ids[9, 2] = 1 << 30
    ids[11, 3] = -(1 << 30)
    y = exp.run(x, w, ids)
    torch.cuda.synchronize()
    want = exp.reference(x, w, ids, drop_invalid=True)
    assert rel_err(y, want) <= LOW_TOL
    assert torch.equal(y[3], torch.zeros_like(y[3]))
    # One token takes the direct path (its slots are the work items, no
    # align kernel): bad slots are skipped there as well.
    for row in (5, 9, 11):
        y1 = exp.run(x[row : row + 1], w[row : row + 1], ids[row : row + 1])
        want1 = exp.reference(x[row : row + 1], w[row : row + 1], ids[row : row + 1], drop_invalid=True)
        assert rel_err(y1, want1) <= LOW_TOL, row
    y1 = exp.run(x[3:4], w[3:4], ids[3:4])
    assert torch.equal(y1, torch.zeros_like(y1))


@cuda
def test_cuda_noncontiguous_inputs():
    check_noncontiguous_inputs("cuda")


@cuda
def test_cuda_wrong_device_arguments():
    gen = torch.Generator().manual_seed(25)
    exp = Experts(4, 128, 64, gen)
    x = random_x(3, 128, torch.bfloat16, gen, "cuda")
    w, ids = random_routing(3, 4, 2, gen, "cuda")
    with pytest.raises(ValueError, match=r"device"):
        exp.run(x, w, ids)  # experts on the CPU
    exp.to("cuda")
    with pytest.raises(ValueError, match=r"device"):
        exp.run(x, w.cpu(), ids)
    with pytest.raises(TypeError, match=r"'x'"):
        exp.run(x.float(), w, ids)  # fp32 activations are CPU only


def route_and_moe(x, gate_w, bias, w13, w13s, g13, w2, w2s, g2):
    w, ids = lowbit.dense_router(x, gate_w, bias, 6, "sqrtsoftplus", 1, 1, True, 1.5)
    return lowbit.nvfp4_moe(x, w, ids, w13, w13s, g13, w2, w2s, g2, 10.0)


@cuda
def test_cuda_graph_capture_routing_and_experts():
    gen = torch.Generator().manual_seed(26)
    M, H, I, E = 48, 1024, 512, 32
    exp = Experts(E, H, I, gen, "cuda")
    gate_w = (torch.randn(E, H, generator=gen) * H**-0.5).bfloat16().cuda()
    bias = (torch.randn(E, generator=gen) * 0.1).cuda()
    x = random_x(M, H, torch.bfloat16, gen, "cuda")
    expected = route_and_moe(x, gate_w, bias, *exp.args())
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        route_and_moe(static, gate_w, bias, *exp.args())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = route_and_moe(static, gate_w, bias, *exp.args())
    fresh = random_x(M, H, torch.bfloat16, gen, "cuda")
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, route_and_moe(fresh, gate_w, bias, *exp.args()))
    static.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@cuda
def test_cuda_compile_reduce_overhead_matches_eager_bitwise():
    gen = torch.Generator().manual_seed(27)
    exp = Experts(16, 512, 256, gen, "cuda")
    gate_w = (torch.randn(16, 512, generator=gen) * 512**-0.5).bfloat16().cuda()
    bias = torch.zeros(16, device="cuda")
    compiled = torch.compile(route_and_moe, mode="reduce-overhead", fullgraph=True)
    for M in (4, 4, 4, 32, 32, 32):
        x = random_x(M, 512, torch.bfloat16, gen, "cuda")
        assert torch.equal(compiled(x, gate_w, bias, *exp.args()), route_and_moe(x, gate_w, bias, *exp.args()))


@cuda
def test_cuda_compile_dynamic_no_recompile():
    gen = torch.Generator().manual_seed(28)
    exp = Experts(8, 256, 128, gen, "cuda")
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(moe_fn, backend=counter, fullgraph=True, dynamic=True)
    with size_oblivious:
        for M in (1, 7, 64, 65, 1000):
            x = random_x(M, 256, torch.bfloat16, gen, "cuda")
            w, ids = random_routing(M, 8, 4, gen, "cuda")
            assert torch.equal(compiled(x, w, ids, *exp.args()), moe_fn(x, w, ids, *exp.args()))
    assert counter.frame_count == 1


@cuda
def test_cuda_no_host_sync():
    gen = torch.Generator().manual_seed(29)
    exp = Experts(16, 512, 256, gen, "cuda")
    inputs = []
    for M in (1, 16, 300):
        x = random_x(M, 512, torch.bfloat16, gen, "cuda")
        inputs.append((x, *random_routing(M, 16, 6, gen, "cuda")))
    for x, w, ids in inputs:
        exp.run(x, w, ids, 1.0)  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, w, ids in inputs:
            exp.run(x, w, ids, 1.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
