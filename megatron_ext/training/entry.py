"""Entry point: ``torchrun ... launch/pretrain.py [Megatron flags] [megatron-ext flags]``."""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import signal
import sys
import traceback
from functools import partial
from typing import List

import megatron.training
from megatron.core.enums import ModelType
from megatron.training import get_tokenizer, pretrain
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args, parse_args

from megatron_ext.checkpoint_manifest import CheckpointError
from megatron_ext.compat import cpu, upstream_fixes
from megatron_ext.flags import flag_value, has_flag
from megatron_ext.models.family import FamilyRun
from megatron_ext.models.registry import family_of, load_plugins
from megatron_ext.models.specs import te_available, te_problem
from megatron_ext.training import adam_impl, cross_entropy, profiler, rope
from megatron_ext.training.arguments import (
    add_extension_args,
    check_family_args,
    drop_unavailable_fusions,
    parse_error_line,
    validate_extension_args,
)
from megatron_ext.training.datasets import train_valid_test_datasets_provider
from megatron_ext.training.dry_run import main as dry_run_main
from megatron_ext.training.forward_step import forward_step
from megatron_ext.training.model_provider import model_provider
from megatron_ext.training.preflight import (
    check_async_save,
    check_data_paths,
    check_fully_sharded,
    check_grouped_experts,
    check_layout,
    check_load_dir,
    check_required_flags,
    check_resume,
    check_save_dir,
    check_table_memory,
)
from megatron_ext.training.presets import expand_argv
from megatron_ext.training.refusal import launch_rank, refuse, say
from megatron_ext.training.session import TrainingSession
from megatron_ext_kernels.row_adam_cpu import RowKernelError


def _default_transformer_impl(argv):
    """Megatron defaults to Transformer Engine; fall back to the local backend without it. An
    installed TE that does not import is named (a warning; refused where the flags ask for it)
    instead of falling back as silently as for an absent one."""
    problem = te_problem()
    if has_flag(argv, "--transformer-impl"):
        if flag_value(argv, "--transformer-impl") == "transformer_engine" and problem:
            refuse(f"--transformer-impl transformer_engine: Transformer Engine is installed but "
                   f"does not import ({problem}); repair it, or pass --transformer-impl local")
        return argv
    if te_available():
        return argv
    if problem:
        say(f"warning: Transformer Engine is installed but does not import ({problem}): "
            "training on the local backend (--transformer-impl local silences this)")
    return argv + ["--transformer-impl", "local"]


def _parse_flags():
    """Megatron's parser on ``sys.argv``. An argparse error (an unknown flag, a bad value) is
    refused in one line with status 2, argparse's, instead of Megatron's ~740-line usage on
    every rank; ``--help`` prints as usual."""
    complaint = io.StringIO()
    try:
        with contextlib.redirect_stderr(complaint):
            args = parse_args(extra_args_provider=add_extension_args)
    except SystemExit as exc:
        if exc.code in (0, None):
            sys.stderr.write(complaint.getvalue())
            raise
        refuse(parse_error_line(complaint.getvalue()), status=2)
    sys.stderr.write(complaint.getvalue())
    return args


_DUMP = re.compile(r"^-+ arguments -+$.*?^-+ end of arguments -+$\n?", re.M | re.S)


def _validate_flags():
    """Megatron's parse, validation and global state for the flags; returns the arguments and
    what Megatron printed meanwhile (its ~890-line argument table), held back until the checks
    after it pass: a refused start ends with its one line, not with the table. An error of
    Megatron's validation (its assertions) is refused in one line naming the place."""
    printed = io.StringIO()
    try:
        # On the CPU backend --moe-grouped-gemm passes upstream's compute-capability check
        # (cpu.grouped_gemm_validation says why).
        with contextlib.redirect_stdout(printed), cpu.grouped_gemm_validation():
            args = parse_and_validate_args(extra_args_provider=add_extension_args)
    except (AssertionError, ValueError, RuntimeError) as exc:
        sys.stdout.write(_DUMP.sub("", printed.getvalue()))
        where = traceback.extract_tb(exc.__traceback__)[-1]
        text = " ".join(str(exc).split()) or (where.line or "an assertion")
        refuse(f"Megatron refused these flags: {text} "
               f"({os.path.relpath(where.filename, _SITE)}:{where.lineno})")
    return args, printed.getvalue()


# Where the megatron package lies: its checks are named as megatron/training/arguments.py:LINE.
_SITE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    megatron.training.__file__))))


