"""Every CUDA op from several processes at once, each result bit for bit its first.

A kernel can be correct alone and wrong beside others: a programmatic
dependent launch that reads the previous grid's output before
griddepcontrol.wait, or through a non-coherent load, returns stale data only
when the timing shifts, and other processes on the GPU shift it
(docs/ARCHITECTURE.md, "Chained kernels"). This test starts PROCS processes
on one GPU. Each builds every op's cases on fixed inputs (fresh random data
from fixed seeds, never zeros), runs them once, checks that first result
against an independent reference (the CPU op where that is cheap, else
float32 math on the dequantized weights), and then, once every process is
ready, runs all cases in a shuffled order, again and again for SECONDS,
comparing each result with its first bit for bit. Mismatches are reported
per op and case.

Kernel forms: the library picks a form from the shapes (M crossing the
dispatch thresholds, N, K, experts, rows per expert), and most cases here
are chosen to land on one form each on a 132-SM H100 (`form` in each case
name; csrc/lowbit/linear/sm90_linear_plan.cu linear_plan, nvfp4_moe.cu plan,
routing.cu route_typed, routing_ops_cuda.cpp dense_router_cuda). A few
forms only appear on shapes too large for a test: the Linear and MoE cases
run again under plan strings that force them (PLAN_SETS, through
lowbit::_nvfp4_linear_with_plan and lowbit::_nvfp4_moe_with_plan), in every
process beside the shipped plan's cases.

The same cases, at smaller sizes, are what scripts/sanitize_ops.py runs
under compute-sanitizer (build_cases(..., small=True)).

Environment: LOWBIT_CONCURRENCY_PROCS (default 6), LOWBIT_CONCURRENCY_SECONDS
(default 20; the loop's length, after each process's setup),
LOWBIT_CONCURRENCY_REPORT (a file to which the result table is written, for
the GPU run record). Run directly as a dry run on any machine:
    python tests/python/test_concurrency.py --device cpu --small --seconds 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import lowbit
from lowbit.linear import _explain_plan, _nvfp4_linear_with_plan
from lowbit.moe import _nvfp4_moe_with_plan

pytestmark = [pytest.mark.cuda, pytest.mark.concurrency]

PROCS = int(os.environ.get("LOWBIT_CONCURRENCY_PROCS", "6"))
SECONDS = float(os.environ.get("LOWBIT_CONCURRENCY_SECONDS", "20"))

# Plan strings that choose kernel forms the shapes below do not reach
# (csrc/lowbit/linear/sm90_linear_plan.h, "Overrides"; csrc/lowbit/moe/
# nvfp4_moe.h, MoePlanOverrides); the cases of the shipped plan run too.
PLAN_SETS = [
    {
        # Linear: the stream-K kernel at M <= 8 wherever it can run; the wide
        # kernel always on wgmma (its MT 2 and 4 forms at 9..32 rows); wgmma
        # CTAs in pairs wherever tiles are 256 tokens and K is unsplit.
        "linear": "stream_k=1,wide_wgmma=1,wgmma_pair=1",
        # MoE: one token on the register-staged narrow kernels.
        "moe": "stream=0",
    },
    {
        # Linear: two W tiles per warp at 5..16 rows wherever the stream
        # kernel can run, rings of 3 slots; the wide kernel on mma.sync
        # only; wgmma CTAs never paired.
        "linear": "stream_tiles=2,stream_stages=3,wide_wgmma=0,wgmma_pair=0",
        # MoE: hot experts left in the narrow list (no mixed kernels).
        "moe": "hot=0",
    },
]

LINEAR_TOL = 4e-3  # linear_reference.py REL_TOL
MOE_TOL = 5e-3  # test_nvfp4_moe.py LOW_TOL
CPU_MACS = 5e7  # first results are checked against the CPU op up to this many multiply-adds
# Where the float32 references above CPU_MACS run: on the op's device by
# default; scripts/sanitize_ops.py sets "cpu", so that no cuBLAS kernel runs
# in a process under compute-sanitizer (its racecheck fails internally on
# some of them).
REFERENCE_DEVICE = None


# ------------------------------------------------------------------ helpers --


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t as integers of its width (bit-for-bit comparisons: NaN, -0, float8)."""
    if t.is_floating_point():
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def same_bits(a, b) -> bool:
    return all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


def rel_err(y: torch.Tensor, want: torch.Tensor) -> float:
    y, want = y.double().to(want.device), want.double()
    return ((y - want).norm() / want.norm().clamp_min(1e-30)).item()


def _cpu(t):
    return None if t is None else t.cpu()


def _ref(t):
    """t on the device the float32 references run on (REFERENCE_DEVICE)."""
    return t if REFERENCE_DEVICE is None or t is None else t.to(REFERENCE_DEVICE)


@dataclass
class Case:
    op: str  # the op (family) mismatches are reported under
    name: str  # op, intended kernel form and shape
    run: Callable[[], tuple]  # the device call(s): a tuple of tensors
    check: Callable[[tuple], str | None]  # first result -> None, or what is wrong
    plan: str = ""  # the plan string the case runs under ("": the shipped plan)


@dataclass
class Builder:
    device: str
    small: bool
    cases: list = field(default_factory=list)

    def gen(self, *parts):
        """A generator on the device, seeded from the case (same in every process)."""
        g = torch.Generator(device=self.device)
        g.manual_seed(abs(hash_str(repr(parts))))
        return g

    def randn(self, *shape, gen, dtype=torch.float32, std=1.0):
        return (torch.randn(*shape, generator=gen, device=self.device) * std).to(dtype)

    def add(self, op, name, run, check, plan=""):
        self.cases.append(Case(op, name, run, check, plan))


def hash_str(s: str) -> int:
    import zlib

    return zlib.crc32(s.encode())


# -------------------------------------------------------------- quantization --


