"""A vLLM user's script, run unchanged but for its import: the offline API's outputs read as vLLM's (`Logprob`s with
their rank and text, `stop_reason`, `cumulative_logprob`, `prompt_logprobs`, `llm.llm_engine`), and `stop_reason`
through the engine-core process too."""
import asyncio
import math

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import Logprob

PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo"]


@pytest.fixture(scope="module")
def llm():
    "The packaged model (it has a tokenizer), in float32."
    with LLM(dtype="float32") as engine:
        yield engine


def test_a_vllm_script_reads_logprobs_stop_reason_and_prompt_logprobs(llm):
    # --- the script, as written for vLLM ---
    params = SamplingParams(temperature=0.8, max_tokens=64, logprobs=2, prompt_logprobs=1, stop=["\n"], seed=0)
    out = llm.generate(PROMPTS, params)
    completion = out[0].outputs[0]
    tok = completion.token_ids[0]
    first = completion.logprobs[0][tok]
    logprob, rank, text = first.logprob, first.rank, first.decoded_token
    stop_reason, cumulative = completion.stop_reason, completion.cumulative_logprob
    prompt_tok = out[0].prompt_token_ids[1]
    prompt_logprob = out[0].prompt_logprobs[1][prompt_tok].logprob
    tokenizer = llm.get_tokenizer()
    # --- what it reads ---
    assert isinstance(llm.llm_engine, LLMEngine)
    assert isinstance(first, Logprob) and logprob <= 0 and text == tokenizer.decode([tok])
    assert isinstance(rank, int) and rank >= 1  # among the whole vocabulary, as vLLM's
    for request in out:
        c = request.outputs[0]
        assert (c.finish_reason, c.stop_reason) == ("stop", "\n") and "\n" not in c.text
        assert len(c.logprobs) == len(c.token_ids)
        for t, position in zip(c.token_ids, c.logprobs):
            assert t in position and len(position) in (2, 3)
            ranks = [lp.rank for lp in position.values()]
            # the 2 most likely rank 1 and 2; the sampled token beside them (a third entry) is below them, counted
            assert ranks[:2] == [1, 2] and (len(ranks) == 2 or (ranks[2] == position[t].rank >= 3))
            assert all(lp.decoded_token == tokenizer.decode([u]) for u, lp in position.items())
        assert math.isclose(c.cumulative_logprob, sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)),
                            rel_tol=1e-12)
        assert request.prompt_logprobs[0] is None and len(request.prompt_logprobs) == len(request.prompt_token_ids)
        for t, position in zip(request.prompt_token_ids[1:], request.prompt_logprobs[1:]):
            assert t in position and [lp.rank for lp in position.values()][0] == 1
            assert position[t].rank == 1 if len(position) == 1 else position[t].rank >= 2  # the prompt token's, counted
    assert stop_reason == "\n" and cumulative < 0 and prompt_logprob <= 0


def test_stop_reason_names_a_stop_token_and_is_none_otherwise(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0]
    assert (free.finish_reason, free.outputs[0].stop_reason, free.outputs[0].cumulative_logprob) == ("length", None, None)
    token = free.token_ids[5]
    stopped = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[token]),
                           use_tqdm=False)[0]
    cut = free.token_ids.index(token) + 1
    assert stopped.token_ids == free.token_ids[:cut]
    assert (stopped.finish_reason, stopped.outputs[0].stop_reason) == ("stop", token)
    string = free.text[len(free.text) // 2:][:3]
    by_string = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop=[string]), use_tqdm=False)[0]
    assert (by_string.finish_reason, by_string.outputs[0].stop_reason) == ("stop", string)
    streamed = list(llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[token],
                                                          logprobs=0)))
    assert streamed[-1].outputs[0].stop_reason == token
    assert math.isclose(streamed[-1].outputs[0].cumulative_logprob,
                        sum(p[t].logprob for d in streamed for c in d.outputs for t, p in zip(c.token_ids, c.logprobs)))


def test_async_llm_gives_the_same_stop_reason_and_logprobs(llm):
    "Through the engine-core process: the stop token crosses the socket in each completion's last delta."
    from minivllm.serve.async_llm import AsyncLLM
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    token = free.token_ids[5]
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[token], logprobs=1)
    offline = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]

    async def run(engine):
        return [d async for d in engine.generate(PROMPTS[0], params)]

    with AsyncLLM(dtype="float32") as engine:
        deltas = asyncio.run(run(engine))
    last = deltas[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", token)
    logprobs = [p for d in deltas for p in d.outputs[0].logprobs]
    assert [sorted(p) for p in logprobs] == [sorted(p) for p in offline.logprobs]
    assert all(p[t].rank == q[t].rank and p[t].decoded_token == q[t].decoded_token
               and math.isclose(p[t].logprob, q[t].logprob, abs_tol=1e-4)
               for p, q in zip(logprobs, offline.logprobs) for t in p)
    assert math.isclose(last.cumulative_logprob, offline.cumulative_logprob, abs_tol=1e-3)
