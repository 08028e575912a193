"""The records of a refit stream, and the error a failed refit raises.

A refit is one stream: ``NamedTensor`` records (the trainer's BF16 weights, layer by layer, under
fp4rl's names or the hub's per-expert names), then exactly one ``EndOfStream`` that carries the
new policy version and the names the sender sent (its inventory). A sender that fails part way
ends its stream with ``Abort`` instead, where its transport can say so (across processes); in
one process its exception reaches the receiver directly. This module owns the records only:
`sender` produces them, `transport` carries them, `receiver` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class NamedTensor:
    name: str  # fp4rl name ("layers.3.mlp.experts.w13") or hub name ("model.layers.3...")
    tensor: torch.Tensor  # the values, in the sender's dtype; cast to the engine's at load


@dataclass(frozen=True, slots=True)
class EndOfStream:
    policy_version: int  # must exceed the engine's; becomes its version once all is applied
    inventory: tuple[str, ...]  # every name the sender sent, in order


@dataclass(frozen=True, slots=True)
class Abort:
    reason: str  # the sender's error, as it would print it


Record = NamedTensor | EndOfStream | Abort


class RefitError(RuntimeError):
    """A refit that was not applied in full; the engine is marked invalid until a later refit
    succeeds. The message names the tensor (or the record) at fault."""
