# shellcheck shell=bash disable=SC2034,SC2153
# (SC2034/SC2153: the LAUNCH_* variables are set and read across this file and the scripts.)
# Shared by launch/single_node.sh, launch/multi_node.sh and launch/slurm.sbatch: argument parsing,
# environment defaults for A100/H100 nodes, and the launch/pretrain.py flag list they all build.
#
# A script sets LAUNCH_SCRIPT (its name, for messages) and LAUNCH_USAGE (its own usage lines),
# sources this file, then calls
#   launch_parse_args "$@"       the common options (below) into LAUNCH_* variables
#   launch_setup                 device, environment defaults, layout check, MEGATRON_ARGS
#   launch_run CMD...            print (--print-only) or run CMD, tee'd to the node's log file
# Nothing is started or written before launch_run.

# --- messages --------------------------------------------------------------------------------

launch_die() {  # a usage error: the message names the option; exit code 2 like argparse
    echo "${LAUNCH_SCRIPT}: error: $*" >&2
    echo "${LAUNCH_SCRIPT}: see '${LAUNCH_SCRIPT} --help'" >&2
    exit 2
}

launch_note() {
    echo "${LAUNCH_SCRIPT}: $*" >&2
}

launch_usage() {
    cat <<EOF
usage: ${LAUNCH_SCRIPT} --preset NAME [options] [-- EXTRA MEGATRON FLAGS...]

${LAUNCH_USAGE}

model and layout
  --preset NAME            a preset under launch/presets (e.g. stem_1b) or a JSON path (required)
  --gpus-per-node G        ranks per node (default 8; on a CPU machine: processes)
  --tp N --pp N --ep N --cp N
                           tensor / pipeline / expert / context parallel sizes (default 1);
                           tp*pp*cp and ep*pp must divide nodes*gpus-per-node
  --micro-batch-size N     Megatron --micro-batch-size (default 1)
  --train-iters N          Megatron --train-iters (the preset's value otherwise)

data
  --data-path PREFIX       a Megatron indexed dataset prefix; repeat it for several (Megatron
                           blends them by size; a weighted blend goes after --)
  --mock-data              Megatron's synthetic data (no files needed)
  --tokenizer-model PATH   a Hugging Face tokenizer (directory or hub name):
                           --tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH;
                           with --mock-data and no tokenizer: NullTokenizer with the preset's vocab

checkpoints and logs
  --save DIR               save torch_dist checkpoints to DIR (every 1000 iterations and at the end)
  --load DIR               resume from DIR (default: the --save directory, so a restarted job resumes)
  --log-dir DIR            tensorboard in DIR/tb; console tee'd to DIR/logs/<timestamp>_node<rank>.log

rendezvous (multi_node.sh, slurm.sbatch)
  --nodes N                number of nodes
  --master-addr HOST       the rendezvous host (the first node); or
  --rdzv-endpoint HOST[:PORT]
  --master-port PORT       rendezvous port (default 29500)
  --rdzv-id ID             the job id shared by all nodes (default: \$SLURM_JOB_ID, else megatron-ext)

machine
  --gpu a100|h100          NCCL/CUDA environment defaults for this GPU (default: from nvidia-smi)
  --device auto|gpu|cpu    auto (default): gpu when nvidia-smi lists a GPU, else cpu (gloo, the CPU
                           flags, for development and CI)

what to do
  --print-only             print the environment and the exact command(s), quoted for copy-paste;
                           run nothing
  --dry-run                run 'launch/pretrain.py --dry-run --dry-run-world-size nodes*gpus' with
                           the same flags: parameters, FLOPs and memory per rank; no torchrun
  -h, --help               this text
  -- FLAGS...              every later argument goes to launch/pretrain.py verbatim (they come
                           last, so they win over the flags this script adds)

Environment variables the script sets when unset are listed by --print-only and in docs/launch.md.
EOF
}

# --- parsing ---------------------------------------------------------------------------------

LAUNCH_PRESET=""
LAUNCH_GPUS_PER_NODE=""
LAUNCH_NODES=""
LAUNCH_MASTER_ADDR=""
LAUNCH_MASTER_PORT=""
LAUNCH_RDZV_ENDPOINT=""
LAUNCH_RDZV_ID=""
LAUNCH_NODE_RANK=""
LAUNCH_GPU=""
LAUNCH_DEVICE="auto"
LAUNCH_DATA_PATHS=()
LAUNCH_MOCK_DATA=0
LAUNCH_TOKENIZER_MODEL=""
LAUNCH_SAVE=""
LAUNCH_LOAD=""
LAUNCH_LOG_DIR=""
LAUNCH_TP=1
LAUNCH_PP=1
LAUNCH_EP=1
LAUNCH_CP=1
LAUNCH_MICRO_BATCH_SIZE=""
LAUNCH_TRAIN_ITERS=""
LAUNCH_PRINT_ONLY=0
LAUNCH_DRY_RUN=0
LAUNCH_EXTRA=()          # everything after --, verbatim
declare -A LAUNCH_GIVEN=()  # option -> 1 for each option on the command line

launch_parse_args() {
    local opt value has_inline
    while (($#)); do
        opt=$1
        shift
        has_inline=0
        if [[ $opt == --*=* ]]; then
            value=${opt#*=}
            opt=${opt%%=*}
            has_inline=1
        fi
        case $opt in
            --)
                LAUNCH_EXTRA=("$@")
                return 0
                ;;
            -h | --help)
                launch_usage
                exit 0
                ;;
            --mock-data | --print-only | --dry-run)
                ((has_inline)) && launch_die "option ${opt} takes no value (got '${opt}=${value}')"
                LAUNCH_GIVEN[$opt]=1
                case $opt in
                    --mock-data) LAUNCH_MOCK_DATA=1 ;;
                    --print-only) LAUNCH_PRINT_ONLY=1 ;;
                    --dry-run) LAUNCH_DRY_RUN=1 ;;
                esac
                continue
                ;;
            --preset | --gpus-per-node | --nodes | --master-addr | --master-port | \
                --rdzv-endpoint | --rdzv-id | --node-rank | --gpu | --device | --data-path | \
                --tokenizer-model | --save | --load | --log-dir | --tp | --pp | --ep | --cp | \
                --micro-batch-size | --train-iters) ;;
            -*)
                launch_die "unknown option ${opt} (Megatron and megatron-ext flags go after '--')"
                ;;
            *)
                launch_die "unexpected argument '${opt}' (Megatron flags go after '--')"
                ;;
        esac
        if ((!has_inline)); then
            # A value that looks like an option means the value was forgotten.
            if (($# == 0)) || [[ $1 == --* ]]; then
                launch_die "option ${opt} needs a value"
            fi
            value=$1
            shift
        fi
        [[ -n $value ]] || launch_die "option ${opt} needs a non-empty value"
        LAUNCH_GIVEN[$opt]=1
        case $opt in
            --preset) LAUNCH_PRESET=$value ;;
            --gpus-per-node) LAUNCH_GPUS_PER_NODE=$(launch_positive_int "$opt" "$value") ;;
            --nodes) LAUNCH_NODES=$(launch_positive_int "$opt" "$value") ;;
            --master-addr) LAUNCH_MASTER_ADDR=$value ;;
            --master-port) LAUNCH_MASTER_PORT=$(launch_port "$opt" "$value") ;;
            --rdzv-endpoint) LAUNCH_RDZV_ENDPOINT=$value ;;
            --rdzv-id) LAUNCH_RDZV_ID=$value ;;
            --node-rank) LAUNCH_NODE_RANK=$(launch_int "$opt" "$value") ;;
            --gpu)
                case $value in
                    a100 | h100) LAUNCH_GPU=$value ;;
                    *) launch_die "option --gpu: '${value}' is not one of a100, h100" ;;
                esac
                ;;
            --device)
                case $value in
                    auto | gpu | cpu) LAUNCH_DEVICE=$value ;;
                    *) launch_die "option --device: '${value}' is not one of auto, gpu, cpu" ;;
                esac
                ;;
            --data-path) LAUNCH_DATA_PATHS+=("$value") ;;
            --tokenizer-model) LAUNCH_TOKENIZER_MODEL=$value ;;
            --save) LAUNCH_SAVE=$value ;;
            --load) LAUNCH_LOAD=$value ;;
            --log-dir) LAUNCH_LOG_DIR=$value ;;
            --tp) LAUNCH_TP=$(launch_positive_int "$opt" "$value") ;;
            --pp) LAUNCH_PP=$(launch_positive_int "$opt" "$value") ;;
            --ep) LAUNCH_EP=$(launch_positive_int "$opt" "$value") ;;
            --cp) LAUNCH_CP=$(launch_positive_int "$opt" "$value") ;;
            --micro-batch-size) LAUNCH_MICRO_BATCH_SIZE=$(launch_positive_int "$opt" "$value") ;;
            --train-iters) LAUNCH_TRAIN_ITERS=$(launch_positive_int "$opt" "$value") ;;
        esac
    done
}

