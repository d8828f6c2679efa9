"""A vLLM user's launch lines work unchanged: `vllm serve`'s options as its documentation writes them, the model as
`serve MODEL` and `generate MODEL PROMPT` take it, and the packaged model's name, `minivllm-default`, wherever a model
is named. The packaged model (or its name) stands in for a hub id, so that everything runs offline."""
import logging
import shutil

import httpx
import pytest
import torch

from minivllm.bench.workload import ServerProcess
from minivllm.cli import main
from minivllm.llm import LLM
from minivllm.model_source import DEFAULT_MODEL, DEFAULT_MODEL_NAME, model_folder
from minivllm.sampling_params import SamplingParams
from minivllm.testing import make_tiny_checkpoint

# vLLM's documentation style: the model first, then the options a launch script carries
LAUNCH_LINE = ("--dtype auto --max-model-len 4096 --gpu-memory-utilization 0.9 --enable-chunked-prefill "
               "--disable-log-requests --block-size 16 --max-logprobs 20 --seed 0 --port 8000").split()
MORE_OPTIONS = ("-tp 1 --max-num-seqs 64 --max-num-batched-tokens 512 --served-model-name qwen --host 127.0.0.1 "
                "--enforce-eager --uvicorn-log-level warning --trust-remote-code --enable-prefix-caching "
                "--disable-log-stats --swap-space 4 --disable-frontend-multiprocessing --device cpu "
                "-pp 1 --kv-cache-dtype auto --load-format auto --async-scheduling").split()


@pytest.fixture
def offline(monkeypatch, tmp_path):
    "An empty Hugging Face cache and the hub off, so that nothing goes online."
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def served(monkeypatch):
    "`minivllm.serve.server.serve` replaced by a recorder: what `minivllm serve` would start the server with."
    import minivllm.serve.server
    seen = {}
    monkeypatch.setattr(minivllm.serve.server, "serve", lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs))
    return seen


def test_the_packaged_model_answers_to_its_name_everywhere():
    assert DEFAULT_MODEL_NAME == "minivllm-default"
    assert model_folder(DEFAULT_MODEL_NAME) == model_folder(None) == DEFAULT_MODEL
    with LLM(DEFAULT_MODEL_NAME, max_model_len=64) as by_name:
        assert by_name.llm_engine.args.model == str(DEFAULT_MODEL)
        greedy = SamplingParams(temperature=0, max_tokens=4)
        assert by_name.generate(["ROMEO."], greedy)[0].outputs[0].token_ids


