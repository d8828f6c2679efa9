"""The engine end to end: greedy tokens identical at TP=1, 2, 4 and to transformers (roomy cache; a small cache that
preempts, shared prefixes that hit the prefix cache and a token budget that chunks prefills), seeded sampling across
runs and TP sizes, shutdown after close / a worker's exception / SIGKILL / rank 0 interrupted, two engines side by
side, and bad requests refused while the engine keeps serving."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import transformers

from minivllm import LLM, SamplingParams
from minivllm.distributed import RankFailure
from minivllm.bench.workload import default_sigint
from minivllm.testing import (InterruptedAfterOneStep, gone, make_tiny_checkpoint, shm_segments, tcp_listeners,
                              wait_until)

SHM = Path("/dev/shm")
MAX_TOKENS = 16


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    "18 prompts of 1..70 tokens; 8 of them share a 40-token prefix (so the prefix cache has something to hit)."
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(1, vocab, (n,), generator=g).tolist()
    shared = rand(40)
    lengths = [1, 3, 7, 12, 17, 25, 33, 50, 64, 70]
    return [rand(n) for n in lengths] + [shared + rand(k) for k in (1, 2, 5, 8, 9, 13, 20, 24)]


CASES = {  # name: (model_type, checkpoint overrides)
    "qwen3": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama": ("llama", dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    "A tiny float32 checkpoint, prompts, and transformers' greedy completions of them."
    model_type, kw = CASES[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), model_type, vocab_size=256, seed=1, **kw)
    prompts = make_prompts(256)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                            eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    return path, prompts, expected


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True, seed=100 + i)
          for i in range(18)]
_sampled_at = {}  # (case, tp) -> seeded completions, compared across TP sizes


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_greedy_matches_transformers_with_a_roomy_cache(case, tp):
    path, prompts, expected = case
    with LLM(path, tensor_parallel_size=tp, max_model_len=128, kvcache_block_size=8) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions == 0
        assert [o.token_ids for o in outputs] == expected
        assert all(o.finish_reason == "length" for o in outputs)
        sampled = [o.token_ids for o in llm.generate(prompts, SEEDED, use_tqdm=False)]
        again = [o.token_ids for o in llm.generate(prompts[::-1], SEEDED[::-1], use_tqdm=False)][::-1]
        assert sampled == again, "a seeded request must not depend on what it is batched with"
    _sampled_at[(str(path), tp)] = sampled
    if (str(path), 1) in _sampled_at:
        assert sampled == _sampled_at[(str(path), 1)], "seeded sampling must give the same tokens at every TP size"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_greedy_matches_with_preemption_prefix_hits_and_chunked_prefill(case, tp):
    "24 blocks of 4 tokens for 18 requests, 32 tokens per step: preempts, hits the prefix cache and chunks prompts."
    path, prompts, expected = case
    with LLM(path, tensor_parallel_size=tp, max_model_len=96, kvcache_block_size=4, num_kvcache_blocks=24,
             max_num_batched_tokens=32, max_num_seqs=8) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the small cache should have forced preemption"
        assert llm.llm_engine.scheduler.block_manager.prefix_cache_hit_blocks > 0, "shared prefixes should hit the cache"
        assert max(len(p) for p in prompts) > 32, "a prompt longer than the token budget is prefilled in chunks"


def as_if_cores_were_shared(llm: LLM, monkeypatch) -> list[int]:
    "Make the engine's ThreadPolicy see another process on one of two cores, with tiny prefills worth streams; the streams' counts."
    from minivllm.cpu import threads
    policy, runner = llm.llm_engine.runner.threads, llm.llm_engine.runner
    policy.max_threads, policy.threads, policy.choose = 2, 1, lambda: 1  # as the policy would have chosen
    monkeypatch.setattr(threads, "MIN_STREAM_TOKENS", 4)
    counts, streamed = [], runner._streamed_hidden
    runner._streamed_hidden = lambda parts, kv_cache: counts.append(len(parts)) or streamed(parts, kv_cache)
    return counts


def test_prefills_in_streams_give_the_tokens_of_one_stream(case, monkeypatch):
    "Prefills cut into streams (chunked, preempted, with prefix hits) give transformers' greedy tokens and the seeded draws of one stream."
    path, prompts, expected = case
    kw = dict(max_model_len=96, kvcache_block_size=4, num_kvcache_blocks=24, max_num_batched_tokens=32, max_num_seqs=8)
    with LLM(path, **kw) as llm:
        sampled = [o.token_ids for o in llm.generate(prompts, SEEDED, use_tqdm=False)]
    with LLM(path, **kw) as llm:
        counts = as_if_cores_were_shared(llm, monkeypatch)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        assert counts and set(counts) == {2}, "prefills should have run in two streams"
        scheduler = llm.llm_engine.scheduler
        assert scheduler.block_manager.prefix_cache_hit_blocks > 0 and scheduler.num_preemptions > 0
        assert [o.token_ids for o in llm.generate(prompts, SEEDED, use_tqdm=False)] == sampled


def test_a_stream_that_fails_fails_the_step_and_leaves_no_thread(tiny, monkeypatch):
    "An error in a stream other than the engine's own thread is the step's error; closing leaves no stream thread."
    import threading
    with LLM(tiny, max_model_len=64) as llm:
        counts = as_if_cores_were_shared(llm, monkeypatch)
        runner, forward = llm.llm_engine.runner, llm.llm_engine.runner._hidden_at_last_tokens
        def fail_elsewhere(step, kv_cache):
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("a stream failed")
            return forward(step, kv_cache)
        runner._hidden_at_last_tokens = fail_elsewhere
        with pytest.raises(RuntimeError, match="a stream failed"):
            llm.generate([[1, 2, 3, 4, 5], [6, 7, 8, 9]], GREEDY, use_tqdm=False)
        assert counts == [2]
    assert not [t for t in threading.enumerate() if t.name.startswith("minivllm-stream")]

def test_prefix_cache_hits_are_reported_per_request(case):
    path, prompts, expected = case
    with LLM(path, max_model_len=128, kvcache_block_size=8) as llm:
        first = llm.generate(prompts[10], GREEDY, use_tqdm=False)[0]
        second = llm.generate(prompts[11:13], GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in second] == [40, 40]  # the shared 40 tokens: five full blocks of 8
    assert [o.token_ids for o in second] == expected[11:13]


# ------------------------------------------------------------------------------------------------ bad requests
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3", num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("prompt, params, message", [
    ([1] * 64, GREEDY, "max_model_len is 64"),
    ([], GREEDY, "the prompt is empty"),
    ([1, 5000], GREEDY, "out of range for a vocabulary of"),
    ([1, -3], GREEDY, "token id -3 is out of range"),
    ("text", GREEDY, "has no tokenizer"),
    ([1, 2], "greedy", "must be a SamplingParams"),
])
def test_bad_requests_are_refused_and_the_engine_keeps_serving(tiny, prompt, params, message):
    with LLM(tiny, tensor_parallel_size=2, max_model_len=64) as llm:
        good = llm.add_request([1, 2, 3], GREEDY)
        with pytest.raises((ValueError, TypeError), match=message):
            llm.generate([[4, 5], prompt], [GREEDY, params], use_tqdm=False)
        waiting = llm.llm_engine.scheduler.waiting  # the good request of the failed call was not left queued
        assert [s.prompt_token_ids for s in waiting] == [good.prompt_token_ids] == [[1, 2, 3]]
        while not good.is_finished: llm.step()
        assert len(good.output().token_ids) == MAX_TOKENS
        assert len(llm.generate([4, 5], GREEDY, use_tqdm=False)[0].token_ids) == MAX_TOKENS


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=-0.5), "temperature must be"), (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"), (dict(max_tokens=0), "max_tokens must be"),
    (dict(top_k=-2), "top_k must be"),
])
def test_bad_sampling_params_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw, message", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size"),
    (dict(tensor_parallel_size=16), "tensor_parallel_size"),
    (dict(max_model_len=100_000), "max_position_embeddings"),
    (dict(kvcache_block_size=0), "kvcache_block_size must be a positive integer"),
    (dict(num_kvcache_blocks=2, kvcache_block_size=16, max_model_len=256), "raise num_kvcache_blocks"),
])
def test_bad_engine_arguments(tiny, kw, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        LLM(tiny, device="cuda")


def test_missing_checkpoint_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        LLM(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises((FileNotFoundError, ValueError), match="config.json"):
        LLM(tmp_path / "empty")


# ------------------------------------------------------------------------------------------------ shutdown and faults
def workers_of(llm):
    return list(llm.llm_engine.channel.processes.values())


def test_close_stops_workers_and_frees_shared_memory(tiny):
    llm = LLM(tiny, tensor_parallel_size=4, max_model_len=64)
    segment, workers = llm.llm_engine.channel.name, workers_of(llm)
    assert len(workers) == 3 and (SHM / segment).exists()
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    llm.close()
    llm.close()  # idempotent
    assert all(not p.is_alive() for p in workers) and not (SHM / segment).exists()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


def test_garbage_collected_engine_shuts_down(tiny):
    import gc
    llm = LLM(tiny, tensor_parallel_size=2, max_model_len=64)
    segment, workers = llm.llm_engine.channel.name, workers_of(llm)
    del llm
    gc.collect()
    assert wait_until(lambda: all(not p.is_alive() for p in workers), 10) and not (SHM / segment).exists()


def test_worker_exception_is_reported_and_cleaned_up(tiny):
    llm = LLM(tiny, tensor_parallel_size=2, max_model_len=64)
    segment, workers = llm.llm_engine.channel.name, workers_of(llm)
    llm.llm_engine.channel.call("no_such_method", wait=False)  # the worker raises AttributeError and exits
    with pytest.raises(RankFailure, match=r"(?s)worker rank 1 raised.*AttributeError.*no_such_method"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert llm.llm_engine.closed and all(not p.is_alive() for p in workers) and not (SHM / segment).exists()


def test_closing_an_engine_frees_its_model_at_once(tiny):
    "The model's weights go when the engine closes, not whenever Python's cyclic collector next runs."
    import weakref
    for tp in (1, 2):
        llm = LLM(tiny, tensor_parallel_size=tp, max_model_len=64)
        model = weakref.ref(llm.llm_engine.runner.model)
        llm.close()
        assert model() is None


def test_worker_killed_during_generation(tiny):
    import threading
    llm = LLM(tiny, tensor_parallel_size=2, max_model_len=512)
    segment, (worker,) = llm.llm_engine.channel.name, workers_of(llm)
    errors, steps, step = [], [], llm.step
    llm.step = lambda: (steps.append(1), step())[1]  # counts the engine's steps, to kill mid-generation
    def run():
        try:
            llm.generate([[1, 2, 3]] * 8, SamplingParams(temperature=0, max_tokens=480, ignore_eos=True), use_tqdm=False)
        except Exception as e:
            errors.append(e)
    t = threading.Thread(target=run)
    t.start()
    assert wait_until(lambda: len(steps) >= 3, 30), "generation did not start"
    os.kill(worker.pid, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive(), "generate did not return after its worker was killed"
    assert errors and isinstance(errors[0], RankFailure), errors
    assert "worker rank 1" in str(errors[0]) and "SIGKILL" in str(errors[0])
    assert llm.llm_engine.closed and not (SHM / segment).exists()


RANK0_SCRIPT = textwrap.dedent("""
    import json, sys
    from minivllm import LLM, SamplingParams
    llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=512)
    channel = llm.llm_engine.channel
    print(json.dumps({"segment": channel.name, "workers": [p.pid for p in channel.processes.values()]}),
          flush=True)
    if sys.argv[2] == "interrupt":
        step = llm.step
        def step_and_tell():  # once generation is under way, say so: the test then interrupts or kills us
            llm.step = step
            print("generating", flush=True)
            return step()
        llm.step = step_and_tell
        llm.generate([[1, 2, 3]] * 8, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True), use_tqdm=False)
    else:  # exit without close(): the interpreter's exit shuts the engine down
        print(llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].token_ids, flush=True)
