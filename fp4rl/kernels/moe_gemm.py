"""Grouped GEMM of expert-sorted BF16 rows with packed NVFP4 expert weights.

``y[a] = x[a] @ W_e.T`` for the rows ``a`` of expert ``e`` (rows sorted by expert, ``counts_E``
each), FP32 accumulation, BF16 out. The weight ``w`` is an `NVFP4Tensor` ``[E, N, K]`` (E2M1
codes, E4M3 block scales along K, a global scale per expert): each program decodes the codes
and scales of its tile in registers and feeds BF16 tiles to the tensor cores, so only experts
that have rows are read, 4.5 bits per weight. Nothing is dequantized to memory. The same
program takes a BF16 weight ``[E, N, K]`` too (``PACKED`` off: its tiles loaded as they lie),
which is how the BF16 engine's experts, the FP4 engine's baseline, run their decode steps.

Numerics: the weight values entering the dot products are bitwise
``reference.dequantize(w, torch.bfloat16)``, i.e. ``bf16(f32(e2m1 * block_scale) *
global_scale)`` (for global scales below 2**120, which covers every scale quantize computes from
finite input); only the FP32 accumulation order differs from `reference_gemm` below (the twin)
and from any other grouped GEMM. This module does not own the routing, the sort, the
activation quantization or the SwiGLU (`fp4rl.model.experts`).

Work: program (j, t) computes output columns ``[j * BLOCK_N, (j + 1) * BLOCK_N)`` of the t-th
tile of BLOCK_M rows, tiles numbered expert by expert (``ceil(counts_E[e] / BLOCK_M)`` each).
Each program finds its expert and first row from ``counts_E`` on the device (a cumulative sum
over E), so a launch needs no host sync and can be captured in a CUDA graph; the grid is sized
for the most tiles any routing of A rows can need, and programs past the last tile return.

Legend: A rows (token-expert assignments), K reduction, N output columns, E experts.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from fp4rl.fp4 import reference
from fp4rl.fp4.tensor import NVFP4Tensor
from fp4rl.kernels import dependent_launch
from fp4rl.kernels.dependent_launch import wait_for_prior
from fp4rl.kernels.launch import (
    check_contiguous,
    check_device,
    check_kernel_device,
    device_of,
    multiprocessors,
    register_kernels_refusal,
    scale_per_group,
    wgmma_refusal,
)
from fp4rl.kernels.moe_tiles import (
    REGISTERS_MAX_ROWS_PER_EXPERT,
    GemmTile,
    config_for,
    register_config_for,
)
from fp4rl.kernels.numerics import dot, e4m3_value, round_to
from fp4rl.kernels.packed_words import (
    BLOCK_SCALE_BIAS,
    GLOBAL_SCALE_BIAS,
    PAIRS,
    bf16x2_bits,
    bf16x2_halves,
    packed_code,
    packed_pair,
)

# How a packed code becomes its value exactly (the biases, the bit trick): `packed_words.py`.


@triton.jit
def _scaled(words, scale_NW, s_N, J: tl.constexpr, SCALE_AFTER: tl.constexpr):
    """Element J of each word times its block scale and its row's global scale, as BF16 (the
    global scale left out with SCALE_AFTER)."""
    value = packed_code(words, J) * scale_NW
    if not SCALE_AFTER:
        value = value * s_N[:, None]
    return round_to(value, tl.bfloat16)


@triton.jit
def _block_scales(block_scale_ptrs, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Biased block scales ``sf * 2**118`` (FP32), ``[BLOCK_N, BLOCK_K // 16]``.

    Scales are read as int32 words of 4 when BLOCK_K >= 64: loads of at least 4 bytes are what
    the software pipeline can prefetch (cp.async), and bytes are picked out by shifts."""
    if BLOCK_K >= 64:
        sw = tl.load(block_scale_ptrs)  # [BLOCK_N, BLOCK_K // 64] int32: blocks 4i .. 4i + 3
        sf0 = e4m3_value(sw & 0xFF) * BLOCK_SCALE_BIAS
        sf1 = e4m3_value((sw >> 8) & 0xFF) * BLOCK_SCALE_BIAS
        sf2 = e4m3_value((sw >> 16) & 0xFF) * BLOCK_SCALE_BIAS
        sf3 = e4m3_value((sw >> 24) & 0xFF) * BLOCK_SCALE_BIAS
        # [..., k1, k0] for block k = 2 * k1 + k0 of the word.
        sf_NB = tl.reshape(tl.join(tl.join(sf0, sf2), tl.join(sf1, sf3)), [BLOCK_N, BLOCK_K // 16])
    else:
        sf_NB = e4m3_value(tl.load(block_scale_ptrs).to(tl.int32)) * BLOCK_SCALE_BIAS
    return sf_NB


@triton.jit
def _per_word(v_NB):
    """``[BLOCK_N, BLOCK_K // 16]`` values per block -> per word of 8 codes (a block is two)."""
    return tl.reshape(tl.join(v_NB, v_NB), [v_NB.shape[0], v_NB.shape[1] * 2])


@triton.jit
def _decode_tile(words_NW, scale_NW, s_N, SCALE_AFTER: tl.constexpr):
    """``[BLOCK_N, BLOCK_K]`` BF16 weights from their codes (int32 words of 8, ``[BLOCK_N,
    BLOCK_K // 8]``), biased block scales per word and biased global scales per row."""
    # Joined as [..., b2, b1, b0] for J = 4 * b2 + 2 * b1 + b0: element 8 * word + J.
    evens = tl.join(
        tl.join(
            _scaled(words_NW, scale_NW, s_N, 0, SCALE_AFTER),
            _scaled(words_NW, scale_NW, s_N, 4, SCALE_AFTER),
        ),
        tl.join(
            _scaled(words_NW, scale_NW, s_N, 2, SCALE_AFTER),
            _scaled(words_NW, scale_NW, s_N, 6, SCALE_AFTER),
        ),
    )
    odds = tl.join(
        tl.join(
            _scaled(words_NW, scale_NW, s_N, 1, SCALE_AFTER),
            _scaled(words_NW, scale_NW, s_N, 5, SCALE_AFTER),
        ),
        tl.join(
            _scaled(words_NW, scale_NW, s_N, 3, SCALE_AFTER),
            _scaled(words_NW, scale_NW, s_N, 7, SCALE_AFTER),
        ),
    )
    return tl.reshape(tl.join(evens, odds), [words_NW.shape[0], words_NW.shape[1] * 8])


@triton.jit
def _decode_tile_paired(words_NW, scale_pair_NW):
    """`_decode_tile` with the global scale left out (SCALE_AFTER), two codes per instruction:
    ``scale_pair_NW`` holds each word's biased block scale as BF16x2 (`packed_words.packed_pair`).
    The weights are the same BF16 values, ``e2m1 * sf * 2**-8``."""
    lo0, hi0 = bf16x2_halves(packed_pair(words_NW, 0), scale_pair_NW)  # codes 0 and 4
    lo1, hi1 = bf16x2_halves(packed_pair(words_NW, 1), scale_pair_NW)
    lo2, hi2 = bf16x2_halves(packed_pair(words_NW, 2), scale_pair_NW)
    lo3, hi3 = bf16x2_halves(packed_pair(words_NW, 3), scale_pair_NW)
    # As in `_decode_tile`: [..., b2, b1, b0] for J = 4 * b2 + 2 * b1 + b0.
    evens = tl.join(tl.join(lo0, hi0), tl.join(lo2, hi2))
    odds = tl.join(tl.join(lo1, hi1), tl.join(lo3, hi3))
    return tl.reshape(tl.join(evens, odds), [words_NW.shape[0], words_NW.shape[1] * 8])


@triton.jit
def _expert_tile(counts_E, tile, num_rows, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(tiles in all, expert, first row, end of the expert's rows) of tile number ``tile``."""
    e_E = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_E + e_E, mask=e_E < E, other=0).to(tl.int32)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    row_end = tl.cumsum(counts, 0)
    expert = tl.sum((tile_end <= tile).to(tl.int32), 0)
    mine = e_E == expert
    first_tile = tl.sum(tl.where(mine, tile_end - tiles, 0), 0)
    rows_end = tl.sum(tl.where(mine, row_end, 0), 0)
    rows_start = rows_end - tl.sum(tl.where(mine, counts, 0), 0)
    # Rows past A are never touched, even if counts_E sums to more than A.
    return (
        tl.sum(tiles, 0),
        expert,
        rows_start + (tile - first_tile) * BLOCK_M,
        tl.minimum(rows_end, num_rows),
    )


# A changes with every batch: no recompiling for A == 1 or A % 16 == 0.
@triton.jit(do_not_specialize=["A", "top_k"])
def _moe_gemm_kernel(
    x_AK,
    codes_ENW,
    block_scale_ENB,
    scale_G,
    counts_E,
    y_AN,
    order_A,
    A,
    N,
    K,
    E,
    rows_per_group,
    top_k,
    GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
    PACKED: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    # PACKED=False: ``codes_ENW`` is a BF16 weight [E, N, K], read as it lies (the scale
    # pointers are not read): the same program for the BF16 engine's experts.
    tile = tl.program_id(1)
    num_tiles, expert, row0, rows_end = _expert_tile(counts_E, tile, A, E, BLOCK_M, BLOCK_E)
    if tile >= num_tiles:
        return
    rows_M = row0 + tl.arange(0, BLOCK_M)
    row_ok_M = rows_M < rows_end
    cols_N = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # N % BLOCK_N == 0
    w_rows_N = expert.to(tl.int64) * N + cols_N

    x_rows_M = rows_M.to(tl.int64)
    if GATHER:  # x holds tokens: row a of the product is token order[a] // top_k
        x_rows_M = tl.load(order_A + rows_M, mask=row_ok_M, other=0).to(tl.int64) // top_k
    x_ptrs = x_AK + x_rows_M[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
    if PACKED:
        s_N = tl.load(scale_G + w_rows_N // rows_per_group) * GLOBAL_SCALE_BIAS
        word_ptrs = codes_ENW + w_rows_N[:, None] * (K // 8) + tl.arange(0, BLOCK_K // 8)[None, :]
        # Block scales as int32 words of 4 (K % 64 == 0) or as bytes; see `_block_scales`.
        SCALES_PER_LOAD: tl.constexpr = 4 if BLOCK_K >= 64 else 1
        scale_ptrs = (
            block_scale_ENB.to(tl.pointer_type(tl.int32 if BLOCK_K >= 64 else tl.uint8))
            + w_rows_N[:, None] * (K // 16 // SCALES_PER_LOAD)
            + tl.arange(0, BLOCK_K // 16 // SCALES_PER_LOAD)[None, :]
        )
    else:
        w_ptrs = codes_ENW + w_rows_N[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
    # The (decoded) weights are the dot's first operand (M = BLOCK_N >= 64 suits the tensor
    # cores' tile even for a single row) and the few rows of x its second: y.T = W @ x.T.
    acc_NM = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for _ in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):  # K % BLOCK_K == 0
        x_MK = tl.load(x_ptrs, mask=row_ok_M[:, None], other=0.0)
        if not PACKED:
            w_NK = tl.load(w_ptrs)
            w_ptrs += BLOCK_K
        else:
            sf_NB = _block_scales(scale_ptrs, BLOCK_N, BLOCK_K)
            if SCALE_AFTER and PAIRS:
                w_NK = _decode_tile_paired(tl.load(word_ptrs), _per_word(bf16x2_bits(sf_NB)))
            else:
                w_NK = _decode_tile(tl.load(word_ptrs), _per_word(sf_NB), s_N, SCALE_AFTER)
            word_ptrs += BLOCK_K // 8
            scale_ptrs += BLOCK_K // 16 // SCALES_PER_LOAD
        acc_NM = dot(w_NK, tl.trans(x_MK), acc_NM)
        x_ptrs += BLOCK_K
    if PACKED and SCALE_AFTER:
        acc_NM = acc_NM * s_N[:, None]
    y_ptrs = y_AN + rows_M.to(tl.int64)[None, :] * N + cols_N[:, None]
    tl.store(y_ptrs, round_to(acc_NM, tl.bfloat16), mask=row_ok_M[None, :])


# The engine's experts have the producers of their GEMMs' rows (`norm_quant`, `swiglu`) store
# them permuted where the launcher's own tile is the register kernel's (`rows_step`), and the
# GEMMs read them so (`launch`'s ``x_permuted_by``): the same bits, with loads of x that touch a
# quarter of the cache lines. A trial switch, off until the engine is timed with it
# (`python benchmarks/decode.py --permuted-rows`; BENCHMARKS.md "The decode made free").
PERMUTED_ROWS = False


def rows_step(device: torch.device, A: int, E: int, N: int, K: int) -> int | None:
    """The K step in which `launch`'s own choice for ``A`` rows of packed ``[E, N, K]`` weights
    on ``device`` reads x's rows permuted under `PERMUTED_ROWS` (its register tile's), or None:
    the switch off, or that choice the warpgroup MMA's or `moe_gemm`'s program."""
    if not PERMUTED_ROWS or A == 0 or E == 0:
        return None
    wgmma = on_warpgroup_mma(device, N, K)
    if not _registers_by_default(device, A, E, wgmma):
        return None
    tile = register_config_for(A, E, K, wgmma=wgmma).fitted(N, K)
    return None if tile.wgmma else tile.block_k


def _registers_by_default(device: torch.device, A: int, E: int, wgmma: bool) -> bool:
    """Whether `launch` takes the register programs for packed weights left to its choice."""
    if register_kernels_refusal(device) is not None:
        return False
    return wgmma or A <= REGISTERS_MAX_ROWS_PER_EXPERT * E


def on_warpgroup_mma(device: torch.device, N: int, K: int) -> bool:
    """Whether `launch` sends packed ``[E, N, K]`` weights on ``device`` to `moe_gemm_wgmma`'s
    warpgroup MMA (by default, whatever the rows): a Hopper GPU, and N and K multiples of 64 (its
    tiles take whole warpgroups of 64 columns and K steps of 64)."""
    return N % 64 == 0 and K % 64 == 0 and wgmma_refusal(device) is None


def launch(
    x_AK: torch.Tensor,
    w: NVFP4Tensor | torch.Tensor,
    counts_E: torch.Tensor,
    *,
    config: GemmTile | None = None,
    global_scale_on_accumulator: bool = False,
    order_A: torch.Tensor | None = None,
    top_k: int = 1,
    registers: bool | None = None,
    x_permuted_by: int | None = None,
) -> torch.Tensor:
    """``[A, N]`` BF16: rows ``x_AK`` sorted by expert (``counts_E[e]`` rows of expert e, in
    order) times ``dequantize(w, bf16)[e].T``, or ``w[e].T`` for a BF16 tensor ``w`` (the BF16
    engine's experts: the same program, its weight tiles loaded as they lie). ``counts_E`` must
    sum to A; that is not checked (it would need a device sync), but rows past A are never read
    or written.

    With ``order_A`` (int64 ``[A]``, the MoE dispatch's assignments sorted by expert) x holds
    tokens and the product's row a is x's row ``order_A[a] // top_k``, read where it lies: the
    same bits as gathering ``x_AK[order_A // top_k]`` first, without the gather. The indices
    must lie within x (not checked: it would need a device sync).

    ``global_scale_on_accumulator`` is a measured alternative, not the numerics contract: the
    dot then sees ``bf16(e2m1 * block_scale)`` (exact) and the FP32 sum is multiplied by the
    global scale; outputs differ from the contract's by rounding. Compiled, that path decodes
    two codes per instruction (`_decode_tile_paired`), about 28 % fewer instructions than the
    contract's decode (BENCHMARKS.md, "Expert GEMM").

    ``registers`` runs the same product on packed weights with `moe_gemm_registers`' program
    (compiled only): the weights decoded straight into the tensor cores' register operands. Its
    tile keeps at most ``block_n // 16`` warps. A ``wgmma`` tile runs `moe_gemm_wgmma`'s
    program instead (Hopper only), its warps cut to as many warpgroups as ``block_n`` holds
    (64 columns each); with ``decoders`` too, `moe_gemm_specialized`'s warp-specialized
    program (opt-in; its decoder warps cut to ``block_n // 16``). Left as None, the launcher
    takes the register programs for packed weights on a CUDA GPU, without ``config`` or
    ``global_scale_on_accumulator``: on Hopper, for N and K multiples of 64, at every batch (the
    tile of `register_config_for`, the warpgroup MMA's above 5.5 rows per expert), otherwise for
    batches of at most `REGISTERS_MAX_ROWS_PER_EXPERT` rows per expert on average.

    ``x_permuted_by`` (the register kernel only; the engine's under `PERMUTED_ROWS`): x's rows
    are stored permuted within K steps of that width (`launch.permuted_rows`), which must be the
    K step of the tile the launch runs (`rows_step` says which for the launcher's own choice);
    the product and its bits are those of the rows in real order.
    """
    check_kernel_device("x_AK", x_AK)
    if x_AK.dtype != torch.bfloat16 or x_AK.dim() != 2:
        raise ValueError(
            f"x_AK must be a 2-D bfloat16 tensor; got {x_AK.dtype} of shape {tuple(x_AK.shape)}"
        )
    check_contiguous("x_AK", x_AK)
    if len(w.shape) != 3:
        raise ValueError(f"w must be [E, N, K]; got shape {tuple(w.shape)}")
    E, N, K = w.shape
    if x_AK.shape[1] != K:
        raise ValueError(f"x_AK has K={x_AK.shape[1]} columns but w is [E, N, K]={tuple(w.shape)}")
    if N % 16:
        raise ValueError(f"w's N={N} must be a multiple of 16")
    packed = isinstance(w, NVFP4Tensor)
    if packed:
        for name, t in (("codes", w.codes), ("block_scale", w.block_scale)):
            check_device(name, t, x_AK.device)
            check_contiguous(name, t)
        if w.block_scale.data_ptr() % 4:  # read as int32 words of 4 scales
            raise ValueError(
                f"w.block_scale must be 4-byte aligned; got address {w.block_scale.data_ptr():#x}"
            )
        check_device("global_scale", w.global_scale, x_AK.device)
    else:
        if w.dtype != torch.bfloat16:
            raise ValueError(f"w must be an NVFP4Tensor or a bfloat16 tensor; got {w.dtype}")
        if K % 16:
            raise ValueError(f"w's K={K} must be a multiple of 16")
        check_device("w", w, x_AK.device)
        check_contiguous("w", w)
        if global_scale_on_accumulator:
            raise ValueError("global_scale_on_accumulator is for NVFP4 weights; w is bfloat16")
        if registers:
            raise ValueError("registers is for NVFP4 weights; w is bfloat16")
    if registers and global_scale_on_accumulator:
        raise ValueError("registers decodes the contract's weights; global_scale_on_accumulator "
                         "is not supported there")  # fmt: skip
    check_device("counts_E", counts_E, x_AK.device)
    if counts_E.shape != (E,) or counts_E.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"counts_E must be int32 or int64 of shape ({E},); got {counts_E.dtype} of shape "
            f"{tuple(counts_E.shape)}"
        )
    check_contiguous("counts_E", counts_E)

    A = x_AK.shape[0]
    if order_A is not None:
        check_device("order_A", order_A, x_AK.device)
        if order_A.dtype != torch.int64 or order_A.dim() != 1:
            raise ValueError(
                f"order_A must be a 1-D int64 tensor; got {order_A.dtype} of shape "
                f"{tuple(order_A.shape)}"
            )
        check_contiguous("order_A", order_A)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive int; got {top_k!r}")
        A = order_A.shape[0]
    y_AN = torch.empty((A, N), dtype=torch.bfloat16, device=x_AK.device)
    if A == 0 or E == 0:
        return y_AN
    wgmma = packed and on_warpgroup_mma(x_AK.device, N, K)
    if registers is None:
        registers = (
            packed
            and config is None
            and not global_scale_on_accumulator
            and _registers_by_default(x_AK.device, A, E, wgmma)
        )
    sms = multiprocessors(x_AK.device)
    if config is None:
        config = register_config_for(A, E, K, wgmma=wgmma) if registers else config_for(
            A, E, N, sms, bf16=not packed
        )  # fmt: skip
    tile = config.fitted(N, K)
    if packed:
        scale_G, rows_per_group = scale_per_group("global_scale", w.global_scale, w.shape)
        members = (w.codes.view(torch.int32), w.block_scale.view(torch.uint8), scale_G)
    else:
        rows_per_group = 1
        members = (w, w, w)  # stand-ins for the scales, not read
    # Each expert with rows has at most one partial tile.
    max_tiles = A // tile.block_m + min(E, A)
    grid = (N // tile.block_n, max_tiles)
    if tile.block_m < 16 and not registers:
        raise ValueError(f"block_m={tile.block_m}: 8 rows are for the register kernel only")
    if tile.split_k > 1 and not registers:
        raise ValueError(f"split_k={tile.split_k}: splitting K is for the register kernel only")
    if tile.wgmma and not registers:
        raise ValueError("a wgmma tile is for the register programs (registers=True) only")
    if tile.wgmma:
        if (refusal := wgmma_refusal(x_AK.device)) is not None:
            raise ValueError(f"a wgmma tile (x_AK's device) {refusal}")
        if tile.decoders:
            from fp4rl.kernels import moe_gemm_specialized as program

            # Each decoder warp over 16 of the tile's columns at least, as narrowed to N.
            tile = dataclasses.replace(tile, decoders=min(tile.decoders, tile.block_n // 16))
        else:
            from fp4rl.kernels import moe_gemm_wgmma as program

            # Whole warpgroups, each over 64 of the tile's columns at least (wgmma's m64).
            warps = max(4, min(tile.num_warps, tile.block_n // 16))
            tile = dataclasses.replace(tile, num_warps=warps)
    elif registers:
        if (refusal := register_kernels_refusal(x_AK.device)) is not None:
            raise ValueError(f"registers (x_AK's device) {refusal}")
        from fp4rl.kernels import moe_gemm_registers as program

        # Each warp takes 16 of the tile's columns at least (the MMA's m16).
        warps_n = min(tile.num_warps // tile.split_k, tile.block_n // 16)
        tile = dataclasses.replace(tile, num_warps=warps_n * tile.split_k)
    if x_permuted_by is not None and (not registers or tile.wgmma or
                                      x_permuted_by != tile.block_k):  # fmt: skip
        program_name = "moe_gemm_wgmma" if tile.wgmma else "moe_gemm"
        raise ValueError(
            f"x_permuted_by={x_permuted_by!r}: rows permuted in K steps of that width need the "
            f"register kernel with a tile of that K step; this launch runs "
            + (f"it with {tile}" if registers and not tile.wgmma else f"{program_name}'s program")
        )  # fmt: skip
    if registers:
        with device_of(x_AK):
            program.launch_kernel(
                grid, x_AK, members, counts_E, y_AN, order_A, A=A, E=E, N=N, K=K,
                rows_per_group=rows_per_group, top_k=top_k, tile=tile,
                **({} if x_permuted_by is None else {"x_permuted": True}),
            )  # fmt: skip
        return y_AN
    with device_of(x_AK):
        _moe_gemm_kernel[grid](
            x_AK, *members, counts_E,
            y_AN, x_AK if order_A is None else order_A, A, N, K, E, rows_per_group, top_k,
            GATHER=order_A is not None,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            BLOCK_E=triton.next_power_of_2(E), NUM_STAGES=tile.num_stages,
            SCALE_AFTER=global_scale_on_accumulator, PACKED=packed, num_warps=tile.num_warps,
            # Products feed additions only inside the dot; no FMA may merge the two scalings.
            enable_fp_fusion=False,
            **dependent_launch.keywords(x_AK.device),
        )  # fmt: skip
    return y_AN


def reference_gemm(x_AK: torch.Tensor, w: NVFP4Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """The kernel's specification in plain PyTorch: ``dequantize(w, bf16)`` (the recipe's
    ``bf16(f32(e2m1 * block_scale) * global_scale)``), then for each expert its rows times
    the transposed weight, BF16 operands upcast exactly and accumulated in FP32, rounded to
    BF16 once at the end. Reads the counts on the host."""
    w_ENK = reference.dequantize(w, torch.bfloat16)
    out = torch.empty((x_AK.shape[0], w_ENK.shape[1]), dtype=torch.bfloat16, device=x_AK.device)
    start = 0
    for e, count in enumerate(counts_E.tolist()):
        if count:
            rows = slice(start, start + count)
            out[rows] = (x_AK[rows].float() @ w_ENK[e].float().T).to(torch.bfloat16)
            start += count
    return out
