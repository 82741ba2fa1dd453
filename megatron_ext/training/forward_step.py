"""Forward step and loss for ``megatron.training.pretrain`` (same contract as upstream's GPT)."""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
from megatron.core.utils import get_attr_wrapped_model
from megatron.training import get_args, get_timers

from megatron_ext.models.family import FamilyRun
from megatron_ext.models.token_ids import wrapped_attr
from megatron_ext.training.batch import HostTokenGroup, get_batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses, the token count, and the report Megatron averages across DP."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model, *, run: FamilyRun,
                 host_group: Optional[HostTokenGroup] = None):
    """One micro-batch of ``model`` (a chunk) for ``pretrain``; ``run``: the family's run of
    this training, ``host_group``: its gloo copy of the tensor-parallel group (the trainer binds
    both, ``functools.partial(forward_step, run=..., host_group=...)``)."""
    args = get_args()
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    token_layers_here = bool(wrapped_attr(model, "needs_token_ids", False))

    def read_batch():
        """The five tensors and the tokens' host copy (or None), the ids checked on the host
        where there is one: the model's forward then need not read them back from the GPU,
        which would wait for every kernel queued before (the previous micro-batch's backward)."""
        batch = get_batch(data_iterator, args, vp_stage, token_layers_here, host_tokens=True,
                          host_group=host_group)
        if token_layers_here and batch[0] is not None and batch[5] is not None:
            get_attr_wrapped_model(model, "check_host_token_ids")(batch[5])
        return batch

    # The family's run: STEM's managed tables fetch the rows (and read ahead), others read.
    batch, model_kwargs = run.take_batch(model, read_batch)
    if token_layers_here:  # the ids were checked on their host copy (read_batch)
        model_kwargs["token_ids_checked"] = batch[0] is not None and batch[5] is not None
    tokens, labels, loss_mask, attention_mask, position_ids = batch[:5]
    timers("batch-generator").stop()
    run.before_forward(model)  # e.g. Sigma's top-k of this step
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                          **model_kwargs)
    return output_tensor, partial(loss_func, loss_mask)
