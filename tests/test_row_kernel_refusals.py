"""Every refusal of the compiled row kernels (``kernels/row_adam_cpu.py``) reaches
Python as one ``RowKernelError`` naming the function, the row (or tensor) and why, with nothing
written: for each exported function and each of its checks, with a team of 16 threads, while
another Python thread holds the GIL, and on the tables' worker thread, whose error the training
thread gets when it waits. On a GPU machine's host the refusal of ``catch_up_rows_`` (a C++
exception thrown out of a call that had released the GIL) died with SIGSEGV; the kernels now
throw nothing (a plain C library that returns its refusals)."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_ext.stem.runtime.row_adam import AdamHyper, RowClock
from megatron_ext_kernels import row_adam_cpu
from megatron_ext_kernels.row_adam_cpu import RowKernelError

ROWS, WIDTH, U = 40, 24, 30


@pytest.fixture(scope="module")
def kernel():
    found = row_adam_cpu.load()
    if found is None:
        pytest.skip("no C++ compiler")
    return found


def _clock() -> RowClock:
    """A sparse optimizer's clock after U iterations (betas 0.5, 0.9: a horizon of 47)."""
    clock = RowClock()
    for t in range(1, U + 1):
        clock.advance(t, AdamHyper(1e-2, 0.5, 0.9, 1e-3, 0.1))
    return clock


def _state(seed: int = 0) -> dict:
    """Valid arguments of every kernel: a shard, its moments, rows current 0..U-1, ten rows to
    step or read."""
    g = torch.Generator().manual_seed(seed)
    last = torch.randint(0, U, (ROWS,), generator=g)
    return {"p": torch.randn(ROWS, WIDTH, generator=g), "m": torch.randn(ROWS, WIDTH, generator=g),
            "v": torch.rand(ROWS, WIDTH, generator=g),
            "rows": torch.randperm(ROWS, generator=g)[:10],
            "last": last, "touched": (last - 3).clamp(min=0), "clock": _clock().kernel_state(U),
            "g": torch.randn(10, WIDTH, generator=g),
            "out": torch.zeros(10, WIDTH, dtype=torch.bfloat16)}


def _call(kernel, fn: str, a: dict):
    if fn == "sparse_adamw_":
        return kernel.sparse_adamw_(a["p"], a["m"], a["v"], a["rows"], a["g"], a["last"],
                                    a["touched"], a["clock"], 1e-2, 1.5, 0.999)
    if fn == "catch_up_rows_":
        return kernel.catch_up_rows_(a["p"], a["m"], a["v"], a["rows"], a["last"], a["touched"],
                                     a["clock"])
    if fn == "gather_rows_":
        return kernel.gather_rows_(a["p"], a["rows"], a["out"])
    return kernel.gather_current_rows_(a["p"], a["m"], a["v"], a["rows"], a["last"],
                                       a["touched"], a["clock"], a["out"])


def _set(key, value):
    def change(a):
        a[key] = value(a) if callable(value) else value
    return change


def _row(key, position, value):
    """``a[key]`` at the row ``rows[position]`` set to ``value(a)``."""
    def change(a):
        new = value(a) if callable(value) else value
        a[key] = a[key].clone()
        a[key][a["rows"][position]] = new
    return change


def _index(position, value):
    def change(a):
        a["rows"] = a["rows"].clone()
        a["rows"][position] = value
    return change


def _clock_part(i, value):
    def change(a):
        c = list(a["clock"])
        c[i] = value(c) if callable(value) else value
        a["clock"] = tuple(c)
    return change


