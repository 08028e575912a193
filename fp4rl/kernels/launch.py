"""Host-side helpers the launchers share: tile configs, input checks, the ``[R, K]`` row view.

Every kernel sees its input as ``R = numel / K`` rows of K values; a scaling group is
``rows_per_group`` consecutive rows (per-row: 1, per-tensor: R, per-expert ``[E, N, K]``: N).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from fp4rl.fp4 import reference
from fp4rl.fp4.rounding import CompactCodes
from fp4rl.fp4.tensor import NVFP4Tensor


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Work of one program per step: ``block_k`` columns (a power of two >= 16) of enough rows
    to make ``tile`` elements. The kernels are memory-bound: tiles are sized for 16-byte loads
    and bytes in flight, and ``num_stages > 1`` prefetches the next chunk (cp.async)."""

    block_k: int
    tile: int
    num_warps: int
    num_stages: int

    def launch(self, num_rows: int, k: int) -> tuple[tuple[int], dict]:
        """(grid, launch keywords) for ``[num_rows, k]``: a tile no wider than the row.

        BLOCK_R does not shrink for small R: masked rows cost no memory traffic, and a tile
        that depends on K alone compiles once per K rather than once per batch size.
        """
        # Plain integer arithmetic: triton.cdiv and friends cost microseconds per call from Python.
        block_k = min(self.block_k, 1 << max(k - 1, 0).bit_length())
        block_r = max(1, self.tile // block_k)
        meta = dict(
            BLOCK_R=block_r,
            BLOCK_K=block_k,
            NUM_STAGES=self.num_stages,
            num_warps=self.num_warps,
            # No result here depends on FMA contraction (products feed additions only where
            # they are exact); fixing it off keeps triton versions' defaults out of the picture.
            enable_fp_fusion=False,
        )
        return (-(-num_rows // block_r),), meta


CONFIGS = {
    # 4 rows x 1024 columns (7 chunks of a 7168-wide row); latency hidden by occupancy.
    "default": TileConfig(block_k=1024, tile=4096, num_warps=4, num_stages=1),
    # The same tile with the next chunk prefetched (cp.async): slower on one H200 (per-tensor
    # quantize of 8 x 4096 x 7168 BF16: 562-570 us against 339-341 us without, in one run),
    # kept as a tested alternative.
    "prefetch": TileConfig(block_k=1024, tile=4096, num_warps=4, num_stages=3),
    # Whole rows up to 8192 values in registers (per-row quantize reads x once).
    "row": TileConfig(block_k=8192, tile=8192, num_warps=8, num_stages=1),
    # The same with 4 warps: each thread holds 64 values, which halves the per-row reduction.
    "row-4warps": TileConfig(block_k=8192, tile=8192, num_warps=4, num_stages=1),
}


def config_for(k: int) -> TileConfig:
    """The tile for a single-pass kernel over rows of k values: whole rows when they fit."""
    return CONFIGS["row"] if k <= CONFIGS["row"].block_k else CONFIGS["default"]


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


# The register kernels (Gluon over mma.sync) turn E4M3 block-scale bytes into FP32 with the
# GPU's own conversion, which Triton emits from sm_89 (Ada, Hopper) on; sm_80 has bf16 mma.sync
# but not that conversion.
REGISTER_KERNELS_CAPABILITY = (8, 9)


def register_kernels_refusal(device: torch.device) -> str | None:
    """Why the register kernels cannot run on ``device`` (a sentence naming it), or None."""
    if device.type != "cuda" or interpreting():
        return f"runs on a CUDA GPU only; got {device}{' (interpreted)' if interpreting() else ''}"
    if (capability := torch.cuda.get_device_capability(device)) < REGISTER_KERNELS_CAPABILITY:
        return f"needs sm_89 or newer (E4M3 conversion, bf16 mma.sync); got {capability}"
    return None


def wgmma_refusal(device: torch.device) -> str | None:
    """Why `moe_gemm_wgmma`'s warpgroup MMA cannot run on ``device`` (a sentence naming it), or
    None: it needs what the register kernels need, on Hopper (sm_90), whose ``wgmma`` it is."""
    if (refusal := register_kernels_refusal(device)) is not None:
        return refusal
    if (capability := torch.cuda.get_device_capability(device))[0] != 9:
        return f"needs a Hopper GPU (sm_90, wgmma); got {capability}"
    return None


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's SM count; 1 off CUDA (the interpreter: as few programs as possible)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like x; got {t.device}")


def check_x(x: torch.Tensor) -> None:
    """What every kernel needs of x: a float dtype, K % 16 == 0, contiguous, on a CUDA device."""
    reference.check_input(x)
    if not x.is_contiguous():
        raise ValueError(
            f"x must be contiguous; got shape {tuple(x.shape)} strides {tuple(x.stride())}"
        )
    check_kernel_device("x", x)


def check_kernel_device(name: str, t: torch.Tensor) -> None:
    if not (t.is_cuda or interpreting()):
        raise ValueError(
            f"{name} must be a CUDA tensor (or run with TRITON_INTERPRET=1 on the CPU); "
            f"got device {t.device}"
        )


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous; got shape {tuple(t.shape)} strides {tuple(t.stride())}"
        )


def permute_step(permuted_by: int | None, width: int) -> int:
    """The K step rows of ``width`` values are permuted in (`launch.permuted_rows`'
    order), 0 for None; raises ValueError naming the value unless it is a power of two >= 32
    that divides the width."""
    if permuted_by is None:
        return 0
    if isinstance(permuted_by, bool) or not isinstance(permuted_by, int):
        raise ValueError(f"permuted_by must be an int or None; got {permuted_by!r}")
    if permuted_by < 32 or permuted_by & (permuted_by - 1):
        raise ValueError(f"permuted_by must be a power of two >= 32; got {permuted_by}")
    if width % permuted_by:
        raise ValueError(f"rows of {width} values cannot be permuted in steps of {permuted_by}")
    return permuted_by


def permuted_rows(x_RK: torch.Tensor, block_k: int) -> torch.Tensor:
    """A copy of rows ``x_RK`` in the order `moe_gemm_registers`' kernel reads x in with
    ``X_PERMUTED`` (`moe_gemm.launch`'s ``x_permuted_by``) for K steps of ``block_k``, and the
    producers write with ``permuted_by``. Within a step, the 4 lanes of a quad each hold a
    quarter of it, in pieces of 8 values; the pieces are stored one of each lane after the
    other: place ``8 * (4 * j + c) + i`` holds real ``k = c * block_k / 4 + 8 * j + i``. In real
    order one warp-wide 16-byte load touches 32 cache lines (a lane's quarter is 128 contiguous
    bytes of its row); in this order, 8 (a quad's four pieces are 64 contiguous bytes). Each
    thread holds the same values as before, so the products and their bits do not change."""
    R, K = x_RK.shape
    permute_step(block_k, K)
    steps = x_RK.reshape(R, K // block_k, 4, block_k // 32, 8)
    return steps.transpose(2, 3).contiguous().reshape(R, K)


def pair_view(x_RK: torch.Tensor) -> torch.Tensor:
    """What the kernels load for x: bf16 as int32 pairs (unpacked by bit operations, which
    also keeps the interpreter's lossy bf16 casts out of the way), other dtypes as they are."""
    return x_RK.view(torch.int32) if x_RK.dtype == torch.bfloat16 else x_RK


def word_view(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes ``[..., K / 2]`` (uint8) as the int32 words the kernels store, 4 codes bytes
    each (K is a multiple of 16, so rows are whole words)."""
    return codes.view(torch.int32)


def outputs(x: torch.Tensor, fake: bool):
    """``(values_RK, codes, codes_words, block_scale)`` for a quantizing kernel over x:
    fake-quant values ``[R, K]`` in x's dtype, or packed codes (uint8, and the int32 words the
    kernel stores them as) and block-scale bytes. Buffers a launch will not store are stand-ins
    (any pointer will do)."""
    k = x.shape[-1]
    if fake:
        values_RK = torch.empty_like(x.view(-1, k))
        return values_RK, values_RK, values_RK, values_RK
    codes = torch.empty((*x.shape[:-1], k // 2), dtype=torch.uint8, device=x.device)
    block_scale = torch.empty((*x.shape[:-1], k // 16), dtype=torch.uint8, device=x.device)
    return x.view(-1, k), codes, word_view(codes), block_scale


# A site's record as the quantizing kernels store it on the way (`tiles.store_record`).
RECORD_FORMS = {None: 0, "full": 1, "compact": 2}


class SiteRecordOutputs(NamedTuple):
    """The buffers a kernel stores a site's record into: ``record`` (what the caller gets: an
    `NVFP4Tensor`, `CompactCodes`, or None) and the three pointers `tiles.store_record` takes,
    stand-ins where no record is made (RECORD 0)."""

    record: NVFP4Tensor | CompactCodes | None
    RECORD: int
    bits: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor

    def pointers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(bits, block_scale, global_scale)``, in `tiles.store_record`'s order."""
        return self.bits, self.block_scale, self.global_scale


def record_outputs(
    form: str | None, lead: tuple[int, ...], k: int, device: torch.device
) -> SiteRecordOutputs:
    """A record of rows ``[*lead, k]`` in ``form`` ("full": `NVFP4Tensor`, "compact":
    `CompactCodes`, each with one FP32 global scale per row; None: nothing), allocated on
    ``device``; a bad form is refused by name."""
    if form not in RECORD_FORMS:
        raise ValueError(f"record form must be 'full', 'compact' or None; got {form!r}")
    if form is None:
        stand_in = torch.empty(0, dtype=torch.int32, device=device)
        return SiteRecordOutputs(None, 0, stand_in, stand_in, stand_in)

    def empty(width, dtype):
        return torch.empty((*lead, width), dtype=dtype, device=device)

    block_scale, global_scale = empty(k // 16, torch.uint8), empty(1, torch.float32)
    scale = block_scale.view(torch.float8_e4m3fn)
    if form == "full":
        codes = empty(k // 2, torch.uint8)
        record = NVFP4Tensor(codes=codes, block_scale=scale, global_scale=global_scale)
        bits = word_view(codes)
    else:
        mantissa = empty(k // 8, torch.uint8)
        record = CompactCodes(mantissa_bits=mantissa, block_scale=scale, global_scale=global_scale)
        bits = mantissa.view(torch.int16)
    return SiteRecordOutputs(record, RECORD_FORMS[form], bits, block_scale, global_scale)


def device_of(t: torch.Tensor):
    """Make t's GPU the current one while launching (triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def rows_per_group(shape: torch.Size, group_ndim: int) -> int:
    """Rows of ``shape[:-1]`` sharing one global scale when the trailing ``group_ndim`` dims do."""
    return math.prod(shape[len(shape) - group_ndim : -1])


def scale_per_group(
    name: str, global_scale: torch.Tensor, shape: torch.Size
) -> tuple[torch.Tensor, int]:
    """(scales ``[G]`` FP32 contiguous, rows_per_group) for a global scale broadcastable to
    ``[*shape[:-1], 1]``: the scale of row r is ``scales[r // rows_per_group]``.

    ``shape[:-g] + (1,) * g`` (what quantize produces) needs no copy; another broadcast pattern
    (say one scale per N shared by E experts) is expanded to one scale per row.
    """
    lead, held = tuple(shape[:-1]), tuple(global_scale.shape)
    if (
        len(held) != len(shape)
        or held[-1] != 1
        or any(h not in (1, n) for h, n in zip(held, lead, strict=False))
    ):
        raise ValueError(f"{name} of shape {held} does not broadcast to {(*lead, 1)}")
    for j in range(len(lead) + 1):
        if held[:j] == lead[:j] and all(n == 1 for n in held[j:-1]):
            return global_scale.reshape(-1).contiguous(), math.prod(lead[j:])
    return global_scale.expand(*lead, 1).reshape(-1).contiguous(), 1
