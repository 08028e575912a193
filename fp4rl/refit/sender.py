"""The trainer's side of a refit: its weights as a stream of named tensors, layer by layer.

The tensors are the trainer's own parameters (detached views, never copies): in one process the
receiver quantizes or copies straight from them, across processes the transport sends them as
they are. The default names are fp4rl's, routed experts fused per layer
(``layers.N.mlp.experts.w13 [E, 2I, H]`` / ``.w2 [E, H, I]``, as ``state_dict()`` names them);
``names="hf"`` sends the hub's per-expert tensors instead (``model.layers.N.mlp.experts.J
.gate_proj.weight`` ...), views into the same parameters through the one name table of
`fp4rl.model.checkpoint`. Does not own the transport or any check: the receiver checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from fp4rl.model.checkpoint import fp4rl_to_hf
from fp4rl.refit.protocol import EndOfStream, NamedTensor, Record

Names = Literal["fused", "hf"]


def refit_records(model, policy_version: int, *, names: Names = "fused") -> Iterator[Record]:
    """``model``'s weights in model order, then ``EndOfStream(policy_version, inventory)``.

    ``model`` is the trainer's `MoETransformer` (BF16 or QAT experts). A tied lm_head is the
    embedding and is sent once, as it.
    """
    if names == "fused":
        tensors = ((name, p.detach()) for name, p in model.named_parameters())
    elif names == "hf":
        tensors = iter(fp4rl_to_hf(model.state_dict(), model.config).items())
    else:
        raise ValueError(f"names must be 'fused' or 'hf', got {names!r}")
    sent = []
    for name, tensor in tensors:
        yield NamedTensor(name, tensor)
        sent.append(name)
    yield EndOfStream(policy_version, tuple(sent))
