"""pytest that survives a crashing test: what ran, and the test a crash or hang stopped in.

A test that kills its process (a segmentation fault in a compiled kernel, an abort, a hang) takes
pytest's JUnit report with it, and every file after it goes unrun: on an H100 the GPU tests died
of SIGSEGV at 81% of their files and the one failure before it was lost (issue 48). Here pytest
runs as a child with this module loaded as its plugin (``-p isolated_pytest``), which appends
one JSON line per event (collected, started, each phase's outcome, finished) to a log, flushed
as it is written. When the child dies, or no test starts or finishes for ``--test-timeout``
seconds (the child is then killed), the log names the test that started and never finished;
pytest starts again on the files that had not started (a crash before the first test: each file
alone, so that the one that dies is found). ``--json`` gets, per file, the tests passed, failed,
errored, skipped, crashed and never run, the failing test ids, the crash; it is rewritten before
and after each pytest run, so a kill of this process too (the GPU runner's step limit) leaves a
record that :func:`load` completes from the event logs.

    python scripts/isolated_pytest.py --json OUT.json [--junit-dir DIR] [--test-timeout 180] \\
        tests/test_a.py tests/test_b.py::test_one ...
    python scripts/isolated_pytest.py --collect-only tests/test_a.py ...   # collection alone

Exit status: 0 when at least one test passed and nothing failed, errored or crashed; 5 when no
test passed (all skipped: on the GPU machine, no GPU or a missing package); 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
EVENTS_ENV = "ISOLATED_PYTEST_EVENTS"
NORMAL_EXITS = (0, 1, 5)  # pytest: all passed, some failed, none collected
STARTUP_S = 60.0


# ----------------------------------------------------------------------------- the plugin (child)

_events = None


def _event(record: dict) -> None:
    global _events
    path = os.environ.get(EVENTS_ENV)
    if not path:
        return
    if _events is None:
        # Line-buffered: each event is in the kernel's hands once written, so a segmentation
        # fault a moment later loses none of them.
        _events = open(path, "a", buffering=1)
    _events.write(json.dumps(record) + "\n")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def pytest_collection_finish(session) -> None:
    _event({"collected": [[item.nodeid, str(item.path)] for item in session.items]})


def pytest_collectreport(report) -> None:
    if report.failed:
        _event({"collect_error": report.nodeid, "path": str(report.fspath),
                "message": _last_line(report.longreprtext)})


def pytest_runtest_logstart(nodeid, location) -> None:
    _event({"start": nodeid})


def pytest_runtest_logreport(report) -> None:
    record = {"report": report.nodeid, "when": report.when, "outcome": report.outcome}
    if report.skipped:
        record["xfail"] = hasattr(report, "wasxfail")
        if isinstance(report.longrepr, tuple):  # (file, line, "Skipped: reason")
            record["reason"] = str(report.longrepr[2]).removeprefix("Skipped: ")
    if report.failed:
        record["message"] = _last_line(report.longreprtext)
    _event(record)


def pytest_runtest_logfinish(nodeid, location) -> None:
    _event({"finish": nodeid})


# ----------------------------------------------------------------------------- reading the logs

def _file_of(arg: str) -> str:
    return arg.split("::", 1)[0]


def _read_events(path: str) -> List[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:  # a line cut by the crash
                    pass
    except OSError:
        pass
    return out


def signal_name(rc: int) -> str:
    try:
        return f"{signal.Signals(-rc).name}, exit {rc}"
    except ValueError:
        return f"exit {rc}"


def _empty() -> dict:
    return {"collected": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "crashed": 0,
            "not_run": 0, "failed_ids": [], "crashed_in": None, "crash": None,
            "skip_reasons": {}}


def _keys(doc: dict, events: List[dict]) -> Dict[str, str]:
    """Each collected test's file, keyed as the arguments spell it (node ids are relative to
    pytest's rootdir, the arguments to the working folder)."""
    key_of_path = {os.path.realpath(p): k for k, p in doc["paths"].items()}
    return {nodeid: key_of_path.get(os.path.realpath(path), _file_of(nodeid))
            for ev in events if "collected" in ev for nodeid, path in ev["collected"]}


