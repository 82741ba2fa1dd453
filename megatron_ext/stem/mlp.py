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

import math
from typing import Optional, Tuple

import torch
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.compiled import compile_region
from megatron_ext.models.sharding import mlp_sharded_state_dict
from megatron_ext.models.token_ids import TOKEN_TABLES, split_context
from megatron_ext.stem.config import StemConfig
from megatron_ext.stem.initial_rows import InitialRows, draw_rows
from megatron_ext_kernels import stem_gate
from megatron_ext_kernels.stem_gate import gate_product
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


class StemMLP(MegatronModule):
    """STEM feed-forward block. ``forward(h, context=...)`` returns ``(out, bias)`` like
    Megatron's MLP; ``context`` is the block's (``models/token_ids.py`` ``TokenContext``: the ids
    ``[s, b]`` and, for managed tables, the rows fetched for them), which
    :class:`megatron_ext.models.layer.TokenContextTransformerLayer` passes on.

    Managed tables (``StemConfig.managed_tables``) are not parameters of this module: it draws
    their initial values (the rows ``kept_rows`` only: this rank's, given by the family's spec
    builder) and hands them over once (``release_initial_table``); it never sees the runtime
    that keeps them (``stem/runtime/tables.py``) but through its arguments: the rows in ``context``,
    and the runtime in the ``metadata`` of ``sharded_state_dict``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        stem: StemConfig,
        vocab_size: int,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        name: Optional[str] = None,
        kept_rows: Optional[torch.Tensor] = None,
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
        # Managed tables (host-resident and/or vocab-sharded, stem/runtime/tables.py) are not parameters
        # of this module: their values are drawn here the same way, a block of rows at a time,
        # only the rows this rank will own kept (stem/initial_rows.py), and handed over once.
        self.managed = stem.managed_tables
        if self.managed:
            self._initial_table: Optional[InitialRows] = draw_rows(
                vocab_size, ffn, self.tp_rank, self.tp_size, init_method,
                keep=kept_rows, initialize=config.perform_initialization)
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
        self.layer_number: Optional[int] = None
        # The fused lookup-and-gate (kernels/stem_gate.py) or its PyTorch reference below.
        self.kernel = stem_gate.resolve(stem.kernel, self.activation_func)
        # The PyTorch path's product after the gather, compiled with --stem-compile gate.
        self.gate_product = compile_region(gate_product) if stem.compile == "gate" \
            else gate_product

    @classmethod
    def as_mlp_submodule(cls, submodules: MLPSubmodules, stem: StemConfig, vocab_size: int,
                         config: TransformerConfig, pg_collection, is_mtp_layer: bool = False,
                         name: Optional[str] = None,
                         kept_rows: Optional[torch.Tensor] = None) -> "StemMLP":
        """Builder matching megatron-core 0.18+'s ``submodules.mlp(config=, pg_collection=, ...)``."""
        if is_mtp_layer:
            raise ValueError("STEM layers cannot be multi-token-prediction layers")
        return cls(config=config, submodules=submodules, stem=stem, vocab_size=vocab_size,
                   tp_group=pg_collection.tp, name=name, kept_rows=kept_rows)

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

    def _table_and_index(self, context) -> Tuple[torch.Tensor, torch.Tensor]:
        """What the lookup gathers from: the table parameter and the ids, or a managed table's
        unique rows of this micro-batch (fetched by the runtime, in ``context``) and each
        token's index into them."""
        ids, fetched = split_context(context)
        if ids is None:
            raise RuntimeError(
                "StemMLP called without token ids: STEM layers must be built with "
                "megatron_ext's layer specs and model (the ids travel in the block's `context`)")
        if not self.managed:
            return self.table, ids
        if fetched is None:
            raise RuntimeError("managed STEM table used without rows for this micro-batch: the "
                               "forward step must fetch its rows first (the family's "
                               "take_batch passes them to the model as token_rows)")
        rows, inverse = fetched.of_layer(self.layer_number)
        if inverse.shape != ids.shape:
            raise RuntimeError(f"the fetched STEM rows index {tuple(inverse.shape)} tokens, the "
                               f"micro-batch has {tuple(ids.shape)}")
        return rows, inverse

    def forward(self, hidden_states: torch.Tensor, context=None, **kwargs):
        """``context``: the block's ``TokenContext`` (or, for a layer run on its own, the ids
        ``[s, b]`` of an ordinary table)."""
        table, index = self._table_and_index(context)
        fc1_out, _ = self.linear_fc1(hidden_states)
        if fc1_out.shape[:2] != index.shape:
            raise RuntimeError(
                f"STEM token ids have shape {tuple(index.shape)} but the MLP input covers "
                f"{tuple(fc1_out.shape[:2])} [sequence, batch] positions")
        if self.kernel == "triton" and stem_gate.runs_on(fc1_out):
            intermediate = stem_gate.stem_gate(fc1_out, table, index, self.variant)
            return self.linear_fc2(intermediate)
        if self.managed:
            rows = torch.nn.functional.embedding(index, table)
        else:
            rows = lookup_rows(table, index)
        intermediate = self.gate_product(fc1_out, rows, self.variant, self.activation_func,
                                         self.config.params_dtype if self.managed else None)
        return self.linear_fc2(intermediate)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> ShardedStateDict:
        """fc1/fc2 as in Megatron's MLP; the table sharded along its columns (axis 1) over TP.
        A managed table is saved under the same key and global shape, in row blocks gathered
        from their owners (``stem/runtime/checkpoint.py``; collective over the data-parallel group)."""
        tables = {} if self.managed else {"table": 1}
        sharded = mlp_sharded_state_dict(self, prefix, sharded_offsets, metadata, tables,
                                         gated_fc1=self.variant == "dagger")
        if not self.managed:
            # The padded vocabulary differs between TP sizes: read the rows both runs have, as
            # Megatron's word embeddings do (checkpoint.block_sharded_tensor, managed tables).
            sharded[f"{prefix}table"].allow_shape_mismatch = True
        if self.managed:
            tables = (metadata or {}).get(TOKEN_TABLES)
            if tables is None:
                raise RuntimeError("a managed STEM table is saved by its model's runtime: call "
                                   "the model's sharded_state_dict (models/token_ids.py), which "
                                   "passes it in metadata")
            # The checkpoint's dtype is the model's, as for an ordinary table parameter.
            sharded.update(tables.sharded_blocks(self.layer_number, f"{prefix}table",
                                                 sharded_offsets, self.config.params_dtype))
        return sharded

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """Managed tables: the model's runtime took the loaded row blocks out before
        (``TokenIdsMixin.load_state_dict``); a whole table cannot load into one."""
        if self.managed:
            left = [k for k in state_dict if k.startswith(f"{prefix}table")]
            if left:
                raise RuntimeError(f"{left[0]}: managed STEM tables load from torch_dist "
                                   "checkpoints only, through the model's load_state_dict")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
