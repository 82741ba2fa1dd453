"""from-hf: a Hugging Face Llama / Qwen3 checkpoint imported into a Megatron torch_dist checkpoint,
optionally with STEM layers inserted (docs/convert.md, "from-hf: STEM insertion").

Tiny random models are made here and imported once per module (``python -m megatron_ext.convert
from-hf`` in a subprocess: the importer runs Megatron in its own process). Then:

* every Hugging Face tensor is where it belongs in the checkpoint, read back with
  ``torch.distributed.checkpoint`` and no process group (q/k/v per query group, the gate/up halves,
  QK-norm, zero padded vocabulary rows, stacked vs per-layer keys);
* STEM tables: ``U_l[t] = W · RMSNorm_l(E[t])`` (W_up for ``up``, W_gate for ``gate``), computed
  here in plain PyTorch; the ``dagger`` table is zero and the kept projections are in place;
* ``launch/pretrain.py --load`` trains from the dense import under TP=2 (the first loss is the one
  the Hugging Face model gives on Megatron's mock data, a successor sequence), and the imported
  Qwen3 (tied embeddings, QK-norm, head dim != hidden/heads) with dagger STEM layers gives the
  Hugging Face model's logits under PP=2 (dagger is exact at insertion);
* to-hf gives the imported dense model back bit for bit;
* bad inputs are refused with messages naming the field or flag, and nothing is left behind.

Two torchrun launches (20-40 s each here) and four conversions (~10 s each).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from convert_support import TIED, base, hf_logits, megatron_logits, tokens
from multirank import ROOT, require_ok, torchrun

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

VOCAB = 1000
GQA = ["--group-query-attention", "--num-query-groups", "2"]
SUCCESSOR_LOGIT = 8.0  # the crafted model's logit of the next token t+1 (see _llama)
# Llama 3.1's RoPE scaling: Megatron's --use-rope-scaling with GPTModel's default factor 8.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
               "rope_theta": 500000.0}


# --------------------------------------------------------------------------------------------
# the Hugging Face models


def _randomise_norms(model) -> None:
    """Norm weights away from 1, so a norm in the wrong place shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name != "model.norm.weight":
                p.uniform_(0.5, 1.5)


def _llama(path: str):
    """4 layers, hidden 64, 4 heads / 2 KV heads, ffn 128, vocab 1000, untied.

    The residual stream is dominated by the embedding (N(0, 1) rows; the layers add ~1%) and the
    head is crafted so the model predicts t+1 after t (the mock data's sequences, ``1, 2, 3, ...
    mod vocab``): ``lm_head[s] = a/H * E[s-1]/rms(E[s-1])`` gives the next token the logit ``a``
    and the others ``a * cos`` (random directions), a loss of about 0.5 instead of ln(1000)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    _randomise_norms(model)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, 1.0)
        unit = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
        model.lm_head.weight.copy_(SUCCESSOR_LOGIT / cfg.hidden_size * unit.roll(1, dims=0))
    model.save_pretrained(path, max_shard_size="300KB")  # several shards and an index
    return model.eval()


def _qwen3(path: str):
    """Qwen3 (QK-norm), tied embeddings, head dim 32 != 64/4, rope theta 20000, eps 1e-6."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=64, rms_norm_eps=1e-6,
                      tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
    model = Qwen3ForCausalLM(cfg)
    _randomise_norms(model)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return model.eval()


