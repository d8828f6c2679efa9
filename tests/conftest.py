"""Shared pytest setup: the repository paths and a guard that no rank process outlives a test."""
from pathlib import Path

import pytest
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / "nbs"


@pytest.fixture(autouse=True)
def no_leftover_ranks():
    "Fail a test that leaves a spawned rank process running."
    yield
    alive = [p for p in mp.active_children() if p.name.startswith("minivllm-rank")]
    assert not alive, f"rank processes left running: {alive}"
