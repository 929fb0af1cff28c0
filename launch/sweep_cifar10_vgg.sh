#!/usr/bin/env bash
# Kurakin et al. 2022, App. H: simple VGG on CIFAR-10 at three noise levels.
# The noise level is chosen by validation accuracy: VALIDATION_FRACTION (default
# 0.1, 5,000 images) of the training set is held out (stratified) and not trained
# on; tfdp.tuning prints the selected run's test accuracy as the final number.
# Usage: launch/sweep_cifar10_vgg.sh [extra train flags]
set -euo pipefail
validation="${VALIDATION_FRACTION:-0.1}"
workdirs=()
for noise in 0.5 1.0 1.5; do
  workdir="workdir/cifar10_vgg_noise_${noise}"
  python -m tfdp.train --gin_file=gin/cifar10_vgg.gin --gin_param="NOISE = ${noise}" \
    --gin_param="DataConfig.validation_fraction = ${validation}" --workdir="${workdir}" "$@"
  workdirs+=("${workdir}")
done
python -m tfdp.tuning "${workdirs[@]}"
