"""No request can stop `minivllm serve`: values the engine cannot hold, a 100,000-prompt request beside normal ones,
clients that leave, 1,000 failing requests, a stopped engine core, a killed API server, a quantized checkpoint.
Each against real server processes (and the engine core's own socket), as a fault probe would try them."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import httpx
import msgspec
import pytest

from minivllm import SamplingParams
from minivllm.distributed import free_port, process_state
from minivllm.serve.core import AddRequest, EngineCoreProcess, Ping, Pong, Rejected, StepOutputs
from minivllm.bench.workload import ServerProcess
from minivllm.testing import (BAD_REQUEST_VALUES as BAD_VALUES, engine_idle_after, gone, rank_processes, rss_mib,
                              server_metrics as metrics, tcp_listeners, wait_until)

@pytest.fixture(scope="module")
def server(chat_ckpt):
    "A TP=1 server of the tiny chat checkpoint that takes batches of up to 100,000 prompts and 150,000 queued tokens."
    with ServerProcess("--model", str(chat_ckpt), "--max-model-len", "256", "--served-model-name", "tiny",
                       "--max-prompts-per-request", "100000", "--max-queued-tokens", "150000") as s:
        yield s


def post_raw(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    "POST `body` as JSON text that Python's json writes (a lone surrogate as its \\ud800 escape, as any client may)."
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def test_every_bad_value_is_a_400_naming_its_field_and_the_next_request_is_served_within_1s(server):
    good = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.Client(base_url=server.url, timeout=30) as client:  # one keep-alive connection for all of them
        def refused(path, body, param, said):
            r = post_raw(client, path, body)
            assert r.status_code == 400, (path, body, r.text)
            error = r.json()["error"]
            assert said in error["message"] and error["type"] == "invalid_request_error", (path, body, error)
            assert param is None or error["param"] == param, (path, body, error)
            assert r.headers.get("connection") != "close", (path, body)  # the connection is kept
            start = time.monotonic()
            assert client.post("/v1/completions", json=good).status_code == 200, body
            assert time.monotonic() - start < 1.0, body

        for extra, param, said in BAD_VALUES:
            refused("/v1/completions", good | extra, param, said)
            if sampling := {k: v for k, v in extra.items() if k not in ("prompt", "logprobs")}:
                refused("/v1/chat/completions", chat | sampling, param, said)
        refused("/v1/chat/completions", chat | {"messages": [{"role": "user", "content": "\ud800"}]}, "messages",
                "messages[0].content is not valid Unicode")
    assert server.proc.poll() is None


def test_the_engine_core_refuses_bad_values_on_its_own_socket_and_serves_on(chat_ckpt):
    "What no front end should send, written straight into the core's inbox: each request refused alone."
    encode = msgspec.msgpack.Encoder().encode
    with EngineCoreProcess(dict(model=str(chat_ckpt), max_model_len=256)) as core:
        sent = 0
        raw_only = [({"temperature": -1.0}, 0, 0), ({"top_p": float("nan")}, 0, 0), ({"n": 0}, 0, 0),
                    ({"logprobs": 21}, 0, 0), ({"prompt": [-1]}, 0, 0), ({"prompt": []}, 0, 0),
                    ({"prompt": [1] * 300}, 0, 0), ({"max_tokens": 300}, 0, 0)]
        for extra, _, _ in BAD_VALUES + raw_only:
            fields = {k: v for k, v in extra.items() if k != "prompt"}
            prompt = extra.get("prompt", [1, 2, 3])
            try:
                raw = encode(["add", f"bad{sent}", prompt if isinstance(prompt, list) else [1], fields, True])
            except (OverflowError, TypeError, UnicodeEncodeError):  # MessagePack cannot carry it (2**80, a lone surrogate)
                continue
            if fields or isinstance(prompt, list):
                core.inbox.send(raw)
                sent += 1
        core.inbox.send(b"\xc1 not a message")
        refused = []
        while len(refused) < sent:
            message = core.receive(timeout_s=60)
            assert isinstance(message, Rejected), message
            refused.append(message)
        assert sorted(m.request_id for m in refused) == sorted(f"bad{i}" for i in range(sent))
        assert sent == 16, sent  # 8 of the probe's values can be sent at all, and 8 more
        core.send(Ping(5))
        assert core.receive(timeout_s=60) == Pong(5)
        core.send(AddRequest("good", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
        tokens = []
        while len(tokens) < 4:
            message = core.receive(timeout_s=60)
            assert isinstance(message, StepOutputs)
            tokens += [t for d in message.deltas for t in d.token_ids]
        assert core.process.is_alive()


def test_1000_failing_requests_leave_the_servers_memory_flat(server):
    "The probe's leak: failing requests with n=128 and long prompts. RSS of the API server within 20 MiB after 1,000."
    prompt = list(range(1, 201))
    failing = [{"n": 128, "prompt": prompt, "seed": 2**80}, {"n": 128, "prompt": prompt, "max_tokens": 2**64},
               {"n": 128, "prompt": prompt, "max_tokens": 100}, {"n": 128, "prompt": "\ud800"},
               {"n": 128, "prompt": [prompt, prompt + [99999]]}, {"n": 128, "prompt": prompt, "temperature": 3.5e38}]

    async def send(http, count):
        for i in range(count):
            body = {"model": "tiny"} | failing[i % len(failing)]
            r = await http.post("/v1/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text

    async def run(count):
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            await asyncio.gather(*(send(http, count // 8) for _ in range(8)))

    asyncio.run(run(200))  # warm: allocators, caches and imports settle
    before = rss_mib(server.proc.pid)
    asyncio.run(run(1000))
    after = rss_mib(server.proc.pid)
    assert after - before < 20, (before, after)
    assert httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_normal_requests_are_served_beside_a_100000_prompt_request_which_ends_when_its_client_leaves(server):
    url = server.url
    big = {"model": "tiny", "prompt": [[i % 200 + 1] for i in range(100_000)], "max_tokens": 16, "ignore_eos": True}
    normal = {"model": "tiny", "prompt": "Hello", "max_tokens": 16, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as big_client, \
                   httpx.AsyncClient(base_url=url, timeout=120) as http:
            r = await http.post("/v1/completions", json=big | {"prompt": big["prompt"] + [[1]]})
            assert r.status_code == 400 and "at most 100,000 per request" in r.json()["error"]["message"], r.text
            task = asyncio.create_task(big_client.post("/v1/completions", json=big))
            assert await asyncio.to_thread(wait_until, lambda: metrics(url)["minivllm_num_requests_running"] > 0, 60)
            r = await http.post("/v1/completions", json={"model": "tiny", "prompt": [[1]] * 60_000, "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text  # 100,000 + 60,000 > 150,000
            assert r.json()["error"]["type"] == "rate_limit_error"
            latencies = []

            async def one():
                start = time.perf_counter()
                r = await http.post("/v1/completions", json=normal)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
                latencies.append(time.perf_counter() - start)

            end = time.monotonic() + 6
            while time.monotonic() < end:
                await asyncio.gather(*(one() for _ in range(4)))
            assert not task.done()  # the big one still runs: everyone was served beside it
            task.cancel()
            await big_client.aclose()  # its client goes away
            return sorted(latencies), await asyncio.to_thread(engine_idle_after, url, time.monotonic(), 10)

    latencies, freed_after = asyncio.run(run())
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    assert p99 < 2.0, latencies
    assert freed_after is not None and freed_after < 1.0, freed_after  # every one of its prompts aborted within 1 s


def test_health_is_503_while_the_engine_core_is_stopped_and_200_again_after(server):
    [core] = rank_processes(server.proc.pid)
    assert httpx.get(server.url + "/health").status_code == 200
    os.kill(core, signal.SIGSTOP)
    try:
        assert wait_until(lambda: process_state(core) == "stopped", 5)  # the kernel takes a moment
        start = time.monotonic()
        r = httpx.get(server.url + "/health", timeout=30)
        assert r.status_code == 503 and f"the engine core (pid {core}) is stopped" in r.json()["error"]["message"]
        assert time.monotonic() - start < 1.0
    finally:
        os.kill(core, signal.SIGCONT)
    assert wait_until(lambda: httpx.get(server.url + "/health", timeout=30).status_code == 200, 10)


def test_a_killed_api_server_leaves_no_socket_folder(chat_ckpt, tmp_path):
    "SIGKILL gives the API server no chance to clean up: its engine core, which outlives it, removes the folder."
    server = ServerProcess("--model", str(chat_ckpt), "--max-model-len", "256", env={"TMPDIR": str(tmp_path)})
    try:
        [core] = rank_processes(server.proc.pid)
        assert [p.name[:14] for p in tmp_path.iterdir()] == ["minivllm-core-"]
        server.proc.kill()
        server.proc.wait(30)
        assert wait_until(lambda: gone(core), 10), "".join(server.log)
        assert list(tmp_path.iterdir()) == []
    finally:
        server.stop(signal.SIGKILL)


def test_a_checkpoint_with_integer_weights_is_refused_at_start_in_one_line(chat_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil
    import torch
    shutil.copytree(chat_ckpt, tmp_path / "int8")
    tensors = load_file(tmp_path / "int8" / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].mul(100).to(torch.int8)
    save_file(tensors, tmp_path / "int8" / "model.safetensors", metadata={"format": "pt"})
    r = subprocess.run([sys.executable, "-m", "minivllm", "serve", str(tmp_path / "int8"), "--port", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert f"tensor {name!r} is int8" in lines[-1] and "floating-point weights" in lines[-1], r.stderr
    assert "Traceback" not in r.stderr


def flood_store(port: int, writes: int = 150, size: int = 4 << 20) -> int:
    "The trust probe's flood: `writes` values of `size` random bytes under new keys in a store at 127.0.0.1:`port`; how many it took."
    import torch.distributed as dist
    taken = 0
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=3))
        for i in range(writes):
            client.set(f"junk/{i}", os.urandom(size))
            taken += 1
    except RuntimeError:  # refused (nothing listens), or the connection was closed
        pass
    return taken


def test_a_flood_of_the_rendezvous_port_while_serving_at_tp2_leaves_the_engine_core_flat(chat_ckpt):
    "150 values of 4 MiB under new keys at the rendezvous port (the probe's 680 -> 1,288 MiB): no store listens once the ranks have started."
    port = free_port()
    with ServerProcess("--model", str(chat_ckpt), "--max-model-len", "256", "--served-model-name", "tiny", "--tp", "2",
                       "--master-port", str(port)) as server:
        [core] = rank_processes(server.proc.pid)
        good = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
        assert httpx.post(server.url + "/v1/completions", json=good, timeout=60).status_code == 200
        before = rss_mib(core)
        assert flood_store(port) == 0
        after = rss_mib(core)
        assert after - before < 20, (before, after)
        assert not any(a.endswith(f":{port}") for a in tcp_listeners([core, *rank_processes(core)]))
        assert httpx.post(server.url + "/v1/completions", json=good, timeout=60).status_code == 200


# --- fields typed as OpenAI types them; fields minivllm cannot honour refused -------------------------------------------

CHAT = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
GOOD = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
NAN = float("nan")  # json.dumps writes NaN, which the server's JSON reader takes


@pytest.mark.parametrize("path, body, param, said", [
    # the probe's: a content part's text that is not a string was a 500
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]},
     "messages.0.content", "must be a string, or a list of text parts"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": ["a"]}]}, "messages.0.content",
     "must be a string, or a list of text parts"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]}, "messages.0.content",
     "must be a string, or a list of text parts"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
     "a text part without its text"),
    # strict types, as OpenAI's schema: no "yes" for a boolean, no true for a token id, no 2.0 for a count
    ("/v1/completions", GOOD | {"stream": "yes"}, "stream", "valid boolean"),
    ("/v1/chat/completions", CHAT | {"stream": "yes"}, "stream", "valid boolean"),
    ("/v1/chat/completions", CHAT | {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
     "valid boolean"),
    ("/v1/completions", GOOD | {"prompt": [True]}, "prompt", "a list of token ids (integers)"),
    ("/v1/completions", GOOD | {"prompt": [[1, True]]}, "prompt", "a list of token ids (integers)"),
    ("/v1/completions", GOOD | {"max_tokens": 2.0}, "max_tokens", "valid integer"),
    ("/detokenize", {"tokens": [True]}, "tokens.0", "valid integer"),
    ("/v1/completions", GOOD | {"best_of": "abc"}, "best_of", "valid integer"),
    ("/v1/completions", GOOD | {"best_of": NAN}, "best_of", "valid integer"),
    # fields that cannot be honoured: refused, never ignored
    ("/v1/completions", GOOD | {"best_of": 3}, "best_of", "best_of > n is not supported"),
    ("/v1/completions", GOOD | {"n": 2, "best_of": 1}, "best_of", "best_of must be at least n"),
    ("/v1/chat/completions", CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "tools is not supported: minivllm does not call tools"),
    ("/v1/chat/completions", CHAT | {"tool_choice": "required"}, "tool_choice", "is not supported"),
    ("/v1/chat/completions", CHAT | {"functions": [{"name": "f"}]}, "functions", "is not supported"),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "xml"}}, "response_format",
     "response_format type must be 'text', 'json_object' or 'json_schema'"),
    ("/v1/completions", GOOD | {"suffix": "The end."}, "suffix", "suffix is not supported"),
    ("/v1/completions", GOOD | {"stop_token_ids": [10**9]}, "stop_token_ids", "out of range for a vocabulary of 4096"),
    ("/v1/chat/completions", CHAT | {"stop_token_ids": [4096]}, "stop_token_ids", "out of range for a vocabulary"),
    # max_completion_tokens as OpenAI defines it: the bound, 0 refused (not max_tokens' fallback), no disagreement
    ("/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "max_tokens"} | {"max_completion_tokens": 0},
     "max_completion_tokens", "max_tokens must be an integer >= 1, got 0"),
    ("/v1/chat/completions", CHAT | {"max_completion_tokens": 0}, "max_completion_tokens", "disagree"),
])
def test_fields_are_typed_as_openai_types_them_and_what_cannot_be_honoured_is_refused(server, path, body, param, said):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = post_raw(client, path, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert said in error["message"] and error["param"] == param and error["type"] == "invalid_request_error", error
        assert client.post("/v1/completions", json=GOOD).status_code == 200


def test_max_completion_tokens_bounds_the_reply_and_best_of_equal_to_n_is_served(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        chat = {k: v for k, v in CHAT.items() if k != "max_tokens"} | {"ignore_eos": True}
        for given in ({"max_completion_tokens": 3}, {"max_completion_tokens": 3, "max_tokens": 3}, {"max_tokens": 3}):
            r = client.post("/v1/chat/completions", json=chat | given)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, (given, r.text)
        r = client.post("/v1/completions", json=GOOD | {"n": 2, "best_of": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]
        joined = client.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]}).json()
        plain = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi there"}]}).json()
        assert joined["tokens"] == plain["tokens"]


@pytest.mark.parametrize("path, body", [("/v1/completions", GOOD), ("/v1/chat/completions", CHAT | {"stream": True})])
def test_a_request_while_the_engine_core_is_stopped_is_a_503_within_the_health_timeout(server, path, body):
    "Not a wait until the client gives up: while its first output is late, the request looks at the engine's processes."
    from minivllm.serve.server import HEALTH_TIMEOUT_S
    [core] = rank_processes(server.proc.pid)
    os.kill(core, signal.SIGSTOP)
    try:
        assert wait_until(lambda: process_state(core) == "stopped", 5)
        start = time.monotonic()
        r = httpx.post(server.url + path, json=body, timeout=HEALTH_TIMEOUT_S + 5)
        took = time.monotonic() - start
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert f"the engine core (pid {core}) is stopped" in error["message"] and error["type"] == "server_error", error
        assert took < HEALTH_TIMEOUT_S, took
    finally:
        os.kill(core, signal.SIGCONT)
    assert httpx.post(server.url + "/v1/completions", json=GOOD, timeout=30).status_code == 200
    assert engine_idle_after(server.url, time.monotonic(), 10) is not None  # nothing of the refused request runs on
    m = metrics(server.url)
    assert m["minivllm_kv_cache_blocks_used"] == 0 and m["minivllm_num_requests_waiting"] == 0, m


# --- slow clients: a request's head and body within their time limits, a cap on open connections -----------------------

@pytest.fixture(scope="module")
def guarded(chat_ckpt):
    "A server whose requests' heads and bodies must arrive within 2 s each, holding at most 8 connections."
    with ServerProcess("--model", str(chat_ckpt), "--max-model-len", "256", "--served-model-name", "tiny",
                       "--header-timeout", "2", "--body-timeout", "2", "--max-connections", "8") as s:
        s.address = ("127.0.0.1", int(s.url.rsplit(":", 1)[1]))
        yield s


def trickle(address, first: bytes, drip: bytes, seconds: float) -> tuple[bytes, float | None]:
    "Send `first`, then `drip` a byte every 0.1 s; what the server sent, and when it closed the connection (None: not within `seconds`)."
    with socket.create_connection(address) as s:
        s.sendall(first)
        s.settimeout(0.1)
        got, start, drops = b"", time.monotonic(), iter(drip)
        while time.monotonic() - start < seconds:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                try:
                    s.send(bytes([next(drops, 32)]))
                except OSError:  # closed at the server's end
                    return got, time.monotonic() - start
                continue
            except ConnectionResetError:
                return got, time.monotonic() - start
            if not chunk:
                return got, time.monotonic() - start
            got += chunk
        return got, None


@pytest.mark.parametrize("part", ["head", "body"])
def test_a_client_that_trickles_its_request_gets_a_408_and_its_connection_closed(guarded, part):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: tiny\r\nContent-Type: application/json\r\n"
    if part == "head":
        first, drip = head, b"X-Slow: " + b"a" * 1000
    else:
        first, drip = head + b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny\"", b" " * 1000
    got, closed_after = trickle(guarded.address, first, drip, 6)
    assert closed_after is not None and closed_after < 3, (got, closed_after)  # the limit is 2 s
    assert got.startswith(b"HTTP/1.1 408 "), got
    assert f"the request's {part} did not arrive within 2 s".encode() in got, got
    assert httpx.post(guarded.url + "/v1/completions", json=GOOD, timeout=30).status_code == 200


def read_until_closed(s: socket.socket, timeout_s: float) -> bytes:
    "What the server sends on `s` until it closes the connection (`socket.timeout` past `timeout_s`)."
    s.settimeout(timeout_s)
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


def test_a_connection_past_the_cap_is_refused_at_once_and_served_once_the_slow_ones_are_closed(guarded):
    held = [socket.create_connection(guarded.address) for _ in range(8)]  # they send nothing
    try:
        time.sleep(0.3)  # the server has taken them
        start = time.monotonic()
        with socket.create_connection(guarded.address) as extra:
            got = read_until_closed(extra, 5)
        assert time.monotonic() - start < 1, time.monotonic() - start
        assert got.startswith(b"HTTP/1.1 503 ") and b"holds 8 connections, its most (max_connections)" in got, got
        for s in held:  # the silent ones are closed by the head's time limit
            assert read_until_closed(s, 5).startswith(b"HTTP/1.1 408 ")
    finally:
        for s in held:
            s.close()
    assert httpx.post(guarded.url + "/v1/completions", json=GOOD, timeout=30).status_code == 200
    assert guarded.proc.poll() is None