def _hf_tensors(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------------------------
# running the importer and reading its output


def _command(hf: str, save: str, *args: str) -> list:
    return [sys.executable, "-m", "megatron_ext.convert", "from-hf", "--hf", hf, "--save", save,
            "--no-progress", *args]


def from_hf(hf: str, save: str, *args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(_command(hf, save, *args), cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)


def read_checkpoint(save: str) -> dict:
    """Every tensor of the checkpoint the tracker names (global shapes), without a process
    group: torch.distributed.checkpoint's FileSystemReader + ``no_dist=True``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        tracker = f.read().strip()
    folder = "release" if tracker == "release" else f"iter_{int(tracker):07d}"
    reader = dcp.FileSystemReader(os.path.join(save, folder))
    meta = reader.read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in meta.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def layer(ck: dict, i: int, name: str) -> torch.Tensor:
    """Layer ``i``'s tensor: per layer (STEM) or one slice of the stacked tensor (dense)."""
    if f"decoder.layers.{i}.{name}" in ck:
        return ck[f"decoder.layers.{i}.{name}"]
    return ck[f"decoder.layers.{name}"][i]


def rms_norm(x, w, eps):
    x = x.float()
    return w.float() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The Hugging Face models and their imports (each conversion once for the module)."""
    root = tmp_path_factory.mktemp("from_hf")
    llama = _llama(str(root / "llama"))
    qwen3 = _qwen3(str(root / "qwen3"))
    out = {"root": root, "llama": llama, "qwen3": qwen3}
    jobs = {
        "dense": ("llama", []),
        "up": ("llama", ["--stem-layers", "1,3"]),
        "gate": ("llama", ["--stem-ratio", "1/2", "--stem-variant", "gate", "--iteration", "5"]),
        "dagger": ("qwen3", ["--stem-ratio", "1/2", "--stem-variant", "dagger"]),
    }
    # Side by side: most of each conversion is importing Megatron and transformers.
    procs = {}
    for name, (hf, args) in jobs.items():
        out[name] = str(root / f"ck_{name}")
        procs[name] = subprocess.Popen(_command(str(root / hf), out[name], *args), cwd=ROOT,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"from-hf ({name}) failed:\n{log}"
    return out


# --------------------------------------------------------------------------------------------
# (a) every tensor in its place


def _check_dense_layer(ck, hf, i, nh=4, ng=2, hd=16, stem_variant=None):
    p = f"model.layers.{i}."
    qkv = layer(ck, i, "self_attention.linear_qkv.weight").view(ng, nh // ng + 2, hd, -1)
    q = hf[p + "self_attn.q_proj.weight"].view(ng, nh // ng, hd, -1)
    assert torch.equal(qkv[:, :nh // ng], q), f"layer {i}: q heads of each query group"
    assert torch.equal(qkv[:, -2], hf[p + "self_attn.k_proj.weight"].view(ng, hd, -1))
    assert torch.equal(qkv[:, -1], hf[p + "self_attn.v_proj.weight"].view(ng, hd, -1))
    assert torch.equal(layer(ck, i, "self_attention.linear_proj.weight"),
                       hf[p + "self_attn.o_proj.weight"])
    # Megatron's local norms are saved under Transformer Engine's fused names.
    assert torch.equal(layer(ck, i, "self_attention.linear_qkv.layer_norm_weight"),
                       hf[p + "input_layernorm.weight"])
    assert torch.equal(layer(ck, i, "mlp.linear_fc1.layer_norm_weight"),
                       hf[p + "post_attention_layernorm.weight"])
    assert torch.equal(layer(ck, i, "mlp.linear_fc2.weight"), hf[p + "mlp.down_proj.weight"])
    fc1 = layer(ck, i, "mlp.linear_fc1.weight")
    gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
    expected = {None: torch.cat([gate, up]), "dagger": torch.cat([gate, up]),
                "up": gate, "gate": up}[stem_variant]
    assert torch.equal(fc1, expected), f"layer {i} ({stem_variant or 'dense'}): linear_fc1"


def test_dense_import_is_exact(imported):
    ck = read_checkpoint(imported["dense"])
    hf = _hf_tensors(imported["llama"])
    # Homogeneous layers: stacked with a leading layer axis; the vocabulary padded to 1024.
    assert ck["decoder.layers.self_attention.linear_qkv.weight"].shape == (4, 128, 64)
    for key, name in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                      ("output_layer.weight", "lm_head.weight")):
        assert ck[key].shape == (1024, 64)
        assert torch.equal(ck[key][:VOCAB], hf[name]), key
        assert not ck[key][VOCAB:].any(), f"{key}: padded rows must be zero"
    assert torch.equal(ck["decoder.final_layernorm.weight"], hf["model.norm.weight"])
    for i in range(4):
        _check_dense_layer(ck, hf, i)
    assert not any("table" in k for k in ck)
    with open(os.path.join(imported["dense"], "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "release"
    info = json.load(open(os.path.join(imported["dense"], "from_hf.json")))
    assert info["padded_vocab_size"] == 1024 and info["checkpoint"] == "release"
    assert info["make_vocab_size_divisible_by_per_tp"]["2"] == 128
    assert not [f for f in os.listdir(imported["root"]) if ".partial-" in f]
    # The checksum manifest, written in the staged directory before the rename, lists every file.
    from megatron_ext import checkpoint_manifest as cm

    release = os.path.join(imported["dense"], "release")
    assert sorted(cm.verify(release)["files"]) == cm.checkpoint_files(release)


# --------------------------------------------------------------------------------------------
# (c) STEM insertion


def _stem_table_reference(hf, i, proj, eps, vocab_rows):
    """``W · RMSNorm_l(E[t])`` for every token, zero for padded rows (plain PyTorch)."""
    p = f"model.layers.{i}."
    normed = rms_norm(hf["model.embed_tokens.weight"], hf[p + "post_attention_layernorm.weight"],
                      eps)
    table = torch.zeros(vocab_rows, hf[p + f"mlp.{proj}.weight"].shape[0])
    table[:VOCAB] = normed @ hf[p + f"mlp.{proj}.weight"].float().t()
    return table


@pytest.mark.parametrize("variant", ["up", "gate"])
def test_stem_tables_from_the_dense_projection(imported, variant):
    ck = read_checkpoint(imported[variant])
    hf = _hf_tensors(imported["llama"])
    assert "decoder.layers.1.mlp.table" in ck and "decoder.layers.0.mlp.table" not in ck
    for i in range(4):
        stem = i in (1, 3)  # --stem-layers 1,3 and --stem-ratio 1/2 choose the same layers
        _check_dense_layer(ck, hf, i, stem_variant=variant if stem else None)
        if stem:
            proj = "up_proj" if variant == "up" else "gate_proj"
            ref = _stem_table_reference(hf, i, proj, 1e-5, 1024)
            table = ck[f"decoder.layers.{i}.mlp.table"]
            assert table.shape == (1024, 128)
            torch.testing.assert_close(table, ref, rtol=1e-5, atol=1e-5)
            assert not table[VOCAB:].any()
        else:
            assert f"decoder.layers.{i}.mlp.table" not in ck
    if variant == "gate":  # --iteration 5: iter_0000005, loaded with --finetune
        with open(os.path.join(imported["gate"], "latest_checkpointed_iteration.txt")) as f:
            assert f.read().strip() == "5"
        info = json.load(open(os.path.join(imported["gate"], "from_hf.json")))
        assert info["checkpoint"] == "iter_0000005" and "--finetune" in info["pretrain_flags"]


def test_dagger_table_is_zero_and_qwen3_maps(imported):
    ck = read_checkpoint(imported["dagger"])
    hf = _hf_tensors(imported["qwen3"])
    # Tied: no output layer; the embedding serves both ends.
    assert "output_layer.weight" not in ck
    assert torch.equal(ck["embedding.word_embeddings.weight"][:VOCAB],
                       hf["model.embed_tokens.weight"])
    for i in range(4):
        stem = i in (1, 3)
        _check_dense_layer(ck, hf, i, hd=32, stem_variant="dagger" if stem else None)
        for ours, theirs in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            assert torch.equal(layer(ck, i, f"self_attention.{ours}.weight"),
                               hf[f"model.layers.{i}.self_attn.{theirs}.weight"])
        if stem:
            table = ck[f"decoder.layers.{i}.mlp.table"]
            assert table.shape == (1024, 128) and not table.any()
    info = json.load(open(os.path.join(imported["dagger"], "from_hf.json")))
    flags = info["pretrain_flags"]
    for expected in (["--kv-channels", "32"], ["--rotary-base", "20000"], ["--qk-layernorm"],
                     ["--stem-ratio", "1/2"], ["--stem-variant", "dagger"]):
        i = flags.index(expected[0])
        assert flags[i:i + len(expected)] == expected
    assert "--untie-embeddings-and-output-weights" not in flags


# --------------------------------------------------------------------------------------------
# (b) Megatron trains from / computes with the imports


def _successor_loss(model, windows: int = 16) -> float:
    """The Hugging Face model's mean loss on windows of Megatron's mock data (1, 2, 3, ...)."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(1, 4000, (windows, 1), generator=g)
    ids = (starts + torch.arange(65)) % VOCAB
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                             ids[:, 1:].reshape(-1)).item()


def test_pretrain_trains_from_the_import_under_tp2(imported, tmp_path):
    expected = _successor_loss(imported["llama"])
    assert expected < 2.0, expected  # the crafted model predicts the mock data
    run = require_ok(torchrun("pretrain_tp2", str(tmp_path), base(GQA) + [
        "--tensor-model-parallel-size", "2", "--load", imported["dense"],
        "--train-iters", "2"]))
    assert "loading release" in run.log  # weights only: fresh optimizer, iteration 0
    first = run.losses[1]
    assert abs(first - expected) < 0.15, f"iteration 1 loss {first} vs Hugging Face {expected}"
    assert math.isfinite(run.losses[2])


def test_round_trip_through_to_hf_is_exact(imported, tmp_path):
    """from-hf then to-hf gives back the very tensors (to-hf reads the release folder)."""
    from safetensors.torch import load_file

    from convert_support import to_hf

    out = to_hf(os.path.join(imported["dense"], "release"), str(tmp_path / "hf"))
    back = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            back.update(load_file(os.path.join(out, f)))
    original = _hf_tensors(imported["llama"])
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_dagger_import_gives_the_hf_logits_under_pp2(imported, tmp_path):
    info = json.load(open(os.path.join(imported["dagger"], "from_hf.json")))
    flags = list(info["pretrain_flags"])
    i = flags.index("--load")
    del flags[i:i + 2]
    ids = tokens()
    ref = hf_logits(imported["qwen3"], ids)
    # megatron_logits runs TINY_GPT (tied: without --untie-...) + these flags.
    ours = megatron_logits(str(tmp_path), "dagger_pp2", [TIED, *flags,
                           "--pipeline-model-parallel-size", "2"], imported["dagger"], ids)
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-4, f"max |HF - Megatron| = {diff:.2e}"


# --------------------------------------------------------------------------------------------
# (d) refusals


def _write_config(src: str, dst: str, **changes) -> str:
    """A copy of the Hugging Face directory ``src`` with config.json fields changed."""
    import shutil

    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))
    return dst


