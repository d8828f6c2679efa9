"""tools/serve_cpu.py: where a streamed token's CPU goes, by thread, measured on a real server."""
import importlib.util
import json
from pathlib import Path

import pytest

from minivllm.testing import make_chat_checkpoint


def load_tool():
    "tools/serve_cpu.py as a module (tools/ is no package)."
    spec = importlib.util.spec_from_file_location("serve_cpu", Path(__file__).resolve().parents[1] / "tools" / "serve_cpu.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_the_serving_cpu_tool_runs_small(tmp_path):
    "tools/serve_cpu.py on a tiny checkpoint whose engine is paced: each thread's CPU a token, from a real server."
    tool = load_tool()
    model = make_chat_checkpoint(tmp_path / "tiny")
    assert tool.main(["--model", str(model), "--runs", "1", "--output-len", "8", "--step-ms", "5",
                      "--json", str(tmp_path / "cpu.json")]) == 0
    (run,) = json.loads((tmp_path / "cpu.json").read_text())["runs"]
    assert set(run) == {"event loop", "other threads", "engine", "client", "tokens_per_s"}
    assert all(v >= 0 for v in run.values()) and run["tokens_per_s"] > 0


def test_the_serving_cpu_tool_refuses_bad_options_before_starting_a_server(capsys):
    "No run count of 0, no negative pace: a usage error naming the option, and no server started for it."
    tool = load_tool()
    for option in (["--runs", "0"], ["--step-ms", "-5"]):
        with pytest.raises(SystemExit):
            tool.main(option)
        assert f"argument {option[0]}: must be above 0" in capsys.readouterr().err


def test_an_engine_process_that_ends_or_starts_between_readings_counts_nothing():
    "The engine's CPU between two readings, over the processes in both: one gone or new is left out, never negative."
    tool = load_tool()
    before = {"event loop": 1.0, "other threads": 2.0, "engine": {10: 5.0, 11: 3.0}}
    after = {"event loop": 1.5, "other threads": 2.25, "engine": {10: 6.0, 12: 0.5}}
    assert tool.spent(before, after) == {"event loop": 0.5, "other threads": 0.25, "engine": 1.0}
