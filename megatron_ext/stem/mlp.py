"""The STEM MLP: a SwiGLU MLP whose up-projection is a token-indexed table (Eq. 4 of the STEM paper).

Extends the layout of ``megatron.core.transformer.mlp.MLP``: ``linear_fc1`` is column-parallel,
``linear_fc2`` row-parallel, both built from the same submodule builders as the dense MLP (local or
Transformer Engine), so a STEM layer differs from a dense one only in its fc1 width and its table.

Variants (``StemConfig.variant``)::

    up      y = W_d( act(W_g x)  *  U[t] )            linear_fc1 = W_g  (H -> F)
    gate    y = W_d( act(U[t])   *  W_u x )           linear_fc1 = W_u  (H -> F)
    dagger  y = W_d( act(W_g x)  * (W_u x + U[t]) )   linear_fc1 = [W_g; W_u] as in Megatron's MLP

The table ``U`` is ``[vocab, F]``. Under tensor parallelism its columns are split exactly like the
output of ``linear_fc1`` (each rank holds ``F / tp`` contiguous columns), so the lookup needs no
communication. The token ids ``t`` are the full (not sequence-parallel-split) ids of this rank's
context-parallel chunk, laid out ``[s, b]`` like the hidden states: ``linear_fc1`` all-gathers the
sequence under sequence parallelism, so its output covers the whole local sequence.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.models.sharding import mlp_sharded_state_dict
from megatron_ext.stem import checkpoint
from megatron_ext.stem.config import StemConfig
from megatron_ext.stem.initial_rows import InitialRows, draw_rows
from megatron_ext.stem.ownership import RowOwnership
from megatron_ext_kernels import stem_gate
from megatron_ext_kernels.stem_lookup import lookup_rows


def table_init_method(init: str, config: TransformerConfig):
    """The initialiser of a STEM table (see ``StemConfig.init``)."""
    if init == "normal":
        std = config.init_method_std
        return lambda t: torch.nn.init.normal_(t, mean=0.0, std=std)
    if init == "fan-in":
        std = config.init_method_std * math.sqrt(config.hidden_size)
        return lambda t: torch.nn.init.normal_(t, mean=0.0, std=std)
    if init == "ones":
        return torch.nn.init.ones_
    if init == "zeros":
        return torch.nn.init.zeros_
    raise ValueError(f"--stem-init={init!r}: unknown initialisation")


def rows_owned_at_build(stem: StemConfig, vocab_size: int) -> Optional[torch.Tensor]:
    """The global rows a managed table of this rank will hold (vocab sharding: the rows
    ``RowOwnership`` gives this data-parallel rank, as ``StemTables`` will), the only ones whose
    drawn values are kept; None (every row) for replicated tables and for a model built without
    Megatron's parallel state."""
    if stem.sharding != "vocab" or not parallel_state.model_parallel_is_initialized():
        return None
    return RowOwnership(vocab_size, parallel_state.get_data_parallel_world_size(),
                        stem.ownership).owned_ids(parallel_state.get_data_parallel_rank())


