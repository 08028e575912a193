"""What the rollout hands to the trainer: one `Completion` per sample.

Token-aligned fields cover the ``T = len(prompt_ids) + len(completion_ids) - 1`` tokens the
model was fed (the last sampled token never is): row ``t`` of ``routing`` and of each guidance
record belongs to token ``t`` of ``prompt_ids + completion_ids``, the input whose output
predicted token ``t + 1``. ``logprobs[i]`` scores ``completion_ids[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4rl.fp4 import CompactCodes, NVFP4Tensor
from fp4rl.rollout.capture import record_nbytes

SiteKey = tuple[int, str]  # (decoder layer, site): "expert_input", "expert_hidden", "k", "v"


@dataclass(frozen=True, kw_only=True, slots=True)
class Completion:
    prompt_index: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]  # the stop token, if any, included
    finish_reason: str  # "stop" | "length"
    policy_version: int  # weights version that generated it (bumped by each refit)
    # float32 [len(completion_ids)]: log-prob under the distribution sampled from (after
    # temperature / top-k / top-p), and under the unprocessed logits; None unless requested.
    logprobs: torch.Tensor | None = None
    raw_logprobs: torch.Tensor | None = None
    routing: torch.Tensor | None = None  # int32 [L_moe, T, top_k], -1 = no record
    # (layer, site) -> record with leading dim T: NVFP4Tensor ("full") or CompactCodes; None
    # for the FP4 layers compact guidance leaves out (the trainer rounds those to nearest).
    guidance: dict[SiteKey, NVFP4Tensor | CompactCodes | None] | None = None

    @property
    def num_fed_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids) - 1

    def guidance_nbytes(self) -> int:
        return sum(record_nbytes(r) for r in (self.guidance or {}).values() if r is not None)

    def routing_nbytes(self) -> int:
        return 0 if self.routing is None else self.routing.numel() * self.routing.element_size()


def capture_bytes_per_generated_token(completions: list[Completion]) -> dict[str, float]:
    """What the captured records cost per generated token, over a batch of completions:
    ``{"routing": ..., "guidance": ...}`` (prompt tokens' records included in the numerator)."""
    generated = sum(len(c.completion_ids) for c in completions)
    if generated == 0:
        return {"routing": 0.0, "guidance": 0.0}
    return {
        "routing": sum(c.routing_nbytes() for c in completions) / generated,
        "guidance": sum(c.guidance_nbytes() for c in completions) / generated,
    }
