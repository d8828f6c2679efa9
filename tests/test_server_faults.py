"""No request can stop `minivllm serve`: values the engine cannot hold, a 100,000-prompt request beside normal ones,
clients that leave, 1,000 failing requests, a stopped engine core, a killed API server, a quantized checkpoint.
Each against real server processes (and the engine core's own socket), as a fault probe would try them."""
import asyncio
import json
import os
import signal
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
from minivllm.testing import (BAD_REQUEST_VALUES as BAD_VALUES, ServerProcess, engine_idle_after, gone, rank_processes,
                              rss_mib, server_metrics as metrics, tcp_listeners, wait_until)

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
