"""Offline default corpus: a byte-level BPE tokenizer and a Megatron indexed dataset built from text
that ships with every Python (``pydoc_data.topics`` and the standard library's sources); or, with
``--source zipf``, ids drawn from a Zipf law over a whole vocabulary (``tools/synthetic_corpus.py``:
``--vocab-size 128256 --zipf-tokens N --zipf-exponent S``, the same layout and manifest).

``python -m megatron_ext.tools.data_prep --out DIR [--vocab-size 8192] [--max-mb 8] [--seed N]``
writes::

    DIR/tokenizer/tokenizer.json         a Hugging Face tokenizer directory: --tokenizer-type
    DIR/tokenizer/tokenizer_config.json  HuggingFaceTokenizer --tokenizer-model DIR/tokenizer
    DIR/corpus_text_document.{bin,idx}   --data-path DIR/corpus_text_document
    DIR/manifest.json                    what was built (megatron_ext/data_manifest.py)

One document per pydoc topic and per source file; each document is its token ids followed by the
EOD token ``<|endoftext|>``, as Megatron's ``tools/preprocess_data.py --append-eod`` writes them.
Everything is built in a temporary directory next to ``DIR`` and renamed into place, so ``DIR`` is
either absent, the previous complete build, or the new complete build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import numpy
import torch
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

# The manifest's format, which the trainer reads too (--ext-data-manifest).
from megatron_ext.data_manifest import MANIFEST, load_manifest, manifest_path
from megatron_ext.tools import synthetic_corpus

logger = logging.getLogger(__name__)

EOD_TOKEN = "<|endoftext|>"
DATA_NAME = "corpus_text_document"
TOKENIZER_DIR = "tokenizer"
FORMAT_VERSION = 1
SOURCES = ("text", "zipf")
# Directories of the standard library that are not ordinary library source: test suites (large,
# repetitive fixtures), installed third-party packages, caches, pydoc_data (its topics are taken
# directly, as text, not as the Python literal that holds them) and encodings (mostly generated
# 256-entry codec tables: near-zero loss text that would dominate a small validation split).
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                       "__pycache__", "pydoc_data", "encodings"})
# DATA_NAME itself is the directory where Megatron caches its GPTDataset indices by default.
_MANAGED_NAMES = frozenset({MANIFEST, TOKENIZER_DIR, DATA_NAME, DATA_NAME + ".bin",
                            DATA_NAME + ".idx"})


@dataclass(frozen=True)
class DataPrepConfig:
    """Options of the data preparation; every field is a command-line flag."""

    out: str
    vocab_size: int = 8192
    max_mb: float = 8.0
    seed: int = 1234
    source: str = "text"  # "zipf": synthetic ids over the whole vocabulary
    zipf_tokens: int = 1 << 24
    # fitted to the text corpus's own BPE ids (ranks 10-5,000; tools/synthetic_corpus.py)
    zipf_exponent: float = 1.07

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("--out: an output directory is required")
        if self.source not in SOURCES:
            raise ValueError(f"--source={self.source}: one of {', '.join(SOURCES)}")
        if not 1 <= self.zipf_tokens <= 1 << 34:
            raise ValueError(f"--zipf-tokens={self.zipf_tokens}: allowed range is 1..{1 << 34}")
        if not 0.0 < self.zipf_exponent <= 4.0:
            raise ValueError(f"--zipf-exponent={self.zipf_exponent}: allowed range is (0, 4] "
                             "(real BPE text: about 1.0-1.1)")
        # 256 byte symbols + the EOD token are the smallest byte-level vocabulary.
        if not 258 <= self.vocab_size <= 1_000_000:
            raise ValueError(f"--vocab-size={self.vocab_size}: allowed range is 258..1000000 "
                             "(byte-level BPE starts from 256 byte symbols plus the EOD token)")
        if not 0 < self.max_mb <= 1024:
            raise ValueError(f"--max-mb={self.max_mb}: allowed range is (0, 1024]")

    def settings(self) -> Dict[str, object]:
        """What decides the content of the output (a rebuild happens when any of it changes)."""
        if self.source == "zipf":
            return {"format": FORMAT_VERSION, "source": "zipf", "vocab_size": self.vocab_size,
                    "zipf_tokens": self.zipf_tokens, "zipf_exponent": float(self.zipf_exponent),
                    "doc_tokens": synthetic_corpus.DOC_TOKENS, "seed": self.seed}
        return {
            "format": FORMAT_VERSION,
            "vocab_size": self.vocab_size,
            "max_mb": float(self.max_mb),
            "seed": self.seed,
            "python": platform.python_version(),
            "skip_dirs": sorted(SKIP_DIRS),
        }


@dataclass(frozen=True)
class Document:
    name: str
    text: str


# ---------------------------------------------------------------------------------------------
# corpus


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def pydoc_documents() -> List[Document]:
    """One document per ``pydoc_data.topics`` entry (language reference and more, in English)."""
    from pydoc_data.topics import topics

    return [Document(f"pydoc:{key}", topics[key]) for key in sorted(topics) if topics[key].strip()]


def stdlib_files(root: Optional[str] = None) -> List[str]:
    """``.py`` files of the standard library in sorted order, without tests and site-packages."""
    root = root or stdlib_dir()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        found.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return sorted(found)


def _read_source(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None  # a few stdlib files use other encodings; they are not needed


def collect_documents(max_bytes: int, seed: int, root: Optional[str] = None) -> List[Document]:
    """The corpus, at most ``max_bytes`` of UTF-8 text.

    The pydoc topics come first (they are the English part and small), then standard library files
    in a seeded random order, each kept when it still fits. The kept documents are shuffled with
    the same seed, so that the split Megatron makes over the document order (``--split``) puts a
    mixture of both sources into training and validation.
    """
    rng = random.Random(seed)
    root = root or stdlib_dir()
    files = stdlib_files(root)
    rng.shuffle(files)
    docs: List[Document] = []
    total = 0

    def take(doc: Document) -> None:
        nonlocal total
        size = len(doc.text.encode("utf-8"))
        if size and total + size <= max_bytes:
            docs.append(doc)
            total += size

    for doc in pydoc_documents():
        take(doc)
    for path in files:
        if total >= max_bytes:
            break
        text = _read_source(path)
        if text is not None and EOD_TOKEN not in text:
            take(Document(os.path.relpath(path, root), text))
    rng.shuffle(docs)
    return docs


# ---------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(docs: List[Document], vocab_size: int, progress: bool = True):
    """A byte-level BPE (GPT-2 style pre-tokenizer, lossless decoding) with ``<|endoftext|>``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tokenizer.train_from_iterator((d.text for d in docs), trainer, length=len(docs))
    return tokenizer


