"""A launch that cannot start ends with one line, printed once, last (``training/refusal.py``):
an unknown flag, a parallel layout the ranks cannot hold, a resume whose learning-rate schedule
differs from the checkpoint's, STEM tables larger than the memory there is, an installed but
broken Transformer Engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from multirank import PRETRAIN, ROOT, TINY_GPT, launch_port
from rank_server import run_python
from tests_helpers import refusal

# --preset stem_cpu with the vocabulary and width of issue 49: its host tables (two STEM layers of
# 1,000,000 x 16,384 fp32 rows, with their Adam moments) need far more than this machine has.
HUGE_TABLES = ["--preset", "stem_cpu", "--mock-data", "--tokenizer-type", "NullTokenizer",
               "--vocab-size", "1000000", "--ffn-hidden-size", "16384", "--micro-batch-size", "2",
               "--train-iters", "3", "--eval-iters", "0", "--stem-table-placement", "cpu",
               "--stem-table-sharding", "vocab"]


def parse(extra, world_size=1):
    from megatron.training.arguments import parse_args

    from megatron_ext.training.arguments import add_extension_args

    argv, env = sys.argv, os.environ.get("WORLD_SIZE")
    sys.argv = ["pretrain.py", *TINY_GPT, *extra]
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        return parse_args(extra_args_provider=add_extension_args)
    finally:
        sys.argv = argv
        if env is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = env


# ---------------------------------------------------------------------------------------------
# printing: rank 0 prints, every rank exits


@pytest.mark.parametrize("rank,local,scope,torchrun,printed", [
    ("0", "0", "per_node", False, "megatron-ext: --x=1: wrong"),
    ("1", "1", "per_node", False, None),
    ("2", "0", "per_node", True, "megatron-ext: --x=1: wrong"),  # another node's local rank 0
    ("3", "1", "per_rank", False, "megatron-ext: --x=1: wrong"),
    # under torchrun past the wait for the printing rank (which would have ended this one)
    ("1", "1", "per_node", True, "megatron-ext: (rank 1) --x=1: wrong")])
def test_refuse_prints_on_one_rank_and_exits_on_all(monkeypatch, capsys, tmp_path, rank, local,
                                                    scope, torchrun, printed):
    from megatron_ext.training import refusal

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(refusal, "WAIT_S", 0.0)
    with pytest.raises(SystemExit) as exit_:
        refusal.refuse("--x=1: wrong", status=2, scope=scope)
    assert exit_.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (printed + "\n" if printed else "")
    # torchrun's failure summary shows the line as its root cause (its error-file format).
    if printed:
        assert json.loads(error_file.read_text())["message"] == printed
    else:
        assert not error_file.exists()


def test_argparse_errors_become_one_line_with_the_closest_flag():
    from megatron_ext.training.arguments import parse_error_line

    usage = "usage: pretrain.py [-h] [--num-layers NUM_LAYERS]\n" * 3
    line = parse_error_line(usage + "pretrain.py: error: unrecognized arguments: --stem-layer 2 "
                                    "--ffn-hiden-size=3 --zzz\n")
    assert line == ("unrecognized arguments: --stem-layer 2 --ffn-hiden-size=3 --zzz "
                    "(--stem-layer: did you mean --stem-layers?; --ffn-hiden-size: did you mean "
                    "--ffn-hidden-size?); launch/pretrain.py --help lists every flag")
    line = parse_error_line(usage + "pretrain.py: error: argument --num-layers: invalid int "
                                    "value: 'x'\n")
    assert line == ("argument --num-layers: invalid int value: 'x'; launch/pretrain.py --help "
                    "lists every flag")


def test_an_unknown_flag_is_one_line_not_the_usage():
    """Megatron's parser printed its ~740-line usage (on every rank) and then the error."""
    proc = run_python([PRETRAIN, *TINY_GPT, "--train-iters", "1", "--stem-layer", "2"], ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "usage:" not in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "megatron-ext: unrecognized arguments: --stem-layer 2 (did you mean --stem-layers?); "
        "launch/pretrain.py --help lists every flag")


@pytest.mark.multirank
def test_under_torchrun_the_line_is_printed_once_and_ends_torchruns_summary(tmp_path):
    """Two ranks under torchrun with an unknown flag: the line once (rank 0), and torchrun's own
    failure summary, which ends the screen, gives it as the root cause."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run(
        [torchrun, "--nproc_per_node=2", f"--master-port={launch_port()}", PRETRAIN, *TINY_GPT,
         "--train-iters", "1", "--stem-layer", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = "megatron-ext: unrecognized arguments: --stem-layer 2 (did you mean --stem-layers?)"
    assert proc.returncode != 0
    ours = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith(line)]
    assert len(ours) == 1, proc.stderr[-3000:]
    assert "usage:" not in proc.stderr
    summary = proc.stderr[proc.stderr.rindex("Root Cause (first observed failure):"):]
    assert f"traceback : {line}" in summary and "exitcode  : 2" in summary, summary


def test_megatrons_own_validation_is_one_line_naming_its_check():
    """An assertion of Megatron's validate_args was a traceback."""
    proc = run_python([PRETRAIN, *TINY_GPT, "--train-iters", "1", "--mla-down-proj-fusion"], ROOT)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "megatron-ext: Megatron refused these flags: --mla-down-proj-fusion requires "
        "--multi-latent-attention (megatron/training/arguments.py:"), last
    assert "------------------------ arguments" not in proc.stdout


# ---------------------------------------------------------------------------------------------
# the parallel layout


@pytest.mark.parametrize("world,extra,message", [
    (2, ["--expert-model-parallel-size", "3"],
     "2 ranks with --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
     "--context-parallel-size 1 --expert-model-parallel-size 3: EP x expert-TP = 3 x 1 does not "
     "divide the 2 ranks of a pipeline stage (TP x CP x DP = 1 x 1 x 2)"),
    (3, ["--tensor-model-parallel-size", "2"],
     "3 ranks with --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 "
     "--context-parallel-size 1 --expert-model-parallel-size 1: world size 3 is not divisible by "
     "TP x PP x CP = 2 x 1 x 1"),
])
def test_a_layout_the_ranks_cannot_hold_is_refused(world, extra, message):
    from megatron_ext.training.preflight import check_layout

    with pytest.raises(ValueError) as refused:
        check_layout(parse(extra, world_size=world))
    assert str(refused.value).startswith(message)
    check_layout(parse(["--expert-model-parallel-size", "2"], world_size=2))
    check_layout(parse(["--tensor-model-parallel-size", "2"], world_size=4))


def test_expert_parallelism_beyond_the_ranks_is_refused_at_start(monkeypatch):
    """``--expert-model-parallel-size 3`` on 2 ranks (6 experts, which 3 divides): Megatron's
    validation passed it and its process groups raised "world_size (2) is not divisible by
    expert_tensor_model_pipeline_parallel size (3)" on every rank."""
    from test_cli_errors import SIGMA

    flags = list(SIGMA)
    flags[flags.index("--num-experts") + 1] = "6"
    for name, value in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0").items():
        monkeypatch.setenv(name, value)
    proc = run_python([PRETRAIN, *TINY_GPT, *flags, "--expert-model-parallel-size", "3",
                       "--train-iters", "1"], ROOT)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "megatron-ext: 2 ranks with --tensor-model-parallel-size 1 --pipeline-model-parallel-size "
        "1 --context-parallel-size 1 --expert-model-parallel-size 3: EP x expert-TP = 3 x 1 "
        "does not divide"), proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# a resume with another learning-rate schedule


def schedule_args(extra):
    """Parsed flags with what Megatron's validation adds that the scheduler reads."""
    args = parse(["--lr-warmup-fraction", "0.1", *extra])
    args.lr_warmup_iters = 0  # TINY_GPT's --lr-warmup-iters 1 gives way to the fraction
    args.start_weight_decay = args.end_weight_decay = args.weight_decay
    return args


def scheduler_state(args) -> dict:
    """The state dict of the learning-rate scheduler ``args`` build (upstream's, as a save
    writes it), with ``args`` as Megatron's global arguments for the call."""
    from megatron.training import global_vars

    from megatron_ext.training.preflight import _schedule

    global_vars.set_args(args)
    try:
        return _schedule(args).state_dict()
    finally:
        global_vars.set_args(None)


