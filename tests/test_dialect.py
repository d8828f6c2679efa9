"""vLLM's names, as vLLM documents them: SamplingParams' defaults and extra knobs, LLM.get_tokenizer, dict prompts; an
unknown keyword names the ones that exist. Run on the packaged model (it has a tokenizer)."""
from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import ParamError


@pytest.fixture(scope="module")
def llm():
    with LLM() as engine:
        yield engine


def greedy(llm, prompt="ROMEO.", **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, **kw), use_tqdm=False)[0].outputs[0]


def test_vllms_none_defaults_are_taken():
    "vLLM's SamplingParams defaults stop and stop_token_ids to None: the same as none."
    p = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None, prompt_logprobs=None)
    assert (p.stop, p.stop_token_ids, p.logit_bias) == ((), (), None)


def test_an_unknown_keyword_names_the_ones_that_exist():
    with pytest.raises(TypeError, match=r"no parameter 'best_of', 'guided_decoding'; it takes temperature, .*logit_bias"):
        SamplingParams(best_of=2, guided_decoding=None)


def test_prompt_logprobs_is_refused_with_the_reason():
    with pytest.raises(ParamError, match="prompt_logprobs .* is not computed by minivllm") as e:
        SamplingParams(prompt_logprobs=1)
    assert e.value.param == "prompt_logprobs"


def test_include_stop_str_in_output_keeps_the_stop_string(llm):
    text = greedy(llm, max_tokens=24).text
    stop = text[10:14]  # a piece of what the model says anyway
    cut, kept = greedy(llm, max_tokens=24, stop=[stop]), greedy(llm, max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    assert cut.text == text[:text.index(stop)] and kept.text == text[:text.index(stop) + len(stop)]
    assert cut.finish_reason == kept.finish_reason == "stop"
    streamed = "".join(o.outputs[0].text for o in llm.stream(
        "ROMEO.", SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True)))
    assert streamed == kept.text


def test_logit_bias_forces_or_bans_a_token_and_skip_special_tokens_shows_it(llm):
    eos = llm.get_tokenizer().eos_token_id
    forced = greedy(llm, max_tokens=3, logit_bias={eos: 100}, ignore_eos=True)
    assert forced.token_ids == [eos] * 3 and forced.text == ""  # special tokens are skipped by default
    shown = greedy(llm, max_tokens=3, logit_bias={str(eos): 100}, ignore_eos=True, skip_special_tokens=False)
    assert shown.text == llm.get_tokenizer().eos_token * 3  # JSON's string keys are taken too
    plain = greedy(llm, max_tokens=4)
    banned = greedy(llm, max_tokens=4, logit_bias={plain.token_ids[0]: -100})
    assert banned.token_ids[0] != plain.token_ids[0]


def test_a_bias_past_the_vocabulary_is_refused_and_the_engine_goes_on(llm):
    vocab = llm.config.vocab_size
    with pytest.raises(ParamError, match=f"logit_bias names token {vocab}, out of range for a vocabulary of {vocab}"):
        greedy(llm, logit_bias={vocab: 1.0})
    with pytest.raises(ParamError, match="a bias from -100 to 100"):
        SamplingParams(logit_bias={1: 101})
    assert greedy(llm, max_tokens=2).token_ids  # nothing was left queued


def test_get_tokenizer_and_dict_prompts(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("ROMEO.")
    by_text, by_dict, by_ids = (greedy(llm, p, max_tokens=5).token_ids
                                for p in ("ROMEO.", {"prompt": "ROMEO."}, {"prompt_token_ids": ids}))
    assert by_text == by_dict == by_ids
    with pytest.raises(ValueError, match="holds one of 'prompt' .* or 'prompt_token_ids'"):
        greedy(llm, {"text": "ROMEO."})


def test_a_chat_template_from_the_command_line_is_checked_then_used(llm):
    "`serve --chat-template`: the template renders a conversation before it replaces the tokenizer's."
    import copy
    from minivllm.server import use_chat_template
    tok = copy.deepcopy(llm.get_tokenizer())
    use_chat_template(tok, "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi"
    with pytest.raises(ValueError, match="the chat template cannot render a conversation"):
        use_chat_template(tok, "{% for %}")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        use_chat_template(None, "{{ messages }}")


def test_an_unknown_engine_keyword_names_the_ones_that_exist():
    with pytest.raises(TypeError, match=r"EngineArgs has no parameter 'max_num_seq'; it takes model, .*max_num_seqs"):
        LLM(max_num_seq=4)
