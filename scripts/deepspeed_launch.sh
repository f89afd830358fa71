#!/usr/bin/env bash
# The deepspeed launcher, from one node; it starts every rank on the hosts of HOSTFILE over ssh (pdsh).
#   HOSTFILE=hostfile RUN_ID=lora-r16 scripts/deepspeed_launch.sh +hw=a100_80g model=glm4_9b_chat ...
#   NUM_GPUS=2 scripts/deepspeed_launch.sh dist=zero3          # this machine only (also CPU-only, gloo)
# A hostfile line is "<host> slots=<GPUs>". --no_local_rank: the launcher otherwise appends --local_rank=N,
# which Hydra rejects; ranks read LOCAL_RANK from the environment. --module runs `python -m glmtune`.
# The deepspeed launcher sets no shared run id, so the run dir is fixed here, once, and passed to every rank
# as hydra.run.dir (arguments reach remote nodes unchanged; environment variables may not).
set -euo pipefail
RUN_ID=${RUN_ID:-$(date +%Y-%m-%d_%H-%M-%S)}
args=(--master_port "${MASTER_PORT:-29500}" --no_local_rank --module)
[[ -n "${HOSTFILE:-}" ]] && args=(--hostfile "$HOSTFILE" "${args[@]}")
[[ -n "${NUM_GPUS:-}" ]] && args=(--num_gpus "$NUM_GPUS" "${args[@]}")
exec deepspeed "${args[@]}" glmtune "hydra.run.dir=${RUN_DIR:-outputs/$RUN_ID}" "$@"
