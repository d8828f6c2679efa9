"""Building the C++ CPU kernels (notebook 04a): a build killed at any point never blocks a later start, a build held by
a live process is waited for only so long, a first run builds in the background, environments sharing one cache
rebuild nothing of each other's, another ninja changes no folder, and a new build removes the old ones of its library
that nothing holds. A tiny library stands in for the real ones (it compiles in about a second)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minivllm.cpu import kernels
from minivllm.cpu.kernels import cpu_kernels_enabled, file_lock, kernel_build_folder, kernel_build_inputs, remove_stale_builds

pytestmark = pytest.mark.skipif(not cpu_kernels_enabled(), reason="the C++ kernels are off here")

PROBE = 'extern "C" int minivllm_probe() { return 42; }\n'
SLOW_PROBE = "#include <ATen/ATen.h>\n" + PROBE  # a few seconds of compiling: time to kill it in the middle
# a child that builds the probe library and prints whether it got it; an argument is another environment's torch folder
CHILD = """import os, sys, time
from minivllm.cpu import kernels
if len(sys.argv) > 1:
    real = kernels.kernel_build_inputs
    kernels.kernel_build_inputs = lambda: real() | {"torch install": sys.argv[1]}
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
    "Two environments (two torch installs) alternating on one cache: a folder each, and after the first build no rebuild."
    first = {}
    for env in ("venv-a", "venv-b"):
        (tmp_path / env).mkdir()  # installed: neither environment's build is stale to the other
    for turn in range(2):
        for env in (str(tmp_path / "venv-a"), str(tmp_path / "venv-b")):
            (ok, _, folder), err = run_child(tmp_path, env)
            so = next(folder.glob("*.so"))
            assert ok
            if turn == 0:
                first[env] = (folder, so.stat().st_mtime_ns)
                assert "building the CPU kernels probe" in err
            else:
                assert (folder, so.stat().st_mtime_ns) == first[env] and "building" not in err, err[-2000:]
    assert first[str(tmp_path / "venv-a")][0] != first[str(tmp_path / "venv-b")][0]


@pytest.fixture
def fresh_inputs():
    "`kernel_build_inputs` read again inside the test and after it (it is kept once a process)."
    kernels._build_inputs.cache_clear()
    yield
    kernels._build_inputs.cache_clear()


def test_the_key_does_not_change_with_ninja(tmp_path, monkeypatch, fresh_inputs):
    "Another ninja first on PATH (pip's, from the dev extra), or another sys.prefix: the same inputs, the same folder."
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    before, folder = kernel_build_inputs(), kernel_build_folder(PROBE)
    fake = tmp_path / "bin" / "ninja"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 99.0.0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another venv"))
    kernels._build_inputs.cache_clear()
    assert subprocess.run(["ninja", "--version"], capture_output=True, text=True).stdout == "99.0.0\n"
    assert (kernel_build_inputs(), kernel_build_folder(PROBE)) == (before, folder)
    assert not any("ninja" in k or "ninja" in v for k, v in before.items())


def test_the_key_changes_with_the_compiler_torch_and_flags(tmp_path, monkeypatch, fresh_inputs):
    "What makes another binary makes another folder: the compiler (its version), torch's version, the flags, the source."
    folder = kernel_build_folder(PROBE)
    assert kernel_build_folder(PROBE + "\n") != folder
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\necho 'g++ (Other) 99.1'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    kernels._build_inputs.cache_clear()
    assert kernel_build_inputs()["compiler version"] == "g++ (Other) 99.1" and kernel_build_folder(PROBE) != folder
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(kernels.torch, "__version__", "99.0.0")
    kernels._build_inputs.cache_clear()
    assert kernel_build_folder(PROBE) != folder
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "KERNEL_FLAGS", [*kernels.KERNEL_FLAGS, "-DOTHER"])
    kernels._build_inputs.cache_clear()
    assert kernel_build_folder(PROBE) != folder


def fake_build(cache: Path, lib: str, folder: str, age_s: float, torch_dir: str | None) -> Path:
    "A folder as a build leaves it: the library (`age_s` old) and, unless None, the torch it was built with."
    (cache / folder).mkdir(parents=True)
    so = cache / folder / f"{lib}_{folder}.so"
    so.write_bytes(b"")
    os.utime(so, (time.time() - age_s,) * 2)
    if torch_dir is not None:
        (cache / folder / "inputs.json").write_text(json.dumps({"torch install": torch_dir}))
    return cache / folder


def test_stale_builds_are_removed_and_the_others_kept(tmp_path):
    "Older builds of the same library, of this torch, of a torch gone or of an older key, are removed; no other."
    here = kernel_build_inputs()["torch install"]
    new = fake_build(tmp_path, "minivllm_cpu", "new", 0, here)
    stale = [fake_build(tmp_path, "minivllm_cpu", "old", 60, here),
             fake_build(tmp_path, "minivllm_cpu", "oldkey", 60, None),
             fake_build(tmp_path, "minivllm_cpu", "gone", 60, str(tmp_path / "removed venv"))]
    kept = [fake_build(tmp_path, "minivllm_cpu", "live", 60, str(tmp_path)),  # another environment, installed
            fake_build(tmp_path, "minivllm_cpu_layers", "layers", 60, here),  # another library, a longer name
            fake_build(tmp_path, "minivllm_cpu", "newer", -60, here),  # built after this one
            fake_build(tmp_path, "minivllm_cpu", "loading", 60, here)]  # held by another process
    (tmp_path / "no library").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               str(kept[-1] / "minivllm.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert sorted(remove_stale_builds("minivllm_cpu", new)) == sorted(stale)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["new", "no library", *(p.name for p in kept)])
    assert remove_stale_builds("minivllm_cpu", new) == [kept[-1]]  # let go: removed the next time
    assert remove_stale_builds("minivllm_cpu", tmp_path / "never built") == []


def test_stale_builds_that_cannot_be_removed_stay(tmp_path, monkeypatch):
    "A failure to remove an old build (a read-only folder, say) leaves it and the new build alone."
    here = kernel_build_inputs()["torch install"]
    new, old = fake_build(tmp_path, "lib", "new", 0, here), fake_build(tmp_path, "lib", "old", 60, here)
    monkeypatch.setattr(kernels.shutil, "rmtree", lambda path: (_ for _ in ()).throw(PermissionError("read-only")))
    assert remove_stale_builds("lib", new) == [] and old.exists() and new.exists()
    (old / "inputs.json").write_text("{not json")
    assert remove_stale_builds("lib", new) == [] and old.exists()


def test_a_new_build_removes_the_old_build_of_its_library(tmp_path):
    "A new version of the probe's source, built under the same name: its folder is new, the old version's is gone."
    (ok, _, old), _ = run_child(tmp_path)
    (ok2, _, new), err = run_child(tmp_path, probe=PROBE.replace("42", "43"))
    assert ok and ok2 and old != new, err[-2000:]
    assert not old.exists() and list(new.glob("probe_*.so"))
    assert json.loads((new / "inputs.json").read_text())["torch install"] == kernel_build_inputs()["torch install"]
