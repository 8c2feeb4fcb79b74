"""The block-scaled FP8 GEMMs of the blockwise training recipe, alone: for
each fp8_train shape (M tokens, K in, N out) the step's three GEMMs

  fprop  y  [M, N] = x [M, K] (1 x 128 scales) . W [N, K] (128 x 128)
  dgrad  dx [M, K] = dy [M, N] (1 x 128) . W^T [K, N] (128 x 128)
  wgrad  dW [N, K] = dy^T [N, M] (1 x 128 along M) . x^T [K, M] (1 x 128 along M)

by provider, timed in turns on the same FP8 operands (CUDA graphs, cold L2
through rotating operand sets):

  lowbit          lowbit.fp8_gemm with a bfloat16 output, as the recipe
                  runs it (cuBLASLt's block scaling where it takes the shape);
  lowbit:fp32     lowbit.fp8_gemm with a float32 output (the weight gradient
                  of FP32 master weights): lowbit's own block-scaled kernel,
                  which cuBLASLt's block scaling (bfloat16 only) cannot serve;
  lowbit:fp16     lowbit.fp8_gemm with a float16 output: the reference
                  formula on the device (FP32 dequantize + FP32 matmul), the
                  path float32 outputs took before lowbit's kernel;
  cublaslt:block  torch._scaled_mm with the same block scales (cuBLASLt's
                  DeepSeek-style block scaling, bfloat16 output);
  cublaslt:tensor torch._scaled_mm on the same codes with one scale per
                  operand (fast accumulation off): what the GEMM costs
                  without block scales;
  bf16            torch.mm on BF16 operands of the same shapes.

Columns: us, TFLOP/s (2 M N K), x_block (cuBLASLt block's time over this
one), x_bf16, %floor (2 M N K at the FP8 peak measured in the same run);
the lowbit:fp32 row's note gives its largest difference from cuBLASLt's
block result, relative to the output's largest magnitude.
"""

from __future__ import annotations

import torch

from lowbit.bench.fp8_train import QUICK_SHAPES, SHAPES
from lowbit.bench.harness import Hardware, rotation_count, time_calls_in_turns

GEMMS = ("fprop", "dgrad", "wgrad")
PROVIDERS = ("lowbit", "lowbit:fp32", "lowbit:fp16", "cublaslt:block", "cublaslt:tensor", "bf16")
COLUMNS = ["M", "K", "N", "gemm", "provider", "us", "TFLOP/s", "x_block", "x_bf16", "%floor", "note"]


def gemm_dims(shape: tuple[int, int, int], gemm: str) -> tuple[int, int, int]:
    """(rows of a, rows of b, reduction) of one of the step's GEMMs."""
    m, k, n = shape
    return {"fprop": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}[gemm]


def make_rows(hw: Hardware, shape, gemm: str, times: dict, notes: dict) -> list[dict]:
    """Rows of one GEMM from seconds per call by provider (None: not run)."""
    rows_a, rows_b, red = gemm_dims(shape, gemm)
    flops = 2.0 * rows_a * rows_b * red
    floor = flops / hw.fp8_flops
    block, bf16 = times.get("cublaslt:block"), times.get("bf16")
    rows = []
    for name in PROVIDERS:
        t = times.get(name)
        row = {"M": shape[0], "K": shape[1], "N": shape[2], "gemm": gemm, "provider": name}
        if t is None:
            row.update({"us": "n/a", "note": notes.get(name, "not run")})
        else:
            row.update({"us": t * 1e6, "TFLOP/s": flops / t / 1e12, "%floor": 100 * floor / t,
                        "x_block": block / t if block else "n/a", "x_bf16": bf16 / t if bf16 else "n/a"})
            if name in notes:
                row["note"] = notes[name]
        rows.append(row)
    return rows


def _operands(rows_a: int, rows_b: int, red: int, b_scaling: str, device="cuda"):
    import lowbit

    xa = torch.randn(rows_a, red, device=device, dtype=torch.bfloat16)
    xb = torch.randn(rows_b, red, device=device, dtype=torch.bfloat16) * 0.05
    ca, cb = lowbit.fp8_cast(xa, "block"), lowbit.fp8_cast(xb, b_scaling)
    one = torch.ones((), device=device)
    # cuBLASLt's layouts (csrc/torch/fp8_ops_cuda.cpp): a's scales column-major,
    # b's 128 x 128 scales as [K/128, N/128], its 1 x 128 scales as [K/128, N].
    sa_mm = ca.scale.t().contiguous().t()
    sb_mm = cb.scale.contiguous().t() if b_scaling == "block2d" else cb.scale.t().contiguous()
    return {
        "lowbit": lambda: lowbit.fp8_gemm(ca.data, ca.scale, cb.data, cb.scale, "block", b_scaling),
        "lowbit:fp32": lambda: lowbit.fp8_gemm(ca.data, ca.scale, cb.data, cb.scale, "block", b_scaling, None,
                                               torch.float32),
        "lowbit:fp16": lambda: lowbit.fp8_gemm(ca.data, ca.scale, cb.data, cb.scale, "block", b_scaling, None,
                                               torch.float16),
        "cublaslt:block": lambda: torch._scaled_mm(ca.data, cb.data.t(), sa_mm, sb_mm, out_dtype=torch.bfloat16),
        "cublaslt:tensor": lambda: torch._scaled_mm(ca.data, cb.data.t(), one, one, out_dtype=torch.bfloat16),
        "bf16": lambda: torch.mm(xa, xb.t()),
    }


def _time_gemm(hw: Hardware, shape, gemm: str, use_graph: bool):
    rows_a, rows_b, red = gemm_dims(shape, gemm)
    b_scaling = "block" if gemm == "wgrad" else "block2d"
    n_sets = rotation_count(rows_a * red + rows_b * red + 2 * rows_a * rows_b, hw.l2_bytes, maximum=4)
    sets = [_operands(rows_a, rows_b, red, b_scaling) for _ in range(n_sets)]
    providers, names, notes = [], [], {}
    for name in PROVIDERS:
        try:
            for s in sets:
                s[name]()
            torch.cuda.synchronize()
        except Exception as e:  # e.g. a cuBLASLt without block scaling
            notes[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:100]}"
            continue
        providers.append((lambda i, name=name: sets[i][name](), n_sets))
        names.append(name)
    if "lowbit:fp32" in names and "cublaslt:block" in names:
        ours, peer = sets[0]["lowbit:fp32"](), sets[0]["cublaslt:block"]().float()
        rel = float((ours - peer).abs().max() / peer.abs().max().clamp_min(1e-30))
        notes["lowbit:fp32"] = f"max |lowbit:fp32 - cublaslt:block| = {rel:.1e} of max |y|"
    times = dict(zip(names, time_calls_in_turns(providers, use_graph=use_graph)))
    return times, notes


def run(hw: Hardware, quick: bool, shapes=None, use_graph: bool = True):
    rows = []
    for shape in shapes or (QUICK_SHAPES if quick else SHAPES):
        for gemm in GEMMS:
            times, notes = _time_gemm(hw, tuple(shape), gemm, use_graph)
            rows += make_rows(hw, tuple(shape), gemm, times, notes)
    return rows, COLUMNS
