"""The scheduler: which sequences run this step and how many of their tokens (continuous batching).

There are no prefill and decode phases. Each sequence has `num_tokens` and `num_computed_tokens`; each
step spends a token budget (`max_num_batched_tokens`) so that computed catches up with total, oldest
requests first (FCFS; under the priority policy, the lowest `priority` value first, then the oldest). A
long prompt therefore spreads over several steps (chunked prefill) while the running decodes keep going.
When the KV pool runs dry the last running sequence in that order (the newest, of the highest priority
value) is preempted: its blocks are freed and it is recomputed later from its tokens (which it keeps).
The result is a frozen `StepPlan`, the only thing the model runner reads.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from .block_manager import BlockManager
from .config import SchedulerConfig
from .sampling_params import SamplingParams
from .sequence import PENDING_TOKEN, Request, Sequence, SequenceStatus


class ScheduledSequence(NamedTuple):
    """Tokens of one sequence to compute this step: positions start_pos .. start_pos + len(token_ids).

    NOTE: under async scheduling the last token may be PENDING_TOKEN: sampled by the previous step and
    still on the device, where the model runner takes it from.
    NOTE: a NamedTuple, not a frozen dataclass: as immutable, and a step builds one per sequence (a
    frozen dataclass took ~0.8 us more each, ~0.4 ms of host time in a 500-sequence step).
    """

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    compute_logits: bool


class SamplingRow(NamedTuple):
    """One token to sample, from row `logits_index` of the step's logits (one row per sequence whose
    `compute_logits` is set, in plan order). A NamedTuple as ScheduledSequence is.

    NOTE: after a fork several rows share one `logits_index`: the n choices of a prompt sample from the
    prompt's one set of logits, each with its own random stream.
    """

    seq_id: int
    logits_index: int
    params: SamplingParams
    rng_seed: int
    output_position: int
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    # the sequence's grammar matcher (structured outputs), or None. NOTE: the engine advances it as it
    # reads tokens, and reads every step that samples the sequence before planning the next, so at
    # sampling time it stands where the row's tokens end
    grammar: object = None
    bad_words: tuple[tuple[int, ...], ...] = ()  # Request.bad_words (with the output tokens, which they follow)
    allowed_mask: object = None  # Request.allowed_mask: a torch.Tensor, or None


class PromptScoreRows(NamedTuple):
    """Prompt tokens to score this step (`SamplingParams.prompt_logprobs`): the logits of the scheduled
    sequence's tokens `offset .. offset + len(targets) - 1` of this step (positions `first_position ..`)
    give the log-probabilities of `targets`, the prompt tokens after each, with the top `num_top`."""

    seq_id: int
    offset: int  # into the sequence's tokens of this step
    first_position: int
    targets: tuple[int, ...]
    num_top: int


@dataclass(frozen=True)
class StepPlan:
    seqs: tuple[ScheduledSequence, ...]
    sampling_rows: tuple[SamplingRow, ...]
    block_copies: tuple[tuple[int, int], ...]
    num_batched_tokens: int
    num_preempted: int
    prompt_score_rows: tuple[PromptScoreRows, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, rng_seed_for_child) -> None:
        self.config = config
        self.block_manager = block_manager
        # NOTE: both kept sorted by Sequence.sort_key (priority, then arrival): the waiting queue is admitted
        # from its front, and the running list's last sequence is the one preempted
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._rng_seed_for_child = rng_seed_for_child
        self.seqs_by_id: dict[int, Sequence] = {}  # every unfinished sequence
        self.num_preemptions_total = 0

    # ---- queue changes -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        seq = request.seqs[0]
        self.seqs_by_id[seq.seq_id] = seq
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Into the waiting queue at its sort key's place: at the back unless a priority puts it earlier
        (or it is a preempted sequence, older than the arrivals behind it)."""
        if not self.waiting or self.waiting[-1].sort_key <= seq.sort_key:
            self.waiting.append(seq)
        else:
            self.waiting.insert(bisect.bisect_left([s.sort_key for s in self.waiting], seq.sort_key), seq)

    def finish_sequence(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """NOTE: every way a sequence ends (finished, stopped, aborted, failed) comes through here."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        del self.seqs_by_id[seq.seq_id]
        seq.num_pending = 0  # tokens sampled after the end are dropped
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def finish_request(self, request: Request, reason: str) -> None:
        for seq in request.seqs:
            self.finish_sequence(seq, reason)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        copies: list[tuple[int, int]] = []
        num_preempted = 0

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if self._ends_with_pending_token(seq):
                index += 1
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            seq_copies, preempted = self._allocate_or_preempt(seq, num_new)
            num_preempted += preempted
            if seq_copies is None:
                break  # `seq` itself was preempted; everything after it already was too
            copies += seq_copies
            scheduled.append((seq, num_new))
            budget -= num_new
            index += 1

        # NOTE: no admissions in a step that had to preempt: memory is short, and the preempted sequences
        # (older, or of a higher priority, than any waiting behind them) go first.
        while self.waiting and budget > 0 and num_preempted == 0 and self._has_seat_for(self.waiting[0]):
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted while a step was in flight: its tokens must be known to recompute them
            # cached blocks of its prefix count as computed; NOTE: not for prompt tokens still to be scored,
            # whose logits only a computation gives (vLLM's rule too)
            cached = 0 if seq.request.needs_prompt_logprobs else self.block_manager.match_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            seq_copies = self.block_manager.allocate_slots(seq, num_new)
            if seq_copies is None:
                self.block_manager.free(seq)  # NOTE: a waiting sequence holds no blocks
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.request.times.first_scheduled is None:
                seq.request.times.first_scheduled = time.monotonic()
                seq.request.times.cached_prompt_tokens = cached
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            copies += seq_copies
            scheduled.append((seq, num_new))
            budget -= num_new

        return self._build_plan(longest_context_first(scheduled), copies, num_preempted)

    def _ends_with_pending_token(self, seq: Sequence) -> bool:
        """Its pending token is its last one (max_tokens or the context length reached): nothing to
        compute; the sequence finishes when the token is read."""
        if not seq.num_pending:
            return False
        max_tokens = seq.request.params.max_tokens
        return (max_tokens is not None and seq.num_output_tokens >= max_tokens) or (
            seq.num_tokens >= self.config.max_model_len
        )

    def _has_seat_for(self, seq: Sequence) -> bool:
        seats = 1 if seq.request.is_forked else seq.request.params.n
        return len(self.running) + seats <= self.config.max_num_seqs

    def _allocate_or_preempt(self, seq: Sequence, num_new: int) -> tuple[list | None, int]:
        """Allocate for `seq`, preempting the last running sequences (the newest of the lowest priority)
        until it fits."""
        num_preempted = 0
        while True:
            seq_copies = self.block_manager.allocate_slots(seq, num_new)
            if seq_copies is not None:
                return seq_copies, num_preempted
            victim = self.running[-1]
            self._preempt(victim)
            num_preempted += 1
            if victim is seq:
                return None, num_preempted

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV blocks, keep the tokens, requeue by sort key (ahead of the
        newer arrivals of its priority)."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self._enqueue(seq)

    def _build_plan(self, scheduled, copies, num_preempted) -> StepPlan:
        seqs: list[ScheduledSequence] = []
        rows: list[SamplingRow] = []
        forked: list[Sequence] = []
        scores: list[PromptScoreRows] = []
        num_logit_rows = 0
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            completes = start + num_new == seq.num_tokens
            known = seq.token_ids[start : start + num_new]
            if seq.request.needs_prompt_logprobs:
                score = _prompt_score_rows(seq, start, num_new)
                if score is not None:
                    scores.append(score)
            seqs.append(
                ScheduledSequence(
                    seq_id=seq.seq_id,
                    token_ids=tuple(known) + (PENDING_TOKEN,) * (num_new - len(known)),
                    start_pos=start,
                    block_table=tuple(seq.block_table),
                    compute_logits=completes,
                )
            )
            if not completes:
                continue
            family = [seq]
            if not seq.request.is_forked:
                family += self._fork(seq, start + num_new)
                forked += family[1:]
            rows += [_sampling_row(member, num_logit_rows) for member in family]
            num_logit_rows += 1
        for child in forked:
            bisect.insort(self.running, child, key=lambda s: s.sort_key)
        return StepPlan(
            seqs=tuple(seqs),
            sampling_rows=tuple(rows),
            block_copies=tuple(copies),
            num_batched_tokens=sum(len(s.token_ids) for s in seqs),
            num_preempted=num_preempted,
            prompt_score_rows=tuple(scores),
        )

    def _fork(self, parent: Sequence, num_computed_after_step: int) -> list[Sequence]:
        """Create choices 1..n-1 of a request whose prompt completes this step; they share its blocks."""
        request = parent.request
        children = []
        for index in range(1, request.params.n):
            child = parent.fork(index, self._rng_seed_for_child(request, index))
            child.status = SequenceStatus.RUNNING
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = num_computed_after_step  # computed by the parent's step
            request.seqs.append(child)
            self.seqs_by_id[child.seq_id] = child
            children.append(child)
        return children

    def update_computed(self, plan: StepPlan) -> None:
        """Once the step is launched: its tokens are in the cache for every later step (the device runs
        steps in order), and each sampling row's sequence awaits one token."""
        for scheduled in plan.seqs:
            seq = self.seqs_by_id[scheduled.seq_id]
            seq.num_computed_tokens += len(scheduled.token_ids)
            self.block_manager.cache_full_blocks(seq)
        for row in plan.sampling_rows:
            self.seqs_by_id[row.seq_id].num_pending += 1


def longest_context_first(scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
    """A decode step (one new token each) lists its sequences longest context first; other steps keep
    the running order.

    Why: the decode attention kernel starts its programs in the batch's order (kernels/paged_decode.py),
    and ragged contexts (tens to a thousand tokens in one step) then end with the shortest programs, not
    with a long one started last. NOTE: nothing else depends on a step's row order: sampling rows and
    pending inputs are found by sequence id.
    """
    if not all(num_new == 1 for _, num_new in scheduled):
        return scheduled
    return sorted(scheduled, key=lambda entry: -entry[0].num_computed_tokens)  # NOTE: stable: ties keep order


def _prompt_score_rows(seq: Sequence, start: int, num_new: int) -> PromptScoreRows | None:
    """The rows scoring prompt tokens among positions start .. start + num_new - 1 not scored yet (the last
    prompt position's logits are the first sampling row's, not a prompt token's score)."""
    request = seq.request
    first = max(start, request.prompt_positions_scored)
    end = min(start + num_new, request.num_prompt_tokens - 1)
    if first >= end:
        return None
    request.prompt_positions_scored = end
    return PromptScoreRows(seq.seq_id, first - start, first, tuple(request.prompt_token_ids[first + 1 : end + 1]),
                           request.params.prompt_logprobs)


def _sampling_row(seq: Sequence, logits_index: int) -> SamplingRow:
    params, bad_words = seq.request.params, seq.request.bad_words
    penalties = params.uses_penalties
    return SamplingRow(
        seq_id=seq.seq_id,
        logits_index=logits_index,
        params=params,
        rng_seed=seq.rng_seed,
        output_position=seq.num_output_tokens,
        prompt_token_ids=tuple(seq.token_ids[: seq.num_prompt_tokens]) if penalties else (),
        output_token_ids=tuple(seq.output_token_ids) if penalties or bad_words else (),
        grammar=seq.grammar,
        bad_words=bad_words,
        allowed_mask=seq.request.allowed_mask,
    )
