"""The scheduler against a one-request-at-a-time reference: a fake runner stores token ids in a paged cache
(through the real attention metadata) and predicts each next token from the context it reads back, so wrong
block tables, bad prefix-cache hits, lost chunks or incomplete recomputation change the tokens. Every batch is
checked against the budgets."""
from __future__ import annotations

import random

import pytest

from minivllm.config import check_token_ids
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.scheduler import Scheduler
from minivllm.sampling_params import SamplingParams
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.testing import FAKE_VOCAB, FakeRunner, reference_tokens, run_scheduler


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                   eos_token_ids=()):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens, max_model_len,
                     eos_token_ids)


def workload(seed: int, n: int = 10):
    "Requests over a few shared prefixes (one prompt is exactly a prefix), of mixed lengths, some stopping at EOS."
    rng = random.Random(seed)
    shared = [[rng.randrange(FAKE_VOCAB) for _ in range(rng.randrange(4, 14))] for _ in range(2)]
    prompts = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.5:
            prompts.append(rng.choice(shared) + [rng.randrange(FAKE_VOCAB) for _ in range(rng.randrange(0, 10))])
        else:
            prompts.append([rng.randrange(FAKE_VOCAB) for _ in range(rng.randrange(1, 40))])
    return [(p, SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=rng.random() < 0.7)) for p in prompts]


# ---------------------------------------------------------------------------------------------- sequences

def test_sequence_properties():
    seq = Sequence(3, [5, 6, 7])
    assert (seq.seq_id, seq.status, seq.num_tokens, seq.last_token, seq.num_uncomputed_tokens) == \
           (3, SequenceStatus.WAITING, 3, 7, 3)
    seq.token_ids.append(8)
    assert (seq.prompt_token_ids, seq.completion_token_ids, seq.num_completion_tokens) == ([5, 6, 7], [8], 1)
    assert "id=3" in repr(seq)


@pytest.mark.parametrize("prompt, message", [
    ([], "the prompt is empty"),
    ("abc", "tokenize it first"),
    ([1, 2.0], r"token ids \(integers >= 0 that fit in 64 bits\)"),
    ([1, -1], r"token ids \(integers >= 0 that fit in 64 bits\)"),
    ([True], r"token ids \(integers >= 0 that fit in 64 bits\)"),
    ([1, 2**63], r"token ids \(integers >= 0 that fit in 64 bits\)"),
])
def test_bad_prompts_are_refused(prompt, message):
    with pytest.raises(ValueError, match=message):
        check_token_ids(prompt)
    with pytest.raises(ValueError, match=message):
        make_scheduler().add(prompt)


# ---------------------------------------------------------------------------------------------- scheduling

def test_all_requests_finish_with_exactly_max_tokens_when_ignoring_eos():
    requests = [(list(range(1, 1 + n)), SamplingParams(max_tokens=m, ignore_eos=True))
                for n, m in [(3, 1), (5, 7), (9, 2), (17, 12), (1, 30)]]
    sched = make_scheduler(num_blocks=32, eos_token_ids=list(range(FAKE_VOCAB)))  # every token is an EOS, ignored
    seqs, _ = run_scheduler(sched, requests)
    assert [s.num_completion_tokens for s in seqs] == [1, 7, 2, 12, 30]
    assert all(s.finish_reason == "length" and s.status is SequenceStatus.FINISHED for s in seqs)
    assert [s.completion_token_ids for s in seqs] == [reference_tokens(p, sp) for p, sp in requests]