def summarize(doc: dict) -> dict:
    """Per file (keyed as the arguments spell it) and in total, from every pytest run's events
    (``doc``: what :func:`main` writes, its ``parts`` and ``paths``)."""
    key_of_path = {os.path.realpath(p): k for k, p in doc["paths"].items()}
    files: Dict[str, dict] = {k: _empty() for k in doc["paths"]}
    problems: List[str] = []
    for part in doc["parts"]:
        if part.get("retried"):  # died before its first test; its files ran again one by one
            continue
        events = _read_events(part["events"])
        key = _keys(doc, events)
        phases: Dict[str, Dict[str, dict]] = {}
        started: List[str] = []
        finished = set()
        collect_errors = 0
        for k in key.values():
            files.setdefault(k, _empty())["collected"] += 1
        for ev in events:
            if "collect_error" in ev:
                collect_errors += 1
                k = key_of_path.get(os.path.realpath(ev.get("path", "")), ev["collect_error"])
                f = files.setdefault(k, _empty())
                f["errors"] += 1
                f["failed_ids"].append(f"{ev['collect_error']} (collection: {ev['message']})")
            elif "start" in ev:
                started.append(ev["start"])
            elif "report" in ev:
                phases.setdefault(ev["report"], {})[ev["when"]] = ev
            elif "finish" in ev:
                finished.add(ev["finish"])
        for nodeid in started:
            f = files.setdefault(key.get(nodeid, _file_of(nodeid)), _empty())
            if nodeid not in finished:  # the test it died in (or was killed in)
                f["crashed"] += 1
                f["crashed_in"] = nodeid
                f["crash"] = _how_it_ended(part, in_test=True)
                f["not_run"] += sum(1 for n, k in key.items()
                                    if k == key.get(nodeid) and n not in started)
                continue
            p = phases.get(nodeid, {})
            if any(ev["outcome"] == "failed" for w, ev in p.items() if w != "call"):
                f["errors"] += 1  # setup or teardown
                f["failed_ids"].append(nodeid)
            elif p.get("call", {}).get("outcome") == "failed":
                f["failed"] += 1
                f["failed_ids"].append(nodeid)
            elif any(ev["outcome"] == "skipped" for ev in p.values()):
                f["skipped"] += 1
                reason = next((ev.get("reason") for ev in p.values()
                               if ev["outcome"] == "skipped"), None) or "xfail"
                f["skip_reasons"][reason] = f["skip_reasons"].get(reason, 0) + 1
            else:
                f["passed"] += 1
        ended_badly = part.get("killed") or part.get("exit") not in NORMAL_EXITS
        if ended_badly and all(n in finished for n in started) and not collect_errors:
            # Died outside any test: before the first (import, collection) or after the last.
            where = "before its first test" if not started else "after its last test"
            ks = sorted({_file_of(a) for a in part["args"]})
            if len(ks) == 1 and not started:
                f = files[ks[0]]
                f["crashed"] += 1
                f["crashed_in"] = f"{ks[0]} ({where})"
                f["crash"] = _how_it_ended(part, in_test=False)
            else:
                problems.append(f"pytest on {' '.join(part['args'])}: "
                                f"{_how_it_ended(part, in_test=False)} {where}")
    totals = {k: sum(f[k] for f in files.values())
              for k in ("passed", "failed", "errors", "skipped", "crashed", "not_run")}
    return dict(doc, files=files, totals=totals, problems=problems)


def _how_it_ended(part: dict, in_test: bool) -> str:
    if part.get("killed"):
        return part["killed"]
    rc = part.get("exit")
    if rc is None:
        return "stopped from outside (the step's time limit?) while it ran"
    if rc < 0:
        return signal_name(rc)
    if in_test:
        return f"exit {rc} inside the test"
    said = [ln for ln in part.get("output_tail", []) if ln.strip()]
    return f"exit {rc}" + (f": {said[-1].strip()[:300]}" if said else "")


def exit_status(summary: dict) -> int:
    t = summary["totals"]
    if t["failed"] or t["errors"] or t["crashed"] or summary["problems"]:
        return 1
    return 0 if t["passed"] else 5


def load(path: str) -> dict:
    """The result ``main`` wrote at ``path``, completed from the event logs (a run stopped
    from outside wrote its last record before its last pytest run started)."""
    with open(path) as f:
        return summarize(json.load(f))


def describe(summary: dict) -> List[str]:
    lines = []
    for k, f in summary["files"].items():
        line = (f"{k}: {f['passed']} passed, {f['failed']} failed, {f['errors']} errors, "
                f"{f['skipped']} skipped")
        if f["crashed"]:
            line += f"; crashed in {f['crashed_in']} ({f['crash']}), {f['not_run']} not run"
        if f["failed_ids"]:
            line += "; failed: " + ", ".join(f["failed_ids"])
        lines.append(line)
    lines += [f"problem: {p}" for p in summary["problems"]]
    t = summary["totals"]
    lines.append(f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
                 f"{t['skipped']} skipped, {t['crashed']} crashed, {t['not_run']} not run")
    return lines


# ----------------------------------------------------------------------------- the driver

