"""Whole NVFP4 checkpoints (ModelOpt, compressed-tensors) loaded into
transformers DeepSeek-V3 and V4 models: ``lowbit.load_pretrained`` and
``lowbit.load_checkpoint_``.

The checkpoints are written here from tiny random models, the way ModelOpt
and llm-compressor export a transformers DeepSeek model: one tensor set per
Linear, the routed experts one module per expert, gate and up of an expert
(and of the shared expert) with one global scale, lm_head left in BF16.
Quantized with the reference rule, they hold the very codes that
``lowbit.quantize_`` computes from the same model, so the loaded model must
compute ``quantize_``'s logits bit for bit; test_hf_models checks those
against the dequantized model. A layout error (gate and up swapped, experts
out of order) changes them.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import lowbit
from lowbit.nn import Nvfp4GroupedLinear, Nvfp4Linear, Nvfp4MoE
from lowbit.nn.moe import auto_moe_fp8_min_rows

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hf_tiny_models import VOCAB, build, devices, rel  # noqa: E402



def not_lm_head(mod: torch.nn.Module, name: str) -> bool:
    return name != "lm_head"


def _nvfp4(w: torch.Tensor, prefix: str, fmt: str, global_scale: torch.Tensor | None = None) -> dict:
    q = lowbit.nvfp4_quantize(w.detach().cpu(), global_scale)
    scale = q.block_scale.view(torch.float8_e4m3fn)
    if fmt == "modelopt":
        return {f"{prefix}.weight": q.packed, f"{prefix}.weight_scale": scale,
                f"{prefix}.weight_scale_2": q.global_scale.reshape(()),
                f"{prefix}.input_scale": torch.tensor(0.01)}  # an activation scale, unused by W4A16
    return {f"{prefix}.weight_packed": q.packed, f"{prefix}.weight_scale": scale,
            f"{prefix}.weight_global_scale": q.global_scale.reciprocal().reshape(1),  # 2688 / amax
            f"{prefix}.input_global_scale": torch.tensor([100.0])}


def _pair(gate: torch.Tensor, up: torch.Tensor, gate_name: str, up_name: str, fmt: str) -> dict:
    """Gate and up quantized with one global scale, as exporters do for a
    fused pair: that of the two together."""
    shared_global = lowbit.nvfp4_quantize(torch.cat([gate, up]).detach().cpu()).global_scale
    return {**_nvfp4(gate, gate_name, fmt, shared_global), **_nvfp4(up, up_name, fmt, shared_global)}


def nvfp4_state(model: torch.nn.Module, fmt: str = "modelopt", expert_names=("gate_proj", "up_proj", "down_proj"),
                skip=("lm_head",)) -> dict:
    """The checkpoint tensors of ``model`` with its Linear layers, grouped
    Linear layers and MoE experts in NVFP4 (those ``quantize_`` converts,
    less ``skip``) and the rest as they are."""
    out, covered = {}, set()
    for name, mod in model.named_modules():
        if any(name == s or name.startswith(s + ".") for s in covered) or name in skip:
            continue
        if Nvfp4MoE.is_hf_block(mod):
            ex, sh = mod.experts, mod.shared_experts
            i = ex.gate_up_proj.shape[1] // 2
            g, u, d = expert_names
            for e in range(ex.gate_up_proj.shape[0]):
                base = f"{name}.experts.{e}"
                out.update(_pair(ex.gate_up_proj[e, :i], ex.gate_up_proj[e, i:], f"{base}.{g}", f"{base}.{u}", fmt))
                out.update(_nvfp4(ex.down_proj[e], f"{base}.{d}", fmt))
            out.update(_pair(sh.gate_proj.weight, sh.up_proj.weight, f"{name}.shared_experts.gate_proj",
                             f"{name}.shared_experts.up_proj", fmt))
            out.update(_nvfp4(sh.down_proj.weight, f"{name}.shared_experts.down_proj", fmt))
            covered.update({f"{name}.experts", f"{name}.shared_experts"})
        elif (Nvfp4Linear.computes_like(mod) and mod.in_features % 16 == 0 and mod.out_features % 16 == 0) \
                or Nvfp4GroupedLinear.is_hf_grouped(mod):
            out.update(_nvfp4(mod.weight, name, fmt))
            if mod.bias is not None:
                out[f"{name}.bias"] = mod.bias.detach().cpu()
            covered.add(name)
    for key, t in model.state_dict().items():
        if not any(key.startswith(c + ".") for c in covered):
            out[key] = t.detach().cpu()
    return out


def write_checkpoint(path: Path, model: torch.nn.Module, tensors: dict, fmt: str = "modelopt",
                     n_shards: int = 2) -> Path:
    """config.json, the format's quantization config and ``tensors`` in
    ``n_shards`` safetensors files with an index."""
    model.config.save_pretrained(path)
    if fmt == "modelopt":
        (path / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}))
    else:
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                          "weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}
        (path / "config.json").write_text(json.dumps(config))
    keys = sorted(tensors)
    weight_map = {}
    for s in range(n_shards):
        file = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[s::n_shards]}
        safetensors_torch.save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def quantized_reference(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """The reference: ``model`` built by transformers from its config in
    BF16 (which keeps the rotary frequencies in float32, where ``build``'s
    ``.to(bfloat16)`` rounds them), given ``model``'s weights, and
    quantized by quantize_ (lm_head kept)."""
    ref = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)
    ref.load_state_dict(model.state_dict())
    return lowbit.quantize_(ref.to(device).eval(), not_lm_head, progress=False)


def logits(model: torch.nn.Module, device: str, shape=(2, 24)) -> torch.Tensor:
    torch.manual_seed(7)
    ids = torch.randint(0, VOCAB, shape).to(device)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("family", ["v3", "v4"])
def test_modelopt_checkpoint_loads_to_quantize_s_model(family, device, tmp_path):
    model = build(family, "cpu")
    write_checkpoint(tmp_path, model, nvfp4_state(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing unused, nothing left unloaded
        loaded = lowbit.load_pretrained(tmp_path, device=device, progress=False)
    want = quantized_reference(model, device)

    assert type(loaded) is type(model) and not loaded.training
    kinds = [Nvfp4Linear, Nvfp4GroupedLinear, Nvfp4MoE]
    assert [sum(isinstance(m, k) for m in loaded.modules()) for k in kinds] == \
        [sum(isinstance(m, k) for m in want.modules()) for k in kinds]
    assert isinstance(loaded.lm_head, torch.nn.Linear) and loaded.lm_head.weight.dtype == torch.bfloat16
    assert all(t.device.type == device for t in [*loaded.parameters(), *loaded.buffers()])
    torch.testing.assert_close(logits(loaded, device), logits(want, device), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["v3", "v4"])
def test_compressed_tensors_checkpoint(family, tmp_path):
    """The same codes with compressed-tensors' names and reciprocal global
    scales: the loaded globals are the reciprocals' reciprocals (within an
    ulp of ModelOpt's), so the logits agree to BF16 rounding."""
    model = build(family, "cpu")
    write_checkpoint(tmp_path, model, nvfp4_state(model, fmt="compressed-tensors"), fmt="compressed-tensors")
    loaded = lowbit.load_pretrained(tmp_path, device="cpu", progress=False)
    want = quantized_reference(model, "cpu")
    globals_got = torch.cat([b.flatten() for n, b in loaded.named_buffers() if n.endswith("global")])
    globals_want = torch.cat([b.flatten() for n, b in want.named_buffers() if n.endswith("global")])
    torch.testing.assert_close(globals_got, globals_want, rtol=2 ** -23, atol=0)
    # A global an ulp off moves a BF16 rounding here and there, and the
    # models carry it on. Measured: V3 0, V4 2.7e-3; the models' own BF16
    # error is 7.5e-3 and 8.9e-3 (test_hf_models).
    got = rel(logits(loaded, "cpu"), logits(want, "cpu"))
    assert got <= 5e-3, got


