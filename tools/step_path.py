"""The path of one decode step through the package's files: which files' functions run, in which order, and whether
any file calls back into one that called it. A reader follows the same path when reading how a step works.

    python tools/step_path.py              # the packaged model, TP=1, greedy; prints the files and the calls
    python tools/step_path.py --json out   # the same as JSON

It traces `LLM.step()` of a decode step with `sys.setprofile` (Python functions of minivllm only; torch's and the
C++ kernels' inner calls are not counted): a *file* is a module some function of the step ran in, a *hop* is one
caller-file -> callee-file pair (each counted once), and the step runs *one direction* when those pairs form no cycle.
What a reader pays: the *lines* of the functions the step runs (each function counted once, from its first line to
its last; comprehensions and lambdas inside them are part of them), and the *check calls* (calls of functions named
`check`, `validate`, `check_...` or `validate_...`, each call counted). A *detour* is a file of the periphery
(`cpu/`, `serve/`, `cluster/`, `bench/`) the step enters; a pair *calls back up* when its callee is the engine, what
calls it, or one of the engine's stages (the files its step calls: the scheduler, the ranks) and its caller lies
below them, as a runner asking the scheduler would.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import minivllm


@dataclass
class StepTrace:
    "What one call ran of the package: its files in the order first entered, caller->callee file pairs, functions, check calls."
    files: list[str] = field(default_factory=list)
    pairs: list[tuple[str, str]] = field(default_factory=list)
    functions: dict[str, int] = field(default_factory=dict)  # "file:line name" -> its lines
    check_calls: dict[str, int] = field(default_factory=dict)  # "file:line name" -> how many times the step called it

    @property
    def lines(self) -> int: return sum(self.functions.values())


def function_lines(code) -> int:
    "Lines of a function, from its first line to its last."
    last = max((line for *_, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    return last - code.co_firstlineno + 1


def is_check(name: str) -> bool:
    "Whether a function of this name checks its inputs: `check`, `validate`, `check_...`, `validate_...` (a leading _ too)."
    name = name.lstrip("_")
    return name in ("check", "validate") or name.startswith(("check_", "validate_"))


def trace_step(step) -> StepTrace:
    "Run `step()` under a profiler: what it ran of the package."
    root = str(Path(minivllm.__file__).parent) + "/"
    trace, files, pairs = StepTrace(), {}, {}
    stack: list[str | None] = []

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            here = code.co_filename[len(root):] if code.co_filename.startswith(root) else None
            caller = next((f for f in reversed(stack) if f is not None), None)
            if here is not None:
                files.setdefault(here)
                if caller is not None and caller != here:
                    pairs.setdefault((caller, here))
                if not code.co_name.startswith("<"):  # a comprehension or lambda is counted in its function's lines
                    key = f"{here}:{code.co_firstlineno} {code.co_name}"
                    trace.functions.setdefault(key, function_lines(code))
                    if is_check(code.co_name):
                        trace.check_calls[key] = trace.check_calls.get(key, 0) + 1
            stack.append(here)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    trace.files, trace.pairs = list(files), list(pairs)
    return trace


def cycles(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    "The caller->callee pairs whose callee (transitively) calls the caller back: where a step runs back up."
    graph: dict[str, set[str]] = {}
    for a, b in pairs:
        graph.setdefault(a, set()).add(b)
    def reaches(a: str, target: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            f = todo.pop()
            if f == target:
                return True
            if f not in seen:
                seen.add(f)
                todo.extend(graph.get(f, ()))
        return False
    return [(a, b) for a, b in pairs if reaches(b, a)]


PERIPHERY = ("cpu/", "serve/", "cluster/", "bench/")  # the folders outside the textbook's core (tests/test_package_layout.py)
ENGINE = "engine/llm_engine.py"


def detours(trace: StepTrace) -> list[str]:
    "The periphery's files the step enters: code a reader leaves the core for."
    return [f for f in trace.files if f.startswith(PERIPHERY)]


def calls_back_up(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    "Caller->callee pairs into the engine, what calls it, or one of its stages (the files the engine's step calls) from a file below them."
    above = {a for a, b in pairs if b == ENGINE} | {ENGINE}
    up = above | {b for a, b in pairs if a == ENGINE}
    return [(a, b) for a, b in pairs if b in up and a not in above]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--json", help="write the files and pairs here as JSON")
    a = p.parse_args(argv)
    from minivllm import LLM, SamplingParams
    with LLM(tensor_parallel_size=a.tp, dtype="float32") as llm:
        llm.add_request("ROMEO.", SamplingParams(temperature=0, max_tokens=8))
        llm.step()  # the prefill
        llm.step()  # a first decode (warm: graphs and caches are built)
        trace = trace_step(llm.step)
    back, up, side = cycles(trace.pairs), calls_back_up(trace.pairs), detours(trace)
    print(f"{len(trace.files)} files, {len(trace.pairs)} caller->callee file pairs, {len(back)} of them in a cycle, "
          f"{len(up)} calling back up; {len(trace.functions)} functions of {trace.lines} lines; "
          f"{sum(trace.check_calls.values())} check calls; {len(side)} detour files ({', '.join(side) or 'none'})")
    for f in trace.files:
        lines = sum(n for key, n in trace.functions.items() if key.split(":")[0] == f)
        print(f"  {f}: {lines} lines{'   (detour)' if f in side else ''}")
    for caller, callee in trace.pairs:
        note = "   (cycle)" if (caller, callee) in back else "   (back up)" if (caller, callee) in up else ""
        print(f"  {caller} -> {callee}{note}")
    for key, calls in sorted(trace.check_calls.items(), key=lambda kv: -kv[1]):
        print(f"  {calls:4d} calls of {key}")
    if a.json:
        Path(a.json).write_text(json.dumps({"files": trace.files, "pairs": trace.pairs, "cycles": back,
                                            "calls_back_up": up, "detours": side,
                                            "functions": trace.functions, "lines": trace.lines,
                                            "check_calls": trace.check_calls}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
