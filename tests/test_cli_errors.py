"""Bad flags are refused with a message that names the flag, not a traceback from Megatron."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from multirank import PRETRAIN, ROOT, TINY_GPT
from tests_helpers import parse_tiny_args as parse


# The Sigma family's fixed flags (the entry point adds them; parse() here does not) + 4 experts.
SIGMA = ["--model-family", "sigma", "--num-experts", "4", "--moe-ffn-hidden-size", "32",
         "--moe-router-topk", "1", "--qk-layernorm", "--moe-router-pre-softmax", "--moe-router-dtype", "fp32",
         "--moe-router-load-balancing-type", "none"]



@pytest.mark.parametrize("extra,match", [
    (["--model-family", "stem", "--stem-layers", "0,2"], "layer 0 is never"),
    (["--model-family", "stem", "--stem-layers", "2,4"], "4 out of range; STEM layers must be in 1..3"),
    (["--model-family", "stem", "--stem-layers", "2,a"], "comma-separated"),
    (["--model-family", "stem", "--stem-cpu-threads", "-2"], "--stem-cpu-threads=-2: must be >= 0"),
    (["--model-family", "sigma"], "--num-experts=None: the Sigma family needs"),
    (SIGMA + ["--expert-model-parallel-size", "3"],
     "--num-experts=4 is not divisible by --expert-model-parallel-size=3"),
    (SIGMA + ["--moe-router-topk", "5"], r"--moe-router-topk=5: must be in 1..4"),
    (SIGMA + ["--sigma-topk-schedule", "[2,2,2,2,2]", "--sigma-sparsify-at", "2"],
     "--sigma-topk-schedule has 5 entries but the model has 4 layers"),
    (SIGMA + ["--sigma-topk-schedule", "[2]", "--sigma-sparsify-at", "0.5"],
     "is a fraction of training: it needs --train-iters"),
    ([f for f in SIGMA if f != "--qk-layernorm"], "needs --qk-layernorm"),
    (SIGMA[:-1] + ["aux_loss"], "needs --moe-router-load-balancing-type none"),
    (SIGMA + ["--sigma-lbl-coeff", "-1"], "--sigma-lbl-coeff=-1.0: must be >= 0"),
    (["--model-family", "structmoe", "--calculate-per-token-loss"], "--structmoe-aux-loss-coeff 0"),
    (["--model-family", "stem", "--stem-table-placement", "cpu", "--save", "/tmp/ck",
      "--ckpt-format", "torch"],
     "--stem-table-placement cpu --stem-table-sharding replicated does not support "
     "--ckpt-format torch"),
    (["--model-family", "structmoe", "--structmoe-aux-loss-coeff", "-1"],
     "--structmoe-aux-loss-coeff=-1.0: must be >= 0"),
    (["--model-family", "structmoe", "--structmoe-ffn-pad-to", "0"],
     "--structmoe-ffn-pad-to=0: must be >= 1"),
    # D'_ff = 112 (Eq. 8 at the tiny shape) stored as 117 does not split over 2 TP ranks.
    (["--model-family", "structmoe", "--structmoe-num-experts", "4", "--structmoe-rank", "4",
      "--structmoe-ffn-pad-to", "9", "--tensor-model-parallel-size", "2"],
     r"--structmoe-ffn-pad-to=9: StructMoE's D'_ff stored as 117 is not divisible by "
     r"--tensor-model-parallel-size=2"),
    (["--model-family", "stem", "--stem-table-placement", "tiered"],
     "both tiers are sharded by vocabulary .* pass --stem-table-sharding vocab"),
    (["--model-family", "stem", "--stem-table-placement", "tiered", "--stem-table-sharding",
      "vocab", "--stem-gpu-tier", "ten"], "--stem-gpu-tier: GPU tier size 'ten'"),
    (["--model-family", "stem", "--stem-table-placement", "tiered", "--stem-table-sharding",
      "vocab", "--stem-tier-count-tokens", "-1"], "--stem-tier-count-tokens=-1: must be >= 0"),
    (["--model-family", "stem", "--stem-table-placement", "tiered", "--stem-table-sharding",
      "vocab", "--stem-gpu-step", "triton"],
     "--stem-gpu-step triton steps the sparse optimizer's rows on the GPU: it needs "
     "--stem-optimizer sparse"),
    (["--model-family", "stem", "--stem-table-placement", "cpu", "--stem-table-sharding",
      "vocab", "--stem-optimizer", "sparse", "--stem-gpu-step", "triton"],
     "--stem-table-placement tiered or gpu"),
])
def test_bad_extension_flags(extra, match):
    from megatron_ext.training.arguments import validate_extension_args

    with pytest.raises(ValueError, match=match):
        validate_extension_args(parse(extra))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel runs where CUDA is")
def test_stem_kernel_refused_without_cuda(monkeypatch):
    from megatron_ext.training.arguments import validate_extension_args

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="--stem-kernel=triton needs Triton with a CUDA device"):
        validate_extension_args(parse(["--model-family", "stem", "--stem-kernel", "triton"]))
    validate_extension_args(parse(["--model-family", "stem", "--stem-kernel", "torch"]))
    tiered = ["--model-family", "stem", "--stem-table-placement", "tiered",
              "--stem-table-sharding", "vocab", "--stem-optimizer", "sparse"]
    with pytest.raises(ValueError, match="--stem-gpu-step triton needs Triton and a CUDA device"):
        validate_extension_args(parse(tiered + ["--stem-gpu-step", "triton"]))
    validate_extension_args(parse(tiered + ["--stem-gpu-step", "torch"]))


def test_structmoe_width_flags():
    from megatron_ext.models.registry import family_config as structmoe_config_from_args

    family = ["--model-family", "structmoe"]
    assert structmoe_config_from_args(parse(family)).param_matched
    explicit = structmoe_config_from_args(parse(family + ["--structmoe-ffn-hidden-size", "96"]))
    assert explicit.ffn_hidden_size == 96 and not explicit.param_matched
    assert not structmoe_config_from_args(parse(family + ["--no-structmoe-param-matched"])).param_matched
    with pytest.raises(ValueError, match="exclude each other"):
        structmoe_config_from_args(parse(family + ["--structmoe-param-matched",
                                                   "--structmoe-ffn-hidden-size", "96"]))


def test_stem_host_huge_pages_flag():
    from megatron_ext.models.registry import family_config as stem_config_from_args

    family = ["--model-family", "stem"]
    assert stem_config_from_args(parse(family)).host_huge_pages
    assert not stem_config_from_args(parse(family + ["--no-stem-host-huge-pages"])).host_huge_pages


def test_stem_needs_gated_activation():
    from megatron_ext.training.arguments import validate_extension_args

    args = parse(["--model-family", "stem"])
    args.swiglu = False
    with pytest.raises(ValueError, match="--swiglu"):
        validate_extension_args(args)


def test_manifest_vocab_mismatch_is_refused(tmp_path):
    from megatron_ext.training.arguments import data_manifest_path, validate_extension_args

    manifest = {"tokenizer_vocab_size": 4096, "data_prefix_relative": "corpus_text_document",
                "tokenizer_dir_relative": "tokenizer"}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    args = parse(["--model-family", "stem"])
    args.data_path = [str(tmp_path / "corpus_text_document")]
    assert data_manifest_path(args) == str(tmp_path / "manifest.json")
    validate_extension_args(args, tokenizer_vocab_size=4096)
    with pytest.raises(ValueError, match="vocab size mismatch.*4096.*8000"):
        validate_extension_args(args, tokenizer_vocab_size=8000)


def test_entry_point_reports_bad_flags_without_traceback():
    proc = subprocess.run(
        [sys.executable, PRETRAIN, *TINY_GPT, "--train-iters", "1", "--model-family", "stem",
         "--stem-layers", "0,2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0"))
    assert proc.returncode != 0
    assert "megatron-ext: --stem-layers=0,2: layer 0 is never a STEM layer" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sigma_valid_flags_pass():
    from megatron_ext.models.registry import family_config as sigma_config_from_args
    from megatron_ext.training.arguments import validate_extension_args

    args = parse(SIGMA + ["--sigma-topk-schedule", "[2,2]", "--sigma-sparsify-at", "3"])
    validate_extension_args(args)
    assert list(sigma_config_from_args(args).initial_topks()) == [2, 2, 1, 1]


@pytest.mark.parametrize("extra,message", [
    (["--sigma-preset", "nope"], "megatron-ext: --sigma-preset=nope: no such preset"),
    (SIGMA + ["--expert-model-parallel-size", "3"],
     "megatron-ext: --num-experts=4 is not divisible by --expert-model-parallel-size=3"),
])
def test_entry_point_reports_bad_sigma_flags_without_traceback(extra, message):
    proc = subprocess.run(
        [sys.executable, PRETRAIN, *TINY_GPT, "--train-iters", "1", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0"))
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_help_prints_every_flag():
    """``--help`` prints Megatron's flags (one of whose help texts has a bare '%') and ours."""
    proc = subprocess.run([sys.executable, PRETRAIN, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--moe-paged-stash-buffer-size-factor-cuda", "--num-layers",
                 "--stem-table-placement", "--sigma-sparsify-at", "--structmoe-rank"):
        assert flag in proc.stdout, flag


def test_entry_point_without_torchrun_says_how_to_launch():
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, PRETRAIN, *TINY_GPT, "--train-iters", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    assert "megatron-ext: launch/pretrain.py runs under torchrun" in proc.stderr, \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_sigma_switch_beyond_training_is_announced(capsys):
    from megatron_ext.training.arguments import check_family_args as validate_sigma_args

    args = parse(SIGMA + ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
                          "--sigma-topk-schedule", "[2,2]", "--sigma-sparsify-at", "12",
                          "--train-iters", "10"])
    validate_sigma_args(args)
    assert "the switch will not happen in this run" in capsys.readouterr().err
    args = parse(SIGMA + ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
                          "--sigma-topk-schedule", "[2,2]", "--sigma-sparsify-at", "0.5",
                          "--train-iters", "10"])
    validate_sigma_args(args)
    assert "will not happen" not in capsys.readouterr().err