def _refused(capsys, hf: str, save: str, *args: str) -> str:
    """In-process: refusals happen before Megatron starts (no global state is touched)."""
    from megatron_ext.convert import from_hf as mod

    assert mod.main(["--hf", hf, "--save", save, "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert "from-hf: error:" in err
    return err


@pytest.mark.parametrize("changes,args,match", [
    ({"attention_bias": True}, [], "attention_bias=true"),
    ({"hidden_act": "gelu"}, [], "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, [],
     "rope_type='linear'"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, [],
     "architectures=['MistralForCausalLM']"),
    ({"rope_parameters": dict(LLAMA3_ROPE, low_freq_factor=2.0)}, [], "low_freq_factor"),
    ({}, ["--stem-layers", "0,2"], "layer 0 is never a STEM layer"),
    ({}, ["--stem-layers", "1,4"], "4 out of range"),
    ({}, ["--stem-variant", "dagger", "--stem-layers", "1", "--stem-init-scale", "2"],
     "dagger tables start at zero"),
])
def test_bad_inputs_are_refused(imported, tmp_path, capsys, changes, args, match):
    hf = _write_config(str(imported["root"] / "llama"), str(tmp_path / "hf"), **changes)
    save = str(tmp_path / "ck")
    assert match in _refused(capsys, hf, save, *args)
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # nothing written


def test_llama3_rope_scaling_maps_to_megatron(imported, tmp_path):
    from megatron_ext.convert.from_hf import describe_hf, model_flags

    # Llama 3.2 uses factor 32: it reaches GPTModel through --rope-scaling-factor.
    hf = _write_config(str(imported["root"] / "llama"), str(tmp_path / "hf"),
                       rope_parameters=dict(LLAMA3_ROPE, factor=32.0))
    m = describe_hf(hf)
    assert m.llama3_rope and m.rope_theta == 500000
    flags = model_flags(m, None, 128)
    assert "--use-rope-scaling" in flags and flags[flags.index("--rotary-base") + 1] == "500000"
    assert flags[flags.index("--rope-scaling-factor") + 1] == "32"


def test_existing_target_and_failures_leave_nothing(imported, tmp_path, capsys):
    hf = str(imported["root"] / "llama")
    target = tmp_path / "ck"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    assert "exists and is not empty" in _refused(capsys, hf, str(target))
    assert os.listdir(target) == ["keep.txt"]
    # A failure after the temporary directory was made (here: under a multi-rank launcher).
    proc = from_hf(hf, str(tmp_path / "ck2"), env=dict(os.environ, WORLD_SIZE="2"))
    assert proc.returncode == 2 and "WORLD_SIZE=2: from-hf runs as one process" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_save_overlapping_hf_or_unwritable_is_refused(tmp_path, capsys):
    """--save inside --hf (through a symlink too), --save holding --hf, and a --save where no
    file can be created (/sys, even as root) are refused before the model is read, naming both
    paths; nothing is written."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")  # never read: the paths are checked first
    (tmp_path / "link").symlink_to(hf)
    inside = str(tmp_path / "link" / "ck")
    assert f"--save {inside} (= {hf}/ck) lies inside --hf {hf}" in _refused(capsys, str(hf),
                                                                             inside)
    assert f"--save {tmp_path} holds --hf {hf}" in _refused(capsys, str(hf), str(tmp_path))
    assert "--save /sys/megatron_ext_ck: cannot write in /sys (" in _refused(
        capsys, str(hf), "/sys/megatron_ext_ck")
    assert sorted(os.listdir(tmp_path)) == ["hf", "link"] and os.listdir(hf) == ["config.json"]