""")


@pytest.mark.parametrize("how", ["interrupt", "exit", "sigkill"])
def test_rank0_interrupted_exiting_or_killed_leaves_nothing_behind(tiny, how):
    "Rank 0 interrupted, exiting without close(), or killed: the workers leave and unlink both of its segments."
    proc = subprocess.Popen([sys.executable, "-c", RANK0_SCRIPT, str(tiny), "interrupt" if how == "sigkill" else how],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    info = json.loads(proc.stdout.readline())
    if how in ("interrupt", "sigkill"):
        assert proc.stdout.readline().strip() == "generating"
        proc.send_signal(signal.SIGINT if how == "interrupt" else signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    if how == "interrupt":
        assert proc.returncode != 0 and ("interrupted in the middle of a step" in err or "KeyboardInterrupt" in err), err
    elif how == "sigkill":
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 0, err
    assert wait_until(lambda: all(gone(pid) for pid in info["workers"]), 10), "a worker outlived rank 0"
    assert not (SHM / info["segment"]).exists() and not shm_segments(proc.pid)


TWO_ENGINES = textwrap.dedent("""
    import sys
    from minivllm import LLM, SamplingParams
    with LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=64) as llm:
        out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        print([o.token_ids for o in out])
""")


def test_two_engines_side_by_side(tiny):
    "Two TP=2 engines in two processes at once (their own ports and segments), and two TP=1 engines in this one."
    procs = [subprocess.Popen([sys.executable, "-c", TWO_ENGINES, str(tiny)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    with LLM(tiny, max_model_len=64) as a, LLM(tiny, max_model_len=64) as b:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        here = [o.token_ids for o in a.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)]
        assert here == [o.token_ids for o in b.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-2000:] for r in results]
    assert [r[0].strip() for r in results] == [str(here)] * 2


def test_a_checkpoint_without_tokenizer_json_names_the_file_and_the_folder(tmp_path):
    "tokenizer_config.json but no tokenizer.json: the error names both, not transformers' sentencepiece or tiktoken."
    import shutil
    from minivllm.model_source import DEFAULT_MODEL
    folder = tmp_path / "no-tokenizer-json"
    shutil.copytree(DEFAULT_MODEL, folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=rf"cannot load the tokenizer of {folder}: it has no tokenizer.json") as e:
        LLM(folder)
    assert "sentencepiece" not in str(e.value) and "tiktoken" not in str(e.value)
    r = subprocess.run([sys.executable, "-m", "minivllm", "generate", "hi", "--model", str(folder), "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "it has no tokenizer.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_generate_on_a_checkpoint_without_tokenizer_is_a_clear_error(tiny):
    r = subprocess.run([sys.executable, "-m", "minivllm", "generate", "hello", "--model", str(tiny), "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "has no tokenizer" in r.stderr


# ------------------------------------------------------------------------------------------------ the first hour, made safe
GUARDLESS = textwrap.dedent("""
    import sys
    from minivllm import LLM, SamplingParams
    llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]), max_model_len=64)  # no main guard, no close()
    out = llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    print([o.token_ids for o in out])
