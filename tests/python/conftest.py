import pytest
import torch

import lowbit

CUDA_AVAILABLE = torch.cuda.is_available() and lowbit.has_cuda_kernels()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and lowbit's CUDA kernels")
    config.addinivalue_line(
        "markers", "concurrency: every op from several processes at once (test_concurrency.py; -m 'not concurrency' "
        "leaves it out)")
    if not config.pluginmanager.hasplugin("xdist"):
        config.addinivalue_line("markers", "xdist_group(name): pytest-xdist's --dist loadgroup group")


# Modules whose module-scoped fixtures are expensive (AOTInductor packages
# compiled once per module): under pytest-xdist with --dist loadgroup
# (scripts/gpu_check.sh) all their tests go to one worker, which builds the
# fixtures once instead of once per worker.
XDIST_GROUPS = {"test_aoti.py": "aoti"}


def pytest_collection_modifyitems(config, items):
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
