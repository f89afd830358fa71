#!/usr/bin/env bash
# Several nodes: run this once on every node, with the same NNODES, MASTER_ADDR, MASTER_PORT and RUN_ID.
#   node 0:  NNODES=2 NODE_RANK=0 NPROC=8 MASTER_ADDR=node0 RUN_ID=lora-r16 scripts/torchrun_multinode.sh +hw=a100_80g ...
#   node 1:  NNODES=2 NODE_RANK=1 NPROC=8 MASTER_ADDR=node0 RUN_ID=lora-r16 scripts/torchrun_multinode.sh +hw=a100_80g ...
# The agents meet at a c10d rendezvous on MASTER_ADDR:MASTER_PORT. --rdzv_id becomes TORCHELASTIC_RUN_ID in
# every worker, which names the run dir (outputs/$RUN_ID): give each launch its own id (inside SLURM,
# $SLURM_JOB_ID). The run dir must be on a filesystem all nodes share, or only node 0's copy is complete.
# After a stop (exit 7), the same command with the same RUN_ID resumes that run dir.
# glmtune.supervise runs torchrun: a SIGTERM/SIGINT/SIGUSR1 to this script goes to this node's ranks (they
# agree on a step with the other nodes, save and exit 7), not to torchrun, which would kill them 30 s later.
# Any other failure exits with this node's first failed rank's code and its line once (README "When a run
# fails"); torchrun runs from $PYTHON itself, so PYTHON=/path/venv/bin/python needs no activated venv.
set -euo pipefail
: "${NNODES:?set NNODES}" "${MASTER_ADDR:?set MASTER_ADDR (node 0 host name or address)}"
: "${RUN_ID:?set RUN_ID, the same on every node (it names the run dir)}"
# torchrun sets OMP_NUM_THREADS=1 in each rank when it is unset, with a 4-line banner saying so; the same default
# is set here without the banner (export another value to give each rank more CPU threads).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PYTHON:-python}" -m glmtune.supervise torchrun --nnodes "$NNODES" --node_rank "${NODE_RANK:-0}" \
    --nproc_per_node "${NPROC:-1}" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" \
    --rdzv_id "$RUN_ID" -m glmtune "$@"
