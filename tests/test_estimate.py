"""The dry-run estimate (planning/estimate.py, planning/model_shape.py, planning/layout.py)
against the papers' counts, against hand-written formulas, and against models Megatron really
builds under TP=2 x PP=2 (and EP=2 for Sigma)."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys

import pytest

from megatron_ext.planning.estimate import estimate, layer_activation_bytes, rank_estimate
from megatron_ext.planning.layout import Layout
from megatron_ext.planning.model_shape import ModelShape
from megatron_ext.training.presets import load_preset_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spec_from_preset(name: str, **over) -> ModelShape:
    """The spec written out by hand from a preset's JSON (independent of Megatron's parser)."""
    data = load_preset_file(name)
    f, vocab = data["flags"], data["tokenizer"]["vocab_size"]
    vocab = math.ceil(vocab / 128) * 128  # --make-vocab-size-divisible-by 128, TP=1
    layers, heads = f["num-layers"], f["num-attention-heads"]
    kw = dict(family=f["model-family"], num_layers=layers, hidden=f["hidden-size"],
              ffn=f["ffn-hidden-size"], heads=heads,
              query_groups=f.get("num-query-groups", heads),
              head_dim=f.get("kv-channels", f["hidden-size"] // heads), vocab=vocab,
              seq_length=f["seq-length"], gated=bool(f.get("swiglu")),
              layernorm=f.get("normalization") == "LayerNorm", qk_norm=f["model-family"] == "sigma")
    if kw["family"] == "stem":
        ratio = f["stem-ratio"]
        step = {"1/3": 3, "1/2": 2}.get(ratio)
        kw["stem_layers"] = tuple(i for i in range(1, layers) if step is None
                                  or (i + 1) % step == 0)
    if kw["family"] == "structmoe":
        from megatron_ext.structmoe.config import param_matched_ffn

        n, r = f["structmoe-num-experts"], f["structmoe-rank"]
        kw.update(smoe_ffn=param_matched_ffn(kw["hidden"], kw["ffn"], n, r, 3 if kw["gated"] else 2),
                  smoe_experts=n, smoe_rank=r, smoe_topk=f["structmoe-topk"])
    if kw["family"] == "sigma":
        sched = json.loads(f["sigma-topk-schedule"])
        kw.update(experts=f["num-experts"], expert_ffn=f["moe-ffn-hidden-size"],
                  topks=tuple(sched) + (1,) * (layers - len(sched)), target_topks=(1,) * layers)
    kw.update(over)
    return ModelShape(**kw)


# ---------------------------------------------------------------------------------------------
# the papers' numbers


def test_stem_table3_counts():
    """STEM paper Table 3: total / active parameters (B) and #GFLOPs (the ROI denominator)."""
    one = lambda x: round(x / 1e9, 2)  # noqa: E731
    d1, s1 = (estimate(spec_from_preset(p), Layout()) for p in ("dense_1b", "stem_1b"))
    assert one(d1.total_params) == 1.50 and one(d1.paper_active_params) == 1.50
    assert round(d1.paper_gflops_per_token, 2) == 3.00
    assert one(s1.paper_active_params) == 1.41 and round(s1.paper_gflops_per_token, 2) == 2.83
    assert abs(s1.total_params / 6.75e9 - 1) < 0.015  # 6.67B: the table rounds its own way
    d350, s350 = (estimate(spec_from_preset(p), Layout()) for p in ("dense_350m", "stem_350m"))
    assert round(d350.total_params / 1e9, 2) in (0.37, 0.38)
    assert one(s350.paper_active_params) == 0.35 and round(s350.paper_gflops_per_token, 2) == 0.70
    assert abs(s350.total_params / 1.14e9 - 1) < 0.03
    # the saving is exactly the replaced up-projections: 6 h f per STEM layer and token
    spec = spec_from_preset("stem_1b")
    saving = d1.train_flops_per_token - s1.train_flops_per_token
    assert saving == 6 * spec.hidden * spec.ffn * len(spec.stem_layers) == 6 * 2048 * 8192 * 5


