#!/usr/bin/env bash
# Multi-node launch with DeepSpeed's launcher and an MPI-style hostfile ("node1 slots=8" lines):
#   launch/deepspeed.sh HOSTFILE RECIPE [hydra overrides ...]
#   launch/deepspeed.sh hostfile.txt scaling/orthros_2p7b trainer.run_dir=/scratch/runs/2p7b
# The launcher sets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR for every process, which the trainer
# reads at its entry point; the parallel layout comes from the recipe, the data-parallel size and
# the accumulation steps from the world size.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 HOSTFILE RECIPE [hydra overrides ...]" >&2
  exit 2
fi
HOSTFILE=$1
RECIPE=$2
shift 2
if [[ ! -f $HOSTFILE ]]; then
  echo "$0: hostfile $HOSTFILE not found (one 'hostname slots=N' line per node)" >&2
  exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/find_python.sh"  # sets PYTHON
# The recipe, the layout for the hostfile's slots and the run directory, checked once here: a
# refusal is one line, not one per rank inside the launcher's output.
SLOTS=$(awk '/^[[:space:]]*[^#[:space:]]/ { n = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) { split($i, a, "="); n = a[2] } total += n } END { print total + 0 }' "$HOSTFILE")
if [[ $SLOTS -lt 1 ]]; then
  echo "$0: hostfile $HOSTFILE lists no hosts (one 'hostname slots=N' line per node)" >&2
  exit 2
fi
ORTHROS_PRECHECK_WORLD_SIZE=$SLOTS "$PYTHON" -m orthros_train.train.cli --config-name "$RECIPE" "$@"
# DeepSpeed's launcher as a module of that interpreter (the `deepspeed` script on PATH may be another's).
exec "$PYTHON" -m deepspeed.launcher.runner --hostfile "$HOSTFILE" --master_port "${MASTER_PORT:-29500}" \
  --module orthros_train.train.cli --config-name "$RECIPE" "$@"
