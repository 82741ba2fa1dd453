"""Run as a ``"module"`` item of a ``tests/dist/multi_config.py`` plan on 2 ranks: upstream's
local self-attention (``get_gpt_layer_local_spec``'s, linear_qkv and linear_proj split over
TP=2 with sequence parallelism) built twice with the same weights, once with Megatron's
``DotProductAttention`` and once with ``SDPAttention`` as its core attention, fed the same input;
writes per rank the largest relative differences of the output and of the input's and every weight's
gradient, fp32, causal, with and without GQA. Usage: ``main(["--out", DIR])``."""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel.schedules import custom_backward
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.compat import cpu
from megatron_ext.models.sdpa_attention import SDPAttention


def _attention(config, core):
    spec = get_gpt_layer_local_spec().submodules.self_attention
    spec = ModuleSpec(module=spec.module, params=dict(spec.params),
                      submodules=dataclasses.replace(spec.submodules, core_attention=core))
    return build_module(spec, config=config, layer_number=1)


def _compare(num_query_groups: int, sq: int = 16, b: int = 3):
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8,
                               num_query_groups=num_query_groups, tensor_model_parallel_size=2,
                               sequence_parallel=True, use_cpu_initialization=True,
                               attention_dropout=0.0, hidden_dropout=0.0, add_bias_linear=False,
                               params_dtype=torch.float32, gradient_accumulation_fusion=False,
                               masked_softmax_fusion=False, bias_dropout_fusion=False)
    ref = _attention(config, DotProductAttention)
    new = _attention(config, SDPAttention)
    new.load_state_dict(ref.state_dict())
    tp = parallel_state.get_tensor_model_parallel_rank()
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(sq, b, config.hidden_size, generator=gen)
    grad_full = torch.randn(sq, b, config.hidden_size, generator=gen)
    part = sq // 2  # sequence parallel: this rank's slice of the sequence
    results = {}
    for name, module in (("ref", ref), ("new", new)):
        x = full[tp * part:(tp + 1) * part].clone().requires_grad_(True)
        out, _ = module(x, attention_mask=None)
        # Megatron's own backward call (the C++ engine, as its schedules run it): under the CPU
        # backend Tensor.backward runs outside the device mode (compat/cpu.py) and SP's
        # backward all-gather would allocate on "cuda".
        custom_backward((out * grad_full[tp * part:(tp + 1) * part]).sum(), None)
        results[name] = (out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()})
    (o1, g1, w1), (o2, g2, w2) = results["ref"], results["new"]

    def rel(a, b):  # the largest difference relative to the largest reference value
        return ((a - b).abs().max() / a.abs().max()).item()

    return {"out": rel(o1, o2), "grad_input": rel(g1, g2),
            "grad_weights": max(rel(w1[n], w2[n]) for n in w1),
            "core": type(new.core_attention).__name__,
            "heads_per_rank": new.core_attention.num_attention_heads_per_partition,
            "groups_per_rank": new.core_attention.num_query_groups_per_partition,
            "causal": new.core_attention.attn_mask_type == AttnMaskType.causal}


def main(argv) -> None:
    out_dir = argv[argv.index("--out") + 1]
    os.makedirs(out_dir, exist_ok=True)
    cpu.install()  # the CPU backend, as a training installs it (a no-op on a GPU)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        model_parallel_cuda_manual_seed(1234)
        result = {"mha": _compare(8), "gqa": _compare(2)}
    finally:
        parallel_state.destroy_model_parallel()
    with open(os.path.join(out_dir, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(result, f)