def test_structmoe_table1_parameter_matching():
    for size, paper in (("0p9b", 0.9e9), ("1p6b", 1.6e9)):
        dense = estimate(spec_from_preset(f"dense_structmoe_{size}"), Layout())
        smoe = estimate(spec_from_preset(f"structmoe_{size}"), Layout())
        assert abs(dense.total_params / paper - 1) < 0.03
        assert abs(smoe.total_params / dense.total_params - 1) < 1e-4  # Eq. 8's floor
        assert spec_from_preset(f"structmoe_{size}").smoe_ffn == 6618  # Table 1
        assert smoe.train_flops_per_token < dense.train_flops_per_token


def test_sigma_tiny_against_its_budget_and_the_report():
    from megatron_ext.sigma.budget import SigmaBudget

    spec = spec_from_preset("sigma_moe_tiny")
    est = estimate(spec, Layout())
    b = SigmaBudget(spec.num_layers, spec.hidden, spec.heads, spec.query_groups, spec.head_dim,
                    spec.experts, spec.expert_ffn, spec.vocab, tied_embeddings=False)
    assert est.total_params == b.total
    emb = spec.vocab * spec.hidden + spec.hidden  # output layer, one embedding row
    assert est.active_params - emb == b.active(spec.topks)
    assert est.active_params_target - emb == b.active(spec.target_topks)
    assert abs(b.active(spec.target_topks) / 0.5e9 - 1) < 0.1  # "0.5B activated"
    assert abs(b.active(spec.topks) / 0.65e9 - 1) < 0.02  # Table 3: 0.65B before the switch
    assert abs(est.total_params / 20e9 - 1) < 0.02


# ---------------------------------------------------------------------------------------------
# hand-written formulas


def tiny(**over) -> ModelShape:
    kw = dict(family="gpt", num_layers=4, hidden=64, ffn=192, heads=4, query_groups=2,
              head_dim=16, vocab=512, seq_length=32)
    kw.update(over)
    return ModelShape(**kw)


def test_dense_counts_by_hand():
    s = tiny()
    attn = 64 * (64 + 2 * 32) + 64 * 64
    mlp = 3 * 64 * 192
    total = 512 * 64 * 2 + 4 * (attn + mlp + 2 * 64) + 64
    est = estimate(s, Layout())
    assert est.total_params == total
    assert est.active_params == total - 512 * 64 + 64
    core = 12 * 32 * 64
    assert est.train_flops_per_token == 6 * 4 * (attn + mlp) + 4 * core + 6 * 64 * 512


def test_bias_qknorm_layernorm_counts():
    s = tiny(bias=True, qk_norm=True, layernorm=True, gated=False)
    per_layer = (64 * 128 + 64 * 64 + 128 + 64 + 2 * 16 * 2  # attention, biases, QK LayerNorm
                 + 2 * 64 * 192 + 192 + 64 + 2 * 128)          # GELU MLP with biases, 2 norms
    assert estimate(s, Layout()).total_params == 2 * 512 * 64 + 4 * per_layer + 128


