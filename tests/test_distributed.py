"""The process-group helpers and the rank launcher: collectives at 2 and 4 ranks, failures, torchrun."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from minivllm.distributed import (RankFailure, all_gather, all_reduce, divide, free_port, gather_to_rank0,
                                  init_distributed, run_on_ranks, tp_rank, tp_size)


def collectives():
    "Each rank contributes a [2, 3] block filled with its rank + 1."
    r, n = tp_rank(), tp_size()
    x = torch.full((2, 3), float(r + 1))
    return dict(n=n, threads=torch.get_num_threads(), reduced=all_reduce(x.clone()),
                gathered=all_gather(x, dim=-1), gathered0=all_gather(x, dim=0), on_rank0=gather_to_rank0(x, dim=-1))


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives(world_size):
    out = run_on_ranks(collectives, world_size)
    blocks = [torch.full((2, 3), float(r + 1)) for r in range(world_size)]
    assert out["n"] == world_size and out["threads"] == 1
    torch.testing.assert_close(out["reduced"], sum(blocks))
    torch.testing.assert_close(out["gathered"], torch.cat(blocks, dim=-1))
    torch.testing.assert_close(out["gathered0"], torch.cat(blocks, dim=0))
    torch.testing.assert_close(out["on_rank0"], torch.cat(blocks, dim=-1))


def others_get_none():
    "What gather_to_rank0 returns on every rank, collected on rank 0."
    got = gather_to_rank0(torch.ones(2))
    flags = all_gather(torch.tensor([float(got is None)]))
    return flags


def test_gather_to_rank0_gives_none_elsewhere():
    torch.testing.assert_close(run_on_ranks(others_get_none, 3), torch.tensor([0.0, 1.0, 1.0]))


def test_single_rank_is_plain_torch():
    assert (tp_rank(), tp_size()) == (0, 1)
    x = torch.randn(3)
    assert all_reduce(x) is x and all_gather(x) is x and gather_to_rank0(x) is x
    assert run_on_ranks(collectives, 1)["n"] == 1


def raises_on_last_rank():
    if tp_rank() == tp_size() - 1:
        raise KeyError("the last rank failed")
    all_reduce(torch.ones(1))  # the others block here for a partner that never comes


def killed_rank():
    if tp_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    all_reduce(torch.ones(1))


def sleeps():
    time.sleep(60)


def test_failures_are_reported_and_nothing_survives():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 3 of 4 raised:(.|\n)*KeyError: 'the last rank failed'"):
        run_on_ranks(raises_on_last_rank, 4)
    with pytest.raises(RankFailure, match=r"rank 1 died with exit code -9 \(killed by SIGKILL\)"):
        run_on_ranks(killed_rank, 2)
    with pytest.raises(RankFailure, match="did not finish within 3 s"):
        run_on_ranks(sleeps, 2, timeout_s=3)
    assert time.monotonic() - t0 < 60  # no failure waits for a collective's own (long) timeout


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        run_on_ranks(collectives, 0)
    with pytest.raises(ValueError, match="rank=2 is outside 0..1"):
        init_distributed(2, 2, free_port(), backend="gloo")
    with pytest.raises(ValueError, match="pass rank=, world_size= and port= together"):
        init_distributed(0, 2)
    with pytest.raises(ValueError, match=r"hidden_size=10 is not divisible by 4"):
        divide(10, 4, "hidden_size")


def test_two_groups_side_by_side():
    "Two TP groups on one machine at once: each picks its own free port."
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


def test_torchrun_environment(tmp_path):
    "Under torchrun (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE), init_distributed() needs no arguments."
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch
        from minivllm.distributed import init_distributed, destroy_distributed, all_reduce, tp_rank, tp_size
        torch.set_num_threads(1)
        init_distributed()
        x = all_reduce(torch.tensor([float(tp_rank() + 1)]))
        print(f"rank {tp_rank()}/{tp_size()} sum {x.item():.0f}")
        destroy_distributed()
    """))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rank 0/2 sum 3" in proc.stdout and "rank 1/2 sum 3" in proc.stdout


def test_init_without_torchrun_variables(monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="needs the environment variables"):
        init_distributed()


def test_port_taken_before_rank0_binds_it(monkeypatch):
    "If another process grabs the chosen port first, the launcher retries on a fresh one."
    import socket
    import minivllm.distributed as d
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0)); busy.listen()
    ports = iter([busy.getsockname()[1]])
    real_free_port = d.free_port
    monkeypatch.setattr(d, "free_port", lambda host="127.0.0.1": next(ports, None) or real_free_port(host))
    try:
        out = run_on_ranks(collectives, 2)
    finally:
        busy.close()
    torch.testing.assert_close(out["reduced"], torch.full((2, 3), 3.0))
