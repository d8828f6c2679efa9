"""`minivllm serve` as users meet it: the official openai client against a real server process, 64 streaming
clients at once at TP=2, clients that drop mid-stream, bad requests, and SIGTERM leaving nothing behind."""
import asyncio
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.bench.workload import ServerProcess
from minivllm.testing import gone, rank_processes, server_metrics, shm_segments, wait_until

KEY = "test-key"
HELLO = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def tp2(chat_ckpt):
    "A TP=2 server of the tiny chat checkpoint, as 'tiny' (and its alias 'tiny-alias'), behind an API key."
    with ServerProcess("--model", str(chat_ckpt), "--tp", "2", "--max-model-len", "256", "--api-key", KEY,
                       "--served-model-name", "tiny", "tiny-alias") as server:
        server.model = chat_ckpt
        yield server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def metrics(server) -> dict[str, float]:
    "The server's Prometheus samples without labels, by name."
    return server_metrics(server.url)


def test_the_openai_client_gets_completions_and_chats_streamed_and_whole(tp2, chat_ckpt):
    c = client(tp2)
    assert [m.id for m in c.models.list().data] == ["tiny", "tiny-alias"]
    whole = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    pieces = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, stream=True,
                                  stream_options={"include_usage": True})
    chunks = list(pieces)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    chat = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, temperature=0)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, temperature=0,
                                                 stream=True))
    assert streamed == chat.choices[0].message.content and chat.choices[0].message.role == "assistant"
    with LLM(chat_ckpt, max_model_len=256) as llm:  # the same reply offline, at TP=1
        offline = llm.chat(HELLO, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert chat.choices[0].message.content == offline.text


def test_sampling_parameters_reach_the_engine(tp2):
    c = client(tp2)
    base = dict(model="tiny", prompt="Hello there", temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    plain = c.completions.create(**base).choices[0].text
    cut = plain[5:8]
    stopped = c.completions.create(**base | {"stop": [cut]}).choices[0]
    assert (stopped.text, stopped.finish_reason) == (plain[:plain.index(cut)], "stop")
    two = c.completions.create(**base | {"n": 2, "temperature": 1.0, "seed": 3})
    assert [ch.index for ch in two.choices] == [0, 1] and two.usage.completion_tokens == 32
    seeded = [c.completions.create(**base | {"temperature": 1.0, "seed": 9}).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    scored = c.completions.create(**base | {"logprobs": 2}).choices[0].logprobs
    assert len(scored.tokens) == 16 and all(len(t) == 2 for t in scored.top_logprobs)
    assert all(lp <= 0 for lp in scored.token_logprobs)
    chat = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, temperature=0, logprobs=True,
                                     top_logprobs=3).choices[0].logprobs.content
    assert len(chat) == 4 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in chat)
    penalised = c.completions.create(**base | {"frequency_penalty": 2.0, "presence_penalty": 1.0}).choices[0].text
    assert penalised != plain


def test_vllm_sampling_fields_reach_the_engine_on_both_routes(tp2):
    c = client(tp2)
    base = dict(model="tiny", prompt="Hello there", temperature=0, max_tokens=16)
    plain = c.completions.create(**base).choices[0]
    for extra in ({"min_p": 0.5}, {"repetition_penalty": 1.0}):  # greedy: neither changes the argmax
        assert c.completions.create(**base, extra_body=extra).choices[0].text == plain.text
    repeated = c.completions.create(**base, extra_body={"ignore_eos": True, "repetition_penalty": 5.0}).choices[0].text
    assert repeated != c.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    at_least = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, temperature=0,
                                         extra_body={"min_tokens": 12, "stop_token_ids": [0, 1, 2]})
    assert at_least.usage.completion_tokens == 12  # no EOS or stop token before 12
    for bad, message in (({"min_p": 2.0}, "min_p must be"), ({"repetition_penalty": 0}, "repetition_penalty must be"),
                         ({"min_tokens": 99}, "min_tokens must be"), ({"logit_bias": {"99999": 1}}, "out of range for a vocabulary"),
                         ({"logit_bias": {"3": 500}}, "a bias from -100 to 100")):
        with pytest.raises(openai.BadRequestError, match=message):
            c.completions.create(**base, extra_body=bad)
    # vLLM's include_stop_str_in_output and OpenAI's logit_bias, on both routes
    cut = plain.text[3:6]
    kept = c.completions.create(**base, stop=[cut], extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == plain.text[:plain.text.index(cut) + len(cut)] and kept.finish_reason == "stop"
    forced = c.completions.create(**base | {"max_tokens": 3}, logit_bias={"7": 100}, logprobs=0).choices[0].logprobs
    chat = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, temperature=0, logit_bias={"7": 100},
                                     logprobs=True).choices[0].logprobs.content
    assert len({t for t in forced.tokens}) == 1 and [t.token for t in chat] == forced.tokens
    # completions' top_logprobs hold the sampled token too (vLLM's): with logprobs=0, only it
    sampled = c.completions.create(**base | {"temperature": 1.0, "seed": 5, "logprobs": 0}).choices[0].logprobs
    assert all(list(top.values()) == [lp] for top, lp in zip(sampled.top_logprobs, sampled.token_logprobs))