@pytest.fixture
def saved_schedule(tmp_path, mcore_single_rank):
    """A torch_dist checkpoint at iteration 3 whose common state holds the scheduler state of
    TINY_GPT with ``--lr-warmup-fraction 0.1 --train-iters 3`` (upstream's scheduler, saved by
    upstream's dist_checkpointing as its save_checkpoint does)."""
    from megatron.core import dist_checkpointing

    args = schedule_args(["--train-iters", "3"])
    state = scheduler_state(args)
    folder = tmp_path / "ck" / "iter_0000003"
    folder.mkdir(parents=True)
    dist_checkpointing.save({"opt_param_scheduler": state, "iteration": 3}, str(folder))
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text("3")
    return str(tmp_path / "ck")


def test_the_resume_checks_read_the_checkpoint_once(saved_schedule, monkeypatch):
    """The schedule and the optimizer layout checks at start-up share one read of the
    checkpoint's common state (each read it before)."""
    from megatron.training import global_vars

    from megatron_ext.training import preflight

    reads = []
    read = preflight._saved_common_state
    monkeypatch.setattr(preflight, "_saved_common_state",
                        lambda args: reads.append(args.load) or read(args))
    args = schedule_args(["--load", saved_schedule, "--train-iters", "3",
                          "--use-distributed-optimizer"])
    global_vars.set_args(args)
    try:
        preflight.check_resume(args)
    finally:
        global_vars.set_args(None)
    assert reads == [saved_schedule]


