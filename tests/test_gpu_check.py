"""tools/gpu_check.py: its quick dry run (every step of the GPU check on the CPU with tiny models, its table and JSON),
the import preflight, the child pytest's budget, the profiler split, the compile report's graceful paths."""
import ast
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minivllm.bench.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.py"
# the Python packages of the lent GPU machines' image that the check may rely on (KINDS.md's list, read 2026-11-17);
# minivllm's own requirements that the image lacks (fastcore, msgspec, ...) travel as wheels (tools/offline_wheels.sh)
GPU_IMAGE = {"torch", "triton", "transformers", "safetensors", "huggingface-hub", "numpy", "xxhash", "tqdm",
             "cloudpickle", "pytest", "pytest-xdist", "pytest-timeout"}


@pytest.fixture
def gpu_check(monkeypatch):
    "tools/gpu_check.py as a module (registered, as its dataclasses need, and unregistered after the test)."
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)
    spec.loader.exec_module(module)
    return module


def rows_of(stdout: str) -> list[str]:
    "The check column of the first markdown table in `stdout`."
    table = []
    for line in stdout.splitlines():
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    return [r.split(" | ")[0][2:] for r in table[2:]]


# ---------------------------------------------------------------------------------------------- the whole check

def test_the_quick_check_runs_dry_on_the_cpu_and_writes_its_table_and_json(tmp_path, gpu_check):
    out = tmp_path / "check.json"
    env = os.environ | {"MINIVLLM_CPU_GEMM": "torch"}  # no GEMM timing: this is about the script, not the CPU
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--dry-run", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check.json"]  # nothing else left in the working folder
    checks = rows_of(run.stdout)
    assert checks[:5] == ["preflight", "device", "copy bandwidth", "cuda tests", "attention backend"], checks
    assert sum(c.startswith("greedy vs transformers") for c in checks) == 5  # 2 models x 2 dtypes (eager on the CPU)
    assert "greedy vs transformers: qwen3 float32, its own draft model" in checks  # and speculative decoding
    assert {"workload (6 requests), eager", "decode at batch 1", "decode at batch 4", "decode step at batch 4, profiled",
            *(f"decode step at batch 4: {part}" for part in ("attention", "other ops", "sampler", "host")),
            "compile report", "step seconds"} <= set(checks), checks
    assert "transformers batched generate (4 requests)" not in checks  # --quick leaves it out (the full check's)
    results = json.loads(out.read_text())
    assert set(results) == {"mode", "dry_run", "preflight", "environment", "attention_backend", "cuda_tests",
                            "greedy_equivalence", "speculative", "workload", "decode", "profile", "compile_report", "steps", "total_s",
                            "budget_s", "over_budget", "errors"}
    assert results["errors"] == {} and run.stderr.count("Traceback") == 0
    assert (results["mode"], results["dry_run"], results["preflight"]["missing"]) == ("quick", True, [])
    assert results["cuda_tests"] == dict(files=list(gpu_check.GPU_TEST_FILES), budget_s=130,
                                         skipped_because="dry run: no GPU")
    float32 = [r for r in results["greedy_equivalence"] if r["dtype"] == "float32"]
    assert all(r["equal"] == r["prompts"] == 13 and r["parts"] == [] for r in float32), float32  # float32: exactly
    spec = results["speculative"]
    assert spec["equal"] == spec["prompts"] and spec["kept"] == spec["guessed"] > 0, spec  # its own draft: every guess
    assert spec["target_blocks"] > 0 and spec["draft_blocks"] > 0
    [workload] = results["workload"]
    assert workload["output_tokens"] == Workload.nano_vllm(6, 110, 104).output_tokens and not workload["graphs"]
    assert workload["warm_up_prefix_hit_tokens"] > 0  # the warm-up ran a prefill over a cached prefix
    assert all(0 < r["fraction"] for r in results["decode"])
    p = results["profile"]
    parts = [p[f"{k}_ms"] for k in ("attention", "other", "sampler", "host")]
    assert (p["batch"], p["source"]) == (4, "CPU ops") and all(x > 0 for x in parts), p
    assert sum(parts) == pytest.approx(p["wall_ms"], rel=0.01), p
    assert set(results["steps"]) == set(gpu_check.plan_for(quick=True, dry_run=True).budgets)
    assert all(s["seconds"] >= 0 and s["budget_s"] > 0 for s in results["steps"].values())
    for step in results["steps"]:
        assert f"gpu_check: {step}: " in run.stderr  # each step's seconds on stderr as it ends
    report = results["compile_report"]
    if gpu_check.COMPILE_REPORT.exists():  # its table follows ours; its rows are in the JSON
        assert report["status"] == "ran" and report["rows"], report["line"]
        assert report["table"] and report["table"] in run.stdout
    else:
        assert report["line"] == "compile report: tools/gpu_compile_report.py missing"
        assert report["line"] in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run for real")
