"""Rule `embedding`: repeated tokens, a shared table, weight decay on the table."""

import keras
import numpy as np
import tensorflow as tf

from tests.dp import dp_test_case
from tests.dp.rules import rule_test_case


def _ids(seed=0):
    x = np.random.default_rng(seed).integers(0, 20, size=(6, 7))
    x[0, 1] = x[0, 0]  # A repeated token: its gradient rows add up.
    return tf.constant(x, tf.int32)


class EmbeddingRuleTest(rule_test_case.RuleTestCase):

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(4)

    def test_text_model(self):
        self.assert_rule_matches_naive(
            dp_test_case.text_model(), _ids(), tf.constant([0, 1, 2, 0, 1, 2]), "embedding",
            sample_weight=rule_test_case.weights(6),
        )

    def test_weight_decay_on_the_table(self):
        model = dp_test_case.text_model()
        embeddings = model.get_layer("embedding").embeddings
        self.assert_rule_matches_naive(
            model, _ids(1), tf.constant([0, 1, 2, 0, 1, 2]), "embedding",
            weight_decay=0.1, weight_decay_variables=[embeddings],
        )


if __name__ == "__main__":
    tf.test.main()
