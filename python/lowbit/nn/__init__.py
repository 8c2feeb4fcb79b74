"""lowbit.nn: inference modules built on lowbit's operators."""

from .fp8_linear import Fp8Linear  # noqa: F401
from .linear import Nvfp4GroupedLinear, Nvfp4Linear  # noqa: F401
from .moe import Nvfp4MoE  # noqa: F401
from .router import Router  # noqa: F401
