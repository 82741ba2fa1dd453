"""STEM's checkpoint check (``Family.check_checkpoint``, ``stem/family.py``) looks the tables up
where upstream's loader reads them: a GPT-path checkpoint loaded into the hybrid path
(``--hybrid-layer-pattern``) gives hybrid MLP position ``p`` the paired GPT layer (the i-th ``-``
is GPT layer i), so a table of another width, or STEM layers the checkpoint does not have
(``--stem-layers``), is refused naming the flags before upstream's loader runs; the matching
checkpoint is accepted. Checkpoints of real models saved in one process (``torch_dist``)."""

from __future__ import annotations

import argparse
import os
import re

import pytest
import torch
import torch.nn.functional as F

PATTERN = "*-*-*-*-"  # 4 MLP blocks at positions 1, 3, 5, 7
VOCAB, HIDDEN, FFN = 128, 32, 64


def _config(num_layers, ffn=FFN):
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=num_layers, hidden_size=HIDDEN, ffn_hidden_size=ffn,
                               num_attention_heads=4, gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False,
                               normalization="RMSNorm", use_cpu_initialization=True)
    config.hetereogenous_dist_checkpoint = True  # one key per layer, as the model provider sets
    return config


def _gpt_model(stem_layers, ffn=FFN):
    from megatron_ext.models.gpt import TokenIdsGPTModel
    from megatron_ext.stem.config import StemConfig
    from megatron_ext.stem.specs import decoder_block_spec

    config = _config(4, ffn)
    spec = decoder_block_spec(config, StemConfig(layers=stem_layers), VOCAB, use_te=False)
    return TokenIdsGPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                            max_sequence_length=16, position_embedding_type="rope")


def _hybrid_model(stem_layers, ffn=FFN):
    from megatron_ext.models import hybrid_specs
    from megatron_ext.models.hybrid import TokenIdsHybridModel
    from megatron_ext.models.layer import TokenContextMLPLayer
    from megatron_ext.models.specs import with_mlp
    from megatron_ext.stem.config import StemConfig
    from megatron_ext.stem.mlp import StemMLP

    config = _config(len(PATTERN), ffn)
    stem = StemConfig(layers=stem_layers)
    spec = hybrid_specs.hybrid_stack_spec(
        config, PATTERN, False,
        lambda k, dense: with_mlp(dense, StemMLP.as_mlp_submodule, TokenContextMLPLayer,
                                  stem=stem, vocab_size=VOCAB) if k in stem_layers else dense)
    return TokenIdsHybridModel(config=config, hybrid_stack_spec=spec, vocab_size=VOCAB,
                               max_sequence_length=16, hybrid_layer_pattern=PATTERN,
                               position_embedding_type="rope")


def _args(stem_layers, pattern, no_load_optim=False, variant="up"):
    return argparse.Namespace(
        model_family="stem", hybrid_layer_pattern=pattern, num_layers=8 if pattern else 4,
        stem_layers=",".join(map(str, stem_layers)), stem_ratio="1/3", stem_variant=variant,
        no_load_optim=no_load_optim, finetune=False)