""")


def test_a_script_without_a_main_guard_gives_the_tp1_tokens_at_tp_2_and_4(tiny, tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(GUARDLESS)
    runs = [subprocess.run([sys.executable, str(script), str(tiny), str(tp)], capture_output=True, text=True,
                           timeout=300) for tp in (1, 2, 4)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-3000:] for r in runs]
    assert runs[0].stdout.startswith("[[") and runs[0].stdout == runs[1].stdout == runs[2].stdout


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def broken_start(kind: str, tiny: Path, tmp_path: Path) -> tuple[Path, dict]:
    "A checkpoint (and engine arguments) whose engine fails to start after its ranks have joined their group."
    if kind == "too few blocks":
        return tiny, dict(num_kvcache_blocks=1)
    from safetensors.torch import load_file, save_file
    import shutil
    dst = tmp_path / kind.replace(" ", "_")
    shutil.copytree(tiny, dst)
    weights = dst / "model.safetensors"
    if kind == "wrong shape":
        tensors = load_file(weights)
        tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 64)
        save_file(tensors, weights, metadata={"format": "pt"})
    else:  # truncated file
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return dst, {}


@pytest.mark.parametrize("kind", ["too few blocks", "wrong shape", "truncated file"])
def test_after_a_failed_start_engines_of_every_size_work(tiny, tmp_path, kind):
    path, kw = broken_start(kind, tiny, tmp_path)
    with pytest.raises(Exception):  # the first failure also warms up what a process opens once (thread pools, ...)
        LLM(path, tensor_parallel_size=2, max_model_len=64, **kw)
    before = open_fds()
    for _ in range(3):
        with pytest.raises(Exception) as failure:
            LLM(path, tensor_parallel_size=2, max_model_len=64, **kw)
        assert not isinstance(failure.value, TimeoutError)
    del failure
    assert open_fds() <= before, "a failed start leaked file descriptors"
    for tp in (1, 2):
        with LLM(tiny, tensor_parallel_size=tp, max_model_len=64) as llm:
            assert len(llm.generate([1, 2, 3], GREEDY, use_tqdm=False)[0].token_ids) == MAX_TOKENS


def test_engines_of_different_sizes_take_turns_in_one_process(tiny):
    "A TP=2 engine, then a TP=1 engine, then another TP=2 engine, all open at once: each has its own group."
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5]]
    with LLM(tiny, tensor_parallel_size=2, max_model_len=64) as a, LLM(tiny, max_model_len=64) as b, \
            LLM(tiny, tensor_parallel_size=2, max_model_len=64) as c:
        reference = [o.token_ids for o in b.generate(prompts, params, use_tqdm=False)]
        for llm in (a, b, c, a, c, b):
            assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference


@pytest.mark.skipif(subprocess.run(["which", "ss"], capture_output=True).returncode != 0, reason="needs ss (iproute2)")
def test_the_engine_leaves_no_listener_once_started(tiny):
    "At TP=2, once the ranks are connected, neither this process nor rank 1 listens on any port (notebook 01)."
    with LLM(tiny, tensor_parallel_size=2, max_model_len=64) as llm:
        llm.generate([1, 2, 3], GREEDY, use_tqdm=False)
        addresses = tcp_listeners([os.getpid()] + [p.pid for p in workers_of(llm)])
    assert addresses == [], addresses


def test_numpy_token_ids_are_checked_like_python_ints(tiny):
    import numpy as np
    with LLM(tiny, tensor_parallel_size=2, max_model_len=64) as llm:
        reference = llm.generate([1, 2, 3], GREEDY, use_tqdm=False)[0].token_ids
        assert llm.generate(np.array([1, 2, 3]), GREEDY, use_tqdm=False)[0].token_ids == reference
        assert llm.generate([np.array([1, 2, 3], dtype=np.int32)], GREEDY, use_tqdm=False)[0].token_ids == reference
        assert llm.generate([np.int64(1), np.int16(2), 3], GREEDY, use_tqdm=False)[0].token_ids == reference
        for bad, message in ((np.array([1, 5000]), "out of range for a vocabulary of"),
                             ([np.int64(1), np.int64(300)], "out of range for a vocabulary of"),
                             (np.array([[1, -2]]), "token id -2 is out of range for a vocabulary of"),
                             ([1, np.float32(2.0)], r"token ids \(integers >= 0 that fit in 64 bits\)")):
            with pytest.raises(ValueError, match=message):
                llm.generate(bad, GREEDY, use_tqdm=False)
        assert llm.llm_engine.scheduler.is_finished()
        assert llm.generate([1, 2, 3], GREEDY, use_tqdm=False)[0].token_ids == reference  # still serving


def test_a_stopped_worker_is_named_within_seconds(tiny):
    llm = LLM(tiny, tensor_parallel_size=2, max_model_len=512)
    segment, (worker,) = llm.llm_engine.channel.name, workers_of(llm)
    llm.generate([1, 2, 3], GREEDY, use_tqdm=False)
    os.kill(worker.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"worker rank 1 \(pid \d+\) has been stopped \(SIGSTOP or a debugger\)"):
        llm.generate([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - t0 < 10
    assert llm.llm_engine.closed and not worker.is_alive() and not (SHM / segment).exists()


@pytest.mark.parametrize("tp", [1, 2])
def test_an_interruption_between_steps_aborts_the_calls_requests(tiny, tp):
    with InterruptedAfterOneStep(tiny, tensor_parallel_size=tp, max_model_len=64) as llm:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False)
        manager = llm.llm_engine.scheduler.block_manager
        assert llm.llm_engine.scheduler.is_finished() and manager.num_free_blocks == manager.num_blocks
        out = llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False)
        assert [len(o.token_ids) for o in out] == [MAX_TOKENS] * 2  # only this call's requests ran
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.add_request([1, 2, 3])


def test_default_threads_follow_the_load_and_fixed_threads_stay(tiny):
    "Rank 0's ThreadPolicy counts the workers as the engine's own; each step's choice is applied; num_threads=N fixes it."
    before = torch.get_num_threads()
    with LLM(tiny, max_model_len=64, tensor_parallel_size=2) as llm:
        policy = llm.llm_engine.runner.threads
        assert policy.fixed is None and {p.pid for p in llm.llm_engine.channel.processes.values()} < policy.pids
    with LLM(tiny, max_model_len=64) as llm:
        policy = llm.llm_engine.runner.threads
        policy.choose, policy.next_check_at = (lambda: 1), 0.0  # the load is due a look: another process holds a core
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before  # the engine gives its threads back
    with LLM(tiny, max_model_len=64, num_threads=1) as llm:
        assert llm.llm_engine.runner.threads.fixed == 1 and llm.llm_engine.runner.threads.choose() == 1
