"""What crosses the rollout -> trainer seam: `Completion`, site records, and the packed batch.

Both sides import this module and it imports neither (only the NVFP4 containers), so a trainer
never needs the engine package and the engine never needs the trainer's. `collate` packs
completions into one `TrainBatch`: the token stream the trainer feeds, which rows it scores,
the rollout's logprobs aligned to those rows, and the routing and guidance of the whole stream.

Token alignment: a completion's model was fed ``T = len(prompt_ids) + len(completion_ids) - 1``
tokens (the last sampled token never is). Row ``t`` of its routing record and of each guidance
record belongs to fed token ``t``, the input whose output predicted token ``t + 1``; so the
row that scores ``completion_ids[i]`` is ``len(prompt_ids) - 1 + i``.

Legend: T fed tokens (all sequences packed), N scored tokens, L_moe MoE layers, k experts per
token, B sequences.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fp4rl.fp4 import CompactCodes, NVFP4Tensor, SparseCodes
from fp4rl.fp4.sparse_guidance import PackedSparse
from fp4rl.row_records import RowPlan, RowRecords, plan_of  # noqa: F401 (RowPlan: the rollout)

SiteKey = tuple[int, str]  # (decoder layer, site): "expert_input", "expert_hidden", "k", "v"
# Full codes or compact mantissa bits, each with the rollout's scales; or sparse near-boundary
# bits with the row maxima the scales follow from, as the engine cuts and the trainer reads them
# (SparseCodes) or as a completion carries them (PackedSparse: `record_pack`, `record_unpack`).
SiteRecord = NVFP4Tensor | CompactCodes | SparseCodes | PackedSparse
# A None value means "round this site to nearest" on purpose (compact guidance leaves out the
# earlier FP4 layers); a missing key is an error.
GuidanceMap = Mapping[SiteKey, SiteRecord | None]


def record_members(r: SiteRecord) -> tuple[torch.Tensor, ...]:
    """The record's tensors in field order, the first with one row per token (sparse entries
    and packed streams have not)."""
    if isinstance(r, NVFP4Tensor | SparseCodes | PackedSparse):
        return r.tensors()
    return r.mantissa_bits, r.block_scale, r.global_scale


def record_like(r: SiteRecord, members) -> SiteRecord:
    """A record of ``r``'s kind (and sparse columns) over other ``members``."""
    if isinstance(r, SparseCodes | PackedSparse):
        return type(r)(*members, r.columns)
    return type(r)(*members)


def record_pack(r: SiteRecord) -> SiteRecord:
    """The form a completion carries: sparse records packed (`SparseCodes.pack`), others as
    they are."""
    return r.pack() if isinstance(r, SparseCodes) else r


def record_unpack(r: SiteRecord) -> SiteRecord:
    """The form the trainer reads: packed sparse records unpacked, others as they are."""
    return r.unpack() if isinstance(r, PackedSparse) else r


def record_rows(r: SiteRecord, start: int, end: int) -> SiteRecord:
    """Rows ``[start, end)`` of a token-major record (per-row scales make this exact)."""
    if isinstance(r, SparseCodes):  # its entries are ragged: found through the row counts
        return r.rows(start, end)
    if isinstance(r, PackedSparse):
        return r.unpack().rows(start, end).pack()
    return record_like(r, [m[start:end] for m in record_members(r)])


def record_gather(r: SiteRecord, spans: Sequence[tuple[int, int]]) -> SiteRecord:
    """The rows of ``spans`` (``[start, end)`` ranges, in order) of a token-major record, as
    one record: one gather per member (sparse records: a slice per span, then one concat)."""
    if isinstance(r, PackedSparse):
        return record_gather(r.unpack(), spans).pack()
    if isinstance(r, SparseCodes):
        return SparseCodes.cat([r.rows(a, b) for a, b in spans])
    rows = [i for a, b in spans for i in range(a, b)]
    index = torch.tensor(rows, dtype=torch.long).to(record_members(r)[0].device, non_blocking=True)
    return record_like(r, [m[index] for m in record_members(r)])


def record_gather_packed(
    r: SiteRecord, parts: Sequence[Sequence[tuple[int, int]]]
) -> list[SiteRecord]:
    """For each part (``[start, end)`` row spans, in order), its rows of a token-major record
    in the form a completion carries (`record_pack`): sparse records of all parts are gathered
    and packed in one pass, others gathered part by part."""
    if isinstance(r, PackedSparse):
        r = r.unpack()
    if isinstance(r, SparseCodes):
        return r.pack_rows(parts)
    return [record_gather(r, spans) for spans in parts]


