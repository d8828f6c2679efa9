"""The host's time in one decode step at a batch of 256, without a model: the scheduler's step (with its step
message), the decode graph's inputs filled from the block tables a rank keeps and its draw settings (what a GPU
step's host builds; sampled at temperature 0.6, as nano-vllm's benchmark), and postprocess with the sampled tokens.
Medians over 300 steps, in milliseconds, in each of `--rounds` rounds; the round with the least host time is printed
last (a shared machine's other work only adds time).

    python tools/host_step.py [--batch 256] [--steps 300] [--rounds 1] [--ahead]

`--ahead` schedules each step before the one before it is recorded, as the engine does on a GPU (asynchronous
scheduling, notebook 11b): each sequence's newest token is still on its way, and the graph's inputs take it from the
step before's sampled tokens.

Run it in two worktrees (PYTHONPATH=<worktree>) to compare versions, alternating the order; name the CPU (lscpu).
"""
import argparse
import random
import statistics
import time

import torch

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.cuda_graphs import DecodeBuffers, GraphDraws
from minivllm.engine.scheduler import Scheduler
from minivllm.kv_cache import BlockTables
from minivllm.sampling_params import SamplingParams

BLOCK_SIZE, MAX_BLOCKS, VOCAB = 16, 128, 151_936  # Qwen3's vocabulary


def decoding_scheduler(batch: int) -> tuple[Scheduler, BlockTables]:
    "A scheduler with `batch` sampled requests of 300 to 300 + batch prompt tokens, past their prefill; the rank's tables."
    sched = Scheduler(BlockManager(batch * 80, BLOCK_SIZE), batch, 16384, 2048, [0])
    tables = BlockTables(batch, MAX_BLOCKS)
    for i in range(batch):
        sched.add([(7 * i + j) % 1000 + 1 for j in range(300 + i)],
                  SamplingParams(temperature=0.6, max_tokens=1000, ignore_eos=True))
    while sched.waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):
        b = sched.schedule()
        tables.update(b.step.table_updates)
        sched.postprocess(b, [5] * b.num_seqs)
    return sched, tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--ahead", action="store_true", help="schedule each step before the one before it lands")
    a = parser.parse_args()
    if min(a.batch, a.steps, a.rounds) < 1:
        parser.error("--batch, --steps and --rounds must be at least 1")
    sched, tables = decoding_scheduler(a.batch)
    buffers, rng = DecodeBuffers(a.batch, MAX_BLOCKS), random.Random(0)
    on_device = torch.randint(1, 1000, (a.batch,))  # the step before's sampled tokens, where the inputs take them
    flying = []  # steps scheduled, not recorded yet

    def step() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        flying.append(sched.schedule())
        t1 = time.perf_counter()
        b = flying[-1]
        tables.update(b.step.table_updates)
        buffers.fill(b.step, a.batch, tables, GraphDraws.of_step(b.step, VOCAB), on_device)
        t2 = time.perf_counter()
        if len(flying) <= a.ahead:  # the first step scheduled ahead: nothing to record yet
            return t1 - t0, t2 - t1, 0.0
        b = flying.pop(0)
        sampled = [rng.randrange(1, 1000) for _ in range(b.num_seqs)]  # (the device's tokens: not the host's time)
        t3 = time.perf_counter()
        sched.postprocess(b, sampled)
        return t1 - t0, t2 - t1, time.perf_counter() - t3

    for _ in range(20):
        step()
    rounds = []
    for _ in range(a.rounds):
        times = [step() for _ in range(a.steps)]
        rounds.append([statistics.median(t[k] for t in times) * 1e3 for k in range(3)])
    for name, parts in [(f"round {i + 1}", p) for i, p in enumerate(rounds)] * (a.rounds > 1) + [("best", min(rounds, key=sum))]:
        print(f"batch {a.batch}{', ahead' * a.ahead}, {name}: schedule {parts[0]:.3f} ms, graph inputs {parts[1]:.3f} ms, "
              f"postprocess {parts[2]:.3f} ms, host {sum(parts):.3f} ms")


if __name__ == "__main__":
    main()
