"""vLLM's names, as vLLM documents them: SamplingParams' defaults and extra knobs, LLM.get_tokenizer, dict prompts; an
unknown keyword names the ones that exist. Run on the packaged model (it has a tokenizer)."""
from __future__ import annotations

import pytest
import torch
import transformers

from minivllm import LLM, SamplingParams
from minivllm.model_source import DEFAULT_MODEL
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


PROMPT = "KING HENRY.\nMy lords, we have heard the news from France, and the news is bad: the Dauphin is coming."


@pytest.fixture(scope="module")
def reference_logprobs():
    "transformers' log-probabilities at every position of PROMPT (row p: the token at p + 1), in float32."
    tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    ids = tok(PROMPT).input_ids
    with torch.no_grad():
        return ids, torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def llm32():
    "The packaged model in float32, to compare with transformers' float32 values."
    with LLM(dtype="float32") as engine:
        yield engine


def check_prompt_logprobs(got, reference, k):
    "vLLM's layout: None first, then each prompt token's log-probability and the k most likely, equal to transformers'."
    ids, ref = reference
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        row, top = ref[p - 1], ref[p - 1].topk(k).indices.tolist()
        assert set(got[p]) == set(top) | {ids[p]}, p
        torch.testing.assert_close(torch.tensor([got[p][t].logprob for t in top + [ids[p]]]), row[top + [ids[p]]],
                                   atol=2e-4, rtol=1e-4)
        # vLLM's ranks: 1..k for the k most likely; the prompt token's counted among the whole vocabulary, which
        # transformers' row bounds (its tokens surely above it, and those perhaps above it at float rounding)
        ranks = {t: lp.rank for t, lp in got[p].items()}
        assert sorted(ranks[t] for t in top) == list(range(1, k + 1)), (p, ranks)
        own = row[ids[p]]
        assert int((row >= own + 1e-3).sum()) + 1 <= ranks[ids[p]] <= int((row >= own - 1e-3).sum()), (p, ranks)


def test_prompt_logprobs_equal_transformers_even_beside_a_cached_prefix(llm32, reference_logprobs):
    llm = llm32
    "A prompt already in the prefix cache is computed again for its log-probabilities; greedy and sampled alike."
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # now in the prefix cache
    greedy_out, sampled = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                                                          SamplingParams(temperature=0.8, max_tokens=2, prompt_logprobs=0, seed=1)],
                                       use_tqdm=False)
    check_prompt_logprobs(greedy_out.prompt_logprobs, reference_logprobs, 3)
    check_prompt_logprobs(sampled.prompt_logprobs, reference_logprobs, 0)
    assert greedy_out.num_cached_tokens == 0 and greedy(llm, PROMPT, max_tokens=2).token_ids == greedy_out.token_ids
    assert llm.generate(PROMPT, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_logprobs is None


def test_prompt_logprobs_with_n_samples_and_in_a_stream(llm32, reference_logprobs):
    llm = llm32
    "n samples share one record (vLLM gives it per request); a stream gives it with its first delta."
    out = llm.generate(PROMPT, SamplingParams(n=2, temperature=0.8, max_tokens=3, prompt_logprobs=1), use_tqdm=False)[0]
    check_prompt_logprobs(out.prompt_logprobs, reference_logprobs, 1)
    deltas = list(llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)))
    check_prompt_logprobs(deltas[0].prompt_logprobs, reference_logprobs, 1)
    assert all(d.prompt_logprobs is None for d in deltas[1:])


def test_prompt_logprobs_in_chunks_at_tp_2(reference_logprobs):
    "A prompt prefilled in chunks of 8 tokens, over two ranks (the LM head is collective): the same values."
    with LLM(dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=8, max_num_seqs=8) as engine:
        out = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    check_prompt_logprobs(out.prompt_logprobs, reference_logprobs, 2)


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ParamError, match="prompt_logprobs must be None or an integer from 0 to 20") as e:
        SamplingParams(prompt_logprobs=21)
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
    vocab = llm.llm_engine.config.vocab_size
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
    from minivllm.serve.server import use_chat_template
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
