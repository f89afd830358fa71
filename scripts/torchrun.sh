#!/usr/bin/env bash
# One node, N GPUs:   scripts/torchrun.sh 4 +hw=a100_40g model=glm4_9b_chat model.path=/models/glm-4-9b-chat
# --standalone runs a private rendezvous and gives every worker the same fresh TORCHELASTIC_RUN_ID (a uuid),
# which names the run dir (outputs/DATE/torchrun-<first 8 hex digits>/), so all ranks write into one folder;
# rank N logs to rank<N>.log. Running the same command again after a stop (exit 7) resumes that run dir.
# glmtune.supervise runs torchrun: a SIGTERM/SIGINT/SIGUSR1 goes to the ranks (which finish the step, save and
# exit 7), not to torchrun (which would kill them 30 s later and print a traceback); the script then exits 7.
# Any other failure exits with the rank's own code (2 bad input, 3 no fit, 4 out of memory, ...: README "When a
# run fails") and its line once, without torchrun's ChildFailedError report. torchrun runs from $PYTHON itself
# (python -m torch.distributed.run): PYTHON=/path/venv/bin/python needs no activated venv.
set -euo pipefail
NPROC=${1:?usage: scripts/torchrun.sh NPROC [glmtune overrides...]}
shift
# torchrun sets OMP_NUM_THREADS=1 in each rank when it is unset, with a 4-line banner saying so; the same default
# is set here without the banner (export another value to give each rank more CPU threads).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PYTHON:-python}" -m glmtune.supervise torchrun --standalone --nproc_per_node "$NPROC" -m glmtune "$@"
