"""The cluster launch scripts (launch/single_node.sh, multi_node.sh, slurm.sbatch, common.sh).

Commands are checked as tokens (``shlex.split`` of what ``--print-only`` prints), never as
substrings. Stub ``torchrun``/``srun``/``scontrol`` executables show that what is printed is what
runs, without starting Megatron; one real 2-rank CPU run goes through ``single_node.sh``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch")
SCRIPTS = ["common.sh", "single_node.sh", "multi_node.sh", "slurm.sbatch"]
PRETRAIN = os.path.join(LAUNCH, "pretrain.py")

# Variables the scripts read or set: removed so the caller's environment cannot leak in.
CLEARED = ("CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG",
           "NCCL_IB_TIMEOUT", "NCCL_NVLS_ENABLE", "TORCH_CUDA_ARCH_LIST", "OMP_NUM_THREADS",
           "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
           "PYTHON", "TORCHRUN", "MEGATRON_EXT_ROOT", "LAUNCH_TIMESTAMP")

GPU_H100 = ["--device", "gpu", "--gpu", "h100"]


def run_script(script, *args, env=None, timeout=120):
    base = {k: v for k, v in os.environ.items() if k not in CLEARED and not k.startswith("SLURM_")}
    base.update(env or {})
    return subprocess.run(["bash", os.path.join(LAUNCH, script), *args], cwd=ROOT, env=base,
                          capture_output=True, text=True, timeout=timeout)


class Printed:
    """What ``--print-only`` printed: exported variables, the command and its tee target."""

    def __init__(self, proc):
        assert proc.returncode == 0, proc.stderr
        self.env = {}
        commands = []
        for line in proc.stdout.splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            tokens = shlex.split(line)
            if tokens[0] == "export":
                name, _, value = tokens[1].partition("=")
                self.env[name] = value
            else:
                commands.append(tokens)
        assert len(commands) == 1, proc.stdout
        tokens = commands[0]
        self.tee = None
        if "|" in tokens:
            bar = tokens.index("|")
            assert tokens[bar - 1] == "2>&1" and tokens[bar + 1:bar + 3] == ["tee", "-a"]
            self.tee = tokens[bar + 3]
            assert len(tokens) == bar + 4
            tokens = tokens[:bar - 1]
        self.tokens = tokens
        i = tokens.index(PRETRAIN)
        self.launcher, self.megatron = tokens[:i], tokens[i + 1:]


def value(tokens, flag):
    """The single value of ``flag`` (``--f v`` or ``--f=v``); fails when it is absent or repeated."""
    found = [tokens[i + 1] for i, t in enumerate(tokens) if t == flag]
    found += [t.split("=", 1)[1] for t in tokens if t.startswith(flag + "=")]
    assert len(found) == 1, f"{flag}: {found} in {tokens}"
    return found[0]


def count(tokens, flag):
    return sum(t == flag or t.startswith(flag + "=") for t in tokens)


def torchrun_part(launcher):
    """The torchrun executable and its options inside a launcher prefix (after srun/bash -c)."""
    i = max(i for i, t in enumerate(launcher) if os.path.basename(t) == "torchrun")
    return launcher[i:]


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", os.path.join(LAUNCH, script)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS[1:])
def test_help_needs_no_preset(script):
    proc = run_script(script, "--help")
    assert proc.returncode == 0 and "--preset NAME" in proc.stdout and "--print-only" in proc.stdout


def test_megatron_fsdp_leaves_the_device_connections_unset():
    """Megatron-FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1, the scripts' default for TP/SP
    overlap: with --use-megatron-fsdp among the flags they leave it unset (the entry point then
    leaves it unset too)."""
    proc = run_script("single_node.sh", "--preset", "dense_1b", *GPU_H100, "--mock-data",
                      "--print-only", "--", "--use-megatron-fsdp")
    p = Printed(proc)
    assert count(p.megatron, "--use-megatron-fsdp") == 1
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in p.env
    assert p.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_single_node_print_only(tmp_path):
    logs = tmp_path / "logs"
    proc = run_script("single_node.sh", "--preset", "stem_1b", *GPU_H100, "--tp", "2", "--pp", "2",
                      "--data-path", "/data/my corpus_text_document", "--tokenizer-model",
                      "meta-llama/Llama-3.2-1B", "--save", str(tmp_path / "ckpt"),
                      "--log-dir", str(logs), "--micro-batch-size", "2", "--train-iters", "100",
                      "--print-only")
    p = Printed(proc)
    tr = torchrun_part(p.launcher)
    assert tr == p.launcher and "--standalone" in tr
    assert value(tr, "--nproc-per-node") == "8" and value(tr, "--nnodes") == "1"
    assert count(tr, "--rdzv-endpoint") == 0
    m = p.megatron
    assert value(m, "--preset") == "stem_1b"
    assert value(m, "--tensor-model-parallel-size") == "2"
    assert value(m, "--pipeline-model-parallel-size") == "2"
    assert value(m, "--expert-model-parallel-size") == "1"
    assert value(m, "--context-parallel-size") == "1"
    assert value(m, "--micro-batch-size") == "2" and value(m, "--train-iters") == "100"
    assert value(m, "--data-path") == "/data/my corpus_text_document"  # one token, space kept
    assert value(m, "--tokenizer-type") == "HuggingFaceTokenizer"
    assert value(m, "--tokenizer-model") == "meta-llama/Llama-3.2-1B"
    assert value(m, "--save") == str(tmp_path / "ckpt") == value(m, "--load")
    assert value(m, "--ckpt-format") == "torch_dist" and value(m, "--save-interval") == "1000"
    assert value(m, "--tensorboard-dir") == str(logs / "tb")
    assert value(m, "--tensorboard-log-interval") == "1" and value(m, "--log-interval") == "10"
    assert value(m, "--distributed-backend") == "nccl" and count(m, "--log-throughput") == 1
    assert count(m, "--mock-data") == 0 and count(m, "--no-rope-fusion") == 0
    assert re.fullmatch(re.escape(str(logs)) + r"/logs/\d{8}-\d{6}_node0\.log", p.tee)
    assert p.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert p.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert p.env["NCCL_NVLS_ENABLE"] == "1" and p.env["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert int(p.env["OMP_NUM_THREADS"]) >= 1 and "CUDA_VISIBLE_DEVICES" not in p.env
    assert not tmp_path.joinpath("logs").exists() and not tmp_path.joinpath("ckpt").exists()


def test_cpu_print_only_uses_gloo_and_mock_tokenizer():
    proc = run_script("single_node.sh", "--preset", "stem_cpu", "--device", "cpu",
                      "--gpus-per-node", "2", "--mock-data", "--load", "/ck", "--print-only")
    p = Printed(proc)
    m = p.megatron
    assert value(p.launcher, "--nproc-per-node") == "2" and p.tee is None
    assert value(m, "--distributed-backend") == "gloo"
    for flag in ("--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                 "--no-bias-swiglu-fusion", "--no-rope-fusion", "--mock-data"):
        assert count(m, flag) == 1, flag
    assert value(m, "--eval-iters") == "0" and value(m, "--log-interval") == "1"
    # The preset's vocabulary (stem_cpu.json: 512) sizes the NullTokenizer.
    assert value(m, "--tokenizer-type") == "NullTokenizer" and value(m, "--vocab-size") == "512"
    assert value(m, "--load") == "/ck" and count(m, "--save") == 0
    assert p.env["CUDA_VISIBLE_DEVICES"] == "" and "NCCL_DEBUG" not in p.env


def test_multi_node_print_only():
    proc = run_script("multi_node.sh", "--preset", "structmoe_0p9b", "--device", "gpu", "--gpu",
                      "a100", "--nodes", "4", "--master-addr", "node0", "--master-port", "29600",
                      "--rdzv-id", "run42", "--node-rank", "3", "--tp", "2", "--pp", "2",
                      "--cp", "2", "--ep", "4", "--mock-data", "--log-dir", "/runs/x",
                      "--print-only")
    p = Printed(proc)
    tr = torchrun_part(p.launcher)
    assert value(tr, "--nnodes") == "4" and value(tr, "--nproc-per-node") == "8"
    assert value(tr, "--rdzv-backend") == "c10d"
    assert value(tr, "--rdzv-endpoint") == "node0:29600" and value(tr, "--rdzv-id") == "run42"
    assert "--standalone" not in tr and count(tr, "--node-rank") == 0
    assert [value(p.megatron, f"--{d}-model-parallel-size") for d in
            ("tensor", "pipeline", "expert")] == ["2", "2", "4"]
    assert value(p.megatron, "--context-parallel-size") == "2"
    assert re.fullmatch(r"/runs/x/logs/\d{8}-\d{6}_node3\.log", p.tee)
    assert p.env["NCCL_NVLS_ENABLE"] == "0" and p.env["TORCH_CUDA_ARCH_LIST"] == "8.0"


def test_multi_node_endpoint_forms():
    base = ["--preset", "dense_cpu", "--device", "gpu", "--nodes", "2", "--mock-data",
            "--print-only"]
    tr = torchrun_part(Printed(run_script("multi_node.sh", *base, "--rdzv-endpoint",
                                          "10.0.0.1:1234")).launcher)
    assert value(tr, "--rdzv-endpoint") == "10.0.0.1:1234"
    tr = torchrun_part(Printed(run_script("multi_node.sh", *base, "--rdzv-endpoint", "head",
                                          "--master-port", "4321")).launcher)
    assert value(tr, "--rdzv-endpoint") == "head:4321"
    tr = torchrun_part(Printed(run_script("multi_node.sh", *base,
                                          env={"MASTER_ADDR": "envhost"})).launcher)
    assert value(tr, "--rdzv-endpoint") == "envhost:29500"
    assert value(tr, "--rdzv-id") == "megatron-ext"


def test_slurm_print_only_outside_slurm():
    proc = run_script("slurm.sbatch", "--preset", "stem_1b", "--mock-data", "--log-dir", "/runs/s",
                      "--save", "/ck", "--print-only")
    p = Printed(proc)
    assert p.tee is None  # the tee runs on each node, inside srun
    srun = p.launcher[:p.launcher.index("bash")]
    assert srun[0] == "srun" and value(srun, "--nodes") == "4"  # the #SBATCH --nodes header
    assert value(srun, "--ntasks-per-node") == "1" and value(srun, "--kill-on-bad-exit") == "1"
    bash = p.launcher[len(srun):]
    assert bash[1] == "-c" and "tee" in shlex.split(bash[2])
    assert re.fullmatch(r"/runs/s/logs/\d{8}-\d{6}_node", bash[3])
    tr = torchrun_part(p.launcher)
    assert tr == bash[4:]
    assert value(tr, "--nnodes") == "4" and value(tr, "--nproc-per-node") == "8"
    assert value(tr, "--rdzv-backend") == "c10d"
    assert value(tr, "--rdzv-endpoint") == "<first-node>:29500"
    assert value(tr, "--rdzv-id") == "<job-id>"
    # A command for the cluster: GPU flags although this machine may have none.
    assert value(p.megatron, "--distributed-backend") == "nccl"
    assert value(p.megatron, "--save") == "/ck" == value(p.megatron, "--load")

    p = Printed(run_script("slurm.sbatch", "--preset", "stem_1b", "--mock-data", "--nodes", "2",
                           "--gpus-per-node", "4", "--master-addr", "gpu7", "--print-only"))
    assert p.launcher[0] == "srun" and "bash" not in p.launcher
    tr = torchrun_part(p.launcher)
    assert value(p.launcher, "--nodes") == "2" and value(tr, "--nnodes") == "2"
    assert value(tr, "--nproc-per-node") == "4" and value(tr, "--rdzv-endpoint") == "gpu7:29500"


@pytest.fixture
def stubs(tmp_path):
    """A directory of stub executables (put first on PATH) that record their arguments."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "record"

    def make(name, body):
        path = bindir / name
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)
        return str(path)

    make("scontrol", 'printf "gpu001\\ngpu002\\n"\n')
    make("srun", f'printf "%s\\n" "$@" > {record}\n')
    torchrun = make("torchrun", f'printf "%s\\n" "$@" > {record}\nenv > {record}.env\n'
                                'echo "stub torchrun output"\nexit "${STUB_RC:-0}"\n')
    return {"path": f"{bindir}:{os.environ['PATH']}", "record": record, "torchrun": torchrun}


