"""The package's layers, read from its import statements: the core (what the textbook teaches) reaches the periphery
only through the `minivllm.cpu` and `minivllm.cluster` interfaces, and no module imports one that imports it."""
from __future__ import annotations

import ast
from pathlib import Path

import minivllm

ROOT = Path(minivllm.__file__).parent
PERIPHERY = ("minivllm.cpu", "minivllm.serve", "minivllm.cluster", "minivllm.bench", "minivllm.testing",
             "minivllm.checkpoints", "minivllm.cli", "minivllm.cost_model", "minivllm.__main__")
INTERFACES = {"minivllm.cpu", "minivllm.cluster"}  # packages whose __init__ names what the core may use
# an optional backend loaded on first use, where its hardware and library are there (notebook 06b needs triton)
LOADED_ON_FIRST_USE = {("minivllm.attention", "minivllm.triton_attention")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py") if p.name != "_modidx.py"}


def imports(name: str) -> list[tuple[str, bool]]:
    "The package's modules `name` imports, each with whether the import runs when the module loads (not in a function)."
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            above = package[:len(package) - node.level + 1] if node.level else []  # `from ..x import`: relative
            base = ".".join(above + ([node.module] if node.module else []))
            # `from pkg import sub` imports the module pkg.sub where there is one, else names of pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found += [(t, node.col_offset == 0) for t in targets if t in MODULES and t != name]
    return found


def is_periphery(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PERIPHERY)


def test_the_core_reaches_the_periphery_only_through_its_interfaces():
    core = sorted(m for m in MODULES if not is_periphery(m))
    assert {"minivllm.llm", "minivllm.engine.llm_engine", "minivllm.layers.linear", "minivllm.attention"} <= set(core)
    wrong = [(m, t) for m in core for t, _ in imports(m) if is_periphery(t) and t not in INTERFACES]
    assert not wrong, f"core modules importing the periphery past its interface: {wrong}"


def test_no_module_imports_one_that_imports_it():
    "The import graph has no cycle (the one optional backend loaded on first use aside)."
    graph = {m: {t for t, _ in imports(m) if (m, t) not in LOADED_ON_FIRST_USE} for m in MODULES}
    graph = {m: ts - {p for p in ts if m.startswith(p + ".")} for m, ts in graph.items()}  # a package's own __init__
    done, path = set(), []

    def visit(m: str) -> None:
        if m in path:
            raise AssertionError(f"an import cycle: {' -> '.join(path[path.index(m):] + [m])}")
        if m in done:
            return
        path.append(m)
        for t in sorted(graph[m]):
            visit(t)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_the_engine_core_process_and_the_front_ends_drive_one_engine_class():
    "`LLM` and the engine-core process both drive `LLMEngine`; the engine-core process never imports `llm.py`."
    assert "minivllm.engine.llm_engine" in {t for t, _ in imports("minivllm.serve.core")}
    assert "minivllm.llm" not in {t for t, _ in imports("minivllm.serve.core")}
    assert "minivllm.engine.llm_engine" in {t for t, _ in imports("minivllm.llm")}
