"""Structured outputs (notebook 05b) through the engine: every schema of the corpus (tests/structured_corpus.py) gives
output that parses and validates, greedy and sampled, on the packaged model and on a random one; choices, regexes and
grammars hold; a constraint keeps working with n, stop strings, logprobs, scheduling ahead, several ranks, preemption
and chunked prefills; a bad constraint is refused naming the problem, and the engine serves the next request."""
import json
import re

import pytest

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import ParamError
from minivllm.structured_outputs import StructuredOutputsParams
from structured_corpus import SCHEMAS

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

PROMPTS = ["ROMEO.", "JULIET.", "First Citizen.", "HAMLET.", "KING HENRY.", "NURSE.", "MERCUTIO.", "LADY MACBETH."]


@pytest.fixture(scope="module")
def packaged():
    with LLM(max_model_len=1024) as llm:
        yield llm


def assert_valid(outs, schemas):
    "Every output finished (not cut by length), parses, and validates against its schema."
    for out, schema in zip(outs, schemas, strict=True):
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.finish_reason, c.text, schema)
            jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_schema_of_the_corpus_parses_and_validates_on_the_packaged_model(packaged, temperature):
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=400, structured_outputs=dict(json=s))
              for i, s in enumerate(SCHEMAS)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))]
    assert_valid(packaged.generate(prompts, params, use_tqdm=False), SCHEMAS)


def test_every_schema_of_the_corpus_parses_and_validates_on_a_random_model(chat_ckpt):
    "A random model (the packaged tokenizer) writes whatever its logits say: the mask alone makes it valid."
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=400, structured_outputs=dict(json=s))
              for i, s in enumerate(SCHEMAS)]
    with LLM(chat_ckpt, max_model_len=512) as llm:
        outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))], params, use_tqdm=False)
    assert_valid(outs, SCHEMAS)


def test_choices_regexes_grammars_and_json_objects(packaged):
    cases = [(dict(choice=["Romeo", "Juliet", 'Mer"cutio']), lambda t: t in ("Romeo", "Juliet", 'Mer"cutio')),
             (dict(regex="[A-Z][a-z]{1,8} [0-9]{2}"), lambda t: re.fullmatch("[A-Z][a-z]{1,8} [0-9]{2}", t)),
             (dict(grammar='start: "(" WORD ("," WORD)? ("," WORD)? ")"\nWORD: /[a-z]{1,5}/'),
              lambda t: re.fullmatch(r"\([a-z]{1,5}(,[a-z]{1,5}){0,2}\)", t)),
             (dict(grammar='root ::= "yes" | "no" | "maybe"'), lambda t: t in ("yes", "no", "maybe")),
             (dict(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                   disable_any_whitespace=True), lambda t: " " not in t and isinstance(json.loads(t)["a"], int))]
    for constraint, holds in cases:
        for temperature in (0.0, 1.0):
            [out] = packaged.generate(["ROMEO."], SamplingParams(temperature=temperature, seed=3, max_tokens=200,
                                                                structured_outputs=constraint), use_tqdm=False)
            text = out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop" and holds(text), (constraint, text)
    # any JSON object: the packaged model may write one key without end (a free string), but never leaves JSON
    outs = packaged.generate(PROMPTS, SamplingParams(temperature=0.9, seed=1, max_tokens=60,
                                                     structured_outputs=dict(json_object=True)), use_tqdm=False)
    for c in (out.outputs[0] for out in outs):
        assert c.text.startswith("{") and (c.finish_reason == "length" or isinstance(json.loads(c.text), dict)), c.text


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "colour": {"enum": ["red", "green", "blue"]}}, "required": ["name", "colour"]}


def constrained_run(llm, **extra):
    "Five requests under SCHEMA (n = 2, stop strings, logprobs among them): each completion's tokens, text and ending."
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=100, structured_outputs=dict(json=SCHEMA), **kw)
              for i, kw in enumerate([{}, dict(n=2), dict(logprobs=2), dict(stop=["zzz-never"]), {}])]
    outs = llm.generate(PROMPTS[:5], params, use_tqdm=False)
    for out in outs:
        for c in out.outputs:
            jsonschema.validate(json.loads(c.text), SCHEMA)
    return [(c.token_ids, c.text, c.finish_reason) for out in outs for c in out.outputs]


# every guess checked (not only those that pay for their rows, notebook 05c): the verify path itself
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1, "adaptive": False}


