"""One sample being generated: its tokens, blocks, random generator and what it has recorded.

A `Sequence` is the engine's mutable bookkeeping; it becomes an immutable
`fp4rl.rollout.records.Completion` when it finishes. Preemption keeps the tokens, logprobs and
the generator (so the recomputed sequence continues with the very draws it would have made)
and drops the blocks and the capture, which the recomputation produces again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fp4rl.rollout.block_manager import BlockTable
from fp4rl.rollout.capture import SequenceCapture
from fp4rl.rollout.config import SamplingParams


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
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

    def append(self, token: int, logprob: float, raw_logprob: float, max_model_len: int) -> bool:
        """Record a sampled token; return True when the sequence is finished."""
        self.completion_ids.append(token)
        self.logprobs.append(logprob)
        self.raw_logprobs.append(raw_logprob)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.completion_ids) >= self.params.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = "length"
        return self.finish_reason is not None
