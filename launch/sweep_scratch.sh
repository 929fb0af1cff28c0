#!/usr/bin/env bash
# Observations 1-4 (Kurakin et al. 2022): from-scratch private ImageNet training.
#   SWEEP=epochs : Obs. 2, more epochs (with more noise) at a fixed epsilon.
#   SWEEP=batch  : Obs. 4, larger logical batches via virtual steps.
#   SWEEP=clip   : Obs. 3, joint C / learning-rate tuning.
#   SWEEP=models : Obs. 1, ResNet-18 vs ResNet-50 at epsilon in {4.6, 13.2, 71}.
# Settings are chosen by validation accuracy: VALIDATION_FRACTION (default 0.01,
# 12,812 images) of the training set is held out and not trained on, and
# tfdp.tuning prints the selected run's test accuracy as the final number (for
# SWEEP=models, one selection per epsilon).
# Usage: SWEEP=epochs launch/sweep_scratch.sh [extra train flags]
set -euo pipefail
sweep="${SWEEP:-epochs}"
validation="${VALIDATION_FRACTION:-0.01}"
workdirs=()
run() {  # run WORKDIR [train flags]
  local workdir="$1"; shift
  python -m tfdp.train --workdir="${workdir}" \
    --gin_param="DataConfig.validation_fraction = ${validation}" "$@"
  workdirs+=("${workdir}")
}
case "$sweep" in
  epochs)
    for e in 10 20 40 70 90; do
      run "workdir/scratch_r18_epochs_$e" --gin_file=gin/imagenet_r18_scratch.gin \
        --gin_param="EPOCHS = $e" "${@}"
    done ;;
  batch)
    for b in 1024 4096 16384 65536; do
      run "workdir/scratch_r18_batch_$b" --gin_file=gin/imagenet_r18_scratch.gin \
        --gin_param="BATCH = $b" "${@}"
    done ;;
  clip)
    for c in 0.1 0.5 1.0 5.0; do
      for lr in 0.1 0.5 2.0 8.0; do
        run "workdir/scratch_r18_c${c}_lr${lr}" --gin_file=gin/imagenet_r18_scratch.gin \
          --gin_param="CLIP = $c" --gin_param="BASE_LR = $lr" "${@}"
      done
    done ;;
  models)
    for eps in 4.6 13.2 71; do
      workdirs=()
      for m in r18 r50; do
        run "workdir/scratch_${m}_eps_$eps" --gin_file=gin/imagenet_${m}_scratch.gin \
          --gin_param="EPSILON = $eps" "${@}"
      done
      python -m tfdp.tuning "${workdirs[@]}"
    done
    exit 0 ;;
  *) echo "error: unknown SWEEP=$sweep (epochs|batch|clip|models)" >&2; exit 2 ;;
esac
python -m tfdp.tuning "${workdirs[@]}"
