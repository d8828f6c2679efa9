"""RMSNorm, rotary embedding, SiLU-and-mul and the sampler against transformers and against the mathematics."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TopKLogitsWarper,
                                                   TopPLogitsWarper)
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from minivllm.config import Config
from minivllm.cpu import use_cpu_kernels
from minivllm.layers.embed_head import first_max
from minivllm.testing import hf_rope, hf_rotate
from minivllm.layers.common import RMSNorm, RotaryEmbedding, SiluAndMul, get_rope, rope_inv_freq
from minivllm.sampler import (GREEDY_TEMPERATURE, MASK32, Sampler, apply_min_p, apply_penalties, apply_top_k_top_p,
                              check_sampling_inputs, exponential_noise, int64_seed, mask_tokens, philox4x32, seeded_noise)
from minivllm.sampling_params import ParamError, SamplingParams

transformers.logging.set_verbosity_error()

EXACT = dict(rtol=0, atol=0)
# Our rotation is done in float32 and rounded once; HF rounds cos, sin and both products to the model dtype.
# The two differ by about one ulp of |x| (randn inputs: |x| <= ~5).
ROPE_TOL = {torch.float32: EXACT, torch.bfloat16: EXACT, torch.float16: EXACT}  # we round where transformers rounds
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
LLAMA32 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def forward_tol(x):
    "forward in float32 on the CPU runs the C++ kernels (notebook 04a): float32's rounding of HF, not its bits."
    return {} if use_cpu_kernels(x) else EXACT


# ---------------------------------------------------------------- RMSNorm

def norms(hidden, dtype, eps, seed=0):
    "A Qwen3RMSNorm and an RMSNorm with the same random weight, in `dtype`."
    hf, ours = Qwen3RMSNorm(hidden, eps=eps), RMSNorm(hidden, eps=eps)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hidden, generator=gen(seed)))
        ours.weight.copy_(hf.weight)
    return hf.to(dtype), ours.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,eps", [((7, 64), 1e-6), ((2, 5, 96), 1e-5), ((3, 4, 16), 1e-6)])
def test_rmsnorm_matches_hf(dtype, shape, eps):
    hf, ours = norms(shape[-1], dtype, eps)
    x, res = torch.randn(*shape, generator=gen(1)).to(dtype), torch.randn(*shape, generator=gen(2)).to(dtype)
    torch.testing.assert_close(ours.rms_norm(x), hf(x), **EXACT)  # the torch path: HF's bits in every dtype
    torch.testing.assert_close(ours.rms_norm(res + x), hf(res + x), **EXACT)
    torch.testing.assert_close(ours(x), hf(x), **forward_tol(x))
    out, new_res = ours(x, res)
    torch.testing.assert_close(new_res, res + x, **EXACT)
    torch.testing.assert_close(out, hf(res + x), **forward_tol(x))
    assert out.dtype == new_res.dtype == dtype


def test_rmsnorm_chained_residual_matches_hf_block_order():
    "Two sublayers as a decoder layer runs them: norm, f, add, norm, g, add."
    hf1, ours1 = norms(32, torch.bfloat16, 1e-6, seed=3)
    hf2, ours2 = norms(32, torch.bfloat16, 1e-6, seed=4)
    f, g = torch.nn.Linear(32, 32).bfloat16(), torch.nn.Linear(32, 32).bfloat16()
    x = torch.randn(6, 32, generator=gen(5)).bfloat16()
    with torch.no_grad():
        h = x + f(hf1(x))  # HF: residual = x; h = f(norm(x)); h = residual + h
        h_hf = h + g(hf2(h))
        a = f(ours1(x))
        y, residual = ours2(a, x)
        h_ours = residual + g(y)
    torch.testing.assert_close(h_ours, h_hf, **EXACT)


def test_rmsnorm_parameters():
    norm = RMSNorm(8, eps=1e-5)
    assert list(norm.state_dict()) == ["weight"] and norm.weight.equal(torch.ones(8)) and norm.eps == 1e-5
    assert "8, eps=1e-05" in repr(norm)


# ---------------------------------------------------------------- SiLU and mul

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    gate, up = torch.randn(4, 3, 10, generator=gen(1)).to(dtype), torch.randn(4, 3, 10, generator=gen(2)).to(dtype)
    out = SiluAndMul()(torch.cat([gate, up], dim=-1))
    assert out.shape == (4, 3, 10) and out.dtype == dtype
    torch.testing.assert_close(out, F.silu(gate) * up)


def test_silu_and_mul_odd_width():
    with pytest.raises(ValueError, match="even last dimension"):
        SiluAndMul()(torch.randn(2, 5))


# ---------------------------------------------------------------- rotary embedding

@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("base", [1e4, 5e5, 1e6])
@pytest.mark.parametrize("scaling", [None, LLAMA31, LLAMA32], ids=["default", "llama3.1", "llama3.2"])
def test_inv_freq_matches_hf(head_dim, base, scaling):
    torch.testing.assert_close(rope_inv_freq(head_dim, base, scaling), hf_rope(head_dim, 64, base, scaling).inv_freq,
                               **EXACT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "default"}, LLAMA31, LLAMA32],
                         ids=["none", "default", "llama3.1", "llama3.2"])
@pytest.mark.parametrize("head_dim,base,max_pos", [(64, 1e6, 40960), (128, 5e5, 131072)])
def test_rotary_matches_hf(dtype, scaling, head_dim, base, max_pos):
    T = 16
    positions = torch.cat([torch.tensor([0, 1, 2, 8191, 8192, max_pos - 1]),
                           torch.randint(0, max_pos, (T - 6,), generator=gen(1))])
    q = torch.randn(T, 4, head_dim, generator=gen(2)).to(dtype)
    k = torch.randn(T, 2, head_dim, generator=gen(3)).to(dtype)
    rope = RotaryEmbedding(head_dim, max_pos, base, scaling)
    q_ours, k_ours = rope.rotate(positions, q, k)  # the torch path
    q_hf, k_hf = hf_rotate(hf_rope(head_dim, max_pos, base, scaling), positions, q, k)
    assert q_ours.dtype == k_ours.dtype == dtype and q_ours.shape == q.shape and k_ours.shape == k.shape
    torch.testing.assert_close(q_ours, q_hf, **ROPE_TOL[dtype])
    torch.testing.assert_close(k_ours, k_hf, **ROPE_TOL[dtype])
    q_fwd, k_fwd = rope(positions, q, k)  # forward: the C++ kernel in float32 on the CPU
    assert q_fwd.dtype == dtype and q_fwd.shape == q.shape and k_fwd.shape == k.shape
    torch.testing.assert_close((q_fwd, k_fwd), (q_hf, k_hf), **forward_tol(q))


def test_rotary_flattened_and_strided_inputs():
    "q, k as views of a fused QKV output `[T, (4 + 2 + 2) * head_dim]`: flattened and not contiguous."
    T, hd = 5, 16
    rope = RotaryEmbedding(hd, 100, 1e4)
    qkv = torch.randn(T, 8 * hd, generator=gen(1))
    q, k, v = qkv.split([4 * hd, 2 * hd, 2 * hd], dim=-1)
    assert not q.is_contiguous()
    positions = torch.tensor([3, 0, 99, 50, 7])
    q_flat, k_flat = rope(positions, q, k)
    q_heads, k_heads = rope(positions, q.reshape(T, 4, hd), k.reshape(T, 2, hd))
    assert q_flat.shape == (T, 4 * hd) and k_flat.shape == (T, 2 * hd)
    torch.testing.assert_close(q_flat, q_heads.flatten(1), **EXACT)
    torch.testing.assert_close(k_flat, k_heads.flatten(1), **EXACT)
    torch.testing.assert_close((q_flat, k_flat), rope.rotate(positions, q, k), **forward_tol(q))
    assert qkv.equal(torch.cat([q, k, v], -1))  # the input is not modified


def test_rotary_position_zero_is_identity_and_norm_preserved():
    rope = RotaryEmbedding(32, 64, 1e4)
    q, k = torch.randn(3, 2, 32, generator=gen(1)), torch.randn(3, 1, 32, generator=gen(2))
    q0, k0 = rope(torch.zeros(3, dtype=torch.long), q, k)
    torch.testing.assert_close(q0, q, **EXACT)
    q5, _ = rope(torch.full((3,), 5), q, k)
    torch.testing.assert_close(q5.norm(dim=-1), q.norm(dim=-1))


@pytest.mark.parametrize("scaling", [None, LLAMA31], ids=["default", "llama3"])
def test_rotary_scores_depend_on_distance_only(scaling):
    rope = RotaryEmbedding(64, 20000, 5e5, scaling)
    q, k = torch.randn(1, 1, 64, generator=gen(1)), torch.randn(1, 1, 64, generator=gen(2))
    score = lambda m, n: (rope(torch.tensor([m]), q, k)[0] * rope(torch.tensor([n]), q, k)[1]).sum()
    for shift in (1, 100, 12345):
        torch.testing.assert_close(score(10, 3), score(10 + shift, 3 + shift), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rope_type", ["yarn", "linear", "dynamic", "longrope", "su"])
def test_rotary_unsupported_scaling(rope_type):
    with pytest.raises(ValueError, match=rf"unsupported rope scaling '{rope_type}': minivllm implements "
                                         r"\('default', 'llama3'\)"):
        RotaryEmbedding(64, 128, 1e4, {"rope_type": rope_type, "factor": 2.0})


def test_rotary_legacy_type_key():
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'"):
        rope_inv_freq(64, 1e4, {"type": "yarn", "factor": 2.0})
    torch.testing.assert_close(rope_inv_freq(64, 5e5, {**LLAMA31, "type": "llama3"}), rope_inv_freq(64, 5e5, LLAMA31))


def test_rotary_errors():
    rope = RotaryEmbedding(16, 32, 1e4)
    q, k = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 32\).*got 0..32"):
        rope(torch.tensor([0, 32]), q, k)
    with pytest.raises(ValueError, match="positions must lie in"):
        rope(torch.tensor([-3, 1]), q, k)
    with pytest.raises(ValueError, match="1-d integer tensor"):
        rope(torch.tensor([[0, 1]]), q, k)
    with pytest.raises(ValueError, match="1-d integer tensor"):
        rope(torch.tensor([0.0, 1.0]), q, k)
    with pytest.raises(ValueError, match=r"expected \[2, heads, 16\]"):
        rope(torch.tensor([0, 1]), torch.randn(2, 2, 8), k)
    with pytest.raises(ValueError, match=r"expected \[2, heads, 16\]"):
        rope(torch.tensor([0, 1]), q, torch.randn(2, 24))
    with pytest.raises(ValueError, match=r"expected \[2, heads, 16\]"):
        rope(torch.tensor([0, 1]), torch.randn(3, 2, 16), k)
    with pytest.raises(ValueError, match="even head_dim"):
        RotaryEmbedding(15, 32, 1e4)
    rope(torch.tensor([], dtype=torch.long), q[:0], k[:0])  # an empty batch is fine


def test_rotary_table_stays_float32():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        rope = RotaryEmbedding(32, 64, 1e4, LLAMA31)
    finally:
        torch.set_default_dtype(default)
    assert rope.cos_sin_cache.dtype == torch.float32
    torch.testing.assert_close(rope.cos_sin_cache, RotaryEmbedding(32, 64, 1e4, LLAMA31).cos_sin_cache, **EXACT)
    assert list(rope.state_dict()) == []  # derived from the config, never loaded from a checkpoint
    with pytest.raises(TypeError, match="not float32"):
        rope.to(torch.bfloat16)(torch.tensor([1]), torch.randn(1, 1, 32), torch.randn(1, 1, 32))


def tiny_config(**kw):
    base = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                rope_theta=5e5, rope_scaling=dict(LLAMA31))
    return Config(**{**base, **kw})


def test_get_rope_is_shared_per_arguments():
    rope = get_rope(tiny_config())
    assert get_rope(tiny_config(num_hidden_layers=3, tensor_parallel_size=2)) is rope
    assert get_rope(tiny_config(rope_scaling=dict(reversed(list(LLAMA31.items()))))) is rope  # key order is irrelevant
    for other in (dict(rope_scaling=None), dict(rope_theta=1e4), dict(head_dim=32, hidden_size=128),
                  dict(max_position_embeddings=512), dict(rope_scaling={**LLAMA31, "factor": 32.0})):
        assert get_rope(tiny_config(**other)) is not rope
    assert (rope.head_dim, rope.max_position, rope.base, rope.rope_scaling) == (16, 256, 5e5, LLAMA31)
    cfg = tiny_config()
    cfg.rope_scaling = {"rope_type": "yarn", "factor": [1.0]}  # mutated after validation: still a clear error
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'"):
        get_rope(cfg)


# ---------------------------------------------------------------- sampler

def sample(logits, temperature=1.0, top_k=0, top_p=1.0, **kw):
    "Sampler on `logits` with the same settings in every row."
    B = logits.shape[0]
    return Sampler()(logits, [temperature] * B, [top_k] * B, [top_p] * B, **kw)


def kept_sets(probs, top_ks, top_ps):
    out = apply_top_k_top_p(probs.log().expand(len(top_ks), -1), torch.tensor(top_ks), torch.tensor(top_ps))
    return [set(row.isfinite().nonzero().flatten().tolist()) for row in out]


def test_top_k_top_p_on_a_hand_made_distribution():
    probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])  # by rank: 1, 3, 4, 0, 2
    cases = [((0, 1.0), {0, 1, 2, 3, 4}), ((-1, 1.0), {0, 1, 2, 3, 4}), ((5, 1.0), {0, 1, 2, 3, 4}),
             ((1, 1.0), {1}), ((2, 1.0), {1, 3}), ((4, 1.0), {0, 1, 3, 4}),
             ((0, 0.3), {1}), ((0, 0.6), {1, 3}), ((0, 0.8), {1, 3, 4}), ((0, 0.9), {0, 1, 3, 4}),
             ((0, 0.97), {0, 1, 2, 3, 4}), ((0, 1e-6), {1}),
             # after top-k, top-p counts renormalised mass: top-3 is 0.47, 0.35, 0.18; top-2 is 0.57, 0.43
             ((3, 0.8), {1, 3}), ((3, 0.9), {1, 3, 4}), ((2, 0.5), {1}), ((2, 0.6), {1, 3})]
    (ks, ps), expected = zip(*[c[0] for c in cases]), [c[1] for c in cases]
    assert kept_sets(probs, list(ks), list(ps)) == expected


def test_top_k_keeps_ties_like_hf():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    assert kept_sets(logits.softmax(-1)[0], [2], [1.0]) == [{1, 2, 3}]


def test_top_k_top_p_match_hf_warpers():
    B, V = 64, 200
    logits = torch.randn(B, V, generator=gen(1)) * 3
    top_ks = torch.randint(-1, 12, (B,), generator=gen(2))
    top_ps = torch.rand(B, generator=gen(3)).clamp(0.05, 1.0)
    top_ps[::5] = 1.0
    ours = apply_top_k_top_p(logits, top_ks, top_ps)
    for i in range(B):
        row = logits[i:i + 1]
        if top_ks[i] > 0:
            row = TopKLogitsWarper(int(top_ks[i]))(None, row)
        if top_ps[i] < 1:
            row = TopPLogitsWarper(float(top_ps[i]))(None, row)
        assert ours[i].isinf().equal(row[0].isinf()), f"row {i}: k={top_ks[i]}, p={top_ps[i]}"
        torch.testing.assert_close(ours[i][ours[i].isfinite()], logits[i][ours[i].isfinite()], **EXACT)


def test_min_p_matches_hf_warper():
    B, V = 32, 200
    logits = torch.randn(B, V, generator=gen(1)) * 3
    min_ps = torch.rand(B, generator=gen(2))
    min_ps[::4] = 0.0
    min_ps[1] = 1.0
    ours = apply_min_p(logits, min_ps)
    for i in range(B):
        ref = MinPLogitsWarper(float(min_ps[i]))(None, logits[i:i + 1].clone())[0] if min_ps[i] > 0 else logits[i]
        torch.testing.assert_close(ours[i], ref, **EXACT)
    assert ours[1].isfinite().sum() == 1 and ours[0].isfinite().all()
    torch.testing.assert_close(apply_min_p(logits, torch.zeros(B)), logits, **EXACT)  # off: every token stays


def test_sampler_skips_what_no_row_uses(monkeypatch):
    "Off for every row (by the host lists): no min-p softmax, no top-k/top-p sort at all."
    import minivllm.sampler as sampler_module

    def never(*args):
        raise AssertionError("called with every row off")
    monkeypatch.setattr(sampler_module, "apply_min_p", never)
    monkeypatch.setattr(sampler_module, "apply_top_k_top_p", never)
    logits = torch.randn(3, 10, generator=gen(1))
    tokens = Sampler()(logits, [1.0, 0.5, 0.0], [0, -1, 10], [1.0] * 3, generator=gen(2), min_ps=[0.0] * 3)
    assert tokens.shape == (3,) and tokens[2] == logits[2].argmax()


def test_sampling_follows_min_p_after_temperature():
    "Frequencies match softmax(logits / t) with the tokens below min_p x the top probability removed, renormalised."
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    N = 40_000
    for t, min_p, k in ((1.0, 0.2, 0), (0.5, 0.2, 0), (2.0, 0.3, 0), (1.0, 0.1, 2)):
        q = (logits / t).softmax(-1)
        q = torch.where((q >= min_p * q.max()) & (torch.arange(6) < (k or 6)), q, 0)
        q = q / q.sum()
        tokens = sample(logits.expand(N, -1), t, k, generator=gen(1), min_ps=[min_p] * N)
        assert chi_square_ok(tokens, q), (t, min_p, k)
        assert set(tokens.unique().tolist()) == set(q.nonzero().flatten().tolist())


def test_repetition_penalty_matches_hf_processor():
    B, V = 6, 50
    logits = torch.randn(B, V, generator=gen(1)) * 2
    prompts = [[1, 2, 3], [4, 4], [], [7], [0, 49], [5]]
    outputs = [[3, 9, 9], [], [11, 12], [7, 7], [], [6]]
    penalties = [1.2, 0.8, 2.0, 1.0, 1.5, 1.1]
    ours = apply_penalties(logits, outputs, repetition_penalties=penalties, prompt_token_ids=prompts)
    for i in range(B):
        ids = torch.tensor([prompts[i] + outputs[i]], dtype=torch.long)
        ref = RepetitionPenaltyLogitsProcessor(penalties[i])(ids, logits[i:i + 1].clone())[0]
        torch.testing.assert_close(ours[i], ref, **EXACT)


def test_penalties_in_vllms_order():
    "Repetition first (prompt and output), then frequency and presence (output only), as vLLM applies them."
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = apply_penalties(logits, [[0, 0, 1]], [0.5], [0.25], [2.0], [[2]])
    expected = torch.tensor([[2.0 / 2 - 0.5 - 2 * 0.25, -1.0 * 2 - 0.5 - 0.25, 0.5 / 2, 3.0]])
    torch.testing.assert_close(out, expected, **EXACT)
    assert apply_penalties(logits, [[0]], [0.0], [0.0]).equal(logits)


def test_mask_tokens():
    logits = torch.randn(3, 10, generator=gen(1))
    out = mask_tokens(logits, [[1, 4], [], [9, 10, 1000]])  # ids past the vocabulary can never be sampled anyway
    assert out[0].isinf().nonzero().flatten().tolist() == [1, 4] and (out[0] < 0).sum() >= 2
    assert out[1].equal(logits[1]) and out[2].isinf().nonzero().flatten().tolist() == [9]
    assert logits.isfinite().all() and mask_tokens(logits, [[], [], []]) is logits
    tokens = sample(out[:1].expand(2000, -1), 1.0, generator=gen(2))
    assert not torch.isin(tokens, torch.tensor([1, 4])).any() and len(tokens.unique()) == 8  # never, and all others


def test_top_k_top_p_off_returns_input():
    logits = torch.randn(3, 10)
    torch.testing.assert_close(apply_top_k_top_p(logits, torch.tensor([0, -1, 10]), torch.ones(3)), logits, **EXACT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(8, 300, generator=gen(1)).to(dtype)
    argmax = logits.float().argmax(-1)
    for t in (0.0, GREEDY_TEMPERATURE / 2):
        tokens = sample(logits, t, top_k=5, top_p=0.5)
        assert tokens.dtype == torch.int64 and tokens.equal(argmax)


def test_top_k_one_is_greedy():
    logits = torch.randn(8, 300, generator=gen(1))
    for t in (0.5, 1.0, 3.0):
        assert sample(logits, t, top_k=1, generator=gen(2)).equal(logits.argmax(-1))


def test_temperature_towards_zero_approaches_greedy():
    logits = torch.randn(16, 40, generator=gen(4))
    argmax = logits.argmax(-1)
    g = gen(5)
    hits = [torch.stack([sample(logits, t, generator=g) == argmax for _ in range(30)]).float().mean().item()
            for t in (2.0, 1.0, 0.3, 0.1, 0.03)]
    assert hits == sorted(hits) and hits[0] < 0.2 and hits[-1] > 0.95
    best, second = logits.topk(2).values.unbind(-1)
    assert (best - second).min() > 20 * 1e-4
    assert sample(logits, 1e-4, generator=g).equal(argmax)


def chi_square_ok(tokens, p):
    "Every token's frequency within 5 standard errors of `p` (deterministic under a seeded generator)."
    N = len(tokens)
    freq = tokens.bincount(minlength=len(p)).double() / N
    return bool(((freq - p.double()).abs() <= 5 * (p.double() * (1 - p.double()) / N).sqrt() + 1e-12).all())


def test_exponential_race_is_categorical():
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    N = 40_000
    tokens = sample(p.log().expand(N, -1), generator=gen(0))
    assert chi_square_ok(tokens, p)


def test_sampling_follows_temperature_top_k_top_p():
    "Frequencies match softmax(logits / t), truncated to top-k then top-p and renormalised, computed by hand."
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    N = 40_000
    for t, k, top_p in ((0.7, 0, 1.0), (1.5, 4, 1.0), (1.0, 0, 0.8), (2.0, 5, 0.75)):
        q = (logits / t).softmax(-1)  # already in descending order
        keep = torch.arange(6) < (k if k > 0 else 6)
        q = torch.where(keep, q, 0) / q[keep].sum()
        mass_before = q.cumsum(-1) - q
        q = torch.where(mass_before < top_p, q, 0)
        q = q / q.sum()
        tokens = sample(logits.expand(N, -1), t, k, top_p, generator=gen(1))
        assert chi_square_ok(tokens, q), (t, k, top_p)
        assert set(tokens.unique().tolist()) == set(q.nonzero().flatten().tolist())


def test_masked_tokens_are_never_sampled():
    logits = torch.zeros(2000, 8)
    logits[:, 5:] = float("-inf")  # e.g. vocabulary padding
    assert sample(logits, 1.0, generator=gen(1)).max() < 5
    logits = torch.randn(2000, 8, generator=gen(2))
    tokens = sample(logits, 1.0, top_k=2, generator=gen(3))
    assert (tokens[:, None] == logits.topk(2).indices).any(-1).all()


def test_mixed_batch_rows_match_the_same_rows_alone():
    logits = torch.randn(6, 100, generator=gen(1))
    temps, ks, ps = [0.0, 1.0, 0.0, 0.8, 1.2, 0.0], [0, 0, 3, 10, 0, 1], [1.0, 0.9, 0.5, 1.0, 0.95, 1.0]
    seeds, steps = [None, 11, None, 12, 13, 14], [0, 4, 0, 5, 6, 7]
    batch = Sampler()(logits, temps, ks, ps, seeds=seeds, steps=steps)
    for i in range(6):
        alone = Sampler()(logits[i:i + 1], temps[i:i + 1], ks[i:i + 1], ps[i:i + 1], seeds=seeds[i:i + 1],
                          steps=steps[i:i + 1])
        assert batch[i] == alone[0], i
    greedy = [i for i in range(6) if temps[i] == 0]
    assert batch[greedy].equal(logits[greedy].argmax(-1))


def seeded_tokens(seed, steps=range(24), others=(), position=0):
    "Tokens a request with `seed` draws at `steps` from a flat distribution, sharing each batch with `others`."
    out = []
    for step in steps:
        seeds = list(others)
        seeds.insert(position, seed)
        B = len(seeds)
        tokens = Sampler()(torch.zeros(B, 64), torch.ones(B), torch.zeros(B, dtype=torch.long), torch.ones(B),
                           seeds=seeds, steps=[step] * B, generator=gen(step))
        out.append(tokens[position].item())
    return out


def test_seeded_row_is_independent_of_its_batch():
    alone = seeded_tokens(1234)
    assert len(set(alone)) > 12  # really random: 24 draws from 64 tokens
    assert seeded_tokens(1234) == alone  # across calls
    assert seeded_tokens(1234, others=[None, None, 5], position=2) == alone
    assert seeded_tokens(1234, others=[7] * 9, position=9) == alone
    assert seeded_tokens(1234, others=[None] * 3, position=1) == alone
    assert seeded_tokens(1235) != alone
    assert seeded_tokens(1234, steps=range(1, 25)) == alone[1:] + seeded_tokens(1234, steps=[24])


def test_seeded_row_ignores_engine_generator_and_global_rng():
    logits = torch.randn(1, 500, generator=gen(1))
    a = Sampler()(logits, [1.0], [0], [1.0], seeds=[99], steps=[3], generator=gen(1))
    torch.manual_seed(12345)
    b = Sampler()(logits, [1.0], [0], [1.0], seeds=[99], steps=[3])
    torch.manual_seed(54321)
    c = Sampler()(logits, [1.0], [0], [1.0], seeds=[99], steps=[3], generator=gen(2))
    assert a == b == c


def test_unseeded_rows_use_the_generator_or_the_global_rng():
    logits = torch.zeros(32, 1000)
    assert sample(logits, generator=gen(7)).equal(sample(logits, generator=gen(7)))
    assert not sample(logits, generator=gen(7)).equal(sample(logits, generator=gen(8)))
    torch.manual_seed(3)
    first = sample(logits)
    torch.manual_seed(3)
    assert sample(logits).equal(first)


def test_noise_and_int64_seed():
    assert int64_seed(-5) == -5 and int64_seed(2**63 - 1) == 2**63 - 1 and int64_seed(2**64 - 5) == -5
    seeds, steps = zip(*[(s, t) for s in range(-20, 20) for t in range(50)])
    first = seeded_noise(torch.tensor(seeds), torch.tensor(steps), 4)
    assert first.equal(seeded_noise(torch.tensor(seeds), torch.tensor(steps), 4))  # the same (seed, step), the same noise
    assert len({tuple(row) for row in first.tolist()}) == 2000  # neighbouring seeds and steps: unrelated noise
    noise = exponential_noise(4, 20000, [None, 3, None, 3], [0, 0, 0, 1], generator=gen(0))
    assert (noise > 0).all()
    torch.testing.assert_close(noise.mean(-1), torch.ones(4), atol=0.03, rtol=0)
    torch.testing.assert_close(noise.var(-1), torch.ones(4), atol=0.06, rtol=0)
    assert not noise[1].equal(noise[3])


def test_tensor_settings_and_output():
    logits = torch.randn(3, 50, dtype=torch.bfloat16)
    tokens = Sampler()(logits, torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64), torch.tensor([0, 5, -1]),
                       torch.tensor([1.0, 0.9, 1.0]), generator=gen(0))
    assert tokens.shape == (3,) and tokens.dtype == torch.int64 and tokens[0] == logits[0].float().argmax()


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-0.1), r"temperature must be a finite number >= 0 \(0 = greedy\), got -0.1"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
    (dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-5), r"top_k must be -1 \(off\) or an integer >= 1, got -5"),
    (dict(min_p=1.1), r"min_p must be a number from 0 to 1 \(0 = off\), got 1.1"),
])
def test_invalid_values_are_refused_at_the_door(kwargs, message):
    "Values out of range are SamplingParams' to refuse, when a request is made; the sampler trusts what reaches it."
    with pytest.raises(ParamError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperatures=[1.0]), r"temperatures must have shape \(2,\)"),
    (dict(top_ps=[[1.0, 1.0]]), r"top_ps must have shape \(2,\)"),
    (dict(top_ks=[0.0, 3.0]), "top_ks must be integers"),
    (dict(top_ks=torch.tensor([0.0, 3.0])), "top_ks must be integers"),
    (dict(top_ks=[0, 0, 0]), r"top_ks must have shape \(2,\)"),
    (dict(seeds=[1, 2, 3], steps=[0, 0, 0]), r"seeds must have one entry \(an int or None\) per row"),
    (dict(seeds=[1, None]), "seeded sampling needs steps"),
    (dict(seeds=[1, None], steps=[0]), "seeded sampling needs steps"),
    (dict(seeds=[1, None], steps=[0, -1]), "steps must be >= 0"),
    (dict(min_ps=[0.1]), r"min_ps must have shape \(2,\)"),
    (dict(logits=torch.zeros(2, 3, 4)), r"logits must be a float tensor \[batch, vocab\]"),
    (dict(logits=torch.zeros(2, 4, dtype=torch.long)), r"logits must be a float tensor \[batch, vocab\]"),
])
def test_invalid_inputs(kwargs, message):
    args = dict(logits=torch.zeros(2, 4), temperatures=[1.0, 1.0], top_ks=[0, 0], top_ps=[1.0, 1.0])
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Sampler()(**args)


def test_check_sampling_inputs_converts():
    "Settings come back as host lists (a tensor read once), seeds as one None per row when none are given."
    t, k, p, seeds, steps, m = check_sampling_inputs(torch.zeros(2, 4), (0.5, 0.0), (3, -1), (0.9, 1.0))
    assert (t, k, p, seeds, steps, m) == ([0.5, 0.0], [3, -1], [0.9, 1.0], [None, None], None, None)
    t, k, p, _, _, m = check_sampling_inputs(torch.zeros(2, 4), torch.tensor([0.5, 0.0], dtype=torch.float64),
                                             torch.tensor([3, -1]), torch.tensor([0.9, 1.0]), min_ps=[0, 0.5])
    assert k == [3, -1] and all(type(v) is int for v in k) and m == [0, 0.5] and math.isclose(t[0], 0.5)
    assert math.isclose(p[0], 0.9, rel_tol=1e-7)  # float32's 0.9, read into a Python float


def test_philox_on_int64_tensors_is_philox_on_python_ints():
    "Products past int64 wrap; the masked words equal Philox computed on Python's unbounded ints."
    g = gen(3)
    words = torch.randint(0, 2**32, (6, 500), generator=g)
    words[:, :4] = torch.tensor([MASK32, 0, MASK32, 1])  # the extremes too, in every word
    ours = torch.stack(philox4x32(*words))
    for j in range(words.shape[1]):
        assert ours[:, j].tolist() == list(philox4x32(*(int(w) for w in words[:, j]))), j


def test_seeded_noise_is_tritons_philox():
    "Token j at step s is word j % 4 of `tl.randint4x(seed, (s << 32) + j // 4)`: a Triton kernel draws the same bits."
    from minivllm.gpu.triton_attention import HAS_TRITON, TRITON_RUNS_ON_CPU
    if not (HAS_TRITON and (torch.cuda.is_available() or TRITON_RUNS_ON_CPU)):
        pytest.skip("needs triton (>= 3.2 to run on the CPU, in its interpreter)")
    import triton
    import triton.language as tl

    @triton.jit
    def draw(seed, step, out, BLOCK: tl.constexpr):
        j = tl.arange(0, BLOCK)
        w0, w1, w2, w3 = tl.randint4x(seed, (step.to(tl.int64) << 32) + j.to(tl.int64))
        tl.store(out + 4 * j, w0.to(tl.int64, bitcast=False) & 0xFFFFFFFF)
        tl.store(out + 4 * j + 1, w1.to(tl.int64, bitcast=False) & 0xFFFFFFFF)
        tl.store(out + 4 * j + 2, w2.to(tl.int64, bitcast=False) & 0xFFFFFFFF)
        tl.store(out + 4 * j + 3, w3.to(tl.int64, bitcast=False) & 0xFFFFFFFF)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seed, step in ((0, 0), (7, 3), (-123456789012345, 41), (2**63 - 1, 2**31 - 1)):
        out = torch.empty(4 * 64, dtype=torch.int64, device=device)
        draw[(1,)](seed, step, out, BLOCK=64)
        counter = torch.arange(64)
        ours = torch.stack(philox4x32(counter, torch.tensor(step) & MASK32, 0, 0, torch.tensor(seed) & MASK32,
                                      (torch.tensor(seed) >> 32) & MASK32), dim=-1).flatten()
        assert out.cpu().equal(ours), (seed, step)
        u = ((out.cpu() >> 9).float() + 0.5) * 2.0 ** -23
        torch.testing.assert_close(seeded_noise(torch.tensor([seed]), torch.tensor([step]), 256)[0], -u.log(), **EXACT)


def chi_square_critical(df: int, z: float = 3.719) -> float:
    "The chi-squared statistic with `df` degrees of freedom exceeded with probability 1e-4 (z: the normal's), by Wilson-Hilferty."
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def reference_distribution(logits, t, k, p, min_p):
    "softmax(logits / t), then min-p, top-k and top-p as vLLM orders them, renormalised: a plain loop over one row."
    q = (logits.double() / t).softmax(-1)
    q = torch.where(q >= min_p * q.max(), q, 0)
    order = q.argsort(descending=True)
    keep = torch.zeros_like(q, dtype=torch.bool)
    keep[order[:k if k > 0 else len(q)]] = True
    q = torch.where(keep, q, 0) / q[keep].sum()
    mass = 0.0
    for i in order.tolist():
        if mass >= p:
            q[i] = 0
        mass += q[i].item()
    return q / q.sum()


@pytest.mark.parametrize("seeded", ["distinct seeds", "distinct steps", "unseeded"])
@pytest.mark.parametrize("t,k,p,min_p", [(1.0, -1, 1.0, 0.0), (0.7, 8, 1.0, 0.0), (1.4, -1, 0.85, 0.0),
                                         (1.2, 10, 0.9, 0.02), (2.0, -1, 1.0, 0.1)])
def test_chi_squared_of_the_sampled_distribution(seeded, t, k, p, min_p):
    "20,000 draws over 12 tokens: Pearson's statistic against the reference distribution stays below its 1e-4 quantile."
    V, N = 12, 20_000
    logits = torch.randn(V, generator=gen(7)) * 1.5
    q = reference_distribution(logits, t, k, p, min_p)
    seeds = {"distinct seeds": list(range(N)), "distinct steps": [42] * N, "unseeded": [None] * N}[seeded]
    steps = list(range(N)) if seeded == "distinct steps" else [3] * N
    tokens = Sampler()(logits.expand(N, V), [t] * N, [k] * N, [p] * N, seeds=seeds, steps=steps, generator=gen(11),
                       min_ps=[min_p] * N)
    counts = tokens.bincount(minlength=V).double()
    kept = q > 0
    assert counts[~kept].sum() == 0  # a removed token is never drawn
    expected = q[kept] * N
    statistic = ((counts[kept] - expected) ** 2 / expected).sum().item()
    assert statistic < chi_square_critical(int(kept.sum()) - 1), (statistic, q.tolist(), counts.tolist())


def test_seeded_batch_is_the_same_twice_and_row_by_row():
    "A seeded batch draws the same tokens on a second run, and each row the same as alone."
    logits = torch.randn(40, 300, generator=gen(1))
    args = ([1.0] * 40, [-1] * 40, [1.0] * 40)
    kw = dict(seeds=[int64_seed(2**63 + i * 7919) for i in range(40)], steps=list(range(40)))
    first = Sampler()(logits, *args, generator=gen(1), **kw)
    assert first.equal(Sampler()(logits, *args, generator=gen(2), **kw))
    for i in (0, 17, 39):
        alone = Sampler()(logits[i:i + 1], [1.0], [-1], [1.0], seeds=kw["seeds"][i:i + 1], steps=[i])
        assert alone[0] == first[i]
    assert len(set(first.tolist())) > 30


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_first_max_is_the_first_of_tied_maxima(dtype):
    "The greedy token: what torch's max(dim=-1) picks (the C++ kernel on float32 and bfloat16), ties and NaNs included."
    g = torch.Generator().manual_seed(4)
    for n in (3, 16, 100, 49152):
        logits = torch.randn(8, n, generator=g).mul(4).round().to(dtype)  # ties in every row
        logits[1, n // 3] = float("nan")
        logits[2] = float("-inf")
        logits[3, -1] = float("inf")
        assert first_max(logits).equal(logits.max(dim=-1).indices)
        assert first_max(logits).equal(logits.float().argmax(-1))


def test_cpu_kernels_switched_off_give_the_torch_path_bit_for_bit():
    "MINIVLLM_CPU_KERNEL=0: float32 layers on the CPU run torch's operations again, transformers' bits."
    code = ("import torch; from minivllm.cpu.kernels import layer_kernels, use_cpu_kernels; "
            "from minivllm.layers.common import RMSNorm, RotaryEmbedding, SiluAndMul; "
            "x, p = torch.randn(3, 2, 8), torch.tensor([0, 5, 9]); n, r = RMSNorm(8), RotaryEmbedding(8, 16, 1e4); "
            "assert layer_kernels() is None and not use_cpu_kernels(x); assert n(x).equal(n.rms_norm(x)); "
            "assert all(a.equal(b) for a, b in zip(r(p, x, x), r.rotate(p, x, x))); "
            "g, u = x.chunk(2, -1); assert SiluAndMul()(x).equal(torch.nn.functional.silu(g) * u); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"MINIVLLM_CPU_KERNEL": "0"})
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr
