"""How long one engine command takes to reach another process: through notebook 10's shared-memory channel, and
through notebook 10a's gloo broadcast (the path to other machines), over command sizes. Writes the data of
notebook 10a's figure, nbs/command_paths.json, with the sizes of real commands of the packaged model marked.

    python tools/bench_command_paths.py            # about a minute on 2 cores
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from minivllm.engine.ipc import encode_command
from minivllm.engine.step import StepInputs
from minivllm.bench.comm import time_command_paths
from minivllm.cluster.multinode import INLINE_BYTES

SIZES = [256, 1024, 4096, 16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024]


def command_sizes(block_size: int = 16) -> dict[str, int]:
    "Pickled sizes of `run` commands: decodes of 8 and 256 sequences of 512 tokens, and an 8,192-token prefill."
    def decode(n: int, tokens: int = 512) -> StepInputs:
        blocks = -(-tokens // block_size)
        return StepInputs.build(False, [[1000 + i] for i in range(n)], [tokens - 1] * n,
                                [list(range(i * blocks, (i + 1) * blocks)) for i in range(n)], block_size,
                                greedy=True, num_threads=1)
    prefill = StepInputs.build(True, [[1000 + (s * 1024 + i) % 3000 for i in range(1024)] for s in range(8)], [0] * 8,
                               [list(range(s * 64, (s + 1) * 64)) for s in range(8)], block_size, num_threads=1)
    return {"decode, 8 seqs": len(encode_command("run", decode(8))),
            "decode, 256 seqs": len(encode_command("run", decode(256))),
            "prefill, 8k tokens": len(encode_command("run", prefill))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "nbs" / "command_paths.json"))
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    times = time_command_paths(SIZES, iters=a.iters, repeats=a.repeats)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor())
    out = {"machine": f"{cpu.split('@')[0].strip()}, loopback", "inline_bytes": INLINE_BYTES,
           "command": f"python tools/bench_command_paths.py --iters {a.iters} --repeats {a.repeats}",
           "commands": command_sizes(), "times": {path: {str(n): t for n, t in ts.items()} for path, ts in times.items()}}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for path, ts in times.items():
        print(path, " ".join(f"{n}:{t * 1e6:.0f}us" for n, t in ts.items()))
    print(out["commands"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
