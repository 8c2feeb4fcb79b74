import pytest
import torch

import lowbit

CUDA_AVAILABLE = torch.cuda.is_available() and lowbit.has_cuda_kernels()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and lowbit's CUDA kernels")


def pytest_collection_modifyitems(config, items):
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
