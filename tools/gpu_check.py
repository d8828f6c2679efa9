"""What anyone with one GPU runs first: is minivllm correct there, and how fast is it against what the card can do.

    python tools/gpu_check.py --quick [--out PATH]  # at most 4 minutes on an H100: fits one call of a lent GPU machine
    python tools/gpu_check.py [--out PATH] [--num-prompts N] [--skip-tests] [--attention-backend NAME]  # the full one
    python tools/gpu_check.py --quick --dry-run     # the same steps on the CPU with tiny models (what CI runs)
    python tools/gpu_check.py --sweep [PATH]        # only: the attention's fastest tiles on this card, into a table
    python tools/gpu_check.py --quick --only transformers_slice  # named steps alone (here: beside transformers)

Prints one table (then the compile report's) and writes a JSON after every step, so a run cut short keeps what it
measured. First, in about a second and before torch is imported, every module the check and its tests need is looked
up; a missing one ends the run with one line naming them all and the `tools/offline_wheels.sh` line that brings them.
Then: the card, driver, torch, triton, transformers and flash-attn; the card's measured copy bandwidth; the GPU test
files (`GPU_TEST_FILES`, named by file) in a child pytest that is killed at its budget; greedy tokens against
transformers on the same device (tiny Qwen3 and Llama, float32 and bfloat16; where a prompt's tokens part,
transformers' own logit gap between its token and ours at the first difference: a near tie that kernels' different
sums may break either way); the tiny Qwen3 with itself as its draft model (speculative decoding: the draft's engine
beside the target's on one card, in its share of gpu_memory_utilization; greedy tokens against transformers', every
guess kept); nano-vllm's benchmark workload (a Qwen3-0.6B-shaped random model in bfloat16, 256
requests, prompt and output lengths uniform in 100..1024 drawn as its bench.py draws them, temperature 0.6,
ignore_eos, max_model_len 4096) beside its bandwidth ceiling (each decode step's weights and keys and values over
the measured copy bandwidth: notebook 14c's `bandwidth_ceiling`); decode tokens/s at batch 1, 16, 64 and 256 beside
the bandwidth ceiling (weights and KV read per step over the measured copy bandwidth), and at batch 1 and 16 an
engine without CUDA graphs too; one decode step at batch 256 under torch.profiler, split into attention kernels, the other kernels, the sampler and the host; and `tools/gpu_compile_report.py --quick`
(registers, spills, shared memory and occupancy of each Triton kernel variant, compiled for this card), run in the
background without Triton's interpreter. Every engine runs a warm-up of the shapes its timed run meets (a prefill, a
prefill over a cached prefix, decodes at batch 1 and at its largest batch) before the timer starts, so no Triton
compile falls inside a timing. Each step has a budget: its seconds go to stderr as it ends, and into the JSON.

How --quick fits 4 minutes (budgets in `plan_for`; seconds measured on an H200 with torch 2.11 and triton 3.6):
  tests 130 s: the five files over 8 xdist workers where pytest-xdist is installed (their Triton compiles spread over
    the cores), killed and reported at the budget: alone they took 99 s (337 tests); beside the compile report and
    the making of the workload's 0.6B checkpoint, which run meanwhile, 90 s saw 302 of them;
  greedy 35 s (19-34 s): 8 prompts of 16 tokens, CUDA graphs only (the engine's normal path; the full check adds
    eager and 13 prompts of 32 tokens);
  speculative 10 s (not yet measured on a GPU): two engines' start (the target's and its draft's) and 8 prompts;
  workload 15 s (12-13 s): all 256 requests, CUDA graphs only (the full check adds eager, and transformers' batched
    generate on a 64-request slice): the engine's start and warm-up, then 133,966 tokens in 6.2-6.3 s;
  decode rates 20 s (5 s with CUDA graphs, plus an eager engine at batches 1 and 16) and the profiled step 5 s
    (1 s); preflight, imports, environment, the checkpoint and the compile report's wait 25 s (7-8 s when the tests
    run; the checkpoint alone takes 52 s, so with --skip-tests the model step waits for it).
The full check takes about 7-11 minutes on an H100: more than one 600 s call of a lent machine allows.
`--only STEP[,STEP...]` runs those steps alone (after the device's line and its copy bandwidth), at --quick's sizes
or the full check's: a narrow rerun of what a run showed, or a step --quick leaves out in a call of its own.
`--quick --only transformers_slice` is the full check's 64 requests beside transformers' batched generate, about
3 minutes on an H200 (estimated, not yet measured: the checkpoint alone 52 s, and transformers took 95 s on that
slice in the first run, at 382 tok/s).
`--attention-backend sdpa` (or any backend of notebook 06a) runs every engine of the check on that backend: the
table before and after a kernel.
"""
from __future__ import annotations

import argparse
import configparser
import importlib.metadata
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and minivllm are imported where they are used: the preflight must run before them
    import torch
    from minivllm import LLM
    from minivllm.bench.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
COMPILE_REPORT = ROOT / "tools" / "gpu_compile_report.py"
# the test files that exercise the GPU (and import only what the GPU image has, or minivllm's carried requirements)
GPU_TEST_FILES = ("tests/test_triton_attention.py", "tests/test_triton_layers.py", "tests/test_triton_sampler.py",
                  "tests/test_cuda_graphs.py", "tests/test_kv_cache.py")
# module -> the distribution that installs it: what the check and GPU_TEST_FILES import, directly or through minivllm
NEEDED_MODULES = {"torch": "torch", "triton": "triton", "transformers": "transformers", "safetensors": "safetensors",
                  "huggingface_hub": "huggingface_hub", "numpy": "numpy", "xxhash": "xxhash", "tqdm": "tqdm",
                  "cloudpickle": "cloudpickle", "fastcore": "fastcore", "msgspec": "msgspec"}
TEST_MODULES = {"pytest": "pytest"}  # needed only where the tests run
ATTENTION_KERNELS = ("attention", "flash", "fmha", "_merge_splits")  # kernel or op names of attention (any case)
SAMPLER_LABEL = "gpu_check.sampler"  # the profiler range around the engine's sampler in the profiled step
TINY = {  # the two tiny models of the greedy comparison: a GQA Qwen3, and a tied MHA Llama of head size 24
    "qwen3": dict(model_type="qwen3", vocab_size=1000, num_attention_heads=4, num_key_value_heads=2),
    "llama": dict(model_type="llama", vocab_size=1000, tie_word_embeddings=True, hidden_size=96, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=24),
}


# ---------------------------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Plan:
    "How big each step is, and the seconds it may take (a budget: reported when overrun, enforced on the tests)."
    greedy_prompts: int
    greedy_tokens: int
    greedy_eager: bool  # on a GPU, eager engines beside the CUDA-graph ones
    workload_eager: bool  # on a GPU, the workload eager too
    transformers_slice: int  # requests of transformers' batched generate beside ours; 0: none
    batches: tuple[int, ...]  # decode batch sizes; the largest is profiled
    context: int  # decode rates: prompt tokens
    steps: int  # decode rates: new tokens
    max_model_len: int  # the workload's engine
    copy_mib: int
    compile_report_timeout_s: float  # from its start, in the background
    budgets: dict[str, float]  # step -> seconds


