"""Where a streamed token's CPU goes: `minivllm serve` started here, sent our client's seeded workload `--runs` times
(64 requests of 128 tokens in and out, all at once); per output token, the microseconds of CPU of the API server's
event loop (its main thread), of its other threads (the engine's outputs read and made into text), of the engine (the
processes under the server) and of the client (this process).

    python tools/serve_cpu.py [--model PATH] [--runs 3] [--step-ms MS] [--py-spy FILE] [--json out.json]

Run it with PYTHONPATH=<worktree> to measure a version, in alternating order against another; name the CPU (lscpu).
The server imports the package this process imports (it prints which): `python -m` would put its working directory
first, so the server starts with PYTHONSAFEPATH=1 (Python 3.11 and later). With py-spy installed, `--py-spy FILE` also records the server's
samples where it holds the GIL, for a split by function. A sample is taken where the server holds the GIL, so one
taken while the engine's threads keep the server off the cores counts too: `--step-ms 20 --model TINY` (a tiny random
checkpoint, `minivllm.testing.make_chat_checkpoint`) serves at the pace of a bigger model's steps, at no CPU, for a
split of what the server itself does.
"""
import argparse
import asyncio
import glob
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import minivllm
from minivllm.bench.serve import descendants, run_clients
from minivllm.bench.workload import ServerProcess, Workload
from minivllm.config import Config
from minivllm.cpu.threads import process_ticks
from minivllm.model_source import model_folder


def task_seconds(pid: int, threads: str = "*") -> float:
    "Seconds on a CPU so far of a process's threads (`threads`: a glob of thread ids), from the scheduler's nanoseconds."
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/{threads}/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])  # nanoseconds run on a CPU (a thread gone meanwhile counts 0)
        except OSError:
            pass
    return total / 1e9


def cpu_seconds(pid: int) -> dict:
    "Seconds on a CPU so far of the server's event loop (its main thread), of its other threads, and of each engine process."
    hz = os.sysconf("SC_CLK_TCK")
    # subtle: the engine in clock ticks, which count its threads that have ended too (the scheduler's counts do not)
    engine = {child: process_ticks([child]) / hz for child in descendants(pid)}
    if os.path.exists(f"/proc/{pid}/task/{pid}/schedstat"):  # nanoseconds, where clock ticks count hundredths of a second
        loop = task_seconds(pid, str(pid))
        return {"event loop": loop, "other threads": task_seconds(pid) - loop, "engine": engine}
    loop = process_ticks([f"{pid}/task/{pid}"]) / hz  # /proc/PID/task/PID: the main thread alone
    return {"event loop": loop, "other threads": process_ticks([pid]) / hz - loop, "engine": engine}


def spent(before: dict, after: dict) -> dict[str, float]:
    "Seconds each part spent between two `cpu_seconds`; the engine's, over the processes in both (one may start or end)."
    engine = sum(after["engine"][p] - before["engine"][p] for p in after["engine"].keys() & before["engine"].keys())
    return {k: after[k] - before[k] for k in ("event loop", "other threads")} | {"engine": engine}


# what the API server's code does, by the frames of a sample's stack (the first match from the innermost frame out)
GROUPS = [
    # (uvicorn 0.54's lines of `RequestResponseCycle.send` that call `transport.write`: another version, other lines;
    # and the server's own write of an event where it lands, notebook 13c's ChunkWriter)
    ("socket write", lambda f: "httptools_impl.py:544" in f or "httptools_impl.py:554" in f or "ChunkWriter.write" in f),
    ("detokenizing", lambda f: "IncrementalDetokenizer" in f or "tokenization_utils" in f),
    ("metrics (RequestTimer)", lambda f: "RequestTimer" in f or "prometheus" in f or "GapHistogram" in f),
    ("SSE events (OpenAIReply)", lambda f: "OpenAIReply" in f or "sse (minivllm" in f),
    ("ASGI send path", lambda f: "send" in f.split(" (")[0].lower() and any(m in f for m in ("starlette", "uvicorn", "server.py"))),
    ("streaming response (Starlette)", lambda f: "StreamingResponse" in f or "anyio" in f),
    ("request outputs (Request.add, .delta)", lambda f: "outputs.py" in f),
    ("handing over (deltas, streams, generators)", lambda f: "async_llm.py" in f or "server.py" in f),
    ("engine-core messages (zmq, msgspec)", lambda f: "core.py" in f or "zmq" in f),
    ("routes, HTTP per request", lambda f: any(m in f for m in ("fastapi", "starlette", "uvicorn", "pydantic"))),
]


