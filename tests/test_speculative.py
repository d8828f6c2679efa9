"""Speculative decoding on a real model (notebook 05c's rule over the paged KV cache): a verify pass scores a
sequence's newest token and its guesses in one prefill-type pass over its cached prefix, exactly as decoding them one
by one would; greedy decoding by such steps gives greedy's tokens whatever the guesses, and guesses it rejects leave
no trace in the cache."""
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.step import StepInputs
from minivllm.kv_cache import allocate_kv_cache, decode_metadata, prefill_metadata
from minivllm.models import load_model
from minivllm.speculative import accept_proposals, ngram_proposal
from minivllm.testing import greedy_generate, make_tiny_checkpoint

F32 = dict(rtol=1e-5, atol=1e-5)
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("spec"), "qwen3", seed=5))


def paged_sequence(model, prompt: list[int], room: int):
    "A cache with `prompt` prefilled in a block table of scattered blocks that holds `room` more tokens; (cache, table, logits of its last token)."
    c = model.config
    table = list(range(-(-(len(prompt) + room) // BLOCK_SIZE)))[::-1]  # not the identity map: paging is exercised
    cache = allocate_kv_cache(c.num_hidden_layers, len(table), BLOCK_SIZE, c.num_kv_heads_per_rank, c.head_dim,
                              c.dtype, "cpu")
    with torch.no_grad():
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), cache,
                       prefill_metadata([table], [0], [len(prompt)], BLOCK_SIZE))
    return cache, table, model.compute_logits(hidden[-1:])


def verify_pass(model, cache, table, cached: int, new: list[int]) -> torch.Tensor:
    "Logits `[len(new), vocab]` of `new` (the newest token, then the guesses) at positions cached, cached + 1, ... in one pass over the cache."
    with torch.no_grad():
        hidden = model(torch.tensor(new), torch.arange(cached, cached + len(new)), cache,
                       prefill_metadata([table], [cached], [len(new)], BLOCK_SIZE))
        return model.compute_logits(hidden)


def test_a_verify_pass_scores_each_guess_as_decoding_them_one_by_one(tiny_model):
    "The newest token and 4 guesses in one pass over a 13-token cached prefix: each row's logits and the cache equal 5 decode steps'."
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, tiny_model.config.vocab_size, (13,), generator=g).tolist()
    new = torch.randint(0, tiny_model.config.vocab_size, (5,), generator=g).tolist()
    cache, table, _ = paged_sequence(tiny_model, prompt, room=8)
    decoded_cache = cache.clone()
    one_pass = verify_pass(tiny_model, cache, table, len(prompt), new)
    one_by_one = []
    for i, token in enumerate(new):
        n = len(prompt) + i + 1
        with torch.no_grad():
            hidden = tiny_model(torch.tensor([token]), torch.tensor([n - 1]), decoded_cache,
                                decode_metadata([table], [n], BLOCK_SIZE))
        one_by_one.append(tiny_model.compute_logits(hidden)[0])
    torch.testing.assert_close(one_pass, torch.stack(one_by_one), **F32)
    torch.testing.assert_close(cache, decoded_cache, **F32)


def test_a_verify_step_as_a_decode_step_computes_what_it_does(tiny_model):
    "Three sequences with 3, 0 and 1 guesses after their newest tokens, over cached prefixes in scattered blocks: the verify step as a decode step of a row a token (notebook 08c's `as_decode`, what a GPU replays in its decode graphs) gives each row's logits and the cache that the verify step gives."
    c, g = tiny_model.config, torch.Generator().manual_seed(1)
    cached, guesses = [9, 13, 4], [3, 0, 1]
    tables = [[5, 1, 7, 3], [0, 8, 2, 9, 11], [4, 6]]  # each holds its prefix and its new tokens
    cache = allocate_kv_cache(c.num_hidden_layers, 12, BLOCK_SIZE, c.num_kv_heads_per_rank, c.head_dim, c.dtype, "cpu")
    prompts = [torch.randint(0, c.vocab_size, (n,), generator=g).tolist() for n in cached]
    with torch.no_grad():
        tiny_model(torch.tensor(sum(prompts, [])), torch.cat([torch.arange(n) for n in cached]), cache,
                   prefill_metadata(tables, [0] * 3, cached, BLOCK_SIZE))
    new = [torch.randint(0, c.vocab_size, (k + 1,), generator=g).tolist() for k in guesses]
    verify = StepInputs.build(True, new, cached, tables, BLOCK_SIZE, num_guesses=guesses)
    def run(step, cache):
        with torch.no_grad():
            hidden = tiny_model(torch.tensor(step.input_ids), torch.tensor(step.positions), cache, step.metadata())
            return tiny_model.compute_logits(hidden[step.sample_rows])
    as_decode, decoded_cache = verify.as_decode(), cache.clone()
    assert not as_decode.is_prefill and len(as_decode.sample_rows) == sum(guesses) + 3
    torch.testing.assert_close(run(as_decode, decoded_cache), run(verify, cache), **F32)
    torch.testing.assert_close(decoded_cache, cache, **F32)


