"""What tfdp.keras relies on in the installed Keras, pinned with clear messages.

`DPModel` overrides `make_train_function` (for Poisson steps one Keras step is
one logical step) and relies on Keras' `fit` calling it and then
`train_function(iterator)` once per step; two helpers come from Keras' own
modules, which Keras does not export.
"""

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tests.keras import keras_test_case as ktc

SUPPORTED = ((3, 10), (4, 0))  # setup.cfg: keras>=3.10,<4.


class KerasContractTest(ktc.KerasTestCase):

    def test_installed_keras_is_supported(self):
        version = tuple(int(part) for part in keras.__version__.split(".")[:2])
        self.assertTrue(
            SUPPORTED[0] <= version < SUPPORTED[1],
            f"tfdp.keras supports Keras >= 3.10, < 4; found {keras.__version__}. Check "
            "DPModel.make_train_function against Keras' fit loop before widening this.")
        from keras.src.trainers.data_adapters import array_slicing
        from keras.src.utils import tracking

        self.assertTrue(callable(array_slicing.train_validation_split),
                        "keras.src...array_slicing.train_validation_split moved "
                        "(DPModel.fit's validation_split)")
        self.assertTrue(callable(tracking.no_automatic_dependency_tracking),
                        "keras.src.utils.tracking.no_automatic_dependency_tracking moved "
                        "(DPOptimizer.build)")

    def test_fit_calls_the_train_function_once_per_logical_step(self):
        # Poisson steps (N = 20, B = 5, batches of 2) take 1 to 5 physical
        # batches each; with steps_per_execution=3 each call takes up to 3
        # logical steps, never past an epoch's 4.
        n = 20
        x, y = np.eye(n, dtype="float32"), np.zeros([n], "float32")
        model = keras.Sequential([keras.Input((n,)), keras.layers.Dense(1, use_bias=False)])
        dp = tfdp.make_private(model)
        dp.compile(optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 0.0,
                                              expected_batch_size=5),
                   loss=lambda t, p: tf.reshape(p, [-1]), steps_per_execution=3)
        calls = []
        epoch_steps = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: calls.append(int(dp.optimizer.iterations)))
        dp.fit(x, y, batch_size=2, epochs=3, verbose=0, callbacks=[epoch_steps])
        # 3 + 1 calls per epoch; taking 3 logical steps in each would give 6 a epoch.
        self.assertEqual(calls, [4, 8, 12])


if __name__ == "__main__":
    tf.test.main()
