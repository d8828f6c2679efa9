"""A fault probe of `minivllm serve`: what one client can do to everyone else's service, measured.

    python tools/fault_probe.py [--tp 2] [--model PATH] [--out probe.json]

Starts a server (the packaged model unless --model), then: (1) sends every value of `BAD_REQUEST_VALUES` to both
completion routes, each followed by a normal request, timed; (2) sends 1,000 failing requests (n=128, long prompts)
and reads the API server's RSS before and after; (3) runs a request of 100,000 one-token prompts while clients send
normal requests (16 tokens each, four at a time) for `--seconds`, then leaves, and times how long until the engine
holds nothing of it; (4) stops the engine core with SIGSTOP and times /health's 503. Prints one table, writes JSON.
"""
import argparse
import asyncio
import json
import os
import platform
import signal
import time
from pathlib import Path

import httpx

from minivllm.distributed import process_state
from minivllm.testing import BAD_REQUEST_VALUES, ServerProcess, engine_idle_after, rank_processes, rss_mib, wait_until
from minivllm.testing import server_metrics as metrics


def post_raw(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def bad_values(url: str, model: str) -> dict:
    "Every bad value on both routes: how many got a 4xx, and the slowest normal request right after one."
    good = {"model": model, "prompt": "ROMEO.", "max_tokens": 2}
    chat = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    statuses, slowest = [], 0.0
    with httpx.Client(base_url=url, timeout=60) as client:
        for fields, _, _ in BAD_REQUEST_VALUES:
            bodies = [("/v1/completions", good | fields)]
            if sampling := {k: v for k, v in fields.items() if k not in ("prompt", "logprobs")}:
                bodies.append(("/v1/chat/completions", chat | sampling))
            for path, body in bodies:
                statuses.append(post_raw(client, path, body).status_code)
                start = time.perf_counter()
                assert client.post("/v1/completions", json=good).status_code == 200
                slowest = max(slowest, time.perf_counter() - start)
    return dict(sent=len(statuses), answered_4xx=sum(400 <= s < 500 for s in statuses),
                slowest_next_request_s=round(slowest, 3))


def failing_requests(url: str, pid: int, model: str, count: int = 1000) -> dict:
    "RSS of the API server before and after `count` failing requests of the probe's kinds."
    prompt = list(range(1, 201))
    failing = [{"n": 128, "prompt": prompt, "seed": 2**80}, {"n": 128, "prompt": prompt, "max_tokens": 2**64},
               {"n": 128, "prompt": prompt, "temperature": 3.5e38}, {"n": 128, "prompt": "\ud800"},
               {"n": 128, "prompt": [prompt, prompt + [10**9]]}, {"n": 128, "prompt": prompt * 50}]

    async def run(n):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async def send(k):
                for i in range(k):
                    r = await http.post("/v1/completions", content=json.dumps({"model": model} | failing[i % len(failing)]),
                                        headers={"Content-Type": "application/json"})
                    assert 400 <= r.status_code < 500, r.text
            await asyncio.gather(*(send(n // 8) for _ in range(8)))

    asyncio.run(run(200))
    before = rss_mib(pid)
    asyncio.run(run(count))
    after = rss_mib(pid)
    return dict(requests=count, rss_before_mib=round(before, 1), rss_after_mib=round(after, 1),
                growth_mib=round(after - before, 1))


def huge_request(url: str, model: str, seconds: float, num_prompts: int = 100_000) -> dict:
    "Normal requests' latency beside a request of `num_prompts` one-token prompts, and how fast it ends once its client leaves."
    big = {"model": model, "prompt": [[i % 200 + 1] for i in range(num_prompts)], "max_tokens": 16, "ignore_eos": True}
    normal = {"model": model, "prompt": "ROMEO.", "max_tokens": 16, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=600) as big_client, \
                   httpx.AsyncClient(base_url=url, timeout=600) as http:
            task = asyncio.create_task(big_client.post("/v1/completions", json=big))
            await asyncio.to_thread(wait_until, lambda: metrics(url)["minivllm_num_requests_running"] > 0, 120)
            latencies = []

            async def one():
                start = time.perf_counter()
                r = await http.post("/v1/completions", json=normal)
                assert r.status_code == 200, r.text
                latencies.append(time.perf_counter() - start)

            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await asyncio.gather(*(one() for _ in range(4)))
            tokens = metrics(url)["minivllm_generation_tokens_total"]
            task.cancel()
            await big_client.aclose()
            return sorted(latencies), await asyncio.to_thread(engine_idle_after, url, time.monotonic(), 60), tokens

    latencies, freed_s, tokens = asyncio.run(run())
    pick = lambda q: round(latencies[min(len(latencies) - 1, int(len(latencies) * q))], 3)
    return dict(prompts=num_prompts, normal_requests=len(latencies), p50_s=pick(0.5), p99_s=pick(0.99),
                max_s=round(latencies[-1], 3), batch_tokens_meanwhile=int(tokens),
                freed_after_leaving_s=None if freed_s is None else round(freed_s, 3))


def stopped_core(url: str, pid: int) -> dict:
    "/health while the engine core is stopped (SIGSTOP), and after SIGCONT."
    [core] = rank_processes(pid)
    os.kill(core, signal.SIGSTOP)
    try:
        wait_until(lambda: process_state(core) == "stopped", 5)
        start = time.perf_counter()
        status = httpx.get(url + "/health", timeout=60).status_code
        seconds = time.perf_counter() - start
    finally:
        os.kill(core, signal.SIGCONT)
    wait_until(lambda: httpx.get(url + "/health", timeout=60).status_code == 200, 30)
    return dict(health_while_stopped=status, answered_in_s=round(seconds, 3),
                health_after=httpx.get(url + "/health", timeout=60).status_code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: the packaged model)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=10.0, help="how long normal requests run beside the huge one")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    args = ["--tp", str(a.tp), "--max-prompts-per-request", "100000", "--max-queued-tokens", "200000",
            "--served-model-name", "probe"] + (["--model", a.model] if a.model else [])
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    with ServerProcess(*args) as server:
        results = dict(cpu=cpu, cores=os.cpu_count(), tp=a.tp, model=a.model or "packaged",
                       load_at_start=round(os.getloadavg()[0], 2),
                       bad_values=bad_values(server.url, "probe"),
                       failing_requests=failing_requests(server.url, server.proc.pid, "probe"),
                       huge_request=huge_request(server.url, "probe", a.seconds),
                       stopped_core=stopped_core(server.url, server.proc.pid),
                       server_alive=server.proc.poll() is None)
    print(f"fault probe of minivllm serve ({results['model']}, TP={a.tp}) on {cpu}, load {results['load_at_start']}")
    for part in ("bad_values", "failing_requests", "huge_request", "stopped_core"):
        print(f"  {part:17} " + ", ".join(f"{k} {v}" for k, v in results[part].items()))
    print(f"  server alive at the end: {results['server_alive']}")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