def speculative_greedy(model, prompt: list[int], max_new_tokens: int, propose, k: int) -> tuple[list[int], list[int]]:
    "Greedy decoding of one sequence by speculative steps of up to `k` guesses from `propose(tokens)`; (its tokens, guesses kept each step)."
    vocab = model.config.vocab_size
    cache, table, logits = paged_sequence(model, prompt, room=max_new_tokens + k)
    tokens, kept = list(prompt) + [int(logits.argmax())], []
    while len(tokens) - len(prompt) < max_new_tokens:
        left = max_new_tokens - (len(tokens) - len(prompt))
        guesses = propose(tokens)[:min(k, left - 1)]  # a step emits at most its guesses and one more
        # subtle: the newest token's keys and values are not in the cache yet; a rejected guess's are, past the tokens
        # kept, where the next pass writes over them
        greedy = verify_pass(model, cache, table, len(tokens) - 1, [tokens[-1]] + guesses).argmax(-1)
        emitted = accept_proposals(torch.nn.functional.one_hot(greedy, vocab).float(), guesses)
        kept.append(len(emitted) - 1)
        tokens += emitted
    return tokens[len(prompt):], kept


@pytest.mark.parametrize("proposer", ["the model's own continuation", "a third of it wrong", "n-gram lookup",
                                      "random tokens"])
def test_greedy_decoding_by_speculative_steps_gives_greedys_tokens(tiny_model, proposer):
    "Whatever the guesses, 24 tokens equal plain greedy decoding's; right guesses are all kept, wrong ones cost only speed."
    vocab, k, rng = tiny_model.config.vocab_size, 4, random.Random(0)
    pattern = [rng.randrange(vocab) for _ in range(5)]
    prompt = pattern * 3 + [rng.randrange(vocab) for _ in range(3)]  # text that repeats: n-gram lookup finds it
    (expected,) = greedy_generate(tiny_model, [prompt], 24, block_size=BLOCK_SIZE)
    def continuation(tokens):
        return expected[len(tokens) - len(prompt):][:k]
    propose = {
        "the model's own continuation": continuation,
        "a third of it wrong": lambda tokens: [(t + 1) % vocab if (len(tokens) + i) % 3 == 0 else t
                                               for i, t in enumerate(continuation(tokens))],
        "n-gram lookup": lambda tokens: ngram_proposal(tokens, k, min_n=1, max_n=3),
        "random tokens": lambda tokens: [rng.randrange(vocab) for _ in range(k)],
    }[proposer]
    tokens, kept = speculative_greedy(tiny_model, prompt, 24, propose, k)
    assert tokens == expected
    if proposer == "the model's own continuation":  # every guess kept: 5 tokens a step, the last step shorter
        assert kept[:-1] == [k] * (len(kept) - 1) and len(kept) == 5, kept
    elif proposer == "a third of it wrong":
        assert 0 < sum(kept) < k * len(kept), kept
    elif proposer == "random tokens":
        assert sum(kept) <= 2, kept


# ---------------------------------------------------------------------------------------------- in the engine

# every guess checked (not only those that pay for their rows, notebook 05c): these tests exercise the verify path
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1, "adaptive": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec-engine"), "qwen3", seed=5)


