"""The sampler's token-order draw (``cdf_order="token"``) in two launches, nothing on the host.

What it computes: for each row b of FP32 log-probabilities ``logprobs [B, V]`` and its float64
uniform number ``u[b]`` in [0, 1), the first token t whose float64 CDF in token-id order,
``sum_{i <= t} exp(float64(logprobs[b, i]))``, exceeds ``u[b] * total`` (total: the whole row's
sum), and ``logprobs[b, t]`` (the input's bits). No draw is a token of probability zero (-inf
logprob): the draw keeps to the tokens of positive probability, so a number at the total (u =
1) takes the last of them. A row without any (all -inf, or NaN, which the engine refuses after
the draw) still gets an index in [0, V - 1]. This is `fp4rl.rollout.sampler._draw_in_token_order`
(torch's float64 ``exp().cumsum()``) but for the order of the float64 sums.

The sum order: the row is cut into chunks of `CHUNK` tokens, each chunk into blocks of `BLOCK`.
A chunk's sum is its blocks' sums added left to right (``running += tl.sum(exp(block))``, each
block summed by Triton's reduction tree), the row's CDF at chunk boundaries is Triton's scan of
those chunk sums, and inside a chunk ``cdf = before + running + tl.cumsum(exp(block))``, where
``before`` is the scan's value at the end of the chunk before. The tree and scan orders are
Triton's for these tiles on this device (compiled: the reduction over the threads' registers,
the lanes, the warps; interpreted: numpy's): device-specific, but fixed by V alone. The chunk
and block sizes and the warps are constants, so neither B nor which rows share the batch
changes a bit of a row's result: a row computed alone equals the row in any batch. (The
compiler picks the vector width of a load, and with it the registers' grouping in the
reduction tree, from the alignment it can prove: V's divisibility by 16, fixed by V, and the
input's 16-byte alignment, which `launch` guarantees by copying a misaligned view first.)

Against torch's scan, another sum order moves a CDF boundary by float64 roundings, some 1e-13 of
the total or less at Qwen3's vocabulary, so only a target that close to a boundary may take the
neighbouring token: for uniform numbers, at most about 2 * 1e-13 * 151,936, three draws in a
hundred million (tests/kernels/test_kernel_token_draw.py holds the kernel to torch's scan on
random rows, and puts numbers on boundaries to see both sides).
The token-order mode promises the distribution, one number per token and the logprob's bits,
not equality with torch's scan.

Why two launches: a row of Qwen3's vocabulary (151,936 values, 600 KB) is too long for one
program to stream and scan at a batch of a few dozen rows (a few dozen programs on 132 SMs), yet
the token of a row depends on all of its values, and the programs of one launch cannot wait for
each other (without a grid-wide barrier, which a launch may not assume its programs co-resident
for). So:

1. `_chunk_sums_kernel`, grid (B, C) with ``C = ceil(V / CHUNK)``: each program sums the
   exponentials of one chunk of one row into a float64 ``[B, C]`` buffer; the whole read of the
   logprobs spreads over B * C programs.
2. `_draw_kernel`, grid (B,): each program scans its row's C chunk sums, finds the chunk whose
   CDF crosses ``u * total`` and walks that chunk alone (`CHUNK` values), block by block, with
   the same per-block operations as the first launch, to the first token past the target. Should
   the walk's rounding leave no token past it (its own sum of the chunk can differ from the
   first launch's in the last bits), the chunk's last token of positive probability is drawn.

Both launches take their sizes from V and B alone and read nothing back, so a call is
asynchronous and can be captured in a CUDA graph. `python benchmarks/sampler.py` times the
sampler's token-order draw through this kernel against torch's scan in the same run
(BENCHMARKS.md). The first launch reads well below a copy's rate: the float64 exponential
(libdevice's, a range reduction and a polynomial, some twenty float64 operations a value) is
the likelier bound, not the memory.

Legend: B rows, V vocab, C chunks of a row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels import dependent_launch
from fp4rl.kernels.dependent_launch import wait_for_prior
from fp4rl.kernels.launch import check_contiguous, check_device, check_kernel_device, device_of

try:  # where Triton keeps libdevice moved between versions
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the installed Triton
    from triton.language.extra.cuda import libdevice

# Tokens per chunk of the first launch (and walked by the second), in blocks of BLOCK. Fixed, so
# the sum order depends on V alone. At V = 151,936: 75 chunks a row, 4,800 programs at B = 64.
CHUNK = 2048
BLOCK = 1024
# 4 warps: 8 values a thread per block, 16 float64 registers of exponentials. Both launches use
# the same warps, so that the second's sum of a block is the first's (the same tile, the same
# reduction tree) and its walk rarely needs the fallback. Chunks of 1,024-8,192, blocks of
# 512-2,048 and 2-8 warps were tried on one H200 at V = 151,936; these were the fastest at 256
# rows and within a few percent at 64.
NUM_WARPS = 4
# Kernels are decorated interpreted-or-compiled when this package is imported; so is this.
_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def exp64(x):
    """float64 ``exp(x)``: libdevice's ``exp`` compiled (CUDA's double ``exp``, the function
    torch's float64 exp runs on the GPU: the same bits on one H200), numpy's under the
    interpreter, whose libdevice functions are stubs that return nothing. ``tl.exp`` of float64
    compiled to the same bits under Triton 3.6, but its float32 lowering is an approximation
    (``ex2.approx``), so the function is named here rather than left to the lowering."""
    if _INTERPRETED:
        return tl.exp(x)
    return libdevice.exp(x)


@triton.jit
def block_exp(logprobs_BV, row, at, V):
    """``exp(float64(logprobs[row, at]))`` for a block of token ids ``at``, zero past V."""
    x = tl.load(logprobs_BV + row * V + at, mask=at < V, other=float("-inf"))
    return exp64(x.to(tl.float64))


@triton.jit
def _chunk_sums_kernel(
    logprobs_BV, sums_BC, V, C,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    running = tl.zeros([], dtype=tl.float64)
    for step in tl.static_range(CHUNK // BLOCK):  # unrolled: the chunk's loads in flight at once
        e = block_exp(logprobs_BV, row, chunk * CHUNK + step * BLOCK + cols, V)
        running += tl.sum(e, axis=0)
    tl.store(sums_BC + row * C + chunk, running)


@triton.jit
def _draw_kernel(
    logprobs_BV, u_B, sums_BC, token_B, logprob_B, V, C,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, PADDED_C: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, PADDED_C)
    valid = lanes < C
    sums = tl.load(sums_BC + row * C + lanes, mask=valid, other=0.0)
    cdf_at_ends = tl.cumsum(sums, axis=0)
    # Values picked out of a vector by a sum of one lane and zeros: exact (NaN stays NaN).
    total = tl.sum(tl.where(lanes == C - 1, cdf_at_ends, 0.0), axis=0)
    target = tl.load(u_B + row) * total
    # The first chunk of positive mass whose CDF at its end passes the target; else (u * total
    # at or past every end: u = 1, or a rounding of the scan) the last chunk of positive mass;
    # a row without any (NaN or all -inf) walks chunk 0. Requiring positive mass keeps a
    # rounding of the scan from landing on a chunk of -inf alone.
    positive = valid & (sums > 0.0)
    first = tl.min(tl.where(positive & (cdf_at_ends > target), lanes, PADDED_C), axis=0)
    last = tl.max(tl.where(positive, lanes, 0), axis=0)
    chunk = tl.minimum(first, last)
    before = tl.sum(tl.where(lanes == chunk - 1, cdf_at_ends, 0.0), axis=0)  # 0 for chunk 0

    cols = tl.arange(0, BLOCK)
    running = tl.zeros([], dtype=tl.float64)
    drawn = tl.zeros([], dtype=tl.int32) + V  # V: none past the target yet
    last_live = chunk * CHUNK  # the chunk's first id, should it hold no positive probability
    for step in tl.static_range(CHUNK // BLOCK):
        at = chunk * CHUNK + step * BLOCK + cols
        e = block_exp(logprobs_BV, row, at, V)
        cdf = before + running + tl.cumsum(e, axis=0)
        # Only tokens of positive probability are drawn: the scan's rounding cannot make a -inf
        # token's CDF pass the target where its predecessor's did not.
        live = e > 0.0
        drawn = tl.minimum(drawn, tl.min(tl.where(live & (cdf > target), at, V), axis=0))
        last_live = tl.maximum(last_live, tl.max(tl.where(live, at, -1), axis=0))
        running += tl.sum(e, axis=0)
    token = tl.where(drawn < V, drawn, last_live).to(tl.int64)
    tl.store(token_B + row, token)
    tl.store(logprob_B + row, tl.load(logprobs_BV + row * V + token))


def chunks(V: int) -> int:
    """The number of chunks of a row of V tokens: the first launch's grid is (B, chunks(V))."""
    return -(-V // CHUNK)


def _check(logprobs_BV: torch.Tensor, u_B: torch.Tensor) -> None:
    check_kernel_device("logprobs_BV", logprobs_BV)
    if logprobs_BV.dtype != torch.float32 or logprobs_BV.dim() != 2 or logprobs_BV.shape[1] < 1:
        raise ValueError(
            f"logprobs_BV must be float32 [B, V] with V >= 1; got {logprobs_BV.dtype} of shape "
            f"{tuple(logprobs_BV.shape)}"
        )
    B = logprobs_BV.shape[0]
    if u_B.dtype != torch.float64 or u_B.shape != (B,):
        raise ValueError(f"u_B must be float64 [{B}]; got {u_B.dtype} of shape {tuple(u_B.shape)}")
    check_device("u_B", u_B, logprobs_BV.device)
    check_contiguous("logprobs_BV", logprobs_BV)
    check_contiguous("u_B", u_B)


def launch(logprobs_BV: torch.Tensor, u_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token [B] int64, logprob [B] float32)`` drawn from each row of ``logprobs_BV`` (float32
    ``[B, V]``, contiguous) at its ``u_B`` (float64 ``[B]``), as the module docstring computes
    them; two launches, nothing read back."""
    _check(logprobs_BV, u_B)
    B, V = logprobs_BV.shape
    device = logprobs_BV.device
    token_B = torch.empty(B, dtype=torch.int64, device=device)
    logprob_B = torch.empty(B, dtype=torch.float32, device=device)
    if B == 0:
        return token_B, logprob_B
    if logprobs_BV.data_ptr() % 16:
        # A fresh allocation is aligned: the compiled sum order is then the one of every
        # aligned input (module docstring), whatever view the caller passed.
        logprobs_BV = logprobs_BV.clone()
    C = chunks(V)
    sums_BC = torch.empty(B, C, dtype=torch.float64, device=device)
    pdl = dependent_launch.keywords(device)
    with device_of(logprobs_BV):
        _chunk_sums_kernel[(B, C)](
            logprobs_BV, sums_BC, V, C, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=NUM_WARPS,
            enable_fp_fusion=False, **pdl,
        )  # fmt: skip
        _draw_kernel[(B,)](
            logprobs_BV, u_B, sums_BC, token_B, logprob_B, V, C, CHUNK=CHUNK, BLOCK=BLOCK,
            PADDED_C=max(2, triton.next_power_of_2(C)), num_warps=NUM_WARPS,
            enable_fp_fusion=False, **pdl,
        )  # fmt: skip
    return token_B, logprob_B