def record_cat(records: Sequence[SiteRecord]) -> SiteRecord:
    """Token-major records concatenated along rows; all of one kind. (Sparse entries are in
    row order, so theirs concatenate as they are.)"""
    kinds = {type(r) for r in records}
    if len(kinds) != 1:
        raise ValueError(f"cannot concatenate records of kinds {sorted(k.__name__ for k in kinds)}")
    if isinstance(records[0], PackedSparse):
        return PackedSparse.unpack_cat(records).pack()
    if isinstance(records[0], SparseCodes):
        return SparseCodes.cat(records)
    return record_like(
        records[0], [torch.cat(ms) for ms in zip(*map(record_members, records), strict=True)]
    )


def record_nbytes(r: SiteRecord) -> int:
    return sum(m.numel() * m.element_size() for m in record_members(r))


def record_num_rows(r: SiteRecord) -> int:
    return record_members(r)[0].shape[0]


def record_to(
    r: SiteRecord, device: torch.device | str, *, non_blocking: bool = False
) -> SiteRecord:
    """The record on ``device``. From a CUDA device to the CPU with ``non_blocking``, the copy
    lands in pinned memory and is only queued: read it after the stream has been synchronized."""
    return record_like(r, [m.to(device, non_blocking=non_blocking) for m in record_members(r)])


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
    # The records are in host memory: the trainer moves them to its device when it uses them.
    # int32 [L_moe, T, top_k], -1 = no record; from the engine, a view of one block that
    # holds the routing of its generate call, token-major (so not contiguous).
    routing: torch.Tensor | None = None
    # (layer, site) -> record with leading dim T: NVFP4Tensor ("full"), CompactCodes or
    # PackedSparse; None for the FP4 layers compact guidance leaves out (the trainer rounds
    # those to nearest). From the engine, a `RowRecords`: full and compact records still in the
    # rows of bytes the generate call landed them in (shared by its completions, pinned when
    # made on a GPU), read when first used; `collate` gathers a batch's at once.
    guidance: GuidanceMap | None = None

    @property
    def num_fed_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids) - 1

    def fed_tokens(self) -> tuple[int, ...]:
        return (self.prompt_ids + self.completion_ids)[:-1]

    def guidance_nbytes(self) -> int:
        g = self.guidance or {}
        rows = g.row_nbytes() if isinstance(g, RowRecords) else 0  # without reading them
        others = g.others if isinstance(g, RowRecords) else g
        return rows + sum(record_nbytes(r) for r in others.values() if r is not None)

    def routing_nbytes(self) -> int:
        return 0 if self.routing is None else self.routing.numel() * self.routing.element_size()

    def detached(self) -> Completion:
        """This completion with records of its own. What the engine hands out shares its
        generate call's routing block and guidance rows with the call's other completions, so
        keeping one keeps them all; a detached copy (routing copied out, guidance a plain dict
        of its records, each a tensor of its own) keeps only its own bytes."""
        make, args = self.__reduce__()
        own = make(*args)
        if isinstance(own.guidance, RowRecords):
            make, args = own.guidance.__reduce__()
            own = dataclasses.replace(own, guidance=make(*args))
        return own

    def __reduce__(self):
        # An engine's routing record views the block of its whole generate call, and pickle
        # (and copy.deepcopy) would write that whole block with every completion: send its
        # own bytes instead. The guidance's rows do the same (`RowRecords.__reduce__`).
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.routing is not None:
            fields["routing"] = self.routing.clone(memory_format=torch.contiguous_format)
        return functools.partial(Completion, **fields), ()


def capture_totals(completions: Sequence[Completion]) -> dict[str, int]:
    """Bytes of the captured records over a batch of completions, and its generated tokens:
    ``{"routing": ..., "guidance": ..., "generated": ...}`` (sums: they add up across ranks)."""
    return {
        "routing": sum(c.routing_nbytes() for c in completions),
        "guidance": sum(c.guidance_nbytes() for c in completions),
        "generated": sum(len(c.completion_ids) for c in completions),
    }