# the steps --only may choose (the decode step profiles its largest batch too), those every run takes, and those that
# need the workload's checkpoint
CHOSEN_STEPS = ("tests", "greedy", "speculative", "workload", "transformers_slice", "decode", "compile_report")
ALWAYS_STEPS = ("preflight", "imports", "environment")
MODEL_STEPS = frozenset({"workload", "transformers_slice", "decode"})
STEP_PARTS = {"decode": ("decode", "profile")}  # a chosen step timed in parts


def plan_for(quick: bool, dry_run: bool, only: frozenset[str] | None = None) -> Plan:
    "The plan of a run: --quick or the full check, on a GPU or dry on the CPU; `only` (--only) keeps those steps alone."
    plan = _whole_plan(quick, dry_run)
    if only is None:
        return plan
    unknown = only - set(CHOSEN_STEPS)
    if unknown or not only:
        named = f"no step {', '.join(sorted(unknown))}" if unknown else "no step named"
        raise ValueError(f"--only: {named}; the steps are {', '.join(CHOSEN_STEPS)}")
    full = _whole_plan(False, dry_run)  # (the transformers slice is the full check's, also with --quick)
    slice_size = full.transformers_slice if "transformers_slice" in only else 0
    timed = {part for step in only for part in STEP_PARTS.get(step, (step,))}
    budgets = {k: v for k, v in plan.budgets.items() if k in ALWAYS_STEPS or k in timed}
    if only & MODEL_STEPS:
        # subtle: on a GPU machine the 0.6B checkpoint is made while the tests run; made alone, it takes its 52 s
        budgets["model"] = plan.budgets["model"] if dry_run or "tests" in only else max(plan.budgets["model"], 60)
    if slice_size:
        budgets["transformers_slice"] = full.budgets["transformers_slice"]
    return replace(plan, transformers_slice=slice_size, budgets=budgets)


def _whole_plan(quick: bool, dry_run: bool) -> Plan:
    "Every step's plan: --quick or the full check, on a GPU or dry on the CPU."
    if dry_run:  # every step at a size the CPU does in seconds; greedy as large as the full check's (float32 is exact)
        budgets = dict(preflight=1, imports=20, environment=5, tests=1, model=10, greedy=40, speculative=20, workload=20,
                       decode=20, profile=15, compile_report=90) | ({} if quick else dict(transformers_slice=30))
        return Plan(greedy_prompts=13, greedy_tokens=8, greedy_eager=False, workload_eager=False,
                    transformers_slice=0 if quick else 4, batches=(1, 4), context=32, steps=8, max_model_len=256,
                    copy_mib=64, compile_report_timeout_s=90, budgets=budgets)
    if quick:  # see the module's docstring for how these fit 4 minutes
        budgets = dict(preflight=1, imports=10, environment=5, tests=130, model=5, greedy=35, speculative=10, workload=15,
                       decode=20, profile=5, compile_report=4)
        return Plan(greedy_prompts=8, greedy_tokens=16, greedy_eager=False, workload_eager=False, transformers_slice=0,
                    batches=(1, 16, 64, 256), context=512, steps=64, max_model_len=4096, copy_mib=1024,
                    compile_report_timeout_s=150, budgets=budgets)
    budgets = dict(preflight=1, imports=6, environment=8, tests=300, model=10, greedy=90, speculative=20, workload=300,
                   transformers_slice=150, decode=40, profile=10, compile_report=30)
    return Plan(greedy_prompts=13, greedy_tokens=32, greedy_eager=True, workload_eager=True, transformers_slice=64,
                batches=(1, 16, 64, 256), context=512, steps=64, max_model_len=4096, copy_mib=1024,
                compile_report_timeout_s=600, budgets=budgets)


class StepClock:
    "Each step's seconds against its budget, and its error if it failed: a line on stderr as each ends, and a record."
    def __init__(self, budgets: dict[str, float], log):
        self.budgets, self.log, self.seconds, self.errors, self.start = budgets, log, {}, {}, time.perf_counter()

    @contextmanager
    def step(self, name: str, what: str):
        "Time the step `name` (its budget's key); `what` says what it does. Its error is recorded, and the run goes on."
        self.log(f"gpu_check: {what} (budget {self.budgets.get(name, 0):.0f} s)")
        start = time.perf_counter()
        try:
            yield
        except Exception as e:  # subtle: GPU time is scarce: one step's failure must not lose the steps after it
            self.log(traceback.format_exc().rstrip())
            self.errors[name] = f"{type(e).__name__}: {e}".splitlines()[0]
        finally:
            self.seconds[name] = seconds = round(time.perf_counter() - start, 2)
            over = " OVER BUDGET" if seconds > self.budgets.get(name, float("inf")) else ""
            self.log(f"gpu_check: {name}: {seconds:.1f} s{over} ({time.perf_counter() - self.start:.0f} s so far)")

    def add(self, name: str, seconds: float) -> None:
        "Record a step timed elsewhere (the preflight, which runs before anything else)."
        self.seconds[name] = round(seconds, 2)
        self.log(f"gpu_check: {name}: {seconds:.1f} s")

    def record(self) -> dict:
        "Per step: seconds and budget; the total and the plan's budget; the steps over budget."
        steps = {n: dict(seconds=s, budget_s=self.budgets.get(n)) for n, s in self.seconds.items()}
        return dict(steps=steps, total_s=round(time.perf_counter() - self.start, 1),
                    budget_s=sum(self.budgets.values()), errors=dict(self.errors),
                    over_budget=[n for n, s in self.seconds.items() if s > self.budgets.get(n, float("inf"))])


# ---------------------------------------------------------------------------------------------- the preflight

def missing_modules(modules: dict[str, str]) -> list[str]:
    "The top-level modules of `modules` that this Python cannot import (looked up, not imported)."
    # subtle: find_spec of a dotted name imports its parents; top-level names only, so nothing heavy is imported here
    return [m for m in modules if importlib.util.find_spec(m) is None]


def offline_requirements(settings: Path = ROOT / "settings.ini") -> set[str]:
    "The distributions `tools/offline_wheels.sh` downloads: settings.ini's requirements less torch, names normalized."
    c = configparser.ConfigParser()
    c.read(settings)
    names = {re.split(r"[<>=!~;\[ ]", r)[0] for r in c["DEFAULT"]["requirements"].split()}
    return {normalized(n) for n in names} - {"torch"}


def normalized(distribution: str) -> str: return re.sub(r"[-_.]+", "-", distribution).lower()


def install_line(missing: list[str], modules: dict[str, str], python: str, offline: set[str]) -> str:
    "One line: the missing modules, and the commands that bring them to a machine without a package index."
    dists = sorted({modules[m] for m in missing})
    wheels = [d for d in dists if normalized(d) in offline]
    others = [d for d in dists if normalized(d) not in offline and d != "torch"]
    fetch = ([f"tools/offline_wheels.sh {python} wheels/"] if wheels else []) + (
        [f"pip download --only-binary=:all: --python-version {python} --platform manylinux2014_x86_64 -d wheels/ "
         + " ".join(others)] if others else [])
    line = f"gpu_check: missing module{'s' * (len(missing) > 1)} {', '.join(missing)}"
    if fetch:
        line += (f": on a machine with pip run `{' && '.join(fetch)}`, bring wheels/ here, then "
                 f"`pip install --no-index --find-links wheels/ {' '.join(d for d in dists if d != 'torch')}`")
    if "torch" in dists:
        line += "; torch: install its CUDA build (offline_wheels.sh leaves torch out on purpose)"
    return line