def test_without_a_gpu_the_check_says_so_and_how_to_dry_run():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--dry-run" in run.stderr


def test_the_plans_fit_their_windows(gpu_check):
    "--quick within 4 minutes on a GPU, its tests within 130 s; the full check keeps eager runs and transformers."
    quick, full = gpu_check.plan_for(quick=True, dry_run=False), gpu_check.plan_for(quick=False, dry_run=False)
    assert sum(quick.budgets.values()) <= 240 and quick.budgets["tests"] == 130
    assert quick.compile_report_timeout_s < sum(quick.budgets.values())
    assert (quick.greedy_eager, quick.workload_eager, quick.transformers_slice) == (False, False, 0)
    assert (full.greedy_eager, full.workload_eager, full.transformers_slice) == (True, True, 64)
    assert quick.batches == full.batches == (1, 16, 64, 256) and quick.max_model_len == full.max_model_len == 4096
    for dry in (gpu_check.plan_for(True, True), gpu_check.plan_for(False, True)):  # float32's exact 13/13 on the CPU
        assert dry.greedy_prompts == 13


def test_only_keeps_the_steps_it_names_at_their_plans_sizes(gpu_check):
    "--only: the named steps' budgets (and those every run takes), the checkpoint's where a step needs it, one call."
    plan = lambda quick, only, dry=False: gpu_check.plan_for(quick, dry, frozenset(only))
    alone = plan(True, {"transformers_slice"})
    assert alone.transformers_slice == 64 and set(alone.budgets) == {"preflight", "imports", "environment", "model",
                                                                       "transformers_slice"}
    assert alone.budgets["model"] == 60 and sum(alone.budgets.values()) <= 600  # made alone: its whole 52 s
    assert plan(True, {"tests", "workload"}).budgets["model"] == 5  # made beside the tests, as --quick makes it
    assert plan(True, {"transformers_slice"}, dry=True).transformers_slice == 4
    assert set(plan(False, {"decode"}).budgets) == {"preflight", "imports", "environment", "model", "decode", "profile"}
    assert set(plan(True, {"greedy"}).budgets) == {"preflight", "imports", "environment", "greedy"}  # no checkpoint
    assert plan(True, {"greedy"}).transformers_slice == 0 and plan(False, {"greedy"}).transformers_slice == 0
    whole = gpu_check.plan_for(True, False)
    assert plan(True, set(gpu_check.CHOSEN_STEPS) - {"transformers_slice"}) == whole  # --quick's steps: --quick
    with pytest.raises(ValueError, match="no step decod; the steps are tests, greedy, speculative"):
        plan(True, {"decod"})
    with pytest.raises(ValueError, match="--only: no step named; the steps are tests"):
        plan(True, set())


