"""lowbit inside Hugging Face transformers' DeepSeek-V3 and V4 models (tiny
configurations, random weights).

``lowbit.quantize_`` swaps the Linear layers and the MoE blocks; the model
must then compute what the same model computes with the dequantized NVFP4
weights, to within the BF16 rounding of that model itself. A layout error
(gate and up rows swapped, the wrong expert, a Linear subclass computed as
a plain Linear) moves the logits by O(1), far past that bound.
"""

from __future__ import annotations

import copy

import pytest
import torch

import lowbit
from lowbit.nn import Nvfp4GroupedLinear, Nvfp4Linear, Nvfp4MoE
from lowbit.quantize import nvfp4_round_trip_

transformers = pytest.importorskip("transformers")

from hf_tiny_models import VOCAB, build, devices, rel  # noqa: E402
from test_aoti import run_from_cpp  # noqa: E402

# family -> (Nvfp4Linear layers, Nvfp4MoE blocks, Nvfp4GroupedLinear layers) after quantize_
COUNTS = {
    # 3 x 5 attention projections, the dense first layer's MLP, lm_head.
    "v3": (19, 2, 0),
    # 3 x (q_a, q_b, kv, o_b, compressor kv and gate), lm_head, and the 3
    # o_a_proj (DeepseekV4GroupedLinear, block-diagonal), whose
    # Nvfp4GroupedLinear holds its weight in an Nvfp4Linear.
    "v4": (19 + 3, 3, 3),
}


def dequantized_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every weight that quantize_ converts replaced by its
    NVFP4 round trip."""
    return nvfp4_round_trip_(copy.deepcopy(model))


@pytest.mark.slow
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("family", sorted(COUNTS))
def test_quantized_model_computes_its_dequantized_weights(family, device):
    n_linear, n_moe, n_grouped = COUNTS[family]
    model = build(family, device)
    ids = torch.randint(0, VOCAB, (2, 24), device=device)
    ref = dequantized_copy(model)
    quantized = lowbit.quantize_(copy.deepcopy(model), progress=False)

    assert sum(isinstance(m, Nvfp4Linear) for m in quantized.modules()) == n_linear
    assert sum(isinstance(m, Nvfp4MoE) for m in quantized.modules()) == n_moe
    assert sum(isinstance(m, Nvfp4GroupedLinear) for m in quantized.modules()) == n_grouped
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.modules())  # nothing left in BF16
    assert not any(Nvfp4MoE.is_hf_block(m) for m in quantized.modules())
    assert any(m.mode == "hash" for m in quantized.modules() if isinstance(m, Nvfp4MoE)) == (family == "v4")

    with torch.no_grad():
        got = quantized(ids).logits
        want = copy.deepcopy(ref).float()(ids).logits  # the dequantized model in FP32
        bf16_noise = rel(ref(ids).logits, want)  # the same model's own BF16 error
        unquantized = model(ids).logits
        # A decode step after a prefill (other kernels on the GPU: 2 rows, not 46).
        prefill = quantized(ids[:, :-1], use_cache=True)
        step = quantized(ids[:, -1:], past_key_values=prefill.past_key_values).logits
    assert torch.isfinite(got).all()
    assert 0 < bf16_noise < 0.1
    # Measured: 1.1-1.2 times the noise (0.0075-0.0089; CPU and H100).
    assert rel(got, want) <= 1.5 * bf16_noise, (rel(got, want), bf16_noise)
    assert rel(step[:, -1], got[:, -1]) <= bf16_noise
    # The quantization error itself: well above the BF16 noise (the check
    # above would not see a missing quantization otherwise), yet bounded.
    assert 2 * bf16_noise < rel(got, unquantized) < 0.6


@pytest.mark.slow
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("family", sorted(COUNTS))
def test_quantized_model_compiles_in_one_graph(family, device):
    model = lowbit.quantize_(build(family, device), progress=False)
    ids = torch.randint(0, VOCAB, (2, 24), device=device)
    # The eager backend: Dynamo's trace only (fullgraph raises on a graph
    # break); Inductor on the ops is test_linear_compile's and test_nn_moe's.
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, model(ids).logits)


class Logits(torch.nn.Module):
    """input ids -> logits, without a cache: the graph a package holds."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


@pytest.mark.slow
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("family", sorted(COUNTS))
def test_quantized_model_in_an_aoti_package(family, device, tmp_path):
    """The whole quantized model exported with a dynamic sequence length,
    compiled by AOTInductor into a package and run from Python and from the
    C++ runner (test_aoti.py). Inductor fuses the model's own ops otherwise
    than eager, so the bound is the eager model's above: within 1.5x of the
    dequantized model's own BF16 error against its FP32 output (measured on
    the CPU: 0.97-1.05 times that error). The C++ runner runs the package's
    compiled code as Python's loader does: bit for bit."""
    model = build(family, device)
    ref = dequantized_copy(model)
    quantized = Logits(lowbit.quantize_(model, progress=False))
    ids = torch.randint(0, VOCAB, (2, 12), device=device)
    with torch.no_grad():
        exported = torch.export.export(quantized, (ids,),
                                       dynamic_shapes=({1: torch.export.Dim("seq", min=2, max=64)},))
    path = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "model.pt2"))
    package = torch._inductor.aoti_load_package(path)
    ref32 = copy.deepcopy(ref).float()
    for n in (5, 24):
        ids = torch.randint(0, VOCAB, (2, n), device=device)
        with torch.no_grad():
            got = package(ids)
            want = ref32(ids).logits
            bf16_noise = rel(ref(ids).logits, want)
        assert got.shape == (2, n, VOCAB)
        assert 0 < bf16_noise < 0.1
        assert rel(got, want) <= 1.5 * bf16_noise, (n, rel(got, want), bf16_noise)
        (from_cpp,) = run_from_cpp(path, (ids,), tmp_path)
        assert torch.equal(from_cpp, got.cpu())


