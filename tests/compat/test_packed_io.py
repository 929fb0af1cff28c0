"""TF-Privacy's DPModel with a dict of inputs and of outputs, each with its own weighted loss."""

import keras
import numpy as np
import pytest

from tfdp.compat import tensorflow_privacy

DIM, BATCH = 10, 4


def _model(private, num_microbatches=None):
    inputs = {"foo": keras.Input((DIM,), name="foo"), "bar": keras.Input((DIM,), name="bar")}
    outputs = {"foo": keras.layers.Dense(1, kernel_initializer="ones")(inputs["foo"]),
               "bar": keras.layers.Dense(1, kernel_initializer="ones")(inputs["bar"])}
    if private:
        model = tensorflow_privacy.DPModel(
            l2_norm_clip=1e9, noise_multiplier=0.0, num_microbatches=num_microbatches,
            inputs=inputs, outputs=outputs)
    else:
        model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.SGD(1.0),
                  loss={"foo": keras.losses.MeanSquaredError(),
                        "bar": keras.losses.MeanAbsoluteError()},
                  loss_weights={"foo": 0.4, "bar": 0.6})
    return model


def _batch():
    rows = np.arange(DIM * BATCH, dtype="float32").reshape(BATCH, DIM)
    x = {"foo": rows, "bar": 2.0 * rows}
    y = {"foo": np.zeros((BATCH, 1), "float32"), "bar": np.ones((BATCH, 1), "float32")}
    return x, y


@pytest.mark.parametrize("num_microbatches", [None, 2, 4])
def test_weighted_losses_of_several_outputs_take_keras_step(num_microbatches):
    x, y = _batch()
    plain, private = _model(False), _model(True, num_microbatches)
    plain.fit(x, y, epochs=1, batch_size=BATCH, shuffle=False, verbose=0)
    private.fit(x, y, epochs=1, batch_size=BATCH, shuffle=False, verbose=0)
    for a, b in zip(plain.trainable_variables, private.trainable_variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_predict_and_evaluate_take_the_models_own_structure():
    x, y = _batch()
    plain, private = _model(False), _model(True)
    predicted = private.predict(x, verbose=0)
    assert set(predicted) == {"foo", "bar"} and predicted["foo"].shape == (BATCH, 1)
    np.testing.assert_allclose(predicted["bar"], plain.predict(x, verbose=0)["bar"], rtol=1e-6)
    assert np.isfinite(private.evaluate(x, y, verbose=0))


def test_missing_or_unknown_keys_are_refused():
    x, y = _batch()
    with pytest.raises(ValueError, match="inputs are"):
        _model(True).fit({"foo": x["foo"]}, y, batch_size=BATCH, verbose=0)


def test_save_and_load_keep_the_structure(tmp_path):
    x, y = _batch()
    private = _model(True)
    private.fit(x, y, epochs=1, batch_size=BATCH, shuffle=False, verbose=0)
    path = str(tmp_path / "packed.keras")
    private.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0)["foo"],
                               private.predict(x, verbose=0)["foo"], rtol=1e-6)
