"""Fixes for megatron-core 0.19.x bugs that the plugin's supported setups hit.

Each fix is a function making the replacement of an upstream function from the original, and a
row of :data:`FIXES` (``compat/seam.py`` makes the assignment): ``install()`` (called by the
training entry point and the conversion tools) puts in place those whose bug exists here, and each
is covered by a test that fails without it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import logging
import sys
from typing import Callable, Dict, Optional, Sequence, Tuple

import megatron.core.datasets.utils as dutils
import torch
from megatron.core.optimizer import clip_grads, distrib_optimizer
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale
from megatron.training import get_args, training
from megatron.training.utils import common_utils as training_utils

from megatron_ext.compat import seam, sync_save
from megatron_ext.compat.seam import Seam

logger = logging.getLogger(__name__)


def _no_apex_or_te() -> bool:
    return not distrib_optimizer.HAVE_APEX_OR_TE


def _upstream_fallback(module, name: str, fallback) -> Callable[[], bool]:
    """Whether megatron-core chose its own stand-in ``fallback`` for ``module.name`` when it was
    imported (neither Apex nor Transformer Engine there): read once, before any replacement."""
    chosen = getattr(module, name) is fallback
    return lambda: chosen


def _state_dict_before_the_first_step(original):
    """Resume of ``--use-distributed-optimizer`` with torch's Adam (no Apex/TE), bug 1 of 3:
    ``DistributedOptimizer.state_dict`` reads the Adam step from the per-parameter states
    (``assert len(steps) == 1``). Before the first step, e.g. while the checkpoint loader builds
    the state dict to load into, torch's Adam has no state, so loading fails. We report step 0
    there (the loaded value replaces it) and leave the states as they were."""

    @functools.wraps(original)
    def state_dict(self):
        inner = self.optimizer
        if any("step" in st for st in inner.state.values()):
            return original(self)
        added = []
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p]["step"] = torch.tensor(0.0)
                added.append(p)
        try:
            return original(self)
        finally:
            for p in added:
                del inner.state[p]["step"]
                if not inner.state[p]:
                    del inner.state[p]

    return state_dict


def _load_state_dict_own_steps(original):
    """Bug 2 of 3: ``DistributedOptimizer.load_state_dict`` gives every parameter's state the
    *same* ``step`` tensor, then ``_set_main_param_and_optimizer_states`` copies the
    parameter-state part of the checkpoint into every state tensor, ``step`` included, which
    overwrites the step read from the param groups (it came back as 0, so Adam's bias correction
    restarted). torch's Adam also increments each state's step in place, so a shared tensor would
    advance once per parameter per iteration. After loading, each state gets its own tensor
    holding the step of the loaded param groups."""

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        steps = {g["step"] for g in state_dict["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            raise RuntimeError(f"distributed optimizer checkpoint holds Adam steps {steps}; "
                               "expected one value")
        step = float(steps.pop())
        for st in self.optimizer.state.values():
            if "step" in st:
                # On the device torch's load put it: the host for the foreach AdamW, the
                # parameter's device for the fused one (--ext-adam-impl), whose kernel reads it.
                st["step"] = torch.tensor(step, dtype=torch.float32, device=st["step"].device)
        return result

    return load_state_dict


class _StepsNotHeld(dict):
    """The loaded tensors of one parameter, any other state key read as None: not a tensor, which
    ``_set_main_param_and_optimizer_states`` leaves as it is."""

    def __missing__(self, key):
        return None


def _set_states_without_autograd(original):
    """Bug 3 of 3: with fp32 parameters the "main" parameter shard is a view of the model
    parameter, which requires grad; ``_set_main_param_and_optimizer_states`` copies the loaded
    values into it with autograd on and fails. The copy runs under ``torch.no_grad()``.
    With ``--dist-ckpt-optim-fully-reshardable`` it also failed (KeyError 'step'): it copies
    every tensor of torch's Adam state (``step`` among them) from the loaded tensors, and
    ``load_parameter_state_from_fully_reshardable`` passes no ``step`` (the step is read from
    the param groups, bug 2). A state key the loaded tensors lack is left as it is."""

    @functools.wraps(original)
    def set_main_param_and_optimizer_states(self, model_param, tensors, *args, **kwargs):
        with torch.no_grad():
            return original(self, model_param, _StepsNotHeld(tensors), *args, **kwargs)

    return set_main_param_and_optimizer_states


def _helpers_prebuilt() -> bool:
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False  # a source checkout: upstream's make works
    return True


def _no_compile(original):
    """The megatron-core wheel ships the compiled dataset helpers (``helpers_cpp``) but not the
    Makefile that ``compile_helpers`` runs, so ``pretrain`` exits ("Failed to compile the C++
    dataset helper functions") on any machine, GPU or CPU. Compile only when the prebuilt module
    does not import (``_helpers_prebuilt``)."""

    def compile_helpers():
        return None

    return compile_helpers


def _help_as_written(original):
    """``--help`` fails: megatron-core 0.19.2's help text of
    ``--moe-paged-stash-buffer-size-factor-cuda`` has a bare ``%``, which argparse's help
    formatter takes for a format directive ("unsupported format character ')'"), so the first
    command a user types prints no flag at all. A help string that cannot be expanded is printed
    as written."""

    @functools.wraps(original)
    def _expand_help(self, action):
        try:
            return original(self, action)
        except (ValueError, TypeError, KeyError):
            return self._get_help_string(action)

    return _expand_help


def _first_iteration_logged_as_any(original):
    """After a resume the console's loss of the second iteration is the mean of the first two:
    megatron-core 0.19.2's ``training_log`` keeps its accumulators on a process's first iteration
    (``should_reset = not is_first_iteration``, meant for a first iteration inside a logging
    interval), also when that iteration ends an interval, so the next interval adds to it.
    Tensorboard has the right values. A first iteration that ends a logging interval is logged
    as any other (its accumulators reset)."""

    @functools.wraps(original)
    def training_log(*args, **kwargs):
        if kwargs.get("is_first_iteration"):
            iteration = args[3] if len(args) > 3 else kwargs["iteration"]
            if iteration % get_args().log_interval == 0:
                kwargs["is_first_iteration"] = False
        return original(*args, **kwargs)

    return training_log


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


def _unset_eval_interval_counts_no_evaluation(original):
    """Training without ``--eval-interval`` fails once the model is built: megatron-core 0.19.2's
    ``ValidationConfig.eval_interval`` defaults to None ("evaluation will not run during
    training"), and the training loop honours that, but ``get_train_valid_test_num_samples``
    computes ``train_iters // eval_interval`` (TypeError on None) and, on a resume,
    ``build_train_valid_test_data_loaders`` ``iteration // eval_interval``. With no interval
    both count no evaluation during training; the evaluation of ``--eval-iters`` iterations at
    the end of training stays, as upstream's loop runs it."""

    @functools.wraps(original)
    def fixed(*args, **kwargs):
        with _unset_eval_interval_as_never():
            return original(*args, **kwargs)

    return fixed


def _l2_norm_without_host_reads(original):
    """Without Apex or Transformer Engine, megatron-core 0.19's gradient norm
    (``clip_grads.l2_norm_impl`` = ``utils.local_multi_tensor_l2_norm``) launches one norm per
    gradient tensor, then builds ``torch.tensor(list_of_device_scalars)``: a host read of every
    tensor's norm, each waiting on the device, then one more (``float(...)``) and a copy back.
    torch's multi-tensor norm (``torch._foreach_norm``) computes the same per-tensor norms in a
    few launches and the total stays on the device. Same contract as amp_C's
    ``multi_tensor_l2norm``: ``([total], None)``; per-tensor norms are not asked for by
    ``get_grad_norm_fp32`` and are refused."""

    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        if per_tensor:
            raise NotImplementedError("per-tensor norms: megatron-core's fallback has none")
        tensors = tensor_lists[0]
        norms = torch._foreach_norm(tensors, 2.0)
        total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
        return total.reshape(1), None

    return l2_norm


def _scale_in_few_launches(original):
    """Without Apex or Transformer Engine, megatron-core 0.19's ``multi_tensor_scale`` stand-in
    (``utils.local_multi_tensor_scale``: ``dst.copy_(src * scale)`` per tensor, two launches and
    a temporary each) scales the gradients when they are clipped and copies fp32 main parameters
    into bf16 model ones. torch's multi-tensor ops do it in a few launches; the values are the
    same bit for bit (a product by the same float, one rounding into ``dst``'s dtype)."""

    def scale(chunk_size, noop_flag, tensor_lists, scale):
        src, dst = tensor_lists[0], tensor_lists[1]
        if len(src) != len(dst):
            raise ValueError(f"multi_tensor_scale: {len(src)} sources for {len(dst)} targets")
        if all(s is d for s, d in zip(src, dst)):
            torch._foreach_mul_(dst, scale)
        elif scale == 1.0:
            torch._foreach_copy_(dst, src)
        else:
            torch._foreach_copy_(dst, torch._foreach_mul(src, scale))

    return scale


# Upstream's identifier of a parameter group on load (``param_group_identifier_keys``), less the
# one key that depends on the expert-parallel layout.
_LAYOUT_FREE_KEYS = tuple(k for k in megatron_optimizer.param_group_identifier_keys
                          if k != "is_expert_parallel")


def _group_identifier(group: dict) -> tuple:
    """Upstream's ``_filter_and_reorder_param_groups`` identifier (NeMo's ``pre_`` aliases, a
    missing key read as None) without ``is_expert_parallel``."""
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in _LAYOUT_FREE_KEYS)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu())))
    return a == b


