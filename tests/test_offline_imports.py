"""The offline engine needs only torch, transformers, safetensors and the small helpers: `LLM` at TP=1 and TP=2 runs
in processes where serving's and the cluster's packages cannot be imported at all (a GPU machine without them)."""
import os
import subprocess
import sys
import textwrap

SERVING_AND_CLUSTER = ("fastapi", "starlette", "uvicorn", "zmq", "msgspec", "cryptography", "prometheus_client",
                       "pydantic", "uvloop", "httptools")

BLOCKER = textwrap.dedent(f'''
    import importlib.abc, sys
    class Absent(importlib.abc.MetaPathFinder):
        "As if these packages were not installed: importing one fails."
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {SERVING_AND_CLUSTER!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
    sys.meta_path.insert(0, Absent())
''')


def test_llm_runs_at_tp_2_without_serving_or_cluster_packages(tmp_path):
    "TP=2: rank 0 (what TP=1 runs) and a spawned rank, each with the packages blocked."
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)  # every process of the engine, spawned ranks too, loads it
    script = textwrap.dedent('''
        from minivllm import LLM, SamplingParams
        with LLM(tensor_parallel_size=2) as llm:
            out = llm.generate("ROMEO.", SamplingParams(temperature=0, max_tokens=8))
        assert len(out[0].token_ids) == 8
        try:
            import msgspec  # noqa: F401
        except ModuleNotFoundError:
            print("OK")
    ''')
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stderr[-3000:]


def test_the_cpu_path_never_imports_triton():
    "Generating on the CPU loads no cluster module and no triton (whose runtime prints pages of `nanobind: leaked` lines at exit)."
    script = textwrap.dedent('''
        import sys
        from minivllm import LLM, SamplingParams
        with LLM(device="cpu") as llm:  # (on a GPU machine too: the CPU's path)
            llm.generate("ROMEO.", SamplingParams(temperature=0, max_tokens=4))
        # one machine's engine imports neither the cluster's modules (notebooks 09a, 10a) nor triton
        assert not {"minivllm.cluster.multinode", "minivllm.cluster.wire"} & set(sys.modules), sorted(sys.modules)
        print("triton" in sys.modules)
    ''')
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("False"), run.stdout + run.stderr[-3000:]
    assert "nanobind" not in run.stderr


def test_a_folder_named_minivllm_beside_a_script_does_not_hide_the_package(tmp_path):
    "A script in the folder that holds the clone (a folder named minivllm without `__init__.py`) imports the package."
    (tmp_path / "minivllm").mkdir()  # the clone's folder as its parent folder sees it: a namespace package
    script = "from minivllm import LLM, SamplingParams; import minivllm; print(minivllm.__file__)"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("__init__.py")


def test_no_module_answers_to_an_old_name():
    "The serving and cluster modules are imported from minivllm.serve and minivllm.cluster; no finder keeps other names."
    script = textwrap.dedent('''
        import importlib, sys
        import minivllm
        from minivllm.serve.server import CompletionRequest  # noqa: F401
        for old in ("minivllm.server", "minivllm.async_llm", "minivllm.cpu_kernels", "minivllm.engine.core",
                    "minivllm.engine.multinode", "minivllm.engine.wire"):
            try:
                importlib.import_module(old)
            except ModuleNotFoundError:
                continue
            raise AssertionError(f"{old} still imports")
        assert not [f for f in sys.meta_path if type(f).__module__.startswith("minivllm")], sys.meta_path
        print("OK")
    ''')
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "OK", run.stderr[-2000:]


def test_importing_the_package_configures_no_logging():
    "No module configures logging as it is imported; `configure_logging()` runs where a program starts (notebook 00a)."
    script = textwrap.dedent('''
        import importlib, logging
        for name in ("minivllm.llm", "minivllm.serve.server", "minivllm.serve.core", "minivllm.cli", "minivllm.testing",
                     "minivllm.cost_model", "minivllm.bench.throughput", "minivllm.cluster.multinode"):
            importlib.import_module(name)
        print(logging.getLogger("minivllm").handlers, logging.getLogger().handlers)
        from minivllm.logger import configure_logging
        print(configure_logging(), logging.getLogger("minivllm").handlers)
    ''')
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout == "[] []\nTrue [<_StderrHandler (NOTSET)>]\n", run.stderr[-2000:]