def bytes_per_generated_token(totals: Mapping[str, int]) -> dict[str, float]:
    """``{"routing": ..., "guidance": ...}`` per generated token from `capture_totals` (prompt
    tokens' records included in the numerator); 0 when nothing was generated."""
    generated = totals["generated"]
    return {key: totals[key] / generated if generated else 0.0 for key in ("routing", "guidance")}


def capture_bytes_per_generated_token(completions: Sequence[Completion]) -> dict[str, float]:
    """What the captured records cost per generated token, over a batch of completions."""
    return bytes_per_generated_token(capture_totals(completions))


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainBatch:
    """Completions packed into one token stream for the trainer's forward.

    Each sequence is its completion's prompt followed by its completion minus the last token,
    in the order given to `collate`; a prompt shared by n samples appears n times (each
    sequence attends only to itself), with its records repeated, so every row is exact.
    """

    tokens_T: torch.Tensor  # long [T], CPU
    seq_lens: tuple[int, ...]  # fed tokens per sequence, summing to T
    rows_N: torch.Tensor  # long [N]: the stream row whose output scores target N
    targets_N: torch.Tensor  # long [N]: the completion token scored
    seq_index_N: torch.Tensor  # long [N]: which sequence (completion) each target belongs to
    # float32 [N]: the rollout's log-prob of each target under the raw logits (what the
    # trainer recomputes) and under the distribution it sampled from; None if not recorded.
    rollout_logprobs_N: torch.Tensor | None
    sampling_logprobs_N: torch.Tensor | None
    routing: torch.Tensor | None  # int32 [L_moe, T, k], on the CPU (`Completion`)
    # Records with leading dim T; sparse ones unpacked (SparseCodes), as the trainer reads them.
    guidance: dict[SiteKey, SiteRecord | None] | None
    prompt_index: tuple[int, ...]  # per sequence
    sample_index: tuple[int, ...]
    policy_version: tuple[int, ...]
    finish_reason: tuple[str, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_targets(self) -> int:
        return int(self.targets_N.shape[0])


def collate(completions: Sequence[Completion]) -> TrainBatch:
    """Pack completions, in order, into a `TrainBatch`; raises ValueError naming the completion
    (by prompt and sample index) whose records are inconsistent with the others or with its own
    length. Records stay where the rollout left them (host memory)."""
    if not completions:
        raise ValueError("collate needs at least one completion")
    for c in completions:
        _check_completion(c)
    tokens, rows, targets, seq_index, offset = [], [], [], [], 0
    for b, c in enumerate(completions):
        fed = c.fed_tokens()
        first = offset + len(c.prompt_ids) - 1
        tokens += fed
        rows += range(first, first + len(c.completion_ids))
        targets += c.completion_ids
        seq_index += [b] * len(c.completion_ids)
        offset += len(fed)

    def field_of(name: str):
        return tuple(getattr(c, name) for c in completions)

    return TrainBatch(
        tokens_T=torch.tensor(tokens, dtype=torch.long),
        seq_lens=tuple(c.num_fed_tokens for c in completions),
        rows_N=torch.tensor(rows, dtype=torch.long),
        targets_N=torch.tensor(targets, dtype=torch.long),
        seq_index_N=torch.tensor(seq_index, dtype=torch.long),
        rollout_logprobs_N=_cat_all(completions, "raw_logprobs"),
        sampling_logprobs_N=_cat_all(completions, "logprobs"),
        routing=_cat_routing(completions),
        guidance=_cat_guidance(completions),
        prompt_index=field_of("prompt_index"),
        sample_index=field_of("sample_index"),
        policy_version=field_of("policy_version"),
        finish_reason=field_of("finish_reason"),
    )


def _name(c: Completion) -> str:
    return f"completion (prompt {c.prompt_index}, sample {c.sample_index})"


def _check_completion(c: Completion) -> None:
    if not c.prompt_ids or not c.completion_ids:
        raise ValueError(
            f"{_name(c)} has {len(c.prompt_ids)} prompt and {len(c.completion_ids)} completion "
            "tokens; training needs at least one of each"
        )
    T = c.num_fed_tokens
    for name in ("logprobs", "raw_logprobs"):
        lp = getattr(c, name)
        if lp is not None and tuple(lp.shape) != (len(c.completion_ids),):
            raise ValueError(
                f"{_name(c)}: {name} has shape {tuple(lp.shape)}, expected "
                f"({len(c.completion_ids)},)"
            )
    if c.routing is not None and (c.routing.dim() != 3 or c.routing.shape[1] != T):
        raise ValueError(
            f"{_name(c)}: routing has shape {tuple(c.routing.shape)}, expected (L_moe, {T}, k)"
        )
    g = c.guidance or {}
    if isinstance(g, RowRecords) and g.plan.keys and g.num_rows != T:
        raise ValueError(
            f"{_name(c)}: guidance for {list(g.plan.keys)} has {g.num_rows} rows for {T} fed tokens"
        )
    for key, r in (g.others if isinstance(g, RowRecords) else g).items():
        if r is not None and record_num_rows(r) != T:
            raise ValueError(
                f"{_name(c)}: guidance for layers.{key[0]} site '{key[1]}' has "
                f"{record_num_rows(r)} rows for {T} fed tokens"
            )


def _present(completions: Sequence[Completion], name: str) -> bool:
    """Whether every completion carries the field; a mix is an error (half a batch unguided)."""
    have = [getattr(c, name) is not None for c in completions]
    if any(have) and not all(have):
        missing = next(c for c, h in zip(completions, have, strict=True) if not h)
        raise ValueError(f"{_name(missing)} has no {name} while others in the batch do")
    return all(have)


def _cat_all(completions: Sequence[Completion], name: str) -> torch.Tensor | None:
    if not _present(completions, name):
        return None
    return torch.cat([getattr(c, name).float().cpu() for c in completions])


def _cat_routing(completions: Sequence[Completion]) -> torch.Tensor | None:
    if not _present(completions, "routing"):
        return None
    shape = completions[0].routing.shape
    for c in completions:
        if (c.routing.shape[0], c.routing.shape[2]) != (shape[0], shape[2]):
            raise ValueError(
                f"{_name(c)}: routing has shape {tuple(c.routing.shape)}, others "
                f"({shape[0]}, T, {shape[2]})"
            )
    return torch.cat([c.routing for c in completions], dim=1)


def _cat_guidance(completions: Sequence[Completion]) -> dict[SiteKey, SiteRecord | None] | None:
    if not _present(completions, "guidance"):
        return None
    first = completions[0].guidance
    out = {}
    for c in completions:
        if c.guidance.keys() != first.keys():
            raise ValueError(
                f"{_name(c)}: guidance sites {sorted(c.guidance)} differ from "
                f"{_name(completions[0])}'s {sorted(first)}"
            )
    rowed = _gather_rows([c.guidance for c in completions])
    for key in first:
        if key in rowed:
            out[key] = rowed[key]
            continue
        records = [c.guidance[key] for c in completions]
        r = records[0]
        if r is None or any(x is None for x in records):
            if any(x is not None for x in records):
                raise ValueError(
                    f"guidance for layers.{key[0]} site '{key[1]}' is left to nearest rounding "
                    "in some completions of the batch and recorded in others"
                )
            out[key] = None
        elif all(isinstance(x, PackedSparse) for x in records):
            out[key] = _unpack_cat(completions, key)
        else:
            out[key] = record_cat(records)
    return out


def _gather_rows(guidance: list[GuidanceMap]) -> dict[SiteKey, SiteRecord]:
    """Key -> record of the whole batch, for the records every completion still holds in rows
    of one layout (`RowRecords`, from the engine): each member gathered once for the batch,
    straight out of the calls' rows, contiguous as `record_cat` makes it (not one gather and one
    view per completion and member, then a concatenation). Empty for any other batch."""
    plan = plan_of(guidance)
    return RowRecords.gather(guidance) if plan is not None and plan.keys else {}


def _unpack_cat(completions: Sequence[Completion], key: SiteKey) -> SparseCodes:
    """Packed sparse records of a batch, unpacked in one pass; a malformed one names its
    completion and site (found by unpacking them one by one)."""
    try:
        return PackedSparse.unpack_cat([c.guidance[key] for c in completions])
    except ValueError as err:
        for c in completions:
            try:
                c.guidance[key].unpack()
            except ValueError as own:
                raise ValueError(
                    f"{_name(c)}: guidance for layers.{key[0]} site '{key[1]}': {own}"
                ) from own
        raise ValueError(f"guidance for layers.{key[0]} site '{key[1]}': {err}") from err
