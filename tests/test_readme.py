"""The README's Python example runs as written, saved as a script with no main guard."""
import os
import re
import subprocess
import sys

from conftest import ROOT
from minivllm.testing import rank_processes


def test_the_python_example_runs_as_a_script(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks, "the README has no Python example"
    example = blocks[0]
    assert "__main__" not in example  # no guard is needed, so the example shows none
    script = tmp_path / "example.py"
    script.write_text(example)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ROMEO." in proc.stdout and ("length" in proc.stdout or "stop" in proc.stdout), proc.stdout
    assert not rank_processes(os.getpid())


def test_the_serving_example_runs_against_the_packaged_models_server(tmp_path):
    "The README's client (a streamed completion, then a chat) against `minivllm serve` of the packaged model."
    from minivllm.bench.workload import ServerProcess
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    example = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "OpenAI(" in b)
    assert "chat.completions.create" in example
    with ServerProcess() as server:
        script = tmp_path / "client.py"
        script.write_text(example.replace("http://127.0.0.1:8000/v1", server.url + "/v1"))
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]  # a refused chat would be an openai error, and exit 1
    assert proc.stdout.strip().count("\n") >= 1, proc.stdout  # the completion, then the chat's reply below it