def add_quant_cases(b: Builder):
    shape = (2, 48, 400) if b.small else (3, 1024, 2064)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        g = b.gen("quant", str(dtype))
        x = b.randn(*shape, gen=g, dtype=dtype, std=0.02)
        x_cpu = x.cpu()
        given = torch.full((shape[0],), 1e-5, device=b.device)

        def check_q(out, x_cpu=x_cpu, given=given):
            want = lowbit.nvfp4_quantize(x_cpu)
            want2 = lowbit.nvfp4_quantize(x_cpu, given.cpu())
            return None if same_bits([t.cpu() for t in out], [*want, *want2]) else "differs from the CPU op"

        b.add("nvfp4_quantize", f"nvfp4_quantize amax pass + given scale {list(shape)} {dtype}",
              lambda x=x, given=given: (*lowbit.nvfp4_quantize(x), *lowbit.nvfp4_quantize(x, given)), check_q)

    g = b.gen("dequant")
    q = lowbit.nvfp4_quantize(b.randn(*shape, gen=g, std=0.02).cpu())
    packed, scale, glob = (t.to(b.device) for t in q)
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        def check_dq(out, out_dtype=out_dtype):
            want = lowbit.nvfp4_dequantize(q.packed, q.block_scale, q.global_scale, out_dtype)
            return None if same_bits([out[0].cpu()], [want]) else "differs from the CPU op"

        b.add("nvfp4_dequantize", f"nvfp4_dequantize {list(shape)} -> {out_dtype}",
              lambda out_dtype=out_dtype: (lowbit.nvfp4_dequantize(packed, scale, glob, out_dtype),), check_dq)

    # prepack (the Linear's and the MoE's) and unpack
    n, k = shape[1], shape[2]
    w_packed, w_scale, w_glob = packed[0], scale[0], glob[0]

    def check_prepack(out):
        want = lowbit.nvfp4_prepack(q.packed[0], q.block_scale[0])
        return None if same_bits([t.cpu() for t in out], list(want)) else "differs from the CPU op"

    b.add("nvfp4_prepack", f"nvfp4_prepack {n}x{k}", lambda: tuple(lowbit.nvfp4_prepack(w_packed, w_scale)),
          check_prepack)
    pw, ps = lowbit.nvfp4_prepack(w_packed, w_scale)
    for out_dtype in (torch.bfloat16, torch.float32):
        def check_unpack(out, out_dtype=out_dtype):
            want = lowbit.nvfp4_unpack(pw.cpu(), ps.cpu(), w_glob.cpu(), k, out_dtype)
            return None if same_bits([out[0].cpu()], [want]) else "differs from the CPU op"

        b.add("nvfp4_unpack", f"nvfp4_unpack {n}x{k} -> {out_dtype}",
              lambda out_dtype=out_dtype: (lowbit.nvfp4_unpack(pw, ps, w_glob, k, out_dtype),), check_unpack)

    def check_to_fp8(out):
        want = lowbit.nvfp4_to_fp8(pw.cpu(), ps.cpu(), w_glob.cpu(), k)
        got = [out[0].cpu().view(torch.uint8), out[1].cpu()]
        return None if same_bits(got, [want.weight.view(torch.uint8), want.scale]) else "differs from the CPU op"

    b.add("nvfp4_to_fp8", f"nvfp4_to_fp8 {n}x{k}", lambda: tuple(lowbit.nvfp4_to_fp8(pw, ps, w_glob, k)), check_to_fp8)

    e, h, i = (2, 64, 48) if b.small else (4, 512, 208)
    g = b.gen("moe prepack")
    q13 = lowbit.nvfp4_quantize(b.randn(e, 2 * i, h, gen=g, std=0.02).cpu())
    q2 = lowbit.nvfp4_quantize(b.randn(e, h, i, gen=g, std=0.02).cpu())
    dev = [t.to(b.device) for t in (q13.packed, q13.block_scale, q2.packed, q2.block_scale)]

    def check_moe_prepack(out):
        want = lowbit.nvfp4_moe_prepack(q13.packed, q13.block_scale, q2.packed, q2.block_scale)
        return None if same_bits([t.cpu() for t in out], list(want)) else "differs from the CPU op"

    b.add("nvfp4_moe_prepack", f"nvfp4_moe_prepack E={e} H={h} I={i}",
          lambda: tuple(lowbit.nvfp4_moe_prepack(*dev)), check_moe_prepack)


# -------------------------------------------------------------------- Linear --


class LinearWeight:
    """A random NVFP4 weight [n, k] (0.02 randn) quantized and prepacked on the
    device, and its dequantized float32 copy (the reference's)."""

    def __init__(self, b: Builder, n, k):
        g = b.gen("linear weight", n, k)
        q = lowbit.nvfp4_quantize(b.randn(n, k, gen=g, std=0.02))
        self.n, self.k = n, k
        self.pw, self.ps = lowbit.nvfp4_prepack(q.packed, q.block_scale)
        self.g = q.global_scale
        self.deq = lowbit.nvfp4_dequantize(q.packed, q.block_scale, q.global_scale, torch.float32)


def _linear_check(w: LinearWeight, x, bias, fp8_min_rows, tol):
    def check(out):
        y = out[0]
        if not torch.isfinite(y).all():
            return "non-finite output"
        m = x.numel() // w.k
        if m * w.n * w.k <= CPU_MACS and fp8_min_rows == 0:
            want = lowbit.nvfp4_linear(x.cpu(), w.pw.cpu(), w.ps.cpu(), w.g.cpu(), _cpu(bias)).double()
            what = "CPU op"
        else:
            want = _ref(x).float() @ _ref(w.deq).T + (0 if bias is None else _ref(bias).float())
            what = "float32 reference"
        err = rel_err(y, want)
        return None if err <= tol else f"rel err {err:.2e} vs the {what} (tolerance {tol:.0e})"

    return check


# (n, k, [(m, form, dtype)]): forms per linear_plan on a 132-SM H100 with
# the shipped plan (see the comments of test_linear_kernels_cuda.py).
LINEAR_SHAPES = [
    (22400, 1168, [(1, "stream, 1 warp/tile, capped CTAs/SM", torch.bfloat16),
                   (5, "stream 5..8 rows", torch.float16),
                   (8, "stream 5..8 rows", torch.bfloat16),
                   (9, "wide mma.sync MT2", torch.bfloat16),
                   (16, "panel", torch.bfloat16)]),
    (5600, 1168, [(2, "narrow 4 warps/tile", torch.bfloat16),
                  (9, "narrow 2 m-tiles", torch.float16)]),
    (4096, 4096, [(1, "stream unsplit", torch.bfloat16),
                  (12, "stream two tiles/warp, 8-warp CTAs", torch.bfloat16)]),
    (2048, 4096, [(1, "stream split-K + reduce", torch.bfloat16)]),
    (256, 7168, [(2, "narrow split-K + reduce", torch.bfloat16)]),
    (16 * 1537, 1552, [(16, "panel, 2 K splits in a cluster", torch.bfloat16)]),
    (16 * 261, 7184, [(16, "panel, 8 K splits through partials", torch.float16)]),
    (4096, 1024, [(32, "wide mma.sync MT4", torch.bfloat16),
                  (64, "wide mma.sync MT8", torch.float16),
                  (100, "wide wgmma MT8, K splits through partials", torch.bfloat16),
                  (300, "wgmma 256-token tiles", torch.bfloat16),
                  (2100, "unpack + cuBLAS", torch.bfloat16)]),
    (8192, 1024, [(100, "wide wgmma MT8, K splits in a cluster", torch.bfloat16)]),
    # The panel kernel at 12-16 rows where its grid runs in one wave (on an
    # H100 the larger shapes above now go to two W tiles per warp).
    (48, 400, [(12, "panel", torch.bfloat16)]),
    (256, 2176, [(16, "panel", torch.bfloat16)]),
    (16 * 449, 9360, [(12, "wide wgmma MT2 (2^25 weights)", torch.bfloat16),
                      (17, "wide wgmma MT4", torch.float16)]),
    (1024, 1904, [(129, "wgmma 128-token tiles, K split over a cluster", torch.bfloat16)]),
    (16 * 769, 2176, [(1000, "wgmma CTA pairs", torch.bfloat16)]),
]
# Small sizes (sanitizers): the same forms where small shapes reach them.
LINEAR_SHAPES_SMALL = [
    (48, 400, [(1, "narrow", torch.bfloat16),
               (5, "stream 5..8 rows", torch.float16),
               (9, "narrow 2 m-tiles", torch.bfloat16),
               (12, "panel", torch.bfloat16),
               (32, "wide mma.sync MT4", torch.bfloat16),
               (64, "wide mma.sync MT8", torch.float16),
               (100, "wide wgmma MT8", torch.bfloat16),
               (129, "wgmma 128-token tiles", torch.bfloat16),
               (2100, "unpack + cuBLAS", torch.bfloat16)]),
    (256, 2176, [(1, "narrow split-K + reduce", torch.bfloat16),
                 (3, "narrow split-K + reduce", torch.float16),
                 (16, "panel", torch.bfloat16)]),
    (22400, 1168, [(1, "stream, 1 warp/tile", torch.bfloat16),
                   (16, "panel", torch.bfloat16)]),
    (4096, 4096, [(12, "stream two tiles/warp, 8-warp CTAs", torch.bfloat16)]),
    (256, 128, [(800, "wgmma 256-token tiles, CTA pairs", torch.bfloat16)]),
]


