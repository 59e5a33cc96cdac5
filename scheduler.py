"""
scheduler.py -- continuous batching: which sequences run this step, and how many tokens each.

The lesson: decode is memory-bound. Each step reads every weight once, so a decode matmul over
B sequences does 2*B FLOPs per weight read (arithmetic intensity ~ B): batching is the most
important serving optimization. But requests arrive at different times and want different
lengths; "static" batching (run a group to completion, then the next) leaves seats empty
while the longest one finishes. Continuous batching schedules ONE step at a time:

    every step:  finished sequences leave, waiting ones join at once,
                 and the tokens of all running sequences form one flat batch.

Selective batching makes that possible: the MLPs and norms work on a flat [N, D] tensor
whatever sequence each token belongs to; only attention is per sequence, over its own paged
KV cache (cache.py, kernels.py).

Place in the data flow: step 1 of LLM.step (engine.py): schedule() picks the step's work,
reserving each sequence's KV blocks; the engine runs the model, samples, and hands finished
sequences back through finish(). No model, no sampler here: sequences and blocks only.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from cache import BlockManager
from sequence import FINISHED, RUNNING, WAITING, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int              # first position fed this step (= num_computed before the step)
    count: int              # tokens fed: a prefill chunk, 1, or 1 + len(drafts)

    @property
    def tokens(self) -> list[int]:
        """The token ids fed: a prefill chunk, or the last sampled token (+ drafts to verify)."""
        return (self.seq.token_ids[self.start:] + self.seq.draft_tokens)[:self.count]


class Scheduler:
    """FCFS waiting queue + running list, one token budget per step (_schedule_once). When the
    pool runs short, the NEWEST running sequence gives its blocks back: the oldest finishes."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()      # FCFS; a preempted one rejoins at the front
        self.running: list[Sequence] = []            # oldest first: the last one is preempted first
        self.num_preemptions = 0
        self.release_hooks = []                  # called with a sequence whose blocks were freed

    def _seats(self, seq):
        """Seats a sequence takes: a request with n > 1 forks when its prompt is done."""
        return seq.params.n if len(seq.request.seqs) == 1 and seq.params.n > 1 else 1

    def _fit(self, seq, start: int, count: int) -> int:
        """How many of `count` tokens from `start` the pool can take now (no shared blocks)."""
        table, bs = self.bm.tables[seq.seq_id], self.bm.block_size
        return max(0, min(count, len(table) * bs - start + self.bm.num_free_blocks * bs))

    def preempt(self, seq: Sequence):
        """Preemption by recompute: drop the cache, keep the tokens, requeue first. The sequence
        leaves `running`, its blocks are freed (BlockManager.free) and every release_hooks(seq)
        is called (the drafter drops its draft cache); num_computed = 0, status WAITING, its
        drafts dropped; request.metrics.preemptions and self.num_preemptions count it; it goes to
        the FRONT of `waiting` (it arrived before everything still waiting)."""
        # assignment: scheduler-step
        self.running.remove(seq)
        self.bm.free(seq.seq_id)
        for hook in self.release_hooks:
            hook(seq)
        seq.num_computed = 0                 # its tokens stay; their K/V are recomputed
        seq.status, seq.draft_tokens = WAITING, []
        seq.request.metrics.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        # end assignment

    def schedule(self) -> list[ScheduledSeq]:
        """This step's work: _schedule_once's. If it schedules nothing while a running sequence
        still has tokens to feed, every running sequence is waiting for blocks: preempt the
        NEWEST running sequence and try again (at most len(running) + 1 times; a running sequence
        with nothing to feed, remaining == 0, waits for its last token and is not stuck)."""
        # assignment: scheduler-step
        for _ in range(len(self.running) + 1):
            out = self._schedule_once()
            # (a running sequence with nothing to feed waits for its last token: not stuck)
            if out or not any(seq.remaining for seq in self.running):
                return out
            self.preempt(self.running[-1])      # stuck: every running sequence waits for blocks
        return []
        # end assignment

    def _schedule_once(self) -> list[ScheduledSeq]:
        """One pass within the token budget (max_num_batched_tokens) and the seats (max_num_seqs),
        each sequence at most once, each with its blocks reserved (BlockManager.reserve), in three
        phases: (1) _decodes, (2) _prefills, (3) _admit. Returns the ScheduledSeq of each, in that
        order."""
        # assignment: scheduler-step
        # The token budget bounds one forward pass: decode tokens are cheap (memory-bound), prefill
        # tokens are compute; chunked prompts keep each step short, so no decode stalls behind one.
        out: list[ScheduledSeq] = []            # (1), then (2) and (3) with the budget each left
        self._admit(out, self._prefills(out, self._decodes(out, self.max_num_batched_tokens)))
        return out
        # end assignment

    def _decodes(self, out: list, budget: int) -> int:
        """(1) every decoding sequence (remaining == 1), oldest first: 1 + len(draft_tokens) tokens;
        drafts that do not fit the budget left are dropped (1 token); while the pool cannot hold
        its slots, the NEWEST running sequence is preempted (itself, if it is the newest). Each is
        appended to `out`; returns the budget left."""
        # assignment: scheduler-step
        for seq in [s for s in self.running if s.remaining == 1]:
            if seq.status != RUNNING:            # preempted below as a victim
                continue
            count = 1 + len(seq.draft_tokens)
            if count > budget:                   # no room to verify: drop the drafts
                seq.draft_tokens, seq.draft_probs = [], None
                count = 1
                if budget == 0:
                    break
            while not self.bm.can_append(seq.seq_id, seq.num_computed, count):
                victim = self.running[-1]        # the newest sequence gives its blocks back
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status != RUNNING:
                continue
            self.bm.reserve(seq.seq_id, seq.num_computed, count)
            out.append(ScheduledSeq(seq, seq.num_computed, count))
            budget -= count
        return budget
        # end assignment

    def _prefills(self, out: list, budget: int) -> int:
        """(2) every other running sequence (a prompt being prefilled, not in `out` yet): a chunk
        of what fits the budget and the free blocks (_fit), none if nothing fits. Appended to
        `out`; returns the budget left."""
        # assignment: scheduler-step
        scheduled = {item.seq for item in out}
        for seq in [s for s in self.running if s not in scheduled]:
            count = self._fit(seq, seq.num_computed, min(seq.remaining, budget))
            if count == 0:
                continue
            self.bm.reserve(seq.seq_id, seq.num_computed, count)
            out.append(ScheduledSeq(seq, seq.num_computed, count))
            budget -= count
        return budget
        # end assignment

    def _admit(self, out: list, budget: int) -> None:
        """(3) waiting sequences in arrival order, never skipping one: admitted while the budget
        lasts and the seats hold it (a prompt of n > 1 samples takes n seats: _seats; count the
        seats of every running sequence the same way), its blocks allocated with the prefix cache
        (BlockManager.allocate; use_prefix_cache=False while its request still scores its prompt:
        prompt_logprobs), then a chunk that fits (_fit; nothing fits: free its blocks and stop
        admitting). An admitted sequence becomes RUNNING, num_computed = the cached tokens; its
        request's metrics get first_scheduled_time and cached_tokens on its first admission only.
        Each is appended to `out`."""
        # assignment: scheduler-step
        # A seat is a sequence now or soon: a running prompt of n > 1 holds n (its samples fork
        # when it is done).
        seats = sum(self._seats(s) for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seats + self._seats(seq) > self.max_num_seqs:
                break
            # prefix cache hits, but not for a prompt still to score (prompt_logprobs)
            cached = self.bm.allocate(seq.seq_id, seq.token_ids,
                                      use_prefix_cache=seq.request.num_scored == seq.num_prompt)
            count = self._fit(seq, cached, min(len(seq.token_ids) - cached, budget))
            if count == 0:
                self.bm.free(seq.seq_id)                             # no room yet: try next step
                break
            self.waiting.popleft()
            seq.status, seq.num_computed = RUNNING, cached
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = time.perf_counter()
                seq.request.metrics.cached_tokens = cached
            self.running.append(seq)
            seats += self._seats(seq)
            self.bm.reserve(seq.seq_id, cached, count)
            out.append(ScheduledSeq(seq, cached, count))
            budget -= count
        # end assignment

    def fork(self, seq: Sequence, num_computed: int, tokenizer) -> list[Sequence]:
        """n > 1: when the prompt is done, add n - 1 sequences sharing its blocks. Runs after the
        parent's slots were reserved, before the forward pass: the children share what it fills."""
        req, children = seq.request, []
        while len(req.seqs) < req.params.n:
            child = Sequence(req, seq.token_ids, len(req.seqs), tokenizer)
            child.status, child.num_computed = RUNNING, num_computed
            self.bm.fork(seq.seq_id, child.seq_id)               # ref counts up, nothing copied
            req.seqs.append(child)
            self.running.append(child)
            children.append(child)
        return children

    def finish(self, seq: Sequence):
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self.bm.tables:
            self.bm.free(seq.seq_id)
        for hook in self.release_hooks:
            hook(seq)
        seq.status = FINISHED
