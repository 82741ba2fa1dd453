"""Managed STEM tables in one process: a fetch started ahead (its rows read on the worker thread)
binds the same rows as a synchronous one, and the bound rows and index reproduce ``table[ids]``;
the overlapped table step (the forward step's read-ahead of the next step's first micro-batch,
whose read the optimizer releases after stepping the rows it needs) lets every micro-batch read
rows with every earlier step applied. On a GPU the rows come from host memory through a pinned
buffer over a side stream (the path CI cannot run); on the CPU the thread path."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_ext.stem.config import StemConfig

VOCAB = 100


def _worker():
    """The host worker of this file's tables (a training's ``StemRun`` makes one per
    training)."""
    from megatron_ext.stem.runtime.worker import HostWorker

    return HostWorker()


WORKER = _worker()


class FakeLayer:
    """A STEM layer as StemTables knows it (``LayerTable``), and the rows and index of the last
    micro-batch fetched for it (``bound``: what the layer reads from its ``FetchedRows``)."""

    def __init__(self, table, layer_number=None):
        from megatron_ext.stem.runtime.tables import LayerTable

        self.layer_number = layer_number if layer_number is not None else id(self)
        self.spec = LayerTable(self.layer_number, table, table.dtype, table.shape[0])
        self.bound = None


def recording(tables, layers):
    """``tables`` whose fetches also leave each layer's rows in ``layer.bound``."""
    finish = tables.finish_fetch

    def finish_fetch(fetch):
        fetched = finish(fetch)
        for layer in layers:
            layer.bound = fetched.of_layer(layer.layer_number)
        return fetched

    tables.finish_fetch = finish_fetch  # fetch_now finishes through it too
    return tables


def host_tables(g: torch.Generator, placement: str = "cpu", hot_mask=None):
    """Two tables (widths 8 and 4) drawn from ``g``, managed in host shards with prefetch (or
    ``tiered``, the ids of ``hot_mask`` in the GPU tier): (the drawn tables, the fake layers,
    StemTables, the device rows go to)."""
    from megatron.core import parallel_state

    from megatron_ext.stem.runtime.tables import StemTables

    full = [torch.randn(VOCAB, 8, generator=g), torch.randn(VOCAB, 4, generator=g)]
    layers = [FakeLayer(t.clone(), n) for n, t in enumerate(full, start=2)]
    tables = recording(StemTables([layer.spec for layer in layers],
                                  StemConfig(placement=placement, sharding="vocab"), VOCAB,
                                  parallel_state.get_data_parallel_group(), WORKER,
                                  hot_mask=hot_mask),
                       layers)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return full, layers, tables, device


def test_prefetch_binds_what_a_synchronous_fetch_binds(mcore_single_rank):
    g = torch.Generator().manual_seed(0)
    full, layers, tables, device = host_tables(g)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g).to(device)  # [b, s] as batches come
    with torch.no_grad():
        tables.fetch_now(ids)
        sync = [(r.clone(), i.clone()) for r, i in (l.bound for l in layers)]
        tables.finish_fetch(tables.start_fetch(ids, ahead=True))
    for layer, table, (rows, inverse) in zip(layers, full, sync):
        got_rows, got_inverse = layer.bound
        assert got_rows.device.type == device.type
        assert torch.equal(got_rows, rows) and torch.equal(got_inverse, inverse)
        # [s, b] lookups equal the table rows of the transposed ids.
        torch.testing.assert_close(got_rows[got_inverse].cpu(), table[ids.t().cpu()])


class ReadClock:
    """``time`` for ``stem/runtime/tables.py``: a clock that moves only while the owners' read gathers
    rows (``READ`` seconds per read), so the fetch's time accounting is exact and independent of
    the machine's load. ``release`` (an event) is set by the training thread's first reading
    of the clock once ``armed``."""

    READ = 5.0

    def __init__(self):
        self.now, self.armed, self.release, self.reads = 0.0, False, None, []

    def perf_counter(self):
        import threading

        if self.armed and threading.current_thread() is threading.main_thread():
            self.armed = False
            self.release.set()
        return self.now

    def wrap(self, gather):
        import threading

        def timed(*args, **kwargs):
            self.reads.append(threading.current_thread().name)
            self.now += self.READ
            return gather(*args, **kwargs)

        return timed