def preflight(run_tests: bool) -> dict:
    "Every module the run needs, looked up: the names, the missing ones, and the one line that says how to bring them."
    start = time.perf_counter()
    modules = NEEDED_MODULES | (TEST_MODULES if run_tests else {})
    missing = missing_modules(modules)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    line = install_line(missing, modules, python, offline_requirements()) if missing else None
    return dict(modules=sorted(modules), missing=missing, line=line, seconds=round(time.perf_counter() - start, 3))


# ---------------------------------------------------------------------------------------------- the tests

RESULT = r"(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
NODE = r"(\S+\.py::\S+)"  # a test's node id


def parse_pytest_output(text: str) -> dict:
    "Counts and names from `pytest -v -rfE` output (xdist's too), complete or cut short: what passed, failed, ran last."
    results = {}
    started = None
    for line in text.splitlines():
        if m := re.match(rf"^{NODE}(?: {RESULT}\b)?", line):  # plain -v: the node id, then its result
            started = m[1]
            if m[2]: results[m[1]] = m[2]
        elif m := re.search(rf"\b{RESULT} {NODE}", line):  # xdist -v: '[gw0] [ 5%] PASSED node'
            results[m[2]] = m[1]
    count = lambda result: sum(r == result for r in results.values())
    failing = [n for n, r in results.items() if r in ("FAILED", "ERROR")]
    # the short summary names what has no result line too: a file that failed to import
    failing += [m[1] for m in re.finditer(r"^(?:FAILED|ERROR) (\S+\.py\S*)", text, re.M) if m[1] not in failing]
    summary = re.findall(r"^=+ (.*(?:passed|failed|skipped|error|no tests ran).*) =+$", text, re.M)
    return dict(passed=count("PASSED"), failed=count("FAILED"), skipped=count("SKIPPED"), errors=count("ERROR"),
                failing=failing, summary=summary[-1] if summary else None,
                unfinished=started if started is not None and started not in results else None)


def run_tests(files: tuple[str, ...], budget_s: float, workers: int) -> dict:
    "`files` in a child pytest (over `workers` xdist processes where > 1), killed at `budget_s`: its counts and failures."
    command = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider",
               *(["-n", str(workers)] if workers > 1 else []), *files]
    start = time.perf_counter()
    # subtle: the output goes to a file, not a pipe: a child killed at its budget leaves all it wrote, and a chatty
    # one never blocks on a full pipe. Its own session, so the kill reaches the xdist workers and their children too
    with tempfile.TemporaryFile("w+") as out:
        child = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                                 env=os.environ | {"PYTHONUNBUFFERED": "1"}, start_new_session=True)
        try:
            code = child.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if child.poll() is None:  # over its budget (or this process interrupted): the whole group goes
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        out.seek(0)
        text = out.read()
    tail = [l for l in text.strip().splitlines() if l.strip()][-1:] or [""]
    return dict(files=list(files), command=" ".join(command[1:]), workers=workers, exit_code=code,
                killed_at_budget=code is None, budget_s=budget_s, seconds=round(time.perf_counter() - start, 1),
                crashed=code is not None and code < 0, **parse_pytest_output(text), tail=tail[0])