def repeating_prompts(vocab: int = 256) -> list[list[int]]:
    "Prompts that repeat themselves (n-gram lookup finds guesses in them) and one that does not."
    rng = random.Random(0)
    pattern = [rng.randrange(vocab) for _ in range(5)]
    return [pattern * 3 + [rng.randrange(vocab) for _ in range(3)], [rng.randrange(vocab) for _ in range(20)],
            pattern * 4, [rng.randrange(vocab) for _ in range(7)] * 2]


def generate(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_greedy_tokens_with_ngram_speculation_equal_greedy_tokens_without(checkpoint, tp):
    "n-gram lookup's guesses, checked by the model in verify steps: the same greedy tokens at TP 1, 2 and 4."
    prompts, params = repeating_prompts(), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(checkpoint, tensor_parallel_size=tp, max_model_len=128) as llm:
        expected = generate(llm, prompts, params)
    with LLM(checkpoint, tensor_parallel_size=tp, max_model_len=128, speculative_config=NGRAM) as llm:
        assert generate(llm, prompts, params) == expected
        scheduler = llm.llm_engine.scheduler
        assert scheduler.num_guessed_tokens > 0 and 0 <= scheduler.num_kept_guesses <= scheduler.num_guessed_tokens


@pytest.mark.parametrize("sampled", [False, True])
def test_verify_steps_run_as_decode_steps_give_the_same_tokens(checkpoint, sampled):
    "The runner's form of a verify step where a decode graph holds it (a decode step of a row a token), taken on the CPU for every verify step: greedy tokens, and seeded sampled ones (n = 2, top-k, top-p, min-p, penalties), equal those without guesses."
    prompts = repeating_prompts()
    params = (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) if not sampled else
              [SamplingParams(n=2, temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, presence_penalty=0.3, seed=i,
                              max_tokens=40, ignore_eos=True) for i in range(len(prompts))])
    run = lambda llm: [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(checkpoint, max_model_len=128) as llm:
        expected = run(llm)
    with LLM(checkpoint, max_model_len=128, speculative_config=NGRAM) as llm:
        runner, forms = llm.llm_engine.runner, []
        def as_run(step):  # what the runner does where its graphs hold the step's rows
            forms.append(step.as_decode() if step.num_guesses is not None else None)
            return forms[-1] or step
        runner._as_run = as_run
        assert run(llm) == expected
        assert sum(f is not None for f in forms) > 5  # verify steps ran as decode steps
        assert llm.llm_engine.scheduler.num_kept_guesses > 0


def test_only_the_guesses_that_pay_are_checked(checkpoint):
    "By default the engine times its decode and verify steps into the scheduler's step cost and checks only the guesses that pay for their rows (notebook 05c); where a row costs a token's whole share, none; the tokens are the same."
    prompts, params = repeating_prompts(), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(checkpoint, max_model_len=128) as llm:
        expected = generate(llm, prompts, params)
    with LLM(checkpoint, max_model_len=128, speculative_config={**NGRAM, "adaptive": True}) as llm:
        assert generate(llm, prompts, params) == expected
        scheduler = llm.llm_engine.scheduler
        cost, guessed = scheduler.step_cost, scheduler.num_guessed_tokens
        assert guessed > 0 and cost.sums[0] > 0 and cost.line is not None  # steps timed, a line fitted
        cost.line, cost.record = (0.0, 1.0), lambda rows, seconds: None  # a row costs a token's share, and stays so
        assert generate(llm, prompts, params) == expected
        assert scheduler.num_guessed_tokens == guessed  # no guess checked


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_tokens_with_a_draft_model_equal_greedy_tokens_without(checkpoint, tmp_path, tp):
    "A draft model's guesses: the target itself keeps every guess, an unrelated model few; the same greedy tokens at TP 1 and 2."
    unrelated = make_tiny_checkpoint(tmp_path / "unrelated", "llama", num_hidden_layers=1, seed=11)
    prompts, params = repeating_prompts(), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(checkpoint, tensor_parallel_size=tp, max_model_len=128) as llm:
        expected = generate(llm, prompts, params)
    kept = {}
    for name, draft in (("itself", checkpoint), ("unrelated", unrelated)):
        spec = {"model": str(draft), "num_speculative_tokens": 4, "adaptive": False}
        with LLM(checkpoint, tensor_parallel_size=tp, max_model_len=128, speculative_config=spec) as llm:
            assert generate(llm, prompts, params) == expected
            s = llm.llm_engine.scheduler
            kept[name] = s.num_kept_guesses / max(1, s.num_guessed_tokens)
            assert s.num_guessed_tokens > 0
    assert kept["itself"] == 1.0 and kept["unrelated"] < 0.5, kept


@pytest.mark.parametrize("tp", [1, 2])
def test_a_draft_model_draws_as_its_requests_do(checkpoint, tmp_path, tp):
    "Sampled requests (seeded, with penalties, min-p and n = 2) with a draft model: the draft draws over its request's noise, so the target itself keeps every guess and an unrelated model few, and both give the tokens drawn without guesses."
    unrelated = make_tiny_checkpoint(tmp_path / "unrelated", "llama", num_hidden_layers=1, seed=11)
    prompts = repeating_prompts()
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=i, max_tokens=20, ignore_eos=True,
                             presence_penalty=0.3, min_p=0.02, n=1 + (i == 2)) for i in range(len(prompts))]
    run = lambda llm: [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(checkpoint, tensor_parallel_size=tp, max_model_len=128) as llm:
        expected = run(llm)
    kept = {}
    for name, draft in (("itself", checkpoint), ("unrelated", unrelated)):
        spec = {"model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
        with LLM(checkpoint, tensor_parallel_size=tp, max_model_len=128, speculative_config=spec) as llm:
            assert run(llm) == expected
            s = llm.llm_engine.scheduler
            kept[name] = s.num_kept_guesses / max(1, s.num_guessed_tokens)
            assert s.num_guessed_tokens > 0
    assert kept["itself"] == 1.0 and kept["unrelated"] < 0.5, kept


def test_unseeded_draws_with_a_draft_model_follow_the_models_distribution(checkpoint, tmp_path):
    "800 unseeded draws of one prompt with an unrelated draft model (each request given a seed its draft shares): the first three tokens come as often as without guesses (chi-squared)."
    unrelated = make_tiny_checkpoint(tmp_path / "unrelated", "llama", num_hidden_layers=1, seed=11)
    prompt, n = repeating_prompts()[1], 800
    params = SamplingParams(temperature=0.6, max_tokens=3, ignore_eos=True)
    run = lambda llm: [tuple(o.outputs[0].token_ids) for o in llm.generate([prompt] * n, params, use_tqdm=False)]
    with LLM(checkpoint, max_model_len=64) as llm:
        plain = run(llm)
    spec = {"model": str(unrelated), "num_speculative_tokens": 2, "adaptive": False}
    with LLM(checkpoint, max_model_len=64, speculative_config=spec) as llm:
        guessed = run(llm)
        assert llm.llm_engine.scheduler.num_kept_guesses > 20
    assert two_sample_p(Counter(plain), Counter(guessed)) > 1e-3


@pytest.mark.parametrize("tp", [1, 2])
def test_sampled_requests_guess_too_and_seeded_ones_keep_their_tokens(checkpoint, tp):
    "Sampled requests beside a greedy one (and n = 3): each row draws at its own position and a guess is kept where the draw equals it (notebook 05c's rule for a certain guess); a seeded draw depends on its seed and position only, so the tokens are those without guesses."
    prompts = repeating_prompts()
    params = [SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(len(prompts))]
    params[1] = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    params[2] = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)  # samples sharing a prompt
    run = lambda llm: [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(checkpoint, tensor_parallel_size=tp, max_model_len=128) as llm:
        expected = run(llm)
    with LLM(checkpoint, tensor_parallel_size=tp, max_model_len=128, speculative_config=NGRAM) as llm:
        assert run(llm) == expected
        scheduler = llm.llm_engine.scheduler
        assert scheduler.num_drafts > 0 and scheduler.num_kept_guesses > 0


def test_requests_short_of_min_tokens_guess_too(checkpoint):
    "A request short of its min_tokens masks EOS and its stop tokens row by row in a verify step (each row counts the guesses before it): its tokens are those without guesses."
    prompts = repeating_prompts()
    with LLM(checkpoint, max_model_len=128) as llm:
        free = generate(llm, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        # the 4th token of each is its stop token: min_tokens holds it back for 12 tokens
        params = [SamplingParams(temperature=0, max_tokens=30, min_tokens=12, stop_token_ids=[out[3]]) for out in free]
        expected = generate(llm, prompts, params)
    assert all(len(out) >= 12 for out in expected)
    with LLM(checkpoint, max_model_len=128, speculative_config=NGRAM) as llm:
        assert generate(llm, prompts, params) == expected
        assert llm.llm_engine.scheduler.num_guessed_tokens > 0


@pytest.mark.parametrize("extra", ["logprobs", "penalties"])
def test_logprobs_and_penalties_with_guesses_are_those_without(checkpoint, extra):
    "Seeded requests asking for logprobs, or with penalties, a bias and min-p, guess too: each row draws after the guesses before it, and each emitted token's logprobs are its row's, as decoding without guesses gives them."
    prompts = repeating_prompts()
    more = {"logprobs": dict(logprobs=2), "penalties": dict(logprobs=1, presence_penalty=0.4, frequency_penalty=0.3,
                                                            repetition_penalty=1.3, logit_bias={5: 2.0}, min_p=0.05)}
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=20, ignore_eos=True, **more[extra])
              for i in range(len(prompts))]
    run = lambda llm: llm.generate(prompts, params, use_tqdm=False)
    with LLM(checkpoint, max_model_len=128) as llm:
        expected = run(llm)
    with LLM(checkpoint, max_model_len=128, speculative_config=NGRAM) as llm:
        if extra == "penalties":  # penalised repeats leave n-gram lookup little: guess the tokens to come instead
            oracle(llm, prompts, [list(o.outputs[0].token_ids) for o in expected])
        got = run(llm)
        assert llm.llm_engine.scheduler.num_kept_guesses > 0
    for e, g in zip(expected, got):
        e, g = e.outputs[0], g.outputs[0]
        assert g.token_ids == e.token_ids and len(g.logprobs) == len(e.logprobs) == 20
        for le, lg in zip(e.logprobs, g.logprobs):
            assert le.keys() == lg.keys()
            torch.testing.assert_close([x.logprob for x in lg.values()], [x.logprob for x in le.values()], **F32)
            assert [x.rank for x in lg.values()] == [x.rank for x in le.values()]


def two_sample_p(a: Counter, b: Counter, least: int = 10) -> float:
    "The p-value of Pearson's chi-squared test that counts `a` and `b` come from one distribution (outcomes seen fewer than `least` times in both pooled)."
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= least]
    rows = [(a[k], b[k]) for k in keys]
    rows += [(sum(a.values()) - sum(r[0] for r in rows), sum(b.values()) - sum(r[1] for r in rows))]
    na, nb = sum(a.values()), sum(b.values())
    x = sum((c - (ca + cb) * n / (na + nb)) ** 2 / ((ca + cb) * n / (na + nb))
            for ca, cb in rows if ca + cb for c, n in ((ca, na), (cb, nb)))
    df = sum(1 for ca, cb in rows if ca + cb) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)))