def test_a_vllm_launch_line_is_accepted_with_the_right_engine_settings(served, caplog):
    caplog.set_level(logging.INFO, logger="minivllm")
    assert main(["serve", DEFAULT_MODEL_NAME, *LAUNCH_LINE]) == 0
    folder, tp, host, port, key, name, log_level = served["args"]
    assert (folder, tp, host, port, key, name, log_level) == (DEFAULT_MODEL, 1, "127.0.0.1", 8000, None,
                                                              DEFAULT_MODEL_NAME, "warning")
    kwargs = served["kwargs"]
    assert {k: kwargs[k] for k in ("dtype", "max_model_len", "gpu_memory_utilization", "seed", "kvcache_block_size")} == \
        dict(dtype=None, max_model_len=4096, gpu_memory_utilization=0.9, seed=0, kvcache_block_size=16)
    assert "device" not in kwargs and "async_scheduling" not in kwargs  # not given: the engine chooses
    # the options that change nothing here, named in one log line
    lines = [r.getMessage() for r in caplog.records if "change nothing here" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    for option in ("--enable-chunked-prefill (", "--disable-log-requests (", "--max-logprobs 20 ("):
        assert option in lines[0], (option, lines[0])


def test_every_common_vllm_serve_option_is_accepted(served, caplog):
    caplog.set_level(logging.INFO, logger="minivllm")
    assert main(["serve", str(DEFAULT_MODEL), *LAUNCH_LINE, *MORE_OPTIONS, "--tokenizer", DEFAULT_MODEL_NAME]) == 0
    folder, tp, host, port, key, name, log_level = served["args"]
    assert (str(folder), tp, name, host) == (str(DEFAULT_MODEL), 1, ["qwen"], "127.0.0.1")
    kwargs = served["kwargs"]
    assert {k: kwargs[k] for k in ("max_num_seqs", "max_num_batched_tokens", "enforce_eager", "device",
                                   "kvcache_block_size")} == \
        dict(max_num_seqs=64, max_num_batched_tokens=512, enforce_eager=True, device="cpu", kvcache_block_size=16)
    assert kwargs["async_scheduling"] is True  # vLLM's --async-scheduling, with its meaning (notebook 11b)
    (line,) = [r.getMessage() for r in caplog.records if "change nothing here" in r.getMessage()]
    for option in ("--trust-remote-code", "--enable-prefix-caching", "--disable-log-stats", "--swap-space 4.0",
                   "--disable-frontend-multiprocessing", "--pipeline-parallel-size 1", "--kv-cache-dtype auto",
                   "--load-format auto"):
        assert option + " (" in line, (option, line)
    # vLLM's --log-level name for uvicorn's, and minivllm's own
    for flag in ("--uvicorn-log-level", "--log-level"):
        assert main(["serve", str(DEFAULT_MODEL), flag, "info"]) == 0 and served["args"][6] == "info"


def test_served_model_name_takes_several_names_as_vllms_does(served):
    "`--served-model-name A B`: every name reaches the server, the first first; a model written after the names is the model."
    assert main(["serve", DEFAULT_MODEL_NAME, "--served-model-name", "qwen", "qwen-alias", "--port", "0"]) == 0
    assert served["args"][0] == DEFAULT_MODEL and served["args"][5] == ["qwen", "qwen-alias"]
    assert main(["serve", "--served-model-name", "qwen", "qwen-alias", str(DEFAULT_MODEL)]) == 0  # as with one name
    assert served["args"][0] == DEFAULT_MODEL and served["args"][5] == ["qwen", "qwen-alias"]
    assert main(["serve", "--served-model-name", "qwen", "qwen-alias"]) == 0  # no model: the packaged one, two names
    assert served["args"][0] is None and served["args"][5] == ["qwen", "qwen-alias"]


@pytest.mark.parametrize("option, phrase", [
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill is not available: minivllm always prefills"),
    (["--no-enable-prefix-caching"], "drop --no-enable-prefix-caching"),
    (["--max-logprobs", "50"], "--max-logprobs 50 is not available: minivllm's server shows at most 20"),
    (["-pp", "2"], "tensor parallelism only (-tp); drop --pipeline-parallel-size"),
    (["--kv-cache-dtype", "fp8"], "drop --kv-cache-dtype"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--block-size", "0"], "kvcache_block_size must be"),
    (["--tokenizer", "other"], "--tokenizer other is neither a folder nor the packaged model"),
])
def test_an_option_minivllm_cannot_honour_is_one_error_line(option, phrase, capsys, offline):
    assert main(["serve", DEFAULT_MODEL_NAME, "--port", "0", *option]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minivllm: error: ") and err.count("\n") == 1 and phrase in err, err


def test_tokenizer_is_accepted_only_when_it_is_the_models_own(served, tmp_path, capsys, offline):
    copy = tmp_path / "copy"  # the same tokenizer files in another folder
    shutil.copytree(DEFAULT_MODEL, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    for same in (DEFAULT_MODEL_NAME, str(DEFAULT_MODEL), str(copy)):
        assert main(["serve", DEFAULT_MODEL_NAME, "--tokenizer", same]) == 0, same
    assert main(["serve", "org/name", "--tokenizer", "org/name"]) == 2  # the same name is fine; the model is not here
    assert "is not in the local cache" in capsys.readouterr().err
    other = make_tiny_checkpoint(tmp_path / "other")
    shutil.copy(DEFAULT_MODEL / "tokenizer.json", other)  # a tokenizer, but not the packaged model's whole one
    assert main(["serve", DEFAULT_MODEL_NAME, "--tokenizer", str(other)]) == 2
    assert "is not the model's own tokenizer" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine --device cuda is honoured")
def test_device_cuda_without_a_gpu_is_one_error_line(capsys):
    assert main(["generate", DEFAULT_MODEL_NAME, "ROMEO.", "--device", "cuda", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "device='cuda' but torch sees no CUDA GPU" in err, err


def test_generate_takes_the_model_first_as_vllm_users_name_it(capsys, offline):
    # the packaged model by name, then the prompt: greedy, as the same model named by its folder
    argv = ["ROMEO.", "--max-tokens", "4", "--temperature", "0", "--quiet", "--block-size", "32", "--device", "cpu"]
    assert main(["generate", DEFAULT_MODEL_NAME, *argv]) == 0
    by_name = capsys.readouterr().out
    assert main(["generate", "--model", str(DEFAULT_MODEL), *argv]) == 0
    assert capsys.readouterr().out == by_name and by_name.startswith("ROMEO.") and DEFAULT_MODEL_NAME not in by_name
    # a hub id that is not on this machine: the error LLM gives, in one line
    with pytest.raises(FileNotFoundError) as llm_error:
        LLM("Qwen/Qwen3-0.6B")
    assert main(["generate", "Qwen/Qwen3-0.6B", "Hello"]) == 2
    err = capsys.readouterr().err
    assert err == f"minivllm: error: {llm_error.value}\n" and "is not in the local cache" in err, err
    # one argument is always a prompt, even one that looks like a model
    assert main(["generate", "Qwen/Qwen3-0.6B", "--max-tokens", "2", "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("Qwen/Qwen3-0.6B")


def test_serve_starts_from_a_vllm_launch_line_and_answers():
    "One real server from a vLLM launch line (the packaged model by name; --port 0 from ServerProcess, last wins)."
    line = [option for option in LAUNCH_LINE if option not in ("--port", "8000")]
    line[line.index("4096")] = "512"  # the packaged model's max_position_embeddings is 1024
    with ServerProcess(DEFAULT_MODEL_NAME, *line, "--max-num-seqs", "8") as server:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [DEFAULT_MODEL_NAME]
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": DEFAULT_MODEL_NAME, "prompt": "ROMEO.", "max_tokens": 4, "temperature": 0,
                             "logprobs": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"]) == 4
    said = [line for line in server.log if "change nothing here" in line]
    assert len(said) == 1 and "--enable-chunked-prefill" in said[0] and "--max-logprobs 20" in said[0], server.log


def test_bench_takes_the_name_too():
    "`bench` (and `bench serve`) resolve --model through model_folder, as every command does."
    from minivllm.cli import make_parser
    for argv in (["bench", "--model", DEFAULT_MODEL_NAME], ["bench", "serve", "--model", DEFAULT_MODEL_NAME]):
        assert model_folder(make_parser().parse_args(argv).model) == DEFAULT_MODEL
