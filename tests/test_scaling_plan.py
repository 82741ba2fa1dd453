"""The one-GPU run plan of issue 51 through ``launch/scaling.py``: the command it launches for each
preset on a GPU is accepted by our argument parser (Megatron's with the plugin's flags: the dry run
of exactly those flags, in this process, ``training/dry_run.py``), and the report's MFU for dense_1b
equals a hand count (training FLOPs per token of the Llama-3.2-1B shape, an H100 SXM's dense bf16
peak)."""

from __future__ import annotations

import json
import os

import pytest

from megatron_ext.training import dry_run
from megatron_ext.training.presets import expand_argv
from tests_helpers import load_script

sh = load_script("launch/scaling.py", "scaling_plan")

# The one-GPU presets (capability 2).
PRESETS = ["dense_1b", "stem_1b", "dense_structmoe_0p9b", "structmoe_0p9b", "sigma_moe_tiny"]


def _pretrain_flags(preset, extra=()):
    opts, extra = sh.parse_args(["--preset", preset, "--gpus", "1", "--layouts", "tp1",
                                 "--mock-data", "--micro-batch-size", "1", "--iters", "20",
                                 "--", *extra])
    cmd = sh.torchrun_command(opts.layout_list[0], opts, extra, "/tmp/report.json", cuda=True)
    return cmd[cmd.index(sh.PRETRAIN) + 1:]


def _dry(flags, json_path):
    raw = ["--dry-run", "--dry-run-world-size", "1", "--dry-run-json", str(json_path), *flags]
    return dry_run.main(expand_argv(raw), raw)


@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_command_parses(preset, tmp_path, capsys):
    flags = _pretrain_flags(preset)
    assert "--no-create-attention-mask-in-dataloader" in flags  # the flash kernel's condition
    rc = _dry(flags, tmp_path / "d.json")
    assert rc == 0, capsys.readouterr().err[-2000:]
    assert json.loads((tmp_path / "d.json").read_text())["preset"] == preset


def test_a_flag_the_parser_does_not_know_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _dry(_pretrain_flags("dense_1b", ["--no-such-flag"]), tmp_path / "d.json")
    assert exc.value.code != 0 and "--no-such-flag" in capsys.readouterr().err


def test_mfu_of_dense_1b_by_hand(tmp_path):
    # Llama-3.2-1B shape (launch/presets/dense_1b.json): L 16, h 2048, SwiGLU f 8192, 32 heads of
    # 64, 8 KV groups, s 4096, vocabulary 128256 (a multiple of 128: no padding), untied output.
    L, h, f, kv, s, V = 16, 2048, 8192, 8 * 64, 4096, 128256
    qkv_proj = h * (h + 2 * kv) + h * h  # weights of QKV and the output projection
    core = 2 * 2 * s * h  # QK^T and probs x V, forward, per token (no causal halving)
    mlp = 3 * h * f
    per_token = L * (6 * qkv_proj + 3 * core + 6 * mlp) + 6 * h * V  # forward + backward
    assert per_token == 9_025_093_632
    rc = _dry(_pretrain_flags("dense_1b"), tmp_path / "d.json")
    assert rc == 0
    estimate = json.loads((tmp_path / "d.json").read_text())["train_flops_per_token"]
    assert estimate == per_token  # what the run report records (training/run_report.py)

    peak, label = sh.gpu_peak("NVIDIA H100 80GB HBM3")
    assert peak == 989.4 and "H100 SXM" in label
    # a report: start-up, one warm-up, then 3 iterations of 8 sequences of 4096 in 0.8 s each
    tokens = 8 * s
    its = [{"iteration": i + 1, "seconds": sec, "sequences": 8, "tokens": tokens,
            "train_flops_per_token": estimate, **({"startup": True} if i == 0 else {})}
           for i, sec in enumerate([30.0, 1.5, 0.8, 0.8, 0.8])]
    report = {"iterations": its,
              "layout": {"world_size": 1, "micro_batch_size": 8, "global_batch_size": 8,
                         "num_microbatches": 1, "seq_length": s},
              "memory": {"peak_bytes": 0, "peak_metric": "max_reserved_bytes",
                         "max_rss_bytes": 0},
              "device": {"name": "NVIDIA H100 80GB HBM3"}}
    m = sh.metrics_from_report(report, warmup_iters=2, peak_tflops=peak)
    tokens_per_s = 3 * tokens / 2.4  # 40,960
    assert m["tokens_per_s_per_gpu"] == pytest.approx(tokens_per_s)
    assert m["tflops_per_s_per_gpu"] == pytest.approx(tokens_per_s * 9_025_093_632 / 1e12)
    # 40,960 x 9.025e9 = 369.67 TFLOP/s of 989.4: 37.36 %
    assert m["mfu"] == pytest.approx(369.6678 / 989.4, rel=1e-6)


fr = load_script("launch/first_runs.py", "first_runs_plan")


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    """The main job's corpus builder at its smallest (the dry run loads the tokenizer)."""
    from megatron_ext.tools import data_prep

    m = data_prep.prepare(data_prep.DataPrepConfig(
        out=str(tmp_path_factory.mktemp("corpus")), vocab_size=300, max_mb=0.02))
    return {"prefix": m["data_prefix"], "tokenizer": m["tokenizer_dir"],
            "vocab": int(m["tokenizer_vocab_size"]), "tokens": int(m["num_tokens"]),
            "manifest": os.path.join(os.path.dirname(m["data_prefix"]), data_prep.MANIFEST)}


@pytest.mark.parametrize("name", fr.GPU_RUNS)
def test_first_runs_gpu_command_parses(name, tiny_corpus, tmp_path, capsys):
    """launch/first_runs.py's command for each run (the corpus's tokenizer padded to the
    preset's vocabulary, the short schedule, the stop by signal) is accepted by our parser, and
    the padding gives dense_1b the preset's FLOPs per token (the hand count above)."""
    opts = fr.parse_args(["--out", str(tmp_path)])
    data = tiny_corpus
    cmd = fr.run_command(name, opts, data, str(tmp_path / name), str(tmp_path / "r.json"),
                         cuda=True)
    rc = _dry(cmd[cmd.index(sh.PRETRAIN) + 1:], tmp_path / "d.json")
    assert rc == 0, capsys.readouterr().err[-2000:]
    dry = json.loads((tmp_path / "d.json").read_text())
    assert dry["preset"] == fr.RUNS[name][0]
    if name == "dense_1b":
        assert dry["train_flops_per_token"] == 9_025_093_632