def save_hf_tokenizer(tokenizer, directory: str) -> str:
    """Save as a Hugging Face tokenizer directory; returns the path of ``tokenizer.json``."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "tokenizer.json")
    tokenizer.save(path)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOD_TOKEN,
        "eos_token": EOD_TOKEN,
        "unk_token": EOD_TOKEN,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "unk_token": EOD_TOKEN}, f,
                  indent=2)
    return path


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# indexed dataset


def _batches(docs: List[Document], size: int) -> Iterator[List[Document]]:
    for i in range(0, len(docs), size):
        yield docs[i:i + size]


def write_indexed_dataset(tokenizer, docs: List[Document], prefix: str, vocab_size: int,
                          eod_id: int, progress: bool = True) -> int:
    """Each document's ids + EOD as one item and one document; returns the number of tokens."""
    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    num_tokens = 0
    total_bytes = sum(len(d.text.encode("utf-8")) for d in docs)
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenize", disable=not progress,
              file=sys.stderr) as bar:
        for batch in _batches(docs, 64):
            for doc, enc in zip(batch, tokenizer.encode_batch([d.text for d in batch])):
                ids = numpy.asarray(enc.ids + [eod_id], dtype=numpy.int64)
                builder.add_item(torch.from_numpy(ids))
                builder.end_document()
                num_tokens += ids.size
                bar.update(len(doc.text.encode("utf-8")))
    builder.finalize(get_idx_path(prefix))
    return num_tokens


# ---------------------------------------------------------------------------------------------
# manifest


def is_complete(out: str, settings: Dict[str, object]) -> bool:
    """``out`` holds a finished build made with ``settings``."""
    path = manifest_path(out)
    if not os.path.isfile(path):
        return False
    try:
        manifest = load_manifest(path)
    except (OSError, ValueError, KeyError):
        return False
    if manifest.get("settings") != settings:
        return False
    tokenizer_json = os.path.join(manifest["tokenizer_dir"], "tokenizer.json")
    files = [tokenizer_json, manifest["data_prefix"] + ".bin", manifest["data_prefix"] + ".idx"]
    if not all(os.path.isfile(p) for p in files):
        return False
    return sha256_file(tokenizer_json) == manifest.get("tokenizer_sha256")


