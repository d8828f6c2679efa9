"""The GPU's fast paths: Triton kernels for paged attention and the cache store (notebook 06b). Loaded only on a GPU,
or when Triton is asked for, never on the CPU's path; the core reaches them through the names below only."""
from .triton_attention import (HAS_TRITON, TRITON_RUNS_ON_CPU, paged_attention_triton, store_kvcache_triton)

__all__ = ["HAS_TRITON", "TRITON_RUNS_ON_CPU", "paged_attention_triton", "store_kvcache_triton"]
