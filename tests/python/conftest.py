import os

from gpu_spread import spread_device

# On a machine of several GPUs, scripts/gpu_check.sh (SPREAD_GPUS=n) spreads
# pytest-xdist's workers over them: worker k sees only the (k mod n)-th of
# the run's GPUs. This must be set before CUDA starts in the worker, hence
# before anything below.
_DEVICE = spread_device(os.environ.get("PYTEST_XDIST_WORKER", ""),
                        int(os.environ.get("LOWBIT_TEST_SPREAD_GPUS", "0") or 0),
                        os.environ.get("CUDA_VISIBLE_DEVICES"))
if _DEVICE is not None:
    os.environ["CUDA_VISIBLE_DEVICES"] = _DEVICE

import pytest  # noqa: E402
import torch  # noqa: E402

import lowbit  # noqa: E402

CUDA_AVAILABLE = torch.cuda.is_available() and lowbit.has_cuda_kernels()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and lowbit's CUDA kernels")
    config.addinivalue_line(
        "markers", "concurrency: every op from several processes at once (test_concurrency.py; -m 'not concurrency' "
        "leaves it out)")
    config.addinivalue_line(
        "markers", "slow: AOTInductor packages and whole transformers models, tens of seconds each on the CPU "
        "(pytest -m 'not slow' is the quick tier; the full run, bash run.sh test, keeps them)")
    if not config.pluginmanager.hasplugin("xdist"):
        config.addinivalue_line("markers", "xdist_group(name): pytest-xdist's --dist loadgroup group")


# Modules whose module-scoped fixtures are expensive (AOTInductor packages
# compiled once per module): under pytest-xdist with --dist loadgroup
# (scripts/gpu_check.sh) all their tests go to one worker, which builds the
# fixtures once instead of once per worker.
XDIST_GROUPS = {"test_aoti.py": "aoti"}


# Tests that take a minute or more on the GPU machine (the durations that
# scripts/gpu_check.sh prints), started first so that under pytest-xdist
# none of them begins last and holds the run's end.
SLOW_FIRST = (
    "test_aoti.py",  # one xdist group: its packages, in turn, on one worker
    "test_hf_models.py::test_quantized_model_in_an_aoti_package",
    "test_linear_compile.py::test_compile_inductor_fullgraph",
    "test_nn_moe.py::test_cuda_matches_reference_and_cpu",
    "test_concurrency.py",
    "test_demo.py",
    "test_linear_kernels_cuda.py::test_cuda_stream_kernel",
    "test_routing.py::test_compile_fullgraph_matches_eager",
    "test_hf_models.py",
    "test_checkpoint.py::test_modelopt_checkpoint_loads_to_quantize_s_model",
    "test_nn_moe.py::test_state_dict_round_trip_and_to",
)


def _slow_rank(item) -> int:
    for i, key in enumerate(SLOW_FIRST):
        if key in item.nodeid:
            return i
    return len(SLOW_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_slow_rank)  # stable: the rest keep their order
    for item in items:
        group = XDIST_GROUPS.get(item.path.name)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if CUDA_AVAILABLE:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and lowbit built with CUDA kernels")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
