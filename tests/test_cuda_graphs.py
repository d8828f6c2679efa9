"""CUDA-graph decode: buckets and padding on the CPU (every batch size, real rows equal eager, padding stores
nothing), enforce_eager on and off giving identical outputs; on a GPU, replay against eager for a tiny Qwen3 and a
Qwen3-0.6B-shaped random model in bfloat16."""
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import Config
from minivllm.engine.cuda_graphs import DecodeBuffers, GraphDraws, graph_batch_sizes, pick_graph_batch_size, run_padded
from minivllm.engine.step import SamplingInputs, StepInputs
from minivllm.sampler import Sampler


def decode_step(input_ids, context_lens, block_tables, block_size):
    "A decode step's message (notebook 08c): each sequence's one new token, at position context_len - 1."
    return StepInputs.build(False, [[t] for t in input_ids], [n - 1 for n in context_lens], block_tables, block_size)
from minivllm.kv_cache import allocate_kv_cache, decode_metadata, prefill_metadata
from minivllm.models import load_model
from minivllm.testing import make_tiny_checkpoint

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
F32 = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 9, 16, 17, 100, 256, 512])
def test_buckets_cover_every_batch_size(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] >= max_num_seqs and sizes[-1] - max_num_seqs < 16
    assert [s for s in sizes if s <= 8] == [s for s in (1, 2, 4, 8) if s <= sizes[-1]]
    assert all(s % 16 == 0 for s in sizes if s > 8)
    for b in range(1, max_num_seqs + 1):
        s = pick_graph_batch_size(b, sizes)
        assert s >= b and not [t for t in sizes if b <= t < s]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("g"), "qwen3", num_attention_heads=4,
                                           num_key_value_heads=2, seed=3))


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 11, 16])
def test_padded_static_buffers_match_eager_decode(tiny_model, batch):
    "Random decode batches, padded to their bucket: the real rows and the cache match an eager step."
    model, bs, c = tiny_model, 4, tiny_model.config
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 30, (batch,), generator=g).tolist()
    tables, next_block = [], 0
    for n in lens:
        k = -(-(n + 1) // bs)
        tables.append(list(range(next_block, next_block + k))[::-1])
        next_block += k
    prompts = [torch.randint(0, c.vocab_size, (n,), generator=g).tolist() for n in lens]
    def prefilled():
        cache = allocate_kv_cache(c.num_hidden_layers, next_block + 2, bs, c.num_kv_heads_per_rank, c.head_dim,
                                  c.dtype, "cpu")
        with torch.no_grad():
            model(torch.tensor(sum(prompts, [])), torch.cat([torch.arange(n) for n in lens]), cache,
                  prefill_metadata(tables, [0] * batch, lens, bs))
        return cache
    new_ids = torch.randint(0, c.vocab_size, (batch,), generator=g).tolist()
    ctx = [n + 1 for n in lens]
    eager_cache, padded_cache = prefilled(), prefilled()
    with torch.no_grad():
        eager = model(torch.tensor(new_ids), torch.tensor(ctx) - 1, eager_cache, decode_metadata(tables, ctx, bs))
    sizes = graph_batch_sizes(16)
    bucket = pick_graph_batch_size(batch, sizes)
    buf = DecodeBuffers(sizes[-1], max_blocks=max(map(len, tables)) + 1)
    buf.fill(decode_step([7] * 16, [3] * 16, [[0]] * 16, bs), 16)  # a stale, larger step first
    buf.fill(decode_step(new_ids, ctx, tables, bs), bucket)
    with torch.no_grad():
        padded = run_padded(model, buf, padded_cache, bucket)
    torch.testing.assert_close(padded[:batch], eager, **F32)
    torch.testing.assert_close(padded_cache, eager_cache, **F32)
    assert (padded_cache != 0).equal(eager_cache != 0)


def test_the_draw_in_the_padded_step_gives_the_samplers_tokens(tiny_model):
    "The LM head and the one-pass draw on the padded buffers (what a graph with a draw records): greedy and seeded rows draw what the sampler draws from eager logits."
    gpu = pytest.importorskip("minivllm.gpu")
    from minivllm.gpu.triton_attention import INTERPRETED
    if not (gpu.TRITON_RUNS_ON_CPU and INTERPRETED):  # (on a GPU the interpreter is off: the CUDA tests below draw there)
        pytest.skip("the draw runs on the CPU only in Triton's interpreter (triton >= 3.2, TRITON_INTERPRET=1)")
    model, bs, c = tiny_model, 4, tiny_model.config
    lens, tables = [5, 9, 3], [[0, 1], [2, 3, 4], [5]]
    g = torch.Generator().manual_seed(4)
    cache = allocate_kv_cache(c.num_hidden_layers, 8, bs, c.num_kv_heads_per_rank, c.head_dim, c.dtype, "cpu")
    prompts = [torch.randint(0, c.vocab_size, (n - 1,), generator=g).tolist() for n in lens]
    with torch.no_grad():
        model(torch.tensor(sum(prompts, [])), torch.cat([torch.arange(n - 1) for n in lens]), cache,
              prefill_metadata(tables, [0] * 3, [n - 1 for n in lens], bs))
    step = decode_step([7, 8, 9], lens, tables, bs)
    step.sampling = SamplingInputs([0.0, 0.8, 1.3], [0, 0, 0], [1.0, 1.0, 1.0], [None, 11, -5], [0, 4, 2 ** 33],
                                   min_ps=[0.0, 0.0, 0.2])
    draws = GraphDraws.of_step(step, c.vocab_size)
    buf = DecodeBuffers(4, max_blocks=4)
    buf.fill(step, 4, draws=draws)
    with torch.no_grad():
        eager_logits = model.compute_logits(model(torch.tensor([7, 8, 9]), torch.tensor(lens) - 1, cache.clone(),
                                                  decode_metadata(tables, lens, bs)))
        logits, tokens = run_padded(model, buf, cache, 4, gpu.sample_rows_triton)
    torch.testing.assert_close(logits[:3], eager_logits, **F32)
    s = step.sampling
    want = Sampler()(logits[:3], s.temperatures, s.top_ks, s.top_ps, s.seeds, s.steps, min_ps=s.min_ps)
    assert tokens[:3].tolist() == want.tolist()  # the greedy row's argmax, the seeded rows' race


def test_buffers_reject_what_they_cannot_hold():
    buf = DecodeBuffers(4, max_blocks=2)
    with pytest.raises(ValueError, match="bucket"):
        buf.fill(decode_step([1] * 5, [2] * 5, [[0]] * 5, 4), 4)
    with pytest.raises(ValueError, match="of 2 blocks"):
        buf.fill(decode_step([1], [9], [[0, 1, 2]], 4), 1)


def test_enforce_eager_on_and_off_give_identical_outputs(tmp_path):
    "On the CPU the engine is eager either way; the flag must change nothing."
    path = make_tiny_checkpoint(tmp_path, "qwen3", seed=5)
    prompts = [[1, 2, 3], [9] * 17, [4, 5]]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True, seed=1),
              SamplingParams(temperature=1.0, top_k=20, max_tokens=12, ignore_eos=True, seed=2)]
    outs = []
    for eager in (True, False):
        with LLM(path, max_model_len=64, enforce_eager=eager) as llm:
            assert llm.llm_engine.runner.graphs is None or not eager
            outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]


