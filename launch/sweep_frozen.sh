#!/usr/bin/env bash
# Observation 5 (Kurakin et al. 2022, App. G): private fine-tuning of the Places365
# ResNet-18 at epsilon = 10 with 0..4 of (stem, block_group1..4) frozen.
# Usage: launch/sweep_frozen.sh [extra train flags, e.g. --strategy=mirrored]
set -euo pipefail
for frozen in 0 1 2 3 4; do
  python -m tfdp.train --gin_file=gin/imagenet_r18_frozen.gin \
    --gin_param="FROZEN = ${frozen}" --workdir="workdir/imagenet_r18_frozen_${frozen}" "$@"
done
