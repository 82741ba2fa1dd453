"""``launch/pretrain.py``'s training with Dynamo's cache of the families' compiled regions emptied
first: a ``"module"`` item of a ``tests/dist/multi_config.py`` plan (``main(argv)``, the same
flags as ``launch/pretrain.py``).

In one process Dynamo keeps what it compiled for a function's code across trainings: a later
training whose region has the same shapes and guards runs the code an earlier training compiled,
without compiling, and so without the ``TORCH_LOGS=bytecode`` lines that name the region
(tests/test_compiled_training.py reads them). With the regions' entries dropped, each training
compiles its own regions, as the one training of a process does outside the tests. Only the
regions' code: what upstream compiles (its fused bias-dropout and SwiGLU) stays cached, and
``torch._dynamo.reset()`` of everything doubled the compile time of the test's trainings.
"""

from __future__ import annotations

import torch

from megatron_ext.sigma.router import compiled_routing
from megatron_ext.structmoe.balance import lbl_statistics
from megatron_ext.structmoe.routed import dense_masked_route_tail, route_head
from megatron_ext.training.entry import main as entry_main
from megatron_ext_kernels.stem_gate import gate_product

# Every function a family passes to megatron_ext.compiled.compile_region.
REGIONS = (compiled_routing, lbl_statistics, dense_masked_route_tail, route_head, gate_product)


def main(argv) -> None:
    for fn in REGIONS:
        torch._dynamo.reset_code(fn.__code__)
    entry_main(argv)