def test_only_runs_its_steps_dry_and_leaves_out_the_rest(tmp_path, gpu_check):
    out = tmp_path / "check.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--dry-run", "--only", "greedy,transformers_slice",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=os.environ | {"MINIVLLM_CPU_GEMM": "torch"})
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["only"] == ["greedy", "transformers_slice"] and results["errors"] == {}
    assert set(results["steps"]) == {"preflight", "imports", "environment", "model", "greedy", "transformers_slice"}
    assert {"cuda_tests", "speculative", "workload", "decode", "profile", "compile_report"}.isdisjoint(results)
    assert results["transformers_slice"]["requests"] == 4  # the full check's slice (dry), though --quick
    checks = rows_of(run.stdout)
    assert "transformers batched generate (4 requests)" in checks and "cuda tests" not in checks, checks
    bad = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "greedy,nope"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--only: no step nope" in bad.stderr
    both = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--sweep", "--only", "greedy"],
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "--sweep runs alone: leave out --only" in both.stderr
    empty = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", ","], capture_output=True, text=True,
                           timeout=60)
    assert empty.returncode == 2 and "--only: no step named" in empty.stderr


def test_a_failing_step_is_recorded_and_the_run_goes_on(gpu_check):
    lines = []
    clock = gpu_check.StepClock(dict(slow=0.0, broken=5.0), lines.append)
    with clock.step("slow", "a step over its budget"):
        time.sleep(0.01)
    with clock.step("broken", "a step that fails"):
        raise RuntimeError("no GPU memory left\nsecond line")
    record = clock.record()
    assert record["errors"] == {"broken": "RuntimeError: no GPU memory left"} and record["over_budget"] == ["slow"]
    assert set(record["steps"]) == {"slow", "broken"} and record["budget_s"] == 5.0
    assert any("Traceback" in l for l in lines) and any(l.startswith("gpu_check: slow: ") and "OVER BUDGET" in l
                                                         for l in lines)
    rows = rows_of(gpu_check.table(record))
    assert rows == ["broken failed", "step seconds"]


def test_a_bad_out_path_is_refused_before_any_step(tmp_path, gpu_check, capsys):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path / "no" / "check.json")]) == 2
    assert capsys.readouterr().err.strip() == (f"gpu_check: --out {tmp_path / 'no' / 'check.json'}: the folder "
                                               f"{tmp_path / 'no'} does not exist (make it first, or name a file "
                                               "elsewhere)")
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 2
    assert "is a folder: name a file in it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--num-prompts", "0"])
    assert "--num-prompts must be at least 1, got 0" in capsys.readouterr().err


def test_the_default_json_goes_to_the_temp_folder_not_the_working_tree():
    import tempfile
    run = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and str(Path(tempfile.gettempdir()) / "gpu_check.json") in run.stdout


def test_the_full_checks_transformers_slice_compares_on_the_same_requests(tmp_path, gpu_check):
    "The full check's one step that --quick leaves out: transformers' batched generate beside ours, and its row."
    from minivllm.checkpoints import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3", vocab_size=10_240, dtype="bfloat16")
    workload = Workload.make(vocab_size=10_240, num_prompts=3, input_len=(4, 12), output_len=(4, 8))
    s = gpu_check.transformers_slice(path, workload, 2, torch.device("cpu"), 256)
    assert s["requests"] == 2 and s["transformers_tokens_per_s"] > 0 and s["minivllm_tokens_per_s"] > 0
    assert rows_of(gpu_check.table(dict(transformers_slice=s))) == ["transformers batched generate (2 requests)"]


def test_an_eager_engines_decode_rates_sit_beside_the_graphs_at_small_batches(tmp_path, gpu_check):
    "On a GPU the decode rows carry an engine without CUDA graphs at batches up to 16, and what graphs gain."
    from minivllm.checkpoints import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3", dtype="bfloat16")
    plan = gpu_check.plan_for(quick=True, dry_run=True)
    eager = gpu_check.eager_decode_rates(path, torch.device("cpu"), (1, 4, 64), plan, bandwidth_gbs=100.0)
    assert [r["batch"] for r in eager] == [1, 4] and all(r["tokens_per_s"] > 0 for r in eager)  # 64: past 16
    graphs = [dict(batch=b, tokens_per_s=3.0 * b, ceiling_tokens_per_s=10.0 * b, fraction=0.3) for b in (1, 64)]
    rows = gpu_check.with_eager(graphs, [dict(batch=1, tokens_per_s=1.5)])
    assert rows[0] == graphs[0] | dict(eager_tokens_per_s=1.5, graphs_over_eager=2.0) and rows[1] == graphs[1]
    assert "eager 2 tok/s, graphs 2.0x" in gpu_check.table(dict(decode=rows))