CLOCKED = ("sparse_adamw_", "catch_up_rows_", "gather_current_rows_")
ROWWISE = CLOCKED + ("gather_rows_",)
# (functions, what is wrong, the message's pattern after "<function>: ")
CASES = [
    (ROWWISE, _index(3, ROWS + 7), rf"row {ROWS + 7} \(position 3 of 10\) is outside the "
                                   rf"shard's {ROWS} rows"),
    (ROWWISE, _index(9, -1), rf"row -1 \(position 9 of 10\) is outside the shard's {ROWS} rows"),
    (("gather_rows_",), _index(0, 1 << 40), rf"row {1 << 40} \(position 0 of 10\) is outside"),
    (CLOCKED, _row("last", 2, U + 5), rf"row \d+ was last brought up to date at iteration "
                                      rf"{U + 5}, outside the clock's 0\.\.{U}"),
    (CLOCKED, _row("last", 4, -2), r"row \d+ was last brought up to date at iteration -2, "
                                   r"outside the clock's 0\.\."),
    (CLOCKED, _row("touched", 5, lambda a: a["last"][a["rows"][5]] + 1),
     r"row \d+ was last given a gradient at iteration \d+, outside 0\.\.\d+ \(its last "
     r"iteration\)"),
    (CLOCKED, _row("touched", 6, -1), r"row \d+ was last given a gradient at iteration -1"),
    (CLOCKED, _clock_part(5, U + 1), rf"iteration {U + 1} is outside the clock's 0\.\.{U}"),
    (CLOCKED, _clock_part(1, lambda c: c[1][1:]), r"the clock's series do not cover iteration "
                                                  rf"{U} \(window {U}, needs {U + 1}"),
    (CLOCKED, _clock_part(4, 0), r"iteration 30 is outside the clock's 0\.\.30 \(horizon 0\)"),
    (CLOCKED, _clock_part(0, lambda c: c[0].float()), r"the clock's decay series must be a "
                                                      r"contiguous 1-D torch.float64 CPU tensor"),
    (CLOCKED, _clock_part(0, None), r"the clock's decay series must be .* got NoneType"),
    (CLOCKED, _set("clock", (1, 2)), r"the clock must be RowClock.kernel_state\(u\), got tuple"),
    (ROWWISE, _set("p", lambda a: a["p"].t().contiguous().t()),
     r"(p|src) must be a contiguous 2-D torch.float32 CPU tensor, got strided"),
    (ROWWISE, _set("p", lambda a: a["p"].double()), r"(p|src) must be .* got contiguous "
                                                    r"torch.float64"),
    (ROWWISE, _set("p", lambda a: torch.empty(ROWS, WIDTH, device="meta")),
     r"(p|src) must be .* CPU tensor, got contiguous torch.float32 meta"),
    (CLOCKED, _set("m", lambda a: a["m"][:, :-1].contiguous()),
     r"rows and moments of one shape, got p \(40, 24\), m \(40, 23\)"),
    (CLOCKED, _set("v", lambda a: a["v"].view(-1)), r"v must be a contiguous 2-D"),
    (ROWWISE, _set("rows", lambda a: a["rows"].int()), r"(rows|index) must be a contiguous 1-D "
                                                       r"torch.int64 CPU tensor, got contiguous "
                                                       r"torch.int32"),
    (CLOCKED, _set("last", lambda a: a["last"][:-1].clone()),
     rf"last needs one iteration per row \({ROWS}\), got {ROWS - 1}"),
    (CLOCKED, _set("touched", lambda a: a["touched"].float()), r"touched must be a contiguous"),
    (("sparse_adamw_",), _set("g", lambda a: a["g"][:-1].clone()),
     rf"g must be \[10, {WIDTH}\] \(rows x width\), got \(9, {WIDTH}\)"),
    (("sparse_adamw_",), _set("g", lambda a: a["g"].half()), r"g must be a contiguous 2-D "
                                                             r"torch.float32"),
    (("gather_rows_", "gather_current_rows_"), _set("out", lambda a: a["out"].double()),
     r"out must be a contiguous 2-D torch.float32 or torch.bfloat16 or torch.float16"),
    (("gather_rows_", "gather_current_rows_"), _set("out", lambda a: a["out"][:, 1:]),
     r"out must be .* got strided"),
    (("gather_rows_", "gather_current_rows_"), _set("out", lambda a: a["out"][1:].clone()),
     rf"out must be \[10, {WIDTH}\] \(index x width\), got \(9, {WIDTH}\)"),
]
PARAMS = [pytest.param(fn, change, match, id=f"{fn}-{i}")
          for i, (fns, change, match) in enumerate(CASES) for fn in fns]


def _tensors(a: dict) -> list:
    return [(k, x.clone()) for k, x in a.items() if isinstance(x, torch.Tensor)
            and x.device.type == "cpu"]


