#!/usr/bin/env bash
# Train on one node: torchrun --standalone --nproc-per-node=G launch/pretrain.py ...
#
#   bash launch/single_node.sh --preset stem_1b --gpus-per-node 8 --data-path DATA/corpus_text_document \
#       --tokenizer-model meta-llama/Llama-3.2-1B --save ckpt/stem_1b --log-dir runs/stem_1b \
#       -- --use-distributed-optimizer
#
# Options: --help, docs/launch.md. Without a GPU (no nvidia-smi) it runs on the CPU with gloo.
set -euo pipefail

LAUNCH_SCRIPT=single_node.sh
LAUNCH_USAGE="One node: torchrun --standalone (a free rendezvous port is picked, so several jobs can
share a node). For several nodes use multi_node.sh or slurm.sbatch."
LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/common.sh
source "$LAUNCH_DIR/common.sh"

launch_parse_args "$@"
for opt in --master-addr --master-port --rdzv-endpoint --rdzv-id --node-rank; do
    launch_refuse "$opt" "it runs torchrun --standalone on this node (several nodes: multi_node.sh)"
done
if [[ -n $LAUNCH_NODES && $LAUNCH_NODES != 1 ]]; then
    launch_die "option --nodes ${LAUNCH_NODES}: single_node.sh runs one node (several nodes: multi_node.sh or slurm.sbatch)"
fi
LAUNCH_NODES=1
LAUNCH_ROOT=$(launch_find_root "$LAUNCH_DIR") || launch_die "cannot find the repository (set MEGATRON_EXT_ROOT)"
launch_setup

if ((LAUNCH_DRY_RUN)); then
    launch_dry_run_cmd
    launch_run "" "${LAUNCH_CMD[@]}"
fi

LOG_FILE=""
if [[ -n $LAUNCH_LOG_DIR ]]; then
    LOG_FILE="${LAUNCH_LOG_DIR%/}/logs/$(launch_timestamp)_node0.log"
fi
launch_run "$LOG_FILE" "$(launch_torchrun)" --standalone --nnodes=1 \
    --nproc-per-node="$LAUNCH_GPUS_PER_NODE" "$LAUNCH_ROOT/launch/pretrain.py" "${MEGATRON_ARGS[@]}"