@pytest.mark.parametrize("backend, tp", [("guidance", 1), ("xgrammar", 1), ("guidance", 2)])
def test_constrained_requests_guess_and_keep_their_completions(chat_ckpt, backend, tp):
    "With speculation a constrained request guesses too: its guesses cut where its constraint refuses one, each row masked after the guesses before it, its matcher taking what is kept; the seeded completions (n = 2, logprobs, stop strings) are those without guesses."
    pytest.importorskip("xgrammar" if backend == "xgrammar" else "llguidance")
    with LLM(chat_ckpt, max_model_len=256, structured_outputs_backend=backend) as llm:
        plain = constrained_run(llm)
        tokenizer = llm.get_tokenizer()
    control = tokenizer.convert_tokens_to_ids("\u0101")  # the byte 0x01: JSON takes no raw control character
    letter = tokenizer.encode("a")[0]  # allowed inside a string, refused elsewhere
    completions = {}
    for prompt, (token_ids, _, _) in zip([PROMPTS[0], *PROMPTS[1:2] * 2, *PROMPTS[2:5]], plain):
        completions.setdefault(tuple(tokenizer.encode(prompt)), []).append(list(token_ids))
    proposed = []

    def guess(seq, limit):  # the completion to come (one of n = 2's), every 5th token refused, every 7th a letter
        done = seq.completion_token_ids
        ahead = next(c for c in completions[tuple(seq.prompt_token_ids)] if c[:len(done)] == done)[len(done):][:limit]
        at = lambda j: len(done) + j
        g = [control if at(j) % 5 == 3 else letter if at(j) % 7 == 5 else t for j, t in enumerate(ahead)]
        proposed.append(len(g))
        return g

    with LLM(chat_ckpt, max_model_len=256, structured_outputs_backend=backend, tensor_parallel_size=tp,
             speculative_config=NGRAM) as llm:
        llm.llm_engine.scheduler.guess = guess
        assert constrained_run(llm) == plain
        s = llm.llm_engine.scheduler
    assert 0 < s.num_kept_guesses < s.num_guessed_tokens < sum(proposed)  # kept, drawn otherwise, cut by the constraint


@pytest.mark.parametrize("guesses", ["ngram", "draft model"])
def test_constrained_requests_guess_from_their_text_or_a_draft_model(chat_ckpt, guesses):
    "n-gram lookup's guesses, or a draft model's (the target itself, which knows nothing of the constraint): the same completions as without guesses."
    with LLM(chat_ckpt, max_model_len=256) as llm:
        plain = constrained_run(llm)
    spec = NGRAM if guesses == "ngram" else {"model": str(chat_ckpt), "num_speculative_tokens": 3, "adaptive": False}
    with LLM(chat_ckpt, max_model_len=256, speculative_config=spec) as llm:
        assert constrained_run(llm) == plain
        assert llm.llm_engine.scheduler.num_kept_guesses > 0


@pytest.mark.parametrize("setting", [dict(async_scheduling=True), dict(tensor_parallel_size=2),
                                     dict(max_num_batched_tokens=16, max_num_seqs=3),
                                     dict(num_kvcache_blocks=8, kvcache_block_size=16, max_model_len=128)],
                         ids=["ahead", "tp2", "chunked", "preempting"])
def test_a_constraint_gives_the_same_outputs_whatever_runs_it(chat_ckpt, setting):
    "Scheduled ahead, over two ranks, in chunks, or preempted: the same valid completions as the plain engine's."
    with LLM(chat_ckpt, max_model_len=256) as llm:
        plain = constrained_run(llm)
    with LLM(chat_ckpt, **{"max_model_len": 256, **setting}) as llm:
        assert constrained_run(llm) == plain
        assert "num_kvcache_blocks" not in setting or llm.llm_engine.scheduler.num_preemptions > 0


def test_logprobs_are_of_what_the_constraint_allows(packaged):
    [out] = packaged.generate(["ROMEO."], SamplingParams(temperature=0, max_tokens=20, logprobs=5,
                                                         structured_outputs=dict(choice=["Romeo", "Juliet"])),
                              use_tqdm=False)
    first = out.outputs[0].logprobs[0]  # the sampled token's and the 5 likeliest: each one that can start a choice
    assert all(lp.logprob > float("-inf") and any(c.startswith(lp.decoded_token) for c in ("Romeo", "Juliet"))
               for lp in first.values()), first


@pytest.mark.parametrize("constraint, message", [
    (dict(json={"type": "strin"}), "the json constraint does not compile"),
    (dict(regex="(unclosed"), "the regex constraint does not compile"),
    (dict(grammar="start: nowhere"), "the grammar constraint does not compile"),
    (dict(choice=[]), "choice must be a non-empty list of strings"),
    (dict(json={"type": "object"}, regex="a"), "exactly one of"),
    (dict(structural_tag="{}", json_object=True), "structural_tag is not supported"),
    (dict(jsn={}), "jsn")])
def test_a_bad_constraint_is_refused_and_the_engine_serves_the_next_request(packaged, constraint, message):
    with pytest.raises((ParamError, ValueError), match=re.escape(message)):
        packaged.generate(["ROMEO."], SamplingParams(max_tokens=5, structured_outputs=constraint), use_tqdm=False)
    [out] = packaged.generate(["ROMEO."], SamplingParams(max_tokens=5, structured_outputs=dict(choice=["ok"])),
                              use_tqdm=False)
    assert out.outputs[0].text == "ok"


