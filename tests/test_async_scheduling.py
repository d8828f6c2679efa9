"""Asynchronous scheduling: the next step scheduled and launched before this one's tokens land gives exactly the
tokens, logprobs and endings of the synchronous engine, whatever the requests ask (seeds, penalties, stops, n,
preemption, chunks); a launched step reads nothing from the device until its result is asked. On the CPU the
step has run when it is launched, so this is the logic a GPU runs, without the overlap."""
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import LLMEngine
from minivllm.testing import count_host_reads, make_tiny_checkpoint

PROMPTS = [[5, 9, 2, 7, 1], [3] * 21, [8, 6, 4, 2, 250, 17, 33, 12, 90], [7], [5, 9, 2, 7, 1, 4, 4]]
PARAMS = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=1.0, seed=7, max_tokens=7, min_p=0.1, min_tokens=3, stop_token_ids=[5, 11, 40]),
          SamplingParams(temperature=0.8, seed=1, max_tokens=9, presence_penalty=0.5, repetition_penalty=1.2,
                         ignore_eos=True),
          SamplingParams(temperature=0.7, seed=3, max_tokens=6, n=2, prompt_logprobs=1, ignore_eos=True)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3", num_attention_heads=4, num_key_value_heads=2)


def run_engine(ckpt, ahead: bool, prompts=PROMPTS, params=PARAMS, **kwargs):
    "Every request to its end; per sequence its tokens, ending, logprobs and prompt logprobs, and the step count."
    with LLMEngine(ckpt, async_scheduling=ahead, **{"max_model_len": 128, **kwargs}) as engine:
        seqs = [s for p, sp in zip(prompts, params) for s in engine.add(p, sp)]
        steps = 0
        while not engine.scheduler.is_finished():
            engine.step()
            steps += 1
        preemptions = engine.scheduler.num_preemptions
        assert not engine.in_flight and not engine.scheduler.in_flight
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        return [(s.completion_token_ids, s.finish_reason, s.stop_reason, s.logprobs, s.prompt_logprobs)
                for s in seqs], steps, preemptions


def assert_same_outputs(got, expected):
    "The same tokens, endings and logprob keys; logprobs to float32 rounding (a batch's make-up and the threads may change the last bits)."
    for (tokens, *ending, logprobs, prompt_logprobs), (tokens_, *ending_, logprobs_, prompt_logprobs_) in zip(got, expected, strict=True):
        assert (tokens, ending) == (tokens_, ending_)
        for record, record_ in ((logprobs, logprobs_), (prompt_logprobs, prompt_logprobs_)):
            assert (record is None) == (record_ is None)
            for d, d_ in zip(record or [], record_ or [], strict=True):
                assert (d is None) == (d_ is None) and (d is None or d.keys() == d_.keys())
                if d is not None:
                    torch.testing.assert_close(torch.tensor(list(d.values())), torch.tensor([d_[k] for k in d]),
                                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("limits", [{}, dict(num_kvcache_blocks=12, kvcache_block_size=4, max_model_len=48),
                                    dict(max_num_batched_tokens=8, max_num_seqs=4)],
                         ids=["roomy", "preempting", "chunked"])
def test_scheduling_ahead_gives_the_synchronous_engines_outputs(ckpt, limits):
    sync, sync_steps, sync_preemptions = run_engine(ckpt, False, **limits)
    ahead, ahead_steps, preemptions = run_engine(ckpt, True, **limits)
    assert_same_outputs(ahead, sync)
    assert ahead_steps <= sync_steps + 2  # one call to launch the first step, one to land the last
    assert (sync_preemptions > 0, preemptions > 0) == (("num_kvcache_blocks" in limits),) * 2


def test_a_step_ahead_reads_nothing_until_its_tokens_are_asked(ckpt):
    with LLMEngine(ckpt, max_model_len=64, async_scheduling=True) as engine:
        engine.add([5, 9, 2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        engine.add([7, 7], SamplingParams(temperature=0.8, seed=2, max_tokens=6, ignore_eos=True))
        finished, stats = engine.step()  # the prefill launched; nothing landed yet
        assert (finished, stats["tokens"], stats["sampled"], len(engine.in_flight)) == ([], 0, [], 1)
        batch = engine.scheduler.schedule()  # the first decode, its tokens still "on the device"
        assert batch.step.pending == [(0, 0), (1, 1)]
        with torch.no_grad(), count_host_reads() as reads:
            launched = engine.runner.launch(batch.step)
        assert reads.count == 0, reads  # the host goes on: scheduling, recording, text
        engine.in_flight.append((batch, launched))
        with count_host_reads() as reads:
            finished, stats = engine.step()  # launches the step after, then lands the prefill: its one read
        assert reads.count == 1 and stats["tokens"] == 5 and len(engine.in_flight) == 2
        while not engine.scheduler.is_finished():
            engine.step()
        assert not engine.in_flight


def test_stop_strings_and_streams_are_the_same_ahead():
    "The packaged model's text: a stop string ends a request while its next step is in flight; streams too."
    prompts = ["HAMLET. To be, or not to be", "HORATIO. My lord"]
    params = [SamplingParams(temperature=0.8, seed=9, max_tokens=24, stop=["e"]),
              SamplingParams(temperature=0, max_tokens=16, stop=[" your"], include_stop_str_in_output=True)]
    outputs = {}
    for ahead in (False, True):
        with LLM("minivllm-default", max_model_len=128, async_scheduling=ahead) as llm:
            out = llm.generate(prompts, params, use_tqdm=False)
            streamed = [d.outputs[0].text for d in llm.stream(prompts[:1], params[0])]
            outputs[ahead] = ([(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in out],
                              streamed)
    assert outputs[True] == outputs[False]
    assert [reason for _, reason, _ in outputs[True][0]] == ["stop", "stop"]


@pytest.mark.parametrize("tp", [2, 4])
def test_scheduling_ahead_at_several_ranks_gives_the_synchronous_engines_outputs(ckpt, tp):
    "Every rank fills the pending rows from rank 0's tokens, broadcast after each step: the one-rank engine's outputs."
    sync, _, _ = run_engine(ckpt, False)
    ahead, ahead_steps, _ = run_engine(ckpt, True, tensor_parallel_size=tp,
                                       max_num_batched_tokens=8, max_num_seqs=4)  # chunked prefills, rows that change
    chunked, _, _ = run_engine(ckpt, False, max_num_batched_tokens=8, max_num_seqs=4)
    assert_same_outputs(ahead, chunked)
    assert_same_outputs(chunked, sync)
