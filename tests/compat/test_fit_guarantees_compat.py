"""Privacy guarantees of TF-Privacy compat `fit` (`DPSequential` / `DPKeras*Optimizer`).

The compat classes run the Keras route, so they keep its guarantees: labels
checked before any step, NaN/Inf parameters stop `fit`, non-finite
microbatches are dropped and counted, and a `PrivacyBudget` caps the
releases at its sensitivity. (Their contract has no target ε of its own and
no banded noise: TF-Privacy's optimizers take neither.)
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tests.keras.keras_test_case import digits
from tests.keras.keras_test_case import tiny_model
from tfdp.compat import tensorflow_privacy

N, B = 64, 16


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _dp_sequential(num_microbatches=None, learning_rate=0.1, noise_multiplier=1.0):
    model = tensorflow_privacy.DPSequential(
        l2_norm_clip=1.0, noise_multiplier=noise_multiplier,
        num_microbatches=num_microbatches, layers=tiny_model().layers)
    model.build((None, 8, 8, 1))
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss=_loss())
    return model


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(0)


@pytest.mark.parametrize("bad", [-7, 13])
def test_out_of_range_labels_are_refused_before_any_step(bad):
    x, y = digits(N)
    y = y.copy()
    y[9] = bad
    model = _dp_sequential(num_microbatches=4)
    with pytest.raises(ValueError, match=r"\[0, num_classes=10\).* 1 of 64 rows") as e:
        model.fit(x, y, batch_size=B, verbose=0)
    assert str(bad) not in str(e.value)  # Labels are private.
    assert int(model.optimizer.iterations.numpy()) == 0


def test_a_stream_batch_with_a_bad_label_releases_nothing():
    x, y = digits(N)
    y = y.copy()
    y[B + 3] = -1  # The second batch.
    model = tfdp.make_private(tiny_model())
    model.compile(optimizer=tensorflow_privacy.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1), loss=_loss())
    stream = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not class indices"):
        model.fit(stream, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1


def test_nan_parameters_stop_fit():
    x, y = digits(N)
    model = _dp_sequential(learning_rate=1e39)
    with pytest.raises(FloatingPointError, match="The parameters are NaN/Inf after step 1"):
        model.fit(x, y, batch_size=B, verbose=0)


def test_non_finite_microbatches_are_dropped_and_counted():
    x, y = digits(N)
    x = x.copy()
    x[5] = np.nan  # Poisons its microbatch of 4 rows, one unit.
    model = _dp_sequential(num_microbatches=4)
    with pytest.warns(UserWarning, match="1 examples .* not covered by epsilon"):
        model.fit(x, y, batch_size=B, verbose=0)
    assert model.optimizer.account.nonfinite_examples == 1
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_a_budget_callback_caps_the_releases_at_the_microbatch_sensitivity():
    x, y = digits(N)
    model = _dp_sequential(num_microbatches=4)
    target = 12.0
    budget = tfdp.callbacks.PrivacyBudget(target, verbose=0)
    model.fit(x, y, batch_size=B, epochs=2, callbacks=[budget], verbose=0)
    allowed = model.optimizer.ledger(steps=0).max_steps_within(target)
    assert 0 < int(model.optimizer.iterations.numpy()) <= allowed < 2 * N // B
    assert model.optimizer.ledger().epsilon() <= target