def test_key_map_and_deepseek_expert_names(tmp_path):
    """A checkpoint named otherwise than the model (no "model." prefix,
    DeepSeek's w1 / w3 / w2 for the experts' gate / up / down) loads
    through key_map, into a model built on the meta device."""
    model = build("v3", "cpu")
    state = nvfp4_state(model, expert_names=("w1", "w3", "w2"))
    write_checkpoint(tmp_path, model, {k.removeprefix("model."): v for k, v in state.items()})
    with lowbit.checkpoint.parameters_on_meta():
        target = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)
    assert all(p.device.type == "meta" for p in target.parameters())
    report = lowbit.load_checkpoint_(
        target, tmp_path, device="cpu", progress=False,
        key_map=lambda key: key if key.startswith("lm_head.") else "model." + key)
    want = quantized_reference(model, "cpu")
    torch.testing.assert_close(logits(target.eval(), "cpu"), logits(want, "cpu"), rtol=0, atol=0)
    assert len(report.linear) == 3 * 5 + 3 and report.moe == ["model.layers.1.mlp", "model.layers.2.mlp"]
    assert report.grouped == [] and report.unused == [] and report.not_in_checkpoint == []
    # Every quantized module's activation scale, skipped on purpose.
    assert len(report.ignored) == len(report.linear) + 2 * (3 * 8 + 3)
    assert all(k.endswith(".input_scale") for k in report.ignored)


def test_compute_reaches_the_linear_and_moe_layers(tmp_path):
    # compute="auto": every Nvfp4Linear and Nvfp4MoE with its FP8 copy made
    # at load time.
    model = build("v3", "cpu")
    write_checkpoint(tmp_path, model, nvfp4_state(model))
    loaded = lowbit.load_pretrained(tmp_path, device="cpu", progress=False, compute="auto")
    linears = [m for m in loaded.modules() if isinstance(m, Nvfp4Linear)]
    moes = [m for m in loaded.modules() if isinstance(m, Nvfp4MoE)]
    assert {m.compute for m in linears} == {"auto"} and len(moes) == 2 and {m.compute for m in moes} == {"auto"}
    assert all(m.weight_fp8 is not None and m.weight_fp8.dtype == torch.float8_e4m3fn for m in linears)
    assert all(m.w13_fp8 is not None and m.w2_fp8.dtype == torch.float8_e4m3fn for m in moes)
    assert not any("_fp8" in k for k in loaded.state_dict())
    plain = lowbit.load_pretrained(tmp_path, device="cpu", progress=False)
    assert all(m.weight_fp8 is None for m in plain.modules() if isinstance(m, Nvfp4Linear))
    assert all(m.w13_fp8 is None for m in plain.modules() if isinstance(m, Nvfp4MoE))
    # Decode-sized inputs run W4A16 under "auto": the same logits. (16
    # tokens: below every "auto" threshold, the MoE's 32 rows per expert
    # being at least 32 tokens.)
    torch.testing.assert_close(logits(loaded, "cpu", (1, 16)), logits(plain, "cpu", (1, 16)), rtol=0, atol=0)
    with pytest.raises(ValueError, match="lowbit.load_pretrained: compute must be 'w4a16', 'auto' or 'fp8'"):
        lowbit.load_pretrained(tmp_path, device="cpu", progress=False, compute="fp4")
    # The deprecated fp8_min_rows: compute="auto" from that many rows.
    with pytest.deprecated_call(match="fp8_min_rows is deprecated"):
        loaded = lowbit.load_pretrained(tmp_path, device="cpu", progress=False, fp8_min_rows=512)
    assert {(m.compute, m._fp8_rows) for m in loaded.modules() if isinstance(m, Nvfp4Linear)} == {("auto", 512)}
    # A Linear's row count is not the experts' threshold: each MoE keeps its own.
    assert {(m.compute, m._fp8_rows) for m in loaded.modules() if isinstance(m, Nvfp4MoE)} == \
        {("auto", auto_moe_fp8_min_rows(m.n_experts, m.k)) for m in loaded.modules() if isinstance(m, Nvfp4MoE)}


