"""Offline tools, apart from the trainer glue (``megatron_ext/training/``): data preparation
(``python -m megatron_ext.tools.data_prep``), the parameter/FLOPs/memory estimate and
``--dry-run``, the analytic FLOPs accounting, and reading a run's tensorboard scalars."""
