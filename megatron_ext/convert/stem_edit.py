"""``python -m megatron_ext.convert stem-edit``: swap or copy the STEM rows of tokens.

Knowledge editing as in Section 5.2 of the STEM paper: every token ``t`` owns one row
``e_{t,l}`` of the table of each STEM layer ``l`` (``model.layers.{l}.mlp.stem_table.weight``,
``docs/convert.md``), so exchanging the rows of "Spain" and "Germany" (or writing Germany's rows
over Spain's, ``e_{Spain,l} <- e_{Germany,l}``) changes what the model answers to a prompt that
still says "Spain", and nothing else in the model changes.

Two entry points:

* on a loaded model (any module with ``model.model.layers[i].mlp.stem_table`` an ``nn.Embedding``):
  ``swap_rows`` (an involution: twice restores the model bit for bit), ``copy_rows`` (returns an
  undo record) and ``revert``;
* on a Hugging Face directory (``main``): the safetensors shards are copied as files and only the
  bytes of the edited rows are patched in the copy, so any dtype and any size streams through; the
  edit is appended to ``stem_edits.json`` (and the overwritten rows of a copy to
  ``stem_edits.safetensors``) so that ``--revert`` restores the original tensors exactly.

Tokens are ids or strings. A string is encoded as given and, failing that, with a leading space
(the form a word takes inside a sentence: " Spain"); a single token is used as is. Words of several
tokens are edited piece by piece when both words have the same number of pieces (the STEM authors'
recipe for entities of equal tokenization length); words of different lengths are refused with
their pieces listed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import operator
import re
import shutil
import struct
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch import nn

from megatron_ext.convert.output import progress as progress_bar
from megatron_ext.convert.output import check_output_path, check_separate, staged_directory
from megatron_ext.stem.config import HF_MLP_TYPE

Token = Union[int, str]
STEM_TENSOR = re.compile(r"^model\.layers\.(\d+)\.mlp\.stem_table\.weight$")
EDITS_JSON = "stem_edits.json"
EDITS_ROWS = "stem_edits.safetensors"
FORMAT_VERSION = 1

# safetensors dtype names -> torch, for the saved rows of --copy (docs of the safetensors format).
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8}


# --------------------------------------------------------------------------- tokens

def _encode(tokenizer, text: str) -> List[int]:
    """Ids of ``text`` without BOS/EOS, for a ``tokenizers.Tokenizer`` or a transformers one."""
    out = tokenizer.encode(text, add_special_tokens=False)
    return list(out.ids if hasattr(out, "ids") else out)


def _piece(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"#{token_id}"
    if hasattr(tokenizer, "id_to_token"):
        return str(tokenizer.id_to_token(token_id))
    return str(tokenizer.convert_ids_to_tokens(token_id))


def _as_id(x) -> int:
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"token {x!r}: expected a token id (an integer) or a string") from None


def resolve_pairs(tokenizer, a: Token, b: Token) -> List[Tuple[int, int]]:
    """Token-id pairs ``(a_i, b_i)`` to edit for the words ``a`` and ``b``.

    Tried in order: both as given, then both with a leading space; the first form in which both
    are single tokens wins, else the first in which they have the same number of pieces (edited
    position by position). Ints are token ids and pass through.
    """
    # Any integer (numpy, a 0-d tensor) is an id; anything else must be a string.
    a, b = (x if isinstance(x, str) else _as_id(x) for x in (a, b))
    if isinstance(a, int) and isinstance(b, int):
        return [(a, b)]
    if tokenizer is None:
        raise ValueError(f"tokens {a!r} / {b!r} are strings: pass a tokenizer (or token ids)")

    def forms(x):
        if isinstance(x, int):
            return [x, x]
        if not x or x[0].isspace():
            return [x, x]  # the user chose the whitespace explicitly
        return [x, " " + x]

    candidates = []
    for fa, fb in zip(forms(a), forms(b)):
        pa = [fa] if isinstance(fa, int) else _encode(tokenizer, fa)
        pb = [fb] if isinstance(fb, int) else _encode(tokenizer, fb)
        if (fa, fb) not in [(c[0], c[1]) for c in candidates]:
            candidates.append((fa, fb, pa, pb))
    singles = [(pa[0], pb[0]) for _, _, pa, pb in candidates if len(pa) == len(pb) == 1]
    if singles:
        if len(singles) > 1 and singles[1] != singles[0]:
            # Inside a sentence ("The capital of Spain is") a word is its leading-space token,
            # which an edit of the bare form leaves alone: say so rather than edit silently.
            shown = [[_piece(tokenizer, t) for t in p] for p in singles[:2]]
            warnings.warn(f"{a!r}/{b!r} are single tokens as given {shown[0]} and also with a "
                          f"leading space {shown[1]}: editing the former; pass the words with a "
                          "leading space to edit the form they take inside a sentence",
                          stacklevel=3)
        return [singles[0]]
    for fa, fb, pa, pb in candidates:
        if pa and len(pa) == len(pb):
            return list(zip(pa, pb))

    def listed(form, pieces):
        return f"{form!r} -> {[_piece(tokenizer, i) for i in pieces]}"

    shown = "; ".join(f"{listed(fa, pa)}, {listed(fb, pb)}" for fa, fb, pa, pb in candidates)
    raise ValueError(f"{a!r} and {b!r} do not tokenize to single tokens or to the same number of "
                     f"pieces ({shown}); STEM rows are per token: pick words of one token each, "
                     f"words of equal length in tokens, or give token ids")


def _moves(op: str, pairs: Sequence[Tuple[int, int]], vocab: int):
    """Checked pairs and the row moves ``table[targets] <- table[sources]`` (read before write).

    swap: pairs are (a, b), every token in at most one pair, so the edit is a product of disjoint
    transpositions and applying it twice is the identity. copy: pairs are (src, dst), each dst
    written once (all sources are read from the table before the edit).
    """
    if op not in ("swap", "copy"):
        raise ValueError(f"op={op!r}: expected 'swap' or 'copy'")
    kept: List[Tuple[int, int]] = []
    for x, y in pairs:
        x, y = int(x), int(y)
        for t in (x, y):
            if not 0 <= t < vocab:
                raise ValueError(f"token id {t} is outside the STEM table (vocabulary {vocab})")
        if x != y and (x, y) not in kept:  # a piece shared by both words stays where it is
            kept.append((x, y))
    if not kept:
        raise ValueError(f"nothing to {op}: every pair names the same token twice ({list(pairs)})")
    if op == "swap":
        seen: Dict[int, Tuple[int, int]] = {}
        for p in kept:
            for t in p:
                if t in seen and seen[t] != p:
                    raise ValueError(f"token id {t} is in two swapped pairs ({seen[t]}, {p}): "
                                     "the swap would not be undone by applying it again")
                seen[t] = p
        return kept, [a for a, _ in kept] + [b for _, b in kept], \
            [b for _, b in kept] + [a for a, _ in kept]
    dsts = [d for _, d in kept]
    dup = sorted({d for d in dsts if dsts.count(d) > 1})
    if dup:
        raise ValueError(f"token ids {dup} would be written from two different sources")
    return kept, dsts, [s for s, _ in kept]


# --------------------------------------------------------------------------- loaded model

@dataclasses.dataclass
class StemEdit:
    """What ``swap_rows`` / ``copy_rows`` did; ``revert`` takes it back."""

    op: str                               # "swap" | "copy"
    pairs: List[Tuple[int, int]]          # (a, b) for swap, (src, dst) for copy
    layers: List[int]
    saved: Dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # copy: old dst rows


def _decoder_layers(model: nn.Module):
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no model.layers (expected a Hugging Face "
                        "causal LM whose layers' mlp may hold a stem_table)")
    return layers


def _layer_kind(model: nn.Module, i: int) -> str:
    spec = getattr(getattr(model, "config", None), "mlp_layers", None)
    if isinstance(spec, (list, tuple)) and i < len(spec) and isinstance(spec[i], dict):
        return str(spec[i].get("type"))
    return type(getattr(_decoder_layers(model)[i], "mlp", None)).__name__


def stem_layers(model: nn.Module) -> List[int]:
    """Indices of the decoder layers whose MLP holds a ``stem_table`` embedding."""
    return [i for i, layer in enumerate(_decoder_layers(model))
            if isinstance(getattr(getattr(layer, "mlp", None), "stem_table", None), nn.Embedding)]


def _check_layers(layers, n_layers: int, stem: List[int], kind) -> List[int]:
    """``layers`` (None: every STEM layer) checked against the model; ``kind(i)`` names a type."""
    if not stem:
        raise ValueError("the model has no STEM layer (no model.layers.*.mlp.stem_table)")
    if layers is None:
        return list(stem)
    chosen = sorted({int(i) for i in layers})
    if not chosen:
        raise ValueError("layers is empty: give at least one STEM layer or None for all")
    for i in chosen:
        if not 0 <= i < n_layers:
            raise ValueError(f"layer {i} does not exist: the model has {n_layers} layers "
                             f"(0..{n_layers - 1})")
        if i not in stem:
            raise ValueError(f"layer {i} is not a STEM layer (its MLP is {kind(i)!r}); "
                             f"STEM layers: {stem}")
    return chosen


def _tables(model: nn.Module, layers) -> List[Tuple[int, torch.Tensor]]:
    all_layers = _decoder_layers(model)
    chosen = _check_layers(layers, len(all_layers), stem_layers(model),
                           lambda i: _layer_kind(model, i))
    out, seen = [], set()
    for i in chosen:
        w = all_layers[i].mlp.stem_table.weight
        # A table shared by several layers is edited once, else a swap would undo itself.
        if w.data_ptr() not in seen:
            seen.add(w.data_ptr())
            out.append((i, w))
    return out


def _edit(model, op, a, b, layers, tokenizer) -> StemEdit:
    tables = _tables(model, layers)
    pairs, targets, sources = _moves(op, resolve_pairs(tokenizer, a, b), tables[0][1].shape[0])
    for _, w in tables[1:]:
        if w.shape[0] != tables[0][1].shape[0]:
            raise ValueError("STEM tables of different vocabulary sizes in one model")
    record = StemEdit(op, pairs, [i for i, _ in tables])
    with torch.no_grad():
        for i, w in tables:
            t = torch.tensor(targets, device=w.device)
            s = torch.tensor(sources, device=w.device)
            if op == "copy":
                record.saved[i] = w[t].clone()
            w[t] = w[s]  # the right-hand side is gathered (a copy) before any row is written
    return record


def swap_rows(model: nn.Module, token_a: Token, token_b: Token, layers=None, *,
              tokenizer=None) -> StemEdit:
    """Exchange the STEM rows of ``token_a`` and ``token_b`` in ``layers`` (None: every STEM
    layer), in place. Applying it twice restores the tables bit for bit. Strings need
    ``tokenizer``."""
    return _edit(model, "swap", token_a, token_b, layers, tokenizer)


def copy_rows(model: nn.Module, src: Token, dst: Token, layers=None, *,
              tokenizer=None) -> StemEdit:
    """Write the STEM rows of ``src`` over those of ``dst`` (``e_dst <- e_src``, Section 5.2 of
    the STEM paper) in place; returns the record that ``revert`` needs."""
    return _edit(model, "copy", src, dst, layers, tokenizer)


def revert(model: nn.Module, record: StemEdit) -> None:
    """Undo ``swap_rows`` / ``copy_rows`` exactly (the edited rows get their old bits back)."""
    tables = dict(_tables(model, record.layers))
    _, targets, sources = _moves(record.op, record.pairs, next(iter(tables.values())).shape[0])
    with torch.no_grad():
        for i, w in tables.items():
            t = torch.tensor(targets, device=w.device)
            if record.op == "swap":
                w[t] = w[torch.tensor(sources, device=w.device)]
            else:
                w[t] = record.saved[i].to(device=w.device, dtype=w.dtype)


# --------------------------------------------------------------------------- directory

def _header(path: Path) -> Tuple[int, dict]:
    """(byte offset of the data, header) of a safetensors file (8-byte little-endian header
    length, then the JSON header)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


