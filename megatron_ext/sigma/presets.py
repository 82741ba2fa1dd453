"""The Sigma family's fixed flags, added to the command line after preset expansion.

Presets themselves (data files under ``launch/presets``, ``--preset`` / ``--sigma-preset``) are
expanded by :mod:`megatron_ext.training.presets`.

``--model-family sigma`` fixes what the Sigma layer is (report, Sec. 2): top-1 unless
``--moe-router-topk`` says otherwise, pre-softmax top-k (Megatron refuses top-1 without it), an
FP32 router, QK-norm and no upstream aux loss (the family's ``--sigma-lbl`` replaces it). Those
flags are added when absent; contradicting values given explicitly are refused later by
``check_args`` in ``sigma/family.py`` with a message.
"""

from __future__ import annotations

FAMILY_FLAGS = (
    ("--moe-router-topk", "1"),  # Megatron's default is 2; Sigma's target sparsity is top-1
    ("--moe-router-pre-softmax", None),
    ("--moe-router-dtype", "fp32"),
    ("--moe-router-load-balancing-type", "none"),
    ("--qk-layernorm", None),
)