def test_prompt_logprobs_in_vllms_layout_equal_the_offline_engines(tp2):
    "vLLM's prompt_logprobs: completions' on each choice (whole, or with the first chunk), chat's beside the choices."
    c = client(tp2)
    whole = c.completions.create(model="tiny", prompt="Hello there, friend", max_tokens=2, temperature=0,
                                 extra_body={"prompt_logprobs": 2}).choices[0].model_extra["prompt_logprobs"]
    chunks = list(c.completions.create(model="tiny", prompt="Hello there, friend", max_tokens=2, temperature=0,
                                       stream=True, extra_body={"prompt_logprobs": 2}))
    assert chunks[0].choices[0].model_extra["prompt_logprobs"] == whole
    assert all("prompt_logprobs" not in ch.choices[0].model_extra for ch in chunks[1:] if ch.choices)
    with LLM(tp2.model, dtype="float32") as llm:
        offline = llm.generate("Hello there, friend", SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                               use_tqdm=False)[0]
    ids = offline.prompt_token_ids
    assert whole[0] is None and len(whole) == len(ids)
    for t, served, d in zip(ids[1:], whole[1:], offline.prompt_logprobs[1:]):
        assert set(served) == {str(u) for u in d} and str(t) in served
        torch.testing.assert_close([served[str(u)]["logprob"] for u in d], [lp.logprob for lp in d.values()],
                                   atol=1e-4, rtol=1e-4)
        assert all((served[str(u)]["rank"], served[str(u)]["decoded_token"]) == (lp.rank, lp.decoded_token)
                   for u, lp in d.items())  # the offline Logprobs' ranks and texts
        ranks = sorted(r["rank"] for r in served.values())  # the prompt token's counted in the vocabulary, top 2 or not
        assert ranks[:2] == [1, 2] and (len(served) == 2 or ranks[2] == served[str(t)]["rank"] >= 3)
    chat = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    plain = c.completions.create(model="tiny", prompt="Hello there, friend", max_tokens=2, temperature=0).choices[0]
    assert "prompt_logprobs" not in plain.model_extra


