"""The torch ops of one read of a micro-batch's rows while a sparse table step is owed: what the
host worker runs for the next step's first micro-batch (``TableStore.gather``: the owed step's
rows that the read needs are stepped first, ``schedule.OwedStep.settle``, then every row read is
brought up to date and gathered). On a GPU each op of the GPU tier is a kernel launch of about
5-10 us, and each host op a few us of Python and dispatch on the worker; this counts them per
phase with a ``TorchDispatchMode``, the GPU tier on the ``meta`` device (its torch path runs
without data, so its ops are told apart from the host's: ``device``, views apart, and ``host``).

Phases: ``step: bookkeeping`` (the owed step's choice of rows, its gradients' split by tier),
``step: GPU tier`` (the GPU tier's rows stepped with torch ops), ``step: host tier`` (the host
rows stepped by the row kernel: ops around its C calls), ``read: GPU tier settle`` (rows read but
not stepped, brought up to date in place), ``read: host tier`` (``gather_current_rows_``) and
``read: rest`` (the split by tier, the output's assembly). ``would sync on the device``: device
ops that wait for the GPU (``.item()``, ``nonzero``, ``unique``, a boolean-mask index).

The store is the real one (``TableStore``, ``cpu`` or ``tiered`` placement), its optimizer
``RowAdamW``/``TieredRowAdamW`` sparse, the owed step made by ``TableSteps.step_table`` as in
training. Rows are drawn Zipf(1) over the owned rows (local order: hot first); a few steps run
first so that rows owe catch-ups of different lengths; each timed read gets a new owed step.
Times: medians of ``--reps`` reads, wall and process CPU time, the GPU tier on ``--device``
(on the CPU its torch path is forced: there it would take the host kernel); the op count is
that of one read, without the counter in the timings.

    .venv/bin/python benchmarks/stem_catchup_ops.py     # 2 tables x 30000 rows x 8192, 4096 read
    .venv/bin/python benchmarks/stem_catchup_ops.py --rows 8000 --width 2048 --verbose
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import report_json, sync  # noqa: E402

SYNCING = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive",
           "masked_select", "item"}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched, per phase (``phase`` is a stack set by ``in_phase``):
    ``device`` the ops on a tensor of the GPU tier's device (``--count-device``: ``meta``, where
    the GPU tier's ops run without data), views apart; ``host`` the others."""

    def __init__(self, default: str, device: str):
        super().__init__()
        self.phases = [default]
        self.device = device
        self.counts = collections.defaultdict(collections.Counter)
        self.kinds = collections.defaultdict(collections.Counter)
        self.syncs = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        phase = self.phases[-1]
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        on_device = any(t.device.type == self.device for t in tensors)
        kind = ("device view" if func.is_view else "device") if on_device else "host"
        self.counts[phase][f"{kind}:{name}"] += 1
        self.kinds[phase][kind] += 1
        if on_device and (name in SYNCING or (name in ("index", "index_put", "index_put_") and any(
                t.dtype == torch.bool for t in tensors))):
            self.syncs[phase] += 1
        return out


def in_phase(counter_ref: list, phase: str, fn):
    """``fn`` run with ``phase`` on the counter's stack (when one is counting)."""

    def wrapped(*args, **kwargs):
        counter = counter_ref[0]
        if counter is None:
            return fn(*args, **kwargs)
        counter.phases.append(phase)
        try:
            return fn(*args, **kwargs)
        finally:
            counter.phases.pop()

    return wrapped


class _Worker:
    """The host worker as ``TableSteps.step_table`` sees it: the owed step is kept, not run."""

    def hand_over(self, tensors):
        list(tensors)

    def submit_background(self, owed, after=None):
        return None

    def wait(self):
        return 0.0


class _Table:
    """What ``TableSteps.step_table`` needs of a chunk's ``StemTables``: a deferred read."""

    def __init__(self, store):
        self.store = store
        self.deferred = object()
        self.stats = collections.defaultdict(float)

    def release(self, fetch, after=None):
        pass


