"""What a step hands back to the host: its sampled tokens, logprobs and raw logprobs, and
which logit rows were unfit to sample, in one copy queued behind the sampling (the engine's one
wait for the device is on it), and the check that refuses unfit rows."""

from __future__ import annotations

import torch

from fp4rl.rollout.sampler import SampleOutput


def bad_rows(logits_SV: torch.Tensor) -> torch.Tensor:
    """Rows with a NaN or +inf logit, or no finite one (bool ``[S]``, on the device), in one
    reduction: a row's maximum is NaN if any logit is (torch's max propagates NaN), +inf if one
    is and none is NaN, -inf if all are, and finite exactly when the row is fit to sample."""
    return ~torch.isfinite(logits_SV.amax(-1))


def queue_read_back(bad_S: torch.Tensor, out: SampleOutput) -> tuple[torch.Tensor, object]:
    """The bad-row flags and the sampled tokens, logprobs and raw logprobs in one float64 tensor
    (which holds token ids and FP32 values exactly), its copy to the host queued right behind
    the sampling: a later step launched before this one is read does not delay it. Returns the
    host tensor and the event (None off the GPU) that says it has landed."""
    parts = (bad_S, out.token_ids_B, out.logprobs_B, out.raw_logprobs_B)
    values = torch.cat([p.to(torch.float64) for p in parts])
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(values, non_blocking=True)
    landed = torch.cuda.Event()
    landed.record(torch.cuda.current_stream(values.device))
    return host, landed


def read_back(queued: tuple, num_rows: int, num_samples: int):
    """What `queue_read_back` queued for ``num_rows`` logit rows and ``num_samples`` samples, on
    the host (the wait for the device): ``(bad rows, tokens, logprobs, raw logprobs)`` lists."""
    host, landed = queued
    if landed is not None:
        landed.synchronize()
    values = host.tolist()
    bad, rest = values[:num_rows], values[num_rows:]
    B = num_samples
    return [v != 0 for v in bad], [int(v) for v in rest[:B]], rest[B : 2 * B], rest[2 * B :]


def check_logits(bad_S: list[bool], groups: list) -> None:
    """Refuse to sample from NaN, +inf or all -inf logits (`bad_rows`): any token drawn from
    them would be a plausible-looking lie in the training data. Tokens drawn from such rows in
    the same step are discarded with the step. ``groups[i]``: the sequences sampling row i."""
    if any(bad_S):
        names = [
            f"prompt {s.prompt_index} sample {s.sample_index}"
            for i, bad in enumerate(bad_S)
            if bad
            for s in groups[i]
        ]
        raise RuntimeError(f"non-finite logits for {', '.join(names)}; generation stopped")
