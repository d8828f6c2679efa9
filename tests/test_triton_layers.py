"""The Triton layer kernels (notebook 06c) against notebook 05's torch operations: add + RMSNorm, SiLU-and-multiply,
rotary embeddings alone and after Qwen3's q/k norm, argmax; in float32, bfloat16 and float16, on a model's layouts
(q and k views of one qkv row), with the grid's programs in any order. Without a GPU they run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before minivllm is imported)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from contextlib import nullcontext

import pytest
import torch

from minivllm.gpu.triton_attention import HAS_TRITON, TRITON_RUNS_ON_CPU
from minivllm.layers.common import RMSNorm, RotaryEmbedding, SiluAndMul
from minivllm.testing import interpreter_programs, written_twice

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.skipif(not (HAS_TRITON and (ON_GPU or TRITON_RUNS_ON_CPU)),
                                reason="needs triton (>= 3.2 to run on the CPU, in its interpreter)")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EXACT = dict(rtol=0, atol=0)
TOL = {torch.float32: {}, torch.bfloat16: EXACT, torch.float16: EXACT}  # float32's rounding; 16-bit: torch's bits
# a float32 step that is not torch's own (squares summed in another order; numpy's exp in the interpreter) can move a
# 16-bit rounding by one ulp, rarely (a few numbers in 100,000)
ULP_TOL = TOL | {torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -8), torch.float16: dict(rtol=2 ** -10, atol=2 ** -11)}


def tl_module():
    import minivllm.gpu.triton_layers as module
    return module


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def random_norm(hidden: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    "Notebook 05's RMSNorm (torch's operations) with a random weight near 1."
    norm = RMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(hidden, generator=torch.Generator().manual_seed(seed)) / 4)
    return norm


def qkv_views(T: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    "q [T, heads, head_dim] and k [T, kv_heads, head_dim]: views of one qkv projection's rows, as a model cuts them."
    qkv = randn(T, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(T, heads, head_dim), k.view(T, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", (False, True))
@pytest.mark.parametrize("layout", ("rows", "3-d", "q heads"))
def test_add_rms_norm_equals_the_torch_norm(dtype, residual, layout):
    "`(norm(x),)` or `(norm(x + r), x + r)` as RMSNorm.forward gives them: contiguous rows, [B, T, H], q's heads in place."
    if layout == "q heads":  # Qwen3's q norm: each head of a view into the qkv row, a width of head_dim
        x, _ = qkv_views(5, 4, 2, 64, dtype, seed=1)
        res = randn(5, 4, 64, dtype=dtype, seed=2) if residual else None
    else:
        shape = (6, 96) if layout == "rows" else (2, 3, 200)  # widths that are no power of two: padded programs
        x, res = randn(*shape, dtype=dtype, seed=1), randn(*shape, dtype=dtype, seed=2) if residual else None
    norm = random_norm(x.shape[-1], dtype)
    got = tl_module().add_rms_norm_triton(x, res, norm.weight, norm.eps)
    if res is None:
        assert len(got) == 1
        torch.testing.assert_close(got[0], norm(x), **ULP_TOL[dtype])
    else:
        want, want_sum = norm(x, res)
        torch.testing.assert_close(got[1], want_sum, **EXACT)
        torch.testing.assert_close(got[0], want, **ULP_TOL[dtype])
    assert all(t.dtype == dtype and t.shape == x.shape for t in got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_torch(dtype):
    "Two column blocks of a row (d = 1,100 > SILU_BLOCK), leading dimensions kept."
    x = randn(2, 2, 2 * 1100, dtype=dtype, seed=3, scale=3.0)
    got = tl_module().silu_and_mul_triton(x)
    assert got.shape == (2, 2, 1100)
    torch.testing.assert_close(got, SiluAndMul()(x), **ULP_TOL[dtype])


POSITIONS = [0, 3, 517, 4095]  # past the first few, the table's last row included


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2)])  # groups 1, 2 and 3
def test_rotary_equals_rotate_and_norm_rotary_equals_norms_then_rotate(dtype, head_dim, heads):
    "q, k views of one qkv row, [T, heads, D] and [T, heads * D]; then q/k norm + rotary in one launch."
    m = tl_module()
    rope = RotaryEmbedding(head_dim, 4096, 1e6).to(DEVICE)
    positions = torch.tensor(POSITIONS, device=DEVICE)
    q, k = qkv_views(len(POSITIONS), *heads, head_dim, dtype, seed=4)
    assert not q.is_contiguous()
    got = m.rotary_embedding_triton(positions, q, k, rope.cos_sin_cache, head_dim)
    torch.testing.assert_close(got, rope.rotate(positions, q, k), **TOL[dtype])
    flat = m.rotary_embedding_triton(positions, q.flatten(1), k.flatten(1), rope.cos_sin_cache, head_dim)
    assert [t.shape for t in flat] == [q.flatten(1).shape, k.flatten(1).shape]
    torch.testing.assert_close((flat[0].view_as(q), flat[1].view_as(k)), got, **EXACT)
    q_norm, k_norm = random_norm(head_dim, dtype, seed=5), random_norm(head_dim, dtype, seed=6)
    fused = m.norm_rotary_triton(positions, q, k, q_norm.weight, k_norm.weight, 1e-6, rope.cos_sin_cache, head_dim)
    torch.testing.assert_close(fused, rope.rotate(positions, q_norm(q), k_norm(k)), **ULP_TOL[dtype])


def test_a_position_outside_the_table_gives_nan_not_a_stray_read():
    rope = RotaryEmbedding(64, 16, 1e4).to(DEVICE)
    q, k = qkv_views(3, 4, 2, 64, torch.float32)
    positions = torch.tensor([2, 16, -1], device=DEVICE)
    got_q, got_k = tl_module().rotary_embedding_triton(positions, q, k, rope.cos_sin_cache, 64)
    assert got_q[1:].isnan().all() and got_k[1:].isnan().all()
    torch.testing.assert_close((got_q[0], got_k[0]), tuple(t[0] for t in rope.rotate(positions[:1], q[:1], k[:1])))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_takes_the_first_maximum_and_the_first_nan(dtype):
    "Ties in one tile and across tiles, a NaN, all -inf, a strided row, a vocabulary of Qwen's size."
    m = tl_module()
    x = randn(5, 5000, dtype=dtype, seed=7)
    x[1, [4100, 4200]] = 50.0  # a tie in the last tile
    x[2, [100, 2148]] = 50.0  # a tie across tiles, in the same lane
    x[3, [10, 3000]] = float("nan")
    x[4] = float("-inf")
    got = m.argmax_rows_triton(x)
    assert got.dtype == torch.int64 and got.tolist() == x.max(dim=-1).indices.tolist()
    assert got[1:].tolist() == [4100, 100, 10, 0]
    assert m.argmax_rows_triton(x[:, ::2]).tolist() == x[:, ::2].max(dim=-1).indices.tolist()
    vocab = randn(1, 151936, dtype=dtype, seed=8)
    assert m.argmax_rows_triton(vocab).tolist() == vocab.max(dim=-1).indices.tolist()


def launch_each_kernel(dtype=torch.bfloat16):
    "One launch of each kernel on small inputs (several programs each): their outputs."
    m = tl_module()
    norm, q_norm, k_norm = random_norm(64, dtype), random_norm(32, dtype, 1), random_norm(32, dtype, 2)
    x, res = randn(5, 64, dtype=dtype, seed=9), randn(5, 64, dtype=dtype, seed=10)
    q, k = qkv_views(3, 6, 2, 32, dtype)
    rope = RotaryEmbedding(32, 64, 1e4).to(DEVICE)
    pos = torch.tensor([1, 9, 63], device=DEVICE)
    return (*m.add_rms_norm_triton(x, res, norm.weight, 1e-6), m.silu_and_mul_triton(randn(3, 2 * 1100, dtype=dtype)),
            *m.rotary_embedding_triton(pos, q, k, rope.cos_sin_cache, 32),
            *m.norm_rotary_triton(pos, q, k, q_norm.weight, k_norm.weight, 1e-6, rope.cos_sin_cache, 32),
            m.argmax_rows_triton(randn(4, 3000, dtype=dtype, seed=11)))


@pytest.mark.parametrize("order", ("reversed", "shuffled"))
def test_programs_in_any_order_write_only_their_own_outputs(order):
    "No address is stored by two programs of a launch, and the grid in any order gives the in-order outputs."
    first = launch_each_kernel()
    # subtle: on a GPU the programs run in the GPU's own order, which is the test; the interpreter is told one
    with interpreter_programs(order, seed=3) if not ON_GPU else nullcontext([]) as launches:
        again = launch_each_kernel()
    assert len(launches) == (0 if ON_GPU else 5)
    assert [written_twice(launch) for launch in launches] == [{}] * len(launches)
    torch.testing.assert_close(again, first, **EXACT)


def test_the_batch_size_chooses_no_new_variant():
    "Batches of 1, 3 and 16 tokens launch one compiled variant of each kernel: no argument that changes with the batch chooses one."
    from minivllm.testing import triton_variants
    m = tl_module()
    norm, head_norm = random_norm(64, torch.bfloat16), random_norm(32, torch.bfloat16)
    rope = RotaryEmbedding(32, 64, 1e4).to(DEVICE)
    with triton_variants(m) as variants:
        for T in (1, 3, 16):
            x = randn(T, 64, dtype=torch.bfloat16)
            m.add_rms_norm_triton(x, x, norm.weight, 1e-6)
            m.silu_and_mul_triton(x)
            q, k = qkv_views(T, 4, 2, 32, torch.bfloat16)
            m.add_rms_norm_triton(q, None, head_norm.weight, 1e-6)  # the q norm: [T, heads, head_dim] in place
            pos = torch.arange(T, device=DEVICE)
            m.rotary_embedding_triton(pos, q, k, rope.cos_sin_cache, 32)
            m.norm_rotary_triton(pos, q, k, head_norm.weight, head_norm.weight, 1e-6, rope.cos_sin_cache, 32)
            m.argmax_rows_triton(randn(T, 300, dtype=torch.float32))
    assert len(variants) == 3 * 6
    assert sorted(name for name, _ in set(variants)) == sorted(
        ["_add_rms_norm_kernel"] * 2 + ["_silu_and_mul_kernel", "_argmax_rows_kernel"] + ["_rotary_kernel"] * 2)


def test_layer_ops_bind_into_the_layers_and_give_their_bits():
    "The ops object has the C++ operators' names and calls: RMSNorm, SiluAndMul and RotaryEmbedding take it unchanged."
    m = tl_module()
    assert m.layer_ops_for("cpu", torch.float32) is None  # a CPU model: the C++ kernels, never the interpreter
    assert m.layer_ops_for(DEVICE, torch.int32, interpreted=True) is None
    ops = m.layer_ops_for(DEVICE, torch.bfloat16, interpreted=True)
    assert {"add_rms_norm", "silu_and_mul", "rotary_embedding", "argmax_rows", "norm_rotary"} <= set(vars(ops))
    norm, act, rope = random_norm(64, torch.bfloat16), SiluAndMul(), RotaryEmbedding(32, 64, 1e4).to(DEVICE)
    x, res = randn(3, 64, dtype=torch.bfloat16, seed=12), randn(3, 64, dtype=torch.bfloat16, seed=13)
    q, k = qkv_views(3, 4, 2, 32, torch.bfloat16)
    pos = torch.tensor([0, 5, 40], device=DEVICE)
    want = norm(x), norm(x, res), act(x), rope(pos, q, k)
    for layer in (norm, act, rope):
        layer.use_kernels(ops)
    assert norm.kernel is ops.add_rms_norm and act.kernel is ops.silu_and_mul and rope.kernel is ops.rotary_embedding
    torch.testing.assert_close((norm(x), norm(x, res), act(x), rope(pos, q, k)), want, **ULP_TOL[torch.bfloat16])


def test_kernels_refuse_what_they_cannot_read():
    m = tl_module()
    x = randn(2, 64)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        m.silu_and_mul_triton(x.double())
    with pytest.raises(ValueError, match="even last dimension"):
        m.silu_and_mul_triton(x[:, :7])
    with pytest.raises(ValueError, match="a residual like x"):
        m.add_rms_norm_triton(x, x[:1], torch.ones(64, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="of x's dtype"):
        m.add_rms_norm_triton(x, None, torch.ones(64, device=DEVICE, dtype=torch.bfloat16), 1e-6)
    rope = RotaryEmbedding(64, 16, 1e4).to(DEVICE)
    q, k = qkv_views(2, 4, 2, 64, torch.float32)
    pos = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="float32 \\[max_position, head_dim\\]"):
        m.rotary_embedding_triton(pos, q, k, rope.cos_sin_cache.half(), 64)
    with pytest.raises(ValueError, match="must be \\[T, heads, 32\\]"):
        m.rotary_embedding_triton(pos, q, k, rope.cos_sin_cache[:, :32], 32)
    with pytest.raises(ValueError, match="positions must be integers"):
        m.rotary_embedding_triton(pos.float(), q, k, rope.cos_sin_cache, 64)
    with pytest.raises(ValueError, match="both norms' weights"):
        m.norm_rotary_triton(pos, q, k, None, None, 1e-6, rope.cos_sin_cache, 64)
    with pytest.raises(ValueError, match="0 < n < 2\\^31"):
        m.argmax_rows_triton(x[:, :0])


def test_empty_batches_launch_nothing():
    m = tl_module()
    x = randn(0, 64)
    assert m.add_rms_norm_triton(x, x, torch.ones(64, device=DEVICE), 1e-6)[0].shape == (0, 64)
    assert m.silu_and_mul_triton(x).shape == (0, 32)
    assert m.argmax_rows_triton(x).shape == (0,)
    rope = RotaryEmbedding(64, 16, 1e4).to(DEVICE)
    got = m.rotary_embedding_triton(torch.zeros(0, dtype=torch.int64, device=DEVICE), x.view(0, 1, 64),
                                    x.view(0, 1, 64), rope.cos_sin_cache, 64)
    assert [t.shape for t in got] == [(0, 1, 64)] * 2


@pytest.mark.skipif(ON_GPU, reason="on the CPU only")
def test_cpu_tensors_without_the_interpreter_say_how(monkeypatch):
    m = tl_module()
    monkeypatch.setattr(m, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        m.silu_and_mul_triton(torch.randn(2, 8))
    assert m.layer_ops_for("cpu", torch.float32, interpreted=True) is None


def test_the_module_loads_without_triton():
    "Without triton the module imports, names its kernels nowhere, and `layer_ops_for` says None: torch serves."
    code = textwrap.dedent('''
        import importlib.abc, importlib.util, sys
        real_find_spec = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "triton" else real_find_spec(name, *a)
        class Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "triton":
                    raise ModuleNotFoundError("No module named 'triton' (blocked by the test)")
        sys.meta_path.insert(0, Absent())
        import torch
        from minivllm.gpu import triton_layers as m
        assert not m.HAS_TRITON and "triton" not in sys.modules
        assert m.layer_ops_for("cuda", torch.bfloat16) is None
        try:
            m.silu_and_mul_triton(torch.randn(2, 8))
        except RuntimeError as e:
            print("OK" if "pip install triton" in str(e) else e)
    ''')
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "OK", run.stderr[-3000:]


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_a_model_on_the_triton_kernels_gives_transformers_greedy_tokens(tmp_path, model_type):
    "Bound when the model is built (notebook 07), the Triton kernels keep float32 greedy tokens equal to transformers'."
    from minivllm.models import DecoderAttention, load_model
    from minivllm.testing import greedy_generate, hf_greedy, make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / model_type, model_type, tie_word_embeddings=model_type == "llama")
    model = load_model(path, device=DEVICE)
    model.choose_implementations(DEVICE, "triton", block_size=16, layer_kernels="triton")
    attention = next(m for m in model.modules() if isinstance(m, DecoderAttention))
    assert (attention.norm_rotary is not None) == (model_type == "qwen3")  # Qwen3 norms q and k: one kernel with RoPE
    prompts = [[3, 17, 42, 5, 9], [11, 2]]
    assert greedy_generate(model, prompts, 6) == hf_greedy(path, prompts, 6)


def test_a_decoder_layer_launches_at_most_twelve_kernels():
    "One decode step through a decoder layer on the fused kernels: at most 12 kernels (torch's small layers: about 60)."
    from minivllm.bench.gpu_step import decoder_layer_kernels
    fused, unfused = decoder_layer_kernels("triton", device=DEVICE), decoder_layer_kernels("torch", device=DEVICE)
    assert fused.total <= 12, dict(fused.kernels)
    assert unfused.total >= 40, dict(unfused.kernels)
    assert fused.kernels["aten.mm"] == 4 and not any(k.startswith("aten.") and k != "aten.mm" for k in fused.kernels)


def test_asking_for_triton_layer_kernels_without_triton_says_how(monkeypatch):
    "layer_kernels='triton' where triton is absent is a clear error, not torch's operations in silence."
    import minivllm.gpu as gpu
    from minivllm.models import layer_ops
    monkeypatch.setattr(gpu, "HAS_TRITON", False)
    monkeypatch.setattr(gpu, "layer_ops_for", lambda *a, **k: None)
    with pytest.raises(ValueError, match="pip install triton"):
        layer_ops("triton", "cuda", torch.bfloat16)