@pytest.mark.parametrize("extra,refused", [
    (["--train-iters", "6"], "warmup iterations: 2.4 in the checkpoint, 4.8 with these flags"),
    # the decay's length kept, the weight-decay ramp still follows --train-iters
    (["--train-iters", "6", "--lr-decay-iters", "3"],
     "total number of weight decay iterations: 24 in the checkpoint, 48 with these flags"),
    (["--train-iters", "3"], None),
    (["--train-iters", "6", "--override-opt_param-scheduler"], None),
    (["--train-iters", "6", "--use-checkpoint-opt_param-scheduler"], None),
    (["--train-iters", "6", "--no-load-optim"], None),
])
def test_a_resume_with_another_schedule_is_refused_before_the_model_is_built(
        saved_schedule, extra, refused):
    """Megatron asserted on it after building the model, in OptimizerParamScheduler's
    load_state_dict, as a traceback."""
    from megatron_ext.training.preflight import check_schedule_resume

    args = schedule_args(["--load", saved_schedule, *extra])
    decay_iters = args.lr_decay_iters
    text = refusal(check_schedule_resume, args)
    assert args.lr_decay_iters == decay_iters  # upstream's scheduler ran on a copy
    if refused is None:
        assert text is None
        return
    assert text == (
        f"--load={saved_schedule}: the checkpoint's learning-rate schedule differs from these "
        f"flags': {refused} (in samples, iterations x --global-batch-size: --train-iters sets "
        "the decay and weight-decay lengths, --lr-warmup-fraction a share of the decay's); pass "
        "--override-opt_param-scheduler to go on with these flags' schedule, or "
        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")


# ---------------------------------------------------------------------------------------------
# memory for the STEM tables


def test_table_memory_is_the_estimates_per_rank_and_node(monkeypatch):
    """Each rank of this node by its pipeline stage, the dry run's arithmetic; the drawing's
    share where it is the larger (a GPU placement draws its rows in host memory)."""
    from megatron_ext.training.preflight import check_table_memory, table_memory_needs

    args = parse(["--model-family", "stem", "--stem-table-placement", "cpu",
                  "--stem-table-sharding", "vocab", "--stem-optimizer", "sparse"], world_size=2)
    # Set by the tokenizer; tables far larger than the drawing's two 32 MiB blocks.
    args.padded_vocab_size = 2 ** 20
    from megatron_ext.models.registry import family_config

    stem_layers = len(family_config(args).stem_layers(args.num_layers))
    rows, width = args.padded_vocab_size // 2, 128 * stem_layers  # vocab-sharded over DP 2
    (gpu, host), = table_memory_needs(args, cuda=False)
    assert gpu == {} and host["stem_tables"] == 4 * rows * width
    assert host["stem_adam_moments"] == 8 * rows * width
    need = sum(host.values())
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_table_memory(args, cuda=False, available=2 * need)
    with pytest.raises(SystemExit):  # the node's two ranks together
        check_table_memory(args, cuda=False, available=2 * need - 1)
    args.stem_table_placement = "gpu"  # on a GPU: the drawn rows pass through host memory
    (gpu, host), = table_memory_needs(args, cuda=True)
    assert gpu["stem_tables"] == 4 * rows * width
    assert host == {"stem_tables": 4 * rows * width, "stem_drawing_buffers": 2 * 32 << 20}
    with pytest.raises(SystemExit):
        check_table_memory(args, cuda=True, available=10 ** 12, gpu_free=sum(gpu.values()) - 1)


SPY = """import runpy, sys
import megatron_ext.stem.mlp as mlp

def draw_rows(*args, **kwargs):  # instead of allocating the rows: say so and stop
    open({mark!r}, "w").write("draw_rows ran")
    raise SystemExit(3)

mlp.draw_rows = draw_rows
sys.argv = [{pretrain!r}] + sys.argv[1:]
runpy.run_path({pretrain!r}, run_name="__main__")
"""


def test_tables_larger_than_memory_are_refused_before_any_row_is_drawn(tmp_path, monkeypatch):
    """Issue 49's command: ``draw_rows`` asked the allocator for 32.8 GB per table (a traceback),
    the host-room check of the table store coming later. Now the start-up check refuses it,
    with the bytes per rank and those available, and the rows are never drawn."""
    mark = tmp_path / "drawn"
    spy = tmp_path / "spy.py"
    spy.write_text(SPY.format(pretrain=PRETRAIN, mark=str(mark)))
    # A launch of one rank (torchrun's variables): without the check it builds the model.
    for name, value in dict(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(launch_port())).items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    proc = run_python([str(spy), *HUGE_TABLES], ROOT)
    assert not mark.exists(), proc.stderr[-2000:]
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron-ext: STEM tables need 488.3"), last  # 1 rank: every row
    assert "of host memory per rank at start-up (STEM tables (fp32) 122.0" in last
    assert "GiB is available (MemAvailable + SwapFree" in last
    assert "------------------------ arguments" not in proc.stdout
    assert time.monotonic() - start < 120  # imports, parsing and the check: nothing built


# ---------------------------------------------------------------------------------------------
# Transformer Engine installed but broken


@pytest.fixture
def broken_te(tmp_path, monkeypatch):
    """An installed ``transformer_engine`` whose import fails as an ABI mismatch does."""
    from megatron_ext.models import specs

    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('libtransformer_engine.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(specs, "HAVE_TE", True)  # as if upstream's TE layers had imported
    specs.te_problem.cache_clear()
    yield
    specs.te_problem.cache_clear()


BROKEN = ("ImportError: libtransformer_engine.so: undefined symbol: "
          "_ZN3c104cuda9SetDeviceEi")


@pytest.mark.skipif(__import__("importlib").util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed here")
def test_an_absent_transformer_engine_goes_unsaid(capsys):
    from megatron_ext.models import specs
    from megatron_ext.training.entry import _default_transformer_impl

    specs.te_problem.cache_clear()
    assert specs.te_problem() is None and not specs.te_available()
    assert _default_transformer_impl(["--x"]) == ["--x", "--transformer-impl", "local"]
    assert capsys.readouterr().err == ""


def test_a_broken_transformer_engine_is_named(broken_te, capsys, monkeypatch):
    from megatron_ext.models import specs
    from megatron_ext.training.entry import _default_transformer_impl

    assert specs.te_problem() == BROKEN and not specs.te_available()
    monkeypatch.setenv("RANK", "0")
    assert _default_transformer_impl(["--x"]) == ["--x", "--transformer-impl", "local"]
    assert capsys.readouterr().err == (
        f"megatron-ext: warning: Transformer Engine is installed but does not import ({BROKEN}): "
        "training on the local backend (--transformer-impl local silences this)\n")
    assert _default_transformer_impl(["--transformer-impl", "local"]) == [
        "--transformer-impl", "local"]
    with pytest.raises(SystemExit) as refused:
        _default_transformer_impl(["--transformer-impl", "transformer_engine"])
    assert refused.value.code == 1
    assert capsys.readouterr().err == (
        "megatron-ext: --transformer-impl transformer_engine: Transformer Engine is installed "
        f"but does not import ({BROKEN}); repair it, or pass --transformer-impl local\n")
