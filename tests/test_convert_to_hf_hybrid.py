"""to-hf of hybrid-path checkpoints (``--hybrid-layer-pattern``, upstream's ``HybridModel``):
Hugging Face layer i is the i-th ``*`` (attention) and the i-th ``-`` (MLP) of the pattern, the
final norm ``decoder.final_norm``; the converted model's logits equal (1e-4, fp32) those Megatron
computes from the same checkpoint under another layout, as for GPT-path checkpoints
(``tests/test_convert_to_hf.py``). STEM's layers count MLP blocks (``--stem-ratio 1/2``: blocks 1
and 3, pattern positions 3 and 7). A pattern that is not ``*`` then one MLP symbol, repeated, has
no Hugging Face layout and is refused naming the flag, with nothing written. StructMoE (every
``-``) and Sigma (every ``E``, a Qwen3-MoE layer) go through the same mapping. The trainings
share one launch (tests/multirank.py, Launches).
"""

from __future__ import annotations

import json
import os

import pytest

from convert_support import (hf_logits, hf_model, reference_logits, to_hf, tokens,
                             train_flags, trained)
from multirank import ROOT, Launches, assert_teardown_left_only_the_default_group
from rank_server import run_python

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

GQA = ["--group-query-attention", "--num-query-groups", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
HYBRID = ["--hybrid-layer-pattern", "*-*-*-*-"]  # TINY_GPT's 4 blocks (--num-layers derived)
HYBRID_PP2 = ["--hybrid-layer-pattern", "*-*-|*-*-"] + PP2  # the stage boundary in the pattern
STEM = ["--model-family", "stem", "--stem-ratio", "1/2"]  # MLP blocks 1 and 3
SMOE = ["--model-family", "structmoe", "--structmoe-num-experts", "4", "--structmoe-rank", "4",
        "--structmoe-topk", "2"]
# Sigma top-1 from the start: every E a Qwen3-MoE layer (native, no remote code).
SIGMA = ["--model-family", "sigma", "--num-experts", "8", "--moe-ffn-hidden-size", "16",
         "--moe-token-dispatcher-type", "alltoall", "--sigma-lbl", "global",
         "--sigma-lbl-coeff", "0.01"] + GQA
SIGMA_HYBRID = ["--hybrid-layer-pattern", "*E*E*E*E"]
EP2 = ["--expert-model-parallel-size", "2"]
CUSTOM = "MegatronExtForCausalLM"
TOL = 1e-4

# name: (model flags, training flags, {evaluation layout: flags}, architecture)
CASES = {
    # Trained with PP=2 (a stage boundary in the pattern), evaluated with TP=2.
    "hybrid_dense_gqa": (GQA, HYBRID_PP2, {"tp2": HYBRID + TP2}, "LlamaForCausalLM"),
    # Evaluated with PP=2 and no --hybrid-layer-pattern: megatron_logits takes the checkpoint's
    # (upstream splits an unpiped pattern evenly over the stages).
    "hybrid_stem_up": (STEM, HYBRID + TP2, {"pp2_pattern_from_checkpoint": PP2}, CUSTOM),
    # StructMoE trained with PP=2 (its DeepNorm depth counts the 4 MLP blocks), evaluated TP=2.
    "hybrid_structmoe": (SMOE + GQA, HYBRID_PP2, {"tp2": HYBRID + TP2}, CUSTOM),
    # Sigma's E layers trained with EP=2, evaluated with TP=2.
    "hybrid_sigma": (SIGMA, SIGMA_HYBRID + EP2, {"tp2": SIGMA_HYBRID + TP2},
                     "Qwen3MoeForCausalLM"),
}
# the exported MLP types (config "mlp_layers") of the cases with remote code
MLP_TYPES = {"hybrid_stem_up": ["dense", "stem", "dense", "stem"],
             "hybrid_structmoe": ["structmoe"] * 4}
REFUSED = ("hybrid_attention_first", ["--hybrid-layer-pattern", "**--"])  # 2 `*`, then 2 `-`


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("to_hf_hybrid_train"))
    launches, saves = Launches(workdir), {}
    for case, (model, train_layout, _, _) in CASES.items():
        flags, saves[case] = train_flags(workdir, case, model + train_layout)
        launches.add(case, flags)
    name, flags = REFUSED
    flags, saves[name] = train_flags(workdir, name, flags)
    launches.add(name, flags)
    runs = launches.run()
    return {name: (runs[name], save) for name, save in saves.items()}


@pytest.fixture(scope="module")
def reference(checkpoints, tmp_path_factory):
    """Megatron's logits of every case under each of its evaluation layouts, in one launch of 2
    ranks (``convert_support.megatron_logits_many``): ``{name: logits}``."""
    return reference_logits(checkpoints, CASES,
                            str(tmp_path_factory.mktemp("to_hf_hybrid_logits")))


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_checkpoint_logits_match_megatron(case, checkpoints, reference, tmp_path):
    model, train_layout, layouts, arch = CASES[case]
    ck = trained(checkpoints, case)
    out = to_hf(ck, str(tmp_path / "hf"))
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == [arch] and cfg["num_hidden_layers"] == 4
    record = json.load(open(os.path.join(out, "megatron_ext_conversion.json")))
    assert record["hybrid_layer_pattern"] == dict(zip(train_layout, train_layout[1:]))[
        "--hybrid-layer-pattern"]
    if arch == CUSTOM:  # STEM layers are MLP blocks 1 and 3
        assert [m["type"] for m in cfg["mlp_layers"]] == MLP_TYPES[case]
    hf = hf_model(out, remote=arch == CUSTOM)
    assert type(hf).__name__ == arch
    ids = tokens()
    ours = hf_logits(hf, ids)
    for name, flags in layouts.items():
        diff = (ours - reference[f"{case}_{name}"]).abs().max().item()
        assert diff <= TOL, f"{case} under {name}: max |HF - Megatron| = {diff:.2e}"


def test_a_pattern_without_a_hugging_face_layout_is_refused(checkpoints, tmp_path):
    ck = trained(checkpoints, REFUSED[0])
    out = str(tmp_path / "hf")
    proc = run_python(["-m", "megatron_ext.convert", "to-hf", "--load", ck, "--out", out,
                       "--no-progress"], cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("to-hf: error: the checkpoint's --hybrid-layer-pattern '**--' has no "
                           "Hugging Face layout"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(out) and not [f for f in os.listdir(tmp_path) if ".partial-" in f]


def test_teardown_frees_every_training(checkpoints):
    """The trainings of the launch are each freed at their teardown with their process groups."""
    assert_teardown_left_only_the_default_group([run for run, _ in checkpoints.values()])