def test_prefetch_reads_on_the_worker_while_the_training_thread_goes_on(mcore_single_rank,
                                                                        monkeypatch):
    """A fetch started ahead returns before its rows are read: the read is queued on the worker
    thread (here held up by an earlier task) and runs there. What the training thread did not
    wait for is counted as hidden: all of the read when it was done before ``finish_fetch``,
    none when ``finish_fetch`` waited for all of it, none for a synchronous fetch."""
    import threading

    from megatron_ext.stem.runtime import tables as tables_module

    g = torch.Generator().manual_seed(4)
    full, layers, tables, device = host_tables(g)
    clock = ReadClock()
    monkeypatch.setattr(tables_module, "time", clock)
    monkeypatch.setattr(tables.store, "gather", clock.wrap(tables.store.gather))
    ids = torch.randint(0, VOCAB, (2, 16), generator=g).to(device)

    def check_bound():
        for layer, table in zip(layers, full):
            rows, inverse = layer.bound
            torch.testing.assert_close(rows[inverse].cpu(), table[ids.t().cpu()])

    gate = threading.Event()
    clock.release = threading.Event()
    try:
        with torch.no_grad():
            # Read ahead, done before the training thread asks for it: all of it hidden.
            WORKER.submit(gate.wait)
            fetch = tables.start_fetch(ids, ahead=True)
            assert clock.reads == [] and not fetch.served.done()  # queued, not read
            gate.set()
            fetch.served.result(timeout=60)
            tables.finish_fetch(fetch)
            check_bound()
            assert clock.reads == ["stem-worker"]
            assert tables.stats["fetch_seconds_hidden"] == ReadClock.READ
            # Read ahead, but the worker starts it only once finish_fetch waits: none hidden.
            WORKER.submit(clock.release.wait)
            fetch = tables.start_fetch(ids, ahead=True)
            clock.armed = True
            tables.finish_fetch(fetch)
            check_bound()
            assert clock.reads == ["stem-worker"] * 2
            # Synchronous: read on the worker as well, never counted as hidden.
            tables.fetch_now(ids)
            check_bound()
            assert clock.reads == ["stem-worker"] * 3
    finally:  # a failed check leaves no worker task waiting (later tests share the worker)
        gate.set()
        clock.release.set()
        WORKER.wait()
    assert tables.stats["fetch_seconds_hidden"] == ReadClock.READ
    assert tables.stats["fetch_seconds"] == 2 * ReadClock.READ  # the waits of the last two


@pytest.mark.parametrize("huge", [True, False])
def test_tables_hand_the_huge_page_choice_to_the_store(mcore_single_rank, huge):
    """--stem-host-huge-pages reaches the store, which allocates the host shards and binds the
    moments (tests/test_stem_host_memory.py checks the pages themselves)."""
    from megatron.core import parallel_state

    from megatron_ext.stem.runtime.tables import StemTables

    layers = [FakeLayer(torch.randn(VOCAB, 8)).spec]
    tables = StemTables(layers, StemConfig(placement="cpu", sharding="vocab",
                                           host_huge_pages=huge), VOCAB,
                        parallel_state.get_data_parallel_group(), WORKER)
    assert tables.store.huge_pages is huge and tables.store.lazy.huge_pages is huge


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_through_pinned_staging(dtype):
    """Rows of several shards, side by side, in the wire dtype: through the reusable pinned buffer
    on a GPU (twice, so the buffer is reused and grown), directly on the CPU."""
    from megatron_ext.stem.runtime.store import PinnedStaging, gather_rows

    g = torch.Generator().manual_seed(1)
    shards = [torch.randn(50, 8, generator=g), torch.randn(50, 3, generator=g)]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    staging = PinnedStaging() if cuda else None
    for n in (7, 40):
        index = torch.randint(0, 50, (n,), generator=g)
        got = gather_rows(shards, index, device, dtype, staging, chunk=5)
        want = torch.cat([s[index] for s in shards], dim=1).to(dtype)
        assert got.device.type == device.type and got.dtype == dtype
        assert torch.equal(got.cpu(), want)


def run_microbatches(read_ahead, reader, layers, expected, weights, step):
    """Step ``step`` (of two) of three micro-batches through ``read_ahead`` from ``reader``: the
    rows bound to each layer reproduce ``expected[ids]`` (the plain tables with every earlier
    step applied), and a loss of the rows weighted by ``weights`` is backpropagated."""
    for m in range(3):
        batch, fetched = read_ahead.take(lambda: next(reader), 3, next_step=step == 0)
        loss = 0.0
        for layer, want, w in zip(layers, expected, weights):
            rows, inverse = fetched.of_layer(layer.layer_number)
            looked_up = rows[inverse]  # [s, b, F]
            assert torch.equal(looked_up.detach().cpu(), want[batch[0].t().cpu()]), (step, m)
            loss = loss + (looked_up * w).sum()
        loss.backward()


