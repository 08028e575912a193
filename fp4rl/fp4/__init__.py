"""The NVFP4 recipe: the format, the reference quantizer (the spec), guided rounding, containers.

Plain PyTorch, importable without Triton or a GPU, and importing nothing else from fp4rl:
`fp4rl.kernels` imports this package to reproduce it bit for bit, and `fp4rl.ops`, above both,
sends each call to one or the other. Code that computes with NVFP4 calls `fp4rl.ops`; code that
only holds or describes NVFP4 data imports from here.
"""

from fp4rl.fp4.format import BLOCK_SIZE, E2M1_MAX, E2M1_VALUES, E4M3_MAX
from fp4rl.fp4.reference import Scaling, amax_of, global_scale_from_amax
from fp4rl.fp4.rounding import CompactCodes, compact
from fp4rl.fp4.sparse_guidance import SparseCodes, sparse
from fp4rl.fp4.tensor import NVFP4Tensor

__all__ = [
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "CompactCodes",
    "NVFP4Tensor",
    "Scaling",
    "SparseCodes",
    "amax_of",
    "compact",
    "global_scale_from_amax",
    "sparse",
]
