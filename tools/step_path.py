"""The path of one decode step through the package's files: which files' functions run, in which order, and whether
any file calls back into one that called it. A reader follows the same path when reading how a step works.

    python tools/step_path.py              # the packaged model, TP=1, greedy; prints the files and the calls
    python tools/step_path.py --json out   # the same as JSON

It traces `LLM.step()` of a decode step with `sys.setprofile` (Python functions of minivllm only; torch's and the
C++ kernels' inner calls are not counted): a *file* is a module some function of the step ran in, a *hop* is one
caller-file -> callee-file pair (each counted once), and the step runs *one direction* when those pairs form no cycle.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import minivllm


def trace_step(step) -> tuple[list[str], list[tuple[str, str]]]:
    "Run `step()` under a profiler; the package's files in the order first entered, and the caller->callee file pairs."
    root = str(Path(minivllm.__file__).parent) + "/"
    files: dict[str, None] = {}
    pairs: dict[tuple[str, str], None] = {}
    stack: list[str | None] = []

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            here = name[len(root):] if name.startswith(root) else None
            caller = next((f for f in reversed(stack) if f is not None), None)
            if here is not None:
                files.setdefault(here)
                if caller is not None and caller != here:
                    pairs.setdefault((caller, here))
            stack.append(here)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return list(files), list(pairs)


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
        files, pairs = trace_step(llm.step)
    back = cycles(pairs)
    print(f"{len(files)} files, {len(pairs)} caller->callee file pairs, {len(back)} of them in a cycle")
    for f in files:
        print(f"  {f}")
    for caller, callee in pairs:
        print(f"  {caller} -> {callee}{'   (back up)' if (caller, callee) in back else ''}")
    if a.json:
        Path(a.json).write_text(json.dumps({"files": files, "pairs": pairs, "cycles": back}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
