"""tools/step_path.py: what one call runs of the package, counted as a reader pays for it."""
import importlib.util
import inspect
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
