"""tools/gpu_compile_report.py: every Triton kernel of the package compiles for sm_80 and sm_90 on this machine (no
GPU), and no variant spills registers."""
import importlib.util
import itertools
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from minivllm.gpu.triton_attention import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
TOOL = ROOT / "tools" / "gpu_compile_report.py"


def run_report(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    "The tool in a process of its own, with the interpreter off (the kernels must be compiled, not interpreted)."
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=timeout, env=env)


def tool():
    spec = importlib.util.spec_from_file_location("gpu_compile_report", TOOL)
    module = sys.modules["gpu_compile_report"] = importlib.util.module_from_spec(spec)  # (its dataclass looks it up)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "report.json"
    run = run_report("--json", str(out))
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout, json.loads(out.read_text())


def test_every_variant_compiles_for_sm80_and_sm90(report):
    "Every kernel, dtype, head size and group the report promises, for both archs: one row each, none missing."
    table, rows = report
    import triton
    assert f"Compiled by triton {triton.__version__} for sm_80/sm_90" in table
    attention = {"prefill", "prefill over a prefix", "decode", "split decode"}
    t = tool()
    want = {(k, d, h, g, a) for k, d, h, g, a in itertools.product(attention, t.DTYPES, t.HEAD_SIZES, t.GROUPS, t.ARCHS)}
    want |= {(k, d, h, None, a) for k, d, h, a in itertools.product(("store", "merge splits", *t.LAYER_LABELS), t.DTYPES,
                                                                     t.HEAD_SIZES, t.ARCHS)}
    want |= {(k, d, None, None, a) for k, d, a in itertools.product(t.HEAD_FREE_LABELS, t.DTYPES, t.ARCHS)}
    from minivllm.gpu.triton_attention import measured_tiles
    for key in measured_tiles():  # a GPU's sweep's tiles, compiled for the arch that measured them
        arch, head, group, dtype, phase = key.split("/")
        labels = ("decode", "split decode") if phase == "decode" else ("prefill", "prefill over a prefix")
        want |= {(f"{label} (measured)", dtype, int(head[4:]), int(group[5:]), int(arch[2:])) for label in labels}
    got = [(r["kernel"], r["dtype"], r["head_size"], r["group"], r["arch"]) for r in rows]
    assert sorted(got, key=str) == sorted(want, key=str)
    assert all(r["registers"] > 0 and r["blocks_per_sm"] >= 1 for r in rows)
    assert table.count("| sm_") == len(rows)


def test_no_variant_spills(report):
    "16-bit variants (what GPUs serve) and float32 ones keep every value in registers."
    _, rows = report
    spilling = [r for r in rows if r["spill_bytes"]]
    assert not [r for r in spilling if r["dtype"] != "float32"], spilling
    assert not spilling, spilling


def test_the_layer_kernels_keep_every_16bit_rounding(report):
    "The kernels that round where torch rounds (notebook 06c): compiled without fusion, no 16-bit instruction that may skip a rounding."
    _, rows = report
    layers = [r for r in rows if r["kernel"] in tool().LAYER_LABELS]
    assert layers and not [r for r in layers if r["fp_fusion"]]
    assert all(r["fused_16bit"] == 0 for r in layers if r["arch"] >= 90), [r for r in layers if r["fused_16bit"]]


def test_fused_16bit_ops_counts_what_may_skip_a_rounding():
    "fma on 16-bit numbers, and 16-bit multiplies and sums without `.rn` (the assembler may fuse them); not float32's."
    ptx = """
    fma.rn.bf16 %rs1, %rs2, %rs3, %rs4;
    mul.bf16x2 %r1, %r2, %r3;
    sub.f16 %rs5, %rs6, %rs7;
    sub.rn.bf16x2 %r4, %r5, %r6;
    mul.rn.f16 %rs8, %rs9, %rs10;
    fma.rn.f32 %f1, %f2, %f3, %f4;
    add.f32 %f5, %f6, %f7;
    add.s64 %rd1, %rd2, %rd3;
    cvt.rn.bf16.f32 %rs11, %f8;"""
    assert tool().fused_16bit_ops(ptx) == 3


def test_the_report_covers_every_kernel_of_the_package():
    "A kernel added to the package without a launch in the report is named, not left out."
    assert tool().package_kernels() == {"_paged_attention_kernel", "_merge_splits_kernel", "_store_kvcache_kernel",
                                        "_add_rms_norm_kernel", "_silu_and_mul_kernel", "_rotary_kernel",
                                        "_argmax_rows_kernel", "_sample_rows_kernel"}


def test_quick_takes_qwen3_shapes_and_refuses_an_unknown_arch():
    run = run_report("--quick", "--arch", "90")
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [line for line in run.stdout.splitlines() if "| sm_90 |" in line and "(measured)" not in line]
    assert any("| decode (measured) | bfloat16 | 128 | 2 | sm_90 |" in line for line in run.stdout.splitlines())
    assert len(rows) == 12 and all("| bfloat16 | 128 |" in line for line in rows
                                   if not line.startswith(("| argmax |", "| sample rows |")))
    assert "| argmax | bfloat16 | - | - | sm_90 |" in run.stdout  # over the vocabulary: no head size
    assert "| sample rows | bfloat16 | - | - | sm_90 |" in run.stdout
    bad = run_report("--arch", "75")
    assert bad.returncode == 2 and "unknown compute capability [75]" in bad.stderr
