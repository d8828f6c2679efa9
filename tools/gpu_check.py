"""What anyone with one GPU runs first: is minivllm correct there, and how fast is it against what the card can do.

    python tools/gpu_check.py [--out gpu_check.json] [--num-prompts 256] [--skip-tests] [--attention-backend NAME]
    python tools/gpu_check.py --dry-run    # the same steps on the CPU with tiny models (what CI runs)

Prints one table and writes a JSON: the card, driver, torch, triton, transformers and flash-attn; the card's measured
copy bandwidth; the `cuda` tests; greedy tokens against transformers on the same device (tiny Qwen3 and Llama,
float32 and bfloat16, CUDA graphs and eager; where a prompt's tokens part, transformers' own logit gap between its
token and ours at the first difference: a near tie that kernels' different sums may break either way); nano-vllm's benchmark workload (a Qwen3-0.6B-shaped random model in
bfloat16, 256 requests, prompt and output lengths uniform in 100..1024 drawn as its bench.py draws them, temperature
0.6, ignore_eos, max_model_len 4096) with graphs and eager; transformers' batched `generate` on a 64-request slice;
decode tokens/s at batch 1, 16, 64 and 256 beside the bandwidth ceiling (weights and KV read per step over the
measured copy bandwidth). About five minutes on an H100 or H200 once attention is fast. `--attention-backend sdpa`
(or any backend of notebook 06a) runs every engine of the check on that backend: the table before and after a kernel.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minivllm.bench.throughput import bench_transformers
from minivllm.bench.workload import Workload
from minivllm.checkpoints import SHAPES, make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENCE_PROMPTS = 13  # prompts per greedy comparison
TINY = {  # the two tiny models of the greedy comparison: a GQA Qwen3, and a tied MHA Llama of head size 24
    "qwen3": dict(model_type="qwen3", vocab_size=1000, num_attention_heads=4, num_key_value_heads=2),
    "llama": dict(model_type="llama", vocab_size=1000, tie_word_embeddings=True, hidden_size=96, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=24),
}


def version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def copy_bandwidth_gbs(device: torch.device, mib: int) -> float:
    "GB/s of a device-to-device copy of `mib` MiB (bytes read plus bytes written), the best of 10."
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment(device: torch.device, mib: int) -> dict:
    "The card (or CPU) and the software around it."
    from minivllm.bench.workload import device_name
    info = dict(device=device_name(), torch=torch.__version__, cuda=torch.version.cuda, triton=version_of("triton"),
                transformers=version_of("transformers"), flash_attn=version_of("flash-attn") or version_of("flash_attn"))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= dict(memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}")
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            info["driver"] = None
    info["copy_bandwidth_gbs"] = round(copy_bandwidth_gbs(device, mib), 1)
    return info


def cuda_tests(dry_run: bool) -> dict:
    "The test suite's CUDA tests (those named *cuda*), in a child pytest; its counts."
    if dry_run:
        return dict(skipped="dry run: no GPU")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=1800)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", run.stdout)}
    return dict(exit_code=run.returncode, **counts, tail=run.stdout.strip().splitlines()[-1] if run.stdout.strip() else "")


def hf_greedy_on(path: Path, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype, device: torch.device):
    "transformers' greedy continuations on `device`, one prompt at a time, EOS an ordinary token."
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        return [hf.generate(torch.tensor([p], device=device), max_new_tokens=new_tokens, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def logit_gap(path: Path, prompt: list[int], ours: list[int], theirs: list[int], dtype: torch.dtype,
              device: torch.device) -> dict:
    "Where two greedy continuations first part: transformers' logit of its token minus its logit of ours, and both's scale."
    import transformers
    step = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + theirs[:step]], device=device)).logits[0, -1].float()
    return dict(step=step, gap=float(logits[theirs[step]] - logits[ours[step]]), max_logit=float(logits.abs().max()))


def greedy_equivalence(folder: Path, device: torch.device, new_tokens: int, backend: str | None = None) -> list[dict]:
    "For each tiny model, dtype and (on a GPU) graph setting: how many of the prompts' greedy tokens equal transformers'."
    from minivllm import LLM, SamplingParams
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, shape in TINY.items():
        kw = dict(shape)
        path = make_tiny_checkpoint(folder / name, kw.pop("model_type"), **kw)
        prompts = [torch.randint(0, kw["vocab_size"], (n,), generator=g).tolist()
                   for n in torch.randint(3, 60, (EQUIVALENCE_PROMPTS,), generator=g).tolist()]
        for dtype in ("float32", "bfloat16"):
            reference = hf_greedy_on(path, prompts, new_tokens, getattr(torch, dtype), device)
            for eager in ((True, False) if device.type == "cuda" else (True,)):
                with LLM(path, dtype=dtype, device=device.type, enforce_eager=eager, max_model_len=256,
                         attention_backend=backend) as llm:
                    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                                        use_tqdm=False)
                same = sum(o.token_ids == r for o, r in zip(outs, reference))
                # subtle: a part where transformers' own two logits lie within float rounding of each other is a tie
                # that any other order of the same sums may break the other way; a wide gap would be a bug
                parts = [logit_gap(path, p, o.token_ids, r, getattr(torch, dtype), device)
                         for p, o, r in zip(prompts, outs, reference) if o.token_ids != r]
                rows.append(dict(model=name, dtype=dtype, graphs=not eager, equal=same, prompts=len(prompts),
                                 parts=parts))
    return rows


def run_workload(path: Path, workload: Workload, device: torch.device, eager: bool, max_model_len: int,
                 backend: str | None = None) -> dict:
    "minivllm's output tokens/s on `workload` (one generate call), after a warm-up."
    from minivllm import LLM, SamplingParams
    with LLM(path, dtype="bfloat16", device=device.type, enforce_eager=eager, max_model_len=max_model_len,
             attention_backend=backend) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        sync(device)
        start = time.perf_counter()
        outs = llm.generate(workload.prompts, workload.sampling_params(), use_tqdm=False)
        sync(device)
        seconds = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == workload.output_lens
    return dict(graphs=not eager, requests=len(workload.prompts), output_tokens=workload.output_tokens,
                seconds=round(seconds, 2), tokens_per_s=round(workload.output_tokens / seconds, 1))


def model_bytes(path: Path) -> int:
    "Bytes of the weights a decode step reads: the checkpoint's tensors (a tied head read once more)."
    from safetensors import safe_open
    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                t = st.get_slice(k)
                n = 1
                for s in t.get_shape(): n *= s
                total += n * {"BF16": 2, "F16": 2, "F32": 4}.get(t.get_dtype(), 2)
    config = json.loads((path / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        total += config["vocab_size"] * config["hidden_size"] * 2  # the head reads the embedding again
    return total


def decode_rates(path: Path, device: torch.device, batches: list[int], context: int, steps: int,
                 bandwidth_gbs: float, backend: str | None = None) -> list[dict]:
    "Decode tokens/s at each batch size (prompts of `context` tokens, `steps` new tokens each), beside the ceiling."
    from minivllm import LLM, SamplingParams
    config = json.loads((path / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2  # K and V, bfloat16
    weights = model_bytes(path)
    rows = []
    with LLM(path, dtype="bfloat16", device=device.type, max_model_len=context + steps + 8,
             max_num_seqs=max(batches), attention_backend=backend) as llm:
        for b in batches:
            prompts = [[(7 * i + j) % 1000 + 1 for j in range(context)] for i in range(b)]
            params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
            sync(device)
            start = time.perf_counter()  # the prefill is timed too, and taken out by timing a one-token run below
            llm.generate(prompts, params, use_tqdm=False)
            sync(device)
            whole = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
            sync(device)
            decode_s = max(whole - (time.perf_counter() - start), 1e-9)
            rate = b * (steps - 1) / decode_s
            step_bytes = weights + b * (context + steps / 2) * kv_per_token
            ceiling = b * bandwidth_gbs * 1e9 / step_bytes
            rows.append(dict(batch=b, tokens_per_s=round(rate, 1), ceiling_tokens_per_s=round(ceiling, 1),
                             fraction=round(rate / ceiling, 3)))
    return rows


def table(results: dict) -> str:
    "One table of every check."
    env, lines = results["environment"], []
    add = lambda check, result, detail="": lines.append(f"| {check} | {result} | {detail} |")
    add("device", env["device"], f"driver {env.get('driver')}, torch {env['torch']} (CUDA {env['cuda']}), triton "
        f"{env['triton']}, transformers {env['transformers']}, flash-attn {env['flash_attn'] or 'absent'}")
    add("copy bandwidth", f"{env['copy_bandwidth_gbs']:,.0f} GB/s", "device to device, read + write")
    t = results["cuda_tests"]
    add("cuda tests", t.get("skipped") or f"{t.get('passed', 0)} passed, {t.get('failed', 0)} failed",
        t.get("tail", ""))
    add("attention backend", results["attention_backend"] or "automatic")
    for r in results["greedy_equivalence"]:
        gaps = ", ".join(f"step {p['step']}: gap {p['gap']:.2g} of logits up to {p['max_logit']:.2g}" for p in r["parts"])
        add(f"greedy vs transformers: {r['model']} {r['dtype']}, {'graphs' if r['graphs'] else 'eager'}",
            f"{r['equal']}/{r['prompts']}", f"where they part, transformers' own logit gap: {gaps}" if gaps else "")
    for r in results["workload"]:
        add(f"workload ({r['requests']} requests), {'graphs' if r['graphs'] else 'eager'}",
            f"{r['tokens_per_s']:,.0f} tok/s", f"{r['output_tokens']:,} tokens in {r['seconds']} s")
    if len(results["workload"]) == 2:
        add("graphs over eager", f"{results['workload'][0]['tokens_per_s'] / results['workload'][1]['tokens_per_s']:.2f}x")
    s = results["transformers_slice"]
    add(f"transformers batched generate ({s['requests']} requests)", f"{s['transformers_tokens_per_s']:,.0f} tok/s",
        f"minivllm {s['minivllm_tokens_per_s']:,.0f} tok/s on the same slice: {s['ratio']:.1f}x")
    for r in results["decode"]:
        add(f"decode at batch {r['batch']}", f"{r['tokens_per_s']:,.0f} tok/s",
            f"ceiling {r['ceiling_tokens_per_s']:,.0f} tok/s ({r['fraction']:.0%})")
    return "\n".join(["| check | result | detail |", "|---|---|---|", *lines])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny models on the CPU: every step, in seconds, no GPU")
    ap.add_argument("--out", default="gpu_check.json", help="where the JSON goes (default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=256, help="requests of the workload (default: %(default)s)")
    ap.add_argument("--skip-tests", action="store_true", help="leave out the cuda tests")
    ap.add_argument("--attention-backend", default=None, metavar="NAME",
                    help="run every engine on this attention backend (triton, sdpa, flash, ...; default: automatic)")
    a = ap.parse_args(argv)
    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA GPU here (run with --dry-run to try the steps on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if a.dry_run else "cuda")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        results = {"environment": environment(device, 64 if a.dry_run else 1024), "attention_backend": a.attention_backend}
        log(f"on {results['environment']['device']}")
        results["cuda_tests"] = cuda_tests(a.dry_run) if not a.skip_tests else dict(skipped="--skip-tests")
        log("greedy against transformers")
        results["greedy_equivalence"] = greedy_equivalence(tmp, device, 8 if a.dry_run else 32, a.attention_backend)
        if a.dry_run:  # the workload's shape, scaled down: a tiny Qwen3 with a vocabulary that holds its ids
            model = make_tiny_checkpoint(tmp / "shape", "qwen3", vocab_size=10_240, dtype="bfloat16")
            workload = Workload.nano_vllm(num_prompts=min(a.num_prompts, 6), max_input_len=110, max_output_len=104)
            slice_size, batches, context, steps, max_len = 4, [1, 4], 32, 8, 256
        else:
            model = make_tiny_checkpoint(tmp / "qwen3-0.6b", initializer_range=0.02, dtype="bfloat16",
                                         **SHAPES["qwen3-0.6b"])
            workload = Workload.nano_vllm(num_prompts=a.num_prompts)
            slice_size, batches, context, steps, max_len = 64, [1, 16, 64, 256], 512, 64, 4096
        results["workload"] = []
        for eager in ((False, True) if device.type == "cuda" else (True,)):
            log(f"the workload, {'eager' if eager else 'with CUDA graphs'}")
            results["workload"].append(run_workload(model, workload, device, eager, max_len, a.attention_backend))
        part = Workload(workload.prompts[:slice_size], workload.output_lens[:slice_size])  # greedy: transformers' too
        log(f"transformers on {slice_size} requests")
        theirs = bench_transformers(model, part, "bfloat16", slice_size, device=device.type)
        ours = run_workload(model, part, device, False if device.type == "cuda" else True, max_len, a.attention_backend)
        results["transformers_slice"] = dict(requests=slice_size, transformers_tokens_per_s=round(theirs.tokens_per_s, 1),
                                             minivllm_tokens_per_s=ours["tokens_per_s"],
                                             ratio=round(ours["tokens_per_s"] / theirs.tokens_per_s, 2))
        log("decode rates")
        results["decode"] = decode_rates(model, device, batches, context, steps,
                                         results["environment"]["copy_bandwidth_gbs"], a.attention_backend)
    print(table(results))
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
