"""The fp8_gemm benchmark suite's rows, from made-up timings (no GPU): the
three GEMMs' dimensions, speedups against cuBLASLt's block scaling and BF16,
the floor and the rows of providers that did not run."""

import pytest

from lowbit.bench import fp8_gemm
from lowbit.bench.__main__ import available_suites
from lowbit.bench.harness import Hardware

HW = Hardware("fake", 132, 50 * 2**20, hbm_bytes_per_s=3e12, bf16_flops=700e12, fp8_flops=1400e12)


def test_registered():
    assert "fp8_gemm" in available_suites()


def test_gemm_dims_follow_the_step():
    shape = (16384, 4096, 14336)  # M tokens, K in, N out
    assert fp8_gemm.gemm_dims(shape, "fprop") == (16384, 14336, 4096)
    assert fp8_gemm.gemm_dims(shape, "dgrad") == (16384, 4096, 14336)
    assert fp8_gemm.gemm_dims(shape, "wgrad") == (14336, 4096, 16384)


def test_rows_from_fake_timings():
    shape = (2048, 4096, 1024)
    times = {"lowbit": 5e-6, "lowbit:fp32": 4e-6, "lowbit:fp16": 80e-6, "cublaslt:block": 5e-6,
             "cublaslt:tensor": 3.5e-6, "bf16": 8e-6}
    notes = {"lowbit:fp32": "max |lowbit:fp32 - cublaslt:block| = 1.0e-03 of max |y|"}
    rows = {r["provider"]: r for r in fp8_gemm.make_rows(HW, shape, "dgrad", times, notes)}
    assert list(rows) == list(fp8_gemm.PROVIDERS)
    assert rows["lowbit:fp16"]["x_block"] == pytest.approx(1 / 16)
    ours = rows["lowbit:fp32"]
    flops = 2.0 * 2048 * 4096 * 1024
    assert ours["us"] == pytest.approx(4.0) and ours["TFLOP/s"] == pytest.approx(flops / 4e-6 / 1e12)
    assert ours["x_block"] == pytest.approx(1.25) and ours["x_bf16"] == pytest.approx(2.0)
    assert ours["%floor"] == pytest.approx(100 * flops / 1400e12 / 4e-6)
    assert ours["note"] == notes["lowbit:fp32"]
    assert rows["cublaslt:block"]["x_block"] == pytest.approx(1.0)


def test_rows_of_providers_that_did_not_run():
    times = {"lowbit": 4e-6, "bf16": 8e-6}
    notes = {"cublaslt:block": "RuntimeError: no block scaling"}
    rows = {r["provider"]: r for r in fp8_gemm.make_rows(HW, (256, 256, 256), "wgrad", times, notes)}
    assert rows["cublaslt:block"]["us"] == "n/a" and rows["cublaslt:block"]["note"] == notes["cublaslt:block"]
    assert rows["cublaslt:tensor"]["note"] == "not run"
    assert rows["lowbit"]["x_block"] == "n/a" and rows["lowbit"]["x_bf16"] == pytest.approx(2.0)
