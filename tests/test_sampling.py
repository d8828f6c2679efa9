"""What serving added to sampling, against plain references at TP=1 and 2: logprobs are the model's log-softmax
(transformers'), penalties pick what a penalised argmax over transformers' logits picks, min-p draws what the seeded
race draws from transformers' min-p distribution, min_tokens holds EOS and stop tokens back, n samples share the
prompt's blocks and are reproducible, stream deltas add up to generate, stop strings cut the text."""
import json
import shutil

import pytest
import torch
import transformers
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                   TemperatureLogitsWarper)

from minivllm import LLM, SamplingParams
from minivllm.sampler import exponential_noise
from minivllm.testing import make_chat_checkpoint, make_tiny_checkpoint

PROMPTS = [[5, 9, 2, 7, 1], [3] * 21, [8, 6, 4, 2, 250, 17, 33, 12, 90]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3", num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def hf(tiny):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat"))


@torch.no_grad()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    "transformers' log-softmax at every position of `ids`."
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_are_the_models_log_softmax(tiny, hf, tp):
    with LLM(tiny, tensor_parallel_size=tp, max_model_len=128) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3),
                            use_tqdm=False)
        plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, out, same in zip(PROMPTS, outs, plain):
        assert out.token_ids == same.token_ids  # asking for logprobs changes no token
        ref = hf_logprobs(hf, prompt + out.token_ids)
        for j, (token, lps) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert set(lps) == set(row.topk(3).indices.tolist()) | {token}
            got = torch.tensor([lps[t].logprob for t in sorted(lps)])
            torch.testing.assert_close(got, row[sorted(lps)], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tp", [1, 2])
def test_penalties_pick_the_penalised_argmax(tiny, hf, tp):
    presence, frequency = 0.3, 0.7
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=presence,
                            frequency_penalty=frequency)
    with LLM(tiny, tensor_parallel_size=tp, max_model_len=128) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids, made = list(prompt), []
        for _ in range(12):  # the plain reference: transformers' logits, minus the penalties, argmax
            with torch.no_grad():
                logits = hf(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(made, dtype=torch.long), minlength=logits.numel()).float()
            token = int((logits - frequency * counts - presence * (counts > 0)).argmax())
            ids.append(token); made.append(token)
        assert out.token_ids == made
    assert len(set(outs[1].token_ids)) > 3  # the penalties really steered it off repeats


@torch.no_grad()
def hf_next_logits(hf, ids: list[int]) -> torch.Tensor:
    "transformers' logits `[1, V]` for the token after `ids`."
    return hf(torch.tensor([ids])).logits[:, -1].float()


@pytest.mark.parametrize("tp", [1, 2])
def test_repetition_penalty_picks_transformers_penalised_argmax(tiny, hf, tp):
    penalty, n = 1.8, 12
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, repetition_penalty=penalty)
    with LLM(tiny, tensor_parallel_size=tp, max_model_len=128) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    processor = RepetitionPenaltyLogitsProcessor(penalty)  # vLLM's definition: over the prompt and the output
    for prompt, out in zip(PROMPTS, outs):
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(processor(torch.tensor([ids]), hf_next_logits(hf, ids)).argmax()))
        assert out.token_ids == ids[len(prompt):]
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]  # the penalty really changed the tokens


@pytest.mark.parametrize("tp", [1, 2])
def test_min_p_draws_from_transformers_min_p_distribution(tiny, hf, tp):
    "Seeded: each token is argmax(p / E) for the request's own Exp(1) noise E and p transformers' min-p distribution."
    temperature, min_p, n = 1.5, 0.2, 10
    params = [SamplingParams(temperature=temperature, min_p=min_p, seed=i, max_tokens=n, ignore_eos=True)
              for i in range(len(PROMPTS))]
    with LLM(tiny, tensor_parallel_size=tp, max_model_len=128) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        unfiltered = llm.generate(PROMPTS, [SamplingParams(temperature=temperature, seed=i, max_tokens=n,
                                                           ignore_eos=True) for i in range(len(PROMPTS))],
                                  use_tqdm=False)
    warp_t, warp_p = TemperatureLogitsWarper(temperature), MinPLogitsWarper(min_p)  # vLLM's order: t, then min-p
    for seed, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        ids = list(prompt)
        for step in range(n):
            probs = warp_p(None, warp_t(None, hf_next_logits(hf, ids))).softmax(-1)[0]
            noise = exponential_noise(1, probs.numel(), [seed], [step])[0]
            ids.append(int((probs / noise).argmax()))
            assert probs[ids[-1]] >= min_p * probs.max()
        assert out.token_ids == ids[len(prompt):]
    assert [o.token_ids for o in outs] != [o.token_ids for o in unfiltered]  # min-p really cut some draws


