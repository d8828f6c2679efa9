"""`SamplingParams`: its defaults, and every bad value refused with a message that gives the valid range."""
import pytest

from minivllm.sampling_params import SamplingParams


def test_sampling_params_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.ignore_eos, p.seed, p.stop_token_ids) == \
           (1.0, -1, 1.0, 16, False, None, ())  # vLLM's defaults, max_tokens=16 included
    assert (p.min_p, p.min_tokens, p.repetition_penalty, p.needs_logits) == (0.0, 0, 1.0, False)  # all three off
    assert SamplingParams(min_tokens=16).min_tokens == 16 and SamplingParams(min_tokens=99, max_tokens=None).min_tokens == 99
    assert SamplingParams(min_p=1, repetition_penalty=0.5).repetition_penalty == 0.5
    assert SamplingParams(temperature=0, top_k=1, stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=(t for t in [5, 6])).stop_token_ids == (5, 6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), r"temperature must be a finite number >= 0 \(0 = greedy\), got -0.5"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(temperature="hot"), "temperature must be a finite number"),
    (dict(top_p=0), r"top_p must be in \(0, 1\] \(1 = off\), got 0"),
    (dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
    (dict(top_k=0), r"top_k must be -1 \(off\) or an integer >= 1, got 0"),
    (dict(top_k=-3), r"top_k must be -1 \(off\) or an integer >= 1, got -3"),
    (dict(top_k=1.5), "top_k must be -1"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(max_tokens=2.0), "max_tokens must be an integer >= 1"),
    (dict(min_p=-0.1), r"min_p must be a number from 0 to 1 \(0 = off\), got -0.1"),
    (dict(min_p=1.01), r"min_p must be a number from 0 to 1 \(0 = off\), got 1.01"),
    (dict(min_p="0.1"), "min_p must be a number from 0 to 1"),
    (dict(repetition_penalty=0), r"repetition_penalty must be a finite number > 0 \(1 = off, above 1 discourages repeats\), got 0"),
    (dict(repetition_penalty=-1.2), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=True), "repetition_penalty must be a finite number > 0"),
    (dict(min_tokens=-1), r"min_tokens must be an integer >= 0 \(0 = off\), got -1"),
    (dict(min_tokens=1.5), "min_tokens must be an integer >= 0"),
    (dict(min_tokens=17), r"min_tokens must be from 0 to max_tokens \(16\), got 17: lower min_tokens or raise max_tokens"),
    (dict(min_tokens=5, max_tokens=4), r"min_tokens must be from 0 to max_tokens \(4\), got 5"),
    (dict(ignore_eos=1), "ignore_eos must be True or False"),
    (dict(seed=1.5), "seed must be an integer or None"),
    (dict(stop_token_ids=[1, -1]), "the stop_token_ids must hold token ids"),
    (dict(stop_token_ids="12"), "stop_token_ids must be a sequence of token ids"),
    (dict(stop_token_ids=7), "stop_token_ids must be a sequence of token ids"),
])
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_one_type_under_every_import_path():
    import minivllm
    from minivllm.engine import scheduler
    assert minivllm.SamplingParams is scheduler.SamplingParams is SamplingParams
