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
