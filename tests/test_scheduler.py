"""The scheduler alone, with exact block ids and token counts: no model, no tensors."""

from bento_pagedllm.block_manager import BlockManager
from bento_pagedllm.config import SchedulerConfig
from bento_pagedllm.sampling_params import SamplingParams
from bento_pagedllm.scheduler import Scheduler
from bento_pagedllm.sequence import Request, TokenLogprob


def make_scheduler(num_blocks=64, block_size=4, budget=16, max_seqs=8, max_len=256):
    bm = BlockManager(num_blocks, block_size)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len)
    return Scheduler(config, bm, lambda request, index: index), bm


def add(scheduler, name, num_tokens, n=1):
    request = Request(name, None, list(range(num_tokens)), SamplingParams(n=n, max_tokens=100), rng_seed=0)
    scheduler.add_request(request)
    return request


def run_step(scheduler, token=5):
    """Schedule, pretend the model ran, append a sampled token to every sampled sequence."""
    plan = scheduler.schedule()
    scheduler.update_computed(plan)
    for row in plan.sampling_rows:
        scheduler.seqs_by_id[row.seq_id].append_token(TokenLogprob(token, 0.0))
    return plan


def test_chunked_prefill_spends_the_budget_and_samples_only_at_the_end():
    scheduler, _ = make_scheduler(budget=16)
    request = add(scheduler, "a", 40)
    chunks = []
    while True:
        plan = run_step(scheduler)
        chunks.append([len(s.token_ids) for s in plan.seqs])
        if plan.sampling_rows:
            break
    assert chunks == [[16], [16], [8]]
    assert request.seqs[0].num_output_tokens == 1
    plan = run_step(scheduler)
    assert [len(s.token_ids) for s in plan.seqs] == [1]  # then it decodes


def test_decodes_are_not_stalled_by_a_long_prompt():
    scheduler, _ = make_scheduler(budget=16)
    add(scheduler, "short", 4)
    run_step(scheduler)  # short prompt done, now decoding
    add(scheduler, "long", 100)
    for _ in range(5):
        plan = run_step(scheduler)
        sizes = {s.seq_id: len(s.token_ids) for s in plan.seqs}
        assert sorted(sizes.values()) == [1, 15]  # the decode runs every step, the prompt takes the rest


def test_preemption_takes_the_newest_and_recomputes_it_first():
    # 6 blocks of 4 tokens: two sequences of 10 tokens fit (3 blocks each); growth forces preemption
    scheduler, bm = make_scheduler(num_blocks=6, block_size=4, budget=64)
    old = add(scheduler, "old", 10).seqs[0]
    new = add(scheduler, "new", 10).seqs[0]
    for _ in range(3):
        run_step(scheduler)  # positions 0..11 computed: 3 blocks each, all 6 used
    assert bm.num_free_blocks == 0 and new.num_tokens == 13
    plan = run_step(scheduler)  # old writes position 12, a 4th block: new is preempted
    assert plan.num_preempted == 1
    assert [s.seq_id for s in plan.seqs] == [old.seq_id]
    assert new.num_computed_tokens == 0 and new.block_table == [] and new.num_tokens == 13
    assert list(scheduler.waiting) == [new]
    assert scheduler.num_preemptions_total == 1
    # when old finishes, new is recomputed from all its 13 tokens in one chunk and resumes sampling
    scheduler.finish_sequence(old, "stop")
    plan = run_step(scheduler)
    assert [(s.seq_id, len(s.token_ids), s.compute_logits) for s in plan.seqs] == [(new.seq_id, 13, True)]
    scheduler.finish_sequence(new, "stop")
    assert bm.num_free_blocks == 6


def test_a_sequence_that_cannot_fit_preempts_itself_without_deadlock():
    scheduler, bm = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a = add(scheduler, "a", 8).seqs[0]
    b = add(scheduler, "b", 8).seqs[0]
    steps = 0
    while (a.num_output_tokens < 6 or b.num_output_tokens < 6) and steps < 100:
        run_step(scheduler)
        steps += 1
        for seq in (a, b):
            if seq.num_output_tokens >= 6 and not seq.is_finished:
                scheduler.finish_sequence(seq, "length")
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert bm.num_free_blocks == 4


def test_fcfs_admission_and_seat_limit():
    scheduler, _ = make_scheduler(budget=64, max_seqs=2)
    reqs = [add(scheduler, f"r{i}", 4) for i in range(3)]
    plan = run_step(scheduler)
    assert [s.seq_id for s in plan.seqs] == [reqs[0].seqs[0].seq_id, reqs[1].seqs[0].seq_id]
    scheduler.finish_sequence(reqs[0].seqs[0], "stop")
    plan = run_step(scheduler)
    assert reqs[2].seqs[0].seq_id in [s.seq_id for s in plan.seqs]


