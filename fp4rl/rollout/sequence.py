"""One sample being generated: its tokens, blocks, random draws and what it has recorded.

A `Sequence` is the engine's mutable bookkeeping; it becomes an immutable
`fp4rl.rollout.records.Completion` when it finishes. Preemption keeps the tokens, logprobs and
the draws (so the recomputed sequence continues with the very numbers it would have drawn)
and drops the blocks and the capture, which the recomputation produces again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fp4rl.rollout.block_manager import BlockTable
from fp4rl.rollout.capture import SequenceCapture
from fp4rl.rollout.config import SamplingParams
from fp4rl.rollout.sampler import Draws


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    draws: Draws  # its generator's uniform numbers, one per sampled token
    stop_ids: frozenset[int]  # stop_token_ids plus the engine's EOS ids unless ignore_eos
    capture: SequenceCapture | None = None
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    block_table: BlockTable = field(default_factory=BlockTable)
    num_cached: int = 0  # leading tokens whose K/V are in the cache
    finish_reason: str | None = None  # "stop" | "length" once finished

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def tokens_from(self, start: int) -> list[int]:
        """``tokens()[start:]`` without copying the whole sequence (a decode needs one)."""
        P = len(self.prompt_ids)
        if start >= P:
            return self.completion_ids[start - P :]
        return self.prompt_ids[start:] + self.completion_ids

    def reserve(self, token: int, max_model_len: int) -> bool:
        """Hold a sampled token not read back yet, as a `placeholder`; return True when the
        sequence ends with it whatever it is (its length limits)."""
        self.completion_ids.append(token)
        return (
            len(self.completion_ids) >= self.params.max_tokens or self.num_tokens >= max_model_len
        )

    def resolve(self, token: int, logprob: float, raw_logprob: float, max_model_len: int) -> bool:
        """Put the first held token's value in its place; return True when the sequence is
        finished with it. A stop token drops the tokens held after it (sampled in a step that
        was launched before this token was read)."""
        at = len(self.logprobs)
        self.completion_ids[at] = token
        self.logprobs.append(logprob)
        self.raw_logprobs.append(raw_logprob)
        if token in self.stop_ids:
            self.finish_reason = "stop"
            del self.completion_ids[at + 1 :]
        elif at + 1 >= self.params.max_tokens or len(self.prompt_ids) + at + 1 >= max_model_len:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, raw_logprob: float, max_model_len: int) -> bool:
        """Record a sampled token known at once (`reserve` then `resolve`); return True when
        the sequence is finished."""
        self.reserve(token, max_model_len)
        return self.resolve(token, logprob, raw_logprob, max_model_len)


def placeholder(row: int) -> int:
    """A token not read back yet: row ``row`` of its step's sampled tokens (a negative id)."""
    return -1 - row


def resolve_placeholders(tokens_T: torch.Tensor, sampled_S: torch.Tensor | None) -> torch.Tensor:
    """``tokens_T`` (int64, on the device) with each `placeholder` replaced by the token it
    names in ``sampled_S``, the previous step's samples where they lie (no wait for the device:
    the replacement is queued like the rest of the step)."""
    if sampled_S is None:
        return tokens_T
    rows = (-1 - tokens_T).clamp_(0, sampled_S.shape[0] - 1)
    return torch.where(tokens_T < 0, sampled_S[rows], tokens_T)
