"""The offline corpus: tokenizer, indexed dataset round trip, manifest, skip/atomic behaviour."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest

from megatron_ext.data_manifest import verify_manifest
from megatron_ext.tools import data_prep
from megatron_ext.tools.data_prep import (
    EOD_TOKEN,
    DataPrepConfig,
    collect_documents,
    prepare,
    sha256_file,
)

MAX_MB, VOCAB, SEED = 0.05, 400, 7


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "corpus"
    config = DataPrepConfig(out=str(out), vocab_size=VOCAB, max_mb=MAX_MB, seed=SEED)
    manifest = prepare(config, progress=False)
    return config, manifest


def test_manifest_contents(built):
    config, manifest = built
    out = config.out
    assert manifest["tokenizer_vocab_size"] == VOCAB
    assert manifest["eod_token"] == EOD_TOKEN and manifest["eod_id"] == 0
    assert manifest["data_prefix"] == os.path.join(out, "corpus_text_document")
    assert manifest["tokenizer_sha256"] == sha256_file(
        os.path.join(out, "tokenizer", "tokenizer.json"))
    docs = collect_documents(int(MAX_MB * 1e6), SEED)
    assert manifest["num_documents"] == len(docs)
    assert manifest["corpus_bytes"] == sum(len(d.text.encode()) for d in docs) <= MAX_MB * 1e6
    assert manifest["settings"] == config.settings()
    # Nothing but the build is left next to it.
    assert sorted(os.listdir(os.path.dirname(out))) == ["corpus"]


def test_dataset_round_trip(built):
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer

    config, manifest = built
    dataset = IndexedDataset(manifest["data_prefix"])
    tokenizer = Tokenizer.from_file(os.path.join(manifest["tokenizer_dir"], "tokenizer.json"))
    docs = collect_documents(int(MAX_MB * 1e6), SEED)
    assert len(dataset) == len(docs)
    assert len(dataset.document_indices) == len(docs) + 1  # one item per document
    assert dataset.index.dtype == numpy.uint16
    total = 0
    for i, doc in enumerate(docs):
        ids = dataset[i]
        total += ids.size
        assert ids[-1] == manifest["eod_id"]  # EOD closes every document ...
        assert manifest["eod_id"] not in ids[:-1]  # ... and appears nowhere else
        assert tokenizer.decode(ids[:-1].tolist(), skip_special_tokens=False) == doc.text
    assert total == manifest["num_tokens"]


def test_megatron_loads_the_tokenizer(built):
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    _, manifest = built
    args = SimpleNamespace(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=manifest["tokenizer_dir"],
        chat_template=None, vocab_file=None, merge_file=None, special_tokens=None,
        tokenizer_hf_no_use_fast=False, trust_remote_code=False,
        tokenizer_hf_no_include_special_tokens=False, metadata_path=None, pad_vocab_size=False)
    tokenizer = build_tokenizer(args)
    assert tokenizer.vocab_size == manifest["tokenizer_vocab_size"]
    assert tokenizer.eod == manifest["eod_id"]
    text = "def f(x):\n    return x  # ok\n"
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_verify_manifest(built):
    config, manifest = built
    path = os.path.join(config.out, "manifest.json")
    assert verify_manifest(path, VOCAB)["eod_id"] == manifest["eod_id"]
    with pytest.raises(ValueError) as err:
        verify_manifest(path, 8192)
    message = str(err.value)
    assert f"vocab size {VOCAB}" in message and "vocab size 8192" in message
    assert "--tokenizer-model" in message and "--vocab-size" in message
    with pytest.raises(ValueError, match="no such file"):
        verify_manifest(os.path.join(config.out, "missing.json"), VOCAB)


def test_rerun_is_skipped(built, caplog):
    config, manifest = built
    stamp = os.stat(manifest["data_prefix"] + ".bin").st_mtime_ns
    with caplog.at_level(logging.INFO, logger=data_prep.__name__):
        again = prepare(config, progress=False)
    assert "up to date" in caplog.text
    assert again == manifest
    assert os.stat(manifest["data_prefix"] + ".bin").st_mtime_ns == stamp


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(data_prep, "write_indexed_dataset", boom)
    out = tmp_path / "corpus"
    with pytest.raises(RuntimeError, match="interrupted"):
        prepare(DataPrepConfig(out=str(out), vocab_size=300, max_mb=0.01), progress=False)
    assert os.listdir(tmp_path) == []


def test_changed_settings_rebuild_in_place(tmp_path):
    out = tmp_path / "corpus"
    first = prepare(DataPrepConfig(out=str(out), vocab_size=300, max_mb=0.01, seed=1),
                    progress=False)
    second = prepare(DataPrepConfig(out=str(out), vocab_size=320, max_mb=0.01, seed=1),
                     progress=False)
    assert (first["tokenizer_vocab_size"], second["tokenizer_vocab_size"]) == (300, 320)
    assert os.listdir(tmp_path) == ["corpus"]  # the old build and the temp dir are gone
    assert json.loads((out / "manifest.json").read_text())["settings"]["vocab_size"] == 320


def test_foreign_directory_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="did not write"):
        prepare(DataPrepConfig(out=str(tmp_path), vocab_size=300, max_mb=0.01), progress=False)
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_corpus_selection():
    docs = collect_documents(int(2e6), seed=1)
    assert docs == collect_documents(int(2e6), seed=1)
    assert sum(len(d.text.encode()) for d in docs) <= 2e6
    names = [d.name for d in docs]
    assert any(n.startswith("pydoc:") for n in names) and any(n.endswith(".py") for n in names)
    skipped = data_prep.SKIP_DIRS
    assert not any(part in skipped for n in names for part in n.split(os.sep)[:-1])
    assert [d.name for d in collect_documents(int(2e6), seed=2)] != names


@pytest.mark.parametrize("kwargs,flag", [(dict(vocab_size=100), "--vocab-size"),
                                         (dict(max_mb=0), "--max-mb"),
                                         (dict(out=""), "--out")])
def test_bad_config(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        DataPrepConfig(**{"out": "x", **kwargs})


def test_manifest_json_is_plain(built):
    config, _ = built
    with open(os.path.join(config.out, "manifest.json")) as f:
        raw = json.load(f)
    for key in ("tokenizer_vocab_size", "eod_id", "tokenizer_sha256", "num_documents",
                "num_tokens", "corpus_bytes", "data_prefix"):
        assert key in raw
