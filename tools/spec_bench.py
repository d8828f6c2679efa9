"""Speculative decoding's verify path with guesses of known quality: greedy decoding's output tokens/s with and
without speculation, where the guesses are the model's own greedy continuation with a share of them replaced
(each replaced guess is wrong; a step keeps the guesses before its first wrong one). The same prompts run without
guesses and with them, alternating, `--rounds` times; each line prints both speeds, their ratio, the guesses kept
and the tokens a sequence gained a step. With `--json`, every pair is written for notebook 05c's figure.

    python tools/spec_bench.py [--random-shape smollm2-135m | --model PATH] [--batch 1] [--k 1,2,4,6] [--replaced 0,0.2,0.5]
                               [--max-tokens 128] [--rounds 2] [--dtype float32] [--adaptive] [--json spec_bench.json]

Every guess is checked (the verify path itself); `--adaptive` checks only the guesses that pay for their rows, as the
engine does by default (notebook 05c). A ratio is the pair's own (the two runs back to back); name the CPU (lscpu).
"""
import argparse
import json
import random
import sys
import time

from minivllm import LLM, SamplingParams
from minivllm.bench.workload import device_name
from minivllm.checkpoints import SHAPES, random_checkpoint
from minivllm.config import Config


def known_guesses(continuations: dict[tuple, list[int]], k: int, replaced: float, vocab_size: int):
    "A scheduler's `guess`: the next `k` tokens of each prompt's own continuation, each replaced (made wrong) with probability `replaced`, the same ones every run."
    def guess(seq, limit):
        done = seq.num_completion_tokens
        ahead = continuations[tuple(seq.prompt_token_ids)][done:done + min(limit, k)]
        return [t if random.Random(done + i).random() >= replaced else (t + 1) % vocab_size for i, t in enumerate(ahead)]
    return guess


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], float]:
    "The greedy tokens of `prompts` and the output tokens/s."
    start = time.perf_counter()
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return out, sum(map(len, out)) / (time.perf_counter() - start)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--random-shape", default="smollm2-135m", choices=sorted(SHAPES),
                   help="a random-weight checkpoint of this real model's shape (built once, cached)")
    p.add_argument("--model", default=None, help="a checkpoint folder instead")
    p.add_argument("--batch", type=int, default=1, help="requests, all at once")
    p.add_argument("--k", default="1,2,4,6", help="comma-separated num_speculative_tokens values")
    p.add_argument("--replaced", default="0,0.2,0.5", help="comma-separated shares of the guesses made wrong")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--adaptive", action="store_true", help="check only the guesses that pay (the engine's default)")
    p.add_argument("--json", default=None, help="also write every pair to this file")
    a = p.parse_args(argv)
    ks, shares = [int(k) for k in a.k.split(",")], [float(s) for s in a.replaced.split(",")]
    if min(a.batch, a.max_tokens, a.prompt_len, a.rounds, *ks) < 1 or not all(0 <= s <= 1 for s in shares):
        p.error("--batch, --max-tokens, --prompt-len, --rounds and --k must be at least 1, --replaced in [0, 1]")
    model = a.model or random_checkpoint(a.random_shape)
    vocab = Config.from_pretrained(model).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(a.batch)]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    kw = dict(dtype=a.dtype, max_model_len=a.prompt_len + a.max_tokens)
    pairs = []
    with LLM(model, **kw) as plain, LLM(
            model, speculative_config={"num_speculative_tokens": max(ks), "adaptive": a.adaptive}, **kw) as spec:
        expected, _ = timed(plain, prompts, params)
        continuations = {tuple(q): e for q, e in zip(prompts, expected)}
        scheduler = spec.llm_engine.scheduler
        for k in ks:
            # subtle: the engine's k bounds the limit each `guess` is given; `known_guesses` takes k of them
            for share in shares:
                scheduler.guess = known_guesses(continuations, k, share, vocab)
                timed(spec, prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm up
                for r in range(a.rounds):
                    before = (scheduler.num_drafts, scheduler.num_guessed_tokens, scheduler.num_kept_guesses)
                    runs = {}
                    for name in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):  # alternate the order
                        runs[name] = timed(plain if name == "plain" else spec, prompts, params)
                    if runs["spec"][0] != expected:
                        print("speculative decoding changed the greedy tokens", file=sys.stderr)
                        return 1
                    drafts, guessed, kept = (n - b for n, b in zip(
                        (scheduler.num_drafts, scheduler.num_guessed_tokens, scheduler.num_kept_guesses), before))
                    pair = dict(k=k, replaced=share, round=r + 1, plain_tok_s=runs["plain"][1],
                                spec_tok_s=runs["spec"][1], ratio=runs["spec"][1] / runs["plain"][1],
                                guesses=guessed, kept=kept, tokens_per_step=1 + kept / max(drafts, 1))
                    pairs.append(pair)
                    print(f"batch {a.batch}, k {k}, {share:.0%} replaced, round {r + 1}: plain {pair['plain_tok_s']:.1f} "
                          f"tok/s, speculative {pair['spec_tok_s']:.1f} ({pair['ratio']:.2f}x); {kept} of {guessed} "
                          f"guesses kept, {pair['tokens_per_step']:.2f} tokens a step", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "device": device_name(), "pairs": pairs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
