"""No C++ kernel crashes the interpreter, whatever it is given: a tensor of another device, a wrong dtype, a
non-contiguous view, an empty batch. Each public entry point either answers what torch answers or raises a clear
Python error; the calls run in a child process, so that a crash shows up as a crash, not as a dead test run."""
import json
import subprocess
import sys

import pytest

from minivllm.cpu.kernels import layer_kernels

SCRIPT = r'''
import json, torch
import torch.nn.functional as F
from minivllm import attention as kv
from minivllm.cpu import kernels as ck
from minivllm.kv_cache import decode_metadata

g = torch.Generator().manual_seed(0)
r = lambda *s: torch.randn(*s, generator=g)
meta = lambda t: torch.empty_like(t, device="meta")

def norm_ref(x, w, eps=1e-6):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w
def rope_ref(pos, x, table, d):
    cos, sin = table[pos].chunk(2, dim=-1)
    h = x.unflatten(-1, (-1, d)); a, b = h.chunk(2, dim=-1)
    return torch.cat([a * cos[:, None] - b * sin[:, None], b * cos[:, None] + a * sin[:, None]], -1).flatten(-2)

x, w, table, pos = r(4, 16), r(16), r(10, 8), torch.tensor([0, 3, 9, 1])
key, value, cache = r(3, 2, 8), r(3, 2, 8), torch.zeros(2, 4, 4, 2, 8)
slots = torch.tensor([0, 5, 13])
q = r(2, 4, 8)
md = decode_metadata([[0, 1], [2]], [6, 3], 4, "cpu")
with_md = lambda **changes: md.__class__(**{**md.__dict__, **changes})
xt = r(16, 4).t()  # a strided view [4, 16]

cases = {  # name: (call, reference or None when it must raise)
    "norm, another device": (lambda: ck.add_rms_norm(meta(x), None, meta(w), 1e-6), None),
    "norm, float16": (lambda: ck.add_rms_norm(x.half(), None, w.half(), 1e-6), None),
    "norm, weight of another dtype": (lambda: ck.add_rms_norm(x, None, w.bfloat16(), 1e-6), None),
    "norm, a strided view": (lambda: ck.add_rms_norm(xt, None, w, 1e-6), lambda: norm_ref(xt, w)),
    "norm, an empty batch": (lambda: ck.add_rms_norm(r(0, 16), None, w, 1e-6), lambda: norm_ref(r(0, 16), w)),
    "silu, another device": (lambda: ck.silu_and_mul(meta(x)), None),
    "silu, int64": (lambda: ck.silu_and_mul(x.long()), None),
    "silu, a strided view": (lambda: ck.silu_and_mul(x.t().contiguous().t()), lambda: F.silu(x[:, :8]) * x[:, 8:]),
    "silu, an empty batch": (lambda: ck.silu_and_mul(r(0, 16)), lambda: r(0, 8)),
    "rope, another device": (lambda: ck.rotary_embedding(pos, meta(x), meta(x), table, 8), None),
    "rope, int32 positions": (lambda: ck.rotary_embedding(pos.int(), x, x, table, 8), None),
    "rope, a bfloat16 table": (lambda: ck.rotary_embedding(pos, x, x, table.bfloat16(), 8), None),
    "rope, a position past the table": (lambda: ck.rotary_embedding(torch.tensor([0, 3, 9, 10]), x, x, table, 8), None),
    "rope, an empty batch": (lambda: ck.rotary_embedding(pos[:0], x[:0], x[:0], table, 8)[0], lambda: x[:0]),
    "rope, strided positions": (lambda: ck.rotary_embedding(torch.tensor([0, 9, 3, 9, 9, 9, 1, 9])[::2], x, x, table, 8)[0],
                                lambda: rope_ref(pos, x, table, 8)),
    "argmax, another device": (lambda: ck.argmax_rows(meta(x)), None),
    "argmax, float64": (lambda: ck.argmax_rows(x.double()), None),
    "argmax, no columns": (lambda: ck.argmax_rows(r(2, 0)), None),
    "argmax, a strided view": (lambda: ck.argmax_rows(x.t()), lambda: x.t().argmax(-1)),
    "argmax, an empty batch": (lambda: ck.argmax_rows(r(0, 16)), lambda: r(0, 16).argmax(-1)),
    "philox, another device": (lambda: ck.philox_uniform(meta(pos), pos, 8), None),
    "philox, int32 seeds": (lambda: ck.philox_uniform(pos.int(), pos, 8), None),
    "philox, no columns": (lambda: ck.philox_uniform(pos, pos, 0), None),
    "philox, strided seeds": (lambda: ck.philox_uniform(torch.arange(8)[::2], pos, 9),
                              lambda: ck.philox_uniform(torch.arange(8)[::2].contiguous(), pos, 9)),
    "philox, an empty batch": (lambda: ck.philox_uniform(pos[:0], pos[:0], 8), lambda: r(0, 8)),
    "bitmask, another device": (lambda: ck.apply_bitmask(meta(x), torch.zeros(4, 1, dtype=torch.int32)), None),
    "bitmask, int64 bits": (lambda: ck.apply_bitmask(x, torch.zeros(4, 1, dtype=torch.int64)), None),
    "bitmask, bits past the rows": (lambda: ck.apply_bitmask(x, torch.zeros(5, 1, dtype=torch.int32)), None),
    "bitmask, a strided view": (lambda: ck.apply_bitmask(xt, torch.full((4, 1), -1, dtype=torch.int32)), lambda: xt),
    "bitmask, an empty batch": (lambda: ck.apply_bitmask(r(0, 16), torch.zeros(0, 1, dtype=torch.int32)), lambda: r(0, 16)),
    "store, another device": (lambda: kv.store_kvcache(key, value, meta(cache[0]), meta(cache[1]), slots), None),
    "store, another dtype": (lambda: kv.store_kvcache(key.bfloat16(), value.bfloat16(), cache[0], cache[1], slots), None),
    "store, int32 slots": (lambda: kv.store_kvcache(key, value, cache[0], cache[1], slots.int()), None),
    "store, a slot past the cache": (lambda: kv.store_kvcache(key, value, cache[0], cache[1], torch.tensor([0, 5, 32])), None),
    "store, strided caches": (lambda: kv.store_kvcache(key, value, cache[0].transpose(0, 1), cache[1].transpose(0, 1),
                                                        slots), None),
    "store, an empty batch": (lambda: kv.store_kvcache(key[:0], value[:0], cache[0], cache[1], slots[:0]), "none"),
    "decode, another device": (lambda: kv.paged_decode_attention_cpu(meta(q), cache[0], cache[1], md, 0.3), None),
    "decode, float16": (lambda: kv.paged_decode_attention_cpu(q.half(), cache[0].half(), cache[1].half(), md, 0.3), None),
    "decode, int64 tables": (lambda: kv.paged_decode_attention_cpu(q, cache[0], cache[1],
                                                                    with_md(block_tables=md.block_tables.long()), 0.3), None),
    "decode, an empty batch": (lambda: kv.paged_decode_attention_cpu(q[:0], cache[0], cache[1], with_md(
        block_tables=md.block_tables[:0], context_lens=md.context_lens[:0]), 0.3), lambda: q[:0]),
}
if ck.bf16_gemm() is not None:
    W = r(64, 16).bfloat16(); P = ck.pack_bf16_panels(W); xb = x.bfloat16()
    cases |= {
        "gemm, another device": (lambda: ck.avx512bf16_linear(meta(xb), P, 64), None),
        "gemm, float32 input": (lambda: ck.avx512bf16_linear(x, P, 64), None),
        "gemm, a bias on another device": (lambda: ck.avx512bf16_linear(xb, P, 64, meta(r(64))), None),
        "gemm, a strided view": (lambda: ck.avx512bf16_linear(xb.t().contiguous().t(), P, 64),
                                 lambda: F.linear(xb.float(), W.float()).bfloat16()),
        "gemm, an empty batch": (lambda: ck.avx512bf16_linear(xb[:0], P, 64), lambda: xb[:0, :0].new_zeros(0, 64)),
    }
out = {}
for name, (call, ref) in cases.items():
    try:
        got = call()
    except Exception as e:
        out[name] = ["raised", type(e).__name__, str(e).splitlines()[0]]
        continue
    if callable(ref):
        want = ref()
        ok = got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        out[name] = ["answered", "equal" if ok else f"differs {tuple(got.shape)} {tuple(want.shape)}", ""]
    else:
        out[name] = ["answered", str(ref), ""]
print("RESULT " + json.dumps(out))
'''


@pytest.mark.skipif(layer_kernels() is None, reason="the C++ CPU kernels are off or cannot be built here")
def test_no_cpu_kernel_crashes_on_inputs_it_cannot_take():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"the child died (status {run.returncode}):\n{run.stderr[-3000:]}"
    results = json.loads(next(l for l in run.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    for name, (outcome, kind, message) in results.items():
        if outcome == "raised":
            assert kind in ("ValueError", "RuntimeError", "TypeError"), (name, kind, message)
            assert "attempted to run this operator with Meta" not in message, (name, message)  # our words, not the dispatcher's
        else:
            assert kind in ("equal", "none"), (name, kind)
    must_raise = [n for n in results if any(w in n for w in ("another device", "float16", "another dtype", "int32",
                                                              "int64", "float64", "no columns", "past the", "bfloat16 table",
                                                              "float32 input", "strided caches"))]
    assert all(results[n][0] == "raised" for n in must_raise), {n: results[n] for n in must_raise}
    for name in must_raise:
        if "another device" in name:
            assert "dense CPU tensors" in results[name][2], (name, results[name])
