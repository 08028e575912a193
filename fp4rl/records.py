"""What crosses the rollout -> trainer seam: `Completion`, site records, and the packed batch.

Both sides import this module and it imports neither (only the NVFP4 containers), so a trainer
never needs the engine package and the engine never needs the trainer's. `collate` packs
completions into one `TrainBatch`: the token stream the trainer feeds, which rows it scores,
the rollout's logprobs aligned to those rows, and the routing and guidance of the whole stream.
`RowLayout` lays token-major records out as rows of bytes, one per token, so that the engine
moves a step's records as one buffer and cuts each sequence's out of the rows of a call.

Token alignment: a completion's model was fed ``T = len(prompt_ids) + len(completion_ids) - 1``
tokens (the last sampled token never is). Row ``t`` of its routing record and of each guidance
record belongs to fed token ``t``, the input whose output predicted token ``t + 1``; so the
row that scores ``completion_ids[i]`` is ``len(prompt_ids) - 1 + i``.

Legend: T fed tokens (all sequences packed), N scored tokens, L_moe MoE layers, k experts per
token, B sequences.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fp4rl.fp4 import CompactCodes, NVFP4Tensor, SparseCodes
from fp4rl.fp4.sparse_guidance import PackedSparse

SiteKey = tuple[int, str]  # (decoder layer, site): "expert_input", "expert_hidden", "k", "v"
# Full codes or compact mantissa bits, each with the rollout's scales; or sparse near-boundary
# bits with the row maxima the scales follow from, as the engine cuts and the trainer reads them
# (SparseCodes) or as a completion carries them (PackedSparse: `record_pack`, `record_unpack`).
SiteRecord = NVFP4Tensor | CompactCodes | SparseCodes | PackedSparse
# A None value means "round this site to nearest" on purpose (compact guidance leaves out the
# earlier FP4 layers); a missing key is an error.
GuidanceMap = Mapping[SiteKey, SiteRecord | None]


def _members(r: SiteRecord) -> tuple[torch.Tensor, ...]:
    """The record's tensors in field order, the first with one row per token (sparse entries
    and packed streams have not)."""
    if isinstance(r, NVFP4Tensor | SparseCodes | PackedSparse):
        return r.tensors()
    return r.mantissa_bits, r.block_scale, r.global_scale


def _rebuild(r: SiteRecord, members) -> SiteRecord:
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
    return _rebuild(r, [m[start:end] for m in _members(r)])


def record_gather(r: SiteRecord, spans: Sequence[tuple[int, int]]) -> SiteRecord:
    """The rows of ``spans`` (``[start, end)`` ranges, in order) of a token-major record, as
    one record: one gather per member (sparse records: a slice per span, then one concat)."""
    if isinstance(r, PackedSparse):
        return record_gather(r.unpack(), spans).pack()
    if isinstance(r, SparseCodes):
        return SparseCodes.cat([r.rows(a, b) for a, b in spans])
    rows = [i for a, b in spans for i in range(a, b)]
    index = torch.tensor(rows, dtype=torch.long).to(_members(r)[0].device, non_blocking=True)
    return _rebuild(r, [m[index] for m in _members(r)])


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
    return _rebuild(records[0], [torch.cat(ms) for ms in zip(*map(_members, records), strict=True)])


def record_nbytes(r: SiteRecord) -> int:
    return sum(m.numel() * m.element_size() for m in _members(r))


def record_num_rows(r: SiteRecord) -> int:
    return _members(r)[0].shape[0]


def record_to(
    r: SiteRecord, device: torch.device | str, *, non_blocking: bool = False
) -> SiteRecord:
    """The record on ``device``. From a CUDA device to the CPU with ``non_blocking``, the copy
    lands in pinned memory and is only queued: read it after the stream has been synchronized."""
    return _rebuild(r, [m.to(device, non_blocking=non_blocking) for m in _members(r)])


_ALIGN = 16  # bytes: every piece of a host buffer starts at a multiple of any element size


def to_host_together(items: Sequence[torch.Tensor | SiteRecord]) -> list[torch.Tensor | SiteRecord]:
    """``items`` (tensors and records, all on one device) copied to the CPU through one byte
    buffer: their bytes concatenated on the device (one concatenation, each piece padded to 16
    bytes), one copy to pinned memory queued on the current stream, and each tensor handed back
    as a view of that buffer. A step's records thus cost two operations instead of one per
    tensor. The copy is only queued: read the results after the stream has been synchronized.
    (From the CPU the buffer is a plain one and the copy immediate.)"""
    parts = [[t] if isinstance(t, torch.Tensor) else list(_members(t)) for t in items]
    flat = [t for tensors in parts for t in tensors]
    if not flat:
        return list(items)
    device = flat[0].device
    pad = torch.empty(_ALIGN, dtype=torch.uint8, device=device)  # never read
    pieces, offsets, offset = [], [], 0
    for t in flat:
        data = t.contiguous().reshape(-1).view(torch.uint8)
        pieces.append(data)
        offsets.append(offset)
        offset += data.numel()
        if offset % _ALIGN:
            pieces.append(pad[: _ALIGN - offset % _ALIGN])
            offset += _ALIGN - offset % _ALIGN
    host = torch.empty(offset, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.copy_(torch.cat(pieces), non_blocking=True)
    views = iter(
        host[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        for t, start in zip(flat, offsets, strict=True)
    )
    out = []
    for item, tensors in zip(items, parts, strict=True):
        mine = [next(views) for _ in tensors]
        out.append(mine[0] if isinstance(item, torch.Tensor) else _rebuild(item, mine))
    return out


# The token-major record kinds `RowLayout` lays out: every member has one row per token.
_ROW_KINDS = (torch.Tensor, NVFP4Tensor, CompactCodes)


@dataclass(frozen=True, slots=True)
class RowLayout:
    """Where each member of some token-major items (tensors and records, each under a key) lies
    in one row of bytes: ``members[i]`` holds ``(offset, dtype, shape)`` per member of item
    ``i``, its bytes of one token at ``offset`` (16-aligned) of a ``row_bytes`` row, ``shape``
    the member's shape without its leading token dim. A step's items pack into one uint8 buffer
    of ``[tokens, row_bytes]`` (`pack`), so that any prefix of its rows is the records of those
    tokens and one copy moves them; the layout does not depend on the number of tokens, only
    on the keys, kinds, dtypes and per-token shapes, and is made once for each (`of`)."""

    keys: tuple
    kinds: tuple[type, ...]  # torch.Tensor or the record's class, per item
    members: tuple[tuple[tuple[int, torch.dtype, tuple[int, ...]], ...], ...]
    row_bytes: int

    @staticmethod
    def of(keys: Sequence, items: Sequence[torch.Tensor | SiteRecord]) -> RowLayout:
        """The layout of ``items`` (the same for any number of tokens): computed on its first
        use, then cached. Raises ValueError naming the key of an item that is not token-major."""
        signature = []
        for key, item in zip(keys, items, strict=True):
            if not isinstance(item, _ROW_KINDS):
                raise ValueError(f"{key!r}: a {type(item).__name__} has no fixed bytes per token")
            kind = torch.Tensor if isinstance(item, torch.Tensor) else type(item)
            signature.append((key, kind, tuple((m.dtype, m.shape[1:]) for m in _tensors(item))))
        return _row_layout(tuple(signature))

    def pack(self, items: Sequence[torch.Tensor | SiteRecord]) -> torch.Tensor:
        """uint8 ``[tokens, row_bytes]`` on the items' device: their bytes, token by token, by
        one concatenation (the bytes that align each member are junk, and never read). Raises
        ValueError naming the key of an item that does not fit the layout."""
        if len(items) != len(self.keys) or not items:
            raise ValueError(f"{len(items)} items for a layout of keys {self.keys}")
        flat = [
            (key, m) for key, item in zip(self.keys, items, strict=True) for m in _tensors(item)
        ]
        rows = flat[0][1].shape[0]
        pad = torch.empty(rows, _ALIGN, dtype=torch.uint8, device=flat[0][1].device)
        pieces, end = [], 0
        for (key, m), (offset, dtype, shape) in zip(flat, _flat(self.members), strict=True):
            if (m.shape[0], m.shape[1:], m.dtype) != (rows, shape, dtype):
                raise ValueError(
                    f"{key!r}: a member of {m.dtype} {tuple(m.shape)} in a layout of {dtype} "
                    f"{(rows, *shape)}"
                )
            if offset > end:
                pieces.append(pad[:, : offset - end])
            piece = m.reshape(rows, math.prod(shape)).view(torch.uint8)
            pieces.append(piece)
            end = offset + piece.shape[1]
        if self.row_bytes > end:
            pieces.append(pad[:, : self.row_bytes - end])
        return torch.cat(pieces, dim=1)

    def column(self, rows: torch.Tensor, item: int, member: int) -> torch.Tensor:
        """The bytes of one member in packed ``rows``: a uint8 ``[tokens, nbytes]`` view."""
        offset, dtype, shape = self.members[item][member]
        return rows[:, offset : offset + math.prod(shape) * dtype.itemsize]

    def gather(self, rows: torch.Tensor, indices: Sequence[torch.Tensor], keys=None) -> list[dict]:
        """For each index tensor, key -> item over those rows of packed ``rows``, for ``keys``
        (all by default): one gather per member and index, each a contiguous tensor of its own
        (a completion's records share no storage with another's)."""
        chosen = [i for i, key in enumerate(self.keys) if keys is None or key in keys]
        # Per chosen item, per member: its bytes' column of ``rows``, dtype and shape per row.
        plan = [
            [
                (self.column(rows, i, j), dt, shape)
                for j, (_, dt, shape) in enumerate(self.members[i])
            ]
            for i in chosen
        ]
        out = []
        for index in indices:
            n = index.shape[0]
            out.append({
                self.keys[i]: _assemble(self.kinds[i], [
                    column.index_select(0, index).view(dtype).view(n, *shape)
                    for column, dtype, shape in members
                ])
                for i, members in zip(chosen, plan, strict=True)
            })  # fmt: skip
        return out

    def unpack(self, rows: torch.Tensor) -> dict:
        """Key -> item as views of packed ``rows`` (no copy)."""
        n = rows.shape[0]
        return {
            key: _assemble(
                kind,
                [
                    self.column(rows, i, j).view(dtype).view(n, *shape)
                    for j, (_, dtype, shape) in enumerate(self.members[i])
                ],
            )
            for i, (key, kind) in enumerate(zip(self.keys, self.kinds, strict=True))
        }


def _assemble(kind: type, members: list[torch.Tensor]) -> torch.Tensor | SiteRecord:
    return members[0] if kind is torch.Tensor else kind(*members)


def _tensors(item: torch.Tensor | SiteRecord) -> tuple[torch.Tensor, ...]:
    return (item,) if isinstance(item, torch.Tensor) else _members(item)


def _flat(members):
    return [m for item in members for m in item]


@functools.lru_cache(maxsize=256)
def _row_layout(signature: tuple) -> RowLayout:
    keys, kinds, members, offset = [], [], [], 0
    for key, kind, specs in signature:
        placed = []
        for dtype, shape in specs:
            placed.append((offset, dtype, tuple(shape)))
            offset += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        keys.append(key)
        kinds.append(kind)
        members.append(tuple(placed))
    return RowLayout(tuple(keys), tuple(kinds), tuple(members), offset)


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
    # The records are in host memory (pageable; each completion owns its own): the trainer moves
    # them to its device when it uses them.
    routing: torch.Tensor | None = None  # int32 [L_moe, T, top_k], -1 = no record
    # (layer, site) -> record with leading dim T: NVFP4Tensor ("full"), CompactCodes or
    # PackedSparse; None for the FP4 layers compact guidance leaves out (the trainer rounds
    # those to nearest).
    guidance: dict[SiteKey, SiteRecord | None] | None = None

    @property
    def num_fed_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids) - 1

    def fed_tokens(self) -> tuple[int, ...]:
        return (self.prompt_ids + self.completion_ids)[:-1]

    def guidance_nbytes(self) -> int:
        return sum(record_nbytes(r) for r in (self.guidance or {}).values() if r is not None)

    def routing_nbytes(self) -> int:
        return 0 if self.routing is None else self.routing.numel() * self.routing.element_size()


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
    for key, r in (c.guidance or {}).items():
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
    for key, r in first.items():
        records = [c.guidance[key] for c in completions]
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