def test_tokenize_detokenize_and_version(tp2):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=tp2.url, headers=headers, timeout=60) as http:
        text = "Once upon a time"
        tokens = http.post("/tokenize", json={"model": "tiny", "prompt": text}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 256
        assert http.post("/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]}).json() == {"prompt": text}
        chat = http.post("/tokenize", json={"messages": HELLO}).json()  # the model is optional, as in vLLM
        assert chat["count"] > len(HELLO[0]["content"].split())  # the template's tokens too
        for path, body, status, message in (("/tokenize", {"prompt": "a", "messages": HELLO}, 400, "not both"),
                                            ("/detokenize", {"tokens": [-1]}, 400, "out of range for a vocabulary"),
                                            ("/tokenize", {"model": "other", "prompt": "a"}, 404, "is not served here")):
            r = http.post(path, json=body)
            assert r.status_code == status and message in r.json()["error"]["message"], r.text
        from minivllm import __version__
        assert httpx.get(tp2.url + "/version").json() == {"version": __version__}
    assert httpx.post(tp2.url + "/tokenize", json={"prompt": "a"}).status_code == 401  # the key guards it


def test_lists_of_prompts_and_chat_without_max_tokens(tp2):
    c = client(tp2)
    many = c.completions.create(model="tiny", prompt=["One", "Two", "Three"], n=2, max_tokens=3, temperature=0)
    assert [ch.index for ch in many.choices] == list(range(6)) and many.usage.completion_tokens == 18
    alone = c.completions.create(model="tiny", prompt="Two", max_tokens=3, temperature=0).choices[0].text
    assert many.choices[2].text == many.choices[3].text == alone  # prompt 1's two greedy completions
    with pytest.raises(openai.BadRequestError, match="out of range for a vocabulary"):
        c.completions.create(model="tiny", prompt=[[1, 2], [3, 99999]], max_tokens=3)
    chat = c.chat.completions.create(model="tiny", messages=HELLO, temperature=0,
                                     extra_body={"stop_token_ids": [], "ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"  # no max_tokens: up to the context (256 tokens)
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 256


def test_64_streaming_clients_at_once_each_get_the_greedy_text(tp2):
    prompts = [f"Client {i} says" for i in range(64)]
    body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def whole(http, prompt):
        r = await http.post("/v1/completions", json=body | {"prompt": prompt})
        return r.json()["choices"][0]["text"]

    async def streamed(http, prompt):
        text, usage = "", None
        async with http.stream("POST", "/v1/completions", json=body | {"prompt": prompt, "stream": True,
                                                                       "stream_options": {"include_usage": True}}) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            chunk = json.loads(line[len("data: "):])
            text += "".join(ch["text"] for ch in chunk["choices"])
            usage = chunk.get("usage") or usage
        return text, usage["completion_tokens"]

    async def run():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=tp2.url, headers=headers, timeout=300, limits=limits) as http:
            expected = await asyncio.gather(*(whole(http, p) for p in prompts))
            got = await asyncio.gather(*(streamed(http, p) for p in prompts))
        return expected, got

    expected, got = asyncio.run(run())
    assert [text for text, _ in got] == expected
    assert all(n == 24 for _, n in got)
    with LLM(tp2.model, max_model_len=256) as llm:  # offline, at TP=1, in this process
        offline = [o.text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                                use_tqdm=False)]
    assert expected == offline
    m = metrics(tp2)
    assert m["minivllm_batch_size_peak"] > 1 and m["minivllm_kv_cache_blocks_used"] == 0


def test_clients_that_drop_mid_stream_leave_no_blocks(tp2):
    headers = {"Authorization": f"Bearer {KEY}"}
    long = {"model": "tiny", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}

    async def drop(http, i):
        async with http.stream("POST", "/v1/completions", json=long | {"prompt": f"Dropper {i}"}) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break  # leaving the block closes the connection mid-stream

    async def finish(http, i):
        r = await http.post("/v1/completions", json=long | {"prompt": f"Stayer {i}", "stream": False, "max_tokens": 40})
        return r.json()["usage"]["completion_tokens"]

    async def run():
        async with httpx.AsyncClient(base_url=tp2.url, headers=headers, timeout=300) as http:
            return await asyncio.gather(*(drop(http, i) for i in range(16)), *(finish(http, i) for i in range(4)))

    done = asyncio.run(run())
    assert done[16:] == [40] * 4
    assert wait_until(lambda: (m := metrics(tp2))["minivllm_kv_cache_blocks_used"] == 0
                      and m["minivllm_num_requests_running"] == 0, 30), metrics(tp2)
    assert metrics(tp2)["minivllm_generation_tokens_total"] < 64 * 24 * 2 + 16 * 200  # the dropped did not run on


@pytest.mark.parametrize("body, status, message", [
    ({"prompt": "Hi"}, 400, "model: Field required"),
    ({"model": "tiny"}, 400, "prompt: Field required"),
    ({"model": "tiny", "prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "Hi", "n": 0}, 400, "n must be an integer >= 1"),
    ({"model": "tiny", "prompt": "Hi", "max_tokens": 5000}, 400, "lower max_tokens to at most"),
    ({"model": "tiny", "prompt": [1] * 300}, 400, "max_model_len is 256"),
    ({"model": "tiny", "prompt": [1, 99999]}, 400, "out of range for a vocabulary of"),
    ({"model": "tiny", "prompt": "Hi", "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ({"model": "tiny", "prompt": "Hi", "logprobs": 9}, 400, "logprobs must be from 0 to 5"),
    ({"model": "tiny", "prompt": "Hi", "prompt_logprobs": 21}, 400, "prompt_logprobs must be None or an integer from 0 to 20"),
    ({"model": "tiny", "prompt": "Hi", "n": 129}, 400, "n must be at most 128"),
    ({"model": "tiny", "prompt": "Hi", "n": 10000}, 400, "n must be at most 128"),
    ({"model": "tiny", "prompt": "x" * 1_000_000}, 400, "max_model_len is 256 tokens"),
    ({"model": "tiny", "prompt": ["Hi", "x" * 100_000]}, 400, "characters can fit; shorten it"),
    # values finite or whole in JSON that the engine cannot hold (float32, int64): refused before the engine sees them
    ({"model": "tiny", "prompt": "Hi", "temperature": 3.5e38}, 400, "infinite in float32"),
    ({"model": "tiny", "prompt": "Hi", "top_p": 1e-46}, 400, "0.0 in float32"),
    ({"model": "tiny", "prompt": "Hi", "top_k": 2**63}, 400, "fit in 64 bits"),
    ({"model": "tiny", "prompt": "Hi", "seed": 2**80}, 400, "fit in 64 bits"),
    ({"model": "tiny", "prompt": [[1, 2], [1] * 300]}, 400, "prompt 1: the prompt has 300 tokens"),
])
def test_bad_completion_requests_get_openai_errors_and_the_server_goes_on(tp2, body, status, message):
    r = httpx.post(tp2.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert client(tp2).completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_an_unknown_model_is_a_404_as_in_vllm(tp2):
    "vLLM answers a request naming a model it does not serve with a 404 (NotFoundError); the server goes on."
    headers = {"Authorization": f"Bearer {KEY}"}
    for path, body in (("/v1/completions", {"model": "gpt-5", "prompt": "Hi"}),
                       ("/v1/chat/completions", {"model": "gpt-5", "messages": HELLO})):
        r = httpx.post(tp2.url + path, json=body, headers=headers, timeout=60)
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert "is not served here: this server serves 'tiny', 'tiny-alias'" in error["message"]
        assert (error["type"], error["code"], error["param"]) == ("NotFoundError", 404, "model")
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        client(tp2).completions.create(model="gpt-5", prompt="Hi", max_tokens=2)
    assert client(tp2).completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_every_served_name_answers_and_responses_report_the_first(tp2):
    "`--served-model-name tiny tiny-alias`, as vLLM's: either name answers, /v1/models lists both, responses say 'tiny'."
    c = client(tp2)
    assert [(m.id, m.max_model_len) for m in c.models.list().data] == [("tiny", 256), ("tiny-alias", 256)]
    for name in ("tiny", "tiny-alias"):
        whole = c.completions.create(model=name, prompt="Hi", max_tokens=2)
        chat = c.chat.completions.create(model=name, messages=HELLO, max_tokens=2)
        streamed = c.completions.create(model=name, prompt="Hi", max_tokens=2, stream=True)
        assert (whole.model, chat.model, {chunk.model for chunk in streamed}) == ("tiny", "tiny", {"tiny"}), name
    assert any("serving 'tiny' (also as 'tiny-alias') at http://" in line for line in tp2.log), tp2.log


VLLM_METRICS = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
                "vllm:kv_cache_usage_perc": "gauge", "vllm:gpu_cache_usage_perc": "gauge",
                "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
                "vllm:time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
                "vllm:prompt_tokens_total": "counter", "vllm:generation_tokens_total": "counter",
                "vllm:request_success_total": "counter", "vllm:num_preemptions_total": "counter"}


def test_metrics_under_vllms_names_and_types(tp2):
    "A dashboard made for vLLM reads /metrics: each of vLLM's names, with its type and the model_name label."
    from prometheus_client.parser import text_string_to_metric_families
    list(client(tp2).completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True}, stream=True))
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(tp2.url + "/metrics", timeout=60).text)}
    for name, kind in VLLM_METRICS.items():
        family = families.get(name.removesuffix("_total") if kind == "counter" else name)  # a counter's family drops _total
        assert family is not None and family.type == kind, (name, family)
        assert family.samples and all(s.labels.get("model_name") == "tiny" for s in family.samples), (name, family.samples)
    value = lambda family, suffix="", **labels: next(s.value for s in families[family].samples if s.name == family + suffix
                                                     and s.labels == {"model_name": "tiny"} | labels)
    assert 0 <= value("vllm:kv_cache_usage_perc") <= 1
    assert value("vllm:generation_tokens", "_total") == families["minivllm_generation_tokens"].samples[0].value
    assert value("vllm:request_success", "_total", finished_reason="length") >= 1
    assert value("vllm:time_to_first_token_seconds", "_count") >= 1
    # each gap between two streamed tokens (tokens that reach the server together share one)
    assert value("vllm:inter_token_latency_seconds", "_count") >= 1
    assert value("vllm:inter_token_latency_seconds", "_sum") <= value("vllm:e2e_request_latency_seconds", "_sum")


def test_keys_json_and_chat_errors(tp2):
    url, good = tp2.url, {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url + "/v1/completions", json=good, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": []}, headers=auth)
    assert r.status_code == 400 and "messages is empty" in r.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200  # /health and /metrics need no key


def test_a_50mb_body_is_refused_at_once_and_does_not_delay_the_others(tp2):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    good = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    big = json.dumps(good | {"prompt": "a" * 50_000_000}).encode()

    def chunks():  # no Content-Length: the body comes with chunked transfer encoding
        for i in range(0, len(big), 2**16):
            yield big[i:i + 2**16]

    def timed(**kw) -> tuple[httpx.Response, float]:
        start = time.perf_counter()
        r = httpx.post(tp2.url + "/v1/completions", headers=headers, timeout=120, **kw)
        return r, time.perf_counter() - start

    usual = min(timed(json=good)[1] for _ in range(3))
    with ThreadPoolExecutor(3) as pool:
        declared, chunked = pool.submit(timed, content=big), pool.submit(timed, content=chunks())
        time.sleep(0.02)  # the big bodies are on their way
        normal = pool.submit(timed, json=good)
        (declared, declared_s), (chunked, chunked_s), (normal, normal_s) = (f.result() for f in (declared, chunked, normal))
    print(f"usual {usual:.3f} s; 50 MB with Content-Length refused in {declared_s:.3f} s, chunked in {chunked_s:.3f} s; "
          f"a normal request meanwhile {normal_s:.3f} s")
    for r in (declared, chunked):
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert "this server reads at most 4,194,304 bytes" in error["message"] and error["code"] == "request_too_large"
    assert "the request body has 50,000,0" in declared.json()["error"]["message"]
    assert declared_s < 1 and chunked_s < 1
    assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 8
    assert normal_s < 3 * usual + 2
    assert client(tp2).completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_prompts_that_cannot_fit_are_refused_before_tokenizing(tp2):
    auth = {"Authorization": f"Bearer {KEY}"}
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": "Hello " * 500_000}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi " * 1_000_000}]})):
        start = time.perf_counter()
        r = httpx.post(tp2.url + path, json=body, headers=auth, timeout=60)
        elapsed = time.perf_counter() - start
        assert r.status_code == 400 and "max_model_len is 256 tokens" in r.json()["error"]["message"], r.text
        assert elapsed < 1, elapsed  # 3 MB of text: refused by its length, never tokenized
    c = client(tp2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs must be from 0 to 20"):
        c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="n must be at most 128"):
        c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, n=129)
    assert c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2).usage.completion_tokens >= 1