def _write_and_load(tmp_path, state, model, **kwargs):
    write_checkpoint(tmp_path, model, state, **kwargs)
    return lowbit.load_pretrained(tmp_path, device="cpu", progress=False)


def test_bad_checkpoints_raise_clear_errors(tmp_path):
    model = build("v3", "cpu")
    good = nvfp4_state(model)
    block = "model.layers.1.mlp"
    cases = [
        ("expert", {k: v for k, v in good.items() if f"{block}.experts.3.up_proj." not in k},
         f"holds NVFP4 experts for {block} but not expert 3's up projection"),
        ("norm", {k: v for k, v in good.items() if k != "model.norm.weight"},
         "does not hold the model's model.norm.weight"),
        ("global", {k: v for k, v in good.items() if k != "model.layers.0.mlp.up_proj.weight_scale_2"},
         r"holds model.layers.0.mlp.up_proj.weight_scale without an NVFP4 global scale"),
        ("shape", {**good, "model.layers.0.mlp.up_proj.weight": good["model.layers.0.mlp.up_proj.weight"][:, :64],
                   "model.layers.0.mlp.up_proj.weight_scale": good["model.layers.0.mlp.up_proj.weight_scale"][:, :8]},
         r"holds model.layers.0.mlp.up_proj.weight as torch.uint8 \[512, 64\]; the model's layer is 256 -> 512"),
        ("pair", {**good, f"{block}.experts.2.up_proj.weight_scale_2": torch.tensor(1e-3)},
         rf"holds MoE block {block} that .*'expert\(2\) w13_weight_scale_2' holds different gate and up global"),
        ("shared", {k: v for k, v in good.items() if not k.startswith(f"{block}.shared_experts.down_proj.")}
         | {f"{block}.shared_experts.down_proj.weight": model.get_submodule(block).shared_experts.down_proj.weight},
         f"holds {block}'s routed experts in NVFP4 but not its shared expert's down_proj"),
    ]
    for name, state, message in cases:
        path = tmp_path / name
        path.mkdir()
        with pytest.raises(ValueError, match=message):
            _write_and_load(path, state, model)


def test_other_formats_are_refused(tmp_path):
    model = build("v3", "cpu")
    fp8 = {k: v for k, v in model.state_dict().items()}
    w = fp8["model.layers.0.mlp.up_proj.weight"]
    fp8["model.layers.0.mlp.up_proj.weight"] = w.to(torch.float8_e4m3fn)  # ModelOpt FP8: codes, one scale
    fp8["model.layers.0.mlp.up_proj.weight_scale"] = torch.tensor(1.0)
    (tmp_path / "a").mkdir()
    with pytest.raises(ValueError, match="holds model.layers.0.mlp.up_proj.weight_scale without an NVFP4 global"):
        _write_and_load(tmp_path / "a", fp8, model)
    del fp8["model.layers.0.mlp.up_proj.weight_scale"]
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match=r"holds model.layers.0.mlp.up_proj.weight as torch.float8_e4m3fn without"):
        _write_and_load(tmp_path / "b", fp8, model)

    # DeepSeek's own FP4 releases: E2M1 codes with E8M0 scales per 32 (MXFP4).
    mxfp4 = {**nvfp4_state(model), "model.layers.1.mlp.experts.0.w1.scale": torch.ones(16, 8).to(torch.float8_e8m0fnu)}
    (tmp_path / "e").mkdir()
    with pytest.raises(ValueError, match=r"holds model.layers.1.mlp.experts.0.w1.scale in E8M0, the block scales"):
        _write_and_load(tmp_path / "e", mxfp4, model)

    (tmp_path / "c").mkdir()
    write_checkpoint(tmp_path / "c", model, model.state_dict())
    (tmp_path / "c" / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(ValueError, match=r"holds a ModelOpt checkpoint with quant_algo \['FP8'\]"):
        lowbit.load_pretrained(tmp_path / "c", device="cpu", progress=False)
    (tmp_path / "d").mkdir()
    write_checkpoint(tmp_path / "d", model, nvfp4_state(model, fmt="compressed-tensors"), fmt="compressed-tensors")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int"
    config["quantization_config"]["config_groups"]["group_0"]["format"] = "pack-quantized"
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="group 'group_0' is 'pack-quantized'"):
        lowbit.load_pretrained(tmp_path / "d", device="cpu", progress=False)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'fp8'"):
        lowbit.load_pretrained(tmp_path / "d", device="cpu", progress=False)