@pytest.mark.parametrize("tp", [1, 2])
def test_min_tokens_holds_eos_and_stop_tokens_back(tiny, hf, tp, tmp_path):
    n, m = 12, 5
    greedy = []  # transformers' greedy continuations, to pick an EOS and a stop token the model wants early
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(3):
            ids.append(int(hf_next_logits(hf, ids).argmax()))
        greedy.append(ids[len(prompt):])
    eos, stop = greedy[0][0], greedy[1][1]
    ckpt = shutil.copytree(tiny, tmp_path / "eos")  # the same weights, with that EOS
    config = json.loads((ckpt / "config.json").read_text()) | {"eos_token_id": eos}
    (ckpt / "config.json").write_text(json.dumps(config))

    def reference(prompt, min_tokens, ignore_eos):
        "Greedy over transformers' logits, EOS and the stop token masked while fewer than min_tokens came before."
        ids, made = list(prompt), []
        while len(made) < n:
            logits = hf_next_logits(hf, ids)[0]
            if len(made) < min_tokens:
                logits[[eos, stop]] = float("-inf")
            made.append(int(logits.argmax())); ids.append(made[-1])
            if made[-1] == stop or (made[-1] == eos and not ignore_eos):
                break
        return made

    with LLM(ckpt, tensor_parallel_size=tp, max_model_len=128) as llm:
        for ignore_eos in (False, True):
            params = SamplingParams(temperature=0, max_tokens=n, min_tokens=m, stop_token_ids=[stop],
                                    ignore_eos=ignore_eos)
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            for prompt, out in zip(PROMPTS, outs):
                assert out.token_ids == reference(prompt, m, ignore_eos)
                assert eos not in out.token_ids[:m] and stop not in out.token_ids[:m]
        plain = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=n, stop_token_ids=[stop]),
                             use_tqdm=False)
        assert (plain[0].token_ids, plain[0].finish_reason) == ([eos], "stop")  # without min_tokens: EOS at once
        sampled = llm.generate(PROMPTS * 4, [SamplingParams(temperature=1.0, seed=i, max_tokens=n, min_tokens=m,
                                                            stop_token_ids=[stop]) for i in range(12)],
                               use_tqdm=False)
    for out in sampled:  # sampled too: EOS and the stop token no earlier than min_tokens
        assert len(out.token_ids) > m or out.finish_reason == "length"
        assert eos not in out.token_ids[:m] and stop not in out.token_ids[:m]


@pytest.mark.parametrize("tp", [1, 2])
def test_n_samples_share_the_prompt_blocks_and_are_reproducible(tiny, tp):
    prompt = list(range(1, 41))  # 2 full blocks of 16, and 8 tokens more
    params = SamplingParams(temperature=1.0, n=4, seed=3, max_tokens=10, ignore_eos=True)
    with LLM(tiny, tensor_parallel_size=tp, max_model_len=128, kvcache_block_size=16) as llm:
        hits = llm.llm_engine.scheduler.block_manager.prefix_cache_hit_tokens
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert llm.llm_engine.scheduler.block_manager.prefix_cache_hit_tokens - hits == 3 * 32  # the 3 later samples hit both
        assert [c.index for c in out.outputs] == [0, 1, 2, 3] and len({tuple(c.token_ids) for c in out.outputs}) == 4
        single = llm.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True),
                              use_tqdm=False)[0]
        again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == single.token_ids
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    with LLM(tiny, max_model_len=128, kvcache_block_size=16) as tp1:
        assert [c.token_ids for c in tp1.generate(prompt, params, use_tqdm=False)[0].outputs] == \
               [c.token_ids for c in out.outputs]


@pytest.mark.parametrize("tp", [1, 2])
def test_stream_deltas_add_up_to_generate_and_stop_strings_cut(chat_ckpt, tp):
    prompts = ["Once upon a time", "The king said", "Hello"]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2)
    with LLM(chat_ckpt, tensor_parallel_size=tp, max_model_len=128) as llm:
        whole = llm.generate(prompts, params, use_tqdm=False)
        texts, ids = {}, {}
        for delta in llm.stream(prompts, params):
            for c in delta.outputs:
                key = (int(delta.request_id), c.index)
                texts[key] = texts.get(key, "") + c.text
                ids[key] = ids.get(key, []) + c.token_ids
        assert texts == {(i, c.index): c.text for i, o in enumerate(whole) for c in o.outputs}
        assert ids == {(i, c.index): c.token_ids for i, o in enumerate(whole) for c in o.outputs}
        first = whole[0].text
        stop = first[len(first) // 2:len(first) // 2 + 3]
        cut = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0]
        assert (cut.text, cut.finish_reason) == (first[:first.index(stop)], "stop")
        assert not llm.llm_engine.scheduler.running and llm.llm_engine.scheduler.block_manager.num_free_blocks == \
               llm.llm_engine.scheduler.block_manager.num_blocks
