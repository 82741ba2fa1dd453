"""Forward step and loss for ``megatron.training.pretrain`` (same contract as upstream's GPT)."""

from __future__ import annotations

from functools import partial

import torch

from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.utils import get_attr_wrapped_model, get_model_config
from megatron.training import get_args, get_timers

from megatron_ext.training.batch import get_batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses, the token count, and the report Megatron averages across DP."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    args = get_args()
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    token_layers_here = bool(get_attr_wrapped_model(model, "needs_token_ids", allow_none=True))
    tables = get_attr_wrapped_model(model, "stem_tables", allow_none=True) \
        if token_layers_here else None

    def read_batch():
        return get_batch(data_iterator, args, vp_stage, token_layers_here)

    # Managed STEM tables: the batch comes with its rows bound (and, with prefetch, the next
    # micro-batch's rows being fetched in the background). The last micro-batch of a step may
    # read the next step's first one (the overlapped table step) when a next step will run here:
    # ``curr_iteration`` is the number of steps done before this one.
    if tables is not None:
        upcoming = args.curr_iteration + 1
        read_ahead = upcoming < args.train_iters and not (
            args.exit_interval and upcoming % args.exit_interval == 0)
        batch = tables.take_batch(read_batch, get_num_microbatches(), read_ahead=read_ahead)
    else:
        batch = read_batch()
    tokens, labels, loss_mask, attention_mask, position_ids = batch
    timers("batch-generator").stop()
    if args.model_family == "structmoe":
        # Upstream sets the aux-loss gradient scale only for models with --num-experts.
        from megatron_ext.structmoe.balance import set_aux_loss_scale

        set_aux_loss_scale(get_model_config(model), get_num_microbatches(),
                           args.context_parallel_size)
    if args.model_family == "sigma":
        # Progressive sparsification: every layer's top-k for this step (a function of the step).
        from megatron_ext.sigma.schedule import apply_schedule
        from megatron_ext.training.arguments import sigma_config_from_args

        apply_schedule(get_attr_wrapped_model(model, "sigma_layers"), sigma_config_from_args(args),
                       args.curr_iteration, args.train_iters)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)