def pytest_workers(cpus: int | None) -> int:
    "xdist workers for the tests: up to 8, half the cores, where pytest-xdist is installed; else 1 (no xdist)."
    return max(1, min(8, (cpus or 1) // 2)) if importlib.util.find_spec("xdist") is not None else 1


# ---------------------------------------------------------------------------------------------- the compile report

class CompileReport:
    "`tools/gpu_compile_report.py` in a process of its own, started now, without Triton's interpreter; `result` waits."
    def __init__(self, folder: Path, quick: bool, arch: str | None, timeout_s: float):
        self.json_path, self.timeout_s, self.arch = folder / "compile_report.json", timeout_s, arch
        self.start, self.child = time.perf_counter(), None
        if not COMPILE_REPORT.exists():
            return
        self.command = [sys.executable, str(COMPILE_REPORT), *(["--quick"] if quick else []),
                        *(["--arch", arch] if arch else []), "--json", str(self.json_path)]
        # subtle: it compiles for real GPUs: with TRITON_INTERPRET (which the test suite sets) Triton would not compile
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.child = subprocess.Popen(self.command, cwd=ROOT, env=env, stdout=self.out, stderr=self.err, text=True,
                                      start_new_session=True)

    def __enter__(self): return self

    def __exit__(self, *exc):
        "Stop it if it still runs (a run that ends early leaves no compiler behind)."
        if self.child is not None and self.child.poll() is None:
            os.killpg(self.child.pid, signal.SIGKILL)
            self.child.wait()

    def result(self) -> dict:
        "Its rows and table, or why there are none (missing, failed, timed out): never an exception."
        if self.child is None:
            return dict(status="missing", line="compile report: tools/gpu_compile_report.py missing", rows=[], table="")
        left = max(self.timeout_s - (time.perf_counter() - self.start), 0.1)
        try:
            code = self.child.wait(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(self.child.pid, signal.SIGKILL)
            self.child.wait()
            code = None
        seconds = round(time.perf_counter() - self.start, 1)
        self.out.seek(0), self.err.seek(0)
        table, errors = self.out.read().strip(), self.err.read().strip().splitlines()
        self.out.close(), self.err.close()
        common = dict(arch=self.arch, seconds=seconds, command=" ".join(self.command[1:]))
        if code is None:
            return dict(status="timed out", line=f"compile report: timed out after {self.timeout_s:.0f} s", rows=[],
                        table="", **common)
        if code != 0:
            return dict(status="failed", line=f"compile report: failed (exit {code}): {errors[-1] if errors else ''}",
                        rows=[], table=table, **common)
        try:
            rows = json.loads(self.json_path.read_text())
        except (OSError, ValueError) as e:
            return dict(status="failed", line=f"compile report: no JSON rows ({e})", rows=[], table=table, **common)
        return dict(status="ran", line=f"compile report: {len(rows)} kernel variants", rows=rows, table=table, **common)


# ---------------------------------------------------------------------------------------------- the profiler split

@dataclass(frozen=True)
class StepEvent:
    "One profiler event, reduced to what the split needs (times in microseconds)."
    name: str
    start_us: float
    end_us: float
    on_gpu: bool = False  # a kernel, copy or range on the GPU's timeline; else a host op or range
    launched_us: float | None = None  # a GPU event: when the host op that launched it began, where known


def is_attention(name: str) -> bool: return any(k in name.lower() for k in ATTENTION_KERNELS)


def covered_us(intervals: list[tuple[float, float]]) -> float:
    "Microseconds covered by the union of `intervals`."
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def outermost(events: list[StepEvent]) -> list[StepEvent]:
    "The events that no other event of the list contains (an op's own sub-ops are inside it)."
    kept: list[StepEvent] = []
    for e in sorted(events, key=lambda e: (e.start_us, -e.end_us)):
        if not kept or e.start_us >= kept[-1].end_us:
            kept.append(e)
    return kept


def split_step(events: list[StepEvent], wall_us: float, label: str = SAMPLER_LABEL) -> dict[str, float]:
    "A step's microseconds in four parts: attention, other kernels (on the CPU: other ops), the sampler, the host."
    host_ranges = [(e.start_us, e.end_us) for e in events if e.name == label and not e.on_gpu]
    gpu_ranges = [(e.start_us, e.end_us) for e in events if e.name == label and e.on_gpu]
    within = lambda t, ranges: t is not None and any(s <= t <= e for s, e in ranges)
    kernels = [e for e in events if e.on_gpu and e.name != label]
    parts = dict(attention=0.0, other=0.0, sampler=0.0)
    if kernels:  # a GPU: the kernels' own time; the sampler's are those its range launched (or the GPU range holds)
        for k in kernels:
            sampler = within(k.launched_us, host_ranges) or within(k.start_us, gpu_ranges)
            parts["sampler" if sampler else "attention" if is_attention(k.name) else "other"] += k.end_us - k.start_us
        busy = covered_us([(k.start_us, k.end_us) for k in kernels])
    else:  # the CPU: the outermost ops outside the sampler's range; the range itself is the sampler
        ops = [e for e in events if e.name != label and not within(e.start_us, host_ranges)]
        for op in outermost(ops):
            parts["attention" if is_attention(op.name) else "other"] += op.end_us - op.start_us
        parts["sampler"] = covered_us(host_ranges)
        busy = sum(parts.values())
    parts["host"] = max(wall_us - busy, 0.0)
    return parts


def profiler_events(prof) -> list[StepEvent]:
    "torch.profiler's events as StepEvents: each GPU event with the start of the host op that launched it."
    from torch.autograd import DeviceType
    events = list(prof.events())
    # subtle: a kernel's linked_correlation_id is the id of the op that launched it (the runtime calls link the same
    # way but are not ops, so only events that link to nothing are looked up)
    ops = {e.id: e.time_range.start for e in events
           if e.device_type == DeviceType.CPU and getattr(e, "linked_correlation_id", 0) == 0}
    out = []
    for e in events:
        on_gpu = e.device_type == DeviceType.CUDA
        if on_gpu and getattr(e, "is_user_annotation", False) and e.name != SAMPLER_LABEL:
            continue  # another range's GPU side: a span over kernels, not a kernel
        link = getattr(e, "linked_correlation_id", 0) if on_gpu else 0
        out.append(StepEvent(e.name, e.time_range.start, e.time_range.end, on_gpu, ops.get(link) if link else None))
    return out


class Labelled:
    "Calls `inner` inside a profiler range named `label` (wraps the engine's sampler for the profiled step)."
    def __init__(self, inner, label: str):
        self.inner, self.label = inner, label

    def __call__(self, *args, **kwargs):
        import torch
        with torch.profiler.record_function(self.label):
            return self.inner(*args, **kwargs)


def profile_decode_step(llm: LLM, batch: int, context: int, device: torch.device) -> dict:
    "One decode step of `batch` sequences at nano-vllm's temperature under torch.profiler, after two unprofiled ones."
    import torch
    from minivllm import SamplingParams
    params = SamplingParams(temperature=0.6, max_tokens=llm.llm_engine.args.max_model_len - context, ignore_eos=True)
    requests = [llm.add_request([(13 * i + j) % 1000 + 1 for j in range(context)], params) for i in range(batch)]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":  # subtle: CUPTI records the kernels that CUDA graphs replay, so graphs stay on
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    runner = llm.llm_engine.runner
    sampler = runner.sampler
    try:
        full = 0
        for _ in range(10_000):  # the prefills, then two decodes of the whole batch: every kernel and buffer warm
            _, stats = llm.step()
            full += not stats["prefill"] and len(stats["seq_ids"]) == batch
            if full == 2:
                break
        else:
            raise RuntimeError(f"no decode step of {batch} sequences came in 10,000 steps")
        runner.sampler = Labelled(sampler, SAMPLER_LABEL)
        with torch.profiler.profile(activities=activities) as prof:
            sync(device)
            start = time.perf_counter()
            _, stats = llm.step()
            sync(device)
            wall_us = (time.perf_counter() - start) * 1e6
    finally:
        runner.sampler = sampler
        for r in requests: llm.abort_request(r)
    if stats["prefill"] or len(stats["seq_ids"]) != batch:
        raise RuntimeError(f"the profiled step was not a decode of {batch} sequences: {stats['prefill']=}, "
                           f"{len(stats['seq_ids'])} sequences")
    events = profiler_events(prof)
    parts = split_step(events, wall_us)
    return dict(batch=batch, context=context, wall_ms=round(wall_us / 1e3, 3),
                source="CUDA kernels" if any(e.on_gpu for e in events) else "CPU ops",
                **{f"{k}_ms": round(v / 1e3, 3) for k, v in parts.items()})


# ---------------------------------------------------------------------------------------------- the measurements

def version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def copy_bandwidth_gbs(device: torch.device, mib: int) -> float:
    "GB/s of a device-to-device copy of `mib` MiB (bytes read plus bytes written), the best of 10."
    import torch
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best / 1e9


def sync(device: torch.device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment(device: torch.device, mib: int) -> dict:
    "The card (or CPU) and the software around it."
    import torch
    from minivllm.bench.workload import device_name
    info = dict(device=device_name(), torch=torch.__version__, cuda=torch.version.cuda, triton=version_of("triton"),
                transformers=version_of("transformers"), flash_attn=version_of("flash-attn") or version_of("flash_attn"))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= dict(memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}")
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            info["driver"] = None
    info["copy_bandwidth_gbs"] = round(copy_bandwidth_gbs(device, mib), 1)
    return info


def hf_greedy_on(path: Path, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype, device: torch.device):
    "transformers' greedy continuations on `device`, one prompt at a time, EOS an ordinary token."
    import torch
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        return [hf.generate(torch.tensor([p], device=device), max_new_tokens=new_tokens, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def logit_gap(path: Path, prompt: list[int], ours: list[int], theirs: list[int], dtype: torch.dtype,
              device: torch.device) -> dict:
    "Where two greedy continuations first part: transformers' logit of its token minus its logit of ours, and both's scale."
    import torch
    import transformers
    step = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + theirs[:step]], device=device)).logits[0, -1].float()
    return dict(step=step, gap=float(logits[theirs[step]] - logits[ours[step]]), max_logit=float(logits.abs().max()))


def greedy_equivalence(folder: Path, device: torch.device, new_tokens: int, backend: str | None = None,
                       num_prompts: int = 13, eager_too: bool = True) -> list[dict]:
    "For each tiny model, dtype and (on a GPU) graph setting: how many of the prompts' greedy tokens equal transformers'."
    import torch
    from minivllm import LLM, SamplingParams
    from minivllm.checkpoints import make_tiny_checkpoint
    g = torch.Generator().manual_seed(0)
    modes = eager_settings(device, eager_too)
    rows = []
    for name, shape in TINY.items():
        kw = dict(shape)
        path = make_tiny_checkpoint(folder / name, kw.pop("model_type"), **kw)
        prompts = [torch.randint(0, kw["vocab_size"], (n,), generator=g).tolist()
                   for n in torch.randint(3, 60, (num_prompts,), generator=g).tolist()]
        for dtype in ("float32", "bfloat16"):
            reference = hf_greedy_on(path, prompts, new_tokens, getattr(torch, dtype), device)
            for eager in modes:
                with LLM(path, dtype=dtype, device=device.type, enforce_eager=eager, max_model_len=256,
                         max_num_seqs=16, attention_backend=backend) as llm:
                    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                                        use_tqdm=False)
                    ahead = llm.llm_engine.args.async_scheduling
                same = sum(o.token_ids == r for o, r in zip(outs, reference))
                # subtle: a part where transformers' own two logits lie within float rounding of each other is a tie
                # that any other order of the same sums may break the other way; a wide gap would be a bug
                parts = [logit_gap(path, p, o.token_ids, r, getattr(torch, dtype), device)
                         for p, o, r in zip(prompts, outs, reference) if o.token_ids != r]
                rows.append(dict(model=name, dtype=dtype, graphs=not eager, ahead=ahead, equal=same, prompts=len(prompts),
                                 parts=parts))
    return rows


def speculative_equivalence(folder: Path, device: torch.device, new_tokens: int, backend: str | None = None,
                            num_prompts: int = 8) -> dict:
    "The tiny Qwen3 in float32 with itself as its draft model: how many prompts' greedy tokens equal transformers', the guesses kept, and both engines' KV-cache blocks (on a GPU the draft's share of one card)."
    import torch
    from minivllm import LLM, SamplingParams
    from minivllm.checkpoints import make_tiny_checkpoint
    kw = dict(TINY["qwen3"])
    path = make_tiny_checkpoint(folder / "speculative-qwen3", kw.pop("model_type"), **kw)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, kw["vocab_size"], (n,), generator=g).tolist()
               for n in torch.randint(3, 60, (num_prompts,), generator=g).tolist()]
    reference = hf_greedy_on(path, prompts, new_tokens, torch.float32, device)
    spec = {"model": str(path), "num_speculative_tokens": 3, "adaptive": False}  # every guess checked
    # subtle: 32 sequences a step, so a verify step of the 8 prompts' newest tokens and 3 guesses each (32 rows)
    # fits the largest decode graph and replays it (notebook 08c's `as_decode`)
    with LLM(path, dtype="float32", device=device.type, max_model_len=256, max_num_seqs=32, attention_backend=backend,
             speculative_config=spec) as llm:
        engine, verify_forms = llm.llm_engine, []
        form_of = engine.runner._as_run
        def as_run(step):
            form = form_of(step)
            if step.num_guesses is not None:
                verify_forms.append(form.is_prefill)
            return form
        engine.runner._as_run = as_run
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                            use_tqdm=False)
        s, blocks = engine.scheduler, (engine.runner.num_blocks, engine.draft.engine.runner.num_blocks)
    return dict(equal=sum(o.token_ids == r for o, r in zip(outs, reference)), prompts=len(prompts),
                guessed=s.num_guessed_tokens, kept=s.num_kept_guesses, target_blocks=blocks[0], draft_blocks=blocks[1],
                verify_steps=len(verify_forms), verify_as_decode=verify_forms.count(False))