def linear_case_label(m: int, n: int, k: int, intended: str, device, plan: str = "") -> str:
    """A Linear case's label: on the GPU the kernel its plan runs (explain_plan,
    without the source file); elsewhere the form its shape was chosen to reach."""
    if not str(device).startswith("cuda"):
        return f"plan {plan}" if plan else intended
    kernel = re.sub(r" \([\w.]+\.cu\)", "", _explain_plan(m, n, k, device, plan).kernel)
    return f"plan {plan}: {kernel}" if plan else kernel


def add_linear_cases(b: Builder):
    for n, k, runs in LINEAR_SHAPES_SMALL if b.small else LINEAR_SHAPES:
        w = LinearWeight(b, n, k)
        for m, form, dtype in runs:
            g = b.gen("linear x", n, k, m, str(dtype))
            x = b.randn(m, k, gen=g, dtype=dtype)
            bias = b.randn(n, gen=g, dtype=dtype) if m % 2 else None
            shape = f"M={m} {n}x{k} {str(dtype)[6:]}{' +bias' if m % 2 else ''}"
            check = _linear_check(w, x, bias, 0, LINEAR_TOL)
            b.add("nvfp4_linear", f"nvfp4_linear [{linear_case_label(m, n, k, form, b.device)}] {shape}",
                  lambda w=w, x=x, bias=bias: (lowbit.nvfp4_linear(x, w.pw, w.ps, w.g, bias),), check)
            if m > 2048:  # unpack + cuBLAS, whatever the plan strings
                continue
            for plans in PLAN_SETS:
                plan = plans["linear"]
                b.add("nvfp4_linear", f"nvfp4_linear [{linear_case_label(m, n, k, form, b.device, plan)}] {shape}",
                      lambda w=w, x=x, bias=bias, plan=plan:
                      (_nvfp4_linear_with_plan(x, w.pw, w.ps, w.g, bias, plan=plan),), check, plan)
    # The FP8 mode (cuBLASLt FP8 after lowbit's row-rounding kernels): its
    # extra error is ~4e-2 (linear_reference.py FP8_MODE_TOL 6e-2).
    n, k = (256, 512) if b.small else (4096, 1024)
    w = LinearWeight(b, n, k)
    x = b.randn(64, k, gen=b.gen("fp8 x"), dtype=torch.bfloat16)
    b.add("nvfp4_linear", f"nvfp4_linear [FP8 mode] M=64 {n}x{k} bf16",
          lambda: (lowbit.nvfp4_linear(x, w.pw, w.ps, w.g, None, 1),), _linear_check(w, x, None, 1, 6e-2))
    # The same on W's E4M3 form made once (compute="auto" / "fp8"); "FP8
    # mode" in the name: a cuBLASLt case (gpu_check.sh's sanitizers skip it
    # where they cannot see cuBLAS's writes).
    w8 = lowbit.nvfp4_to_fp8(w.pw, w.ps, w.g, k)
    b.add("nvfp4_linear", f"nvfp4_linear [FP8 mode, cached weight] M=64 {n}x{k} bf16",
          lambda: (lowbit.nvfp4_linear(x, w.pw, w.ps, w.g, None, 1, *w8),), _linear_check(w, x, None, 1, 6e-2))
    # The FP8 path at up to a few hundred rows on a narrow weight: an output
    # small enough for cuBLASLt's unit-scale GEMM and lowbit's scaling pass
    # instead of the row-scaled GEMM (fp8_row_gemm_cuda.h); a bias.
    # ("cuBLAS" in the name: racecheck and initcheck skip it, as they do
    # every case that runs cuBLAS. Names of its own: the cases above read w
    # and x when they run.)
    sn, sk, sm = (384, 3072, 200) if b.small else (1536, 4096, 256)
    sw = LinearWeight(b, sn, sk)
    g = b.gen("unit-scale x")
    sx = b.randn(sm, sk, gen=g, dtype=torch.bfloat16)
    sbias = b.randn(sn, gen=g, dtype=torch.bfloat16, std=0.1)
    sw8 = lowbit.nvfp4_to_fp8(sw.pw, sw.ps, sw.g, sk)
    b.add("nvfp4_linear", f"nvfp4_linear [FP8 path: unit-scale cuBLAS GEMM + scaling pass, cached weight] M={sm} {sn}x{sk} bf16",
          lambda: (lowbit.nvfp4_linear(sx, sw.pw, sw.ps, sw.g, sbias, 1, *sw8),),
          _linear_check(sw, sx, sbias, 1, 6e-2))


def add_grouped_linear_cases(b: Builder):
    # Up to 256 rows of x (tokens x G): one nvfp4_linear over all groups,
    # the diagonal blocks kept; above, one wgmma kernel over all groups where
    # N / G and K are multiples of 128 and M <= 1024; else the weight
    # unpacked + a batched matmul (csrc/torch/linear_ops_cuda.cpp).
    G = 4
    for gn, k, ms in ((256, 512, (8, 300, 1100)), (48, 400, (8, 100))):
        w = LinearWeight(b, G * gn, k)
        for m in ms:
            form = ("fused Linear over all groups" if m * G <= 256
                    else "wgmma" if gn % 128 == 0 and k % 128 == 0 and m <= 1024 else "unpack + bmm")
            x = b.randn(m, G, k, gen=b.gen("grouped x", gn, k, m), dtype=torch.bfloat16)

            def check(out, w=w, x=x, gn=gn, k=k, m=m):
                y = out[0]
                if m * G * gn * k <= CPU_MACS:
                    want, what = lowbit.nvfp4_grouped_linear(x.cpu(), w.pw.cpu(), w.ps.cpu(), w.g.cpu(), G), "CPU op"
                else:
                    deq = _ref(w.deq).view(G, gn, k)
                    want, what = torch.einsum("mgk,gnk->mgn", _ref(x).float(), deq), "float32 reference"
                err = rel_err(y, want)
                return None if err <= LINEAR_TOL else f"rel err {err:.2e} vs the {what}"

            b.add("nvfp4_grouped_linear", f"nvfp4_grouped_linear [{form}] M={m} G={G} {gn}x{k}",
                  lambda w=w, x=x: (lowbit.nvfp4_grouped_linear(x, w.pw, w.ps, w.g, G),), check)


