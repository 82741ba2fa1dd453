"""What one training does with STEM, in one object: ``StemRun``, the family's ``FamilyRun``
(``models/family.py``), made by ``Family.start_run`` before the model is built and closed by the
trainer's session after the training (``training/session.py``).

It owns what lives as long as the training: the host worker that every chunk's managed tables
share (``stem/runtime/worker.py``), the table optimizer chained onto Megatron's, and the GPU
tier's token counts; it builds each model chunk's tables (``token_tables``), which the model keeps.
``close`` waits for the worker's last host work and ends its thread; nothing of the training is
left in the process after it.
"""

from __future__ import annotations

from typing import List, Optional

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.models.family import FamilyRun
from megatron_ext.models.hybrid_pattern import mlp_block_count
from megatron_ext.models.log import print_rank_0
from megatron_ext.models.token_ids import wrapped_attr
from megatron_ext.stem.config import StemConfig
from megatron_ext.stem.mlp import StemMLP
from megatron_ext.stem.runtime.hot_rows import choose_hot_mask
from megatron_ext.stem.runtime.optimizer import StemTablesOptimizer, wrap_optimizer
from megatron_ext.stem.runtime.read_ahead import take_batch
from megatron_ext.stem.runtime.report import dump_tables, host_memory_report, report_stats
from megatron_ext.stem.runtime.tables import LayerTable, StemTables
from megatron_ext.stem.runtime.worker import DEFAULT_SWITCH_INTERVAL_S, HostWorker


class StemRun(FamilyRun):
    def __init__(self, args, stem: StemConfig):
        self.args, self.stem = args, stem
        self.host_tokens = stem.managed_tables  # the tables route the tokens' host copy
        switch_ms = getattr(args, "stem_gil_switch_ms", 1e3 * DEFAULT_SWITCH_INTERVAL_S)
        self.worker = HostWorker(switch_ms / 1e3)  # its thread starts with the first host work
        self.optimizers: List[StemTablesOptimizer] = []
        self.token_counts: dict = {}  # the GPU tier's counts of the training blend (tiers.py)

    # -- the model ----------------------------------------------------------------------------
    def token_tables(self, model, config) -> Optional[StemTables]:
        """The runtime of the chunk's managed tables (``--stem-table-placement cpu|tiered`` or
        vocab sharding), which the model keeps as ``model.token_tables`` (``models/token_ids.py``):
        the rows are not parameters of the model. None for ordinary tables and on a chunk
        without STEM layers."""
        args, stem = self.args, self.stem
        print_rank_0(f"> STEM layers (0-based MLP blocks): "
                     f"{stem.stem_layers(mlp_block_count(args))} variant={stem.variant} "
                     f"init={stem.init} tables: placement={stem.placement} "
                     f"sharding={stem.sharding}")
        if not stem.managed_tables:
            return None
        layers = [LayerTable(m.layer_number, m.release_initial_table(), m.config.params_dtype,
                             m.vocab_size, m.tp_rank, m.tp_size)
                  for m in model.modules() if isinstance(m, StemMLP) and m.managed]
        if not layers:
            return None
        hot = None
        if stem.placement == "tiered":
            hot, how = choose_hot_mask(args, args.padded_vocab_size, stem.gpu_tier,
                                       stem.tier_count_tokens, self.token_counts)
            print_rank_0(f"> STEM GPU tier: {int(hot.sum())} of {args.padded_vocab_size} "
                         f"rows (--stem-gpu-tier {stem.gpu_tier}): {how}")
        return StemTables(layers, stem, args.padded_vocab_size,
                          parallel_state.get_data_parallel_group(), self.worker, hot_mask=hot,
                          host_group=_host_data_parallel_group())

    # -- each micro-batch ---------------------------------------------------------------------
    def take_batch(self, model, read_batch):
        return take_batch(model, read_batch, self.args)

    def bind_tokens(self, model, tokens) -> dict:
        """A forward outside the trainer: the rows of ``tokens`` fetched from their owners, as
        ``take_batch`` does, for the model's ``token_rows`` (collective over the data-parallel
        group; nothing for ordinary tables)."""
        tables = wrapped_attr(model, "token_tables")
        return {} if tables is None else {"token_rows": tables.fetch_now(tokens)}

    # -- the optimizer and its reports --------------------------------------------------------
    def wrap_optimizer(self, optimizer, chunks):
        """Managed tables step in the table optimizer chained onto Megatron's."""
        if not self.stem.managed_tables:
            return optimizer
        wrapped = wrap_optimizer(optimizer, chunks, self.args.stem_cpu_threads,
                                 self.args.stem_optimizer, self.worker,
                                 gpu_step=self.stem.gpu_step)
        self.optimizers.append(wrapped)
        print(f"[rank {dist.get_rank()}] > {host_memory_report(wrapped)}", flush=True)
        if self.stem.gpu_step != "torch":
            print(f"[rank {dist.get_rank()}] > STEM tables: the sparse step of the rows on the "
                  f"GPU by kernels/row_adam_gpu.py (--stem-gpu-step {self.stem.gpu_step})",
                  flush=True)
        return wrapped

    def log_report(self, args, iteration, total_loss_dict, writer, wandb_writer) -> None:
        report_stats(self.optimizers, args, iteration, total_loss_dict, writer, wandb_writer)

    def after_training(self) -> None:
        if self.stem.managed_tables and self.args.stem_dump_tables:
            dump_tables(self.optimizers, self.args.stem_dump_tables)

    def close(self) -> None:
        """The worker's last host work waited for (its failure raised) and its thread ended;
        the optimizers let go."""
        try:
            self.worker.close()
        finally:
            self.optimizers.clear()


def _host_data_parallel_group():
    """Megatron's gloo copy of the data-parallel group (``create_gloo_process_groups``, on unless
    ``--disable-gloo-process-groups``), over which the tables route their host ids without
    waiting for the GPU (``stem/runtime/exchange.py``); None without it."""
    try:
        return parallel_state.get_data_parallel_group_gloo()
    except AssertionError:
        return None