def test_memory_rules():
    s = tiny()
    base = Layout(world_size=8, global_batch=64)
    dist = Layout(world_size=8, global_batch=64, distributed_optimizer=True)
    e0, e1 = estimate(s, base), estimate(s, dist)
    n = e0.total_params
    assert e0.gpu_bytes["weights"] == 2 * n and e0.gpu_bytes["gradients"] == 4 * n
    assert e0.gpu_bytes["optimizer"] == 12 * n and e1.gpu_bytes["optimizer"] == 12 * n / 8
    fp32 = estimate(s, Layout(param_bytes=4, master_weights=False))
    assert fp32.gpu_bytes["optimizer"] == 8 * n and fp32.gpu_bytes["weights"] == 4 * n
    # TP halves the matrices, not the norms
    tp = rank_estimate(s, Layout(world_size=2, tp=2), 0)
    norms = (2 * 4 + 1) * 64
    assert tp["params"] == (n - norms) // 2 + norms
    # STEM tables handed to the table store leave the GPU; vocab sharding divides the rows
    st = tiny(family="stem", stem_layers=(1, 3))
    kept = estimate(st, Layout(world_size=4, global_batch=8))
    moved = estimate(st, Layout(world_size=4, global_batch=8, stem_managed=True,
                                stem_placement="cpu", stem_sharding="vocab"))
    rows = 512 // 4
    assert kept.gpu_bytes["weights"] - moved.gpu_bytes["weights"] == 2 * 2 * 512 * 192
    assert moved.host_bytes["stem_tables"] == 4 * 2 * rows * 192
    assert moved.host_bytes["stem_adam_moments"] == 8 * 2 * rows * 192
    assert moved.host_bytes["stem_table_gradients"] == 4 * 2 * rows * 192
    assert "stem_tables" not in kept.host_bytes
    # Tiered: the rank's share of the GPU tier on the GPU (10% of 512 = 51 rows: 13 per rank
    # of 4 interleaved, all 51 on the busiest contiguous owner), its other rows on the host.
    for ownership, hot in (("interleaved", 13), ("contiguous", 51)):
        tiered = estimate(st, Layout(world_size=4, global_batch=8, stem_managed=True,
                                     stem_placement="tiered", stem_sharding="vocab",
                                     stem_optimizer="sparse", stem_ownership=ownership))
        assert tiered.gpu_bytes["stem_tables"] == 4 * 2 * hot * 192, ownership
        assert tiered.gpu_bytes["stem_adam_moments"] == 8 * 2 * hot * 192
        assert tiered.host_bytes["stem_tables"] == 4 * 2 * (rows - hot) * 192
        assert tiered.host_bytes["stem_adam_moments"] == 8 * 2 * (rows - hot) * 192
        assert "stem_table_gradients" not in tiered.host_bytes  # sparse: no gradient buffer
    # pipeline: the first stage keeps min(pp, micro-batches) micro-batches
    pp = Layout(world_size=2, pp=2, global_batch=8)
    r0 = rank_estimate(s, pp, 0)["activation_bytes_one_microbatch"]
    assert estimate(s, pp).gpu_bytes["activations"] >= 2 * r0
    # full recomputation keeps much less
    full = estimate(s, Layout(recompute="full"))
    assert full.gpu_bytes["activations"] < e0.gpu_bytes["activations"] / 2


@pytest.mark.parametrize("bad, match", [
    (dict(world_size=6, tp=4), "not divisible by TP"),
    (dict(world_size=8, ep=3), "EP x expert-TP"),
    (dict(world_size=8, global_batch=12, micro_batch=1), "global batch 12"),
])
def test_bad_layouts(bad, match):
    with pytest.raises(ValueError, match=match):
        Layout(**bad)


def test_activation_terms_scale_as_documented():
    s = tiny(rope=False)  # the RoPE tables are the one term that does not scale with the batch
    a = layer_activation_bytes(s, Layout(micro_batch=2, global_batch=4), 0, ())
    b = layer_activation_bytes(s, Layout(micro_batch=4, global_batch=4), 0, ())
    assert b == pytest.approx(2 * a)
    for core in ("sdpa", "te"):
        fused = layer_activation_bytes(s, Layout(micro_batch=2, global_batch=4,
                                                 core_attention=core, attention_mask=False,
                                                 transformer_engine=core == "te"), 0, ())
        assert fused < a  # no s^2 scores


# ---------------------------------------------------------------------------------------------
# the core attention that runs (--ext-core-attention): scores or none


