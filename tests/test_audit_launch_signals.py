"""A scheduler's stop reaching a launch with a log file (launch/common.sh, slurm.sbatch).

Slurm's time limit and ``scancel`` send SIGTERM to every process of the job step, Ctrl-C sends
SIGINT to the terminal's process group: with ``--log-dir`` that is the script's shell, torchrun
and the ``tee`` writing the node's log. torchrun hands the signal to the ranks, and Megatron's
``--exit-signal-handler`` saves a checkpoint before they exit; the log pipe and the waiting
shell must outlive that. A stub ``torchrun`` stands in for the training: it waits for the
signal, then prints (as the ranks print the save) and exits with a status of its own.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess

import pytest

from tests.test_launch_scripts import CLEARED, LAUNCH, Printed, value

STUB = """#!/usr/bin/env bash
trap 'stop=1' TERM INT
echo "stub ready"
while [[ -z ${stop:-} ]]; do sleep 0.02; done
for i in 1 2 3; do echo "stub: checkpoint line $i after the signal"; done
exit 7
"""


@pytest.fixture
def stub_torchrun(tmp_path):
    path = tmp_path / "torchrun"
    path.write_text(STUB)
    path.chmod(0o755)
    return str(path)


def env_with(**extra):
    env = {k: v for k, v in os.environ.items() if k not in CLEARED and not k.startswith("SLURM_")}
    env.update(extra)
    return env


def stop_when_ready(cmd, env, sig=signal.SIGTERM):
    """Start ``cmd`` in a process group of its own, send ``sig`` to the whole group once the
    stub says it is ready (as Slurm signals a step's processes, a terminal its foreground
    group), and return (status, what it printed)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("stub ready"):
                os.killpg(proc.pid, sig)
                break
        out.extend(proc.stdout)
        return proc.wait(timeout=60), "".join(out)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_leaves_the_log_open_and_the_status_torchruns(stub_torchrun, tmp_path,
                                                                    sig):
    logs = tmp_path / "logs"
    cmd = ["bash", os.path.join(LAUNCH, "single_node.sh"), "--preset", "stem_cpu",
           "--device", "gpu", "--mock-data", "--log-dir", str(logs)]
    status, printed = stop_when_ready(cmd, env_with(TORCHRUN=stub_torchrun,
                                                    LAUNCH_TIMESTAMP="20260101-000000"), sig)
    log = (logs / "logs" / "20260101-000000_node0.log").read_text()
    assert status == 7, (status, printed)  # torchrun's status, not the signal's
    for i in (1, 2, 3):
        line = f"stub: checkpoint line {i} after the signal"
        assert line in log and line in printed


def test_slurm_node_script_keeps_its_log_through_sigterm(stub_torchrun, tmp_path):
    """The inline script srun runs on each node with --log-dir: the same under SIGTERM."""
    env = env_with(SLURM_JOB_ID="9", SLURM_JOB_NODELIST="n1", SLURM_JOB_NUM_NODES="1",
                   SLURM_GPUS_ON_NODE="2", TORCHRUN=stub_torchrun,
                   LAUNCH_TIMESTAMP="20260101-000000")
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    (tmp_path / "scontrol").write_text("#!/usr/bin/env bash\necho n1\n")
    (tmp_path / "scontrol").chmod(0o755)
    proc = subprocess.run(["bash", os.path.join(LAUNCH, "slurm.sbatch"), "--preset", "stem_cpu",
                           "--device", "gpu", "--mock-data", "--log-dir", str(tmp_path / "runs"),
                           "--print-only"], env=env, capture_output=True, text=True, timeout=60)
    launcher = Printed(proc).launcher
    node_cmd = launcher[launcher.index("bash"):]  # what srun runs on every node
    assert node_cmd[1] == "-c"
    (tmp_path / "runs" / "logs").mkdir(parents=True)  # made by the job before srun
    status, printed = stop_when_ready(node_cmd, dict(env, SLURM_NODEID="0"))
    log = (tmp_path / "runs" / "logs" / "20260101-000000_node0.log").read_text()
    assert status == 7, (status, printed, shlex.join(node_cmd))
    assert "stub: checkpoint line 3 after the signal" in log


def test_a_run_that_saves_checkpoints_saves_one_when_stopped():
    """With --save the scripts ask Megatron to save and exit on SIGTERM (its
    --exit-signal-handler), so a stopped job resumes where it stopped, not at its last
    --save-interval checkpoint; without --save there is nothing to save."""
    base = ["--preset", "stem_cpu", "--device", "gpu", "--mock-data", "--print-only"]
    for script, extra in [("single_node.sh", []),
                          ("multi_node.sh", ["--nodes", "2", "--master-addr", "h"]),
                          ("slurm.sbatch", [])]:
        run = lambda *a: subprocess.run(["bash", os.path.join(LAUNCH, script), *base, *extra, *a],
                                        env=env_with(), capture_output=True, text=True,
                                        timeout=60)
        saving = Printed(run("--save", "/ck")).megatron
        assert saving.count("--exit-signal-handler") == 1, script
        assert value(saving, "--save") == "/ck"
        assert "--exit-signal-handler" not in Printed(run()).megatron, script
        # Given after '--' (or --save given there): once.
        given = Printed(run("--", "--save", "/ck", "--exit-signal-handler")).megatron
        assert given.count("--exit-signal-handler") == 1, script
