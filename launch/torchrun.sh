#!/usr/bin/env bash
# One node, N processes (GPUs, or CPU ranks with gloo):
#   launch/torchrun.sh NPROC RECIPE [hydra overrides ...]
#   launch/torchrun.sh 8 pretrain_1p3b trainer.run_dir=/scratch/runs/1p3b
# The parallel layout comes from the recipe's `parallel` group: NPROC must be a multiple of
# parallel.tensor_parallel x parallel.context_parallel; the data-parallel size and the accumulation
# steps follow from NPROC and trainer.global_batch_size (the trainer names what does not divide).
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 NPROC RECIPE [hydra overrides ...]" >&2
  exit 2
fi
NPROC=$1
RECIPE=$2
shift 2
source "$(dirname "${BASH_SOURCE[0]}")/find_python.sh"  # sets PYTHON
# torchrun sets 1 thread per rank anyway, with a banner saying so when it is unset.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# --standalone: torchrun picks a free port for its rendezvous itself (no race with other jobs);
# set MASTER_PORT to pin one.
if [[ -n ${MASTER_PORT:-} ]]; then
  RDZV=(--master_addr 127.0.0.1 --master_port "$MASTER_PORT")
else
  RDZV=(--standalone)
fi
# The recipe, the layout for NPROC ranks and the run directory, checked once here: a refusal is one
# line, not NPROC ranks' messages inside torchrun's ChildFailedError traceback.
ORTHROS_PRECHECK_WORLD_SIZE=$NPROC "$PYTHON" -m orthros_train.train.cli --config-name "$RECIPE" "$@"
exec "$PYTHON" -m torch.distributed.run \
  --nnodes 1 --nproc_per_node "$NPROC" "${RDZV[@]}" \
  -m orthros_train.train.cli --config-name "$RECIPE" "$@"