def dense_1b_by_hand(core: str, mask: bool) -> int:
    """One micro-batch's activations of dense_1b on one GPU (pipeline stage 0 = last stage), bf16,
    micro batch 1, Megatron's default dropouts (0.1), local backend, written out from the preset:
    16 layers, h 2048, 32 heads of 64 in 8 groups (Q 2048 wide, K and V 512), SwiGLU 8192,
    vocabulary 128,256, sequence 4096."""
    L, h, a, d, q, kv, f, V, s, B = 16, 2048, 32, 64, 2048, 512, 8192, 128256, 4096, 2
    hs = s * h
    norm = 8 * hs + 4 * s + B * hs  # fp32 input and output, fp32 rstd, the bf16 output
    layer = (2 * norm
             + B * s * (q + 2 * kv) + B * s * q  # fused QKV output; the output projection's input
             + B * s * (q + kv) + 4 * s * d * B  # RoPE's new Q and K; its cos/sin tables
             + 2 * hs  # two 1-byte hidden-dropout masks
             + B * s * 5 * f)  # SwiGLU: fc1's 2f output, SiLU, product (fc2's input)
    scores = B * a * s * s + B * a * s * s + a * s * s  # probabilities, dropout output and mask
    # the kernel's fp32 log-sum-exp [b, heads, s]; its output is the output projection's input
    fused = 4 * a * s
    layer += scores if core == "unfused" else fused
    if core == "sdpa" and mask:
        # the batch's mask made additive in bf16, [b, 1, s, s]; K and V expanded to 32 heads
        # (repeat_interleave), which leave RoPE's K and the QKV output unreferenced
        layer += B * s * s + 2 * B * s * q - B * s * (q + 2 * kv) - B * s * kv
    total = L * layer + norm + 4 * s * V + 8 * s  # final norm, fp32 logits, token ids
    if core == "unfused":
        total += s * s  # the causal mask (bool), one for all layers
    return total


@pytest.mark.parametrize("core, mask", [("unfused", True), ("sdpa", False), ("sdpa", True)])
def test_activations_of_each_core_attention_by_hand(core, mask):
    lay = Layout(attention_dropout=True, hidden_dropout=True, core_attention=core,
                 attention_mask=mask)
    got = rank_estimate(spec_from_preset("dense_1b"), lay, 0)["activation_bytes_one_microbatch"]
    assert got == dense_1b_by_hand(core, mask)


def test_unfused_minus_sdpa_is_the_score_tensors():
    """What changes with the core attention is exactly its score tensors (the probabilities,
    their dropout output and 1-byte mask per layer, the shared causal mask), less what the fused
    kernel keeps instead (its fp32 log-sum-exp), for dense_1b at micro batch 1."""
    spec = spec_from_preset("dense_1b")

    def one(core):
        lay = Layout(attention_dropout=True, hidden_dropout=True, core_attention=core,
                     attention_mask=False)
        return rank_estimate(spec, lay, 0)["activation_bytes_one_microbatch"]

    a, s = 32, 4096
    scores = 16 * (2 * a * s * s + 2 * a * s * s + a * s * s) + s * s
    kept = 16 * 4 * a * s
    assert one("unfused") - one("sdpa") == scores - kept == 42_958_061_568  # 40.01 GiB


def _dry_json(capsys, tmp_path, *flags):
    from megatron_ext.training import dry_run
    from megatron_ext.training.presets import expand_argv

    out = tmp_path / "est.json"
    raw = ["--dry-run", "--preset", "dense_1b", "--dry-run-world-size", "1",
           "--micro-batch-size", "1", "--dry-run-json", str(out), *flags]
    rc = dry_run.main(expand_argv(raw), raw)
    text = capsys.readouterr()
    assert rc == 0, text.err[-2000:]
    return json.loads(out.read_text()), text.out


def test_dry_run_follows_ext_core_attention(capsys, tmp_path):
    """``--dry-run --transformer-impl local --ext-core-attention sdpa`` counts no scores (it
    used to: the local backend was taken for upstream's unfused attention), and the report says
    which core attention it assumed; ``auto`` on this CPU is the unfused one, as a run here
    builds it, and the line names the flag that chooses sdpa."""
    local = ["--transformer-impl", "local", "--no-create-attention-mask-in-dataloader"]
    data, out = _dry_json(capsys, tmp_path, *local, "--ext-core-attention", "sdpa")
    assert data["gpu_bytes"]["activations"] == dense_1b_by_hand("sdpa", mask=False)
    assert data["layout"]["core_attention"] == "sdpa"
    assert "core attention: sdpa (" in out and "--ext-core-attention sdpa)" in out
    data, out = _dry_json(capsys, tmp_path, *local)
    assert data["gpu_bytes"]["activations"] == dense_1b_by_hand("unfused", mask=False)
    assert data["layout"]["core_attention"] == "unfused"
    assert "--ext-core-attention auto on a machine without a GPU" in out
    assert "pass --ext-core-attention sdpa to estimate that run" in out
    data, out = _dry_json(capsys, tmp_path)  # Megatron's default backend, the cluster's
    assert data["layout"]["core_attention"] == "te"
    assert "core attention: Transformer Engine's fused attention" in out


