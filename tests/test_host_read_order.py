"""The direct read's order against the CPU's writes of the same host rows
(``--stem-host-read direct``, ``stem/runtime/direct_reads.py``).

The GPU kernel reads host rows after the gather that queued it has returned; every CPU write of
those rows (the table step, dense or sparse, a catch-up settled in place, the store's ``write``,
a read of the shard whole) must wait for the reads of them still queued, on whichever stream
each was queued, and for nothing queued after it. On the CPU the read runs at once under
Triton's interpreter, so the events are fakes (``direct_reads.new_event`` replaced) that finish
when the test says so and note when they are waited for; the writers are the real ones. On a GPU
(marked) the read's stream is held back and the write made at once: the read still returns the
rows as they were before the write.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.stem.runtime import direct_reads, row_adam
from megatron_ext.stem.runtime.direct_reads import DirectReads
from megatron_ext.stem.runtime.row_adam import AdamHyper, RowAdamW, TieredRowAdamW
from megatron_ext.stem.runtime.schedule import TableSteps
from megatron_ext.stem.runtime.store import TableStore
from megatron_ext.stem.runtime.tiers import split_grads
from megatron_ext_kernels import host_rows
from stem_fakes import CallerRunsWorker, StoreTable

HYPER = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


class FakeEvents:
    """Events of named fake streams (``stream``: the one current when an event is recorded); an
    event finishes when the test sets ``done`` or when it is waited for (``waited`` notes each
    wait, ``on_wait`` runs at it)."""

    def __init__(self, monkeypatch):
        self.stream = "current"
        self.made, self.waited = [], []
        self.on_wait = None
        monkeypatch.setattr(direct_reads, "new_event", self.new)

    def new(self):
        event = FakeEvent(self)
        self.made.append(event)
        return event


class FakeEvent:
    def __init__(self, log: FakeEvents):
        self.log, self.done, self.stream = log, False, None

    def record(self):
        self.stream = self.log.stream

    def query(self) -> bool:
        return self.done

    def synchronize(self):
        if not self.done:
            self.log.waited.append(self)
            if self.log.on_wait is not None:
                self.log.on_wait()
        self.done = True


def _read(reads: DirectReads, events: FakeEvents, stream: str, rows) -> FakeEvent:
    events.stream = stream
    reads.record(torch.tensor(rows))
    return events.made[-1]


def test_a_write_waits_for_every_earlier_read_of_its_rows_on_any_stream(monkeypatch):
    """Two streams finish in either order: a write waits for the read of its rows that is still
    queued on one stream although a later read on the other finished (the last read's event
    alone would not do); a write waits for no read of other rows, nor for a read queued after
    it; a write of every row waits for all; finished reads are dropped."""
    events = FakeEvents(monkeypatch)
    reads = DirectReads(16)
    side = _read(reads, events, "side", [1, 2, 3])
    current = _read(reads, events, "current", [3, 4])
    assert (side.stream, current.stream) == ("side", "current")
    current.done = True  # the later read, on the other stream, finished first
    reads.before_write(torch.tensor([9, 10]))  # rows no read reads
    reads.before_write(torch.tensor([], dtype=torch.long))
    assert events.waited == []
    reads.before_write(torch.tensor([3]))  # read by both
    assert events.waited == [side]
    # Reads up to the last of the rows are waited for (an earlier read of a row may have been
    # stamped over), not the reads after it.
    first = _read(reads, events, "side", [5])
    second = _read(reads, events, "current", [6])
    third = _read(reads, events, "side", [5, 7])
    reads.before_write(torch.tensor([6]))
    assert events.waited == [side, first, second]
    after = _read(reads, events, "current", [7])  # queued after the write above
    assert not after.done and not third.done
    reads.before_write(torch.tensor([7]))
    assert events.waited == [side, first, second, third, after]
    a, b = _read(reads, events, "side", [0]), _read(reads, events, "current", [15])
    reads.wait_all()
    assert events.waited[-2:] == [a, b] and reads.pending == 0
    # Over many steps, reads that finished are dropped at the next read: a few are kept.
    for step in range(500):
        _read(reads, events, "side" if step % 2 else "current", [step % 16])
        if step >= 2:
            events.made[-3].done = True
        assert reads.pending <= 3
    assert len(events.waited) == 7


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU keeps its reads")
def test_without_a_gpu_a_read_keeps_nothing():
    """On the CPU (the interpreter's CPU twin) the read has run when ``record`` is called."""
    reads = DirectReads(4)
    reads.record(torch.tensor([1, 2]))
    assert reads.pending == 0
    reads.before_write(torch.tensor([1]))


# -- the store and its writers ------------------------------------------------------------------

ROWS, WIDTH, HOT = 40, 16, 12
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not host_rows.available(), reason="Triton is not installed")


