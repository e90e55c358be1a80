"""Prefix caching: exact block accounting through reuse, eviction, preemption and abort, and outputs
identical with and without it."""

import random

import pytest

from bento_pagedllm import LLM, SamplingParams
from bento_pagedllm.block_manager import BlockManager
from bento_pagedllm.config import SchedulerConfig
from bento_pagedllm.sampling_params import SamplingParams as Params
from bento_pagedllm.scheduler import Scheduler
from bento_pagedllm.sequence import Request, TokenLogprob


def seq_of(tokens, cache_salt=None):
    return Request("r", None, list(tokens), Params(), rng_seed=0, cache_salt=cache_salt).seqs[0]


def compute(bm, seq):
    """Allocate and 'compute' every token of the sequence, then name its full blocks."""
    assert bm.allocate_slots(seq, seq.num_uncomputed_tokens) is not None
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def check_invariants(bm: BlockManager, live_seqs=()):
    counts = [0] * bm.num_blocks
    for seq in live_seqs:
        for block in seq.block_table:
            counts[block] += 1
    assert counts == bm.ref_counts
    assert bm.num_free_blocks == sum(1 for c in counts if c == 0)
    assert len(set(bm._cached.values())) == len(bm._cached)  # one block per name
    for name, block in bm._cached.items():
        assert bm._name_of[block] == name


def test_reuse_of_the_longest_named_prefix():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = seq_of(range(14))  # 3 full blocks + 2 tokens
    compute(bm, a)
    assert bm.num_cached_blocks == 3
    b = seq_of(list(range(8)) + [99, 98, 97, 96, 95])  # shares a's first 2 blocks only
    assert bm.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2] and b.num_computed_tokens == 8
    assert [bm.ref_counts[x] for x in b.block_table] == [2, 2]
    compute(bm, b)
    check_invariants(bm, [a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 4  # a's 3 + b's own third block
    check_invariants(bm)


def test_a_salted_prefix_is_shared_only_with_the_same_salt():
    """vLLM's cache_salt: the same prompt under another salt (or none) finds nothing cached."""
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    owners = [seq_of(range(14), salt) for salt in (None, "tenant-a")]
    for seq in owners:
        compute(bm, seq)
    assert bm.num_cached_blocks == 6  # two sets of 3 names for the same tokens
    for salt, block_table in ((None, owners[0].block_table), ("tenant-a", owners[1].block_table)):
        again = seq_of(range(14), salt)
        assert bm.match_prefix(again) == 12 and again.block_table == block_table[:3]
        bm.free(again)
    stranger = seq_of(range(14), "tenant-b")
    assert bm.match_prefix(stranger) == 0 and stranger.block_table == []
    for seq in owners:
        bm.free(seq)
    check_invariants(bm)


def test_block_names_are_sha256_chains():
    """A block's name is SHA-256 over its prefix's name and its token ids: no crafted prompt collides with
    another's blocks (Python's `hash` of a tuple is not collision-resistant)."""
    import hashlib
    import struct

    from bento_pagedllm.block_manager import empty_prefix_name

    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    for salt, root in ((None, b""), ("t\ud800", empty_prefix_name("t\ud800"))):  # any string: lone surrogates too
        seq = seq_of(range(9), salt)
        compute(bm, seq)
        first = hashlib.sha256(root + struct.pack("<4q", 0, 1, 2, 3)).digest()
        assert seq.block_hashes == [first, hashlib.sha256(first + struct.pack("<4q", 4, 5, 6, 7)).digest()]
        bm.free(seq)
    assert len(root) == 32 and bm.num_cached_blocks == 4
    check_invariants(bm)


def test_the_last_token_is_always_computed():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq_of(range(8))
    compute(bm, a)
    bm.free(a)
    again = seq_of(range(8))  # exactly two full blocks: only the first may be reused
    assert bm.match_prefix(again) == 4


def test_eviction_only_when_needed_and_least_recently_freed_first():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    old, new = seq_of(range(100, 108)), seq_of(range(200, 208))
    compute(bm, old)
    bm.free(old)
    compute(bm, new)
    bm.free(new)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6
    filler = seq_of(range(300, 312))  # 3 blocks: the 2 never-used blocks, then the least recently freed
    assert bm.allocate_slots(filler, 12) == []
    assert bm.num_cached_blocks == 3
    assert bm.match_prefix(seq_of(range(200, 209))) == 8  # new's prefix survived whole
    # old's blocks were freed first, its tail before its head: the tail went, the head survives
    assert bm.match_prefix(seq_of(range(100, 109))) == 4


def test_disabled_caching_never_matches():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(12))
    compute(bm, a)
    bm.free(a)
    assert bm.match_prefix(seq_of(range(12))) == 0 and bm.num_cached_blocks == 0


def test_counts_stay_exact_through_random_reuse_preemption_and_abort():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=24, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16, max_model_len=96), bm,
                          lambda request, index: index)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    requests, preempted = [], 0
    for step in range(400):
        if rng.random() < 0.5 and len(requests) < 60:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
            request = Request(f"r{step}", None, tokens, Params(n=rng.choice([1, 1, 2]), max_tokens=40), rng_seed=0)
            scheduler.add_request(request)
            requests.append(request)
        plan = scheduler.schedule()
        preempted += plan.num_preempted
        scheduler.update_computed(plan)
        for row in plan.sampling_rows:
            seq = scheduler.seqs_by_id[row.seq_id]
            seq.append_token(TokenLogprob(rng.randrange(1000), 0.0))
            if seq.num_output_tokens >= 30 or seq.num_tokens >= 96:
                scheduler.finish_sequence(seq, "length")
        if requests and rng.random() < 0.05:
            scheduler.finish_request(rng.choice(requests), "abort")
        live = [s for s in scheduler.seqs_by_id.values()]
        check_invariants(bm, live)
    for request in requests:
        scheduler.finish_request(request, "abort")
    check_invariants(bm)
    assert bm.num_free_blocks == bm.num_blocks
    assert preempted > 0 and bm.prefix_hit_tokens > 0