def _save(model, directory, pattern=None, row_state=None, stem_layers=None, **extra_args):
    """``model`` as Megatron saves it (iteration 1, the run's args in the common state), with
    ``row_state`` (a name): a per-row tensor of the tables' optimizer state under that name, as
    the sparse table optimizer saves it (``stem/runtime/checkpoint.py``). ``stem_layers``: the STEM
    flags in its args (None: args without them, as an older version saved, which leave the
    tables alone to be checked)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    folder = os.path.join(directory, "iter_0000001")
    os.makedirs(folder)
    args = _args(stem_layers or [], pattern)
    if stem_layers is None:
        for name in ("stem_layers", "stem_ratio", "stem_variant"):
            delattr(args, name)
    vars(args).update(extra_args)
    state = {"model": model.sharded_state_dict(), "iteration": 1, "args": args}
    if row_state is not None:
        key = f"optimizer.state.{row_state}.decoder.layers.1.mlp.table"
        state["optimizer"] = {"stem": ShardedTensor.from_rank_offsets(
            key, torch.zeros(VOCAB, dtype=torch.float64))}
    dist_checkpointing.save(state, folder)
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    return directory


@pytest.fixture(scope="module")
def checkpoints(mcore_single_rank, tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("stem_check")
    return {
        # GPT path: STEM layers 1 and 3 (the 2nd and 4th MLP blocks).
        "gpt_13": _save(_gpt_model((1, 3)), str(root / "gpt_13")),
        "gpt_12_wide": _save(_gpt_model((1, 2), ffn=2 * FFN), str(root / "gpt_12_wide")),
        "hybrid_13": _save(_hybrid_model((1, 3)), str(root / "hybrid_13"), PATTERN),
        # Sparse table optimizer states: today's (each row's last iteration with a gradient)
        # and the earlier lazy-Adam one's (per-row step counts).
        "gpt_13_sparse": _save(_gpt_model((1, 3)), str(root / "gpt_13_sparse"),
                               row_state="stem_row_touched"),
        "gpt_13_lazy": _save(_gpt_model((1, 3)), str(root / "gpt_13_lazy"),
                             row_state="stem_row_steps"),
        # With the STEM flags in its args, as this version saves.
        "gpt_13_args": _save(_gpt_model((1, 3)), str(root / "gpt_13_args"), stem_layers=(1, 3)),
        # A sparse table optimizer's run, with its table flags in the args.
        "gpt_13_sparse_args": _save(_gpt_model((1, 3)), str(root / "gpt_13_sparse_args"),
                                    row_state="stem_row_touched", stem_layers=(1, 3),
                                    stem_table_placement="cpu", stem_table_sharding="vocab",
                                    stem_optimizer="sparse"),
    }


def _check(model, stem_layers, load, pattern=PATTERN, no_load_optim=False, **stem):
    from megatron_ext.models.registry import get_family
    from megatron_ext.stem.config import StemConfig

    get_family("stem").check_checkpoint(
        [model], _args(stem_layers, pattern, no_load_optim, stem.get("variant", "up")),
        StemConfig(layers=stem_layers, **stem), load, None, VOCAB)


def test_the_paired_checkpoint_is_accepted(checkpoints):
    _check(_hybrid_model((1, 3)), (1, 3), checkpoints["gpt_13"])  # GPT layers 1, 3
    _check(_hybrid_model((1, 3)), (1, 3), checkpoints["hybrid_13"])  # positions 3, 7
    _check(_gpt_model((1, 3)), (1, 3), checkpoints["gpt_13"], pattern=None)


def test_another_table_width_is_refused(checkpoints):
    """STEM layers 1, 2: pattern positions 3 and 5, GPT layers 1 and 2 of the checkpoint."""
    with pytest.raises(ValueError, match=r"decoder\.layers\.1\.mlp\.table has shape \[vocab, "
                       r"d_ff\] = \[128, 128\], but this model's tables are \[128, 64\] .*"
                       "--ffn-hidden-size"):
        _check(_hybrid_model((1, 2)), (1, 2), checkpoints["gpt_12_wide"])


@pytest.mark.parametrize("load, where", [("gpt_13", "layers [1, 3]"),
                                         ("hybrid_13", "pattern positions [3, 7]")])
def test_other_stem_layers_are_refused(checkpoints, load, where):
    with pytest.raises(ValueError, match=rf"holds STEM tables in {re.escape(where)}, but "
                       r"this model's STEM layers \(MLP blocks \[1, 2\] from "
                       r"--stem-layers/--stem-ratio\)"):
        _check(_hybrid_model((1, 2)), (1, 2), checkpoints[load])


SPARSE = {"placement": "cpu", "sharding": "vocab", "optimizer": "sparse"}


def test_a_lazy_adam_sparse_state_is_refused_for_a_sparse_resume(checkpoints):
    """A sparse table optimizer state of the earlier lazy-Adam semantics has no per-row
    last-gradient iteration, which the sparse optimizer's catch-up needs: a sparse run that loads
    the optimizer is refused, naming --no-load-optim; without the optimizer state, or with a
    dense table optimizer (refused later, by mode), or today's sparse state, the check passes."""
    model = _gpt_model((1, 3))
    with pytest.raises(ValueError, match=r"gpt_13_lazy.*earlier lazy-Adam semantics \(per-row "
                       r"step counts, optimizer\.state\.stem_row_steps\).*Resume with "
                       r"--no-load-optim"):
        _check(model, (1, 3), checkpoints["gpt_13_lazy"], pattern=None, **SPARSE)
    _check(model, (1, 3), checkpoints["gpt_13_lazy"], pattern=None, no_load_optim=True, **SPARSE)
    _check(model, (1, 3), checkpoints["gpt_13_lazy"], pattern=None,
           **{**SPARSE, "optimizer": "dense"})
    _check(model, (1, 3), checkpoints["gpt_13_sparse"], pattern=None, **SPARSE)


