#!/usr/bin/env bash
# The deepspeed launcher, from one node; it starts every rank on the hosts of HOSTFILE over ssh (pdsh).
#   HOSTFILE=hostfile RUN_ID=lora-r16 scripts/deepspeed_launch.sh +hw=a100_80g model=glm4_9b_chat ...
#   NUM_GPUS=2 scripts/deepspeed_launch.sh dist=zero3          # this machine only (also CPU-only, gloo)
# A hostfile line is "<host> slots=<GPUs>". --no_local_rank: the launcher otherwise appends --local_rank=N,
# which Hydra rejects; ranks read LOCAL_RANK from the environment. --module runs `python -m glmtune`.
# The deepspeed launcher sets no shared run id, so the run dir is fixed here, once, and passed to every rank
# as hydra.run.dir (arguments reach remote nodes unchanged; environment variables may not): outputs/$RUN_ID,
# or without RUN_ID a fresh outputs/DATE/deepspeed-<8 hex>, which glmtune treats as its own name: after a stop
# (exit 7) the same command finds the unfinished run of the same config and resumes it.
# glmtune.supervise runs the launcher: a SIGTERM/SIGINT/SIGUSR1 to this script goes to the local ranks (they
# finish the step, save and exit 7) rather than to the launcher, which would kill them; the script exits 7.
# Any other failure exits with the rank's own code and its line once. The launcher runs from $PYTHON itself
# (python -m deepspeed.launcher.runner), so PYTHON=/path/venv/bin/python needs no activated venv.
set -euo pipefail
RUN_DIR=${RUN_DIR:-outputs/${RUN_ID:-$(date +%Y-%m-%d)/deepspeed-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')}}
# --log_level critical: the launcher's INFO lines (its command, world info, one line per spawned process and per
# exit) and its notices (no hostfile on a one-node run; CPU accelerator) went to the console, ~15 lines a launch,
# and its one error line repeats a failed rank's exit code after the rank's own line (the script exits with that
# code; when no rank said why, glmtune.supervise prints a line naming it). A bad hostfile still raises.
# One OpenMP thread per rank, as torchrun sets (otherwise accelerate picks and warns).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
args=(--master_port "${MASTER_PORT:-29500}" --no_local_rank --module --log_level critical)
[[ -n "${HOSTFILE:-}" ]] && args=(--hostfile "$HOSTFILE" "${args[@]}")
[[ -n "${NUM_GPUS:-}" ]] && args=(--num_gpus "$NUM_GPUS" "${args[@]}")
exec "${PYTHON:-python}" -m glmtune.supervise deepspeed "${args[@]}" glmtune "hydra.run.dir=$RUN_DIR" "$@"
