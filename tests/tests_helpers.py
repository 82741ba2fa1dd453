"""Small builders shared by tests (plain functions, not fixtures)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(relpath: str, name: str):
    """A script of the repository (``launch/``, ``benchmarks/``: not a package) imported as the
    module ``name``, registered in ``sys.modules`` (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def offline_builds(module: str, expression: str, timeout: int = 600):
    """``expression`` (built from ``offline_build`` of ``megatron_ext_kernels.<module>``: the
    kernels compiled for a GPU without one) evaluated in a fresh process without
    ``TRITON_INTERPRET`` (this one's Triton may run the interpreter), its value through JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (f"import json; from megatron_ext_kernels.{module} import offline_build; "
            f"print(json.dumps({expression}))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def refusal(check, args):
    """The text of the ``ValueError`` ``check(args)`` raises with ``args`` as Megatron's global
    arguments (set for the call, cleared after), or ``None`` when it passes."""
    from megatron.training import global_vars

    global_vars.set_args(args)
    try:
        check(args)
    except ValueError as error:
        return str(error)
    finally:
        global_vars.set_args(None)
    return None


def build_tiny_stem_mlp(variant: str = "up", hidden: int = 16, ffn: int = 24, vocab: int = 30,
                        init: str = "fan-in", **config_overrides):
    """A ``StemMLP`` with Megatron-Core's local linear layers (needs the parallel state)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.stem.config import StemConfig
    from megatron_ext.stem.mlp import StemMLP

    cfg = dict(num_layers=2, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=4,
               gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
               use_cpu_initialization=True, init_method_std=0.02)
    cfg.update(config_overrides)
    return StemMLP.as_mlp_submodule(
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        stem=StemConfig(variant=variant, init=init), vocab_size=vocab,
        config=TransformerConfig(**cfg), pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def parse_tiny_args(extra):
    """Megatron's ``parse_args`` with the plugin's flags, on ``multirank.TINY_GPT`` + ``extra``
    (``sys.argv`` restored after)."""
    from megatron.training.arguments import parse_args
    from multirank import TINY_GPT

    from megatron_ext.training.arguments import add_extension_args

    argv = sys.argv
    sys.argv = ["pretrain.py", *TINY_GPT, *extra]
    try:
        return parse_args(extra_args_provider=add_extension_args)
    finally:
        sys.argv = argv
