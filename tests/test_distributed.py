"""The communicator and the rank launcher: collectives at 2 and 4 ranks, failures (raised, killed, frozen), the
rendezvous on loopback only, rank processes that never run the caller's script, torchrun."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from minivllm.distributed import (Communicator, CountingCommunicator, ProcessGroupCommunicator, RankFailure,
                                  RankProcess, divide, free_port, listen_socket, process_state)

from minivllm.testing import rank_processes, run_on_ranks, tcp_listeners


def collectives(comm):
    "Each rank contributes a [2, 3] block filled with its rank + 1."
    r, n = comm.rank, comm.world_size
    x = torch.full((2, 3), float(r + 1))
    return dict(n=n, threads=torch.get_num_threads(), reduced=comm.all_reduce(x.clone()),
                smallest=comm.all_reduce(x.clone(), op="min"), largest=comm.all_reduce(x.clone(), op="max"),
                gathered=comm.all_gather(x, dim=-1), gathered0=comm.all_gather(x, dim=0),
                on_rank0=comm.gather(x, dim=-1), from_last=comm.broadcast(x.clone(), src=n - 1))


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives(world_size):
    out = run_on_ranks(collectives, world_size)
    blocks = [torch.full((2, 3), float(r + 1)) for r in range(world_size)]
    assert out["n"] == world_size and out["threads"] == 1
    torch.testing.assert_close(out["reduced"], sum(blocks))
    torch.testing.assert_close(out["smallest"], blocks[0])
    torch.testing.assert_close(out["largest"], blocks[-1])
    torch.testing.assert_close(out["gathered"], torch.cat(blocks, dim=-1))
    torch.testing.assert_close(out["gathered0"], torch.cat(blocks, dim=0))
    torch.testing.assert_close(out["on_rank0"], torch.cat(blocks, dim=-1))
    torch.testing.assert_close(out["from_last"], blocks[-1])


def others_get_none(comm):
    "What gather returns on every rank (to rank 1), collected on rank 0."
    got = comm.gather(torch.ones(2), dst=1)
    return comm.all_gather(torch.tensor([float(got is None)]))


def test_gather_gives_none_elsewhere():
    torch.testing.assert_close(run_on_ranks(others_get_none, 3), torch.tensor([1.0, 0.0, 1.0]))


def test_single_rank_is_plain_torch():
    comm = Communicator()
    x = torch.randn(3)
    assert comm.all_reduce(x) is x and comm.all_gather(x) is x and comm.gather(x) is x and comm.broadcast(x) is x
    assert run_on_ranks(collectives, 1)["n"] == 1


def test_a_placement_refuses_to_communicate():
    comm = Communicator(rank=1, world_size=4)
    for call in (lambda: comm.all_reduce(torch.ones(1)), lambda: comm.gather(torch.ones(1)), comm.barrier):
        with pytest.raises(RuntimeError, match="places a shard as rank 1 of 4 but has no process group"):
            call()
    for rank, size in ((2, 2), (-1, 2), (0, 0), (True, 2), (0, 2.0)):
        with pytest.raises(ValueError, match="is not a rank of a group of world_size"):
            Communicator(rank, size)


def test_counting_communicator():
    counting = CountingCommunicator(Communicator())
    for _ in range(3): counting.all_reduce(torch.ones(1))
    counting.all_gather(torch.ones(1)); counting.broadcast(torch.ones(1))
    assert dict(counting.counts) == {"all_reduce": 3, "all_gather": 1, "broadcast": 1}


def raises_on_last_rank(comm):
    if comm.rank == comm.world_size - 1:
        raise KeyError("the last rank failed")
    comm.all_reduce(torch.ones(1))  # the others block here for a partner that never comes


def killed_rank(comm):
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(torch.ones(1))


def frozen_rank(comm, stopped_at: Path | None = None):
    if comm.rank == 1:
        if stopped_at is not None: stopped_at.write_text(repr(time.monotonic()))  # subtle: CLOCK_MONOTONIC is system-wide
        os.kill(os.getpid(), signal.SIGSTOP)
    comm.all_reduce(torch.ones(1))


def sleeps(comm):
    time.sleep(60)


def test_failures_are_reported_and_nothing_survives():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 3 of 4 raised:(.|\n)*KeyError: 'the last rank failed'"):
        run_on_ranks(raises_on_last_rank, 4)
    with pytest.raises(RankFailure, match=r"rank 1 (\(pid \d+\) died|died with exit code -9 \(killed by SIGKILL\))"):
        run_on_ranks(killed_rank, 2)
    with pytest.raises(RankFailure, match="did not finish within 3 s"):
        run_on_ranks(sleeps, 2, timeout_s=3)
    assert time.monotonic() - t0 < 60  # no failure waits for a collective's own (long) timeout


def test_a_frozen_rank_is_named_within_seconds(tmp_path):
    "A SIGSTOPped rank costs seconds, not gloo's timeout: its peer names it."
    stopped_at = tmp_path / "stopped_at"
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) has been stopped \(SIGSTOP or a debugger\)"):
        run_on_ranks(frozen_rank, 2, stopped_at)
    assert time.monotonic() - float(stopped_at.read_text()) < 10  # from the freeze, not from the ranks' start-up


def test_process_state():
    assert process_state(os.getpid()) == "running"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        assert wait_for(lambda: process_state(child.pid) == "stopped")
        os.kill(child.pid, signal.SIGCONT)
        assert wait_for(lambda: process_state(child.pid) == "running")
    finally:
        child.kill()
    assert wait_for(lambda: process_state(child.pid) == "dead")  # a zombie: not reaped yet, dead all the same
    child.wait()
    assert process_state(child.pid) == "dead"


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline: return False
        time.sleep(0.02)
    return True


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        run_on_ranks(collectives, 0)
    with pytest.raises(ValueError, match="rank=2 is outside 0..1"):
        ProcessGroupCommunicator.connect(2, 2, free_port())
    with pytest.raises(ValueError, match="pass rank=, world_size= and port= together"):
        ProcessGroupCommunicator.connect(0, 2)
    with pytest.raises(ValueError, match="only rank 0 serves the rendezvous"):
        with listen_socket() as s:
            ProcessGroupCommunicator.connect(1, 2, listener=s)
    with pytest.raises(ValueError, match=r"hidden_size=10 is not divisible by 4"):
        divide(10, 4, "hidden_size")


def test_rank0_alone_gives_up_with_a_named_count():
    with pytest.raises(RankFailure, match="only 1 of 2 ranks joined the process group within 1"):
        ProcessGroupCommunicator.connect(0, 2, free_port(), timeout_s=1)


def test_two_groups_side_by_side():
    "Two TP groups on one machine at once: each listens on its own port."
    results, errors = {}, []

    def launch(key, n):
        try: results[key] = run_on_ranks(collectives, n)
        except Exception as e: errors.append(e)

    threads = [threading.Thread(target=launch, args=(k, 2)) for k in ("a", "b")]
    for t in threads: t.start()
    for t in threads: t.join()
    assert not errors, errors
    for key in ("a", "b"):
        torch.testing.assert_close(results[key]["reduced"], torch.full((2, 3), 3.0))


def addresses_of_the_group(comm):
    "Every rank's TCP listeners, while the group is up."
    return comm_gather_strings(comm, tcp_listeners([os.getpid()]))


def comm_gather_strings(comm, strings):
    "Every rank's list of strings, on every rank (through an all_gather of fixed-size byte tensors)."
    data = "\n".join(strings).encode().ljust(4096, b"\0")
    parts = comm.all_gather(torch.frombuffer(bytearray(data), dtype=torch.uint8).unsqueeze(0), dim=0)
    return [bytes(p.tolist()).rstrip(b"\0").decode().split("\n") for p in parts]


@pytest.mark.skipif(subprocess.run(["which", "ss"], capture_output=True).returncode != 0, reason="needs ss (iproute2)")
def test_no_rank_listens_once_the_group_is_up():
    "The rendezvous store closes and gloo's own ports close once the ranks are connected: nothing left to reach."
    per_rank = run_on_ranks(addresses_of_the_group, 2)
    assert [list(filter(None, addresses)) for addresses in per_rank] == [[], []], per_rank


def test_a_rank_never_runs_the_callers_script(tmp_path):
    "A script without a main guard starts ranks: they run only the function, never the script."
    marker = tmp_path / "runs.txt"
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import torch
        from minivllm.testing import run_on_ranks
        open({str(marker)!r}, "a").write("script\\n")
        def total(comm):
            return comm.all_reduce(torch.tensor([comm.rank + 1.0])).item()
        print("sum", run_on_ranks(total, 2))
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sum 3.0" in proc.stdout and marker.read_text() == "script\n"


def prints_and_fails(message):
    print("a line before the end", file=sys.stderr)
    raise ValueError(message)


def test_rank_process_keeps_its_last_error_line():
    p = RankProcess(prints_and_fails, "the shard does not fit", name="test-rank")
    p.join(60)
    assert p.exitcode == 1
    assert p.describe() == "exited with exit code 1: ValueError: the shard does not fit"
    assert "a line before the end" in p.stderr_tail


def test_torchrun_environment(tmp_path):
    "Under torchrun (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE), connect() needs no arguments."
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch
        from minivllm.distributed import ProcessGroupCommunicator
        torch.set_num_threads(1)
        comm = ProcessGroupCommunicator.connect()
        x = comm.all_reduce(torch.tensor([float(comm.rank + 1)]))
        print(f"rank {comm.rank}/{comm.world_size} sum {x.item():.0f}")
        comm.close()
    """))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rank 0/2 sum 3" in proc.stdout and "rank 1/2 sum 3" in proc.stdout


