"""`minivllm bench`'s workload with the CPU GEMM chosen by measurement (`auto`) against each kernel forced
(`MINIVLLM_CPU_GEMM`), in one process, the settings taking turns in alternating order, float32, greedy, TP=1, the
engine's default threads. Prints each run, the median tokens/s of each setting with its spread, and each setting's
ratio to the first one within every round (median, min-max):

    python tools/bench_cpu_gemm.py --repeats 6                                   # the packaged model, 64 requests
    python tools/bench_cpu_gemm.py --repeats 6 --random-shape smollm2-135m --num-prompts 32
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from minivllm.bench.throughput import bench_minivllm
from minivllm.bench.workload import Workload, device_name
from minivllm.checkpoints import SHAPES, random_checkpoint
from minivllm.config import Config
from minivllm.cpu.gemm import cpu_model
from minivllm.model_source import DEFAULT_MODEL


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gemm", default="auto,mkl", help="comma-separated settings; ratios are to the first")
    p.add_argument("--random-shape", default=None, choices=sorted(SHAPES))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    model = random_checkpoint(a.random_shape) if a.random_shape else DEFAULT_MODEL
    workload = Workload.make(Config.from_pretrained(model).vocab_size, a.num_prompts)
    settings = a.gemm.split(",")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    log(f"{device_name()} ({cpu_model()}); model {Path(model).name}, {a.num_prompts} requests, "
        f"{workload.output_tokens} output tokens, {a.dtype}")
    speeds: dict[str, list[float]] = {s: [] for s in settings}
    for rep in range(a.repeats):
        for s in (settings if rep % 2 == 0 else settings[::-1]):  # subtle: alternate, so drift hits all alike
            os.environ["MINIVLLM_CPU_GEMM"] = s  # read by every layer's pack_for_cpu when the engine starts
            r = bench_minivllm(model, workload, 1, a.dtype)
            speeds[s].append(r.tokens_per_s)
            log(f"run {rep + 1}/{a.repeats} {s}: {r.tokens_per_s:.0f} tok/s (start-up {r.startup_seconds:.1f} s)")
    base = settings[0]
    for s in settings:
        v = speeds[s]
        ratios = [x / b for x, b in zip(v, speeds[base])]
        print(f"{s:>7}: {statistics.median(v):7.0f} tok/s ({min(v):.0f}-{max(v):.0f})   {s}/{base}: "
              f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}), {len(v)} runs")


if __name__ == "__main__":
    main()
