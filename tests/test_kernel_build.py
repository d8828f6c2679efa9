"""Building the C++ CPU kernels (notebook 04a): a build killed at any point never blocks a later start, a build held by
a live process is waited for only so long, a first run builds in the background, and environments sharing one cache
rebuild nothing of each other's. A tiny library stands in for the real ones (it compiles in about a second)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minivllm.cpu.kernels import cpu_kernels_enabled, file_lock

pytestmark = pytest.mark.skipif(not cpu_kernels_enabled(), reason="the C++ kernels are off here")

PROBE = 'extern "C" int minivllm_probe() { return 42; }\n'
SLOW_PROBE = "#include <ATen/ATen.h>\n" + PROBE  # a few seconds of compiling: time to kill it in the middle
# a child that builds the probe library and prints whether it got it; `prefix` stands for another environment
CHILD = """import os, sys, time
if len(sys.argv) > 1: sys.prefix = sys.argv[1]
from minivllm.cpu.kernels import build_cpu_extension, kernel_build_folder
start = time.monotonic()
ok = build_cpu_extension("probe", os.environ["PROBE"])
print(ok, round(time.monotonic() - start, 2), kernel_build_folder(os.environ["PROBE"]), flush=True)"""


def child_env(cache: Path, policy: str = "wait", wait_s: float = 60, probe: str = PROBE) -> dict:
    return os.environ | {"MINIVLLM_CACHE": str(cache), "MINIVLLM_KERNEL_BUILD": policy,
                         "MINIVLLM_KERNEL_WAIT_S": str(wait_s), "PROBE": probe}


def run_child(cache: Path, *args: str, policy: str = "wait", wait_s: float = 60, timeout: float = 120,
              probe: str = PROBE):
    "The child's (ok, seconds, build folder) and its stderr."
    done = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True,
                          env=child_env(cache, policy, wait_s, probe), timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    ok, seconds, folder = done.stdout.split()
    return (ok == "True", float(seconds), Path(folder)), done.stderr


@pytest.mark.parametrize("kill_at", ["torch's lock file", "0.5 s", "2 s"])
def test_a_build_killed_at_any_point_never_blocks_the_next_start(tmp_path, kill_at):
    "SIGKILL while building (torch's lock file left behind, or wherever the build is), then a new start builds."
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=child_env(tmp_path, probe=SLOW_PROBE))
    if kill_at == "torch's lock file":
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("kernels/*/lock")):
            assert child.poll() is None and time.monotonic() < deadline, "the build never took torch's lock"
            time.sleep(0.005)
    else:
        time.sleep(float(kill_at.split()[0]))
    child.send_signal(signal.SIGKILL)
    child.wait()
    if kill_at == "torch's lock file":
        assert list(tmp_path.glob("kernels/*/lock"))  # what used to hang every later start
    (ok, seconds, folder), err = run_child(tmp_path, wait_s=30, probe=SLOW_PROBE)
    assert ok and seconds < 30, err[-2000:]
    assert not (folder / "lock").exists()
    said = [line for line in err.splitlines() if "CPU kernels probe" in line]
    assert len(said) <= 1, err  # one line when it builds (none where the killed build had finished)
    assert run_child(tmp_path, wait_s=30, probe=SLOW_PROBE)[0][0]  # and the next start loads it


def test_a_live_build_is_waited_for_only_so_long(tmp_path):
    "Another process holding the library's lock past MINIVLLM_KERNEL_WAIT_S: torch's operations, and one line why."
    (_, _, folder), _ = run_child(tmp_path)  # built once, so the next start only loads it
    with file_lock(folder / "minivllm.lock", 0) as held:
        assert held
        (ok, seconds, _), err = run_child(tmp_path, wait_s=1)
    assert not ok and 1 <= seconds < 10
    assert "has been building the CPU kernels probe for over 1 s" in err and "torch's operations serve" in err
    (ok, _, _), _ = run_child(tmp_path, wait_s=1)
    assert ok  # released: loaded at once


def test_a_first_run_does_not_wait_the_build_happens_in_the_background(tmp_path):
    "No library yet: the first start returns at once (torch's operations) and says so; a later start has the kernels."
    (ok, seconds, folder), err = run_child(tmp_path, policy="background")
    assert not ok and seconds < 5 and "being built in the background" in err, err[-2000:]
    deadline = time.monotonic() + 120
    while not list(folder.glob("*.so")) or (folder / "lock").exists():
        assert time.monotonic() < deadline, (folder / "build.log").read_text()[-2000:]
        time.sleep(0.2)
    with file_lock(folder / "minivllm.lock", 60):  # the builder has let go
        pass
    (ok, seconds, _), err = run_child(tmp_path, policy="background")
    assert ok and "building" not in err, err[-2000:]


def test_environments_sharing_a_cache_rebuild_nothing_of_each_others(tmp_path):
    "Two environments (two sys.prefix) alternating on one cache: a folder each, and after the first build no rebuild."
    first = {}
    for turn in range(2):
        for env in ("/venv/a", "/venv/b"):
            (ok, _, folder), err = run_child(tmp_path, env)
            so = next(folder.glob("*.so"))
            assert ok
            if turn == 0:
                first[env] = (folder, so.stat().st_mtime_ns)
                assert "building the CPU kernels probe" in err
            else:
                assert (folder, so.stat().st_mtime_ns) == first[env] and "building" not in err, err[-2000:]
    assert first["/venv/a"][0] != first["/venv/b"][0]
