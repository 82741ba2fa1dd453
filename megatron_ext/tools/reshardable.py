"""Re-save a distributed-optimizer checkpoint in Megatron's fully reshardable format, so that it
resumes at another TP / PP / EP / expert-TP size with Adam's moments and step.

    python -m megatron_ext.tools.reshardable --load A --save B [--ckpt-step N] \\
        [--device auto|cpu|gpu] [-- FLAGS...]

A ``--use-distributed-optimizer`` checkpoint saved in Megatron's default format
(``dp_reshardable``) holds the optimizer state in the layout of the optimizer's buffers, which
only a change of the data-parallel size leaves loadable (``training/preflight.py``,
``check_bucket_layout_resume``, refuses another layout at start-up and names this command).
Megatron re-saves a checkpoint in another format through its own conversion path
(``--ckpt-convert-format`` / ``--ckpt-convert-save``: ``setup_model_and_optimizer`` loads the
checkpoint, saves it and exits, no training step), and its save writes the model-space format
with ``--dist-ckpt-optim-fully-reshardable``. This tool runs that path where the checkpoint
loads: at the layout and world size it was saved with, read from the args in its common state.

The run's flags are rebuilt from those args (:func:`training_flags`): every flag whose saved
value differs from the parser's default, less the machine's and the run's own choices
(``SKIPPED``); ``-- FLAGS`` are added after them and win (e.g. a data path that moved). The ranks
run ``launch/pretrain.py`` under ``torchrun --standalone`` on this machine: on its GPUs if it has
as many as the checkpoint's world size, otherwise as CPU ranks over gloo (``docs/cpu_backend.md``).

``B`` is written through a temporary folder beside it and renamed into place once the save and
its checksum manifest are complete: ``B`` is absent or whole. It holds one iteration, the one
loaded, with the same weights, optimizer state, scheduler, iteration and consumed samples; the
args saved in it are the conversion run's, which :func:`check_saved_args` compares with ``A``'s
before ``B`` appears.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import io
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from megatron.core import dist_checkpointing
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.training.arguments import add_megatron_arguments, validate_args

from megatron_ext.checkpoint_manifest import (MANIFEST, CheckpointError, read_tracker,
                                              resolve_checkpoint_dir)
from megatron_ext.compat import cpu
from megatron_ext.models.registry import load_plugins
from megatron_ext.training.arguments import add_extension_args
from megatron_ext.training.preflight import RESHARDABLE_TOOL, optimizer_sharding
from megatron_ext.training.presets import expand_argv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(ROOT, "launch", "pretrain.py")

# What the conversion run does not take from the saved args, by reason (dest names).
SKIPPED_BY_REASON = {
    # this tool sets them: the checkpoint, its iteration, Megatron's conversion path
    "set here": ("load", "save", "ckpt_step", "ckpt_convert_format", "ckpt_convert_save",
                 "dist_ckpt_optim_fully_reshardable", "use_distributed_optimizer",
                 "exit_on_missing_checkpoint"),
    # everything is loaded: weights, optimizer, scheduler, RNG
    "load all": ("finetune", "no_load_optim", "no_load_rng", "use_checkpoint_args",
                 "use_checkpoint_opt_param_scheduler", "override_opt_param_scheduler",
                 "pretrained_checkpoint", "ext_allow_fresh_start"),
    # a single synchronous save of one folder, no other output of the run
    "no other output": ("save_interval", "async_save", "non_persistent_save_interval",
                        "non_persistent_ckpt_type", "non_persistent_global_ckpt_dir",
                        "non_persistent_local_ckpt_dir", "tensorboard_dir", "wandb_project",
                        "wandb_exp_name", "wandb_save_dir", "ext_run_report", "exit_interval",
                        "exit_duration_in_mins", "profile", "ext_profile", "ext_profile_dir"),
    # the machine's: the entry point chooses them for this machine (compat/cpu.py)
    "this machine's": ("distributed_backend", "use_cpu_initialization",
                       "gradient_accumulation_fusion", "masked_softmax_fusion",
                       "bias_swiglu_fusion", "apply_rope_fusion", "transformer_impl"),
    # presets only add flags: every value is given explicitly
    "explicit": ("preset", "sigma_preset"),
}
SKIPPED = frozenset(d for dests in SKIPPED_BY_REASON.values() for d in dests)

HYBRID_DERIVED = ("num_layers", "mtp_num_layers")

# Flags Megatron's validate_args (megatron-core 0.19.2) sets from other flags where not given.
DERIVED = ("encoder_num_layers", "encoder_seq_length", "start_weight_decay", "end_weight_decay",
           "eval_micro_batch_size", "eval_global_batch_size", "kv_channels", "ffn_hidden_size",
           "moe_ffn_hidden_size", "expert_tensor_parallel_size", "bias_gelu_fusion",
           "align_param_gather", "overlap_p2p_comm", "dataloader_type", "async_strategy",
           "tensor_parallel_num_weight_shards", "expert_tensor_parallel_num_weight_shards",
           "main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype",
           "megatron_fsdp_main_params_dtype", "mamba_inference_conv_states_dtype",
           "mamba_inference_ssm_states_dtype", "inference_cuda_graph_scope")

# torch dtypes of the saved args, back to the words of their flags.
_DTYPE_WORDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                torch.uint8: "fp8"}

# Saved args that another value of the conversion run may take without changing what is saved
# (compared by check_saved_args): the skipped ones, and what Megatron sets during a run.
_RUN_STATE = ("rank", "world_size", "iteration", "curr_iteration", "do_train", "do_valid",
              "do_test", "consumed_valid_samples", "ckpt_format", "use_dist_ckpt",
              # the args' copy is stale (0); the checkpoint keeps it beside them: COMMON
              "num_floating_point_operations_so_far")
# The training state beside the args, the same in B as in A.
COMMON = ("iteration", "num_floating_point_operations_so_far", "opt_param_scheduler",
          "checkpoint_version")


# What the load sets in the args from the checkpoint's (compared in B, not in the flags).
_LOADED = ("consumed_train_samples", "skipped_train_samples", "consumed_train_bins",
           "num_floating_point_operations_so_far")


class ReshardError(ValueError):
    """A conversion that cannot run or did not complete: one line for the user."""


# ---------------------------------------------------------------------------------------------
# the checkpoint


def saved_state(load: str, step: Optional[int]) -> Tuple[str, int, dict]:
    """The folder of ``load``'s iteration (``step``, else the tracker's), the iteration and its
    common state (args, content metadata), read without loading a tensor."""
    try:
        folder, iteration = resolve_checkpoint_dir(load, step)
    except CheckpointError as exc:
        raise ReshardError(f"--load={load}: {exc}") from None
    if iteration is None:
        raise ReshardError(f"--load={load}: a release checkpoint holds no optimizer state "
                           "(Megatron does not load one from it): resume from it at any layout")
    if not dist_checkpointing.check_is_distributed_checkpoint(folder):
        raise ReshardError(f"--load={load}: {folder} is not a torch_dist checkpoint (only "
                           "--ckpt-format torch_dist saves a distributed optimizer's state by "
                           "sharding type)")
    try:
        common = dist_checkpointing.load_common_state_dict(folder)
    except Exception as exc:  # noqa: BLE001 - the file's own words name what is wrong
        raise ReshardError(f"--load={load}: {folder}: its common state does not read: "
                           f"{' '.join(str(exc).split())}") from None
    if common.get("args") is None:
        raise ReshardError(f"--load={load}: {folder} holds no training args to rebuild the run "
                           "from")
    return folder, iteration, common


def layout(saved) -> str:
    """The saved model-parallel layout, as flags."""
    etp = getattr(saved, "expert_tensor_parallel_size", None)
    parts = [("--tensor-model-parallel-size", saved.tensor_model_parallel_size),
             ("--pipeline-model-parallel-size", saved.pipeline_model_parallel_size),
             ("--context-parallel-size", getattr(saved, "context_parallel_size", 1)),
             ("--expert-model-parallel-size", getattr(saved, "expert_model_parallel_size", 1))]
    if getattr(saved, "num_experts", None) and etp is not None:
        parts.append(("--expert-tensor-parallel-size", etp))
    return " ".join(f"{flag} {value}" for flag, value in parts)


def check_convertible(load: str, folder: str, common: dict) -> str:
    """The sharding type of the optimizer state to convert (Megatron's bucket layout), or the
    reason there is nothing to convert."""
    saved = common["args"]
    if not getattr(saved, "use_distributed_optimizer", False):
        raise ReshardError(f"--load={load}: {folder} was saved without "
                           "--use-distributed-optimizer: its optimizer state is in the model's "
                           "layout already and resumes at any layout as it is")
    if getattr(saved, "no_save_optim", False):
        raise ReshardError(f"--load={load}: {folder} holds no optimizer state (--no-save-optim): "
                           "it resumes at any layout as it is")
    kind = optimizer_sharding(common)
    if kind is None or kind in DistributedOptimizer.checkpoint_fully_reshardable_formats:
        raise ReshardError(f"--load={load}: {folder} holds its optimizer state in the "
                           f"{kind or 'model-space'} format already, which resumes at any "
                           "layout: resume from it as it is")
    return kind


# ---------------------------------------------------------------------------------------------
# the run's flags


def parser_for(saved) -> argparse.ArgumentParser:
    """Megatron's parser with ours, the families of the run's ``--ext-plugin`` modules included
    (the parser the run had)."""
    plugins = [a for m in (getattr(saved, "ext_plugin", None) or []) for a in ("--ext-plugin", m)]
    load_plugins(plugins)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    add_extension_args(parser)
    return parser


def _words(value, action) -> Optional[List[str]]:
    """``value`` as the words after ``action``'s flag; None where no words give it back."""
    if isinstance(value, torch.dtype):
        value = _DTYPE_WORDS.get(value)
    elif isinstance(value, enum.Enum):
        value = value.name
    if value is None or isinstance(value, (dict, set)):
        return None
    many = action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1)
    if isinstance(value, (list, tuple)):
        if not many:
            return None
        items = list(value)
    else:
        items = [value]
    words = []
    for item in items:
        if isinstance(item, bool) or item is None or not isinstance(item, (int, float, str)):
            return None
        words.append(repr(item) if isinstance(item, float) else str(item))
    return words


