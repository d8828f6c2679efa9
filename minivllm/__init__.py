__version__ = "0.0.1"

from minivllm.sampling_params import SamplingParams  # noqa: E402
from minivllm.llm import LLM, CompletionOutput, RequestOutput  # noqa: E402
from minivllm.async_llm import AsyncLLM  # noqa: E402

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
