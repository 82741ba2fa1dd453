"""The manifest ``python -m megatron_ext.tools.data_prep`` writes beside the data it builds
(``DIR/manifest.json``: the tokenizer, its vocabulary size and digest, the dataset prefix), read
back by the trainer's ``--ext-data-manifest`` check (``training/arguments.py``).

A base module: the tool writes the format and the trainer reads it, and the trainer may not
import the offline tools (docs/architecture.md: no import runs up the layers)."""

from __future__ import annotations

import json
import os

MANIFEST = "manifest.json"


def manifest_path(out: str) -> str:
    return os.path.join(out, MANIFEST)


def load_manifest(path: str) -> dict:
    """The manifest with ``data_prefix`` and ``tokenizer_dir`` resolved against its directory."""
    with open(path) as f:
        manifest = json.load(f)
    base = os.path.dirname(os.path.abspath(path))
    manifest["data_prefix"] = os.path.join(base, manifest["data_prefix_relative"])
    manifest["tokenizer_dir"] = os.path.join(base, manifest["tokenizer_dir_relative"])
    return manifest


def verify_manifest(manifest_path: str, tokenizer_vocab_size: int) -> dict:
    """Refuse to train when the tokenizer is not the one the data was tokenized with.

    ``tokenizer_vocab_size`` is the unpadded vocabulary of the training tokenizer (Megatron's
    ``tokenizer.vocab_size``). Returns the manifest; raises ``ValueError`` on a mismatch.
    """
    if not os.path.isfile(manifest_path):
        raise ValueError(
            f"--ext-data-manifest={manifest_path}: no such file; build the data with "
            "`python -m megatron_ext.tools.data_prep --out DIR` and pass DIR/manifest.json")
    try:
        manifest = load_manifest(manifest_path)
        recorded = int(manifest["tokenizer_vocab_size"])
    except (ValueError, KeyError) as exc:
        raise ValueError(f"--ext-data-manifest={manifest_path}: not a data_prep manifest "
                         f"({exc.__class__.__name__}: {exc})") from None
    if int(tokenizer_vocab_size) != recorded:
        raise ValueError(
            f"vocab size mismatch: the data {manifest['data_prefix']} was tokenized with a "
            f"tokenizer of vocab size {recorded} (recorded in {manifest_path}), but the training "
            f"tokenizer has vocab size {int(tokenizer_vocab_size)}. Pass --tokenizer-type "
            f"HuggingFaceTokenizer --tokenizer-model {manifest['tokenizer_dir']} together with "
            f"--data-path {manifest['data_prefix']}, or rebuild the data for your tokenizer "
            f"(python -m megatron_ext.tools.data_prep --out DIR --vocab-size "
            f"{int(tokenizer_vocab_size)}) and point --data-path/--ext-data-manifest at it.")
    return manifest
