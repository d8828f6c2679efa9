"""tools/gpu_check.py in its dry mode: every step of the GPU check on the CPU with tiny models, its table and JSON."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minivllm.bench.workload import Workload

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_dry_on_the_cpu_and_writes_its_table_and_json(tmp_path):
    out = tmp_path / "check.json"
    env = os.environ | {"MINIVLLM_CPU_GEMM": "torch"}  # no GEMM timing: this is about the script, not the CPU
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--dry-run", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [l for l in run.stdout.splitlines() if l.startswith("| ")]
    checks = [r.split(" | ")[0][2:] for r in rows[1:]]
    assert checks[:4] == ["device", "copy bandwidth", "cuda tests", "attention backend"], checks
    assert sum(c.startswith("greedy vs transformers") for c in checks) == 4  # 2 models x 2 dtypes (eager on the CPU)
    assert {"decode at batch 1", "decode at batch 4"} <= set(checks)
    results = json.loads(out.read_text())
    assert set(results) == {"environment", "attention_backend", "cuda_tests", "greedy_equivalence", "workload",
                            "transformers_slice", "decode"}
    float32 = [r for r in results["greedy_equivalence"] if r["dtype"] == "float32"]
    assert all(r["equal"] == r["prompts"] == 13 and r["parts"] == [] for r in float32), float32  # float32: exactly
    assert results["workload"][0]["output_tokens"] == Workload.nano_vllm(6, 110, 104).output_tokens
    assert all(0 < r["fraction"] for r in results["decode"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run for real")
def test_without_a_gpu_the_check_says_so_and_how_to_dry_run():
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "--dry-run" in run.stderr


def test_offline_wheels_fetches_every_requirement_but_torch():
    import configparser
    listed = subprocess.run(["bash", str(ROOT / "tools" / "offline_wheels.sh"), "--list"], capture_output=True,
                            text=True, timeout=60, check=True).stdout.split()
    c = configparser.ConfigParser()
    c.read(ROOT / "settings.ini")
    required = c["DEFAULT"]["requirements"].split()
    assert listed == [r for r in required if not r.startswith("torch")] and len(listed) == len(required) - 1


def test_logit_gap_measures_how_near_a_tie_the_parting_was(tmp_path):
    "At the first step where two continuations part: transformers' logit of its own token minus that of the other."
    import importlib.util
    from minivllm.checkpoints import make_tiny_checkpoint
    from minivllm.testing import hf_greedy
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    path = make_tiny_checkpoint(tmp_path / "m")
    prompt = [3, 1, 4, 1, 5]
    theirs = hf_greedy(path, [prompt], 5)[0]
    ours = theirs[:2] + [(theirs[2] + 1) % 256] + theirs[3:]
    part = gpu_check.logit_gap(path, prompt, ours, theirs, torch.float32, torch.device("cpu"))
    assert part["step"] == 2 and 0 < part["gap"] <= 2 * part["max_logit"]
