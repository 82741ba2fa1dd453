"""Offline tools, the top layer with ``convert/`` (docs/architecture.md): data preparation
(``python -m megatron_ext.tools.data_prep``), a profiler trace's summary
(``python -m megatron_ext.tools.trace_summary``), a distributed-optimizer checkpoint re-saved
in the fully reshardable format (``python -m megatron_ext.tools.reshardable``) and reading a
run's tensorboard scalars. What the
trainer shares with them lives below it: the estimate behind ``--dry-run`` in
``megatron_ext/planning/``, the data manifest in ``megatron_ext/data_manifest.py``."""