SETTINGS = {  # the cache size in tokens; the longest request of `workload` needs 57
    "roomy": dict(cache_tokens=512, max_num_seqs=16, max_num_batched_tokens=512),
    "tiny cache": dict(cache_tokens=64, max_num_seqs=8, max_num_batched_tokens=64),
    "tiny budget": dict(cache_tokens=512, max_num_seqs=4, max_num_batched_tokens=5),
    "tiny everything": dict(cache_tokens=64, max_num_seqs=2, max_num_batched_tokens=3),
    "one at a time": dict(cache_tokens=512, max_num_seqs=1, max_num_batched_tokens=1),
}


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_same_tokens_whatever_the_schedule(setting, block_size, ahead):
    kw = dict(SETTINGS[setting])
    num_blocks = kw.pop("cache_tokens") // block_size
    eos, preemptions, chunked_steps = [3], 0, 0
    for seed in range(3):
        requests = workload(seed)
        sched = make_scheduler(num_blocks, block_size, eos_token_ids=eos, **kw)
        seqs, batches = run_scheduler(sched, requests, arrivals=[i // 3 for i in range(len(requests))], ahead=ahead)
        assert [s.completion_token_ids for s in seqs] == [reference_tokens(p, sp, eos) for p, sp in requests]
        preemptions += sched.num_preemptions
        chunked_steps += sum(not all(b.samples) for b in batches if b.is_prefill)
    assert (preemptions > 0) == (setting in ("tiny cache", "tiny everything"))
    assert (chunked_steps > 0) == (setting in ("tiny budget", "tiny everything", "one at a time"))


def test_one_sequence_at_a_time_is_the_reference_schedule():
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    requests = workload(7, n=5)
    seqs, batches = run_scheduler(sched, requests)
    assert all(b.num_seqs == 1 for b in batches)
    order = [b.seqs[0].seq_id for b in batches]
    assert order == sorted(order)  # first come, first served, each to its end


def test_decode_waits_while_prompts_are_prefilled():
    sched = make_scheduler(max_num_batched_tokens=8)
    requests = [([1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True)),
                (list(range(20)), SamplingParams(max_tokens=2, ignore_eos=True))]
    seqs, batches = run_scheduler(sched, requests, arrivals=[0, 2])
    kinds = [(b.is_prefill, [s.seq_id for s in b.seqs], b.num_new_tokens) for b in batches[:6]]
    assert kinds == [(True, [0], [3]), (False, [0], [1]), (True, [1], [8]), (True, [1], [8]), (True, [1], [4]),
                     (False, [0, 1], [1, 1])]


def test_chunked_prefill_computes_each_token_once():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=7)
    prompt = list(range(30))
    (seq,), batches = run_scheduler(sched, [(prompt, SamplingParams(max_tokens=3, ignore_eos=True))])
    prefill = [b for b in batches if b.is_prefill]
    assert [b.num_computed_tokens[0] for b in prefill] == [0, 7, 14, 21, 28]
    assert [b.num_new_tokens[0] for b in prefill] == [7, 7, 7, 7, 2]
    assert [b.samples[0] for b in prefill] == [False] * 4 + [True]
    assert seq.completion_token_ids == reference_tokens(prompt, SamplingParams(max_tokens=3))


def test_a_chunk_ending_one_token_short_finishes_as_a_decode():
    "A 9-token prompt with a budget of 8: the 9th token is computed by a decode step, which samples."
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=8)
    prompt = list(range(9))
    (seq,), batches = run_scheduler(sched, [(prompt, SamplingParams(max_tokens=2, ignore_eos=True))])
    assert [(b.is_prefill, b.num_computed_tokens, b.num_new_tokens, b.samples) for b in batches] == \
           [(True, [0], [8], [False]), (False, [8], [1], [True]), (False, [9], [1], [True])]
    assert seq.completion_token_ids == reference_tokens(prompt, SamplingParams(max_tokens=2))


