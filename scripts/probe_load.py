"""Probe: lowbit.load_pretrained on a DeepSeek-V3-size NVFP4 checkpoint (GPU
or CPU; a development tool, not a benchmark suite).

Writes a ModelOpt-format checkpoint of transformers' DeepseekV3 at its real
sizes (hidden 7168, 256 experts of 2048, vocabulary 129280) but with few
layers (the first dense, the others MoE), with random NVFP4 codes and
scales (no quantization, so writing is fast), then loads it with
``lowbit.load_pretrained`` and reports the load time and rate, the device
memory of the loaded model beside the checkpoint's size, the peak above it
(what the conversion needs on top of the model), and one forward step.

  python scripts/probe_load.py DIR [--layers 3] [--device cuda] [--json OUT.json] [--small]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import lowbit
from lowbit.nn import Nvfp4MoE


def random_nvfp4(prefix: str, n: int, k: int, g: torch.Generator) -> dict:
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    # E4M3 block scales in [0.25, 4): codes 0x30 .. 0x47 (no NaN, no zero).
    scales = torch.randint(0x30, 0x48, (n, k // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    return {f"{prefix}.weight": codes, f"{prefix}.weight_scale": scales,
            f"{prefix}.weight_scale_2": torch.tensor(1e-3), f"{prefix}.input_scale": torch.tensor(1.0)}


# --small: the same structure at test sizes, to try the probe on a CPU.
SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=16,
             num_attention_heads=4, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=32, v_head_dim=64,
             qk_nope_head_dim=32, n_group=4, topk_group=2, num_experts_per_tok=4)


def write(path: Path, layers: int, small: bool) -> tuple[int, object]:
    import transformers
    from safetensors.torch import save_file

    config = transformers.DeepseekV3Config(num_hidden_layers=layers, first_k_dense_replace=1, **(SMALL if small else {}))
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    (path / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}))
    with lowbit.checkpoint.parameters_on_meta():
        shapes = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    weight_map, total, shard, shard_tensors = {}, 0, 0, {}

    def flush() -> None:
        nonlocal shard, shard_tensors
        if shard_tensors:
            file = f"model-{shard:05d}.safetensors"
            save_file(shard_tensors, str(path / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in shard_tensors})
            shard, shard_tensors = shard + 1, {}

    def add(tensors: dict) -> None:
        nonlocal total
        shard_tensors.update(tensors)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        if sum(t.numel() * t.element_size() for t in shard_tensors.values()) > 4 << 30:
            flush()

    done = set()
    for name, mod in shapes.named_modules():
        if any(name.startswith(d + ".") for d in done):
            continue
        if type(mod).__name__ == "DeepseekV3MoE":
            e, two_i, h = mod.experts.gate_up_proj.shape
            for j in range(e):
                for proj, (n, k) in (("gate_proj", (two_i // 2, h)), ("up_proj", (two_i // 2, h)),
                                     ("down_proj", (h, two_i // 2))):
                    add(random_nvfp4(f"{name}.experts.{j}.{proj}", n, k, g))
            for proj in ("gate_proj", "up_proj", "down_proj"):
                lin = getattr(mod.shared_experts, proj)
                add(random_nvfp4(f"{name}.shared_experts.{proj}", lin.out_features, lin.in_features, g))
            add({f"{name}.gate.weight": torch.randn(e, h, generator=g).to(torch.bfloat16) * 0.02,
                 f"{name}.gate.e_score_correction_bias": torch.randn(e, generator=g) * 0.01})
            done.add(name)
        elif isinstance(mod, torch.nn.Linear) and name != "lm_head":
            add(random_nvfp4(name, mod.out_features, mod.in_features, g))
            done.add(name)
    for key, t in shapes.state_dict().items():
        if not any(key.startswith(d + ".") for d in done):
            add({key: (torch.randn(t.shape, generator=g) * 0.02).to(t.dtype)})
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total, config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--layers", type=int, default=3, help="decoder layers: 1 dense, the rest MoE")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--small", action="store_true", help="test sizes, to try the probe")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")

    start = time.perf_counter()
    checkpoint_bytes, config = write(args.dir, args.layers, args.small)
    written = time.perf_counter() - start

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = lowbit.load_pretrained(args.dir, device=args.device)
    if cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    row = {"layers": args.layers, "checkpoint_GB": checkpoint_bytes / 1e9, "write_s": written, "load_s": load_s,
           "load_GB_per_s": checkpoint_bytes / 1e9 / load_s, "device": args.device}
    if cuda:
        row["model_GB"] = torch.cuda.memory_allocated() / 1e9
        row["peak_above_model_GB"] = (torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()) / 1e9
        moe = next(m for m in model.modules() if isinstance(m, Nvfp4MoE))
        row["moe_layer_GB"] = sum(b.numel() * b.element_size() for b in moe.buffers()) / 1e9
    ids = torch.randint(0, config.vocab_size, (1, 16), device=args.device)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        step = model(ids[:, -1:], past_key_values=out.past_key_values)
    row["forward_finite"] = bool(torch.isfinite(out.logits).all() and torch.isfinite(step.logits).all())
    print(json.dumps(row, indent=1))
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