def test_sigma_switch_warning_is_printed_once(capsys):
    """The entry point checks the family's flags before and after Megatron's own checks."""
    from megatron_ext.training.arguments import check_family_args

    args = parse(SIGMA + ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
                          "--sigma-topk-schedule", "[2,2]", "--sigma-sparsify-at", "13",
                          "--train-iters", "10"])
    check_family_args(args)
    check_family_args(args)
    assert capsys.readouterr().err.count("the switch will not happen in this run") == 1


def run_entry(flags):
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    return subprocess.run([sys.executable, PRETRAIN, *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.mark.parametrize("flag,message", [
    ("--micro-batch-size", "--micro-batch-size (the samples of one micro-batch"),
    ("--tokenizer-type", "--tokenizer-type (e.g. HuggingFaceTokenizer")])
def test_missing_required_flag_is_named_without_traceback(flag, message):
    """Megatron's validation asserts on --micro-batch-size and its tokenizer builder raises for
    no --tokenizer-type (tracebacks before)."""
    flags = list(TINY_GPT)
    i = flags.index(flag)
    del flags[i:i + 2]
    proc = run_entry(flags + ["--train-iters", "1"])
    assert proc.returncode != 0
    assert f"megatron-ext: missing {message}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_missing_dataset_is_named_before_anything_is_built(tmp_path):
    flags = [f for f in TINY_GPT if f != "--mock-data"] + [
        "--train-iters", "1", "--data-path", "0.5", str(tmp_path / "corpus"), "0.5",
        str(tmp_path / "missing")]
    (tmp_path / "corpus.bin").write_bytes(b"")
    (tmp_path / "corpus.idx").write_bytes(b"")
    proc = run_entry(flags)
    assert proc.returncode != 0
    assert (f"megatron-ext: --data-path: no indexed dataset at {tmp_path / 'missing'} "
            f"({tmp_path / 'missing'}.bin does not exist") in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_datasets_named_in_argument_files_are_checked(tmp_path):
    """--data-args-path and --per-split-data-args-path name their datasets in files: a missing
    file, a missing dataset in one and a file that is not JSON are each named in one line."""
    from argparse import Namespace

    from megatron_ext.training.preflight import check_data_paths

    for name in ("a", "b"):
        (tmp_path / f"{name}.bin").write_bytes(b"")
        (tmp_path / f"{name}.idx").write_bytes(b"")
    a, b, missing = (str(tmp_path / n) for n in ("a", "b", "missing"))
    (tmp_path / "blend.txt").write_text(f"0.3 {a}\n0.7 {b}\n")
    (tmp_path / "bad_blend.txt").write_text(f"0.3 {a} 0.7 {missing}")
    (tmp_path / "splits.json").write_text(json.dumps({"train": f"1 {a}", "valid": [b],
                                                      "test": None}))
    (tmp_path / "bad_splits.json").write_text(json.dumps({"train": [a], "valid": [missing]}))
    (tmp_path / "not.json").write_text("train: a")

    def args(**flags):
        return Namespace(mock_data=False, **flags)

    check_data_paths(args(data_args_path=str(tmp_path / "blend.txt")))
    check_data_paths(args(per_split_data_args_path=str(tmp_path / "splits.json")))
    # Object storage is Megatron's to reach (its cache): neither refused nor read here.
    check_data_paths(args(data_path=["0.5", "s3://bucket/corpus", "0.5", a]))
    check_data_paths(args(data_args_path="msc://profile/blend.txt"))
    for flags, message in (
            (dict(data_args_path=str(tmp_path / "bad_blend.txt")),
             f"--data-args-path: no indexed dataset at {missing} ({missing}.bin does not exist"),
            (dict(per_split_data_args_path=str(tmp_path / "bad_splits.json")),
             f"--per-split-data-args-path: no indexed dataset at {missing}"),
            (dict(data_args_path=str(tmp_path / "nowhere.txt")),
             f"--data-args-path: {tmp_path / 'nowhere.txt'} does not exist"),
            (dict(per_split_data_args_path=str(tmp_path / "not.json")),
             "--per-split-data-args-path: " + str(tmp_path / "not.json") + " is not JSON")):
        with pytest.raises(ValueError, match=re.escape(message)):
            check_data_paths(args(**flags))


def test_unwritable_save_dir_is_refused_at_start(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    proc = run_entry(TINY_GPT + ["--train-iters", "1", "--save", str(blocker / "ck"),
                               "--save-interval", "1"])
    assert proc.returncode != 0
    # The line ends the output; Megatron's ~890-line argument table, printed before the checks
    # after its validation, is held back until they pass.
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"megatron-ext: --save={blocker / 'ck'}: cannot create or write"), proc.stderr[-2000:]
    assert "------------------------ arguments" not in proc.stdout
    assert "Traceback" not in proc.stderr
    from megatron_ext.training.preflight import check_save_dir

    check_save_dir(str(tmp_path / "new" / "ck"), rank=3)  # created, probe removed
    assert os.listdir(tmp_path / "new" / "ck") == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend is not installed there")
def test_async_save_is_refused_on_the_cpu_backend_at_start(tmp_path):
    """Megatron's persistent checkpoint worker selects a CUDA device as it starts: on the CPU
    backend it exited and the ranks waited for it until the process group timed out (seen:
    a 2-rank run killed after 10 minutes, at its first save)."""
    proc = run_entry(TINY_GPT + ["--train-iters", "1", "--save", str(tmp_path / "ck"),
                                 "--save-interval", "1", "--async-save",
                                 "--use-persistent-ckpt-worker", "--async-strategy", "mcore"])
    assert proc.returncode != 0
    assert "megatron-ext: --async-save needs a GPU" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_async_save_checks():
    """Which asynchronous saves are refused at start-up (training/preflight.py): none without
    --async-save (Megatron turns it off without --use-persistent-ckpt-worker); every one on the
    CPU backend; with Megatron's default nvrx writer, those without nvidia-resiliency-ext (which
    Megatron checks only for the torch_dcp and fsdp_dtensor formats)."""
    from types import SimpleNamespace

    from megatron_ext.training.preflight import check_async_save

    off = SimpleNamespace(async_save=False, async_strategy="mcore")
    mcore = SimpleNamespace(async_save=True, async_strategy="mcore")
    nvrx = SimpleNamespace(async_save=True, async_strategy="nvrx")
    for args in (off, mcore, nvrx):
        check_async_save(args, cpu_backend=False, nvrx_available=True)
    check_async_save(off, cpu_backend=True)
    check_async_save(mcore, cpu_backend=False, nvrx_available=False)
    for args in (mcore, nvrx):
        with pytest.raises(ValueError, match="--async-save needs a GPU"):
            check_async_save(args, cpu_backend=True, nvrx_available=True)
    with pytest.raises(ValueError, match="needs nvidia-resiliency-ext, which is not installed: "
                                         "install it, or pass --async-strategy mcore"):
        check_async_save(nvrx, cpu_backend=False, nvrx_available=False)


def test_fusions_without_their_kernels_are_turned_off():
    """Megatron defaults rope and gradient-accumulation fusion on; without Transformer Engine or
    Apex (this machine, and a GPU machine without the extras) the run falls back to the unfused
    paths instead of failing at model build or at the first backward."""
    import argparse
    import importlib.util

    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers

    from megatron_ext.training.arguments import drop_unavailable_fusions

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine provides both fusions")
    assert rope_utils.fused_apply_rotary_pos_emb is None and not layers._grad_accum_fusion_available
    assert importlib.util.find_spec("scaled_masked_softmax_cuda") is None
    args = argparse.Namespace(apply_rope_fusion=True, gradient_accumulation_fusion=True,
                              masked_softmax_fusion=True)
    lines = drop_unavailable_fusions(args)
    assert not (args.apply_rope_fusion or args.gradient_accumulation_fusion
                or args.masked_softmax_fusion)
    assert len(lines) == 3 and "--no-rope-fusion" in lines[0]
    off = argparse.Namespace(apply_rope_fusion=False, gradient_accumulation_fusion=False,
                             masked_softmax_fusion=False)
    assert drop_unavailable_fusions(off) == []


def test_load_without_a_checkpoint_is_refused_unless_it_is_the_save_dir(tmp_path):
    """A mistyped --load (no checkpoint there) stops at start-up naming it; the same empty
    directory as --load and --save (auto-resume's first run) starts fresh with one line."""
    typo = tmp_path / "ck_typo"
    proc = run_entry(TINY_GPT + ["--train-iters", "1", "--load", str(typo)])
    assert proc.returncode != 0
    assert f"megatron-ext: --load={typo}: no checkpoint there" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    from megatron_ext.training.preflight import check_load_dir

    same = tmp_path / "ck"
    assert "training starts from scratch" in check_load_dir(str(same), str(same))
    (same / "iter_0000002").mkdir(parents=True)
    (same / "iter_0000002" / ".metadata").write_bytes(b"")  # a finished save (DCP's last file)
    assert check_load_dir(str(same), str(tmp_path / "other"), step=2) is None  # it loads
    with pytest.raises(ValueError, match="no checkpoint there"):
        check_load_dir(str(typo), str(tmp_path / "other"))


@pytest.mark.multirank
def test_workers_exit_when_the_launcher_is_killed(tmp_path):
    """SIGKILL of the torchrun launcher: its worker (in a session of its own) exits too, instead
    of training and saving on its own (megatron_ext/training/entry.py, exit_with_launcher)."""
    import signal
    import time

    import psutil

    from multirank import launch_port

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    log = open(tmp_path / "log.txt", "w+")
    launcher = subprocess.Popen(
        [torchrun, "--nproc_per_node=1", f"--master-port={launch_port()}", PRETRAIN, *TINY_GPT,
         "--train-iters", "100000", "--save", str(tmp_path / "ck"), "--save-interval", "1000"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    workers = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and launcher.poll() is None:
            log.seek(0)
            if " iteration        2/" in log.read():
                break
            time.sleep(0.5)
        log.seek(0)
        assert launcher.poll() is None, log.read()[-3000:]
        workers = [p for p in psutil.Process(launcher.pid).children(recursive=True)
                   if PRETRAIN in " ".join(p.cmdline())]
        assert workers, log.read()[-3000:]
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        gone, alive = psutil.wait_procs(workers, timeout=60)
        assert not alive, f"workers still running after their launcher died: {alive}"
    finally:
        for p in workers:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        log.close()