def test_unseeded_sampled_tokens_with_guesses_follow_the_models_distribution(checkpoint):
    "1,500 unseeded draws of one prompt, with the most common continuation guessed after the first token: the tokens it guessed come as often as without guesses (chi-squared), where keeping every guess would not."
    prompt, n = repeating_prompts()[1], 1500
    params = SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True)
    run = lambda llm: [tuple(o.outputs[0].token_ids) for o in llm.generate([prompt] * n, params, use_tqdm=False)]
    with LLM(checkpoint, max_model_len=64) as llm:
        plain = run(llm)
    common = list(Counter(t[1:3] for t in plain).most_common(1)[0][0])
    guessed = {}
    for rule in ("the engine's", "keep every guess (wrong)"):
        with LLM(checkpoint, max_model_len=64, speculative_config={"num_speculative_tokens": 2, "adaptive": False}) as llm:
            scheduler = llm.llm_engine.scheduler
            scheduler.guess = lambda seq, limit: common[:limit] if seq.num_completion_tokens == 1 else []
            if rule != "the engine's":
                record = scheduler._record_guesses
                def keep_all(batch, drawn, *logprobs, record=record):
                    drawn, start = list(drawn), 0
                    for g in batch.guesses:
                        drawn[start:start + len(g)] = g
                        start += len(g) + 1
                    return record(batch, drawn, *logprobs)
                scheduler._record_guesses = keep_all
            guessed[rule] = run(llm)
            assert scheduler.num_kept_guesses > 100  # the guesses were right often enough to matter
    p = {rule: two_sample_p(Counter(t[1:3] for t in plain), Counter(t[1:3] for t in tokens))
         for rule, tokens in guessed.items()}
    assert p["the engine's"] > 1e-3 and p["keep every guess (wrong)"] < 1e-6, p


