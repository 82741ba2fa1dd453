"""How a launch that cannot start says so: one line, printed once, the last our code prints.

Every start-up check of ``launch/pretrain.py`` ends a refused launch through :func:`refuse`
(``entry.py`` turns the checks' ``ValueError`` into it; a check of its own may call it too).
Under torchrun every rank runs the same checks before any process group exists, so the rank is
read from torchrun's ``RANK`` / ``LOCAL_RANK`` variables. The line is printed once per node, by
its local rank 0 (rank 0 on a single node: the checks read the flags and the node's files and
memory, the same on its every rank); the other ranks exit with the same status silently. A
check whose outcome depends on the rank (its GPU) prints on every rank that fails it
(``per_rank``). No traceback: ``SystemExit`` with a status.

torchrun ends every rank of a node once one exits non-zero: a rank that does not print waits
(at most ``WAIT_S``) for the one that does, so that the line is not lost with a printing rank
ended before it printed; past the wait it prints the line itself, with its rank.

torchrun then prints a ``ChildFailedError`` block of its own (its only way to say the job failed
besides the exit status scripts rely on): the printing rank also writes the line into torchrun's
error file (``TORCHELASTIC_ERROR_FILE``), which that block shows as its root cause instead of
"To enable traceback see: ...".
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import NoReturn

PREFIX = "megatron-ext: "


def launch_rank(name: str = "RANK") -> int:
    """This process's rank as its launcher set it (``RANK`` or ``LOCAL_RANK``; 0 without one)."""
    try:
        return int(os.environ.get(name, "0") or 0)
    except ValueError:
        return 0


# How long a rank that does not print waits under torchrun for the node's printing rank to exit
# (torchrun then ends it): the ranks reach the checks within seconds of each other.
WAIT_S = 30.0


def prints_here(scope: str = "per_node") -> bool:
    """Whether this rank prints a message of ``scope``: ``per_node`` (each node's local rank 0),
    ``per_rank`` (every rank)."""
    return scope == "per_rank" or launch_rank("LOCAL_RANK") == 0


def say(message: str, scope: str = "per_node") -> None:
    """A start-up line that is not a refusal (a warning, a note), printed on ``scope``'s ranks."""
    if prints_here(scope):
        print(PREFIX + message, file=sys.stderr, flush=True)


def refuse(message: str, status: int = 1, scope: str = "per_node") -> NoReturn:
    """End this launch: ``message`` on stderr (after what is already on stdout) on ``scope``'s
    ranks, and exit ``status`` on every rank."""
    line = message if message.startswith(PREFIX) else PREFIX + message
    if not prints_here(scope):
        if not os.environ.get("TORCHELASTIC_RUN_ID"):
            raise SystemExit(status)
        time.sleep(WAIT_S)  # torchrun ends this rank when the printing one exits
        line = f"{PREFIX}(rank {launch_rank()}) {line[len(PREFIX):]}"
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    _tell_torchrun(line)
    raise SystemExit(status)


def _tell_torchrun(line: str) -> None:
    """The error file torchrun reads for its failure summary (its format for a message without a
    traceback: ``torch.distributed.elastic.multiprocessing.errors.ProcessFailure``)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the line is on stderr already; torchrun's summary then has its generic text