def build(placement: str, a, g, device: torch.device):
    from megatron_ext.stem.runtime.row_adam import RowAdamW, TieredRowAdamW
    from megatron_ext.stem.runtime.store import TableStore

    tables = [torch.randn(a.rows, a.width, generator=g) * 0.02 for _ in range(a.tables)]
    owned = torch.arange(a.rows)
    num_hot = int(a.rows * a.hot_fraction) if placement == "tiered" else None
    store = TableStore(tables, owned, placement, device, num_hot=num_hot)
    del tables
    if placement == "tiered":
        adam = TieredRowAdamW(store.shards, mode="sparse", lazy=store.lazy)
        if device.type == "cpu":
            # The GPU tier steps and catches up with torch ops, as it does on a GPU (on the CPU
            # it would take the host kernel).
            adam.hot.rowwise, store.lazy.hot._kernel = None, False
    else:
        adam = RowAdamW(store.shards, mode="sparse", lazy=store.lazy)
    return store, adam


def draw(weights, n, g):
    return torch.sort(torch.multinomial(weights, n, replacement=False, generator=g)).values


def step_grads(store, rows, first, g, width):
    """The row gradients of one step as the optimizer hands them to ``step_table`` (tiered:
    split by tier, the rows ``first`` reads first among the host rows)."""
    from megatron_ext.stem.runtime.tiers import split_layers

    layers = len(store.shards)
    summed = torch.randn(rows.numel(), layers * width, generator=g) * 1e-3
    per_layer = list(torch.split(summed, width, dim=1))  # as exchange.push leaves them
    if store.placement != "tiered":
        return [(rows, grad) for grad in per_layer]
    # Split as the optimizer splits them; the GPU tier's part on its device (layers of one
    # tensor), the host tier's on the host (as the optimizer's copy to the host leaves them).
    split = split_layers(store.shards, rows, per_layer, first)
    hot = torch.stack([tg.hot for _, tg in split]).to(store.shards[0].hot.device)
    for (_, tg), h in zip(split, hot.unbind(0)):
        tg.hot = h
    return split


class Scenario:
    """A store, its sparse optimizer and the steps before the read (the same for a seed)."""

    def __init__(self, placement: str, a, device: torch.device):
        from megatron_ext.stem.runtime.row_adam import AdamHyper
        from megatron_ext.stem.runtime.schedule import TableSteps

        self.a = a
        self.g = torch.Generator().manual_seed(0)
        self.store, self.adam = build(placement, a, self.g, device)
        self.hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        self.weights = torch.arange(1, a.rows + 1, dtype=torch.float64) ** -1.0
        self.steps = TableSteps("sparse", _Worker())
        self.table = _Table(self.store)
        self.counter = [None]
        store, adam, ref = self.store, self.adam, self.counter
        # Phases: wrappers on the instances (the calls go through their attributes).
        if placement == "tiered":
            for name in ("step_rows", "step_shards"):
                if hasattr(adam.hot, name):
                    setattr(adam.hot, name, in_phase(ref, "step: GPU tier",
                                                     getattr(adam.hot, name)))
                    setattr(adam.cold, name, in_phase(ref, "step: host tier",
                                                      getattr(adam.cold, name)))
            for name in ("settle", "settle_shards"):
                if hasattr(store.lazy.hot, name):
                    setattr(store.lazy.hot, name, in_phase(ref, "read: GPU tier settle",
                                                           getattr(store.lazy.hot, name)))
            host_lazy = store.lazy.cold
        else:
            for name in ("step_rows", "step_shards"):
                if hasattr(adam, name):
                    setattr(adam, name, in_phase(ref, "step: host tier", getattr(adam, name)))
            host_lazy = store.lazy
        for name in ("read_into", "settle", "settle_shards"):
            if hasattr(host_lazy, name):
                setattr(host_lazy, name, in_phase(ref, "read: host tier", getattr(host_lazy, name)))
        for _ in range(a.warmup_steps):  # rows owing catch-ups of different lengths
            self.owe_step()
            self.finish()

    def owe_step(self):
        """Begin a step of ``--step-rows`` touched rows and leave it owed to the store; returns
        the rows the next read asks for."""
        rows = draw(self.weights, self.a.step_rows, self.g)
        read = draw(self.weights, self.a.read_rows, self.g)
        grads = step_grads(self.store, rows, read, self.g, self.a.width)
        self.steps.step_table(self.table, self.adam, self.adam.begin_step(self.hyper), grads,
                              None)
        return read

    def read(self, rows):
        """What ``TableStore.gather`` does (its owed step's settle counted apart)."""
        store, counter = self.store, self.counter[0]
        if counter is not None:
            counter.phases.append("step: bookkeeping")
        try:
            if store.owed_step is not None:
                store.owed_step.settle(rows)
        finally:
            if counter is not None:
                counter.phases.pop()
        saved, store.owed_step = store.owed_step, None  # settled above: the read alone
        try:
            return store.gather(rows, torch.device(self.store.shards[0].device.type
                                                   if store.placement == "cpu" else
                                                   self.store.shards[0].hot.device.type),
                                torch.bfloat16)
        finally:
            store.owed_step = saved

    def finish(self):
        if self.store.owed_step is not None:
            self.store.owed_step.finish()