@pytest.mark.parametrize("fn,change,match", PARAMS)
def test_every_refusal_names_the_function_and_why_and_writes_nothing(kernel, fn, change, match):
    args = _state()
    change(args)
    before = _tensors(args)
    with pytest.raises(RowKernelError, match=rf"^{fn}: {match}") as refused:
        _call(kernel, fn, args)
    assert "\n" not in str(refused.value)  # one line
    for key, x in before:
        assert torch.equal(args[key], x), f"{fn} wrote {key} although it refused the call"


def _refusals(kernel) -> int:
    """Each function's refusal of a row outside the shard, checked."""
    for fn in ROWWISE:
        args = _state(seed=1)
        _index(3, ROWS + 7)(args)
        with pytest.raises(RowKernelError, match=rf"^{fn}: row {ROWS + 7} \(position 3"):
            _call(kernel, fn, args)
    return len(ROWWISE)


def test_refusals_with_a_team_of_16_threads_while_another_thread_holds_the_gil(kernel):
    """The crash's circumstances: a team of 16 threads (the GPU host's cores), the call made on
    a thread other than the main one (the tables' worker) while the main thread runs Python (it
    holds the GIL whenever the worker gives it up), many times over. Every refusal arrives as
    the error, and valid calls after them give the bits of a one-thread team."""
    want = {}
    for fn in ROWWISE:  # the reference bits, one thread
        args = _state(seed=2)
        row_adam_cpu.set_threads(1)
        try:
            _call(kernel, fn, args)
        finally:
            row_adam_cpu.set_threads(0)
        want[fn] = _tensors(args)
    stop, spins, errors = threading.Event(), [0], []

    def hold_the_gil():  # pure Python: gives the GIL up only at the switch interval
        while not stop.is_set():
            spins[0] += 1

    def worker():
        try:
            for _ in range(3):
                _refusals(kernel)
                for fn in ROWWISE:
                    args = _state(seed=2)
                    _call(kernel, fn, args)
                    for (key, x), (_, y) in zip(_tensors(args), want[fn]):
                        assert torch.equal(x, y), (fn, key)
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    row_adam_cpu.set_threads(16)
    spinner = threading.Thread(target=hold_the_gil)
    spinner.start()
    try:
        assert kernel.team_size(row_adam_cpu.threads()) == 16
        caller = threading.Thread(target=worker)
        caller.start()
        caller.join()
    finally:
        stop.set()
        spinner.join()
        row_adam_cpu.set_threads(0)
    assert not errors, errors[0]
    assert spins[0] > 0


def test_a_refusal_on_the_tables_worker_reaches_the_waiting_thread(kernel):
    """A row step refused on the tables' worker thread (``stem/runtime/worker.py``) is raised, as the
    kernel's error, in the thread that waits for the worker (the training thread's ``drain``),
    and the worker goes on serving later tasks."""
    from megatron_ext.stem.runtime.worker import HostWorker

    WORKER = HostWorker()  # a training's worker (stem/run.py makes one)
    args = _state(seed=3)
    _row("last", 0, U + 9)(args)
    WORKER.submit(lambda: _call(kernel, "sparse_adamw_", args))
    with pytest.raises(RowKernelError, match=rf"^sparse_adamw_: row \d+ was last brought up to "
                                             rf"date at iteration {U + 9}"):
        WORKER.wait()
    assert WORKER.submit(lambda: 7).result(timeout=60) == 7
    WORKER.close()


@pytest.mark.parametrize("flags,machine,want", [
    ("cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave "
     "avx512f avx512bw avx512cd avx512dq avx512vl", "x86_64", ["-march=x86-64-v4"]),
    ("cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave "
     "avx512f", "x86_64", ["-march=x86-64-v3"]),
    ("cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 fma abm movbe xsave", "x86_64",
     ["-march=x86-64-v2"]),  # no F16C: not v3
    ("sse2", "x86_64", []),
    ("", "aarch64", []),
])
def test_the_kernels_are_built_for_a_named_level_the_cpu_reports(flags, machine, want):
    assert row_adam_cpu.arch_flags(set(flags.split()), machine) == want