def recorded(stubs):
    return stubs["record"].read_text().splitlines()


def test_slurm_inside_a_job(stubs, tmp_path):
    env = {"PATH": stubs["path"], "SLURM_JOB_ID": "777", "SLURM_JOB_NODELIST": "gpu[001-002]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_ON_NODE": "64",
           "TORCHRUN": "torchrun"}
    args = ["--preset", "stem_1b", "--device", "gpu", "--mock-data", "--log-dir",
            str(tmp_path / "runs")]
    env["LAUNCH_TIMESTAMP"] = "20260101-000000"
    p = Printed(run_script("slurm.sbatch", *args, "--print-only", env=env))
    tr = torchrun_part(p.launcher)
    assert value(p.launcher, "--nodes") == "2" and value(tr, "--nnodes") == "2"
    assert value(tr, "--nproc-per-node") == "4"  # SLURM_GPUS_ON_NODE
    assert value(tr, "--rdzv-endpoint") == "gpu001:29500" and value(tr, "--rdzv-id") == "777"
    assert p.env["OMP_NUM_THREADS"] == "16"  # 64 cores / 4 ranks
    # Submitted: srun gets exactly the printed arguments; the node log directory exists.
    proc = run_script("slurm.sbatch", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    ran = recorded(stubs)
    assert ran == p.tokens[1:]
    assert ran[ran.index("-c") + 2] == str(tmp_path / "runs/logs/20260101-000000_node")
    assert (tmp_path / "runs" / "logs").is_dir()
    # The job's node count cannot be changed from inside the job.
    proc = run_script("slurm.sbatch", *args, "--nodes", "3", "--print-only", env=env)
    assert proc.returncode == 2 and "--nodes 3" in proc.stderr and "sbatch --nodes" in proc.stderr


def test_slurm_outside_a_job_runs_nothing():
    proc = run_script("slurm.sbatch", "--preset", "stem_1b", "--mock-data")
    assert proc.returncode == 2 and "sbatch" in proc.stderr and "--print-only" in proc.stderr


def test_single_node_runs_what_it_prints(stubs, tmp_path):
    """The executed command equals the printed one, the console is tee'd to the node log, the
    exit status is torchrun's, and the user's environment wins over the defaults."""
    logs = tmp_path / "logs"
    args = ["--preset", "stem_1b", *GPU_H100, "--mock-data", "--log-dir", str(logs),
            "--", "--lr", "1e-5"]
    user = {"TORCHRUN": stubs["torchrun"], "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "3",
            "NCCL_NVLS_ENABLE": "0", "LAUNCH_TIMESTAMP": "20260101-000000"}
    printed = Printed(run_script("single_node.sh", "--print-only", *args, env=user))
    proc = run_script("single_node.sh", *args, env=dict(user, STUB_RC="3"))
    assert proc.returncode == 3, proc.stderr
    assert recorded(stubs) == printed.tokens[1:]
    log = logs / "logs" / "20260101-000000_node0.log"
    assert printed.tee == str(log)
    assert "stub torchrun output" in log.read_text() and "stub torchrun output" in proc.stdout
    env = dict(line.split("=", 1) for line in
               stubs["record"].with_suffix(".env").read_text().splitlines() if "=" in line)
    for name, want in [("NCCL_DEBUG", "INFO"), ("OMP_NUM_THREADS", "3"), ("NCCL_NVLS_ENABLE", "0"),
                       ("CUDA_DEVICE_MAX_CONNECTIONS", "1"), ("TORCH_CUDA_ARCH_LIST", "9.0")]:
        assert env[name] == want == printed.env[name], name


def test_environment_defaults_keep_user_values():
    user = {"CUDA_DEVICE_MAX_CONNECTIONS": "8", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "NCCL_DEBUG": "INFO", "NCCL_IB_TIMEOUT": "18", "NCCL_NVLS_ENABLE": "0",
            "TORCH_CUDA_ARCH_LIST": "9.0a", "OMP_NUM_THREADS": "7", "PYTHONUNBUFFERED": "0"}
    for script, extra in [("single_node.sh", []), ("multi_node.sh", ["--nodes", "2",
                                                                     "--master-addr", "h"]),
                          ("slurm.sbatch", [])]:
        p = Printed(run_script(script, "--preset", "stem_1b", *GPU_H100, "--mock-data", *extra,
                               "--print-only", env=user))
        assert {k: p.env.get(k) for k in user} == user, script


PASS_THROUGH = ["--lr", "1e-5", "--log-interval", "5", "--ckpt-format", "torch",
                "--note", "it's a $HOME test; `x` * ?", "--empty", "", "--kv=a=b", "--",
                "--after-dashes", "--distributed-backend=gloo"]


@pytest.mark.parametrize("script,extra", [("single_node.sh", []),
                                          ("multi_node.sh", ["--nodes", "2", "--master-addr", "h"]),
                                          ("slurm.sbatch", [])])
def test_pass_through_is_verbatim_and_wins(script, extra):
    p = Printed(run_script(script, "--preset", "stem_1b", "--device", "gpu", "--mock-data",
                           "--save", "/ck", *extra, "--print-only", "--", *PASS_THROUGH))
    m = p.megatron
    assert m[-len(PASS_THROUGH):] == PASS_THROUGH
    # A default is not added when the same flag comes after '--'.
    for flag in ("--log-interval", "--ckpt-format", "--distributed-backend"):
        assert count(m, flag) == 1, flag
    assert value(m, "--save-interval") == "1000"


def test_dry_run_print_only():
    args = ["--preset", "stem_1b", "--mock-data", "--tp", "2", "--save", "/ck", "--",
            "--use-distributed-optimizer"]
    dry = Printed(run_script("slurm.sbatch", "--dry-run", "--print-only", *args))
    assert len(dry.launcher) == 1 and os.path.basename(dry.launcher[0]).startswith("python")
    assert dry.megatron[:3] == ["--dry-run", "--dry-run-world-size", "32"]  # 4 nodes x 8 GPUs
    # The same flags the job would give pretrain.py.
    job = Printed(run_script("slurm.sbatch", "--print-only", *args))
    assert dry.megatron[3:] == job.megatron
    # Without a GPU here, the estimate is still for the GPU run (no CPU flags).
    single = Printed(run_script("single_node.sh", "--dry-run", "--print-only",
                                "--gpus-per-node", "4", *args))
    assert single.megatron[:3] == ["--dry-run", "--dry-run-world-size", "4"]
    assert value(single.megatron, "--distributed-backend") == "nccl"


BAD = [
    ("single_node.sh", ["--mock-data"], "option --preset is required"),
    ("single_node.sh", ["--preset", "stem_cpu", "--bogus", "1"], "unknown option --bogus"),
    ("single_node.sh", ["--preset", "stem_cpu", "stray"], "unexpected argument 'stray'"),
    ("single_node.sh", ["--mock-data", "--preset"], "option --preset needs a value"),
    ("single_node.sh", ["--preset", "stem_cpu", "--tp", "--pp", "2"], "option --tp needs a value"),
    ("single_node.sh", ["--preset=", "--mock-data"], "option --preset needs a non-empty value"),
    ("single_node.sh", ["--preset", "nope", "--mock-data"], "option --preset: no such preset 'nope'"),
    ("single_node.sh", ["--preset", "stem_cpu", "--tp", "two"], "option --tp: 'two' is not a positive"),
    ("single_node.sh", ["--preset", "stem_cpu", "--gpus-per-node", "0"],
     "option --gpus-per-node: '0' is not a positive"),
    ("single_node.sh", ["--preset", "stem_cpu", "--train-iters", "1e3"],
     "option --train-iters: '1e3' is not a positive"),
    ("single_node.sh", ["--preset", "stem_cpu", "--micro-batch-size=-1"],
     "option --micro-batch-size: '-1' is not a positive"),
    ("single_node.sh", ["--preset", "stem_cpu", "--mock-data", "--tp", "3"],
     "--tp 3 x --pp 1 x --cp 1 = 3 does not divide 1 node(s) x 8 GPUs = 8 ranks"),
    ("single_node.sh", ["--preset", "stem_cpu", "--mock-data", "--gpus-per-node", "4", "--tp", "2",
                        "--pp", "2", "--cp", "2"], "--tp 2 x --pp 2 x --cp 2 = 8 does not divide"),
    ("single_node.sh", ["--preset", "stem_cpu", "--mock-data", "--ep", "16"],
     "--ep 16 x --pp 1 = 16 does not divide"),
    ("single_node.sh", ["--preset", "stem_cpu", "--mock-data", "--",
                        "--tensor-model-parallel-size", "3"], "--tp 3 x --pp 1"),
    ("single_node.sh", ["--preset", "stem_cpu", "--mock-data", "--gpu", "v100"],
     "option --gpu: 'v100' is not one of a100, h100"),
    ("single_node.sh", ["--preset", "stem_cpu", "--mock-data", "--device", "tpu"],
     "option --device: 'tpu'"),
    ("single_node.sh", ["--preset", "stem_cpu", "--mock-data", "--print-only=yes"],
     "option --print-only takes no value"),
    ("single_node.sh", ["--preset", "stem_cpu", "--mock-data", "--nodes", "2"], "option --nodes 2"),
    ("single_node.sh", ["--preset", "stem_cpu", "--mock-data", "--master-addr", "h"],
     "option --master-addr is not used by single_node.sh"),
    ("single_node.sh", ["--preset", "stem_cpu"], "--data-path PREFIX (an indexed dataset) or --mock-data"),
    ("single_node.sh", ["--preset", "stem_cpu", "--mock-data", "--data-path", "/d"],
     "options --data-path and --mock-data exclude each other"),
    ("single_node.sh", ["--preset", "stem_cpu", "--data-path", "/d"],
     "option --data-path needs the tokenizer"),
    ("multi_node.sh", ["--preset", "stem_cpu", "--mock-data", "--master-addr", "h"],
     "option --nodes is required"),
    ("multi_node.sh", ["--preset", "stem_cpu", "--mock-data", "--nodes", "1.5"],
     "option --nodes: '1.5' is not a positive"),
    ("multi_node.sh", ["--preset", "stem_cpu", "--mock-data", "--nodes", "2"],
     "option --master-addr is required"),
    ("multi_node.sh", ["--preset", "stem_cpu", "--mock-data", "--nodes", "2", "--master-addr", "h",
                       "--master-port", "70000"], "option --master-port: '70000' is not a port"),
    ("multi_node.sh", ["--preset", "stem_cpu", "--mock-data", "--nodes", "2", "--master-addr", "h",
                       "--rdzv-endpoint", "h:1"], "--master-addr and --rdzv-endpoint exclude"),
    ("multi_node.sh", ["--preset", "stem_cpu", "--mock-data", "--nodes", "2", "--master-addr", "h",
                       "--node-rank", "x"], "option --node-rank: 'x'"),
    ("slurm.sbatch", ["--preset", "stem_cpu", "--mock-data", "--nodes", "3", "--tp", "16",
                      "--print-only"], "does not divide 3 node(s) x 8 GPUs = 24 ranks"),
    ("slurm.sbatch", ["--preset", "stem_cpu", "--mock-data", "--node-rank", "1", "--print-only"],
     "option --node-rank is not used by slurm.sbatch"),
]


@pytest.mark.parametrize("script,args,message", BAD, ids=[f"{s}:{' '.join(a)}" for s, a, _ in BAD])
def test_bad_input_exits_2_naming_the_option(script, args, message):
    proc = run_script(script, *args, "--print-only" if script != "slurm.sbatch" else "--dry-run")
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert message in proc.stderr
    assert proc.stderr.startswith(f"{script}: error: ") and "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.multirank
def test_single_node_cpu_run(tmp_path):
    """The documented CPU smoke run: 2 gloo ranks, 2 iterations, a checkpoint and the log file."""
    args = ["--preset", "stem_cpu", "--gpus-per-node", "2", "--mock-data", "--train-iters", "2",
            "--save", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs")]
    no_gpu = shutil.which("nvidia-smi") is None
    if not no_gpu:
        args += ["--device", "cpu"]
    proc = run_script("single_node.sh", *args, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    if no_gpu:
        assert "no GPU found" in proc.stderr
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    logs = list((tmp_path / "logs" / "logs").iterdir())
    assert len(logs) == 1 and re.fullmatch(r"\d{8}-\d{6}_node0\.log", logs[0].name)
    text = logs[0].read_text()
    assert re.search(r"iteration\s+2/\s+2 \|", text) and "successfully saved checkpoint" in text
    assert list((tmp_path / "logs" / "tb").iterdir())