class StemMLP(MegatronModule):
    """STEM feed-forward block. ``forward(h)`` returns ``(out, bias)`` like Megatron's MLP.

    The token ids are bound for the duration of one layer call by the owning
    :class:`megatron_ext.models.layer.TokenContextTransformerLayer` (``bind_token_ids``), which
    reads them from the transformer block's ``context`` argument.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        stem: StemConfig,
        vocab_size: int,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        name: Optional[str] = None,
    ):
        super().__init__(config=config)
        if not config.gated_linear_unit:
            raise ValueError(
                "STEM needs a gated activation (it replaces one input of the gated product): "
                "pass --swiglu (SwiGLU, the paper's setting)")
        if config.add_bias_linear:
            raise ValueError("STEM layers have no biases (Table 1 ignores them): pass "
                             "--disable-bias-linear")
        self.stem = stem
        self.variant = stem.variant
        self.vocab_size = vocab_size
        self.tp_group = tp_group
        self.tp_size = tp_group.size() if tp_group is not None else 1
        self.tp_rank = tp_group.rank() if tp_group is not None else 0
        ffn = config.ffn_hidden_size
        if ffn % self.tp_size != 0:
            raise ValueError(f"--ffn-hidden-size={ffn} must be divisible by "
                             f"--tensor-model-parallel-size={self.tp_size}")
        self.ffn_per_partition = ffn // self.tp_size
        fc1_width = 2 * ffn if self.variant == "dagger" else ffn

        self.linear_fc1 = submodules.linear_fc1(
            config.hidden_size,
            fc1_width,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=tp_group,
            stride=2 if self.variant == "dagger" else 1,
            name=(name + ".linear_fc1") if name is not None else None,
        )
        self.activation_func = config.activation_func
        self.linear_fc2 = submodules.linear_fc2(
            ffn,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=tp_group,
            name=(name + ".linear_fc2") if name is not None else None,
        )

        init_method = table_init_method(stem.init, config)
        # Managed tables (host-resident and/or vocab-sharded, stem/tables.py) are not parameters
        # of this module: their values are drawn here the same way, a block of rows at a time,
        # only the rows this rank will own kept (stem/initial_rows.py), and handed over once.
        self.managed = stem.managed_tables
        if self.managed:
            self._initial_table: Optional[InitialRows] = draw_rows(
                vocab_size, ffn, self.tp_rank, self.tp_size, init_method,
                keep=rows_owned_at_build(stem, vocab_size),
                initialize=config.perform_initialization)
            self._rows: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
            # The rows of each micro-batch in flight, by the storage of its block context (the
            # ids), so that a recomputed layer reads its own micro-batch's rows (claim_rows).
            self._rows_by_context = {}
        else:
            device = None if config.use_cpu_initialization else torch.cuda.current_device()
            table = torch.empty(vocab_size, self.ffn_per_partition, dtype=config.params_dtype,
                                device=device)
            if config.perform_initialization and device is None:
                # The full [vocab, F] table is drawn on every rank and sliced, so the values do
                # not depend on the TP size (same as Megatron's linear layers).
                _initialize_affine_weight_cpu(
                    table, vocab_size, ffn, self.ffn_per_partition, 1, init_method,
                    params_dtype=table.dtype, rank=self.tp_rank, world_size=self.tp_size)
            elif config.perform_initialization:
                _initialize_affine_weight_gpu(table, init_method, partition_dim=1)
            self.table = torch.nn.Parameter(table)
            set_tensor_model_parallel_attributes(self.table, True, 1, 1)
        self._token_ids: Optional[torch.Tensor] = None
        self.layer_number: Optional[int] = None
        # The fused lookup-and-gate (megatron_ext_kernels/stem_gate.py) or its PyTorch reference below.
        self.kernel = stem_gate.resolve(stem.kernel, self.activation_func)

    @classmethod
    def as_mlp_submodule(cls, submodules: MLPSubmodules, stem: StemConfig, vocab_size: int,
                         config: TransformerConfig, pg_collection, is_mtp_layer: bool = False,
                         name: Optional[str] = None) -> "StemMLP":
        """Builder matching megatron-core 0.18+'s ``submodules.mlp(config=, pg_collection=, ...)``."""
        if is_mtp_layer:
            raise ValueError("STEM layers cannot be multi-token-prediction layers")
        return cls(config=config, submodules=submodules, stem=stem, vocab_size=vocab_size,
                   tp_group=pg_collection.tp, name=name)

    @contextlib.contextmanager
    def bind_token_ids(self, token_ids: Optional[torch.Tensor]):
        """Make ``token_ids`` ([s, b]) visible to the forward calls made inside the block."""
        previous = self._token_ids
        self._token_ids = token_ids
        try:
            yield
        finally:
            self._token_ids = previous

    def set_layer_number(self, layer_number: int) -> None:
        """Called by ``TransformerLayer`` (1-based, global), as for upstream's MoE layer."""
        self.layer_number = layer_number

    def release_initial_table(self) -> InitialRows:
        """Managed tables: the drawn values of this rank's rows (``[rows, F/tp]``), handed over
        once to StemTables."""
        table, self._initial_table = self._initial_table, None
        if table is None:
            raise RuntimeError("the STEM table of this layer was already handed over")
        return table

    def bind_rows(self, rows: torch.Tensor, inverse: torch.Tensor) -> None:
        """Managed tables: this micro-batch's unique rows and the index of each token into them."""
        self._rows = (rows, inverse)

    def claim_rows(self, context: torch.Tensor) -> None:
        """Managed tables: tie the rows just bound to this micro-batch's block ``context`` (its ids
        ``[s, b]``), called by the model once it has made the context. Megatron's full-recompute
        checkpoint saves the context and hands a detached view of it (same storage) to the
        recomputed layers, so under pipeline schedules, where other micro-batches' rows are bound
        between a forward and its recompute, the recompute still finds its own rows. Contexts of
        micro-batches in flight are alive, so their storages are distinct; an entry of a
        finished micro-batch may be replaced by a later one reusing its memory, which is harmless.
        Emptied each step by :meth:`release_rows`. Ordinary tables: nothing to claim."""
        if self.managed and self._rows is not None:
            if not torch.is_grad_enabled() and not self.training:
                self._rows_by_context.clear()  # evaluation: no recompute, keep one entry
            self._rows_by_context[context.untyped_storage().data_ptr()] = self._rows
            self._rows = None

    def release_rows(self) -> None:
        """Forget every micro-batch's rows (the step's row gradients have been collected)."""
        self._rows = None
        self._rows_by_context.clear()

    def lookup(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``U[t]`` for ids ``[s, b]`` -> ``[s, b, F / tp]``."""
        if not self.managed:
            return lookup_rows(self.table, token_ids)
        rows, inverse = self._table_and_index(token_ids)
        return torch.nn.functional.embedding(inverse, rows).to(self.config.params_dtype)

    def _table_and_index(self, token_ids: torch.Tensor):
        """What the fused kernel gathers from: the table parameter and the ids, or a managed
        table's unique rows of this micro-batch and each token's index into them."""
        if not self.managed:
            return self.table, token_ids
        bound = self._rows_by_context.get(token_ids.untyped_storage().data_ptr(), self._rows)
        if bound is None or bound[1].shape != token_ids.shape:
            raise RuntimeError("managed STEM table used without rows for this micro-batch: the "
                               "forward step must fetch its rows first (StemTables.fetch_now)")
        rows, inverse = bound
        return rows, inverse

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        token_ids = self._token_ids
        if token_ids is None:
            raise RuntimeError(
                "StemMLP called without token ids: STEM layers must be built with "
                "megatron_ext's layer specs and model (the ids travel in the block's `context`)")
        fc1_out, _ = self.linear_fc1(hidden_states)
        if fc1_out.shape[:2] != token_ids.shape:
            raise RuntimeError(
                f"STEM token ids have shape {tuple(token_ids.shape)} but the MLP input covers "
                f"{tuple(fc1_out.shape[:2])} [sequence, batch] positions")
        if self.kernel == "triton" and stem_gate.runs_on(fc1_out):
            table, index = self._table_and_index(token_ids)
            intermediate = stem_gate.stem_gate(fc1_out, table, index, self.variant)
            return self.linear_fc2(intermediate)
        rows = self.lookup(token_ids)
        if self.variant == "up":
            intermediate = self.activation_func(fc1_out) * rows
        elif self.variant == "gate":
            intermediate = self.activation_func(rows) * fc1_out
        else:  # dagger, Eq. 5
            gate, up = torch.chunk(fc1_out, 2, dim=-1)
            intermediate = self.activation_func(gate) * (up + rows)
        return self.linear_fc2(intermediate)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> ShardedStateDict:
        """fc1/fc2 as in Megatron's MLP; the table sharded along its columns (axis 1) over TP.
        A managed table is saved under the same key and global shape, in row blocks gathered
        from their owners (``stem/checkpoint.py``; collective over the data-parallel group)."""
        tables = {} if self.managed else {"table": 1}
        sharded = mlp_sharded_state_dict(self, prefix, sharded_offsets, metadata, tables,
                                         gated_fc1=self.variant == "dagger")
        if not self.managed:
            # The padded vocabulary differs between TP sizes: read the rows both runs have, as
            # Megatron's word embeddings do (checkpoint.block_sharded_tensor, managed tables).
            sharded[f"{prefix}table"].allow_shape_mismatch = True
        if self.managed:
            owner, index = self._owner()
            self.checkpoint_blocks = {}
            for block, rows in checkpoint.table_blocks(owner, index):
                # The checkpoint's dtype is the model's, as for an ordinary table parameter.
                tensor = checkpoint.block_sharded_tensor(
                    f"{prefix}table", rows.to(self.config.params_dtype), block, self.vocab_size,
                    sharded_offsets, self.tp_rank, self.tp_size)
                self.checkpoint_blocks[block] = tensor
                sharded[f"{prefix}table.block{block}"] = tensor
        return sharded

    def _owner(self):
        owner = getattr(self, "managed_by", None)
        if owner is None:
            raise RuntimeError("managed STEM table without its StemTables (model_provider sets "
                               "model.stem_tables)")
        return owner

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """Managed tables: the loaded row blocks go to their owners (collective over the
        data-parallel group; every rank loads its layers in the same order)."""
        if self.managed:
            marker = f"{prefix}table.block"
            keys = [k for k in list(state_dict) if k.startswith(marker)]
            if keys:
                owner, index = self._owner()
                checkpoint.load_table(owner, index,
                                      {int(k[len(marker):]): state_dict.pop(k) for k in keys})
            elif f"{prefix}table" in state_dict:  # a whole table (a non-distributed dict)
                raise RuntimeError(f"{prefix}table: managed STEM tables load from torch_dist "
                                   "checkpoints only")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