# ------------------------------------------------------------------- routing --


def _route_check(want_fn, min_agree, w_rtol):
    """GPU (weights, ids) against the CPU op's: rows whose ids differ are only
    float32 near-ties (libm and summation order differ by ulps), so at least
    min_agree of the rows agree exactly, and there the weights are close."""

    def check(out):
        w, ids = out[0].cpu(), out[1].cpu()
        cw, cids = want_fn()
        same = (ids == cids).all(-1)
        if same.float().mean().item() < min_agree:
            return f"ids agree with the CPU op on {same.float().mean().item():.3f} of the rows"
        if not torch.allclose(w[same], cw[same], rtol=w_rtol, atol=1e-30):
            return "weights differ from the CPU op"
        return None

    return check


ROUTE_CONFIGS = [
    # E, k, score_func, n_group, topk_group, Ms: M <= 256 with E > 64 takes a
    # CTA per token, larger M (or E <= 64) a warp per token; E > 512 or
    # k > 32 the general path (scores in a global workspace).
    (256, 6, "sqrtsoftplus", 1, 1, (1, 40, 300)),
    (384, 6, "sqrtsoftplus", 1, 1, (40, 300)),
    (256, 8, "sigmoid", 8, 4, (40, 300)),
    (128, 8, "softmax", 1, 1, (40, 300)),
    (32, 4, "sigmoid", 1, 1, (300,)),
    (64, 6, "sqrtsoftplus", 1, 1, (300,)),
    (512, 8, "sigmoid", 8, 4, (40,)),
    (1024, 8, "sqrtsoftplus", 1, 1, (100,)),
    (256, 36, "sigmoid", 1, 1, (100,)),
]


def add_routing_cases(b: Builder):
    for E, k, sf, ng, tg, ms in ROUTE_CONFIGS:
        for m in ms[:1] if b.small else ms:
            for dtype in (torch.float32, torch.bfloat16):
                g = b.gen("route", E, k, sf, m, str(dtype))
                logits = b.randn(m, E, gen=g, dtype=dtype, std=2.0)
                bias = b.randn(E, gen=g, std=0.1)
                form = ("general" if E > 512 or k > 32 else "CTA per token" if m <= 256 and E > 64
                        else "warp per token")
                args = (k, sf, ng, tg, True, 2.5)
                b.add("route", f"route [{form}] {sf} E={E} k={k} groups={ng}/{tg} M={m} {str(dtype)[6:]}",
                      lambda logits=logits, bias=bias, args=args: tuple(lowbit.route(logits, bias, *args)),
                      _route_check(lambda logits=logits, bias=bias, args=args:
                                   lowbit.route(logits.cpu(), bias.cpu(), *args), 0.99, 1e-5))

    # dense_router: lowbit's split-K gate GEMM + route as its dependent launch
    # (M <= 64, bf16, E % 16 == 0, H % 64 == 0: MT 1 / 2 / 4 and 2 expert
    # tiles per warp where E % 32 == 0), else cuBLAS + route.
    H = 1024 if b.small else 2048
    dense = [(1, 256, H, "sqrtsoftplus", 1, 1, 6), (16, 384, H, "sqrtsoftplus", 1, 1, 6),
             (33, 256, H, "sigmoid", 8, 4, 8), (64, 48, H, "sigmoid", 1, 1, 4),
             (300, 256, H, "sqrtsoftplus", 1, 1, 6), (8, 256, H + 8, "sigmoid", 8, 4, 8)]
    for m, E, h, sf, ng, tg, k in dense:
        g = b.gen("dense", m, E, h)
        hidden = b.randn(m, h, gen=g, dtype=torch.bfloat16)
        weight = b.randn(E, h, gen=g, dtype=torch.bfloat16, std=0.02)
        bias = b.randn(E, gen=g, std=0.1)
        form = "gate kernel + dependent route" if m <= 64 and E % 16 == 0 and h % 64 == 0 else "cuBLAS + route"
        args = (k, sf, ng, tg, True, 2.5)
        b.add("dense_router", f"dense_router [{form}] {sf} M={m} E={E} H={h} k={k}",
              lambda hidden=hidden, weight=weight, bias=bias, args=args:
              tuple(lowbit.dense_router(hidden, weight, bias, *args)),
              _route_check(lambda hidden=hidden, weight=weight, bias=bias, args=args:
                           lowbit.dense_router(hidden.cpu(), weight.cpu(), bias.cpu(), *args), 0.95, 1e-4))

    V, E, k = (1000, 64, 6) if b.small else (129280, 256, 6)
    g = b.gen("hash")
    table = torch.rand(V, E, generator=g, device=b.device).topk(k, dim=1).indices.int()
    for m, id_dtype, weighting, ldtype in ((500, torch.int64, "gate", torch.float32),
                                           (7, torch.int32, "gate", torch.bfloat16),
                                           (64, torch.int64, "uniform", torch.float32)):
        tids = torch.randint(0, V, (m,), generator=g, device=b.device).to(id_dtype)
        logits = b.randn(m, E, gen=g, dtype=ldtype, std=2.0)
        b.add("hash_router", f"hash_router {weighting} M={m} V={V} E={E} ids {str(id_dtype)[6:]}",
              lambda tids=tids, logits=logits, weighting=weighting:
              tuple(lowbit.hash_router(tids, table, logits, "sqrtsoftplus", weighting, True, 1.5)),
              _route_check(lambda tids=tids, logits=logits, weighting=weighting:
                           lowbit.hash_router(tids.cpu(), table.cpu(), logits.cpu(), "sqrtsoftplus", weighting,
                                              True, 1.5), 1.0, 1e-5))

    shapes = [(300, 256, 6), (64, 1000, 8), (4, 129280, 64)] if not b.small else [(16, 1000, 8), (2, 20000, 64)]
    for rows, cols, k in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            x = b.randn(rows, cols, gen=b.gen("topk", rows, cols, str(dtype)), dtype=dtype)
            x[:, ::97] = x[:, 5:6]  # exact ties

            def check(out, x=x, k=k):
                want = lowbit.topk(x.cpu(), k)
                return None if same_bits([t.cpu() for t in out], list(want)) else "differs from the CPU op"

            b.add("topk", f"topk {rows}x{cols} k={k} {str(dtype)[6:]}", lambda x=x, k=k: tuple(lowbit.topk(x, k)),
                  check)


# ----------------------------------------------------------------------- MoE --


