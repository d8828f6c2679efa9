"""The CPU GEMM chosen per machine and per weight shape (notebook 03): every kernel, forced, gives the plain `F.linear`
outputs on every kind of layer and on the LM head; the timings are cached, per candidate, under a key that changes
with the CPU, torch's version, the threads and the shape (not the candidates: a new one is timed alone); timings
taken on a busy machine are saved marked busy and timed again once, at a start that finds the machine quiet; a broken
cache file is measured again; a forced kernel is never timed."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from minivllm.config import Config
from minivllm.cpu import gemm
from minivllm.cpu.gemm import (GEMM_ROWS, LOGIT_ROWS, GemmStart, choose_gemm, cpu_gemm_setting, gemm_cache_key,
                               gemm_cache_path, gemm_candidate_id, gemm_kernels, pick_gemm, read_gemm_cache,
                               relative_times, time_gemm)
from minivllm.layers.embed_head import ParallelLMHead
from minivllm.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                    RowParallelLinear)
from minivllm.models import build_model, load_checkpoint
from minivllm.testing import load_layer, make_tiny_checkpoint, prefill_logits, rand

# The kernels differ from F.linear only in summation order: a few float32 ulps on outputs of order ten.
F32 = dict(rtol=1.3e-6, atol=1e-5)
KERNELS = gemm_kernels()
IN, OUT, MID, HEAD = 32, 48, 64, 4


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    "Every test measures into a cache file of its own, with no kernel forced from outside."
    # subtle: not by MINIVLLM_CACHE, which would also move the C++ kernels' cache and rebuild them (25 s)
    monkeypatch.setattr(gemm, "gemm_cache_path", lambda: tmp_path / "cache" / "cpu_gemm.json")
    monkeypatch.delenv("MINIVLLM_CPU_GEMM", raising=False)
    monkeypatch.setattr(gemm, "cores_busy_elsewhere", lambda before, after: 0.0)  # a quiet machine, unless a test says
    monkeypatch.setattr(gemm, "THIS_START", GemmStart())  # this process's start: a fresh one for every test


def timed(W, rows=GEMM_ROWS) -> dict:
    "The cached records of `W`'s key: candidate id -> record."
    return read_gemm_cache(gemm.gemm_cache_path())[gemm_cache_key(W, rows)]["timed"]


class CountingMeasure:
    "A stand-in for `time_gemm` that records what it was asked to time and makes `fastest` win everywhere."
    def __init__(self, fastest: str | None = None):
        self.fastest, self.calls = fastest, []

    def __call__(self, weight, kernels, rows):
        self.calls.append((tuple(weight.shape), tuple(kernels), tuple(rows)))
        win = self.fastest or kernels[-1]
        return {k: [[1.0 if k == win else 2.0]] * len(rows) for k in kernels}


def layers(bias: bool, tp_rank: int = 0, tp_size: int = 1):
    "One of every linear layer (this rank's shard), loaded from fixed full weights; with the input each one takes."
    from minivllm.distributed import Communicator
    kw = dict(comm=Communicator(tp_rank, tp_size))
    W, b = rand(OUT, IN, seed=1), (rand(OUT, seed=2) if bias else None)
    Wg, Wu, Wd = rand(MID, IN, seed=3), rand(MID, IN, seed=4), rand(IN, MID, seed=5)
    Wq, Wk, Wv = rand(8 * HEAD, IN, seed=6), rand(2 * HEAD, IN, seed=7), rand(2 * HEAD, IN, seed=8)
    gate_up = MergedColumnParallelLinear(IN, [MID, MID], bias, **kw)
    load_layer(gate_up, Wg, rand(MID, seed=9) if bias else None, shard_id=0)
    load_layer(gate_up, Wu, rand(MID, seed=10) if bias else None, shard_id=1)
    qkv = QKVParallelLinear(IN, HEAD, 8, 2, bias, **kw)
    for sid, Wx in zip("qkv", (Wq, Wk, Wv)):
        load_layer(qkv, Wx, rand(Wx.shape[0], seed=11) if bias else None, shard_id=sid)
    x = rand(5, IN, seed=12)
    return {"replicated": (load_layer(ReplicatedLinear(IN, OUT, bias, **kw), W, b), x),
            "column": (load_layer(ColumnParallelLinear(IN, OUT, bias, **kw), W, b), x),
            "row": (load_layer(RowParallelLinear(IN, OUT, bias, reduce_results=False, **kw), W, b),
                    x.chunk(tp_size, dim=-1)[tp_rank]),
            "merged": (gate_up, x),
            "qkv": (qkv, x),
            "down": (load_layer(RowParallelLinear(MID, IN, bias, reduce_results=False, **kw), Wd, rand(IN, seed=14) if bias else None),
                     rand(3, 2, MID // tp_size, seed=13))}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (1, 2)])
def test_every_forced_kernel_gives_the_plain_outputs(kernel, bias, tp_rank, tp_size):
    "Each layer kind (a TP=2 shard too), packed for each kernel, computes what its plain `F.linear` did."
    for name, (layer, x) in layers(bias, tp_rank, tp_size).items():
        W, b = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
        expected = F.linear(x, W, b)
        assert layer.pack_for_cpu(kernel) == (kernel != "torch"), name
        assert layer.weight.numel() == (W.numel() if kernel == "torch" else 0), name
        torch.testing.assert_close(layer.linear(x, layer.bias), expected, **F32, msg=lambda m: f"{name}: {m}")
        for rows in (0, 1, 64, 300):  # one packing serves every row count
            xs = rand(rows, x.shape[-1], seed=rows)
            torch.testing.assert_close(layer.linear(xs, layer.bias), F.linear(xs, W, b), **F32)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("tie", [True, False])
def test_lm_head_forced_kernel(kernel, tie):
    "The LM head's logits and greedy tokens are the plain ones with each kernel; a tied table stays for the embedding."
    V, H = 300, 40
    head = ParallelLMHead(V, H, bias=not tie)
    W, b = rand(V, H, seed=1), rand(V, seed=2)
    head.weight.data.copy_(W)
    if not tie: head.bias.data.copy_(b)
    hidden = rand(2, 7, H, seed=3)
    logits = F.linear(hidden, W, None if tie else b)
    assert head.pack_for_cpu(free_weight=not tie, gemm=kernel) == (kernel != "torch")
    assert head.weight.numel() == (0 if kernel != "torch" and not tie else V * H)
    torch.testing.assert_close(head(hidden), logits, **F32)
    assert torch.equal(head.greedy_tokens(hidden), head(hidden).argmax(-1))


@pytest.mark.parametrize("kernel", KERNELS)
def test_whole_model_with_a_forced_kernel(tmp_path, monkeypatch, kernel):
    "`MINIVLLM_CPU_GEMM` forces the kernel of every layer of a model; its logits are the unpacked model's."
    path = make_tiny_checkpoint(tmp_path / "ckpt", "qwen2", vocab_size=128, hidden_size=32, intermediate_size=64)
    prompts = [[1, 5, 9, 3], [7, 2]]

    def model():
        m = build_model(Config.from_pretrained(path))
        load_checkpoint(m, path)
        return m.eval()
    reference = prefill_logits(model(), prompts)
    monkeypatch.setenv("MINIVLLM_CPU_GEMM", kernel)
    monkeypatch.setattr(gemm, "time_gemm", lambda *a, **k: pytest.fail("a forced kernel was timed"))
    packed = model()
    assert packed.pack_for_cpu() == (0 if kernel == "torch" else 2 * 4 + 1)  # 4 linear layers a block, the head
    torch.testing.assert_close(prefill_logits(packed, prompts), reference, **F32)
    assert not gemm.gemm_cache_path().exists()  # forced: nothing measured, nothing saved


def test_the_setting():
    assert cpu_gemm_setting() == "auto"
    assert cpu_gemm_setting(" oneDNN ") == "onednn"
    with pytest.raises(ValueError, match="choose auto"):
        cpu_gemm_setting("fastest")


def test_setting_from_the_environment(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_GEMM", "torch")
    assert cpu_gemm_setting() == "torch"
    assert cpu_gemm_setting("mkl") == "mkl"  # an argument wins over the environment
    assert ReplicatedLinear(8, 4).pack_for_cpu() is False  # forced to F.linear: not packed


def test_forced_kernel_this_torch_lacks(monkeypatch):
    monkeypatch.setattr(gemm, "gemm_kernels", lambda dtype=torch.float32: ["torch"])
    with pytest.raises(RuntimeError, match="'onednn' is forced .* this torch has only \\['torch'\\]"):
        choose_gemm(rand(4, 8), "onednn")


needs_choice = pytest.mark.skipif(len(KERNELS) < 2, reason="this torch has one CPU GEMM only: nothing to choose")


@needs_choice
def test_measured_once_then_read_back():
    "A new shape is measured, picked and saved; the same shape again is read back; another shape is measured."
    measure, W = CountingMeasure(), rand(24, 16)
    assert choose_gemm(W, measure=measure) == KERNELS[-1]
    assert choose_gemm(W, measure=measure) == KERNELS[-1]
    assert measure.calls == [((24, 16), tuple(KERNELS), GEMM_ROWS)]
    choose_gemm(rand(16, 24), measure=measure)
    choose_gemm(W, rows=LOGIT_ROWS, measure=measure)  # other rows timed: another entry
    assert [c[0] for c in measure.calls] == [(24, 16), (16, 24), (24, 16)]
    entries = read_gemm_cache(gemm.gemm_cache_path())
    assert len(entries) == 3 and all(sorted(e["timed"]) == sorted(KERNELS) for e in entries.values())
    assert all(r["quiet"] and len(r["samples_us"]) == len(GEMM_ROWS) for r in timed(W).values())


@needs_choice
@pytest.mark.parametrize("change", ["cpu", "torch", "threads", "dtype"])
def test_another_machine_or_stack_measures_again(monkeypatch, change):
    "The cached choice is keyed by the CPU, torch's version, the thread count and the dtype: change one, it re-measures."
    W = rand(24, 16)
    choose_gemm(W, measure=CountingMeasure(KERNELS[0]))
    if change == "cpu":
        monkeypatch.setattr(gemm, "cpu_model", lambda: "Some Other CPU [0badf00d]")
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "99.0.0")
    elif change == "threads":
        monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    else:
        W = W.bfloat16()  # a real checkpoint's dtype, timed on its own candidates (MKL's packed GEMM is float32's)
    kernels = gemm_kernels(W.dtype)
    if len(kernels) < 2:
        pytest.skip(f"this torch has one GEMM for {W.dtype}: nothing to measure")
    measure = CountingMeasure(kernels[-1])
    assert choose_gemm(W, measure=measure) == kernels[-1]  # not the first machine's answer
    assert len(measure.calls) == 1
    assert len(read_gemm_cache(gemm.gemm_cache_path())) == 2  # both machines' choices kept


def test_the_cache_lives_with_the_kernels(tmp_path, monkeypatch):
    monkeypatch.undo()  # the real gemm_cache_path
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    assert gemm_cache_path() == tmp_path / "cpu_gemm.json"
    monkeypatch.delenv("MINIVLLM_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert gemm_cache_path() == tmp_path / ".cache" / "minivllm" / "cpu_gemm.json"


def test_the_key_names_what_the_choice_depends_on(monkeypatch):
    monkeypatch.setattr(gemm, "cpu_model", lambda: "Test CPU [12345678]")
    key = json.loads(gemm_cache_key(rand(24, 16), GEMM_ROWS))
    assert key == ["Test CPU [12345678]", torch.__version__, torch.get_num_threads(), "float32", [24, 16], [1, 16, 64, 256],
                   "from memory"]  # not the candidates: each one's samples are kept apart under the key
    assert gemm.cpu_model() != ""


@needs_choice
@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe\x00", b'{"KEY": {"kernel": "blas"}}',
                                     b'{"KEY": "mkl"}', b'{"KEY": {"timed": {"torch": {"samples_us": [[0]], "quiet": 1}}}}',
                                     None])
def test_a_broken_cache_is_measured_again(content):
    "A cache file that is not JSON, not a dict, has an unknown kernel or cannot be read is ignored, re-measured, rewritten."
    W, path = rand(24, 16), gemm.gemm_cache_path()
    path.parent.mkdir(parents=True)
    key = gemm_cache_key(W, GEMM_ROWS)
    if content is None:
        path.mkdir()  # a folder where the file should be: unreadable, and unwritable too
    else:
        path.write_bytes(content.replace(b'"KEY"', json.dumps(key).encode()))
    measure = CountingMeasure()
    assert choose_gemm(W, measure=measure) == KERNELS[-1]
    assert len(measure.calls) == 1
    if content is not None:  # rewritten with the new timings
        assert sorted(timed(W)) == sorted(KERNELS) and all(r["quiet"] for r in timed(W).values())


@needs_choice
@pytest.mark.parametrize("threads,busy,quiet", [(2, 0.4, True), (2, 1.0, False), (1, 1.0, True), (1, 1.6, False)])
def test_a_timing_on_a_busy_machine_is_saved_marked_busy(monkeypatch, threads, busy, quiet):
    "Other processes took the cores this process's threads need: the timings are saved all the same, marked busy."
    monkeypatch.setattr(gemm, "cores_busy_elsewhere", lambda before, after: busy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(gemm, "process_cores", lambda: 2)
    measure = CountingMeasure()
    assert choose_gemm(rand(24, 16), measure=measure) == KERNELS[-1]
    assert choose_gemm(rand(24, 16), measure=measure) == KERNELS[-1]  # every layer of the shape
    assert len(measure.calls) == 1
    records = timed(rand(24, 16))
    assert sorted(records) == sorted(KERNELS)
    assert {(r["quiet"], r["busy_elsewhere"]) for r in records.values()} == {(quiet, busy)}


@needs_choice
def test_a_busy_marked_choice_is_reused_by_a_busy_start_without_timing(monkeypatch):
    "The next start, on a machine still busy, picks from the busy-marked samples: it looks at the machine once, times nothing."
    monkeypatch.setattr(gemm, "cores_busy_elsewhere", lambda before, after: 2.0)
    monkeypatch.setattr(gemm, "process_cores", lambda: 2)
    measure, W = CountingMeasure(), rand(24, 16)
    assert choose_gemm(W, measure=measure) == KERNELS[-1]
    assert {r["quiet"] for r in timed(W).values()} == {False}
    looks = []
    monkeypatch.setattr(gemm, "machine_busy", lambda: looks.append(1) or (0.0, 0.0, 0.0))
    start, other = GemmStart(), CountingMeasure(KERNELS[0])  # a timing now would pick another kernel
    for _ in range(3):
        assert choose_gemm(W, measure=other, start=start) == KERNELS[-1]
        assert choose_gemm(rand(16, 24), measure=measure, start=start) == KERNELS[-1]  # a new shape: timed, busy
    assert other.calls == [] and len(measure.calls) == 2
    assert len(looks) == 4 and start.busy_elsewhere == 2.0  # two readings for one look, two for the new shape's timing
    assert {r["quiet"] for r in timed(W).values()} == {False}


@needs_choice
def test_a_quiet_start_times_a_busy_marked_entry_again_once(monkeypatch):
    "A start that finds the machine quiet times every candidate of a busy-marked key again, together, once; marked quiet."
    monkeypatch.setattr(gemm, "cores_busy_elsewhere", lambda before, after: 2.0)
    monkeypatch.setattr(gemm, "process_cores", lambda: 2)
    W = rand(24, 16)
    choose_gemm(W, measure=CountingMeasure(KERNELS[0]))
    assert {r["quiet"] for r in timed(W).values()} == {False}
    monkeypatch.setattr(gemm, "cores_busy_elsewhere", lambda before, after: 0.0)
    start, measure = GemmStart(), CountingMeasure(KERNELS[-1])
    for _ in range(3):  # every layer of the shape: timed once
        assert choose_gemm(W, measure=measure, start=start) == KERNELS[-1]
    assert measure.calls == [((24, 16), tuple(KERNELS), GEMM_ROWS)]
    assert {r["quiet"] for r in timed(W).values()} == {True}
    later = CountingMeasure(KERNELS[0])
    assert choose_gemm(W, measure=later, start=GemmStart()) == KERNELS[-1] and later.calls == []  # quiet: kept for good


@needs_choice
def test_a_quiet_start_that_finds_it_busy_again_times_it_only_once(monkeypatch):
    "The machine turned busy again during the quiet start's timing: marked busy again, and not timed again in that start."
    monkeypatch.setattr(gemm, "cores_busy_elsewhere", lambda before, after: 2.0)
    monkeypatch.setattr(gemm, "process_cores", lambda: 2)
    W, measure = rand(24, 16), CountingMeasure()
    choose_gemm(W, measure=measure)
    start = GemmStart()
    start.busy_elsewhere = 0.0  # this start found the machine quiet; its timing does not
    for _ in range(3):
        choose_gemm(W, measure=measure, start=start)
    assert len(measure.calls) == 2 and {r["quiet"] for r in timed(W).values()} == {False}


@needs_choice
def test_a_new_candidate_is_timed_alone_and_the_others_keep_their_timings(monkeypatch):
    "A cache written before a candidate existed (our kernel before its build, say): only the new one is timed."
    W, real, calls = rand(24, 16), gemm.gemm_kernels, []

    def measure(us: dict):
        "A stand-in for `time_gemm` in which each kernel takes `us[kernel]` a call."
        def timing(weight, kernels, rows):
            calls.append(tuple(kernels))
            return {k: [[us[k] * 1e-6] * 3] * len(rows) for k in kernels}
        return timing
    monkeypatch.setattr(gemm, "gemm_kernels", lambda dtype=torch.float32: real(dtype)[:-1])
    assert choose_gemm(W, measure=measure({k: 2.0 + i for i, k in enumerate(KERNELS)})) == KERNELS[0]
    before = timed(W)
    assert sorted(before) == sorted(KERNELS[:-1])
    monkeypatch.setattr(gemm, "gemm_kernels", real)
    path, key = gemm.gemm_cache_path(), gemm_cache_key(W, GEMM_ROWS)
    for us, pick in ((1.0, KERNELS[-1]), (9.0, KERNELS[0])):  # the new one faster than the kept ones, or slower
        calls.clear()
        assert choose_gemm(W, measure=measure({KERNELS[-1]: us}), start=GemmStart()) == pick
        assert choose_gemm(W, measure=measure({}), start=GemmStart()) == pick  # and the next start reads it back
        assert calls == [(KERNELS[-1],)]
        after = timed(W)
        assert {k: after[k] for k in before} == before and sorted(after) == sorted(KERNELS)
        data = read_gemm_cache(path)
        del data[key]["timed"][KERNELS[-1]]  # as it was before the new candidate
        path.write_text(json.dumps(data))


def test_our_kernel_is_a_new_candidate_with_each_version_of_its_source(monkeypatch):
    "Our kernel's samples are kept under its name and source digest: another version is timed alone and replaces them."
    ours = gemm_candidate_id("avx512bf16")
    assert ours.startswith("avx512bf16 ") and gemm_candidate_id("onednn") == "onednn"
    monkeypatch.setattr(gemm.kernels, "BF16_GEMM_SOURCE", "// another version")
    assert gemm_candidate_id("avx512bf16") != ours
    rec = {"samples_us": [[1.0]], "quiet": True}
    path = gemm.gemm_cache_path()
    gemm.save_gemm_timings(path, "k", {ours: rec, "torch": rec})
    gemm.save_gemm_timings(path, "k", {gemm_candidate_id("avx512bf16"): rec})
    assert sorted(read_gemm_cache(path)["k"]["timed"]) == sorted(["torch", gemm_candidate_id("avx512bf16")])


@needs_choice
def test_a_cache_folder_that_cannot_be_written(tmp_path, monkeypatch):
    "A read-only cache still gives a choice, with a warning: measured once per process, in each process."
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setattr(gemm, "gemm_cache_path", lambda: blocked / "below" / "cpu_gemm.json")  # not a folder
    measure, this_start = CountingMeasure(), GemmStart()
    assert choose_gemm(rand(24, 16), measure=measure, start=this_start) == KERNELS[-1]
    assert choose_gemm(rand(24, 16), measure=measure, start=this_start) == KERNELS[-1]
    assert len(measure.calls) == 1
    assert choose_gemm(rand(24, 16), measure=measure, start=GemmStart()) == KERNELS[-1]  # the next process
    assert len(measure.calls) == 2


@needs_choice
def test_layers_use_the_measured_choice(monkeypatch):
    "`pack_for_cpu` packs with what `choose_gemm` picked: each kernel in turn made the fastest by a stubbed timer."
    for fastest in KERNELS:
        monkeypatch.setattr(gemm, "time_gemm", CountingMeasure(fastest))
        monkeypatch.setattr(gemm, "cpu_model", lambda: f"CPU where {fastest} wins")
        layer = load_layer(ColumnParallelLinear(IN, OUT), rand(OUT, IN))
        assert layer.pack_for_cpu() == (fastest != "torch")
        assert (layer.packed.kernel if layer.packed is not None else "torch") == fastest
        head = ParallelLMHead(100, IN)
        head.pack_for_cpu()
        assert (head.packed.kernel if head.packed is not None else "torch") == fastest
        assert gemm.time_gemm.calls[-1][2] == LOGIT_ROWS  # the head is timed at one row per sequence


def one_round(**times):
    "Samples of a single round: `[row count][round]` from one time per row count."
    return {k: [[t] for t in ts] for k, ts in times.items()}


def test_pick_rule():
    "Times relative to the fastest at each row count, averaged: the all-round kernel wins over a one-size specialist."
    assert pick_gemm(one_round(torch=[2.0, 8.0, 30.0, 90.0], mkl=[1.0, 4.0, 20.0, 100.0], onednn=[1.5, 6.0, 25, 95])) == "mkl"
    assert pick_gemm(one_round(torch=[1.0, 1.0], mkl=[1.0, 1.0])) == "torch"  # a tie: the first listed
    assert pick_gemm(one_round(mkl=[3.0], onednn=[1.0])) == "onednn"


def test_pick_rule_under_noise():
    "Ratios within a round, median over rounds: a busy spell slows a round's kernels alike, a burst is outvoted."
    # the machine turns busy (10x) in round 3, after torch's sample and before mkl's, and stays busy; one burst hits
    # mkl's first sample alone. In every other round mkl is 1.5x faster than torch
    samples = {"torch": [[1.5, 1.5, 1.5, 15.0, 15.0]], "mkl": [[50.0, 1.0, 10.0, 10.0, 10.0]]}
    assert relative_times(samples) == {"torch": [1.5], "mkl": [1.0]}
    assert pick_gemm(samples) == "mkl"
    # the medians of the raw times (1.5 against 10) would have picked torch
    assert pick_gemm(one_round(**{k: [sorted(s[0])[2]] for k, s in samples.items()})) == "torch"


def test_time_gemm_takes_turns_in_alternating_order(monkeypatch):
    "After one warm-up call each, the kernels take turns, the order reversed every other round; each row count in turn."
    order = []

    class Recorder:
        def __init__(self, kernel): self.kernel = kernel
        def __call__(self, x, bias=None): order.append((self.kernel, x.shape[0])); return x
    monkeypatch.setattr(gemm, "pack_weight", lambda w, kernel: Recorder(kernel))
    ticks = iter(range(10_000))
    times = time_gemm(rand(24, 16), ["a", "b", "c"], rows=(2, 3), rounds=4, sample_s=1.0, clock=lambda: float(next(ticks)))
    # the clock ticks once per reading: the first call lasts 1 s, so a sample is one call, and one call lasts 1 s
    assert times == {k: [[1.0] * 4, [1.0] * 4] for k in "abc"}
    turns = "abc" + "a" + "abc" + "cba" + "abc" + "cba"  # warm-up, the sizing call, four rounds
    assert order == [(k, 2) for k in turns] + [(k, 3) for k in turns]


def test_time_gemm_reads_each_weight_from_memory(monkeypatch):
    "The calls take turns over copies of the weight that together make `cold_bytes` (here 4 copies), never one copy twice in a row."
    used = []

    class Recorder:
        def __init__(self, w): self.w = w
        def __call__(self, x, bias=None): used.append(self.w.data_ptr()); return x
    monkeypatch.setattr(gemm, "pack_weight", lambda w, kernel: Recorder(w))
    W, ticks = rand(24, 16), iter(range(10_000))
    time_gemm(W, ["a"], rows=(2,), rounds=8, sample_s=1.0, clock=lambda: float(next(ticks)), cold_bytes=4 * W.numel() * 4)
    timed = used[2:]  # after the warm-up call and the sizing call
    assert len(set(used)) == 4 and W.data_ptr() in used
    assert all(a != b for a, b in zip(timed, timed[1:]))


def test_time_gemm_on_real_kernels():
    "A real (tiny) timing: positive seconds for every kernel, row count and round."
    times = time_gemm(rand(24, 16), KERNELS, rows=(1, 4), rounds=3, sample_s=1e-4)
    assert list(times) == KERNELS and all(len(t) == 2 and all(len(s) == 3 and min(s) > 0 for s in t)
                                          for t in times.values())


# ---------------------------------------------------------------- bfloat16 weights

# oneDNN's bfloat16 GEMM sums in float32 and rounds once, F.linear too: outputs of order one within a bfloat16 step
BF16 = dict(rtol=2 ** -7, atol=1e-2)
KERNELS16 = gemm_kernels(torch.bfloat16)


def bf16_layers(bias: bool, tp_rank: int = 0, tp_size: int = 1):
    "`layers` in bfloat16: the same full weights, rounded, loaded into bfloat16 parameters; bfloat16 inputs."
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # subtle: the layers' params_dtype follows the default, as build_model's
    try:
        built = layers(bias, tp_rank, tp_size)
    finally:
        torch.set_default_dtype(dtype)
    return {name: (layer, x.bfloat16()) for name, (layer, x) in built.items()}


@pytest.mark.parametrize("kernel", ["torch", "mkl", "onednn"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (1, 2)])
def test_every_forced_kernel_in_bfloat16(kernel, bias, tp_rank, tp_size):
    "Each layer kind in bfloat16, packed for each kernel that takes bfloat16 (MKL's does not: F.linear), computes F.linear's."
    if kernel not in KERNELS:
        pytest.skip(f"this torch has no {kernel}")
    packs = kernel in KERNELS16 and kernel != "torch"
    for name, (layer, x) in bf16_layers(bias, tp_rank, tp_size).items():
        assert layer.weight.dtype == torch.bfloat16, name
        W, b = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
        assert layer.pack_for_cpu(kernel) == packs, name
        y = layer.linear(x, layer.bias)
        assert y.dtype == torch.bfloat16, name
        torch.testing.assert_close(y, F.linear(x, W, b), **BF16, msg=lambda m: f"{name}: {m}")
        for rows in (0, 1, 64, 300):
            xs = rand(rows, x.shape[-1], seed=rows, dtype=torch.bfloat16)
            torch.testing.assert_close(layer.linear(xs, layer.bias), F.linear(xs, W, b), **BF16)


@pytest.mark.parametrize("kernel", ["torch", "mkl", "onednn"])
def test_bf16_row_parallel_at_tp_2_keeps_float32_partials(kernel):
    "A bfloat16 row-parallel shard that all-reduces at TP=2 is packed as float32: its forward's partial stays float32's."
    if kernel not in KERNELS:
        pytest.skip(f"this torch has no {kernel}")
    from minivllm.distributed import Communicator
    W = rand(OUT, IN, seed=1, dtype=torch.bfloat16)
    layer = load_layer(RowParallelLinear(IN, OUT, comm=Communicator(1, 2), params_dtype=torch.bfloat16), W)
    x = rand(5, IN // 2, seed=2, dtype=torch.bfloat16)
    expected = F.linear(x.float(), W[:, IN // 2:].float())
    assert layer.pack_for_cpu(kernel) == (kernel != "torch")
    assert layer.weight.dtype == torch.float32  # the shard, float32 (packed or not)
    torch.testing.assert_close(layer.linear(x.float(), None), expected, **F32)


@needs_choice
def test_bf16_choice_is_measured_on_its_own_kernels_and_key(monkeypatch):
    "A bfloat16 weight of a shape chosen in float32 is measured again, on bfloat16's candidates; forced MKL is F.linear."
    if len(KERNELS16) < 2:
        pytest.skip("this torch has no packed bfloat16 GEMM: F.linear, nothing to choose")
    W = rand(24, 16)
    choose_gemm(W, measure=CountingMeasure(KERNELS[0]))
    measure = CountingMeasure()
    assert choose_gemm(W.bfloat16(), measure=measure) == KERNELS16[-1]
    assert measure.calls == [((24, 16), tuple(KERNELS16), GEMM_ROWS)] and "mkl" not in KERNELS16
    assert choose_gemm(W.bfloat16(), measure=measure) == KERNELS16[-1] and len(measure.calls) == 1  # read back
    assert json.loads(gemm_cache_key(W.bfloat16(), GEMM_ROWS))[3] == "bfloat16"
    assert len(read_gemm_cache(gemm.gemm_cache_path())) == 2
    if "mkl" in KERNELS:
        assert choose_gemm(W.bfloat16(), "mkl", measure=measure) == "torch"
    assert gemm_kernels(torch.float16) == ["torch"]
    assert choose_gemm(W.half(), measure=measure) == "torch" and len(measure.calls) == 1  # nothing to time
