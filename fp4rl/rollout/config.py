"""Settings of the rollout engine and of one generate call: small, frozen, checked on creation.

`EngineConfig` sizes the engine (KV budget, batch limits, what to capture); `SamplingParams`
says how one request's tokens are drawn; `check_prompts` and `per_prompt_params` check a
generate call's prompts and give each its parameters and seed. Mistakes raise `ValueError`
naming the key and value. Turning the KV byte budget into a number of blocks needs the model's
shape, so it lives in `fp4rl.rollout.kv_cache.num_blocks_for_budget`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal, get_args

from fp4rl import checks

GuidanceMode = Literal["full", "compact", "sparse"]
GUIDANCE_MODES = (None, *get_args(GuidanceMode))
CdfOrder = Literal["probability", "token"]


def _grid_fraction(delta: float) -> bool:
    return 0.0 < delta <= 0.5


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block (the KV format of each layer is the model's plan)
    kv_memory_bytes: int = 1 << 30  # KV budget over all layers; sets the number of blocks
    max_num_seqs: int = 256  # sequences (samples) running at once
    max_num_batched_tokens: int = 8192  # tokens fed to the model in one step
    max_model_len: int = 4096  # prompt + completion tokens of one sequence
    capture_routing: bool = False  # record top-k expert ids per token per MoE layer
    # Record the FP4 sites' codes ("full"), mantissa bits ("compact"), or the bits of the values
    # near a rounding boundary ("sparse"); all with the rollout's scales.
    guidance: GuidanceMode | None = None
    compact_fraction: float = 0.5  # "compact" keeps the latter fraction of the FP4 layers
    # "sparse" records the values within this many E2M1 grid units of a rounding boundary
    # (`fp4rl.fp4.sparse_guidance.boundary_distance`; a value on a codeword is 0.5 from both).
    sparse_delta: float = 0.03
    # Replay decode-only steps, and steps that prefill of up to 2,048 tokens, from CUDA graphs
    # (`fp4rl.rollout.graphs`, `fp4rl.rollout.prefill_graphs`) where the engine runs on a GPU
    # and every layer's attention reads its pages with the paged kernels.
    cuda_graphs: bool = True
    # `Engine.release_kv` keeps the CUDA graphs: the KV pages lie at device addresses reserved
    # for the engine's life (`fp4rl.rollout.device_memory`), their memory given back and mapped
    # again, so `acquire_kv` needs no capture. The graphs' own memory pool stays held while the
    # pages are released. Off: the graphs and their pool go with the pages.
    keep_graphs: bool = True
    # Feed a prompt longer than what is left of a step's token budget in chunks, beside the
    # decodes (`fp4rl.rollout.scheduler`); off: it waits until it fits one step whole.
    chunked_prefill: bool = True
    # Launch the next decode step before reading this one's tokens back, when it decodes every
    # running sequence and admits nothing: the host's share of a step (reading the tokens,
    # scheduling, staging) overlaps the device's work. The step feeds the tokens where they
    # lie; a sequence that sampled a stop token is fed once more, and that row is dropped.
    overlap_steps: bool = True

    def __post_init__(self) -> None:
        s = "engine"
        for key, minimum in (
            ("block_size", 1),
            ("kv_memory_bytes", 1),
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("max_model_len", 2),
        ):
            checks.integer(f"{s}.{key}", getattr(self, key), minimum)
        if self.guidance not in GUIDANCE_MODES:
            raise ValueError(f"{s}.guidance must be one of {GUIDANCE_MODES}, got {self.guidance!r}")
        checks.boolean(f"{s}.capture_routing", self.capture_routing)
        checks.boolean(f"{s}.cuda_graphs", self.cuda_graphs)
        checks.boolean(f"{s}.keep_graphs", self.keep_graphs)
        checks.boolean(f"{s}.chunked_prefill", self.chunked_prefill)
        checks.boolean(f"{s}.overlap_steps", self.overlap_steps)
        fraction = self.compact_fraction
        if (
            not isinstance(fraction, int | float)
            or isinstance(fraction, bool)
            or not (0.0 < fraction <= 1.0)
        ):
            raise ValueError(f"{s}.compact_fraction must be in (0, 1], got {fraction!r}")
        checks.number(f"{s}.sparse_delta", self.sparse_delta, "in (0, 0.5]", _grid_fraction)
        # Without chunked prefill a prompt, or a preempted sequence being recomputed, enters
        # the model in one step, so one step must hold the longest sequence.
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"{s}.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"{s}.max_model_len ({self.max_model_len}) without chunked prefill: prompts are "
                "prefilled in one step"
            )
        # Every running sequence decodes one token per step.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"{s}.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"{s}.max_num_seqs ({self.max_num_seqs}): each running sequence decodes a "
                "token every step"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How the tokens of one request are drawn.

    ``temperature == 0`` is greedy (argmax, ties to the lowest token id). Otherwise the logits
    are divided by the temperature, cut to the ``top_k`` largest, then to the smallest set whose
    probability reaches ``top_p``, renormalized, and sampled. A request with a ``seed`` draws
    its randomness from its own generators (one per sample) so the completion does not depend on
    what else is in the batch; ``seed=None`` picks a fresh seed per generate call.

    A draw is the inverse CDF at one uniform number. ``cdf_order`` says in which order the
    tokens' probabilities are summed into that CDF: ``"probability"`` (the default) from the
    most probable down, which sorts the vocabulary every step; ``"token"`` in token-id order,
    with no sort (2-3 times faster a call at 64-256 rows on an H200). Both draw from the same
    distribution with the same one number per token, but a seed gives other tokens under each.
    ``"token"`` takes the whole vocabulary only (no ``top_k``, ``top_p`` 1): a top-p cut is
    defined by the sorted order.

    A sequence stops at a token of ``stop_token_ids`` or at the engine's EOS ids (unless
    ``ignore_eos``); the stop token is kept in the completion (the trainer scores it too).
    """

    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k cut
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    return_logprobs: bool = True
    cdf_order: CdfOrder = "probability"

    def __post_init__(self) -> None:
        s = "sampling"
        checks.integer(f"{s}.n", self.n, 1)
        checks.integer(f"{s}.max_tokens", self.max_tokens, 1)
        t = self.temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"{s}.temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, int | float) or isinstance(p, bool) or not (0.0 < p <= 1.0):
            raise ValueError(f"{s}.top_p must be in (0, 1], got {p!r}")
        if self.top_k is not None:
            checks.integer(f"{s}.top_k", self.top_k, 1)
        if not isinstance(self.stop_token_ids, tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.stop_token_ids
        ):
            raise ValueError(
                f"{s}.stop_token_ids must be a tuple of non-negative ints, got "
                f"{self.stop_token_ids!r}"
            )
        if self.seed is not None:
            checks.integer(f"{s}.seed", self.seed, 0)
        checks.boolean(f"{s}.ignore_eos", self.ignore_eos)
        checks.boolean(f"{s}.return_logprobs", self.return_logprobs)
        checks.choice(f"{s}.cdf_order", self.cdf_order, get_args(CdfOrder))
        if self.cdf_order == "token" and (self.top_k is not None or self.top_p < 1.0):
            raise ValueError(
                f"{s}.cdf_order='token' draws from the whole vocabulary; it takes no top-k or "
                f"top-p cut (top_k={self.top_k!r}, top_p={self.top_p!r}): use "
                "cdf_order='probability' for those"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_prompts(prompts: list[list[int]], max_model_len: int, vocab_size: int) -> None:
    """Raise ValueError naming the first prompt that is empty, leaves no room to generate
    under ``max_model_len``, or holds a token id outside ``[0, vocab_size)``."""
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(prompt) >= max_model_len:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens; engine.max_model_len={max_model_len} "
                "leaves no room to generate (a prompt must be shorter than max_model_len)"
            )
        for token in prompt:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
                raise ValueError(
                    f"prompt {i} has token id {token!r} outside the vocabulary [0, {vocab_size})"
                )


def per_prompt_params(sampling, num_prompts: int) -> list[tuple[SamplingParams, int]]:
    """``(params, seed)`` of each prompt: the one `SamplingParams` (one seed for the call) or
    the list's entry (a seed per prompt), a fresh seed where none is given."""

    def seed_of(params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        return int.from_bytes(os.urandom(8), "little") >> 1

    if isinstance(sampling, SamplingParams):
        return [(sampling, seed_of(sampling))] * num_prompts
    params = list(sampling)
    if len(params) != num_prompts:
        raise ValueError(
            f"sampling holds {len(params)} SamplingParams for {num_prompts} prompts; give one "
            "per prompt, or a single SamplingParams for all"
        )
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling[{i}] must be a SamplingParams, got {type(p).__name__}")
    return [(p, seed_of(p)) for p in params]
