"""megatron-ext kernels, installed as ``megatron_ext_kernels`` (the directory is ``kernels/``).

Each fast path sits beside the plain-PyTorch reference it is tested against:

* ``stem_lookup``: STEM table row lookup with a row-sparse backward into Megatron's ``main_grad``
  (PyTorch ops; the fused Triton lookup-and-gate kernel is tested against it).
* ``structmoe_routed``: StructMoE's router top-k and the selected experts' codes fused in one
  Triton kernel, forward and backward (``--structmoe-backend triton``), tested against
  ``route()`` and the ``reference`` backend of ``megatron_ext/structmoe/routed.py``.
"""