def saved_flags(saved, parser: argparse.ArgumentParser) -> Dict[str, List[str]]:
    """Each flag whose saved value in ``saved`` differs from the parser's default, as its words
    by dest, less ``SKIPPED``. A value no flag gives back (``None`` where the default is a word,
    set by Megatron) is left out: :func:`training_flags` compares what Megatron derives now."""
    defaults = vars(parser.parse_args([]))
    by_dest: Dict[str, List[str]] = {}
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest in SKIPPED or dest in by_dest \
                or dest == argparse.SUPPRESS or not hasattr(saved, dest):
            continue
        value, default = getattr(saved, dest), defaults.get(dest)
        if _same(value, default) or _same_words(value, default, action):
            continue
        flag = action.option_strings[0]
        kind = type(action).__name__
        if kind in ("_StoreTrueAction", "_StoreFalseAction", "_StoreConstAction"):
            if _same(value, action.const):  # else its opposite (--no-X of --X) may give it
                by_dest[dest] = [flag]
            continue
        if kind == "_AppendAction":
            words = [w for item in (value or []) for w in (_words(item, action) or [None])]
            if None not in words:
                by_dest[dest] = [w for word in words for w in (flag, word)]
            continue
        words = _words(value, action) if kind == "_StoreAction" else None
        if words is not None:
            by_dest[dest] = [flag, *words]
    return by_dest