# ---------------------------------------------------------------------------------------------
# build


def _check_replaceable(out: str) -> None:
    """Only an empty directory or one of our own builds may be replaced."""
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise ValueError(f"--out={out}: exists and is not a directory")
    foreign = sorted(set(os.listdir(out)) - _MANAGED_NAMES)
    if foreign:
        raise ValueError(
            f"--out={out}: the directory holds files data_prep did not write "
            f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); "
            "choose an empty or new directory")


def _swap_into_place(tmp: str, out: str) -> None:
    """Rename ``tmp`` to ``out``; a previous ``out`` is moved aside first and removed after."""
    old = None
    if os.path.exists(out):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-",
                               dir=os.path.dirname(out))
        os.rmdir(old)
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prepare(config: DataPrepConfig, progress: bool = True) -> dict:
    """Build (or find up to date) the corpus, tokenizer and dataset; returns the manifest."""
    out = os.path.abspath(config.out)
    settings = config.settings()
    if is_complete(out, settings):
        logger.info("data_prep: %s is up to date (same settings), skipping", out)
        return load_manifest(manifest_path(out))
    _check_replaceable(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        if config.source == "zipf":
            manifest = _build_zipf(config, tmp, out)
        else:
            manifest = _build_text(config, tmp, out, settings, progress)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("data_prep: done, manifest %s", manifest_path(out))
    return load_manifest(manifest_path(out))


def _build_zipf(config: DataPrepConfig, tmp: str, out: str) -> dict:
    """The synthetic corpus (``tools/synthetic_corpus.py``) and its word tokenizer in ``tmp``;
    returns the manifest."""
    t0 = time.perf_counter()
    vocab = config.vocab_size
    ids, lengths = synthetic_corpus.zipf_tokens(vocab, config.zipf_exponent, config.zipf_tokens,
                                                config.seed)
    tok_json = save_hf_tokenizer(synthetic_corpus.word_tokenizer(vocab, EOD_TOKEN),
                                 os.path.join(tmp, TOKENIZER_DIR))
    prefix = os.path.join(tmp, DATA_NAME)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=DType.optimal_dtype(vocab))
    for doc in synthetic_corpus.documents(ids, lengths):
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    logger.info("data_prep: %d Zipf ids (exponent %g, seed %d) over %d ids in %d documents "
                "[%.1fs]", ids.size, config.zipf_exponent, config.seed, vocab, len(lengths),
                time.perf_counter() - t0)
    return {
        "settings": config.settings(), "tokenizer_vocab_size": vocab, "eod_id": 0,
        "eod_token": EOD_TOKEN, "tokenizer_sha256": sha256_file(tok_json),
        "tokenizer_dir_relative": TOKENIZER_DIR, "num_documents": len(lengths),
        "num_tokens": int(ids.size), "corpus_bytes": 0,  # no text
        "data_prefix_relative": DATA_NAME, "data_prefix": os.path.join(out, DATA_NAME),
        "tokenizer_dir": os.path.join(out, TOKENIZER_DIR),
        "sources": {"synthetic": "zipf", "zipf_exponent": config.zipf_exponent,
                    "seed": config.seed},
    }