def _pooled(parts: Sequence[dict], where: str = "") -> dict:
    """The common (non-tensor) state of the saved optimizers as one: their param groups pooled,
    every other value the same in each (ChainedOptimizer keeps its optimizers' steps equal)."""
    out = {}
    for key in dict.fromkeys(k for part in parts for k in part):
        values = [part[key] for part in parts if key in part]
        if key == "param_groups":
            out[key] = [group for groups in values for group in groups]
        elif all(isinstance(v, dict) for v in values):
            out[key] = _pooled(values, f"{where}{key}.")
        elif all(_same(values[0], v) for v in values[1:]):
            out[key] = values[0]
        else:
            raise RuntimeError(
                f"the checkpoint's {len(parts)} optimizers (expert parallelism) hold different "
                f"values of {where}{key}, which one optimizer keeps once: resume at the "
                "--expert-model-parallel-size it was saved with")
    return out


def _groups_holder(state: dict) -> Optional[dict]:
    """The dict holding ``param_groups`` in one optimizer's state: FP32Optimizer's own,
    Float16OptimizerWithFloat16Params's and DistributedOptimizer's ``optimizer``."""
    if "param_groups" in state:
        return state
    inner = state.get("optimizer")
    return inner if isinstance(inner, dict) and "param_groups" in inner else None


