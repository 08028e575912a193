"""Token sampling: temperature, top-k, top-p, greedy; one random generator per sequence.

Reproducibility: every sequence owns a CPU `torch.Generator` seeded from (request seed, prompt
index, sample index) and draws exactly one uniform number from it per generated token, greedy
or not. The token is then the inverse CDF of the processed distribution at that number, so a
sequence's tokens depend only on its own logits and its own generator, never on which other
sequences share the batch, on preemption or on the device. The engine takes a sequence's
numbers a block at a time (`Draws`): the same numbers in the same order, one host call per
block instead of one per token and sequence.

Logprobs: ``logprob`` is ``log_softmax`` of the distribution actually sampled from (after
temperature, top-k and top-p; masked tokens have probability 0). That is the behaviour
policy an importance ratio needs. ``raw_logprob`` is ``log_softmax`` of the unprocessed logits
(temperature 1, nothing masked), the quantity a trainer recomputes from its own forward. A
greedy choice comes from a point mass, whose logprob (0) says nothing, so greedy rows report
the raw logprob in both fields.

The definition sorts each row (stable: ties keep the lower id first), masks it and walks its
CDF (`_draw_sorted`, `_walk`). Sorting the whole vocabulary is the expensive part, and two
kinds of rows do without it, with results bitwise equal to the definition's:

- greedy rows: an argmax, whose ties go to the lowest id as the stable sort's rank 0 does;
- top-k rows (on a GPU only FP32 rows in batches of at least `TOP_K_SELECTION_MIN_ROWS`): the
  k largest values by partial selection (``torch.topk``), ordered as the sort would order them,
  ties included (`_candidates`), fill the definition's masked sorted row (which holds -inf past
  rank k), and `_walk` runs on it. Same operations on the same row, so the same bits on any
  device (given, as the reproducibility above already does, that torch's kernels compute a row
  alike whatever other rows share the tensor). Elsewhere on a GPU the selection and the passes
  that keep its bits cost more than the sort, and top-k rows sort like the others
  (`_selects_top_k`); which path a batch takes changes no bit.

The other rows keep the sort; when none of them cuts by top-k or top-p (the plain temperature
draw), their masks would keep every token and are not computed. Their top-p masses and logprobs
are normalized by a float32 sum over the sorted vocabulary, whose rounding depends on that
order: summed in any other order (without a sort), the normalizer differs in its last bits,
which moves CDF boundaries and, with them, some tokens (on the CPU at V = 151936, `sum` in
token order instead of sorted order changes about one draw in twenty of randn * 4 logits, as
the sorted float32 sum is off by ~3e-5 there). Equal results rule that out. Nothing is read
back from the device: which rows take which path follows from their SamplingParams.

The sort itself takes the logits as given where that changes no bit: BF16 or FP16 logits (the
engine passes the lm_head's BF16) are exactly their FP32 copies, so rows of temperature 1 sort
the 16-bit values, in the same order and with the same ties, from keys of half the width (on a
GPU, half a radix sort's passes: `benchmarks/sampler.py`'s "bf16" rows). On a GPU, for batches
of at least `SORTED_DRAW_MIN_ROWS` rows, such rows are not sorted at all: a 16-bit row's sorted
values follow from how often each value occurs, counted, and the drawn rank's token from one
scan of the row (`fp4rl.kernels.value_sort`); the walk then runs on the same FP32 values and
its float64 exponentials take one pass, so every result keeps its bits.

A request may give up that equality for speed: ``SamplingParams(cdf_order="token")`` walks
the CDF of the whole vocabulary in token-id order (`_draw_in_token_order`), with no sort at
all. The distribution, the one draw per token and the meaning of both logprobs stay; the token
a given number picks is another one, so those rows are not the definition's. On a GPU the walk
is one fused kernel (`fp4rl.kernels.token_draw`, two launches instead of a float64 scan over
the whole row and two searches), whose float64 sums run in an order of its own, fixed by the
vocabulary size: a number within a few float64 ulps of a CDF boundary may pick the
neighbouring token there and not on the CPU (rare: tests/kernels/test_kernel_token_draw.py
counts them), and a row's token still depends on nothing but its own logits and number.

Outside the contract, as before: NaN logits (the engine refuses them after the draw; the
sampler only keeps every index in range for them). Zeros of either sign are one value to the
sorts (the CPU's, the GPU's radix sort and the counting kernels alike keep their ids in order).

Legend: B rows (sequences), V vocab, K top-k candidates per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4rl import ops
from fp4rl.rollout.config import SamplingParams

_MASK64 = (1 << 64) - 1
# The token-order draw runs its fused kernel on a GPU (a knob for benchmarks/sampler.py, which
# times torch's float64 scan beside it).
TOKEN_DRAW_KERNEL = True
# The sorted draw runs its kernels on a GPU for at least SORTED_DRAW_MIN_ROWS rows: 16-bit rows'
# values counted instead of sorted, the float64 exponentials in one pass (a knob for
# benchmarks/sampler.py, which times torch's sort and passes beside them). With fewer rows their
# six launches cost more than they save (one H200, `python benchmarks/sampler.py`, BENCHMARKS.md
# "The sorted draw by counting").
SORTED_DRAW_KERNELS = True
SORTED_DRAW_MIN_ROWS = 64
# On a GPU, top-k rows of FP32 values skip the sort (partial selection, `_draw_top_k`) in batches
# of at least this many rows; in smaller ones, and where they sort 16-bit values (BF16 logits at
# temperature 1: the engine's), the sort was faster (one H200, `python benchmarks/sampler.py`,
# BENCHMARKS.md "The sampler without a full-vocabulary sort").
TOP_K_SELECTION_MIN_ROWS = 128


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


class Draws:
    """A generator's uniform numbers taken ``block`` at a time: the n-th `next` is the n-th
    ``torch.rand((), generator=generator, dtype=torch.float64)`` the generator would give (the
    CPU draws a block's values one after another from the same stream; the sampler's tests hold
    torch to that). One host call per block instead of one per number: a decode step of a few
    hundred sequences spent about 5 µs of host time on each sequence's draw."""

    __slots__ = ("generator", "block", "_values")

    def __init__(self, generator: torch.Generator, block: int = 64) -> None:
        if block < 1:
            raise ValueError(f"Draws.block must be at least 1; got {block}")
        self.generator, self.block = generator, block
        self._values: list[float] = []

    def next(self) -> float:
        if not self._values:
            drawn = torch.rand(self.block, generator=self.generator, dtype=torch.float64)
            self._values = drawn.tolist()[::-1]  # popped from the end: first drawn, first out
        return self._values.pop()


