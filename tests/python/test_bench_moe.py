"""The MoE benchmark's logic on the CPU at toy sizes: every case gives one
row per provider (lowbit W4A16, lowbit:auto, lowbit:fp8) against the same
BF16 peer, each provider calls nvfp4_moe with its own fp8_min_rows, the
FP8 rows take the FP8 floor, and the bars read as the suite states them."""

import pytest
import torch

from lowbit.bench import moe as bench_moe
from lowbit.bench.harness import Hardware

HW = Hardware("test", 132, 1 << 20, 3e12, 800e12, 1600e12)
PROVIDERS = ["lowbit", "lowbit:auto", "lowbit:fp8"]


def test_dry_run_rows_per_provider(monkeypatch):
    # H, E routed, k, I, swiglu_limit: small enough for the CPU, M on both
    # sides of "auto"'s threshold.
    monkeypatch.setitem(bench_moe.LAYERS, "toy", (64, 4, 2, 32, 10.0))
    for name in ("reset_peak_memory_stats", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 0)
    calls = []

    def fake_time(fn, n, m, what):
        calls.append(what)
        for i in range(n):
            fn(i)
        return 1e-3 if what.endswith("bf16 peer") else 4e-4

    monkeypatch.setattr(bench_moe, "_time", fake_time)
    ms = [1, bench_moe.fp8_min_rows("lowbit:auto", 4, 2)]  # 32 rows per expert: 64 tokens
    assert ms[1] == 64
    cases = bench_moe.bench_layer(HW, "toy", ms, has_moe=True, device="cpu")
    rows = bench_moe._finish(cases)
    assert len(rows) == 3 * len(ms) * len(bench_moe.ROUTINGS)
    assert [r["provider"] for r in rows[:3]] == PROVIDERS
    assert sum(w.endswith("bf16 peer") for w in calls) == len(cases)  # one peer timing serves the three
    by = {(r["routing"], r["M"], r["provider"]): r for r in rows}
    for routing in bench_moe.ROUTINGS:
        small, big = (by[routing, m, "lowbit"] for m in ms)
        # W4A16 and "auto" below its threshold: the same call, the same output.
        assert by[routing, 1, "lowbit:auto"]["rel_err"] == small["rel_err"] < bench_moe.REL_ERR_WARN
        # "fp8" at every M and "auto" from its threshold: the FP8 path, its floor.
        for m in ms:
            fp8 = by[routing, m, "lowbit:fp8"]
            assert small["rel_err"] < fp8["rel_err"] < bench_moe.FP8_REL_ERR_WARN
            assert fp8["bytes"] > by[routing, m, "lowbit"]["bytes"]
        assert by[routing, ms[1], "lowbit:auto"]["rel_err"] == by[routing, ms[1], "lowbit:fp8"]["rel_err"]
        assert by[routing, ms[1], "lowbit:auto"]["bytes"] == by[routing, ms[1], "lowbit:fp8"]["bytes"]
        assert by[routing, 1, "lowbit:auto"]["floor_us"] == small["floor_us"]
        assert all(r["x_bf16"] == pytest.approx(2.5) for r in (small, big))


def case(routing, m, times, bf16_s=1e-3):
    return {"layer": "L", "routing": routing, "M": m, "active": 4.0, "n_sets": 2, "bytes": 1e6, "bytes_fp8": 2e6,
            "floor_s": 1e-4, "floor_fp8_s": 2e-4, "bf16_s": bf16_s, "lowbit_s": times, "rel_err": {},
            "fp8_min_rows": {"lowbit": 0, "lowbit:auto": 1024, "lowbit:fp8": 1}}


def test_bars():
    rows = bench_moe._finish([
        case("uniform", 64, {"lowbit": 1.2e-4, "lowbit:auto": 1.2e-4, "lowbit:fp8": 1e-4}, bf16_s=4e-4),
        case("uniform", 4096, {"lowbit": 8e-4, "lowbit:auto": 4e-4, "lowbit:fp8": 4e-4}),
        case("skewed", 4096, {"lowbit": 1.2e-3, "lowbit:auto": 6e-4}),
        case("one-expert", 4096, {"lowbit": 2e-3, "lowbit:auto": 7e-4, "lowbit:fp8": 9e-4}),
    ])
    bar = {(r["routing"], r["M"], r["provider"]): r["bar"] for r in rows}
    assert bar["uniform", 64, "lowbit"] == bar["uniform", 64, "lowbit:auto"] == "pass"  # 83% of the floor, 3.3x
    assert bar["uniform", 64, "lowbit:fp8"] == "-"
    assert bar["uniform", 4096, "lowbit"] == "pass" and bar["uniform", 4096, "lowbit:auto"] == "pass"
    assert bar["uniform", 4096, "lowbit:fp8"] == "-"
    assert bar["skewed", 4096, "lowbit"] == "FAIL x_bf16<1" and bar["skewed", 4096, "lowbit:auto"] == "FAIL x_bf16<2"
    assert bar["skewed", 4096, "lowbit:fp8"] == "n/a"
    assert bar["one-expert", 4096, "lowbit"] == "FAIL 2.50x uniform"  # against its own uniform time
    assert bar["one-expert", 4096, "lowbit:auto"] == "FAIL x_bf16<2"  # 1.75x uniform, 1.43x the peer
    assert bar["one-expert", 4096, "lowbit:fp8"] == "FAIL 2.25x uniform"
    fp8 = next(r for r in rows if (r["routing"], r["M"], r["provider"]) == ("uniform", 4096, "lowbit:auto"))
    assert fp8["floor_us"] == pytest.approx(200) and fp8["%floor"] == pytest.approx(50)
    assert fp8["GB/s"] == pytest.approx(2e6 / 4e-4 / 1e9)


def test_token_counts_from_shapes():
    assert bench_moe.token_counts([(256,), (1024,)]) == [256, 1024]
    with pytest.raises(ValueError, match=r"--shapes are token counts M >= 1"):
        bench_moe.token_counts([(256, 7168)])
    with pytest.raises(ValueError, match=r"--shapes are token counts M >= 1"):
        bench_moe.token_counts([(0,)])