@pytest.fixture(scope="module")
def llms(tiny_llama3_dir):
    kwargs = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=1024, max_num_batched_tokens=128)
    # NOTE: the cached engine schedules asynchronously, so block naming also meets pending tokens
    return (LLM(tiny_llama3_dir, async_scheduling=True, **kwargs),
            LLM(tiny_llama3_dir, enable_prefix_caching=False, **kwargs))


def test_outputs_identical_with_and_without_prefix_caching(llms):
    cached, plain = llms
    system = "You are a careful assistant. " * 20
    prompts = [system + question for question in ("Hi", "What is 2+2?", "Name a colour.", "Tell me a joke.")]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    first = cached.generate(prompts, params)  # all four arrive together: the later ones may share blocks
    second = cached.generate(prompts, params)  # now every prompt's prefix is cached
    reference = plain.generate(prompts, params)
    hits = cached.engine.block_manager.prefix_hit_tokens
    assert hits >= 4 * (len(cached.tokenizer(system).input_ids) // 16 - 1) * 16
    assert plain.engine.block_manager.prefix_hit_tokens == 0
    for a, b, c in zip(first, second, reference):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        for x, y in zip(b.outputs[0].logprobs, c.outputs[0].logprobs):
            assert abs(x.logprob - y.logprob) < 1e-4
    for llm in llms:
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_a_cached_prefix_gives_the_first_token_sooner(tiny_llama3_dir, async_scheduling):
    """A 700-token shared prefix with 512 tokens a step: computed, a prompt needs two steps; cached, one."""
    rng = random.Random(0)
    shared = [rng.randrange(10, 30000) for _ in range(700)]
    steps_to_first = {}
    for caching in (True, False):
        llm = LLM(tiny_llama3_dir, dtype="float32", device="cpu", num_kv_blocks=400, max_model_len=1024,
                  max_num_batched_tokens=512, async_scheduling=async_scheduling, enable_prefix_caching=caching)
        engine, counts = llm.engine, []
        for i in range(4):
            request_id = f"r{i}"
            engine.add_request(request_id, shared + [rng.randrange(10, 30000) for _ in range(100)],
                               SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            steps = 0
            while True:
                steps += 1
                if any(out.request_id == request_id for out in engine.step()):
                    break
            counts.append(steps)
            while engine.has_unfinished_requests():
                engine.step()
        steps_to_first[caching] = counts
    lag = 1 if async_scheduling else 0  # with async scheduling a step's token is read by the next call
    assert steps_to_first[False] == [2 + lag] * 4
    assert steps_to_first[True] == [2 + lag] + [1 + lag] * 3  # the first request fills the cache
