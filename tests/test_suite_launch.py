"""The suite's launcher (``tests/multirank.py`` ``launch_ranks``, ``tests/rank_server.py``): what
a rank leaves running in its session ends with the launch, forked or exec'd, whether the rank
failed or not; ``sweep_sessions`` never touches a process older than the launch."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from multirank import launch_ranks
from rank_server import clock_ticks, sweep_sessions

pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(not os.path.isdir("/proc"), reason="the sweep reads /proc")]

# A rank that starts a child in its own session (as a checkpoint writer's spawned worker is),
# writes the child's pid and exits with the status it is given, leaving the child behind.
RANK = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(os.path.join(sys.argv[1], f"child{os.environ['RANK']}"), "w") as f:
    f.write(str(child.pid))
sys.exit(int(sys.argv[2]) if os.environ["RANK"] == "0" else 0)
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def wait_gone(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("status", [0, 3])
@pytest.mark.parametrize("start", ["forked", "exec"])
def test_launch_ends_what_ranks_leave_running(tmp_path, status, start):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    code, log = launch_ranks([str(script), str(tmp_path), str(status)], 2, timeout=120,
                             fork=start == "forked")
    assert code == status, log
    children = [int((tmp_path / f"child{rank}").read_text()) for rank in range(2)]
    try:
        for pid in children:
            assert wait_gone(pid), f"the child {pid} a rank left outlived the launch"
    finally:
        for pid in children:
            if alive(pid):
                os.kill(pid, 9)


def test_sweep_spares_processes_older_than_the_launch():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                            start_new_session=True)
    try:
        # A session led by this pid, but its process started before "the launch": untouched.
        assert sweep_sessions([proc.pid], clock_ticks() + 100) == []
        assert proc.poll() is None
        # The same process, once it counts as the launch's: ended.
        assert sweep_sessions([proc.pid], clock_ticks() - 100) == [proc.pid]
        assert proc.wait(timeout=10) == -9
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