def oracle(llm, prompts, continuations):
    "Make the engine's guesses the expected continuation itself: every guess right."
    by_prompt = {tuple(p): c for p, c in zip(prompts, continuations)}
    def guess(seq, limit):
        return by_prompt[tuple(seq.prompt_token_ids)][seq.num_completion_tokens:][:min(limit, 4)]
    llm.llm_engine.scheduler.guess = guess


@pytest.mark.parametrize("ends", ["max_tokens", "a stop token", "EOS"])
def test_a_run_of_right_guesses_is_cut_where_the_request_ends(checkpoint, ends):
    "Every guess right, 5 tokens a step: a request that ends inside a run (max_tokens, a stop token, EOS) ends there, as without guesses."
    prompts = repeating_prompts()
    with LLM(checkpoint, max_model_len=128) as llm:
        free = generate(llm, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        stop = free[0][7]  # a token the first request meets seven tokens in, inside a run of guesses
        params = {"max_tokens": SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                  "a stop token": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop]),
                  "EOS": SamplingParams(temperature=0, max_tokens=30)}[ends]
        expected = generate(llm, prompts, params)
    with LLM(checkpoint, max_model_len=128, speculative_config=NGRAM) as llm:
        oracle(llm, prompts, free)
        assert generate(llm, prompts, params) == expected
        scheduler = llm.llm_engine.scheduler
        assert scheduler.num_kept_guesses == scheduler.num_guessed_tokens > 0
    if ends != "EOS":
        assert len(expected[0]) <= 8


