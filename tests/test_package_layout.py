"""The package's layers, read from its import statements: the core (what the textbook teaches) reaches the periphery
only through the `minivllm.cpu` and `minivllm.cluster` interfaces, no module (and no folder) imports one that imports
it, and no module imports another's private names."""
from __future__ import annotations

import ast
from pathlib import Path

import minivllm

ROOT = Path(minivllm.__file__).parent
PERIPHERY = ("minivllm.cpu", "minivllm.gpu", "minivllm.serve", "minivllm.cluster", "minivllm.bench", "minivllm.testing",
             "minivllm.checkpoints", "minivllm.cli", "minivllm.cost_model", "minivllm.__main__")
INTERFACES = {"minivllm.cpu", "minivllm.gpu", "minivllm.cluster"}  # packages whose __init__ names what the core may use
# an optional backend loaded on first use, where its hardware and library are there (notebook 06b needs triton)
LOADED_ON_FIRST_USE = {("minivllm.attention", "minivllm.gpu"), ("minivllm.models", "minivllm.gpu")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py") if p.name != "_modidx.py"}


def package_of(name: str) -> list[str]:
    "The package that module `name`'s relative imports start from, as parts."
    return name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]


def imported_from(name: str, node: ast.ImportFrom) -> str:
    "The module a `from ... import` statement of module `name` names. Example: `from ..x import y` in a.b.c -> a.x."
    package = package_of(name)
    above = package[:len(package) - node.level + 1] if node.level else []  # `from ..x import`: relative
    return ".".join(above + ([node.module] if node.module else []))


def for_annotations_only(tree: ast.Module) -> set[int]:
    "The ids of the nodes under `if TYPE_CHECKING:`: imports for the annotations, which never run."
    guards = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
    return {id(n) for guard in guards for statement in guard.body for n in ast.walk(statement)}


def imports(name: str, type_checking: bool = True) -> list[tuple[str, bool]]:
    "The package's modules `name` imports, each with whether the import runs when the module loads (not in a function); `type_checking=False` leaves out those under `if TYPE_CHECKING:`."
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    skipped = set() if type_checking else for_annotations_only(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = imported_from(name, node)
            # `from pkg import sub` imports the module pkg.sub where there is one, else names of pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found += [(t, node.col_offset == 0) for t in targets if t in MODULES and t != name]
    return found


def folder(name: str) -> str:
    "Where module `name` sits in the folder graph: its subpackage (`minivllm.engine`), or itself at the top level."
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or MODULES[name].name == "__init__.py" else name


def reached_from(graph: dict[str, set[str]], start: str) -> set[str]:
    "Every node that a path from `start` reaches in `graph`."
    seen, todo = set(), [start]
    while todo:
        for t in graph.get(todo.pop(), ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


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


def test_the_front_ends_share_the_text_side():
    "`LLM`, `AsyncLLM` and the server take prompts' token ids and outputs' text from `minivllm.outputs`; `AsyncLLM` never imports `llm.py`."
    for front_end in ("minivllm.llm", "minivllm.serve.async_llm", "minivllm.serve.server"):
        assert "minivllm.outputs" in {t for t, _ in imports(front_end)}, front_end
    assert "minivllm.llm" not in {t for t, _ in imports("minivllm.serve.async_llm")}


def test_no_folder_imports_one_that_imports_it():
    "Between folders (a subpackage such as `minivllm.engine`, or a top-level module) the imports run one way."
    edges: dict[tuple[str, str], set[str]] = {}  # (folder, folder) -> the module imports that make the edge
    for m in MODULES:
        for t, _ in imports(m, type_checking=False):
            if folder(m) != folder(t) and (m, t) not in LOADED_ON_FIRST_USE:
                edges.setdefault((folder(m), folder(t)), set()).add(f"{m} -> {t}")
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    assert {"minivllm.engine", "minivllm.cluster", "minivllm.distributed", "minivllm.llm"} <= {folder(m) for m in MODULES}
    closing = sorted((a, b) for a, b in edges if a in reached_from(graph, b))
    assert not closing, "imports between folders that lie on a cycle:\n" + "\n".join(
        f"{a} -> {b}: {', '.join(sorted(edges[a, b]))}" for a, b in closing)


def private_imports(name: str) -> list[str]:
    "The private names (`_x`; not `__x__`) that module `name` imports from another module of the package."
    found = []
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = imported_from(name, node)
        if base != name and (base == "minivllm" or base.startswith("minivllm.")):
            found += [f"{name}: from {base} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_a_private_name_of_another():
    "A name that starts with one underscore belongs to its module: no other module of the package imports it."
    assert private_imports("minivllm.engine.ipc") == []  # its own `_worker_main`, by name from the package, is its own
    found = [line for m in sorted(MODULES) for line in private_imports(m)]
    assert not found, "private names imported across modules:\n" + "\n".join(found)