@dataclasses.dataclass
class _Table:
    layer: int
    name: str
    file: str
    dtype: str
    shape: List[int]
    start: int       # absolute byte offset of row 0 in the file
    row_bytes: int


def _dir_tables(model_dir: Path) -> Dict[int, _Table]:
    files = sorted(p.name for p in model_dir.glob("*.safetensors") if p.name != EDITS_ROWS)
    if not files:
        raise ValueError(f"{model_dir} holds no *.safetensors file")
    tables: Dict[int, _Table] = {}
    for fname in files:
        data, header = _header(model_dir / fname)
        for name, info in header.items():
            m = STEM_TENSOR.match(name)
            if not m:
                continue
            begin, end = info["data_offsets"]
            vocab = info["shape"][0]
            tables[int(m.group(1))] = _Table(int(m.group(1)), name, fname, info["dtype"],
                                             list(info["shape"]), data + begin,
                                             (end - begin) // max(vocab, 1))
    return tables


def _dir_layers(model_dir: Path, layers) -> List[_Table]:
    tables = _dir_tables(model_dir)
    config = {}
    if (model_dir / "config.json").exists():
        config = json.loads((model_dir / "config.json").read_text())
    spec = config.get("mlp_layers") or []
    for i, m in enumerate(spec):
        if isinstance(m, dict) and m.get("type") == HF_MLP_TYPE and i not in tables:
            raise ValueError(f"config.json says layer {i} is STEM but no shard holds "
                             f"model.layers.{i}.mlp.stem_table.weight")
    n_layers = int(config.get("num_hidden_layers") or len(spec) or (max(tables, default=-1) + 1))

    def kind(i):
        if i < len(spec) and isinstance(spec[i], dict):
            return str(spec[i].get("type"))
        return "without stem_table"

    chosen = _check_layers(layers, n_layers, sorted(tables), kind)
    vocabs = {tables[i].shape[0] for i in chosen}
    if len(vocabs) != 1:
        raise ValueError(f"STEM tables of different vocabulary sizes {sorted(vocabs)}")
    return [tables[i] for i in chosen]


def _read_rows(f, table: _Table, rows: Sequence[int]) -> List[bytes]:
    out = []
    for r in rows:
        f.seek(table.start + r * table.row_bytes)
        out.append(f.read(table.row_bytes))
    return out


def _write_rows(f, table: _Table, rows: Sequence[int], data: Sequence[bytes]) -> None:
    for r, b in zip(rows, data):
        f.seek(table.start + r * table.row_bytes)
        f.write(b)


def _digest(chunks: Sequence[bytes]) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def _rows_tensor(table: _Table, data: Sequence[bytes]) -> torch.Tensor:
    if table.dtype not in _DTYPES:
        raise ValueError(f"{table.name}: dtype {table.dtype} is not supported")
    raw = torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8)
    return raw.view(_DTYPES[table.dtype]).reshape(len(data), *table.shape[1:])


