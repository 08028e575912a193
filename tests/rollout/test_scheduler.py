"""Scheduler: admission limits, group splitting and forking, decode growth, preemption order."""

import torch

from fp4rl.rollout.block_manager import BlockManager
from fp4rl.rollout.capture import SequenceCapture
from fp4rl.rollout.config import EngineConfig, SamplingParams
from fp4rl.rollout.sampler import Draws
from fp4rl.rollout.scheduler import Group, Scheduler
from fp4rl.rollout.sequence import Sequence


def seqs(prompt_len, n=1, first_id=0):
    return [
        Sequence(
            seq_id=first_id + j,
            prompt_index=first_id,
            sample_index=j,
            prompt_ids=list(range(prompt_len)),
            params=SamplingParams(),
            draws=Draws(torch.Generator()),
            stop_ids=frozenset(),
            capture=SequenceCapture(),
        )
        for j in range(n)
    ]


def scheduler(num_blocks, block_size=4, **config):
    config = {"max_model_len": 32, "max_num_batched_tokens": 64, "max_num_seqs": 8, **config}
    return Scheduler(
        EngineConfig(block_size=block_size, **config), BlockManager(num_blocks, block_size)
    )


def run_step(sched):
    """Schedule, pretend the forward ran, and append one token to every scheduled sequence."""
    step = sched.schedule()
    sched.commit(step)
    for s in [s for g in step.prefills for s in g.seqs] + step.decodes:
        s.append(1, 0.0, 0.0, max_model_len=10_000)
    return step


def test_group_prefills_once_and_forks_share_complete_blocks():
    sched = scheduler(num_blocks=16)
    group = seqs(prompt_len=10, n=3)
    sched.add(Group(group))
    step = run_step(sched)
    assert len(step.prefills) == 1 and step.prefills[0].seqs == group
    assert step.num_tokens == 10  # the prompt is fed once for three samples
    leader = group[0]
    assert [s.block_table[:2] for s in group] == [leader.block_table[:2]] * 3
    assert len({s.block_table[2] for s in group}) == 3
    assert step.block_copies == [(leader.block_table[2], s.block_table[2]) for s in group[1:]]
    assert sched.blocks.num_free_blocks == 16 - 3 - 2
    assert all(s.num_cached == 10 for s in group)
    # Next step: three one-token decodes, no new blocks (position 10 is in block 2).
    step = run_step(sched)
    assert step.decodes == group and step.num_tokens == 3
    assert sched.blocks.num_free_blocks == 11


def test_admission_respects_seq_limit_token_budget_and_order():
    sched = scheduler(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=40, max_model_len=32)
    a, b, c = seqs(20, n=2, first_id=0), seqs(15, first_id=10), seqs(5, first_id=20)
    for g in (a, b, c):
        sched.add(Group(g))
    step = run_step(sched)
    # a (2 samples, 20 tokens) fits; b (15 more) fits the 40-token budget; c does not fit the
    # 3-sequence limit and is not allowed to jump the queue.
    assert [g.seqs for g in step.prefills] == [a, b]
    step = run_step(sched)
    assert step.prefills == [] and step.decodes == a + b


def test_a_group_larger_than_the_free_seats_is_split():
    sched = scheduler(num_blocks=64, max_num_seqs=2)
    group = seqs(6, n=5)
    sched.add(Group(group))
    step = run_step(sched)
    assert step.prefills[0].seqs == group[:2]
    assert sched.waiting[0].seqs == group[2:]
    for s in group[:2]:  # finish them to free the seats
        sched.finish(s)
    step = run_step(sched)
    assert step.prefills[0].seqs == group[2:4]  # recomputed prefix: a new leader


def test_preemption_takes_the_newest_and_requeues_it_first():
    # 4 blocks of 4 tokens. Two sequences of 8 tokens use 2 blocks each; the first decode
    # needs a third block for position 8, so the newest sequence is preempted.
    sched = scheduler(num_blocks=4, max_model_len=16, max_num_batched_tokens=32)
    old, new = seqs(8, first_id=0)[0], seqs(8, first_id=1)[0]
    sched.add(Group([old]))
    sched.add(Group([new]))
    run_step(sched)
    assert sched.running == [old, new] and sched.blocks.num_free_blocks == 0
    new.capture.spans.append((0, 0, 1))  # rows of a step that preemption discards
    step = run_step(sched)
    assert step.num_preempted == 1 and step.decodes == [old] and step.prefills == []
    assert sched.running == [old] and sched.waiting[0].seqs == [new]
    assert new.block_table == [] and new.num_cached == 0 and new.capture.spans == []
    # The preempted sequence keeps its sampled token; it is recomputed with it later.
    assert new.completion_ids == [1] and new.num_tokens == 9
    sched.finish(old)
    step = run_step(sched)
    assert step.prefills[0].seqs == [new] and step.num_tokens == 9


def test_a_sequence_can_preempt_itself_when_it_is_the_newest():
    sched = scheduler(num_blocks=3, max_model_len=12, max_num_batched_tokens=32)
    old, new = seqs(4, first_id=0)[0], seqs(7, first_id=1)[0]
    sched.add(Group([old]))
    sched.add(Group([new]))
    run_step(sched)  # old: 1 block, new: 2 blocks, none free
    old.completion_ids += [1, 1, 1]  # old reaches 8 tokens: its next position needs a block
    step = sched.schedule()
    assert step.num_preempted == 1 and sched.running == [old]
    assert step.decodes == [old] and sched.waiting[0].seqs == [new]


