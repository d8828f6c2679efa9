"""Helpers for tests that start processes: is a pid gone, wait for a condition, a child's SIGINT disposition, and the
rank processes a process has started."""
import signal
import time
from pathlib import Path


def gone(pid: int) -> bool:
    "Whether `pid` has exited (an unreaped zombie counts as gone)."
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(cond, timeout_s: float) -> bool:
    "Poll `cond()` until it is true or `timeout_s` passes; its last value."
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond(): return True
        time.sleep(0.02)
    return cond()


def default_sigint() -> None:
    "In a child about to exec: let SIGINT interrupt it, even if this test run inherited it ignored (a background job)."
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def rank_processes(parent: int) -> list[int]:
    "Pids of the live (not zombie) rank processes whose parent is `parent`: children running minivllm's bootstrap."
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == parent and fields[0] != "Z" and b"_rank_process_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


def shm_segments() -> set[str]:
    "Names of minivllm's shared-memory segments in /dev/shm (`minivllm-<creator pid>-<hex>`)."
    from minivllm.shm_allreduce import SEGMENT_PREFIX
    return {p.name for p in Path("/dev/shm").glob(f"{SEGMENT_PREFIX}*")}


def leftover_segments(before: set[str], pid: int) -> list[str]:
    "Segments not in `before` that are left behind: created by `pid` itself, or by a process that has exited."
    left = []
    for name in sorted(shm_segments() - before):
        creator = name.split("-")[1]
        if creator.isdigit() and (int(creator) == pid or gone(int(creator))):
            left.append(name)
    return left