def _tensor_bytes(t: torch.Tensor) -> List[bytes]:
    # Every dtype reinterprets as bytes; the saved rows go back bit for bit.
    return [r.contiguous().view(torch.uint8).numpy().tobytes() for r in t]


def _load_tokenizer(model_dir: Path):
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"{model_dir} has no tokenizer.json: give tokens as ids (id:1234)")

    return Tokenizer.from_file(str(path))


def _copy_dir(src: Path, dst: Path, progress: bool) -> None:
    """Every file of ``src`` except the edit records, as bytes (the shards included: the edit
    patches rows in the copy)."""
    entries = [p for p in sorted(src.iterdir()) if p.name not in (EDITS_JSON, EDITS_ROWS)]
    total = sum(p.stat().st_size for p in entries if p.is_file())
    with progress_bar(total, "stem-edit", progress, unit="B", unit_scale=True) as bar:
        for p in entries:
            if p.is_dir():
                shutil.copytree(p, dst / p.name)
                continue
            with open(p, "rb") as fi, open(dst / p.name, "wb") as fo:
                while chunk := fi.read(64 << 20):
                    fo.write(chunk)
                    bar.update(len(chunk))
            shutil.copystat(p, dst / p.name)


def _load_records(model_dir: Path) -> Tuple[List[dict], Dict[str, torch.Tensor]]:
    edits, rows = [], {}
    if (model_dir / EDITS_JSON).exists():
        doc = json.loads((model_dir / EDITS_JSON).read_text())
        if doc.get("format") != FORMAT_VERSION:
            raise ValueError(f"{model_dir / EDITS_JSON}: format {doc.get('format')!r}, expected "
                             f"{FORMAT_VERSION}")
        edits = doc["edits"]
    if (model_dir / EDITS_ROWS).exists():
        rows = load_file(str(model_dir / EDITS_ROWS))
    return edits, rows