@pytest.mark.parametrize("slow", [False, True])
def test_overlapped_step_reads_rows_with_the_step_applied(mcore_single_rank, monkeypatch, slow):
    """Two steps of three micro-batches with host shards and prefetch, through the forward step's
    read-ahead and the table optimizer's sparse step left with the store (every read steps the
    rows it needs first, the worker the rest in chunks), with plain SGD as the row rule: every
    bound row equals a plain table updated by the same rule after every step, and the shards end
    equal to it. ``slow``: one row per chunk and 4 ms per row step, so the reads of the step's
    later micro-batches come while most of the step is still owed. The gradients' arrival (a
    GPU copy's event: here one that takes 20 ms) is waited for before any row steps, and that
    wait is counted apart (``stem/optimizer-seconds-grad-wait``), inside the step's time."""
    import threading
    import time

    from megatron_ext.stem.runtime.schedule import OwedStep, TableSteps
    from megatron_ext.stem.runtime.read_ahead import TableReadAhead

    if slow:
        monkeypatch.setattr(OwedStep, "CHUNK_ELEMENTS", 1)
    g = torch.Generator().manual_seed(2)
    full, layers, tables, device = host_tables(g)
    assert tables.overlap
    # Skewed ids (many repeats across micro-batches, some rows read by one only).
    batches = [(torch.multinomial(torch.arange(VOCAB, 0, -1).float() ** 2, 32, replacement=True,
                                  generator=g).view(2, 16).to(device),) for _ in range(7)]
    weights = [torch.randn(16, 2, t.shape[1], generator=g).to(device) for t in full]
    reader = iter(batches)
    expected = [t.clone() for t in full]
    lr = 0.5

    class SGD:  # the row rule, in RowAdamW's step interface
        mode = "sparse"

        def begin_step(self, hyper):
            return None

        def step_rows(self, i, rows, grad, plan):
            if slow:
                time.sleep(0.004 * rows.numel())
            stepped.extend((i, int(r), getattr(in_read, "on", False)) for r in rows)
            tables.store.shards[i].index_add_(0, rows, grad.to(torch.float32), alpha=-lr)

    stepped = []  # (table, row, stepped inside a read of rows)
    in_read = threading.local()  # set on the worker while a read of rows runs
    gather = tables.store.gather

    def gather_marked(*args, **kwargs):
        in_read.on = True
        try:
            return gather(*args, **kwargs)
        finally:
            in_read.on = False

    monkeypatch.setattr(tables.store, "gather", gather_marked)

    class Arrived:  # the event of the gradients' copy to the host: lands 20 ms after the step
        def __init__(self):
            self.at = None

        def synchronize(self):  # every part of the step calls it; the first one waits
            if self.at is None:
                assert not stepped, "a row stepped before its gradients arrived"
                self.at = time.perf_counter() + 0.02
            time.sleep(max(self.at - time.perf_counter(), 0.0))

    steps = TableSteps("sparse", WORKER)  # the table optimizer's row steps, without Megatron's part
    read_ahead = TableReadAhead(tables)
    touched = []  # the owned rows each step touched
    for step in range(2):
        run_microbatches(read_ahead, reader, layers, expected, weights, step)
        WORKER.wait()  # as the optimizer's prepare_grads does (drain) before collecting
        local, grads = tables.collect_grads()
        grads = [x.cpu() for x in grads]
        for want, x in zip(expected, grads):  # the plain rule: SGD on the touched rows
            want.index_add_(0, tables.owned_ids[local], x, alpha=-lr)
        # After the first step the next step's first micro-batch waits for this step.
        assert (tables.deferred is not None) == (step == 0)
        touched.append(local)
        overlapped = list(stepped)  # at step 1: step 0's rows, stepped during step 1
        stepped.clear()
        steps.step_table(tables, SGD(), None, [(local, x) for x in grads], Arrived())
        assert tables.deferred is None
        if step == 1:
            WORKER.wait()
            # every touched row of every table exactly once, whoever stepped it
            for rows, record in ((touched[0], overlapped), (touched[1], stepped)):
                assert sorted((i, r) for i, r, _ in record) == \
                    sorted((i, int(r)) for i in range(2) for r in rows)
    WORKER.wait()
    assert tables.store.owed_step is None
    results = [done.result() for _, done, _ in steps.tasks]
    assert not any(in_a_read for _, _, in_a_read in stepped)  # the last step: at once
    if slow:
        # Step 0 was left with the store: step 1's reads stepped the owed rows they needed (its
        # first micro-batch's at least), the chunks the rest (rows no read of step 1 needs).
        by_reads = sum(in_a_read for _, _, in_a_read in overlapped)
        assert 0 < by_reads < len(overlapped)
        assert all(in_reads < took for took, in_reads in results)
    # Step 1 ran at once (nothing to overlap: its stats are in), step 0 in the background:
    # drained into the stats as the optimizer's next prepare_grads would.
    steps.drain([tables])
    waited = tables.stats["optimizer_seconds_grad_wait"]
    assert 2 * 0.02 <= waited < tables.stats["optimizer_seconds"]
    assert next(reader) is batches[6]  # read ahead exactly one micro-batch: the step's first
    for shard, want in zip(tables.shards, expected):
        assert torch.equal(shard, want[tables.owned_ids])