def test_unused_keys_warn_and_arguments_are_checked(tmp_path):
    model = build("v3", "cpu")
    state = nvfp4_state(model)
    state["model.layers.7.mlp.gate_proj.weight"] = torch.ones(4, 4)  # e.g. a layer the config leaves out
    write_checkpoint(tmp_path, model, state)
    with pytest.warns(UserWarning, match=r"1 checkpoint keys have no place in the model .*layers.7"):
        lowbit.load_pretrained(tmp_path, device="cpu", progress=False)

    with lowbit.checkpoint.parameters_on_meta():
        target = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="device is required: the model's parameters are on the meta device"):
        lowbit.load_checkpoint_(target, tmp_path, progress=False)
    with pytest.deprecated_call(), pytest.raises(ValueError, match="fp8_min_rows must be an int >= 0"):
        lowbit.load_checkpoint_(target, tmp_path, device="cpu", fp8_min_rows=-1)
    with pytest.raises(ValueError, match="lowbit.load_checkpoint_: compute must be 'w4a16', 'auto' or 'fp8'"):
        lowbit.load_checkpoint_(target, tmp_path, device="cpu", compute="FP8")
    with pytest.raises(ValueError, match="key_map maps both"):
        lowbit.load_checkpoint_(target, tmp_path, device="cpu", key_map=lambda k: "x")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .safetensors files"):
        lowbit.load_checkpoint_(target, tmp_path / "nothing", device="cpu")


def test_routers_keep_the_checkpoint_s_precision(tmp_path):
    """The model is built in BF16, but a float32 router weight and
    correction bias go to Nvfp4MoE's router unrounded: BF16 rounding of the
    bias alone moves expert choices."""
    model = build("v3", "cpu")
    state = nvfp4_state(model)
    torch.manual_seed(3)
    fp32 = {}
    for key in list(state):
        if ".mlp.gate." in key:
            fp32[key] = state[key] = state[key].float() + torch.randn(state[key].shape) * 1e-4
    write_checkpoint(tmp_path, model, state)
    loaded = lowbit.load_pretrained(tmp_path, device="cpu", progress=False)
    for layer in (1, 2):
        router = loaded.model.layers[layer].mlp.router
        assert router.weight.dtype == torch.float32
        assert torch.equal(router.weight, fp32[f"model.layers.{layer}.mlp.gate.weight"])
        assert torch.equal(router.e_score_correction_bias, fp32[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"])


def test_auto_device_map_balances_the_layers_in_order():
    from lowbit import _placement

    model = build("v3", "cpu")
    nbytes = {k: 100 for k in model.state_dict()}
    nbytes["model.embed_tokens.weight"] = nbytes["lm_head.weight"] = 1000
    devices = [torch.device("cuda", i) for i in range(3)]
    placement = _placement.auto_device_map(model, nbytes, devices)
    layers = [placement[f"model.layers.{i}"].index for i in range(3)]
    assert layers == sorted(layers) and layers[0] == 0 and layers[-1] == 2  # in order, every device used
    assert placement["model.embed_tokens"] == devices[0] and placement[""] == devices[0]
    assert placement["lm_head"] == placement["model.norm"] == devices[-1]
    place = _placement.placer(placement, devices[0])
    assert place("model.layers.2.mlp.experts.gate_up_proj") == devices[2]
    assert place("model.layers.10.x") == devices[0]  # a prefix must end at a dot

    class NoLayers(torch.nn.Module):
        pass
    with pytest.raises(ValueError, match="'auto' needs the model's decoder layer classes"):
        _placement.auto_device_map(NoLayers(), {}, devices)


def test_device_map_arguments_are_checked(tmp_path):
    model = build("v3", "cpu")
    write_checkpoint(tmp_path, model, nvfp4_state(model))
    # On one device the map changes nothing.
    loaded = lowbit.load_pretrained(tmp_path, device_map={"": "cpu", "model.layers.1": "cpu"}, progress=False)
    torch.testing.assert_close(logits(loaded, "cpu"), logits(quantized_reference(model, "cpu"), "cpu"), rtol=0, atol=0)
    for device_map, error, message in [
        ({"": "cpu", "model.nothing": "cpu"}, ValueError, "names 'model.nothing', which is not a module"),
        ({"": "cpu", "model.layers.1.mlp.experts": "cpu"}, ValueError,
         "places 'model.layers.1.mlp.experts' apart from the rest of model.layers.1.mlp"),
        (["cpu"], TypeError, "must be None, 'auto' or a dict"),
    ]:
        with pytest.raises(error, match=message):
            lowbit.load_pretrained(tmp_path, device_map=device_map, progress=False)
    with pytest.raises(ValueError, match="device and device_map cannot both be given"):
        lowbit.load_pretrained(tmp_path, device="cpu", device_map={"": "cpu"}, progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'auto' spreads the model over CUDA devices, and there are none"):
            lowbit.load_pretrained(tmp_path, device_map="auto", progress=False)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["v3", "v4"])
def test_model_spread_over_gpu_and_cpu(family, tmp_path):
    """The last layer, the norm and the head on the CPU (offloading, and the
    device hooks without a second GPU; tests/python/test_multi_gpu.py spreads
    a model over two). The CPU layer runs the reference kernels, so the
    logits agree with the all-GPU model to BF16 rounding, not bit for bit."""
    model = build(family, "cpu")
    write_checkpoint(tmp_path, model, nvfp4_state(model))
    one = lowbit.load_pretrained(tmp_path, device="cuda", progress=False)
    split = lowbit.load_pretrained(tmp_path, progress=False, device_map={
        "": "cuda", "model.layers.2": "cpu", "model.norm": "cpu", "lm_head": "cpu"})
    assert split.model.layers[1].mlp.w13.device.type == "cuda" and split.model.layers[2].mlp.w13.device.type == "cpu"
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 16), device="cuda")
    with torch.no_grad():
        got, want = split(ids).logits, one(ids).logits
        tokens = split.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                pad_token_id=0)
    assert got.device == ids.device  # back on the input's device
    # Measured (H100): V3 2.9e-3, V4 2.5e-3; the models' own BF16 error is 7.5e-3 and 8.9e-3.
    assert rel(got, want) <= 5e-3, rel(got, want)
    assert tokens.shape == (2, 20) and tokens.device == ids.device and torch.equal(tokens[:, :16], ids)


