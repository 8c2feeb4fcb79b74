"""bench linear's "auto" columns on the CPU: each row takes the time of the
path an Nvfp4Linear with compute="auto" runs at its M (the FP8 path from
lowbit.nn.linear.AUTO_FP8_MIN_ROWS rows)."""

from lowbit.bench.linear import FP8_CACHED_MS, add_auto_columns
from lowbit.nn.linear import AUTO_FP8_MIN_ROWS


def row(k, n, m, with_fp8=True):
    r = {"K": k, "N": n, "M": m, "nvfp4_us": 20.0, "bf16_us": 10.0}
    if with_fp8:
        r["fp8w_us"] = 8.0
    return r


def test_auto_columns_follow_the_layers_threshold():
    assert FP8_CACHED_MS <= AUTO_FP8_MIN_ROWS  # every row from the threshold has its FP8 time
    for n in (1536, 7168):
        below, at = row(4096, n, AUTO_FP8_MIN_ROWS - 1), row(4096, n, AUTO_FP8_MIN_ROWS)
        add_auto_columns(below)
        add_auto_columns(at)
        assert (below["auto_us"], below["x_bf16_auto"]) == (20.0, 0.5)  # W4A16
        assert (at["auto_us"], at["x_bf16_auto"]) == (8.0, 1.25)  # the cached FP8 path


def test_auto_columns_left_out_without_an_fp8_time():
    r = row(4096, 7168, 4096, with_fp8=False)
    add_auto_columns(r)
    assert "auto_us" not in r and "x_bf16_auto" not in r
    r = row(4096, 7168, 1, with_fp8=False)  # W4A16 there: no FP8 time needed
    add_auto_columns(r)
    assert r["auto_us"] == 20.0
