"""Probe: lowbit.nn.Nvfp4GroupedLinear's forms beside transformers' BF16
DeepseekV4GroupedLinear (GPU; a development tool, not a benchmark suite).

The V4-Flash attention's o_a_proj by default (8 groups of 4096 -> 1024).
Every row times, in turns as the bench does, under CUDA graphs with enough
weight sets to rotate through L2: the BF16 layer (one bmm), the fused form
(one nvfp4_linear over all groups, diagonal blocks kept), the grouped form
(lowbit.nvfp4_grouped_linear: one wgmma kernel, each group on its columns
of x) and v2's unpacked form (the weight unpacked to BF16, one bmm); and
the floor: the NVFP4
weight, x and y at the measured HBM bandwidth, or the useful FLOPs (2 T G N
K) at the measured BF16 peak, whichever is longer.

  python scripts/probe_grouped.py [--groups 8 --k 4096 --n 1024] [--tokens 1,2,4,...]
"""

from __future__ import annotations

import argparse

import torch

import lowbit
from lowbit.bench.harness import measure_hardware, rotation_count, time_calls_in_turns
from lowbit.nn import Nvfp4GroupedLinear


def main() -> None:
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=1024, help="outputs per group")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,256,2048")
    args = parser.parse_args()
    g, k, n = args.groups, args.k, args.n
    hw = measure_hardware()
    sets = rotation_count(g * n * k * 2, hw.l2_bytes)
    bf16 = [DeepseekV4GroupedLinear(k, g * n, g).to("cuda", torch.bfloat16) for _ in range(sets)]
    for layer in bf16:
        torch.nn.init.normal_(layer.weight, std=0.02)
    fused = [Nvfp4GroupedLinear.from_hf(layer) for layer in bf16]
    grouped = [Nvfp4GroupedLinear.from_hf(layer) for layer in bf16]
    for layer in fused:
        layer.max_fused_rows = 1 << 62
    for layer in grouped:
        layer.max_fused_rows = 0

    def unpacked(i: int, x: torch.Tensor) -> torch.Tensor:  # v2's form above 128 rows: unpack, one bmm
        lin = grouped[i].linear
        w = lowbit.nvfp4_unpack(lin.weight, lin.weight_scale, lin.weight_global, k, x.dtype).view(g, n, k)
        return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)
    print(f"{hw.name}, HBM {hw.hbm_bytes_per_s / 1e12:.2f} TB/s, BF16 {hw.bf16_flops / 1e12:.0f} TFLOP/s measured; "
          f"{g} groups of {k} -> {n}; lowbit {lowbit.__version__}")
    print(f"{'tokens':>6} {'rows':>6} {'floor us':>9} {'bf16 us':>8} {'fused us':>9} {'grouped us':>11} "
          f"{'unpack us':>10} {'fused x':>8} {'grouped x':>10} {'unpack x':>9}")
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, g, k, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            want = bf16[0](x).float()
            got = [fused[0](x), grouped[0](x), unpacked(0, x)]
            for y in got:  # all within the format's error of the BF16 layer, and of each other
                err = ((y.float() - want).norm() / want.norm()).item()
                assert err < 0.15, err
                assert ((y.float() - got[2].float()).norm() / got[2].float().norm()).item() < 1e-2
            tb, tf, tg, tu = time_calls_in_turns(
                [(lambda i: bf16[i](x), sets), (lambda i: fused[i](x), sets), (lambda i: grouped[i](x), sets),
                 (lambda i: unpacked(i, x), sets)]
            )
        floor = hw.floor_s(g * n * k * 0.5625 + 2 * t * g * (k + n), 2 * t * g * n * k)
        print(f"{t:>6} {t * g:>6} {floor * 1e6:>9.1f} {tb * 1e6:>8.1f} {tf * 1e6:>9.1f} {tg * 1e6:>11.1f} "
              f"{tu * 1e6:>10.1f} {tb / tf:>7.2f}x {tb / tg:>9.2f}x {tb / tu:>8.2f}x")


if __name__ == "__main__":
    main()
