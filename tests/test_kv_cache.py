"""The paged KV cache against plain torch: layout, slot mapping, the store (Triton kernel, C++ store == torch fallback),
attention metadata, and paged attention (variable-length prefill, cached prefix, decode) == dense causal attention."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# subtle: on CPU the Triton kernel runs only in Triton's interpreter, which must be switched on before
# minivllm.kv_cache defines the kernel, i.e. before the module is first imported in this process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import minivllm.attention as attention
import minivllm.kv_cache as kv
import minivllm.gpu.triton_attention as tri
from minivllm.gpu.triton_attention import HAS_TRITON
from minivllm.attention import Attention, attention_backend, causal_mask, cpu_decode_kernel, gather_kv, store_kvcache
from minivllm.kv_cache import (DECODE_GROUP_SIZE, AttentionMetadata, allocate_kv_cache, decode_metadata,
                               kv_cache_bytes_per_block, prefill_metadata, slot_mapping, store_kvcache_torch)
from minivllm.gpu.triton_attention import store_kvcache_triton
from minivllm.testing import (ATTENTION_TOL as TOL, PagedCase, cat_rows, check_prefill_then_decode,
                              tiny_store_inputs)

DTYPES = (torch.float32, torch.bfloat16)
EXACT = dict(rtol=0, atol=0)
HAS_CPU_KERNEL = cpu_decode_kernel() is not None
CPU_BACKENDS = ("torch", "sdpa") + ("cpu",) * HAS_CPU_KERNEL
HEADS = [(4, 2), (2, 2)]  # (query heads, KV heads): grouped-query and multi-head


# ---------------------------------------------------------------------------------------------- helpers

# ---------------------------------------------------------------------------------------------- layout, slots

def test_allocate_kv_cache_layout_and_bytes():
    "One zeroed tensor [2, layers, blocks, block_size, kv_heads, head_dim]; bytes per block match it."
    cache = allocate_kv_cache(3, 5, 4, 2, 8, torch.bfloat16, "cpu")
    assert cache.shape == (2, 3, 5, 4, 2, 8) and cache.dtype == torch.bfloat16 and not cache.any()
    assert cache[1, 2].is_contiguous()
    assert cache.numel() * cache.element_size() == 5 * kv_cache_bytes_per_block(3, 4, 2, 8, torch.bfloat16)
    assert kv_cache_bytes_per_block(28, 256, 8, 128, torch.bfloat16) == 28 * 2**20  # Qwen3-0.6B, TP=1
    assert kv_cache_bytes_per_block(28, 256, 4, 128, torch.float32) == 28 * 2**20  # half the heads, twice the bytes


def test_slot_mapping_hand_worked():
    "Two sequences of 6 and 3 tokens, block tables [5, 1] and [3], blocks of 4."
    assert slot_mapping([5, 1], 0, 6, 4) == [20, 21, 22, 23, 4, 5]
    assert slot_mapping([3], 0, 3, 4) == [12, 13, 14]
    assert slot_mapping([5, 1], 4, 6, 4) == [4, 5]
    assert slot_mapping([5, 1], 7, 8, 4) == [7]
    assert slot_mapping([0, 2], 16, 16, 16) == []
    assert slot_mapping([7, 2], 15, 17, 16) == [127, 32]  # across a block boundary


@pytest.mark.parametrize("start, end", [(0, 9), (-1, 2), (3, 2)])
def test_slot_mapping_rejects_positions_outside_the_table(start, end):
    with pytest.raises(ValueError, match="do not fit in a block table of 2 blocks"):
        slot_mapping([5, 1], start, end, 4)


# ---------------------------------------------------------------------------------------------- the store

def test_store_torch_writes_slots_and_skips_minus_one():
    "Each token's key and value land in its slot's row; the -1 token lands nowhere; other rows stay zero."
    key, value, k_cache, v_cache, slots = tiny_store_inputs(torch.float32, seed=0)
    store_kvcache_torch(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(12, 2, 8), v_cache.view(12, 2, 8)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat_k[slot], key[token], **EXACT)
            torch.testing.assert_close(flat_v[slot], value[token], **EXACT)
    untouched = [s for s in range(12) if s not in slots.tolist()]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_store_rejects_bad_arguments():
    key, value, k_cache, v_cache, slots = tiny_store_inputs(torch.float32, seed=0)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        store_kvcache(key, value, k_cache, v_cache, slots.int())
    with pytest.raises(ValueError, match="slot_mapping must be int64 of shape"):
        store_kvcache(key, value, k_cache, v_cache, slots[:4])
    with pytest.raises(ValueError, match="do not fit keys"):
        store_kvcache(key[:, :1], value[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="key and value must both be"):
        store_kvcache(key, value[:4], k_cache, v_cache, slots)


def test_store_dispatcher_on_cpu_writes_what_the_fallback_writes(monkeypatch):
    "On CPU tensors the dispatcher never calls the Triton kernel (the interpreter is for checking only)."
    def no_triton(*args): raise AssertionError("store_kvcache_triton was called on CPU tensors")
    monkeypatch.setattr(tri, "store_kvcache_triton", no_triton)
    key, value, k_cache, v_cache, slots = tiny_store_inputs(torch.float32, seed=0)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots)
    store_kvcache_torch(key, value, k_ref, v_ref, slots)
    torch.testing.assert_close((k_cache, v_cache), (k_ref, v_ref), **EXACT)


needs_cpu_kernel = pytest.mark.skipif(not HAS_CPU_KERNEL, reason="the CPU kernels could not be built here")


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_store_cpu_kernel_matches_torch(dtype):
    "The C++ store writes what the torch fallback writes, from views into a qkv output and contiguous keys alike."
    g = torch.Generator().manual_seed(3)
    T, heads, head_dim, num_blocks, block_size = 33, 3, 64, 5, 16
    qkv = torch.randn(T, 3 * heads + 2, head_dim, generator=g).to(dtype)  # [T, q|k|v (+2 more q heads), head_dim]
    key, value = qkv[:, 2:2 + heads], qkv[:, 2 + heads:2 + 2 * heads]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[::5] = -1  # skipped tokens (CUDA-graph padding)
    for k, v in ((key, value), (key.contiguous(), value.contiguous())):
        ref = torch.zeros(2, num_blocks, block_size, heads, head_dim, dtype=dtype)
        got = torch.zeros_like(ref)
        store_kvcache_torch(k, v, ref[0], ref[1], slots)
        attention.cpu_store_kernel()(k, v, got[0], got[1], slots)
        torch.testing.assert_close(got, ref, **EXACT)
        store_kvcache(k, v, got[0], got[1], slots)  # the dispatcher takes it on the CPU
        torch.testing.assert_close(got, ref, **EXACT)


@needs_cpu_kernel
def test_store_cpu_kernel_rejects_what_it_cannot_write():
    "A slot past the cache, a dtype that is not the cache's: errors that name the problem, and nothing written."
    key, value, k_cache, v_cache, slots = tiny_store_inputs(torch.float32, seed=0)
    store = attention.cpu_store_kernel()
    with pytest.raises(RuntimeError, match="slot 12 is not in the cache's 12 slots"):
        store(key, value, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 12]))
    assert not k_cache.any() and not v_cache.any()  # checked before the first write
    with pytest.raises(RuntimeError, match="one dtype"):
        store(key.bfloat16(), value.bfloat16(), k_cache, v_cache, slots)
    with pytest.raises(RuntimeError, match="caches must be contiguous"):
        store(key, value, k_cache.transpose(0, 1), v_cache.transpose(0, 1), slots)


needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")


def interpreted(test):
    "Run `test` (the kernel on CPU tensors) where Triton's interpreter can run it; on a GPU the CUDA test below runs."
    for mark in (needs_triton,
                 pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the CUDA kernel test covers it"),
                 pytest.mark.skipif(HAS_TRITON and not tri.TRITON_RUNS_ON_CPU,
                                    reason="triton < 3.2: its interpreter cannot run kernels on CPU tensors")):
        test = mark(test)
    return test


def _check_kernel_runs_here():
    "Fail with the fix if the kernel was defined before TRITON_INTERPRET=1 was set (it then needs a GPU)."
    if not torch.cuda.is_available() and type(tri._store_kvcache_kernel).__name__ != "InterpretedFunction":
        pytest.fail("minivllm.gpu.triton_attention was imported before TRITON_INTERPRET=1 was set, so its Triton kernel needs a "
                    "GPU: set the variable in tests/conftest.py (before any test imports minivllm)")


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, head_dim, slots", [
    (2, 8, (9, 2, -1, 3, 4)),  # D = 16, a power of two
    (3, 4, (-1, 0, 11, -1, 5)),  # D = 12: the kernel's block of 16 is masked
    (1, 2, (-1, -1, -1, -1, -1)),  # all padding: nothing is written
])
def test_store_triton_matches_torch(dtype, heads, head_dim, slots):
    "The Triton kernel (in the interpreter on CPU) writes exactly what the torch fallback writes, -1 slots included."
    _check_kernel_runs_here()
    key, value, k_ref, v_ref, slot_t = tiny_store_inputs(dtype, heads=heads, head_dim=head_dim, slots=slots, seed=0)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    store_kvcache_torch(key, value, k_ref, v_ref, slot_t)
    store_kvcache_triton(key, value, k_tri, v_tri, slot_t)
    torch.testing.assert_close((k_tri, v_tri), (k_ref, v_ref), **EXACT)
    assert int((k_tri != 0).any(-1).any(-1).sum()) == sum(s >= 0 for s in slots)


@interpreted
def test_store_triton_follows_the_row_stride_of_a_qkv_view():
    "Keys and values that are views into one [T, 3, heads, head_dim] qkv tensor."
    _check_kernel_runs_here()
    qkv = torch.randn(4, 3, 2, 8, generator=torch.Generator().manual_seed(1))
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([6, -1, 0, 3])
    (k_ref, v_ref), (k_tri, v_tri) = torch.zeros(2, 2, 4, 2, 8).unbind(0), torch.zeros(2, 2, 4, 2, 8).unbind(0)
    store_kvcache_torch(key, value, k_ref, v_ref, slots)
    store_kvcache_triton(key, value, k_tri, v_tri, slots)
    torch.testing.assert_close((k_tri, v_tri), (k_ref, v_ref), **EXACT)


@needs_triton
def test_store_triton_refuses_cpu_tensors_it_cannot_write(monkeypatch):
    "With a triton whose interpreter cannot write CPU tensors, the kernel refuses them instead of storing nothing."
    monkeypatch.setattr(tri, "TRITON_RUNS_ON_CPU", False)
    key, value, k_cache, v_cache, slots = tiny_store_inputs(torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="cannot run kernels on CPU tensors .* use store_kvcache_torch"):
        store_kvcache_triton(key, value, k_cache, v_cache, slots)
    assert not k_cache.any() and not v_cache.any()


# ---------------------------------------------------------------------------------------------- metadata

def test_prefill_metadata_hand_worked():
    md = prefill_metadata([[5, 1], [3]], [0, 0], [6, 3], block_size=4)
    assert md.is_prefill and md.block_tables is None and md.context_lens is None
    assert md.cu_seqlens_q.tolist() == md.cu_seqlens_k.tolist() == [0, 6, 9]
    assert md.cu_seqlens_q.dtype == md.cu_seqlens_k.dtype == torch.int32
    assert (md.max_seqlen_q, md.max_seqlen_k) == (6, 6)
    assert md.slot_mapping.tolist() == [20, 21, 22, 23, 4, 5, 12, 13, 14] and md.slot_mapping.dtype == torch.int64


def test_prefill_metadata_with_cached_prefix_hand_worked():
    "The first sequence's first block is cached: 2 new tokens attend to 6 keys; block tables padded with -1."
    md = prefill_metadata([[5, 1], [3]], [4, 0], [2, 3], block_size=4)
    assert md.cu_seqlens_q.tolist() == [0, 2, 5] and md.cu_seqlens_k.tolist() == [0, 6, 9]
    assert (md.max_seqlen_q, md.max_seqlen_k) == (3, 6)
    assert md.slot_mapping.tolist() == [4, 5, 12, 13, 14]
    assert md.block_tables.tolist() == [[5, 1], [3, -1]] and md.block_tables.dtype == torch.int32


def test_decode_metadata_hand_worked():
    "The sequences have grown to 7 and 4 tokens: the new ones go to slots 6 and 15."
    md = decode_metadata([[5, 1], [3]], [7, 4], block_size=4)
    assert not md.is_prefill and md.cu_seqlens_q is None
    assert md.slot_mapping.tolist() == [6, 15] and md.slot_mapping.dtype == torch.int64
    assert md.context_lens.tolist() == [7, 4] and md.context_lens.dtype == torch.int32
    assert md.block_tables.tolist() == [[5, 1], [3, -1]] and md.block_tables.dtype == torch.int32


def test_warmup_prefill_metadata_stores_nothing():
    "Sequences without blocks (the engine's warm-up) get slot -1 for every token."
    md = prefill_metadata([[], []], [0, 0], [3, 2], block_size=4)
    assert md.slot_mapping.tolist() == [-1] * 5 and md.block_tables is None


@pytest.mark.parametrize("build, message", [
    (lambda: prefill_metadata([[1]], [0, 0], [1, 1], 4), "one block table, cached count and new count"),
    (lambda: prefill_metadata([[1]], [0], [0], 4), "at least one new token"),
    (lambda: prefill_metadata([[]], [4], [2], 4), "needs the block table"),
    (lambda: prefill_metadata([[1]], [2], [3], 4), "do not fit in a block table"),
    (lambda: decode_metadata([[1]], [0], 4), "at least 1"),
    (lambda: decode_metadata([[1], [2]], [3], 4), "one block table and one context length"),
    (lambda: decode_metadata([[5, 1]], [9], 4), "do not fit in a block table"),
])
def test_metadata_rejects_inconsistent_inputs(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# ---------------------------------------------------------------------------------------------- attention

def test_causal_mask_is_aligned_to_the_end():
    assert torch.equal(causal_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())
    assert causal_mask(2, 5).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert causal_mask(1, 3).all()


def test_gather_kv_reads_sequences_back_in_order():
    "Stored with the slot mapping, read back by block table: the same rows, in position order."
    k_cache = torch.zeros(8, 4, 2, 8)
    keys = torch.randn(9, 2, 8)
    md = prefill_metadata([[5, 1], [3]], [0, 0], [6, 3], block_size=4)
    store_kvcache_torch(keys, keys, k_cache, k_cache.clone(), md.slot_mapping)
    back = gather_kv(k_cache, torch.tensor([[5, 1], [3, -1]], dtype=torch.int32))
    assert back.shape == (2, 8, 2, 8)
    torch.testing.assert_close(back[0, :6], keys[:6], **EXACT)
    torch.testing.assert_close(back[1, :3], keys[6:], **EXACT)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_prefill_and_decode_match_dense(dtype, heads, block_size, backend):
    "No prefix: each sequence attends causally to its own tokens only, in prefill and then in decode."
    case = PagedCase([6, 3, 5, 18, 17], block_size, *heads, dtype, seed=block_size)
    check_prefill_then_decode(case, [0] * 5, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_in_length_groups_matches_dense_and_the_whole_batch(dtype, heads, backend):
    "A batch larger than DECODE_GROUP_SIZE decodes group by group: each row as dense attention and as one big call."
    lengths = [int(n) for n in torch.randint(2, 70, (2 * DECODE_GROUP_SIZE + 5,), generator=torch.Generator().manual_seed(3))]
    case = PagedCase(lengths, 4, *heads, dtype, seed=8)
    check_prefill_then_decode(case, [0] * len(lengths), backend)
    attn, last = Attention(*case.attn_args, backend=backend), [n - 1 for n in lengths]
    grouped = decode_metadata(case.tables, lengths, 4)
    assert len(grouped.decode_groups) == 3
    whole = decode_metadata(case.tables, lengths, 4, group_size=None)
    torch.testing.assert_close(case.run(attn, last, None, grouped), case.run(attn, last, None, whole), **TOL[dtype])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("block_size, lengths, cached", [(4, [12, 7, 20, 9], [8, 4, 0, 5]),
                                                         (16, [20, 7, 12, 40], [16, 0, 3, 32])])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_cached_prefix_matches_dense(dtype, block_size, lengths, cached, backend):
    "Sequences with whole-block, partial-block and no cached prefixes in one prefill batch, then decode."
    case = PagedCase(lengths, block_size, 4, 2, dtype, seed=1)
    check_prefill_then_decode(case, cached, backend)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_cached_prefix_equals_prefill_of_the_whole_prompt(dtype):
    "The new tokens' outputs are those of prefilling the whole prompt at once without any cache."
    lengths, cached = [12, 7, 4], [8, 4, 0]
    case = PagedCase(lengths, 4, 4, 2, dtype, seed=2)
    attn = Attention(*case.attn_args)
    # an earlier request fills the prefix blocks through the layer itself (the third sequence has no prefix)
    attn(*(cat_rows(case.seqs[:2], w, end=cached[:2]) for w in range(3)), case.k_cache, case.v_cache,
         prefill_metadata(case.tables[:2], [0, 0], cached[:2], 4))
    md = prefill_metadata(case.tables, cached, [n - c for n, c in zip(lengths, cached)], 4)
    with_prefix = case.run(attn, cached, None, md)
    whole = [attn(q, k, v, None, None, prefill_metadata([[]], [0], [len(q)], 4)) for q, k, v in case.seqs]
    torch.testing.assert_close(with_prefix, torch.cat([w[c:] for w, c in zip(whole, cached)]), **TOL[dtype])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_dense(dtype, heads, block_size, backend):
    "One new token per sequence over scattered blocks; lengths 1, a full block, one past it, and longer."
    lengths = [1, block_size, block_size + 1, 2 * block_size + 3, 5]
    case = PagedCase(lengths, block_size, *heads, dtype, seed=3)
    last = [n - 1 for n in lengths]
    case.store_prefix(last)
    attn = Attention(*case.attn_args, backend=backend)
    out = case.run(attn, last, None, decode_metadata(case.tables, lengths, block_size))
    torch.testing.assert_close(out.float(), torch.stack([e[-1] for e in case.expected]), **TOL[dtype])
    longest = case.tables[3]
    assert longest != list(range(longest[0], longest[0] + len(longest)))  # its blocks are scattered


@pytest.mark.skipif(not HAS_CPU_KERNEL, reason="the CPU decode kernel could not be built here")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, head_dim", [((9, 3), 64), ((8, 2), 64), ((12, 2), 64), ((16, 8), 128), ((6, 2), 128),
                                             ((6, 2), 80), ((4, 4), 64), ((2, 1), 256)])
def test_cpu_kernel_matches_dense_for_real_head_shapes(dtype, heads, head_dim):
    "Head sizes the kernel unrolls (64, 128) and others (80, 256), 1 to 6 query heads per KV head: equal to dense attention."
    lengths = [1, 16, 17, 40, 3]
    case = PagedCase(lengths, 16, *heads, dtype, head_dim=head_dim, seed=6)
    last = [n - 1 for n in lengths]
    case.store_prefix(last)
    out = case.run(Attention(*case.attn_args, backend="cpu"), last, None, decode_metadata(case.tables, lengths, 16))
    torch.testing.assert_close(out.float(), torch.stack([e[-1] for e in case.expected]), **TOL[dtype])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_decode_padding_rows_store_nothing_and_leave_real_rows_alone(backend):
    "A CUDA-graph-style padded decode batch: slot -1, context length 0, block table of -1."
    lengths = [5, 9]
    case = PagedCase(lengths, 4, 4, 2, torch.float32, seed=4)
    case.store_prefix([4, 8])
    attn = Attention(*case.attn_args, backend=backend)
    q, k, v = (cat_rows(case.seqs, w, [4, 8]) for w in range(3))
    expected = attn(q, k, v, case.k_cache.clone(), case.v_cache.clone(), decode_metadata(case.tables, lengths, 4))
    md = decode_metadata(case.tables, lengths, 4)
    padded = AttentionMetadata(is_prefill=False, slot_mapping=torch.cat([md.slot_mapping, torch.tensor([-1])]),
                               context_lens=torch.cat([md.context_lens, torch.zeros(1, dtype=torch.int32)]),
                               block_tables=torch.cat([md.block_tables, torch.full((1, md.block_tables.shape[1]), -1, dtype=torch.int32)]))
    pad = lambda x: torch.cat([x, torch.randn(1, *x.shape[1:])])
    before = case.k_cache.clone()
    out = attn(pad(q), pad(k), pad(v), case.k_cache, case.v_cache, padded)
    torch.testing.assert_close(out[:2], expected, **EXACT)
    changed = (case.k_cache != before).any(-1).any(-1).flatten().nonzero().flatten().tolist()
    assert changed == sorted(md.slot_mapping.tolist())  # only the real tokens' slots were written


@pytest.mark.parametrize("empty_cache", [None, torch.tensor([])])
def test_attention_without_a_cache(empty_cache):
    "The engine's warm-up runs the model with no cache: plain causal prefill over the new tokens."
    case = PagedCase([6, 3], 4, 4, 2, torch.float32, seed=5)
    attn = Attention(*case.attn_args)
    md = prefill_metadata([[], []], [0, 0], [6, 3], 4)
    out = attn(*(cat_rows(case.seqs, w) for w in range(3)), empty_cache, empty_cache, md)
    torch.testing.assert_close(out, torch.cat(case.expected), **TOL[torch.float32])


def test_attention_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        Attention(6, 8, 0.3, 4)
    with pytest.raises(ValueError, match="unknown attention backend"):
        Attention(4, 8, 0.3, 2, backend="xformers")
    if not attention.HAS_FLASH_ATTN:
        with pytest.raises(ValueError, match="needs flash-attn"):
            Attention(4, 8, 0.3, 2, backend="flash")
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="no cache was given"):
        Attention(4, 8, 0.3, 2)(q, k, k, None, None, decode_metadata([[0], [1]], [1, 1], 4))
    with pytest.raises(ValueError, match=r"expected q \[T, 4, 8\] and k/v \[T, 4, 8\]"):
        Attention(4, 8, 0.3, 4)(q, k, k, None, None, prefill_metadata([[]], [0], [2], 4))


def test_backend_on_cpu_is_the_kernel_for_float32_and_bfloat16_else_sdpa():
    kernel = "cpu" if HAS_CPU_KERNEL else "sdpa"
    assert attention_backend("cpu", torch.float32, 8, is_prefill=False) == kernel
    assert attention_backend("cpu", torch.bfloat16, 8, is_prefill=False) == kernel
    assert attention_backend("cpu", torch.float16, 8, is_prefill=False) == "sdpa"
    assert attention_backend("cpu", torch.float32, 512, is_prefill=False) == "sdpa"  # past the kernel's head size
    # a prefill takes the kernel's backend too: `cpu_prefill` runs the kernel for a few queries over a cached prefix,
    # SDPA for the rest (notebook 06a)
    assert attention_backend("cpu", torch.float32, 8, is_prefill=True) == kernel
    assert attention_backend("cpu", torch.float16, 8, is_prefill=True) == "sdpa"


@pytest.mark.parametrize("env, expect", [({"MINIVLLM_CPU_KERNEL": "0"}, "None\n"),
                                         ({"MINIVLLM_CPU_KERNEL": "1", "MINIVLLM_CACHE": "/dev/null/cannot-be-a-folder"},
                                          "None\n")])
def test_cpu_kernel_can_be_switched_off_and_a_failed_build_falls_back(env, expect):
    "Switched off, or unbuildable (here: a cache folder that cannot exist), the kernel is None and SDPA decodes."
    # (MINIVLLM_CPU_KERNEL=1: the build is tried with any torch, also one older than the kernels are tested with)
    code = ("from minivllm.attention import cpu_decode_kernel as k, attention_backend as b; import torch;"
            "print(k()); assert b('cpu', torch.float32, 8, is_prefill=False) == 'sdpa'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ | env, timeout=120)
    assert done.returncode == 0 and done.stdout == expect, done.stderr
    if "MINIVLLM_CACHE" in env:
        assert "could not be built, using torch" in done.stderr


# ---------------------------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_triton_on_cuda_matches_torch(dtype):
    key, value, k_ref, v_ref, slots = (t.cuda() for t in tiny_store_inputs(dtype, T=5, seed=0))
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    store_kvcache_torch(key, value, k_ref, v_ref, slots)
    store_kvcache(key, value, k_tri, v_tri, slots)
    torch.testing.assert_close((k_tri, v_tri), (k_ref, v_ref), **EXACT)


@needs_cuda
@pytest.mark.parametrize("block_size, cached", [(256, [256, 0, 0]), (16, [32, 16, 0])])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", [None, "sdpa"])
def test_gpu_backends_match_dense(dtype, block_size, cached, backend):
    "The automatic backend (flash-attn where installed and possible, else SDPA) and SDPA, on CUDA."
    case = PagedCase([300, 40, 7], block_size, 4, 2, dtype, device="cuda", head_dim=64, seed=6)
    check_prefill_then_decode(case, cached, backend)


def test_block_tables_follow_their_updates_like_lists():
    "Rows entered, grown and handed to other sequences at random: every selection equals the tables as lists, padded by hand."
    g = torch.Generator().manual_seed(0)
    rand = lambda n: int(torch.randint(0, n, (1,), generator=g))
    num_rows, width = 12, 40
    tables, lists = kv.BlockTables(num_rows, width), [[] for _ in range(num_rows)]
    for _ in range(300):
        updates, touched = [], set()
        for _ in range(rand(5)):
            row = rand(num_rows)
            if row in touched:
                continue
            touched.add(row)
            if rand(3) == 0 or not lists[row]:  # a new sequence takes the row: its table whole
                lists[row] = [rand(1000) for _ in range(rand(width))]
                updates.append((row, 0, list(lists[row])))
            elif len(lists[row]) < width:  # its sequence gains a block
                lists[row].append(rand(1000))
                updates.append((row, len(lists[row]) - 1, lists[row][-1:]))
        tables.update(updates)
        rows = [rand(num_rows) for _ in range(rand(num_rows) + 1)]
        for w in (None, width):
            longest = w or max(len(lists[r]) for r in rows)
            want = torch.tensor([lists[r] + [-1] * (longest - len(lists[r])) for r in rows], dtype=torch.int32)
            assert torch.equal(tables.select(rows, width=w), want)
    assert kv.BlockTables.holding([[], []], max_blocks=3).select([0, 1], width=3).tolist() == [[-1] * 3] * 2
    assert kv.BlockTables.holding([]).select([]).shape == (0, 0)
    with pytest.raises(ValueError, match="does not fit block tables of 1 rows of 5 blocks"):
        kv.BlockTables(1, 5).update([(0, 0, [0] * 39)])
