"""multi_node.sh / slurm.sbatch: a rendezvous host that does not resolve is one line, before
torchrun (which retried it for over a minute, a C++ stack per try, then failed)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.test_launch_scripts import CLEARED, LAUNCH

NO_HOST = "no-such-node.invalid"  # RFC 6761: never resolves


@pytest.fixture
def stubs(tmp_path):
    """torchrun and srun stubs that only say they ran."""
    for name in ("torchrun", "srun"):
        path = tmp_path / name
        path.write_text("#!/usr/bin/env bash\necho \"stub $0 ran\"\n")
        path.chmod(0o755)
    (tmp_path / "scontrol").write_text("#!/usr/bin/env bash\necho localhost\n")
    (tmp_path / "scontrol").chmod(0o755)
    return tmp_path


def run(script, args, stubs, **env):
    base = {k: v for k, v in os.environ.items() if k not in CLEARED and not k.startswith("SLURM_")}
    base.update(env, TORCHRUN=str(stubs / "torchrun"), PATH=f"{stubs}:{os.environ['PATH']}")
    return subprocess.run(["bash", os.path.join(LAUNCH, script), "--preset", "stem_cpu",
                           "--device", "gpu", "--mock-data", *args], env=base,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args,env,named", [
    (["--nodes", "2", "--master-addr", NO_HOST], {}, "option --master-addr"),
    (["--nodes", "2", "--rdzv-endpoint", f"{NO_HOST}:29511"], {}, "option --rdzv-endpoint"),
    (["--nodes", "2"], {"MASTER_ADDR": NO_HOST}, "MASTER_ADDR (environment)"),
])
def test_multi_node_refuses_a_host_that_does_not_resolve(stubs, args, env, named):
    proc = run("multi_node.sh", args, stubs, **env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert f"multi_node.sh: error: {named}: the rendezvous host '{NO_HOST}' does not resolve" \
        in proc.stderr
    assert "stub" not in proc.stdout


def test_multi_node_runs_with_a_host_that_resolves_and_says_what_it_waits_for(stubs):
    for host in ("localhost", "127.0.0.1"):
        proc = run("multi_node.sh", ["--nodes", "2", "--master-addr", host, "--rdzv-id", "r1"],
                   stubs)
        assert proc.returncode == 0 and "stub" in proc.stdout, proc.stderr
        assert f"rendezvous {host}:29500, id r1: waiting for 2 node(s)" in proc.stderr
    # --print-only prints a command for the nodes: nothing resolved here.
    proc = run("multi_node.sh", ["--nodes", "2", "--master-addr", NO_HOST, "--print-only"], stubs)
    assert proc.returncode == 0, proc.stderr


def test_slurm_job_refuses_a_master_addr_that_does_not_resolve(stubs):
    job = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1"}
    proc = run("slurm.sbatch", ["--master-addr", NO_HOST], stubs, **job)
    assert proc.returncode == 2 and f"option --master-addr: the rendezvous host '{NO_HOST}'" \
        in proc.stderr, (proc.stdout, proc.stderr)
    proc = run("slurm.sbatch", [], stubs, **job)  # the job's first node
    assert proc.returncode == 0 and "stub" in proc.stdout, proc.stderr
