"""Where one decode step's time goes: host work (scheduling, inputs, metadata, recording tokens) against model work.

Runs the benchmark's packaged-model workload (64 requests, float32, greedy) on one thread until every request is
decoding, profiles a few decode steps with `torch.profiler`, each phase a `record_function` range, and stores the
median step's phases under LABEL in nbs/step_timeline.json, which notebook 14 draws. It patches only names that
every version of the engine since the C++ decode kernel has, so the same script measures an older checkout too:

    python tools/step_timeline.py "this release"
    git worktree add /tmp/old 0deea5a && (cd /tmp/old && PYTHONPATH=. python $OLDPWD/tools/step_timeline.py "before")
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PHASES = ["schedule", "step inputs", "attention metadata", "model forward", "LM head + argmax", "postprocess"]


def traced(name: str, f):
    "`f`, with each call inside a profiler range called `name`."
    def wrapper(*args, **kwargs):
        with record_function(name):
            return f(*args, **kwargs)
    return wrapper


def measure(steps: int = 7) -> dict:
    "The median of `steps` profiled decode steps: its total and its phases as (phase, start ms, length ms)."
    from minivllm.bench.workload import Workload
    from minivllm.config import Config
    from minivllm.engine.scheduler import ScheduledBatch
    from minivllm.engine.step import StepInputs
    from minivllm.model_source import DEFAULT_MODEL
    from minivllm.llm import LLM
    work = Workload.make(Config.from_pretrained(DEFAULT_MODEL).vocab_size)
    longest = max(len(p) + n for p, n in zip(work.prompts, work.output_lens))
    with LLM(None, num_threads=1, dtype="float32", max_model_len=longest) as llm:
        for prompt, params in zip(work.prompts, work.sampling_params()):
            llm.add_request(prompt, params)
        sched, runner = llm.llm_engine.scheduler, llm.llm_engine.runner
        while sched.waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):
            llm.step()  # the prefills
        for _ in range(3):
            llm.step()  # warm decode steps
        sched.schedule, sched.postprocess = traced("schedule", sched.schedule), traced("postprocess", sched.postprocess)
        ScheduledBatch.step_inputs = traced("step inputs", ScheduledBatch.step_inputs)  # inside "schedule"
        StepInputs.metadata = traced("attention metadata", StepInputs.metadata)
        runner.model.forward = traced("model forward", runner.model.forward)
        runner.model.greedy_tokens = traced("LM head + argmax", runner.model.greedy_tokens)
        batch = len(sched.running)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                with record_function("step"):
                    llm.step()
    events = sorted((e for e in prof.events() if e.name in PHASES + ["step"]), key=lambda e: e.time_range.start)
    found = []
    for step in (e for e in events if e.name == "step"):
        start, end = step.time_range.start, step.time_range.end
        spans = {}
        for e in events:
            if e.name in PHASES and start <= e.time_range.start and e.time_range.end <= end:
                first, total = spans.get(e.name, (e.time_range.start, 0))
                spans[e.name] = (min(first, e.time_range.start), total + e.time_range.elapsed_us())
        found.append({"total_ms": (end - start) / 1e3, "batch": batch,
                      "spans": [[name, (first - start) / 1e3, total / 1e3]
                                for name, (first, total) in sorted(spans.items(), key=lambda kv: kv[1][0])]})
    return sorted(found, key=lambda s: s["total_ms"])[len(found) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("label", help="the name of this measurement in the figure")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "nbs" / "step_timeline.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    step = measure()
    out = Path(a.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    from minivllm.bench.workload import device_name
    data.update(workload="the benchmark's packaged-model workload, a decode step of 64 sequences, float32, one thread",
                device=device_name())
    data.setdefault("steps", {})[a.label] = step | {"measured": time.strftime("%Y-%m-%d")}
    out.write_text(json.dumps(data, indent=1) + "\n")
    host = sum(ms for name, _, ms in step["spans"] if name not in ("model forward", "LM head + argmax"))
    print(f"{a.label}: a decode step of {step['batch']} sequences takes {step['total_ms']:.2f} ms, host work "
          f"{host:.2f} ms ({host / step['total_ms']:.1%}); written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
