"""The scaling harness (``launch/scaling.py``) and the run report (``training/run_report.py``).

Unit tests (no torchrun): layout parsing and Megatron's layout rules (``planning/layout.py``, read
through the harness), the peak table, the throughput/FLOP/s/MFU arithmetic from a report, the
CSV, the error line of a failed log, the report's memory summary and atomic write.

One sweep on 2 CPU ranks (gloo, ``stem_cpu``, 1 + 3 iterations): DP=2 and TP=2 are trained (the
only two torchrun launches), EP=2 is refused before launching (the preset has no experts). The CSV's
numbers are checked against each other and against the run reports, the PNG is a PNG.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron_ext.planning.model_shape import ModelShape, training_flops_per_token
from tests_helpers import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "scaling.py")


sh = load_script("launch/scaling.py", "scaling_harness")


# ---------------------------------------------------------------------------------------------
# layouts


def test_parse_layout_sizes_and_defaults():
    lay = sh.parse_layout("tp2ep1pp1dp4")
    assert (lay.tp, lay.ep, lay.pp, lay.dp, lay.cp, lay.etp) == (2, 1, 1, 4, 1, None)
    assert lay.world_size == 8 and lay.expert_tp == 2 and lay.name == "tp2ep1pp1dp4"
    lay = sh.parse_layout("dp2etp1ep4tp2")  # any order; etp; missing pp and cp are 1
    assert (lay.tp, lay.ep, lay.pp, lay.dp, lay.cp, lay.etp) == (2, 4, 1, 2, 1, 1)
    assert lay.expert_tp == 1
    assert "--expert-tensor-parallel-size" in lay.flags()
    assert "--expert-tensor-parallel-size" not in sh.parse_layout("tp2dp1").flags()
    names = [lay.name for lay in sh.parse_layouts(" tp1ep1pp1dp2, tp2ep1pp1dp1 ,")]
    assert names == ["tp1ep1pp1dp2", "tp2ep1pp1dp1"]


@pytest.mark.parametrize("bad, words", [
    ("", "expected sizes"), ("tp", "expected sizes"), ("tpx2", "expected sizes"),
    ("tp2 dp1", "expected sizes"), ("tp2dp1x", "expected sizes"), ("mp2", "expected sizes"),
    ("tp0dp2", "must be >= 1"), ("tp1tp2", "given twice"),
])
def test_parse_layout_refuses(bad, words):
    with pytest.raises(ValueError, match=words):
        sh.parse_layout(bad)


def test_parse_layouts_refuses_duplicates_and_empty():
    with pytest.raises(ValueError, match="more than once"):
        sh.parse_layouts("tp1dp2,tp1dp2")
    with pytest.raises(ValueError, match="at least one"):
        sh.parse_layouts(" , ")


DENSE = sh.ModelShape(family="stem", num_layers=4, hidden=64, heads=4, ffn=192, vocab=512,
                      seq_length=64)
SIGMA = sh.ModelShape(family="sigma", num_layers=4, hidden=64, heads=4, query_groups=2, ffn=128,
                      experts=8, vocab=512, seq_length=64)
SIGMA_SP = sh.ModelShape(**{**SIGMA.__dict__, "sequence_parallel": True})


def _check(text, gpus=2, shape=DENSE, mbs=2, cpu=True):
    """The layout named ``text`` for micro batch ``mbs`` and the global batch 8."""
    layout = replace(sh.parse_layout(text), micro_batch=mbs, global_batch=8, check=False)
    sh.validate_layout(layout, shape, gpus=gpus, cpu=cpu)


@pytest.mark.parametrize("text, gpus, shape, words", [
    ("tp1ep1pp1dp4", 2, DENSE, r"1 x 1 x 1 x 4 = 4 ranks, but --gpus is 2"),
    ("tp2pp2dp1", 2, DENSE, "= 4 ranks"),
    ("tp1ep2pp1dp2", 2, DENSE, "ep2 needs a model with Megatron experts"),
    ("tp2ep2pp1dp1", 2, SIGMA, r"EP x expert-TP = 2 x 2 does not divide the 2 ranks.*add etp1"),
    ("tp1ep4pp1dp2", 2, SIGMA, "EP x expert-TP = 4 x 1 does not divide"),
    ("tp1ep3pp1dp6", 6, SIGMA, "--num-experts=8 is not divisible by ep3"),
    ("tp2ep1pp1dp1", 2, SIGMA, "sequence parallelism"),
    ("tp1pp3dp1", 3, DENSE, "--num-layers=4 is not divisible by pp3"),
    ("tp3dp1", 3, DENSE, "--num-attention-heads=4 is not divisible by tp3"),
    ("tp4dp1", 4, SIGMA_SP, "--num-query-groups=2 is not divisible by tp4"),
    ("tp1cp2dp1", 2, DENSE, "context parallelism needs a GPU"),
    ("tp1dp3", 3, DENSE, "--global-batch-size=8 is not divisible by micro batch 2 x dp3"),
])
def test_validate_layout_refuses(text, gpus, shape, words):
    with pytest.raises(ValueError, match=words):
        _check(text, gpus, shape)


def test_validate_layout_accepts():
    _check("tp1ep1pp1dp2")
    _check("tp2ep1pp1dp1")
    _check("tp1ep1pp2dp1")
    _check("tp1ep2pp1dp2", shape=SIGMA)
    _check("tp2ep2etp1pp1dp1", shape=SIGMA_SP)
    _check("tp2ep4pp2dp2cp2", gpus=16, shape=SIGMA_SP, mbs=1, cpu=False)


def test_model_shape_reads_preset_and_extra_flags():
    shape = sh.model_shape("sigma_cpu", ["--sequence-parallel", "--num-layers", "6"])
    assert (shape.family, shape.num_experts, shape.query_groups) == ("sigma", 8, 2)
    assert shape.num_layers == 6 and shape.sequence_parallel
    assert sh.model_shape("stem_cpu", []).num_experts is None
    assert sh.null_tokenizer_vocab("stem_cpu", None) == 511
    assert sh.null_tokenizer_vocab("stem_cpu", 1000) == 999


def test_cli_refuses_flags_the_harness_owns(capsys):
    with pytest.raises(SystemExit):
        sh.parse_args(["--preset", "stem_cpu", "--gpus", "2", "--layouts", "tp1dp2", "--",
                       "--tensor-model-parallel-size", "2"])
    assert "the harness sets these" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sh.parse_args(["--preset", "stem_cpu", "--gpus", "2", "--layouts", "tp1dp2",
                       "--warmup-iters", "0"])
    assert "includes start-up" in capsys.readouterr().err
    opts, extra = sh.parse_args(["--preset", "stem_cpu", "--gpus", "2", "--layouts",
                                 "tp1dp2", "--", "--seed", "7"])
    assert extra == ["--seed", "7"] and opts.layout_list[0].dp == 2


def test_torchrun_command_cpu():
    opts, extra = sh.parse_args(["--preset", "stem_cpu", "--gpus", "2", "--layouts", "tp2dp1",
                                 "--iters", "5", "--warmup-iters", "2", "--micro-batch-size",
                                 "2", "--", "--seed", "7"])
    cmd = sh.torchrun_command(opts.layout_list[0], opts, extra, "/r.json", cuda=False)
    text = " ".join(cmd)
    assert "--nproc_per_node=2" in cmd and "--train-iters 7" in text
    assert "--tensor-model-parallel-size 2" in text
    # gloo and the rest come from the entry point's CPU defaults (megatron_ext/compat/cpu.py).
    assert "--distributed-backend" not in text and "--use-cpu-initialization" not in text
    assert "--vocab-size 511" in text and "--ext-run-report /r.json" in text
    assert cmd[-2:] == ["--seed", "7"]  # the user's flags come last, so they win


# ---------------------------------------------------------------------------------------------
# numbers


@pytest.mark.parametrize("name, peak, label", [
    ("NVIDIA H100 80GB HBM3", 989.4, "H100 SXM"), ("NVIDIA H100 PCIe", 756.0, "H100 PCIe"),
    ("NVIDIA H200", 989.4, "H200"), ("NVIDIA A100-SXM4-80GB", 312.0, "A100"),
])
def test_gpu_peak_table(name, peak, label):
    value, source = sh.gpu_peak(name)
    assert value == peak and "bf16 dense" in source and label in source


def test_peak_unknown_gpu_and_given():
    value, source = sh.gpu_peak("NVIDIA GeForce RTX 4090")
    assert value is None and "--peak-tflops" in source
    assert sh.resolve_peak(123.0, True, "anything", 1) == (123.0, "--peak-tflops")
    with pytest.raises(ValueError, match="must be > 0"):
        sh.resolve_peak(0.0, False, "", 1)


def _report(times, tokens=512, flops=None, world=2):
    flops = [1.5e6] * len(times) if flops is None else flops
    return {
        "preset": "stem_cpu", "model_family": "stem",
        "layout": {"world_size": world, "micro_batch_size": 2, "global_batch_size": 8,
                   "num_microbatches": 2, "seq_length": 64},
        "device": {"type": "cpu", "name": "test cpu"},
        "iterations": [{"iteration": i + 1, "seconds": t, "tokens": tokens,
                        "train_flops_per_token": f, "startup": i == 0}
                       for i, (t, f) in enumerate(zip(times, flops))],
        "memory": {"peak_bytes": 3 << 29, "peak_metric": "ru_maxrss", "max_rss_bytes": 3 << 29},
    }


def test_metrics_arithmetic():
    m = sh.metrics_from_report(_report([5.0, 0.25, 0.5, 0.25]), 1, peak_tflops=0.01)
    assert m["measured_iters"] == 3 and m["measured_tokens"] == 1536
    assert m["measured_seconds"] == pytest.approx(1.0)
    assert m["tokens_per_s_per_gpu"] == pytest.approx(1536 / 1.0 / 2)
    assert m["tflops_per_s_per_gpu"] == pytest.approx(768 * 1.5e6 / 1e12)
    assert m["mfu"] == pytest.approx(m["tflops_per_s_per_gpu"] / 0.01)
    assert m["iter_time_ms"] == pytest.approx(250.0)  # the median, not the mean
    assert m["peak_mem_gib"] == pytest.approx(1.5) and m["peak_alloc_gib"] is None
    # more warm-up drops iterations; no peak: no MFU
    m2 = sh.metrics_from_report(_report([5.0, 0.25, 0.5, 0.25]), 3, peak_tflops=None)
    assert m2["measured_iters"] == 1 and m2["mfu"] is None
    assert m2["tokens_per_s_per_gpu"] == pytest.approx(512 / 0.25 / 2)


def test_metrics_startup_never_measured_and_flops_token_weighted():
    # warm-up 0 still leaves the start-up iteration out
    m = sh.metrics_from_report(_report([9.0, 1.0, 1.0]), 0, None)
    assert m["measured_iters"] == 2
    # Sigma: FLOPs per token change at the sparsification switch; the token-weighted mean
    # keeps tokens/s x FLOPs per token = FLOP/s
    r = _report([9.0, 1.0, 3.0], flops=[4e6, 4e6, 2e6])
    r["iterations"][2]["tokens"] = 1024
    m = sh.metrics_from_report(r, 1, None)
    assert m["train_flops_per_token"] == pytest.approx((512 * 4e6 + 1024 * 2e6) / 1536)
    assert m["tflops_per_s_per_gpu"] == pytest.approx((512 * 4e6 + 1024 * 2e6) / 4.0 / 2 / 1e12)
    # no estimate for this run (the report's flops_error): throughput only
    r = _report([9.0, 1.0], flops=[None, None])
    m = sh.metrics_from_report(r, 1, 0.01)
    assert m["tokens_per_s_per_gpu"] == pytest.approx(256.0)
    assert m["tflops_per_s_per_gpu"] is None and m["mfu"] is None
    with pytest.raises(ValueError, match="nothing left to measure"):
        sh.metrics_from_report(_report([9.0, 1.0]), 2, None)


def test_csv_columns_and_formatting(tmp_path):
    rows = [dict(layout="tp1dp2", tp=1, status="ok", tokens_per_s_per_gpu=1234.56789012,
                 mfu=None),
            dict(layout="tp1ep2dp2", status="refused", error="no experts, sorry")]
    path = str(tmp_path / "s.csv")
    sh.write_csv(rows, path)
    with open(path) as f:
        reader = csv.DictReader(f)
        got = list(reader)
    assert reader.fieldnames == sh.COLUMNS
    assert got[0]["tokens_per_s_per_gpu"] == "1234.57" and got[0]["mfu"] == ""
    assert got[1]["error"] == "no experts, sorry" and got[1]["tp"] == ""
    assert os.listdir(tmp_path) == ["s.csv"]  # no temp file left behind


def test_plot_with_refused_rows_and_missing_numbers(tmp_path):
    rows = [dict(layout="tp1ep2dp2", status="refused"),
            dict(layout="tp1dp2", status="ok", tokens_per_s_per_gpu=100.0, mfu=None,
                 peak_mem_gib=0.5, peak_mem_metric="ru_maxrss"),
            dict(layout="tp2dp1", status="failed")]
    path = str(tmp_path / "p.png")
    sh.plot(rows, path, "title", unit="rank")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path) == ["p.png"]


def test_last_error_line_prefers_the_primary_error():
    log = "\n".join([
        "cmd ...", " iteration 1/ 4 | lm loss: 6.2",
        "[rank0]: Traceback (most recent call last):",
        "[rank0]:   File \"x.py\", line 3, in f",
        "[rank0]: AssertionError: num_experts must be non None to use expert model parallelism",
        "[rank1]: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "  error_file: <N/A>",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
    ])
    assert sh.last_error_line(log) == ("AssertionError: num_experts must be non None to use "
                                       "expert model parallelism")
    assert sh.last_error_line("megatron-ext: --stem-ratio=2/7: not one of ...\n") \
        .startswith("megatron-ext: --stem-ratio")
    assert sh.last_error_line("just\nsome output\n") == "some output"


# ---------------------------------------------------------------------------------------------
# run report pieces


def test_memory_summary_cpu_and_gpu():
    from megatron_ext.training.run_report import max_rss_bytes, memory_summary

    cpu = memory_summary([[-1, -1, 100], [-1, -1, 300]])
    assert cpu["kind"] == "cpu" and cpu["peak_bytes"] == 300 and cpu["peak_metric"] == "ru_maxrss"
    assert [r["rank"] for r in cpu["per_rank"]] == [0, 1]
    assert "max_allocated_bytes" not in cpu["per_rank"][0]
    gpu = memory_summary([[10, 20, 5], [30, 25, 7]])
    assert gpu["max_allocated_bytes"] == 30 and gpu["max_reserved_bytes"] == 25
    assert gpu["peak_bytes"] == 25 and gpu["peak_metric"] == "max_memory_reserved"
    assert gpu["per_rank"][1] == {"rank": 1, "max_rss_bytes": 7, "max_allocated_bytes": 30,
                                  "max_reserved_bytes": 25}
    assert max_rss_bytes() > 1 << 20  # a Python process with torch holds more than a MiB


def test_write_json_atomic(tmp_path):
    from megatron_ext.training.run_report import write_json_atomic

    path = str(tmp_path / "sub" / "r.json")
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2})
    with open(path) as f:
        assert json.load(f) == {"a": 2}
    assert os.listdir(tmp_path / "sub") == ["r.json"]


# ---------------------------------------------------------------------------------------------
# one sweep on 2 CPU ranks


OK_LAYOUTS = ["tp1ep1pp1dp2", "tp2ep1pp1dp1"]
REFUSED = "tp1ep2pp1dp2"
WARMUP, ITERS = 1, 3


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    pytest.importorskip("megatron_ext.planning.estimate")
    out = str(tmp_path_factory.mktemp("scaling") / "out")
    cmd = [sys.executable, SCRIPT, "--preset", "stem_cpu", "--gpus", "2",
           "--layouts", ",".join(OK_LAYOUTS + [REFUSED]), "--iters", str(ITERS),
           "--warmup-iters", str(WARMUP), "--micro-batch-size", "2", "--out", out,
           "--timeout", "600"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)  # the harness picks cores / ranks
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(os.path.join(out, "scaling.csv")) as f:
        reader = csv.DictReader(f)
        rows = {r["layout"]: r for r in reader}
        header = reader.fieldnames
    reports = {}
    for name in OK_LAYOUTS:
        with open(os.path.join(out, name, "report.json")) as f:
            reports[name] = json.load(f)
    return out, proc.stderr, header, rows, reports


@pytest.mark.multirank
def test_sweep_csv_rows_and_refusal(sweep):
    out, stderr, header, rows, _ = sweep
    assert header == sh.COLUMNS
    assert list(rows) == OK_LAYOUTS + [REFUSED]
    assert rows[REFUSED]["status"] == "refused"
    assert "needs a model with Megatron experts" in rows[REFUSED]["error"]
    assert not os.path.exists(os.path.join(out, REFUSED))  # refused before launching
    assert f"refused {REFUSED}" in stderr
    for name in OK_LAYOUTS:
        assert rows[name]["status"] == "ok", rows[name]
        assert f"{name}: ok" in stderr
        assert os.path.getsize(os.path.join(out, name, "log.txt")) > 0
    assert rows["tp2ep1pp1dp1"]["tp"] == "2" and rows["tp1ep1pp1dp2"]["dp"] == "2"


@pytest.mark.multirank
def test_sweep_numbers_consistent(sweep):
    _, _, _, rows, _ = sweep
    for name in OK_LAYOUTS:
        r = rows[name]
        num = {k: float(r[k]) for k in ("tokens_per_s_per_gpu", "tflops_per_s_per_gpu", "mfu",
                                        "peak_tflops", "peak_mem_gib", "iter_time_ms",
                                        "train_flops_per_token", "measured_seconds")}
        assert all(v > 0 for v in num.values()), r
        assert num["tflops_per_s_per_gpu"] == pytest.approx(
            num["tokens_per_s_per_gpu"] * num["train_flops_per_token"] / 1e12, rel=1e-4)
        assert num["mfu"] == pytest.approx(num["tflops_per_s_per_gpu"] / num["peak_tflops"],
                                           rel=1e-4)
        assert r["peak_source"].startswith("measured fp32 GEMM")
        assert r["measured_iters"] == str(ITERS) and r["measured_tokens"] == str(ITERS * 8 * 64)
        assert r["peak_mem_metric"] == "ru_maxrss" and r["peak_alloc_gib"] == ""


@pytest.mark.multirank
def test_sweep_matches_run_reports(sweep):
    _, _, _, rows, reports = sweep
    for name, lay in zip(OK_LAYOUTS, (dict(tp=1, dp=2), dict(tp=2, dp=1))):
        rep, row = reports[name], rows[name]
        assert rep["complete"] and rep["finished_by"] == "last_iteration"
        assert rep["preset"] == "stem_cpu" and rep["model_family"] == "stem"
        assert {k: rep["layout"][k] for k in ("tp", "dp", "pp", "ep", "world_size")} == \
            dict(lay, pp=1, ep=1, world_size=2)
        assert rep["layout"]["num_microbatches"] == 8 // (2 * lay["dp"])
        its = rep["iterations"]
        assert [it["iteration"] for it in its] == list(range(1, WARMUP + ITERS + 1))
        assert its[0]["startup"] and not any(it["startup"] for it in its[1:])
        assert all(it["tokens"] == 8 * 64 and it["seconds"] > 0 for it in its)
        measured = its[WARMUP:]
        tok_s_gpu = sum(it["tokens"] for it in measured) / sum(it["seconds"] for it in measured) / 2
        assert float(row["tokens_per_s_per_gpu"]) == pytest.approx(tok_s_gpu, rel=1e-4)
        assert float(row["iter_time_ms"]) == pytest.approx(
            1e3 * statistics.median(it["seconds"] for it in measured), rel=1e-4)
        assert float(row["train_flops_per_token"]) == pytest.approx(rep["train_flops_per_token"],
                                                                    rel=1e-5)
        mem = rep["memory"]
        assert mem["ranks_reported"] == 2 and mem["all_ranks"]
        assert [r["rank"] for r in mem["per_rank"]] == [0, 1]
        assert all(r["max_rss_bytes"] > 1 << 20 for r in mem["per_rank"])
        assert mem["peak_bytes"] == max(r["max_rss_bytes"] for r in mem["per_rank"])
        assert float(row["peak_mem_gib"]) == pytest.approx(mem["peak_bytes"] / 2 ** 30, rel=1e-4)
        assert rep["device"]["type"] == "cpu" and rep["device"]["threads_per_rank"] >= 1


@pytest.mark.multirank
def test_sweep_flops_from_the_estimate(sweep):
    """The report's FLOPs per token are the dry-run estimate's for the same model."""
    _, _, _, _, reports = sweep
    spec = ModelShape(family="stem", num_layers=4, hidden=64, ffn=192, heads=4, query_groups=4,
                      head_dim=16, vocab=512, seq_length=64, gated=True, untied=True, rope=True,
                      stem_layers=(1, 3))
    expected = training_flops_per_token(spec).total
    for name in OK_LAYOUTS:
        assert reports[name]["train_flops_per_token"] == pytest.approx(expected)


@pytest.mark.multirank
def test_sweep_png_and_summary(sweep):
    out = sweep[0]
    png = os.path.join(out, "scaling.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(png) as img:
        img.verify()
    with Image.open(png) as img:
        assert img.size[0] > 600 and img.size[1] > 400
    with open(os.path.join(out, "scaling.json")) as f:
        summary = json.load(f)
    assert summary["gpus"] == 2 and summary["peak_tflops"] > 0
    assert [r["status"] for r in summary["rows"]] == ["ok", "ok", "refused"]
