"Config.from_pretrained's errors on bad config.json files, and resolve_model on a fake, offline Hugging Face cache."
import json
import shutil

import pytest

from minivllm.config import INT_FIELDS, Config
from minivllm.model_source import resolve_model
from minivllm.testing import make_tiny_checkpoint

QWEN3 = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    "A real tiny Qwen3 checkpoint (config.json, generation_config.json, model.safetensors)."
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3")


def write_config(folder, content: str):
    "A checkpoint folder whose config.json holds `content`."
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(content)
    return folder


@pytest.mark.parametrize("content, kind", [("[1, 2]", "an array"), ("42", "a number"), ('"qwen3"', "a string"),
                                           ("null", "null")])
def test_config_that_is_not_an_object_names_the_file(tmp_path, content, kind):
    folder = write_config(tmp_path / "ckpt", content)
    with pytest.raises(ValueError, match="must hold a JSON object") as e:
        Config.from_pretrained(folder)
    assert str(folder / "config.json") in str(e.value) and f"holds {kind}" in str(e.value)


def test_config_that_is_not_json(tmp_path):
    with pytest.raises(ValueError, match="is not valid JSON"):
        Config.from_pretrained(write_config(tmp_path / "ckpt", '{"model_type": "qwen3",'))


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("bad", [0, -1, 3.5, "8", True, [4]])
def test_every_integer_field_names_itself_and_its_value(tmp_path, field, bad):
    folder = write_config(tmp_path / "ckpt", json.dumps({**QWEN3, field: bad}))
    with pytest.raises(ValueError, match=f"{field} must be a positive integer, got {bad!r}".replace("[", r"\[")) as e:
        Config.from_pretrained(folder)
    assert str(folder / "config.json") in str(e.value)


def test_num_key_value_heads_zero_is_no_longer_a_silent_fallback():
    with pytest.raises(ValueError, match="num_key_value_heads must be a positive integer, got 0"):
        Config.from_hf_dict({**QWEN3, "num_key_value_heads": 0})
    assert Config.from_hf_dict({**QWEN3, "num_key_value_heads": None}).num_key_value_heads == 4  # null: the default
    assert Config.from_hf_dict({k: v for k, v in QWEN3.items() if k != "head_dim"}).head_dim == 16


def test_required_field_missing_or_null():
    with pytest.raises(ValueError, match=r"lacks the required fields \['hidden_size'\]"):
        Config.from_hf_dict({**QWEN3, "hidden_size": None})


