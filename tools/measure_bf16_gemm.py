"""bfloat16 GEMMs on this CPU against the float32 ones, on every weight of the packaged model and of SmolLM2-135M
(TP=1): plain `F.linear` in bfloat16, oneDNN's packed matmul on a bfloat16 weight (float32 accumulation; AMX or
AVX512_BF16 where the CPU has them) and, for scale, float32's MKL packed GEMM. Same timing as the engine's
`time_gemm` (kernels side by side in alternating rounds); prints the median time per call of each and each one's
time relative to the fastest in the same round, and writes the table as JSON if asked:

    python tools/measure_bf16_gemm.py [--rounds 11] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minivllm.checkpoints import SHAPES
from minivllm.cpu.gemm import GEMM_ROWS, LOGIT_ROWS, PackedWeight, cpu_model, relative_times
from minivllm.testing import DEFAULT_MODEL

from measure_cpu_gemm import layer_shapes  # tools/, beside this script



def kernels_for(w32: torch.Tensor) -> dict:
    "The candidates on one weight: name -> (function of x, the input dtype it takes)."
    w16 = w32.bfloat16()
    onednn16 = torch.ops.mkldnn._reorder_linear_weight(w16, batch_size=64)
    mkl32 = PackedWeight(w32)
    return {"bf16 F.linear": (lambda x: F.linear(x, w16), torch.bfloat16),
            "bf16 oneDNN packed": (lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn16, None, "none", [], ""),
                                   torch.bfloat16),
            "f32 MKL packed": (lambda x: mkl32(x), torch.float32)}


def time_all(calls: dict, k_in: int, rows, rounds: int, sample_s: float = 2e-3) -> dict[str, list[list[float]]]:
    "Seconds per call, `[row count][round]`, the kernels in alternating order each round (as `time_gemm`)."
    names, samples = list(calls), {n: [] for n in calls}
    for m in rows:
        x32 = torch.randn(m, k_in)
        xs = {n: x32.to(dt) for n, (_, dt) in calls.items()}
        for n, (f, _) in calls.items(): f(xs[n])
        start = time.perf_counter(); calls[names[0]][0](xs[names[0]]); once = time.perf_counter() - start
        reps = max(1, min(200, round(sample_s / max(once, 1e-7))))
        for n in names: samples[n].append([])
        for r in range(rounds):
            for n in (names if r % 2 == 0 else names[::-1]):
                f, x = calls[n][0], xs[n]
                start = time.perf_counter()
                for _ in range(reps): f(x)
                samples[n][-1].append((time.perf_counter() - start) / reps)
    return samples


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"AMX: {'amx_bf16' in Path('/proc/cpuinfo').read_text()}")
    models = {"packaged model": json.loads((DEFAULT_MODEL / "config.json").read_text()),
              "SmolLM2-135M": SHAPES["smollm2-135m"]}
    out = []
    for model, config in models.items():
        for layer, (n, k) in layer_shapes(config).items():
            rows = LOGIT_ROWS if layer == "lm_head" else GEMM_ROWS
            samples = time_all(kernels_for(torch.randn(n, k) * 0.05), k, rows, a.rounds)
            rel = relative_times(samples)
            med = {kk: [statistics.median(s) * 1e6 for s in v] for kk, v in samples.items()}
            out.append(dict(model=model, layer=layer, shape=[n, k], rows=list(rows), median_us=med, relative=rel))
            print(f"{model} {layer} {k}->{n}")
            for kk in samples:
                print(f"   {kk:<20}" + "  ".join(f"M={m}: {t:8.1f} us ({r:.2f})" for m, t, r in zip(rows, med[kk], rel[kk])))
    if a.json:
        open(a.json, "w").write(json.dumps(dict(cpu=cpu_model(), torch=torch.__version__,
                                                threads=torch.get_num_threads(), shapes=out), indent=1))


if __name__ == "__main__":
    main()
