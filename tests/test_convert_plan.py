"""to-hf on synthetic ``torch_dist`` checkpoints (no Megatron run): the tensor plan against a plain
Llama written in the test, refusals (missing, extra, mis-shaped tensors; an existing output),
no half-written output after a failure, and peak memory while streaming a model several times
the shard size."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_ext.checkpoint_manifest import CheckpointError
from megatron_ext.convert import to_hf
from megatron_ext.models.fused_layout import merge_gated_fc1, merge_qkv, split_gated_fc1, split_qkv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def args_for(layers, hidden, heads, groups, ffn, vocab, padded, tied=False):
    return argparse.Namespace(
        model_family="gpt", num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        group_query_attention=groups != heads, num_query_groups=groups, kv_channels=None,
        ffn_hidden_size=ffn, swiglu=True, normalization="RMSNorm",
        position_embedding_type="rope", add_bias_linear=False, rotary_percent=1.0,
        rotary_base=10000, layernorm_epsilon=1e-5, max_position_embeddings=128,
        untie_embeddings_and_output_weights=not tied, qk_layernorm=False,
        tokenizer_type="NullTokenizer", vocab_size=vocab, padded_vocab_size=padded)


def write_checkpoint(path, args, tensors):
    """A torch_dist-shaped checkpoint: global tensors, stacked layers, common state with args."""
    state = dict(tensors)
    # DCP pickles non-tensor entries (Megatron's common state is such an entry).
    state["common_state/shard_0_1"] = [{"args": args, "iteration": 7}]
    folder = os.path.join(path, "iter_0000007")
    # Megatron writes the common state as one pickled entry (no flattening of containers).
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True,
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("7")
    return path


def llama_tensors(layers, hidden, heads, groups, ffn, vocab, padded, seed=0):
    g = torch.Generator().manual_seed(seed)
    hd = hidden // heads
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    emb = r(padded, hidden)
    emb[vocab:] = 0
    return {
        "embedding.word_embeddings.weight": emb,
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": 1 + r(layers, hidden),
        "decoder.layers.self_attention.linear_qkv.weight": r(layers, (heads + 2 * groups) * hd,
                                                             hidden),
        "decoder.layers.self_attention.linear_proj.weight": r(layers, hidden, hidden),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": 1 + r(layers, hidden),
        "decoder.layers.mlp.linear_fc1.weight": r(layers, 2 * ffn, hidden),
        "decoder.layers.mlp.linear_fc2.weight": r(layers, hidden, ffn),
        "decoder.final_layernorm.weight": 1 + r(hidden),
        "output_layer.weight": r(padded, hidden),
    }


SHAPE = dict(layers=2, hidden=32, heads=4, groups=2, ffn=48, vocab=100, padded=128)


@pytest.fixture
def synthetic(tmp_path):
    tensors = llama_tensors(**SHAPE)
    return write_checkpoint(str(tmp_path / "ck"), args_for(**SHAPE), tensors), tensors


def test_layouts_round_trip():
    torch.manual_seed(0)
    qkv = torch.randn((4 + 2 * 2) * 8, 16)
    q, k, v = split_qkv(qkv, 4, 2, 8)
    # Group 0 holds query heads 0-1, then key head 0, then value head 0.
    assert torch.equal(q[:16], qkv[:16]) and torch.equal(k[:8], qkv[16:24])
    assert torch.equal(v[:8], qkv[24:32]) and torch.equal(q[16:32], qkv[32:48])
    assert torch.equal(merge_qkv(q, k, v, 4, 2, 8), qkv)
    fc1 = torch.randn(10, 3)
    assert torch.equal(merge_gated_fc1(*split_gated_fc1(fc1)), fc1)
    with pytest.raises(ValueError, match="linear_qkv has"):
        split_qkv(qkv[:-1], 4, 2, 8)


def test_synthetic_llama_logits(synthetic, tmp_path):
    """The converted Llama equals a plain PyTorch forward written here from the Megatron tensors."""
    ck, t = synthetic
    out = to_hf.convert(ck, str(tmp_path / "hf"), progress=False)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    L, H, nh, ng, F, V = (SHAPE[k] for k in ("layers", "hidden", "heads", "groups", "ffn",
                                              "vocab"))
    hd = H // nh
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(1))

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    def rope(x):  # x [b, heads, s, hd]
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.arange(x.shape[2]).float()[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    h = t["embedding.word_embeddings.weight"][ids]
    b, s = ids.shape
    for i in range(L):
        x = rms(h, t["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i])
        w = t["decoder.layers.self_attention.linear_qkv.weight"][i].view(ng, nh // ng + 2, hd, H)
        q = torch.einsum("bsh,gjdh->bsgjd", x, w[:, :nh // ng]).reshape(b, s, nh, hd)
        k = torch.einsum("bsh,gdh->bsgd", x, w[:, nh // ng])
        v = torch.einsum("bsh,gdh->bsgd", x, w[:, nh // ng + 1])
        q, k, v = rope(q.transpose(1, 2)), rope(k.transpose(1, 2)), v.transpose(1, 2)
        k = k.repeat_interleave(nh // ng, 1)
        v = v.repeat_interleave(nh // ng, 1)
        att = (q @ k.transpose(-1, -2)) / hd ** 0.5
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        o = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, H)
        h = h + o @ t["decoder.layers.self_attention.linear_proj.weight"][i].t()
        x = rms(h, t["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i])
        gate_up = x @ t["decoder.layers.mlp.linear_fc1.weight"][i].t()
        gate, up = gate_up[..., :F], gate_up[..., F:]
        h = h + (torch.nn.functional.silu(gate) * up) @ t["decoder.layers.mlp.linear_fc2.weight"][i].t()
    ref = rms(h, t["decoder.final_layernorm.weight"]) @ t["output_layer.weight"][:V].t()
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    assert model.config.vocab_size == V  # Megatron's padding rows are dropped


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("decoder.layers.mlp.linear_fc2.weight"), "missing tensors"),
    (lambda t: t.update({"decoder.layers.mlp.extra_proj.weight": torch.zeros(2, 4)}),
     "does not know"),
    (lambda t: t.update({"decoder.layers.mlp.linear_fc1.weight": torch.zeros(2, 64, 32)}),
     "wrong shapes"),
])
def test_refusals_write_nothing(tmp_path, change, message):
    tensors = llama_tensors(**SHAPE)
    change(tensors)
    ck = write_checkpoint(str(tmp_path / "ck"), args_for(**SHAPE), tensors)
    out = tmp_path / "hf"
    with pytest.raises(CheckpointError, match=message):
        to_hf.convert(ck, str(out), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_existing_output_and_failure_midway(synthetic, tmp_path, monkeypatch):
    ck, _ = synthetic
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointError, match="exists"):
        to_hf.convert(ck, str(tmp_path / "taken"), progress=False)

    def broken(self, name, tensor):  # the disk fills up after the first shard, say
        if self.files:
            raise OSError("No space left on device")
        original(self, name, tensor)

    original = to_hf.ShardWriter.add
    monkeypatch.setattr(to_hf.ShardWriter, "add", broken)
    with pytest.raises(OSError):
        to_hf.convert(ck, str(tmp_path / "hf"), max_shard_size="20KB", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["ck", "taken"]  # no partial directory left


def test_cli_error_message(synthetic, tmp_path):
    ck, _ = synthetic
    proc = subprocess.run([sys.executable, "-m", "megatron_ext.convert", "to-hf", "--load",
                           str(tmp_path / "nowhere"), "--out", str(tmp_path / "hf")],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "no such checkpoint directory" in proc.stderr


def test_out_that_cannot_be_made_is_one_line_and_leaves_nothing(synthetic, tmp_path,
                                                                  monkeypatch, capsys):
    """--out under a regular file, in a directory that cannot be written (a read-only file
    system), or failing when the staging directory is made: one line, exit 2, nothing written."""
    import errno
    import tempfile

    ck, _ = synthetic
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    readonly = tmp_path / "ro"
    readonly.mkdir()

    def one_line_error(out):
        assert to_hf.main(["--load", ck, "--out", out, "--no-progress"]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("to-hf: error: ")]
        assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
        assert "Traceback" not in err, err
        return errors[0]

    assert f"{blocker} is a file, not a directory" in one_line_error(str(blocker / "hf"))
    access = os.access  # root passes permission bits: a read-only mount is what refuses it
    monkeypatch.setattr(os, "access",
                        lambda p, m: False if str(p) == str(readonly) else access(p, m))
    assert f"cannot write in {readonly}" in one_line_error(str(readonly / "sub" / "hf"))

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "late"))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    assert "cannot create the output directory (Read-only file system" in one_line_error(
        str(tmp_path / "late" / "hf"))
    assert sorted(os.listdir(tmp_path)) == ["a_file", "ck", "late", "ro"]
    assert os.listdir(tmp_path / "late") == [] and os.listdir(readonly) == []


PEAK_SCRIPT = r"""
import sys, threading, time, psutil, torch
from megatron_ext.convert import to_hf
from megatron_ext.checkpoint_reader import MegatronCheckpoint
MegatronCheckpoint(sys.argv[1])  # imports and argument unpickling before the baseline
from megatron_ext.models.registry import families
families()  # the family modules (and Megatron-Core they import) before the baseline too
from transformers import GenerationConfig, LlamaConfig  # noqa: F401 (import cost, not data)
import safetensors.torch  # noqa: F401
proc = psutil.Process()
base = peak = proc.memory_info().rss
done = False
def sample():  # resident memory every 2 ms (ru_maxrss would include the import-time peak)
    global peak
    while not done:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.002)