def test_preempted_sequences_behind_the_walk_are_not_decoded():
    # Blocks of 4, 6 in all. Prompts of 8 tokens take 2 blocks (a, b), of 1 token 1 (c, d).
    # Each sampled a token in its prefill: a and b now decode position 8 and each need a third
    # block; a takes d's, b takes c's. c and d are not decoded and wait, the later victim
    # first.
    sched = scheduler(num_blocks=6, max_model_len=16, max_num_batched_tokens=32)
    a, b, c, d = (seqs(n, first_id=i)[0] for i, n in enumerate((8, 8, 1, 1)))
    for s in (a, b, c, d):
        sched.add(Group([s]))
    run_step(sched)
    assert sched.running == [a, b, c, d] and sched.blocks.num_free_blocks == 0
    step = run_step(sched)
    assert step.num_preempted == 2 and step.decodes == [a, b] and sched.running == [a, b]
    assert [g.seqs for g in sched.waiting] == [[c], [d]]
    assert c.block_table == [] and d.block_table == [] and len(a.block_table) == 3


def test_free_blocks_limit_how_many_samples_of_a_group_fork():
    # 10-token prompt: the leader takes 3 blocks, each fork 1 (its partial block); with 5 free
    # blocks, 3 samples fit and the fourth waits.
    sched = scheduler(num_blocks=5)
    group = seqs(10, n=4)
    sched.add(Group(group))
    step = sched.schedule()
    assert step.prefills[0].seqs == group[:3] and sched.waiting[0].seqs == group[3:]
    assert sched.blocks.num_free_blocks == 0


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_decodes():
    """Budget 12, blocks of 4: a running sequence decodes every step while a 21-token prompt
    with 3 samples feeds chunks of 11, then its last 10 tokens; its samples fork from the leader
    only then (the partial block copied after that step) and join the running sequences."""
    sched = scheduler(num_blocks=32, max_num_batched_tokens=12, max_model_len=32)
    (old,) = seqs(5, first_id=0)
    sched.add(Group([old]))
    step = sched.schedule()
    assert [g.num_new for g in step.prefills] == [5] and step.prefills[0].last
    sched.commit(step)
    old.append(1, 0.0, 0.0, max_model_len=10_000)

    group = seqs(21, n=3, first_id=1)
    sched.add(Group(list(group)))
    step = sched.schedule()
    assert step.decodes == [old]
    (chunk,) = step.prefills
    assert chunk.num_new == 11 and not chunk.last and step.num_prefill_tokens == 11
    assert not step.block_copies and group[1] not in sched.running
    assert len(group[0].block_table) == 6  # the whole prompt's blocks, taken at admission
    sched.commit(step)
    assert group[0].num_cached == 11 and group[1].num_cached == 0
    old.append(1, 0.0, 0.0, max_model_len=10_000)

    step = sched.schedule()
    (chunk,) = step.prefills
    assert chunk.num_new == 10 and chunk.last
    assert step.block_copies and len(step.block_copies) == 2  # block 5 holds tokens 20..
    assert all(s in sched.running for s in group)
    sched.commit(step)
    assert [s.num_cached for s in group] == [21, 21, 21]
    assert not sched.prefilling


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_a_step():
    sched = scheduler(num_blocks=32, max_num_batched_tokens=40, chunked_prefill=False)
    first, second = seqs(30, first_id=0), seqs(20, first_id=1)
    sched.add(Group(first))
    sched.add(Group(second))
    step = sched.schedule()
    assert [g.seqs for g in step.prefills] == [first]  # 20 more would exceed 40
    sched.commit(step)
    first[0].append(1, 0.0, 0.0, max_model_len=10_000)
    step = sched.schedule()
    assert [g.seqs for g in step.prefills] == [second] and step.prefills[0].last


def test_decode_step_only_when_every_running_sequence_just_decodes():
    """The step an engine may launch before reading the previous one's tokens: every running
    sequence's decode, its blocks taken, and None where `schedule` must decide (a prefill under
    way, a seat for a waiting group, a block short)."""
    sched = scheduler(num_blocks=8, max_num_seqs=2)
    first, second, third = seqs(7, first_id=0), seqs(3, first_id=1), seqs(3, first_id=2)
    assert sched.decode_step() is None  # nothing runs
    sched.add(Group(first))
    run_step(sched)
    sched.add(Group(second))
    assert sched.decode_step() is None  # a seat is free for the waiting group
    run_step(sched)
    sched.add(Group(third))
    first[0].completion_ids.append(-1)  # a token sampled and not read back: 9 tokens
    step = sched.decode_step()  # both seats taken: the waiting group must wait anyway
    assert step is not None and step.decodes == first + second and not step.prefills
    assert len(first[0].block_table) == 3  # position 8 opens a third block of 4
    assert sched.blocks.num_free_blocks == 8 - 3 - 1
    sched.commit(step)
    for s in step.decodes:
        s.completion_ids.append(-1)
    sched.blocks.allocate(sched.blocks.num_free_blocks)  # no block left for position 12
    first[0].completion_ids += [-1, -1]
    assert sched.decode_step() is None  # it would have to preempt: `schedule` decides
