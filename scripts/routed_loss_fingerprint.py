"""The exact losses, recorded router metrics and final weights of seven short trainings of tiny
StructMoE and Sigma GPTs on the CPU (one process, 4 Adam steps of 2 micro-batches each): StructMoE
dense-masked, grouped and reference (plain GELU, additive), dense-masked GLU and grouped additive
on SwiGLU with top-2 and an aux-loss coefficient; Sigma with the global and the top-1 LBL. Run it
on two checkouts and compare the JSONs to show that a change of the routed paths leaves the
numbers bit for bit (issue 50, 2026-11-28: the router metrics' records, the in-place gate).

    python scripts/routed_loss_fingerprint.py CHECKOUT OUT.json
"""

import argparse
import hashlib
import json
import os
import sys

if len(sys.argv) != 3:
    raise SystemExit(__doc__)
repo = os.path.abspath(sys.argv[1])
# The checkout's own package and benchmarks, ahead of the installed one.
sys.path.insert(0, repo)
sys.path.insert(0, os.path.join(repo, "benchmarks"))
os.chdir(repo)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import RunSetup  # noqa: E402
ns = argparse.Namespace(layers=3, hidden=32, heads=4, ffn=96, experts=8, rank=4, topk=1, seq=24,
                        micro_batch=2, vocab=128, dtype=None, reps=1, warmup=0, repeats=1,
                        json=None, _gpu_reps=1, _cpu_reps=1)
RunSetup(ns)
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker  # noqa: E402
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler  # noqa: E402


def sigma_model(lbl):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_ext.sigma.config import SigmaConfig
    from megatron_ext.sigma.specs import sigma_block_spec
    config = TransformerConfig(
        num_layers=3, hidden_size=32, ffn_hidden_size=16, num_attention_heads=4,
        num_query_groups=2, qk_layernorm=True, normalization="RMSNorm", activation_func=F.silu,
        gated_linear_unit=True, add_bias_linear=False, num_moe_experts=8, moe_ffn_hidden_size=16,
        moe_router_topk=1, moe_router_pre_softmax=True, moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall", bias_activation_fusion=False,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0)
    sigma = SigmaConfig(num_layers=3, num_experts=8, topk=1, lbl=lbl, lbl_coeff=1e-2)
    spec = sigma_block_spec(config, sigma, use_te=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=128,
                    max_sequence_length=24, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def structmoe_model(backend, gated=False, fusion="additive", topk=1, coeff=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_ext.models.specs import block_spec
    from megatron_ext.structmoe.config import StructMoEConfig
    from megatron_ext.structmoe.specs import structmoe_layers_fn
    config = TransformerConfig(
        num_layers=3, hidden_size=32, ffn_hidden_size=96, num_attention_heads=4,
        activation_func=F.silu if gated else F.gelu, gated_linear_unit=gated,
        add_bias_linear=False,
        bias_activation_fusion=False, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, normalization="LayerNorm")
    kw = dict(num_experts=8, rank=4, topk=topk, backend=backend, fusion=fusion)
    if coeff is not None:
        kw["aux_loss_coeff"] = coeff
    spec = block_spec(config, use_te=False, layer_fn=structmoe_layers_fn(StructMoEConfig(**kw)))
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=128,
                    max_sequence_length=24, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


CONFIGS = {
    "dense-masked": lambda: structmoe_model("dense-masked"),
    "grouped": lambda: structmoe_model("grouped"),
    "reference": lambda: structmoe_model("reference"),
    "dense-masked_glu_gated_top2": lambda: structmoe_model("dense-masked", True, "glu", 2,
                                                           0.05),
    "grouped_gated_additive_top2": lambda: structmoe_model("grouped", True, "additive", 2, 0.05),
    "sigma_global": lambda: sigma_model("global"),
    "sigma_top1": lambda: sigma_model("top1"),
}

def hx(t):
    return [float(v).hex() for v in t.detach().reshape(-1).tolist()]

out = {}
for name, make in CONFIGS.items():
    torch.manual_seed(0)
    model = make()
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    tracker = get_moe_metrics_tracker()
    tracker.metrics.clear()
    g = torch.Generator().manual_seed(1)
    rec = {"losses": [], "metrics": []}
    for _ in range(4):
        tokens = torch.randint(0, 128, (2, 24), generator=g)
        labels = torch.roll(tokens, -1, 1)
        pos = torch.arange(24).unsqueeze(0).expand_as(tokens)
        opt.zero_grad()
        for mb in range(2):  # two micro-batches per step
            loss = model(tokens[mb:mb + 1], pos[mb:mb + 1], None,
                         labels=labels[mb:mb + 1]).float().mean()
            loss.backward()
            rec["losses"].append(float(loss).hex())
        if name.startswith("sigma"):
            from megatron_ext.sigma.router import end_global_batch
            stats = end_global_batch([model])
            rec["metrics"].append({str(k): hx(v.f) for k, v in sorted(stats.items())})
        else:
            rec["metrics"].append({k: hx(e.values) for k, e in sorted(tracker.metrics.items())})
            tracker.clear()
        opt.step()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    rec["params_sha256"] = h.hexdigest()
    out[name] = rec
    print(name, rec["losses"][-1], rec["params_sha256"][:16])
import megatron_ext.structmoe.balance as _b  # noqa: E402
out["_source"] = _b.__file__  # which checkout ran
print("ran", _b.__file__)
with open(sys.argv[2], "w") as f:
    json.dump(out, f, indent=1)