class _Tables:
    """A direct-read store of two layers (host or tiered) and its row optimizer."""

    def __init__(self, placement: str, mode: str, kernel: str = "auto"):
        g = torch.Generator().manual_seed(0)
        tables = [torch.randn(ROWS, WIDTH, generator=g) for _ in range(2)]
        self.store = TableStore(tables, torch.arange(ROWS), placement, DEVICE,
                                num_hot=HOT if placement == "tiered" else None,
                                host_read="direct")
        if placement == "tiered":
            self.adam = TieredRowAdamW(self.store.shards, mode=mode, lazy=self.store.lazy)
            self.host = [s.cold for s in self.store.shards]
        else:
            self.adam = RowAdamW(self.store.shards, mode=mode, kernel=kernel,
                                 lazy=self.store.lazy)
            self.host = self.store.shards

    def host_state(self):
        return [h.clone() for h in self.host]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@needs_triton
@pytest.mark.parametrize("placement,mode,kernel", [
    ("cpu", "sparse", "auto"), ("cpu", "sparse", "torch"), ("cpu", "dense", "auto"),
    ("tiered", "sparse", "auto"), ("tiered", "dense", "auto")])
def test_every_write_of_host_rows_waits_for_the_direct_reads_of_them(placement, mode, kernel,
                                                                      monkeypatch):
    """The real writers of a direct-read store's host rows, each right after a direct read that
    is still queued (a fake event): the table step (sparse: the row kernel or torch ops; dense:
    every row), a catch-up settled in place, the owed step's chunks and the store's ``read`` and
    ``write`` wait for it, and the host rows are unchanged when they do; the owed step's chunks
    that write only rows the read does not read leave it queued."""
    events = FakeEvents(monkeypatch)
    # Dense host rows step with torch ops: the wait is the same, DeepSpeed's build is not needed.
    monkeypatch.setattr(row_adam, "deepspeed_op", lambda: None)
    t = _Tables(placement, mode, kernel)
    store = t.store
    seen = []
    events.on_wait = lambda: seen.append(t.host_state())
    g = torch.Generator().manual_seed(1)
    read_rows = torch.tensor([3, 15, 20, 33, 39])  # both tiers
    written = torch.tensor([2, 15, 21, 33])  # two of them read
    # (On a GPU the kernels run too, unordered against these writes by the fake events: only
    # the waits are checked here; the GPU test below checks what a read returns.)

    def queued_read():
        store.gather(read_rows, DEVICE, torch.bfloat16)
        assert store.reads.pending == 1 and not events.made[-1].done
        return events.made[-1], t.host_state()

    def waited_before_writing(event, before, write):
        write()
        assert event.done and events.waited[-1] is event, "the write did not wait"
        assert _same(seen[-1], before), "the host rows changed before the wait"
        assert not _same(t.host_state(), before), "nothing was written"

    def step():
        plan = t.adam.begin_step(HYPER)
        for i in range(2):
            t.adam.step_rows(i, written, torch.randn(written.numel(), WIDTH, generator=g), plan)

    event, before = queued_read()
    waited_before_writing(event, before, step)
    if mode == "sparse":  # rows owing the last step's catch-up, settled in place
        event, before = queued_read()
        waited_before_writing(event, before, lambda: t.adam.catch_up(0, read_rows))
        # The owed step: its chunks write only rows the read does not read (the read steps its
        # own first), and leave the read queued; ``finish`` after another read of them waits.
        steps = TableSteps("sparse", CallerRunsWorker())
        grads = [torch.randn(written.numel(), WIDTH, generator=g) for _ in range(2)]
        if placement == "tiered":
            items = [split_grads(s, written, gr) for s, gr in zip(store.shards, grads)]
        else:
            items = [(written, gr) for gr in grads]
        steps.step_table(StoreTable(store), t.adam, t.adam.begin_step(HYPER), items, None)
        owed = store.owed_step
        store.gather(torch.tensor([15, 33]), DEVICE, torch.bfloat16)
        event = events.made[-1]
        before = t.host_state()
        owed.finish()  # rows 2 and 21: not read
        assert not event.done and events.waited[-1] is not event
        assert not _same(t.host_state(), before)
        event.done = True  # the GPU ran it
    event, before = queued_read()
    whole = store.read(0)  # the shard itself, or a tiered one's copy, written in place next
    assert event.done and events.waited[-1] is event
    event, before = queued_read()
    if placement == "tiered":  # the copy goes back into the shard's halves
        waited_before_writing(event, before, lambda: store.write(0, whole + 1.0))
    else:
        store.write(0, whole)
        assert event.done and events.waited[-1] is event