def seeded_prompts(vocab_size: int, lengths=(5, 17, 33, 64, 100, 7, 250, 12, 3)) -> list[list[int]]:
    "Prompts of these lengths, each seeded by its length, every id within the model's vocabulary."
    return [torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def test_the_graph_tests_prompts_fit_every_model_they_run(tmp_path):
    "The CUDA test's prompts, run here on the CPU: ids beyond a tiny model's vocabulary would be refused."
    path = make_tiny_checkpoint(tmp_path, "qwen3", dtype="bfloat16")
    prompts = seeded_prompts(Config.from_pretrained(path).vocab_size)
    assert max(map(max, prompts)) < Config.from_pretrained(path).vocab_size
    with LLM(path, max_model_len=512, max_num_seqs=16) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [2] * len(prompts)


@needs_cuda
@pytest.mark.parametrize("shape", ["tiny", "qwen3-0.6b"])
def test_graph_replay_gives_eager_tokens_on_cuda(tmp_path, shape):
    kw = dict(dtype="bfloat16") if shape == "tiny" else dict(
        dtype="bfloat16", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, initializer_range=0.02)
    path = make_tiny_checkpoint(tmp_path, "qwen3", **kw)
    prompts = seeded_prompts(Config.from_pretrained(path).vocab_size)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = []
    for eager in (True, False):
        with LLM(path, max_model_len=512, max_num_seqs=16, enforce_eager=eager, gpu_memory_utilization=0.5) as llm:
            assert (llm.llm_engine.runner.graphs is None) == eager
            outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    agree = sum(a == b for x, y in zip(*outs) for a, b in zip(x, y)) / sum(map(len, outs[0]))
    assert outs[0] == outs[1] or (shape != "tiny" and agree > 0.99), f"tokens agree {agree:.1%}"


@needs_cuda
def test_graph_replay_draws_eager_seeded_tokens_on_cuda(tmp_path):
    "Seeded draws (temperature, top-p, min-p, top-k) in a replayed graph are eager's: the draw is keyed by (seed, position)."
    path = make_tiny_checkpoint(tmp_path, "qwen3", dtype="float32")
    prompts = seeded_prompts(Config.from_pretrained(path).vocab_size)
    params = [SamplingParams(temperature=0.5 + 0.2 * i, top_p=(0.9, 1.0)[i % 2], min_p=(0.0, 0.05)[i % 2],
                             top_k=(-1, 20)[i % 2], seed=i, max_tokens=24, ignore_eos=True) for i in range(len(prompts))]
    outs = []
    for eager in (True, False):
        with LLM(path, max_model_len=512, max_num_seqs=16, enforce_eager=eager, gpu_memory_utilization=0.5) as llm:
            assert (llm.llm_engine.runner.graphs is None) == eager
            outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]


@needs_cuda
def test_verify_steps_replay_decode_graphs_on_cuda(tmp_path):
    "Speculative decoding's verify steps (n-gram lookup, k = 3) replay the decode graphs as decode steps of a row a token: in float32, greedy and seeded sampled tokens equal decoding's without guesses (eager verify steps equal it on the CPU)."
    path = make_tiny_checkpoint(tmp_path, "qwen3", dtype="float32")
    prompts = [p * 3 for p in seeded_prompts(Config.from_pretrained(path).vocab_size)[:4]]  # repeats: n-gram lookup guesses
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=32, ignore_eos=True) for i in range(len(prompts))]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "adaptive": False}  # every guess checked: verify steps whatever the steps cost
    outs = []
    for eager, speculative in ((True, None), (False, spec)):  # 4 sequences x 4 rows: the largest graph's 16 rows
        with LLM(path, max_model_len=512, max_num_seqs=16, enforce_eager=eager, gpu_memory_utilization=0.5,
                 speculative_config=speculative) as llm:
            runner, as_decode = llm.llm_engine.runner, []
            form_of = runner._as_run
            def as_run(step):
                form = form_of(step)
                as_decode.append(step.num_guesses is not None and not form.is_prefill)
                return form
            runner._as_run = as_run
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            assert any(as_decode) == (speculative is not None)  # verify steps replayed decode graphs
    assert outs[0] == outs[1]
