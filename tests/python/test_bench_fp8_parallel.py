"""The fp8_parallel benchmark's logic on the CPU: its providers' steps on
two processes over gloo at toy sizes (Dynamo's aot_eager backend, no CUDA
graphs), and its rows and bars from given timings."""

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lowbit.bench import fp8_parallel
from lowbit.bench.harness import Hardware, format_table

HW = Hardware("test", 132, 50 << 20, 3e12, 800e12, 1400e12)


def _worker(rank, world, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = fp8_parallel.build_and_time(rank, world, torch.device("cpu"), seq=128, d=128, hidden=256,
                                             use_graph=False, samples=2, reps=1, backend="aot_eager")
        times = fp8_parallel._slowest(result, torch.device("cpu"))
        if rank == 0:
            torch.save({"times": times, "notes": result["notes"]}, out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
def test_every_provider_runs_on_two_cpu_processes():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, f"{d}/init", f"{d}/out.pt"), nprocs=2)
        got = torch.load(f"{d}/out.pt")
    want = set(fp8_parallel.provider_names()) - {"torchao"}
    assert set(got["times"]) == want, got["notes"]
    assert all(t > 0 for t in got["times"].values())
    # torchao's row: not importable (a benchmark-only dependency), or its FP8
    # all-gather, which gloo does not carry; either way a note says why.
    assert set(got["notes"]) == {"torchao"} and got["notes"]["torchao"], got["notes"]
    # Not Dynamo's recompile limit: every provider compiles the same
    # nn.Sequential.forward, torchao's last (it failed so at 661f7c5).
    assert "RecompileLimit" not in got["notes"]["torchao"], got["notes"]
    rows = fp8_parallel.make_rows(HW, 128, 128, 256, 2, got["times"], got["notes"])
    assert len(format_table(rows, fp8_parallel.COLUMNS).splitlines()) == 2 + len(fp8_parallel.provider_names())


def test_rows_and_bars_from_given_times():
    times = {"bf16": 10e-3, "lowbit:tensorwise": 6.5e-3, "lowbit:delayed": 7.5e-3, "lowbit:rowwise": 8e-3,
             "lowbit:tensorwise, bf16 all-gather": 7e-3, "all-gather x: bf16": 1e-3, "all-gather x: fp8": 0.5e-3}
    notes = {"lowbit:blockwise": "RuntimeError: x", "torchao": "ModuleNotFoundError: torchao"}
    seq, d, h = fp8_parallel.SEQ_PER_GPU, fp8_parallel.D, fp8_parallel.HIDDEN
    rows = {r["provider"]: r for r in fp8_parallel.make_rows(HW, seq, d, h, 2, times, notes)}
    assert list(rows) == fp8_parallel.provider_names()
    tw = rows["lowbit:tensorwise"]
    assert tw["x_bf16"] == pytest.approx(10 / 6.5) and tw["bar"] == "ok"
    assert tw["x_allgather_MB"] == pytest.approx(2 * seq * d / 1e6)  # FP8: one byte per element of the whole x
    assert rows["lowbit:tensorwise, bf16 all-gather"]["x_allgather_MB"] == pytest.approx(2 * 2 * seq * d / 1e6)
    assert rows["lowbit:delayed"]["x_allgather_MB"] == tw["x_allgather_MB"]  # delayed gathers FP8 too
    assert rows["lowbit:rowwise"]["x_allgather_MB"] == pytest.approx(2 * 2 * seq * d / 1e6)
    flops = 2 * 3 * 2.0 * 2 * seq * d * h / 2
    assert tw["%floor"] == pytest.approx(100 * flops / HW.fp8_flops / 6.5e-3)
    assert rows["bf16"]["%floor"] == pytest.approx(100 * flops / HW.bf16_flops / 10e-3)
    assert rows["lowbit:blockwise"]["us"] == "n/a" and rows["lowbit:blockwise"]["note"] == "RuntimeError: x"
    assert rows["torchao"]["us"] == "n/a" and rows["torchao"]["note"] == "ModuleNotFoundError: torchao"
    with_ao = {r["provider"]: r for r in fp8_parallel.make_rows(HW, seq, d, h, 2, dict(times, torchao=7.2e-3), {})}
    assert with_ao["torchao"]["x_bf16"] == pytest.approx(10 / 7.2)
    assert with_ao["torchao"]["x_allgather_MB"] == tw["x_allgather_MB"]  # torchao gathers x in FP8 too
    assert rows["all-gather x: fp8"]["x_allgather_MB"] * 2 == rows["all-gather x: bf16"]["x_allgather_MB"]
    slow = fp8_parallel.make_rows(HW, seq, d, h, 2, dict(times, **{"lowbit:tensorwise": 8e-3}), notes)
    assert next(r for r in slow if r["provider"] == "lowbit:tensorwise")["bar"] == "MISS: x_bf16 < 1.4"
    # Every lowbit recipe that gathers x in FP8 is checked; the others,
    # which gather BF16, have no bar (no byte saving to show).
    assert rows["lowbit:delayed"]["bar"] == "MISS: x_bf16 < 1.4"  # 10 / 7.5 = 1.33
    assert "bar" not in rows["lowbit:rowwise"] and "bar" not in rows["lowbit:tensorwise, bf16 all-gather"]
    assert [fp8_parallel.gathers_fp8(n) for n in ("lowbit:delayed, scatter overlap", "lowbit:tensorwise",
                                                   "lowbit:tensorwise, bf16 all-gather", "lowbit:rowwise", "bf16")] \
        == [True, True, False, False, False]
    assert fp8_parallel.compile_options("lowbit:delayed, scatter overlap", "inductor") == \
        {"reorder_for_peak_memory": False}
    assert fp8_parallel.compile_options("lowbit:delayed, scatter overlap", "aot_eager") is None
    assert fp8_parallel.compile_options("lowbit:delayed", "inductor") is None
    fast = {r["provider"]: r for r in fp8_parallel.make_rows(HW, seq, d, h, 2, dict(times, **{"lowbit:delayed": 7e-3}),
                                                              notes)}
    assert fast["lowbit:delayed"]["bar"] == "ok"