def saved_tensors(path: Path) -> dict:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(str(file)))
    return out


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("family", ["v3", "v4"])
def test_save_pretrained_writes_modelopt_and_loads_back(family, device, tmp_path):
    """quantize_'s model saved: the tensors are the ModelOpt export written
    here from the same weights, byte for byte, in shards with an index; the
    saved checkpoint loads back to the same logits, bit for bit."""
    model = build(family, "cpu")
    quantized = quantized_reference(model, device)
    lowbit.save_pretrained(quantized, tmp_path, max_shard_bytes=1 << 18, progress=False)
    got = saved_tensors(tmp_path)
    want = {k: v for k, v in nvfp4_state(model).items() if not k.endswith(".input_scale")}
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        g = got[key]
        if w.dtype in (torch.uint8, torch.float8_e4m3fn):  # codes, block scales: the very bytes
            assert g.dtype == w.dtype and torch.equal(g.view(torch.uint8), w.view(torch.uint8)), key
        else:  # routers are kept in float32 / int32 by Nvfp4MoE: the same values
            assert torch.equal(g.to(w.dtype), w), key
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(got) and len(set(index.values())) > 2
    quant = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["exclude_modules"] == ["lm_head"]

    loaded = lowbit.load_pretrained(tmp_path, device=device, progress=False)
    torch.testing.assert_close(logits(loaded, device), logits(quantized, device), rtol=0, atol=0)