def _build_text(config: DataPrepConfig, tmp: str, out: str, settings: Dict[str, object],
                progress: bool) -> dict:
    """The text corpus, its BPE tokenizer and dataset in ``tmp``; returns the manifest."""
    t0 = time.perf_counter()
    docs = collect_documents(int(config.max_mb * 1e6), config.seed)
    if not docs:
        raise ValueError(f"--max-mb={config.max_mb}: no document fits; raise the cap")
    corpus_bytes = sum(len(d.text.encode("utf-8")) for d in docs)
    num_topics = sum(d.name.startswith("pydoc:") for d in docs)
    logger.info("data_prep: corpus %d documents (%d pydoc topics, %d stdlib files), %.2f MB "
                "from %s [%.1fs]", len(docs), num_topics, len(docs) - num_topics,
                corpus_bytes / 1e6, stdlib_dir(), time.perf_counter() - t0)

    t0 = time.perf_counter()
    tokenizer = train_tokenizer(docs, config.vocab_size, progress)
    tok_dir = os.path.join(tmp, TOKENIZER_DIR)
    tok_json = save_hf_tokenizer(tokenizer, tok_dir)
    vocab = tokenizer.get_vocab_size()
    eod_id = tokenizer.token_to_id(EOD_TOKEN)
    if vocab < config.vocab_size:
        logger.warning("data_prep: the corpus only supports %d tokens (asked for %d)",
                       vocab, config.vocab_size)
    logger.info("data_prep: trained byte-level BPE, vocab %d, eod id %d [%.1fs]", vocab,
                eod_id, time.perf_counter() - t0)

    t0 = time.perf_counter()
    num_tokens = write_indexed_dataset(tokenizer, docs, os.path.join(tmp, DATA_NAME), vocab,
                                       eod_id, progress)
    logger.info("data_prep: wrote %d tokens (%.2f bytes/token) to %s.{bin,idx} [%.1fs]",
                num_tokens, corpus_bytes / max(1, num_tokens - len(docs)),
                os.path.join(out, DATA_NAME), time.perf_counter() - t0)

    manifest = {
        "settings": settings,
        "tokenizer_vocab_size": vocab,
        "eod_id": eod_id,
        "eod_token": EOD_TOKEN,
        "tokenizer_sha256": sha256_file(tok_json),
        "tokenizer_dir_relative": TOKENIZER_DIR,
        "num_documents": len(docs),
        "num_tokens": num_tokens,
        "corpus_bytes": corpus_bytes,
        "data_prefix_relative": DATA_NAME,
        # Informational: where the build was made (load_manifest resolves the relative names).
        "data_prefix": os.path.join(out, DATA_NAME),
        "tokenizer_dir": os.path.join(out, TOKENIZER_DIR),
        "sources": {"pydoc_topics": num_topics, "stdlib_files": len(docs) - num_topics,
                    "stdlib": stdlib_dir()},
    }
    return manifest


def megatron_data_args(manifest: dict, split: str = "95,5,0") -> List[str]:
    """The Megatron flags that train on a built corpus."""
    return ["--data-path", manifest["data_prefix"], "--split", split,
            "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", manifest["tokenizer_dir"]]


def parse_args(argv: Optional[List[str]] = None) -> DataPrepConfig:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.tools.data_prep",
        description="Build the offline default corpus (pydoc topics + stdlib sources), a "
                    "byte-level BPE tokenizer and a Megatron indexed dataset.")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--vocab-size", type=int, default=DataPrepConfig.vocab_size)
    parser.add_argument("--max-mb", type=float, default=DataPrepConfig.max_mb,
                        help="cap on the corpus size in MB of UTF-8 text")
    parser.add_argument("--seed", type=int, default=DataPrepConfig.seed,
                        help="seed of the document selection and order (zipf: of the draws)")
    parser.add_argument("--source", choices=SOURCES, default=DataPrepConfig.source,
                        help="text: pydoc topics + stdlib sources with a BPE trained on them; "
                             "zipf: synthetic ids over the whole --vocab-size, Zipf-distributed "
                             "(tools/synthetic_corpus.py; not text: no loss curve to learn from)")
    parser.add_argument("--zipf-tokens", type=int, default=DataPrepConfig.zipf_tokens,
                        help="--source zipf: tokens of the corpus")
    parser.add_argument("--zipf-exponent", type=float, default=DataPrepConfig.zipf_exponent,
                        help="--source zipf: the frequency of the r-th most frequent id is "
                             "proportional to r^-EXPONENT")
    ns = parser.parse_args(argv)
    try:
        return DataPrepConfig(out=ns.out, vocab_size=ns.vocab_size, max_mb=ns.max_mb,
                              seed=ns.seed, source=ns.source, zipf_tokens=ns.zipf_tokens,
                              zipf_exponent=ns.zipf_exponent)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = parse_args(argv)
    try:
        manifest = prepare(config)
    except ValueError as exc:
        raise SystemExit(f"data_prep: {exc}") from None
    summary = {k: manifest[k] for k in ("tokenizer_vocab_size", "eod_id", "num_documents",
                                        "num_tokens", "corpus_bytes", "data_prefix",
                                        "tokenizer_dir")}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
