"""python -m lowbit.demo: quantize a realistic weight to NVFP4, report its
accuracy and size, and run it as an NVFP4 Linear layer; on a GPU also time
the quantizer.

Runs on CPU; uses the GPU when one is present (or --device cuda).
"""

from __future__ import annotations

import argparse
import time

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
    parser.add_argument("--batch", type=int, default=4, help="tokens for the Linear-layer run")
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
    return 0


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


if __name__ == "__main__":
    raise SystemExit(main())
