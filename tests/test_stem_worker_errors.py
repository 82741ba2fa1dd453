"""Nothing the tables' worker thread (``megatron_ext/stem/runtime/worker.py``) runs fails unseen: ``wait``
raises the first failed task's error and names every other failed task (in a note on that error
and in the log), and the exit hook logs a failure nobody waited for."""

from __future__ import annotations

import logging

import pytest

from megatron_ext.stem.runtime import worker


class FailingJob:
    """A background job whose second chunk fails."""

    def __init__(self):
        self.chunks = 0

    def run_chunk(self) -> bool:
        self.chunks += 1
        if self.chunks == 2:
            raise KeyError("chunk 2")
        return False

    def result(self):
        return None


def fail_read():
    raise ValueError("read refused")


def fail_step():
    raise RuntimeError("step refused")


def test_wait_raises_the_first_failure_and_names_every_other(caplog):
    host = worker.HostWorker()
    ran = []
    host.submit(fail_read)
    host.submit(lambda: ran.append(1))
    host.submit_background(FailingJob())
    host.submit(fail_step)
    with caplog.at_level(logging.ERROR, logger=worker.__name__):
        with pytest.raises(ValueError, match="^read refused") as raised:
            host.wait()
    assert str(raised.value) == "read refused" and ran == [1]
    assert raised.value.__notes__ == [  # in the order they were submitted
        "2 more STEM host task(s) failed: FailingJob (background): KeyError: 'chunk 2'; "
        "fail_step: RuntimeError: step refused"]
    logged = [r for r in caplog.records if r.name == worker.__name__]
    assert sorted(r.getMessage() for r in logged) == [
        "STEM host worker: task FailingJob (background) failed too: KeyError: 'chunk 2'",
        "STEM host worker: task fail_step failed too: RuntimeError: step refused"]
    assert all(r.exc_info and r.exc_info[1] is not None for r in logged)  # with its traceback
    assert host.wait() >= 0.0  # every failure was reported once: nothing left


def test_a_single_failure_is_raised_as_it_is(caplog):
    host = worker.HostWorker()
    host.submit(fail_step)
    host.submit(lambda: None)
    with caplog.at_level(logging.ERROR, logger=worker.__name__):
        with pytest.raises(RuntimeError, match="^step refused$") as raised:
            host.wait()
    assert not getattr(raised.value, "__notes__", None)
    assert not [r for r in caplog.records if r.name == worker.__name__]


def test_the_exit_hook_logs_a_failure_nobody_waited_for(caplog, monkeypatch):
    host = worker.HostWorker()  # a training's worker that was not closed
    host.submit(fail_step)
    with caplog.at_level(logging.ERROR, logger=worker.__name__):
        worker._finish_at_exit()  # what atexit calls
    logged = [r for r in caplog.records if r.name == worker.__name__]
    assert [r.getMessage() for r in logged] == [
        "STEM host worker: a task failed after the training's last wait: RuntimeError: step "
        "refused"]
    assert logged[0].exc_info[1].args == ("step refused",)


def test_close_waits_ends_the_thread_and_takes_no_more_work():
    """A training's worker (``StemRun.close``): ``close`` waits for the queued work, raising its
    failure, and ends the thread; a closed worker refuses new work with a message."""
    import time

    host = worker.HostWorker()
    done = []
    host.submit(lambda: time.sleep(0.05) or done.append(1))
    host.submit(fail_step)
    with pytest.raises(RuntimeError, match="^step refused$"):
        host.close()
    assert done == [1] and not host.running and host not in worker._LIVE
    with pytest.raises(RuntimeError, match="finished training got new work"):
        host.submit(lambda: None)
