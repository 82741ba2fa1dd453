"""STEM knowledge editing (Section 5.2 of the STEM paper): swapping / copying token rows of the
STEM tables, on a loaded model and on a Hugging Face directory, is exact and reversible."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from megatron_ext.convert import stem_edit
from megatron_ext.convert.stem_edit import copy_rows, resolve_pairs, revert, swap_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELING = os.path.join(ROOT, "megatron_ext", "convert", "hf_code", "modeling_megatron_ext.py")

SENTENCES = ["The capital of Spain is Madrid.", "The capital of Germany is Berlin.",
             "Spain and Germany are in Europe.",
             "The United States and the United Kingdom are far apart."]
H, F = 8, 12
# Layers 1 and 3 are STEM (the first layer never is); layer 3's table is bf16 to check that the
# directory edit moves raw bytes whatever the dtype.
KINDS = ["dense", "stem", "dense", "stem"]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # min_frequency=2: the one rare word stays in pieces, the repeated ones become tokens.
    trainer = trainers.BpeTrainer(vocab_size=1000, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 20 + ["Czechoslovakia split."], trainer)
    return tok


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


# --------------------------------------------------------------------------- a loaded model

class _MLP(nn.Module):
    def __init__(self, vocab, stem):
        super().__init__()
        self.gate_proj = nn.Linear(H, F, bias=False)
        if stem:
            self.stem_table = nn.Embedding(vocab, F)
        else:
            self.up_proj = nn.Linear(H, F, bias=False)


def fake_model(vocab):
    """Just the attribute path the editor uses: model.model.layers[i].mlp.stem_table."""
    torch.manual_seed(0)
    m = nn.Module()
    m.model = nn.Module()
    m.model.layers = nn.ModuleList()
    for kind in KINDS:
        layer = nn.Module()
        layer.mlp = _MLP(vocab, kind == "stem")
        m.model.layers.append(layer)
    m.config = types.SimpleNamespace(mlp_layers=[{"type": k} for k in KINDS])
    return m


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_only_rows_changed(before, after, layers, expect):
    """``expect``: {row: source row of ``before``} in the tables of ``layers``; all else equal."""
    for name, old in before.items():
        new = after[name]
        m = stem_edit.STEM_TENSOR.match(name)
        if m and int(m.group(1)) in layers:
            for r in range(old.shape[0]):
                assert torch.equal(new[r], old[expect.get(r, r)]), (name, r)
        else:
            assert torch.equal(new, old), name


def test_resolve_pairs(tokenizer):
    spain, germany = ids(tokenizer, " Spain"), ids(tokenizer, " Germany")
    assert len(spain) == len(germany) == 1
    # "Germany" is never sentence-initial in the corpus: only the leading-space form is one token.
    assert len(ids(tokenizer, "Germany")) > 1
    assert resolve_pairs(tokenizer, "Spain", "Germany") == [(spain[0], germany[0])]
    assert resolve_pairs(tokenizer, " Spain", 7) == [(spain[0], 7)]
    assert resolve_pairs(None, 3, 5) == [(3, 5)]
    # "Spain" is also sentence-initial, a token of its own: edited as given, with a warning.
    with pytest.warns(UserWarning, match="also with a leading space"):
        assert resolve_pairs(tokenizer, "Spain", 5) == [(ids(tokenizer, "Spain")[0], 5)]
    # Equal tokenization length: piece by piece (the STEM authors' recipe), shared pieces kept.
    us, uk = ids(tokenizer, " United States"), ids(tokenizer, " United Kingdom")
    assert len(us) == len(uk) == 2 and us[0] == uk[0]
    pairs = resolve_pairs(tokenizer, "United States", "United Kingdom")
    assert [p for p in pairs if p[0] != p[1]] == [(us[1], uk[1])]
    with pytest.raises(ValueError,
                       match=r"same number of pieces \('Czechoslovakia' -> \['C', 'z', "):
        resolve_pairs(tokenizer, "Czechoslovakia", "Spain")
    with pytest.raises(ValueError, match="pass a tokenizer"):
        resolve_pairs(None, "Spain", "Germany")


def test_swap_twice_restores_bit_exactly(tokenizer):
    model = fake_model(tokenizer.get_vocab_size())
    a, b = ids(tokenizer, " Spain")[0], ids(tokenizer, " Germany")[0]
    before = snapshot(model)
    rec = swap_rows(model, "Spain", "Germany", tokenizer=tokenizer)
    assert rec.layers == [1, 3] and rec.pairs == [(a, b)]
    assert_only_rows_changed(before, snapshot(model), [1, 3], {a: b, b: a})
    swap_rows(model, "Spain", "Germany", tokenizer=tokenizer)
    assert_only_rows_changed(before, snapshot(model), [], {})
    swap_rows(model, a, b, layers=[3])
    assert_only_rows_changed(before, snapshot(model), [3], {a: b, b: a})


def test_copy_then_revert_restores_bit_exactly(tokenizer):
    model = fake_model(tokenizer.get_vocab_size())
    src, dst = ids(tokenizer, " Germany")[0], ids(tokenizer, " Spain")[0]
    before = snapshot(model)
    rec = copy_rows(model, "Germany", "Spain", layers=[3], tokenizer=tokenizer)
    assert rec.layers == [3] and set(rec.saved) == {3}
    assert_only_rows_changed(before, snapshot(model), [3], {dst: src})
    revert(model, rec)
    assert_only_rows_changed(before, snapshot(model), [], {})
    # Piecewise words: " United" is shared, only " States" <- " Kingdom" moves.
    us, uk = ids(tokenizer, " United States"), ids(tokenizer, " United Kingdom")
    rec = copy_rows(model, "United Kingdom", "United States", tokenizer=tokenizer)
    assert rec.pairs == [(uk[1], us[1])]
    assert_only_rows_changed(before, snapshot(model), [1, 3], {us[1]: uk[1]})
    revert(model, rec)
    assert_only_rows_changed(before, snapshot(model), [], {})


def test_model_refusals(tokenizer):
    model = fake_model(tokenizer.get_vocab_size())
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"layer 2 is not a STEM layer \(its MLP is 'dense'\); "
                                         r"STEM layers: \[1, 3\]"):
        swap_rows(model, 1, 2, layers=[1, 2])
    with pytest.raises(ValueError, match="layer 4 does not exist"):
        swap_rows(model, 1, 2, layers=[4])
    with pytest.raises(ValueError, match="Czechoslovakia"):
        swap_rows(model, "Czechoslovakia", "Spain", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="outside the STEM table"):
        copy_rows(model, 1, tokenizer.get_vocab_size())
    with pytest.raises(ValueError, match="nothing to swap"):
        swap_rows(model, 5, 5)
    assert_only_rows_changed(before, snapshot(model), [], {})


# --------------------------------------------------------------------------- a directory

def write_hf_dir(path, tokenizer):
    """Two shards + index, config.json with mlp_layers, tokenizer.json."""
    from safetensors.torch import save_file

    vocab = tokenizer.get_vocab_size()
    g = torch.Generator().manual_seed(1)
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    shards = [{"model.embed_tokens.weight": rand(vocab, H)}, {"model.norm.weight": rand(H),
                                                              "lm_head.weight": rand(vocab, H)}]
    for i, kind in enumerate(KINDS):
        t = shards[i // 2]
        p = f"model.layers.{i}.mlp."
        t[f"model.layers.{i}.input_layernorm.weight"] = rand(H)
        t[p + "gate_proj.weight"] = rand(F, H)
        t[p + "down_proj.weight"] = rand(H, F)
        if kind == "stem":
            t[p + "stem_table.weight"] = rand(vocab, F).to(torch.bfloat16 if i == 3 else
                                                           torch.float32)
        else:
            t[p + "up_proj.weight"] = rand(F, H)
    os.makedirs(path)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for name, tensors in zip(names, shards):
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    mlp = [{"type": k, "intermediate_size": F, **({"variant": "up"} if k == "stem" else {})}
           for k in KINDS]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "megatron_ext", "num_hidden_layers": len(KINDS),
                   "vocab_size": vocab, "hidden_size": H, "mlp_layers": mlp}, f)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    return path


def load_dir(path):
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.startswith("model-") and name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def same_files(a, b):
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


def leftovers(parent):
    return [n for n in os.listdir(parent) if ".partial-" in n]


def cli(*args):
    from megatron_ext.convert.__main__ import main

    return main(["stem-edit", *args, "--no-progress"])


@pytest.fixture()
def hf_dir(tmp_path, tokenizer):
    return write_hf_dir(str(tmp_path / "hf"), tokenizer)


def test_cli_swap_then_revert_is_byte_identical(hf_dir, tmp_path, tokenizer, capsys):
    a, b = ids(tokenizer, " Spain")[0], ids(tokenizer, " Germany")[0]
    out, back = str(tmp_path / "edited"), str(tmp_path / "back")
    assert cli("--model", hf_dir, "--out", out, "--swap", "Spain", "Germany") == 0
    assert "'ĠSpain'" in capsys.readouterr().err
    assert_only_rows_changed(load_dir(hf_dir), load_dir(out), [1, 3], {a: b, b: a})
    for name in ("config.json", "tokenizer.json", "model.safetensors.index.json"):
        assert filecmp.cmp(os.path.join(hf_dir, name), os.path.join(out, name), shallow=False)
    record = json.load(open(os.path.join(out, "stem_edits.json")))
    assert [(e["op"], e["pairs"], e["layers"]) for e in record["edits"]] == \
        [("swap", [[a, b]], [1, 3])]
    assert not os.path.exists(os.path.join(out, "stem_edits.safetensors"))
    assert cli("--model", out, "--out", back, "--revert") == 0
    same_files(hf_dir, back)
    assert leftovers(tmp_path) == []


def test_cli_stacked_copy_reverts_one_at_a_time(hf_dir, tmp_path, tokenizer):
    a, b = ids(tokenizer, " Spain")[0], ids(tokenizer, " Germany")[0]
    d = {k: str(tmp_path / k) for k in ("swap", "copy", "back1", "back0")}
    assert cli("--model", hf_dir, "--out", d["swap"], "--swap", f"id:{a}", f"id:{b}",
               "--layers", "3") == 0
    assert cli("--model", d["swap"], "--out", d["copy"], "--copy", "Germany", "Spain",
               "--layers", "1,3") == 0
    # Layer 3 swapped, then Spain (a) <- Germany (b) in layers 1 and 3: in layer 1 both rows are
    # b's original; in layer 3 both are a's original (which b held after the swap).
    orig, edited = load_dir(hf_dir), load_dir(d["copy"])
    t1, t3 = "model.layers.1.mlp.stem_table.weight", "model.layers.3.mlp.stem_table.weight"
    assert torch.equal(edited[t1][a], orig[t1][b]) and torch.equal(edited[t1][b], orig[t1][b])
    assert torch.equal(edited[t3][a], orig[t3][a]) and torch.equal(edited[t3][b], orig[t3][a])
    record = json.load(open(os.path.join(d["copy"], "stem_edits.json")))
    assert [e["op"] for e in record["edits"]] == ["swap", "copy"]
    assert cli("--model", d["copy"], "--out", d["back1"], "--revert") == 0
    same_files(d["swap"], d["back1"])
    assert cli("--model", d["back1"], "--out", d["back0"], "--revert") == 0
    same_files(hf_dir, d["back0"])


def test_cli_refusals_leave_nothing(hf_dir, tmp_path, capsys):
    out = str(tmp_path / "out")
    cases = [
        (["--swap", "Spain", "Germany", "--layers", "1,2"],
         "layer 2 is not a STEM layer (its MLP is 'dense')"),
        (["--swap", "Czechoslovakia", "Spain"], "Czechoslovakia"),
        (["--revert"], "nothing to revert"),
        (["--copy", "Germany", "Germany"], "nothing to copy"),
    ]
    for extra, msg in cases:
        assert cli("--model", hf_dir, "--out", out, *extra) == 2
        assert msg in capsys.readouterr().err
        assert not os.path.exists(out)
    os.makedirs(out)
    assert cli("--model", hf_dir, "--out", out, "--swap", "Spain", "Germany") == 2
    assert "exists" in capsys.readouterr().err and os.listdir(out) == []
    assert cli("--model", hf_dir, "--out", os.path.join(hf_dir, "x"), "--swap", "Spain",
               "Germany") == 2
    assert "inside --model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli("--model", hf_dir, "--out", out, "--swap", "Spain", "Germany", "--layers", "1,a")
    assert leftovers(tmp_path) == []


def test_out_overlapping_model_or_unwritable_is_refused(hf_dir, tmp_path, capsys):
    """--out holding --model, --out that is --model through a symlink, and an --out where no
    file can be created (/sys, even as root): one line naming both paths, nothing written."""
    assert cli("--model", hf_dir, "--out", str(tmp_path), "--swap", "Spain", "Germany") == 2
    assert f"--out {tmp_path} holds --model {hf_dir}" in capsys.readouterr().err
    link = tmp_path / "link"
    link.symlink_to(hf_dir)
    assert cli("--model", hf_dir, "--out", str(link), "--revert") == 2
    assert f"--out {link} (= {hf_dir}) is --model {hf_dir}" in capsys.readouterr().err
    assert cli("--model", hf_dir, "--out", "/sys/megatron_ext_edit", "--swap", "Spain",
               "Germany") == 2
    assert "--out /sys/megatron_ext_edit: cannot write in /sys (" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["hf", "link"]


def test_failure_mid_write_leaves_no_directory(hf_dir, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(stem_edit, "_write_rows", boom)
    out = str(tmp_path / "out")
    with pytest.raises(OSError, match="disk full"):
        stem_edit.edit_dir(hf_dir, out, "swap", "Spain", "Germany", progress=False)
    assert not os.path.exists(out) and leftovers(tmp_path) == []


def test_revert_refuses_rows_changed_since(hf_dir, tmp_path):
    out = str(tmp_path / "edited")
    rec = stem_edit.edit_dir(hf_dir, out, "copy", "Germany", "Spain", progress=False)
    table = stem_edit._dir_tables(stem_edit.Path(out))[1]
    dst = rec["pairs"][0][1]
    with open(os.path.join(out, table.file), "r+b") as f:  # someone edits the row afterwards
        f.seek(table.start + dst * table.row_bytes)
        f.write(b"\x00" * table.row_bytes)
    with pytest.raises(ValueError, match="changed since the edit"):
        stem_edit.revert_dir(out, str(tmp_path / "back"), progress=False)
    assert leftovers(tmp_path) == [] and not os.path.exists(tmp_path / "back")


def test_module_entry_point(hf_dir, tmp_path):
    """The real ``python -m megatron_ext.convert stem-edit`` command line."""
    out = str(tmp_path / "edited")
    r = subprocess.run([sys.executable, "-m", "megatron_ext.convert", "stem-edit", "--model",
                        hf_dir, "--out", out, "--copy", "Germany", "Spain", "--no-progress"],
                       cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    assert os.path.exists(os.path.join(out, "stem_edits.safetensors"))


# --------------------------------------------------------------------------- the exported model

class _Remapped(nn.Module):
    """A STEM table read through ``perm``: the lookups of the listed tokens are redirected, the
    table itself is untouched (the reference the edited model must equal)."""

    def __init__(self, table, perm):
        super().__init__()
        self.table = table
        self.register_buffer("perm", perm)

    def forward(self, token_ids):
        return self.table(self.perm[token_ids])


@pytest.fixture()
def one_thread():
    """Tiny matmuls: one intra-op thread avoids OpenMP spin-waits on a busy 2-core CI box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.skipif(not os.path.exists(MODELING), reason="hf_code/modeling_megatron_ext.py "
                                                         "is not written yet")