def test_first_reads_host_rows_wait_for_their_own_gradients(mcore_single_rank):
    """Tiered tables (ids below 30 in the GPU tier), two steps of three micro-batches with
    prefetch and the overlapped sparse step, the gradients split by tier as the table optimizer
    splits them: the host rows that the next step's first micro-batch reads first
    (``split_grads``'s ``first``). That micro-batch's read waits for those rows' gradients alone
    (``Arrival.synchronize_first``), and steps no host row before the rest have landed but
    those; the rest of the step waits for all (``synchronize``). With plain SGD as the row rule,
    every bound row equals a plain table updated by the same rule, so the rows and gradients
    were reordered together."""
    from megatron_ext.stem.runtime.read_ahead import TableReadAhead
    from megatron_ext.stem.runtime.schedule import TableSteps
    from megatron_ext.stem.runtime.tiers import TierGrads, split_grads

    g = torch.Generator().manual_seed(5)
    full, layers, tables, _ = host_tables(g, "tiered", torch.arange(VOCAB) < 30)
    batches = [(torch.multinomial(torch.arange(VOCAB, 0, -1).float(), 32, replacement=True,
                                  generator=g).view(2, 16),) for _ in range(7)]
    weights = [torch.randn(16, 2, t.shape[1], generator=g) for t in full]
    reader = iter(batches)
    expected = [t.clone() for t in full]
    lr = 0.5

    class Arrival:  # the host tier's gradients landing: the first rows, then all
        def __init__(self, first_rows):
            self.first_rows, self.landed, self.calls = first_rows, set(), []

        def synchronize_first(self):
            self.calls.append("first")
            self.landed.add("first")

        def synchronize(self):
            self.calls.append("all")
            self.landed.update(("first", "all"))

    class SGD:  # the row rule on both tiers, in the tiered optimizer's step interface
        mode = "sparse"

        def step_rows(self, i, rows, grad, plan):
            assert isinstance(grad, TierGrads)
            shard, n = tables.store.shards[i], grad.num_hot
            cold = rows[n:]
            if cold.numel():
                assert "all" in arrival.landed or (
                    "first" in arrival.landed and torch.isin(cold, arrival.first_rows).all()), \
                    "a host row stepped before its gradient landed"
            shard.hot.index_add_(0, rows[:n].to(shard.hot.device), grad.hot.to(shard.hot),
                                 alpha=-lr)  # the GPU tier is on the model's device
            shard.cold.index_add_(0, cold - shard.num_hot, grad.cold, alpha=-lr)

    steps = TableSteps("sparse", WORKER)
    read_ahead = TableReadAhead(tables)
    arrivals = []
    for step in range(2):
        run_microbatches(read_ahead, reader, layers, expected, weights, step)
        WORKER.wait()
        local, grads = tables.collect_grads()
        grads = [x.cpu() for x in grads]  # the host tier's part, as after its copy
        for want, x in zip(expected, grads):
            want.index_add_(0, tables.owned_ids[local], x, alpha=-lr)
        first = tables.deferred.route.requested if tables.deferred is not None else None
        split = [split_grads(s, local, x, first) for s, x in zip(tables.store.shards, grads)]
        cold_first = split[0][1].cold_first
        arrival = Arrival(None if first is None else torch.as_tensor(first))
        arrivals.append((arrival, cold_first, split[0][1].cold.shape[0]))
        steps.step_table(tables, SGD(), None, split, arrival)
    WORKER.wait()
    steps.drain([tables])
    (overlapped, first_rows, cold_rows), (last, _, _) = arrivals
    assert 0 < first_rows < cold_rows  # the test has host rows of both kinds
    assert overlapped.calls[0] == "first" and "all" in overlapped.calls[1:]
    assert last.calls == ["all"]  # nothing read ahead after the last step: all, at once
    for shard, want in zip(tables.store.shards, expected):
        assert torch.equal(shard.full(), want[tables.owned_ids])