def test_dry_run_on_a_gpu_without_te_takes_the_local_backend(monkeypatch):
    """On a GPU without Transformer Engine the training falls back to the local backend and
    ``auto`` builds sdpa (models/specs.py): the dry run assumes the same."""
    from megatron_ext.flags import flag_value
    from megatron_ext.models import specs
    from megatron_ext.planning.layout import core_attention_of
    from megatron_ext.training import dry_run

    monkeypatch.setattr(dry_run, "_cuda", lambda: True)
    monkeypatch.setattr(dry_run, "te_available", lambda: False)
    argv = dry_run.dry_run_argv(["--vocab-size", "512"], ["--vocab-size", "512"])
    assert flag_value(argv, "--transformer-impl") == "local"
    given = ["--vocab-size", "512", "--transformer-impl", "transformer_engine"]
    assert flag_value(dry_run.dry_run_argv(given, given), "--transformer-impl") == \
        "transformer_engine"
    monkeypatch.setattr(specs.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(specs, "te_available", lambda: False)
    assert core_attention_of("local", None) == "sdpa"
    assert core_attention_of("local", "unfused") == "unfused"
    assert "auto on this GPU without Transformer Engine" in dry_run.core_attention_line(
        "sdpa", ["--transformer-impl", "local"], True)


# ---------------------------------------------------------------------------------------------
# against built models (torchrun, gloo)

CPU = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "511",
       "--distributed-backend", "gloo", "--use-cpu-initialization",
       "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
       "--no-bias-swiglu-fusion", "--no-rope-fusion", "--eval-iters", "0",
       "--eval-interval", "100000", "--attention-dropout", "0", "--hidden-dropout", "0",
       "--train-iters", "1", "--micro-batch-size", "2", "--global-batch-size", "8"]

