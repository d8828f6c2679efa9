"""Structured outputs (notebook 05b) over a tokenizer of a real model's size, with none on disk: a byte-level BPE of
151,936 tokens (Qwen3's count) trained here on Python sources: the standard library's, then this environment's
packages' (the `tokenizers` library, offline, the same files in the same order each time), a tiny random checkpoint over it, then every schema of the test
corpus (tests/structured_corpus.py), greedy and sampled, with each backend. Reported per backend: how many outputs
parse and validate (a random model writes any token its mask allows), the time to compile each schema, and the time
to fill and apply 64 rows' masks (all 151,936 tokens judged per row).

    python tools/structured_real_vocab.py [--vocab 151936] [--megabytes 150] [--backends guidance xgrammar] [--json PATH]

Training the tokenizer takes a minute or two on 2 cores; `--folder` keeps it (and the checkpoint) for a second run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"


def train_tokenizer(folder: Path, vocab_size: int, megabytes: float):
    "A byte-level BPE of `vocab_size` tokens (EOS first) trained on Python sources (`--megabytes` of them), saved in `folder`."
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    if (folder / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(folder)
    files, size = [], 0
    sources = [Path(sysconfig.get_paths()[name]) for name in ("stdlib", "purelib")]  # then this environment's packages
    for path in [p for source in sources for p in sorted(source.rglob("*.py"))]:  # (sorted: the same text each time)
        if size > megabytes * 1e6:
            break
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:  # (a few test files hold other encodings on purpose)
            continue
        files.append(str(path))
        size += path.stat().st_size
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train(files, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS)
    tokenizer.save_pretrained(folder)
    print(f"trained a byte-level BPE of {len(tokenizer):,} tokens on {len(files):,} files ({size / 1e6:.0f} MB)")
    return tokenizer


def checkpoint(folder: Path, tokenizer, vocab_size: int) -> Path:
    "A tiny random Qwen3 checkpoint whose vocabulary is `vocab_size` rows, with `tokenizer`."
    from minivllm.checkpoints import make_tiny_checkpoint
    path = folder / "ckpt"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, vocab_size=vocab_size)
        tokenizer.save_pretrained(path)
        config = json.loads((path / "config.json").read_text())
        config["eos_token_id"] = tokenizer.eos_token_id
        (path / "config.json").write_text(json.dumps(config))
    return path


def judged(outs, schemas) -> tuple[int, int]:
    "(valid, finished): how many outputs parse and validate, and how many ended by their constraint (not by length)."
    import jsonschema
    valid = finished = 0
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        finished += c.finish_reason == "stop"
        try:
            jsonschema.validate(json.loads(c.text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return valid, finished


def host_costs(tokenizer, vocab_size: int, backend: str, schemas: list[dict]) -> dict:
    "Compile times of each schema (ms), and the least time to fill and to apply 64 rows' masks a few tokens in (ms)."
    import torch

    from minivllm.structured_outputs import Grammars, StructuredOutputsParams, allowed_tokens, mask_logits
    grammars = Grammars(tokenizer, vocab_size, backend)
    grammars.matcher(StructuredOutputsParams(regex="[0-9]"))  # the tokenizer wrapped before the timing
    compile_ms, compiled = [], []
    for s in schemas:
        start = time.perf_counter()
        try:
            grammars.compiled(StructuredOutputsParams(json=s))
            compiled.append(s)
        except ValueError:
            continue  # (xgrammar refuses what it would break: the run below leaves those out too)
        compile_ms.append((time.perf_counter() - start) * 1e3)
    rows = [grammars.matcher(StructuredOutputsParams(json=compiled[i % len(compiled)])) for i in range(64)]
    g = torch.Generator().manual_seed(0)
    for _ in range(4):  # a few tokens in, random logits, greedy
        logits = mask_logits(torch.randn(64, vocab_size, generator=g), allowed_tokens(rows))
        for m, token in zip(rows, logits.argmax(-1).tolist()):
            if not m.is_stopped: m.consume(token)
    fill, apply = [], []
    for _ in range(5):
        start = time.perf_counter(); bits = allowed_tokens(rows); fill.append(time.perf_counter() - start)
        logits = torch.randn(64, vocab_size)
        start = time.perf_counter(); mask_logits(logits, bits); apply.append(time.perf_counter() - start)
    return dict(compile_ms_median=statistics.median(compile_ms), compile_ms_max=max(compile_ms),
                compiled=len(compiled), fill_ms=min(fill) * 1e3, apply_ms=min(apply) * 1e3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936, help="tokens of the tokenizer and rows of the logits")
    p.add_argument("--megabytes", type=float, default=150, help="of Python sources to train on")
    p.add_argument("--backends", nargs="+", default=["guidance", "xgrammar"])
    p.add_argument("--folder", default=None, help="keep the tokenizer and checkpoint here (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from structured_corpus import SCHEMAS

    from minivllm import LLM, SamplingParams
    from minivllm.structured_outputs import strict_schema, xgrammar_ignores
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(a.folder or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer = train_tokenizer(folder, a.vocab, a.megabytes)
        path, results = checkpoint(folder, tokenizer, a.vocab), {"tokens": len(tokenizer)}
        for backend in a.backends:
            schemas = [s for s in SCHEMAS if backend != "xgrammar" or xgrammar_ignores(strict_schema(s)) is None]
            r = host_costs(tokenizer, a.vocab, backend, schemas)
            with LLM(path, max_model_len=512, structured_outputs_backend=backend) as llm:
                for temperature in (0.0, 0.9):
                    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=400,
                                             structured_outputs=dict(json=s)) for i, s in enumerate(schemas)]
                    outs = llm.generate([f"{i}: " for i in range(len(schemas))], params, use_tqdm=False)
                    r[f"valid_t{temperature}"], r[f"finished_t{temperature}"] = judged(outs, schemas)
            r["schemas"] = len(schemas)
            results[backend] = r
            print(f"{backend}: valid {r['valid_t0.0']}/{len(schemas)} greedy, {r['valid_t0.9']}/{len(schemas)} sampled "
                  f"(finished {r['finished_t0.0']}, {r['finished_t0.9']}); compile median {r['compile_ms_median']:.1f} ms, "
                  f"max {r['compile_ms_max']:.1f} ms; 64 rows: fill {r['fill_ms']:.2f} ms, apply {r['apply_ms']:.2f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