def test_connect_without_torchrun_variables(monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="needs the environment variables"):
        ProcessGroupCommunicator.connect()


def test_listen_socket_holds_the_port_from_the_start():
    "The port rank 0 serves is bound (on loopback) before any rank starts: nobody can take it in between."
    with listen_socket() as s:
        host, port = s.getsockname()
        assert host == "127.0.0.1"
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
    assert not rank_processes(os.getpid())


def test_a_one_gpu_machine_runs_two_ranks_on_the_cpu_unless_told_otherwise(monkeypatch, caplog, tmp_path):
    "The default device and backend count the GPUs: one GPU and two ranks means the CPU and gloo, said once."
    from minivllm.distributed import default_backend, default_device
    from minivllm.engine.args import EngineArgs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert (default_device(1), default_backend(1)) == ("cuda", "nccl")
    assert (default_device(2), default_backend(2)) == ("cpu", "gloo")
    with caplog.at_level("WARNING", logger="minivllm"):
        assert EngineArgs(tmp_path, tensor_parallel_size=2).device == "cpu"
    assert "needs 2 GPUs on this machine, but 1 are visible: its ranks run on the CPU" in caplog.text
    assert EngineArgs(tmp_path, tensor_parallel_size=1).device == "cuda"
    with pytest.raises(ValueError, match="needs 2 GPUs per machine, but 1 are visible"):
        EngineArgs(tmp_path, tensor_parallel_size=2, device="cuda")  # told to use GPUs: it insists
