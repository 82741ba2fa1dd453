"""megatron-ext kernels: the top-level folder ``kernels/``, imported as ``megatron_ext_kernels``
(``setup.py`` maps the name to the folder; a top-level ``kernels`` would collide with the Hugging
Face package of that name).

Each fast path sits beside the plain-PyTorch reference it is tested against:

* ``stem_lookup``: STEM table row lookup with a row-sparse backward into Megatron's ``main_grad``
  (PyTorch ops).
* ``stem_gate``: the fused STEM lookup-and-gate Triton kernel (``--stem-kernel``), tested against
  its plain-PyTorch reference ``stem_gate_reference``.
* ``structmoe_routed``: StructMoE's router top-k and the selected experts' codes fused in one
  Triton kernel, forward and backward (``--structmoe-backend triton``), tested against
  ``route()`` and the ``reference`` backend of ``megatron_ext/structmoe/routed.py``.

``_triton_runtime`` holds what both Triton modules share: whether Triton can run here, the lazy
import of the jitted kernels, and the offline GPU build that reports their resource use.
``_build_dir`` says where the JIT-built CPU extensions (``row_adam_cpu``'s kernels, DeepSpeed's
``cpu_adam``) are built: a folder per virtualenv, torch version and CPU; ``deepspeed_builder``
DeepSpeed's ``cpu_adam`` builder, its question about the CPU (a subprocess per call) answered once
per machine and kept in that folder.
"""
