"""The shared-memory command channel: order and arguments at 1 and 3 workers, the size limit, clean shutdown,
a worker that raises, dies while starting, is killed or frozen, rank 0 killed or interrupted, two channels at once,
the stale-segment sweep."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from minivllm.distributed import RankFailure, worker_loop
from minivllm.engine.ipc import ShmCommandChannel, ShmCommandReceiver, encode_command
from minivllm.shm import segment_name, sweep_stale_segments

from minivllm.bench.workload import default_sigint
from minivllm.testing import Recorder, gone, records, wait_until

SHM = Path("/dev/shm")


class Worker:
    "A handler that idles, sleeps or fails on demand."
    def __init__(self, rank, fail_on_rank=None):
        if fail_on_rank == "init": raise RuntimeError(f"could not build the model on rank {rank}")
        self.rank, self.fail_on_rank = rank, fail_on_rank
    def noop(self, *args): pass
    def sleep(self, s, rank=None):
        if rank in (None, self.rank): time.sleep(s)
    def run(self, x):
        if self.rank == self.fail_on_rank: raise ValueError(f"bad input {x!r} on rank {self.rank}")


def commands():
    "A mix of arguments: none, scalars, nested Python objects, tensors of several dtypes."
    yield ("start",)
    for i in range(12):
        yield ("step", i, {"ids": list(range(i)), "nested": [(i, str(i)), {"x": None}]})
    yield ("tensors", torch.arange(10), torch.randn(3, 4, dtype=torch.float32), torch.ones(5, dtype=torch.bfloat16))
    yield ("mixed", [torch.tensor([i]) for i in range(3)], b"\x00bytes", 1.5, None, True)


def same(a, b) -> bool:
    "Equality that compares tensors by dtype and values, recursively."
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("n_workers", [1, 3])
def test_commands_arrive_in_order(n_workers, tmp_path):
    sent = list(commands())
    with ShmCommandChannel(n_workers) as ch:
        procs = ch.start_workers(Recorder, str(tmp_path))
        for i, (method, *args) in enumerate(sent):
            ch.call(method, *args, wait=i % 2 == 0)  # waiting or not must not change what arrives
        ch.call("exit")
    got_all = records(tmp_path)
    for rank in range(1, n_workers + 1):
        got = [(m, *a) for r, m, a in got_all if r == rank]
        assert len(got) == len(sent) + 1 and got[-1] == ("exit",)
        assert all(same(g, s) for g, s in zip(got, sent)), f"rank {rank} received {got}"
    assert [p.exitcode for p in procs] == [0] * n_workers


def test_commands_near_the_limit(tmp_path):
    limit = 1 << 20
    overhead = len(encode_command("blob", b"x" * (limit // 2))) - limit // 2  # pickle frames big objects differently
    exactly = b"\x01" * (limit - overhead)
    assert len(encode_command("blob", exactly)) == limit
    big_tensor = torch.arange((limit - 4096) // 8, dtype=torch.int64)  # a tensor pickles with ~600 bytes of overhead
    assert len(encode_command("tensor", big_tensor)) <= limit
    with ShmCommandChannel(1, max_bytes=limit) as ch:
        ch.start_workers(Recorder, str(tmp_path))
        ch.call("blob", exactly)
        ch.call("tensor", big_tensor)
        with pytest.raises(ValueError, match=r"command 'blob' pickles to 1,048,577 bytes, more than this channel's "
                                             r"limit of 1,048,576 bytes.*larger max_bytes"):
            ch.call("blob", exactly + b"\x01")
        ch.call("after", "the refusal")  # a refused command changes nothing
    (_, m1, a1), (_, m2, a2), (_, m3, a3), (_, m4, _) = records(tmp_path)
    assert m4 == "exit"  # close() ends the loop through the handler's exit hook
    assert (m1, m2, m3) == ("blob", "tensor", "after")
    assert a1 == (exactly,) and torch.equal(a2[0], big_tensor) and a3 == ("the refusal",)


def test_close_without_exit_command():
    "close() alone tells idle workers to exit: they leave cleanly (exit code 0), nobody needs killing."
    with ShmCommandChannel(2) as ch:
        procs = ch.start_workers(Worker)
        ch.call("noop")
        name = ch.name
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 2
    assert [p.exitcode for p in procs] == [0, 0] and not (SHM / name).exists()
    ch.close()  # idempotent
    with pytest.raises(RuntimeError, match="is closed"):
        ch.send("noop")


def test_worker_exception_reaches_rank0():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"worker rank 2 raised:\nTraceback(.|\n)*ValueError: bad input 1 on rank 2"):
        with ShmCommandChannel(2) as ch:
            procs = ch.start_workers(Worker, 2)
            ch.call("run", 1)
            ch.call("run", 2)  # the failure of command 1 on rank 2 surfaces at the latest here
            ch.call("run", 3)
    assert [p.is_alive() for p in procs] == [False, False] and not (SHM / ch.name).exists()
    # a failure while building the handler, and an unknown method, surface the same way
    with pytest.raises(RankFailure, match="RuntimeError: could not build the model on rank 1"):
        with ShmCommandChannel(1) as ch:
            ch.start_workers(Worker, "init")
            ch.call("noop")
            ch.call("noop")
    with pytest.raises(RankFailure, match="AttributeError: 'Worker' object has no attribute 'nope'"):
        with ShmCommandChannel(1) as ch:
            ch.start_workers(Worker)
            ch.call("nope")
            ch.call("noop")
    assert time.monotonic() - t0 < 30


def test_a_worker_that_dies_while_starting_is_named_with_its_last_words():
    "A worker that cannot even unpickle its handler (a module only rank 0 has): its exit code and its own error line."
    import types
    ghost = types.ModuleType("ghost_module_for_test")
    exec("class Handler:\n    def __init__(self, rank): pass\n    def noop(self): pass", ghost.__dict__)
    ghost.Handler.__module__ = ghost.__name__
    sys.modules[ghost.__name__] = ghost
    try:
        with pytest.raises(RankFailure, match=r"worker rank 1 \(pid \d+\) exited with exit code 1: "
                                              r"ModuleNotFoundError: No module named 'ghost_module_for_test'"):
            with ShmCommandChannel(1) as ch:
                ch.start_workers(ghost.Handler)
                ch.call("noop")
                ch.call("noop")
    finally:
        del sys.modules[ghost.__name__]


def test_a_frozen_worker_is_named_within_seconds():
    with ShmCommandChannel(2, stopped_grace_s=1.0) as ch:
        procs = ch.start_workers(Worker)
        ch.call("noop")
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"worker rank 2 \(pid \d+\) has been stopped \(SIGSTOP or a debugger\)"):
            ch.call("noop")
            ch.call("noop")
        assert time.monotonic() - t0 < 10
    assert [p.is_alive() for p in procs] == [False, False]


def test_killed_worker_is_named_not_waited_for():
    "Rank 0 blocked on a worker that is busy, then killed: the wait ends within a poll and names it."
    with ShmCommandChannel(2) as ch:
        procs = ch.start_workers(Worker)
        ch.call("sleep", 60, 1)  # acknowledged at once; rank 1 then sleeps, so it cannot take the next command
        killer = threading.Timer(0.5, os.kill, (procs[0].pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(RankFailure, match=r"worker rank 1 \(pid \d+\) died with exit code -9 \(killed by SIGKILL\)"):
                ch.call("noop")
        finally:
            killer.cancel()
        assert time.monotonic() - t0 < 5
    assert [p.is_alive() for p in procs] == [False, False]


RANK0 = textwrap.dedent("""
    import sys, time
    from minivllm.engine.ipc import ShmCommandChannel
    class Idle:
        def __init__(self, rank): pass
        def ping(self): pass
    ch = ShmCommandChannel(n_workers=2, grace_s=10)  # no main guard: the workers never run this script
    ch.start_workers(Idle)
    ch.call("ping")
    print(ch.name, *[p.pid for p in ch.processes.values()], flush=True)
    if sys.argv[1] == "exit_without_close":
        sys.exit(0)
    with ch:
        time.sleep(60)
