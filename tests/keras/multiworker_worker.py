"""One process of `tests/keras/test_multiworker_fit.py`: a private `fit`, recorded.

Usage: `python tests/keras/multiworker_worker.py OUT_DIR SCENARIO[,SCENARIO...]`.
With `TF_CONFIG` set the process is one worker of a
`MultiWorkerMirroredStrategy` (one CPU device, one replica); without it, the
one-device reference. For each scenario it writes to OUT_DIR/SCENARIO.npz
the weights before and after `fit`, the rows it trained on in each logical
step (recorded inside the train step), the step count and the ε it printed.

Scenarios (`SCENARIOS`):
- `native_seeded` / `compat_seeded`: a small model with real gradients, an
  insecure public key (the same in every process), so that the weights can
  be compared with the one-process run;
- `native_secret` / `compat_secret`: a fresh secret key per process (as a
  real run draws it), and a model whose gradients are zero (its dense layer
  sees inputs scaled by 0), so that the update is the noise alone.
"""

import json
import os
import sys
import warnings

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tensorflow as tf  # noqa: E402

# 2 cores for 2 workers: one thread each keeps them from starving each other.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import tfdp  # noqa: E402
from tfdp import secret_key as secret_key_lib  # noqa: E402

N = 256
PHYSICAL = 16  # Global rows per physical batch: 8 per worker.
SIGMA_SECRET = 2.0

# name: (route, key, optimizer options, epochs)
SCENARIOS = {
    "native_seeded": ("native", "seeded", dict(expected_batch_size=32), 1),
    "native_secret": ("native", "secret", dict(expected_batch_size=64), 2),
    "compat_seeded": ("compat", "seeded", {}, 1),
    "compat_secret": ("compat", "secret", {}, 1),
}


class RecordingModel(tfdp.DPModel):
    """A `DPModel` whose train step records the rows it trains on, by logical step."""

    rows_by_step = {}
    ids_of = {}

    def train_step(self, data):
        x, weights = data[0], data[2]
        tf.py_function(self._record, [x, weights, self.dp_optimizer.iterations], [])
        return super().train_step(data)

    @classmethod
    def _record(cls, x, weights, step):
        # Rows of no example are the train_step probe's synthetic batches,
        # replayed before training: not trained on.
        rows = [cls.ids_of[row.tobytes()] for row, w in zip(x.numpy(), weights.numpy())
                if w > 0 and row.tobytes() in cls.ids_of]
        cls.rows_by_step.setdefault(int(step), []).extend(rows)


def data():
    """N digits, each row distinct, and its id by its bytes."""
    train, _, _ = tfdp.data.load_offline("digits")
    x = train.images[:N].astype("float32")
    y = train.labels[:N].astype("int32")
    RecordingModel.ids_of = {row.tobytes(): i for i, row in enumerate(x)}
    return x, y


def inner_model(zero_gradients):
    if zero_gradients:
        # The dense kernel's per-example gradient is its input (0) times the
        # output's gradient: zero, so the update is the noise alone.
        return keras.Sequential([
            keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Rescaling(0.0),
            keras.layers.Dense(200, use_bias=False, name="head")])
    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, name="conv"),
        keras.layers.GroupNormalization(2, name="norm"), keras.layers.Activation("tanh"),
        keras.layers.Flatten(), keras.layers.Dense(10, name="head")])


def optimizer(route, key, options):
    secret = key == "secret"
    sigma = SIGMA_SECRET if secret else 1.0
    # Learning rate 1 without momentum: the update is the noisy mean itself.
    sgd = dict(learning_rate=1.0) if secret else dict(learning_rate=0.5, momentum=0.5)
    if route == "native":
        return tfdp.DPOptimizer(keras.optimizers.SGD(**sgd), l2_norm_clip=1.0,
                                noise_multiplier=sigma,
                                insecure_reproducible_seed=None if secret else 3, **options)
    from tfdp.compat import tensorflow_privacy

    opt = tensorflow_privacy.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=sigma, **sgd)
    if not secret:
        # TF-Privacy's optimizers take no seed; a public key for the comparison.
        opt.mechanism_builder.secret_key = secret_key_lib.SecretKey.insecure_from_seed(3)
    return opt


def run(strategy, scenario, out_path):
    """Trains `scenario` under `strategy` and writes what it trained to `out_path`."""
    route, key, options, epochs = SCENARIOS[scenario]
    x, y = data()
    RecordingModel.rows_by_step = {}
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = RecordingModel(inner_model(key == "secret"))
        model.compile(optimizer=optimizer(route, key, options),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    validation = {}
    if key == "seeded":
        validation["validation_data"] = (x[:64], y[:64])
    before = [w.numpy() for w in model.model.trainable_variables]
    history = model.fit(x, y, batch_size=PHYSICAL, epochs=epochs, verbose=0, **validation)
    epsilon = model.describe_epsilon()
    print(f"{scenario}: {epsilon}", flush=True)
    out = {
        "replicas": strategy.num_replicas_in_sync,
        "steps": int(model.optimizer.iterations.numpy()),
        "epsilon": epsilon,
        "rows": json.dumps({str(k): v for k, v in RecordingModel.rows_by_step.items()}),
        "batch_size": float(model.optimizer.logical_batch_size),
        "sigma": float(model.optimizer.noise_multiplier),
        "clip": float(model.optimizer.l2_norm_clip),
        "val_loss": np.array(history.history.get("val_loss", [])),
    }
    for i, (w0, w) in enumerate(zip(before, model.model.trainable_variables)):
        out[f"before{i}"] = w0
        out[f"after{i}"] = w.numpy()
    np.savez(out_path, **out)


def main(out_dir, scenarios):
    """Runs each scenario in turn; writes `<out_dir>/<scenario>.npz`."""
    warnings.simplefilter("ignore")  # The insecure seed's warning.
    # One strategy per process: TensorFlow's collectives are set up once.
    strategy = (tf.distribute.MultiWorkerMirroredStrategy() if os.environ.get("TF_CONFIG")
                else tf.distribute.OneDeviceStrategy("/cpu:0"))
    for scenario in scenarios:
        run(strategy, scenario, os.path.join(out_dir, f"{scenario}.npz"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
