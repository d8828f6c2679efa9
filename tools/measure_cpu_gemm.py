"""Time the CPU GEMMs (plain F.linear, MKL packed, oneDNN packed) on every weight shape of the packaged model and of
SmolLM2-135M at TP=1, the way the engine's `choose_gemm` does but with more rounds, and store the table, the kernel
the rule picks for each shape and what the engine's own measurement costs in nbs/cpu_gemm.json, which notebook 03
draws. Run it on a quiet machine:

    python tools/measure_cpu_gemm.py              # threads: torch's default (the engine's at TP=1)
    python tools/measure_cpu_gemm.py --rounds 9
    python tools/measure_cpu_gemm.py --dtype bfloat16   # bfloat16 weights: stored under "bfloat16" in the same file
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from minivllm.checkpoints import SHAPES
from minivllm.cpu.gemm import (GEMM_ROWS, LOGIT_ROWS, choose_gemm, cores_busy_elsewhere, cpu_model, gemm_kernels,
                                    machine_busy, pick_gemm, relative_times, time_gemm)
from minivllm.testing import DEFAULT_MODEL

OUT = Path(__file__).resolve().parents[1] / "nbs" / "cpu_gemm.json"


def layer_shapes(c: dict) -> dict[str, tuple[int, int]]:
    "The `(out, in)` weight of each linear layer of a transformer block and of the LM head, at TP=1."
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    h, i = c["hidden_size"], c["intermediate_size"]
    return {"qkv": ((c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd, h),
            "o": (h, c["num_attention_heads"] * hd), "gate_up": (2 * i, h), "down": (h, i), "lm_head": (c["vocab_size"], h)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    models = {"packaged model": json.loads((DEFAULT_MODEL / "config.json").read_text()),
              "SmolLM2-135M": SHAPES["smollm2-135m"]}
    kernels, result = gemm_kernels(dtype), []
    for model, config in models.items():
        for layer, (n, k) in layer_shapes(config).items():
            w = (torch.randn(n, k) * 0.05).to(dtype)
            rows = LOGIT_ROWS if layer == "lm_head" else GEMM_ROWS
            before = machine_busy()
            samples = time_gemm(w, kernels, rows, rounds=a.rounds)
            busy = cores_busy_elsewhere(before, machine_busy())
            with tempfile.TemporaryDirectory() as tmp:  # what the engine pays once: choose_gemm on an empty cache
                start = time.perf_counter()
                engine_pick = choose_gemm(w, rows=rows, cache=Path(tmp) / "c.json")
                cost = time.perf_counter() - start
            us = {kk: [[round(t * 1e6, 2) for t in s] for s in per_rows] for kk, per_rows in samples.items()}
            row = dict(model=model, layer=layer, shape=[n, k], rows=list(rows), pick=pick_gemm(samples),
                       engine_pick=engine_pick, measure_s=round(cost, 3), busy_elsewhere=round(busy, 2),
                       median_us={kk: [statistics.median(s) for s in per_rows] for kk, per_rows in us.items()},
                       relative={kk: [round(r, 3) for r in rel] for kk, rel in relative_times(samples).items()},
                       samples_us=us)
            print(json.dumps({kk: v for kk, v in row.items() if kk != "samples_us"}), flush=True)
            result.append(row)
    table = dict(cpu=cpu_model(), torch=torch.__version__, threads=torch.get_num_threads(), rounds=a.rounds,
                 kernels=kernels, shapes=result)
    out = Path(a.out)
    old = json.loads(out.read_text()) if out.exists() else {}
    # float32's table at the top (as notebook 03 reads it), bfloat16's under "bfloat16"; a run replaces only its own
    data = table | {"bfloat16": old.get("bfloat16")} if a.dtype == "float32" else old | {"bfloat16": table}
    out.write_text(json.dumps({k: v for k, v in data.items() if v is not None}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
