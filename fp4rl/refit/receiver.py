"""The engine's side of a refit: apply a stream of named tensors in place, or fail closed.

`RefitReceiver(engine).receive(records)` marks the engine invalid, then takes the records as
they arrive. Each tensor is checked before it is used: a name the engine's model takes (fp4rl's
or the hub's, through `fp4rl.model.checkpoint.hf_to_fp4rl_names`), not seen before in this
refit, of the right shape and a floating dtype (`fp4rl.model.weights.check_weight`). BF16
modules are copied into the model's parameters; routed experts of FP4 layers are quantized once
a layer's ``w13`` and ``w2`` are both there (one launch per tensor, one global scale per expert
for W1+W3 and one for W2: `PackedExperts.quantized`) and copied into the packed storage already
held (`PackedExperts.install`). Hub per-expert pieces of a packed layer are assembled in one
layer-sized staging tensor first; those of a BF16 layer go straight to their parameter. Storage
addresses never change, so CUDA graphs captured against them stay valid.

Finiteness is read where the values land, in the dtype the engine holds: an ``aminmax`` of each
copied parameter, and the NaN global scale that the NVFP4 recipe gives any expert holding a
non-finite value. The flags stay on the device and are read once, at the end of the stream, so
a refit costs one host synchronization rather than one per tensor.

The end-of-stream record must carry a policy version above the engine's and an inventory equal
to the names that arrived, and every weight of the model must have arrived. Only then does the
engine take the new version and become valid again. Any failure (the sender's exception, an
``Abort``, a bad tensor, a lost peer) leaves the engine invalid with the reason, and the rest of
the stream is read and dropped, so a sender is never left blocked. This module does not own the
transport (`transport`) or the engine's loop (`fp4rl.rollout.engine`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

import torch

from fp4rl.model.checkpoint import Slot, hf_to_fp4rl_names, non_finite
from fp4rl.model.experts import PackedExperts
from fp4rl.model.weights import check_weight, weight_specs
from fp4rl.refit.protocol import Abort, EndOfStream, NamedTensor, Record, RefitError

_MAX_LISTED = 20  # names per error message


class RefitReceiver:
    """Applies refit streams to ``engine`` (a `fp4rl.rollout.Engine`), in place."""

    def __init__(self, engine) -> None:
        self.engine = engine
        model = engine.model
        self.specs = weight_specs(model)
        self.hub = hf_to_fp4rl_names(model.config)
        self.num_pieces = Counter(slot.name for slot in self.hub.values())
        self.params = dict(model.named_parameters())
        self.packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedExperts)}
        self.device = model.embed_tokens.weight.device

    def receive(self, records: Iterable[Record]) -> int:
        """Apply one refit stream; return the engine's new policy version.

        Raises `RefitError` naming the tensor or record at fault; the engine then stays invalid
        (`Engine.generate` raises) until a later refit succeeds.
        """
        engine, start = self.engine, self.engine.policy_version
        engine.invalid = f"a refit from policy version {start} is in progress"
        stream = iter(records)
        try:
            version = _Refit(self).run(stream, start)
        except Exception as err:
            reason = str(err) if isinstance(err, RefitError) else f"{type(err).__name__}: {err}"
            engine.invalid = f"the refit from policy version {start} failed: {reason}"
            _drain(stream)
            if isinstance(err, RefitError):
                raise
            raise RefitError(reason) from err
        engine.policy_version, engine.invalid = version, None
        return version


def _drain(stream: Iterator[Record]) -> None:
    """Read the rest of a failed stream, dropping it, so the sender finishes its sends."""
    try:
        for record in stream:
            if isinstance(record, EndOfStream | Abort):
                return
    except Exception:  # the stream broke too; the refit has already failed
        pass


class _Refit:
    """The state of one refit: what arrived, what waits to be quantized, the finite flags."""

    def __init__(self, receiver: RefitReceiver) -> None:
        self.r = receiver
        self.seen: set[str] = set()
        self.whole: set[str] = set()  # fp4rl names that arrived as one tensor
        self.pieces: Counter[str] = Counter()  # fp4rl name -> hub pieces arrived
        self.staging: dict[str, torch.Tensor] = {}  # packed w13/w2 being assembled from pieces
        self.waiting: dict[str, dict[str, torch.Tensor]] = {}  # packed module -> w13 / w2
        self.finite: list[tuple[str, torch.Tensor]] = []  # (fp4rl name, bool on the device)

    @torch.no_grad()
    def run(self, stream: Iterator[Record], start: int) -> int:
        last = "none"
        while True:
            try:
                record = next(stream)
            except StopIteration:
                raise RefitError(
                    f"the stream ended without an end-of-stream record after {len(self.seen)} "
                    f"tensors (last: {last})"
                ) from None
            except Exception as err:
                raise RefitError(
                    f"the sender failed after {len(self.seen)} tensors (last: {last}): "
                    f"{type(err).__name__}: {err}"
                ) from err
            if isinstance(record, NamedTensor):
                self.add(record.name, record.tensor)
                last = record.name
            elif isinstance(record, EndOfStream):
                return self.finish(record, start)
            elif isinstance(record, Abort):
                raise RefitError(
                    f"the sender aborted after {len(self.seen)} tensors (last: {last}): "
                    f"{record.reason}"
                )
            else:
                raise RefitError(f"not a refit record: {type(record).__name__}")

    def add(self, name: str, tensor: torch.Tensor) -> None:
        r = self.r
        if name in self.seen:
            raise RefitError(f"{name}: duplicate: already received in this refit")
        self.seen.add(name)
        slot = Slot(name) if name in r.specs else r.hub.get(name)
        if slot is None:
            raise RefitError(f"{name}: unknown name: the engine's model takes no such tensor")
        target, spec = slot.name, r.specs[slot.name]
        problem = check_weight(name, tensor, slot.shape(spec.shape))
        if problem:
            raise RefitError(problem)
        if target in self.whole or (slot.expert is None and self.pieces[target]):
            raise RefitError(f"{name}: duplicate: {target} already received in this refit")
        if slot.expert is None:
            self.whole.add(target)
        else:
            self.pieces[target] += 1
        complete = slot.expert is None or self.pieces[target] == r.num_pieces[target]
        if not spec.packed:
            param = r.params[target]
            (param[slot.index] if slot.index else param).copy_(tensor)
            if complete and param.numel():  # one flag per parameter, read at the end
                self.finite.append((target, torch.isfinite(torch.stack(param.aminmax())).all()))
            return
        if slot.expert is not None:  # a hub piece of a packed layer: assemble it first
            if target not in self.staging:
                self.staging[target] = torch.empty(spec.shape, dtype=spec.dtype, device=r.device)
            self.staging[target][slot.index].copy_(tensor)
            if not complete:
                return
            tensor = self.staging.pop(target)
        module, _, leaf = target.rpartition(".")
        waiting = self.waiting.setdefault(module, {})
        waiting[leaf] = tensor
        if len(waiting) == 2:
            self.quantize(module, waiting.pop("w13"), waiting.pop("w2"), spec.dtype)
            del self.waiting[module]

    def quantize(self, module: str, w13: torch.Tensor, w2: torch.Tensor, dtype) -> None:
        experts = self.r.packed[module]
        device = self.r.device
        # Quantized from the values the engine would hold, as `load_weights` does.
        w13, w2 = w13.to(device, dtype), w2.to(device, dtype)
        experts.install(*experts.quantized(w13, w2), dtype)
        for leaf, t in (("w13", experts.w13_packed), ("w2", experts.w2_packed)):
            self.finite.append((f"{module}.{leaf}", ~t.global_scale.isnan().any()))

    def finish(self, end: EndOfStream, start: int) -> int:
        version = end.policy_version
        if not isinstance(version, int) or isinstance(version, bool) or version <= start:
            raise RefitError(
                f"policy version {version!r} of the end-of-stream record does not advance past "
                f"the engine's {start}"
            )
        inventory = set(end.inventory)
        lost, unlisted = sorted(inventory - self.seen), sorted(self.seen - inventory)
        if lost:
            raise RefitError(
                f"the sender's inventory lists tensors that never arrived: {_list(lost)}"
            )
        if unlisted:
            raise RefitError(
                f"tensors arrived that the sender's inventory lacks: {_list(unlisted)}"
            )
        missing = [
            f"{name} ({self.pieces[name]} of {self.r.num_pieces[name]} pieces)"
            if self.pieces[name]
            else name
            for name in self.r.specs
            if name not in self.whole and self.pieces[name] < max(self.r.num_pieces[name], 1)
        ]
        if missing:
            raise RefitError(f"missing at the end of the stream: {_list(missing)}")
        if self.finite:
            ok = torch.stack([flag for _, flag in self.finite]).cpu()  # the one host sync
            bad = [
                name for (name, _), good in zip(self.finite, ok.tolist(), strict=True) if not good
            ]
            if bad:
                raise RefitError(f"non-finite weights: {'; '.join(self.describe(bad))}")
        return version

    def describe(self, names: list[str]) -> list[str]:
        """Each non-finite weight named as the loader names it (routed experts: which ones)."""
        lines = []
        for name in dict.fromkeys(names):
            if name in self.r.params:
                lines += non_finite({name: self.r.params[name]})
            else:
                module, _, leaf = name.rpartition(".")
                scale = getattr(self.r.packed[module], f"{leaf}_packed").global_scale
                experts = scale.flatten(1).isnan().any(1).nonzero().flatten().tolist()
                lines.append(f"{name}: non-finite values in experts {experts}")
        return lines


def _list(names: list[str]) -> str:
    more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return str(names[:_MAX_LISTED]) + more
