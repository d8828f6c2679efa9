"""Equivalence tests of `minivllm.layers.linear` against plain `F.linear` on the full weights, at TP = 1, 2 and 4
on CPU ranks (the shared-memory communicator, gloo for what does not fit); GQA head splits; the bias added once;
error messages; two TP groups at once on one machine."""
from __future__ import annotations

import functools
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

from minivllm.distributed import Communicator
from minivllm.shm_allreduce import ShmCommunicator
from minivllm.testing import gqa_attention, load_layer, rand, run_on_ranks, split_heads
from minivllm.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                    ReplicatedLinear, RowParallelLinear, heads_per_rank)

# subtle: spawned ranks import a by-reference function's module by name; that works for this file only while
# pytest's default import mode puts tests/ on sys.path (`--import-mode=importlib` gives `No module named 'tests'`).
# Shipping this module's functions by value works under any import mode.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TPS = [1, 2, 4]
DTYPES = [torch.float32, torch.bfloat16]
# float32: the sharded sums differ from the dense one only in summation order (~1e-6 for outputs of order one).
# bfloat16 has 8 significant bits (eps = 2**-7); each rank rounds its partial sum to bf16 before the all-reduce,
# which adds roundings of its own: allow 2.5 eps (the largest error measured here is about half of that).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
IN, OUT, MID = 32, 48, 64          # all divisible by 1, 2 and 4
HEAD, HIDDEN = 4, 32
GQA = [(32, 8), (4, 2), (8, 1)]    # (query heads, KV heads): plain split, replication at TP=4, MQA


# ---------------------------------------------------------------- what every rank runs

def stack_ranks(comm, t):
    "Every rank's `t`, stacked along a new first dim (rank r at index r)."
    return comm.all_gather(t.unsqueeze(0).contiguous(), dim=0)


def rank_layers(comm, x, W, b, W2, b2, Wg, Wu, bg, bu, Wd, bd):
    "All the linear layers on this rank, built with its communicator; every rank's outputs, stacked."
    n, r, bias, dt = comm.world_size, comm.rank, b is not None, W.dtype
    kw = dict(params_dtype=dt, comm=comm)
    x_r = x.chunk(n, dim=-1)[r]  # this rank's input features, for the row layers fed with `x`
    rep = load_layer(ReplicatedLinear(IN, OUT, bias, **kw), W, b)
    col = load_layer(ColumnParallelLinear(IN, OUT, bias, **kw), W, b)
    col_gathered = load_layer(ColumnParallelLinear(IN, OUT, bias, gather_output=True, **kw), W, b)
    row = load_layer(RowParallelLinear(IN, OUT, bias, **kw), W, b)
    row_partial = load_layer(RowParallelLinear(IN, OUT, bias, reduce_results=False, **kw), W, b)
    row2 = load_layer(RowParallelLinear(OUT, IN, bias, **kw), W2, b2)
    gate_up = MergedColumnParallelLinear(IN, [MID, MID], bias, **kw)
    load_layer(gate_up, Wg, bg, shard_id=0)
    load_layer(gate_up, Wu, bu, shard_id=1)
    down = load_layer(RowParallelLinear(MID, IN, bias, **kw), Wd, bd)
    gate, up = gate_up(x).chunk(2, dim=-1)
    s = lambda t: stack_ranks(comm, t)
    return dict(replicated=s(rep(x)), column=s(col(x)), column_gathered=s(col_gathered(x)), row=s(row(x_r)),
                row_partial=s(row_partial(x_r)), column_row=s(row2(F.silu(col(x)))),
                gate_up=s(gate_up(x)), mlp=s(down(F.silu(gate) * up)))


def rank_qkv(comm, x, Wq, Wk, Wv, bq, bk, bv, nq, nkv):
    "A QKV layer on this rank; every rank's q, k, v and the global head ids it holds."
    qkv = QKVParallelLinear(HIDDEN, HEAD, nq, nkv, bias=bq is not None, params_dtype=Wq.dtype, comm=comm)
    for sid, w, b in zip("qkv", (Wq, Wk, Wv), (bq, bk, bv)):
        load_layer(qkv, w, b, shard_id=sid)
    q, k, v = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
    s = lambda t: stack_ranks(comm, t)
    return dict(q=s(q), k=s(k), v=s(v), q_heads=s(torch.tensor(list(qkv.q_head_ids))),
                kv_heads=s(torch.tensor(list(qkv.kv_head_ids))))


