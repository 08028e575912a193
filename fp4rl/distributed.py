"""One run over several processes: torch.distributed, launched by torchrun, one rank per GPU.

Each rank holds a colocated engine (the whole packed policy) and a shard of the trainer:

- `launch` starts the process group torchrun describes (its ``RANK`` / ``WORLD_SIZE`` /
  ``LOCAL_RANK`` / ``MASTER_*`` variables; NCCL on GPUs, gloo on CPUs) and gives the `Ranks`;
  without them it gives None, and the run is the single-process one, unchanged. `tear_down`
  ends it, the backend's threads joined before the process exits.
- `Ranks`: this rank's share of a step's prompts (a prompt's samples stay on one rank), the
  reductions the loop's metrics need (sums and maxima by key), and running a piece of work on
  rank 0 alone (the run directory, checkpoints) with its outcome, or its error, told to every
  rank.
- `shard_policy` applies FSDP2 (``fully_shard``) per decoder layer and once more for the rest
  (embeddings, final norm, lm_head). The sharded parameters are FP32 and are the optimizer's
  masters; each forward gathers them in the policy's dtype (BF16), which is exactly the BF16
  parameter a single process holds (round to nearest even of the master). Gradients are
  reduce-scattered in FP32 and summed (never averaged: the loss is already normalized by the
  counts of the whole update, over all ranks) into the FP32 shard: once per update, or in
  every micro-batch, as `fp4rl.train.step.grpo_update` tells FSDP2 before each micro-batch
  (``run.gradient_sync``, ``run.keep_gathered``). QAT, router replay and guided rounding run
  unchanged inside the gathered layer.
- `ShardedAdamW`: `MasterAdamW`'s update over those shards (masters and moments sharded).
- `gathered_records`: the refit stream, each FSDP unit's full weights gathered once in the
  policy's dtype, handed to this rank's engine and freed before the next unit is gathered, so
  the whole unsharded model never sits on one device; `weights_of`, the trainer's refit stream
  in one process or sharded.
- `full_state_dict`: the policy's full weights, one tensor at a time, for rank 0's checkpoint.

Does not own the loop's order (`fp4rl.loop`), the checkpoint layout (`fp4rl.checkpoints`) or the
refit protocol (`fp4rl.refit`).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from fp4rl.refit import refit_records
from fp4rl.refit.protocol import EndOfStream, NamedTensor, Record
from fp4rl.train.optim import MasterAdamW, OptimConfig, adamw

# torchrun sets these for every process it starts; `launch` needs all of them.
ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, kw_only=True)
class Ranks:
    """This process's place in the run, and what the loop asks of all ranks together."""

    rank: int
    world_size: int
    device: torch.device  # where this rank computes: cuda:LOCAL_RANK, or the CPU
    mesh: DeviceMesh  # 1-D, every rank: FSDP's sharding

    @property
    def writer(self) -> bool:
        """Rank 0 writes the run directory, its metrics and its checkpoints."""
        return self.rank == 0

    def share(self, num: int, what: str = "rollout.prompts_per_step") -> range:
        """This rank's contiguous share of ``num`` items (the first ``num % world_size`` ranks
        take one more); ``what`` names the setting that counts them, for the error."""
        if num < self.world_size:
            raise ValueError(
                f"{what}={num} cannot be shared by {self.world_size} ranks: every rank needs at "
                "least one"
            )
        base, extra = divmod(num, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Each key summed over the ranks in rank order (absent on a rank: 0); sorted keys."""
        parts = self.gather({k: float(v) for k, v in values.items()})
        keys = sorted({k for part in parts for k in part})
        return {k: sum(part.get(k, 0.0) for part in parts) for k in keys}

    def max(self, values: dict[str, float]) -> dict[str, float]:
        """Each key's largest value over the ranks that hold it; sorted keys."""
        parts = self.gather({k: float(v) for k, v in values.items()})
        keys = sorted({k for part in parts for k in part})
        return {k: max(part[k] for part in parts if k in part) for k in keys}

    def broadcast(self, obj):
        """Rank 0's ``obj`` (picklable), on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_writer(self, work, *args, **kwargs):
        """``work(*args, **kwargs)`` on rank 0 alone; every rank returns its (picklable)
        result, or raises (rank 0 its own error, the others a RuntimeError naming it), so no
        rank waits on a collective that rank 0 will never reach."""
        result, error = None, None
        if self.writer:
            try:
                result = work(*args, **kwargs)
            except BaseException as err:
                error = err
        told = None if error is None else f"{type(error).__name__}: {error}"
        told, result = self.broadcast((told, result))
        if error is not None:
            raise error
        if told is not None:
            raise RuntimeError(f"rank 0 failed: {told}")
        return result

    def barrier(self) -> None:
        dist.barrier()


def from_environment() -> bool:
    """Whether this process was started by torchrun (or another launcher setting its variables)."""
    return all(key in os.environ for key in ENVIRONMENT)


@contextlib.contextmanager
def launch(device: str, *, timeout: timedelta = timedelta(minutes=30)):
    """The `Ranks` of a process torchrun started, the process group torn down on exit; None
    (and nothing started) without torchrun's environment. ``device`` is ``model.device``:
    "cuda" (or "auto" with CUDA present) takes GPU ``LOCAL_RANK`` and NCCL, "cpu" gloo."""
    if not from_environment():
        yield None
        return
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPUs: "
                "start at most that many processes per node (--nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    ranks = None
    try:
        ranks = ranks_of_group("cuda" if cuda else "cpu")
        yield ranks
    finally:
        tear_down(ranks)


def tear_down(ranks: Ranks | None) -> None:
    """Destroy the process groups and let their backends go now, which joins their threads,
    rather than at the interpreter's exit. ``ranks``: those of the group (None if `Ranks` were
    never made).

    `dist.destroy_process_group` forgets the groups, but the mesh still holds them (its
    ``_pg_registry``), and the mesh lives to the end of the process: DTensor's sharding and
    redistribution caches keep it. A gloo group then keeps its worker threads, and one may
    still be dropping the work of the last collective, whose tensors are Python objects: that
    takes the GIL, and a thread taking the GIL once the interpreter finalizes is ended inside
    the work's destructor (std::terminate: "terminate called without an active exception",
    SIGABRT on exit). Without the mesh's reference the backend is destroyed here, and its
    destructor waits for its queue and joins its threads (the GIL released). A sharded model
    the caller still holds keeps its groups (FSDP's state): drop it before."""
    dist.destroy_process_group()
    if ranks is not None:
        getattr(ranks.mesh, "_pg_registry", {}).clear()
    gc.collect()  # FSDP's state of a policy no longer used, in reference cycles, holds them too


def ranks_of_group(device_type: str) -> Ranks:
    """The `Ranks` of the default process group, already initialized (by `launch` or a test)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mesh = init_device_mesh(device_type, (world,))
    return Ranks(rank=rank, world_size=world, device=device, mesh=mesh)


def shard_policy(model, ranks: Ranks, dtype: torch.dtype, *, frozen: bool = False):
    """Shard the trainer's ``model`` (built on the CPU in ``dtype``) over ``ranks`` with FSDP2:
    one unit per decoder layer, one for the rest. Its parameters become FP32 shards on
    ``ranks.device`` (the masters); forwards gather them in ``dtype``. ``frozen``: a model
    that is never trained (the KL term's reference policy) keeps its parameters in ``dtype``,
    sharded as they are, and forwards gather those same values. Returns ``model``."""
    gathered = None if dtype == torch.float32 or frozen else dtype
    # cast_forward_inputs=False: the guidance records' FP32 global scales must stay FP32.
    policy = MixedPrecisionPolicy(
        param_dtype=gathered, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    units = [*model.layers, model]
    for unit in units:
        with torch.no_grad():
            for p in unit.parameters():
                if not frozen and not isinstance(p, DTensor) and p.dtype != torch.float32:
                    p.data = p.data.float()  # exact: every BF16 value is an FP32 value
        fully_shard(unit, mesh=ranks.mesh, mp_policy=policy)
    # The trainer calls hidden_states (then lm_head on the rows it scores), not forward.
    register_fsdp_forward_method(model, "hidden_states")
    gloo = dist.get_backend() == "gloo"
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # a sum over ranks, not a mean
        if gloo:  # gloo has no pre-multiplied sum; a plain sum is the same with a factor of 1
            unit.set_force_sum_reduction_for_comms(True)
    return model


def held_bytes(model) -> int:
    """Bytes of ``model``'s parameters this process holds: its shards' where FSDP2 shards it."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return sum(t.numel() * t.element_size() for t in local)


class ShardedAdamW(MasterAdamW):
    """`MasterAdamW` over FSDP2's FP32 shards: the sharded parameters are the masters (no copy),
    torch's AdamW keeps its moments beside them, sharded alike. FSDP2 sums the update's
    gradient into the shard's ``.grad`` in FP32 (unsharded until the update's reduce-scatter,
    or reduce-scattered micro-batch after micro-batch), so there is nothing to accumulate by
    hand and nothing to round back: the next forward gathers the masters in the policy's
    dtype. The gradient norm is over the whole model (every rank's shards)."""

    def __init__(self, params, config: OptimConfig) -> None:
        self.config = config
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ShardedAdamW got no parameters that require grad")
        bad = [tuple(p.shape) for p in self.params if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"ShardedAdamW needs FP32 shards (shard_policy); got others {bad[:3]}")
        self.masters = self.params
        self.optimizer = adamw(self.masters, config)
        self.num_updates = 0

    def accumulate(self) -> None:
        """Nothing: FSDP2 has already added the micro-batch's gradient, in FP32, to the
        unsharded sum or to each shard."""

    def clip(self, grads: list[torch.Tensor], max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=True)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def write_back(self) -> None:
        """Nothing: the masters are the parameters."""


def units(model) -> list[tuple[str, torch.nn.Module]]:
    """The FSDP units of ``model`` in refit order as ``(name prefix, unit)``: the root (whose
    own parameters are the embeddings, final norm and lm_head), then every decoder layer."""
    return [("", model), *((f"layers.{i}.", layer) for i, layer in enumerate(model.layers))]


@torch.no_grad()
def gathered_records(model, policy_version: int) -> Iterator[Record]:
    """The refit stream of a sharded policy (`fp4rl.refit.refit_records`' records and names):
    each unit's parameters gathered once in the policy's dtype, sent, then freed. Every rank
    must consume its stream to the end (the gathers are collective); a receiver that fails
    drains it, which keeps the ranks in step."""
    sent: list[str] = []
    for prefix, unit in units(model):
        unit.unshard()
        try:
            own = unit.named_parameters() if prefix else _root_parameters(model)
            for name, p in own:
                yield NamedTensor(prefix + name, p.detach())
                sent.append(prefix + name)
        finally:
            unit.reshard()
    yield EndOfStream(policy_version, tuple(sent))


def weights_of(policy, policy_version: int, ranks: Ranks | None) -> Iterator[Record]:
    """The refit stream of the trainer's weights: its parameters as they are in one process
    (``ranks`` None), gathered one FSDP unit at a time when sharded (`gathered_records`)."""
    if ranks is None:
        return refit_records(policy, policy_version=policy_version)
    return gathered_records(policy, policy_version)


def _root_parameters(model):
    return ((n, p) for n, p in model.named_parameters() if not n.startswith("layers."))


@torch.no_grad()
def full_state_dict(model, dtype: torch.dtype, ranks: Ranks) -> dict[str, torch.Tensor] | None:
    """The policy's full weights in ``dtype`` on rank 0's CPU (None elsewhere), gathered one
    tensor at a time (the FP32 master rounded to ``dtype``: the single process's parameter)."""
    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if ranks.writer:
            out[name] = full.to("cpu", dtype)
        del full
    return out if ranks.writer else None