def exit_with_launcher() -> None:
    """Ask Linux to end this process (SIGTERM) when the process that started it dies.

    torchrun starts its workers in sessions of their own, so a SIGKILL of the launcher (a job
    scheduler's hard stop, a ``kill -9``) left them training and saving checkpoints on their own.
    ``prctl(PR_SET_PDEATHSIG)`` ties each worker to its launcher; if the launcher died before
    that took effect, exit now. Elsewhere than Linux: nothing."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before prctl took effect
        raise SystemExit("megatron-ext: the launcher of this process is gone; exiting")


def set_device_connections(flags: List[str]) -> None:
    """``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless set: Megatron requires it for TP/CP (kernel
    ordering of TP communication) and its own launch scripts export it. Not with Megatron-FSDP
    among ``flags`` (a preset's expanded), which refuses 1 (it overlaps its all-gathers and
    reduce-scatters with compute on several queues) and only warns with TP/CP."""
    if not has_flag(flags, "--use-megatron-fsdp"):
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def main(argv=None) -> None:
    exit_with_launcher()

    cpu.install()
    upstream_fixes.install()
    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)

    try:
        raw_argv = list(sys.argv[1:])
        load_plugins(raw_argv)  # families of --ext-plugin modules, before the flags are parsed
        expanded = expand_argv(raw_argv)
    except ValueError as exc:
        refuse(str(exc))
    # Nothing before this point creates a CUDA context, where the driver reads the variable.
    set_device_connections(expanded)
    if "--dry-run" in expanded:
        # Numbers only: no process group, no model (megatron_ext/training/dry_run.py). Megatron's
        # default backend (Transformer Engine) is kept: the estimate is for the cluster's run.

        raise SystemExit(dry_run_main(expanded, raw_argv))
    expanded, cpu_added = cpu.default_flags(expanded)
    if cpu_added and launch_rank() == 0:
        print(f"megatron-ext: no CUDA: CPU backend defaults {' '.join(cpu_added)} "
              "(docs/cpu_backend.md; a flag given wins)", flush=True)
    sys.argv = [sys.argv[0]] + _default_transformer_impl(expanded)

    try:
        # The family's layout checks first (Sigma: experts vs EP, top-k vs experts, the schedule
        # vs the model): a message naming our flag rather than one of Megatron's assertions.
        parsed = _parse_flags()
        check_required_flags(parsed)
        check_family_args(parsed)
        check_layout(parsed)
    except ValueError as exc:
        refuse(str(exc))
    args, megatron_printed = _validate_flags()

    for line in drop_unavailable_fusions(args):
        if launch_rank() == 0:
            print(f"megatron-ext: {line}", flush=True)
    try:
        validate_extension_args(args, tokenizer_vocab_size=get_tokenizer().vocab_size)
        check_data_paths(args)
        # Before --save's directory is made.
        note = check_load_dir(args.load, args.save, args.ckpt_step,
                              args.ext_allow_fresh_start)
        if note and launch_rank() == 0:
            print(f"megatron-ext: {note}", flush=True)
        check_save_dir(args.save, launch_rank())
        check_async_save(args, cpu_backend=cpu.is_installed())
        check_fully_sharded(args, cpu_backend=cpu.is_installed())
        check_grouped_experts(args)
        adam_impl.check_args(args)
        if cross_entropy.check_args(args) == "fused" and launch_rank() == 0:
            print("megatron-ext: cross entropy: fused (--ext-cross-entropy fused; "
                  "megatron_ext_kernels/vocab_ce.py)", flush=True)
        if rope.check_args(args) == "fused" and launch_rank() == 0:
            print("megatron-ext: rope: fused (--ext-rope fused; megatron_ext_kernels/rope.py)",
                  flush=True)
        check_resume(args)  # the schedule and the optimizer's layout, one read of the state
        check_table_memory(args)  # before the model draws the tables' rows
    except ValueError as exc:
        refuse(str(exc))
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        refuse("launch/pretrain.py runs under torchrun (MASTER_ADDR/MASTER_PORT are not set): "
               "torchrun --nproc_per_node=N launch/pretrain.py <flags>, or "
               "launch/single_node.sh")
    family = family_of(args)
    family_cfg = family.config_from_args(args)

    try:
        profiler.install(args)
    except (ValueError, RuntimeError) as exc:
        refuse(str(exc))
    # This run's log hooks (the family's report, --ext-run-report's), its manifest writer and
    # the upstream functions replaced for them (training/upstream_seams.py), closed on every
    # way out of here.
    # The family's run (models/family.py FamilyRun: STEM's host worker and tables, Sigma's
    # layers) is the session's, closed with it.
    run = family.start_run(args, family_cfg) if family.start_run is not None else FamilyRun()
    session = TrainingSession(run, report_path=args.ext_run_report).open()
    try:
        cfg = pretrain_cfg_container_from_args(args)
        # The start-up checks passed: Megatron's argument table, held back, goes out now.
        sys.stdout.write(megatron_printed)
        sys.stdout.flush()
        try:
            pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
                     partial(forward_step, run=run, host_group=session.host_tokens),
                     model_provider=partial(model_provider, run=run,
                                            host_group=session.host_tokens))
        except CheckpointError as exc:
            refuse(str(exc))
        except RowKernelError as exc:
            # Raised on the rank whose table rows the kernel refused (on the tables' worker
            # thread, re-raised where the training thread waits for it); torchrun ends the other
            # ranks.
            refuse("the CPU row kernel refused a STEM table step or read (nothing was written): "
                   + " ".join([str(exc), *getattr(exc, "__notes__", [])]), scope="per_rank")
        except RuntimeError as exc:
            if "Connection closed by peer" not in str(exc):
                raise
            # gloo's error in a collective whose peer process ended (a rank that stopped with
            # its own line, or was killed): one line from rank 0 instead of a traceback per rank.
            refuse("another rank ended during training (its own message, or torchrun's "
                   "summary, says why); this rank stopped in a collective with it")
        session.manifests.wait()  # the last save's manifest
        run.after_training()
    finally:
        session.close()
