"""A run's plan from numbers alone, nothing built: the model's shape (parameters, FLOPs per
token: ``model_shape.py``), its parallel layout and Megatron's rules for it (``layout.py``) and
the memory per rank (``estimate.py``).

A layer of its own, between the trainer seam and the families: the trainer reads it (the
``--dry-run`` report, the start-up memory check of ``training/preflight.py``, the run report's
FLOPs), and so do the offline tools and the launch scripts (the scaling harness, the main job);
it reads the families only through ``models/`` (the registry's terms) and STEM's variant names.
It is not ``models/``, which builds modules on Megatron-Core, nor ``tools/``, whose command lines
the trainer must not import (docs/architecture.md: no import runs up the layers)."""
