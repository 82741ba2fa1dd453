"""Training ranks forked from a server that has imported torch and Megatron once.

A rank started as ``python launch/pretrain.py`` spends about 5 s of CPU importing torch,
Megatron-Core and the plugin before its first line runs, and the suite starts about a hundred
ranks. ``start_rank`` forks them instead from a server of Python's ``multiprocessing``
(``forkserver``: one fresh interpreter per test process that imports ``PRELOAD`` and forks on
request; nothing has run a thread or a kernel in it, so the fork is safe). A forked rank gets what
an exec'd one gets: its own session, its environment, the working directory, ``sys.argv``, a fresh
interpreter's ``sys.path`` behind the script's folder, the default start method of
``multiprocessing``, its output in a file, ``__main__`` run by ``runpy``,
``atexit`` handlers at the end and the script's exit status.

``run_python`` runs a command-line tool of the package the same way and returns what
``subprocess.run`` would.

Every rank, forked or exec'd, leads a session of its own. ``sweep_sessions`` ends what is left
in those sessions once the ranks are done: processes a rank started and did not end (a checkpoint
writer's spawned worker of a rank stopped midway), which would otherwise outlive the launch,
orphaned, holding their memory until the machine restarts.

A rank whose environment differs from the server's in anything but the rendezvous variables
(a test's ``env``, read perhaps at import) is exec'd as before, and so is every rank with
``TEST_EXEC_RANKS=1`` in the environment.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from typing import Dict, List, Optional, Sequence

# What every rank imports before its first line: launch/pretrain.py and tests/dist/multi_config.py
# import these.
PRELOAD = ["torch", "megatron.core", "megatron.training.training", "megatron_ext.training.entry",
           "megatron_ext.convert.to_hf"]
# Set per rank, as torchrun's static rendezvous sets them, and the test pytest is running (set at
# every phase of every test): read at run time, not at import, so they may differ from the
# server's.
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "PYTEST_CURRENT_TEST")

_SERVER_ENV: Optional[Dict[str, str]] = None
_PATH: Optional[list] = None  # sys.path of a fresh interpreter with the server's environment


def _rank_main(argv: Sequence[str], env: Dict[str, str], cwd: str, out_path: str,
               path: Sequence[str], err_path: Optional[str] = None) -> None:
    """In the forked child: become ``python argv`` with ``env`` in ``cwd``, output to
    ``out_path`` (standard error to ``err_path`` if given); ``path``: ``sys.path`` of a fresh
    interpreter less its first entry."""
    os.setsid()
    # A forked child of the server inherits its start method (forkserver), under which Megatron's
    # data-loader workers, whose init function is local, cannot start; an exec'd rank has the
    # platform's default (fork).
    multiprocessing.set_start_method(None, force=True)
    fd = os.open(out_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if err_path is not None:
        fd = os.open(err_path, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:] = [cwd, *path]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *path]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if isinstance(exc.code, int):
            code = exc.code
        elif exc.code is not None:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # a normal interpreter exit runs them; os._exit below would not
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ForkedRank:
    """``subprocess.Popen``'s ``pid``, ``poll()`` and ``wait()`` for a forked rank."""

    def __init__(self, process):
        self.process = process
        self.pid = process.pid

    def poll(self) -> Optional[int]:
        return self.process.exitcode

    def wait(self) -> int:
        self.process.join()
        return self.process.exitcode


def clock_ticks() -> int:
    """Now, in the clock ticks since boot that ``/proc/PID/stat`` gives start times in."""
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def sweep_sessions(leaders: Sequence[int], since: int) -> List[int]:
    """SIGKILL every live process in the sessions led by ``leaders`` (ranks' pids) that started at
    or after ``since`` (``clock_ticks()`` before the leaders started; so a process of a session
    whose leader's pid was reused by a later one is never touched). Returns the pids signalled.
    Linux only (``/proc``); elsewhere it does nothing."""
    if not os.path.isdir("/proc") or not leaders:
        return []
    sessions = set(leaders)
    killed = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
        state, session, started = fields[0], int(fields[3]), int(fields[19])
        if session in sessions and state not in ("Z", "X") and started >= since:
            try:
                os.kill(int(name), 9)
                killed.append(int(name))
            except ProcessLookupError:
                pass
    return killed


def _ensure_server(env: Dict[str, str]) -> None:
    """The forkserver of this process, started with ``env`` (its environment at import)."""
    global _SERVER_ENV, _PATH
    if _SERVER_ENV is not None:
        return
    from multiprocessing import forkserver

    fresh = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
                           env=env, capture_output=True, text=True, check=True)
    _PATH = json.loads(fresh.stdout)[1:]  # the first entry is the script's folder ('' for -c)

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _SERVER_ENV = dict(env)


def _without_rank_vars(env: Dict[str, str]) -> Dict[str, str]:
    return {k: v for k, v in env.items() if k not in RANK_VARS}


def suite_env() -> Dict[str, str]:
    """The environment of the suite's launches and CLI runs (the server's, while it lasts)."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _forks(env: Dict[str, str]) -> bool:
    """Whether a process with ``env`` is forked from the server (started here on first use):
    ``env`` is ``suite_env()`` but for the rendezvous variables, and ``TEST_EXEC_RANKS`` is not
    1."""
    common = _without_rank_vars(suite_env())
    if os.environ.get("TEST_EXEC_RANKS") == "1" or _without_rank_vars(env) != common:
        return False
    _ensure_server(common)
    return _SERVER_ENV == common


def start_rank(argv: Sequence[str], env: Dict[str, str], cwd: str, out_path: str,
               fork: bool = True):
    """Start ``python argv`` (``-m module ...`` too) as one rank with ``env`` in ``cwd``, its
    output appended to ``out_path``: forked from the server when ``fork`` and ``_forks(env)``,
    else exec'd. Returns a ``Popen`` or a ``ForkedRank``."""
    if fork and _forks(env):
        process = multiprocessing.get_context("forkserver").Process(
            target=_rank_main, args=(list(argv), dict(env), cwd, out_path, _PATH))
        process.start()
        return ForkedRank(process)
    out = open(out_path, "a")
    try:
        return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        out.close()


def run_python(argv: Sequence[str], cwd: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``subprocess.run([python, *argv], capture_output=True, text=True)`` in ``suite_env()``,
    forked from the server (a CLI of the package, ``-m megatron_ext.convert to-hf ...``, without
    its imports); ``subprocess.TimeoutExpired`` past ``timeout`` seconds."""
    env = suite_env()
    if not _forks(env):
        return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout)
    paths = []
    for name in ("out", "err"):
        fd, p = tempfile.mkstemp(prefix=f"run_python_{name}")
        os.close(fd)
        paths.append(p)
    since = clock_ticks() - 1
    process = multiprocessing.get_context("forkserver").Process(
        target=_rank_main, args=(list(argv), env, cwd, paths[0], _PATH, paths[1]))
    process.start()
    process.join(timeout)
    try:
        if process.exitcode is None:
            os.killpg(process.pid, 9)
            process.join()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        texts = []
        for p in paths:
            with open(p) as f:
                texts.append(f.read())
        return subprocess.CompletedProcess([sys.executable, *argv], process.exitcode, *texts)
    finally:
        sweep_sessions([process.pid], since)
        for p in paths:
            os.unlink(p)
