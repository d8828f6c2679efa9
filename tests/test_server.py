"""`minivllm serve` as users meet it: the official openai client against a real server process, 64 streaming
clients at once at TP=2, clients that drop mid-stream, bad requests, and SIGTERM leaving nothing behind."""
import asyncio
import json
import os
import signal

import httpx
import openai
import pytest

from minivllm import LLM, SamplingParams
from minivllm.testing import ServerProcess, gone, make_chat_checkpoint, rank_processes, shm_segments, wait_until

KEY = "test-key"
HELLO = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def tp2(chat_ckpt):
    "A TP=2 server of the tiny chat checkpoint, as 'tiny', behind an API key."
    with ServerProcess("--model", str(chat_ckpt), "--tp", "2", "--max-model-len", "256", "--api-key", KEY,
                       "--served-model-name", "tiny") as server:
        yield server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def metrics(server) -> dict[str, float]:
    "The server's Prometheus samples without labels, by name."
    text = httpx.get(server.url + "/metrics").text
    return {l.split()[0]: float(l.split()[1]) for l in text.splitlines() if l and not l.startswith("#") and "{" not in l}


def test_the_openai_client_gets_completions_and_chats_streamed_and_whole(tp2, chat_ckpt):
    c = client(tp2)
    assert [m.id for m in c.models.list().data] == ["tiny"]
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
        offline = llm.chat(HELLO, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
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
    ({"model": "gpt-5", "prompt": "Hi"}, 400, "is not served here"),
])
def test_bad_completion_requests_get_openai_errors_and_the_server_goes_on(tp2, body, status, message):
    r = httpx.post(tp2.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert client(tp2).completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


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


def test_the_packaged_model_serves_completions_and_refuses_chat_clearly():
    with ServerProcess() as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        name = c.models.list().data[0].id
        whole = c.completions.create(model=name, prompt="ROMEO.\n", max_tokens=30, temperature=0)
        streamed = "".join(ch.choices[0].text for ch in
                           c.completions.create(model=name, prompt="ROMEO.\n", max_tokens=30, temperature=0, stream=True))
        assert streamed == whole.choices[0].text and whole.choices[0].text.strip()
        with pytest.raises(openai.BadRequestError, match="has no chat template"):
            c.chat.completions.create(model=name, messages=HELLO)
        assert c.completions.create(model=name, prompt="JULIET.\n", max_tokens=3).usage.completion_tokens >= 1


@pytest.mark.parametrize("how, status", [("SIGTERM", 0), ("Ctrl-C", 130)])
def test_a_signal_mid_stream_ends_the_stream_stops_the_server_and_leaves_nothing(chat_ckpt, how, status):
    server = ServerProcess("--model", str(chat_ckpt), "--tp", "2", "--max-model-len", "256")
    pid = server.proc.pid
    try:
        ranks = rank_processes(pid)
        assert len(ranks) == 1 and shm_segments(pid)
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"model": str(chat_ckpt), "prompt": "Go on", "max_tokens": 200, "stream": True,
                                "ignore_eos": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            if how == "SIGTERM":
                server.proc.send_signal(signal.SIGTERM)
            else:  # a terminal's Ctrl-C reaches the whole process group: the server and its worker
                os.killpg(pid, signal.SIGINT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "the engine has shut down" in rest[-2]  # ended, not cut
        assert server.proc.wait(60) == status
    finally:
        server.stop(signal.SIGKILL)
    assert gone(pid) and all(gone(r) for r in ranks) and not shm_segments(pid), "".join(server.log)