""")


@pytest.mark.parametrize("how", ["sigkill", "keyboard_interrupt", "exit_without_close"])
def test_rank0_gone_leaves_nothing(how):
    "Rank 0 killed, interrupted, or exiting without close(): the workers exit and the segment is unlinked."
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=default_sigint)
    name, pids = None, []
    try:
        line = rank0.stdout.readline().split()
        assert line, rank0.communicate(timeout=30)[1]
        name, *pids = line[0], *map(int, line[1:])
        assert (SHM / name).exists() and len(pids) == 2
        if how == "sigkill": rank0.kill()
        if how == "keyboard_interrupt": rank0.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        assert wait_until(lambda: all(gone(p) for p in pids) and not (SHM / name).exists(), 10), \
            f"after {how}: workers alive {[p for p in pids if not gone(p)]}, segment there {(SHM / name).exists()}"
        elapsed = time.monotonic() - t0
        stderr = rank0.communicate(timeout=30)[1]  # once the workers and the resource tracker let go of the pipe
    finally:
        rank0.kill()
        for pid in pids:
            if not gone(pid): os.kill(pid, signal.SIGKILL)
        if name: (SHM / name).unlink(missing_ok=True)
    assert elapsed < 5
    assert "leaked" not in stderr and "resource_tracker" not in stderr, stderr
    if how == "sigkill":
        assert rank0.returncode == -signal.SIGKILL
    else:
        # (an uncaught KeyboardInterrupt ends Python with SIGINT itself, so that its parent sees why)
        assert rank0.returncode == (-signal.SIGINT if how == "keyboard_interrupt" else 0), stderr
        if how == "keyboard_interrupt": assert "KeyboardInterrupt" in stderr


def test_two_channels_side_by_side(tmp_path):
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    with ShmCommandChannel(1) as a, ShmCommandChannel(1) as b:
        assert a.name != b.name and (SHM / a.name).exists() and (SHM / b.name).exists()
        a.start_workers(Recorder, str(tmp_path / "a"))
        b.start_workers(Recorder, str(tmp_path / "b"))
        for i in range(5):
            a.call("to_a", i)
            b.call("to_b", -i)
    assert [(m, args) for _, m, args in records(tmp_path / "a")] == [("to_a", (i,)) for i in range(5)] + [("exit", ())]
    assert [(m, args) for _, m, args in records(tmp_path / "b")] == [("to_b", (-i,)) for i in range(5)] + [("exit", ())]


def test_protocol_in_one_process():
    "Both ends in one process: order, the acknowledgement timeout, long tracebacks, shutdown, bad arguments."
    with ShmCommandChannel(1, max_bytes=4096) as ch:
        rx = ShmCommandReceiver(ch.handle(1))
        for i in range(3):
            ch.send("step", i)
            assert rx.recv() == ("step", (i,))
        ch.send("unread")  # nobody reads it yet
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"worker rank 1 did not acknowledge command 4 within 0.3 s"):
            ch.wait(timeout_s=0.3)
        assert time.monotonic() - t0 < 2
        assert rx.recv() == ("unread", ())
        ch.wait()
        rx.report_error("Traceback:\n" + "x" * 100_000 + "\nValueError: the end survives")
        with pytest.raises(RankFailure) as err:
            ch.call("next")
        assert str(err.value).startswith("worker rank 1 raised:\n[...]") and str(err.value).endswith("the end survives")
        assert len(str(err.value)) < 17_000
    assert rx._shm.buf[16] == 1  # close() raised the shutdown flag (and closed this in-process receiver's pipe ends)
    rx.close()
    with pytest.raises(ValueError, match="n_workers must be at least 1"):
        ShmCommandChannel(0)
    with pytest.raises(TypeError, match="must be a str"):
        encode_command(None)


def test_wait_after_a_timeout_waits_only_for_the_missing_acks():
    with ShmCommandChannel(2, max_bytes=1024) as ch:
        rx1, rx2 = ShmCommandReceiver(ch.handle(1)), ShmCommandReceiver(ch.handle(2))
        ch.send("go")
        assert rx1.recv() == ("go", ())
        with pytest.raises(RankFailure, match="worker rank 2 did not acknowledge command 1 within 0.2 s"):
            ch.wait(timeout_s=0.2)
        assert rx2.recv() == ("go", ())
        ch.wait(timeout_s=5)  # rank 1's acknowledgement was taken already: only rank 2's is awaited
        ch.send("next")
        assert rx1.recv() == rx2.recv() == ("next", ())
        ch.wait(timeout_s=5)
        rx1.close(); rx2.close()


def test_worker_loop_calls_methods_and_exit_hook():
    calls = []

    class Handler:
        def add(self, x, y): calls.append(x + y)
        def exit(self, *args): calls.append(("exit", args))

    with ShmCommandChannel(1) as ch:
        rx = ShmCommandReceiver(ch.handle(1))
        ch.send("add", 1, 2)
        thread = threading.Thread(target=worker_loop, args=(rx, Handler()))
        thread.start()
        ch.call("add", 3, 4)
        ch.call("exit", "bye")
        thread.join(5)
        assert not thread.is_alive() and calls == [3, 7, ("exit", ("bye",))]
        rx.close()


def test_sweep_stale_segments(tmp_path):
    "The sweep, on a scratch directory standing in for /dev/shm (the real one may hold other engines' segments)."
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / segment_name(dead_pid)
    not_ours = tmp_path / f"minivllm-{dead_pid}"  # no random part: not a name we make
    other = tmp_path / f"other-{dead_pid}-abcd"
    live = tmp_path / segment_name()                # this process is alive
    for p in (stale, not_ours, other, live): p.write_bytes(b"x")
    assert sweep_stale_segments(tmp_path) == [stale.name]
    assert not stale.exists() and not_ours.exists() and other.exists() and live.exists()
    assert sweep_stale_segments(tmp_path / "no-such-dir") == []
