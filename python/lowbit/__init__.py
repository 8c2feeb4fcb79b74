"""lowbit: low-precision (NVFP4, FP8) transformer kernels as PyTorch operators."""

from ._library import build_info, has_cuda_kernels, load as _load, ops_library_path

_load()

from .format import Nvfp4Tensor, nvfp4_dequantize, nvfp4_quantize  # noqa: E402
from .routing import dense_router, hash_router, route, topk  # noqa: E402
from .linear import (  # noqa: E402
    explain_plan,
    nvfp4_grouped_linear,
    nvfp4_linear,
    nvfp4_prepack,
    nvfp4_to_fp8,
    nvfp4_unpack,
    nvfp4_unprepack,
)
from .moe import Nvfp4MoeFp8, Nvfp4MoePrepacked, nvfp4_moe, nvfp4_moe_prepack, nvfp4_moe_to_fp8, nvfp4_moe_unprepack  # noqa: E402,E501
from .quantize import quantize_  # noqa: E402
from .fp8_training import (  # noqa: E402
    convert_to_fp8_training,
    fp8_microbatch,
    fp8_state_dict,
    fp8_sync_amax,
    fp8_training_plan,
    fp8_wins,
    load_fp8_state_dict,
)
from .checkpoint import load_checkpoint_, load_pretrained, save_pretrained  # noqa: E402
from .fp8 import Fp8Activation, Fp8Recipe, fp8_cast, fp8_gemm, fp8_linear, fp8_state  # noqa: E402
from .fp8_fsdp import enable_fsdp_fp8_all_gather  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Fp8Activation",
    "Fp8Recipe",
    "Nvfp4MoeFp8",
    "Nvfp4MoePrepacked",
    "Nvfp4Tensor",
    "build_info",
    "convert_to_fp8_training",
    "dense_router",
    "enable_fsdp_fp8_all_gather",
    "explain_plan",
    "fp8_cast",
    "fp8_gemm",
    "fp8_linear",
    "fp8_microbatch",
    "fp8_state",
    "fp8_state_dict",
    "fp8_sync_amax",
    "fp8_training_plan",
    "fp8_wins",
    "hash_router",
    "has_cuda_kernels",
    "load_checkpoint_",
    "load_fp8_state_dict",
    "load_pretrained",
    "nvfp4_dequantize",
    "nvfp4_grouped_linear",
    "nvfp4_linear",
    "nvfp4_moe",
    "nvfp4_moe_prepack",
    "nvfp4_moe_to_fp8",
    "nvfp4_moe_unprepack",
    "nvfp4_prepack",
    "nvfp4_quantize",
    "nvfp4_to_fp8",
    "nvfp4_unpack",
    "nvfp4_unprepack",
    "ops_library_path",
    "route",
    "topk",
    "quantize_",
    "save_pretrained",
]