def _write(doc: dict, path: Optional[str]) -> None:
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)


def _run_part(args: List[str], events: str, junit: Optional[str], test_timeout: float,
              part: dict) -> None:
    """One pytest child on ``args``; ``part`` gets its exit status, or ``killed`` when its
    events stopped for ``test_timeout`` seconds, and the last lines of its output."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "isolated_pytest",
           *([f"--junitxml={junit}"] if junit else []), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{EVENTS_ENV: events})
    env["PYTHONPATH"] = HERE + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    open(events, "w").close()
    # Same process group as this one: the GPU runner's kill of its step reaches the child too.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    tail: collections.deque = collections.deque(maxlen=40)

    def echo():
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    size, last = 0, time.time()
    while proc.poll() is None:
        now = os.path.getsize(events)
        if now != size:
            size, last = now, time.time()
        # Before the first event, start-up and collection (torch and Megatron imports: tens of
        # seconds on a busy machine) get at least STARTUP_S.
        elif time.time() - last > (test_timeout if size else max(test_timeout, STARTUP_S)):
            part["killed"] = f"timeout: no progress for {time.time() - last:.0f} s " \
                             f"(--test-timeout {test_timeout:g})"
            proc.kill()
            break
        time.sleep(0.2)
    part["exit"] = proc.wait()
    reader.join(timeout=5)
    part["output_tail"] = list(tail)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tests", nargs="+", help="test files or node ids (file::test)")
    p.add_argument("--json", default=None, help="the result, per file (rewritten as it goes)")
    p.add_argument("--junit-dir", default=None,
                   help="one JUnit report per pytest run here (part0.xml, part1.xml, ...)")
    p.add_argument("--test-timeout", type=float, default=300.0,
                   help="kill pytest when no test has started or finished for this long "
                        f"(before the first test: at least {STARTUP_S:g} s)")
    p.add_argument("--collect-only", action="store_true",
                   help="collect the tests in one pytest run, run none")
    opts = p.parse_args(argv)
    if opts.collect_only:
        return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                               "-p", "no:cacheprovider", *opts.tests]).returncode
    if opts.test_timeout <= 0:
        p.error(f"--test-timeout={opts.test_timeout:g} must be positive")

    out = os.path.abspath(opts.json) if opts.json else None
    work = opts.junit_dir or (os.path.splitext(out)[0] if out else None)
    if work is None:
        import tempfile

        work = tempfile.mkdtemp(prefix="isolated_pytest_")
    os.makedirs(work, exist_ok=True)
    doc = {"status": "running", "paths": {}, "parts": []}
    for a in opts.tests:
        doc["paths"].setdefault(_file_of(a), os.path.abspath(_file_of(a)))
    pending, one_file = list(opts.tests), False
    while pending:
        if one_file:
            first = _file_of(pending[0])
            batch = [a for a in pending if _file_of(a) == first]
        else:
            batch = list(pending)
        n = len(doc["parts"])
        part = {"args": batch, "events": os.path.join(work, f"part{n}.events.jsonl"),
                "exit": None}
        doc["parts"].append(part)
        _write(doc, out)  # a kill from outside from here on still names the test
        _run_part(batch, part["events"], os.path.join(work, f"part{n}.xml")
                  if opts.junit_dir else None, opts.test_timeout, part)
        events = _read_events(part["events"])
        key = _keys(doc, events)
        started = {key.get(ev["start"], _file_of(ev["start"])) for ev in events if "start" in ev}
        left = [a for a in pending if a not in batch]
        if not part.get("killed") and part["exit"] in NORMAL_EXITS:
            pending = left
        elif not started and len({_file_of(a) for a in batch}) > 1:
            # Died before any test (an import, collection): each file alone finds which.
            part["retried"] = True
            one_file = True
        else:  # the files that had not started run in a new pytest
            rest = [a for a in pending if _file_of(a) not in started]
            pending = rest if started and len(rest) < len(pending) else left
        if part.get("killed") or part["exit"] not in NORMAL_EXITS:
            print(f"[isolated-pytest] pytest ended ({_how_it_ended(part, False)}); "
                  f"{len(pending)} test arguments left to run", flush=True)
    doc["status"] = "done"
    summary = summarize(doc)
    _write(summary, out)
    print("\n[isolated-pytest] " + "\n[isolated-pytest] ".join(describe(summary)), flush=True)
    status = exit_status(summary)
    if status == 5:
        reasons = collections.Counter()
        for f in summary["files"].values():
            reasons.update(f["skip_reasons"])
        print(f"[isolated-pytest] no test passed: all {summary['totals']['skipped']} skipped "
              f"(no GPU or a missing package?): {dict(reasons)}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
