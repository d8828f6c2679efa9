"""tools/spec_bench.py: speculative decoding's speed with guesses of known quality."""
import json
import subprocess
import sys
from pathlib import Path

from minivllm.testing import make_tiny_checkpoint

TOOL = Path(__file__).resolve().parents[1] / "tools" / "spec_bench.py"


def test_the_spec_bench_keeps_every_right_guess_and_counts_the_wrong_ones(tmp_path):
    "A tiny run: right guesses all kept (k + 1 tokens a step at most), replaced ones not; one line and one pair a setting and round."
    out, model = tmp_path / "spec.json", make_tiny_checkpoint(tmp_path / "model", "qwen3")
    run = subprocess.run([sys.executable, str(TOOL), "--model", str(model), "--k", "2,3", "--replaced", "0,1",
                          "--max-tokens", "12", "--prompt-len", "8", "--rounds", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(run.stdout.splitlines()) == 4
    pairs = json.loads(out.read_text())["pairs"]
    assert [(p["k"], p["replaced"]) for p in pairs] == [(2, 0.0), (2, 1.0), (3, 0.0), (3, 1.0)]
    for p in pairs:
        assert p["guesses"] > 0 and p["ratio"] > 0
        if p["replaced"] == 0:
            assert p["kept"] == p["guesses"] and 1 < p["tokens_per_step"] <= p["k"] + 1
        else:
            assert p["kept"] == 0 and p["tokens_per_step"] == 1


def test_the_spec_bench_refuses_a_share_out_of_range():
    run = subprocess.run([sys.executable, str(TOOL), "--replaced", "1.5"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--replaced in [0, 1]" in run.stderr
