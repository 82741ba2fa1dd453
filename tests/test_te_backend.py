"""STEM layers on the Transformer Engine backend (GPU with TE only; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.models.specs import te_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                                 reason="needs a GPU with Transformer Engine")]


def test_stem_model_with_te_specs_trains_a_step(mcore_single_rank):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.models.gpt import TokenIdsGPTModel
    from megatron_ext.stem.config import StemConfig
    from megatron_ext.stem.mlp import StemMLP
    from megatron_ext.stem.specs import decoder_block_spec

    config = TransformerConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128,
                               num_attention_heads=4, gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False,
                               normalization="RMSNorm", bf16=False, params_dtype=torch.float32)
    model = TokenIdsGPTModel(config=config,
                             transformer_layer_spec=decoder_block_spec(
                                 config, StemConfig(ratio="1/2"), 256, use_te=True),
                             vocab_size=256, max_sequence_length=32,
                             position_embedding_type="rope").cuda()
    stem_layers = [i for i, layer in enumerate(model.decoder.layers)
                   if isinstance(layer.mlp, StemMLP)]
    assert stem_layers == [1, 3]
    tokens = torch.randint(0, 256, (2, 32), device="cuda")
    pos = torch.arange(32, device="cuda").unsqueeze(0).expand(2, 32)
    loss = model(tokens, pos, None, labels=tokens).float().mean()
    loss.backward()
    table = model.decoder.layers[1].mlp.table
    assert torch.isfinite(loss)
    assert torch.count_nonzero(table.grad[tokens.flatten()]) > 0
