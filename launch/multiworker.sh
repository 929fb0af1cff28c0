#!/usr/bin/env bash
# launch/multiworker.sh — one worker of a multi-host DP-SGD run
# (tf.distribute.MultiWorkerMirroredStrategy). Run it once on every host,
# with the same host list and gin file and that host's index.
#
# Usage:
#   launch/multiworker.sh HOSTS INDEX GIN_FILE --workdir=SHARED_DIR [more tfdp.train flags ...]
#     HOSTS  comma-separated host:port of all workers, in the same order on
#            every host (the port must be free; TF opens a gRPC server on it)
#     INDEX  this host's position in HOSTS (0-based); index 0 is the chief
# Example (2 hosts x 8 GPUs):
#   host A: launch/multiworker.sh 10.0.0.1:12345,10.0.0.2:12345 0 gin/imagenet_r18_places.gin --workdir=gs://bucket/r18
#   host B: launch/multiworker.sh 10.0.0.1:12345,10.0.0.2:12345 1 gin/imagenet_r18_places.gin --workdir=gs://bucket/r18
#
# --workdir must be the same shared directory (GCS, NFS) on every host:
# every worker restores from it, only the chief (index 0) writes checkpoints
# and the privacy ledger there. RunConfig.physical_batch_size is GLOBAL (all
# GPUs of all hosts) and must be a multiple of the total GPU count; each
# host builds its own share of every physical batch (input_context).
# All workers must run the same code, gin file and --seed. Only the chief
# writes the run's outputs (summary, report, model, TensorBoard); the other
# workers write only a scratch copy of each checkpoint under $TMPDIR, removed
# when they end. If a worker is lost, the others print one "error:" line and
# exit with code 75: rerun this same command on every host to resume from
# the last checkpoint. See docs/DISTRIBUTED.md.
set -euo pipefail

if [[ $# -lt 3 ]]; then
  sed -n '2,25p' "$0" >&2
  exit 2
fi
HOSTS="$1"
INDEX="$2"
GIN_FILE="$3"
shift 3

cd "$(dirname "$0")/.."
IFS=',' read -r -a WORKERS <<< "${HOSTS}"
if ! [[ "${INDEX}" =~ ^[0-9]+$ ]] || (( INDEX >= ${#WORKERS[@]} )); then
  echo "error: INDEX must be in [0, ${#WORKERS[@]}). Received: INDEX=${INDEX}" >&2
  exit 2
fi
WORKER_JSON="$(printf '"%s",' "${WORKERS[@]}")"
export TF_CONFIG="{\"cluster\": {\"worker\": [${WORKER_JSON%,}]}, \"task\": {\"type\": \"worker\", \"index\": ${INDEX}}}"
echo "launch/multiworker.sh: worker ${INDEX} of ${#WORKERS[@]}; TF_CONFIG=${TF_CONFIG}" >&2

exec "${PYTHON:-python3}" -m tfdp.train --gin_file="${GIN_FILE}" --strategy=multi_worker_mirrored "$@"
