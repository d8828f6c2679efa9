"""The Triton paged-attention kernel (notebook 06b) against the reference: variable-length prefill, a cached prefix,
decode, a mixed batch, flash-decoding; then the whole engine through it. Without a GPU it runs in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before minivllm is imported)."""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch
import transformers

from minivllm import LLM, SamplingParams
from minivllm.attention import Attention, attention_backend_name, paged_attention_torch
from minivllm.kv_cache import decode_metadata, prefill_metadata
from minivllm.gpu.triton_attention import HAS_TRITON, TRITON_RUNS_ON_CPU
from minivllm.testing import (ATTENTION_TOL, PagedCase, check_prefill_then_decode, hf_greedy, interpreter_programs,
                              make_tiny_checkpoint, triton_variants, written_twice)

transformers.logging.set_verbosity_error()
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.skipif(not (HAS_TRITON and (ON_GPU or TRITON_RUNS_ON_CPU)),
                                reason="needs triton (>= 3.2 to run on the CPU, in its interpreter)")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEADS = [(4, 2), (2, 2)]  # (query heads, KV heads): grouped-query and multi-head


def kernel():
    from minivllm.gpu.triton_attention import paged_attention_triton
    return paged_attention_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", (16, 32))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_prefill_over_cached_prefix_then_decode_equals_dense(dtype, heads, block_size, head_dim):
    "Cached prefixes (none, a part of a block, several blocks), a variable-length prefill, a decode: == dense attention."
    case = PagedCase([40, 7, 21, 3], block_size, *heads, dtype, device=DEVICE, head_dim=head_dim, seed=1)
    check_prefill_then_decode(case, [33, 0, 16, 1], backend="triton")


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_without_cache_reads_the_new_keys(dtype):
    "No cached prefix anywhere (block tables None): the keys are read from the new k and v, sequence by sequence."
    case = PagedCase([9, 1, 30, 17], 16, 8, 2, dtype, device=DEVICE, head_dim=64, seed=2)
    md = prefill_metadata(case.tables, [0] * 4, case.lengths, 16, DEVICE)
    assert md.block_tables is None
    out = case.run(lambda *a: kernel()(*a, case.scale), None, None, md)
    torch.testing.assert_close(out.float(), torch.cat(case.expected).view_as(out).float(), **ATTENTION_TOL[dtype])
    warmup = Attention(8, 64, case.scale, 2, backend="triton")  # as the engine's warm-up: no cache at all
    torch.testing.assert_close(case.run(lambda q, k, v, kc, vc, m: warmup(q, k, v, None, None, m), None, None, md),
                               out.flatten(1), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_of_prefills_and_decodes_in_one_launch(dtype):
    "A prefill, a prefill over a cached prefix and two one-token decodes in one metadata: == the reference backend."
    case = PagedCase([7, 50, 2, 33], 16, 4, 2, dtype, device=DEVICE, head_dim=64, seed=3)
    case.store_prefix(case.lengths)
    cached = [0, 30, 1, 32]
    md = prefill_metadata(case.tables, cached, [n - c for n, c in zip(case.lengths, cached)], 16, DEVICE)
    got = case.run(lambda *a: kernel()(*a, case.scale), cached, None, md)
    want = case.run(lambda *a: paged_attention_torch(*a, case.scale), cached, None, md)
    torch.testing.assert_close(got.float(), want.float(), **ATTENTION_TOL[dtype])


@pytest.mark.parametrize("splits", (2, 4, 16))
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_decode_equals_the_plain_kernel(splits, dtype):
    "Flash-decoding's shares, merged, give the one-program result (empty shares included)."
    case = PagedCase([3, 100, 64, 17], 16, 8, 2, dtype, device=DEVICE, head_dim=64, seed=4)
    case.store_prefix(case.lengths)
    md = decode_metadata(case.tables, case.lengths, 16, DEVICE, group_size=None)
    last = [n - 1 for n in case.lengths]
    plain = case.run(lambda *a: kernel()(*a, case.scale, num_splits=1), last, None, md)
    split = case.run(lambda *a: kernel()(*a, case.scale, num_splits=splits), last, None, md)
    torch.testing.assert_close(split.float(), plain.float(), **ATTENTION_TOL[dtype])
    torch.testing.assert_close(split.float().flatten(1), torch.stack([e[-1] for e in case.expected]).float(),
                               **ATTENTION_TOL[dtype])


RACE_HEADS = [(6, 2), (9, 3), (7, 1), (16, 8), (8, 8)]  # groups 3, 3, 7, 2, 1: spare rows in a block for 3 and 7


@pytest.mark.parametrize("order", ("reversed", "shuffled"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("block_size", (16, 32))
@pytest.mark.parametrize("heads", RACE_HEADS)
def test_programs_in_any_order_write_only_their_own_rows(heads, block_size, dtype, order):
    "No output is written by two programs, so the grid in any order gives dense attention: prefill, over a prefix, decode."
    lengths = [38, 29, 41, 47]  # queries across several tiles of keys
    # subtle: 6 and 12 (22 and 28) cached tokens put the last query of a block of 10 and of 4 queries (groups 3 and 7)
    # on a boundary of float32's 16-key (16-bit's 32-key) tiles, where the spare rows' race gave wrong numbers
    for cached in ([0, 0, 0, 0], [6, 12, 22, 28]):
        case = PagedCase(lengths, block_size, *heads, dtype, device=DEVICE, head_dim=16, seed=6)
        case.store_prefix(lengths)  # over a prefix, the kernel reads the new keys from the cache as well
        prefill = prefill_metadata(case.tables, cached, [n - c for n, c in zip(lengths, cached)], block_size, DEVICE)
        decode = decode_metadata(case.tables, lengths, block_size, DEVICE, group_size=None)
        last = [n - 1 for n in lengths]
        # subtle: on a GPU the programs run in the GPU's own order, which is the test; the interpreter is told one
        with interpreter_programs(order, seed=block_size) if not ON_GPU else nullcontext([]) as launches:
            out = case.run(lambda *a: kernel()(*a, case.scale), cached, None, prefill)
            if order == "shuffled":  # (decode has one query a program: no spare rows, so one order is enough)
                one = case.run(lambda *a: kernel()(*a, case.scale, num_splits=4), last, None, decode)
                torch.testing.assert_close(one.flatten(1).float(), torch.stack([e[-1] for e in case.expected]),
                                           **ATTENTION_TOL[dtype])
        assert [written_twice(launch) for launch in launches] == [{}] * len(launches), (heads, cached)
        torch.testing.assert_close(out.flatten(1).float(), torch.cat([e[c:] for e, c in zip(case.expected, cached)]),
                                   **ATTENTION_TOL[dtype])



def shipped_tiles() -> list[tuple[str, int, int, torch.dtype, bool, dict]]:
    "Each variant of the package's triton_tiles.json (a GPU's sweep): its key, head size, group, dtype, phase, tiles."
    from minivllm.gpu.triton_attention import measured_tiles
    rows = []
    for key, chosen in measured_tiles().items():
        _, head, group, dtype, phase = key.split("/")
        rows.append((key, int(head.removeprefix("head")), int(group.removeprefix("group")), getattr(torch, dtype),
                     phase == "decode", chosen))
    return rows


@pytest.mark.parametrize("order", ("reversed", "shuffled"))
def test_the_shipped_measured_tiles_give_dense_attention_in_any_order(order):
    "The tiles a GPU's sweep chose (used there, never on the CPU) against dense attention, the grid in any order."
    from minivllm.gpu.triton_attention import TritonTiles, triton_tiles
    assert shipped_tiles(), "the package ships no measured tiles: tools/gpu_check.py --sweep writes them"
    lengths, cached = [70, 45, 131], [0, 20, 64]  # several tiles of 64 keys; prefixes in and on a tile's edge
    for key, head_dim, group, dtype, decode, chosen in shipped_tiles():
        case = PagedCase(lengths, 16, 2 * group, 2, dtype, device=DEVICE, head_dim=head_dim, seed=7)
        tiles = TritonTiles(triton_tiles(2 * group, 2, decode, dtype).block_m, chosen["tile"], chosen["warps"])
        run = lambda *a: kernel()(*a, case.scale, tiles=tiles)
        case.store_prefix(lengths)
        with interpreter_programs(order, seed=3) if not ON_GPU else nullcontext([]) as launches:
            if decode:
                last = [n - 1 for n in lengths]
                out = case.run(run, last, None, decode_metadata(case.tables, lengths, 16, DEVICE, group_size=None))
                want = torch.stack([e[-1] for e in case.expected])
            else:
                md = prefill_metadata(case.tables, cached, [n - c for n, c in zip(lengths, cached)], 16, DEVICE)
                out = case.run(run, cached, None, md)
                want = torch.cat([e[c:] for e, c in zip(case.expected, cached)])
        assert [written_twice(launch) for launch in launches] == [{}] * len(launches), key
        torch.testing.assert_close(out.flatten(1).float(), want, **ATTENTION_TOL[dtype], msg=key)

def test_padding_rows_of_a_graph_bucket_read_nothing_out_of_bounds():
    "A CUDA-graph bucket pads with rows of context 1 and block table -1: they read block 0, the real rows are right."
    case = PagedCase([5, 20], 16, 4, 2, torch.float32, device=DEVICE, head_dim=64, seed=5)
    case.store_prefix(case.lengths)
    md = decode_metadata(case.tables, case.lengths, 16, DEVICE, group_size=None)
    q = torch.cat([torch.stack([s[0][-1] for s in case.seqs]), torch.randn(2, 4, 64, device=DEVICE)])
    md.block_tables = torch.cat([md.block_tables, torch.full((2, md.block_tables.shape[1]), -1, dtype=torch.int32,
                                                             device=DEVICE)])
    md.context_lens = torch.cat([md.context_lens, torch.ones(2, dtype=torch.int32, device=DEVICE)])
    out = kernel()(q, None, None, case.k_cache, case.v_cache, md, case.scale)
    torch.testing.assert_close(out[:2].flatten(1), torch.stack([e[-1] for e in case.expected]), **ATTENTION_TOL[torch.float32])
    assert out[2:].isfinite().all()


def test_kernel_refuses_what_it_cannot_read():
    q = torch.randn(3, 4, 64, device=DEVICE)
    md = prefill_metadata([[0]], [0], [3], 16, DEVICE)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        kernel()(q.double(), q.double()[:, :2], q.double()[:, :2], None, None, md, 0.1)
    with pytest.raises(ValueError, match="head sizes equal and at most 256"):
        kernel()(q, q[:, :3, :32], q[:, :3, :32], None, None, md, 0.1)
    with pytest.raises(ValueError, match="last dimension is contiguous"):
        kernel()(q.transpose(0, 2).contiguous().transpose(0, 2), q[:, :2], q[:, :2], None, None, md, 0.1)
    with pytest.raises(ValueError, match="no cache was given"):
        kernel()(q, q[:, :2], q[:, :2], None, None, decode_metadata([[0]] * 3, [1] * 3, 16, DEVICE), 0.1)


def test_kernel_on_cpu_tensors_without_the_interpreter_says_how(monkeypatch):
    import minivllm.gpu.triton_attention as tri
    monkeypatch.setattr(tri, "INTERPRETED", False)
    q = torch.randn(3, 4, 64)
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1 before minivllm is imported"):
        tri.paged_attention_triton(q, q[:, :2], q[:, :2], None, None, prefill_metadata([[0]], [0], [3], 16), 0.1)


def test_backend_names_ours_and_vllms():
    assert [attention_backend_name(n) for n in ("TRITON_ATTN", "triton", "FLASH_ATTN", "TORCH_SDPA", None)] == \
        ["triton", "triton", "flash", "sdpa", None]
    with pytest.raises(ValueError, match="unknown attention backend 'paged'"):
        attention_backend_name("paged")


@pytest.mark.skipif(ON_GPU, reason="on the CPU only: the interpreter is off in the child")
def test_triton_on_the_cpu_without_the_interpreter_is_a_clear_error(tmp_path):
    "Forcing the kernel on the CPU without TRITON_INTERPRET=1 fails at start with the fix, not deep inside triton."
    path = make_tiny_checkpoint(tmp_path / "m")
    code = f"from minivllm import LLM; LLM({str(path)!r}, attention_backend='triton')"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0 and "set TRITON_INTERPRET=1" in done.stderr, done.stderr[-2000:]


TINY = {  # a GQA Qwen3, and a tied multi-head Llama of head size 24 (not a power of two: the kernel pads to 32)
    "qwen3": dict(model_type="qwen3"),
    "llama": dict(model_type="llama", tie_word_embeddings=True, hidden_size=96, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=24, vocab_size=300),
}
PROMPTS = [[1, 5, 9, 2, 44, 17, 3], list(range(3, 40)), [7], [200, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23,
                                                                 24, 25, 26, 27]]


on_cpu_only = pytest.mark.skipif(ON_GPU, reason="the interpreter's engine runs: on a GPU, tools/gpu_check.py compares "
                                                "with transformers on the same GPU")


@on_cpu_only
@pytest.mark.parametrize("name", TINY)
def test_engine_through_the_kernel_equals_transformers(tmp_path, name):
    "The whole engine with every layer on the Triton kernel (float32, blocks of 16, a shared prefix): transformers' tokens."
    path = make_tiny_checkpoint(tmp_path / name, **TINY[name])
    prompts = PROMPTS + [PROMPTS[1][:33] + [5, 6]]  # shares two blocks of the second prompt: a cached prefix
    with LLM(str(path), attention_backend="TRITON_ATTN", max_num_seqs=4, device="cpu") as llm:
        assert {m.backend for m in llm.llm_engine.runner.model.modules() if isinstance(m, Attention)} == {"triton"}
        outs = llm.generate(prompts,
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 8)


@on_cpu_only
def test_engine_at_tp2_takes_the_backend_from_the_environment(tmp_path, monkeypatch):
    "MINIVLLM_ATTENTION_BACKEND reaches every rank: TP=2 through the kernel equals transformers."
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    path = make_tiny_checkpoint(tmp_path / "m")
    with LLM(str(path), tensor_parallel_size=2, max_num_seqs=4, device="cpu") as llm:
        assert llm.llm_engine.args.attention_backend == "triton"
        outs = llm.generate(PROMPTS,
                            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS, 6)


@on_cpu_only
def test_start_up_compiles_every_kernel_variant_a_run_launches(tmp_path):
    "Every variant launched while generating (each a compile on a GPU) was launched by the engine's start-up already."
    import minivllm.gpu.triton_attention as ta
    path = make_tiny_checkpoint(tmp_path / "m", **TINY["qwen3"])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with triton_variants(ta) as launched:
        with LLM(str(path), attention_backend="TRITON_ATTN", max_num_seqs=4, device="cpu") as llm:
            started = len(launched)
            llm.generate(PROMPTS, params, use_tqdm=False)
            llm.generate([PROMPTS[1][:33] + [5, 6]], params, use_tqdm=False)  # two blocks cached: over a prefix
    at_start, running = set(launched[:started]), set(launched[started:])
    assert running <= at_start, running - at_start
    # a prefill, a prefill over a prefix and a decode: what a run launches on the CPU (no splits; the C++ store)
    assert len(running) == 3 and {name for name, _ in running} == {"_paged_attention_kernel"}


def test_a_damaged_tiles_table_is_a_clear_error(tmp_path, monkeypatch):
    "A triton_tiles.json that is not the sweep's table names the file and the fix."
    import importlib.resources

    import minivllm.gpu.triton_attention as ta
    (tmp_path / ta.TILES_FILE).write_text("{not json")
    monkeypatch.setattr(importlib.resources, "files", lambda package: tmp_path)
    ta.measured_tiles.cache_clear()
    try:
        with pytest.raises(ValueError, match="run the sweep again"):
            ta.measured_tiles()
    finally:
        ta.measured_tiles.cache_clear()
