"""The `minivllm` command line, in this process (`main([...])`) and as a real `python -m minivllm` process: help with
defaults and at once (no torch), vLLM's names (`serve MODEL -tp 2`), one-line errors with exit status 2, Ctrl-C,
--quiet, the text streamed on a terminal."""
import json
import logging
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from minivllm import __version__
from minivllm.cli import main, make_parser
from minivllm.model_source import DEFAULT_MODEL
from minivllm.bench.workload import ServerProcess, default_sigint
from minivllm.testing import gone, make_tiny_checkpoint, rank_processes, wait_until

OPTIONS = ("--model", "--tensor-parallel-size", "--max-tokens", "--temperature", "--top-k", "--top-p", "--seed",
           "--ignore-eos", "--dtype", "--max-model-len", "--num-threads", "--device", "--block-size", "--chat", "--quiet",
           "--nnodes", "--master-addr", "--master-port", "--async-scheduling", "--structured-outputs-backend",
           "--speculative-config")


@pytest.fixture(scope="module")
def hub_env(tmp_path_factory):
    "The environment of a child `minivllm`: an empty Hugging Face cache and the hub off, so nothing goes online."
    cache = tmp_path_factory.mktemp("hf-cache")
    return {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def spawn_cli(*args, env, **kwargs) -> subprocess.Popen:
    "Start `python -m minivllm ARGS`, its output captured as text."
    return subprocess.Popen([sys.executable, "-m", "minivllm", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **kwargs)


def assert_one_error_line(status: int, stderr: str):
    "Exit status 2, and stderr exactly one line `minivllm: error: ...` with no traceback."
    assert status == 2, stderr
    assert stderr.startswith("minivllm: error: ") and stderr.count("\n") == 1 and stderr.endswith("\n"), stderr
    assert "Traceback" not in stderr


# --- one-line errors ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    "Each mistake a user can make -> (argv, a phrase its error line must contain)."
    root = tmp_path_factory.mktemp("bad")
    not_an_object = root / "not-an-object"
    not_an_object.mkdir()
    (not_an_object / "config.json").write_text("[1, 2, 3]")
    corrupt = root / "corrupt"
    shutil.copytree(DEFAULT_MODEL, corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    tiny = make_tiny_checkpoint(root / "tiny")
    plain = root / "plain"  # the packaged model's config and tokenizer, without its chat template
    shutil.copytree(DEFAULT_MODEL, plain, ignore=shutil.ignore_patterns("*.safetensors"))
    settings = json.loads((plain / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(settings))
    taken = socket.create_server(("127.0.0.1", 0))  # a port in use, held until the module's tests are done
    yield {
        "serve: missing folder": (["serve", "--model", str(root / "nowhere")], "does not exist"),
        "serve: tp 3 for 4 heads": (["serve", "--tp", "3"], "tensor_parallel_size=3 does not divide"),
        "serve: port out of range": (["serve", "--port", "70000"], "--port must be from 0 to 65535"),
        "serve: port in use": (["serve", "--port", str(taken.getsockname()[1])], "Address already in use): choose "
                                                                                   "another --port"),
        "serve: two models": (["serve", "a/b", "--model", "c/d"], "the model is given twice, as MODEL (a/b) and as "
                                                                   "--model (c/d): give it once"),
        "serve: bad dtype": (["serve", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        "missing folder": (["generate", "hi", "--model", str(root / "nowhere")], "does not exist"),
        "hub id not cached": (["generate", "hi", "--model", "org/not-cached"], "is not in the local cache"),
        "config not an object": (["generate", "hi", "--model", str(not_an_object)], "must hold a JSON object"),
        "tp 3 for 4 heads": (["generate", "hi", "--tp", "3"], "tensor_parallel_size=3 does not divide"),
        "negative temperature": (["generate", "hi", "--temperature", "-1"], "temperature must be"),
        "corrupt safetensors": (["generate", "hi", "--model", str(corrupt), "--quiet"], "is corrupt or incomplete"),
        "chat without template": (["generate", "hi", "--chat", "--model", str(plain)], "has no chat template"),
        "no tokenizer": (["generate", "hi", "--model", str(tiny)], "has no tokenizer"),
        "usage error": (["generate", "hi", "--tp", "two"], "invalid int value"),
        "serve: unknown option": (["serve", "--chat-tmplate"], "unrecognized arguments: --chat-tmplate (did you mean "
                                  "--chat-template?) (see minivllm serve --help)"),
        "serve: no prefix caching": (["serve", "--no-enable-prefix-caching"], "drop --no-enable-prefix-caching"),
        "serve: missing template": (["serve", "--chat-template", str(root / "none.jinja")], "No such file"),
    }
    taken.close()


CASES = ["serve: missing folder", "serve: tp 3 for 4 heads", "serve: port out of range", "serve: port in use",
         "serve: two models", "serve: bad dtype", "missing folder", "hub id not cached", "config not an object", "tp 3 for 4 heads", "negative temperature",
         "corrupt safetensors", "chat without template", "no tokenizer", "usage error", "serve: unknown option",
         "serve: no prefix caching", "serve: missing template"]
CHILD_CASES = ["serve: missing folder", "serve: tp 3 for 4 heads", "serve: port out of range", "serve: port in use",
         "serve: two models", "serve: bad dtype", "missing folder", "config not an object", "tp 3 for 4 heads", "negative temperature", "corrupt safetensors",
               "chat without template"]


@pytest.fixture(scope="module")
def bad_input_children(bad_inputs, hub_env):
    "Started by the first test and checked by the last ones: real `python -m minivllm` runs (seconds of imports each)."
    children = {name: spawn_cli(*bad_inputs[name][0], env=hub_env) for name in CHILD_CASES}
    yield children
    for child in children.values():
        if child.poll() is None: child.kill()
        child.communicate()


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_error_line_in_process(case, bad_inputs, bad_input_children, capsys, monkeypatch, hub_env):
    monkeypatch.setenv("HF_HUB_CACHE", hub_env["HF_HUB_CACHE"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv, phrase = bad_inputs[case]
    status = main(argv)
    out, err = capsys.readouterr()
    assert_one_error_line(status, err)
    assert phrase in err and out == ""


# --- help --------------------------------------------------------------------------------------------------------------

def test_help_describes_every_option_with_its_default(capsys, hub_env):
    assert main(["generate", "--help"]) == 0
    in_process = capsys.readouterr().out
    child = subprocess.run([sys.executable, "-m", "minivllm", "generate", "--help"], capture_output=True, text=True,
                           env=hub_env, timeout=60)
    assert child.returncode == 0 and child.stdout == in_process
    flat = " ".join(in_process.split())
    for option in OPTIONS:
        assert option in flat, option
    assert flat.count("(default:") == len(OPTIONS)
    for default in ("(default: 0.8; SamplingParams: 1.0)", "(default: 0.95; SamplingParams: 1.0)", "(default: 64)",
                    "(default: -1)", "(default: 1)"):
        assert default in flat, default
    assert "SamplingParams' (temperature 1.0, top_p 1.0)" in flat


def test_top_level_help_and_version(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "generate" in out and "bench" in out and "--version" in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"minivllm {__version__}\n"


def test_help_names_each_default_once(capsys):
    for argv in (["bench", "--help"], ["bench", "serve", "--help"], ["bench", "allreduce", "--help"], ["serve", "--help"]):
        assert main(argv) == 0
        flat = " ".join(capsys.readouterr().out.split())
        assert "(default: None)" not in flat and not re.search(r"\(default: [^()]*\) \(default:", flat), (argv, flat)
    assert main(["bench", "--help"]) == 0
    assert " ".join(capsys.readouterr().out.split()).count("(default: the packaged model)") == 1


# --- help and usage errors at once: no torch before a command runs -----------------------------------------------------

NO_TORCH = """
import sys, contextlib, io
from minivllm.cli import main
assert not {"torch", "transformers"} & set(sys.modules), "import minivllm.cli"
for argv in (["--help"], ["--version"], ["generate", "--help"], ["serve", "--help"], ["worker", "--help"],
             ["serve", "a", "--model", "b"], ["generate", "hi", "--tp", "two"], ["serve", "--port", "70000"], []):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(argv)
    assert not {"torch", "transformers"} & set(sys.modules), argv
print("no torch")
"""


def test_the_cli_imports_no_torch_until_a_command_runs(hub_env):
    child = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, env=hub_env, timeout=60)
    assert child.returncode == 0 and child.stdout == "no torch\n", child.stderr
    # the package's public names still load on first use, and are the modules' own
    child = subprocess.run([sys.executable, "-c", "import sys, minivllm; assert 'torch' not in sys.modules; "
                            "from minivllm import LLM, SamplingParams; import minivllm.llm as m; "
                            "assert LLM is m.LLM and 'LLM' in dir(minivllm); print('ok')"],
                           capture_output=True, text=True, env=hub_env, timeout=120)
    assert child.returncode == 0 and child.stdout == "ok\n", child.stderr


def test_help_answers_at_once(hub_env):
    "A loose guard against importing torch before parsing: under 2 s, the best of three runs, on a busy machine too."
    def seconds() -> float:
        start = time.perf_counter()
        child = subprocess.run([sys.executable, "-m", "minivllm", "--help"], capture_output=True, text=True,
                               env=hub_env, timeout=60)
        assert child.returncode == 0 and "serve" in child.stdout, child.stderr
        return time.perf_counter() - start
    best = min(seconds() for _ in range(3))
    assert best < 2.0, f"minivllm --help took {best:.2f} s"


# --- vLLM's names ------------------------------------------------------------------------------------------------------

def test_serve_passes_every_option_to_the_server(monkeypatch):
    import minivllm.serve.server
    seen = {}
    monkeypatch.setattr(minivllm.serve.server, "serve", lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs))
    model = str(DEFAULT_MODEL)
    assert main(["serve", model, "-tp", "2", "--host", "0.0.0.0", "--port", "0", "--api-key", "k",
                 "--served-model-name", "m", "--max-model-len", "128", "--dtype", "bfloat16", "--max-num-seqs", "8",
                 "--gpu-memory-utilization", "0.5", "--enforce-eager", "--seed", "7", "--num-threads", "1",
                 "--max-num-batched-tokens", "512", "--stream-interval", "3",
                 "--structured-outputs-config.backend", "xgrammar"]) == 0
    folder, tp, host, port, key, name, log_level = seen["args"]
    assert (str(folder), tp, host, port, key, name, log_level) == (model, 2, "0.0.0.0", 0, "k", ["m"], "warning")
    assert seen["kwargs"] == dict(dtype="bfloat16", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=512,
                                  gpu_memory_utilization=0.5,
                                  enforce_eager=True, seed=7, num_threads=1, stream_interval=3, nnodes=1,
                                  master_addr="127.0.0.1",
                                  master_port=0, chat_template=None, structured_outputs_backend="xgrammar")
    # vLLM's defaults; the model as --model, or given twice alike; --dtype auto is the checkpoint's
    assert main(["serve", "--model", model, "--tensor-parallel-size", "1"]) == 0
    assert seen["args"][:2] == (DEFAULT_MODEL, 1) and seen["args"][5] == model
    assert seen["kwargs"] == dict(dtype=None, max_model_len=None, max_num_seqs=256, max_num_batched_tokens=None,
                                  gpu_memory_utilization=0.9,
                                  enforce_eager=False, seed=0, num_threads=None, stream_interval=1, nnodes=1,
                                  master_addr="127.0.0.1",
                                  master_port=0, chat_template=None)
    assert main(["serve", model, "--model", model, "--tp", "2"]) == 0
    assert seen["args"][:2] == (DEFAULT_MODEL, 2)
    # vLLM's options that scripts pass: a chat template (a file or the template itself), prefix caching, remote code
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert main(["serve", model, "--chat-template", template, "--enable-prefix-caching", "--trust-remote-code"]) == 0
    assert seen["kwargs"]["chat_template"] == template


def test_serve_model_tp_2_serves(chat_ckpt):
    "`minivllm serve MODEL -tp 2`, as a vLLM user types it: the model named as given, two ranks, a completion."
    with ServerProcess(str(chat_ckpt), "-tp", "2", "--max-model-len", "256", "--seed", "1") as server:
        assert len(rank_processes(server.proc.pid)) == 1  # rank 1; rank 0 is the server itself
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [str(chat_ckpt)]
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": str(chat_ckpt), "prompt": "ROMEO.", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


# --- the text as it comes, on a terminal -------------------------------------------------------------------------------

def test_generate_streams_on_a_terminal_what_it_prints_into_a_pipe(capsys, hub_env):
    argv = ["generate", "ROMEO.", "JULIET.", "--max-tokens", "8", "--temperature", "0", "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    main_fd, terminal = pty.openpty()
    child = subprocess.Popen([sys.executable, "-m", "minivllm", *argv], stdout=terminal, stderr=subprocess.PIPE,
                             env=hub_env)
    os.close(terminal)
    screen = b""
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    os.close(main_fd)
    assert child.wait(timeout=120) == 0, child.stderr.read()
    assert child.stderr.read() == b""
    assert screen.decode().replace("\r\n", "\n") == printed


# --- Ctrl-C and --quiet ------------------------------------------------------------------------------------------------

def test_sigint_during_generation_exits_130_and_stops_the_ranks(hub_env):
    child = spawn_cli("generate", "ROMEO.", "--tp", "2", "--max-tokens", "1000", "--ignore-eos", "--seed", "0",
                      env=hub_env, preexec_fn=default_sigint)
    try:
        stderr, deadline = "", time.monotonic() + 120  # generous: a loaded machine starts ranks slowly
        while "generate:" not in stderr and time.monotonic() < deadline:  # the progress bar: generation has begun
            if select.select([child.stderr], [], [], 1.0)[0]:
                stderr += os.read(child.stderr.fileno(), 65536).decode()
        assert "generate:" in stderr, stderr
        ranks = rank_processes(child.pid)
        assert ranks, "expected a worker rank at --tp 2"
        time.sleep(0.5)  # a few decode steps in
        child.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        out, rest = child.communicate(timeout=60)
        took = time.monotonic() - interrupted
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    stderr += rest
    assert child.returncode == 130, stderr[-2000:]
    # promptly (the worker, left in the step's collectives, is stopped at once), and what was generated is printed
    assert took < 4, f"Ctrl-C took {took:.1f} s"
    assert out.startswith("ROMEO.") and len(out) > len("ROMEO.\n"), out
    assert "Traceback" not in stderr and stderr.count("interrupted") == 1, stderr[-2000:]
    assert stderr.splitlines()[-1].split("\r")[-1].endswith("minivllm: interrupted"), stderr[-2000:]
    assert wait_until(lambda: all(gone(pid) for pid in ranks), 10), f"rank processes left: {ranks}"


def test_quiet_prints_nothing_on_stderr(capsys, hub_env):
    child = spawn_cli("generate", "ROMEO.", "--tp", "2", "--max-tokens", "4", "--seed", "0", "--quiet", env=hub_env)
    engine_logger = logging.getLogger("minivllm")
    level = engine_logger.level
    assert main(["generate", "ROMEO.", "--max-tokens", "4", "--seed", "0", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("ROMEO.")
    assert engine_logger.level == level  # restored after the run
    (child_out, child_err), status = child.communicate(timeout=120), child.returncode
    assert status == 0 and child_err == "" and child_out.startswith("ROMEO."), child_err


# --- the same bad inputs, in real processes -------------------------------------------------------------------------

@pytest.mark.parametrize("case", CHILD_CASES)
def test_bad_input_is_one_error_line_in_a_child(case, bad_inputs, bad_input_children):
    child = bad_input_children[case]
    out, err = child.communicate(timeout=120)
    assert_one_error_line(child.returncode, err)
    assert bad_inputs[case][1] in err and out == ""


# --- bench's help and usage errors at once too: its benchmark modules import torch only when a benchmark runs ----------

BENCH_NO_TORCH = """
import sys, contextlib, io
from minivllm.cli import main
for argv, status, stream, text in (
        (["bench", "--help"], 0, "out", "--random-shape"), (["bench", "serve", "--help"], 0, "out", "--request-rate"),
        (["bench", "allreduce", "--help"], 0, "out", "--shape"), (["bench", "--tp"], 2, "err", "minivllm: error: "),
        (["bench", "--random-shape", "gpt"], 2, "err", "minivllm: error: "),
        (["bench", "serve", "--request-rate", "0"], 2, "err", "minivllm: error: "),
        (["bench", "allreduce", "--tp", "two"], 2, "err", "minivllm: error: ")):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        got = main(argv)
    assert got == status and text in {"out": out, "err": err}[stream].getvalue(), (argv, got, err.getvalue())
    assert not {"torch", "transformers"} & set(sys.modules), argv
print("no torch")
"""


def test_bench_help_and_usage_errors_import_no_torch(hub_env):
    child = subprocess.run([sys.executable, "-c", BENCH_NO_TORCH], capture_output=True, text=True, env=hub_env, timeout=60)
    assert child.returncode == 0 and child.stdout == "no torch\n", child.stderr
    # the real command too: `python -m minivllm bench --help` imports every benchmark module, and neither torch nor transformers
    child = subprocess.run([sys.executable, "-X", "importtime", "-m", "minivllm", "bench", "--help"], capture_output=True,
                           text=True, env=hub_env, timeout=60)
    modules = {line.rsplit("|", 1)[-1].strip() for line in child.stderr.splitlines() if line.startswith("import time:")}
    assert child.returncode == 0 and "--random-shape" in child.stdout, child.stderr[-2000:]
    assert {"minivllm.bench.throughput", "minivllm.bench.serve", "minivllm.bench.comm"} <= modules, sorted(modules)
    assert not {"torch", "transformers"} & modules, sorted(m for m in modules if m.split(".")[0] in ("torch", "transformers"))


def test_generate_takes_a_local_model_as_its_first_argument(capsys, tmp_path, hub_env):
    "`minivllm generate MODEL PROMPT`: a checkpoint folder first is the model; a word that names none stays a prompt."
    from minivllm.cli import split_model_and_prompts
    model = str(DEFAULT_MODEL)
    assert split_model_and_prompts(None, [model, "ROMEO."]) == (model, ["ROMEO."])
    assert split_model_and_prompts(None, ["ROMEO and JULIET", "hi"]) == (None, ["ROMEO and JULIET", "hi"])
    assert split_model_and_prompts(model, [model, "hi"]) == (model, [model, "hi"])  # --model given: all prompts
    assert split_model_and_prompts(None, [model]) == (None, [model])  # one argument is the prompt
    assert main(["generate", model, "ROMEO.", "--max-tokens", "4", "--temperature", "0", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ROMEO.") and model not in out


def test_the_api_key_help_says_that_the_variable_keeps_the_key_out_of_ps():
    serve = next(a for a in make_parser()._subparsers._group_actions[0].choices["serve"]._actions
                 if "--api-key" in a.option_strings)
    assert "MINIVLLM_API_KEY" in serve.help and "`ps`" in serve.help


# --- a config.json whose sizes cannot fit in memory: one line at config load, before any rank starts --------------

@pytest.fixture(scope="module")
def oversized_checkpoints(tmp_path_factory):
    "The packaged model with one size damaged -> (its folder, the phrase its error line must hold)."
    import json
    root = tmp_path_factory.mktemp("oversized")
    cases = {"vocab_size": (2**40, "GiB of it for the embedding (vocab_size=1099511627776 x hidden_size=256 in "
                                   "bfloat16), more than this machine has"),
             "max_position_embeddings": (2**62, "GiB of it for the rotary table (max_position_embeddings="
                                                "4611686018427387904 x head_dim=64, float32), more than this machine has")}
    folders = {}
    for field, (value, phrase) in cases.items():
        folder = shutil.copytree(DEFAULT_MODEL, root / field)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, field: value}))
        folders[field] = (folder, phrase)
    return folders


@pytest.mark.parametrize("field", ["vocab_size", "max_position_embeddings"])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_sizes_that_cannot_fit_are_one_error_line(command, field, oversized_checkpoints, capsys, hub_env):
    folder, phrase = oversized_checkpoints[field]
    argv = ["generate", "hi", "--model", str(folder), "--quiet"] if command == "generate" else \
           ["serve", "--model", str(folder), "--port", "0"]
    start = time.monotonic()
    status = main(argv)
    out, err = capsys.readouterr()
    assert_one_error_line(status, err)
    assert phrase in err and f"{folder / 'config.json'}: the model needs" in err and out == "", err
    assert time.monotonic() - start < 10  # refused at config load, before any rank starts (seconds of start-up)


def test_sizes_that_cannot_fit_are_one_error_line_in_a_child(oversized_checkpoints, hub_env):
    folder, phrase = oversized_checkpoints["vocab_size"]
    child = spawn_cli("serve", str(folder), "--port", "0", env=hub_env)
    out, err = child.communicate(timeout=120)
    assert_one_error_line(child.returncode, err)
    assert phrase in err and out == ""


# --- the API key kept out of `ps`; the server's limits passed when given ----------------------------------------------

def test_serve_takes_the_api_key_from_a_file_or_the_variable_and_warns_when_it_is_an_argument(monkeypatch, tmp_path,
                                                                                              capsys):
    import minivllm.serve.server
    seen = {}
    monkeypatch.setattr(minivllm.serve.server, "serve", lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs))
    monkeypatch.delenv("MINIVLLM_API_KEY", raising=False)
    model, key_file, empty = str(DEFAULT_MODEL), tmp_path / "key", tmp_path / "empty"
    key_file.write_text("from-file\n")
    empty.write_text("\n")
    assert main(["serve", model]) == 0 and seen["args"][4] is None  # no key: the routes are open
    assert main(["serve", model, "--api-key-file", str(key_file)]) == 0 and seen["args"][4] == "from-file"
    monkeypatch.setenv("MINIVLLM_API_KEY", "from-env")
    assert main(["serve", model]) == 0 and seen["args"][4] == "from-env"
    assert capsys.readouterr().err == ""
    assert main(["serve", model, "--api-key", "from-argv"]) == 0 and seen["args"][4] == "from-argv"  # the option wins
    assert "minivllm: warning: --api-key puts the key on the command line" in capsys.readouterr().err
    for argv, phrase in ((["--api-key", "a", "--api-key-file", str(key_file)], "given twice"),
                         (["--api-key-file", str(empty)], f"the API key of --api-key-file {empty} is empty"),
                         (["--api-key-file", str(tmp_path / "none")], "No such file")):
        assert_one_error_line(main(["serve", model, *argv]), err := capsys.readouterr().err)
        assert phrase in err, err
    monkeypatch.setenv("MINIVLLM_API_KEY", "")
    assert_one_error_line(main(["serve", model]), err := capsys.readouterr().err)
    assert "the API key of MINIVLLM_API_KEY is empty" in err


HIDE = """
import os, subprocess, sys
from minivllm.cli import hide_from_ps
print(hide_from_ps(sys.argv[2]), hide_from_ps("absent"))  # the key as it came
print(subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(os.getpid())], capture_output=True, text=True).stdout)
"""


def test_hide_from_ps_overwrites_the_key_on_the_process_command_line(hub_env):
    child = subprocess.run([sys.executable, "-c", HIDE, "--api-key", "s3cret-key", "--api-key=s3cret-key"],
                           capture_output=True, text=True, env=hub_env, timeout=60)
    assert child.returncode == 0, child.stderr
    found, shown = child.stdout.split("\n", 1)
    assert found == "True False" and "s3cret-key" not in shown, child.stdout
    assert "--api-key ********** --api-key=**********" in shown, shown


def test_serve_passes_the_slow_client_limits_and_the_stop_string_caps_only_when_given(monkeypatch, capsys):
    import minivllm.serve.server
    seen = {}
    monkeypatch.setattr(minivllm.serve.server, "serve", lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs))
    model = str(DEFAULT_MODEL)
    assert main(["serve", model, "--header-timeout", "3", "--body-timeout", "4.5", "--max-connections", "9",
                 "--max-stop-strings", "7", "--max-stop-string-chars", "100"]) == 0
    given = dict(header_timeout_s=3.0, body_timeout_s=4.5, max_connections=9, max_stop_strings=7,
                 max_stop_string_chars=100)
    assert {k: seen["kwargs"].get(k) for k in given} == given
    assert main(["serve", model]) == 0
    assert not set(given) & set(seen["kwargs"])  # the server's defaults, and AsyncLLM's
    monkeypatch.undo()  # the real serve: its checks come before it binds a port or starts an engine
    for argv, phrase in ((["--header-timeout", "0"], "header_timeout_s must be a positive number of seconds, got 0.0"),
                         (["--body-timeout", "nan"], "body_timeout_s must be a positive number of seconds, got nan"),
                         (["--max-connections", "0"], "max_connections must be a positive whole number")):
        assert_one_error_line(main(["serve", model, "--port", "0", *argv]), err := capsys.readouterr().err)
        assert phrase in err, err
