"""minivllm: a small, readable LLM inference engine.

The public names load on first use (PEP 562's module `__getattr__`), so `import minivllm.cli` and `minivllm --help`
do not import torch or transformers; `from minivllm import LLM` imports them as it always did."""
__version__ = "0.0.1"

import importlib
import importlib.abc
import importlib.util
import sys

# each public name -> the module that defines it
_LAZY = {"SamplingParams": "minivllm.sampling_params", "LLM": "minivllm.llm", "CompletionOutput": "minivllm.llm",
         "RequestOutput": "minivllm.llm", "AsyncLLM": "minivllm.serve.async_llm"}

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

# modules that moved into the subpackages (serving, cluster, CPU) -> where they are now: imports by the old name still work
_MOVED = {"minivllm.cpu_kernels": "minivllm.cpu.kernels", "minivllm.server": "minivllm.serve.server", "minivllm.async_llm": "minivllm.serve.async_llm",
          "minivllm.engine.core": "minivllm.serve.core", "minivllm.engine.multinode": "minivllm.cluster.multinode",
          "minivllm.engine.wire": "minivllm.cluster.wire"}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    "Imports a moved module by its old name as the very module at its new place (one module object, two names)."
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in _MOVED else None

    def create_module(self, spec):
        return importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module):
        pass  # subtle: already executed under its new name; running it again would make a second copy


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())


def __getattr__(name: str):
    "Import the module that defines the public `name` on first use, and keep the name here for later lookups."
    if name not in _LAZY:
        raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