def rank_bias_once(comm):
    "A row-parallel layer with zero weight: its output is its bias, once, whatever the TP size."
    row = load_layer(RowParallelLinear(IN, OUT, bias=True, comm=comm), torch.zeros(OUT, IN), torch.arange(1.0, OUT + 1))
    return stack_ranks(comm, row(torch.ones(2, IN // comm.world_size)))


def run_cases(comm, cases):
    "Run every `(fn, kwargs)` of `cases` on this rank; one launch for all of them."
    return {name: fn(comm, **kwargs) for name, (fn, kwargs) in cases.items()}


# ---------------------------------------------------------------- inputs, launches and references (parent)

def layer_inputs(dtype, bias):
    t = lambda *shape, seed: rand(*shape, seed=seed, dtype=dtype)
    return dict(x=t(2, 5, IN, seed=1), W=t(OUT, IN, seed=2), b=t(OUT, seed=3) if bias else None,
                W2=t(IN, OUT, seed=4), b2=t(IN, seed=5) if bias else None,
                Wg=t(MID, IN, seed=6), Wu=t(MID, IN, seed=7), bg=t(MID, seed=8) if bias else None,
                bu=t(MID, seed=9) if bias else None, Wd=t(IN, MID, seed=10), bd=t(IN, seed=11) if bias else None)


def qkv_inputs(nq, nkv, dtype, bias):
    t = lambda *shape, seed: rand(*shape, seed=seed, dtype=dtype)
    return dict(x=t(5, HIDDEN, seed=20), Wq=t(nq * HEAD, HIDDEN, seed=21), Wk=t(nkv * HEAD, HIDDEN, seed=22),
                Wv=t(nkv * HEAD, HIDDEN, seed=23), bq=t(nq * HEAD, seed=24) if bias else None,
                bk=t(nkv * HEAD, seed=25) if bias else None, bv=t(nkv * HEAD, seed=26) if bias else None,
                nq=nq, nkv=nkv)


QKV_CASES = [(nq, nkv, dtype, bias) for nq, nkv in GQA
             for dtype, bias in [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)]]


@functools.cache
def results(tp):
    "Launch `tp` ranks once, run every case on them; returns `{case: (inputs, rank outputs)}`."
    cases = {("layers", dtype, bias): (rank_layers, layer_inputs(dtype, bias)) for dtype in DTYPES for bias in (False, True)}
    cases |= {("qkv",) + c: (rank_qkv, qkv_inputs(*c)) for c in QKV_CASES}
    cases |= {("bias_once",): (rank_bias_once, {})}
    outs = run_on_ranks(run_cases, tp, cases, connect=ShmCommunicator.connect, timeout_s=300)
    return {name: (kwargs, outs[name]) for name, (_, kwargs) in cases.items()}


def ref_linear(x, W, b):
    return F.linear(x, W, b)


def rank_slice(t, r, n):
    "Rank r's block of the last dim of `t`, split n ways."
    return t.chunk(n, dim=-1)[r]


params = pytest.mark.parametrize
dtype_ids = {torch.float32: "fp32", torch.bfloat16: "bf16"}


# ---------------------------------------------------------------- equivalence at TP = 1, 2, 4

@params("bias", [False, True], ids=["nobias", "bias"])
@params("dtype", DTYPES, ids=dtype_ids.get)
@params("tp", TPS, ids=lambda n: f"tp{n}")
class TestLayersMatchDense:
    def get(self, tp, dtype, bias):
        inp, out = results(tp)[("layers", dtype, bias)]
        return inp, out, TOL[dtype]

    def test_replicated(self, tp, dtype, bias):
        inp, out, tol = self.get(tp, dtype, bias)
        for r in range(tp):
            torch.testing.assert_close(out["replicated"][r], ref_linear(inp["x"], inp["W"], inp["b"]), **tol)

    def test_column_each_rank_has_its_slice(self, tp, dtype, bias):
        inp, out, tol = self.get(tp, dtype, bias)
        ref = ref_linear(inp["x"], inp["W"], inp["b"])
        for r in range(tp):
            torch.testing.assert_close(out["column"][r], rank_slice(ref, r, tp), **tol)
            torch.testing.assert_close(out["column_gathered"][r], ref, **tol)

    def test_row_all_reduced(self, tp, dtype, bias):
        inp, out, tol = self.get(tp, dtype, bias)
        for r in range(tp):
            torch.testing.assert_close(out["row"][r], ref_linear(inp["x"], inp["W"], inp["b"]), **tol)

    def test_row_partial_sums(self, tp, dtype, bias):
        inp, out, tol = self.get(tp, dtype, bias)
        partial = out["row_partial"]
        torch.testing.assert_close(partial.float().sum(0), ref_linear(inp["x"], inp["W"], inp["b"]).float(), **tol)
        for r in range(1, tp):  # only rank 0's partial sum carries the bias
            x_r, W_r = rank_slice(inp["x"], r, tp), rank_slice(inp["W"], r, tp)
            torch.testing.assert_close(partial[r], ref_linear(x_r, W_r, None), **tol)

    def test_column_then_row_is_dense_two_layer(self, tp, dtype, bias):
        inp, out, tol = self.get(tp, dtype, bias)
        ref = ref_linear(F.silu(ref_linear(inp["x"], inp["W"], inp["b"])), inp["W2"], inp["b2"])
        for r in range(tp):
            torch.testing.assert_close(out["column_row"][r], ref, **tol)

    def test_merged_gate_up_is_two_linears(self, tp, dtype, bias):
        inp, out, tol = self.get(tp, dtype, bias)
        gate, up = ref_linear(inp["x"], inp["Wg"], inp["bg"]), ref_linear(inp["x"], inp["Wu"], inp["bu"])
        for r in range(tp):  # rank r holds [gate shard r; up shard r]
            torch.testing.assert_close(out["gate_up"][r], torch.cat([rank_slice(gate, r, tp), rank_slice(up, r, tp)], -1), **tol)
        ref_mlp = ref_linear(F.silu(gate) * up, inp["Wd"], inp["bd"])
        for r in range(tp):
            torch.testing.assert_close(out["mlp"][r], ref_mlp, **tol)


@params("tp", TPS, ids=lambda n: f"tp{n}")
def test_row_parallel_adds_bias_exactly_once(tp):
    _, out = results(tp)[("bias_once",)]
    bias = torch.arange(1.0, OUT + 1)
    for r in range(tp):  # were it added on every rank, this would be tp * bias
        torch.testing.assert_close(out[r], bias.expand(2, OUT), atol=0, rtol=0)


def test_a_placed_shard_refuses_to_reduce():
    "A shard built with a placement (no process group) computes locally, and refuses the collective it cannot do."
    row = load_layer(RowParallelLinear(IN, OUT, comm=Communicator(1, 2)), rand(OUT, IN, seed=0))
    with pytest.raises(RuntimeError, match="places a shard as rank 1 of 2 but has no process group"):
        row(torch.ones(2, IN // 2))
    col = load_layer(ColumnParallelLinear(IN, OUT, gather_output=True, comm=Communicator(1, 2)), rand(OUT, IN, seed=0))
    with pytest.raises(RuntimeError, match="has no process group"):
        col(torch.ones(2, IN))


def expected_heads(nq, nkv, tp, r):
    "Rank r's global q heads and KV heads, written out plainly (not with the layer's own formula)."
    q = list(range(r * nq // tp, (r + 1) * nq // tp))
    kv = list(range(r * nkv // tp, (r + 1) * nkv // tp)) if tp <= nkv else [r // (tp // nkv)]
    return q, kv


@params("nq,nkv,dtype,bias", QKV_CASES, ids=[f"{nq}q{nkv}kv-{dtype_ids[d]}-{'bias' if b else 'nobias'}" for nq, nkv, d, b in QKV_CASES])
@params("tp", TPS, ids=lambda n: f"tp{n}")
def test_qkv_rank_outputs_are_head_slices(tp, nq, nkv, dtype, bias):
    inp, out = results(tp)[("qkv", nq, nkv, dtype, bias)]
    tol = TOL[dtype]
    x = inp["x"]
    full_q = split_heads(ref_linear(x, inp["Wq"], inp["bq"]), nq)
    full_k = split_heads(ref_linear(x, inp["Wk"], inp["bk"]), nkv)
    full_v = split_heads(ref_linear(x, inp["Wv"], inp["bv"]), nkv)
    full_attn = gqa_attention(full_q.float(), full_k.float(), full_v.float())
    group = nq // nkv
    for r in range(tp):
        q_ids, kv_ids = expected_heads(nq, nkv, tp, r)
        assert out["q_heads"][r].tolist() == q_ids and out["kv_heads"][r].tolist() == kv_ids
        assert sorted({h // group for h in q_ids}) == kv_ids  # the KV heads its q heads read: all here
        q, k, v = split_heads(out["q"][r], len(q_ids)), split_heads(out["k"][r], len(kv_ids)), split_heads(out["v"][r], len(kv_ids))
        torch.testing.assert_close(q, full_q[q_ids], **tol)
        torch.testing.assert_close(k, full_k[kv_ids], **tol)
        torch.testing.assert_close(v, full_v[kv_ids], **tol)
        torch.testing.assert_close(gqa_attention(q.float(), k.float(), v.float()), full_attn[q_ids], **tol)


# ---------------------------------------------------------------- shapes, head bookkeeping (one process)

@params("tp", TPS)
def test_shard_shapes_dtypes_and_loaders(tp):
    for r in range(tp):
        kw = dict(comm=Communicator(r, tp), params_dtype=torch.bfloat16)
        layers = {ReplicatedLinear(IN, OUT, True, **kw): (OUT, IN),
                  ColumnParallelLinear(IN, OUT, True, **kw): (OUT // tp, IN),
                  RowParallelLinear(IN, OUT, True, **kw): (OUT, IN // tp),
                  MergedColumnParallelLinear(IN, [MID, MID], True, **kw): (2 * MID // tp, IN),
                  QKVParallelLinear(HIDDEN, HEAD, 32, 8, True, **kw): ((32 + 16) * HEAD // tp, HIDDEN)}
        for layer, shape in layers.items():
            assert tuple(layer.weight.shape) == shape and tuple(layer.bias.shape) == shape[:1]
            for p in (layer.weight, layer.bias):
                assert p.dtype == torch.bfloat16 and not p.requires_grad
                assert p.weight_loader.__self__ is layer


@params("tp", TPS)
def test_merged_unequal_parts_each_rank(tp):
    "Three parts of different sizes: rank r's output is [part0 slice r; part1 slice r; part2 slice r]."
    sizes, x = [16, 32, 8], rand(3, IN, seed=30)
    Ws, bs = [rand(n, IN, seed=31 + i) for i, n in enumerate(sizes)], [rand(n, seed=41 + i) for i, n in enumerate(sizes)]
    for r in range(tp):
        layer = MergedColumnParallelLinear(IN, sizes, bias=True, comm=Communicator(r, tp))
        for i, (W, b) in enumerate(zip(Ws, bs)):
            load_layer(layer, W, b, shard_id=i)
        want = torch.cat([rank_slice(ref_linear(x, W, b), r, tp) for W, b in zip(Ws, bs)], dim=-1)
        torch.testing.assert_close(layer(x), want, **TOL[torch.float32])


def test_default_dtype_and_no_bias():
    layer = ColumnParallelLinear(IN, OUT)
    assert layer.weight.dtype == torch.get_default_dtype() and layer.bias is None
    assert (layer.tp_rank, layer.tp_size) == (0, 1)


def test_loader_casts_checkpoint_dtype():
    W = rand(OUT, IN, seed=0)
    layer = load_layer(RowParallelLinear(IN, OUT, comm=Communicator(1, 2), params_dtype=torch.bfloat16), W)
    assert torch.equal(layer.weight, W[:, IN // 2:].to(torch.bfloat16))


@params("nq,nkv,tp,expected", [(32, 8, 1, (32, 8, 1)), (32, 8, 4, (8, 2, 1)), (32, 8, 8, (4, 1, 1)),
                                (32, 8, 16, (2, 1, 2)), (4, 2, 2, (2, 1, 1)), (4, 2, 4, (1, 1, 2)),
                                (8, 1, 4, (2, 1, 4)), (16, 16, 4, (4, 4, 1))])
def test_qkv_sizes(nq, nkv, tp, expected):
    layer = QKVParallelLinear(HIDDEN, HEAD, nq, nkv, comm=Communicator(tp - 1, tp))
    assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas) == expected
    assert (layer.q_size, layer.kv_size) == (expected[0] * HEAD, expected[1] * HEAD)
    assert heads_per_rank(nq, nkv, tp) == expected


def test_qkv_default_kv_heads_is_multi_head_attention():
    layer = QKVParallelLinear(HIDDEN, HEAD, 8, comm=Communicator(1, 2))
    assert (layer.total_num_kv_heads, layer.num_kv_heads, list(layer.kv_head_ids)) == (8, 4, [4, 5, 6, 7])


def test_every_valid_gqa_split_keeps_attention_local():
    "For every valid (Q heads, KV heads, TP): each rank's q heads read only KV heads it holds; all heads are covered."
    checked = 0
    for nkv in (1, 2, 3, 4, 8):
        for group in (1, 2, 3, 4, 7):
            nq = nkv * group
            for tp in range(1, nq + 1):
                try:
                    num_heads, num_kv, replicas = heads_per_rank(nq, nkv, tp)
                except ValueError:
                    assert nq % tp or (nkv % tp and tp % nkv)
                    continue
                layers = [QKVParallelLinear(8, 2, nq, nkv, comm=Communicator(r, tp)) for r in range(tp)]
                assert [h for l in layers for h in l.q_head_ids] == list(range(nq))
                for l in layers:
                    assert sorted({h // group for h in l.q_head_ids}) == list(l.kv_head_ids)
                holders = [sum(kv in l.kv_head_ids for l in layers) for kv in range(nkv)]
                assert holders == [replicas] * nkv
                checked += 1
    assert checked > 50


# ---------------------------------------------------------------- bad input: clear ValueErrors

@params("nq,nkv,tp,match", [
    (14, 14, 4, r"tensor_parallel_size=4 does not divide num_attention_heads=14; "
                r"valid tensor_parallel_size values for this model: \[1, 2, 7, 14\]"),
    (14, 2, 4, r"tensor_parallel_size=4 does not divide num_attention_heads=14; .*: \[1, 2, 14\]"),
    (6, 3, 2, r"tensor_parallel_size=2 neither divides num_key_value_heads=3 nor is a multiple of it.*: \[1, 3, 6\]"),
    (32, 8, 3, r"tensor_parallel_size=3 does not divide num_attention_heads=32"),
    (8, 2, 16, r"tensor_parallel_size=16 does not divide num_attention_heads=8; .*: \[1, 2, 4, 8\]"),
    (4, 3, 2, r"num_attention_heads=4 is not a positive multiple of num_key_value_heads=3"),
])
def test_qkv_heads_that_do_not_split(nq, nkv, tp, match):
    with pytest.raises(ValueError, match=match):
        QKVParallelLinear(HIDDEN, HEAD, nq, nkv, comm=Communicator(0, tp))


@params("make,match", [
    (lambda: ColumnParallelLinear(IN, 6, comm=Communicator(0, 4)), r"ColumnParallelLinear output_size=6 is not divisible by 4"),
    (lambda: RowParallelLinear(14, OUT, comm=Communicator(0, 4)), r"RowParallelLinear input_size=14 is not divisible by 4"),
    (lambda: MergedColumnParallelLinear(IN, [6, 10], comm=Communicator(0, 4)), r"output_sizes\[0\]=6 is not divisible by 4"),
    (lambda: ColumnParallelLinear(IN, OUT, comm=Communicator(2, 2)), r"rank=2 is not a rank of a group of world_size=2"),
    (lambda: RowParallelLinear(IN, OUT, comm=Communicator(0, 0)), r"rank=0 is not a rank of a group of world_size=0"),
], ids=["column", "row", "merged", "rank", "size"])
def test_sizes_that_do_not_split(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@params("shard_id", [2, -1, "gate", None])
def test_merged_bad_shard_id(shard_id):
    layer = MergedColumnParallelLinear(IN, [MID, MID], comm=Communicator(0, 2))
    with pytest.raises(ValueError, match=r"shard_id=.* does not exist; valid ids are \[0, 1\]"):
        layer.weight.weight_loader(layer.weight, torch.zeros(MID, IN), shard_id)


@params("shard_id", ["o", "Q", 0])
def test_qkv_bad_shard_id(shard_id):
    layer = QKVParallelLinear(HIDDEN, HEAD, 4, 2, comm=Communicator(0, 2))
    with pytest.raises(ValueError, match=r"shard_id=.* does not exist; valid ids are 'q', 'k', 'v'"):
        layer.weight.weight_loader(layer.weight, torch.zeros(4 * HEAD, HIDDEN), shard_id)


@params("make,tensor,shard_id,match", [
    (lambda: ReplicatedLinear(IN, OUT), torch.zeros(IN, OUT), None,
     r"ReplicatedLinear weight: expected the full checkpoint tensor of shape \(48, 32\), got \(32, 48\)"),
    (lambda: ColumnParallelLinear(IN, OUT, comm=Communicator(1, 2)), torch.zeros(OUT // 2, IN), None,
     r"ColumnParallelLinear weight: expected .* \(48, 32\), got \(24, 32\)"),
    (lambda: RowParallelLinear(IN, OUT, comm=Communicator(1, 2)), torch.zeros(OUT, IN // 2), None,
     r"RowParallelLinear weight: expected .* \(48, 32\), got \(48, 16\)"),
    (lambda: MergedColumnParallelLinear(IN, [MID, 2 * MID], comm=Communicator(0, 2)), torch.zeros(MID, IN), 1,
     r"MergedColumnParallelLinear weight shard 1: expected .* \(128, 32\), got \(64, 32\)"),
    (lambda: QKVParallelLinear(HIDDEN, HEAD, 4, 2, comm=Communicator(0, 2)), torch.zeros(4 * HEAD, HIDDEN), "k",
     r"QKVParallelLinear weight shard 'k': expected .* \(8, 32\), got \(16, 32\)"),
], ids=["replicated", "column", "row", "merged", "qkv"])
def test_wrong_checkpoint_shape(make, tensor, shard_id, match):
    layer = make()
    with pytest.raises(ValueError, match=match):
        load_layer(layer, tensor, shard_id=shard_id)


def test_wrong_bias_shape():
    layer = RowParallelLinear(IN, OUT, bias=True, comm=Communicator(0, 2))
    with pytest.raises(ValueError, match=r"RowParallelLinear bias: expected .* \(48,\), got \(24,\)"):
        layer.bias.weight_loader(layer.bias, torch.zeros(OUT // 2))


# ---------------------------------------------------------------- two TP groups on one machine

def meet(comm, folder, me, other):
    "Run in TP group `me`; rank 0 waits until group `other` is also running, so both groups are alive at once."
    x = comm.all_reduce(torch.ones(1))
    if comm.rank == 0:
        Path(folder, me).touch()
        deadline = time.monotonic() + 120
        while not Path(folder, other).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"TP group {other} never ran while group {me} was running")
            time.sleep(0.05)
    return comm.all_reduce(x).item()


def test_two_tp_groups_at_once(tmp_path):
    got, errors = {}, []

    def launch(me, other):
        try:
            got[me] = run_on_ranks(meet, 2, str(tmp_path), me, other, connect=ShmCommunicator.connect, timeout_s=180)
        except BaseException as e:  # report it from the main thread
            errors.append(e)

    threads = [threading.Thread(target=launch, args=pair) for pair in (("a", "b"), ("b", "a"))]
    for t in threads: t.start()
    for t in threads: t.join()
    assert not errors, errors
    assert got == {"a": 4.0, "b": 4.0}