@needs_triton
def test_loading_the_optimizer_state_waits_for_queued_reads_before_writing(monkeypatch):
    """``checkpoint.load_optimizer_state`` writes the host shards in place (the fp32 master
    rows, the moments) past the store: it waits for every direct read still queued first."""
    from types import SimpleNamespace

    from megatron_ext.stem.runtime import checkpoint

    events = FakeEvents(monkeypatch)
    t = _Tables("cpu", "sparse")
    t.store.gather(torch.tensor([1, 7]), DEVICE, torch.bfloat16)
    event = events.made[-1]
    writes = []
    # The sources are where the loads write: by then the read must have been waited for.
    monkeypatch.setattr(checkpoint, "_optimizer_sources",
                        lambda optimizer: writes.append(event.done) or [])
    optimizer = SimpleNamespace(tables=[SimpleNamespace(store=t.store)], mode="dense",
                                drain=lambda: None, step_count=0)
    checkpoint.load_optimizer_state(optimizer, {"mode": "dense", "step_count": 3, "tensors": {}})
    assert writes == [True] and events.waited == [event]


# -- GPU only ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@needs_triton
def test_gpu_direct_read_returns_the_rows_before_a_host_write_made_at_once():
    """A direct read queued behind a held stream (``torch.cuda._sleep``), then at once the table
    step of the same rows on the CPU: the read returns the rows as they were before the step.
    Then the same with the read held on a side stream and a later read of the same rows on the
    current stream, which finishes first: the step still waits for the held one."""
    device = torch.device("cuda")
    rows = 256
    table = torch.randn(rows, 512)
    store = TableStore([table], torch.arange(rows), "cpu", device, host_read="direct")
    adam = RowAdamW(store.shards, mode="sparse", kernel="torch", lazy=store.lazy)
    index = torch.randperm(rows)[:96]
    grad = torch.randn(index.numel(), 512)
    hold = int(2e8)  # GPU clock cycles, about 0.1 s: far longer than the step on the CPU

    want = store.shards[0][index].clone()
    torch.cuda._sleep(hold)
    got = store.gather(index, device, torch.float32)
    adam.step([(index, grad)], HYPER)  # writes the rows the read has not read yet
    assert torch.equal(got.cpu(), want)
    assert not torch.equal(store.shards[0][index], want)

    want = store.shards[0][index].clone()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(hold)
        held = store.gather(index, device, torch.float32)
    quick = store.gather(index[:8], device, torch.float32)
    torch.cuda.current_stream().synchronize()  # the later read has finished
    adam.step([(index, grad)], HYPER)
    torch.cuda.synchronize()
    assert torch.equal(held.cpu(), want) and torch.equal(quick.cpu(), want[:8])
