"""The one-pass Triton sampling kernel (notebook 06d) against notebook 05a's reference sampler: Triton's Philox words
are `philox4x32`'s, seeded rows draw the reference's tokens (with min-p, and with top-k and top-p masked by the
caller), greedy rows take the first maximum, masked tokens are never drawn, the draws fit softmax(l / T), the grid's
programs run in any order, and the kernel compiles for sm_80 and sm_90 without spills. Without a GPU it runs in
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before minivllm is imported)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from minivllm.gpu.triton_attention import HAS_TRITON, INTERPRETED, TRITON_RUNS_ON_CPU
from minivllm.layers.embed_head import first_max
from minivllm.sampler import (MASK32, Sampler, apply_min_p, apply_top_k_top_p, int64_seed, philox4x32, random_seeds,
                              seeded_noise)
from minivllm.testing import interpreter_programs, written_twice

ROOT = Path(__file__).resolve().parents[1]
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.skipif(not (HAS_TRITON and (ON_GPU or TRITON_RUNS_ON_CPU)),
                                reason="needs triton (>= 3.2 to run on the CPU, in its interpreter)")


def ts_module():
    import minivllm.gpu.triton_sampler as module
    return module


def rows(*values, dtype=torch.float32) -> torch.Tensor:
    "Per-row settings as the device tensor the kernel reads."
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def sample(logits, temps, min_ps, seeds, steps, greedy=None) -> list[int]:
    "The kernel's tokens for settings given as lists (no row greedy by its flag unless `greedy` says so)."
    greedy = [False] * len(temps) if greedy is None else greedy
    return ts_module().sample_rows_triton(logits, rows(*temps), rows(*min_ps), rows(*seeds, dtype=torch.int64),
                                          rows(*steps, dtype=torch.int64), rows(*greedy, dtype=torch.bool)).tolist()


def reference(logits, temps, min_ps, seeds, steps, top_ks=None, top_ps=None) -> list[int]:
    "Notebook 05a's Sampler on the CPU, on the same rows."
    b = len(temps)
    return Sampler()(logits.cpu(), temps, top_ks or [0] * b, top_ps or [1.0] * b, seeds, steps, min_ps=min_ps).tolist()


def random_rows(batch: int, vocab: int, seed: int, scale: float = 2.0):
    "Logits, temperatures in [0.3, 1.8], int64_seed-wrapped seeds (negative ones too) and steps past 2^32."
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=g) * scale).to(DEVICE)
    temps = (torch.rand(batch, generator=g) * 1.5 + 0.3).tolist()
    seeds = [int64_seed(s) for s in torch.randint(-2 ** 63, 2 ** 63 - 1, (batch,), generator=g).tolist()]
    steps = torch.randint(0, 2 ** 34, (batch,), generator=g).tolist()
    return logits, temps, seeds, steps


if HAS_TRITON:
    import triton
    import triton.language as tl

    from minivllm.gpu.triton_sampler import race_keys

    @triton.jit
    def _philox_words_kernel(out_ptr, seed_ptr, step_ptr, COUNTERS: tl.constexpr):
        "Words 0-3 of counters `(j, step, 0, 0)`, j < COUNTERS, under the seed, as `philox4x32` lays them out."
        j = tl.arange(0, COUNTERS)
        words = tl.philox(tl.load(seed_ptr), j, (tl.load(step_ptr) & 0xFFFFFFFF).to(tl.uint32), 0, 0)
        for w in tl.static_range(4):
            tl.store(out_ptr + 4 * j + w, words[w].to(tl.int64))

    @triton.jit
    def _race_keys_kernel(out_ptr, seed, step, first_counter, COUNTERS: tl.constexpr, INTERPRETER: tl.constexpr):
        "The module's keys of one tile of zero logits: `-log E`."
        cols = 4 * tl.arange(0, COUNTERS)[:, None] + tl.arange(0, 4)[None, :]
        zeros = tl.zeros((COUNTERS, 4), tl.float32)
        tl.store(out_ptr + cols, race_keys(zeros, seed, step.to(tl.uint32), first_counter, COUNTERS, INTERPRETER))


@pytest.mark.parametrize("seed, step", [(0, 0), (12345, 7), (-1, 3), (2 ** 63 - 5, 2 ** 32 + 9), (-2 ** 63, 1)])
def test_tl_philox_is_the_reference_philox(seed, step):
    "tl.philox(seed, j, step, 0, 0): the words of philox4x32 with counter (j, step) and key int64_seed(seed) split in two."
    got = torch.empty(4 * 16, dtype=torch.int64, device=DEVICE)
    _philox_words_kernel[(1,)](got, rows(seed, dtype=torch.int64), rows(step, dtype=torch.int64), COUNTERS=16)
    key = torch.tensor(int64_seed(seed))
    want = philox4x32(torch.arange(16), step & MASK32, 0, 0, key & MASK32, (key >> 32) & MASK32)
    assert got.cpu().tolist() == torch.stack(want, dim=-1).flatten().tolist()


def test_race_keys_are_minus_the_log_of_the_reference_noise():
    "A tile past the first counters: its keys are -log(seeded_noise), to a rounding of the two logarithms."
    seed, step = int64_seed(-987654321), 5
    got = torch.empty(64, device=DEVICE)
    _race_keys_kernel[(1,)](got, seed, step, 3, COUNTERS=16, INTERPRETER=INTERPRETED)
    noise = seeded_noise(torch.tensor([seed]), torch.tensor([step]), 12 + 64)[0, 12:]
    # numpy's log and torch's may round apart by an ulp: a few 1e-7, where a wrong word is off by about 1
    torch.testing.assert_close(got.cpu(), -noise.log(), rtol=2 ** -21, atol=2 ** -21)


@pytest.mark.parametrize("vocab", (5, 5003))
def test_equal_logits_draw_the_token_of_least_noise(vocab):
    "All logits equal: a seeded row's token is argmin_j E_j of seeded_noise, past a tile's end and a vocabulary of no multiple of 4."
    _, temps, seeds, steps = random_rows(6, 1, seed=1)
    got = sample(torch.zeros(6, vocab, device=DEVICE), temps, [0.0] * 6, seeds, steps)
    assert got == seeded_noise(torch.tensor(seeds), torch.tensor(steps), vocab).argmin(dim=-1).tolist()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("with_min_p", (False, True))
def test_seeded_rows_draw_the_reference_samplers_tokens(dtype, with_min_p):
    "Random rows at random temperatures, seeds and steps: the reference's tokens, and the float64 argmax of l / T - log E."
    logits, temps, seeds, steps = random_rows(40, 300, seed=2)
    logits = logits.to(dtype)
    min_ps = (torch.rand(40, generator=torch.Generator().manual_seed(3)) * 0.3).tolist() if with_min_p else [0.0] * 40
    got = sample(logits, temps, min_ps, seeds, steps)
    # subtle: both take the largest p_j / E_j, rounded differently: they could part only at a float32 tie, none here
    assert got == reference(logits, temps, min_ps, seeds, steps)
    scaled = logits.cpu().double() / torch.tensor(temps, dtype=torch.float64)[:, None]
    kept = scaled >= scaled.amax(-1, keepdim=True) + torch.tensor(min_ps, dtype=torch.float64).log()[:, None]
    keys = scaled - seeded_noise(torch.tensor(seeds), torch.tensor(steps), 300).double().log()
    assert got == keys.masked_fill(~kept, float("-inf")).argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_greedy_rows_take_the_first_maximum(dtype):
    "Ties in one tile and across tiles, a NaN (above every number), all -inf; greedy by flag or by a temperature below 1e-5."
    x = torch.randn(6, 5000, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    x[1, [4100, 4200]] = 50.0  # a tie in the second tile
    x[2, [100, 4196]] = 50.0  # a tie across tiles, in the same lane
    x[3, [10, 3000]] = float("nan")
    x[4] = float("-inf")
    temps, flags = [0.0, 1.0, 0.5, 0.0, 0.0, 1e-6], [True, True, True, False, True, False]  # the last: its temperature
    got = sample(x, temps, [0.0, 0.0, 0.2, 0.0, 0.0, 0.5], list(range(6)), [0] * 6, flags)
    assert got == first_max(x.float()).tolist()
    assert got[1:5] == [4100, 100, 10, 0]


def test_masked_tokens_are_never_drawn_and_min_p_one_keeps_the_maximum():
    "-inf logits (top-k's and top-p's mask) are never drawn, even with one token left; min-p = 1 keeps only the maximum."
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    keep = torch.zeros(5, 64, dtype=torch.bool, device=DEVICE)
    keep[0, 5] = keep[1, [7, 40]] = keep[2, :3] = keep[3, 60:] = keep[4] = True
    x = x.masked_fill(~keep, float("-inf"))
    for step in range(12):
        got = sample(x, [1.0, 1.0, 2.0, 0.5, 3.0], [0.0, 0.0, 0.0, 0.0, 1.0], [7, 8, 9, 10, 11], [step] * 5)
        assert keep[torch.arange(5, device=DEVICE), torch.tensor(got, device=DEVICE)].all(), got
        assert got[4] == x[4].argmax().item()


def test_top_k_and_top_p_masked_by_the_caller_give_the_reference_tokens():
    "The caller's torch steps (scale, min-p, top-k/top-p) then the kernel at temperature 1, min-p 0: the reference's draw."
    top_ks, top_ps, min_ps = [5, 0, 20, 3] * 6, [1.0, 0.8, 0.9, 0.5] * 6, [0.0, 0.0, 0.1, 0.05] * 6
    logits, temps, seeds, steps = random_rows(24, 100, seed=6)
    scaled = apply_min_p(logits / rows(*temps)[:, None], rows(*min_ps))
    scaled = apply_top_k_top_p(scaled, rows(*top_ks, dtype=torch.int64), rows(*top_ps))
    got = sample(scaled, [1.0] * 24, [0.0] * 24, seeds, steps)
    assert got == reference(logits, temps, min_ps, seeds, steps, top_ks, top_ps)


def chi_squared_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    "Pearson's chi-squared p-value of `counts` against `probs` over the tokens with p > 0 (each expected count >= 5)."
    keep = probs > 0
    expected = probs[keep].double() * counts.sum()
    assert expected.min() >= 5, expected.min()
    chi2 = ((counts[keep].double() - expected) ** 2 / expected).sum()
    # the chi-squared survival function with keep - 1 degrees of freedom (scipy is not a dependency)
    return torch.special.gammaincc(torch.tensor((keep.sum().item() - 1) / 2, dtype=torch.float64), chi2 / 2).item()


def test_the_draws_fit_softmax_of_l_over_t_cut_by_min_p():
    "One launch, 2,000 rows of the same 16 logits and their own seeds: T 0.8, then T 1.3 with min-p 0.25 (11 tokens kept)."
    base = torch.linspace(-1.5, 1.0, 16)[torch.randperm(16, generator=torch.Generator().manual_seed(7))]
    n, halves = 1000, [(0.8, 0.0), (1.3, 0.25)]
    temps, min_ps = [t for t, _ in halves for _ in range(n)], [m for _, m in halves for _ in range(n)]
    seeds = [int64_seed(s) for s in
             torch.randint(-2 ** 63, 2 ** 63 - 1, (2 * n,), generator=torch.Generator().manual_seed(8)).tolist()]
    steps = list(range(2 * n))
    logits = base.expand(2 * n, 16).to(DEVICE)
    drawn = {"kernel": torch.tensor(sample(logits, temps, min_ps, seeds, steps)),
             "reference": torch.tensor(reference(logits, temps, min_ps, seeds, steps))}
    for i, (temp, min_p) in enumerate(halves):
        probs = (base / temp).softmax(-1)
        probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
        assert (probs > 0).sum() == (16 if min_p == 0 else 11)
        for name, tokens in drawn.items():
            counts = torch.bincount(tokens[i * n:(i + 1) * n], minlength=16)
            assert counts[probs == 0].sum() == 0, (name, counts)  # nothing below the min-p cut, ever
            assert chi_squared_p(counts, probs) > 1e-3, (name, temp, min_p, counts)


def mixed_launch() -> list[int]:
    "One launch over greedy, sampled and min-p rows of three tiles each."
    x = (torch.randn(6, 9000, generator=torch.Generator().manual_seed(9)) * 2).to(DEVICE)
    return sample(x, [0.0, 1.0, 0.7, 1.2, 0.0, 1.0], [0.0, 0.0, 0.1, 0.3, 0.0, 0.05], list(range(6)), list(range(6)),
                  [True, False, False, False, False, False])


@pytest.mark.parametrize("order", ("reversed", "shuffled"))
def test_programs_in_any_order_write_only_their_own_token(order):
    first = mixed_launch()
    # subtle: on a GPU the programs run in the GPU's own order, which is the test; the interpreter is told one
    with interpreter_programs(order, seed=4) if not ON_GPU else nullcontext([]) as launches:
        again = mixed_launch()
    assert len(launches) == (0 if ON_GPU else 1)
    assert [written_twice(launch) for launch in launches] == [{}] * len(launches)
    assert again == first


def test_the_batch_size_chooses_no_new_variant():
    "Batches of 1, 3 and 16 rows launch one compiled variant: no argument that changes with the batch chooses one."
    from minivllm.testing import triton_variants
    m = ts_module()
    with triton_variants(m) as variants:
        for b in (1, 3, 16):
            logits, temps, seeds, steps = random_rows(b, 160, seed=b)
            sample(logits, temps, [0.1] * b, seeds, steps, [i % 2 == 0 for i in range(b)])
    assert len(variants) == 3 and len(set(variants)) == 1, variants


def test_random_seeds_are_int64_drawn_by_the_generator():
    a, b = (random_seeds(8, DEVICE, torch.Generator(DEVICE).manual_seed(1)) for _ in range(2))
    assert a.dtype == torch.int64 and a.shape == (8,) and a.device.type == DEVICE and a.tolist() == b.tolist()
    assert len(set(a.tolist())) == 8 and (a < 0).any()  # the whole int64 range, negative seeds too


def test_settings_of_the_wrong_kind_are_refused_with_their_name():
    m = ts_module()
    x = torch.randn(3, 10, device=DEVICE)
    good = dict(temperatures=rows(1.0, 1.0, 1.0), min_ps=rows(0.0, 0.0, 0.0), seeds=rows(1, 2, 3, dtype=torch.int64),
                steps=rows(0, 0, 0, dtype=torch.int64), greedy=rows(False, False, True, dtype=torch.bool))
    for bad, message in [(dict(seeds=rows(1.0, 2.0, 3.0)), "seeds must be a tensor \\[3\\] of int64"),
                         (dict(min_ps=[0.0, 0.0, 0.0]), "min_ps must be .* got list"),
                         (dict(steps=rows(0, 0, dtype=torch.int64)), "steps must be .* got int64 \\(2,\\)"),
                         (dict(temperatures=rows(1.0, 1.0, 1.0, dtype=torch.float64)), "temperatures must be"),
                         (dict(greedy=rows(0.0, 0.0, 1.0)), "greedy must be a tensor \\[3\\] of bool")]:
        with pytest.raises(ValueError, match=message):
            m.sample_rows_triton(x, **(good | bad))
    with pytest.raises(ValueError, match="logits \\[batch, vocab\\]"):
        m.sample_rows_triton(x[0], **good)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        m.sample_rows_triton(x.double(), **good)
    assert m.sample_rows_triton(x, **(good | dict(greedy=rows(0, 0, 1, dtype=torch.int32))))[2] == x[2].argmax()
    assert m.sample_rows_triton(x[:0], **{k: v[:0] for k, v in good.items()}).shape == (0,)
    strided = torch.randn(3, 20, device=DEVICE)[:, ::2]  # a strided last dimension: copied, the same tokens
    assert m.sample_rows_triton(strided, **good).tolist() == m.sample_rows_triton(strided.contiguous(), **good).tolist()


def test_the_wrapper_reads_nothing_back_from_the_device(monkeypatch):
    "Checks and launch without a host read (what would make a GPU's host wait, and break a CUDA graph's capture)."
    from minivllm.testing import count_host_reads
    m = ts_module()
    launched = []
    # subtle: the kernel's launch is recorded, not run: the interpreter's own copies of its arguments are no read of ours
    monkeypatch.setattr(m, "_sample_rows_kernel", type("Recorder", (), {"__getitem__": lambda self, grid: (
        lambda *args, **kwargs: launched.append(grid))})())
    logits, temps, seeds, steps = random_rows(4, 50, seed=10)
    settings = (rows(*temps), rows(0.0, 0.1, 0.0, 0.2), rows(*seeds, dtype=torch.int64),
                rows(*steps, dtype=torch.int64), rows(True, False, False, False, dtype=torch.bool))
    with count_host_reads() as reads:
        m.sample_rows_triton(logits, *settings)
        m.sample_rows_triton(logits, *settings[:2], random_seeds(4, DEVICE), *settings[3:])
    assert launched == [(4,), (4,)]
    assert reads.count == 0, reads.sites


@pytest.mark.skipif(ON_GPU, reason="on the CPU only")
def test_cpu_tensors_without_the_interpreter_say_how(monkeypatch):
    import minivllm.gpu.triton_layers as layers
    monkeypatch.setattr(layers, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        sample(torch.randn(2, 8), [1.0, 1.0], [0.0, 0.0], [1, 2], [0, 0])


COMPILE = textwrap.dedent('''
    import importlib.util, json, sys
    import torch
    spec = importlib.util.spec_from_file_location("gpu_compile_report", sys.argv[1])
    tool = sys.modules["gpu_compile_report"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    import minivllm.gpu.triton_sampler as m
    from minivllm.gpu.triton_attention import blocks_per_sm
    rows_out, B, V = [], 48, 151936  # Qwen's vocabulary
    for dtype in (torch.float32, torch.bfloat16):
        settings = [torch.empty(B, dtype=d, device="meta") for d in
                    (torch.float32, torch.float32, torch.int64, torch.int64, torch.bool)]
        with tool.recording(m, {"_sample_rows_kernel": "sample"}) as launches:
            m.sample_rows_triton(torch.empty(B, V, dtype=dtype, device="meta"), *settings)
        (_, kernel, args, kwargs), = launches
        for arch in (80, 90):
            compiled = tool.compile_for(kernel, arch, *args, **kwargs)
            use = tool.resource_usage(compiled.asm["cubin"])
            shared = compiled.metadata.shared + use["static_shared"]
            blocks, limit = blocks_per_sm(use["registers"], shared, compiled.metadata.num_warps, arch)
            rows_out.append(dict(dtype=str(dtype)[6:], arch=arch, **use, shared_bytes=shared,
                                 warps=compiled.metadata.num_warps, blocks_per_sm=blocks, limited_by=limit))
    print(json.dumps(rows_out))
''')


def test_the_kernel_compiles_for_sm80_and_sm90_without_spills():
    "Compiled as the JIT would on an A100 and an H100/H200 (no GPU needed), at Qwen's vocabulary: registers, no spill."
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    run = subprocess.run([sys.executable, "-c", COMPILE, str(ROOT / "tools" / "gpu_compile_report.py")],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    print(*report, sep="\n")
    assert sorted((r["dtype"], r["arch"]) for r in report) == [("bfloat16", 80), ("bfloat16", 90), ("float32", 80),
                                                                ("float32", 90)]
    assert all(r["spill_bytes"] == 0 and 0 < r["registers"] <= 128 and r["blocks_per_sm"] >= 1 for r in report), report


def test_the_sampler_with_the_one_pass_draw_equals_the_torch_sampler():
    "`Sampler(draw=sample_rows_triton)`, as a GPU's runner builds it: greedy, seeded and min-p rows in the kernel, top-k and top-p cut first; the torch Sampler's tokens."
    one_pass = Sampler(draw=ts_module().sample_rows_triton)
    logits, temps, seeds, steps = random_rows(12, 301, seed=9)
    temps[0] = temps[5] = 0.0  # greedy rows beside the sampled ones
    min_ps = [0.0, 0.1, 0.0, 0.3] * 3
    for top_ks, top_ps in (([0] * 12, [1.0] * 12), ([0, 5, 40, 0] * 3, [1.0, 0.9, 1.0, 0.5] * 3)):
        args = (temps, top_ks, top_ps, seeds, steps)
        assert one_pass(logits, *args, min_ps=min_ps).tolist() == Sampler()(logits.cpu(), *args, min_ps=min_ps).tolist()
    unseeded = one_pass(logits, temps, [0] * 12, [1.0] * 12, [None] * 12, None, torch.Generator(DEVICE).manual_seed(1))
    assert unseeded[[0, 5]].tolist() == first_max(logits[[0, 5]].float()).tolist()  # greedy rows need no seed
