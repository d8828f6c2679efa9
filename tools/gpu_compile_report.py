"""Every Triton kernel of minivllm compiled for real NVIDIA GPUs on this machine, with no GPU: registers, spills,
shared memory, how many blocks a multiprocessor can hold, and the 16-bit float instructions that may skip a rounding
torch makes (a fused multiply-add, or one the assembler may fuse: the layer kernels must have none).
The attention's variants with the tiles a GPU's sweep chose (minivllm/gpu/triton_tiles.json) are compiled too, for
the arch that measured them, as "decode (measured)" and the like.

    python tools/gpu_compile_report.py [--arch 80 90] [--quick] [--json PATH] [--jobs N]

Each kernel is launched as the engine launches it (the attention layer's own call, on `meta` tensors laid out as a
model's: q, k and v views of one qkv projection, a paged cache, block tables), but the launch is recorded instead of
run; each recorded launch is then compiled the way Triton's JIT compiles it on a GPU (the same argument
specialisation, options and constexprs), for sm_80 (A100) and sm_90 (H100, H200), with the `ptxas` that the triton
wheel bundles. `cuobjdump`, bundled too, reads each cubin's registers a thread, local memory (spills) and static
shared memory. The variants: attention decode, split decode and its merge, prefill, prefill over a cached prefix, and
the KV-cache store; float16, bfloat16 and float32; head sizes 64 and 128; 1, 2, 3 and 8 query heads a KV head. The
layer kernels (notebook 06c) are launched by their own calls on a model's layouts (16 query heads and 8 KV heads,
hidden size 16 heads' worth: 1,024 at head size 64, 2,048 at 128; q and k views of one qkv row): add + RMSNorm,
SiLU-and-multiply, rotary, q/k norm + rotary at each dtype and head size, argmax and the sampler's one-pass draw
(notebook 06d) over Qwen's 151,936 columns at each dtype. `--quick` takes Qwen3-0.6B's shapes alone (bfloat16,
head size 128, 2 heads a KV head). Compiling a variant takes about a second; `--jobs` compiles in that many
processes (default: the machine's cores).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

KV_HEADS = 8  # Qwen3-0.6B's: the store's row is KV_HEADS * head_dim numbers
BLOCK_SIZE = 16
DTYPES = ("float16", "bfloat16", "float32")
HEAD_SIZES = (64, 128)
GROUPS = (1, 2, 3, 8)
ARCHS = (80, 90)
QUICK = dict(dtypes=("bfloat16",), head_sizes=(128,), groups=(2,))  # Qwen3-0.6B
ATTENTION_KERNELS = {"_paged_attention_kernel": "attention", "_merge_splits_kernel": "merge splits",
                     "_store_kvcache_kernel": "store"}
LAYER_KERNELS = {"_add_rms_norm_kernel": "add rms norm", "_silu_and_mul_kernel": "silu and mul",
                 "_rotary_kernel": "rotary", "_argmax_rows_kernel": "argmax"}
SAMPLER_KERNELS = {"_sample_rows_kernel": "sample rows"}
LAYER_LABELS = ("add rms norm", "silu and mul", "rotary", "norm rotary")  # a variant each per dtype and head size
HEAD_FREE_LABELS = ("argmax", "sample rows")  # a variant per dtype
LAYER_HEADS, LAYER_KV_HEADS, VOCAB = 16, 8, 151936  # Qwen3-0.6B's heads; Qwen's vocabulary
@dataclass
class Variant:
    "One compiled kernel variant and what it costs a multiprocessor."
    kernel: str
    dtype: str
    head_size: int | None  # None: the kernel does not depend on it (argmax)
    group: int | None  # None: the kernel does not depend on it (store, merge, the layer kernels)
    arch: int
    registers: int
    spill_bytes: int  # local memory a thread: what did not fit in registers
    shared_bytes: int  # a block's: dynamic (Triton's buffers) + static
    warps: int
    stages: int
    blocks_per_sm: int
    limited_by: str
    fp_fusion: bool  # whether the compiler may fuse a product into a sum (Triton's default; off: `TORCH_ROUNDING`)
    fused_16bit: int | None  # 16-bit float instructions that may skip a rounding torch makes; None below sm_90


def package_kernels() -> set[str]:
    "The Triton kernels the package launches: every `@triton.jit` function whose name ends in `_kernel`, in any module."
    import minivllm
    found = set()
    for path in Path(minivllm.__file__).parent.rglob("*.py"):
        found |= set(re.findall(r"@triton\.jit(?:\([^)]*\))?\s*\n\s*def (\w+_kernel)\(", path.read_text()))
    return found


@contextlib.contextmanager
def recording(module, kernels: dict[str, str]):
    "Replace `module`'s kernels (name: label) by recorders while the block runs: yields the launches, (label, kernel, args, kwargs)."
    launches, originals = [], {name: getattr(module, name) for name in kernels}

    class Recorder:
        def __init__(self, name, kernel): self.name, self.kernel = name, kernel
        def __getitem__(self, grid): return lambda *a, **kw: launches.append((self.name, self.kernel, a, kw))

    try:
        for name, label in kernels.items():
            setattr(module, name, Recorder(label, originals[name]))
        yield launches
    finally:
        for name, kernel in originals.items():
            setattr(module, name, kernel)


def recorded_launches(dtype: str, head_size: int, group: int) -> list[tuple[str, object, tuple, dict]]:
    "The kernel launches the attention layer and the store make for one shape, recorded (name, kernel, args, kwargs)."
    import torch

    import minivllm.gpu.triton_attention as ta
    from minivllm.kv_cache import allocate_kv_cache, decode_metadata, prefill_metadata

    missing = package_kernels() - set(ATTENTION_KERNELS) - set(LAYER_KERNELS) - set(SAMPLER_KERNELS)
    if missing:
        raise RuntimeError(f"kernels with no variant in the report: {sorted(missing)}: launch them in recorded_launches "
                           "or recorded_layer_launches")
    dev, dt, H, KVH, D = "meta", getattr(torch, dtype), group * KV_HEADS, KV_HEADS, head_size
    T, lengths, cached = 48, [40, 8], [24, 0]
    tables = [[1, 2, 3], [4]]
    qkv = torch.empty(T, (H + 2 * KVH) * D, dtype=dt, device=dev)  # q, k and v are views of it, as in a model
    q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
    kv_cache = allocate_kv_cache(1, 8, BLOCK_SIZE, KVH, D, dt, dev)
    k_cache, v_cache = kv_cache[0, 0], kv_cache[1, 0]
    with recording(ta, ATTENTION_KERNELS) as launches:
        scale = D ** -0.5
        ta.store_kvcache_triton(k, v, k_cache, v_cache, torch.zeros(T, dtype=torch.int64, device=dev))
        ta.paged_attention_triton(q, k, v, None, None, prefill_metadata(tables, [0, 0], lengths, BLOCK_SIZE, dev), scale)
        over_prefix = prefill_metadata(tables, cached, [n - c for n, c in zip(lengths, cached)], BLOCK_SIZE, dev)
        ta.paged_attention_triton(q[:24], k[:24], v[:24], k_cache, v_cache, over_prefix, scale)
        decode = decode_metadata(tables, lengths, BLOCK_SIZE, dev, group_size=None)
        ta.paged_attention_triton(q[:2], None, None, k_cache, v_cache, decode, scale, num_splits=1)
        ta.paged_attention_triton(q[:2], None, None, k_cache, v_cache, decode, scale, num_splits=ta.DECODE_SPLITS)
    labels = ["store", "prefill", "prefill over a prefix", "decode", "split decode", "merge splits"]
    assert len(launches) == len(labels), [l[0] for l in launches]
    return [(label, *launch[1:]) for label, launch in zip(labels, launches)]


def measured_launches(dtype: str, head_size: int, group: int) -> list[tuple[str, object, tuple, dict, int]]:
    "The attention's launches with the tiles a GPU's sweep chose for this shape (minivllm/gpu/triton_tiles.json), each labelled '... (measured)' with the arch that measured it."
    import minivllm.gpu.triton_attention as ta
    table, out = ta.measured_tiles(), []
    for arch in ARCHS:
        shape = f"sm{arch}/head{head_size}/group{group}/{dtype}/"
        if not any(key.startswith(shape) for key in table):
            continue
        real = ta.compute_capability
        ta.compute_capability = lambda device, arch=arch: arch  # subtle: the meta tensors' launches read this arch's rows
        try:
            launches = recorded_launches(dtype, head_size, group)
        finally:
            ta.compute_capability = real
        for label, *rest in launches:
            phase = "decode" if "decode" in label else "prefill" if "prefill" in label else None
            if phase is not None and shape + phase in table:
                out.append((f"{label} (measured)", *rest, arch))
    return out


def recorded_layer_launches(dtype: str, head_size: int, with_argmax: bool) -> list[tuple[str, object, tuple, dict]]:
    "The layer kernels' launches for a model of this dtype and head size, recorded (label, kernel, args, kwargs)."
    import torch

    import minivllm.gpu.triton_layers as tl
    import minivllm.gpu.triton_sampler as ts

    dev, dt, D, T = "meta", getattr(torch, dtype), head_size, 48
    hidden = LAYER_HEADS * D  # 1,024 at head size 64 (Qwen3-0.6B's width), 2,048 at 128
    x, weight = torch.empty(T, hidden, dtype=dt, device=dev), torch.empty(hidden, dtype=dt, device=dev)
    qkv = torch.empty(T, (LAYER_HEADS + 2 * LAYER_KV_HEADS) * D, dtype=dt, device=dev)  # q and k are views of it
    q, k, _ = (t.view(T, -1, D) for t in qkv.split([LAYER_HEADS * D, LAYER_KV_HEADS * D, LAYER_KV_HEADS * D], dim=-1))
    positions = torch.empty(T, dtype=torch.int64, device=dev)
    cos_sin, head_weight = torch.empty(4096, D, device=dev), torch.empty(D, dtype=dt, device=dev)
    with recording(tl, LAYER_KERNELS) as launches, recording(ts, SAMPLER_KERNELS) as sampler_launches:
        tl.add_rms_norm_triton(x, x, weight, 1e-6)
        tl.silu_and_mul_triton(torch.empty(T, 2 * 3 * hidden, dtype=dt, device=dev))
        tl.rotary_embedding_triton(positions, q, k, cos_sin, D)
        tl.norm_rotary_triton(positions, q, k, head_weight, head_weight, 1e-6, cos_sin, D)
        if with_argmax:
            tl.argmax_rows_triton(torch.empty(T, VOCAB, dtype=dt, device=dev))
            settings = [torch.empty(T, dtype=d, device=dev) for d in (torch.float32, torch.float32, torch.int64,
                                                                      torch.int64, torch.bool)]
            ts.sample_rows_triton(torch.empty(T, VOCAB, dtype=dt, device=dev), *settings)
    launches += sampler_launches
    labels = LAYER_LABELS + (HEAD_FREE_LABELS if with_argmax else ())
    assert len(launches) == len(labels), [l[0] for l in launches]
    return [(label, *launch[1:]) for label, launch in zip(labels, launches)]


def compile_for(kernel, arch: int, *args, **kwargs):
    "Compile a `@triton.jit` kernel for an NVIDIA GPU of compute capability `arch` as its launch with these arguments would."
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs, debug=False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def fused_16bit_ops(ptx: str) -> int:
    "How many 16-bit float instructions of `ptx` fuse a product into a sum (fma), or may be fused by `ptxas` (no `.rn`)."
    # subtle: for sm_90 and later only: sm_80 has no 16-bit add or multiply, and does each as an fma with 1 or -0
    count = 0
    for op in re.findall(r"^\s*((?:fma|mul|add|sub)\.[\w.]+)", ptx, re.M):
        parts = op.split(".")
        if parts[-1] in ("f16", "f16x2", "bf16", "bf16x2") and (parts[0] == "fma" or "rn" not in parts):
            count += 1
    return count


def resource_usage(cubin: bytes) -> dict[str, int]:
    "Registers a thread, stack and local memory a thread (spills) and static shared memory, as `cuobjdump` reads them."
    import tempfile

    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    line = next(l for l in out.splitlines() if "REG:" in l)
    fields = dict(part.split(":", 1) for part in line.split() if ":" in part)
    # subtle: a Triton kernel has no local arrays and no calls left after inlining, so its stack frame is its spills
    return dict(registers=int(fields["REG"]), spill_bytes=int(fields["STACK"]) + int(fields["LOCAL"]),
                static_shared=int(fields["SHARED"]))


def compile_shape(dtype: str, head_size: int, group: int, archs: tuple[int, ...], shared_kernels: bool,
                  head_free_kernels: bool = False) -> list[dict]:
    "Every kernel variant of one shape, compiled for each arch (the store, merge and layer kernels only when `shared_kernels`, argmax when `head_free_kernels`)."
    from minivllm.gpu.triton_attention import blocks_per_sm
    rows = []
    launches = recorded_launches(dtype, head_size, group)
    if shared_kernels:
        launches += recorded_layer_launches(dtype, head_size, head_free_kernels)
    variants = [(label, kernel, args, kwargs, archs) for label, kernel, args, kwargs in launches]
    variants += [(label, kernel, args, kwargs, (arch,)) for label, kernel, args, kwargs, arch
                 in measured_launches(dtype, head_size, group) if arch in archs]
    for label, kernel, args, kwargs, variant_archs in variants:
        independent = label in ("store", "merge splits", *LAYER_LABELS, *HEAD_FREE_LABELS)  # the same whatever the group
        if independent and not shared_kernels:
            continue
        for arch in variant_archs:
            compiled = compile_for(kernel, arch, *args, **kwargs)
            use = resource_usage(compiled.asm["cubin"])
            shared = compiled.metadata.shared + use["static_shared"]
            warps = compiled.metadata.num_warps
            blocks, limit = blocks_per_sm(use["registers"], shared, warps, arch)
            head = None if label in HEAD_FREE_LABELS else head_size
            rows.append(asdict(Variant(label, dtype, head, None if independent else group, arch, use["registers"],
                                       use["spill_bytes"], shared, warps, compiled.metadata.num_stages, blocks, limit,
                                       compiled.metadata.enable_fp_fusion,
                                       fused_16bit_ops(compiled.asm["ptx"]) if arch >= 90 else None)))
    return rows


def compile_report(archs=ARCHS, dtypes=DTYPES, head_sizes=HEAD_SIZES, groups=GROUPS, jobs: int | None = None) -> list[dict]:
    "Every kernel variant compiled for every arch: one row each."
    shapes = list(itertools.product(dtypes, head_sizes, groups))
    tasks = [(d, h, g, tuple(archs), g == groups[0], g == groups[0] and h == head_sizes[0]) for d, h, g in shapes]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    if jobs == 1:
        return [row for task in tasks for row in compile_shape(*task)]
    with ProcessPoolExecutor(jobs) as pool:
        return [row for rows in pool.map(compile_shape, *zip(*tasks)) for row in rows]


def report_table(rows: list[dict], triton_version: str) -> str:
    "One markdown table of the rows, the triton that compiled them named above it."
    head = ("| kernel | dtype | head | group | arch | registers | spills (B) | shared (KB) | warps | stages | "
            "blocks/SM | limited by | fusion, fused 16-bit |")
    lines = [f"Compiled by triton {triton_version} for sm_{'/sm_'.join(str(a) for a in sorted({r['arch'] for r in rows}))}:",
             "", head, "|" + "---|" * 13]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['dtype']} | {r['head_size'] or '-'} | {r['group'] or '-'} | sm_{r['arch']} | "
                     f"{r['registers']} | {r['spill_bytes']} | {r['shared_bytes'] / 1024:.1f} | {r['warps']} | "
                     f"{r['stages']} | {r['blocks_per_sm']} | {r['limited_by']} | "
                     f"{'on' if r['fp_fusion'] else 'off'}, {'-' if r['fused_16bit'] is None else r['fused_16bit']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), metavar="CC",
                    help="compute capabilities to compile for (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="Qwen3-0.6B's shapes only (bfloat16, head 128, group 2)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list here")
    ap.add_argument("--jobs", type=int, default=None, help="processes that compile (default: the machine's cores)")
    a = ap.parse_args(argv)
    # subtle: before minivllm's kernels are defined, so that they are JIT functions: this process compiles them, the
    # interpreter would only run them
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        import triton

        from minivllm.gpu.triton_attention import SHARED_PER_SM
    except ImportError:
        print("gpu_compile_report: triton is not installed (pip install triton)", file=sys.stderr)
        return 2
    unknown = [cc for cc in a.arch if cc not in SHARED_PER_SM]
    if unknown:
        ap.error(f"unknown compute capability {unknown}: use one of {sorted(SHARED_PER_SM)}")
    rows = compile_report(a.arch, jobs=a.jobs, **(QUICK if a.quick else {}))
    print(report_table(rows, triton.__version__))
    if a.json:
        Path(a.json).write_text(json.dumps([dict(r, triton=triton.__version__) for r in rows], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
