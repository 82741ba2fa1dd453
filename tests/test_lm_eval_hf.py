"""lm-eval harness on an in-memory Hugging Face model, offline, on a local synthetic task."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_DIR = os.path.join(ROOT, "tests", "data", "lm_eval_synthetic")
TASK = "synthetic_repeat"

try:
    import lm_eval  # noqa: F401
    from lm_eval.models.huggingface import HFLM  # noqa: F401  (needs accelerate)
    LM_EVAL_MISSING = None
except ImportError as e:
    LM_EVAL_MISSING = f"lm-eval with its hf extra is not importable ({e})"

pytestmark = pytest.mark.skipif(LM_EVAL_MISSING is not None, reason=str(LM_EVAL_MISSING))


@pytest.fixture()
def offline(monkeypatch):
    """No socket may connect: the evaluation must not touch the Hub (or anything else)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    def refuse(self, address, *a, **k):
        raise AssertionError(f"network access to {address} during an offline evaluation")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: one intra-op thread avoids OpenMP spin-waits on a busy 2-core CI box
    (1 ms instead of 10 us per call)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture()
def include_path(tmp_path):
    """The task YAML with the data file's absolute path: ``datasets`` opens ``data_files``
    relative to the current directory, so a path relative to the YAML would not be found."""
    return write_include_path(tmp_path)


def tiny_tokenizer():
    """A word-level tokenizer of 14 ids (fits any model with a vocabulary of 14 or more)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(specials + list("abcdefghij"))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")


def tiny_llama_and_tokenizer():
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_tok = tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(hf_tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                      pad_token_id=3)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval(), hf_tok


def reference_accuracy(model, tok):
    """acc by hand: the choice whose tokens after the context have the largest summed log-prob."""
    hits = []
    with open(os.path.join(TASK_DIR, f"{TASK}.jsonl")) as f:
        docs = [json.loads(line) for line in f]
    for doc in docs:
        n_ctx = len(tok(doc["context"], add_special_tokens=False).input_ids)
        scores = []
        for choice in doc["choices"]:
            ids = tok(doc["context"] + " " + choice, add_special_tokens=False).input_ids
            with torch.no_grad():
                logp = model(torch.tensor([ids])).logits.float().log_softmax(-1)[0]
            scores.append(sum(logp[i - 1, ids[i]].item() for i in range(n_ctx, len(ids))))
        hits.append(float(max(range(len(scores)), key=scores.__getitem__) == doc["label"]))
    return sum(hits) / len(hits), len(docs)


def test_simple_evaluate_on_in_memory_llama(offline, include_path):
    from megatron_ext.convert.evaluate import evaluate_hf

    model, tok = tiny_llama_and_tokenizer()
    out = evaluate_hf(model, tok, [TASK], include_path, batch_size=4)
    res = out["results"][TASK]
    assert 0.0 <= res["acc,none"] <= 1.0 and 0.0 <= res["acc_norm,none"] <= 1.0
    acc, n = reference_accuracy(model, tok)
    assert out["n-samples"][TASK]["effective"] == n
    # lm-eval scored our model with our tokenizer: its accuracy is the hand-computed one.
    assert res["acc,none"] == pytest.approx(acc)


def write_include_path(tmp_path) -> str:
    """The include_path fixture as a function (for tests in other files)."""
    with open(os.path.join(TASK_DIR, f"{TASK}.yaml.in")) as f:
        text = f.read().replace("@DATA_DIR@", TASK_DIR)
    text = text.replace("@CACHE_DIR@", str(tmp_path / "datasets_cache"))
    os.makedirs(tmp_path / "tasks", exist_ok=True)
    (tmp_path / "tasks" / f"{TASK}.yaml").write_text(text)
    return str(tmp_path / "tasks")


def test_unknown_task_is_refused(include_path):
    from megatron_ext.convert.evaluate import evaluate_hf

    model, tok = tiny_llama_and_tokenizer()
    with pytest.raises(ValueError, match=r"tasks \['no_such_task'\] are not defined"):
        evaluate_hf(model, tok, "no_such_task", include_path)
