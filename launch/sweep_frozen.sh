#!/usr/bin/env bash
# Observation 5 (Kurakin et al. 2022, App. G): private fine-tuning of the Places365
# ResNet-18 at epsilon = 10 with 0..4 of (stem, block_group1..4) frozen.
# The number of frozen groups is chosen by validation accuracy: VALIDATION_FRACTION
# (default 0.01, 12,812 images) of the ImageNet training set is held out and not
# trained on; tfdp.tuning prints the selected run's test accuracy as the final number.
# Usage: launch/sweep_frozen.sh [extra train flags, e.g. --strategy=mirrored]
set -euo pipefail
validation="${VALIDATION_FRACTION:-0.01}"
workdirs=()
for frozen in 0 1 2 3 4; do
  workdir="workdir/imagenet_r18_frozen_${frozen}"
  python -m tfdp.train --gin_file=gin/imagenet_r18_frozen.gin \
    --gin_param="FROZEN = ${frozen}" --gin_param="DataConfig.validation_fraction = ${validation}" \
    --workdir="${workdir}" "$@"
  workdirs+=("${workdir}")
done
python -m tfdp.tuning "${workdirs[@]}"
