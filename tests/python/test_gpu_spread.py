"""gpu_spread.spread_device: the GPU each pytest-xdist worker sees under
scripts/gpu_check.sh's SPREAD_GPUS (CPU-only logic)."""

from gpu_spread import spread_device


def test_workers_take_the_gpus_in_turn():
    assert [spread_device(f"gw{k}", 3, None) for k in range(7)] == ["0", "1", "2", "0", "1", "2", "0"]


def test_an_inherited_device_list_is_indexed_not_replaced():
    # CUDA_VISIBLE_DEVICES=1,2,3 with SPREAD_GPUS=3: workers on GPUs 1, 2, 3
    # (not 0, 1, 2, which the run was not given).
    assert [spread_device(f"gw{k}", 3, "1,2,3") for k in range(4)] == ["1", "2", "3", "1"]
    assert [spread_device(f"gw{k}", 4, "5, 7") for k in range(3)] == ["5", "7", "5"]  # fewer GPUs than n


def test_nothing_spread_outside_xdist_or_for_one_gpu():
    assert spread_device("", 4, None) is None
    assert spread_device("master", 4, "0,1") is None
    assert spread_device("gw3", 1, None) is None
    assert spread_device("gw3", 0, "0,1,2,3") is None
