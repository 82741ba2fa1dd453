"""Loading DeepSpeed's ``cpu_adam`` op (STEM's dense host optimizer) asks py-cpuinfo, a Python
subprocess per call, once per machine: DeepSpeed's own answers, kept beside the builds
(``kernels/deepspeed_builder.py``)."""

from __future__ import annotations

import pytest

op_builder = pytest.importorskip("deepspeed.ops.op_builder")
cpuinfo = pytest.importorskip("cpuinfo")

from megatron_ext.stem.runtime import row_adam  # noqa: E402
from megatron_ext_kernels import deepspeed_builder  # noqa: E402

# A CPU as py-cpuinfo reports one (stands in for its subprocess, which takes ~1.2 s a call).
CPU = {"arch": "X86_64", "flags": ["avx", "avx2", "fma", "sse4_2"]}


class FakeOp:
    def create_adam(self, *args):
        pass


@pytest.fixture
def asked(monkeypatch, tmp_path):
    """The calls of py-cpuinfo; the builds' folder a fresh one, no answers in memory; a builder's
    ``load`` computes its flags as DeepSpeed's JIT load does first, and builds nothing."""
    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or dict(CPU))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(deepspeed_builder, "_ANSWERS", {})
    monkeypatch.setattr(op_builder.CPUAdamBuilder, "load",
                        lambda self, verbose=False: (self.cxx_args(), FakeOp())[1])
    return calls


def test_the_cpu_adam_load_asks_the_cpu_once_per_machine(asked):
    assert isinstance(row_adam.deepspeed_op.__wrapped__(), FakeOp)
    assert len(asked) == 2  # DeepSpeed's two questions (cpu_arch, simd_width), asked once
    row_adam.deepspeed_op.__wrapped__()
    assert len(asked) == 2  # the same process: from memory
    deepspeed_builder._ANSWERS.clear()  # the next process on this machine: from the file
    row_adam.deepspeed_op.__wrapped__()
    assert len(asked) == 2


def test_the_flags_are_deepspeeds_own(asked):
    ours = deepspeed_builder.builder()
    assert isinstance(ours, op_builder.CPUAdamBuilder)
    theirs = op_builder.CPUAdamBuilder()
    assert ours.cxx_args() == theirs.cxx_args()
    assert ours.absolute_name() == theirs.absolute_name() and ours.name == theirs.name
    assert "-D__AVX256__" in ours.cxx_args()  # the fake CPU's: DeepSpeed's choice for avx2
    deepspeed_builder._ANSWERS.clear()
    assert deepspeed_builder.builder().cxx_args() == theirs.cxx_args()  # read back the same


def test_another_cpu_or_version_is_asked_again(tmp_path):
    path = deepspeed_builder.answers_path(str(tmp_path), cpu="a", versions="v1")
    assert path.startswith(str(tmp_path))
    assert path == deepspeed_builder.answers_path(str(tmp_path), cpu="a", versions="v1")
    assert path != deepspeed_builder.answers_path(str(tmp_path), cpu="b", versions="v1")
    assert path != deepspeed_builder.answers_path(str(tmp_path), cpu="a", versions="v2")


def test_a_damaged_answers_file_is_asked_again(tmp_path, monkeypatch):
    monkeypatch.setattr(deepspeed_builder, "_ANSWERS", {})
    path = str(tmp_path / "answers.json")
    with open(path, "w") as f:
        f.write('{"cpu_arch": "-march=nat')  # a writer stopped midway (renames make it rare)
    answers = {"cpu_arch": "-march=native", "simd_width": "-D__AVX512__"}
    assert deepspeed_builder.cpu_answers(lambda: answers, path) == answers
    deepspeed_builder._ANSWERS.clear()
    assert deepspeed_builder.cpu_answers(lambda: pytest.fail("asked again"), path) == answers
