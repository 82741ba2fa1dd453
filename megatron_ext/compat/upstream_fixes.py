"""Fixes for megatron-core 0.19.x bugs that the plugin's supported setups hit.

Each fix is installed by ``install()`` (called by the training entry point), checks the condition
under which the bug exists, and is covered by a test that fails without it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import sys

import megatron.core.datasets.utils as dutils
import torch
from megatron.core.optimizer import distrib_optimizer
from megatron.training import get_args, training

logger = logging.getLogger(__name__)

_INSTALLED = set()


def _fix_distrib_optimizer_torch_adam_resume() -> bool:
    """Resume of ``--use-distributed-optimizer`` with torch's Adam (no Apex/TE), two bugs.

    1. ``DistributedOptimizer.state_dict`` reads the Adam step from the per-parameter states
       (``assert len(steps) == 1``). Before the first step, e.g. while the checkpoint loader
       builds the state dict to load into, torch's Adam has no state, so loading fails. We report
       step 0 there (the loaded value replaces it) and leave the states as they were.
    2. ``DistributedOptimizer.load_state_dict`` gives every parameter's state the *same* ``step``
       tensor, then ``_set_main_param_and_optimizer_states`` copies the parameter-state part of
       the checkpoint into every state tensor, ``step`` included, which overwrites the step read
       from the param groups (it came back as 0, so Adam's bias correction restarted). torch's
       Adam also increments each state's step in place, so a shared tensor would advance once per
       parameter per iteration. After loading, each state gets its own tensor holding the step
       of the loaded param groups.
    3. With fp32 parameters the "main" parameter shard is a view of the model parameter, which
       requires grad; ``_set_main_param_and_optimizer_states`` copies the loaded values into it
       with autograd on and fails. The copy runs under ``torch.no_grad()``.
    """
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return False
    cls = distrib_optimizer.DistributedOptimizer
    original_state_dict = cls.state_dict
    original_load = cls.load_state_dict

    @functools.wraps(original_state_dict)
    def state_dict(self):
        inner = self.optimizer
        if any("step" in st for st in inner.state.values()):
            return original_state_dict(self)
        added = []
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p]["step"] = torch.tensor(0.0)
                added.append(p)
        try:
            return original_state_dict(self)
        finally:
            for p in added:
                del inner.state[p]["step"]
                if not inner.state[p]:
                    del inner.state[p]

    @functools.wraps(original_load)
    def load_state_dict(self, state_dict):
        result = original_load(self, state_dict)
        steps = {g["step"] for g in state_dict["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            raise RuntimeError(f"distributed optimizer checkpoint holds Adam steps {steps}; "
                               "expected one value")
        step = float(steps.pop())
        for st in self.optimizer.state.values():
            if "step" in st:
                st["step"] = torch.tensor(step, dtype=torch.float32)
        return result

    original_set = cls._set_main_param_and_optimizer_states

    @functools.wraps(original_set)
    def set_main_param_and_optimizer_states(self, *args, **kwargs):
        with torch.no_grad():
            return original_set(self, *args, **kwargs)

    cls.state_dict = state_dict
    cls.load_state_dict = load_state_dict
    cls._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
    return True


def _fix_prebuilt_dataset_helpers() -> bool:
    """The megatron-core wheel ships the compiled dataset helpers (``helpers_cpp``) but not the
    Makefile that ``compile_helpers`` runs, so ``pretrain`` exits ("Failed to compile the C++
    dataset helper functions") on any machine, GPU or CPU. Compile only when the prebuilt module
    does not import."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False  # a source checkout: upstream's make works
    dutils.compile_helpers = lambda: None
    return True


def _fix_help_percent_signs() -> bool:
    """``--help`` fails: megatron-core 0.19.2's help text of
    ``--moe-paged-stash-buffer-size-factor-cuda`` has a bare ``%``, which argparse's help
    formatter takes for a format directive ("unsupported format character ')'"), so the first
    command a user types prints no flag at all. Extends ``argparse.HelpFormatter._expand_help``:
    a help string that cannot be expanded is printed as written."""
    original = argparse.HelpFormatter._expand_help
    if getattr(original, "_megatron_ext_fixed", False):
        return False

    @functools.wraps(original)
    def _expand_help(self, action):
        try:
            return original(self, action)
        except (ValueError, TypeError, KeyError):
            return self._get_help_string(action)

    _expand_help._megatron_ext_fixed = True
    argparse.HelpFormatter._expand_help = _expand_help
    return True


def _fix_first_logged_loss_after_resume() -> bool:
    """After a resume the console's loss of the second iteration is the mean of the first two:
    megatron-core 0.19.2's ``training_log`` keeps its accumulators on a process's first iteration
    (``should_reset = not is_first_iteration``, meant for a first iteration inside a logging
    interval), also when that iteration ends an interval, so the next interval adds to it.
    Tensorboard has the right values. Extends ``megatron.training.training.training_log``: a first
    iteration that ends a logging interval is logged as any other (its accumulators reset)."""
    upstream = training.training_log
    if getattr(upstream, "_megatron_ext_first_iteration", False):
        return False

    @functools.wraps(upstream)
    def training_log(*args, **kwargs):
        if kwargs.get("is_first_iteration"):
            iteration = args[3] if len(args) > 3 else kwargs["iteration"]
            if iteration % get_args().log_interval == 0:
                kwargs["is_first_iteration"] = False
        return upstream(*args, **kwargs)

    training_log._megatron_ext_first_iteration = True
    training.training_log = training_log
    return True


@contextlib.contextmanager
def _unset_eval_interval_as_never():
    """While upstream's sample counts run: an unset ``--eval-interval`` read as an interval no
    run reaches (``n // sys.maxsize == 0`` for any iteration count), i.e. no evaluation point
    during training, which is what None means to megatron-core."""
    args = get_args()
    if args.eval_interval is not None:
        yield
        return
    args.eval_interval = sys.maxsize
    try:
        yield
    finally:
        args.eval_interval = None


def _fix_unset_eval_interval() -> bool:
    """Training without ``--eval-interval`` fails once the model is built: megatron-core 0.19.2's
    ``ValidationConfig.eval_interval`` defaults to None ("evaluation will not run during
    training"), and the training loop honours that, but ``get_train_valid_test_num_samples``
    computes ``train_iters // eval_interval`` (TypeError on None) and, on a resume,
    ``build_train_valid_test_data_loaders`` ``iteration // eval_interval``. Extends both: with no
    interval they count no evaluation during training; the evaluation of ``--eval-iters``
    iterations at the end of training stays, as upstream's loop runs it."""
    if getattr(training.build_train_valid_test_data_loaders, "_megatron_ext_eval_interval",
               False):
        return False
    for name in ("get_train_valid_test_num_samples", "build_train_valid_test_data_loaders"):
        upstream = getattr(training, name)

        def fixed(*args, _upstream=upstream, **kwargs):
            with _unset_eval_interval_as_never():
                return _upstream(*args, **kwargs)

        functools.update_wrapper(fixed, upstream)
        fixed._megatron_ext_eval_interval = True
        setattr(training, name, fixed)
    return True


FIXES = {
    "distrib_optimizer_torch_adam_resume": _fix_distrib_optimizer_torch_adam_resume,
    "prebuilt_dataset_helpers": _fix_prebuilt_dataset_helpers,
    "help_percent_signs": _fix_help_percent_signs,
    "first_logged_loss_after_resume": _fix_first_logged_loss_after_resume,
    "unset_eval_interval": _fix_unset_eval_interval,
}


def install() -> list:
    """Install every applicable fix once; returns the names installed now."""
    installed = []
    for name, fix in FIXES.items():
        if name in _INSTALLED:
            continue
        if fix():
            _INSTALLED.add(name)
            installed.append(name)
            logger.info("megatron_ext: installed upstream fix %s", name)
    return installed