# --- resolve_model ------------------------------------------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(cache, repo_id: str, files_from) -> str:
    "Lay out `files_from`'s files as huggingface_hub caches `repo_id` at revision main; returns the snapshot folder."
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(files_from, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    "An empty Hugging Face cache folder, with the hub switched off."
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_local_paths_are_returned_as_they_are(tiny_checkpoint):
    assert resolve_model(tiny_checkpoint) == tiny_checkpoint
    assert resolve_model(str(tiny_checkpoint)) == tiny_checkpoint


def test_a_missing_path_that_is_no_hub_id(offline_cache):
    for model in ("/no/such/folder", "./models/qwen", "typo-without-slash", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="does not exist: pass the folder that holds config.json"):
            resolve_model(model)


def test_hub_id_from_the_local_cache(offline_cache, tiny_checkpoint):
    snapshot = fake_hub_cache(offline_cache, "org/name", tiny_checkpoint)
    folder = resolve_model("org/name")
    assert folder.resolve() == snapshot.resolve()
    assert Config.from_pretrained(folder).vocab_size == 256


def test_hub_id_not_cached_says_why_and_what_to_do(offline_cache):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("org/not-cached")
    message = str(e.value)
    assert "\n" not in message
    for part in ("no folder org/not-cached exists", "not in the local cache", str(offline_cache),
                 "could not be downloaded (HF_HUB_OFFLINE is set)", "hf download org/not-cached",
                 "pass a local checkpoint folder"):
        assert part in message, part


def test_hub_snapshot_without_weights_is_not_a_checkpoint(offline_cache, tiny_checkpoint, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", config_only)
    fake_hub_cache(offline_cache, "org/tokenizer-only", config_only)
    with pytest.raises(FileNotFoundError, match="not in the local cache"):
        resolve_model("org/tokenizer-only")


# --- sizes that cannot fit in memory, refused at config load ----------------------------------------------------------

@pytest.mark.parametrize("field, value, part", [
    ("vocab_size", 2**40, "the embedding and LM head (vocab_size=1099511627776 x hidden_size=64 x 2 in float32)"),
    ("max_position_embeddings", 2**62, "the rotary table (max_position_embeddings=4611686018427387904 x head_dim=16, "
                                       "float32)"),
    ("intermediate_size", 2**40, "the MLP weights (num_hidden_layers=2 x 3 x hidden_size=64 x "
                                 "intermediate_size=1099511627776 in float32)"),
    ("num_hidden_layers", 2**50, "the MLP weights (num_hidden_layers=1125899906842624 x"),
    ("head_dim", 2**60, "the attention weights (num_hidden_layers=2 x hidden_size=64 x (2 x num_attention_heads=4 + "
                        "2 x num_key_value_heads=2) x head_dim=1152921504606846976 in float32)")])
def test_sizes_that_cannot_fit_are_named_in_one_line_at_config_load(tmp_path, field, value, part):
    folder = write_config(tmp_path / "ckpt", json.dumps({**QWEN3, field: value}))
    with pytest.raises(ValueError) as e:
        Config.from_pretrained(folder)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{folder / 'config.json'}: the model needs ")
    assert f"GiB of it for {part}" in message and "more than this machine has" in message, message
    assert "GiB of memory" in message and ("lower max_position_embeddings" if field == "max_position_embeddings"
                                           else "fix the size that is wrong") in message


def test_the_weights_counted_are_transformers_parameters_less_norms():
    "rank_bytes at TP=1 against the same shape built by transformers (on the meta device: nothing allocated)."
    import torch
    import transformers
    from minivllm.config import rank_bytes
    for model_type, tied, extra in (("qwen3", True, {}), ("qwen3", False, {}), ("llama", False, {"head_dim": 32})):
        hf = {**QWEN3, "model_type": model_type, "tie_word_embeddings": tied, "vocab_size": 1000, **extra}
        config = Config.from_hf_dict(hf)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf))
        weights = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name) * 4
        parts = rank_bytes(config)
        assert sum(size for part, (_, size) in parts.items() if part != "the rotary table") == weights, (hf, parts)
        assert parts["the rotary table"][1] == 512 * config.head_dim * 4


def test_the_bound_is_one_ranks_share_against_the_machines_ram_or_gpu(monkeypatch):
    import minivllm.config as config_module
    hf = {**QWEN3, "vocab_size": 2**22, "tie_word_embeddings": True}  # an embedding of 2**22 x 64 float32: 1 GiB
    monkeypatch.setattr(config_module, "ram_bytes", lambda: int(0.4 * 2**30))  # a machine of 0.4 GiB, with no GPU
    monkeypatch.setattr(config_module, "gpu_bytes", lambda: 0)
    with pytest.raises(ValueError, match=r"the model needs 1\.0 GiB, 1\.0 GiB of it for the embedding .* 0\.4 GiB of "
                                         r"memory.*--tp\), load it in bfloat16 \(--dtype bfloat16\), or use a machine"):
        Config.from_hf_dict(hf)
    with pytest.raises(ValueError, match=r"the model needs 0\.5 GiB per rank \(tensor_parallel_size=2\)"):
        Config.from_hf_dict(hf, tensor_parallel_size=2)  # half the weights, and the whole rotary table
    with pytest.raises(ValueError, match=r"0\.5 GiB of it for the embedding \(.* in bfloat16\).*--tp\), or use a"):
        Config.from_hf_dict(hf, dtype="bfloat16")  # 16-bit already: no advice to load it in bfloat16
    assert Config.from_hf_dict(hf, tensor_parallel_size=4).tensor_parallel_size == 4
    assert Config.from_hf_dict(hf, tensor_parallel_size=2, dtype="bfloat16").dtype is not None
    monkeypatch.setattr(config_module, "gpu_bytes", lambda: 2**31)  # a GPU of 2 GiB holds it
    assert Config.from_hf_dict(hf).vocab_size == 2**22
    monkeypatch.setattr(config_module, "ram_bytes", lambda: 2**31)
    monkeypatch.setattr(config_module, "gpu_bytes", lambda: pytest.fail("CUDA asked, though the model fits the RAM"))
    assert Config.from_hf_dict(hf).vocab_size == 2**22