def validated(parser: argparse.ArgumentParser, flags: Sequence[str], world: int):
    """``flags`` parsed and validated by Megatron's ``validate_args`` as a rank of ``world``
    would (its printing held back); a refusal of it as a :class:`ReshardError`."""
    argv = expand_argv(flags)  # the family's fixed flags where absent, as the entry adds them
    ns = parser.parse_args(argv)
    ns.rank, ns.world_size = 0, world
    ns._is_global_batch_size_explicitly_specified = ns.global_batch_size is not None
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), cpu.grouped_gemm_validation():
            validate_args(ns)
    except (AssertionError, ValueError, RuntimeError) as exc:
        raise ReshardError("Megatron refuses the flags rebuilt from the checkpoint's args: "
                           f"{' '.join(str(exc).split()) or 'an assertion'}; give the right "
                           "value after --") from None
    return ns


def training_flags(saved, extra: Sequence[str] = (),
                   parser: Optional[argparse.ArgumentParser] = None
                   ) -> Tuple[List[str], List[str]]:
    """The flags that rebuild the run whose args are ``saved``, ``extra`` last: those of
    :func:`saved_flags`, less each one Megatron derives (``DERIVED``) from the others to the
    saved value when it is not given (given, ``validate_args`` refuses some of them beside the
    flags they follow from: ``--start-weight-decay`` with a constant weight decay,
    ``--encoder-num-layers`` with ``--num-layers``). Returns them and the args whose rebuilt value
    still differs from the saved one (``dest: saved -> rebuilt``)."""
    parser = parser or parser_for(saved)
    by_dest = saved_flags(saved, parser)
    world = int(saved.world_size)
    # On the hybrid path the pattern gives the layer counts, which validate_args then refuses
    # beside it ("should not be set at the same time as hybrid_layer_pattern").
    derived = DERIVED + (HYBRID_DERIVED if getattr(saved, "hybrid_layer_pattern", None) else ())
    primary = [w for dest, words in by_dest.items() if dest not in derived for w in words]
    ns = validated(parser, [*primary, *extra], world)
    wanted = [w for dest, words in by_dest.items() if dest in derived
              and not _same(getattr(ns, dest, None), getattr(saved, dest)) for w in words]
    flags = [*primary, *wanted]
    if wanted:
        ns = validated(parser, [*flags, *extra], world)
    given = {a.split("=", 1)[0] for a in extra if a.startswith("--")}
    changed = {a.dest for a in parser._actions if given.intersection(a.option_strings)}
    differ = [f"{dest}: {value!r} -> {getattr(ns, dest, None)!r}"
              for dest, value in sorted(vars(saved).items())
              if dest not in SKIPPED and dest not in _RUN_STATE and dest not in _LOADED
              and dest not in changed
              and not dest.startswith("_") and hasattr(ns, dest)
              and not _same(getattr(ns, dest), value)
              and not _same_words(value, getattr(ns, dest), _store(dest, parser))]
    return flags + list(extra), differ