def _with_common(loaded: dict, common: dict) -> dict:
    """``loaded`` (one optimizer's loaded tensors, in this run's layout) with the saved common
    values it lacks."""
    for key, value in common.items():
        if key not in loaded:
            loaded[key] = value
        elif isinstance(loaded[key], dict) and isinstance(value, dict):
            _with_common(loaded[key], value)
    return loaded


def _current_layout(chain, state_dict: dict) -> Optional[dict]:
    """The state dict a ChainedOptimizer of this run's layout loads, built from one saved at
    another chain length; None where the layouts agree (upstream's own load then) or where the
    saved groups do not cover this run's (upstream's load names the missing group)."""
    n = len(chain.chained_optimizers)
    ints = sorted(k for k in state_dict if isinstance(k, int))
    rest = {k: v for k, v in state_dict.items() if not isinstance(k, int)}
    if n == 1 and ints:  # saved by a chain (EP > 1), loaded into one optimizer
        saved, loaded = [state_dict[k] for k in ints], [rest]
    elif n > 1 and rest and ints == list(range(n)):  # saved by one, loaded into a chain
        saved, loaded = [rest], [state_dict[k] for k in ints]
    else:
        return None
    common = _pooled(saved)
    pool = (_groups_holder(common) or {}).get("param_groups")
    if pool is None:
        return None
    parts = []
    for optimizer, part in zip(chain.chained_optimizers, loaded):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or not hasattr(inner, "param_groups"):
            return None
        groups = []
        for current in inner.param_groups:
            alike = [g for g in pool if _group_identifier(g) == _group_identifier(current)]
            if not alike:
                return None
            # A group of the same kind where there is one: equal but for that flag anyway.
            alike.sort(key=lambda g: g.get("is_expert_parallel") != current["is_expert_parallel"])
            group = {k: v for k, v in alike[0].items() if k != "params"}
            group["is_expert_parallel"] = current["is_expert_parallel"]
            groups.append(group)
        own = _groups_holder(part)  # this run's groups with their params' ids, if loaded
        own = own["param_groups"] if own and len(own["param_groups"]) == len(groups) else None
        merged = _with_common(part, copy.deepcopy(common))
        # Where the pooled groups came in with the common state (DistributedOptimizer's, all
        # common) or beside this run's: this run's groups, in its order, with its ids.
        _groups_holder(merged)["param_groups"] = [
            dict(group, **({"params": own[i]["params"]} if own and "params" in own[i] else {}))
            for i, group in enumerate(groups)]
        parts.append(merged)
    return parts[0] if n == 1 else dict(enumerate(parts))


