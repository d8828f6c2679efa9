"""tools/step_path.py: what one call runs of the package, counted as a reader pays for it."""
import importlib.util
import inspect
import json
import os
import subprocess
import sys

from conftest import ROOT
from minivllm.config import check_token_ids


def tool():
    spec = importlib.util.spec_from_file_location("step_path", ROOT / "tools" / "step_path.py")
    module = sys.modules["step_path"] = importlib.util.module_from_spec(spec)  # (its dataclass looks it up)
    spec.loader.exec_module(module)
    return module


def test_a_call_is_counted_by_its_functions_lines_and_check_calls():
    "Each function once, first line to last; each call of a check* function counted; files and their pairs."
    step_path = tool()
    trace = step_path.trace_step(lambda: [check_token_ids([1, 2], 10) for _ in range(3)])
    source, first = inspect.getsourcelines(check_token_ids)
    key = f"config.py:{first} check_token_ids"
    assert trace.functions[key] == len(source) and trace.check_calls[key] == 3
    assert trace.lines == sum(trace.functions.values()) and trace.files[0] == "config.py"
    assert step_path.is_check("_validate_x") and step_path.is_check("check") and not step_path.is_check("checkpoint")
    assert step_path.cycles([("a.py", "b.py"), ("b.py", "a.py"), ("b.py", "c.py")]) == [("a.py", "b.py"),
                                                                                       ("b.py", "a.py")]


def test_calls_back_up_and_detours_are_named():
    "A call into the engine's stages from below them calls back up; a file of the periphery is a detour."
    step_path = tool()
    before = [("llm.py", "engine/llm_engine.py"), ("engine/llm_engine.py", "engine/scheduler.py"),
              ("engine/llm_engine.py", "engine/launch.py"), ("engine/launch.py", "engine/model_runner.py"),
              ("engine/model_runner.py", "engine/scheduler.py"), ("engine/model_runner.py", "kv_cache.py")]
    assert step_path.calls_back_up(before) == [("engine/model_runner.py", "engine/scheduler.py")]
    assert step_path.calls_back_up(before[:4] + before[5:]) == []
    trace = step_path.StepTrace(files=["llm.py", "cpu/threads.py", "models.py", "cpu/gemm.py"])
    assert step_path.detours(trace) == ["cpu/threads.py", "cpu/gemm.py"]


def test_one_decode_step_meets_the_textbook_targets(tmp_path):
    "The packaged model's decode step at TP=1, with the C++ kernels (built first if need be): issue 55's targets."
    out = tmp_path / "step.json"
    env = os.environ | {"MINIVLLM_KERNEL_BUILD": "wait"}  # subtle: a process that found no kernels keeps torch's ops
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "step_path.py"), "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    trace = json.loads(out.read_text())
    assert trace["lines"] <= 550 and sum(trace["check_calls"].values()) <= 10, done.stdout
    assert len(trace["detours"]) <= 1 and not trace["calls_back_up"] and not trace["cycles"], done.stdout
    assert "engine/scheduler.py" not in {callee for caller, callee in trace["pairs"] if caller == "engine/model_runner.py"}
