"""A model family defined by a test alone (``tests/test_family_plugin.py``): the dense GPT with a
non-gated GELU MLP, loaded by ``launch/pretrain.py --ext-plugin gelu_family`` (this folder on
``PYTHONPATH``). It uses the family contract (``megatron_ext/models/family.py``) and nothing else
of the plugin's trainer: its own flag, config, check, block spec and hooks, whose calls it writes
to ``--gelu-report`` after training."""

from __future__ import annotations

import json
from typing import Optional

import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from megatron_ext.models.family import Family, FamilyRun
from megatron_ext.models.registry import register_family
from megatron_ext.models.specs import block_spec as build_block, with_mlp

CALLS = {"start_run": 0, "before_forward": 0, "model_state": 0}


class GeluMLP(MLP):
    """Megatron's MLP, held to fc1 -> GELU -> fc2 (no gate)."""

    def __init__(self, config, submodules, **kwargs):
        if config.gated_linear_unit or config.activation_func is not F.gelu:
            raise ValueError("GeluMLP: a non-gated GELU MLP (no --swiglu)")
        super().__init__(config, submodules, **kwargs)


def add_args(parser) -> None:
    group = parser.add_argument_group("test GELU family")
    group.add_argument("--gelu-report", default=None, metavar="PATH",
                       help="after training, write the hooks' calls as JSON to PATH")


def config_from_args(args) -> dict:
    return {"report": args.gelu_report}


def validate_args(args, tokenizer_vocab_size: Optional[int] = None) -> None:
    if args.swiglu:
        raise ValueError("--model-family=gelu is the non-gated GELU MLP: drop --swiglu")


def block_spec(args, config, use_te: bool, vp_stage: Optional[int] = None):
    return build_block(config, use_te, lambda i, dense: with_mlp(dense, GeluMLP.as_mlp_submodule),
                       vp_stage=vp_stage)


class GeluRun(FamilyRun):
    """The plugin's run: counts the hooks the trainer calls (one run per training, the model
    state per chunk, before_forward per micro-batch) and writes the counts after training."""

    def __init__(self, args, cfg):
        CALLS["start_run"] += 1
        self.cfg = cfg

    def model_state(self, model, config) -> None:
        CALLS["model_state"] += 1

    def before_forward(self, model) -> None:
        CALLS["before_forward"] += 1

    def after_training(self) -> None:
        import torch.distributed as dist

        if self.cfg["report"] and dist.get_rank() == 0:
            with open(self.cfg["report"], "w") as f:
                json.dump(CALLS, f)


FAMILY = register_family(Family(
    "gelu", "test: dense GPT with a GELU MLP", block_spec, add_args=add_args,
    config_from_args=config_from_args, validate_args=validate_args, start_run=GeluRun))
