"Config.from_pretrained's errors on bad config.json files, and resolve_model on a fake, offline Hugging Face cache."
import json
import shutil

import pytest

from minivllm.config import INT_FIELDS, Config, resolve_model
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