class MoeExperts:
    """E random experts (0.02 randn) quantized and prepacked on the device;
    the checkpoint-layout tensors stay for the reference."""

    def __init__(self, b: Builder, E, H, I):
        g = b.gen("experts", E, H, I)
        self.E, self.H, self.I = E, H, I
        self.q13 = lowbit.nvfp4_quantize(b.randn(E, 2 * I, H, gen=g, dtype=torch.bfloat16, std=0.02))
        self.q2 = lowbit.nvfp4_quantize(b.randn(E, H, I, gen=g, dtype=torch.bfloat16, std=0.02))
        p = lowbit.nvfp4_moe_prepack(self.q13.packed, self.q13.block_scale, self.q2.packed, self.q2.block_scale)
        self.args = (p.w13, p.w13_scale, self.q13.global_scale, p.w2, p.w2_scale, self.q2.global_scale)

    def reference(self, x, w, ids, limit):
        """float32 on x's device, one active expert at a time (weights
        dequantized by lowbit.nvfp4_dequantize, itself checked bit for bit
        against the CPU op); h rounded to x's dtype as the kernels do."""
        out = torch.zeros(x.shape[0], self.H, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            if e < 0 or e >= self.E:
                continue
            tok, slot = (ids == e).nonzero(as_tuple=True)
            w13 = lowbit.nvfp4_dequantize(self.q13.packed[e], self.q13.block_scale[e], self.q13.global_scale[e],
                                          torch.float32).to(x.device)
            w2 = lowbit.nvfp4_dequantize(self.q2.packed[e], self.q2.block_scale[e], self.q2.global_scale[e],
                                         torch.float32).to(x.device)
            gu = x[tok].float() @ w13.T
            gate, up = gu[:, : self.I], gu[:, self.I:]
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            h = (F.silu(gate) * up).to(x.dtype).float()
            out.index_add_(0, tok, (h @ w2.T) * w[tok, slot][:, None])
        return out


# name, M, H, I, E, k, hot: the MoE plan follows the mean rows per expert
# M k / min(E, M k) (nvfp4_moe.cu plan): one token: direct (no align
# kernel); <= 16: narrow (with a hot list, mixed, where both GEMMs have
# over 8 waves of one-warp (item, W tile) pairs); <= 40 wide MT 4; < 80
# wide MT 8; < 128 wgmma 128-row items; else 256.
MOE_PLANS = [
    ("direct one token (streaming warps)", 1, 1024, 512, 16, 6, False),
    ("narrow", 8, 1024, 512, 64, 6, False),
    ("narrow 1 warp x 4 tiles/CTA", 30, 8208, 128, 32, 6, False),
    ("mixed (hot list)", 1000, 400, 208, 512, 8, True),
    ("wide MT4", 128, 256, 128, 8, 2, False),
    ("wide MT8", 256, 256, 128, 8, 2, False),
    ("wgmma 128-row items", 400, 256, 128, 8, 2, False),
    ("wgmma 256-row items", 600, 144, 48, 4, 2, False),
]
MOE_PLANS_SMALL = [
    ("direct one token (streaming warps)", 1, 256, 128, 16, 6, False),
    ("narrow", 8, 256, 128, 64, 6, False),
    ("mixed (hot list)", 1000, 400, 208, 512, 8, True),
    ("wide MT4", 128, 256, 128, 8, 2, False),
    ("wide MT8", 256, 256, 128, 8, 2, False),
    ("wgmma 128-row items", 400, 256, 128, 8, 2, False),
    ("wgmma 256-row items", 600, 144, 48, 4, 2, False),
]
# Routing modes: (score_func, n_group, topk_group) by E for the grouped
# (DeepSeek-V3) router.
GROUPS = {4: (2, 1), 8: (4, 2), 16: (4, 2), 32: (4, 2), 64: (8, 4), 512: (8, 4)}


def add_moe_cases(b: Builder):
    for plan in MOE_PLANS_SMALL if b.small else MOE_PLANS:
        _add_moe_plan(b, *plan)
    _add_moe_fp8(b, 300, 1024, 512, 32, 8, None)
    _add_moe_fp8(b, 64, 256, 128, 8, 2, 0.5)
    _add_moe_fp8(b, 600, 1024, 256, 16, 5, None)  # 187 rows per expert: an empty group after each expert's


MOE_FP8_TOL = 3e-2  # test_nvfp4_moe_fp8.py FP8_CUDA_TOL: fast accumulation and BF16 roundings, amplified by E4M3


def _add_moe_fp8(b: Builder, M, H, I, E, k, limit):
    # The FP8 path (fp8_min_rows = 1): the experts' E4M3 form made here
    # (checked bit for bit against the CPU op), then lowbit's sort / act /
    # combine kernels around torch's grouped FP8 GEMMs.
    exp = MoeExperts(b, E, H, I)
    g = b.gen("moe fp8 inputs", M, H, I, E, k)
    x = b.randn(M, H, gen=g, dtype=torch.bfloat16)
    ids = torch.rand(M, E, generator=g, device=b.device).topk(k, dim=1).indices.int()
    w = torch.rand(M, k, generator=g, device=b.device) + 0.05
    form = lowbit.nvfp4_moe_to_fp8(*exp.args)
    cpu_args = [t.cpu() for t in exp.args]
    cpu_form = lowbit.nvfp4_moe_to_fp8(*cpu_args)
    for got, want in zip(form, cpu_form):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), "nvfp4_moe_to_fp8 vs the CPU op"
    want = lowbit.nvfp4_moe(x.cpu(), w.cpu(), ids.cpu(), *cpu_args, limit, 1, *cpu_form).double()

    def check(y):
        err = rel_err(y, want)
        return None if err <= MOE_FP8_TOL else f"rel err {err:.2e} vs the CPU op"

    b.add("nvfp4_moe", f"nvfp4_moe [FP8 path, grouped FP8 GEMMs] M={M} H={H} I={I} E={E} k={k}"
          f"{' limit' if limit else ''}", lambda: lowbit.nvfp4_moe(x, w, ids, *exp.args, limit, 1, *form), check)