def _save_records(out: Path, edits: List[dict], rows: Dict[str, torch.Tensor]) -> None:
    if edits:
        (out / EDITS_JSON).write_text(json.dumps({"format": FORMAT_VERSION, "edits": edits},
                                                 indent=2) + "\n")
    if rows:
        save_file({k: v.contiguous() for k, v in sorted(rows.items())}, str(out / EDITS_ROWS))


def _build(out_dir, work) -> None:
    """Run ``work(tmp)`` on a fresh directory beside ``out_dir`` and rename it into place; on any
    failure the temporary directory is removed and ``out_dir`` never appears."""
    out = Path(out_dir)
    if out.exists() or out.is_symlink():
        raise FileExistsError(f"{out} exists: stem-edit writes a new directory (remove it or "
                              "pick another --out)")
    with staged_directory(str(out)) as tmp:
        work(Path(tmp))
        if out.exists():
            raise FileExistsError(f"{out} appeared while stem-edit was writing it")


def _source_dir(model_dir, out_dir) -> Path:
    src = Path(model_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory")
    # An output inside the source would be copied into itself (and into every later edit); one
    # holding it would be replaced by the output's rename.
    check_separate(str(model_dir), "--model", str(out_dir), "--out")
    check_output_path(str(out_dir))  # before any work: a read-only place fails here
    return src


def _saved_key(k: int, name: str) -> str:
    return f"edits.{k}.{name}"


def edit_dir(model_dir, out_dir, op: str, a: Token, b: Token, layers=None,
             progress: bool = True) -> dict:
    """Write ``out_dir``: ``model_dir`` with the STEM rows of ``a``/``b`` swapped (op "swap") or
    ``b``'s rows replaced by ``a``'s (op "copy", ``a`` the source). Returns the edit's record."""
    src = _source_dir(model_dir, out_dir)
    tables = _dir_layers(src, layers)
    needs_tok = isinstance(a, str) or isinstance(b, str)
    tokenizer = _load_tokenizer(src) if needs_tok else None
    pairs, targets, sources = _moves(op, resolve_pairs(tokenizer, a, b), tables[0].shape[0])
    edits, saved = _load_records(src)
    k = len(edits)
    record = {"op": op, "args": [a, b], "pairs": [list(p) for p in pairs],
              "pieces": [[_piece(tokenizer, x), _piece(tokenizer, y)] for x, y in pairs],
              "layers": [t.layer for t in tables], "tensors": {}}

    def work(tmp: Path):
        _copy_dir(src, tmp, progress)
        for t in tables:
            with open(tmp / t.file, "r+b") as f:
                data = _read_rows(f, t, sources)  # all reads before the first write
                if op == "copy":
                    saved[_saved_key(k, t.name)] = _rows_tensor(t, _read_rows(f, t, targets))
                _write_rows(f, t, targets, data)
            record["tensors"][t.name] = {"file": t.file, "rows_sha256": _digest(data)}
        _save_records(tmp, edits + [record], saved)

    _build(out_dir, work)
    return record


def revert_dir(model_dir, out_dir, progress: bool = True) -> dict:
    """Write ``out_dir``: ``model_dir`` with its last recorded edit undone (the tensors get their
    bits from before the edit; the record is dropped). Returns the reverted record."""
    src = _source_dir(model_dir, out_dir)
    edits, saved = _load_records(src)
    if not edits:
        raise ValueError(f"{src} has no {EDITS_JSON}: nothing to revert")
    k, record = len(edits) - 1, edits[-1]
    tables = _dir_tables(src)
    _, targets, sources = _moves(record["op"], [tuple(p) for p in record["pairs"]],
                                 next(iter(tables.values())).shape[0])
    plan = []
    for layer in record["layers"]:
        t = tables.get(layer)
        if t is None or t.name not in record["tensors"]:
            raise ValueError(f"{EDITS_JSON} names STEM layer {layer} that {src} does not hold")
        with open(src / t.file, "rb") as f:
            now = _read_rows(f, t, targets)
        # The rows must still be those the edit wrote, else restoring would clobber a later change.
        if _digest(now) != record["tensors"][t.name]["rows_sha256"]:
            raise ValueError(f"{t.name}: the edited rows changed since the edit was recorded; "
                             "refusing to revert")
        if record["op"] == "copy":
            key = _saved_key(k, t.name)
            if key not in saved:
                raise ValueError(f"{EDITS_ROWS} lacks {key}: cannot restore the copied-over rows")
            plan.append((t, _tensor_bytes(saved[key])))
        else:
            plan.append((t, None))
    rest = {n: v for n, v in saved.items() if not n.startswith(f"edits.{k}.")}

    def work(tmp: Path):
        _copy_dir(src, tmp, progress)
        for t, old in plan:
            with open(tmp / t.file, "r+b") as f:
                data = old if old is not None else _read_rows(f, t, sources)
                _write_rows(f, t, targets, data)
        _save_records(tmp, edits[:-1], rest)

    _build(out_dir, work)
    return record


def _token_arg(s: str) -> Token:
    return int(s[3:]) if re.fullmatch(r"id:\d+", s) else s


def _layers_arg(s: str) -> List[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers={s!r}: expected comma-separated layer "
                                         "indices such as 1,3") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m megatron_ext.convert stem-edit",
        description="Swap or copy the STEM rows of two tokens in a Hugging Face STEM model "
                    "(knowledge editing, Section 5.2 of the STEM paper).",
        epilog="Tokens are words (encoded with the directory's tokenizer.json, as given or with a "
               "leading space) or ids written id:1234. Words of several tokens are edited piece "
               "by piece when both have the same number of pieces, else refused.")
    p.add_argument("--model", required=True, help="Hugging Face directory to read")
    p.add_argument("--out", required=True, help="directory to create (must not exist)")
    op = p.add_mutually_exclusive_group(required=True)
    op.add_argument("--swap", nargs=2, metavar=("A", "B"), help="exchange the rows of A and B")
    op.add_argument("--copy", nargs=2, metavar=("SRC", "DST"),
                    help="write the rows of SRC over those of DST")
    op.add_argument("--revert", action="store_true",
                    help="undo the last edit recorded in --model's stem_edits.json")
    p.add_argument("--layers", type=_layers_arg, default=None,
                   help="comma-separated STEM layers (default: every STEM layer)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    try:
        if a.revert:
            if a.layers is not None:
                raise ValueError("--revert undoes the recorded layers: drop --layers")
            rec = revert_dir(a.model, a.out, progress=not a.no_progress)
            print(f"stem-edit: reverted {rec['op']} {rec['args']} in layers {rec['layers']} "
                  f"-> {a.out}", file=sys.stderr)
        else:
            kind, (x, y) = ("swap", a.swap) if a.swap else ("copy", a.copy)
            rec = edit_dir(a.model, a.out, kind, _token_arg(x), _token_arg(y), a.layers,
                           progress=not a.no_progress)
            shown = ", ".join(f"{pa!r}(#{ia}) {'<->' if kind == 'swap' else '->'} {pb!r}(#{ib})"
                              for (ia, ib), (pa, pb) in zip(rec["pairs"], rec["pieces"]))
            print(f"stem-edit: {kind} {shown} in layers {rec['layers']} -> {a.out}",
                  file=sys.stderr)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"stem-edit: error: {e}", file=sys.stderr)
        return 2
    return 0
