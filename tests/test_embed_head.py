"""The vocab-parallel embedding and LM head (its logits and its greedy pick) against the unsharded reference, in one
process and on 1-4 CPU ranks."""
from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

from minivllm.distributed import Communicator
from minivllm.shm_allreduce import ShmCommunicator
from minivllm.testing import TinyLM, load_tensors, run_on_ranks
from minivllm.layers.embed_head import (ParallelLMHead, VocabParallelEmbedding, pad_vocab_size,
                                        vocab_range)

# subtle: tests/ is not a package, so a spawned rank cannot count on importing this module by name;
# ship this module's functions and classes to the ranks by value instead.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# The embedding is a lookup plus a sum of zeros, so it is exact. The head is a matmul whose sharded and
# unsharded versions may accumulate in a different order: float32 within a few ulps, bfloat16 within
# about one bf16 ulp (2**-8 relative) of the result.
EXACT = dict(rtol=0, atol=0)
HEAD_TOL = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def reference(V, H, dtype, seed=0):
    "The full weight `[V, H]`, bias `[V]` and hidden states `[2, 3, H]`, identical on every rank."
    g = torch.Generator().manual_seed(seed)
    W, b, hidden = torch.randn(V, H, generator=g), torch.randn(V, generator=g), torch.randn(2, 3, H, generator=g)
    return W.to(dtype), b.to(dtype), hidden.to(dtype)


def edge_ids(V, N, n_random=6, seed=0):
    "First and last id of every rank's non-empty range (so 0 and V-1) plus random ids, shaped `[1, n]`."
    edges = {i for start, end in (vocab_range(V, r, N) for r in range(N)) if end > start for i in (start, end - 1)}
    rand = torch.randint(0, V, (n_random,), generator=torch.Generator().manual_seed(seed)).tolist()
    return torch.tensor(sorted(edges) + rand)[None]


def check_vocab_layers(comm, cases):
    "On every rank, check each `(V, H)` case against F.embedding / F.linear; rank 0 returns what it checked."
    N, rank, done = comm.world_size, comm.rank, []
    for V, H in cases:
        ids = edge_ids(V, N)
        for dtype in (torch.float32, torch.bfloat16):
            W, b, hidden = reference(V, H, dtype)
            emb = VocabParallelEmbedding(V, H, params_dtype=dtype, comm=comm)
            load_tensors(emb, {"weight": W})
            assert emb.weight.dtype == dtype
            # every rank agrees on the split, and the ranges tile [0, V) in rank order
            ranges = comm.all_gather(torch.tensor([emb.vocab_start_idx, emb.vocab_end_idx]), dim=0).view(N, 2).tolist()
            assert ranges == [list(vocab_range(V, r, N)) for r in range(N)]
            assert ranges[0][0] == 0 and ranges[-1][1] == V
            assert all(ranges[r][1] == ranges[r + 1][0] for r in range(N - 1))
            torch.testing.assert_close(emb(ids), F.embedding(ids, W), **EXACT)
            for bias in (False, True):
                head = ParallelLMHead(V, H, bias=bias, params_dtype=dtype, comm=comm)
                load_tensors(head, {"weight": W, "bias": b} if bias else {"weight": W})
                logits, greedy = head(hidden), head.greedy_tokens(hidden)
                if rank == 0:
                    torch.testing.assert_close(logits, F.linear(hidden, W, b if bias else None), **HEAD_TOL[dtype])
                    assert torch.equal(greedy, logits.argmax(-1))  # the gathered pairs pick what argmax picks
                else:
                    assert logits is None and greedy is None, f"rank {rank} got logits"
            # tied: a checkpoint with no lm_head.weight fills both layers
            tied = TinyLM(V, H, tie=True, params_dtype=dtype, comm=comm)
            assert list(dict(tied.named_parameters())) == ["embed_tokens.weight"]
            load_tensors(tied, {"embed_tokens.weight": W})
            torch.testing.assert_close(tied.embed_tokens(ids), F.embedding(ids, W), **EXACT)
            logits = tied.lm_head(hidden)
            if rank == 0: torch.testing.assert_close(logits, hidden @ W.T, **HEAD_TOL[dtype])
            else: assert logits is None
            done.append((V, H, str(dtype).removeprefix("torch.")))
    return dict(tp_size=N, done=done)