def _store(dest: str, parser: argparse.ArgumentParser):
    for action in parser._actions:
        if action.dest == dest and type(action).__name__ == "_StoreAction":
            return action
    return None


def _same_words(value, default, action) -> bool:
    """Whether a stored value gives the default's words (a dtype object and its word)."""
    if action is None or type(action).__name__ != "_StoreAction":
        return False
    words = _words(value, action)
    return words is not None and words == _words(default, action)


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    if isinstance(a, (list, tuple)) and len(a) == 1:  # nargs '+' given one word
        return a[0] == b
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - tensors and the like: not equal to a default
        return False


def check_saved_args(common: dict, written_common: dict) -> List[str]:
    """Where the common state ``written_common`` (the conversion run's, saved in ``B``) differs
    from ``common`` (``A``'s): the training state beside the args (``COMMON``) and the args, less
    what the run sets itself; each a ``name: A's -> B's`` line."""
    out = [f"{key}: {common.get(key)!r} -> {written_common.get(key)!r}" for key in COMMON
           if not _same(common.get(key), written_common.get(key))]
    saved, written = common["args"], written_common["args"]
    for dest, value in sorted(vars(saved).items()):
        if dest in SKIPPED or dest in _RUN_STATE or dest.startswith("_"):
            continue
        if not hasattr(written, dest):
            out.append(f"{dest}: {value!r} -> (absent)")
        elif not _same(getattr(written, dest), value):
            out.append(f"{dest}: {value!r} -> {getattr(written, dest)!r}")
    return out


# ---------------------------------------------------------------------------------------------
# the launch


def _say(line: str) -> None:
    print(f"reshardable: {line}", flush=True)


def _device(choice: str, world: int) -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "gpu" and gpus < world:
        raise ReshardError(f"--device gpu: the checkpoint was saved by {world} ranks and this "
                           f"machine has {gpus} GPUs; pass --device cpu (CPU ranks over gloo)")
    if choice == "auto":
        return "gpu" if gpus >= world else "cpu"
    return choice