def test_rejected_guesses_leave_no_trace_in_the_cache(checkpoint):
    "After generating with mostly wrong guesses, a request whose prompt is that text reuses its cached blocks and gets a fresh engine's tokens."
    prompts, params = repeating_prompts(), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(checkpoint, max_model_len=160, speculative_config=NGRAM) as llm:
        first = generate(llm, prompts, params)
        later = [p + out[:33] for p, out in zip(prompts, first)]  # the prompt and most of what came: cached blocks
        spec_later = generate(llm, later, params)
        assert llm.llm_engine.scheduler.block_manager.prefix_cache_hit_tokens > 0
    with LLM(checkpoint, max_model_len=160) as llm:
        assert generate(llm, later, params) == spec_later


def test_the_engine_core_streams_a_runs_tokens_and_counts_its_guesses(checkpoint):
    "Behind the server: each step's deltas carry all the tokens a run kept, and the stats vLLM's metrics read count the guesses."
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.serve.core import AddRequest, EngineCore
    from minivllm.serve.server import EngineCollector
    prompts, params = repeating_prompts(), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(checkpoint, max_model_len=128) as llm:
        expected = generate(llm, prompts, params)
    with LLMEngine(checkpoint, max_model_len=128, speculative_config=NGRAM) as engine:
        core = EngineCore(engine)
        for i, p in enumerate(prompts):
            assert core.add(AddRequest(f"r{i}", p, params)) is None
        got, most = {}, 0
        while core.has_work:
            outputs = core.step()
            for d in outputs.deltas:
                got.setdefault(d.request_id, []).extend(d.token_ids)
                most = max(most, len(d.token_ids))
        stats = outputs.stats
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    assert stats.spec_draft_tokens > 0 and stats.spec_drafts > 0 and 0 <= stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert most > 1 if stats.spec_accepted_tokens else most >= 1  # a step with kept guesses sends several tokens
    metrics = {f.name: f.samples[0].value for f in EngineCollector(SimpleNamespace(stats=stats), "m").collect()
               if "spec_decode" in f.name}
    assert metrics["vllm:spec_decode_num_draft_tokens"] == stats.spec_draft_tokens
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == stats.spec_accepted_tokens
