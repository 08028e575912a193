"""Token sampling: temperature, top-k, top-p, greedy; one random generator per sequence.

Reproducibility: every sequence owns a CPU `torch.Generator` seeded from (request seed, prompt
index, sample index) and draws exactly one uniform number from it per generated token, greedy
or not. The token is then the inverse CDF of the processed distribution at that number, so a
sequence's tokens depend only on its own logits and its own generator, never on which other
sequences share the batch, on preemption or on the device.

Logprobs: ``logprob`` is ``log_softmax`` of the distribution actually sampled from (after
temperature, top-k and top-p; masked tokens have probability 0). That is the behaviour
policy an importance ratio needs. ``raw_logprob`` is ``log_softmax`` of the unprocessed logits
(temperature 1, nothing masked), the quantity a trainer recomputes from its own forward. A
greedy choice comes from a point mass, whose logprob (0) says nothing, so greedy rows report
the raw logprob in both fields.

Legend: B rows (sequences), V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4rl.rollout.config import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sequence_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A well-mixed 63-bit seed per sample; neighbouring indices give unrelated streams."""
    h = _splitmix64(seed)
    h = _splitmix64(h ^ prompt_index)
    return _splitmix64(h ^ sample_index) >> 1


def make_generator(seed: int, prompt_index: int, sample_index: int) -> torch.Generator:
    seed = sequence_seed(seed, prompt_index, sample_index)
    return torch.Generator(device="cpu").manual_seed(seed)


@dataclass(frozen=True, slots=True)
class SampleOutput:
    token_ids_B: torch.Tensor  # long
    logprobs_B: torch.Tensor  # float32, of the sampled distribution (see module docstring)
    raw_logprobs_B: torch.Tensor  # float32, of the unprocessed logits


def _processed_sorted(logits_BV, temperature_B, top_k_B, top_p_B):
    """Scaled logits sorted descending (stable: ties keep the lower id first), with the mask
    of the tokens top-k and top-p keep."""
    scaled = logits_BV / temperature_B[:, None]
    sorted_BV, order_BV = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank_V = torch.arange(logits_BV.shape[1], device=logits_BV.device)
    keep_BV = rank_V[None, :] < top_k_B[:, None]
    probs_BV = torch.softmax(sorted_BV.masked_fill(~keep_BV, float("-inf")), dim=-1)
    # Top-p keeps the smallest prefix whose mass reaches top_p: a token stays when the mass
    # strictly before it is still short of top_p (so the top token always stays).
    mass_before_BV = probs_BV.cumsum(-1) - probs_BV
    keep_BV &= mass_before_BV < top_p_B[:, None]
    return sorted_BV, order_BV, keep_BV


def sample(
    logits_BV: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> SampleOutput:
    """Draw one token per row of FP32 ``logits_BV``, row ``b`` with ``params[b]`` and its
    generator ``generators[b]`` (advanced by exactly one draw)."""
    B, V = logits_BV.shape
    if len(params) != B or len(generators) != B:
        raise ValueError(f"{B} logit rows, {len(params)} params, {len(generators)} generators")
    device = logits_BV.device
    logits_BV = logits_BV.float()
    # One draw per row from its own generator, in float64 so tokens of tiny probability keep
    # their chance; drawn on the CPU, then moved in one copy.
    u_B = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    u_B = u_B.to(device)
    greedy_B = torch.tensor([p.greedy for p in params], device=device)
    temperature_B = torch.tensor(
        [1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32, device=device
    )
    top_k_B = torch.tensor([p.top_k or V for p in params], device=device)
    top_p_B = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)

    raw_logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
    sorted_BV, order_BV, keep_BV = _processed_sorted(logits_BV, temperature_B, top_k_B, top_p_B)
    logprobs_sorted_BV = torch.log_softmax(sorted_BV.masked_fill(~keep_BV, float("-inf")), -1)
    cdf_BV = logprobs_sorted_BV.double().exp().cumsum(-1)
    # First rank whose CDF exceeds u * total: never a zero-probability rank, except through
    # rounding at the very top, which the clamp to the last positive rank (the positive ranks
    # are a prefix, as the logits are sorted) removes.
    rank_B = torch.searchsorted(cdf_BV, (u_B * cdf_BV[:, -1])[:, None], right=True)[:, 0]
    rank_B = torch.minimum(rank_B, (logprobs_sorted_BV > float("-inf")).sum(-1) - 1)
    rank_B = torch.where(greedy_B, torch.zeros_like(rank_B), rank_B)

    token_B = order_BV.gather(1, rank_B[:, None])[:, 0]
    raw_B = raw_logprobs_BV.gather(1, token_B[:, None])[:, 0]
    processed_B = logprobs_sorted_BV.gather(1, rank_B[:, None])[:, 0]
    return SampleOutput(
        token_ids_B=token_B,
        logprobs_B=torch.where(greedy_B, raw_B, processed_B),
        raw_logprobs_B=raw_B,
    )