def convert(load: str, save: str, step: Optional[int] = None, device: str = "auto",
            extra: Sequence[str] = (), timeout: Optional[float] = None) -> str:
    """Write ``save`` from ``load``'s iteration (``step``, else its latest) in the fully
    reshardable format; returns the folder written."""
    folder, iteration, common = saved_state(load, step)
    kind = check_convertible(load, folder, common)
    saved = common["args"]
    if os.path.exists(save) and (not os.path.isdir(save) or os.listdir(save)):
        raise ReshardError(f"--save={save}: exists and is not empty; name a new directory "
                           "(nothing is written into an existing one)")
    parent = os.path.dirname(os.path.abspath(save))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ReshardError(f"--save={save}: {parent} is not a writable directory")
    world = int(saved.world_size)
    _say(f"{folder}: iteration {iteration}, saved by {world} ranks at {layout(saved)} in "
         f"Megatron's bucket layout ({kind})")
    flags, differ = training_flags(saved, extra)
    if differ:
        raise ReshardError("the flags rebuilt from the checkpoint's args do not give its args "
                           f"back: {'; '.join(differ)}; give the checkpoint's value after --")
    where = _device(device, world)

    work = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(save))}.",
                            suffix=".reshardable", dir=parent)
    log_path = os.path.abspath(save) + ".reshardable.log"
    argv = [*flags, "--load", os.path.abspath(load), "--ckpt-step", str(iteration),
            "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable",
            "--ckpt-convert-format", "torch_dist", "--ckpt-convert-save", work]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", PRETRAIN, *argv]
    env = dict(os.environ)
    if where == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the entry point's CPU backend (compat/cpu.py)
    _say(f"loading it with {world} {'GPU' if where == 'gpu' else 'CPU'} ranks at that layout "
         f"and saving it with --dist-ckpt-optim-fully-reshardable (no training step); log: "
         f"{log_path}")
    try:
        with open(log_path, "w") as log:
            log.write(" ".join(shlex.quote(w) for w in cmd) + "\n")
            log.flush()
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  cwd=ROOT, timeout=timeout)
        written = os.path.join(work, "torch_dist")
        if proc.returncode != 0:
            raise ReshardError(f"the conversion run failed (status {proc.returncode}): "
                               f"{_last_line(log_path)} (log: {log_path})")
        if read_tracker(written) != str(iteration):
            raise ReshardError(f"the conversion run ended without saving iteration {iteration} "
                               f"(log: {log_path})")
        new_folder, _, new_common = saved_state(written, iteration)
        written_kind = optimizer_sharding(new_common)
        if written_kind != "fully_reshardable":
            raise ReshardError(f"the conversion run saved the {written_kind} format, not "
                               f"fully_reshardable (log: {log_path})")
        if not os.path.exists(os.path.join(new_folder, MANIFEST)):
            raise ReshardError(f"the conversion run wrote no checksum manifest (log: {log_path})")
        differ = check_saved_args(common, new_common)
        if differ:
            raise ReshardError("the conversion run's args differ from the checkpoint's: "
                               f"{'; '.join(differ)}; give the checkpoint's value after -- "
                               f"(log: {log_path})")
        os.rename(written, save)
    except subprocess.TimeoutExpired:
        raise ReshardError(f"the conversion run took over {timeout:.0f} s (log: {log_path})") \
            from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    os.unlink(log_path)
    _say(f"wrote {save} (iteration {iteration}, optimizer state fully_reshardable): resume with "
         f"--load {save} at any --tensor-model-parallel-size, --pipeline-model-parallel-size, "
         "--expert-model-parallel-size")
    return save


def _last_line(log_path: str) -> str:
    """The run's refusal (our ``megatron-ext:`` line), else its last non-empty line."""
    with open(log_path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    ours = [line for line in lines if line.startswith("megatron-ext: ")]
    return (ours or lines or ["no output"])[-1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(
        prog=RESHARDABLE_TOOL, description=__doc__.split("\n\n")[0],
        usage="%(prog)s --load A --save B [--ckpt-step N] [--device auto|cpu|gpu] [-- FLAGS...]",
        epilog="FLAGS after -- are added to the flags rebuilt from the checkpoint's args, and "
               "win (e.g. --data-path NEW, where the data moved).")
    p.add_argument("--load", required=True, help="the checkpoint directory (--save of its run)")
    p.add_argument("--save", required=True, help="a new directory for the converted checkpoint")
    p.add_argument("--ckpt-step", type=int, default=None,
                   help="the iteration to convert (default: the latest)")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto: this machine's GPUs if it has one per saved rank, else CPU ranks")
    args = p.parse_args(argv)
    try:
        convert(args.load, args.save, args.ckpt_step, args.device, extra)
    except ReshardError as exc:
        print(f"reshardable: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