# The checks below run inside $(...): exit 2 there ends only the subshell, so the caller's
# assignment fails and `set -e` ends the script with the same status after the message.
launch_int() {
    [[ $2 =~ ^[0-9]+$ ]] || launch_die "option $1: '$2' is not a non-negative integer"
    echo $((10#$2))
}

launch_positive_int() {
    if [[ ! $2 =~ ^[0-9]+$ ]] || (($((10#$2)) == 0)); then
        launch_die "option $1: '$2' is not a positive integer"
    fi
    echo $((10#$2))
}

launch_port() {
    local port
    port=$(launch_positive_int "$1" "$2") || exit 2
    ((port <= 65535)) || launch_die "option $1: '$2' is not a port (1-65535)"
    echo "$port"
}

launch_refuse() {  # launch_refuse OPTION WHY: the option is not for this script
    if [[ -n ${LAUNCH_GIVEN[$1]:-} ]]; then
        launch_die "option $1 is not used by ${LAUNCH_SCRIPT}: $2"
    fi
}

launch_extra_has() {  # is FLAG among the pass-through flags (as FLAG or FLAG=value)?
    local a
    for a in "${LAUNCH_EXTRA[@]}"; do
        [[ $a == "$1" || $a == "$1="* ]] && return 0
    done
    return 1
}

launch_extra_value() {  # the last value of FLAG among the pass-through flags, or $2
    local value=$2 i n=${#LAUNCH_EXTRA[@]}
    for ((i = 0; i < n; i++)); do
        if [[ ${LAUNCH_EXTRA[i]} == "$1" ]] && ((i + 1 < n)); then
            value=${LAUNCH_EXTRA[i + 1]}
        elif [[ ${LAUNCH_EXTRA[i]} == "$1="* ]]; then
            value=${LAUNCH_EXTRA[i]#*=}
        fi
    done
    echo "$value"
}

# --- quoting ---------------------------------------------------------------------------------

launch_quote() {  # the arguments as one shell line; each word quoted like Python's shlex.quote
    local out=() a sq="'" esc="'\"'\"'"
    for a in "$@"; do
        if [[ -z $a ]]; then
            out+=("''")
        elif [[ $a =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
            out+=("$a")
        else
            out+=("'${a//"$sq"/"$esc"}'")
        fi
    done
    echo "${out[*]}"
}

# --- setup -----------------------------------------------------------------------------------

# The repository holding launch/pretrain.py. sbatch runs a copy of the script from its spool
# directory, so the script's own path is not enough there: MEGATRON_EXT_ROOT, then the script's
# directory, then the directory sbatch was called from.
launch_find_root() {
    local dir
    for dir in "${MEGATRON_EXT_ROOT:-}" "$1/.." "${SLURM_SUBMIT_DIR:-}"; do
        if [[ -n $dir && -f $dir/launch/pretrain.py && -f $dir/launch/common.sh ]]; then
            (cd "$dir" && pwd)
            return 0
        fi
    done
    return 1
}

launch_has_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

launch_preset_file() {  # a preset name or path -> its JSON file
    local name=$1 file
    if [[ -f $name ]]; then
        file=$name
    else
        file=${LAUNCH_ROOT}/launch/presets/${name%.json}.json
    fi
    if [[ ! -f $file ]] || ! grep -q '"flags"' "$file"; then
        local names=() f
        for f in "${LAUNCH_ROOT}"/launch/presets/*.json; do
            grep -q '"flags"' "$f" && names+=("$(basename "${f%.json}")")
        done
        launch_die "option --preset: no such preset '${name}' (available: ${names[*]}, or a path to a JSON file)"
    fi
    echo "$file"
}

launch_preset_vocab() {  # the preset's "tokenizer": {"vocab_size": N}, or nothing
    sed -n 's/.*"vocab_size"[[:space:]]*:[[:space:]]*\([0-9][0-9]*\).*/\1/p' "$1" | sed -n 1p
}

# The environment variables launch_env_defaults may set, in the order --print-only lists them.
LAUNCH_ENV_VARS=(CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_DEBUG
    NCCL_IB_TIMEOUT NCCL_NVLS_ENABLE TORCH_CUDA_ARCH_LIST OMP_NUM_THREADS PYTHONUNBUFFERED
    CUDA_VISIBLE_DEVICES)

# Defaults only: a value the user exported wins (`: "${VAR:=value}"`). Reasons: docs/launch.md.
launch_env_defaults() {
    local cores
    if [[ ${LAUNCH_ASSUME_GPU:-0} != 1 ]]; then
        # (Not when printing a cluster command elsewhere: the job counts its own node's cores.)
        cores=${SLURM_CPUS_ON_NODE:-$(nproc 2>/dev/null || echo 1)}
        # Each rank's intra-op threads get an equal share of the node's cores (no
        # oversubscription; torchrun would otherwise force 1 thread per rank).
        : "${OMP_NUM_THREADS:=$((cores / LAUNCH_GPUS_PER_NODE > 0 ? cores / LAUNCH_GPUS_PER_NODE : 1))}"
        export OMP_NUM_THREADS
    fi
    # Log lines reach the console and the tee'd log file as they are printed.
    : "${PYTHONUNBUFFERED:=1}"
    export PYTHONUNBUFFERED
    if [[ $LAUNCH_DEVICE == cpu ]]; then
        # Hide any GPU so the entry point installs the CPU backend (megatron_ext/compat/cpu.py).
        export CUDA_VISIBLE_DEVICES=""
        return 0
    fi
    # One hardware work queue: TP/SP communication kernels are issued before the GEMMs they
    # overlap with, which Megatron requires for TP/SP communication overlap. Not with
    # Megatron-FSDP, which refuses 1 (its all-gathers and reduce-scatters overlap compute on
    # several queues): left unset, as the entry point leaves it then.
    if ! launch_extra_has --use-megatron-fsdp; then
        : "${CUDA_DEVICE_MAX_CONNECTIONS:=1}"
    fi
    # A failed or timed-out collective ends the process without aborting the communicator (which
    # can itself hang), so torchrun/srun end the job instead of waiting for the wall-clock
    # limit. 3 is the default of the torch we pin; set so that other versions behave alike.
    : "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=3}"
    # NCCL's warnings and errors (the first thing to read after a hang), without the INFO flood.
    : "${NCCL_DEBUG:=WARN}"
    # InfiniBand retry timeout 4.096 us * 2^22 (about 17 s): rides out transient fabric congestion.
    : "${NCCL_IB_TIMEOUT:=22}"
    export CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_DEBUG NCCL_IB_TIMEOUT
    case $LAUNCH_GPU in
        a100)
            # A100's NVSwitch has no NVLink SHARP: skip NCCL's NVLS probing and buffers.
            : "${NCCL_NVLS_ENABLE:=0}"
            # Extensions compiled at start-up target sm_80 only (shorter build).
            : "${TORCH_CUDA_ARCH_LIST:=8.0}"
            export NCCL_NVLS_ENABLE TORCH_CUDA_ARCH_LIST
            ;;
        h100)
            # NVLink SHARP: all-reduce inside the NVSwitch of an HGX H100 node (0 frees the
            # memory NCCL reserves for it).
            : "${NCCL_NVLS_ENABLE:=1}"
            # Extensions compiled at start-up target sm_90 only (shorter build).
            : "${TORCH_CUDA_ARCH_LIST:=9.0}"
            export NCCL_NVLS_ENABLE TORCH_CUDA_ARCH_LIST
            ;;
    esac
}

launch_gpu_from_nvidia_smi() {
    local name
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sed -n 1p) || true
    case $name in
        *H100* | *H200* | *H800*) echo h100 ;;
        *A100* | *A800*) echo a100 ;;
    esac
}

# Decide the device and GPU type, set the environment defaults, check the layout and build
# MEGATRON_ARGS. Needs LAUNCH_NODES (1 for a single node) and LAUNCH_ROOT.
launch_setup() {
    [[ -n $LAUNCH_PRESET ]] || launch_die "option --preset is required (e.g. --preset stem_1b)"
    LAUNCH_PRESET_FILE=$(launch_preset_file "$LAUNCH_PRESET")
    : "${LAUNCH_GPUS_PER_NODE:=8}"

    local cpu_note=0
    if [[ $LAUNCH_DEVICE == auto ]]; then
        if ((LAUNCH_DRY_RUN)) || [[ ${LAUNCH_ASSUME_GPU:-0} == 1 ]]; then
            # The estimate (or the printed cluster command) is for the cluster's GPUs.
            LAUNCH_DEVICE=gpu
        elif launch_has_gpu; then
            LAUNCH_DEVICE=gpu
        else
            LAUNCH_DEVICE=cpu
            cpu_note=1
        fi
    fi
    if [[ $LAUNCH_DEVICE == gpu && -z $LAUNCH_GPU ]] && command -v nvidia-smi >/dev/null 2>&1; then
        LAUNCH_GPU=$(launch_gpu_from_nvidia_smi)
    fi
    launch_env_defaults

    # Layout: Megatron splits the world into TP x PP x CP x DP, and experts into EP x ... x PP.
    local world=$((LAUNCH_NODES * LAUNCH_GPUS_PER_NODE)) tp pp cp ep
    tp=$(launch_extra_value --tensor-model-parallel-size "$LAUNCH_TP")
    pp=$(launch_extra_value --pipeline-model-parallel-size "$LAUNCH_PP")
    cp=$(launch_extra_value --context-parallel-size "$LAUNCH_CP")
    ep=$(launch_extra_value --expert-model-parallel-size "$LAUNCH_EP")
    local v
    for v in "$tp" "$pp" "$cp" "$ep"; do
        [[ $v =~ ^[1-9][0-9]*$ ]] || launch_die "a parallel size after '--' is not a positive integer: '${v}'"
    done
    if ((world % (tp * pp * cp) != 0)); then
        launch_die "layout: --tp ${tp} x --pp ${pp} x --cp ${cp} = $((tp * pp * cp)) does not divide" \
            "${LAUNCH_NODES} node(s) x ${LAUNCH_GPUS_PER_NODE} GPUs = ${world} ranks"
    fi
    if ((world % (ep * pp) != 0)); then
        launch_die "layout: --ep ${ep} x --pp ${pp} = $((ep * pp)) does not divide" \
            "${LAUNCH_NODES} node(s) x ${LAUNCH_GPUS_PER_NODE} GPUs = ${world} ranks"
    fi
    LAUNCH_WORLD=$world

    launch_build_megatron_args
    # Said once everything is checked, so that an error message comes first.
    if ((cpu_note)); then
        launch_note "no GPU found (nvidia-smi absent or lists none): running on the CPU with" \
            "gloo and the CPU flags (--device gpu overrides)"
    fi
}

# launch_check_rdzv_host SOURCE ENDPOINT: the rendezvous host of HOST:PORT resolves on this node.
# torchrun retries an unknown host for a minute and more with a C++ stack per try, and a node whose
# endpoint names another store than the others waits silently for torchrun's 600 s join timeout;
# the first is a typo this catches. IP literals are left to torchrun.
launch_check_rdzv_host() {
    local source=$1 host=${2%:*}
    host=${host#[}
    host=${host%]}
    [[ $host =~ ^[0-9.]+$ || $host == *:* ]] && return 0
    command -v getent >/dev/null 2>&1 || return 0
    getent hosts "$host" >/dev/null 2>&1 || launch_die "${source}: the rendezvous host '${host}'" \
        "does not resolve on this node ($(hostname)): give the first node's name or address, the" \
        "same on every node"
}

launch_add_default() {  # launch_add_default FLAG [VALUE]: added unless FLAG is after '--'
    launch_extra_has "$1" || MEGATRON_ARGS+=("$@")
}

launch_build_megatron_args() {
    MEGATRON_ARGS=(--preset "$LAUNCH_PRESET")
    MEGATRON_ARGS+=(--tensor-model-parallel-size "$LAUNCH_TP" --pipeline-model-parallel-size "$LAUNCH_PP"
        --expert-model-parallel-size "$LAUNCH_EP" --context-parallel-size "$LAUNCH_CP")
    if [[ -n $LAUNCH_MICRO_BATCH_SIZE ]]; then
        MEGATRON_ARGS+=(--micro-batch-size "$LAUNCH_MICRO_BATCH_SIZE")
    else
        # Megatron requires one and the presets leave it to the layout: 1 fits any GPU.
        launch_add_default --micro-batch-size 1
    fi
    [[ -n $LAUNCH_TRAIN_ITERS ]] && MEGATRON_ARGS+=(--train-iters "$LAUNCH_TRAIN_ITERS")

    # Data and tokenizer.
    if ((${#LAUNCH_DATA_PATHS[@]})) && ((LAUNCH_MOCK_DATA)); then
        launch_die "options --data-path and --mock-data exclude each other"
    fi
    if ((${#LAUNCH_DATA_PATHS[@]})); then
        MEGATRON_ARGS+=(--data-path "${LAUNCH_DATA_PATHS[@]}")
    elif ((LAUNCH_MOCK_DATA)); then
        MEGATRON_ARGS+=(--mock-data)
    elif ! launch_extra_has --data-path && ! launch_extra_has --mock-data \
        && ! launch_extra_has --train-data-path && ! launch_extra_has --data-args-path \
        && ! launch_extra_has --per-split-data-args-path && ((!LAUNCH_DRY_RUN)); then
        launch_die "give the data: --data-path PREFIX (an indexed dataset) or --mock-data"
    fi
    if [[ -n $LAUNCH_TOKENIZER_MODEL ]]; then
        MEGATRON_ARGS+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$LAUNCH_TOKENIZER_MODEL")
    elif ! launch_extra_has --tokenizer-type; then
        if ((LAUNCH_MOCK_DATA)); then
            # Synthetic tokens need only a vocabulary size: the one the preset's paper used.
            local vocab
            vocab=$(launch_preset_vocab "$LAUNCH_PRESET_FILE")
            [[ -n $vocab ]] || launch_die "option --mock-data: preset '${LAUNCH_PRESET}' names no" \
                "vocab_size; give --tokenizer-model PATH or '-- --tokenizer-type NullTokenizer --vocab-size N'"
            MEGATRON_ARGS+=(--tokenizer-type NullTokenizer --vocab-size "$vocab")
        elif ((${#LAUNCH_DATA_PATHS[@]})); then
            launch_die "option --data-path needs the tokenizer the data was built with:" \
                "--tokenizer-model PATH (or '-- --tokenizer-type ...')"
        fi
    fi

    # Checkpoints: torch_dist can be resumed under another TP/PP/DP layout.
    if [[ -n $LAUNCH_SAVE ]]; then
        MEGATRON_ARGS+=(--save "$LAUNCH_SAVE")
        launch_add_default --save-interval 1000
        # A restarted (requeued) job resumes from its own last checkpoint.
        : "${LAUNCH_LOAD:=$LAUNCH_SAVE}"
    fi
    if [[ -n $LAUNCH_SAVE ]] || launch_extra_has --save; then
        # SIGTERM (a scheduler's stop before its SIGKILL) makes Megatron save a checkpoint after
        # the current iteration and exit; without it the work since the last --save-interval
        # checkpoint is lost.
        launch_add_default --exit-signal-handler
    fi
    [[ -n $LAUNCH_LOAD ]] && MEGATRON_ARGS+=(--load "$LAUNCH_LOAD")
    launch_add_default --ckpt-format torch_dist

    # Logs.
    if [[ -n $LAUNCH_LOG_DIR ]]; then
        MEGATRON_ARGS+=(--tensorboard-dir "${LAUNCH_LOG_DIR%/}/tb")
        launch_add_default --tensorboard-log-interval 1
    fi
    # Megatron has no default evaluation interval (it divides by it even without evaluation).
    launch_add_default --eval-interval 1000
    if [[ $LAUNCH_DEVICE == cpu ]]; then
        # CPU runs are short smoke tests: every iteration's line, no evaluation pass.
        launch_add_default --log-interval 1
        launch_add_default --eval-iters 0
    else
        launch_add_default --log-interval 10
    fi
    launch_add_default --log-throughput

    # Backend. The fused kernels named below exist only for CUDA (docs/cpu_backend.md).
    if [[ $LAUNCH_DEVICE == cpu ]]; then
        launch_add_default --distributed-backend gloo
        launch_add_default --no-gradient-accumulation-fusion
        launch_add_default --no-masked-softmax-fusion
        launch_add_default --no-bias-swiglu-fusion
        launch_add_default --no-rope-fusion
    else
        launch_add_default --distributed-backend nccl
    fi

    MEGATRON_ARGS+=("${LAUNCH_EXTRA[@]}")
}

# The interpreter and torchrun: the repository's virtualenv when it has one, else PATH.
# PYTHON / TORCHRUN in the environment win.
launch_python() {
    if [[ -n ${PYTHON:-} ]]; then
        echo "$PYTHON"
    elif [[ -x $LAUNCH_ROOT/.venv/bin/python ]]; then
        echo "$LAUNCH_ROOT/.venv/bin/python"
    else
        echo python3
    fi
}

launch_torchrun() {
    if [[ -n ${TORCHRUN:-} ]]; then
        echo "$TORCHRUN"
    elif [[ -x $LAUNCH_ROOT/.venv/bin/torchrun ]]; then
        echo "$LAUNCH_ROOT/.venv/bin/torchrun"
    else
        echo torchrun
    fi
}

launch_timestamp() {  # one timestamp per launch; LAUNCH_TIMESTAMP lets several nodes share one
    : "${LAUNCH_TIMESTAMP:=$(date +%Y%m%d-%H%M%S)}"
    echo "$LAUNCH_TIMESTAMP"
}

launch_print_env() {
    local var
    echo "# ${LAUNCH_SCRIPT}: device ${LAUNCH_DEVICE}${LAUNCH_GPU:+ (${LAUNCH_GPU})}, ${LAUNCH_NODES} node(s) x ${LAUNCH_GPUS_PER_NODE} ranks"
    for var in "${LAUNCH_ENV_VARS[@]}"; do
        if [[ -n ${!var+set} ]]; then
            echo "export $(launch_quote "${var}=${!var}")"
        fi
    done
}

# The dry-run command: the flags of the run, for nodes*gpus ranks, without torchrun.
launch_dry_run_cmd() {
    LAUNCH_CMD=("$(launch_python)" "$LAUNCH_ROOT/launch/pretrain.py" --dry-run
        --dry-run-world-size "$LAUNCH_WORLD" "${MEGATRON_ARGS[@]}")
}

# launch_run LOG_FILE CMD...: print it (--print-only) or run it, tee'd to LOG_FILE when not
# empty; the script's exit status is the command's.
launch_run() {
    local log=$1
    shift
    if ((LAUNCH_PRINT_ONLY)); then
        launch_print_env
        if [[ -n $log ]]; then
            echo "$(launch_quote "$@") 2>&1 | tee -a $(launch_quote "$log")"
        else
            launch_quote "$@"
        fi
        exit 0
    fi
    launch_note "running: $(launch_quote "$@")"
    if [[ -z $log ]]; then
        exec "$@"
    fi
    mkdir -p "$(dirname "$log")"
    {
        echo "# $(date -Is) $(hostname) ${LAUNCH_SCRIPT}"
        launch_print_env
        launch_quote "$@"
    } >>"$log"
    launch_note "console log: $log"
    # A scheduler's stop (Slurm's time limit, scancel: SIGTERM to every process of the step) or
    # Ctrl-C (SIGINT to the terminal's group) also reaches this shell and tee, not only torchrun,
    # which hands it to the ranks (Megatron's --exit-signal-handler saves a checkpoint then).
    # Dead at once, tee closed the pipe and the ranks' next line (the save's) killed them, and
    # the script reported the signal instead of torchrun's status. So tee ignores these signals
    # (it ends when the command closes its output) and this shell traps them (bash runs the trap
    # after the foreground pipeline ends; the command gets the default handlers back).
    trap : INT TERM HUP
    # pipefail (set by the scripts): the status is the command's, not tee's.
    "$@" 2>&1 | (trap '' INT TERM HUP && exec tee -a "$log")
}