def _load_across_expert_parallel_sizes(original):
    """A checkpoint saved at one expert-parallel size does not resume, optimizer state included,
    at another. With expert parallelism (more exactly: expert parameters reduced over their own
    group) Megatron builds a ChainedOptimizer of a dense and an expert optimizer, otherwise one
    optimizer; the tensors (Adam's moments, fp32 main parameters, the distributed optimizer's
    model-space formats) are saved under the model parameters' names and reshard, but the common
    state (the param groups, the step) is saved per optimizer, nested by the chain's index. Loaded
    at another chain length, upstream finds no group (``_filter_and_reorder_param_groups``: the
    groups key on ``is_expert_parallel``), the wrong number of entries or no ``optimizer`` key.
    The saved common state is pooled and mapped onto this run's optimizers: each of its param
    groups takes the saved group of the same identifier but ``is_expert_parallel``, and the step
    all saved optimizers shared."""

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        if isinstance(state_dict, dict):
            remapped = _current_layout(self, state_dict)
            if remapped is not None:
                state_dict = remapped
        return original(self, state_dict)

    return load_state_dict


_OPTIMIZER = distrib_optimizer.DistributedOptimizer
_WHY_ADAM = ("bug of megatron-core 0.19: a --use-distributed-optimizer resume with torch's Adam "
             "(no Apex/TE); upstream has no hook in its optimizer's state handling")

