"""Programmatic dependent launch: a decode step's small kernels start while the one before ends.

A decode step at a small batch is a chain of some fifteen kernels per layer, most of them a few
microseconds long, each reading what the one before wrote. Launched plainly, a kernel's
programs are scheduled only once the kernel before it has finished and its writes are flushed,
and that latency is paid at every link of the chain. Launched with programmatic dependent launch
(Hopper and newer: the launch attribute ``launch_pdl``, kept by CUDA graphs as a programmatic
edge), a kernel may be scheduled while the kernel before it is still running; its programs then
wait at ``griddepcontrol.wait`` (`wait_for_prior`), which returns once every kernel it depends
on has completed and its memory operations are visible.

The rule every kernel launched this way follows: `wait_for_prior` is the first thing each of its
programs does, before any load or store and before any early return. So nothing it reads is
stale, nothing it writes can race a reader still running before it, and it cannot complete
before the kernel it follows (which keeps the dependency transitive for the kernel after it).
Nothing moves in the arithmetic: the same programs compute the same bits, only sooner.

When the kernel after it may be scheduled is a second choice. By default a kernel's dependents
may start as its programs exit. Under `early_dependents` a kernel lets them start as soon as
every one of its programs is running (``griddepcontrol.launch_dependents``, right after the
wait): the next kernel's programs are then placed on the multiprocessors and parked at their
own wait while this one computes, so a chain of short kernels pays neither the launch latency
nor the programs' start at each link. On one H200 it shortened every decode step of up to 32
sequences (batch 1 the most: NVFP4 3.46 -> 3.03 ms at 48 layers), but a long ALU-bound kernel
placed while the kernel before it still runs can lose: the NVFP4 decode attention after the K/V
store did, so the engine captures its graphs early and switches early dependents off around that
store (`fp4rl.rollout.attention`, with the measurements). Only where and when programs start
moves; the bits do not. The switch is process-wide, and scoped: set it around a capture on the
thread that launches.

Kernels take a ``PDL`` constexpr (`PLAIN`, `DEPENDENT` or `EARLY`) and their launchers pass
`keywords` (both the constexpr and the launch option). Off CUDA, under Triton's interpreter,
before sm_90, or with `ENABLED` false the launch is a plain one and the wait is compiled out.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon

from fp4rl.kernels.launch import interpreting

# Hopper introduced grid dependency control.
CAPABILITY = (9, 0)
# Off: every kernel is launched plainly (an A/B switch for benchmarks; results are the same).
ENABLED = True
# The values of a kernel's PDL constexpr: launched plainly; dependently; dependently, letting the
# kernels after it start once all of its programs run (`early_dependents`).
PLAIN, DEPENDENT, EARLY = 0, 1, 2
_early = False


@contextlib.contextmanager
def early_dependents(on: bool = True):
    """Kernels launched dependently inside this block (a CUDA graph's capture, say) let their
    dependents start as soon as all of their programs are running, not as they exit."""
    global _early
    before, _early = _early, on
    try:
        yield
    finally:
        _early = before


@functools.cache
def _supported(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= CAPABILITY


def keywords(device: torch.device) -> dict:
    """Launch keywords for a kernel with a ``PDL`` constexpr on ``device``: ``PDL`` (`PLAIN`,
    else `DEPENDENT` or, under `early_dependents`, `EARLY`) and the launch option
    ``launch_pdl``, true where dependent launch applies."""
    on = ENABLED and device.type == "cuda" and not interpreting() and _supported(device)
    return dict(PDL=(EARLY if _early else DEPENDENT) if on else PLAIN, launch_pdl=on)


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    """Wait until the kernels this launch depends on have completed and their writes are
    visible (``griddepcontrol.wait``), then, for ``PDL`` `EARLY`, let the kernels that depend
    on this one be scheduled; nothing when launched plainly (``PDL`` `PLAIN`)."""
    if PDL == 2:  # EARLY
        tl.inline_asm_elementwise(
            "griddepcontrol.wait; griddepcontrol.launch_dependents; // $0",
            "=r", [], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    elif PDL:
        tl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


# The same function for the Gluon kernels: the same Python body.
gluon_wait_for_prior = gluon.jit(wait_for_prior.fn)
