"""The input a layer sees under ``torch.autocast``, shared by the NVFP4 and
FP8 layers so that each behaves as the ``nn.Linear`` it replaces. The ops
themselves compute in the dtypes they are given (their Autocast kernels
turn autocast off inside them; csrc/torch/registry.cpp)."""

import torch
from torch import Tensor


def autocast_input(x):
    """``x`` as ``torch.autocast`` hands it to ``F.linear``: in the autocast
    dtype where autocast is on for x's device, else unchanged (anything but
    a floating tensor, an Fp8Activation say: unchanged). The layer's output
    then has that dtype, as nn.Linear's (TransformerEngine's and torchao's
    Linears cast their input the same way)."""
    if isinstance(x, Tensor) and x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x
