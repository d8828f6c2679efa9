"""The shared-memory collectives against gloo's at 2 and 4 ranks, for sizes on both sides of the one-shot/two-shot
crossover and beyond a slot; bit-identical across ranks; and their faults: a rank killed or frozen in the middle of
an all-reduce, a rank that leaves, rank 0 killed, a /dev/shm without room, a machine without the fast path."""
import os
import signal
import sys
import time
from functools import partial
from pathlib import Path

import cloudpickle
import pytest
import torch

import minivllm.shm_allreduce as shm_module
from minivllm.distributed import ProcessGroupCommunicator, RankFailure
from minivllm.shm_allreduce import ShmAllReduce, ShmCommunicator, make_communicator
from minivllm.testing import run_on_ranks

# subtle: tests/ is not a package; the ranks get this module's functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SHM = Path("/dev/shm")
SLOT = 1 << 20
# sizes in elements: tiny, one-shot territory, above the 4-rank crossover (2 MiB of float32), above a 1 MiB slot
SIZES = [7, 64 * 1024, 600 * 1024, 300 * 1024]
ELEMENT_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.int64: 8}


def compare(comm, sizes, dtype, two_shot_bytes):
    "For each size: shm all-reduce, gloo all-reduce, every rank's copy, one-shot vs two-shot, and the other collectives."
    comm.shm.two_shot_bytes = two_shot_bytes
    out = []
    for n in sizes:
        g = torch.Generator().manual_seed(1000 * comm.rank + n)
        x = (torch.randn(n, generator=g) * 10).to(dtype) if dtype.is_floating_point else torch.randint(-99, 99, (n,), generator=g)
        fits = comm.shm.fits(x)
        fast = comm.all_reduce(x.clone())
        gloo = ProcessGroupCommunicator.all_reduce(comm, x.clone())
        copies = comm.all_gather(fast.unsqueeze(0), dim=0)
        both = (comm.shm.all_reduce_one_shot(x.clone()), comm.shm.all_reduce_two_shot(x.clone())) if fits else None
        small = x[:5].contiguous()
        gathered = (comm.all_gather(small), ProcessGroupCommunicator.all_gather(comm, small),
                    comm.gather(small, dst=1), comm.broadcast(small.clone(), src=comm.world_size - 1))
        out.append(dict(n=n, fits=fits, fast=fast, gloo=gloo, copies=copies, both=both, gathered=gathered,
                        inputs=comm.all_gather(x.unsqueeze(0), dim=0)))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_shared_memory_collectives_equal_gloo(world_size, dtype):
    connect = partial(ShmCommunicator.connect, slot_bytes=SLOT)
    two_shot = 2 << 20 if world_size == 4 else float("inf")
    results = run_on_ranks(compare, world_size, SIZES, dtype, two_shot, connect=connect)
    assert [r["fits"] for r in results] == [n * ELEMENT_BYTES[dtype] <= SLOT for n in SIZES]
    for r in results:
        inputs = r["inputs"]
        in_rank_order = inputs[0].clone()
        for other in inputs[1:]: in_rank_order += other
        for copy in r["copies"]:  # every rank holds the same bits
            torch.testing.assert_close(copy, r["fast"], rtol=0, atol=0)
        if r["fits"]:
            torch.testing.assert_close(r["fast"], in_rank_order, rtol=0, atol=0)  # slots added in rank order
            for one_or_two in r["both"]:
                torch.testing.assert_close(one_or_two, r["fast"], rtol=0, atol=0)
        if world_size == 2 or not dtype.is_floating_point:  # a + b == b + a: gloo's sum to the bit
            torch.testing.assert_close(r["fast"], r["gloo"], rtol=0, atol=0)
        else:  # gloo adds four in its own order
            tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.5)
            torch.testing.assert_close(r["fast"], r["gloo"], **tol)
        shm_all, gloo_all, on_rank1, from_last = r["gathered"]
        torch.testing.assert_close(shm_all, gloo_all, rtol=0, atol=0)
        assert on_rank1 is None  # we are rank 0
        torch.testing.assert_close(from_last, inputs[-1][:5], rtol=0, atol=0)


def die_in_the_middle(comm, victim, how):
    "Rank `victim` is killed (or frozen) instead of taking part in the second all-reduce; the others wait in it."
    x = torch.ones(1000)
    comm.all_reduce(x)
    if comm.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
    except RankFailure as e:
        raise RankFailure(f"{e} [after {time.monotonic() - t0:.1f} s]") from None


@pytest.mark.parametrize("world_size, victim", [(2, 1), (4, 2), (2, 0)])
def test_a_rank_killed_in_the_middle_of_an_all_reduce(world_size, victim):
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=rf"rank {victim} (\(pid \d+\) died|died with exit code -9)"):
        run_on_ranks(die_in_the_middle, world_size, victim, "kill", connect=ShmCommunicator.connect)
    assert time.monotonic() - t0 < 30


def test_a_frozen_rank_is_named_within_seconds():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) has been stopped"):
        run_on_ranks(die_in_the_middle, 2, 1, "stop", connect=ShmCommunicator.connect)
    assert time.monotonic() - t0 < 15


def one_leaves(comm):
    "Rank 1 leaves the group while rank 0 waits for it in an all-reduce."
    if comm.rank == 1:
        comm.close()
        time.sleep(5)
        return None
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(10))
    except RankFailure as e:
        return str(e), time.monotonic() - t0


def test_a_rank_that_leaves_stops_the_others_at_once():
    message, waited = run_on_ranks(one_leaves, 2, connect=ShmCommunicator.connect)
    assert "rank 1 left the group" in message and waited < 2


def without_room(rank, world_size, port, **kw):
    "Connect as if /dev/shm were full: the segment cannot be created."
    def full(size): raise MemoryError("/dev/shm has 0 MiB free (a test)")
    shm_module.create_shared_memory = full
    return ShmCommunicator.connect(rank, world_size, port, **kw)


def sums(comm):
    return comm.shm is None, comm.all_reduce(torch.full((4,), comm.rank + 1.0)), comm.all_gather(torch.ones(1))


def test_no_room_in_dev_shm_falls_back_to_gloo():
    no_shm, total, gathered = run_on_ranks(sums, 2, connect=without_room)
    assert no_shm and total.tolist() == [3.0] * 4 and gathered.tolist() == [1.0, 1.0]


def elsewhere(rank, world_size, port, **kw):
    "make_communicator on a machine without the fast path (not x86-64)."
    shm_module.SHM_ALLREDUCE_SUPPORTED = False
    return make_communicator(rank, world_size, port, **kw)


def kind(comm):
    return type(comm).__name__, comm.all_reduce(torch.ones(2)).tolist()


def test_the_communicator_is_picked_by_machine():
    assert run_on_ranks(kind, 2, connect=elsewhere) == ("ProcessGroupCommunicator", [2.0, 2.0])
    assert run_on_ranks(kind, 2, connect=make_communicator) == ("ShmCommunicator", [2.0, 2.0])
    assert type(make_communicator(0, 1)).__name__ == "Communicator"


def test_two_segments_are_torn_down_by_their_owner_only():
    "One process, two ends: the attached end closing leaves the segment; the owner's close unlinks it."
    owner = ShmAllReduce.create(2, 4096)
    name = owner.name
    peer = ShmAllReduce.attach(name, 1, 2, 4096)
    peer.close()
    assert (SHM / name).exists()
    owner.close()
    owner.close()  # idempotent
    assert not (SHM / name).exists()
