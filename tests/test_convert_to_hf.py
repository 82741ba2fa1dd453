"""to-hf, verified by logits: for every family, a checkpoint trained under one layout is converted
and the Hugging Face model's logits must equal (1e-4, fp32) those Megatron computes from the same
checkpoint under TP=2 and PP=2 (``megatron_ext.convert.megatron_logits``).

The checkpoints cover: GQA with TP=2 (q/k/v per query group and the gate/up halves split per TP
rank: the classic conversion bugs), STEM tables resident on the host and sharded by vocabulary
(saved as row blocks by their DP owners), every STEM variant, StructMoE, Sigma with expert
parallelism before the sparsification switch (per-layer top-k: exported code) and after it
(uniform top-1: native Qwen3-MoE, loaded without remote code). Each torchrun launch costs 20-40 s
here, so each family trains once (all seven trainings in one launch: tests/multirank.py, Launches)
and is evaluated under the layouts it was not trained with.
"""

from __future__ import annotations

import filecmp
import json
import os

import pytest

from convert_support import (TIED, hf_logits, hf_model, reference_logits, to_hf,
                             tokens, train_flags, trained)
from multirank import Launches, assert_teardown_left_only_the_default_group

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

GQA = ["--group-query-attention", "--num-query-groups", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
TP2_SP = TP2 + ["--sequence-parallel"]
STEM = ["--model-family", "stem", "--stem-ratio", "1/2"]  # STEM layers 1 and 3
MANAGED = ["--stem-table-placement", "cpu", "--stem-table-sharding", "vocab"]
# The main job's table mode (launch/main_job.py STEM_TABLES): the GPU tier on the model's device.
TIERED = ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
          "--stem-optimizer", "sparse"]
SMOE = ["--model-family", "structmoe", "--structmoe-num-experts", "4", "--structmoe-rank", "4",
        "--structmoe-topk", "2"]
SIGMA = ["--model-family", "sigma", "--num-experts", "8", "--moe-ffn-hidden-size", "16",
         "--moe-token-dispatcher-type", "alltoall", "--sigma-lbl", "global",
         "--sigma-lbl-coeff", "0.01", "--sigma-topk-schedule", "[2,2]",
         "--sigma-sparsify-at", "2"] + GQA
CUSTOM = "MegatronExtForCausalLM"

# name: (model flags, training layout flags, {evaluation layout: flags}, architecture)
CASES = {
    "dense_gqa": (GQA, TP2, {"tp2": TP2, "pp2": PP2}, "LlamaForCausalLM"),
    # QK-norm makes the dense model a Qwen3; tied embeddings are shared by both PP stages.
    "dense_qknorm_tied": (GQA + ["--qk-layernorm", TIED], PP2, {"tp2": TP2},
                          "Qwen3ForCausalLM"),
    # Logits also with the training run's own managed-table flags (rows fetched per forward).
    "stem_up_managed": (STEM + GQA, MANAGED, {"tp2": TP2, "pp2": PP2, "managed_pp2": MANAGED + PP2,
                                              "managed_dp2": MANAGED, "tiered_dp2": TIERED},
                        CUSTOM),
    "stem_dagger": (STEM + ["--stem-variant", "dagger"], TP2, {"pp2": PP2}, CUSTOM),
    "stem_gate": (STEM + ["--stem-variant", "gate"], PP2, {"tp2": TP2}, CUSTOM),
    "structmoe": (SMOE + GQA, TP2, {"tp2": TP2, "pp2": PP2}, CUSTOM),
    # D'_ff = 112 stored as 128, trained at TP=2 (the padding on rank 1), read at PP=2: the
    # export drops the zero padding.
    "structmoe_padded": (SMOE + GQA + ["--structmoe-ffn-pad-to", "128"], TP2, {"pp2": PP2},
                         CUSTOM),
}
TOL = 1e-4


def _check_directory(out: str, arch: str) -> dict:
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == [arch]
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    shards = set(index["weight_map"].values())
    assert shards == {f for f in os.listdir(out) if f.endswith(".safetensors")}
    assert os.path.exists(os.path.join(out, "generation_config.json"))
    code = [f"{kind}_megatron_ext.py" for kind in ("configuration", "modeling")]
    if arch == CUSTOM:
        assert cfg["auto_map"]["AutoModelForCausalLM"] == \
            "modeling_megatron_ext.MegatronExtForCausalLM"
        src = os.path.join(os.path.dirname(__file__), "..", "megatron_ext", "convert", "hf_code")
        for f in code:
            assert filecmp.cmp(os.path.join(out, f), os.path.join(src, f), shallow=False)
    else:
        assert "auto_map" not in cfg and not any(os.path.exists(os.path.join(out, f))
                                                 for f in code)
    assert not [f for f in os.listdir(os.path.dirname(out)) if ".partial-" in f]
    return cfg


