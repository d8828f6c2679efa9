"""A /dev/shm that fills up after the engine started, or that is too small from the start (notebook 01a): the engine
either works or fails at start with a clear error, never dies of SIGBUS later, and leaves no segment behind.

Each case runs a child in its own mount namespace with a small private tmpfs on /dev/shm (needs root and `unshare`);
the child is this file run as a script."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.shm import create_shared_memory
from minivllm.testing import shm_segments

SHM = Path("/dev/shm")
ENGINE = dict(tensor_parallel_size=2, dtype="float32", max_model_len=1024, max_num_seqs=64)
# subtle: max_num_seqs=64 gives the all-reduce 512 KiB slots (a 3 MiB segment, room in a 16 MiB tmpfs); warm-up on
# the CPU writes 16 rows into them, and a 480-token prefill (480 x 256 float32 = 480 KiB) fills fresh pages of them
PROMPT = [(37 * i + 11) % 4000 + 10 for i in range(480)]
MAX_TOKENS = 8


def _can_mount_a_private_tmpfs() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare") or not SHM.is_dir():
        return False
    probe = ["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"]
    return subprocess.run(probe, capture_output=True).returncode == 0


needs_namespace = pytest.mark.skipif(not _can_mount_a_private_tmpfs(),
                                     reason="needs root and `unshare --mount` to put a small tmpfs on /dev/shm")


def in_small_dev_shm(size: str, mode: str, tmp_path: Path, timeout_s: float = 300.0):
    "Run this file as `mode` in a mount namespace whose /dev/shm is a fresh tmpfs of `size`: (exit code, its report, what the tmpfs held after it exited, its stderr)."
    out, left = tmp_path / f"{mode}.json", tmp_path / f"{mode}.left"
    script = (f'mount -t tmpfs -o size={size} tmpfs /dev/shm && "$@"; rc=$?; '
              'ls -A /dev/shm > "$0"; exit $rc')  # subtle: the tmpfs goes with the namespace: look before leaving
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(left),
           sys.executable, __file__, mode, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    report = json.loads(out.read_text()) if out.exists() else None
    held = left.read_text().split() if left.exists() else None
    return proc.returncode, report, held, proc.stderr


@pytest.fixture(scope="module")
def expected():
    "The packaged model's greedy tokens for the long prompt, from one rank (which needs no shared memory)."
    from minivllm import LLM, SamplingParams
    with LLM(**(ENGINE | {"tensor_parallel_size": 1})) as llm:
        return llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)[0].token_ids


def no_sigbus(rc: int, stderr: str) -> None:
    assert rc not in (128 + signal.SIGBUS, -signal.SIGBUS), f"killed by SIGBUS:\n{stderr[-4000:]}"


@needs_namespace
def test_dev_shm_filled_after_start_is_no_sigbus(tmp_path, expected):
    rc, report, held, stderr = in_small_dev_shm("16m", "fill", tmp_path)
    no_sigbus(rc, stderr)
    assert rc == 0 and report is not None, f"exit code {rc}:\n{stderr[-4000:]}"
    assert report["shm_allreduce"], "the all-reduce fell back to gloo: the test would not touch its slots"
    assert len(report["segments"]) == 2, report  # the command channel's and the all-reduce's
    assert report["fill_error"] and report["free_after_fill"] == 0, report  # /dev/shm was full to the brim
    assert report["error"] is None, report["error"]
    assert report["tokens"] == expected
    assert report["left"] == [] and not [n for n in held if n.startswith("minivllm-")], (report, held)


@needs_namespace
def test_dev_shm_too_small_at_start_fails_clearly(tmp_path):
    rc, report, held, stderr = in_small_dev_shm("3m", "start", tmp_path)
    no_sigbus(rc, stderr)
    assert rc == 0 and report is not None, f"exit code {rc}:\n{stderr[-4000:]}"
    assert report["error"].startswith("MemoryError: /dev/shm has 3.00 MiB free, fewer than the 4.02 MiB this needs: "
                                      "free some, or give the container more shared memory"), report
    assert report["ranks"] == [] and report["left"] == [] and held == [], (report, held)


def test_a_reservation_that_finds_no_room_fails_clearly_and_unlinks(monkeypatch):
    "/dev/shm filling between the free-space check and the reservation: the check's error, no segment left."
    before = shm_segments(os.getpid())
    def no_space(fd, offset, size): raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(MemoryError, match=r"^/dev/shm has .* MiB free, fewer than the 1.00 MiB this needs: free some"):
        create_shared_memory(1 << 20)
    assert shm_segments(os.getpid()) == before


def test_without_posix_fallocate_the_pages_are_written(monkeypatch):
    "Where posix_fallocate is not supported, the segment is still taken whole at creation (by writing zeros)."
    def unsupported(fd, offset, size): raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    size = (3 << 20) + 4096
    seg = create_shared_memory(size)
    try:
        assert os.stat(SHM / seg.name).st_blocks * 512 == size
        assert bytes(seg.buf[-4096:]) == bytes(4096)
    finally:
        seg.close(); seg.unlink()


def test_a_new_segment_is_reserved_whole():
    seg = create_shared_memory(5 << 20)
    try:
        assert os.stat(SHM / seg.name).st_blocks * 512 == 5 << 20  # taken from /dev/shm, though nothing was written
    finally:
        seg.close(); seg.unlink()


# ---- the child, in its own mount namespace ----

def _fill(out: Path) -> None:
    "Start a TP=2 engine, fill /dev/shm from another process, then prefill a long prompt."
    from minivllm import LLM, SamplingParams
    report = {"error": None, "tokens": None}
    with LLM(**ENGINE) as llm:
        report["segments"] = sorted(shm_segments())
        report["shm_allreduce"] = getattr(llm.llm_engine.runner.comm, "shm", None) is not None
        fill = subprocess.run(["sh", "-c", "cat /dev/zero > /dev/shm/filler"], capture_output=True, text=True)
        report["fill_error"] = fill.stderr.strip()
        st = os.statvfs(SHM)
        report["free_after_fill"] = st.f_bavail * st.f_frsize
        try:
            report["tokens"] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                                            use_tqdm=False)[0].token_ids
        except Exception as e:
            report["error"] = f"{type(e).__name__}: {e}"
    report["left"] = sorted(shm_segments())
    out.write_text(json.dumps(report))


def _start(out: Path) -> None:
    "Start a TP=2 engine in a /dev/shm too small for its command channel."
    from minivllm import LLM
    from minivllm.testing import rank_processes
    report = {"error": None}
    try:
        LLM(**ENGINE).close()
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
    report["ranks"], report["left"] = rank_processes(os.getpid()), sorted(shm_segments())
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    _fill(out) if mode == "fill" else _start(out)
