"""A decode step reads the device once: the sampled tokens. `count_host_reads` (minivllm.testing) counts every read of
tensor values into Python, what on a GPU makes the host wait for the card; the sampler makes none of its own."""
import pytest
import torch

from minivllm import SamplingParams
from minivllm.engine.args import EngineArgs
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.model_runner import ModelRunner, execute_step
from minivllm.engine.scheduler import Scheduler
from minivllm.sampler import Sampler
from minivllm.testing import count_host_reads, make_tiny_checkpoint

GREEDY = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 3
SAMPLED = [SamplingParams(temperature=0.8, top_k=5, max_tokens=4, ignore_eos=True, seed=7),
           SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05, max_tokens=4, ignore_eos=True),
           SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                          max_tokens=4, ignore_eos=True),
           SamplingParams(temperature=1.0, seed=2**63 - 1, logit_bias={3: 2.0}, min_tokens=2, max_tokens=4,
                          ignore_eos=True)]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3", num_attention_heads=4, num_key_value_heads=2)
    runner = ModelRunner(0, EngineArgs(ckpt, max_model_len=64))
    yield runner
    runner.exit()


def decode_step(runner, params):
    "A scheduler past its prefill, and its first decode batch."
    sched = Scheduler(BlockManager(runner.num_blocks, runner.block_size), 8, 64, runner.max_model_len)
    for i, p in enumerate(params):
        sched.add([5 + i, 9, 2, 7, 1], p)
    batch = sched.schedule()
    sched.postprocess(batch, *execute_step(batch.step, runner))
    batch = sched.schedule()
    assert not batch.step.is_prefill
    return sched, batch


class CountingSampler(Sampler):
    "The runner's sampler, counting the reads inside it."
    def forward(self, *args, **kwargs):
        with count_host_reads() as reads:
            tokens = super().forward(*args, **kwargs)
        self.reads.append(reads)
        return tokens


LOGPROBS = [SamplingParams(temperature=0.7, logprobs=3, max_tokens=4, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED, LOGPROBS], ids=["greedy", "sampled", "logprobs"])
def test_a_decode_step_reads_the_device_once(runner, params):
    sched, batch = decode_step(runner, params)
    runner.sampler = sampler = CountingSampler()
    sampler.reads = []
    try:
        with torch.no_grad(), count_host_reads() as reads:
            output = runner.run(batch.step)
    finally:
        runner.sampler = Sampler()
    assert len(output.token_ids) == len(params)
    if params is not GREEDY:
        assert len(sampler.reads) == 1 and sampler.reads[0].count == 0, sampler.reads  # the sampler reads nothing
    # the sampled tokens (with their logprobs when asked) as they land (`PendingOutput.result`), and nothing else
    assert reads.count == 1 and reads.sites[0].startswith("tolist at step.py"), reads
    sched.postprocess(batch, *output)


def test_sampler_alone_reads_nothing():
    "Every setting at once, seeded and not, on a batch: the tokens come back as a tensor, unread."
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    with count_host_reads() as reads:
        tokens = Sampler()(logits, [0.0, 0.7, 1.0, 1.3, 0.5, 1.0], [-1, 5, 0, 20, 1, -1], [1.0, 0.9, 0.5, 1.0, 1.0, 0.7],
                           seeds=[None, 1, None, 2**63 - 1, -5, None], steps=[0, 3, 0, 9, 1, 0],
                           generator=torch.Generator().manual_seed(1), min_ps=[0.0, 0.1, 0.0, 0.05, 0.0, 0.2])
    assert reads.count == 0, reads
    assert tokens.shape == (6,)


def test_a_decode_step_with_logprobs_reads_once(runner):
    "Asking for logprobs adds no read: the tokens and every asked row's log-probabilities come back at once."
    params = [SamplingParams(temperature=0.9, seed=i, logprobs=3, max_tokens=4, ignore_eos=True) for i in range(4)]
    sched, batch = decode_step(runner, params)
    with torch.no_grad(), count_host_reads() as reads:
        output = runner.run(batch.step)
    assert all(len(lp) >= 3 for lp in output.logprobs)
    assert reads.count == 1, reads  # the tokens and the logprobs' table, in one read
    sched.postprocess(batch, *output)
