"""tools/fault_probe.py: its two cheap scenarios run whole, briefly (rows and fields, not results, which measure the
server), and how a slow connection's outcome is read, against stand-in servers."""
import asyncio
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "fault_probe.py"


@pytest.fixture(scope="module")
def probe():
    "tools/fault_probe.py as a module."
    spec = importlib.util.spec_from_file_location("fault_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_chat_template_and_slow_clients_rows_in_brief(tmp_path):
    out = tmp_path / "probe.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--only", "chat_template", "slow_clients", "--connections", "10",
                          "--seconds", "3", "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split()[0]: line for line in run.stdout.splitlines()[1:]}
    assert sorted(rows) == ["chat_template", "slow_clients"], run.stdout
    results = json.loads(out.read_text())
    assert {"text_chat", "text_tokenize", "file_chat", "file_tokenize", "all_200"} <= set(results["chat_template"])
    slow = results["slow_clients"]
    assert {"held_open", "answered_408", "closed", "normal_ok", "normal_max_s"} <= set(slow), slow
    assert (slow["connections"], slow["seconds"]) == (10, 3)
    assert slow["held_open"] + slow["answered"] + slow["closed"] + slow["refused"] == 10
    for name in ("bad_values", "huge_request", "stop_list_stall", "idle_rank_death"):  # --only: nothing else ran
        assert name not in results


def test_only_names_the_scenarios_it_takes():
    run = subprocess.run([sys.executable, str(SCRIPT), "--only", "nonsense"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "invalid choice: 'nonsense'" in run.stderr
    assert "idle_rank_death" in run.stderr and "slow_clients" in run.stderr


async def stand_in(answer: bytes | None, after_bytes: int):
    "A TCP server that, once it has read `after_bytes` bytes, writes `answer` and closes (None: closes without a word)."
    async def handle(reader, writer):
        try:
            await reader.readexactly(after_bytes)
        except asyncio.IncompleteReadError:  # the client left first
            return
        if answer is not None:
            writer.write(answer)
            await writer.drain()
        writer.close()
    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("answer, after_bytes, outcome", [
    (b"HTTP/1.1 408 Request Timeout\r\n\r\n", 4, "answered 408"),
    (None, 4, "closed"),
    (None, 100, "open")])  # more bytes than two seconds of trickling send
def test_a_slow_connections_outcome(probe, answer, after_bytes, outcome):
    async def run():
        server = await stand_in(answer, after_bytes)
        async with server:
            port = server.sockets[0].getsockname()[1]
            return await probe.slow_connection("127.0.0.1", port, b"GET", b"xyz", time.monotonic() + 2)
    assert asyncio.run(run()) == outcome


def test_quantile(probe):
    assert probe.quantile([0.1, 0.2, 0.3, 0.4], 0.5) == 0.3 and probe.quantile([0.1, 0.2], 0.99) == 0.2
    assert probe.quantile([], 0.5) is None