def run(placement: str, a) -> dict:
    # Times: the GPU tier on --device (the CPU: its torch path forced).
    scenario = Scenario(placement, a, torch.device(a.device))
    wall, cpu = [], []
    for _ in range(a.reps):
        read = scenario.owe_step()
        sync()
        start, start_cpu = time.perf_counter(), time.process_time()
        scenario.read(read)
        sync()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        scenario.finish()
    del scenario
    # Ops: the GPU tier on the meta device (its ops run without data, told apart from the host's).
    device = torch.device(a.count_device if placement == "tiered" else "cpu")
    scenario = Scenario(placement, a, device)
    read = scenario.owe_step()
    counter = OpCounter("read: rest", a.count_device)
    scenario.counter[0] = counter
    with counter:
        scenario.read(read)
    scenario.counter[0] = None
    scenario.finish()
    return {"ops": {p: dict(c) for p, c in counter.kinds.items()},
            "total": dict(sum(counter.kinds.values(), collections.Counter())),
            "would_sync_on_device": dict(counter.syncs),
            "by_op": {p: dict(c.most_common()) for p, c in counter.counts.items()},
            "read_ms": 1e3 * statistics.median(wall),
            "read_cpu_ms": 1e3 * statistics.median(cpu),
            "read_ms_all": [round(1e3 * t, 3) for t in wall]}


def grad_times(a, layers: int, kernel: str = "torch") -> dict:
    """Milliseconds of the gradient path with the GPU tier on ``--device`` (medians of
    ``--grad-reps``, the device synchronised after each part): ``split_ms`` the split by tier
    and, on a GPU, the host tier's gradients queued for their copy to the host
    (``transfer.stage_to_host``): the training thread's part; ``step_ms`` the whole owed table
    step (the worker's: the GPU tier's launches and the host tier's rows), its copies waited for."""
    from megatron_ext.stem.runtime.store import PinnedStaging
    from megatron_ext.stem.runtime.transfer import stage_to_host

    device = torch.device(a.device)
    b = argparse.Namespace(**vars(a))
    b.tables, b.warmup_steps = layers, 1
    scenario = Scenario("tiered", b, device)
    scenario.adam.hot.gpu_kernel = kernel  # the GPU tier's step: torch ops or one Triton kernel
    store, g = scenario.store, scenario.g
    staging = PinnedStaging() if device.type == "cuda" else None
    stream = torch.cuda.Stream() if device.type == "cuda" else None
    split_ms, step_ms = [], []
    for _ in range(a.grad_reps):
        rows = draw(scenario.weights, a.step_rows, g)
        read = draw(scenario.weights, a.read_rows, g)
        summed = (torch.randn(rows.numel(), layers * a.width, generator=g) * 1e-3).to(device)
        sync()
        start = time.perf_counter()
        split = split_table(store.shards, rows, list(torch.split(summed, a.width, dim=1)), read)
        arrived = None
        if staging is not None:
            views, arrived = stage_to_host([tg.cold for _, tg in split], staging, stream,
                                           [tg.cold_first for _, tg in split])
            for (_, tg), view in zip(split, views):
                tg.cold = view
        sync()
        mid = time.perf_counter()
        scenario.steps.step_table(scenario.table, scenario.adam,
                                  scenario.adam.begin_step(scenario.hyper), split, arrived)
        scenario.finish()
        sync()
        split_ms.append(1e3 * (mid - start))
        step_ms.append(1e3 * (time.perf_counter() - mid))
        del split, summed
    return {"device": str(device), "kernel": kernel, "split_ms": statistics.median(split_ms),
            "step_ms": statistics.median(step_ms), "split_ms_all": split_ms,
            "step_ms_all": step_ms}