SIGMA_EP2 = "sigma_ep2"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every case's training run (and Sigma's, saving each of its 3 steps), in one launch of 2
    ranks (tests/multirank.py, Launches): the --save directory of each."""
    workdir = str(tmp_path_factory.mktemp("to_hf_train"))
    launches, saves = Launches(workdir), {}
    for case, (model, train_layout, _, _) in CASES.items():
        flags, saves[case] = train_flags(workdir, case, model + train_layout)
        launches.add(case, flags)
    flags, saves[SIGMA_EP2] = train_flags(workdir, SIGMA_EP2,
                                          SIGMA + ["--expert-model-parallel-size", "2"], iters=3,
                                          extra=["--save-interval", "1"])
    launches.add(SIGMA_EP2, flags)
    runs = launches.run()
    return {name: (runs[name], save) for name, save in saves.items()}


@pytest.fixture(scope="module")
def reference(checkpoints, tmp_path_factory):
    """Megatron's logits of every case under each of its evaluation layouts, and of Sigma's
    checkpoints before and after the switch, all in one launch of 2 ranks (``megatron_logits``
    torn down between them, ``convert_support.megatron_logits_many``): ``{name: logits}``."""
    return reference_logits(
        checkpoints, CASES, str(tmp_path_factory.mktemp("to_hf_logits")),
        [("sigma_step1_pp2", SIGMA + PP2, SIGMA_EP2, tokens(1), 1),
         ("sigma_step3_tp2", SIGMA + TP2_SP, SIGMA_EP2, tokens(1), None)])


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory):
    """to-hf of a case's checkpoint, once for the module (the logits test and the lm-eval test
    read the same output): ``converted(case)`` is its Hugging Face directory."""
    outs = {}

    def convert(case):
        if case not in outs:
            # A small shard size: the output has several shards and an index that must cover
            # them.
            outs[case] = to_hf(trained(checkpoints, case),
                               str(tmp_path_factory.mktemp(f"hf_{case}") / "hf"),
                               "--max-shard-size", "300KB")
        return outs[case]
    return convert


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_megatron(case, converted, reference):
    model, train_layout, layouts, arch = CASES[case]
    out = converted(case)
    _check_directory(out, arch)
    hf = hf_model(out, remote=arch == CUSTOM)
    assert type(hf).__name__ == arch
    ids = tokens()
    ours = hf_logits(hf, ids)
    for name, flags in layouts.items():
        diff = (ours - reference[f"{case}_{name}"]).abs().max().item()
        assert diff <= TOL, f"{case} under {name}: max |HF - Megatron| = {diff:.2e}"
    # Converted models generate (greedy, with the KV cache).
    out_ids = hf.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)
    assert out_ids.shape == (1, 12)


def test_structmoe_export_drops_the_stored_padding(converted):
    """The exported StructMoE has the model's D'_ff = 112 (the padded checkpoint's tensors are
    128 wide), and its config says nothing of the padding."""
    from safetensors import safe_open

    out = converted("structmoe_padded")
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert {m["intermediate_size"] for m in cfg["mlp_layers"]} == {112}
    assert not any(k.startswith("_") for m in cfg["mlp_layers"] for k in m)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
    shapes = {}
    for name in ("gate_proj", "up_proj", "down_proj", "lore_b"):
        key = f"model.layers.0.mlp.{name}" + ("" if name == "lore_b" else ".weight")
        with safe_open(os.path.join(out, index[key]), "pt") as f:
            shapes[name] = tuple(f.get_slice(key).get_shape())
    assert shapes["gate_proj"][0] == shapes["up_proj"][0] == 112
    assert shapes["down_proj"][1] == shapes["lore_b"][-1] == 112


def test_lm_eval_scores_a_converted_stem_model(converted, tmp_path):
    """A converted model with exported code (STEM) runs in lm-eval's HFLM on the synthetic task,
    and lm-eval's accuracy is the one computed by hand from the model's log-probabilities. Its
    own test: without lm-eval only this skips, the logits test above still passes or fails."""
    import test_lm_eval_hf as lm

    if lm.LM_EVAL_MISSING:
        pytest.skip(lm.LM_EVAL_MISSING)
    from megatron_ext.convert.evaluate import evaluate_hf

    model = hf_model(converted("stem_up_managed"), remote=True)
    tok = lm.tiny_tokenizer()
    out = evaluate_hf(model, tok, [lm.TASK], lm.write_include_path(tmp_path), batch_size=4)
    acc, _ = lm.reference_accuracy(model, tok)
    assert out["results"][lm.TASK]["acc,none"] == pytest.approx(acc)


def test_sigma_before_and_after_the_switch(checkpoints, reference, tmp_path):
    """Expert parallelism in training; before the switch layers 0-1 route to 2 experts (exported
    code, per-layer top-k), after it every layer to 1 (native Qwen3-MoE, no remote code)."""
    ck = trained(checkpoints, SIGMA_EP2)
    ids = tokens(1)
    before = to_hf(ck, str(tmp_path / "hf_step1"), "--ckpt-step", "1")
    cfg = _check_directory(before, CUSTOM)
    assert [m["top_k"] for m in cfg["mlp_layers"]] == [2, 2, 1, 1]
    ref = reference["sigma_step1_pp2"]
    diff = (hf_logits(hf_model(before, remote=True), ids) - ref).abs().max().item()
    assert diff <= TOL, f"Sigma step 1 (PP=2): {diff:.2e}"

    after = to_hf(ck, str(tmp_path / "hf_step3"))
    cfg = _check_directory(after, "Qwen3MoeForCausalLM")
    assert cfg["num_experts_per_tok"] == 1 and cfg["norm_topk_prob"] is False
    hf = hf_model(after, remote=False)
    ref = reference["sigma_step3_tp2"]
    diff = (hf_logits(hf, ids) - ref).abs().max().item()
    assert diff <= TOL, f"Sigma step 3 (TP=2 + SP): {diff:.2e}"
    assert hf.generate(ids[:1, :8], max_new_tokens=4, do_sample=False).shape == (1, 12)


def test_a_damaged_checkpoint_is_refused_naming_the_file(checkpoints, tmp_path):
    """to-hf checks the checkpoint against the manifest the trainer wrote beside it: a truncated
    .distcp (a bare EOFError from DCP before) and 4 KiB of garbage in one (converted silently
    before) are refused in one line naming the file, with nothing written;
    --no-verify-checkpoint converts the second anyway."""
    import shutil

    from multirank import ROOT
    from rank_server import run_python

    from megatron_ext import checkpoint_manifest as cm

    save = trained(checkpoints, "dense_gqa")
    folder, _ = cm.resolve_checkpoint_dir(save)

    def run(load, out, *extra):
        return run_python(["-m", "megatron_ext.convert", "to-hf", "--load", load, "--out", out,
                           "--no-progress", *extra], cwd=ROOT)

    ok = run(save, str(tmp_path / "hf_ok"))
    assert ok.returncode == 0, ok.stderr
    assert f"{folder}: {len(cm.read_manifest(folder)['files'])} files match their checksums" \
        in ok.stdout + ok.stderr
    for damage in ("truncate", "garbage"):
        copy = str(tmp_path / f"ck_{damage}")
        shutil.copytree(save, copy)
        cfolder, _ = cm.resolve_checkpoint_dir(copy)
        target = os.path.join(cfolder, sorted(n for n in os.listdir(cfolder)
                                              if n.endswith(".distcp"))[0])
        size = os.path.getsize(target)
        with open(target, "r+b") as f:
            if damage == "truncate":
                f.truncate(size // 2)
            else:
                f.seek(size // 2)
                f.write(b"\x5a" * 4096)
        out = str(tmp_path / f"hf_{damage}")
        proc = run(copy, out)
        assert proc.returncode == 2
        why = (f"{size // 2} bytes, the manifest says {size} (truncated" if damage == "truncate"
               else "its SHA-256 differs from the manifest's (damaged bytes")
        assert proc.stderr.strip().splitlines()[-1] == (
            f"to-hf: error: checkpoint {cfolder} is damaged: {target}: {why}"
            + (" or rewritten)" if damage == "truncate" else ")")
            + ". Load another iteration (--ckpt-step), or pass --no-verify-checkpoint to load "
            "it anyway"), proc.stderr
        assert "Traceback" not in proc.stderr and not os.path.exists(out)
    unchecked = run(str(tmp_path / "ck_garbage"), str(tmp_path / "hf_unchecked"),
                    "--no-verify-checkpoint")
    assert unchecked.returncode == 0, unchecked.stderr


def test_teardown_frees_every_training(checkpoints):
    """The trainings of the launch are each freed at their teardown with their process groups."""
    assert_teardown_left_only_the_default_group([run for run, _ in checkpoints.values()])