def eager_settings(device: torch.device, eager_too: bool) -> tuple[bool, ...]:
    "The enforce_eager settings to run: CUDA graphs (and eager too, if asked) on a GPU; eager, the only way, on the CPU."
    return ((False, True) if eager_too else (False,)) if device.type == "cuda" else (True,)


def warm_up(llm: LLM, max_batch: int, temperature: float, seed: int = 1) -> int:
    "Run the shapes a timed run meets, so no kernel compiles inside it; the prefix-cache tokens it hit (> 0)."
    from minivllm import SamplingParams
    rng, block = random.Random(seed), llm.llm_engine.args.kvcache_block_size
    vocab, room = min(llm.llm_engine.config.vocab_size, 10_000), llm.llm_engine.args.max_model_len - 4
    draw = lambda n: [rng.randrange(1, vocab) for _ in range(n)]
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    shared = block * max(1, min(2, (room - 2) // block))  # whole blocks: the prefix cache keeps whole blocks only
    first = draw(shared + max(1, min(5, room - shared)))
    manager = llm.llm_engine.scheduler.block_manager
    hits = manager.prefix_cache_hit_tokens
    llm.generate([first], params, use_tqdm=False)  # a prefill, and decodes at batch 1
    llm.generate([first[:shared] + draw(max(1, min(7, room - shared)))], params, use_tqdm=False)  # over a cached prefix
    # decodes at the largest batch the timed run reaches (on a GPU: its largest graph)
    llm.generate([draw(1 + i % block) for i in range(max_batch)], params, use_tqdm=False)
    return manager.prefix_cache_hit_tokens - hits


def run_workload(path: Path, workload: Workload, device: torch.device, eager: bool, max_model_len: int,
                 backend: str | None = None) -> dict:
    "minivllm's output tokens/s on `workload` (one generate call), after a warm-up of the shapes it meets."
    from minivllm import LLM
    with LLM(path, dtype="bfloat16", device=device.type, enforce_eager=eager, max_model_len=max_model_len,
             attention_backend=backend) as llm:
        hits = warm_up(llm, min(llm.llm_engine.args.max_num_seqs, len(workload.prompts)), workload.temperature)
        sync(device)
        start = time.perf_counter()
        outs = llm.generate(workload.prompts, workload.sampling_params(), use_tqdm=False)
        sync(device)
        seconds = time.perf_counter() - start
        ahead = llm.llm_engine.args.async_scheduling
    assert [len(o.token_ids) for o in outs] == workload.output_lens
    return dict(graphs=not eager, ahead=ahead, requests=len(workload.prompts), output_tokens=workload.output_tokens,
                seconds=round(seconds, 2), tokens_per_s=round(workload.output_tokens / seconds, 1),
                warm_up_prefix_hit_tokens=hits)


def workload_ceiling(path: Path, workload: Workload, bandwidth_gbs: float) -> float:
    "Output tokens/s of `workload` if each decode step read only its weights and its keys and values, at `bandwidth_gbs`."
    from minivllm.bench.gpu_step import Card, bandwidth_ceiling
    from minivllm.config import Config
    config = Config.from_pretrained(path, dtype="bfloat16")
    return bandwidth_ceiling(config, workload, Card("measured", bandwidth_gbs * 1e9, 0, 0.0))


def transformers_slice(path: Path, workload: Workload, size: int, device: torch.device, max_model_len: int,
                       backend: str | None = None) -> dict:
    "transformers' batched generate and minivllm on the workload's first `size` requests, greedy (both)."
    from minivllm.bench.throughput import bench_transformers
    from minivllm.bench.workload import Workload
    part = Workload(workload.prompts[:size], workload.output_lens[:size])  # greedy: transformers' too
    theirs = bench_transformers(path, part, "bfloat16", size, device=device.type)
    ours = run_workload(path, part, device, device.type != "cuda", max_model_len, backend)
    return dict(requests=size, transformers_tokens_per_s=round(theirs.tokens_per_s, 1),
                minivllm_tokens_per_s=ours["tokens_per_s"], ratio=round(ours["tokens_per_s"] / theirs.tokens_per_s, 2))


def model_bytes(path: Path) -> int:
    "Bytes of the weights a decode step reads: the checkpoint's tensors (a tied head read once more)."
    from safetensors import safe_open
    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                t = st.get_slice(k)
                n = 1
                for s in t.get_shape(): n *= s
                total += n * {"BF16": 2, "F16": 2, "F32": 4}.get(t.get_dtype(), 2)
    config = json.loads((path / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        total += config["vocab_size"] * config["hidden_size"] * 2  # the head reads the embedding again
    return total


def decode_rates(llm: LLM, path: Path, device: torch.device, batches: tuple[int, ...], context: int, steps: int,
                 bandwidth_gbs: float) -> list[dict]:
    "Decode tokens/s at each batch size (prompts of `context` tokens, `steps` new tokens each), beside the ceiling."
    from minivllm import SamplingParams
    config = json.loads((path / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2  # K and V, bfloat16
    weights = model_bytes(path)
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows = []
    for b in batches:
        prompts = [[(7 * i + j) % 1000 + 1 for j in range(context)] for i in range(b)]
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # subtle: the timed runs' shapes (their prompts cached) compiled
        sync(device)
        start = time.perf_counter()  # the prefill is timed too, and taken out by timing a one-token run below
        llm.generate(prompts, params, use_tqdm=False)
        sync(device)
        whole = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate(prompts, one_token, use_tqdm=False)
        sync(device)
        decode_s = max(whole - (time.perf_counter() - start), 1e-9)
        rate = b * (steps - 1) / decode_s
        step_bytes = weights + b * (context + steps / 2) * kv_per_token
        ceiling = b * bandwidth_gbs * 1e9 / step_bytes
        rows.append(dict(batch=b, tokens_per_s=round(rate, 1), ceiling_tokens_per_s=round(ceiling, 1),
                         fraction=round(rate / ceiling, 3)))
    return rows


def eager_decode_rates(path: Path, device: torch.device, batches: tuple[int, ...], plan: Plan, bandwidth_gbs: float,
                       backend: str | None = None) -> list[dict]:
    "Decode tokens/s of an engine without CUDA graphs at the `batches` (those up to 16: where graphs matter most)."
    from minivllm import LLM
    small = tuple(b for b in batches if b <= 16)
    with LLM(path, dtype="bfloat16", device=device.type, enforce_eager=True, max_model_len=plan.context + plan.steps + 8,
             max_num_seqs=max(small), attention_backend=backend) as llm:
        warm_up(llm, max(small), 0.0)
        return decode_rates(llm, path, device, small, plan.context, plan.steps, bandwidth_gbs)


def with_eager(rows: list[dict], eager: list[dict]) -> list[dict]:
    "The decode rows with the eager engine's rate beside the graphs' at the batches it ran."
    by_batch = {r["batch"]: r["tokens_per_s"] for r in eager}
    return [r | (dict(eager_tokens_per_s=by_batch[r["batch"]],
                      graphs_over_eager=round(r["tokens_per_s"] / max(by_batch[r["batch"]], 1e-9), 2))
                 if r["batch"] in by_batch else {}) for r in rows]


# ---------------------------------------------------------------------------------------------- the tile sweep

TILES_JSON = ROOT / "minivllm" / "gpu" / "triton_tiles.json"  # what notebook 06b's `triton_tiles` reads first
# (query heads, KV heads, head size) of the models a sweep measures for: Qwen3-0.6B, Qwen3-8B/Llama-3-8B, Qwen2-0.5B
SWEEP_SHAPES = ((16, 8, 128), (32, 8, 128), (14, 2, 64))
SWEEP_TILES, SWEEP_WARPS = (16, 32, 64), (2, 4, 8)


def sweep_case(heads: int, kv_heads: int, head_dim: int, dtype, device, decode: bool, dry_run: bool):
    "The attention call a sweep times: a decode of 64 sequences of 1,024 keys, or 4 prefills of 512 (tiny when dry)."
    import torch
    from minivllm.kv_cache import allocate_kv_cache, decode_metadata, prefill_metadata
    batch, length, block = (2, 40, 16) if dry_run else ((64, 1024, 16) if decode else (4, 512, 16))
    blocks = -(-length // block)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    cache = allocate_kv_cache(1, batch * blocks, block, kv_heads, head_dim, dtype, device).normal_()
    tokens = batch if decode else batch * length
    q, k, v = (torch.randn(tokens, h, head_dim, dtype=dtype, device=device) for h in (heads, kv_heads, kv_heads))
    md = (decode_metadata(tables, [length] * batch, block, device, group_size=None) if decode
          else prefill_metadata(tables, [0] * batch, [length] * batch, block, device))
    return q, k, v, cache[0, 0], cache[1, 0], md, head_dim ** -0.5


def time_call(f, device, repeats: int) -> float:
    "The median seconds of `f()` over `repeats` timed calls, after one untimed (its compile)."
    f()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        f()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def sweep_tiles(device, dtypes, shapes=SWEEP_SHAPES, tiles=SWEEP_TILES, warps=SWEEP_WARPS, repeats: int = 5,
                dry_run: bool = False, log=lambda msg: None) -> dict[str, dict]:
    "For each shape, dtype and phase, the keys a tile and warps that ran the Triton attention fastest on `device`."
    from minivllm.gpu.triton_attention import (TritonTiles, compute_capability, paged_attention_triton, tiles_key,
                                               triton_tiles)
    arch, best = compute_capability(device), {}
    for heads, kv_heads, head_dim in shapes:
        for dtype in dtypes:
            for decode in (True, False):
                case = sweep_case(heads, kv_heads, head_dim, dtype, device, decode, dry_run)
                rows = triton_tiles(heads, kv_heads, decode, dtype).block_m
                timed = {}
                for tile in tiles:
                    for w in warps:
                        chosen = TritonTiles(rows, tile, w)
                        try:
                            timed[tile, w] = time_call(lambda: paged_attention_triton(*case, tiles=chosen), device,
                                                       repeats)
                        except Exception as e:  # a variant the card cannot hold (shared memory): not a candidate
                            log(f"gpu_check: tiles {tile} x {w} warps failed: {type(e).__name__}: {e}")
                (tile, w), seconds = min(timed.items(), key=lambda item: item[1])
                key = tiles_key(arch, head_dim, heads // kv_heads, dtype, decode)
                best[key] = dict(tile=tile, warps=w, us=round(seconds * 1e6, 1))
                log(f"gpu_check: {key}: {tile} keys a tile, {w} warps ({seconds * 1e6:,.1f} us)")
    return best


def write_tiles(best: dict[str, dict], path: Path) -> None:
    "Merge a sweep's choices into the table at `path` (other cards' entries kept)."
    table = json.loads(path.read_text()) if path.exists() else {}
    table.update({key: dict(tile=v["tile"], warps=v["warps"]) for key, v in best.items()})
    path.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")


def decode_and_profile(model: Path, device: torch.device, plan: Plan, bandwidth_gbs: float, backend: str | None,
                       clock: StepClock, results: dict, save) -> None:
    "The decode step (rates at each of the plan's batches, an eager engine's beside them on a GPU), then its largest batch's step under the profiler."
    from minivllm import LLM
    with ExitStack() as engine:
        llm = None
        with clock.step("decode", f"decode rates at batch {', '.join(map(str, plan.batches))}"):
            # subtle: the eager engine first, and closed, so that the graphs' engine has the card to itself
            eager = (eager_decode_rates(model, device, plan.batches, plan, bandwidth_gbs, backend)
                     if device.type == "cuda" else [])
            llm = engine.enter_context(LLM(model, dtype="bfloat16", device=device.type,
                                           max_model_len=plan.context + plan.steps + 8,
                                           max_num_seqs=max(plan.batches), attention_backend=backend))
            warm_up(llm, max(plan.batches), 0.0)
            results["decode"] = with_eager(decode_rates(llm, model, device, plan.batches, plan.context, plan.steps,
                                                        bandwidth_gbs), eager)
        save()
        if llm is not None:
            with clock.step("profile", f"one decode step at batch {max(plan.batches)} under torch.profiler"):
                results["profile"] = profile_decode_step(llm, max(plan.batches), plan.context, device)
            save()


# ---------------------------------------------------------------------------------------------- the report

def table(results: dict) -> str:
    "One table of every check that ran (a run cut short, or --quick, leaves some out)."
    lines = []
    add = lambda check, result, detail="": lines.append(f"| {check} | {result} | {detail} |")
    if p := results.get("preflight"):
        add("preflight", f"{len(p['modules']) - len(p['missing'])}/{len(p['modules'])} modules found",
            p["line"] or f"looked up in {p['seconds']} s: {', '.join(p['modules'])}")
    if env := results.get("environment"):
        add("device", env["device"], f"driver {env.get('driver')}, torch {env['torch']} (CUDA {env['cuda']}), triton "
            f"{env['triton']}, transformers {env['transformers']}, flash-attn {env['flash_attn'] or 'absent'}")
        add("copy bandwidth", f"{env['copy_bandwidth_gbs']:,.0f} GB/s", "device to device, read + write")
    if t := results.get("cuda_tests"):
        if "skipped_because" in t:
            add("cuda tests", t["skipped_because"], f"on a GPU: {' '.join(t['files'])}, in {t['budget_s']:.0f} s at most")
        else:
            cut = (f"killed at its {t['budget_s']:.0f} s budget" + (f" in {t['unfinished']}" if t["unfinished"] else "")
                   if t["killed_at_budget"] else f"crashed (exit {t['exit_code']}) in {t['unfinished']}"
                   if t["crashed"] else t["summary"] or t["tail"])
            add("cuda tests", f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped, {t['errors']} errors",
                f"{cut}; failing: {', '.join(t['failing'])}" if t["failing"] else cut)
    if "attention_backend" in results:
        add("attention backend", results["attention_backend"] or "automatic")
    for r in results.get("greedy_equivalence", []):
        gaps = ", ".join(f"step {p['step']}: gap {p['gap']:.2g} of logits up to {p['max_logit']:.2g}" for p in r["parts"])
        add(f"greedy vs transformers: {r['model']} {r['dtype']}, {'graphs' if r['graphs'] else 'eager'}"
            f"{', scheduled ahead' if r.get('ahead') else ''}",
            f"{r['equal']}/{r['prompts']}", f"where they part, transformers' own logit gap: {gaps}" if gaps else "")
    if r := results.get("speculative"):
        add("greedy vs transformers: qwen3 float32, its own draft model", f"{r['equal']}/{r['prompts']}",
            f"{r['kept']} of {r['guessed']} guesses kept; verify steps replaying decode graphs: "
            f"{r.get('verify_as_decode', 0)} of {r.get('verify_steps', 0)}; KV-cache blocks: target "
            f"{r['target_blocks']}, draft {r['draft_blocks']}")
    for r in results.get("workload", []):
        add(f"workload ({r['requests']} requests), {'graphs' if r['graphs'] else 'eager'}"
            f"{', scheduled ahead' if r.get('ahead') else ''}",
            f"{r['tokens_per_s']:,.0f} tok/s", f"{r['output_tokens']:,} tokens in {r['seconds']} s, after a warm-up "
            f"(prefix-cache hit: {r['warm_up_prefix_hit_tokens']} tokens)"
            + (f"; ceiling {r['ceiling_tokens_per_s']:,.0f} tok/s ({r['fraction']:.0%})" if "fraction" in r else ""))
    if len(results.get("workload", [])) == 2:
        add("graphs over eager", f"{results['workload'][0]['tokens_per_s'] / results['workload'][1]['tokens_per_s']:.2f}x")
    if s := results.get("transformers_slice"):
        add(f"transformers batched generate ({s['requests']} requests)", f"{s['transformers_tokens_per_s']:,.0f} tok/s",
            f"minivllm {s['minivllm_tokens_per_s']:,.0f} tok/s on the same slice: {s['ratio']:.1f}x")
    for r in results.get("decode", []):
        add(f"decode at batch {r['batch']}", f"{r['tokens_per_s']:,.0f} tok/s",
            f"ceiling {r['ceiling_tokens_per_s']:,.0f} tok/s ({r['fraction']:.0%})"
            + (f"; eager {r['eager_tokens_per_s']:,.0f} tok/s, graphs {r['graphs_over_eager']:.1f}x"
               if "eager_tokens_per_s" in r else ""))
    if p := results.get("profile"):
        add(f"decode step at batch {p['batch']}, profiled", f"{p['wall_ms']:.2f} ms",
            f"context {p['context']}, temperature 0.6, split by {p['source']} (the profiler's own cost included)")
        other = "other kernels" if p["source"] == "CUDA kernels" else "other ops"
        for part, what in (("attention", "attention"), ("other", other), ("sampler", "sampler"), ("host", "host")):
            ms = p[f"{part}_ms"]
            add(f"decode step at batch {p['batch']}: {what}", f"{ms:.2f} ms", f"{ms / max(p['wall_ms'], 1e-9):.0%} of the step")
    if c := results.get("compile_report"):
        add("compile report", c["line"].removeprefix("compile report: "),
            f"arch {c.get('arch') or 'its default'}, in {c.get('seconds')} s; its table follows" if c["table"] else "")
    for name, error in results.get("errors", {}).items():
        add(f"{name} failed", error, "its traceback is on stderr")
    if steps := results.get("steps"):
        over = results["over_budget"]
        add("step seconds", f"{results['total_s']:.0f} s of a {results['budget_s']:.0f} s budget",
            ", ".join(f"{n} {v['seconds']:.1f}" for n, v in steps.items())
            + (f"; over budget: {', '.join(over)}" if over else ""))
    return "\n".join(["| check | result | detail |", "|---|---|---|", *lines])


def write_json(path: Path, results: dict) -> None:
    "The results so far, replacing the file whole (a run cut short leaves the last complete one)."
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(part, path)


def out_path_problem(out: Path) -> str | None:
    "Why the JSON could not be written at `out`, before any step runs; None where it can."
    if out.is_dir():
        return f"gpu_check: --out {out} is a folder: name a file in it (e.g. {out / 'gpu_check.json'})"
    if not out.parent.is_dir():
        return f"gpu_check: --out {out}: the folder {out.parent} does not exist (make it first, or name a file elsewhere)"
    return None


def main(argv: list[str] | None = None) -> int:
    default_out = Path(tempfile.gettempdir()) / "gpu_check.json"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the check sized to finish in 4 minutes on an H100")
    ap.add_argument("--dry-run", action="store_true", help="tiny models on the CPU: every step, in seconds, no GPU")
    ap.add_argument("--out", type=Path, default=default_out,
                    help="where the JSON goes, rewritten after every step (default: %(default)s, the temp folder's, "
                         "so that a run leaves nothing in the working tree; on a lent GPU machine name one under $OUT)")
    ap.add_argument("--num-prompts", type=int, default=256, help="requests of the workload (default: %(default)s)")
    ap.add_argument("--skip-tests", action="store_true", help="leave out the GPU test files")
    ap.add_argument("--sweep", nargs="?", const=TILES_JSON, type=Path, metavar="PATH",
                    help="only time the Triton attention's tiles and warps on this card and write the fastest into "
                         "PATH (default: %(const)s, which the kernel reads first)")
    ap.add_argument("--attention-backend", default=None, metavar="NAME",
                    help="run every engine on this attention backend (triton, sdpa, flash, ...; default: automatic)")
    ap.add_argument("--only", type=lambda text: frozenset(filter(None, text.split(","))), default=None, metavar="STEP[,STEP...]",
                    help=f"run these steps alone, at the --quick or full check's sizes (one of {', '.join(CHOSEN_STEPS)}; "
                         "transformers_slice at the full check's 64 requests, also with --quick)")
    a = ap.parse_args(argv)
    if a.num_prompts < 1:
        ap.error(f"--num-prompts must be at least 1, got {a.num_prompts}")
    if a.sweep is not None and a.only is not None:
        ap.error("--sweep runs alone: leave out --only")
    try:
        plan = plan_for(a.quick, a.dry_run, a.only)
    except ValueError as e:
        ap.error(str(e))
    wanted = lambda step: a.only is None or step in a.only
    if problem := out_path_problem(a.out):
        print(problem, file=sys.stderr)
        return 2
    pre = preflight(run_tests=not (a.skip_tests or a.dry_run) and wanted("tests"))
    if pre["missing"]:
        print(pre["line"], file=sys.stderr)  # subtle: the one line a run that cannot start prints
        return 2
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    clock = StepClock(plan.budgets, log)
    clock.add("preflight", pre["seconds"])
    with clock.step("imports", "importing torch, transformers and minivllm"):
        import torch
        from minivllm import LLM  # noqa: F401 (the engine's import cost counted here, not in the first step that uses it)
        from minivllm.bench.workload import Workload
        from minivllm.checkpoints import SHAPES, make_tiny_checkpoint
    if "imports" in clock.errors:
        return 1
    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA GPU here (run with --dry-run to try the steps on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if a.dry_run else "cuda")
    if a.sweep is not None:  # the tile sweep alone: minutes on a GPU, its table beside the kernel
        dtypes = (torch.float32,) if a.dry_run else (torch.bfloat16, torch.float16)
        best = sweep_tiles(device, dtypes, **(dict(shapes=((4, 2, 16),), tiles=(16, 32), warps=(4,), repeats=1)
                                             if a.dry_run else {}), dry_run=a.dry_run, log=log)
        write_tiles(best, a.sweep)
        log(f"gpu_check: {len(best)} choices written to {a.sweep}")
        return 0
    results = dict(mode="quick" if a.quick else "full", dry_run=a.dry_run, preflight=pre,
                   attention_backend=a.attention_backend) | ({} if a.only is None else dict(only=sorted(a.only)))
    save = lambda: write_json(a.out, results | clock.record())
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        background = stack.enter_context(ThreadPoolExecutor(1))
        env = {}
        with clock.step("environment", "the device, its software and its copy bandwidth"):
            results["environment"] = env = environment(device, plan.copy_mib)
        save()
        arch = env["capability"].replace(".", "") if "capability" in env else None
        # the dry run compiles Qwen3-0.6B's variants only (--quick): all of them take minutes on a small CPU
        start_report = lambda: stack.enter_context(CompileReport(tmp, a.quick or a.dry_run, arch,
                                                                 plan.compile_report_timeout_s))
        # subtle: on a GPU machine it compiles in the background from the tests on (its cores are idle while the GPU
        # works); on the dry run's small CPU it would share the cores with the steps beside it, so it runs alone, last
        report = None if a.dry_run or not wanted("compile_report") else start_report()
        if not (a.only is None or a.only & MODEL_STEPS):
            checkpoint = None  # no step asks for the workload's model
        elif a.dry_run:  # the workload's shape, scaled down: a tiny Qwen3 with a vocabulary that holds its ids
            checkpoint = background.submit(make_tiny_checkpoint, tmp / "shape", "qwen3", vocab_size=10_240,
                                           dtype="bfloat16")
            workload = Workload.nano_vllm(num_prompts=min(a.num_prompts, 6), max_input_len=110, max_output_len=104)
        else:
            checkpoint = background.submit(make_tiny_checkpoint, tmp / "qwen3-0.6b", initializer_range=0.02,
                                           dtype="bfloat16", **SHAPES["qwen3-0.6b"])
            workload = Workload.nano_vllm(num_prompts=a.num_prompts)
        if wanted("tests"):
            with clock.step("tests", f"the GPU test files ({', '.join(GPU_TEST_FILES)})"):
                if a.dry_run or a.skip_tests:
                    results["cuda_tests"] = dict(files=list(GPU_TEST_FILES),  # and their budget on a GPU
                                                 budget_s=plan_for(a.quick, dry_run=False).budgets["tests"],
                                                 skipped_because="dry run: no GPU" if a.dry_run else "--skip-tests")
                else:
                    results["cuda_tests"] = run_tests(GPU_TEST_FILES, plan.budgets["tests"],
                                                      pytest_workers(os.cpu_count()))
            save()
        model = None
        if checkpoint is not None:
            with clock.step("model", "the workload's checkpoint (made in the background)"):
                # subtle: made in a thread while the tests run; awaited before any other step draws from torch's
                # global generator (make_tiny_checkpoint seeds it), so every checkpoint's weights stay those of its seed
                model = checkpoint.result()
        if wanted("greedy"):
            with clock.step("greedy", "greedy tokens against transformers"):
                results["greedy_equivalence"] = greedy_equivalence(tmp, device, plan.greedy_tokens, a.attention_backend,
                                                                   plan.greedy_prompts, plan.greedy_eager)
            save()
        if wanted("speculative"):
            with clock.step("speculative", "a draft model beside the target: greedy tokens against transformers"):
                results["speculative"] = speculative_equivalence(tmp, device, plan.greedy_tokens, a.attention_backend)
            save()
        if model is not None:  # else the model step's error (or --only) says why the rest is missing
            if wanted("workload"):
                with clock.step("workload", f"nano-vllm's workload, {len(workload.prompts)} requests"):
                    ceiling = workload_ceiling(model, workload, env["copy_bandwidth_gbs"])
                    results["workload"] = [r | dict(ceiling_tokens_per_s=round(ceiling, 1),
                                                    fraction=round(r["tokens_per_s"] / ceiling, 3))
                                           for eager in eager_settings(device, plan.workload_eager)
                                           for r in [run_workload(model, workload, device, eager, plan.max_model_len,
                                                                  a.attention_backend)]]
                save()
            if plan.transformers_slice:
                with clock.step("transformers_slice", f"transformers on {plan.transformers_slice} requests"):
                    results["transformers_slice"] = transformers_slice(model, workload, plan.transformers_slice,
                                                                       device, plan.max_model_len, a.attention_backend)
                save()
            if wanted("decode"):
                decode_and_profile(model, device, plan, env["copy_bandwidth_gbs"], a.attention_backend, clock, results,
                                   save)
        if wanted("compile_report"):
            with clock.step("compile_report", "the compile report, running since the tests began" if report
                            else "the compile report"):
                results["compile_report"] = (report or start_report()).result()
                log(f"gpu_check: {results['compile_report']['line']}")
    save()
    print(table(results | clock.record()))
    if results.get("compile_report", {}).get("table"):
        print("\n" + results["compile_report"]["table"])
    log(f"gpu_check: the JSON is {a.out}")
    return 1 if clock.errors else 0


if __name__ == "__main__":
    sys.exit(main())
