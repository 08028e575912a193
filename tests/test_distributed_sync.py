"""What a sharded update communicates (`fp4rl.train.step.sharded_micro_batch`), counted in two
gloo processes: FSDP2's reduce-scatters and all-gathers per update, for each setting of
``run.gradient_sync`` and ``run.keep_gathered``, and the weights each setting trains, against one
process with the same micro-batches.

The two ranks run unequal shares (rank 0 two micro-batches, rank 1 one and a padding pass), so
the update's last micro-batch, where the gradients are reduce-scattered, is a padding pass on
rank 1. Each micro-batch is the same completions as in the single process, so every micro-batch's
BF16 gradient (a1, a2 on rank 0, b1 on rank 1) is the same tensor on both sides. One process sums
them into the FP32 master gradient as (a1 + a2) + b1. Reduced once per update, rank 0 sums
a1 + a2 in FP32 (FSDP2 upcasts the first unsharded gradient to its FP32 reduce dtype and adds
the next into it), rank 1 b1 + 0, and the reduce-scatter adds the two: the same FP32 additions
in the same order, so the FP32 masters after two updates are equal bit for bit; an unsharded
sum kept in BF16 would round a1 + a2 to 8 significant bits and differ. Reduced in every
micro-batch, the sum is (a1 + b1) + a2: the same terms in another order, which rounds apart
where they are not exactly representable together (a 1-ulp difference of a router gradient
here); the masters then agree to a small fraction of one Adam step.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny_models import qat_model, tiny_precision

from fp4rl import distributed
from fp4rl.records import Completion
from fp4rl.train.grpo import GrpoConfig
from fp4rl.train.optim import MasterAdamW, OptimConfig
from fp4rl.train.step import check_unsharded_fits, grpo_update

WORLD = 2
MICRO_BATCH = 2
NUM_UPDATES = 2
SHARES = (range(0, 4), range(4, 6))  # rank 0: micro-batches [0, 1], [2, 3]; rank 1: [4, 5], pad
SETTINGS = (("micro_batch", False), ("update", False), ("update", True))
OPTIM = OptimConfig(lr=1e-3)


def batch(update: int) -> tuple[list[Completion], list[float]]:
    """Six completions of random tokens with random sampling logprobs and advantages."""
    g = torch.Generator().manual_seed(update)
    completions, advantages = [], []
    for i in range(6):
        prompt = torch.randint(0, 128, (3 + i % 2,), generator=g).tolist()
        completion = torch.randint(0, 128, (2 + i % 3,), generator=g).tolist()
        completions.append(
            Completion(
                prompt_index=i // 2,
                sample_index=i % 2,
                prompt_ids=tuple(prompt),
                completion_ids=tuple(completion),
                finish_reason="length",
                policy_version=update,
                logprobs=-3 * torch.rand(len(completion), generator=g),
            )
        )
        advantages.append(float(torch.randn((), generator=g)))
    return completions, advantages


def update(policy, optimizer, completions, advantages, **kw) -> dict[str, float]:
    return grpo_update(
        policy, optimizer, completions, advantages, config=GrpoConfig(), replay=False,
        guided=False, temperature=1.0, micro_batch_seqs=MICRO_BATCH, **kw,
    )  # fmt: skip


def _first_of(*names: str) -> str:
    return next(name for name in names if hasattr(dist, name))


# What FSDP2's collectives call: the ``_single`` names from torch 2.13, the ``_tensor`` ones before.
REDUCE_SCATTER = _first_of("reduce_scatter_single", "reduce_scatter_tensor")
ALL_GATHER = _first_of("all_gather_single", "all_gather_into_tensor")
COUNTED = (REDUCE_SCATTER, ALL_GATHER)


@contextlib.contextmanager
def counting(counts: Counter):
    """Count the calls of `COUNTED` into ``counts`` (each still made)."""

    def counted(name: str):
        collective = getattr(dist, name)

        def call(*args, **kwargs):
            counts[name] += 1
            return collective(*args, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        for name in COUNTED:
            stack.enter_context(mock.patch.object(dist, name, counted(name)))
        yield


def worker(rank: int, store: str, out: str) -> None:
    """One rank: `train_each_setting`; rank 0 saves what it returns."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    ranks = None
    try:
        ranks = distributed.ranks_of_group("cpu")
        results = train_each_setting(ranks)
        if rank == 0:
            torch.save(results, out)
    finally:
        # The policies are gone with train_each_setting's frame: gloo's threads are joined
        # here, before the process exits.
        distributed.tear_down(ranks)