def _add_moe_plan(b: Builder, plan, M, H, I, E, k, hot):
    exp = MoeExperts(b, E, H, I)
    g = b.gen("moe inputs", plan)
    x = b.randn(M, H, gen=g, dtype=torch.bfloat16)
    gate = b.randn(E, H, gen=g, dtype=torch.bfloat16, std=0.02)
    bias = b.randn(E, gen=g, std=0.1)
    if hot:  # expert 0 picked by every token: a hot expert of M rows
        bias[0] = 100.0
    V = 1000
    scores = torch.rand(V, E, generator=g, device=b.device)
    if hot:
        scores[:, 0] = 2.0  # every token's first pick
    table = scores.topk(k, dim=1).indices.int()
    tids = torch.randint(0, V, (M,), generator=g, device=b.device)
    # The hash router's gate logits, made where the references run: under
    # sanitize_ops.py no cuBLAS kernel runs in the checked process but those
    # of the cases named "cuBLAS".
    logits = (_ref(x).float() @ _ref(gate).float().T).to(b.device).contiguous()
    limit = 0.5 if M % 2 == 0 else None  # clamps a share of gate / up (|gate_up| ~ 0.02 sqrt(H): 0.24-1.8)
    ng, tg = GROUPS[E]
    # dense_router's own gate kernel (routing.h dense_gate_supported), else
    # cuBLAS: named in the case, which racecheck and initcheck leave out.
    own_gate = M <= 64 and E % 16 == 0 and H % 64 == 0 and E <= 512 and k <= 32
    routers = {
        "dense": lambda: lowbit.dense_router(x, gate, bias, k, "sqrtsoftplus", 1, 1, True, 1.5),
        "grouped": lambda: lowbit.dense_router(x, gate, bias, k, "sigmoid", ng, tg, True, 2.5),
        "hash": lambda: lowbit.hash_router(tids, table, logits, "sqrtsoftplus", "gate", True, 1.5),
    }

    def check(out):
        w, ids, y = out
        if not torch.isfinite(y).all():
            return "non-finite output"
        if M * k * 3 * H * I <= CPU_MACS:
            cpu_args = [t.cpu() for t in exp.args]
            want, what = lowbit.nvfp4_moe(x.cpu(), w.cpu(), ids.cpu(), *cpu_args, limit).double(), "CPU op"
        else:
            want, what = exp.reference(_ref(x), _ref(w), _ref(ids), limit), "float32 reference"
        err = rel_err(y, want)
        return None if err <= MOE_TOL else f"rel err {err:.2e} vs the {what}"

    # The plan strings that change this case's kernels: stream only for one
    # token (nvfp4_moe.cu launch_narrow), hot only where a hot list runs.
    plan_strings = [""] + [p["moe"] for p in PLAN_SETS if ("stream=" in p["moe"] and M == 1) or
                           ("hot=" in p["moe"] and hot)]
    for mode, router in routers.items():
        for plan_string in plan_strings:
            def run(router=router, plan_string=plan_string):
                w, ids = router()
                return w, ids, _nvfp4_moe_with_plan(x, w, ids, *exp.args, limit, plan=plan_string)

            label = f"{plan}, plan {plan_string}" if plan_string else plan
            gate_form = " (cuBLAS gate)" if mode != "hash" and not own_gate else ""
            b.add("nvfp4_moe", f"nvfp4_moe [{label}] {mode} routing{gate_form} M={M} H={H} I={I} E={E} k={k}"
                  f"{' limit' if limit else ''}", run, check, plan_string)


# ---------------------------------------------------------------------- FP8 --

FP8_TOL = 1e-2  # device vs CPU op on the same FP8 operands: accumulation order and bf16 rounding only


