"""tools/host_step.py: the host's time in a decode step, without a model."""
import re
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "host_step.py"


def test_the_host_step_tool_prints_each_round_and_the_best():
    "A small batch over a few steps: one line a round, then the least one, each with its three parts adding up."
    run = subprocess.run([sys.executable, str(TOOL), "--batch", "8", "--steps", "5", "--rounds", "2"],
                         capture_output=True, text=True, timeout=120, check=True)
    lines = run.stdout.splitlines()
    assert [l.split(":")[0] for l in lines] == ["batch 8, round 1", "batch 8, round 2", "batch 8, best"], lines
    for line in lines:
        schedule, inputs, post, host = map(float, re.findall(r"([\d.]+) ms", line))
        assert abs(schedule + inputs + post - host) < 0.002, line
    assert lines[-1].split(":")[1] in {l.split(":")[1] for l in lines[:2]}


def test_the_host_step_tool_refuses_a_count_below_one():
    run = subprocess.run([sys.executable, str(TOOL), "--rounds", "0"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--batch, --steps and --rounds must be at least 1" in run.stderr


def test_the_host_step_tool_schedules_ahead():
    "--ahead: each step scheduled before the one before it is recorded, its newest tokens taken from the step before's."
    run = subprocess.run([sys.executable, str(TOOL), "--batch", "8", "--steps", "5", "--ahead"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert run.stdout.startswith("batch 8, ahead, best: schedule "), run.stdout
