"""The CPU's fast paths: its C++ kernels (notebook 04a, sources in this folder), the GEMM chosen by measurement
(notebook 03a), the threads per rank chosen from the load (notebook 04b). The core reaches them through the names
below only; nothing here imports the core's layers."""
from .gemm import GEMM_ROWS, LOGIT_ROWS, cpu_gemm_setting, gemm_kernels, packed_weight
from .kernels import (add_rms_norm, argmax_rows, build_cpu_extension, check_cpu_tensors, cpp_listing, cpp_source,
                      layer_ops_for, philox_uniform, rotary_embedding, silu_and_mul, use_cpu_kernels)
from .threads import ThreadPolicy, prefill_streams

__all__ = ["GEMM_ROWS", "LOGIT_ROWS", "cpu_gemm_setting", "gemm_kernels", "packed_weight", "add_rms_norm", "argmax_rows",
           "build_cpu_extension", "check_cpu_tensors", "cpp_listing", "cpp_source", "layer_ops_for", "philox_uniform", "rotary_embedding", "silu_and_mul",
           "use_cpu_kernels", "ThreadPolicy", "prefill_streams"]