def test_n_choices_fork_when_the_prompt_completes_and_share_its_blocks():
    scheduler, bm = make_scheduler(num_blocks=16, block_size=4, budget=64)
    request = add(scheduler, "r", 6, n=3)
    plan = run_step(scheduler)
    assert len(plan.seqs) == 1  # the prompt is computed once
    assert len(plan.sampling_rows) == 3 and {r.logits_index for r in plan.sampling_rows} == {0}
    assert len({r.rng_seed for r in plan.sampling_rows}) == 3
    parent, *children = request.seqs
    assert all(c.block_table == parent.block_table for c in children)
    assert bm.num_used_blocks == 2
    plan = run_step(scheduler)  # each writes position 6 in the shared partial block: two copies
    assert len(plan.block_copies) == 2 and len(plan.seqs) == 3
    assert bm.num_used_blocks == 4
    for seq in list(request.seqs):
        scheduler.finish_sequence(seq, "stop")
    assert bm.num_free_blocks == 16


def test_abort_of_waiting_and_running_frees_blocks():
    scheduler, bm = make_scheduler(budget=8)
    running = add(scheduler, "a", 20)
    run_step(scheduler)
    waiting = add(scheduler, "b", 4)
    scheduler.finish_request(running, "abort")
    scheduler.finish_request(waiting, "abort")
    assert bm.num_free_blocks == bm.num_blocks
    assert not scheduler.has_work()


def test_a_decode_step_lists_its_sequences_longest_context_first():
    """The decode attention kernel starts programs in row order (kernels/paged_decode.py): the longest
    contexts go first; mixed steps keep the running (arrival) order."""
    scheduler, _ = make_scheduler(budget=64)
    short, long, middle = (add(scheduler, name, n).seqs[0] for name, n in (("short", 3), ("long", 20), ("middle", 9)))
    plan = run_step(scheduler)  # the prompts: a mixed step, in arrival order
    assert [s.seq_id for s in plan.seqs] == [short.seq_id, long.seq_id, middle.seq_id]
    plan = run_step(scheduler)  # every sequence decodes: longest context first
    assert [s.seq_id for s in plan.seqs] == [long.seq_id, middle.seq_id, short.seq_id]
    assert [s.start_pos for s in plan.seqs] == [20, 9, 3]
    # the sampling rows follow the plan's rows, each pointing at its own sequence's logits row
    assert [(r.seq_id, r.logits_index) for r in plan.sampling_rows] == [
        (long.seq_id, 0), (middle.seq_id, 1), (short.seq_id, 2)]
    add(scheduler, "late", 5)
    plan = run_step(scheduler)  # a prompt joins the decodes: the running order again
    assert [s.seq_id for s in plan.seqs][:3] == [short.seq_id, long.seq_id, middle.seq_id]


def add_with_priority(scheduler, name, num_tokens, priority):
    request = Request(name, None, list(range(num_tokens)), SamplingParams(max_tokens=100), rng_seed=0,
                      priority=priority)
    scheduler.add_request(request)
    return request.seqs[0]


def test_priority_orders_admission_then_arrival():
    # one seat: each step admits the waiting sequence of the lowest priority value, the earliest among equals
    scheduler, _ = make_scheduler(max_seqs=1, budget=64)
    seqs = [add_with_priority(scheduler, name, 4, priority)
            for name, priority in [("a", 5), ("b", 1), ("c", 5), ("d", -2), ("e", 1)]]
    assert [s.request.request_id for s in scheduler.waiting] == ["d", "b", "e", "a", "c"]
    admitted = []
    for _ in seqs:
        plan = run_step(scheduler)
        (seq,) = [scheduler.seqs_by_id[s.seq_id] for s in plan.seqs]
        admitted.append(seq.request.request_id)
        scheduler.finish_sequence(seq, "stop")
    assert admitted == ["d", "b", "e", "a", "c"]


def test_preemption_takes_the_lowest_priority_not_the_newest():
    # as test_preemption_takes_the_newest_and_recomputes_it_first, but the older sequence has the higher
    # priority value: it gives way, and is admitted again before a later arrival of its own value
    scheduler, bm = make_scheduler(num_blocks=6, block_size=4, budget=64)
    low = add_with_priority(scheduler, "low", 10, priority=3)
    high = add_with_priority(scheduler, "high", 10, priority=0)
    run_step(scheduler)
    assert [s.request.request_id for s in scheduler.running] == ["high", "low"]
    for _ in range(2):
        run_step(scheduler)
    assert bm.num_free_blocks == 0
    later = add_with_priority(scheduler, "later", 4, priority=3)
    plan = run_step(scheduler)  # high writes position 12, a 4th block: low is preempted
    assert plan.num_preempted == 1
    assert [s.seq_id for s in plan.seqs] == [high.seq_id]
    assert low.num_computed_tokens == 0 and list(scheduler.waiting) == [low, later]
    scheduler.finish_sequence(high, "stop")
    plan = run_step(scheduler)
    assert [s.seq_id for s in plan.seqs][:1] == [low.seq_id]  # low first (then later, if it fits)
    for seq in (low, later):
        scheduler.finish_sequence(seq, "stop")
    assert bm.num_free_blocks == 6