@pytest.mark.parametrize("layers,variant,message", [
    ((1, 2), "up", r"STEM layers \(MLP blocks, from --stem-layers/--stem-ratio\): \[1, 3\] in "
                   r"the checkpoint, \[1, 2\] in this run"),
    ((1, 3), "gate", "--stem-variant: up in the checkpoint, gate in this run"),
])
def test_the_stem_settings_of_the_checkpoint_are_compared_first(checkpoints, layers, variant,
                                                                message):
    """A checkpoint with the STEM flags in its args: another variant (same tables: it loaded
    silently before) or other STEM layers are refused naming both values; the same model
    passes, on the GPT and the hybrid path."""
    from megatron_ext.checkpoint_manifest import CheckpointError

    with pytest.raises(CheckpointError, match=message):
        _check(_hybrid_model(layers), layers, checkpoints["gpt_13_args"], variant=variant)
    _check(_hybrid_model((1, 3)), (1, 3), checkpoints["gpt_13_args"])
    _check(_gpt_model((1, 3)), (1, 3), checkpoints["gpt_13_args"], pattern=None)


def test_another_table_optimizer_is_refused_before_the_loader(checkpoints):
    """A resume that would load the sparse table optimizer's state into the dense one is refused
    with one line naming both modes and the ways out (it was a traceback inside upstream's
    loader); without the optimizer state, with the same mode, or with ordinary tables (no table
    optimizer of ours) the check passes."""
    from megatron_ext.checkpoint_manifest import CheckpointError
    from megatron_ext.training.checkpoint_hooks import check_checkpoint as trainer_check

    model = _gpt_model((1, 3))
    load = checkpoints["gpt_13_sparse_args"]
    with pytest.raises(ValueError, match=r"^--stem-optimizer: sparse in the checkpoint, dense in "
                       r"this run: .*resume with --stem-optimizer sparse, or pass "
                       r"--no-load-optim"):
        _check(model, (1, 3), load, pattern=None, **{**SPARSE, "optimizer": "dense"})
    _check(model, (1, 3), load, pattern=None, no_load_optim=True,
           **{**SPARSE, "optimizer": "dense"})
    _check(model, (1, 3), load, pattern=None, **SPARSE)
    _check(model, (1, 3), load, pattern=None, placement="gpu", sharding="replicated")
    # Through the trainer's check: one line (CheckpointError), no traceback around it.
    from megatron_ext.stem.family import add_args

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--stem-table-placement", "gpu", "--stem-table-sharding", "vocab",
                              "--stem-optimizer", "dense", "--stem-layers", "1,3"])
    vars(args).update({k: v for k, v in vars(_args((1, 3), None)).items()
                       if k not in vars(args) or k.startswith("stem_layers")},
                      ckpt_step=None, hidden_size=model.config.hidden_size,
                      num_attention_heads=model.config.num_attention_heads)
    with pytest.raises(CheckpointError, match="^--stem-optimizer: sparse in the checkpoint"):
        trainer_check([model], args, load, VOCAB)
