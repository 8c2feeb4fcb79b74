"""The fp8_train benchmark suite's rows, from made-up timings (no GPU):
speedups, the torchao peer of each recipe, the floor, issue 40's bars and
the n/a rows of providers that did not run."""

import pytest

from lowbit.bench import fp8_train
from lowbit.bench.__main__ import available_suites
from lowbit.bench.harness import Hardware, format_table

HW = Hardware("fake", 132, 50 * 2**20, hbm_bytes_per_s=3e12, bf16_flops=700e12, fp8_flops=1400e12)


def test_registered_and_shapes():
    assert "fp8_train" in available_suites()
    assert fp8_train.SHAPES[:2] == [(16384, 4096, 14336), (16384, 14336, 4096)] == fp8_train.BAR_SHAPES
    assert set(fp8_train.QUICK_SHAPES) <= set(fp8_train.SHAPES)


def test_floor_adds_gemms_and_bytes():
    m, k, n = 2048, 4096, 1024
    want = 6.0 * m * n * k / 1400e12 + 4.0 * (m * k + n * k + m * n) / 3e12
    assert fp8_train.floor_s(HW, m, k, n) == pytest.approx(want)


def test_rows_from_fake_timings():
    shape = fp8_train.SHAPES[0]
    t = {"bf16": 10e-3, "lowbit:tensorwise": 6e-3, "lowbit:delayed": 6.5e-3, "lowbit:rowwise": 7e-3,
         "lowbit:auto": 10.4e-3, "torchao:tensorwise": 7e-3, "torchao:rowwise": 6.9e-3, "torchao:rowwise_with_gw_hp": 8e-3}
    notes = {"lowbit:blockwise": "NotImplementedError: blockwise needs K % 128 == 0"}
    rows = {r["provider"]: r for r in fp8_train.make_rows(HW, shape, t, notes)}
    assert list(rows) == fp8_train.provider_names()
    tw = rows["lowbit:tensorwise"]
    assert tw["us"] == pytest.approx(6000) and tw["x_bf16"] == pytest.approx(10 / 6)
    assert tw["peer"] == "torchao:tensorwise" and tw["x_peer"] == pytest.approx(7 / 6)
    assert tw["%floor"] == pytest.approx(100 * fp8_train.floor_s(HW, *shape) / 6e-3)
    assert tw["TFLOP/s"] == pytest.approx(6.0 * 16384 * 4096 * 14336 / 6e-3 / 1e12)
    assert tw["bar"] == "ok"  # 1.67x >= 1.60x, faster than torchao
    assert rows["lowbit:delayed"]["peer"] == "torchao:tensorwise"
    assert rows["lowbit:delayed"]["bar"] == "MISS: x_bf16 < 1.65"  # 1.54x
    assert rows["lowbit:rowwise"]["bar"] == "MISS: not faster than torchao:rowwise"
    assert rows["lowbit:blockwise"]["us"] == "n/a" and rows["lowbit:blockwise"]["bar"] == "n/a"
    assert rows["lowbit:blockwise"]["note"].startswith("NotImplementedError")
    assert rows["lowbit:auto"]["bar"] == "MISS: x_bf16 < 0.97" and "peer" not in rows["lowbit:auto"]  # 0.96x
    assert "peer" not in rows["bf16"] and rows["bf16"]["x_bf16"] == pytest.approx(1.0)
    assert "bar" not in rows["torchao:rowwise"]
    table = format_table(list(rows.values()), fp8_train.COLUMNS)
    assert len(table.splitlines()) == 2 + len(rows)


def test_rows_without_torchao_and_off_bar_shapes():
    reason = "torchao not importable (ModuleNotFoundError: No module named 'torchao')"
    t = {"bf16": 1e-3, "lowbit:tensorwise": 1e-3, "lowbit:blockwise": 0.9e-3, "lowbit:auto": 1.02e-3}
    notes = {f"torchao:{r}": reason for r in fp8_train.TORCHAO_RECIPES}
    rows = {r["provider"]: r for r in fp8_train.make_rows(HW, (2048, 4096, 4096), t, notes)}
    # Off the bar shapes only torchao's peer counts, which is missing here.
    assert rows["lowbit:tensorwise"]["bar"] == "ok (peer n/a)" and rows["lowbit:tensorwise"]["x_peer"] == "n/a"
    assert rows["lowbit:auto"]["bar"] == "ok"  # 0.98x
    blockwise = rows["lowbit:blockwise"]
    assert blockwise["peer"] == blockwise["x_peer"] == "-" and blockwise["bar"] == "ok"
    for r in fp8_train.TORCHAO_RECIPES:
        assert rows[f"torchao:{r}"]["us"] == "n/a" and rows[f"torchao:{r}"]["note"] == reason
    assert fp8_train.bar((2048, 4096, 4096), "tensorwise", 0.5, 1.2) == "ok"
    assert fp8_train.bar(fp8_train.SHAPES[1], "rowwise", 1.39, 0.99) == \
        "MISS: x_bf16 < 1.40, not faster than torchao:rowwise"


def test_torchao_absent_gives_a_reason_or_the_api():
    ao = fp8_train.torchao_float8()
    if isinstance(ao, str):
        assert ao.startswith("torchao not importable")
    else:
        convert, config, version = ao
        assert callable(convert) and hasattr(config, "from_recipe_name") and version


def test_steps_run_on_the_cpu():
    # The providers' steps as the suite builds them (Dynamo's eager backend:
    # the graph capture without Inductor's compile time). lowbit's recipes
    # need lowbit.fp8; a provider that cannot run says why in the notes.
    ao = fp8_train.torchao_float8()
    providers, names, notes = fp8_train.build_steps((32, 64, 48), ao, n_sets=2, device="cpu", backend="eager")
    assert "bf16" in names and len(providers) == len(names)
    assert set(names) | set(notes) == set(fp8_train.provider_names())
    for call, n_sets in providers:
        assert n_sets == 2
        call(1)