CASES = {
    1: [(1000, 16), (37, 8)],
    2: [(1000, 16), (37, 8), (151936, 8)],  # 37: one padding row; 151936 (Qwen3): none
    3: [(1000, 16), (4, 8)],  # 334/334/332+2; 2/2/0+2: the last rank owns no ids
    4: [(1000, 16), (1001, 8), (6, 8)],  # 250 each; 251/251/251/248+3; 2/2/2/0+2
}


@pytest.mark.parametrize("tp", sorted(CASES))
def test_matches_unsharded_reference_on_ranks(tp):
    out = run_on_ranks(check_vocab_layers, tp, CASES[tp], connect=ShmCommunicator.connect, timeout_s=300)
    assert out["tp_size"] == tp
    assert out["done"] == [(V, H, dt) for V, H in CASES[tp] for dt in ("float32", "bfloat16")]


# ---- in one process: every shard built with a placement Communicator(rank, world_size), no process group ----

@pytest.mark.parametrize("N", [1, 2, 3, 5, 8])
def test_vocab_split_tiles_the_vocabulary(N):
    for V in [*range(1, 40), 1000, 1001, 32000, 151936]:
        padded = pad_vocab_size(V, N)
        assert padded % N == 0 and V <= padded < V + N
        ranges = [vocab_range(V, r, N) for r in range(N)]
        assert ranges[0][0] == 0 and ranges[-1][1] == V
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(0 <= end - start <= padded // N for start, end in ranges)


def test_vocab_split_examples():
    assert [vocab_range(1000, r, 3) for r in range(3)] == [(0, 334), (334, 668), (668, 1000)]
    assert [vocab_range(151936, r, 2) for r in range(2)] == [(0, 75968), (75968, 151936)]
    emb = VocabParallelEmbedding(1000, 8, comm=Communicator(2, 3))
    assert (emb.num_embeddings, emb.num_embeddings_padded, emb.num_embeddings_per_rank) == (1000, 1002, 334)
    assert (emb.vocab_start_idx, emb.vocab_end_idx, tuple(emb.weight.shape)) == (668, 1000, (334, 8))


@pytest.mark.parametrize("N", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("V", [1, 7, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_shards_sum_and_concatenate_to_the_reference(N, V, bias):
    H = 8
    W, b, hidden = reference(V, H, torch.float32)
    ids = edge_ids(V, N)
    embs = [VocabParallelEmbedding(V, H, comm=Communicator(r, N)) for r in range(N)]
    heads = [ParallelLMHead(V, H, bias=bias, comm=Communicator(r, N)) for r in range(N)]
    for e in embs: load_tensors(e, {"weight": W})
    for h in heads: load_tensors(h, {"weight": W, "bias": b} if bias else {"weight": W})
    # each shard's local part; the collectives would add and concatenate them
    torch.testing.assert_close(sum(e.embed_local(ids) for e in embs), F.embedding(ids, W), **EXACT)
    logits = torch.cat([h.local_logits(hidden) for h in heads], dim=-1)
    assert logits.shape[-1] == pad_vocab_size(V, N)
    torch.testing.assert_close(logits[..., :V], F.linear(hidden, W, b if bias else None), **HEAD_TOL[torch.float32])
    torch.testing.assert_close(logits[..., V:], torch.zeros(2, 3, pad_vocab_size(V, N) - V))  # zeroed padding


def test_padding_rows_are_zeroed_over_garbage():
    emb = VocabParallelEmbedding(1000, 4, comm=Communicator(2, 3))
    emb.weight.data.fill_(float("nan"))
    W = torch.randn(1000, 4)
    load_tensors(emb, {"weight": W})
    torch.testing.assert_close(emb.weight.data[:332], W[668:])
    torch.testing.assert_close(emb.weight.data[332:], torch.zeros(2, 4))


def test_tied_checkpoint_fills_both_layers_in_every_shard():
    V, H, N = 1000, 8, 3
    W, _, hidden = reference(V, H, torch.float32)
    models = [TinyLM(V, H, tie=True, comm=Communicator(r, N)) for r in range(N)]
    for m in models:
        assert m.lm_head.weight is m.embed_tokens.weight
        load_tensors(m, {"embed_tokens.weight": W})
    logits = torch.cat([m.lm_head.local_logits(hidden) for m in models], dim=-1)[..., :V]
    torch.testing.assert_close(logits, hidden @ W.T, **HEAD_TOL[torch.float32])


def test_params_dtype_and_loader_conversion():
    assert VocabParallelEmbedding(10, 4).weight.dtype == torch.get_default_dtype()
    head = ParallelLMHead(10, 4, bias=True, params_dtype=torch.bfloat16)
    assert head.weight.dtype == head.bias.dtype == torch.bfloat16
    assert ParallelLMHead(10, 4).bias is None
    W = torch.randn(10, 4)
    load_tensors(head, {"weight": W, "bias": torch.zeros(10)})  # a float32 checkpoint into bfloat16 parameters
    torch.testing.assert_close(head.weight.data, W.to(torch.bfloat16), **EXACT)


# ---- bad input ----

@pytest.mark.parametrize("shape", [(999, 8), (1001, 8), (1000, 9), (1000,), (334, 8)])
def test_wrong_checkpoint_shape_names_both_shapes(shape):
    emb = VocabParallelEmbedding(1000, 8, comm=Communicator(1, 3))
    with pytest.raises(ValueError) as e:
        emb.weight.weight_loader(emb.weight, torch.zeros(shape))
    msg = str(e.value)
    assert "VocabParallelEmbedding" in msg and str(shape) in msg and "(1000, 8)" in msg


def test_wrong_bias_shape_names_the_head():
    head = ParallelLMHead(1000, 8, bias=True, comm=Communicator(0, 2))
    with pytest.raises(ValueError, match=r"ParallelLMHead: checkpoint tensor has shape \(999,\), expected \(1000,\)"):
        head.bias.weight_loader(head.bias, torch.zeros(999))


def test_an_empty_batch_of_ids_embeds_to_nothing():
    "Token ids are checked at the engine's door (`LLMEngine.add`, tests/test_llm.py), not in the layer."
    assert VocabParallelEmbedding(10, 4)(torch.empty(0, dtype=torch.long)).shape == (0, 4)


@pytest.mark.parametrize("rank, size", [(3, 3), (-1, 2), (0, 0)])
def test_bad_tp_arguments(rank, size):
    with pytest.raises(ValueError, match=f"rank={rank} is not a rank of a group of world_size={size}"):
        VocabParallelEmbedding(1000, 8, comm=Communicator(rank, size))


def test_bad_vocab_size():
    with pytest.raises(ValueError, match="num_embeddings must be positive"):
        ParallelLMHead(0, 8)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_int32_and_int64_ids(dtype):
    W = torch.randn(1000, 4)
    embs = [VocabParallelEmbedding(1000, 4, comm=Communicator(r, 3)) for r in range(3)]
    for e in embs: load_tensors(e, {"weight": W})
    ids = torch.tensor([0, 333, 334, 999], dtype=dtype)
    torch.testing.assert_close(sum(e.embed_local(ids) for e in embs), W[ids.long()], **EXACT)


@pytest.mark.parametrize("N", [1, 2, 3, 4])
def test_greedy_pairs_pick_the_first_of_tied_maxima(N):
    "Logits with exact ties across ranks: the (logit, id) pairs that greedy_tokens gathers pick the lowest id."
    V, H = 12, 4
    W = torch.zeros(V, H)
    W[[2, 7, 11], 0] = 5.0  # three ids tie for the best logit, on different ranks at N > 1
    W[5, 1] = 9.0           # ... unless the hidden state points the other way
    heads = [ParallelLMHead(V, H, comm=CountingGather(r, N)) for r in range(N)]
    for h in heads: load_tensors(h, {"weight": W})
    hidden = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 0, 0]])
    sent = [h.greedy_tokens(hidden) for h in heads]  # each shard's gather records what it sends
    if N == 1:
        picked = sent[0]
    else:
        pairs = torch.cat([h.comm.sent for h in heads], dim=0)
        picked = pairs[..., 1].gather(0, pairs[..., 0].argmax(0, keepdim=True)).squeeze(0).long()
    assert picked.tolist() == F.linear(hidden, W).argmax(-1).tolist() == [2, 5, 0]


class CountingGather(Communicator):
    "A placement whose gather keeps what this rank would send and returns nothing (as on a rank that is not dst)."
    def gather(self, x, dim=-1, dst=0):
        self.sent = x
        return None
