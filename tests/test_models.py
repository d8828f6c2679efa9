"""Qwen3, Qwen2 and Llama on the parallel layers against transformers on the same checkpoints, at TP = 1, 2, 4."""
import json
import shutil
import sys

import cloudpickle
import pytest
import torch
import transformers

from minivllm.distributed import Communicator
from minivllm.shm_allreduce import ShmCommunicator
from minivllm.kv_cache import allocate_kv_cache, prefill_metadata
from minivllm.models import load_model
from minivllm.testing import greedy_generate, hf_greedy, hf_logits, make_tiny_checkpoint, prefill_logits, run_on_ranks

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these functions by value
transformers.logging.set_verbosity_error()

# name -> (model_type, tied, heads, kv heads, extra config). Heads divide by 1, 2 and 4; "qwen3" and "llama-tied"
# have 2 KV heads, so at TP=4 each KV head is replicated on two ranks.
MODELS = {
    "qwen3": ("qwen3", False, 4, 2, {}),
    "qwen3-tied": ("qwen3", True, 8, 4, {"head_dim": 16}),
    "qwen2": ("qwen2", False, 4, 4, {}),
    "qwen2-tied": ("qwen2", True, 8, 2, {}),
    "llama": ("llama", False, 8, 4, {"attention_bias": True, "mlp_bias": True}),
    "llama-tied": ("llama", True, 4, 2, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
}
PROMPTS = [[1, 5, 9, 13, 2], [7, 7, 3, 200, 31, 4, 8, 99, 250, 11, 12, 13, 14, 15, 16, 17, 18], [42, 17], [3] * 40]
# subtle: "argmax agrees on 99% of positions" needs a few hundred positions to mean anything (at 64, one flip fails it)
PREFILL_PROMPTS = PROMPTS + [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                             for n in (60, 90, 120, 150)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for i, (name, (model_type, tied, heads, kv, extra)) in enumerate(MODELS.items()):
        out[name] = make_tiny_checkpoint(root / name, model_type, tie_word_embeddings=tied, num_attention_heads=heads,
                                         num_key_value_heads=kv, seed=i, **extra)
    return out


def all_prefill_logits(comm, paths, dtypes):
    "Our prefill logits for every checkpoint and dtype, computed on this rank."
    return {(name, str(dt)): prefill_logits(load_model(path, dtype=dt, comm=comm), PREFILL_PROMPTS)
            for name, path in paths.items() for dt in dtypes}


@pytest.fixture(scope="module")
def hf_prefill(checkpoints):
    return {(name, str(dt)): hf_logits(path, PREFILL_PROMPTS, dt)
            for name, path in checkpoints.items() for dt in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_prefill_logits_match_transformers(checkpoints, hf_prefill, tp):
    dtypes = (torch.float32, torch.bfloat16)
    ours = (all_prefill_logits(Communicator(), checkpoints, dtypes) if tp == 1 else
            run_on_ranks(all_prefill_logits, tp, checkpoints, dtypes, connect=ShmCommunicator.connect))
    for name in checkpoints:
        theirs = hf_prefill[(name, "torch.float32")]
        scale = theirs.abs().max()
        torch.testing.assert_close(ours[(name, "torch.float32")], theirs, atol=1e-4 * scale, rtol=0,
                                   msg=lambda m: f"{name} float32 at TP={tp}: {m}")
        bf_ours, bf_theirs = ours[(name, "torch.bfloat16")], hf_prefill[(name, "torch.bfloat16")]
        assert bf_ours.dtype == torch.bfloat16
        agree = (bf_ours.argmax(-1) == bf_theirs.argmax(-1)).float().mean().item()
        assert agree >= 0.99, f"{name} bfloat16 at TP={tp}: argmax agrees on only {agree:.1%} of positions"


def generate_all(comm, paths, block_sizes, n):
    return {(name, bs): greedy_generate(load_model(path, comm=comm), PROMPTS, n, block_size=bs)
            for name, path in paths.items() for bs in block_sizes}


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_decode_through_paged_cache_matches_generate(checkpoints, tp):
    paths = {k: checkpoints[k] for k in ("qwen3", "qwen2-tied", "llama-tied")}
    ours = (generate_all(Communicator(), paths, (16, 256), 32) if tp == 1 else
            run_on_ranks(generate_all, tp, paths, (16, 256), 32, connect=ShmCommunicator.connect))
    for name, path in paths.items():
        expected = hf_greedy(path, PROMPTS, 32)
        for bs in (16, 256):
            assert ours[(name, bs)] == expected, f"{name}, block size {bs}, TP={tp}"


def test_prefill_with_cached_prefix_equals_prefill_without(checkpoints):
    "The first blocks of each prompt come from the cache; the logits of the rest are unchanged."
    model, bs = load_model(checkpoints["qwen3"]), 4
    prompts = [PROMPTS[1], PROMPTS[3]]  # 17 and 40 tokens
    cached = [8, 36]  # whole blocks
    tables = [[9, 2, 7, 0, 5], [1, 3, 4, 6, 8, 10, 11, 12, 13, 14]]
    cache = allocate_kv_cache(2, 16, bs, model.config.num_kv_heads_per_rank, model.config.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        # 1. the prefixes, into the cache
        ids = torch.tensor(sum((p[:c] for p, c in zip(prompts, cached)), []))
        pos = torch.cat([torch.arange(c) for c in cached])
        model(ids, pos, cache, prefill_metadata(tables, [0, 0], cached, bs))
        # 2. the rest, reading the prefix from the cache
        rest = [p[c:] for p, c in zip(prompts, cached)]
        ids = torch.tensor(sum(rest, []))
        pos = torch.cat([torch.arange(c, len(p)) for p, c in zip(prompts, cached)])
        md = prefill_metadata(tables, cached, [len(r) for r in rest], bs)
        assert md.block_tables is not None
        with_prefix = model.compute_logits(model(ids, pos, cache, md))
    full = prefill_logits(model, prompts)
    keep = torch.cat([torch.arange(c, len(p)) + off for p, c, off in zip(prompts, cached, [0, len(prompts[0])])])
    torch.testing.assert_close(with_prefix, full[keep], atol=1e-5, rtol=1e-5)


def test_bad_checkpoints(checkpoints, tmp_path):
    src = checkpoints["qwen3"]
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        dst = tmp_path / "noweights"; dst.mkdir(); shutil.copy(src / "config.json", dst); load_model(dst)
    bad = tmp_path / "gpt2"; shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text()); cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_model(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "missing")


def load_on_rank(comm, path):
    return load_model(path, comm=comm)


def test_tp_that_does_not_divide_the_heads(checkpoints):
    with pytest.raises(Exception, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        run_on_ranks(load_on_rank, 3, checkpoints["qwen3"])
    with pytest.raises(ValueError, match="checked for tensor_parallel_size=1 but the communicator is a group of 2"):
        from minivllm.models import build_model
        from minivllm.config import Config
        build_model(Config.from_pretrained(checkpoints["qwen3"]), comm=Communicator(0, 2))


def corrupt_copy(src, dst, damage):
    "A copy of checkpoint `src` at `dst` whose model.safetensors bytes went through `damage(bytes) -> bytes`."
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    return weights


@pytest.mark.parametrize("damage", [lambda b: b[: len(b) // 2], lambda b: b[:-1], lambda b: b"",
                                    lambda b: torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0))
                                    .to(torch.uint8).numpy().tobytes()],
                         ids=["truncated-half", "truncated-by-one-byte", "empty", "random-bytes"])
def test_unreadable_safetensors_file_is_named_with_the_fix(checkpoints, tmp_path, damage):
    weights = corrupt_copy(checkpoints["qwen3"], tmp_path / "ckpt", damage)
    with pytest.raises(ValueError) as e:
        load_model(tmp_path / "ckpt")
    message = str(e.value)
    assert message.startswith(f"{weights.absolute()} is corrupt or incomplete (e.g. a partial download)"), message
    assert "download it again" in message and "safetensors says:" in message


def test_tensor_that_safetensors_cannot_read_names_the_file(checkpoints, tmp_path):
    "A well-formed header whose tensor has a dtype safetensors cannot hand to torch: get_tensor fails, not safe_open."
    import struct
    shutil.copytree(checkpoints["qwen3"], tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    header = json.dumps({"model.norm.weight": {"dtype": "F6_E2M3", "shape": [64], "data_offsets": [0, 48]}}).encode()
    header += b" " * (-len(header) % 8)
    weights.write_bytes(struct.pack("<Q", len(header)) + header + bytes(48))
    with pytest.raises(ValueError, match="is corrupt or incomplete .* download it again") as e:
        load_model(tmp_path / "ckpt")
    assert str(weights.absolute()) in str(e.value)


def poisoned_copy(src, dst, edit):
    "A copy of checkpoint `src` at `dst` whose tensors went through `edit(dict)` in place."
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst / "model.safetensors"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("bad, count", [(float("nan"), "holds 1 NaN and 0 infinite value(s)"),
                                        (float("inf"), "holds 0 NaN and 1 infinite value(s)"),
                                        (float("-inf"), "holds 0 NaN and 1 infinite value(s)")], ids=["nan", "inf", "-inf"])
def test_non_finite_weights_are_refused_naming_the_tensor_and_file(tmp_path, dtype, bad, count):
    good = make_tiny_checkpoint(tmp_path / "good", "qwen3", dtype=dtype)
    name = "model.layers.1.self_attn.k_proj.weight"  # a packed (qkv) tensor, sharded by the loader
    def poison(t): t[name][7, 3] = bad
    weights = poisoned_copy(good, tmp_path / "bad", poison)
    with pytest.raises(ValueError) as e:
        load_model(tmp_path / "bad")
    message = str(e.value)
    assert message.startswith(f"{weights.absolute()}: tensor {name!r} {count}, the first at index (7, 3)"), message
    assert "use a good copy of the checkpoint" in message
    load_model(good)  # the untouched checkpoint still loads


def test_finite_weights_whose_sum_overflows_still_load(tmp_path):
    "float16 weights that are each finite but sum past 65504: the cheap sum check must not refuse them."
    good = make_tiny_checkpoint(tmp_path / "good", "qwen3", dtype="float16")
    def big(t): t["model.norm.weight"].fill_(60_000.0)
    poisoned_copy(good, tmp_path / "big", big)
    model = load_model(tmp_path / "big")
    assert torch.equal(model.model.norm.weight, torch.full_like(model.model.norm.weight, 60_000.0))


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32])
def test_integer_weights_are_refused_at_load_naming_the_tensor(tmp_path, dtype):
    "A quantized (or broken) checkpoint is refused in one line that names the tensor, not served as noise."
    good = make_tiny_checkpoint(tmp_path / "good", "qwen3")
    name = "model.layers.0.mlp.down_proj.weight"
    def quantize(t): t[name] = t[name].clamp(-1, 1).mul(100).to(dtype)
    weights = poisoned_copy(good, tmp_path / "int", quantize)
    with pytest.raises(ValueError) as e:
        load_model(tmp_path / "int")
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{weights.absolute()}: tensor {name!r} is {str(dtype)[6:]}")
    assert "minivllm loads floating-point weights" in message
