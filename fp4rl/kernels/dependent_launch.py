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

Kernels take a ``PDL`` constexpr and their launchers pass `keywords` (both the constexpr and the
launch option). Off CUDA, under Triton's interpreter, before sm_90, or with `ENABLED` false the
launch is a plain one and the wait is compiled out.
"""

from __future__ import annotations

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


@functools.cache
def _supported(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= CAPABILITY


def keywords(device: torch.device) -> dict:
    """Launch keywords for a kernel with a ``PDL`` constexpr on ``device``: ``PDL`` and the
    launch option ``launch_pdl``, both true where dependent launch applies."""
    on = ENABLED and device.type == "cuda" and not interpreting() and _supported(device)
    return dict(PDL=on, launch_pdl=on)


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    """Wait until the kernels this launch depends on have completed and their writes are
    visible (``griddepcontrol.wait``); nothing when not launched dependently (``PDL`` false)."""
    if PDL:
        tl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


# The same function for the Gluon kernels: the same Python body.
gluon_wait_for_prior = gluon.jit(wait_for_prior.fn)