@pytest.mark.parametrize("device", devices())
def test_unprepack_inverts_prepack(device):
    g = torch.Generator().manual_seed(5)
    n, k = 48, 272  # K not a multiple of the 128-column tiles
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(1, 0x7F, (n, k // 16), dtype=torch.uint8, generator=g)  # every positive finite E4M3
    pw, ps = lowbit.nvfp4_prepack(codes.to(device), scales.to(device))
    back = lowbit.nvfp4_unprepack(pw, ps, k)
    assert back.weight.device == pw.device and back.weight_scale.dtype == torch.float8_e4m3fn
    assert torch.equal(back.weight.cpu(), codes) and torch.equal(back.weight_scale.cpu().view(torch.uint8), scales)

    # Zero, negative and NaN block scales come back as the same values.
    odd = scales.clone()
    odd[0, 0], odd[1, 2], odd[2, 3], odd[3, 4] = 0x00, 0x80 | 0x38, 0x7F, 0xFF
    back = lowbit.nvfp4_unprepack(*lowbit.nvfp4_prepack(codes.to(device), odd.to(device)), k)
    one = torch.ones((), device=device)
    before = lowbit.nvfp4_dequantize(codes.to(device), odd.to(device).view(torch.float8_e4m3fn), one, torch.float32)
    after = lowbit.nvfp4_dequantize(back.weight, back.weight_scale, one, torch.float32)
    torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)
    assert back.weight_scale.view(torch.uint8)[0, 0].item() == 0x38  # zero scale: 1.0 with zero codes

    e, h, i = 3, 144, 48
    stacks = [torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=g),
              torch.randint(1, 0x7F, (e, 2 * i, h // 16), dtype=torch.uint8, generator=g),
              torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, generator=g),
              torch.randint(1, 0x7F, (e, h, i // 16), dtype=torch.uint8, generator=g)]
    prepacked = lowbit.nvfp4_moe_prepack(*(t.to(device) for t in stacks))
    for got, want in zip(lowbit.nvfp4_moe_unprepack(*prepacked, h, i), stacks):
        assert torch.equal(got.cpu().view(torch.uint8), want)


def test_unprepack_opcheck_and_bad_input():
    q = lowbit.nvfp4_quantize(torch.randn(32, 144))
    pw, ps = lowbit.nvfp4_prepack(q.packed, q.block_scale)
    torch.library.opcheck(torch.ops.lowbit.nvfp4_unprepack.default, (pw, ps, 144))
    stacked = lowbit.nvfp4_quantize(torch.randn(2, 64, 144))
    down = lowbit.nvfp4_quantize(torch.randn(2, 144, 32))
    pm = lowbit.nvfp4_moe_prepack(stacked.packed, stacked.block_scale, down.packed, down.block_scale)
    torch.library.opcheck(torch.ops.lowbit.nvfp4_moe_unprepack.default, (*pm, 144, 32))
    with pytest.raises(ValueError, match=r"nvfp4_unprepack: argument 'k' must be the K the weight was prepacked for \(144\), got 272"):
        lowbit.nvfp4_unprepack(pw, ps, 272)
    with pytest.raises(ValueError, match="nvfp4_unprepack: argument 'k' must be a multiple of 16"):
        lowbit.nvfp4_unprepack(pw, ps, 100)
    with pytest.raises(ValueError, match=r"nvfp4_moe_unprepack: argument 'w13' must have shape \[2, 96, 128\]"):
        lowbit.nvfp4_moe_unprepack(*pm, 144, 48)


def test_placement_moves_nested_inputs():
    import collections

    from lowbit import _placement

    pair = collections.namedtuple("Pair", "a b")
    meta = torch.device("meta")
    moved = _placement._to((torch.ones(2), [torch.zeros(1)], pair(torch.ones(1), 2), torch.Size([2, 3]),
                            {"x": torch.ones(1)}, "text"), meta)
    assert moved[0].device == meta and moved[1][0].device == meta and isinstance(moved[1], list)
    assert isinstance(moved[2], pair) and moved[2].a.device == meta and moved[2].b == 2
    assert moved[3] == torch.Size([2, 3]) and moved[4]["x"].device == meta and moved[5] == "text"


def meta_model(model: torch.nn.Module) -> torch.nn.Module:
    with lowbit.checkpoint.parameters_on_meta():
        return transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)


def _raises_for(tmp_path, model, cases, family_fmt="modelopt"):
    """Each (name, state, error, message): loading ``state`` raises ``error`` matching ``message``."""
    for name, state, error, message in cases:
        path = tmp_path / name
        path.mkdir()
        with pytest.raises(error, match=message):
            _write_and_load(path, state, model, fmt=family_fmt)


@pytest.mark.parametrize("family", ["v3", "v4"])
def test_missing_router_state_is_an_error(family, tmp_path):
    """A router's correction bias and a hash layer's token table exist only
    in the checkpoint: the model's zeros would route silently wrong (every
    token of a hash layer to expert 0), so their absence is an error as a
    missing parameter's is, into a model built on the meta device too."""
    model = build(family, "cpu")
    good = nvfp4_state(model)
    missing = ["model.layers.1.mlp.gate.e_score_correction_bias"]
    if family == "v4":
        missing.append("model.layers.0.mlp.gate.tid2eid")
    for key in missing:
        path = tmp_path / key
        path.mkdir()
        write_checkpoint(path, model, {k: v for k, v in good.items() if k != key})
        with pytest.raises(ValueError, match=rf"does not hold the model's {key}"):
            lowbit.load_pretrained(path, device="cpu", progress=False)
        with pytest.raises(ValueError, match=rf"does not hold the model's {key}"):
            lowbit.load_checkpoint_(meta_model(model), path, device="cpu", progress=False)


def test_expert_biases_are_refused_and_unknown_leaves_reported(tmp_path):
    """Nvfp4MoE's kernels have no expert bias: a bias on a routed or shared
    expert would be dropped, changing the output, so it is refused by key.
    A zero point changes the math unless it is zero (symmetric NVFP4), an
    AWQ pre-scale always does. A leaf lowbit does not know is reported as
    unused, with a warning."""
    model = build("v3", "cpu")
    good = nvfp4_state(model)
    block = "model.layers.1.mlp"
    _raises_for(tmp_path, model, [
        ("expert_bias", {**good, f"{block}.experts.2.down_proj.bias": torch.ones(256)}, ValueError,
         rf"holds {block}.experts.2.down_proj.bias, a bias of an expert of MoE block {block}; Nvfp4MoE"),
        ("shared_bias", {**good, f"{block}.shared_experts.down_proj.bias": torch.ones(256)}, ValueError,
         rf"holds {block}.shared_experts.down_proj.bias, a bias of an expert of MoE block {block}"),
        ("zero_point", {**good, f"{block}.experts.0.up_proj.weight_zero_point": torch.ones(128, 16, dtype=torch.int8)},
         ValueError, rf"holds {block}.experts.0.up_proj.weight_zero_point with nonzero values"),
        ("awq", {**good, "model.layers.0.mlp.up_proj.pre_quant_scale": torch.ones(256)}, ValueError,
         r"holds model.layers.0.mlp.up_proj.pre_quant_scale, an AWQ pre-quantization scale"),
    ])

    extra = {f"{block}.experts.2.down_proj.weight_scale_3": torch.ones(()),
             "model.layers.0.mlp.up_proj.quant_meta": torch.ones(2)}
    zero_point = {f"{block}.experts.0.up_proj.weight_zero_point": torch.zeros(128, 16, dtype=torch.int8)}
    (tmp_path / "ok").mkdir()
    write_checkpoint(tmp_path / "ok", model, {**good, **extra, **zero_point})
    with pytest.warns(UserWarning, match=r"2 checkpoint keys have no place in the model"):
        report = lowbit.load_checkpoint_(meta_model(model), tmp_path / "ok", device="cpu", progress=False)
    assert sorted(report.unused) == sorted(extra)
    assert list(zero_point)[0] in report.ignored


def test_bias_on_a_grouped_linear_is_reported_unused(tmp_path):
    """transformers' DeepseekV4GroupedLinear ignores a bias, and so does
    Nvfp4GroupedLinear: a checkpoint's is reported, not dropped unseen."""
    model = build("v4", "cpu")
    key = "model.layers.0.self_attn.o_a_proj.bias"
    write_checkpoint(tmp_path, model, {**nvfp4_state(model), key: torch.ones(256)})
    with pytest.warns(UserWarning, match=r"1 checkpoint keys have no place in the model"):
        report = lowbit.load_checkpoint_(meta_model(model), tmp_path, device="cpu", progress=False)
    assert report.unused == [key] and "model.layers.0.self_attn.o_a_proj" in report.grouped


def test_tensors_of_the_wrong_dtype_or_value_are_refused(tmp_path):
    """Integers where the model has floats (and floats where it has
    integers) are not cast; NVFP4 global scales must be float32, finite and
    not negative (zero: an all-zero weight): each is refused by key, with
    what was expected and got."""
    model = build("v3", "cpu")
    good = nvfp4_state(model)
    gate, up, expert = "model.layers.1.mlp.gate.weight", "model.layers.0.mlp.up_proj", "model.layers.1.mlp.experts.2"
    _raises_for(tmp_path, model, [
        ("int_gate", {**good, gate: good[gate].to(torch.int32)}, ValueError,
         rf"holds {gate} as torch.int32; the model's is floating point \(torch.bfloat16\)"),
        ("int_norm", {**good, "model.norm.weight": torch.ones(256, dtype=torch.int32)}, ValueError,
         r"holds model.norm.weight as torch.int32; the model's is floating point"),
        ("int_global", {**good, f"{up}.weight_scale_2": torch.tensor(1, dtype=torch.int32)}, ValueError,
         rf"holds {up}.weight_scale_2 as torch.int32; an NVFP4 global scale is float32"),
        ("bf16_global", {**good, f"{expert}.down_proj.weight_scale_2":
                         good[f"{expert}.down_proj.weight_scale_2"].bfloat16()}, ValueError,
         rf"holds {expert}.down_proj.weight_scale_2 as torch.bfloat16; an NVFP4 global scale is float32"),
        ("negative", {**good, f"{up}.weight_scale_2": -good[f"{up}.weight_scale_2"]}, ValueError,
         rf"holds {up}.weight_scale_2 = -[0-9.e-]+; an NVFP4 global scale \(amax / 2688\) is finite and >= 0"),
        ("nan", {**good, f"{expert}.gate_proj.weight_scale_2": torch.tensor(float("nan")),
                 f"{expert}.up_proj.weight_scale_2": torch.tensor(float("nan"))}, ValueError,
         rf"holds {expert}.gate_proj.weight_scale_2 = nan; an NVFP4 global scale \(amax / 2688\) is finite and >= 0"),
        ("inf", {**good, f"{up}.weight_scale_2": torch.tensor(float("inf"))}, ValueError,
         rf"holds {up}.weight_scale_2 = inf"),
    ])
    model4 = build("v4", "cpu")
    table = "model.layers.0.mlp.gate.tid2eid"
    (tmp_path / "v4").mkdir()
    state = nvfp4_state(model4)
    _raises_for(tmp_path / "v4", model4, [
        ("float_table", {**state, table: state[table].float()}, ValueError,
         rf"holds {table} as torch.float32; the model's is an integer \(torch.int64\)"),
    ])


def test_compressed_tensors_global_scales_are_checked(tmp_path):
    """compressed-tensors stores 2688 / amax: zero (an infinite global) and
    negative values are refused; so is a global of the wrong dtype."""
    model = build("v3", "cpu")
    good = nvfp4_state(model, fmt="compressed-tensors")
    key = "model.layers.0.mlp.up_proj.weight_global_scale"
    _raises_for(tmp_path, model, [
        (name, {**good, key: value}, ValueError, rf"holds {key} = {shown}; compressed-tensors' global scale "
                                                 r"\(2688 / amax\) is > 0")
        for name, value, shown in [("zero", torch.zeros(1), r"0\.0"), ("negative", torch.tensor([-3.0]), r"-3\.0")]
    ] + [("f16", {**good, key: good[key].half()}, ValueError, rf"holds {key} as torch.float16; an NVFP4 global "
                                                              "scale is float32")], family_fmt="compressed-tensors")


def _quant_config_cases(tmp_path, model):
    """(name, writes the bad config into the directory, message)."""
    def hf_quant(text):
        return lambda path: (path / "hf_quant_config.json").write_text(text)

    def quantization_config(qc):
        def write(path):
            (path / "hf_quant_config.json").unlink()
            config = json.loads((path / "config.json").read_text())
            config["quantization_config"] = qc
            (path / "config.json").write_text(json.dumps(config))
        return write

    return [
        ("bad_json", hf_quant("{\"quantization\": "), r"hf_quant_config.json, which is not valid JSON"),
        ("not_object", hf_quant("[1, 2]"), r"hf_quant_config.json: its top level must be an object, got list"),
        ("quantization_str", hf_quant(json.dumps({"quantization": "NVFP4"})),
         r"hf_quant_config.json: 'quantization' must be an object, got str"),
        ("no_quantization", hf_quant(json.dumps({"producer": {}})),
         r"hf_quant_config.json: 'quantization' is missing"),
        ("no_algo", hf_quant(json.dumps({"quantization": {"group_size": 16}})),
         r"hf_quant_config.json: 'quantization'\['quant_algo'\] is missing"),
        ("group_str", hf_quant(json.dumps({"quantization": {"quant_algo": "NVFP4", "group_size": "16"}})),
         r"hf_quant_config.json: 'quantization'\['group_size'\] must be an int, got str"),
        ("layers_list", hf_quant(json.dumps({"quantization": {"quant_algo": "MIXED_PRECISION",
                                                              "quantized_layers": ["a"]}})),
         r"hf_quant_config.json: 'quantization'\['quantized_layers'\] must be an object, got list"),
        ("layer_str", hf_quant(json.dumps({"quantization": {"quant_algo": "MIXED_PRECISION",
                                                            "quantized_layers": {"a": "NVFP4"}}})),
         r"hf_quant_config.json: 'quantization'\['quantized_layers'\]\['a'\] must be an object, got str"),
        ("qc_str", quantization_config("nvfp4"), r"config.json: 'quantization_config' must be an object, got str"),
        ("qc_no_method", quantization_config({"format": "nvfp4-pack-quantized"}),
         r"config.json: 'quantization_config' has no 'quant_method'"),
        ("ct_groups_list", quantization_config({"quant_method": "compressed-tensors", "config_groups": []}),
         r"config.json: 'quantization_config'\['config_groups'\] must be a non-empty object, got list"),
        ("ct_no_weights", quantization_config({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                               "config_groups": {"group_0": {"targets": ["Linear"]}}}),
         r"config.json: 'quantization_config'\['config_groups'\]\['group_0'\]\['weights'\] must be an object, "
         r"got null"),
        ("bad_config_json", lambda path: (path / "config.json").write_text("{"),
         r"config.json, which is not valid JSON"),
        ("bad_index", lambda path: (path / "model.safetensors.index.json").write_text("{\"weight_map\": 3}"),
         r"model.safetensors.index.json: 'weight_map' must be an object, got int"),
        ("index_missing_file", lambda path: (path / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.norm.weight": "nothing.safetensors"}})),
         r"model.safetensors.index.json, which names nothing.safetensors \(for model.norm.weight\), "
         r"which is not in"),
    ]


def test_malformed_quantization_configs_raise_clear_errors(tmp_path):
    model = build("v3", "cpu")
    state = nvfp4_state(model)
    for name, write, message in _quant_config_cases(tmp_path, model):
        path = tmp_path / name
        path.mkdir()
        write_checkpoint(path, model, state)
        write(path)
        with pytest.raises((ValueError, FileNotFoundError), match=rf"lowbit.load_checkpoint_: path .*{message}"):
            lowbit.load_pretrained(path, device="cpu", progress=False)


def test_load_arguments_are_checked(tmp_path):
    model = build("v3", "cpu")
    write_checkpoint(tmp_path, model, nvfp4_state(model))
    target = meta_model(model)
    for kwargs, error, message in [
        (dict(key_map=lambda k: 3), TypeError, r"key_map must return a str or None, got int for 'lm_head.weight'"),
        (dict(key_map=lambda k: ""), ValueError, r"key_map maps 'lm_head.weight' to the empty name"),
        (dict(key_map="model."), TypeError, r"key_map must be a callable \(checkpoint key -> model name or None\), "
                                            r"got str"),
        (dict(device="meta"), ValueError, r"device must be where the tensors are loaded \(cpu, cuda\), got meta"),
        (dict(device="gpu"), ValueError, r"device must be a torch device, got 'gpu'"),
        (dict(device_map={"": "meta"}), ValueError, r"device_map must place tensors on cpu or cuda, got meta for ''"),
    ]:
        with pytest.raises(error, match=message):
            lowbit.load_checkpoint_(target, tmp_path, progress=False, **{"device": "cpu", **kwargs}
                                    if "device_map" not in kwargs else kwargs)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device is cuda, but there is no CUDA device"):
            lowbit.load_checkpoint_(target, tmp_path, device="cuda", progress=False)
    missing = tmp_path / "no_such_checkpoint"
    for load in (lowbit.load_pretrained, lambda p, **kw: lowbit.load_checkpoint_(target, p, **kw)):
        with pytest.raises(FileNotFoundError,
                           match=r"path is not a checkpoint directory: .*no_such_checkpoint does not exist"):
            load(missing, device="cpu", progress=False)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"lowbit.load_pretrained: path holds no config.json"):
        lowbit.load_pretrained(tmp_path, device="cpu", progress=False)


def test_an_integer_linear_bias_is_refused(tmp_path):
    """The bias of an NVFP4 Linear is cast between float types only."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32, dtype=torch.bfloat16))
    state = {**_nvfp4(model[0].weight, "0", "modelopt"), "0.bias": torch.arange(32, dtype=torch.int32)}
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"holds 0.bias as torch.int32; the model's is floating point"):
        lowbit.load_checkpoint_(model, tmp_path, progress=False)
    state["0.bias"] = model[0].bias.detach().float()  # a float32 bias is fine
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    report = lowbit.load_checkpoint_(model, tmp_path, progress=False)
    assert report.linear == ["0"] and report.unused == []
