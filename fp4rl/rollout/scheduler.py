"""Continuous batching: which sequences feed which tokens in the next step.

Every step, each running sequence decodes one token; then, if nothing had to be preempted,
groups whose prefill is under way feed their next chunk, and waiting groups are admitted in
arrival order while the sequence limit, the token budget and the free blocks allow. A *group*
is a set of sequences with identical tokens that is prefilled once: its first sequence (the
leader) computes the K/V, the others fork from it (sharing the complete blocks, copying the
partial one after the step that completes the prefill). A group that does not fit entirely is
split: as many samples as fit are admitted now, the rest wait.

Chunked prefill (``engine.chunked_prefill``): a prompt longer than what is left of the step's
token budget is fed in chunks, one per step beside the decodes, as long as a chunk is at least
a block (or the whole rest); its blocks (and its samples' forks) are taken when it is admitted,
and its samples join the running sequences, and sample, in the step of its last chunk. Without
it a group waits until its whole prompt fits a step.

When a decoding sequence needs a block and none is free, the most recently admitted running
sequence is preempted: its blocks are freed and it goes back to the front of the queue as a
group of one, to be recomputed later from all its tokens (prompt and completion so far). The
oldest sequence therefore always progresses, and one sequence alone always fits
(`kv_cache.num_blocks_for_budget` guarantees it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fp4rl.rollout.block_manager import BlockManager
from fp4rl.rollout.config import EngineConfig
from fp4rl.rollout.sequence import Sequence


@dataclass(eq=False, slots=True)
class Group:
    seqs: list[Sequence]  # identical tokens; seqs[0] is prefilled, the others fork from it
    # Set when a step schedules the group: tokens its leader feeds, whether they end the
    # prefill (then the group's samples sample in that step).
    num_new: int = 0
    last: bool = True
    # Followers' partial prompt blocks, copied from the leader's after the last chunk.
    copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class Step:
    prefills: list[Group] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    # (src, dst) blocks to copy after the forward: forked samples' partial prompt blocks.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0
    num_prefill_tokens: int = 0  # counted when scheduled: sequences grow after the step

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + self.num_prefill_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config, self.blocks = config, blocks
        self.waiting: deque[Group] = deque()
        self.prefilling: deque[Group] = deque()  # admitted, prefill not finished (chunked)
        self.running: list[Sequence] = []  # in admission order

    def add(self, group: Group) -> None:
        self.waiting.append(group)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def schedule(self) -> Step:
        step = Step()
        # Victims come off the end of `running`, so the list shrinks behind the walk: by index,
        # no membership test per sequence (a quadratic walk at hundreds of sequences).
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if self._reserve_decode(seq, step):
                step.decodes.append(seq)
            i += 1
        if step.num_preempted == 0:
            budget = self.config.max_num_batched_tokens - len(step.decodes)
            budget = self._continue_prefills(step, budget)
            self._admit(step, budget)
        return step

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens a prefill with ``remaining`` tokens to go feeds this step (0: none)."""
        if remaining <= budget:
            return remaining
        if not self.config.chunked_prefill or budget < self.config.block_size:
            return 0
        return budget

    def _schedule_prefill(self, step: Step, group: Group, num_new: int) -> None:
        leader = group.seqs[0]
        group.num_new = num_new
        group.last = leader.num_cached + num_new == leader.num_tokens
        step.prefills.append(group)
        step.num_prefill_tokens += num_new
        if group.last:
            self.running.extend(group.seqs)
            step.block_copies += group.copies
            group.copies = []

    def _continue_prefills(self, step: Step, budget: int) -> int:
        while self.prefilling:
            group = self.prefilling[0]
            leader = group.seqs[0]
            num_new = self._chunk(leader.num_tokens - leader.num_cached, budget)
            if num_new == 0:
                break
            self._schedule_prefill(step, group, num_new)
            budget -= num_new
            if not group.last:
                break  # the budget is spent
            self.prefilling.popleft()
        return budget

    def _reserve_decode(self, seq: Sequence, step: Step) -> bool:
        """Make room for ``seq``'s next token, preempting newer sequences if needed."""
        need = self.blocks.blocks_for(seq.num_tokens) - len(seq.block_table)
        if need <= 0:  # the next token fits its last block
            return True
        while need > self.blocks.num_free_blocks:
            victim = self.running[-1]
            self.preempt(victim)
            step.num_preempted += 1
            if victim is seq:
                return False
        self.blocks.grow(seq.block_table, seq.num_tokens)
        return True

    def _admit(self, step: Step, budget: int) -> None:
        while self.waiting:
            group = self.waiting[0]
            num_tokens = group.seqs[0].num_tokens
            slots = (
                self.config.max_num_seqs
                - len(self.running)
                - sum(len(g.seqs) for g in self.prefilling)
            )
            num_new = self._chunk(num_tokens, budget)
            if num_new == 0 or slots == 0:
                return
            leader_cost = self.blocks.blocks_for(num_tokens)
            fork_cost = self.blocks.fork_cost(num_tokens)
            free = self.blocks.num_free_blocks
            if leader_cost > free:
                return
            k = min(len(group.seqs), slots)
            if fork_cost:
                k = min(k, 1 + (free - leader_cost) // fork_cost)
            admitted, rest = group.seqs[:k], group.seqs[k:]
            if rest:
                group.seqs = rest
            else:
                self.waiting.popleft()
            leader = admitted[0]
            leader.block_table = self.blocks.allocate(leader_cost)
            admitted_group = Group(admitted)
            for follower in admitted[1:]:
                follower.block_table, copy = self.blocks.fork(leader.block_table, num_tokens)
                if copy is not None:
                    admitted_group.copies.append(copy)
            self._schedule_prefill(step, admitted_group, num_new)
            budget -= num_new
            if not admitted_group.last:
                self.prefilling.append(admitted_group)
                return  # the budget is spent

    def commit(self, step: Step) -> None:
        """After the forward: every scheduled sequence has all its fed tokens cached."""
        for group in step.prefills:
            group.seqs[0].num_cached += group.num_new
            if group.last:
                for seq in group.seqs:
                    seq.num_cached = seq.num_tokens
        for seq in step.decodes:
            seq.num_cached = seq.num_tokens

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.num_cached = 0
        if seq.capture is not None:
            seq.capture.clear()
        self.waiting.appendleft(Group([seq]))

    def decode_step(self) -> Step | None:
        """The next step, when it is one decode of every running sequence that needs no
        preemption and leaves nothing to admit (no prefill under way, no free seat for a
        waiting group); its blocks are taken. None otherwise: `schedule` decides that step.
        A sequence's length counts a token sampled but not read back, so this step can be
        scheduled while the previous one is still on the device."""
        if not self.running or self.prefilling:
            return None
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            return None
        grow = [
            seq
            for seq in self.running
            if self.blocks.blocks_for(seq.num_tokens) > len(seq.block_table)
        ]
        if len(grow) > self.blocks.num_free_blocks:  # a decode needs one block at most
            return None
        for seq in grow:
            self.blocks.grow(seq.block_table, seq.num_tokens)
        return Step(decodes=list(self.running))

    def finish(self, seq: Sequence) -> None:
        """Retire ``seq`` and free its blocks (nothing for one retired already: a sequence may
        reach its length limit with a stop token)."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.block_table)