def test_the_workloads_ceiling_is_its_steps_bytes_over_the_bandwidth(tmp_path, gpu_check):
    "Each decode step reads the weights and its keys and values: at twice the bandwidth, twice the ceiling."
    from minivllm.checkpoints import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3", dtype="bfloat16")
    workload = Workload.make(vocab_size=1000, num_prompts=3, input_len=(4, 12), output_len=(4, 8))
    one, two = (gpu_check.workload_ceiling(path, workload, gbs) for gbs in (100.0, 200.0))
    assert one > 0 and two == pytest.approx(2 * one)


# ---------------------------------------------------------------------------------------------- the preflight

def test_a_missing_module_stops_the_check_first_with_one_line_that_says_how_to_bring_it():
    "Blocked as Python blocks an import (None in sys.modules): exit 2, one line, before torch is imported."
    code = ("import runpy, sys\n"
            "sys.modules['msgspec'] = sys.modules['fastcore'] = None\n"
            f"sys.argv = [{str(SCRIPT)!r}, '--quick']\n"
            "try:\n"
            f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    print(e.code, 'torch' in sys.modules)\n")
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - start < 10 and run.stdout.split() == ["2", "False"], (run.stdout, run.stderr)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert run.stderr.splitlines() == [
        f"gpu_check: missing modules fastcore, msgspec: on a machine with pip run `tools/offline_wheels.sh {python} "
        "wheels/`, bring wheels/ here, then `pip install --no-index --find-links wheels/ fastcore msgspec`"], run.stderr


def test_install_line_names_what_offline_wheels_brings_what_it_does_not_and_torch(gpu_check):
    modules = gpu_check.NEEDED_MODULES | gpu_check.TEST_MODULES
    line = gpu_check.install_line(["torch", "msgspec", "pytest"], modules, "3.12", gpu_check.offline_requirements())
    assert "\n" not in line and line.startswith("gpu_check: missing modules torch, msgspec, pytest: ")
    assert ("`tools/offline_wheels.sh 3.12 wheels/ && pip download --only-binary=:all: --python-version 3.12 "
            "--platform manylinux2014_x86_64 -d wheels/ pytest`") in line
    assert "`pip install --no-index --find-links wheels/ msgspec pytest`" in line
    assert line.endswith("; torch: install its CUDA build (offline_wheels.sh leaves torch out on purpose)")


def test_offline_requirements_are_what_offline_wheels_downloads(gpu_check):
    listed = subprocess.run(["bash", str(ROOT / "tools" / "offline_wheels.sh"), "--list"], capture_output=True,
                            text=True, timeout=60, check=True).stdout.split()
    import re
    assert gpu_check.offline_requirements() == {gpu_check.normalized(re.split(r"[<>=!~;\[ ]", r)[0]) for r in listed}


def test_offline_wheels_fetches_every_requirement_but_torch():
    import configparser
    listed = subprocess.run(["bash", str(ROOT / "tools" / "offline_wheels.sh"), "--list"], capture_output=True,
                            text=True, timeout=60, check=True).stdout.split()
    c = configparser.ConfigParser()
    c.read(ROOT / "settings.ini")
    required = c["DEFAULT"]["requirements"].split()
    assert listed == [r for r in required if not r.startswith("torch")] and len(listed) == len(required) - 1


def test_the_preflight_looks_up_every_requirement_the_check_and_its_tests_load(gpu_check):
    "What the check and the GPU test files import, through minivllm too: every requirement of ours among it is looked up."
    code = ("import sys, pytest\n"
            "import transformers, safetensors, minivllm, minivllm.bench.throughput, minivllm.checkpoints\n"
            "from minivllm import LLM\n"
            f"pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', *{list(gpu_check.GPU_TEST_FILES)!r}])\n"
            "print('MODULES', *sorted({m.split('.')[0] for m in sys.modules}))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    loaded = set(next(l for l in run.stdout.splitlines() if l.startswith("MODULES")).split()[1:])
    ours = gpu_check.offline_requirements() | {"torch", "triton", "numpy", "pytest"}
    distributions = importlib.metadata.packages_distributions()
    needed = {gpu_check.normalized(d) for m in loaded for d in distributions.get(m, [])} & ours
    looked_up = {gpu_check.normalized(d) for d in (gpu_check.NEEDED_MODULES | gpu_check.TEST_MODULES).values()}
    assert needed <= looked_up, needed - looked_up


def test_the_gpu_test_files_import_only_what_the_gpu_machine_has(gpu_check):
    "Each named file's own imports: the standard library, minivllm, or a looked-up module the image or a wheel brings."
    looked_up = gpu_check.NEEDED_MODULES | gpu_check.TEST_MODULES
    for name in (*gpu_check.GPU_TEST_FILES, "tests/conftest.py"):
        tree = ast.parse((ROOT / name).read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        foreign = imported - set(sys.stdlib_module_names) - {"minivllm", "__future__"} - set(looked_up)
        assert not foreign, f"{name} imports {foreign}: not on the GPU image, not looked up by the preflight"
    carried = {gpu_check.normalized(d) for d in looked_up.values()} - GPU_IMAGE
    assert carried <= gpu_check.offline_requirements(), carried - gpu_check.offline_requirements()
    assert "test_gpu_backends_match_dense" in (ROOT / "tests" / "test_kv_cache.py").read_text()
    assert "tests/test_kv_cache.py" in gpu_check.GPU_TEST_FILES


# ---------------------------------------------------------------------------------------------- the tests' child

def test_the_childs_tests_are_killed_at_their_budget_and_reported(tmp_path, gpu_check):
    test_file = tmp_path / "test_budget.py"
    test_file.write_text("import time\n\ndef test_quick():\n    pass\n\ndef test_hangs():\n    time.sleep(120)\n")
    start = time.perf_counter()
    t = gpu_check.run_tests((str(test_file),), budget_s=6, workers=1)
    assert time.perf_counter() - start < 30
    assert t["killed_at_budget"] and t["passed"] == 1 and t["failed"] == 0, t
    assert t["unfinished"].endswith("test_budget.py::test_hangs"), t
    assert "killed at its 6 s budget in " in gpu_check.table(dict(cuda_tests=t))


def test_pytest_output_gives_counts_failures_and_the_test_that_did_not_finish(gpu_check):
    plain = ("tests/test_a.py::test_one PASSED                       [ 25%]\n"
             "tests/test_a.py::test_two[x-1] FAILED                  [ 50%]\n"
             "tests/test_b.py::test_three SKIPPED (needs a GPU)      [ 75%]\n"
             "tests/test_b.py::test_four \n")
    assert gpu_check.parse_pytest_output(plain) == dict(
        passed=1, failed=1, skipped=1, errors=0, failing=["tests/test_a.py::test_two[x-1]"], summary=None,
        unfinished="tests/test_b.py::test_four")
    xdist = ("[gw1] [ 50%] PASSED tests/test_a.py::test_one \n"
             "[gw0] [100%] ERROR tests/test_b.py::test_five \n"
             "=========================== short test summary info ============================\n"
             "ERROR tests/test_b.py::test_five - RuntimeError: CUDA error\n"
             "ERROR tests/test_c.py - ModuleNotFoundError: No module named 'httpx'\n"
             "=================== 1 passed, 2 errors in 12.31s ===================\n")
    parsed = gpu_check.parse_pytest_output(xdist)
    assert (parsed["passed"], parsed["errors"], parsed["unfinished"]) == (1, 1, None)
    assert parsed["failing"] == ["tests/test_b.py::test_five", "tests/test_c.py"]
    assert parsed["summary"] == "1 passed, 2 errors in 12.31s"


# ---------------------------------------------------------------------------------------------- the profiler split

def test_a_gpu_steps_kernels_split_into_attention_other_sampler_and_host(gpu_check):
    E = gpu_check.StepEvent
    label = gpu_check.SAMPLER_LABEL
    events = [E("aten::softmax", 700, 705), E(label, 690, 800),  # host: an op inside the sampler's range, the range
              E("void at::native::vectorized_elementwise_kernel<...>", 100, 200, True),  # a layer's kernel (a graph's)
              E("_paged_attention_kernel", 200, 300, True),
              E("_merge_splits", 300, 320, True),
              E("ampere_bf16_s16816gemm_bf16_128x64", 320, 420, True, launched_us=650),  # the LM head, before the range
              E("softmax_warp_forward", 720, 760, True, launched_us=700),  # launched inside the sampler's range
              E(label, 760, 790, True),  # the GPU's side of the range
              E("argmax_kernel", 770, 780, True)]  # inside it: the sampler's, though its launch is unknown
    parts = gpu_check.split_step(events, wall_us=1000)
    assert parts == dict(attention=120, other=200, sampler=50, host=1000 - 370)


def test_a_cpu_steps_ops_split_into_attention_other_sampler_and_host(gpu_check):
    E = gpu_check.StepEvent
    events = [E("aten::linear", 0, 100), E("aten::mm", 10, 90),  # an op and its own sub-op: counted once
              E("minivllm_cpu::paged_decode_attention", 120, 170), E("aten::scaled_dot_product_attention", 180, 200),
              E("aten::_softmax", 185, 195),
              E(gpu_check.SAMPLER_LABEL, 300, 400), E("aten::argmax", 310, 330)]
    assert gpu_check.split_step(events, wall_us=500) == dict(attention=70, other=100, sampler=100, host=230)
    assert gpu_check.split_step([], wall_us=7) == dict(attention=0, other=0, sampler=0, host=7)


def test_profiler_events_link_each_kernel_to_the_op_that_launched_it(gpu_check):
    "torch.profiler's events as a GPU run gives them (here made by hand): kernels carry their op's start."
    from types import SimpleNamespace
    from torch.autograd import DeviceType
    def event(name, id, start, end, gpu=False, link=0, annotation=False):
        return SimpleNamespace(name=name, id=id, time_range=SimpleNamespace(start=start, end=end), is_user_annotation=
                               annotation, device_type=DeviceType.CUDA if gpu else DeviceType.CPU,
                               linked_correlation_id=link)
    label = gpu_check.SAMPLER_LABEL
    prof = SimpleNamespace(events=lambda: [
        event("aten::softmax", 7, 10, 20), event("cudaLaunchKernel", 7, 12, 14, link=7),  # an op; its runtime call
        event("softmax_warp_forward", 900, 30, 40, gpu=True, link=7),
        event("graph_kernel", 901, 50, 60, gpu=True),  # replayed from a CUDA graph: launched by no op
        event("some_other_range", 902, 30, 60, gpu=True, annotation=True),  # another range's GPU side: left out
        event(label, 903, 30, 40, gpu=True, annotation=True)])
    assert gpu_check.profiler_events(prof) == [
        gpu_check.StepEvent("aten::softmax", 10, 20), gpu_check.StepEvent("cudaLaunchKernel", 12, 14),
        gpu_check.StepEvent("softmax_warp_forward", 30, 40, True, 10), gpu_check.StepEvent("graph_kernel", 50, 60, True),
        gpu_check.StepEvent(label, 30, 40, True)]


def test_covered_time_counts_overlaps_once(gpu_check):
    assert gpu_check.covered_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20


# ---------------------------------------------------------------------------------------------- the compile report

def fake_report(tmp_path: Path, body: str) -> Path:
    "A stand-in for tools/gpu_compile_report.py: `body` runs with `args` (its command line parsed) and `os`."
    script = tmp_path / "fake_report.py"
    script.write_text("import argparse, json, os, sys, time\n"
                      "ap = argparse.ArgumentParser(); ap.add_argument('--quick', action='store_true')\n"
                      "ap.add_argument('--arch', nargs='+'); ap.add_argument('--json')\n"
                      "args = ap.parse_args()\n" + body)
    return script


def test_the_compile_report_missing_is_one_line_not_a_crash(tmp_path, gpu_check, monkeypatch):
    monkeypatch.setattr(gpu_check, "COMPILE_REPORT", tmp_path / "gpu_compile_report.py")
    result = gpu_check.CompileReport(tmp_path, quick=True, arch="90", timeout_s=10).result()
    assert (result["status"], result["line"], result["rows"]) == (
        "missing", "compile report: tools/gpu_compile_report.py missing", [])
    assert rows_of(gpu_check.table(dict(compile_report=result))) == ["compile report"]


def test_the_compile_report_runs_without_the_interpreter_and_its_rows_come_back(tmp_path, gpu_check, monkeypatch):
    body = ("rows = [dict(kernel='decode', arch=int(args.arch[0]), quick=args.quick,\n"
            "             interpreter=os.environ.get('TRITON_INTERPRET'))]\n"
            "open(args.json, 'w').write(json.dumps(rows)); print('| kernel |')\n")
    monkeypatch.setattr(gpu_check, "COMPILE_REPORT", fake_report(tmp_path, body))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    result = gpu_check.CompileReport(tmp_path, quick=True, arch="90", timeout_s=60).result()
    assert (result["status"], result["table"]) == ("ran", "| kernel |"), result
    assert result["rows"] == [dict(kernel="decode", arch=90, quick=True, interpreter=None)]


@pytest.mark.parametrize("body, status, line", [
    ("sys.exit('no ptxas here')", "failed", "compile report: failed (exit 1): no ptxas here"),
    ("time.sleep(60)", "timed out", "compile report: timed out after 2 s")])
def test_the_compile_report_failing_or_overrunning_is_reported(tmp_path, gpu_check, monkeypatch, body, status, line):
    monkeypatch.setattr(gpu_check, "COMPILE_REPORT", fake_report(tmp_path, body))
    result = gpu_check.CompileReport(tmp_path, quick=True, arch=None, timeout_s=2).result()
    assert (result["status"], result["line"], result["rows"]) == (status, line, [])


# ---------------------------------------------------------------------------------------------- greedy

def test_logit_gap_measures_how_near_a_tie_the_parting_was(tmp_path, gpu_check):
    "At the first step where two continuations part: transformers' logit of its own token minus that of the other."
    from minivllm.checkpoints import make_tiny_checkpoint
    from minivllm.testing import hf_greedy
    path = make_tiny_checkpoint(tmp_path / "m")
    prompt = [3, 1, 4, 1, 5]
    theirs = hf_greedy(path, [prompt], 5)[0]
    ours = theirs[:2] + [(theirs[2] + 1) % 256] + theirs[3:]
    part = gpu_check.logit_gap(path, prompt, ours, theirs, torch.float32, torch.device("cpu"))
    assert part["step"] == 2 and 0 < part["gap"] <= 2 * part["max_logit"]


def test_the_tile_sweep_writes_the_fastest_tiles_that_the_kernel_reads(tmp_path):
    "`--sweep PATH --dry-run` times the Triton attention's candidates (in the interpreter) and writes a choice a phase."
    table = tmp_path / "tiles.json"
    table.write_text(json.dumps({"sm90/head128/group2/bfloat16/decode": {"tile": 64, "warps": 8}}))  # another card's
    env = os.environ | {"TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--sweep", str(table), "--dry-run"], capture_output=True,
                         text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    written = json.loads(table.read_text())
    assert written["sm90/head128/group2/bfloat16/decode"] == {"tile": 64, "warps": 8}  # kept
    for phase in ("decode", "prefill"):
        assert written[f"sm0/head16/group2/float32/{phase}"]["tile"] in (16, 32)
        assert written[f"sm0/head16/group2/float32/{phase}"]["warps"] == 4
