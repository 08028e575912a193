"""NVFP4 numerics: the format, the reference recipe (the spec), rounding modes, fake quant.

Importable without Triton or a GPU. `fp4rl.fp4.reference` and `fp4rl.fp4.rounding` are the
specification; the functions exported here dispatch CUDA tensors to the bit-identical kernels.
"""

from fp4rl.fp4.format import BLOCK_SIZE, E2M1_MAX, E2M1_VALUES, E4M3_MAX
from fp4rl.fp4.ops import (
    Guidance,
    dequantize,
    fake_quantize,
    quantize,
    quantize_guided,
    quantize_site,
)
from fp4rl.fp4.reference import Scaling, amax_of, global_scale_from_amax
from fp4rl.fp4.rounding import CompactCodes, compact
from fp4rl.fp4.tensor import NVFP4Tensor

__all__ = [
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "CompactCodes",
    "Guidance",
    "NVFP4Tensor",
    "Scaling",
    "amax_of",
    "compact",
    "dequantize",
    "fake_quantize",
    "global_scale_from_amax",
    "quantize",
    "quantize_guided",
    "quantize_site",
]