def _uniform(source: torch.Generator | Draws) -> float:
    """The next uniform number of a row's source of randomness (one draw)."""
    if isinstance(source, Draws):
        return source.next()
    return torch.rand((), generator=source, dtype=torch.float64).item()


@dataclass(frozen=True, slots=True)
class SampleOutput:
    token_ids_B: torch.Tensor  # long
    logprobs_B: torch.Tensor  # float32, of the sampled distribution (see module docstring)
    raw_logprobs_B: torch.Tensor  # float32, of the unprocessed logits


def sample(
    logits_BV: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | Draws],
) -> SampleOutput:
    """Draw one token per row of ``logits_BV`` (FP32, BF16 or FP16; computed on in FP32), row
    ``b`` with ``params[b]`` and its generator ``generators[b]`` (advanced by exactly one draw),
    or its `Draws` (one number taken)."""
    B, V = logits_BV.shape
    if len(params) != B or len(generators) != B:
        raise ValueError(f"{B} logit rows, {len(params)} params, {len(generators)} generators")
    device = logits_BV.device
    given_BV, logits_BV = logits_BV, logits_BV.float()
    top_k = [min(p.top_k or V, V) for p in params]
    temperature = [1.0 if p.greedy else p.temperature for p in params]
    # Top-k rows by partial selection, or sorted (16-bit values where all are at temperature 1).
    top_k_narrow = given_BV.dtype != torch.float32 and all(
        temperature[b] == 1.0 for b in range(B) if top_k[b] < V
    )
    selecting = _selects_top_k(B, device, top_k_narrow)
    by_top_k = [b for b, p in enumerate(params) if not p.greedy and top_k[b] < V and selecting]
    by_token = [b for b, p in enumerate(params) if not p.greedy and p.cdf_order == "token"]
    by_sort = [
        b
        for b, p in enumerate(params)
        if not p.greedy and (top_k[b] == V or not selecting) and p.cdf_order == "probability"
    ]
    drawing = by_top_k + by_sort + by_token
    # One draw per row from its own generator, in float64 so tokens of tiny probability keep
    # their chance; drawn on the CPU. What the rows need crosses to the device in one float64
    # copy (it holds the integers exactly) that nothing waits for (`to_device`).
    u = [_uniform(g) for g in generators]
    rest = [p.top_p for p in params] + [float(p.greedy) for p in params] + top_k
    host = torch.tensor(u + temperature + rest + drawing, dtype=torch.float64)
    values = to_device(host, device)
    u_B, temperature_B, top_p_B = values[: 3 * B].view(3, B)
    temperature_B, top_p_B = temperature_B.float(), top_p_B.float()
    ints = values[3 * B :].long()
    greedy_B, top_k_B = ints[:B].bool(), ints[B : 2 * B]
    top_k_rows, sort_rows, token_rows = ints[2 * B :].split(
        [len(by_top_k), len(by_sort), len(by_token)]
    )

    raw_logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
    scaled_BV = None
    if any(temperature[b] != 1.0 for b in drawing):
        scaled_BV = logits_BV / temperature_B[:, None]
    elif drawing:  # x / 1 is x (NaN aside, which the engine refuses): no pass
        scaled_BV = logits_BV
    drawn = []  # (rows, tokens, logprobs) of each way of drawing
    if len(drawing) < B:  # greedy rows: the first maximum, as the stable sort's
        drawn.append((slice(None), logits_BV.argmax(-1), torch.zeros(B, device=device)))
    if by_top_k:
        K = max(top_k[b] for b in by_top_k)  # from the host's params: nothing read back
        pick = _pick(top_k_rows, B)
        drawn.append(
            (pick, *_draw_top_k(scaled_BV[pick], K, top_k_B[pick], top_p_B[pick], u_B[pick]))
        )
    if by_sort:
        pick = _pick(sort_rows, B)
        # Rows without top-k whose top_p keeps every token (the plain temperature draw) mask
        # nothing: their walk skips computing masks that would keep all.
        masked = any(params[b].top_p < 1.0 or top_k[b] < V for b in by_sort)
        # At temperature 1 the scaled rows are the logits: 16-bit ones sort as given.
        narrow = given_BV.dtype != torch.float32 and all(temperature[b] == 1.0 for b in by_sort)
        rows_BV = (given_BV if narrow else scaled_BV)[pick]
        drawn.append(
            (pick, *_draw_sorted(rows_BV, top_k_B[pick], top_p_B[pick], u_B[pick], masked))
        )
    if by_token:
        pick = _pick(token_rows, B)
        # Unscaled rows' log_softmax is the raw one, already computed.
        logprobs_BV = (
            raw_logprobs_BV[pick]
            if scaled_BV is logits_BV
            else torch.log_softmax(scaled_BV[pick], dim=-1)
        )
        drawn.append((pick, *_draw_in_token_order(logprobs_BV, u_B[pick])))
    if len(drawn) == 1:  # one way for every row (the usual case): nothing to scatter
        _, token_B, processed_B = drawn[0]
    else:
        token_B = torch.empty(B, dtype=torch.long, device=device)
        processed_B = torch.empty(B, device=device)
        for rows, tokens, logprobs in drawn:
            token_B[rows], processed_B[rows] = tokens, logprobs

    raw_B = raw_logprobs_BV.gather(1, token_B[:, None])[:, 0]
    return SampleOutput(
        token_ids_B=token_B,
        logprobs_B=torch.where(greedy_B, raw_B, processed_B),
        raw_logprobs_B=raw_B,
    )


