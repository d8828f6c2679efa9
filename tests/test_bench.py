"""`minivllm bench`'s engines on one device: transformers runs where minivllm runs (a GPU against a GPU)."""
import pytest
import torch
import transformers

from minivllm.bench.throughput import bench_transformers
from minivllm.bench.workload import Workload
from minivllm.testing import make_tiny_checkpoint


def test_transformers_runs_its_model_and_inputs_on_the_device_it_is_given(tmp_path, monkeypatch):
    "On the meta device nothing can be computed, so generate fails; what matters is where everything was put first."
    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        model = real(*args, **kwargs)
        generate = model.generate
        def recorded(ids, **kw):
            seen.append((ids.device.type, kw["attention_mask"].device.type, next(model.parameters()).device.type))
            return generate(ids, **kw)
        model.generate = recorded
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recording)
    path = make_tiny_checkpoint(tmp_path, "qwen3")
    workload = Workload.make(vocab_size=256, num_prompts=2, input_len=(4, 8), output_len=(2, 4))
    with pytest.raises(Exception):
        bench_transformers(path, workload, device="meta")
    assert seen == [("meta", "meta", "meta")]
    seen.clear()
    assert bench_transformers(path, workload, device="cpu").output_tokens == workload.output_tokens
    assert seen == [("cpu", "cpu", "cpu")] * 2
    if not torch.cuda.is_available():  # the default is minivllm's own device
        seen.clear()
        bench_transformers(path, workload)
        assert {s for s in seen} == {("cpu", "cpu", "cpu")}