def add_fp8_cases(b: Builder):
    """The FP8 training family: the cast (every scaling, transposed copy,
    both formats), the GEMM through cuBLASLt (every scaling pair), one
    Linear step (forward + backward op) per recipe and the delayed history's
    ops. Casts and the history are checked bit for bit against the CPU op;
    GEMM and Linear outputs within FP8_TOL of it."""
    from lowbit import Fp8Recipe

    m, k = (200, 264) if b.small else (1536, 2304)
    g = b.gen("fp8 cast")
    x = b.randn(m, k, gen=g, dtype=torch.bfloat16, std=2.0)
    x_cpu = x.cpu()
    for scaling in ("tensor", "row", "block", "block2d"):
        for fmt in ("e4m3", "e5m2") if scaling == "tensor" else ("e4m3",):
            def check_cast(out, scaling=scaling, fmt=fmt):
                want = lowbit.fp8_cast(x_cpu, scaling, fmt, transpose=True)
                return None if same_bits([t.cpu() for t in out], list(want)) else "differs from the CPU op"

            b.add("fp8_cast", f"fp8_cast {scaling} {fmt} + transpose {m}x{k}",
                  lambda scaling=scaling, fmt=fmt: tuple(lowbit.fp8_cast(x, scaling, fmt, transpose=True)),
                  check_cast)

    # Many rows, one column strip: the row amax pass walks several tiles
    # per CTA (fp8_cast.cu amax_kernel), misaligned rows take element loads.
    tall = b.randn(140000, 24, gen=g, dtype=torch.bfloat16, std=3.0)
    tall_cpu = tall.cpu()

    def check_tall(out):
        want = lowbit.fp8_cast(tall_cpu, "row", "e4m3", transpose=True)
        return None if same_bits([t.cpu() for t in out], list(want)) else "differs from the CPU op"

    b.add("fp8_cast", "fp8_cast row e4m3 + transpose 140000x24 (several tiles per amax CTA)",
          lambda: tuple(lowbit.fp8_cast(tall, "row", "e4m3", transpose=True)), check_tall)

    # x and W given in FP8 under one scale (an FP8 all-gather): their
    # transposed copies are the codes transposed (fp8_cast.cu
    # transpose_codes_kernel), 16-byte and byte paths; bit for bit. The op
    # runs its GEMM too ("cuBLASLt" in the name: the sanitizers that cannot
    # follow cuBLAS skip it); with a W of no rows there is no GEMM to run,
    # so the "alone" cases give them the transpose kernel by itself.
    tm, tn, tk = (192, 80, 272) if b.small else (4096, 1024, 2048)
    for rows, cols in ((tm, tk), (tm - 5, tk + 3)):
        for n, what in ((tn, "x and W transposed, cuBLASLt GEMM"), (0, "x transposed alone")):
            xq = lowbit.fp8_cast(b.randn(rows, cols, gen=g, dtype=torch.bfloat16), "tensor")
            wq = lowbit.fp8_cast(b.randn(n, cols, gen=g, dtype=torch.bfloat16), "tensor")
            w_hp = torch.zeros(n, cols, device=b.device, dtype=torch.bfloat16)
            state = lowbit.fp8_state(Fp8Recipe("tensorwise"), device=b.device)

            def transposed(xq=xq, wq=wq, w_hp=w_hp, state=state):
                out = torch.ops.lowbit.fp8_linear_forward(xq.data, w_hp, None, state, "tensorwise",
                                                          x_scale=xq.scale, out_dtype=torch.bfloat16,
                                                          w_fp8=wq.data, w_fp8_scale=wq.scale)
                return out[1], out[3]

            def check_transposed(out, xq=xq, wq=wq):
                want = [xq.data.cpu().view(torch.uint8).t(), wq.data.cpu().view(torch.uint8).t()]
                return None if same_bits([t.cpu().view(torch.uint8) for t in out], want) else "differs from the codes"

            b.add("fp8_cast", f"FP8 {what} (fp8_linear_forward, given operands) {rows}x{cols}", transposed,
                  check_transposed)

    gm, gn, gk = (128, 256, 512) if b.small else (1024, 2048, 1536)
    g = b.gen("fp8 gemm")
    a_hp = b.randn(gm, gk, gen=g, dtype=torch.bfloat16)
    w_hp = b.randn(gn, gk, gen=g, dtype=torch.bfloat16, std=gk**-0.5)
    # bfloat16 outputs run cuBLASLt (row x row at the small sizes through its
    # unit-scale GEMM and lowbit's scaling pass, as below); float32 ones with
    # block scales lowbit's block-scaled kernel (2-CTA clusters, multicast
    # copies)
    gemm_cases = [(sa, sb, None, "cuBLASLt") for sa, sb in
                  (("tensor", "tensor"), ("row", "row"), ("block", "block"), ("block", "block2d"))]
    gemm_cases += [("block", sb, torch.float32, "float32 out, lowbit's block kernel") for sb in ("block", "block2d")]
    for sa, sb, out_dtype, path in gemm_cases:
        qa, qb = lowbit.fp8_cast(a_hp, sa), lowbit.fp8_cast(w_hp, sb)
        operands = (qa.data, qa.scale, qb.data, qb.scale, sa, sb, None, out_dtype)

        def check_gemm(out, operands=operands):
            want = lowbit.fp8_gemm(*[t.cpu() if isinstance(t, torch.Tensor) else t for t in operands])
            err = rel_err(out[0], want)
            return None if err < FP8_TOL else f"rel err {err:.2e} vs the CPU op"

        b.add("fp8_gemm", f"fp8_gemm {sa} x {sb} ({path}) M={gm} N={gn} K={gk}",
              lambda operands=operands: (lowbit.fp8_gemm(*operands),), check_gemm)

    # Row x row E4M3 with an output small enough for cuBLASLt's unit-scale
    # GEMM into FP32 and lowbit's scaling pass (fp8_row_gemm_cuda.h);
    # partial row and column tiles (and K at the small sizes), a bias.
    sm, sn, sk = (200, 272, 3088) if b.small else (300, 1040, 4096)
    g = b.gen("fp8 unit-scale gemm")
    qa = lowbit.fp8_cast(b.randn(sm, sk, gen=g, dtype=torch.bfloat16), "row")
    qb = lowbit.fp8_cast(b.randn(sn, sk, gen=g, dtype=torch.bfloat16, std=sk**-0.5), "row")
    unit_bias = b.randn(sn, gen=g, dtype=torch.bfloat16, std=0.1)
    unit_operands = (qa.data, qa.scale, qb.data, qb.scale, "row", "row", unit_bias, torch.bfloat16)

    def check_unit(out):
        want = lowbit.fp8_gemm(*[t.cpu() if isinstance(t, torch.Tensor) else t for t in unit_operands])
        err = rel_err(out[0], want)
        return None if err < FP8_TOL else f"rel err {err:.2e} vs the CPU op"

    b.add("fp8_gemm", f"fp8_gemm row x row (unit-scale cuBLASLt GEMM + scaling pass) M={sm} N={sn} K={sk}",
          lambda: (lowbit.fp8_gemm(*unit_operands),), check_unit)

    lm, ln, lk = (256, 384, 512) if b.small else (2048, 1536, 1024)
    g = b.gen("fp8 linear")
    lx = b.randn(lm, lk, gen=g, dtype=torch.bfloat16)
    lw = b.randn(ln, lk, gen=g, std=lk**-0.5)
    lb = b.randn(ln, gen=g, std=0.1)
    ldy = b.randn(lm, ln, gen=g, dtype=torch.bfloat16, std=1e-2)
    for recipe in (Fp8Recipe("tensorwise"), Fp8Recipe("delayed", amax_history_len=4),
                   Fp8Recipe("rowwise", grad_format="e5m2"), Fp8Recipe("blockwise")):
        history = lowbit.fp8_state(recipe, device=b.device)
        if recipe.stateful:  # a history already in use, so the scales come from it
            history.copy_(torch.rand(history.shape, generator=g, device=b.device) * 4)

        def step(x, w, bias, dy, history, recipe=recipe):
            # One training step of the layer; the (delayed) history restarts
            # from the same values every time, so each run is the same step.
            state = history.clone()
            with torch.enable_grad():
                x, w, bias = (t.clone().requires_grad_() for t in (x, w, bias))
                y = lowbit.fp8_linear(x, w, bias, recipe=recipe, state=state)
                y.backward(dy)
            return y.detach(), x.grad, w.grad, bias.grad, state

        def check_step(out, step=step, history=history):
            want = step(*(t.cpu() for t in (lx, lw, lb, ldy, history)))
            for name, got, w in zip(("y", "dx", "dW", "db"), out, want):
                err = rel_err(got, w)
                if not err < FP8_TOL:
                    return f"{name}: rel err {err:.2e} vs the CPU op"
            return None if same_bits([out[4].cpu()], [want[4]]) else "amax history differs from the CPU op"

        b.add("fp8_linear", f"fp8_linear forward + backward (cuBLASLt GEMMs) {recipe.name} {recipe.grad_format} M={lm} N={ln} K={lk}",
              lambda step=step, history=history: step(lx, lw, lb, ldy, history), check_step)

    # The delayed history's kernels on their own (fp8_history.cu): a history
    # longer than the record kernel's chunk (its roll crosses chunks), every
    # row's scale both ways, then a record into each row (one non-finite).
    g = b.gen("fp8 history")
    hist = torch.rand(3, 1500, generator=g, device=b.device) * 4 + 0.5
    hist_amax = torch.tensor([2.5, float("inf"), 0.25], device=b.device)

    def history_step(hist, amax):
        h = hist.clone()
        scales = [torch.ops.lowbit.fp8_delayed_scale(h, row, mode, 1, True)
                  for row in range(3) for mode in ("max", "most_recent")]
        for row in range(3):
            torch.ops.lowbit.fp8_record_amax(h, row, amax[row])
        return (*scales, h)

    def check_history(out):
        return None if same_bits([t.cpu() for t in out], list(history_step(hist.cpu(), hist_amax.cpu()))) \
            else "differs from the CPU ops"

    b.add("fp8_record_amax", "fp8_delayed_scale + fp8_record_amax, history [3, 1500]",
          lambda: history_step(hist, hist_amax), check_history)


FAMILIES = {"quant": add_quant_cases, "linear": add_linear_cases, "grouped": add_grouped_linear_cases,
            "routing": add_routing_cases, "moe": add_moe_cases, "fp8": add_fp8_cases}


def build_cases(device: str, small: bool = False, families=None) -> list[Case]:
    """Every op's cases on `device` (small: the sanitizers' sizes), or those
    of the FAMILIES named in `families`."""
    b = Builder(device, small)
    with torch.no_grad():
        for name, add in FAMILIES.items():
            if families is None or name in families:
                add(b)
    return b.cases


