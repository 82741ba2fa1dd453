"""Several ``launch/pretrain.py`` trainings in one launch of the ranks, one after the other.

Usage (as ``tests/multirank.torchrun_many`` launches it): ``python tests/dist/multi_config.py
PLAN.json``, where the plan is ``[{"name", "argv", "log_dir"}, ...]``; an item with a
``"module"`` runs that module's ``main(argv)`` instead of ``launch/pretrain.py`` (e.g.
``megatron_ext.convert.megatron_logits``, several checkpoints' logits in one launch).

Most of a tiny test training is start-up: Python, torch and Megatron imports, the process group.
Here they happen once per launch; between trainings Megatron's global state is torn down with
``megatron_ext.training.teardown.destroy_training_state`` (upstream's
``destroy_global_state``, what its in-process restart uses, and the state the plugin keeps per
process). ``initialize_megatron`` then finds the process group up and builds the model
parallel groups of the next training anew; every training seeds its generators itself.

Each training's output (every rank's, fd 1 and 2) goes to ``log_dir/rank<R>.log``; a training
that ends is marked there with ``MULTI-CONFIG OK``. A training that raises or exits ends the
launch (this rank exits with its status; the launcher stops the others): the trainings after it
are not run, and their logs say so by their absence.

Two options of an item:
- ``"expect_failure": true`` (one-rank launches only: with several ranks one may fail while the
  others wait in a collective): a training that fails is marked ``MULTI-CONFIG FAILED <name>
  status <N>``, the state is torn down and the launch goes on; one that succeeds is marked OK.
- ``"thread_guard": true``: every ``torch.distributed`` collective of the launch is wrapped
  (``tests/dist/thread_guard.py``, installed before Megatron is imported; a call from a thread
  other than the training thread fails the training) and the item's log gets this rank's calls.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

OK = "MULTI-CONFIG OK"
FAILED = "MULTI-CONFIG FAILED"
# After a training's teardown, what this rank still has of torch.distributed: its registered
# process groups and its gloo threads (multirank.assert_teardown_left_only_the_default_group checks
# they do not pile up).
LEFT = "MULTI-CONFIG LEFT"


def gloo_threads() -> int:
    """This process's threads named by gloo (its connection loops), from /proc."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += "gloo" in f.read()
        except OSError:  # the thread has just ended
            pass
    return count


def teardown() -> None:
    import torch

    from megatron_ext.training.teardown import destroy_training_state

    destroy_training_state()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        from torch.distributed.distributed_c10d import _world

        print(f"{LEFT} process groups {len(_world.pg_map)} gloo threads {gloo_threads()}",
              flush=True)


def run_one(entry_main, name: str, argv, log_dir: str, rank: int, expect_failure: bool = False,
            guard=None) -> None:
    os.makedirs(log_dir, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    status = 0
    try:
        sys.argv = [os.path.join(ROOT, "launch", "pretrain.py"), *argv]
        try:
            entry_main()
        except SystemExit as exc:  # an error the entry point reports, or Megatron's early exit
            code = exc.code
            if code not in (None, 0):
                print(code if isinstance(code, str) else f"exit status {code}", file=sys.stderr)
                status = code if isinstance(code, int) else 1
        except BaseException:
            traceback.print_exc()
            status = 1
        if guard is not None:
            guard.report()
        if status == 0:
            teardown()
            print(f"{OK} {name}", flush=True)
        elif expect_failure:
            teardown()
            print(f"{FAILED} {name} status {status}", flush=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(log)
    if status and not expect_failure:
        print(f"multi_config: {name} failed (status {status}); the rest of the launch is not run",
              file=sys.stderr, flush=True)
        os._exit(status)  # the launcher stops the other ranks


def main() -> None:
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    rank = int(os.environ.get("RANK", "0"))
    if any(item.get("expect_failure") for item in plan) and \
            int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("multi_config: expect_failure needs a one-rank launch")
    guard = None
    if any(item.get("thread_guard") for item in plan):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import thread_guard as guard

        guard.install()  # before Megatron imports torch.distributed's operations by name
    from megatron_ext.training.entry import main as entry_main

    for item in plan:
        entry = entry_main
        if "module" in item:  # another entry point of the package: its main(argv)
            module = importlib.import_module(item["module"])
            entry = functools.partial(module.main, list(item["argv"]))
        run_one(entry, item["name"], item["argv"], item["log_dir"], rank,
                expect_failure=bool(item.get("expect_failure")),
                guard=guard if item.get("thread_guard") else None)


if __name__ == "__main__":  # the guard matters: torch_dist checkpoint saving starts processes
    main()
