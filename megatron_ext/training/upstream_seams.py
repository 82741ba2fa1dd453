"""Every replacement the plugin makes in an upstream module, in one table (the CPU backend's own
patches aside: ``compat/cpu.py``'s ``PATCHES``, installed only without CUDA).

:data:`SEAMS` lists, in the order they are put in place, the fixes of upstream bugs
(``compat/upstream_fixes.py``) and the trainer's hooks; each row names the upstream attribute,
the function that makes its replacement and the upstream hook it stands in for, or why there is
none. The replacements themselves live beside what they do (``log_hooks``, ``family_hooks``,
``checkpoint_hooks``); none of those modules assigns anything. ``compat/seam.py`` makes and
undoes the assignments; ``docs/architecture.md`` shows the table.

:func:`install` is called by the training run (``TrainingSession.open``) and is idempotent;
:func:`restore` puts the originals back: the run's end (``TrainingSession.close``) restores the
trainer's :data:`HOOKS`, while the fixes of upstream bugs stay for the process, as
``upstream_fixes.install()`` (the entry point's first step, and the conversion tools') put them.
``training_log`` has two rows: the fix of its first logged loss wraps upstream's, and the run's
log hooks wrap the fix, so the hooks run first and upstream sees the fixed arguments (the order
of the rows is that order).

:data:`RESETS` is upstream state that upstream's teardown (``destroy_global_state``) leaves
behind and that a second training in the same process must not inherit
(``training/teardown.py`` calls :func:`forget_upstream_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Sequence, Tuple

import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing import gpt_checkpoint_interop
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.training import training

from megatron_ext.compat import seam, upstream_fixes
from megatron_ext.compat.seam import Seam
from megatron_ext.training import checkpoint_hooks, cross_entropy, family_hooks, log_hooks, rope


def _training_log(upstream, run):
    return log_hooks.wrap_training_log(upstream, run.log_hooks)


def _get_megatron_optimizer(upstream, run):
    return family_hooks.wrap_get_megatron_optimizer(upstream, run.family_run, run.model_chunks)


def _cross_entropy(upstream, run):
    return cross_entropy.wrap(upstream)


def _rope(upstream, run):
    return rope.wrap(upstream)


def _initialize_megatron(upstream, run):
    return checkpoint_hooks.wrap_initialize_megatron(upstream, run.save_lock)


def _save_checkpoint(upstream, run):
    return checkpoint_hooks.wrap_save_checkpoint(upstream, run.manifests)


# megatron-core 0.19's pretrain takes a model provider, a forward step and a datasets provider;
# the functions below are called by their module's name inside it, so a replacement of the
# module attribute is the only way in.
HOOKS: Tuple[Seam, ...] = (
    Seam(training, "training_log", _training_log,
         "no per-iteration callback in train() (post_training_step_callbacks is upstream's own "
         "list); the run's log hooks (family report, run report) before upstream's log",
         per_run=True),
    Seam(training, "get_megatron_optimizer", _get_megatron_optimizer,
         "no optimizer hook in setup_model_and_optimizer; the family run's wrap_optimizer "
         "chains its optimizer onto the one upstream builds", per_run=True),
    Seam(tensor_parallel, "vocab_parallel_cross_entropy", _cross_entropy,
         "LanguageModule.compute_language_model_loss calls it by its package's name; no option "
         "for another loss kernel without Transformer Engine; --ext-cross-entropy's choice",
         per_run=True),
    Seam(rope_utils, "_apply_rotary_pos_emb_bshd", _rope,
         "apply_rotary_pos_emb calls it by its module's name when apply_rope_fusion is off (as "
         "it must be without Transformer Engine); no option for another RoPE kernel; "
         "--ext-rope's choice", per_run=True),
    Seam(training, "initialize_megatron", _initialize_megatron,
         "no hook between initialization and the first write into --save; --save's lock",
         per_run=True),
    Seam(gpt_checkpoint_interop, "retarget_sharded_state_dict_to_gpt_checkpoint",
         checkpoint_hooks.wrap_retarget,
         "load_checkpoint imports it by name when a hybrid run loads a GPT checkpoint; no "
         "option for per-layer keys (families with heterogeneous layers)"),
    Seam(training, "save_checkpoint", _save_checkpoint,
         "no after-save hook; the checksum manifest of each persistent checkpoint, one line "
         "for a failed save", per_run=True),
    Seam(training, "load_checkpoint", checkpoint_hooks.wrap_load_checkpoint,
         "no before-load hook; the manifest check and the model's settings checks before "
         "upstream reads a tensor"),
)

SEAMS: Tuple[Seam, ...] = upstream_fixes.ROWS + HOOKS


def install(run) -> List[Seam]:
    """Every row of :data:`SEAMS` that applies, the per-run rows bound to ``run`` (its
    ``log_hooks`` and ``manifests``); rows in place are left. Returns the rows installed now."""
    return seam.install(SEAMS, run)


def restore(rows: Sequence[Seam] = SEAMS) -> List[Seam]:
    """The originals of ``rows`` (every row by default) back, last row first. Returns the rows
    restored."""
    return seam.restore(rows)


@dataclass(frozen=True)
class Reset:
    owner: Any
    names: Callable[[], Iterable[str]]
    what: str  # the attributes, as docs/architecture.md names them
    why: str


def _process_group_globals() -> List[str]:
    return [n for n, v in vars(parallel_state).items() if isinstance(v, dist.ProcessGroup)]


RESETS: Tuple[Reset, ...] = (
    Reset(MoEAuxLossAutoScaler, lambda: ["main_loss_backward_scale"],
          "MoEAuxLossAutoScaler.main_loss_backward_scale",
          "a class attribute set once by the first MoE training (set_loss_scale copies into it "
          "afterwards); upstream has no reset"),
    Reset(parallel_state, _process_group_globals,
          "parallel_state's ProcessGroup globals",
          "destroy_model_parallel leaves _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP and its gloo "
          "twin: destroyed groups could not be freed with their threads"),
)


def forget_upstream_state() -> None:
    for row in RESETS:
        for name in row.names():
            seam.reset(row.owner, name, None)
