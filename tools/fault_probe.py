"""A fault probe of `minivllm serve`: what one client can do to everyone else's service, measured.

    python tools/fault_probe.py [--only NAME ...] [--tp 2] [--model PATH] [--seconds S] [--connections N] [--out probe.json]

Each scenario is a function that returns one row of the table; `--only` runs the ones named. Four share one server
(the packaged model unless --model): (1) `bad_values` sends every value of `BAD_REQUEST_VALUES` to both completion
routes, each followed by a normal request, timed; (2) `failing_requests` sends 1,000 failing requests (n=128, long
prompts) and reads the API server's RSS before and after; (3) `huge_request` runs a request of 100,000 one-token
prompts while clients send normal requests (16 tokens each, four at a time) for `--seconds`, then leaves, and times
how long until the engine holds nothing of it; (4) `stopped_core` stops the engine core with SIGSTOP and times
/health's 503. Four start servers of their own: (5) `stop_list_stall` times normal streamed requests alone and then
beside four requests with n=8 and 10,000 stop strings of 85 characters; (6) `chat_template` serves the packaged
model, which has no chat template, with --chat-template (its text, then a file) and sends a chat completion and a
/tokenize of messages; (7) `idle_rank_death` SIGKILLs rank 1 of an idle TP=2 server and times /health's 503 and the
server's exit, then counts what is left (processes, /dev/shm segments, socket folders); (8) `slow_clients` holds
`--connections` connections that send their headers (or, a tenth of them, their body) one byte a second, and sends a
normal request every 2 s meanwhile. Prints one table, writes JSON; every server it starts is stopped, and whatever a
server leaves behind is counted, then removed.
"""
import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from minivllm.distributed import process_state
from minivllm.bench.workload import ServerProcess
from minivllm.testing import (BAD_REQUEST_VALUES, CHAT_TEMPLATE, engine_idle_after, gone, leftover_segments,
                              rank_processes, rss_mib, shm_segments, wait_until)
from minivllm.testing import server_metrics as metrics

NORMAL = {"model": "probe", "prompt": "ROMEO.", "max_tokens": 16, "ignore_eos": True}  # a normal request: 16 tokens


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


def quantile(latencies: list[float], q: float) -> float | None:
    "The `q` quantile of `latencies` (sorted), rounded to ms; None for none."
    return round(latencies[min(len(latencies) - 1, int(len(latencies) * q))], 3) if latencies else None


async def normal_requests(http: httpx.AsyncClient, model: str, seconds: float, stream: bool = False) -> list[float]:
    "Normal requests (16 tokens each), four at a time, for `seconds`: their latencies, sorted."
    latencies = []

    async def one():
        start = time.perf_counter()
        async with http.stream("POST", "/v1/completions", json=NORMAL | {"model": model, "stream": stream}) as r:
            await r.aread()
            assert r.status_code == 200, r.text
        latencies.append(time.perf_counter() - start)

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.gather(*(one() for _ in range(4)))
    return sorted(latencies)