def split_samples(path: str) -> dict[str, int]:
    "py-spy's raw samples (`-f raw`) of the server counted by thread and by `GROUPS`."
    counts: dict[str, int] = {}
    for line in open(path):
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        thread = "event loop" if "MainThread" in frames[0] else "outputs thread" if "outputs" in frames[0] else "other"
        group = next((g for f in reversed(frames) for g, matches in GROUPS if matches(f)), "the loop itself")
        counts[f"{thread}: {group}"] = counts.get(f"{thread}: {group}", 0) + int(n)
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


PACED_STEP = """import os, time
import minivllm.serve.core as core
_step, _pause = core.EngineCore.step, float(os.environ["MINIVLLM_STEP_MS"]) / 1000
def paced(self):
    time.sleep(_pause)
    return _step(self)
core.EngineCore.step = paced
"""


def paced_env(step_ms: float, folder: str) -> dict[str, str]:
    "The server's environment for an engine core that sleeps `step_ms` before each step: a sitecustomize in `folder`."
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(PACED_STEP)
    return {"MINIVLLM_STEP_MS": str(step_ms),
            "PYTHONPATH": os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)}


def positive(kind):
    "An argparse type: a number of `kind` above 0."
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint to serve (default: the packaged model)")
    parser.add_argument("--runs", type=positive(int), default=3)
    parser.add_argument("--output-len", type=positive(int), default=128)
    parser.add_argument("--step-ms", type=positive(float), default=None,
                        help="the engine core sleeps this long before each step")
    parser.add_argument("--py-spy", default=None, metavar="FILE", help="record py-spy's GIL samples of the server here")
    parser.add_argument("--json", default=None)
    a = parser.parse_args(argv)
    py_spy = shutil.which("py-spy", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if a.py_spy and py_spy is None:
        parser.error("--py-spy needs py-spy (pip install py-spy), which is not installed here")
    folder = model_folder(a.model)
    vocab = Config.from_pretrained(folder).vocab_size
    workload = Workload.make(vocab, 64, (128, 128), (a.output_len, a.output_len), 0)
    rows, spy = [], None
    with tempfile.TemporaryDirectory() as folder_for_pace:
        # subtle: without PYTHONSAFEPATH, `python -m minivllm` would import the package in the working directory
        env = (paced_env(a.step_ms, folder_for_pace) if a.step_ms else {}) | {"PYTHONSAFEPATH": "1"}
        print(f"serving the package in {os.path.dirname(os.path.dirname(minivllm.__file__))}", flush=True)
        server = ServerProcess(*(["--model", str(folder)] if a.model else []), env=env)
        try:
            name = "minivllm-default" if a.model is None else str(folder)
            asyncio.run(run_clients(server.url, name, workload.salted(99, vocab), math.inf, 0))  # warm up
            if a.py_spy:
                spy = subprocess.Popen([py_spy, "record", "-p", str(server.proc.pid), "--nonblocking", "--gil", "-t", "-r",
                                        "1000", "-f", "raw", "-o", a.py_spy], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            for i in range(a.runs):
                before, client = cpu_seconds(server.proc.pid), time.process_time()
                timings, seconds = asyncio.run(run_clients(server.url, name, workload.salted(i, vocab), math.inf, 0))
                after, client = cpu_seconds(server.proc.pid), time.process_time() - client
                if (failed := next((t.error for t in timings if t.error), None)) is not None:
                    raise RuntimeError(f"a request failed: {failed}")
                tokens = sum(t.output_tokens for t in timings)
                row = {k: v / tokens * 1e6 for k, v in spent(before, after).items()} | {"client": client / tokens * 1e6}
                row["tokens_per_s"] = tokens / seconds
                rows.append(row)
                print(", ".join(f"{k} {v:.1f}" for k, v in row.items() if k != "tokens_per_s")
                      + f" us a token; {row['tokens_per_s']:.0f} tok/s", flush=True)
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # Ctrl-C: py-spy writes what it has
                spy.wait()
        finally:
            if spy is not None and spy.poll() is None:  # a run failed: no samples are wanted
                spy.kill()
                spy.wait()
            server.stop()
    api = [r["event loop"] + r["other threads"] for r in rows]
    print(f"API server: median {statistics.median(api):.1f} us of CPU a streamed token ({min(api):.1f}-{max(api):.1f})")
    split = split_samples(a.py_spy) if a.py_spy else None
    for where, n in (split or {}).items():
        print(f"{n:7d}  {where}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": rows, "api_server_us_per_token": api, "samples": split}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