# Each fix: the rows it replaces (compat/seam.py), installed by ``install()`` and listed with the
# trainer's hooks in ``training/upstream_seams.py``. Each row's ``applies`` is the condition under
# which the bug exists; each fix is covered by a test that fails without it.
FIXES: Dict[str, Tuple[Seam, ...]] = {
    "distrib_optimizer_torch_adam_resume": (
        Seam(_OPTIMIZER, "state_dict", _state_dict_before_the_first_step, _WHY_ADAM,
             applies=_no_apex_or_te),
        Seam(_OPTIMIZER, "load_state_dict", _load_state_dict_own_steps, _WHY_ADAM,
             applies=_no_apex_or_te),
        Seam(_OPTIMIZER, "_set_main_param_and_optimizer_states", _set_states_without_autograd,
             _WHY_ADAM, applies=_no_apex_or_te),
    ),
    "optimizer_state_across_expert_parallel_sizes": (
        Seam(megatron_optimizer.ChainedOptimizer, "load_state_dict",
             _load_across_expert_parallel_sizes,
             "bug of megatron-core 0.19.2: the optimizer's common state is saved per optimizer of "
             "the chain, whose length depends on expert parallelism; load_checkpoint calls the "
             "optimizer's method, no hook"),
    ),
    "multi_tensor_fallbacks_on_the_device": (
        Seam(clip_grads, "l2_norm_impl", _l2_norm_without_host_reads,
             "performance bug of megatron-core 0.19's fallback without Apex/TE: a host read per "
             "gradient tensor in every gradient norm; get_grad_norm_fp32 reads the module "
             "global, no hook",
             applies=_upstream_fallback(clip_grads, "l2_norm_impl", local_multi_tensor_l2_norm)),
        Seam(training_utils, "multi_tensor_l2norm", _l2_norm_without_host_reads,
             "the same fallback in --log-params-norm's norm (calc_params_l2_norm: a host read "
             "per parameter tensor at every logged step); _compute_norm_2 reads the module "
             "global, no hook",
             applies=_upstream_fallback(training_utils, "multi_tensor_l2norm",
                                        local_multi_tensor_l2_norm)),
        Seam(clip_grads, "multi_tensor_scale_impl", _scale_in_few_launches,
             "performance bug of the same fallback: two launches per tensor when gradients are "
             "clipped; module global, no hook",
             applies=_upstream_fallback(clip_grads, "multi_tensor_scale_impl",
                                        local_multi_tensor_scale)),
        Seam(megatron_optimizer, "multi_tensor_scale_impl", _scale_in_few_launches,
             "the same fallback where main parameters are copied into model ones "
             "(_multi_tensor_copy_this_to_that); module global, no hook",
             applies=_upstream_fallback(megatron_optimizer, "multi_tensor_scale_impl",
                                        local_multi_tensor_scale)),
    ),
    "prebuilt_dataset_helpers": (
        Seam(dutils, "compile_helpers", _no_compile,
             "bug of the megatron-core wheel: no Makefile beside its prebuilt dataset helpers; "
             "no hook (initialize_megatron calls it)", applies=_helpers_prebuilt),
    ),
    "help_percent_signs": (
        Seam(argparse.HelpFormatter, "_expand_help", _help_as_written,
             "bug of megatron-core 0.19.2: a bare % in a flag's help; argparse has no hook for "
             "a help string it cannot expand"),
    ),
    "first_logged_loss_after_resume": (
        Seam(training, "training_log", _first_iteration_logged_as_any,
             "bug of megatron-core 0.19.2: a resumed run's first logged loss; train() calls it "
             "by its module name, no hook"),
    ),
    "unset_eval_interval": tuple(
        Seam(training, name, _unset_eval_interval_counts_no_evaluation,
             "bug of megatron-core 0.19.2: no --eval-interval is a TypeError; pretrain calls it "
             "by its module name, no hook")
        for name in ("get_train_valid_test_num_samples", "build_train_valid_test_data_loaders")),
    # A synchronous torch_dist save's write results in a queue of the process (compat/sync_save.py)
    "synchronous_save_results_in_process": sync_save.ROWS,
}
ROWS: Tuple[Seam, ...] = tuple(row for rows in FIXES.values() for row in rows)


def install(names: Optional[Sequence[str]] = None) -> list:
    """Install every applicable fix (or the ``names`` given) where it is not in place; returns the
    names installed now."""
    installed = []
    for name, rows in FIXES.items():
        if names is not None and name not in names:
            continue
        if seam.install(rows):
            installed.append(name)
            logger.info("megatron_ext: installed upstream fix %s", name)
    return installed