# -------------------------------------------------------------- one process --


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_process(device, small, seconds, out_path, ready_path=None, go_path=None, seed=0):
    """Builds the cases, checks first results, waits for the go signal, loops.
    Writes a JSON report {case name: {...}} to out_path."""
    torch.set_num_threads(min(2, torch.get_num_threads()))
    t0 = time.monotonic()
    report = {"cases": {}, "errors": [], "env": {k: v for k, v in os.environ.items() if k.startswith("LOWBIT_")}}
    try:
        with torch.no_grad():
            cases = build_cases(device, small)
            firsts = []
            for case in cases:
                entry = report["cases"][case.name] = {"op": case.op, "runs": 0, "mismatches": 0, "ref": None,
                                                      "error": None}
                try:
                    firsts.append(case.run())
                    entry["runs"] = 1
                except Exception as e:  # noqa: BLE001 - reported per case
                    firsts.append(None)
                    entry["error"] = f"{type(e).__name__}: {e}"[:300]
            _sync(device)
            for case, first in zip(cases, firsts):
                if first is None:
                    continue
                try:
                    report["cases"][case.name]["ref"] = case.check(first)
                except Exception as e:  # noqa: BLE001
                    report["cases"][case.name]["ref"] = f"check raised {type(e).__name__}: {e}"[:300]
            report["setup_s"] = round(time.monotonic() - t0, 1)
            if ready_path:
                Path(ready_path).touch()
                wait_until = time.monotonic() + 600
                while not Path(go_path).exists() and time.monotonic() < wait_until:
                    time.sleep(0.05)
            rng = random.Random(seed)
            live = [(c, f) for c, f in zip(cases, firsts) if f is not None]
            deadline = time.monotonic() + seconds
            iterations = 0
            while time.monotonic() < deadline or iterations == 0:
                rng.shuffle(live)  # other neighbours for every kernel, every round
                outs = []
                for case, _ in live:
                    try:
                        outs.append(case.run())
                    except Exception as e:  # noqa: BLE001
                        outs.append(None)
                        report["cases"][case.name]["error"] = f"{type(e).__name__}: {e}"[:300]
                for (case, first), out in zip(live, outs):
                    entry = report["cases"][case.name]
                    entry["runs"] += 1
                    if out is None or not same_bits(out, first):
                        entry["mismatches"] += 1
                iterations += 1
            report["iterations"] = iterations
            report["loop_s"] = round(time.monotonic() - deadline + seconds, 1)
    except Exception:  # noqa: BLE001
        report["errors"].append(traceback.format_exc()[-3000:])
        if ready_path:
            Path(ready_path).touch()
    Path(out_path).write_text(json.dumps(report, indent=1))
    return report


# ---------------------------------------------------------------- the test --


def summarize(reports: list[dict]) -> tuple[list[str], list[str]]:
    """(table lines per op, failure lines)."""
    ops: dict[str, dict] = {}
    failures = []
    for i, rep in enumerate(reports):
        for err in rep.get("errors", []):
            failures.append(f"process {i}: {err.strip().splitlines()[-1]}")
        for name, c in rep.get("cases", {}).items():
            o = ops.setdefault(c["op"], {"cases": set(), "runs": 0, "mismatches": 0, "ref_fail": 0, "errors": 0})
            o["cases"].add(name)
            o["runs"] += c["runs"]
            o["mismatches"] += c["mismatches"]
            o["ref_fail"] += c["ref"] is not None
            o["errors"] += c["error"] is not None
            if c["mismatches"]:
                failures.append(f"process {i}: {name}: {c['mismatches']} of {c['runs']} runs differ from the first")
            if c["ref"] is not None:
                failures.append(f"process {i}: {name}: first result: {c['ref']}")
            if c["error"] is not None:
                failures.append(f"process {i}: {name}: {c['error']}")
    lines = [f"| {'op':<22} | cases | runs | mismatches | reference failures | errors |",
             f"| {'-' * 22} | ----- | ---- | ---------- | ------------------ | ------ |"]
    for op, o in ops.items():
        lines.append(f"| {op:<22} | {len(o['cases']):5} | {o['runs']:4} | {o['mismatches']:10} | "
                     f"{o['ref_fail']:18} | {o['errors']:6} |")
    return lines, failures


def _child_env():
    import lowbit as lb

    path = os.pathsep.join([os.path.dirname(os.path.dirname(lb.__file__)), os.environ.get("PYTHONPATH", "")])
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_") or k in (
        "LOWBIT_OPS_LIBRARY", "LOWBIT_CONCURRENCY_SECONDS")}
    env.update(PYTHONPATH=path, OMP_NUM_THREADS="2")
    return env


# Every form of the Linear's dispatch (the forms explain_plan names).
LINEAR_FORMS = {"stream", "stream-k", "narrow", "panel", "wide", "wgmma", "unpack"}


@pytest.mark.parametrize("shapes", ["full", "small"])
def test_cuda_linear_cases_reach_every_form(shapes):
    """The Linear cases, with the plan sets, run every kernel form on this GPU
    (the sanitizers run the small ones): a retuned plan that moves a shape off
    its form shows here, not as a form no case checks."""
    forms = set()
    for n, k, runs in LINEAR_SHAPES if shapes == "full" else LINEAR_SHAPES_SMALL:
        for m, _, _ in runs:
            forms.add(_explain_plan(m, n, k, "cuda").form)
            if m <= 2048:
                forms.update(_explain_plan(m, n, k, "cuda", p["linear"]).form for p in PLAN_SETS)
    assert forms >= LINEAR_FORMS, f"no case reaches {sorted(LINEAR_FORMS - forms)}"


def test_cuda_every_op_from_several_processes_at_once(tmp_path):
    procs = []
    for i in range(PROCS):
        cmd = [sys.executable, __file__, "--device", "cuda", "--seconds", str(SECONDS), "--out",
               str(tmp_path / f"report{i}.json"), "--ready", str(tmp_path / f"ready{i}"), "--go",
               str(tmp_path / "go"), "--seed", str(i)]
        log = open(tmp_path / f"log{i}.txt", "w")
        procs.append((subprocess.Popen(cmd, env=_child_env(), stdout=log, stderr=subprocess.STDOUT), log))
    start = time.monotonic()
    try:
        # Every process ready (or gone) before any starts its loop: the loops overlap.
        while time.monotonic() - start < 300:
            if all((tmp_path / f"ready{i}").exists() or p.poll() is not None for i, (p, _) in enumerate(procs)):
                break
            time.sleep(0.1)
        (tmp_path / "go").touch()
        for p, _ in procs:
            p.wait(timeout=max(60, 300 - (time.monotonic() - start)) + SECONDS)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    reports = []
    for i, (p, _) in enumerate(procs):
        path = tmp_path / f"report{i}.json"
        if path.exists():
            reports.append(json.loads(path.read_text()))
        else:
            tail = (tmp_path / f"log{i}.txt").read_text()[-2000:]
            reports.append({"errors": [f"exit code {p.returncode}, no report; log tail:\n{tail}"], "cases": {}})
    lines, failures = summarize(reports)
    iters = [r.get("iterations", 0) for r in reports]
    setup = [r.get("setup_s", 0) for r in reports]
    head = (f"{PROCS} processes, loops of {SECONDS:g} s, iterations per process {iters}, setup seconds {setup}; "
            "plan sets beside the shipped plan: " + "; ".join(" ".join(f"{k} {v}" for k, v in s.items()) for s in PLAN_SETS))
    text = "\n".join([head, *lines, *(["failures:", *failures[:60]] if failures else ["no failures"])])
    print(text)
    if os.environ.get("LOWBIT_CONCURRENCY_REPORT"):
        Path(os.environ["LOWBIT_CONCURRENCY_REPORT"]).write_text(text + "\n")
    assert not failures, text
    assert all(n >= 2 for n in iters), text


def main(argv=None):
    p = argparse.ArgumentParser(description="One process of the concurrency test (or a dry run).")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="the sanitizers' sizes")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--out", default=None)
    p.add_argument("--ready", default=None)
    p.add_argument("--go", default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = a.out or os.devnull
    rep = run_process(a.device, a.small, a.seconds, out, a.ready, a.go, a.seed)
    if a.out is None:
        lines, failures = summarize([rep])
        print("\n".join(lines + failures + [f"iterations {rep.get('iterations')} setup {rep.get('setup_s')} s"]))
        return 1 if failures else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
