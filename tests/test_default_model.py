"""The model the package ships: it loads with no path, its greedy text is the same at TP=1, 2 and 4 and equals
transformers' on the same folder, and the validation loss in its model card is reproduced by our own model code."""
import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from minivllm import LLM, SamplingParams
from minivllm.kv_cache import prefill_metadata
from minivllm.model_source import DEFAULT_MODEL
from minivllm.models import load_model

PROMPTS = ["ROMEO.", "To be, or not to be, that is", "KING HENRY.\nMy lords, we", "And God said"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def expected():
    "transformers' greedy continuations of the prompts, in float32."
    tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    outs = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=tok.pad_token_id or 0)
        outs.append(out[0, ids.shape[1]:].tolist())
    return outs


def test_the_shipped_folder_is_complete_and_small():
    names = {p.name for p in DEFAULT_MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
            "training_log.json", "validation_sample.json"} <= names, names
    assert sum(p.stat().st_size for p in DEFAULT_MODEL.iterdir()) < 25 * 2**20


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_greedy_text_is_the_same_at_every_tp_and_equals_transformers(expected, tp):
    with LLM(tensor_parallel_size=tp, dtype="float32") as llm:  # no path: the packaged model
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    assert all(isinstance(o.text, str) and o.text for o in outputs)


def bf16_ulp(x: float) -> float:
    "The spacing of bfloat16 numbers around `x` (8 significant bits)."
    return 2.0 ** (torch.tensor(abs(x)).log2().floor().item() - 7)


def test_bfloat16_greedy_at_tp_2_follows_tp_1_up_to_a_near_tie():
    """In bfloat16, TP=2 adds its row-parallel partial sums in another order than TP=1's single matmul, so an
    activation can differ in its last bit and the argmax can flip where two tokens are tied within bf16's precision
    (measured: on an AMD EPYC, TP=1's own logits at the step where one prompt parts were 8.6875, 8.6875, 8.625).
    So: TP=2's greedy tokens equal TP=1's, or they part where TP=1's logits put TP=2's token within two bf16 steps
    of the best one. A wrong shard or a wrong sum parts at the first token, with a large gap."""
    outs = []
    for tp in (1, 2):
        with LLM(tensor_parallel_size=tp, dtype="bfloat16") as llm:
            outs.append([o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)])
            prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    model = load_model(DEFAULT_MODEL, dtype="bfloat16")
    for prompt, tp1, tp2 in zip(prompt_ids, *outs):
        if tp1 == tp2:
            continue
        i = next(i for i, (a, b) in enumerate(zip(tp1, tp2)) if a != b)
        ids = prompt + tp1[:i]
        md = prefill_metadata([[]], [0], [len(ids)], block_size=16)
        with torch.no_grad():
            logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), None, md))[-1].float()
        gap = (logits.max() - logits[tp2[i]]).item()
        assert gap <= 2 * bf16_ulp(logits.max().item()), (PROMPTS, i, tp1[i], tp2[i], gap)


def test_model_card_validation_loss_is_reproduced():
    "Our CausalLM (TP=1, float32) on the shipped validation sample gives the loss the model card records (within 0.05)."
    log = json.loads((DEFAULT_MODEL / "training_log.json").read_text())
    sample = json.loads((DEFAULT_MODEL / "validation_sample.json").read_text())
    n, chunk = sample["num_chunks"], sample["chunk_tokens"]
    rows = torch.tensor(sample["token_ids"], dtype=torch.long).view(n, chunk)
    model = load_model(DEFAULT_MODEL, dtype="float32")
    md = prefill_metadata([[] for _ in range(n)], [0] * n, [chunk] * n, block_size=16)
    with torch.no_grad():
        hidden = model(rows.flatten(), torch.arange(chunk).repeat(n), None, md)
        logits = model.compute_logits(hidden).view(n, chunk, -1)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), rows[:, 1:].flatten()).item()
    assert abs(loss - log["validation_sample_loss"]) < 0.05, (loss, log["validation_sample_loss"])
    assert loss < 4.5, "the model card's model should have learned something"


def test_the_packaged_model_chats_as_a_scene():
    "Its chat template writes the user as Hamlet and the model as Horatio; `llm.chat` answers with the greedy text that prompt gets."
    tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    messages = [{"role": "system", "content": "Enter HAMLET and HORATIO."}, {"role": "user", "content": "What news?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "[Enter HAMLET and HORATIO.]\n\nHAMLET.\nWhat news?\n\nHORATIO.\n"
    params = SamplingParams(temperature=0, max_tokens=24, stop=["\n\n"])
    with LLM() as llm:
        chat, plain = llm.chat(messages, params)[0], llm.generate([prompt], params, use_tqdm=False)[0]
    assert chat.outputs[0].text == plain.outputs[0].text and chat.outputs[0].text.strip()
    assert "\n\n" not in chat.outputs[0].text