@pytest.mark.parametrize("content, content_type, message", [
    (b'{"model": "tiny", "prompt": "caf\xe9"}', "application/json", "the body is not valid UTF-8 (byte 32"),
    (b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "application/json", "nested too deeply"),
    (b'{"model": "tiny", "prompt": "Hi", "n": ' + b"1" * 5000 + b"}", "application/json", "cannot be read as JSON"),
    (b'{"model": "tiny", "prompt": "Hi"', "application/json", "the body is not valid JSON"),
    (b'["model", "tiny"]', "application/json", "the body must be a JSON object"),
    (b"", "application/json", "the body is empty"),
    (b'{"model": "tiny", "prompt": "Hi"}', "text/plain", "the body must be JSON, sent with Content-Type: application/json"),
    (b"model=tiny&prompt=Hi", "application/x-www-form-urlencoded", "the body must be JSON"),
])
def test_malformed_bodies_get_openai_errors_and_the_server_goes_on(tp2, content, content_type, message):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": content_type}
    r = httpx.post(tp2.url + "/v1/completions", content=content, headers=headers, timeout=60)
    assert r.status_code == 400 and "detail" not in r.json(), r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error", error
    assert client(tp2).completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_unknown_paths_and_methods_get_openai_errors(tp2):
    r = httpx.get(tp2.url + "/v2/models")
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("there is no /v2/models")
    r = httpx.get(tp2.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and r.json()["error"]["message"] == "GET is not allowed on /v1/completions: use POST"


def test_the_packaged_model_serves_completions_and_chats_as_a_scene():
    "Completions streamed and whole agree; a chat is the completion of its template's scene (Hamlet asks, Horatio answers)."
    with ServerProcess() as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        name = c.models.list().data[0].id
        whole = c.completions.create(model=name, prompt="ROMEO.\n", max_tokens=30, temperature=0)
        streamed = "".join(ch.choices[0].text for ch in
                           c.completions.create(model=name, prompt="ROMEO.\n", max_tokens=30, temperature=0, stream=True))
        assert streamed == whole.choices[0].text and whole.choices[0].text.strip()
        ask = [{"role": "user", "content": "What news, my lord?"}]
        chat = c.chat.completions.create(model=name, messages=ask, max_tokens=24, temperature=0, stop=["\n\n"])
        scene = c.completions.create(model=name, prompt="HAMLET.\nWhat news, my lord?\n\nHORATIO.\n", max_tokens=24,
                                     temperature=0, stop=["\n\n"])
        assert chat.choices[0].message.content == scene.choices[0].text and scene.choices[0].text.strip()
        assert c.completions.create(model=name, prompt="JULIET.\n", max_tokens=3).usage.completion_tokens >= 1


def test_a_model_without_a_chat_template_refuses_chat_in_https_words(no_template):
    with ServerProcess("--model", str(no_template), "--max-model-len", "256", "--served-model-name", "tiny") as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError, match="model 'tiny' has no chat template: use "
                           "/v1/completions") as refused:
            c.chat.completions.create(model="tiny", messages=HELLO)
        assert "/tmp" not in str(refused.value) and "generate()" not in str(refused.value)  # HTTP's words, no paths