BUILT = {
    "stem_tp2_pp2_bf16": ["--preset", "stem_cpu", "--bf16", "--tensor-model-parallel-size", "2",
                          "--pipeline-model-parallel-size", "2"],
    "structmoe_tp2_dp2_distopt": ["--preset", "structmoe_cpu", "--structmoe-backend", "reference",
                                  "--tensor-model-parallel-size", "2",
                                  "--use-distributed-optimizer"],
    # D'_ff = 168 stored as 192: rank 1 of TP=2 holds 72 real columns and the 24 of padding.
    "structmoe_padded_tp2": ["--preset", "structmoe_cpu", "--structmoe-backend", "reference",
                             "--structmoe-ffn-pad-to", "64", "--tensor-model-parallel-size", "2"],
    "sigma_tp2sp_pp2_ep2": ["--preset", "sigma_cpu", "--tensor-model-parallel-size", "2",
                            "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                            "--expert-model-parallel-size", "2",
                            "--expert-tensor-parallel-size", "1"],
    # PyTorch's fused attention (models/sdpa_attention.py): with the batch's mask and GQA (K and
    # V expanded, the mask made additive per layer), and without a mask in bf16 (the GPU runs')
    "stem_sdpa_gqa_tp2sp_mask": ["--preset", "stem_cpu", "--ext-core-attention", "sdpa",
                                 "--group-query-attention", "--num-query-groups", "2",
                                 "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "stem_sdpa_bf16_nomask_tp2_pp2": ["--preset", "stem_cpu", "--bf16",
                                      "--ext-core-attention", "sdpa",
                                      "--no-create-attention-mask-in-dataloader",
                                      "--tensor-model-parallel-size", "2",
                                      "--pipeline-model-parallel-size", "2"],
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every ``BUILT`` model in one launch of 4 ranks (``tests/dist/multi_config.py`` running
    ``tests/dist/estimate_check.py``'s ``main`` for each, Megatron's state torn down between):
    ``{name: (its output folder, whether every rank finished it, its ranks' logs)}``."""
    return launch_built(tmp_path_factory.mktemp("estimate_built"), sorted(BUILT))


def launch_built(tmp, names):
    from multirank import MULTI_CONFIG, launch_ranks, plan_item_logs

    plan = [{"name": name, "module": "estimate_check",
             "argv": ["--estimate-out", str(tmp / name / "out"), *BUILT[name], *CPU],
             "log_dir": str(tmp / name / "ranks")} for name in names]
    plan_path = tmp / "plan.json"
    plan_path.write_text(json.dumps(plan, indent=1))
    status, launch_log = launch_ranks([MULTI_CONFIG, str(plan_path)], 4, timeout=900)
    result = {}
    for item in plan:
        logs, done = plan_item_logs(item, 4)
        result[item["name"]] = (tmp / item["name"] / "out", done,
                                "".join(logs)[-4000:] + launch_log[-2000:])
    return result


@pytest.mark.parametrize("name", sorted(BUILT))
@pytest.mark.multirank
def test_estimate_matches_the_built_model(name, built):
    out, done, log = built[name]
    assert done, log
    ranks = [json.load(open(p)) for p in sorted(glob.glob(str(out / "rank*.json")))]
    assert len(ranks) == 4
    for r in ranks:
        e = r["estimate"]
        assert r["params"] == e["params"], r
        assert r["expert_params"] == e["expert_params"], r
        assert r["weight_bytes"] == e["weight_bytes"], r
        assert r["grad_bytes"] == pytest.approx(e["grad_bytes"], rel=0.02), r  # bucket padding
        assert r["optimizer_bytes"] == pytest.approx(e["optimizer_bytes"], rel=0.02), r
        # activations: dense/STEM layers are itemised exactly, the routed families within 15%
        tolerance = 0.01 if name.startswith("stem") else 0.15
        assert r["saved_bytes"] == pytest.approx(e["activation_bytes_one_microbatch"],
                                                 rel=tolerance), r
    # The model's FLOPs: every rank's matmuls of the step, over the step's tokens. StructMoE's
    # router and A are replicated across TP (models compute them on every TP rank).
    measured = sum(r["step_flops"] for r in ranks) / ranks[0]["tokens_per_step"]
    expected = ranks[0]["estimate"]["train_flops_per_token"]
    if name.startswith("structmoe"):
        h, L, rk, layers = 64, 4, 4, 4
        expected += (2 - 1) * layers * 6 * (h * L + 1 * rk * h)
    if name == "structmoe_padded_tp2":
        # The estimate counts the model's D'_ff (168) in FLOPs; the GEMMs run the stored 192
        # columns: W1' and W2' (GELU: two matrices) and the selected expert's B (k = 1).
        expected += 4 * 6 * (192 - 168) * (2 * 64 + 1 * 4)
    if "_sdpa_" in name:  # the counter has no formula for PyTorch's CPU flash kernel
        measured += 4 * 12 * 64 * 64  # the core's 12 s h per layer, stem_cpu's 4 layers
    assert measured == pytest.approx(expected, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# the command line


def dry_run(*flags, check=True):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "pretrain.py"),
                           "--dry-run", *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_dry_run_command(tmp_path):
    out = tmp_path / "est.json"
    proc = dry_run("--preset", "stem_1b", "--dry-run-world-size", "8", "--micro-batch-size", "1",
                   "--use-distributed-optimizer", "--stem-table-placement", "cpu",
                   "--stem-table-sharding", "vocab", "--dry-run-json", str(out))
    assert "paper ROI denominator          2.829 GFLOPs" in proc.stdout
    assert "host  STEM tables (fp32)" in proc.stdout
    data = json.loads(out.read_text())
    by_hand = estimate(spec_from_preset("stem_1b"), Layout())
    assert data["total_params"] == by_hand.total_params
    assert data["train_flops_per_token"] == by_hand.train_flops_per_token
    assert data["layout"]["dp"] == 8 and data["layout"]["microbatches"] == 64
    rows = math.ceil(128256 / 8)
    assert data["host_bytes"]["stem_tables"] == 4 * rows * 8192 * 5
    # the tables are off the GPU: its weights are the dense part only
    assert data["gpu_bytes"]["weights"] == 2 * (by_hand.total_params - by_hand.stem_table_params)
    # nothing else was written, no process group was needed
    assert sorted(os.listdir(tmp_path)) == ["est.json"]


def test_dry_run_refusals():
    bad = dry_run("--preset", "dense_1b", "--dry-run-world-size", "8",
                  "--tensor-model-parallel-size", "3", check=False)
    assert bad.returncode == 2 and "megatron-ext: --dry-run:" in bad.stderr
    novocab = dry_run("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--seq-length", "64", "--max-position-embeddings", "64", check=False)
    assert novocab.returncode == 2 and "needs the vocabulary" in novocab.stderr


def test_dry_run_tiered_tables(tmp_path):
    """Tiered tables in the dry run: the rank's share of the 20% GPU tier (25,651 of 128,256
    rows, over 8 interleaved owners) on the GPU, its other rows on the host."""
    out = tmp_path / "est.json"
    dry_run("--preset", "stem_1b", "--dry-run-world-size", "8", "--micro-batch-size", "1",
            "--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
            "--stem-optimizer", "sparse", "--stem-gpu-tier", "20%", "--dry-run-json", str(out))
    data = json.loads(out.read_text())
    rows, hot = math.ceil(128256 / 8), math.ceil(25651 / 8)
    assert data["gpu_bytes"]["stem_tables"] == 4 * hot * 8192 * 5
    assert data["gpu_bytes"]["stem_adam_moments"] == 8 * hot * 8192 * 5
    assert data["host_bytes"]["stem_tables"] == 4 * (rows - hot) * 8192 * 5
    assert data["host_bytes"]["stem_adam_moments"] == 8 * (rows - hot) * 8192 * 5


# ---------------------------------------------------------------------------------------------
# the hybrid path (--hybrid-layer-pattern): blocks from the pattern, not --num-layers


@pytest.mark.parametrize("family, pattern, layout", [
    (family, pattern, layout) for family in ("gpt", "stem") for pattern, layout in [
        ("*-*-*-*-", dict()),
        ("*-*-|*-*-", dict(world_size=2, pp=2, global_batch=8)),
        ("*-*-*-*-", dict(world_size=4, tp=2, global_batch=8, distributed_optimizer=True))]
] + [("gpt", "*-|*-|*-|*-", dict(world_size=2, pp=2, global_batch=8, virtual_pp=2))])
def test_hybrid_pattern_of_pairs_is_the_gpt_model(family, pattern, layout):
    """``*-`` repeated n times: the n-layer GPT model's parameters, FLOPs and memory per rank
    (STEM's layers count MLP blocks: 1 and 3 are the pattern's 2nd and 4th '-'). Interleaved
    stages only for the dense model: the GPT path's estimate splits the layers into contiguous
    stages, the hybrid one puts segment k on stage k % pp, as upstream builds them."""
    stem = dict(stem_layers=(1, 3)) if family == "stem" else {}
    gpt = estimate(tiny(family=family, **stem), Layout(**layout))
    hybrid = estimate(tiny(family=family, hybrid_layer_pattern=pattern, **stem), Layout(**layout))
    for key in ("total_params", "stem_table_params", "active_params", "paper_active_params",
                "flops", "rank_params", "gpu_bytes", "host_bytes", "busiest_stage"):
        assert getattr(hybrid, key) == getattr(gpt, key), key
    assert hybrid.model.attention_layers == 4


def test_hybrid_pattern_counts_by_hand():
    """``*-*--``: two attention blocks and three MLP blocks, each with the norm before it."""
    s = tiny(num_layers=3, hybrid_layer_pattern="*-*--")
    assert s.attention_layers == 2
    attn = 64 * (64 + 2 * 32) + 64 * 64
    mlp = 3 * 64 * 192
    total = 512 * 64 * 2 + 2 * (attn + 64) + 3 * (mlp + 64) + 64
    est = estimate(s, Layout())
    assert est.total_params == total
    assert est.active_params == total - 512 * 64 + 64
    core = 12 * 32 * 64
    assert est.flops["attention_linear"] == 6 * 2 * attn
    assert est.flops["attention_core"] == 2 * core
    assert est.flops["mlp"] == 6 * 3 * mlp
    assert est.train_flops_per_token == 6 * (2 * attn + 3 * mlp) + 2 * core + 6 * 64 * 512
    # stages: '*-*' and '--' (an even split of the 6 symbols without '|'), then by segments
    even = estimate(tiny(num_layers=4, hybrid_layer_pattern="*-*---"),
                    Layout(world_size=2, pp=2, global_batch=8))
    split = rank_estimate(tiny(num_layers=4, hybrid_layer_pattern="*-*---"),
                          Layout(world_size=2, pp=2, global_batch=8), 1)["params"]
    assert split == 3 * (mlp + 64) + 64 + 512 * 64  # 3 MLP blocks, final norm, output layer
    assert even.total_params == 512 * 64 * 2 + 2 * (attn + 64) + 4 * (mlp + 64) + 64
    piped = rank_estimate(tiny(num_layers=3, hybrid_layer_pattern="*-|*--"),
                          Layout(world_size=2, pp=2, global_batch=8), 0)["params"]
    assert piped == 512 * 64 + (attn + 64) + (mlp + 64)
    # interleaved: segment k on stage k % pp (upstream's select_pipeline_segment)
    interleaved = rank_estimate(tiny(num_layers=6, hybrid_layer_pattern="*-|*-|*--|*--"),
                                Layout(world_size=2, pp=2, global_batch=8, virtual_pp=2), 0)
    assert interleaved["params"] == 512 * 64 + 2 * (attn + 64) + 3 * (mlp + 64)


def test_hybrid_pattern_refusals():
    with pytest.raises(ValueError, match=r"--hybrid-layer-pattern '\*M\*-': layers M"):
        tiny(num_layers=1, hybrid_layer_pattern="*M*-")
    with pytest.raises(ValueError, match="has 2 MLP blocks"):
        tiny(num_layers=4, hybrid_layer_pattern="*-*-")
    with pytest.raises(ValueError, match="its 5 layers are not divisible by pp2"):
        estimate(tiny(num_layers=3, hybrid_layer_pattern="*-*--"),
                 Layout(world_size=2, pp=2, global_batch=8))
    with pytest.raises(ValueError, match="3 '\\|'-separated segments are not divisible by pp2"):
        estimate(tiny(num_layers=3, hybrid_layer_pattern="*-|*-|-"),
                 Layout(world_size=2, pp=2, global_batch=8))


def test_hybrid_shape_from_flags():
    """The scaling harness's reading: Megatron derives --num-layers from the pattern."""
    argv = ["--num-layers", "5", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--swiglu", "--hybrid-layer-pattern", "*-*--"]
    s = ModelShape.from_flags(argv, 500)
    assert (s.num_layers, s.attention_layers, s.hybrid_layer_pattern) == (3, 2, "*-*--")
    assert ModelShape.from_flags(argv[2:], 500) == s  # no --num-layers needed
    with pytest.raises(ValueError, match="--hybrid-layer-pattern"):
        ModelShape.from_flags(argv[:-1] + ["*-M-"], 500)


def test_dry_run_on_the_hybrid_path(tmp_path):
    """``--dry-run`` with ``*-`` x 16 on the dense 1B preset (Megatron's --num-layers: 32): the
    16-layer GPT model's numbers, written out by hand from the preset; a Mamba pattern is
    refused naming the flag."""
    out = tmp_path / "est.json"
    proc = dry_run("--preset", "dense_1b", "--hybrid-layer-pattern", "*-" * 16,
                   "--dry-run-world-size", "8", "--micro-batch-size", "1",
                   "--dry-run-json", str(out))
    assert "16 attention blocks, 16 MLP blocks" in proc.stdout
    data = json.loads(out.read_text())
    fields = {k: v for k, v in data["layout"].items() if k in Layout.__dataclass_fields__}
    by_hand = estimate(spec_from_preset("dense_1b"), Layout(**fields))
    assert data["total_params"] == by_hand.total_params
    assert data["flops"] == by_hand.flops
    assert data["gpu_bytes"] == by_hand.gpu_bytes
    bad = dry_run("--preset", "dense_1b", "--hybrid-layer-pattern", "*M" * 16,
                  "--dry-run-world-size", "8", check=False)
    assert bad.returncode == 2 and "--hybrid-layer-pattern" in bad.stderr, bad.stderr[-2000:]
