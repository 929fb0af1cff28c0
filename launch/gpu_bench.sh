#!/usr/bin/env bash
# launch/gpu_bench.sh — 224-px DP-SGD against non-private training on one GPU, in one table.
#
# Usage:
#   launch/gpu_bench.sh                 # ResNet-18-GN, ResNet-50-GN and ViT-S/16, 224 px, 1000 classes
#   MODELS=vit_s16 launch/gpu_bench.sh  # one model (any name of python -m tfdp.bench --help)
#   OUT=/tmp/gpu_bench launch/gpu_bench.sh
#
# For each model, non-private training and the best private method (bk,
# book-keeping; METHODS to change), XLA off and on: the largest physical
# batch whose accelerator peak memory (tf.config.experimental.get_memory_info)
# fits BUDGET_MB, found by doubling from START_BATCH in one child process per
# row (python -m tfdp.bench --memory_budget_mb), and the time of one step at
# that batch. A row stops at the first batch that does not fit (over budget
# or out of memory) or when its child reaches CHILD_TIMEOUT seconds; it then
# reports the largest batch that fitted so far and says what stopped it.
#
# Sized for one GPU in under 11 minutes: 3 models x 2 methods x 2 XLA settings
# = 12 children of at most CHILD_TIMEOUT (50 s) each, plus start-up; one
# model (MODELS=...) in under 4.
#
# Every setting is an environment variable, so that the plumbing can be
# dry-run on a CPU with a tiny model:
#   MODELS=small_convnet IMAGE_SIZE=28 CHANNELS=1 NUM_CLASSES=10 START_BATCH=8 \
#     MAX_BATCH=32 BUDGET_MB=4000 CHILD_TIMEOUT=300 launch/gpu_bench.sh
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
MODELS="${MODELS:-resnet18 resnet50 vit_s16}"
METHODS="${METHODS:-nonprivate,bk}"
IMAGE_SIZE="${IMAGE_SIZE:-224}"
CHANNELS="${CHANNELS:-3}"
NUM_CLASSES="${NUM_CLASSES:-1000}"
START_BATCH="${START_BATCH:-32}"
MAX_BATCH="${MAX_BATCH:-2048}"
CHILD_TIMEOUT="${CHILD_TIMEOUT:-50}"
OUT="${OUT:-$(mktemp -d /tmp/gpu_bench.XXXXXX)}"
mkdir -p "${OUT}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"

if [[ -z "${BUDGET_MB:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    # 90% of the first GPU's memory: what the allocator can hand out.
    TOTAL_MB="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)"
    BUDGET_MB="$(( TOTAL_MB * 9 / 10 ))"
  else
    echo "launch/gpu_bench.sh: no nvidia-smi; set BUDGET_MB (MiB) to dry-run on a CPU" >&2
    exit 2
  fi
fi
echo "launch/gpu_bench.sh: models=[${MODELS}] methods=${METHODS} ${IMAGE_SIZE}px budget=${BUDGET_MB} MiB" \
     "batches ${START_BATCH}..${MAX_BATCH} child timeout ${CHILD_TIMEOUT}s -> ${OUT}" >&2
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
fi

status=0
for model in ${MODELS}; do
  "${PYTHON}" -m tfdp.bench --model="${model}" --image_size="${IMAGE_SIZE}" \
    --channels="${CHANNELS}" --num_classes="${NUM_CLASSES}" --methods="${METHODS}" \
    --jit_compile=both --batch_size="${START_BATCH}" --max_batch_size="${MAX_BATCH}" \
    --memory_budget_mb="${BUDGET_MB}" --search_refine=0 --timeout="${CHILD_TIMEOUT}" \
    --json > "${OUT}/${model}.json" || status=$?
done

"${PYTHON}" - "${BUDGET_MB}" "${OUT}" ${MODELS} <<'EOF'
import json
import os
import sys

from tfdp.bench import tables

budget, out, models = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
rows = []
for model in models:
    path = os.path.join(out, f"{model}.json")
    try:
        with open(path) as f:
            rows += json.load(f)
    except (OSError, ValueError) as e:
        print(f"{model}: no results ({e})")
print(tables.format_search_table(rows, budget))
EOF
exit "${status}"
