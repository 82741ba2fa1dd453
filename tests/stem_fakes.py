"""Stand-ins for what ``TableSteps.step_table`` (megatron_ext/stem/runtime/schedule.py) needs
around a ``TableStore``, for tests that drive a store's sparse steps themselves: a host worker
that keeps the owed step for the test to run, and a chunk's tables reduced to the store and a
deferred read."""

import collections


class CallerRunsWorker:
    """The host worker as ``TableSteps.step_table`` sees it; the owed step is run by the test."""

    def hand_over(self, tensors):
        list(tensors)

    def submit_background(self, owed, after=None):
        return None

    def wait(self):
        return 0.0


class StoreTable:
    """A chunk's ``StemTables`` as ``TableSteps.step_table`` sees it: its store, a deferred
    read, statistics."""

    def __init__(self, store):
        self.store, self.deferred = store, object()
        self.stats = collections.defaultdict(float)

    def release(self, fetch, after=None):
        pass