ORDER = ("step: bookkeeping", "step: GPU tier", "step: host tier", "read: GPU tier settle",
         "read: host tier", "read: rest")
GRAD_ORDER = ("grads: split", "grads: staging to host", "step: bookkeeping", "step: GPU tier",
              "step: host tier")


class _Staging:
    """``store.PinnedStaging`` with its buffer on the count device: the copies into it stand for
    the device-to-host copies (one ``cudaMemcpyAsync`` each), counted as device ops."""

    def __init__(self, device: str):
        self.device = device

    def view(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def record(self) -> None:
        pass

    def take_event(self):
        return None


class _NoCuda:
    """``transfer.stage_to_host``'s CUDA streams and events as no-ops (the count runs without a
    GPU); ``record_stream`` (no kernel, no copy) is not counted."""

    class _Event:
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def query(self):
            return True

    class _Stream:
        def wait_event(self, event):
            pass

    def __enter__(self):
        import contextlib

        self.saved = (torch.cuda.Event, torch.cuda.current_stream, torch.cuda.stream,
                      torch.Tensor.record_stream)
        torch.cuda.Event = self._Event
        torch.cuda.current_stream = lambda *a, **k: self._Stream()
        torch.cuda.stream = lambda s: contextlib.nullcontext()
        torch.Tensor.record_stream = lambda self_, s: None
        return self

    def __exit__(self, *exc):
        (torch.cuda.Event, torch.cuda.current_stream, torch.cuda.stream,
         torch.Tensor.record_stream) = self.saved


def split_table(shards, rows, per_layer, first):
    """What ``StemTablesOptimizer._grads_to_shards`` does with a tiered chunk's gradients before
    their copy to the host: the split by tier of every layer (``tiers.split_layers``)."""
    from megatron_ext.stem.runtime.tiers import split_layers

    return split_layers(shards, rows, per_layer, first)


def grad_phases(a, layers: int) -> dict:
    """The ops of one step's gradient path after backward for a tiered chunk of ``layers``
    layers, the GPU tier on the count device: the split by tier (``grads: split``), the host
    tier's gradients staged to the host (``grads: staging to host``), then the whole owed table
    step run to its end (``step: GPU tier``, ``step: host tier``, and its bookkeeping: the chunks'
    choice of rows and their gradients). The gradients come as ``StemTables.collect_grads``
    leaves them: the chunk's touched rows (host) and a column block per layer of one
    ``[rows, layers * width]`` tensor on the device (``exchange.push``)."""
    from megatron_ext.stem.runtime.transfer import stage_to_host

    b = argparse.Namespace(**vars(a))
    b.tables, b.warmup_steps = layers, 1
    scenario = Scenario("tiered", b, torch.device(a.count_device))
    store, g = scenario.store, scenario.g
    rows = draw(scenario.weights, a.step_rows, g)
    read = draw(scenario.weights, a.read_rows, g)
    summed = torch.empty(rows.numel(), layers * a.width, device=a.count_device)
    per_layer = list(torch.split(summed, [a.width] * layers, dim=1))
    counter = OpCounter("grads: split", a.count_device)
    scenario.counter[0] = counter
    with counter:
        split = split_table(store.shards, rows, per_layer, read)
        counter.phases.append("grads: staging to host")
        with _NoCuda():
            stage_to_host([tg.cold for _, tg in split], _Staging(a.count_device),
                          _NoCuda._Stream(),
                          [tg.cold_first for _, tg in split])
        counter.phases.pop()
    # The host tier steps gradients on the host (the staged copies: layers of one pinned buffer;
    # random, outside the count).
    staged = torch.randn((layers,) + tuple(split[0][1].cold.shape), generator=g) * 1e-3
    for (_, tg), cold in zip(split, staged.unbind(0)):
        tg.cold = cold
    plan = scenario.adam.begin_step(scenario.hyper)
    with counter:
        counter.phases.append("step: bookkeeping")
        scenario.steps.step_table(scenario.table, scenario.adam, plan, split, None)
        owed = store.owed_step
        chunks = 0
        while not owed.run_chunk():
            chunks += 1
        counter.phases.pop()
    scenario.counter[0] = None
    return {"ops": {p: dict(c) for p, c in counter.kinds.items()},
            "would_sync_on_device": dict(counter.syncs),
            "by_op": {p: dict(c.most_common()) for p, c in counter.counts.items()},
            "chunks": chunks + 1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=30000, help="rows of each table this rank owns")
    p.add_argument("--width", type=int, default=8192, help="d_ff of a table row")
    p.add_argument("--tables", type=int, default=2)
    p.add_argument("--hot-fraction", type=float, default=0.5,
                   help="tiered: the share of owned rows in the GPU tier")
    p.add_argument("--read-rows", type=int, default=4096,
                   help="distinct rows the first micro-batch reads")
    p.add_argument("--step-rows", type=int, default=12000, help="rows the owed step touched")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--placements", default="cpu,tiered")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the GPU tier lives for the times")
    p.add_argument("--count-device", default="meta",
                   help="where the GPU tier lives for the op count (meta: no data, no memory)")
    p.add_argument("--grad-layers", default="2,4",
                   help="layer counts of the gradient path's count (tiered; empty: none)")
    p.add_argument("--grad-reps", type=int, default=5,
                   help="timed repetitions of the gradient path on --device (0: ops only)")
    p.add_argument("--gpu-kernels", default="torch,triton",
                   help="the GPU tier's step kernels the gradient path is timed with (triton: "
                        "kernels/row_adam_gpu.py, where it runs: CUDA, or TRITON_INTERPRET=1)")
    p.add_argument("--verbose", action="store_true", help="also print the ops per phase")
    p.add_argument("--json", default=None, help="also write the summary as JSON here")
    a = p.parse_args()
    print(f"{a.tables} tables x {a.rows} rows x {a.width}, {a.read_rows} rows read, "
          f"{a.step_rows} owed by the step; {os.cpu_count()} cores, torch {torch.__version__}")
    summary = {}
    for placement in [p for p in a.placements.split(",") if p]:
        r = run(placement, a)
        summary[placement] = r
        total = r["total"]
        print(f"{placement}: {total.get('device', 0)} device ops (+{total.get('device view', 0)} "
              f"views), {total.get('host', 0)} host ops; read {r['read_ms']:.2f} ms wall, "
              f"{r['read_cpu_ms']:.2f} ms CPU (medians of {a.reps}; wall: "
              f"{', '.join(f'{t:.1f}' for t in r['read_ms_all'])})")
        for phase in ORDER:
            if phase in r["ops"]:
                k = r["ops"][phase]
                print(f"  {phase:24s} device {k.get('device', 0):4d} (+{k.get('device view', 0)} "
                      f"views), host {k.get('host', 0):4d}, would sync on the device "
                      f"{r['would_sync_on_device'].get(phase, 0)}")
                if a.verbose:
                    print("      " + ", ".join(f"{k} {v}" for k, v in r["by_op"][phase].items()))
    for layers in [int(x) for x in a.grad_layers.split(",") if x]:
        r = grad_phases(a, layers)
        if a.grad_reps > 0:
            from megatron_ext_kernels import row_adam_gpu

            probe = torch.empty(0, device=a.device)
            r["times"] = {k: grad_times(a, layers, k) for k in a.gpu_kernels.split(",")
                          if k == "torch" or (k == "triton" and row_adam_gpu.usable(probe))}
        summary[f"grads_{layers}_layers"] = r
        print(f"gradient path, tiered, {layers} layers (the owed step in {r['chunks']} chunks):")
        for k, t in r.get("times", {}).items():
            print(f"  on {t['device']}, GPU tier's step {k}: split (and staging) "
                  f"{t['split_ms']:.2f} ms, owed step {t['step_ms']:.2f} ms (medians of "
                  f"{a.grad_reps})")
        for phase in GRAD_ORDER:
            k = r["ops"].get(phase, {})
            print(f"  {phase:24s} device {k.get('device', 0):4d} (+{k.get('device view', 0)} "
                  f"views), host {k.get('host', 0):4d}, would sync on the device "
                  f"{r['would_sync_on_device'].get(phase, 0)}")
            if a.verbose and phase in r["by_op"]:
                print("      " + ", ".join(f"{k} {v}" for k, v in r["by_op"][phase].items()))
    report_json(summary, a.json)


if __name__ == "__main__":
    main()
