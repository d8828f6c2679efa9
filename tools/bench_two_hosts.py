"""One machine against two "machines" on this one (notebook 10a): the packaged model at TP=2, first as two ranks on
one host (shared-memory commands and all-reduces), then as one rank on each of two hosts joined by loopback (a
`minivllm worker` for node 1; gloo broadcasts and all-reduces), in alternating order. Prints output tokens per
second of a greedy batch of 32 requests (64 tokens each) and the ratio of each pair.

    python tools/bench_two_hosts.py            # about two minutes on 2 cores
"""
from __future__ import annotations

import argparse
import sys
import time

from minivllm import LLM, SamplingParams
from minivllm.distributed import free_port
from minivllm.testing import WorkerNode


def tokens_per_second(two_hosts: bool, prompts: list[list[int]], params: SamplingParams) -> float:
    "Output tokens per second of one `generate` of `prompts` (after a warm-up), on one host or on two."
    port = free_port()
    node = WorkerNode("127.0.0.1", port) if two_hosts else None
    spread = dict(nnodes=2, master_port=port) if two_hosts else {}
    with LLM(tensor_parallel_size=2, num_threads=1, **spread) as llm:
        llm.generate(prompts[:4], params, use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    if node is not None:
        node.wait()
    return sum(len(o.token_ids) for o in outputs) / seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3)
    a = p.parse_args(argv)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = [[(i * 7 + j * 13) % 4000 + 10 for j in range(32 + i % 64)] for i in range(32)]
    one, two = [], []
    for pair in range(a.pairs):
        for two_hosts in ((False, True) if pair % 2 == 0 else (True, False)):
            (two if two_hosts else one).append(tokens_per_second(two_hosts, prompts, params))
    print("one host, tokens/s:  ", [round(x) for x in one])
    print("two hosts, tokens/s: ", [round(x) for x in two])
    print("two / one, per pair: ", [round(b / a, 2) for a, b in zip(one, two)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