def _selects_top_k(rows: int, device: torch.device, narrow: bool) -> bool:
    """Whether a batch of ``rows`` on ``device`` draws its top-k rows by partial selection
    (`_draw_top_k`) rather than by the sort: on a GPU from `TOP_K_SELECTION_MIN_ROWS` rows
    unless they would sort 16-bit values (``narrow``), elsewhere always (a CPU sorts a
    vocabulary slowly). Both give the definition's bits; the tests and the benchmark run both."""
    return device.type != "cuda" or (rows >= TOP_K_SELECTION_MIN_ROWS and not narrow)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the CPU) on ``device``. To a GPU the copy goes through pinned memory and is only
    queued: a copy from pageable memory would make the host wait for everything queued before
    it (the step's forward), where the host could be launching the step's sampling instead."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _pick(rows_b: torch.Tensor, B: int):
    """Index of some of B rows: a plain slice when they are all of them (no copy)."""
    return slice(None) if rows_b.shape[0] == B else rows_b


def _draw_sorted(scaled_BV, top_k_B, top_p_B, u_B, masked=True):
    """The definition: ``(token, logprob)`` per row of temperature-scaled logits, FP32 or a
    16-bit dtype holding them exactly (sorted as given, walked in FP32). On a GPU, 16-bit rows
    are not sorted: their sorted values come from counting each bit pattern, and the token at
    the drawn rank from a scan of the row (`ops.sort_values`), the sort's bits."""
    counted = ops.sort_values(scaled_BV) if _kernels_for(scaled_BV) else None
    if counted is not None:
        sorted_BV, ends_BN = counted
        rank_B, logprob_B = _walk(sorted_BV, top_k_B, top_p_B, u_B, masked)
        return ops.token_at_rank(scaled_BV, ends_BN, rank_B), logprob_B
    sorted_BV, order_BV = torch.sort(scaled_BV, dim=-1, descending=True, stable=True)
    rank_B, logprob_B = _walk(sorted_BV.float(), top_k_B, top_p_B, u_B, masked)
    return order_BV.gather(1, rank_B[:, None])[:, 0], logprob_B


def _kernels_for(rows_BV: torch.Tensor) -> bool:
    """Whether the sorted draw tries its kernels (`ops` runs them on a GPU only)."""
    return SORTED_DRAW_KERNELS and rows_BV.shape[0] >= SORTED_DRAW_MIN_ROWS


def _draw_top_k(scaled_BV, K, top_k_B, top_p_B, u_B):
    """`_draw_sorted` for rows with top-k < V (K: the largest), without the sort: `_walk` masks
    the ranks from k on to -inf before anything else, so the sorted row may hold -inf there."""
    values_BK, ids_BK = _candidates(scaled_BV, K)
    in_top_k_BK = torch.arange(K, device=scaled_BV.device)[None, :] < top_k_B[:, None]
    sorted_BV = torch.full_like(scaled_BV, float("-inf"))
    sorted_BV[:, :K] = values_BK.masked_fill(~in_top_k_BK, float("-inf"))
    rank_B, logprob_B = _walk(sorted_BV, top_k_B, top_p_B, u_B)
    return ids_BK.gather(1, rank_B[:, None])[:, 0], logprob_B


def _draw_in_token_order(logprobs_BV, u_B):
    """``(token, logprob)`` per row of ``cdf_order="token"``: the first token whose float64
    CDF, summed in token-id order, exceeds ``u * total``. No sort: the same distribution as the
    sorted walk's, another token for the same ``u``. On a GPU, the fused kernel (its own order
    of the float64 sums; the module docstring)."""
    drawn = ops.draw_in_token_order(logprobs_BV, u_B) if TOKEN_DRAW_KERNEL else None
    if drawn is not None:
        return drawn
    cdf_BV = logprobs_BV.double().exp().cumsum(-1)
    total_B1 = cdf_BV[:, -1:].contiguous()
    token_B = torch.searchsorted(cdf_BV, u_B[:, None] * total_B1, right=True)[:, 0]
    # No draw passes the last token of positive probability (the first whose CDF reaches the
    # total): a number at the total (u = 1, which torch.rand does not give, and nothing here
    # relies on that) would index past the vocabulary. A row of NaN logits, which the engine
    # refuses after the draw, still indexes in range.
    last_B = torch.searchsorted(cdf_BV, total_B1, right=False)[:, 0]
    token_B = torch.minimum(token_B, last_B).clamp_(0, logprobs_BV.shape[1] - 1)
    return token_B, logprobs_BV.gather(1, token_B[:, None])[:, 0]


def _walk(sorted_BV, top_k_B, top_p_B, u_B, masked=True):
    """``(rank, logprob)`` drawn from each sorted row: top-k and top-p masks, ``log_softmax`` of
    what they keep, and the first rank whose float64 CDF exceeds ``u * total``. ``masked=False``
    says every row keeps every token (top-k V, top_p >= 1): the masks would be all true, and
    ``log_softmax`` of the row itself is the same."""
    if masked:
        sorted_BV = sorted_BV.masked_fill(~_keep(sorted_BV, top_k_B, top_p_B), float("-inf"))
    logprobs_BV = torch.log_softmax(sorted_BV, -1)
    # On a GPU the float64 exponentials and the count of positive ranks take one pass
    # (torch's bits), not a cast, an exp, a comparison and a sum.
    walked = ops.walk_exponentials(logprobs_BV) if _kernels_for(logprobs_BV) else None
    if walked is None:
        walked = logprobs_BV.double().exp(), (logprobs_BV > float("-inf")).sum(-1)
    probs_BV, live_B = walked
    cdf_BV = probs_BV.cumsum(-1)
    # First rank whose CDF exceeds u * total: never a zero-probability rank, except through
    # rounding at the very top, which the clamp to the last positive rank (the positive ranks
    # are a prefix, as the logits are sorted) removes.
    rank_B = torch.searchsorted(cdf_BV, (u_B * cdf_BV[:, -1])[:, None], right=True)[:, 0]
    rank_B = torch.minimum(rank_B, live_B - 1)
    # A row with no positive rank (NaN or infinite logits, which the engine refuses once the
    # step's tokens are read) still indexes in range: no device assert before that check.
    rank_B = rank_B.clamp_(min=0)
    return rank_B, logprobs_BV.gather(1, rank_B[:, None])[:, 0]


def _keep(sorted_BV, top_k_B, top_p_B):
    """Which ranks of each sorted row the top-k and top-p masks keep (bool ``[B, V]``)."""
    rank_V = torch.arange(sorted_BV.shape[1], device=sorted_BV.device)
    keep_BV = rank_V[None, :] < top_k_B[:, None]
    probs_BV = torch.softmax(sorted_BV.masked_fill(~keep_BV, float("-inf")), dim=-1)
    # Top-p keeps the smallest prefix whose mass reaches top_p: a token stays when the mass
    # strictly before it is still short of top_p (so the top token always stays). top_p = 1
    # keeps every token: the FP32 running mass reaches 1.0 before the tail (rounding), and
    # comparing against it would drop the tail's tokens.
    mass_before_BV = probs_BV.cumsum(-1) - probs_BV
    return keep_BV & ((mass_before_BV < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0))


def _candidates(scaled_BV, K):
    """Each row's K largest values and their ids, in the stable sort's order: value descending,
    the lower id first among equals. ``torch.topk`` guarantees neither the order of equal values
    nor, where the K-th value is tied with tokens left out, which of the tied ids it took; the
    sort takes the lowest. So the ranks holding the K-th value get the lowest ids of all tokens
    in the row with that value."""
    V = scaled_BV.shape[1]
    values_BK, ids_BK = torch.topk(scaled_BV, K, dim=-1)
    ids_BK, by_id_BK = ids_BK.sort(dim=-1)
    values_BK, order_BK = values_BK.gather(1, by_id_BK).sort(dim=-1, descending=True, stable=True)
    ids_BK = ids_BK.gather(1, order_BK)
    if K == V:
        return values_BK, ids_BK
    last_B1 = values_BK[:, -1:]
    tied_BK = values_BK == last_B1
    first_tied_B1 = (~tied_BK).sum(-1, keepdim=True)
    # The j-th token (j from 1) of the row with the K-th value: the first id where the running
    # count of such tokens reaches j. Rank first_tied + j - 1 holds it.
    count_BV = (scaled_BV == last_B1).cumsum(-1, dtype=torch.int32)
    j_BK = torch.arange(1, K + 1, device=scaled_BV.device, dtype=torch.int32) - first_tied_B1
    tied_ids_BK = torch.searchsorted(count_BV, j_BK.clamp(min=1).to(torch.int32))
    return values_BK, torch.where(tied_BK, tied_ids_BK, ids_BK)
