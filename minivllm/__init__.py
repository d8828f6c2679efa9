"""minivllm: a small, readable LLM inference engine.

The public names load on first use (PEP 562's module `__getattr__`), so `import minivllm.cli` and `minivllm --help`
do not import torch or transformers; `from minivllm import LLM` imports them as it always did."""
__version__ = "0.0.1"

import importlib

# each public name -> the module that defines it
_LAZY = {"SamplingParams": "minivllm.sampling_params", "LLM": "minivllm.llm", "CompletionOutput": "minivllm.outputs",
         "RequestOutput": "minivllm.outputs", "AsyncLLM": "minivllm.serve.async_llm",
         "StructuredOutputsParams": "minivllm.structured_outputs"}

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]

def __getattr__(name: str):
    "Import the module that defines the public `name` on first use, and keep the name here for later lookups."
    if name not in _LAZY:
        raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