t = threading.Thread(target=sample); t.start()
if sys.argv[3] == "whole":  # the non-streaming way, for scale: every tensor in memory at once
    ck = MegatronCheckpoint(sys.argv[1]); held = [ck.read(k) for k in ck.tensor_keys()]
else:
    to_hf.convert(sys.argv[1], sys.argv[2], max_shard_size="32MB", progress=False)
done = True; t.join()
print(peak - base)
"""


def test_peak_memory_well_below_model_size(tmp_path):
    """A 24-layer model of ~330 MB converts with a peak of a few chunks plus one shard."""
    shape = dict(layers=24, hidden=512, heads=8, groups=8, ffn=1536, vocab=8000, padded=8064)
    # Per-layer keys (as Megatron saves models whose layers differ): each saved chunk is one
    # layer's tensor, as in a real checkpoint, where stacked tensors are chunked per layer too.
    tensors = {}
    for key, t in llama_tensors(**shape).items():
        if key.startswith("decoder.layers."):
            tensors.update({key.replace("layers.", f"layers.{i}.", 1): t[i].clone()
                            for i in range(shape["layers"])})
        else:
            tensors[key] = t
    model_bytes = sum(t.numel() * 4 for t in tensors.values())
    ck = write_checkpoint(str(tmp_path / "ck"), args_for(**shape), tensors)
    del tensors
    peaks = {}
    for mode in ("stream", "whole"):
        proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, ck, str(tmp_path / "hf"), mode],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        peaks[mode] = int(proc.stdout.strip().splitlines()[-1])
    mib = {k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()}
    print(f"model {model_bytes / 2**20:.0f} MiB, peak above baseline: {mib}")
    # The sampler sees the whole model when it is held at once (so it can see the difference).
    assert peaks["whole"] > 0.8 * model_bytes
    assert peaks["stream"] < 0.35 * model_bytes, mib


def test_llama3_rope_scaling_maps_to_the_same_frequencies(tmp_path):
    """A checkpoint trained with --use-rope-scaling --rope-scaling-factor 32 (Llama 3.2) becomes
    a Llama with rope_type llama3, whose frequencies equal upstream's RotaryEmbedding's."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = args_for(**SHAPE)
    args.use_rope_scaling, args.rope_scaling_factor, args.rotary_base = True, 32.0, 500000
    ck = write_checkpoint(str(tmp_path / "ck"), args, llama_tensors(**SHAPE))
    out = to_hf.convert(ck, str(tmp_path / "hf"), progress=False)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["factor"] == 32
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    head_dim = SHAPE["hidden"] // SHAPE["heads"]
    megatron = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_base=500000,
                               rope_scaling=True, rope_scaling_factor=32.0, use_cpu_initialization=True)
    plain = 1.0 / (500000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    assert not torch.allclose(megatron.inv_freq.cpu(), plain)  # the scaling does something
    torch.testing.assert_close(hf_inv.float(), megatron.inv_freq.float().cpu())
