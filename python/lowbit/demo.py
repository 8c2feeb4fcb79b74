"""python -m lowbit.demo: quantize a realistic weight to NVFP4, report its
accuracy and size, run it as an NVFP4 Linear layer, run a DeepSeek-style
NVFP4 MoE layer (routed experts with the clamped SwiGLU), and take a small
transformers DeepSeek-V3 through quantize_, save_pretrained and
load_pretrained; on a GPU also time the quantizer and the MoE.

Runs on CPU; uses the GPU when one is present (or --device cuda).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import lowbit


def realistic_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A trained-looking weight: Gaussian bulk (std 0.02) with heavy-tailed
    outlier columns, as in LLM projection matrices."""
    torch.manual_seed(seed)  # torch.distributions samples from the global generator
    w = torch.randn(rows, cols) * 0.02
    outlier_cols = torch.randint(0, cols, (cols // 64,))
    w[:, outlier_cols] *= torch.distributions.StudentT(torch.tensor(3.0)).sample((1, outlier_cols.numel())).abs() + 1
    return w.to(torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowbit.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=4096, help="output features (DeepSeek-V4-Flash gate+up: 2 x 2048)")
    parser.add_argument("--cols", type=int, default=4096, help="input features (hidden size 4096)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=4, help="tokens for the Linear-layer and MoE runs")
    parser.add_argument("--experts", type=int, default=None, help="MoE experts (default: 64 on GPU, 8 on CPU)")
    parser.add_argument("--moe-hidden", type=int, default=None, help="MoE hidden size (default: 4096 GPU, 512 CPU)")
    parser.add_argument("--moe-inter", type=int, default=None, help="MoE intermediate size (default: 2048 GPU, 256 CPU)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    print(f"lowbit {lowbit.__version__} ({lowbit._library.library_path().name}: {torch.ops.lowbit.build_info()}), "
          f"torch {torch.__version__}, device {device}")
    w = realistic_weight(args.rows, args.cols, args.seed).to(device)
    q = lowbit.nvfp4_quantize(w)
    w_hat = lowbit.nvfp4_dequantize(*q)

    ref = w.double()
    err = (w_hat.double() - ref).norm() / ref.norm()
    cos = torch.nn.functional.cosine_similarity(w_hat.double().flatten(), ref.flatten(), dim=0)
    nvfp4_bytes = q.packed.numel() + q.block_scale.numel() + 4 * q.global_scale.numel()
    print(f"weight [{args.rows}, {args.cols}] bf16 -> NVFP4 (E2M1 + E4M3 per 16 + fp32 global {q.global_scale.item():.3e})")
    print(f"  relative error ||w - deq(q(w))|| / ||w|| = {err.item():.4f}, cosine = {cos.item():.5f}, "
          f"SQNR = {-20 * torch.log10(err).item():.1f} dB")
    print(f"  size: {w.numel() * 2 / 2**20:.1f} MiB bf16 -> {nvfp4_bytes / 2**20:.2f} MiB NVFP4 "
          f"({nvfp4_bytes / w.numel():.4f} bytes per weight)")

    if device.type == "cuda":
        given = q.global_scale
        for _ in range(3):
            lowbit.nvfp4_quantize(w, given)
        torch.cuda.synchronize()
        reps = 50
        start = time.perf_counter()
        for _ in range(reps):
            lowbit.nvfp4_quantize(w, given)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / reps
        moved = w.numel() * 2 + nvfp4_bytes
        print(f"  quantize on {torch.cuda.get_device_name(device)}: {seconds * 1e6:.1f} us, {moved / seconds / 1e9:.0f} GB/s "
              f"(bytes read + written; `python -m lowbit.bench quant` compares with the measured HBM bandwidth)")
    else:
        print("  (no GPU: CPU reference kernels; run on a CUDA GPU for the speed report)")

    linear_demo(w, args.batch, device)
    gpu = device.type == "cuda"
    moe_demo(
        args.experts or (64 if gpu else 8),
        args.moe_hidden or (4096 if gpu else 512),
        args.moe_inter or (2048 if gpu else 256),
        args.batch,
        device,
        args.seed,
    )
    checkpoint_demo(device, args.seed)
    return 0


def checkpoint_demo(device: torch.device, seed: int) -> None:
    """A small transformers DeepSeek-V3 (random weights) quantized in place,
    saved as a ModelOpt NVFP4 checkpoint and loaded back."""
    try:
        import transformers
    except ImportError:
        print("transformers DeepSeek-V3 round trip: skipped (pip install transformers)")
        return
    config = transformers.DeepseekV3Config(
        vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=256,
        qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64, n_routed_experts=16, n_group=4, topk_group=2,
        num_experts_per_tok=4, n_shared_experts=1,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()
    bf16_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, config.vocab_size, (2, 32), device=device)
    with torch.no_grad():
        lowbit.quantize_(model, progress=False)
        quantized = model(ids).logits
        with tempfile.TemporaryDirectory() as path:
            lowbit.save_pretrained(model, path, progress=False)
            saved_bytes = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
            loaded = lowbit.load_pretrained(path, device=device, progress=False)
        reloaded = loaded(ids).logits
    print(f"transformers DeepSeek-V3 ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{config.n_routed_experts} experts): lowbit.quantize_ -> save_pretrained -> load_pretrained")
    print(f"  checkpoint {saved_bytes / 2**20:.1f} MiB (ModelOpt NVFP4) for {bf16_bytes / 2**20:.1f} MiB of BF16 weights; "
          f"the loaded model's logits equal the quantized model's: {torch.equal(reloaded, quantized)}")


def linear_demo(w: torch.Tensor, batch: int, device: torch.device) -> None:
    """The same weight as an nn.Linear, swapped for lowbit.nn.Nvfp4Linear."""
    from lowbit.nn import Nvfp4Linear

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dense = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(w)
    layer = Nvfp4Linear.from_linear(dense)
    x = torch.randn(batch, w.shape[1], device=device, dtype=dtype)
    with torch.no_grad():
        y = layer(x).double()
        y_dense = dense(x).double()
    cos = torch.nn.functional.cosine_similarity(y.flatten(), y_dense.flatten(), dim=0)
    rel = (y - y_dense).norm() / y_dense.norm()
    print(f"{layer}")
    print(f"  batch {batch}: output vs the unquantized layer: cosine {cos.item():.5f}, relative difference {rel.item():.4f}")
    print("  speed: `python -m lowbit.bench linear` times it beside cuBLAS BF16 and FP8 on model shapes (cold L2)")


def moe_demo(experts: int, hidden: int, inter: int, batch: int, device: torch.device, seed: int) -> None:
    """Routed experts (DeepSeek-V4-Flash math: k = 6 of E, clamp 10) through
    lowbit.nvfp4_moe, beside the unquantized experts in FP32 and the
    dequantized ones (what the kernel must reproduce)."""
    gen = torch.Generator().manual_seed(seed + 1)
    k, limit = min(6, experts), 10.0
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(device, torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(device, torch.bfloat16)
    q13, q2 = lowbit.nvfp4_quantize(w13), lowbit.nvfp4_quantize(w2)
    packed = lowbit.nvfp4_moe_prepack(q13.packed, q13.block_scale, q2.packed, q2.block_scale)
    x = torch.randn(batch, hidden, generator=gen).to(device, torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(batch)]).int().to(device)
    weights = torch.softmax(torch.randn(batch, k, generator=gen), dim=-1).to(device)

    def run():
        return lowbit.nvfp4_moe(x, weights, ids, packed.w13, packed.w13_scale, q13.global_scale, packed.w2,
                                packed.w2_scale, q2.global_scale, limit)

    y = run().double()

    def experts_fp32(a13: torch.Tensor, a2: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(batch, hidden, dtype=torch.float64, device=device)
        for t in range(batch):
            for j in range(k):
                e = int(ids[t, j])
                gate, up = (a13[e] @ x[t].float()).split(inter)
                h = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
                out[t] += float(weights[t, j]) * (a2[e] @ h).double()
        return out

    y_deq = experts_fp32(lowbit.nvfp4_dequantize(*q13), lowbit.nvfp4_dequantize(*q2))
    y_bf16 = experts_fp32(w13.float(), w2.float())
    kernel_err = (y - y_deq).norm() / y_deq.norm()
    cos = torch.nn.functional.cosine_similarity(y.flatten(), y_bf16.flatten(), dim=0)
    print(f"NVFP4 MoE experts: E={experts}, H={hidden}, I={inter}, k={k}, swiglu_limit={limit}, {batch} tokens")
    print(f"  vs the same experts dequantized, in FP32: relative error {kernel_err.item():.2e} (bf16 rounding of h and of the output)")
    print(f"  vs the unquantized experts: cosine = {cos.item():.5f} (three NVFP4 GEMMs compound the format's ~10% error)")
    if device.type == "cuda":
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        reps = 50
        start = time.perf_counter()
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / reps
        print(f"  {seconds * 1e6:.1f} us per call (eager); `python -m lowbit.bench moe` times DeepSeek layers beside a "
              f"BF16 torch._grouped_mm MoE (CUDA graphs, cold L2)")


if __name__ == "__main__":
    raise SystemExit(main())