@pytest.mark.slow
@pytest.mark.cuda
def test_cuda_compiled_static_cache_generation():
    """transformers' fast generation path: a static cache and the forward
    under torch.compile(fullgraph=True), Inductor included. Inductor fuses
    the model's own ops differently from eager, so the step logits agree to
    BF16 rounding rather than bit for bit (the tokens, from fixed seeds, are
    the same). mode="reduce-overhead" is left out: it crashes in PyTorch
    2.11 on this model without lowbit too (README, Troubleshooting)."""
    model = lowbit.quantize_(build("v3", "cuda"), progress=False)
    ids = torch.randint(0, VOCAB, (2, 12), device="cuda")
    args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        eager = model.generate(ids, **args)
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, fullgraph=True)
        compiled = model.generate(ids, **args)
    assert torch.equal(compiled.sequences, eager.sequences)
    for got, want in zip(compiled.logits, eager.logits):
        assert rel(got, want) <= 1e-2, rel(got, want)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("family", sorted(COUNTS))
def test_moe_block_computes_its_dequantized_block(family, device):
    """Sparse routing (groups, correction bias, V4's hash layer) from the
    same input: the same experts, so only the rounding differs."""
    model = build(family, device, route_all=False)
    torch.manual_seed(1)
    x = torch.randn(2, 40, 256, device=device).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 40), device=device)
    blocks = [layer.mlp for layer in model.model.layers if Nvfp4MoE.is_hf_block(layer.mlp)]
    assert len(blocks) == COUNTS[family][1]
    for block in blocks:
        moe = Nvfp4MoE.from_hf(block)
        ref = nvfp4_round_trip_(copy.deepcopy(block).float())
        token_ids = {"input_ids": ids} if family == "v4" else {}
        with torch.no_grad():
            got, want = moe(x, **token_ids), ref(x.float(), **token_ids)
        # The hidden activations and the output are rounded to BF16 (2^-9
        # relative at most, each); the reference rounds nothing. Measured:
        # 2.3-2.4e-3 (CPU), 2.8-2.9e-3 (H100).
        assert rel(got, want) <= 5e-3, rel(got, want)


def test_grouped_linear_computes_its_dequantized_blocks():
    hf = build("v4", "cpu").model.layers[0].self_attn.o_a_proj
    assert Nvfp4GroupedLinear.is_hf_grouped(hf) and hf.n_groups == 2
    mod = Nvfp4GroupedLinear.from_hf(hf)
    assert "n_groups=2" in repr(mod)
    ref = nvfp4_round_trip_(copy.deepcopy(hf).float())
    # 30 rows: one nvfp4_linear over all groups, diagonal blocks kept;
    # 600 rows: lowbit.nvfp4_grouped_linear (on the CPU its FP32 reference).
    assert mod.max_fused_rows < 600
    for shape in ((3, 5), (300,)):
        x = torch.randn(*shape, 2, hf.in_features).to(torch.bfloat16)
        with torch.no_grad():
            got, want = mod(x), ref(x.float())
        assert got.shape == want.shape == (*shape, 2, hf.out_features // 2)
        assert rel(got, want) <= 5e-3, (shape, rel(got, want))
    with pytest.raises(ValueError, match=r"argument 'x' must have shape \[\.\.\., 2, 128\], got \[3, 64\]"):
        mod(torch.randn(3, 64).to(torch.bfloat16))
    with pytest.raises(TypeError, match="must be a DeepseekV4GroupedLinear without bias"):
        Nvfp4GroupedLinear.from_hf(torch.nn.Linear(64, 64))


def test_quantize_moe_false_and_filter_keep_the_blocks():
    model = build("v3", "cpu")
    lowbit.quantize_(model, progress=False, moe=False)
    blocks = [m for m in model.modules() if Nvfp4MoE.is_hf_block(m)]
    assert len(blocks) == 2
    # Their shared experts' Linear layers were converted on their own.
    assert all(isinstance(b.shared_experts.gate_proj, Nvfp4Linear) for b in blocks)

    model = build("v4", "cpu")
    lowbit.quantize_(model, lambda mod, name: not name.startswith("model.layers.0."), progress=False)
    assert Nvfp4MoE.is_hf_block(model.model.layers[0].mlp)
    assert isinstance(model.model.layers[1].mlp, Nvfp4MoE)


def test_from_hf_rejects_what_it_cannot_hold():
    with pytest.raises(TypeError, match=r"Nvfp4MoE.from_hf: argument 'block' must be one of .*got Linear"):
        Nvfp4MoE.from_hf(torch.nn.Linear(16, 16))
    block = copy.deepcopy(build("v4", "cpu").model.layers[1].mlp)
    block.experts.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match="experts must use SiLU"):
        Nvfp4MoE.from_hf(block)


def test_moe_token_ids_by_either_name():
    block = build("v4", "cpu").model.layers[0].mlp  # a hash layer
    moe = Nvfp4MoE.from_hf(block)
    x = torch.randn(2, 5, 256, dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 5))
    assert torch.equal(moe(x, ids), moe(x, input_ids=ids))
    with pytest.raises(ValueError, match="not both"):
        moe(x, ids, input_ids=ids)