def train_each_setting(ranks: distributed.Ranks) -> dict:
    """For each setting, a fresh sharded tiny model trained by `NUM_UPDATES` updates of this
    rank's share, the collectives counted per update: the counts, metrics and the full FP32
    masters."""
    results = {}
    for gradient_sync, keep_gathered in SETTINGS:
        policy = qat_model(tiny_precision(), dtype=torch.bfloat16)
        distributed.shard_policy(policy, ranks, torch.bfloat16)
        optimizer = distributed.ShardedAdamW(policy.parameters(), OPTIM)
        per_update, metrics = [], []
        for step in range(NUM_UPDATES):
            completions, advantages = batch(step)
            mine = SHARES[ranks.rank]
            counts = Counter()
            with counting(counts):
                metrics.append(
                    update(
                        policy,
                        optimizer,
                        completions[mine.start : mine.stop],
                        advantages[mine.start : mine.stop],
                        across=ranks,
                        gradient_sync=gradient_sync,
                        keep_gathered=keep_gathered,
                    )  # fmt: skip
                )
            per_update.append(ranks.gather(dict(counts)))
        masters = {n: p.full_tensor() for n, p in policy.named_parameters()}
        results[gradient_sync, keep_gathered] = {
            "counts": per_update,
            "metrics": metrics,
            "masters": masters,
            "numel": sum(p.numel() for p in policy.parameters()),  # DTensor: the full shape
        }
    return results


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("sync")
    out = tmp / "results.pt"
    mp.spawn(worker, args=(str(tmp / "store"), str(out)), nprocs=WORLD, join=True)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def one_process() -> dict:
    policy = qat_model(tiny_precision(), dtype=torch.bfloat16)
    optimizer = MasterAdamW(policy.parameters(), OPTIM)
    metrics = [update(policy, optimizer, *batch(step)) for step in range(NUM_UPDATES)]
    names = [n for n, _ in policy.named_parameters()]
    return {"metrics": metrics, "masters": dict(zip(names, optimizer.masters, strict=True))}


def test_each_update_reduce_scatters_once_per_unit_unless_told_every_micro_batch(sharded):
    units = 1 + len(qat_model(tiny_precision()).layers)  # the root and every decoder layer
    micro_batches = len(SHARES[0]) // MICRO_BATCH  # on every rank: rank 1 pads to as many
    for (gradient_sync, keep_gathered), result in sharded.items():
        per_update = micro_batches if gradient_sync == "micro_batch" else 1
        for counts in result["counts"]:  # per update: each rank's counts
            for rank_counts in counts:
                setting = (gradient_sync, keep_gathered, rank_counts)
                assert rank_counts[REDUCE_SCATTER] == units * per_update, setting
                # A layer gathers for its forward and again for its backward, the root once
                # (it stays gathered from its forward to its backward); kept gathered, each
                # unit gathers once per update.
                gathers = units if keep_gathered else (2 * units - 1) * micro_batches
                assert rank_counts[ALL_GATHER] == gathers, setting


def test_every_setting_trains_the_one_process_weights(sharded, one_process):
    """FP32 masters after two updates: bit for bit when reduced once per update, within 1e-8
    (1e-5 of one Adam step of lr 1e-3) when reduced per micro-batch; loss and gradient norm to
    FP32 rounding of sums grouped by rank (and, for the norm, by shard)."""
    for setting, result in sharded.items():
        for got, want in zip(result["metrics"], one_process["metrics"], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-9), setting
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6), setting
            assert got["skipped"] == want["skipped"] == 0.0, setting
        assert result["masters"].keys() == one_process["masters"].keys()
        for name, want in one_process["masters"].items():
            got = result["masters"][name].detach()
            if setting[0] == "update":
                assert torch.equal(got, want), (setting, name)
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=1e-8, msg=f"{setting} {name}")


def test_an_update_that_cannot_hold_its_unsharded_gradient_is_refused_before_it_starts(sharded):
    policy = qat_model(tiny_precision(), dtype=torch.bfloat16)
    num = sum(p.numel() for p in policy.parameters())
    assert all(result["numel"] == num for result in sharded.values())  # counted whole, sharded
    for sync, keep, per_param in (
        ("update", False, 4),
        ("update", True, 6),
        ("micro_batch", True, 2),
    ):
        check_unsharded_fits(policy, sync=sync, keep=keep, free=per_param * num)
        with pytest.raises(ValueError, match=rf"run.gradient_sync='{sync}' with run.keep_gathered"):
            check_unsharded_fits(policy, sync=sync, keep=keep, free=per_param * num - 1)
    check_unsharded_fits(policy, sync="micro_batch", keep=False, free=0)  # nothing unsharded
