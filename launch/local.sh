#!/usr/bin/env bash
# launch/local.sh — DP-SGD on every GPU of one host (tf.distribute.MirroredStrategy).
#
# Usage:
#   launch/local.sh [GIN_FILE] [more tfdp.train flags ...]
# Examples:
#   launch/local.sh gin/imagenet_r18_places.gin --workdir=/data/runs/r18_places
#   CUDA_VISIBLE_DEVICES=0,1 launch/local.sh mnist_default.gin --workdir=/tmp/mnist2
#
# One process drives all visible GPUs (CUDA_VISIBLE_DEVICES selects them).
# RunConfig.physical_batch_size is GLOBAL: it is split evenly over the GPUs and
# must be a multiple of their number (the paper's 8 GPUs x 128 per GPU is
# physical_batch_size = 1024). The logical batch, the noise (added once per
# logical step) and the privacy accounting do not depend on the GPU count.
# Rerunning the same command with the same --workdir resumes. See
# docs/DISTRIBUTED.md.
set -euo pipefail

cd "$(dirname "$0")/.."
GIN_FILE="${1:-mnist_default.gin}"
shift || true

if command -v nvidia-smi >/dev/null 2>&1; then
  NUM_GPUS="$(nvidia-smi -L | wc -l)"
else
  NUM_GPUS=0
fi
echo "launch/local.sh: MirroredStrategy over ${NUM_GPUS} GPU(s) (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all}); gin=${GIN_FILE}" >&2

exec "${PYTHON:-python3}" -m tfdp.train --gin_file="${GIN_FILE}" --strategy=mirrored "$@"
