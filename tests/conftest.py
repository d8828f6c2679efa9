"""Shared pytest setup: the repository paths and a guard that no rank process and no shared-memory segment outlives a
test."""
import os
from pathlib import Path

import pytest
import torch

# subtle: Triton reads this when a kernel is defined (at the first import of minivllm.gpu.triton_attention), so it must be set
# before any test module imports minivllm; on CPU the kernels then run in Triton's interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the tests check the C++ kernels themselves: a missing one is built before its first use, not in the background
os.environ.setdefault("MINIVLLM_KERNEL_BUILD", "wait")

from minivllm.testing import leftover_segments, make_chat_checkpoint, rank_processes, shm_segments  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / "nbs"


@pytest.fixture(autouse=True)
def nothing_left_behind():
    "Fail a test that leaves a rank process of its own running, or a segment of its own in /dev/shm."
    before = shm_segments()
    yield
    alive = rank_processes(os.getpid())
    assert not alive, f"rank processes left running: {alive}"
    left = leftover_segments(before)
    for name in left: (Path("/dev/shm") / name).unlink(missing_ok=True)  # so that later tests start clean
    assert not left, f"shared-memory segments left in /dev/shm: {left}"


@pytest.fixture(scope="session")
def chat_ckpt(tmp_path_factory):
    "A tiny checkpoint with the packaged tokenizer and a chat template (notebook 18), shared by the server tests."
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat"))