def engine_processes(server_pid: int) -> tuple[int, list[int]]:
    "The server's engine-core process and the core's worker ranks."
    cores = rank_processes(server_pid)
    assert len(cores) == 1, cores
    return cores[0], rank_processes(cores[0])


@pytest.mark.parametrize("how, status", [("SIGTERM", 0), ("Ctrl-C", 130)])
def test_a_signal_mid_stream_ends_the_stream_stops_the_server_and_leaves_nothing(chat_ckpt, how, status):
    server = ServerProcess("--model", str(chat_ckpt), "--tp", "2", "--max-model-len", "256")
    pid = server.proc.pid
    try:
        core, ranks = engine_processes(pid)
        assert len(ranks) == 1 and shm_segments(core)
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"model": str(chat_ckpt), "prompt": "Go on", "max_tokens": 200, "stream": True,
                                "ignore_eos": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            if how == "SIGTERM":
                server.proc.send_signal(signal.SIGTERM)
            else:  # a terminal's Ctrl-C reaches the whole process group: the server, its engine core and its worker
                os.killpg(pid, signal.SIGINT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "the engine has shut down" in rest[-2]  # ended, not cut
        assert server.proc.wait(60) == status
    finally:
        server.stop(signal.SIGKILL)
    assert gone(pid) and gone(core) and all(gone(r) for r in ranks), "".join(server.log)
    assert not shm_segments(pid) and not shm_segments(core), "".join(server.log)


def test_an_engine_core_killed_mid_stream_ends_the_streams_and_the_server_exits_non_zero(chat_ckpt):
    server = ServerProcess("--model", str(chat_ckpt), "--tp", "2", "--max-model-len", "256")
    pid = server.proc.pid
    try:
        core, ranks = engine_processes(pid)
        body = {"model": str(chat_ckpt), "prompt": "Go on", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "engine-core process died" in rest[-2], rest[-3:]  # ended, not cut
        try:  # for a moment, new requests hear why (then the server is gone)
            late = httpx.post(server.url + "/v1/completions", json=body | {"stream": False}, timeout=10)
            assert late.status_code == 503 and "the engine has stopped" in late.json()["error"]["message"]
        except httpx.TransportError:
            pass
        assert server.proc.wait(30) == 1  # non-zero: a supervisor restarts it
        assert time.monotonic() - killed < 15
    finally:
        server.stop(signal.SIGKILL)
    assert wait_until(lambda: all(gone(r) for r in ranks), 10), "".join(server.log)
    assert gone(pid) and not shm_segments(pid) and not shm_segments(core), "".join(server.log)
    assert "the server exits with status 1" in "".join(server.log)


def test_64_streams_at_tp1_equal_the_offline_greedy_text(chat_ckpt):
    prompts = [f"Reader {i} asks" for i in range(64)]
    body = {"model": "tiny", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}

    async def streamed(http, prompt):
        async with http.stream("POST", "/v1/completions", json=body | {"prompt": prompt}) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        return "".join(ch["text"] for line in lines[:-1] for ch in json.loads(line[len("data: "):])["choices"])

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=100)) as http:
            return await asyncio.gather(*(streamed(http, p) for p in prompts))

    with ServerProcess("--model", str(chat_ckpt), "--max-model-len", "256", "--served-model-name", "tiny") as server:
        got = asyncio.run(run(server.url))
    with LLM(chat_ckpt, max_model_len=256) as llm:
        offline = [o.text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                                use_tqdm=False)]
    assert got == offline