def test_params_take_the_dataclass_or_a_dict_and_name_a_wrong_type():
    assert SamplingParams(structured_outputs=dict(json_object=True)).structured_outputs == \
        StructuredOutputsParams(json_object=True)
    with pytest.raises(ParamError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    assert SamplingParams(structured_outputs=dict(choice=["a"])).needs_logits  # never the plain greedy path


def test_a_decode_graph_never_draws_for_a_constrained_row():
    "A CUDA graph's one-pass draw cannot see a constraint: a step with one leaves the graph's logits to the sampler."
    import torch

    from minivllm.engine.cuda_graphs import GraphDraws
    from minivllm.engine.step import SamplingInputs, StepInputs
    step = StepInputs.build(False, [[5], [6]], [3, 4], [[0], [1]], 16)
    step.sampling = SamplingInputs([0.8, 0.8], [-1, -1], [1.0, 1.0], [1, 2], [0, 0])
    assert GraphDraws.of_step(step, 100) is not None
    step.sampling.allowed_tokens = torch.full((2, 4), -1, dtype=torch.int32)
    assert GraphDraws.of_step(step, 100) is None


def test_auto_takes_guidance_then_xgrammar_where_it_keeps_the_constraint_whole():
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from minivllm.engine.args import EngineArgs
    from minivllm.model_source import DEFAULT_MODEL
    from minivllm.structured_outputs import Grammars
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    auto, both = Grammars(tokenizer, len(tokenizer)), ["guidance", "xgrammar"]
    cases = [(dict(json={"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}), both),
             (dict(json={"type": "object", "properties": {"x": {"type": "number"}}}), ["guidance"]),  # its decimals
             (dict(json={"type": "string", "pattern": "a+", "maxLength": 3}), ["guidance"]),  # xgrammar drops the bound
             (dict(json_object=True, whitespace_pattern=" ?"), ["guidance"]),
             (dict(grammar='start: "a"'), both), (dict(regex="[0-9]+"), both), (dict(choice=["a", "b"]), both)]
    for constraint, backends in cases:
        assert auto.backends_for(StructuredOutputsParams(**constraint)) == backends, constraint
    assert auto.compiled(StructuredOutputsParams(regex="[0-9]+"))[0] == "guidance"
    xgrammar = Grammars(tokenizer, len(tokenizer), backend="xgrammar")
    for constraint, message in [(dict(json_object=True, whitespace_pattern=" "), "takes no whitespace_pattern"),
                                (dict(json={"type": "number", "multipleOf": 0.5}), "ignore the schema's multipleOf"),
                                (dict(regex="(a"), "the regex constraint does not compile: Regex parsing error")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            xgrammar.matcher(StructuredOutputsParams(**constraint))
    assert xgrammar.compiled(StructuredOutputsParams(json={"type": "number"}))[0] == "xgrammar"  # asked for: its numbers
    with pytest.raises(ValueError, match="structured_outputs_backend must be one of auto, xgrammar, guidance"):
        EngineArgs(DEFAULT_MODEL, structured_outputs_backend="outlines")


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_each_backend_alone_gives_valid_json_on_a_random_model(chat_ckpt, backend):
    "A random model writes any token its mask allows: JSON strings with no raw control character (xgrammar's let them in)."
    pytest.importorskip(backend if backend == "xgrammar" else "llguidance")
    from minivllm.structured_outputs import strict_schema, xgrammar_ignores
    schemas = [s for s in SCHEMAS if backend == "guidance" or xgrammar_ignores(strict_schema(s)) is None]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured_outputs=dict(json=s))
              for i, s in enumerate(schemas)]
    with LLM(chat_ckpt, max_model_len=512, structured_outputs_backend=backend) as llm:
        outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(schemas))], params, use_tqdm=False)
    assert len(schemas) > 40
    assert_valid(outs, schemas)


def test_a_constraint_that_compiles_too_long_is_refused_in_time_and_the_next_is_served(chat_ckpt):
    import asyncio
    import time

    from minivllm.serve.async_llm import AsyncLLM

    async def main(engine):
        compile_now = engine.grammars._compile
        engine.grammars._compile = lambda backend, p: (time.sleep(2), compile_now(backend, p))[1]
        slow = SamplingParams(max_tokens=8, structured_outputs=dict(regex="[a-z]+"))
        start = time.perf_counter()
        with pytest.raises(ParamError, match=r"the regex constraint did not compile within 0.2 s"):
            await engine.compile_constraint(slow, max_seconds=0.2)
        assert time.perf_counter() - start < 1.5  # refused in time: the compile goes on in its thread
        deltas = [o async for o in engine.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))]
        assert sum(len(d.outputs[0].token_ids) for d in deltas) == 3 and deltas[-1].finished

    with AsyncLLM(chat_ckpt, max_model_len=128) as engine:
        asyncio.run(main(engine))


def test_the_real_vocabulary_tool_runs_small(tmp_path):
    "tools/structured_real_vocab.py at a small vocabulary: every output valid with each backend."
    pytest.importorskip("xgrammar")
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "structured_real_vocab", Path(__file__).resolve().parents[1] / "tools" / "structured_real_vocab.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--vocab", "1024", "--megabytes", "2", "--folder", str(tmp_path), "--json", str(tmp_path / "r.json")]) == 0
    results = json.loads((tmp_path / "r.json").read_text())
    for backend in ("guidance", "xgrammar"):
        r = results[backend]
        assert r["valid_t0.0"] == r["valid_t0.9"] == r["schemas"] > 40, r