def test_exported_model_edit_equals_redirected_lookups(one_thread):
    import copy

    from megatron_ext.convert.hf_code.configuration_megatron_ext import MegatronExtConfig
    from megatron_ext.convert.hf_code.modeling_megatron_ext import MegatronExtForCausalLM

    vocab, a, b = 40, 11, 23
    mlp = [{"type": "dense", "intermediate_size": 24}] + [
        {"type": "stem", "variant": v, "intermediate_size": 24} for v in ("up", "gate", "dagger")]
    cfg = MegatronExtConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=4,
                            num_attention_heads=2, mlp_layers=mlp, use_cache=False)
    torch.manual_seed(0)
    model = MegatronExtForCausalLM(cfg).eval()
    seq = torch.tensor([[3, a, 5, b, 7, a, 9, 2]])
    first = 1  # position of the first edited token

    def logits(m):
        with torch.no_grad():
            return m(input_ids=seq).logits

    base = logits(model)
    for layers in (None, [2]):
        for op, mapping in (("swap", {a: b, b: a}), ("copy", {a: b})):
            edited = copy.deepcopy(model)
            fn = swap_rows if op == "swap" else copy_rows
            rec = fn(edited, b, a, layers=layers) if op == "copy" else fn(edited, a, b, layers)
            ref = copy.deepcopy(model)
            perm = torch.arange(vocab)
            for t, s in mapping.items():
                perm[t] = s
            for i in rec.layers:
                mlp_i = ref.model.layers[i].mlp
                mlp_i.stem_table = _Remapped(mlp_i.stem_table, perm)
            got = logits(edited)
            torch.testing.assert_close(got, logits(ref), rtol=0, atol=0)
            torch.testing.assert_close(got[:, :first], base[:, :first], rtol=0, atol=0)
            assert not torch.equal(got[:, first:], base[:, first:])
            revert(edited, rec)
            torch.testing.assert_close(logits(edited), base, rtol=0, atol=0)