def huge_request(url: str, model: str, seconds: float, num_prompts: int = 100_000) -> dict:
    "Normal requests' latency beside a request of `num_prompts` one-token prompts, and how fast it ends once its client leaves."
    big = {"model": model, "prompt": [[i % 200 + 1] for i in range(num_prompts)], "max_tokens": 16, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=600) as big_client, \
                   httpx.AsyncClient(base_url=url, timeout=600) as http:
            task = asyncio.create_task(big_client.post("/v1/completions", json=big))
            await asyncio.to_thread(wait_until, lambda: metrics(url)["minivllm_num_requests_running"] > 0, 120)
            latencies = await normal_requests(http, model, seconds)
            tokens = metrics(url)["minivllm_generation_tokens_total"]
            task.cancel()
            await big_client.aclose()
            return latencies, await asyncio.to_thread(engine_idle_after, url, time.monotonic(), 60), tokens

    latencies, freed_s, tokens = asyncio.run(run())
    return dict(prompts=num_prompts, normal_requests=len(latencies), p50_s=quantile(latencies, 0.5),
                p99_s=quantile(latencies, 0.99), max_s=round(latencies[-1], 3), batch_tokens_meanwhile=int(tokens),
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


# --- the scenarios that start servers of their own -------------------------------------------------------------------

def server_args(a: argparse.Namespace, tp: int | None = None) -> list[str]:
    "`minivllm serve`'s arguments for a probe server: the model, the TP size, the name 'probe'."
    return ["--tp", str(tp or a.tp), "--served-model-name", "probe"] + (["--model", a.model] if a.model else [])


def serve_options() -> str:
    "`minivllm serve --help`, to see which options this version has."
    return subprocess.run([sys.executable, "-m", "minivllm", "serve", "--help"], capture_output=True, text=True,
                          timeout=60).stdout


def stop_list_stall(a: argparse.Namespace, stop_strings: int = 10_000, chars: int = 85) -> dict:
    "Normal streamed requests' latency alone, beside four clients sending requests with n=8 one after another, and beside the same four with `stop_strings` stop strings of `chars` characters each."
    caps = ["--max-stop-strings", str(stop_strings), "--max-stop-string-chars", str(chars)]
    has_caps = all(flag in serve_options() for flag in caps[::2])
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " "  # printable, no line breaks
    stops = ["".join(rng.choices(alphabet, k=chars)) for _ in range(stop_strings)]
    plain = NORMAL | {"n": 8, "max_tokens": 32}
    # subtle: encoded once, here: a 0.9 MB body encoded for each request would run on the loop that times the others
    bodies = {"plain": json.dumps(plain).encode(), "stop lists": json.dumps(plain | {"stop": stops}).encode()}

    async def beside(http, body: bytes) -> tuple[list[float], list[tuple[int, float]]]:
        "Normal requests' seconds while four clients send `body` one after another; the four's (status, seconds)."
        answers, stop = [], asyncio.Event()

        async def heavy_client():  # one after another until the phase ends, or until one is refused
            while not stop.is_set():
                start = time.perf_counter()
                status = (await http.post("/v1/completions", content=body,
                                          headers={"Content-Type": "application/json"})).status_code
                answers.append((status, time.perf_counter() - start))
                if status != 200:
                    return

        clients = [asyncio.create_task(heavy_client()) for _ in range(4)]
        normal = await normal_requests(http, "probe", a.seconds or 10, stream=True)
        stop.set()
        await asyncio.gather(*clients)
        return normal, answers

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            alone = await normal_requests(http, "probe", a.seconds or 10, stream=True)
            return alone, *(await beside(http, bodies["plain"])), *(await beside(http, bodies["stop lists"]))

    with ServerProcess(*server_args(a), *(caps if has_caps else [])) as server:
        alone, without, plain_answers, with_stops, answers = asyncio.run(run(server.url))
    ratio = quantile(with_stops, 0.99) / quantile(without, 0.99)
    seconds = sorted(round(s, 3) for _, s in answers)
    return dict(caps="raised to admit them" if has_caps else "not passed (serve --help lists no --max-stop-strings)",
                alone_p99_s=quantile(alone, 0.99), beside_plain_p50_s=quantile(without, 0.5),
                beside_plain_p99_s=quantile(without, 0.99), beside_stop_lists_p50_s=quantile(with_stops, 0.5),
                beside_stop_lists_p99_s=quantile(with_stops, 0.99), p99_ratio=round(ratio, 2), within_1_5x=ratio <= 1.5,
                stop_list_requests=len(answers), stop_list_statuses=sorted({status for status, _ in answers}),
                stop_list_p50_s=quantile(seconds, 0.5),
                plain_p50_s=quantile(sorted(s for _, s in plain_answers), 0.5))


def chat_template(a: argparse.Namespace) -> dict:
    "The packaged model (no chat template) served with --chat-template, as text and as a file: a chat completion's and a /tokenize's status."
    messages = [{"role": "user", "content": "Hi"}]
    row, errors = {}, []
    with tempfile.TemporaryDirectory() as folder:
        file = Path(folder) / "template.jinja"
        file.write_text(CHAT_TEMPLATE)
        for how, template in (("text", CHAT_TEMPLATE), ("file", str(file))):
            try:
                server = ServerProcess("--served-model-name", "probe", "--chat-template", template)
            except RuntimeError as e:  # the template refused at start: its lines say why
                row[f"{how}_chat"] = row[f"{how}_tokenize"] = "no server"
                errors.append(f"{how}: the server did not start: {e.args[0].splitlines()[-1][:120]}")
                continue
            with server:
                for route, body in (("chat", {"messages": messages, "max_tokens": 4}), ("tokenize", {"messages": messages})):
                    r = httpx.post(server.url + ("/v1/chat/completions" if route == "chat" else "/tokenize"),
                                   json={"model": "probe", **body}, timeout=60)
                    row[f"{how}_{route}"] = r.status_code
                    if r.status_code != 200:
                        errors.append(f"{how} {route}: {r.text[:120]}")
    return row | dict(all_200=not errors) | (dict(first_error=errors[0]) if errors else {})


def descendants(pid: int) -> list[int]:
    "Pids of every live process below `pid` (children, their children, ...)."
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return [p for p in found if not gone(p)]


def health(url: str) -> int | None:
    "/health's status, or None when nothing answers."
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def idle_rank_death(a: argparse.Namespace, timeout_s: float = 60.0) -> dict:
    "An idle TP=2 server whose rank 1 is SIGKILLed: seconds until /health answers 503 and until the server exits; what is left."
    before = shm_segments()
    folder = Path(tempfile.mkdtemp(prefix="fault-probe-"))  # the server's TMPDIR: its socket folders
    server = ServerProcess(*server_args(a, tp=2), env={"TMPDIR": str(folder)})
    processes = descendants(server.proc.pid)
    try:
        [core] = rank_processes(server.proc.pid)
        [rank1] = rank_processes(core)
        wait_until(lambda: health(server.url) == 200, 30)
        os.kill(rank1, signal.SIGKILL)
        start, to_503, to_exit = time.monotonic(), None, None
        while time.monotonic() < start + timeout_s and to_exit is None:
            if to_503 is None and health(server.url) == 503:
                to_503 = round(time.monotonic() - start, 2)
            if server.proc.poll() is not None:
                to_exit = round(time.monotonic() - start, 2)
            time.sleep(0.05)
        status = server.proc.poll()
    finally:
        try:
            server.stop(signal.SIGTERM, 30)
        except subprocess.TimeoutExpired:
            server.stop(signal.SIGKILL)
    wait_until(lambda: all(gone(p) for p in processes), 10)
    left = dict(processes=[p for p in processes if not gone(p)], segments=leftover_segments(before, server.proc.pid),
                socket_folders=[p.name for p in folder.iterdir()])
    for pid in left["processes"]:  # the probe leaves nothing behind: what the server left is counted, then removed
        os.kill(pid, signal.SIGKILL)
    for name in left["segments"]:
        (Path("/dev/shm") / name).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    return dict(health_503_after_s=to_503, exited_after_s=to_exit,
                exit_status=status if to_exit is not None else f"still running after {timeout_s:.0f} s: stopped",
                left_processes=len(left["processes"]), left_segments=len(left["segments"]),
                left_socket_folders=len(left["socket_folders"]))


async def slow_connection(host: str, port: int, first: bytes, drip: bytes, end: float) -> str:
    "Send `first`, then `drip` one byte a second until `end` (`time.monotonic()`): 'open', 'answered NNN' or 'closed'."
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return "refused"
    answer = asyncio.ensure_future(reader.read(64))
    try:
        writer.write(first)
        for byte in itertools.cycle(drip):
            await asyncio.wait([answer], timeout=min(1.0, max(0.0, end - time.monotonic())))
            if answer.done():
                data = answer.result()
                return f"answered {data.split()[1].decode()}" if data.startswith(b"HTTP/") else "closed"
            if time.monotonic() >= end:
                return "open"
            writer.write(bytes([byte]))
            await writer.drain()
    except (ConnectionError, OSError):
        return "closed"
    finally:
        answer.cancel()
        writer.close()


def slow_clients(a: argparse.Namespace) -> dict:
    "`--connections` connections that trickle their headers (a tenth: their body) one byte a second: what the server held, and a normal request's latency meanwhile."
    seconds, count = a.seconds or 20, a.connections
    headers = (b"GET /health HTTP/1.1\r\nHost: probe\r\n", b"X-Slow: " + b"a" * 1000)
    body = (b"POST /v1/completions HTTP/1.1\r\nHost: probe\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n", b'{"prompt": "' + b"a" * 1000)

    async def run(url):
        host, port = httpx.URL(url).host, httpx.URL(url).port
        end = time.monotonic() + seconds
        kinds = [body if i % 10 == 9 else headers for i in range(count)]
        slow = [asyncio.create_task(slow_connection(host, port, *kind, end)) for kind in kinds]
        latencies, statuses = [], []
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while time.monotonic() < end - 1:
                start = time.perf_counter()
                try:
                    statuses.append((await http.post("/v1/completions", json=NORMAL)).status_code)
                    latencies.append(time.perf_counter() - start)
                except httpx.HTTPError as e:
                    statuses.append(type(e).__name__)
                await asyncio.sleep(max(0.0, 2 - (time.perf_counter() - start)))
        return await asyncio.gather(*slow), sorted(latencies), statuses

    with ServerProcess(*server_args(a)) as server:
        outcomes, latencies, statuses = asyncio.run(run(server.url))
        after = health(server.url)
    answered = sorted({o for o in outcomes if o.startswith("answered")})
    return dict(connections=count, seconds=seconds, held_open=outcomes.count("open"),
                answered=sum(o.startswith("answered") for o in outcomes), answers=answered,
                answered_408=outcomes.count("answered 408"), closed=outcomes.count("closed"),
                refused=outcomes.count("refused"), normal_requests=len(statuses),
                normal_ok=all(s == 200 for s in statuses) and bool(statuses),
                normal_max_s=round(latencies[-1], 3) if latencies else None, health_after=after)


SHARED = ("bad_values", "failing_requests", "huge_request", "stopped_core")  # against one server, in this order
OWN = {"stop_list_stall": stop_list_stall, "chat_template": chat_template, "idle_rank_death": idle_rank_death,
       "slow_clients": slow_clients}  # each starts a server of its own


def attempt(fn, *args) -> dict:
    "`fn(*args)`, or its error in one line: one scenario that fails leaves the others' rows."
    try:
        return fn(*args)
    except Exception as e:
        lines = str(e).strip().splitlines()
        return dict(error=f"{type(e).__name__}: {lines[0] if lines else ''}"[:200])


def shared_scenarios(a: argparse.Namespace, names: list[str]) -> dict:
    "The rows of the scenarios in `names` that share one server, and whether it is alive at the end."
    args = server_args(a) + ["--max-prompts-per-request", "100000", "--max-queued-tokens", "200000"]
    runs = {"bad_values": lambda s: bad_values(s.url, "probe"),
            "failing_requests": lambda s: failing_requests(s.url, s.proc.pid, "probe"),
            "huge_request": lambda s: huge_request(s.url, "probe", a.seconds or 10),
            "stopped_core": lambda s: stopped_core(s.url, s.proc.pid)}
    try:
        server = ServerProcess(*args)
    except RuntimeError as e:
        return {name: dict(error=str(e).splitlines()[0]) for name in names}
    with server:
        rows = {name: attempt(runs[name], server) for name in names}
        return rows | dict(server_alive=server.proc.poll() is None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=[*SHARED, *OWN], metavar="NAME",
                    help=f"run these scenarios only: {', '.join([*SHARED, *OWN])} (default: all)")
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: the packaged model)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=None,
                    help="how long each timed phase runs (default: 10 for normal requests, 20 for the slow clients)")
    ap.add_argument("--connections", type=int, default=330, help="the slow clients' connections (default: 330)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    names = a.only or [*SHARED, *OWN]
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    results = dict(cpu=cpu, cores=os.cpu_count(), tp=a.tp, model=a.model or "packaged",
                   load_at_start=round(os.getloadavg()[0], 2))
    if shared := [n for n in SHARED if n in names]:
        results |= shared_scenarios(a, shared)
    results |= {name: attempt(OWN[name], a) for name in OWN if name in names}
    print(f"fault probe of minivllm serve ({results['model']}, TP={a.tp}) on {cpu}, load {results['load_at_start']}")
    for name in [*SHARED, *OWN]:
        if name in results:
            print(f"  {name:17} " + ", ".join(f"{k} {v}" for k, v in results[name].items()))
    if "server_alive" in results:
        print(f"  server alive at the end: {results['server_alive']}")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
