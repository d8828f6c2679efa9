"""The GPU's fast paths: Triton kernels for paged attention and the cache store (notebook 06b), the layers' fused
kernels, the C++ CPU kernels' twins (notebook 06c), and the sampler's one-pass draw (notebook 06d). Loaded only on a
GPU, or when Triton is asked for, never on the CPU's path; the core reaches them through the names below only."""
from .triton_attention import (HAS_TRITON, TRITON_RUNS_ON_CPU, paged_attention_triton, store_kvcache_triton)
from .triton_layers import (TritonLayerOps, add_rms_norm_triton, argmax_rows_triton, layer_ops_for, norm_rotary_triton,
                            rotary_embedding_triton, silu_and_mul_triton)
from .triton_sampler import SAMPLE_TILE, sample_rows_triton

__all__ = ["HAS_TRITON", "TRITON_RUNS_ON_CPU", "paged_attention_triton", "store_kvcache_triton", "TritonLayerOps",
           "add_rms_norm_triton", "argmax_rows_triton", "layer_ops_for", "norm_rotary_triton", "rotary_embedding_triton",
           "silu_and_mul_triton", "SAMPLE_TILE", "sample_rows_triton"]
