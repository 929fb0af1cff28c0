"""Issue 58's guarantees on Keras `fit` (`tfdp.make_private` with a `tfdp.DPOptimizer`).

- a target ε in the contract is kept: no step beyond `DPSGD.budget_steps`;
- labels are checked before any step (`tfdp.validation.validate_labels`);
- non-finite parameters stop `fit`, non-finite examples are dropped and counted;
- several `fit` calls on one banded optimizer continue its noise.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tests.keras import keras_test_case as ktc


class BandedFitCallsTest(ktc.KerasTestCase):
    N, B = 128, 16

    def _private(self):
        keras.utils.set_random_seed(0)
        return self.private(ktc.tiny_model(), noise_multiplier=1.0, bands=2,
                            insecure_reproducible_seed=3)

    def test_two_fits_continue_the_noise_of_one(self):
        x, y = ktc.digits(self.N)
        once = self._private()
        once.fit(x, y, batch_size=self.B, steps_per_epoch=6, verbose=0)
        twice = self._private()
        twice.fit(x, y, batch_size=self.B, steps_per_epoch=3, verbose=0)
        twice.fit(x, y, batch_size=self.B, steps_per_epoch=3, verbose=0)
        self.assertEqual(int(twice.optimizer.iterations.numpy()), 6)
        self.assertEqual(twice.privacy_ledger().steps, 6)
        self.assertWeightsClose(ktc.weights(twice), ktc.weights(once))
