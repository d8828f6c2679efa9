"""A first run says at most two lines before its output, once per run and not once per rank: that the C++ kernels are
being built in the background (notebook 04a) and that the CPU GEMMs are timed once per machine (notebook 03a); a
second run on the same cache says nothing. Each test has a fresh cache (`MINIVLLM_CACHE`), and the kernels are built
in the background, as they are by default; the builders a test started are stopped at its end."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minivllm.cpu.kernels import builder_pid, cpu_kernels_enabled

BUILDING = "the CPU kernels are being built in the background"
TIMING = "timing the CPU GEMMs"


def run_env(cache: Path) -> dict:
    "The environment of a run on `cache`, as a user's: kernels built in the background, notices at INFO."
    env = {k: v for k, v in os.environ.items()
           if k not in ("MINIVLLM_KERNEL_BUILD", "MINIVLLM_LOG_LEVEL", "MINIVLLM_CPU_GEMM")}
    return env | {"MINIVLLM_CACHE": str(cache)}


def generate(cache: Path, tp: int) -> subprocess.CompletedProcess:
    "`minivllm generate Hello --tp N` on `cache`, into a pipe (the completion at the end, on stdout)."
    done = subprocess.run([sys.executable, "-m", "minivllm", "generate", "Hello", "--tp", str(tp), "--max-tokens", "8",
                           "--seed", "0"], capture_output=True, text=True, env=run_env(cache), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def notices(stderr: str) -> list[str]:
    "The lines of `stderr`, less the progress bar (`generate: ...`, redrawn after carriage returns)."
    parts = (part.strip() for line in stderr.splitlines() for part in line.split("\r"))
    return [part for part in parts if part and not part.startswith("generate:")]


def unprefixed(line: str) -> str:
    "A line as its rank wrote it: without the `(minivllm-rank1 pid=...) ` that forwards a worker's stderr."
    return re.sub(r"^\(minivllm-rank\d+ pid=\d+\) ", "", line)


def stop_builders(cache: Path, timeout_s: float = 30) -> None:
    "End the background builders still running on `cache` (each leads a session: its compiler goes with it)."
    folders = list((cache / "kernels").glob("*/"))
    for folder in folders:
        if pid := builder_pid(folder):
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    while any(builder_pid(f) is not None for f in folders) and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_first_run_says_at_most_two_lines_once_and_a_second_run_none(tmp_path, tp):
    "TP 1 and 2 on a fresh cache: the build line and the timing line at most once each, from one rank; then silence."
    try:
        first = generate(tmp_path, tp)
        said = notices(first.stderr)
        assert first.stdout.startswith("Hello"), first.stdout
        assert len(said) <= 2, "\n".join(said)
        assert len({unprefixed(line) for line in said}) == len(said), "\n".join(said)  # no rank repeats another
        assert sum(BUILDING in line for line in said) == cpu_kernels_enabled(), "\n".join(said)
        assert sum(TIMING in line for line in said) <= 1, "\n".join(said)
        second = generate(tmp_path, tp)  # the kernels built or still being built, the GEMMs timed
        assert notices(second.stderr) == [], second.stderr[-3000:]
    finally:
        stop_builders(tmp_path)


PROBE = 'extern "C" int minivllm_probe() { return 42; }\n'
CHILD = """import os
from minivllm.cpu.kernels import build_cpu_extension
print(build_cpu_extension("probe", os.environ["PROBE"]), flush=True)"""


@pytest.mark.skipif(not cpu_kernels_enabled(), reason="the C++ kernels are off here")
def test_two_processes_at_once_start_one_builder_and_one_says_so(tmp_path):
    "Two ranks asking at once for a library not built: one builder, one line; neither waits for it."
    env = run_env(tmp_path) | {"PROBE": PROBE}
    children = [subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env) for _ in range(2)]
    try:
        outs = [child.communicate(timeout=120) for child in children]
        assert {out for out, _ in outs} <= {"False\n", "True\n"}, outs  # True: a late start found it built
        assert sum(BUILDING in err for _, err in outs) == 1, outs
    finally:
        stop_builders(tmp_path)


# a sitecustomize that makes each rank process (notebook 01) say a notice and a warning as soon as it has configured
# its logging, as a kernel-build notice would; the command's own process says nothing
RANK_SAYS = """import sys
if any("_rank_process_main" in arg for arg in getattr(sys, "orig_argv", ())):
    import minivllm.distributed.processes as processes
    from minivllm.logger import logger
    configure = processes.configure_logging
    def configure_then_say(*args, **kwargs):
        done = configure(*args, **kwargs)
        logger.info("a notice from a rank")
        logger.warning("a warning from a rank")
        return done
    processes.configure_logging = configure_then_say
"""


def test_quiet_silences_the_notices_of_every_rank(tmp_path, chat_ckpt):
    "`generate --quiet --tp 2`: rank 1's notices are dropped too (it reads MINIVLLM_LOG_LEVEL), its warnings still shown."
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(RANK_SAYS)
    env = {k: v for k, v in os.environ.items() if k != "MINIVLLM_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path / "site"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "minivllm", "generate", "--model", str(chat_ckpt), "Hello", "--tp", "2",
                           "--max-tokens", "2", "--quiet"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("Hello"), done.stderr[-3000:]
    said = notices(done.stderr)
    assert [unprefixed(line) for line in said] == ["minivllm: a warning from a rank"], done.stderr[-3000:]
    assert said[0].startswith("(minivllm-rank1 pid="), said  # from rank 1, whose notice --quiet dropped