def test_preemption_is_counted_and_recomputed():
    requests = [(list(range(10 * i, 10 * i + 6)), SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(3)]
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    seqs, batches = run_scheduler(sched, requests)
    assert sched.num_preemptions == 2 and [s.num_preemptions for s in seqs] == [0, 1, 1]
    assert [([p.seq_id for p in b.preempted], [s.seq_id for s in b.seqs]) for b in batches if b.preempted] == \
           [([2], [0, 1]), ([1], [0])]
    recompute = [b for b in batches if b.is_prefill and 2 in [s.seq_id for s in b.seqs]][-1]
    i = [s.seq_id for s in recompute.seqs].index(2)
    assert recompute.num_computed_tokens[i] + recompute.num_new_tokens[i] == 6 + 3  # its prompt and the 3 tokens it had
    assert [s.completion_token_ids for s in seqs] == [reference_tokens(p, sp) for p, sp in requests]


def test_several_preempted_sequences_keep_their_order_at_the_front():
    "Four 3-token prompts fill 8 blocks of 2; at the 5th token the two newest are preempted, in one step."
    sched = make_scheduler(num_blocks=8, block_size=2, max_num_seqs=8, max_num_batched_tokens=16)
    for i in range(4):
        sched.add([i + 1] * 3, SamplingParams(max_tokens=10, ignore_eos=True))
    runner = FakeRunner(8, 2)
    for _ in range(3):  # prefill, then two decode steps
        batch = sched.schedule()
        sched.postprocess(batch, runner.run(batch))
    assert [s.seq_id for s in batch.preempted] == [3, 2]  # newest first...
    assert [s.seq_id for s in sched.waiting] == [2, 3]  # ...so the queue keeps their admission order
    assert [s.seq_id for s in batch.seqs] == [0, 1] and sched.num_preemptions == 2


def test_prefix_cache_hits_and_fully_cached_prompt():
    prefix = [11, 12, 13, 14, 15, 16, 17, 18]
    requests = [(prefix + [1], SamplingParams(max_tokens=4, ignore_eos=True)),
                (prefix + [2, 3, 4], SamplingParams(max_tokens=4, ignore_eos=True)),
                (prefix, SamplingParams(max_tokens=2, ignore_eos=True))]  # entirely cached
    sched = make_scheduler(num_blocks=16, block_size=4)
    seqs, batches = run_scheduler(sched, requests, arrivals=[0, 1, 2])
    assert [s.num_cached_tokens for s in seqs] == [0, 8, 4]
    assert [b.num_new_tokens for b in batches[:3]] == [[9], [3], [4]]
    assert sched.block_manager.prefix_cache_hit_tokens == 12
    assert sched.block_manager.prefix_cache_hit_blocks == 3
    assert [s.completion_token_ids for s in seqs] == [reference_tokens(p, sp) for p, sp in requests]


def test_same_prompt_in_one_step_does_not_share_uncomputed_blocks():
    prompt = list(range(12))
    requests = [(prompt, SamplingParams(max_tokens=2, ignore_eos=True))] * 2
    sched = make_scheduler()
    runner = FakeRunner(sched.block_manager.num_blocks, sched.block_manager.block_size)
    seqs, batches = run_scheduler(sched, requests, runner=runner)
    assert [s.num_cached_tokens for s in seqs] == [0, 0]
    assert batches[0].num_new_tokens == [12, 12]
    seqs, _ = run_scheduler(sched, requests, runner=runner)  # later, both find the published blocks
    assert [s.num_cached_tokens for s in seqs] == [8, 8]


def test_eos_and_stop_tokens_finish_requests_and_free_blocks():
    prompt = [1, 2, 3]
    free_run = reference_tokens(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    eos = free_run[4]
    cut = free_run.index(eos) + 1
    sched = make_scheduler(eos_token_ids=[eos])
    requests = [(prompt, SamplingParams(max_tokens=20)),
                (prompt, SamplingParams(max_tokens=20, ignore_eos=True)),
                (prompt, SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[eos])),
                (prompt, SamplingParams(max_tokens=20, stop_token_ids=[free_run[1]]))]
    seqs, _ = run_scheduler(sched, requests)  # run_scheduler() checks that every block is free at the end
    assert [(s.finish_reason, s.completion_token_ids) for s in seqs] == \
           [("stop", free_run[:cut]), ("length", free_run), ("stop", free_run[:cut]),
            ("stop", free_run[:free_run.index(free_run[1]) + 1])]
    assert all(s.block_table == [] for s in seqs)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_hold_eos_and_stop_tokens_back(ignore_eos):
    "Whatever ignore_eos says, EOS or a stop token ends a request only with at least min_tokens tokens before it."
    prompt = [1, 2, 3]
    free_run = reference_tokens(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    eos, stop = free_run[1], free_run[3]
    ends = {stop} if ignore_eos else {stop, eos}
    sched = make_scheduler(eos_token_ids=[eos])
    requests = [(prompt, SamplingParams(max_tokens=30, min_tokens=m, ignore_eos=ignore_eos, stop_token_ids=[stop]))
                for m in range(0, 31, 3)]
    seqs, _ = run_scheduler(sched, requests)
    for (_, params), seq in zip(requests, seqs):
        first = next((i for i, t in enumerate(free_run) if t in ends and i >= params.min_tokens), None)
        expected = ("length", free_run) if first is None else ("stop", free_run[:first + 1])
        assert (seq.finish_reason, seq.completion_token_ids) == expected, params.min_tokens
    assert seqs[0].num_completion_tokens < 5 and seqs[-1].finish_reason == "length"  # min_tokens did hold them back


def test_masked_token_ids_tell_the_sampler_what_min_tokens_holds_back():
    sched = make_scheduler(eos_token_ids=[7, 3])
    a = sched.add([1, 2, 3], SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[9]))
    b = sched.add([4, 5], SamplingParams(max_tokens=8, ignore_eos=True, min_tokens=1))
    c = sched.add([6], SamplingParams(max_tokens=8))
    told = []
    for _ in range(3):
        batch = sched.schedule()
        told.append(batch.masked_token_ids())  # read before postprocess, like the rest of the batch
        sched.postprocess(batch, [11] * batch.num_seqs)
    assert told == [[[3, 7, 9], [3, 7], []], [[3, 7, 9], [], []], None]  # EOS held back even with ignore_eos
    assert [s.num_completion_tokens for s in (a, b, c)] == [3, 3, 3]


def test_max_model_len_caps_prompt_and_output():
    sched = make_scheduler(max_model_len=10)
    (seq,), _ = run_scheduler(sched, [([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))])
    assert (seq.finish_reason, seq.num_tokens) == ("length", 10)
    assert seq.completion_token_ids == reference_tokens([1, 2, 3], SamplingParams(max_tokens=7))
    (seq,), _ = run_scheduler(sched, [(list(range(9)), SamplingParams(max_tokens=50))])
    assert seq.num_completion_tokens == 1


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_and_settings(seed, ahead):
    "Random workloads under random budgets, block sizes and arrival times: the reference's tokens, budgets kept."
    rng = random.Random(1000 + seed)
    block_size = rng.choice([1, 2, 4, 8])
    requests = workload(seed, n=rng.randrange(1, 14))
    longest = max(len(p) + sp.max_tokens for p, sp in requests)
    max_num_seqs = rng.randrange(1, 8)
    kw = dict(block_size=block_size, max_num_seqs=max_num_seqs,
              num_blocks=-(-longest // block_size) + rng.randrange(0, 30),
              max_num_batched_tokens=max_num_seqs + rng.randrange(0, 40), eos_token_ids=[rng.randrange(FAKE_VOCAB)])
    sched = make_scheduler(**kw)
    arrivals = sorted(rng.randrange(0, 20) for _ in requests)
    seqs, _ = run_scheduler(sched, requests, arrivals, ahead=ahead)
    assert [s.completion_token_ids for s in seqs] == \
           [reference_tokens(p, sp, kw["eos_token_ids"]) for p, sp in requests]


# ---------------------------------------------------------------------------------------------- scheduling ahead

def test_a_step_scheduled_ahead_names_the_tokens_on_their_way():
    "The next decode is scheduled before the step before lands: its input rows point at that step's sampled rows."
    sched, runner = make_scheduler(), FakeRunner(64, 4)
    a, b = sched.add([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)), sched.add([4, 5], SamplingParams(max_tokens=5, ignore_eos=True))
    prefill = sched.schedule()
    assert (a.num_pending, b.num_pending, a.num_tokens, a.completion_token_ids) == (1, 1, 4, [])
    first = runner.run(prefill)
    decode = sched.schedule()  # before the prefill's tokens landed
    assert not decode.is_prefill and decode.step.pending == [(0, 0), (1, 1)] and decode.step.input_ids == [0, 0]
    assert decode.step.positions == [3, 2] and (a.num_pending, a.num_tokens) == (2, 5)
    second = runner.run(decode)  # the fake runner takes the pending tokens from the prefill's, as a GPU would
    sched.postprocess(prefill, first)
    assert (a.completion_token_ids, a.num_pending) == ([first[0]], 1)
    with pytest.raises(RuntimeError, match="in the order schedule"):
        sched.postprocess(sched.schedule(), [0, 0])  # a third step: the second is still the oldest
    sched.postprocess(decode, second)
    assert a.completion_token_ids == reference_tokens([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))


def test_a_sequence_whose_tokens_on_their_way_end_it_is_not_scheduled_again():
    sched, runner = make_scheduler(), FakeRunner(64, 4)
    seq = sched.add([1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True))
    prefill = sched.schedule()
    assert sched.schedule() is None  # its one token is on its way: nothing else to run until it lands
    (done,) = sched.postprocess(prefill, runner.run(prefill))
    assert done is seq and seq.finish_reason == "length" and sched.is_finished()
    sched = make_scheduler(max_model_len=5)
    seq = sched.add([1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True))
    flying = [sched.schedule()]
    flying.append(sched.schedule())  # position 3: its last token is the one this step samples (max_model_len 5)
    assert sched.schedule() is None
    for batch in flying:
        sched.postprocess(batch, [7])
    assert (seq.finish_reason, seq.num_tokens, len(seq.block_table)) == ("length", 5, 0)


def test_a_sequence_that_stops_while_its_next_step_is_in_flight_drops_that_step():
    eos = 9
    sched = make_scheduler(eos_token_ids=[eos])
    stopping, going = sched.add([1, 2], SamplingParams(max_tokens=8)), sched.add([3, 4], SamplingParams(max_tokens=8))
    prefill = sched.schedule()
    decode = sched.schedule()
    assert sched.postprocess(prefill, [eos, 5]) == [stopping]  # EOS lands while the decode is in flight
    assert stopping.is_finished and stopping.num_pending == 0 and stopping.block_table == []
    assert sched.postprocess(decode, [6, 6]) == []  # its token from the decode is dropped
    assert (stopping.completion_token_ids, going.completion_token_ids) == ([eos], [5, 6])
    aborted = going
    later = sched.schedule()
    sched.abort(aborted)  # a stop string, a client gone: ended while a step for it is in flight
    assert sched.postprocess(later, [1]) == [] and aborted.completion_token_ids == [5, 6]
    assert sched.is_finished() and sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_a_sequence_preempted_with_tokens_on_their_way_gets_them_and_is_recomputed():
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2, max_num_batched_tokens=8)
    old, new = sched.add([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)), sched.add([4], SamplingParams(max_tokens=6, ignore_eos=True))
    prefill = sched.schedule()  # old: 2 blocks, new: 1, one free
    decode = sched.schedule()  # ahead: old's token at position 3 fits, new's at 1 too
    third = sched.schedule()  # further ahead: old takes the free block; new needs one too and goes
    assert third.preempted == [new] and third.seqs == [old]
    assert new.status is SequenceStatus.WAITING and new.num_pending == 2 and new.block_table == []
    sched.postprocess(prefill, [11, 12])
    sched.postprocess(decode, [13, 14])
    assert new.completion_token_ids == [12, 14] and new.num_pending == 0  # landed, though it holds no blocks now
    assert sched.postprocess(third, [15]) == [old]
    recompute = sched.schedule()
    assert recompute.is_prefill and recompute.seqs == [new] and recompute.step.input_ids == [4, 12, 14]


def test_penalties_make_the_next_step_wait_for_the_tokens_it_counts():
    sched = make_scheduler()
    sched.add([1, 2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert not sched.needs_landed_tokens() and sched.schedule() and not sched.needs_landed_tokens()
    penalised = make_scheduler()
    penalised.add([1, 2], SamplingParams(max_tokens=4, presence_penalty=0.5))
    penalised.schedule()
    assert penalised.needs_landed_tokens()  # its next step counts the token on its way: schedule once it lands


# ---------------------------------------------------------------------------------------------- errors

def test_add_rejects_requests_that_can_never_run():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32)
    with pytest.raises(ValueError, match="the prompt has 32 tokens, but max_model_len is 32"):
        sched.add(list(range(32)))
    with pytest.raises(ValueError, match="need 6 blocks, but the whole KV cache has 4 blocks of 4 tokens"):
        sched.add([1, 2], SamplingParams(max_tokens=20))
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        sched.add([1, 2], {"max_tokens": 3})
    assert not sched.waiting and next(sched.seq_ids) == 0  # nothing was queued, no id was spent
    seq = sched.add(list(range(10)), SamplingParams(max_tokens=7))  # at most 16 tokens with K/V: exactly 4 blocks
    assert seq.seq_id == 1 and list(sched.waiting) == [seq]


def test_a_request_filling_the_whole_cache_runs_alone():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    requests = [(list(range(10)), SamplingParams(max_tokens=7, ignore_eos=True)),
                ([5, 6], SamplingParams(max_tokens=14, ignore_eos=True)),
                (list(range(10)), SamplingParams(max_tokens=7, ignore_eos=True))]
    seqs, _ = run_scheduler(sched, requests)
    assert [s.completion_token_ids for s in seqs] == [reference_tokens(p, sp) for p, sp in requests]


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be a positive integer"),
    (dict(max_model_len=1.5), "max_model_len must be a positive integer"),
    (dict(max_num_seqs=16, max_num_batched_tokens=8), r"max_num_batched_tokens \(8\) must be at least max_num_seqs \(16\)"),
    (dict(eos_token_ids=[-1]), r"eos_token_ids must hold token ids"),
])
def test_scheduler_constructor_validates(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(BlockManager(8, 4), **kwargs)


def test_schedule_and_postprocess_misuse():
    sched = make_scheduler(max_num_batched_tokens=8)
    with pytest.raises(RuntimeError, match="nothing to schedule"):
        sched.schedule()
    seq = sched.add(list(range(12)))
    batch = sched.schedule()
    with pytest.raises(ValueError, match=r"one sampled token per sequence of the batch \(1\), got 2"):
        sched.postprocess(batch, [1, 2])
    assert sched.postprocess(batch, [None]) == []  # a chunk samples nothing
    with pytest.raises(RuntimeError, match="call postprocess exactly once for each batch"):
        sched.postprocess(batch, [None])
    batch = sched.schedule()  # the last 4 tokens: samples a token, on its way until postprocess
    state = lambda: (seq.num_computed_tokens, seq.num_tokens, seq.num_pending, list(seq.token_ids), len(sched.in_flight))
    assert state() == (12, 13, 1, list(range(12)), 1)
    for bad in (None, -5, 2.0):
        with pytest.raises(ValueError, match=r"the token sampled for sequence 0 must be a token id"):
            sched.postprocess(batch, [bad])
        assert state() == (12, 13, 1, list(range(12)), 1)  # a refused call changes nothing
    sched.postprocess(batch, [7])
    assert (seq.num_computed_tokens, seq.completion_token_ids, seq.num_pending) == (12, [7], 0)


def test_sequence_ids_belong_to_their_scheduler():
    a, b = make_scheduler(), make_scheduler()
    assert [a.add([1]).seq_id, a.add([2]).seq_id, b.add([3]).seq_id] == [0, 1, 0]
