"""``--structmoe-backend auto`` follows the measurements: on a GPU the backend whose GPT step was
fastest in the GPU result that ``routed.GPU_EVIDENCE`` names, on the CPU grouped."""

from __future__ import annotations

import json
import os

import torch

from megatron_ext.structmoe import routed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_default_is_the_fastest_measured_backend(monkeypatch):
    with open(os.path.join(ROOT, routed.GPU_EVIDENCE)) as f:
        result = json.load(f)
    assert "H100" in result["device"] or "H200" in result["device"], result["device"]
    backends = {n: ms for n, ms in result["step_ms"].items() if n in routed.BACKENDS
                or n in routed.FUSED_BACKENDS}
    assert len(backends) >= 2, result["step_ms"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert routed.resolve_backend("auto") == min(backends, key=backends.get)


def test_cpu_default_is_grouped(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert routed.resolve_backend("auto") == "grouped"
    assert routed.resolve_backend("triton") == "triton"
