#!/usr/bin/env bash
# Train on several nodes: run this once on every node, with the same arguments. torchrun's c10d
# rendezvous on HOST:PORT (the first node) gathers the nodes and assigns their ranks.
#
#   # on each of 4 nodes (node0 is the first):
#   bash launch/multi_node.sh --preset stem_1b --nodes 4 --master-addr node0 --rdzv-id run42 \
#       --data-path DATA/corpus_text_document --tokenizer-model meta-llama/Llama-3.2-1B \
#       --save ckpt/stem_1b --log-dir runs/stem_1b
#
# Options: --help, docs/launch.md.
set -euo pipefail

LAUNCH_SCRIPT=multi_node.sh
LAUNCH_USAGE="Run once per node with the same arguments; needs --nodes N and the rendezvous host
(--master-addr HOST, --rdzv-endpoint HOST:PORT, or MASTER_ADDR in the environment).
--node-rank R (default: SLURM_NODEID, NODE_RANK, else the host name) only names this node's log
file: the rendezvous assigns the ranks."
LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/common.sh
source "$LAUNCH_DIR/common.sh"

launch_parse_args "$@"
[[ -n $LAUNCH_NODES ]] || launch_die "option --nodes is required (the number of nodes)"
if [[ -n $LAUNCH_MASTER_ADDR && -n $LAUNCH_RDZV_ENDPOINT ]]; then
    launch_die "options --master-addr and --rdzv-endpoint exclude each other"
fi
if [[ -n $LAUNCH_RDZV_ENDPOINT ]]; then
    ENDPOINT=$LAUNCH_RDZV_ENDPOINT
    [[ $ENDPOINT == *:* ]] || ENDPOINT="${ENDPOINT}:${LAUNCH_MASTER_PORT:-29500}"
    HOST_SOURCE="option --rdzv-endpoint"
else
    HOST=${LAUNCH_MASTER_ADDR:-${MASTER_ADDR:-}}
    [[ -n $HOST ]] || launch_die "option --master-addr is required: the first node's address," \
        "the same on every node (or --rdzv-endpoint HOST:PORT, or MASTER_ADDR)"
    ENDPOINT="${HOST}:${LAUNCH_MASTER_PORT:-${MASTER_PORT:-29500}}"
    HOST_SOURCE="option --master-addr"
    [[ -n $LAUNCH_MASTER_ADDR ]] || HOST_SOURCE="MASTER_ADDR (environment)"
fi
RDZV_ID=${LAUNCH_RDZV_ID:-${SLURM_JOB_ID:-megatron-ext}}
NODE_NAME=${LAUNCH_NODE_RANK:-${SLURM_NODEID:-${NODE_RANK:-$(hostname -s)}}}

LAUNCH_ROOT=$(launch_find_root "$LAUNCH_DIR") || launch_die "cannot find the repository (set MEGATRON_EXT_ROOT)"
launch_setup

if ((LAUNCH_DRY_RUN)); then
    launch_dry_run_cmd
    launch_run "" "${LAUNCH_CMD[@]}"
fi

((LAUNCH_PRINT_ONLY)) || launch_check_rdzv_host "$HOST_SOURCE" "$ENDPOINT"
LOG_FILE=""
if [[ -n $LAUNCH_LOG_DIR ]]; then
    LOG_FILE="${LAUNCH_LOG_DIR%/}/logs/$(launch_timestamp)_node${NODE_NAME}.log"
fi
((LAUNCH_PRINT_ONLY)) || launch_note "rendezvous ${ENDPOINT}, id ${RDZV_ID}: waiting for" \
    "${LAUNCH_NODES} node(s); every node needs the same --nodes, endpoint and --rdzv-id" \
    "(torchrun gives up after 600 s)"
launch_run "$LOG_FILE" "$(launch_torchrun)" --nnodes="$LAUNCH_NODES" \
    --nproc-per-node="$LAUNCH_GPUS_PER_NODE" --rdzv-backend=c10d --rdzv-endpoint="$ENDPOINT" \
    --rdzv-id="$RDZV_ID" "$LAUNCH_ROOT/launch/pretrain.py" "${MEGATRON_ARGS[@]}"
