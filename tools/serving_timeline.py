"""Where a server's engine spends its time under load: its steps, and the gaps between them, in one design or the other.

Serves the packaged model (float32, TP=1) with `AsyncLLM(..., record_steps=True)` behind the OpenAI app, sends it
`minivllm bench serve`'s workload (64 streaming requests at once) from a client process, and stores under LABEL in
nbs/serving_timeline.json each engine step's start and end (`time.perf_counter()`, one clock for every process of the
machine), which notebook 13a draws. The engine's API is found at run time, so the same script measures a checkout of
the one-process design too (its `AsyncLLM` took an `LLM` and ran the loop in a thread of the server's process):

    python tools/serving_timeline.py "engine core"
    git worktree add /tmp/old 3dd828b && PYTHONPATH=/tmp/old python tools/serving_timeline.py "one process"
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "nbs" / "serving_timeline.json"


def serve_and_record(port_file: str, steps_file: str) -> None:
    "The server process: an engine that records its steps, served until SIGTERM; then its step records to a file."
    import inspect
    import uvicorn
    import minivllm
    from minivllm.serve.async_llm import AsyncLLM
    from minivllm.serve.server import bind_socket, build_app
    kw = dict(dtype="float32", max_model_len=1024)
    one_process = "llm" in inspect.signature(AsyncLLM).parameters
    engine = AsyncLLM(minivllm.LLM(**kw), record_steps=True) if one_process else AsyncLLM(record_steps=True, **kw)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "m"), log_level="error"))
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    threading.Thread(target=lambda: (time.sleep(1), Path(port_file).write_text(str(sock.getsockname()[1]))),
                     daemon=True).start()
    server.run(sockets=[sock])
    Path(steps_file).write_text(json.dumps(engine.steps))
    engine.close()


def measure(label: str) -> dict:
    "Run the server and the client once; the steps of the all-at-once run, and the client's throughput."
    import tempfile
    folder = tempfile.mkdtemp()
    port_file, steps_file = f"{folder}/port", f"{folder}/steps.json"
    server = subprocess.Popen([sys.executable, __file__, "--serve", port_file, steps_file], env=os.environ)
    while not os.path.exists(port_file):
        if server.poll() is not None:
            raise RuntimeError("the server did not start")
        time.sleep(0.2)
    url = f"http://127.0.0.1:{Path(port_file).read_text()}"
    client = subprocess.run([sys.executable, "-m", "minivllm", "bench", "serve", "--url", url, "--request-rate", "inf",
                             "--json", f"{folder}/client.json"], capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    print(client.stdout, client.stderr[-2000:], sep="\n")
    server.send_signal(signal.SIGTERM)
    server.wait(120)
    steps = json.loads(Path(steps_file).read_text())
    run = json.loads(Path(f"{folder}/client.json").read_text())["runs"][-1]
    big = [s for s in steps if len(s["requests"]) >= 32]  # the all-at-once run: its steps with most requests live
    return {"tokens_per_s": run["tokens_per_s"], "ttft_p50_ms": run["ttft_ms"]["p50"],
            "steps": [[s["start"], s["end"], s["prefill"], len(s["requests"])] for s in big]}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("label", nargs="?")
    p.add_argument("--serve", nargs=2, metavar=("PORT_FILE", "STEPS_FILE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        serve_and_record(*a.serve)
        sys.exit(0)
    from minivllm.bench.workload import device_name
    result = measure(a.label)
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    data = {"workload": "the packaged model, float32, TP=1, 64 streaming requests at once (minivllm bench serve)",
            "device": device_name(), "designs": data.get("designs", {}) | {a.label: result}}
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    steps = result["steps"]
    busy = sum(e - s for s, e, *_ in steps)
    print(f"{a.label}: {len(steps)} steps, engine busy {busy / (steps[-1][1] - steps[0][0]):.0%} of the time, "
          f"{result['tokens_per_s']:.0f} tok/s")
