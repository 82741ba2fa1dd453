"""What one training run keeps of its own beside Megatron's globals, in one object.

``training/entry.py`` makes a :class:`TrainingSession` for each run: its log hooks (the family's
``log_report``, then the run report's), its run report (``--ext-run-report``), its checkpoint
manifest writer, and the upstream seams bound to them (``training/upstream_seams.py``).
:meth:`TrainingSession.open` puts the seams in place before ``pretrain``; :meth:`close`, the one
call that ends the run's state, runs on every way out of the entry point (a return, Megatron's
early ``sys.exit``, an error): it writes the run report of a run stopped early, finishes the
manifest being hashed, and puts back the upstream functions the trainer's hooks replaced, so that
another training in the same process (``tests/dist/multi_config.py``) starts from nothing of this
one.
"""

from __future__ import annotations

from typing import List, Optional

from megatron_ext.checkpoint_manifest import ManifestWriter
from megatron_ext.training import checkpoint_hooks, teardown, upstream_seams
from megatron_ext.training.batch import HostTokenGroup
from megatron_ext.training.log_hooks import Hook
from megatron_ext.training.run_report import RunReport
from megatron_ext.training.save_lock import SaveLock


class TrainingSession:
    def __init__(self, family_run, report_path: Optional[str] = None):
        # The family's run of this training (models/family.py FamilyRun), closed with it.
        self.family_run = family_run
        # Run on every rank at every iteration, in this order (training/log_hooks.py).
        self.log_hooks: List[Hook] = []
        if family_run.log_report is not None:
            self.log_hooks.append(family_run.log_report)
        self.report: Optional[RunReport] = RunReport(report_path) if report_path else None
        if self.report is not None:
            self.log_hooks.append(self.report.hook)
        self.manifests = ManifestWriter(log=checkpoint_hooks.log)
        # --save's lock (taken after Megatron's initialisation), the gloo copy of the
        # tensor-parallel group the batches' host tokens travel over (made by the model
        # provider), and the model chunks the optimizer seam saw (their trainer callbacks are
        # dropped at the end: teardown.release_model_configs).
        self.save_lock = SaveLock()
        self.host_tokens = HostTokenGroup()
        self.model_chunks: list = []
        self.closed = False

    def open(self) -> "TrainingSession":
        upstream_seams.install(self)
        return self

    def close(self) -> None:
        """Idempotent. Upstream's functions come back even when the report or the writer
        fails."""
        if self.closed:
            return
        self.closed = True
        try:
            try:
                # The family's background work waited for (STEM's host worker: its last table
                # step) and what it holds let go.
                self.family_run.close()
            finally:
                if self.report is not None:
                    self.report.at_exit()  # a run that stopped before its last iteration
                # Stops waiting for the trackers of asynchronous saves that will not come; a
                # manifest being hashed is finished first (an ended training waited for them).
                self.manifests.close()
        finally:
            teardown.release_model_configs(self.model_chunks)
            self.model_chunks.clear()
            self.host_tokens.close()
            self.save_lock.release_all()
            self.log_hooks.clear()
            upstream_seams.restore(upstream_seams.HOOKS)  # the fixes of upstream bugs stay
