#!/usr/bin/env bash
# One node, N GPUs:   scripts/torchrun.sh 4 +hw=a100_40g model=glm4_9b_chat model.path=/models/glm-4-9b-chat
# --standalone runs a private rendezvous and gives every worker the same fresh TORCHELASTIC_RUN_ID (a uuid),
# which names the run dir (outputs/DATE/torchrun-<first 8 hex digits>/), so all ranks write into one folder;
# rank N logs to rank<N>.log.
set -euo pipefail
NPROC=${1:?usage: scripts/torchrun.sh NPROC [glmtune overrides...]}
shift
exec torchrun --standalone --nproc_per_node "$NPROC" -m glmtune "$@"
