#!/usr/bin/env bash
# launch/tpu_vm.sh — DP-SGD on a Cloud TPU VM (tf.distribute.TPUStrategy).
#
# Run ON the TPU VM (single host: v2-8, v3-8, v4-8, v5e-8 ...):
#   launch/tpu_vm.sh GIN_FILE --workdir=gs://BUCKET/run [more tfdp.train flags ...]
# From a workstation, e.g.:
#   gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --command \
#     "cd tfdp && launch/tpu_vm.sh gin/imagenet_r18_places.gin --workdir=gs://BUCKET/r18 \
#      --gin_param=\"DataConfig.data_dir='gs://BUCKET/tfds'\""
#
# The VM needs a TensorFlow build for TPU VMs (`pip install tensorflow-tpu`
# of the same version, or the TPU VM image's TF) and `pip install -e .` of
# this repository. TPU hosts read data and write checkpoints through GCS,
# so --workdir and DataConfig.data_dir should be gs:// paths. The 8 TPU cores
# are the replicas: RunConfig.physical_batch_size is GLOBAL and must be a
# multiple of the core count. Mixed precision (bfloat16 compute, float32
# variables, clipping and noise in float32) is the natural setting on TPU:
# --gin_param=RunConfig.mixed_precision=True. TPU_NAME selects a TPU other than
# the local one (TPUClusterResolver). This path is untested in CI (no TPU);
# see docs/DISTRIBUTED.md.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  sed -n '2,22p' "$0" >&2
  exit 2
fi
GIN_FILE="$1"
shift

cd "$(dirname "$0")/.."
echo "launch/tpu_vm.sh: TPUStrategy (TPU_NAME=${TPU_NAME:-local}); gin=${GIN_FILE}" >&2

exec "${PYTHON:-python3}" -m tfdp.train --gin_file="${GIN_FILE}" --strategy=tpu "$@"