def test_the_api_key_given_on_the_command_line_is_not_shown_by_ps(tp2):
    "The key is overwritten on the server's command line at start, with a warning; it still guards the routes."
    import subprocess
    shown = subprocess.run(["ps", "-ww", "-o", "args=", "-g", str(tp2.proc.pid)], capture_output=True, text=True).stdout
    assert "minivllm serve" in shown and "--api-key" in shown and KEY not in shown, shown  # every process of the server
    assert "minivllm: warning: --api-key puts the key on the command line" in "".join(tp2.log)
    assert httpx.get(tp2.url + "/v1/models").status_code == 401
    assert httpx.get(tp2.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def no_template(chat_ckpt, tmp_path_factory):
    "The tiny chat checkpoint without its chat template."
    import shutil
    folder = shutil.copytree(chat_ckpt, tmp_path_factory.mktemp("plain") / "ckpt")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("given", ["file", "inline"])
def test_a_chat_template_given_to_serve_renders_chats_and_tokenize(no_template, tmp_path, given):
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    template = str(tmp_path / "chat.jinja") if given == "file" else TEMPLATE
    with ServerProcess("--model", str(no_template), "--max-model-len", "256", "--served-model-name", "tiny",
                       "--chat-template", template) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        tokens = http.post("/tokenize", json={"messages": HELLO})
        assert tokens.status_code == 200, tokens.text
        text = http.post("/detokenize", json={"tokens": tokens.json()["tokens"]}).json()["prompt"]
        assert text.endswith("[user] Say something.\n[assistant] "), text
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == tokens.json()["count"]


def test_a_prompt_the_server_refuses_leaves_no_library_warning_in_its_log(tp2):
    "A prompt past the tokenizer's own limit is the engine's 400 (max_model_len), not also a transformers warning."
    before = len(tp2.log)
    r = httpx.post(tp2.url + "/v1/completions", json={"model": "tiny", "prompt": "word " * 1500},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and "but max_model_len is 256" in r.json()["error"]["message"], r.text
    assert not any("transformers" in line or "Token indices" in line for line in tp2.log[before:]), tp2.log[before:]


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"]}


def test_structured_outputs_on_both_routes_and_bad_constraints_are_400s(tp2):
    "OpenAI's response_format and vLLM's structured_outputs constrain chats and completions, streamed or whole."
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    c = client(tp2)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=100, temperature=0.8, seed=1,
                                     response_format=fmt)
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    whole = c.completions.create(model="tiny", prompt="Yes or no?", max_tokens=20, temperature=0,
                                 extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert whole.choices[0].text in ("yes", "no") and whole.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="A code:", max_tokens=20, temperature=1.0, seed=2, stream=True,
        extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}}) if ch.choices)
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", streamed), streamed
    bad = [(dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
            "structured_outputs", "does not compile"),
           (dict(response_format={"type": "xml"}), "response_format", "must be 'text', 'json_object' or 'json_schema'"),
           (dict(extra_body={"structured_outputs": {"regex": "(a"}}), "structured_outputs", "does not compile"),
           (dict(extra_body={"structured_outputs": {"choice": []}}), "structured_outputs", "non-empty list")]
    for extra, param, said in bad:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, **extra)
        assert e.value.body["param"] == param and said in e.value.body["message"], e.value.body
    assert c.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0).choices[0].text is not None