class SlowJob:
    """A background job of ``n`` chunks of ``pause`` seconds, recording its chunks in ``log``."""

    def __init__(self, n, pause, log, fail_at=None):
        self.n, self.pause, self.log, self.fail_at, self.done = n, pause, log, fail_at, 0

    def run_chunk(self):
        import time

        if self.done == self.fail_at:
            raise ValueError("chunk failed")
        time.sleep(self.pause)
        self.log.append(f"chunk{self.done}")
        self.done += 1
        return self.done == self.n

    def result(self):
        return self.done


def test_worker_runs_tasks_before_the_rest_of_a_background_job():
    """A task submitted while a background job runs waits for one chunk, not for the job; jobs
    keep their order; wait() waits for both lanes and re-raises a job's error."""
    import threading
    import time

    from megatron_ext.stem.runtime.worker import HostWorker

    worker, log = HostWorker(), []
    first = worker.submit_background(SlowJob(10, 0.02, log))
    second = worker.submit_background(SlowJob(2, 0.0, log))
    time.sleep(0.03)  # the first job is under way
    task = worker.submit(lambda: (log.append("task"), threading.current_thread().name)[1])
    assert task.result(timeout=5) == "stem-worker"
    comm = "/proc/self/task/{}/comm"
    if os.path.exists(comm.format(threading.get_native_id())):  # Linux: the OS knows it too
        name = worker.submit(lambda: open(comm.format(threading.get_native_id())).read())
        assert name.result(timeout=5).strip() == "stem-worker"  # what profilers show
    at = log.index("task")
    assert 1 <= at <= 3, log  # after the chunk that was running
    worker.wait()
    assert first.result() == 10 and second.result() == 2
    assert log.index("chunk9") < len(log) - 2  # the second job after the first
    assert log[at + 1:].count("chunk0") == 1  # the second job's first chunk, after the task

    failing = worker.submit_background(SlowJob(3, 0.0, [], fail_at=1))
    after = worker.submit(lambda: "still runs")
    with pytest.raises(ValueError, match="chunk failed"):
        worker.wait()
    assert failing.exception() is not None and after.result() == "still runs"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_worker_side_stream_work_is_seen_after_wait():
    """GPU work a task queues on the worker's side stream (the GPU tier's step) is seen by the
    current stream's work after ``wait()``, however long it runs on the GPU; a tensor handed
    over from the current stream is not reused while the side stream may still read it."""
    from megatron_ext.stem.runtime.worker import HostWorker

    worker = HostWorker()
    rows = torch.zeros(1 << 20, device="cuda")
    held = [torch.ones(1 << 20, device="cuda")]
    worker.hand_over(held)

    def step(grad=held[0]):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the add
        rows.add_(grad)

    worker.submit(step).result()  # queued on the side stream; the GPU is still sleeping
    del step
    held.clear()
    # The worker drops the finished task when it takes the next: the gradient's last reference
    # goes while the side stream has yet to read it.
    worker.submit(lambda: None).result()
    reuse = torch.full((1 << 20,), 5.0, device="cuda")  # the same size, on the current stream
    worker.wait()
    assert float(rows.sum()) == float(1 << 20)  # the add of ones, seen, and not of fives
    assert float(reuse.sum()) == 5.0 * (1 << 20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_worker_task_after_an_event_skips_later_gpu_work():
    """A task submitted ``after`` an event (``worker.mark``: the table step's gradients are made,
    the model's optimizer step is queued next) runs its side-stream work while the current
    stream's later work still runs; without ``after`` it waits for that work."""
    from megatron_ext.stem.runtime.worker import HostWorker, mark

    worker = HostWorker()
    x = torch.zeros(1, device="cuda")
    worker.submit(lambda: x.add_(0)).result()  # warm-up: the side stream exists
    torch.cuda.synchronize()

    def task():
        x.add_(1)
        done = torch.cuda.Event()
        done.record()
        return done

    made = mark()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time queued after the event
    worker.submit(task, after=made).result().synchronize()
    assert not torch.cuda.current_stream().query()  # done while the current stream sleeps
    later = worker.submit(task).result()
    assert not later.query()  # queued behind the sleep
    worker.wait()
    torch.cuda.synchronize()
    assert later.query() and float(x) == 2.0


def test_owed_step_steps_every_row_once_in_reads_and_chunks(monkeypatch):
    """Reads step the owed rows they need (and no other); the chunks the rest, in budget-sized
    pieces; every position once."""
    from megatron_ext.stem.runtime.schedule import OwedStep

    monkeypatch.setattr(OwedStep, "CHUNK_ELEMENTS", 40)
    rows = [torch.tensor([5, 9, 2, 7, 11]), torch.tensor([9, 3])]
    calls = []

    def step(positions):
        calls.append([p.tolist() for p in positions])
        return 0.001

    owed = OwedStep(step, rows, widths=[8, 16])
    owed.settle(torch.tensor([9, 4]))  # row 9 in both shards; 4 is not owed
    assert calls == [[[1], [0]]]
    owed.settle(torch.tensor([9]))  # already stepped: nothing
    assert len(calls) == 1
    chunks = 0
    while not owed.run_chunk():
        chunks += 1
    assert owed.done and chunks >= 1
    stepped = [(i, rows[i][p].item()) for c in calls for i, ps in enumerate(c) for p in ps]
    assert sorted(stepped) == sorted((i, r.item()) for i, rs in enumerate(rows) for r in rs)
    for c in calls[1:]:  # each chunk within the budget (one row at least)
        size = len(c[0]) * 8 + len(c[1]) * 16
        assert size <= 40 or len(c[0]) + len(c[1]) == 1
    assert owed.result() == pytest.approx((0.001 * len(calls), 0.001))


class RecordingTables:
    """The calls the read-ahead makes on StemTables, recording the ids each fetch gets."""

    prefetch, overlap = True, True

    def __init__(self):
        self.ids = []

    def fetch_now(self, ids):
        self.ids.append(("now", ids))
        return ("rows of", ids)

    def start_fetch(self, ids, ahead=False, after_step=False):
        self.ids.append(("ahead", ids))
        return ids

    def finish_fetch(self, fetch):
        return ("rows of", fetch)


def test_read_ahead_routes_the_host_copy_of_the_tokens():
    """The read-ahead hands the tables the batch's host tokens (the sixth item, what routing
    reads without waiting for the GPU) when the batch has them, the tokens otherwise, and gives
    the forward step the batch with the rows fetched for it."""
    from megatron_ext.stem.runtime.read_ahead import TableReadAhead

    batches = []

    def read_batch(host=True):
        tokens = torch.full((1, 4), len(batches))
        batch = (tokens, None, None, None, None, tokens.clone() if host else None)
        batches.append(batch)
        return batch

    tables = RecordingTables()
    ahead = TableReadAhead(tables)
    with torch.enable_grad():
        for m in range(2):
            got, rows = ahead.take(read_batch, num_microbatches=2, next_step=True)
            assert got is batches[m] and rows == ("rows of", batches[m][5])
    assert [kind for kind, _ in tables.ids] == ["now", "ahead", "ahead"]
    assert all(ids is batch[5] for (_, ids), batch in zip(tables.ids, batches))
    tables.ids.clear()
    ahead.next = None
    with torch.no_grad():  # evaluation, a batch without a host copy: the tokens themselves
        got, rows = ahead.take(lambda: read_batch(host=False), num_microbatches=2,
                               next_step=True)
    assert got is batches[-1] and rows == ("rows of", batches[-1][0])
    assert tables.ids == [("now", batches[-1][0])]


def test_read_ahead_does_not_keep_its_tables_alive():
    """The tables own their read-ahead (``StemTables.read_ahead``), which refers to them weakly:
    once the model (and so its tables) is gone, so are its read-ahead and the tables, with their
    host memory and process groups, by reference counting alone (no cycle left for the
    collector; a process that builds several models, e.g. a launch of several trainings)."""
    import gc
    import weakref

    from megatron_ext.stem.runtime.read_ahead import TableReadAhead

    tables = RecordingTables()
    tables.read_ahead = TableReadAhead(tables)  # as StemTables makes it
    with torch.enable_grad():
        tables.read_ahead.take(lambda: (torch.zeros(1, 4, dtype=torch.long),) * 5,
                               num_microbatches=1, next_step=False)
    gone, gone_ahead = weakref.ref(tables), weakref.ref(tables.read_ahead)
    gc.disable()
    try:
        del tables
        assert gone() is None and gone_ahead() is None
    finally:
        gc.enable()


def test_get_batch_keeps_the_host_tokens(mcore_single_rank):
    """TP rank 0 reads the batch from the data loader: with ``host_tokens`` the sixth item is the
    loader's tokens on the host, equal to the tokens the model gets."""
    from types import SimpleNamespace

    from megatron_ext.training.batch import get_batch

    tokens = torch.randint(0, 50, (2, 8))
    data = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 8),
            "position_ids": torch.arange(8).repeat(2, 1)}
    args = SimpleNamespace(micro_batch_size=2, seq_length=8,
                           create_attention_mask_in_dataloader=False)
    plain = get_batch(iter([data]), args)
    assert len(plain) == 5
    batch = get_batch(iter([data]), args, host_tokens=True)
    assert len(batch) == 6 and batch[5].device.type == "cpu"
    assert torch.equal(batch[5], tokens) and torch.equal(batch[0].cpu(), tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fetch_from_host_ids_does_not_wait_for_the_gpu(mcore_single_rank):
    """On a GPU, a fetch of host ids (start and finish, through the exchange and the pinned
    copies) makes the training thread wait for no kernel: under CUDA's sync debug mode
    ("error") any stream or device synchronisation, implicit copy included, raises."""
    g = torch.Generator().manual_seed(3)
    full, layers, tables, device = host_tables(g)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    with torch.no_grad():
        tables.fetch_now(ids)  # warm up: pinned buffers, the worker's stream
        torch.cuda.synchronize()
        busy = torch.randn(4096, 4096, device=device)
        for _ in range(20):  # kernels queued ahead, as a micro-batch's backward would be
            busy = busy @ busy.t() / 4096
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fetch = tables.start_fetch(ids, ahead=True)
            tables.finish_fetch(fetch)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    for layer, table in zip(layers, full):
        rows, inverse = layer.bound
        torch.testing.assert_close(rows[inverse].cpu(), table[ids.t()])


def test_stats_are_reduced_only_where_a_writer_is_made(mcore_single_rank, monkeypatch):
    """The per-iteration table stats (``report_stats``): without ``--tensorboard-dir`` or
    ``--wandb-project`` (no rank has a writer) they are reset and nothing is reduced; with one,
    every rank joins the reduction and the writing rank writes the sums (one rank here: its
    own counts)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_ext.stem.runtime import report
    from megatron_ext.stem.runtime.tables import StemTables

    class Counters:  # a chunk's tables as the report reads them: counters and row sizes
        reset_stats = StemTables.reset_stats
        row_bytes = grad_row_bytes = 48

    table = Counters()
    table.reset_stats()

    def count():
        table.stats.update(unique_rows=5, fetch_rows_in=3, fetch_seconds=0.25)
        kernel.kernel_times.add(640, 0.125, 0.25)

    from megatron_ext.stem.runtime.row_adam import KernelTimes

    kernel = SimpleNamespace(rowwise=None, kernel_times=KernelTimes())  # a host row optimizer
    active = [SimpleNamespace(tables=[table], grad_seconds=0.5, row_adams=[kernel],
                              team_reported=False)]  # the run's table optimizers
    reductions = []
    gather = dist.all_gather
    other = None  # what a second rank sends, when the test plays one

    def all_gather(out, tensor, *args, **kwargs):
        reductions.append(tensor.numel())
        if other is None:
            return gather(out, tensor, *args, **kwargs)
        out[0].copy_(tensor)
        out[1].copy_(other)

    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 1 if other is None else 2)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("all_reduce"))

    class Writer:
        def __init__(self):
            self.scalars = {}

        def add_scalar(self, name, value, iteration):
            self.scalars[name] = (value, iteration)

    writer = Writer()
    count()
    report.report_stats(active, SimpleNamespace(tensorboard_dir=None, wandb_project=""),
                                 3, {}, None, None)
    assert reductions == [] and table.stats["unique_rows"] == 0
    assert active[0].grad_seconds == 0.0
    with_tb = SimpleNamespace(tensorboard_dir="tb", wandb_project="")
    count()
    report.report_stats(active, with_tb, 4, {}, None, None)  # a rank without a writer
    assert reductions == [17] and table.stats["unique_rows"] == 0  # one collective per report
    assert kernel.kernel_times.take() == (0, 0.0, 0.0)  # taken by the report
    count()
    report.report_stats(active, with_tb, 5, {}, writer, None)
    assert writer.scalars["stem/unique-rows-fetched"] == (5.0, 5)
    assert writer.scalars["stem/fetch-bytes-to-device"] == (3.0 * 48, 5)
    assert writer.scalars["stem/fetch-seconds-exposed"] == (0.25, 5)
    assert writer.scalars["stem/optimizer-kernel-params"] == (640.0, 5)
    assert writer.scalars["stem/optimizer-kernel-loop-seconds"] == (0.125, 5)
    assert writer.scalars["stem/optimizer-kernel-call-seconds"] == (0.25, 5)
    # Two ranks: counts are summed, times are the slowest rank's.
    other = torch.zeros(17, dtype=torch.float64)
    other[0], other[1], other[8], other[10] = 2, 10, 0.5, 0.125  # unique rows, bytes, seconds
    other[7], other[15] = 100, 0.5  # the row kernel's parameters, loop seconds
    count()
    report.report_stats(active, with_tb, 6, {}, writer, None)
    assert writer.scalars["stem/unique-rows-fetched"] == (7.0, 6)
    assert writer.scalars["stem/fetch-bytes-to-device"] == (3.0 * 48 + 10, 6)
    assert writer.scalars["stem/fetch-seconds-exposed"] == (0.5, 6)
    assert writer.scalars["stem/optimizer-seconds"] == (0.125, 6)
    assert writer.scalars["stem/optimizer-kernel-params"] == (740.0, 6)
    assert writer.scalars["stem/optimizer-kernel-loop-seconds"] == (0.5, 6)
    assert active[0].team_reported  # looked at once (no row kernel: no line)


@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_one_reduction_decides_the_skip_and_gives_the_norm(mcore_single_rank, monkeypatch, bad):
    """``prepare_grads`` reduces the tables' squared gradient norm once (float64), and that one
    reduction decides both: a non-finite table gradient makes it non-finite and skips the step; a
    finite one is the norm ``get_grad_norm`` adds, against a reference of the gradients scaled as
    the optimizer scales them (here by 1 / loss scale)."""
    import torch.distributed as dist

    from megatron_ext.stem.runtime.optimizer import StemTablesOptimizer

    g = torch.Generator().manual_seed(3)
    _, layers, tables, device = host_tables(g)
    tables.fetch_now(torch.randint(0, VOCAB, (2, 16), generator=g).to(device))  # leaves kept
    grads = []
    for layer in layers:
        rows, _ = layer.bound
        rows.grad = torch.randn(rows.shape, generator=g).to(device)
        grads.append(rows.grad.clone())
    if bad is not None:
        layers[1].bound[0].grad[2, 1] = bad

    class Inner:  # the model's optimizer: nothing to prepare, a loss scale of 4
        config = None

        def prepare_grads(self):
            return False

        def get_loss_scale(self):
            return torch.tensor([4.0])

    optimizer = StemTablesOptimizer(Inner(), [tables], "dense", WORKER)
    reductions = []
    reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce",
                        lambda t, *a, **k: reductions.append(t.numel()) or reduce(t, *a, **k))
    assert optimizer.prepare_grads() == (bad is not None)
    assert reductions == [1]
    if bad is None:
        want = sum(float(((x.double() / 4.0) ** 2).sum()) for x in grads)
        assert optimizer.table_grad_norm_sq() == pytest.approx(want, rel=1e-12)


def test_gradient_exchange_time_leaves_out_the_wait_for_the_table_step(mcore_single_rank):
    """``prepare_grads`` first waits for the last table step (exposed optimizer time), then
    collects and exchanges the gradients (``grad_seconds``, logged as
    ``stem/grad-exchange-seconds``): the wait is counted once, as the optimizer's (until
    2026-11-27 it was in both)."""
    import time

    from megatron_ext.stem.runtime.optimizer import StemTablesOptimizer

    g = torch.Generator().manual_seed(5)
    _, layers, tables, device = host_tables(g)
    tables.fetch_now(torch.randint(0, VOCAB, (2, 16), generator=g).to(device))
    for layer in layers:
        rows, _ = layer.bound
        rows.grad = torch.randn(rows.shape, generator=g).to(device)

    class Inner:
        config = None

        def prepare_grads(self):
            return False

        def get_loss_scale(self):
            return None

    optimizer = StemTablesOptimizer(Inner(), [tables], "dense", WORKER)
    tables.reset_stats()
    WORKER.submit(lambda: time.sleep(0.5))  # a table step still running on the worker
    assert optimizer.prepare_grads() is False
    assert tables.stats["optimizer_seconds_exposed"] >= 0.45
    assert optimizer.grad_seconds < 0.45
