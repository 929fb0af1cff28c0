#!/usr/bin/env bash
# Kurakin et al. 2022, App. H: simple VGG on CIFAR-10 at three noise levels.
# Usage: launch/sweep_cifar10_vgg.sh [extra train flags]
set -euo pipefail
for noise in 0.5 1.0 1.5; do
  python -m tfdp.train --gin_file=gin/cifar10_vgg.gin --gin_param="NOISE = ${noise}" \
    --workdir="workdir/cifar10_vgg_noise_${noise}" "$@"
done
