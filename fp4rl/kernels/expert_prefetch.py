"""The routed experts' weights started towards L2 as soon as the router has chosen them.

At a token or two a step, each MoE layer's two expert GEMMs read a handful of experts' weights
(8 experts of Qwen3-30B-A3B: 21 MB packed NVFP4, 75 MB BF16) and compute almost nothing with
them. Each GEMM program waits on its first loads from HBM, so the two launches take several
times what their bytes would at the copy bandwidth (BENCHMARKS.md, "Routed-expert GEMM").

This kernel runs between the router and the expert sort. Each program waits for the router's
ids, then issues ``cp.async.bulk.prefetch.L2.global`` for ``LANES`` chunks of one selected
expert's weights, one chunk per thread: a request that the L2 fetch the bytes, with nothing
returned to the program and nothing to wait for. The sort and the GEMMs then find the weights
in L2, or on their way there. A prefetch is a hint: no value anywhere changes, whether the
bytes arrive or not.

Weights are up to `MAX_TENSORS` tensors ``[E, ...]``, contiguous (an NVFP4 tensor's codes and
block scales; a BF16 weight), each expert's ``bytes_per_expert`` a multiple of 16 (the
instruction's granularity). Tensors whose experts are not are left out by `prefetchable`.

Under Triton's interpreter (no PTX) and with ``record`` the kernel stores the ``(address,
size)`` of every chunk it would fetch instead, which is how the tests check the addresses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels import dependent_launch
from fp4rl.kernels.dependent_launch import wait_for_prior
from fp4rl.kernels.launch import check_contiguous, check_kernel_device, device_of, interpreting

# Prefetch only for at most this many token-expert assignments (one token of top-8): at more,
# the experts' weights outgrow the L2 (50 MB on an H200) or the GEMMs' own loads already keep
# HBM busy. Measured in BENCHMARKS.md ("Routed-expert weights prefetched to L2").
MAX_ASSIGNMENTS = 8
MAX_TENSORS = 4
# Bytes per prefetch instruction and instructions per program (one per thread of one warp).
CHUNK = 1 << 14
LANES = 32


@triton.jit
def _prefetch_kernel(
    ids_A,
    where_A4G2,
    base0, base1, base2, base3,
    bytes0, bytes1, bytes2, bytes3,
    CHUNK: tl.constexpr,
    LANES: tl.constexpr,
    GROUPS: tl.constexpr,
    RECORD: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior(PDL)
    a = tl.program_id(0)
    t = tl.program_id(1)
    g = tl.program_id(2)
    expert = tl.load(ids_A + a).to(tl.int64)
    base = tl.where(t == 0, base0, tl.where(t == 1, base1, tl.where(t == 2, base2, base3)))
    size = tl.where(t == 0, bytes0, tl.where(t == 1, bytes1, tl.where(t == 2, bytes2, bytes3)))
    lanes = tl.arange(0, LANES)
    start = (g * LANES + lanes).to(tl.int64) * CHUNK
    chunk = tl.minimum(size.to(tl.int64) - start, CHUNK)
    chunk = tl.where(chunk > 0, chunk, 0).to(tl.int32)
    address = base.to(tl.int64) + expert * size.to(tl.int64) + start
    if RECORD:
        out = where_A4G2 + ((a * 4 + t) * GROUPS * LANES + g * LANES + lanes) * 2
        tl.store(out, tl.where(chunk > 0, address, 0))
        tl.store(out + 1, chunk.to(tl.int64))
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [address, chunk], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


def prefetchable(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of ``weights`` (each ``[E, ...]``) the kernel can fetch: contiguous, on the
    same device, each expert's bytes a multiple of 16 and 16-byte aligned."""
    kept = []
    for w in weights:
        per_expert = w[0].numel() * w.element_size() if w.numel() else 0
        if w.is_contiguous() and per_expert and per_expert % 16 == 0 and w.data_ptr() % 16 == 0:
            kept.append(w)
    return kept[:MAX_TENSORS]


def launch(
    ids: torch.Tensor, weights: list[torch.Tensor], *, record: bool = False
) -> torch.Tensor | None:
    """Start every chunk of expert ``ids[a]``'s slice of each weight (``[E, ...]``, from
    `prefetchable`) towards L2, one program per assignment, weight and group of `LANES` chunks.
    With ``record`` (or under the interpreter, which has no PTX) nothing is fetched and the
    ``(address, bytes)`` of every chunk comes back instead, int64 ``[A, MAX_TENSORS, chunks,
    2]`` (zeros where a weight has fewer chunks). The ids must lie in ``[0, E)``."""
    check_kernel_device("ids", ids)
    check_contiguous("ids", ids)
    if not weights or len(weights) > MAX_TENSORS:
        raise ValueError(f"between 1 and {MAX_TENSORS} weights; got {len(weights)}")
    for w in weights:
        if w.device != ids.device or prefetchable([w]) != [w]:
            raise ValueError(
                f"each weight must be a contiguous [E, ...] tensor on {ids.device} whose experts "
                f"are a multiple of 16 bytes, 16-byte aligned; got {w.dtype} {tuple(w.shape)} on "
                f"{w.device}"
            )
    record = record or interpreting()
    sizes = [w[0].numel() * w.element_size() for w in weights]
    groups = -(-max(sizes) // (CHUNK * LANES))
    A = ids.numel()
    where = torch.zeros(
        (A, MAX_TENSORS, groups * LANES, 2) if record else (1,), dtype=torch.int64,
        device=ids.device,
    )  # fmt: skip
    if A == 0:
        return where if record else None
    bases = [w.data_ptr() for w in weights] + [0] * (MAX_TENSORS - len(weights))
    sizes = sizes + [0] * (MAX_TENSORS - len(weights))
    with device_of(ids):
        _prefetch_kernel[(A, len(weights), groups)](
            ids, where, *bases, *sizes, CHUNK=CHUNK, LANES=LANES, GROUPS=groups,
            RECORD=record, num_warps=1, **dependent_launch.keywords(ids.device),
        )  # fmt: skip
    return where if record else None
